//! Every ClusterIP behaviour Kubernetes defines, in the socket path, on
//! IPv4 and IPv6: each test asserts what the client sees.
use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Result;
use lbtest::objects::{Endpoint as E, SvcPort, node, service_ips, service_typed, slice_of};
use lbtest::{Cluster, Pod, Summary};

const SP: &[SvcPort] = &[("http", 80, 8080, "TCP"), ("dns", 53, 8080, "UDP")];
const EP: &[(&str, u16, &str)] = &[("http", 8080, "TCP"), ("dns", 8080, "UDP")];

fn tcp(c: &Cluster, pod: &Pod, addr: &str, n: u32) -> Result<Summary> {
    c.probe(pod, &["tcp", "--addr", addr, "--count", &n.to_string()])
}

fn udp(c: &Cluster, pod: &Pod, addr: &str, n: u32, extra: &[&str]) -> Result<Summary> {
    let n = n.to_string();
    let mut args = vec!["udp", "--addr", addr, "--count", &n];
    args.extend_from_slice(extra);
    c.probe(pod, &args)
}

fn names(s: &Summary) -> BTreeSet<&str> {
    s.replies.keys().map(String::as_str).collect()
}

fn peers(s: &Summary) -> Vec<&str> {
    s.peers.keys().map(String::as_str).collect()
}

fn be(ip: &str, port: u16) -> String {
    format!("{ip}:{port}")
}

/// A node with `pods` backend pods serving on 8080 and a client pod.
fn one_node(pods: &[&str]) -> Result<(Cluster, Vec<Pod>, Pod)> {
    Cluster::one_node(pods)
}

fn ready4(pods: &[&Pod]) -> Vec<E> {
    pods.iter().map(|p| E::ready(&p.ip, &format!("node-{}", p.node))).collect()
}

fn wait(c: &Cluster, vip: &str, port: u16, proto: &str, backends: &[String]) -> Result<()> {
    let v: Vec<&str> = backends.iter().map(String::as_str).collect();
    c.wait_programmed(vip, port, proto, Some(&v))
}

#[test]
fn ipv6_cluster_ip_reaches_ipv6_backends_and_reports_itself() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a", "pod-b"])?;
    c.write_object("svc.yaml", &service_ips("web6", &["fd00:96::10"], SP, ""))?;
    let eps: Vec<E> = p.iter().map(|p| E::ready(&p.ip6, "node-1")).collect();
    c.write_object("slice.yaml", &slice_of("web6", "web6-1", "IPv6", EP, &eps))?;
    c.start_agent(1)?;
    wait(&c, "fd00:96::10", 80, "TCP", &[be(&p[0].ip6, 8080), be(&p[1].ip6, 8080)])?;

    let s = tcp(&c, &client, "[fd00:96::10]:80", 40)?;
    assert_eq!(s.ok, 40, "{s:?}");
    assert_eq!(names(&s), ["pod-a", "pod-b"].into(), "{s:?}");
    assert_eq!(peers(&s), ["[fd00:96::10]:80"], "getpeername6 reports the ClusterIP: {s:?}");

    let s = udp(&c, &client, "[fd00:96::10]:53", 20, &[])?;
    assert_eq!(s.ok, 20, "{s:?}");
    assert_eq!(peers(&s), ["[fd00:96::10]:53"], "recvfrom reports the ClusterIP: {s:?}");
    let s = udp(&c, &client, "[fd00:96::10]:53", 10, &["--connected"])?;
    assert_eq!(s.ok, 10, "{s:?}");
    assert_eq!(peers(&s), ["[fd00:96::10]:53"], "{s:?}");

    let s = tcp(&c, &client, "[fd00:96::10]:81", 2)?;
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&2), "{s:?}");
    Ok(())
}

#[test]
fn a_dual_stack_service_works_on_both_families() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a", "pod-b"])?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.20", "fd00:96::20"], SP, ""))?;
    c.write_object("s4.yaml", &slice_of("web", "web-v4", "IPv4", EP, &ready4(&[&p[0], &p[1]])))?;
    let eps6: Vec<E> = p.iter().map(|p| E::ready(&p.ip6, "node-1")).collect();
    c.write_object("s6.yaml", &slice_of("web", "web-v6", "IPv6", EP, &eps6))?;
    c.start_agent(1)?;
    wait(&c, "fd00:96::20", 80, "TCP", &[be(&p[0].ip6, 8080), be(&p[1].ip6, 8080)])?;
    wait(&c, "10.96.0.20", 80, "TCP", &[be(&p[0].ip, 8080), be(&p[1].ip, 8080)])?;
    for addr in ["10.96.0.20:80", "[fd00:96::20]:80"] {
        let s = tcp(&c, &client, addr, 30)?;
        assert_eq!(s.ok, 30, "{addr}: {s:?}");
        assert_eq!(names(&s).len(), 2, "{addr}: {s:?}");
        assert_eq!(peers(&s), [addr], "{s:?}");
    }
    let list = c.list(1)?;
    let fams: BTreeSet<&str> = list["frontends"].as_array().unwrap().iter().map(|f| f["family"].as_str().unwrap()).collect();
    assert_eq!(fams, ["IPv4", "IPv6"].into());
    Ok(())
}

#[test]
fn v4_mapped_addresses_on_inet6_sockets_are_balanced_like_ipv4() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a", "pod-b"])?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&[&p[0], &p[1]])))?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[0].ip, 8080), be(&p[1].ip, 8080)])?;
    let s = tcp(&c, &client, "[::ffff:10.96.0.10]:80", 40)?;
    assert_eq!(s.ok, 40, "{s:?}");
    assert_eq!(names(&s).len(), 2, "{s:?}");
    assert_eq!(peers(&s), ["[::ffff:10.96.0.10]:80"], "{s:?}");
    let s = udp(&c, &client, "[::ffff:10.96.0.10]:53", 10, &[])?;
    assert_eq!(s.ok, 10, "{s:?}");
    assert_eq!(peers(&s), ["[::ffff:10.96.0.10]:53"], "{s:?}");
    Ok(())
}

#[test]
fn getpeername_returns_the_cluster_ip() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a"])?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&[&p[0]])))?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[0].ip, 8080)])?;
    let s = tcp(&c, &client, "10.96.0.10:80", 5)?;
    assert_eq!(peers(&s), ["10.96.0.10:80"], "TCP: {s:?}");
    let s = udp(&c, &client, "10.96.0.10:53", 5, &["--connected"])?;
    assert_eq!(s.ok, 5, "{s:?}");
    assert_eq!(peers(&s), ["10.96.0.10:53"], "connected UDP: {s:?}");
    Ok(())
}

#[test]
fn multi_port_services_and_named_target_ports_that_differ_per_pod() -> Result<()> {
    let mut c = Cluster::new(1)?;
    let a = c.add_pod(1, "a")?;
    let b = c.add_pod(1, "b")?;
    c.serve_as(&a, "a-http", 8080)?;
    c.serve_as(&b, "b-http", 9090)?;
    c.serve_as(&a, "a-metrics", 9100)?;
    c.serve_as(&b, "b-metrics", 9100)?;
    let client = c.add_pod(1, "client")?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], &[("http", 80, 0, "TCP"), ("metrics", 9100, 0, "TCP")], ""))?;
    c.write_object("sa.yaml", &slice_of("web", "web-a", "IPv4", &[("http", 8080, "TCP"), ("metrics", 9100, "TCP")], &ready4(&[&a])))?;
    c.write_object("sb.yaml", &slice_of("web", "web-b", "IPv4", &[("http", 9090, "TCP"), ("metrics", 9100, "TCP")], &ready4(&[&b])))?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&a.ip, 8080), be(&b.ip, 9090)])?;
    wait(&c, "10.96.0.10", 9100, "TCP", &[be(&a.ip, 9100), be(&b.ip, 9100)])?;
    let s = tcp(&c, &client, "10.96.0.10:80", 40)?;
    assert_eq!(names(&s), ["a-http", "b-http"].into(), "{s:?}");
    let s = tcp(&c, &client, "10.96.0.10:9100", 40)?;
    assert_eq!(names(&s), ["a-metrics", "b-metrics"].into(), "{s:?}");
    Ok(())
}

#[test]
fn the_same_port_on_tcp_and_udp() -> Result<()> {
    let mut c = Cluster::new(1)?;
    let d = c.add_pod(1, "dns")?;
    c.serve_as(&d, "answer-8053", 8053)?;
    c.serve_as(&d, "answer-8054", 8054)?;
    let client = c.add_pod(1, "client")?;
    let ports = [("dns", 53, 8053, "UDP"), ("dns-tcp", 53, 8054, "TCP")];
    c.write_object("svc.yaml", &service_ips("dns", &["10.96.0.53"], &ports, ""))?;
    c.write_object("slice.yaml", &slice_of("dns", "dns-1", "IPv4", &[("dns", 8053, "UDP"), ("dns-tcp", 8054, "TCP")], &ready4(&[&d])))?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.53", 53, "UDP", &[be(&d.ip, 8053)])?;
    wait(&c, "10.96.0.53", 53, "TCP", &[be(&d.ip, 8054)])?;
    let both = |c: &Cluster| -> Result<()> {
        for _ in 0..2 {
            let s = udp(c, &client, "10.96.0.53:53", 5, &[])?;
            assert_eq!(names(&s), ["answer-8053"].into(), "{s:?}");
            let s = udp(c, &client, "10.96.0.53:53", 5, &["--connected"])?;
            assert_eq!(names(&s), ["answer-8053"].into(), "{s:?}");
            let s = tcp(c, &client, "10.96.0.53:53", 5)?;
            assert_eq!(names(&s), ["answer-8054"].into(), "{s:?}");
        }
        Ok(())
    };
    both(&c)?;
    // With sessionAffinity ClientIP: the two ports (one address and port
    // number, one rev_nat id) keep their own affinity, as kube-proxy's
    // per-endpoint-chain `recent` lists do: a client that used UDP is not
    // sent to the UDP port over TCP, nor the other way round.
    c.write_object("svc.yaml", &service_ips("dns", &["10.96.0.53"], &ports, AFFINITY))?;
    c.wait_for("affinity on", Duration::from_secs(5), || {
        let l = c.list(1)?;
        Ok(l["frontends"].as_array().is_some_and(|f| f.iter().all(|f| !f["affinity_timeout"].is_null())))
    })?;
    both(&c)?;
    let hits = lbtest::world::datapath(&c, 1, "affinity_hit")?;
    assert!(hits >= 10, "the later picks came from affinity: {hits}");
    Ok(())
}

#[test]
fn only_ready_endpoints_and_the_serving_terminating_fallback() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a", "pod-b"])?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &[E::ready(&p[0].ip, "node-1"), E::not_ready(&p[1].ip, "node-1")]))?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[0].ip, 8080)])?;
    let s = tcp(&c, &client, "10.96.0.10:80", 20)?;
    assert_eq!(names(&s), ["pod-a"].into(), "only the ready one: {s:?}");

    // Nothing ready: the serving+terminating endpoint takes the traffic.
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &[E::not_ready(&p[0].ip, "node-1"), E::terminating(&p[1].ip, "node-1")]))?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[1].ip, 8080)])?;
    let s = tcp(&c, &client, "10.96.0.10:80", 20)?;
    assert_eq!(names(&s), ["pod-b"].into(), "{s:?}");
    let list = c.list(1)?;
    assert_eq!(list["frontends"][0]["backends"][0]["state"], "terminating", "{list}");
    Ok(())
}

/// Two nodes, one backend pod and one client pod on each; Service web with
/// internalTrafficPolicy Local.
fn itp_local() -> Result<(Cluster, [Pod; 2], [Pod; 2])> {
    let mut c = Cluster::new(2)?;
    let p1 = c.add_pod(1, "pod-1")?;
    let p2 = c.add_pod(2, "pod-2")?;
    c.serve(&p1, 8080)?;
    c.serve(&p2, 8080)?;
    let c1 = c.add_pod(1, "client-1")?;
    let c2 = c.add_pod(2, "client-2")?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, "  internalTrafficPolicy: Local\n"))?;
    Ok((c, [p1, p2], [c1, c2]))
}

/// sessionAffinity under a traffic policy that turns Local: a client
/// whose affinity points at another node's endpoint gets a local one, as
/// kube-proxy's Local chain, which holds only local endpoints, checks only
/// their `recent` lists.
#[test]
fn affinity_never_sends_a_client_to_another_nodes_endpoint_under_a_local_policy() -> Result<()> {
    let (mut c, [p1, p2], [c1, _c2]) = itp_local()?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, AFFINITY))?;
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&[&p2])))?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p2.ip, 8080)])?;
    assert_eq!(names(&tcp(&c, &c1, "10.96.0.10:80", 5)?), ["pod-2"].into(), "affinity to pod-2");
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&[&p1, &p2])))?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p1.ip, 8080), be(&p2.ip, 8080)])?;
    assert_eq!(names(&tcp(&c, &c1, "10.96.0.10:80", 5)?), ["pod-2"].into(), "kept while the policy is Cluster");
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, &format!("  internalTrafficPolicy: Local\n{AFFINITY}")))?;
    c.wait_for("itp-local", Duration::from_secs(5), || {
        Ok(c.list(1)?["frontends"][0]["flags"].as_array().is_some_and(|f| f.iter().any(|f| f == "itp-local")))
    })?;
    assert_eq!(names(&tcp(&c, &c1, "10.96.0.10:80", 10)?), ["pod-1"].into(), "only the local endpoint now");
    Ok(())
}

#[test]
fn internal_traffic_policy_local_uses_only_this_nodes_endpoints() -> Result<()> {
    let (mut c, [p1, p2], [c1, c2]) = itp_local()?;
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&[&p1, &p2])))?;
    c.start_agent(1)?;
    c.start_agent(2)?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p1.ip, 8080), be(&p2.ip, 8080)])?;
    assert_eq!(names(&tcp(&c, &c1, "10.96.0.10:80", 20)?), ["pod-1"].into());
    assert_eq!(names(&tcp(&c, &c2, "10.96.0.10:80", 20)?), ["pod-2"].into());
    let list = c.list(1)?;
    assert!(list["frontends"][0]["flags"].as_array().unwrap().iter().any(|f| f == "itp-local"), "{list}");

    // No local endpoint, but endpoints elsewhere: unreachable, at once.
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&[&p2])))?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p2.ip, 8080)])?;
    let s = tcp(&c, &c1, "10.96.0.10:80", 3)?;
    assert_eq!(s.errors.get("EHOSTUNREACH"), Some(&3), "{s:?}");
    assert_eq!(names(&tcp(&c, &c2, "10.96.0.10:80", 5)?), ["pod-2"].into());

    // No endpoints at all: refused, as for any Service.
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &[]))?;
    wait(&c, "10.96.0.10", 80, "TCP", &[])?;
    let s = tcp(&c, &c1, "10.96.0.10:80", 3)?;
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&3), "{s:?}");
    Ok(())
}

#[test]
fn the_terminating_fallback_is_decided_separately_for_the_local_set() -> Result<()> {
    let (mut c, [p1, p2], [c1, c2]) = itp_local()?;
    // Cluster-wide there is a ready endpoint (pod-2); on node-1 only a
    // serving+terminating one (pod-1): node-1's clients use pod-1.
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &[E::terminating(&p1.ip, "node-1"), E::ready(&p2.ip, "node-2")]))?;
    c.start_agent(1)?;
    c.start_agent(2)?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p2.ip, 8080)])?;
    assert_eq!(names(&tcp(&c, &c1, "10.96.0.10:80", 10)?), ["pod-1"].into());
    assert_eq!(names(&tcp(&c, &c2, "10.96.0.10:80", 10)?), ["pod-2"].into());
    Ok(())
}

const AFFINITY: &str = "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 10800\n";

#[test]
fn session_affinity_keeps_a_client_on_one_backend() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a", "pod-b", "pod-c"])?;
    let other = c.add_pod(1, "other-client")?;
    let all: Vec<&Pod> = p.iter().collect();
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, AFFINITY))?;
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&all)))?;
    c.start_agent(1)?;
    let every: Vec<String> = p.iter().map(|p| be(&p.ip, 8080)).collect();
    wait(&c, "10.96.0.10", 80, "TCP", &every)?;
    let list = c.list(1)?;
    assert_eq!(list["frontends"][0]["affinity_timeout"], 10800, "{list}");

    let s = tcp(&c, &client, "10.96.0.10:80", 30)?;
    assert_eq!(s.ok, 30, "{s:?}");
    assert_eq!(names(&s).len(), 1, "one client, one backend: {s:?}");
    let affine = names(&s).into_iter().next().unwrap().to_string();
    let s = tcp(&c, &other, "10.96.0.10:80", 20)?;
    assert_eq!(names(&s).len(), 1, "each client sticks: {s:?}");

    // The affine backend goes away: the next connect picks a live one, and sticks to it.
    let rest: Vec<&Pod> = p.iter().filter(|p| p.name != affine).collect();
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&rest)))?;
    wait(&c, "10.96.0.10", 80, "TCP", &rest.iter().map(|p| be(&p.ip, 8080)).collect::<Vec<_>>())?;
    let s = tcp(&c, &client, "10.96.0.10:80", 20)?;
    assert_eq!(s.ok, 20, "{s:?}");
    assert_eq!(names(&s).len(), 1, "{s:?}");
    assert!(!s.replies.contains_key(&affine), "{affine} was removed: {s:?}");

    // Affinity off: spread again. On again: sticky again.
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    c.wait_for("affinity off", Duration::from_secs(5), || Ok(c.list(1)?["frontends"][0]["affinity_timeout"].is_null()))?;
    let s = tcp(&c, &client, "10.96.0.10:80", 40)?;
    assert_eq!(names(&s).len(), 2, "{s:?}");
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, AFFINITY))?;
    c.wait_for("affinity on", Duration::from_secs(5), || Ok(c.list(1)?["frontends"][0]["affinity_timeout"] == 10800))?;
    let s = tcp(&c, &client, "10.96.0.10:80", 30)?;
    assert_eq!(names(&s).len(), 1, "{s:?}");
    Ok(())
}

#[test]
fn session_affinity_expires_after_the_timeout() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a", "pod-b", "pod-c"])?;
    let all: Vec<&Pod> = p.iter().collect();
    let one_second = "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 1\n";
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, one_second))?;
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&all)))?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.10", 80, "TCP", &p.iter().map(|p| be(&p.ip, 8080)).collect::<Vec<_>>())?;
    // Within the timeout: one backend.
    let s = tcp(&c, &client, "10.96.0.10:80", 10)?;
    assert_eq!(names(&s).len(), 1, "{s:?}");
    // Idle longer than the timeout each time: a fresh pick each time. Ten
    // picks from three pods are all the same with probability 3^-9.
    let mut seen = BTreeSet::new();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(1200));
        let s = tcp(&c, &client, "10.96.0.10:80", 1)?;
        seen.extend(s.replies.keys().cloned());
    }
    assert!(seen.len() >= 2, "{seen:?}");
    Ok(())
}

#[test]
fn topology_hints_prefer_this_zone_from_the_node_label_or_the_flag() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a", "pod-b"])?;
    c.write_object("node.yaml", &node("node-1", "zone-a"))?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, "  trafficDistribution: PreferClose\n"))?;
    let hinted = [E::ready(&p[0].ip, "node-1").zone("zone-a"), E::ready(&p[1].ip, "node-2").zone("zone-b")];
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &hinted))?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[0].ip, 8080)])?;
    assert_eq!(names(&tcp(&c, &client, "10.96.0.10:80", 20)?), ["pod-a"].into());
    let list = c.list(1)?;
    assert!(list["frontends"][0]["flags"].as_array().unwrap().iter().any(|f| f == "topology"), "{list}");

    // One ready endpoint without hints: kube-proxy ignores the hints.
    let partly = [E::ready(&p[0].ip, "node-1").zone("zone-a"), E::ready(&p[1].ip, "node-2")];
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &partly))?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[0].ip, 8080), be(&p[1].ip, 8080)])?;
    assert_eq!(names(&tcp(&c, &client, "10.96.0.10:80", 40)?), ["pod-a", "pod-b"].into());

    // --zone overrides the Node label.
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &hinted))?;
    c.kill_agent(1);
    c.start_agent_with(1, &["--zone", "zone-b"])?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[1].ip, 8080)])?;
    assert_eq!(names(&tcp(&c, &client, "10.96.0.10:80", 20)?), ["pod-b"].into());
    Ok(())
}

/// trafficDistribution: PreferSameNode: the EndpointSlice controller hints
/// each endpoint for its own node (and zone); kube-proxy's fallbacks apply.
#[test]
fn prefer_same_node_uses_this_nodes_endpoints_then_the_zone_then_all() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a", "pod-b", "pod-c"])?;
    c.write_object("node.yaml", &node("node-1", "zone-a"))?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, "  trafficDistribution: PreferSameNode\n"))?;
    // pod-a on this node, pod-b elsewhere in this zone, pod-c in another.
    let hinted = [
        E::ready(&p[0].ip, "node-1").zone("zone-a").for_node("node-1"),
        E::ready(&p[1].ip, "node-2").zone("zone-a").for_node("node-2"),
        E::ready(&p[2].ip, "node-3").zone("zone-b").for_node("node-3"),
    ];
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &hinted))?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[0].ip, 8080)])?;
    assert_eq!(names(&tcp(&c, &client, "10.96.0.10:80", 20)?), ["pod-a"].into());

    // This node's endpoint leaves: the zone hints decide.
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &hinted[1..]))?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[1].ip, 8080)])?;
    assert_eq!(names(&tcp(&c, &client, "10.96.0.10:80", 20)?), ["pod-b"].into());

    // A value the controller does not know gives no hints: every endpoint.
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, "  trafficDistribution: PreferSomewhere\n"))?;
    let plain = [E::ready(&p[0].ip, "node-1"), E::ready(&p[1].ip, "node-2"), E::ready(&p[2].ip, "node-3")];
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &plain))?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[0].ip, 8080), be(&p[1].ip, 8080), be(&p[2].ip, 8080)])?;
    assert_eq!(names(&tcp(&c, &client, "10.96.0.10:80", 60)?), ["pod-a", "pod-b", "pod-c"].into());
    Ok(())
}

#[test]
fn objects_kube_proxy_ignores_are_ignored() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a"])?;
    let ep = ready4(&[&p[0]]);
    c.write_object(
        "ext.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: ext, namespace: default}\nspec:\n  type: ExternalName\n  externalName: example.com\n  ports: [{name: http, port: 80}]\n",
    )?;
    c.write_object("headless.yaml", &service_ips("hl", &["None"], SP, ""))?;
    c.write_object("hl-slice.yaml", &slice_of("hl", "hl-1", "IPv4", EP, &ep))?;
    c.write_object(
        "other.yaml",
        &service_ips("other", &["10.96.0.31"], SP, "").replace("  namespace: default\n", "  namespace: default\n  labels: {service.kubernetes.io/service-proxy-name: someone-else}\n"),
    )?;
    c.write_object("other-slice.yaml", &slice_of("other", "other-1", "IPv4", EP, &ep))?;
    c.write_object("fqdn.yaml", &service_ips("fq", &["10.96.0.32"], SP, ""))?;
    c.write_object("fqdn-slice.yaml", &slice_of("fq", "fq-1", "FQDN", EP, &[E::ready("example.com", "node-1")]))?;
    c.write_object("nolabel.yaml", &service_ips("nolabel", &["10.96.0.33"], SP, ""))?;
    c.write_object(
        "nolabel-slice.yaml",
        &slice_of("nolabel", "nolabel-1", "IPv4", EP, &ep).replace("  labels:\n    kubernetes.io/service-name: nolabel\n", ""),
    )?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.32", 80, "TCP", &[])?;
    wait(&c, "10.96.0.33", 80, "TCP", &[])?;
    let list = c.list(1)?;
    let fronts: BTreeSet<&str> = list["frontends"].as_array().unwrap().iter().map(|f| f["address"].as_str().unwrap()).collect();
    assert_eq!(fronts, ["10.96.0.32", "10.96.0.33"].into(), "{list}");

    // Another proxy's Service is not translated: the connect goes to the network.
    let s = tcp(&c, &client, "10.96.0.31:80", 1)?;
    assert!(s.errors.contains_key("EHOSTUNREACH") || s.errors.contains_key("ENETUNREACH"), "{s:?}");
    // FQDN-only and unlabelled slices give no endpoints.
    for vip in ["10.96.0.32:80", "10.96.0.33:80"] {
        let s = tcp(&c, &client, vip, 1)?;
        assert_eq!(s.errors.get("ECONNREFUSED"), Some(&1), "{vip}: {s:?}");
    }
    Ok(())
}

#[test]
fn host_network_clients_hairpin_recreation_and_merged_slices() -> Result<()> {
    let (mut c, p, _client) = one_node(&["pod-a", "pod-b", "pod-c"])?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    // Several EndpointSlices for one Service are merged.
    c.write_object("s1.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&[&p[0], &p[1]])))?;
    c.write_object("s2.yaml", &slice_of("web", "web-2", "IPv4", EP, &ready4(&[&p[2]])))?;
    c.write_object("self.yaml", &service_ips("self", &["10.96.0.40"], SP, ""))?;
    c.write_object("self-slice.yaml", &slice_of("self", "self-1", "IPv4", EP, &ready4(&[&p[0]])))?;
    c.start_agent(1)?;
    let every: Vec<String> = p.iter().map(|p| be(&p.ip, 8080)).collect();
    wait(&c, "10.96.0.10", 80, "TCP", &every)?;
    wait(&c, "10.96.0.40", 80, "TCP", &[be(&p[0].ip, 8080)])?;

    // A hostNetwork client: a process in the node's netns and cgroup.
    let host = c.host(1);
    let s = tcp(&c, &host, "10.96.0.10:80", 60)?;
    assert_eq!(s.ok, 60, "{s:?}");
    assert_eq!(names(&s), ["pod-a", "pod-b", "pod-c"].into(), "all three slices' pods: {s:?}");

    // Hairpin: pod-a reaches itself through its own Service.
    let s = tcp(&c, &p[0], "10.96.0.40:80", 5)?;
    assert_eq!(names(&s), ["pod-a"].into(), "{s:?}");

    // Deleted and recreated with the same ClusterIP: works again.
    c.remove_object("svc.yaml")?;
    c.wait_programmed("10.96.0.10", 80, "TCP", None)?;
    let s = tcp(&c, &host, "10.96.0.10:80", 1)?;
    assert_eq!(s.ok, 0, "{s:?}");
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    wait(&c, "10.96.0.10", 80, "TCP", &every)?;
    let s = tcp(&c, &host, "10.96.0.10:80", 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    Ok(())
}

/// loadBalancerSourceRanges hold for pods and for the node itself on the
/// socket path, as kube-proxy's KUBE-PROXY-FIREWALL applies them to every
/// new connection to an LB IP: a pod outside the ranges reaches nothing
/// there (TCP times out, its datagrams vanish), the node outside them gets
/// EPERM for a datagram (a DROP in OUTPUT), a pod inside them is served,
/// and the Service's ClusterIP is not restricted. The socket hooks run
/// before the kernel picks the source address; the source of the socket's
/// first packet decides.
#[test]
fn load_balancer_source_ranges_hold_for_pods_and_the_node() -> Result<()> {
    let (mut c, p, inside) = one_node(&["pod-a", "pod-b"])?;
    let outside = c.add_pod(1, "other")?;
    let host = c.host(1);
    let (lb4, lb6) = ("10.100.0.10", "fd00:100::10");
    let svc = |ranges: &str| {
        let extra = format!("  ipFamilyPolicy: PreferDualStack\n  loadBalancerSourceRanges: [{ranges}]\n");
        service_typed("web", &["10.96.0.10", "fd00:96::10"], "LoadBalancer", &[("http", 80, 8080, "TCP", 30080), ("dns", 80, 8080, "UDP", 30080)], &extra, &[lb4, lb6])
    };
    c.write_object("svc.yaml", &svc(&format!("\"{}/32\", \"{}/128\"", inside.ip, inside.ip6)))?;
    c.write_object("slice4.yaml", &slice_of("web", "web-v4", "IPv4", EP, &ready4(&[&p[0], &p[1]])))?;
    // Another Service with ranges, for all but the end of the test.
    let ports = [("http", 80, 8080, "TCP", 30080), ("dns", 80, 8080, "UDP", 30080)];
    c.write_object("keep.yaml", &service_typed("keep", &["10.96.0.99"], "LoadBalancer", &ports[..1], "  loadBalancerSourceRanges: [\"192.0.2.0/24\"]\n", &["10.100.0.99"]))?;
    let v6: Vec<E> = p.iter().map(|p| E::ready(&p.ip6, "node-1")).collect();
    c.write_object("slice6.yaml", &slice_of("web", "web-v6", "IPv6", EP, &v6))?;
    c.start_agent(1)?;
    wait(&c, lb4, 80, "TCP", &[be(&p[0].ip, 8080), be(&p[1].ip, 8080)])?;
    let lb6_port = format!("[{lb6}]:80");
    wait(&c, lb6, 80, "TCP", &[be(&p[0].ip6, 8080), be(&p[1].ip6, 8080)])?;
    let short = |pod: &Pod, proto: &str, addr: &str, extra: &[&str]| -> Result<Summary> {
        let mut args = vec![proto, "--addr", addr, "--count", "2", "--timeout-ms", "500"];
        args.extend_from_slice(extra);
        c.probe(pod, &args)
    };
    for addr in [format!("{lb4}:80"), lb6_port.clone()] {
        // Inside the ranges: served, TCP, unconnected and connected UDP.
        assert_eq!(tcp(&c, &inside, &addr, 10)?.ok, 10, "{addr}");
        assert_eq!(udp(&c, &inside, &addr, 5, &[])?.ok, 5, "{addr}");
        assert_eq!(udp(&c, &inside, &addr, 5, &["--connected"])?.ok, 5, "{addr}");
        // Outside them: nothing, and nothing the pod can tell from a drop
        // on the way (TCP times out; datagrams are sent, and no reply comes).
        let s = short(&outside, "tcp", &addr, &[])?;
        assert_eq!((s.ok, s.errors.get("ETIMEDOUT")), (0, Some(&2)), "{addr}: {s:?}");
        for extra in [&[][..], &["--connected"]] {
            let s = short(&outside, "udp", &addr, extra)?;
            assert_eq!((s.ok, s.errors.get("EAGAIN")), (0, Some(&2)), "{addr} {extra:?}: {s:?}");
        }
        // IPv6 extension headers before the UDP header (hop-by-hop or
        // destination options, which a pod with CAP_NET_RAW may set) hide
        // nothing: served inside the ranges, dropped outside them.
        if addr.starts_with('[') {
            for ext in ["dst", "hbh"] {
                for extra in [&["--ip6-ext", ext][..], &["--ip6-ext", ext, "--connected"]] {
                    assert_eq!(udp(&c, &inside, &addr, 3, extra)?.ok, 3, "{addr} {extra:?}");
                    let s = short(&outside, "udp", &addr, extra)?;
                    assert_eq!((s.ok, s.errors.get("EAGAIN")), (0, Some(&2)), "{addr} {extra:?}: {s:?}");
                }
            }
        }
        // The node is outside them too: its datagrams fail with EPERM.
        let s = short(&host, "tcp", &addr, &[])?;
        assert_eq!(s.ok, 0, "{addr}: {s:?}");
        let s = short(&host, "udp", &addr, &[])?;
        assert_eq!((s.ok, s.errors.get("EPERM")), (0, Some(&2)), "{addr}: {s:?}");
    }
    assert!(lbtest::world::datapath(&c, 1, "source_range_dropped")? >= 16, "counted");
    // Per frontend (`lb-agent list --stats`; an address and port, TCP and
    // UDP together): a connection the ranges refused is no connection, for
    // the frontend or its backends; its dropped packets are counted as
    // source_range. Served: 10 TCP connections and 5 connected UDP sockets
    // (IPv6: 6 more with extension headers). Dropped: the pod's 2 SYNs
    // (each timed out before a second one), 2 unconnected and 2 connected
    // datagrams (IPv6: 8 more with extension headers), the node's 2 SYNs
    // and 2 datagrams.
    for (addr, conns, dropped) in [(lb4, 15, 10), (lb6, 21, 18)] {
        let (stats, backends) = c.frontend_stats(1, addr, 80, "TCP")?;
        assert_eq!((stats["conns"].as_u64(), stats["source_range"].as_u64()), (Some(conns), Some(dropped)), "{addr}: {stats}");
        assert_eq!(backends, 10, "{addr}: the TCP backends count the 10 served only: {stats}");
    }
    // The ClusterIP is not restricted.
    assert_eq!(tcp(&c, &outside, "10.96.0.10:80", 5)?.ok, 5);
    assert_eq!(udp(&c, &host, "10.96.0.10:80", 5, &[])?.ok, 5);
    // The LB IP bound on the node (a VIP): the node's sockets sending
    // from it are outside these ranges too.
    let ns = format!("--net=/run/netns/{}", host.netns);
    lbtest::run("nsenter", &[&ns, "--", "ip", "addr", "add", &format!("{lb4}/32"), "dev", "lo"])?;
    let from_vip = ["tcp", "--addr", &format!("{lb4}:80"), "--count", "2", "--timeout-ms", "500", "--src-addr", lb4];
    assert_eq!(c.probe(&host, &from_vip)?.ok, 0);
    // Ranges that hold the node's address: the node is served, though the
    // source it picks for a local backend is the pod bridge's address
    // (kube-proxy checks the source the node picks for the LB IP).
    c.write_object("svc.yaml", &svc("\"192.168.77.11/32\", \"fd00:77::11/128\""))?;
    c.wait_for("the node's ranges", Duration::from_secs(5), || Ok(tcp(&c, &host, &format!("{lb4}:80"), 1)?.ok == 1))?;
    for addr in [format!("{lb4}:80"), lb6_port.clone()] {
        assert_eq!(tcp(&c, &host, &addr, 5)?.ok, 5, "{addr}");
        assert_eq!(udp(&c, &host, &addr, 5, &["--connected"])?.ok, 5, "{addr}");
        assert_eq!(short(&outside, "tcp", &addr, &[])?.ok, 0, "{addr}");
    }
    // kube-proxy also admits the LB IP itself as a source then (a VIP
    // bound on the node: the node's connections to it leave from the
    // VIP); lb admits the node's sockets whatever their source.
    let s = c.probe(&host, &from_vip)?;
    assert_eq!(s.ok, 2, "from the VIP bound on the node: {s:?}");
    lbtest::run("nsenter", &[&ns, "--", "ip", "addr", "del", &format!("{lb4}/32"), "dev", "lo"])?;
    // A connect that the ranges drop goes through with its next SYN once
    // they hold the pod (kube-proxy's firewall checks each new flow).
    let (before, before_backends) = c.frontend_stats(1, lb4, 80, "TCP")?;
    let late = std::thread::scope(|sc| -> Result<Summary> {
        let t = sc.spawn(|| c.probe(&outside, &["tcp", "--addr", &format!("{lb4}:80"), "--count", "1", "--timeout-ms", "5000"]));
        std::thread::sleep(Duration::from_millis(300));
        c.write_object("svc.yaml", &svc(&format!("\"{}/32\"", outside.ip)))?;
        t.join().unwrap()
    })?;
    assert_eq!(late.ok, 1, "{late:?}");
    // Counted once it got through: one connection, after its dropped SYNs.
    let (after, after_backends) = c.frontend_stats(1, lb4, 80, "TCP")?;
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or_default();
    assert_eq!((n(&after, "conns") - n(&before, "conns"), after_backends - before_backends), (1, 1), "{before} -> {after}");
    assert!(n(&after, "source_range") > n(&before, "source_range"), "{before} -> {after}");
    // ... and once the Service has no ranges any more.
    c.write_object("svc.yaml", &svc(&format!("\"{}/32\"", inside.ip)))?;
    c.wait_for("the pod left out again", Duration::from_secs(5), || Ok(short(&outside, "tcp", &format!("{lb4}:80"), &[])?.ok == 0))?;
    let late = std::thread::scope(|sc| -> Result<Summary> {
        let t = sc.spawn(|| c.probe(&outside, &["tcp", "--addr", &format!("{lb4}:80"), "--count", "1", "--timeout-ms", "5000"]));
        std::thread::sleep(Duration::from_millis(300));
        let extra = "  ipFamilyPolicy: PreferDualStack\n";
        c.write_object("svc.yaml", &service_typed("web", &["10.96.0.10", "fd00:96::10"], "LoadBalancer", &ports, extra, &[lb4, lb6]))?;
        t.join().unwrap()
    })?;
    assert_eq!(late.ok, 1, "{late:?}");
    // Ranges that take in the pod network: all are served.
    c.write_object("svc.yaml", &svc("\"10.244.1.0/24\", \"fd00:244:1::/64\""))?;
    c.wait_for("the new ranges", Duration::from_secs(5), || Ok(tcp(&c, &outside, &format!("{lb4}:80"), 1)?.ok == 1))?;
    for addr in [format!("{lb4}:80"), lb6_port] {
        for pod in [&outside, &host] {
            assert_eq!(tcp(&c, pod, &addr, 5)?.ok, 5, "{addr} {}", pod.name);
            assert_eq!(udp(&c, pod, &addr, 5, &[])?.ok, 5, "{addr} {}", pod.name);
            assert_eq!(udp(&c, pod, &addr, 5, &["--connected"])?.ok, 5, "{addr} {}", pod.name);
        }
    }
    // The egress program runs for every packet the node's sockets send:
    // it is attached only while some frontend has ranges.
    let egress = || -> Result<bool> { Ok(lbtest::run("bpftool", &["cgroup", "show", c.nodes[0].cgroup.to_str().unwrap()])?.contains("lb_sock_egress")) };
    assert!(egress()?);
    c.remove_object("keep.yaml")?;
    c.write_object("svc.yaml", &service_typed("web", &["10.96.0.10", "fd00:96::10"], "LoadBalancer", &ports, "  ipFamilyPolicy: PreferDualStack\n", &[lb4, lb6]))?;
    c.wait_for("the egress program detached", Duration::from_secs(5), || Ok(!egress()?))?;
    assert_eq!(tcp(&c, &outside, &format!("{lb4}:80"), 5)?.ok, 5);
    // The first Service with ranges again, a new one: the egress program is
    // attached before its frontend is written, so not one connect from a
    // pod outside the ranges gets through, not even in its first
    // milliseconds (a connect loop runs while it is created; attached after
    // the write, a few connects in between went through). Until the
    // Service comes, the pod's connects fail at once (a route to nowhere
    // for its LB IP; translated connects are routed to the backend).
    lbtest::run("ip", &["-n", &outside.netns, "route", "add", "unreachable", "10.100.0.20/32"])?;
    c.write_object("late-slice.yaml", &slice_of("late", "late-v4", "IPv4", EP, &ready4(&[&p[0]])))?;
    let late = std::thread::scope(|sc| -> Result<Summary> {
        let t = sc.spawn(|| c.probe(&outside, &["tcp", "--addr", "10.100.0.20:80", "--count", "1000000", "--timeout-ms", "5", "--max-ms", "2500"]));
        std::thread::sleep(Duration::from_millis(500));
        let ranged = format!("  loadBalancerSourceRanges: [\"{}/32\"]\n", inside.ip);
        c.write_object("late.yaml", &service_typed("late", &["10.96.0.20"], "LoadBalancer", &ports[..1], &ranged, &["10.100.0.20"]))?;
        t.join().unwrap()
    })?;
    assert_eq!(late.ok, 0, "{late:?}");
    assert!(late.errors.get("EHOSTUNREACH").is_some_and(|n| *n >= 100), "the loop ran before the Service came: {late:?}");
    assert!(late.errors.get("ETIMEDOUT").is_some_and(|n| *n >= 10), "the loop ran on after the Service came: {late:?}");
    assert!(egress()?);
    assert_eq!(tcp(&c, &inside, "10.100.0.20:80", 5)?.ok, 5);
    c.remove_object("late.yaml")?;
    c.write_object("svc.yaml", &svc(&format!("\"{}/32\"", inside.ip)))?;
    // Programmed: the frontend has its ranges (the egress program may
    // still be attached for late.yaml's before this sync; the CI once
    // caught two connects served in between).
    c.wait_for("the ranges programmed", Duration::from_secs(5), || {
        let l = c.list(1)?;
        Ok(l["frontends"].as_array().into_iter().flatten().any(|f| f["address"] == lb4 && f["flags"].as_array().is_some_and(|a| a.iter().any(|x| x == "source-ranges"))))
    })?;
    c.wait_for("the egress program attached", Duration::from_secs(5), egress)?;
    assert_eq!(short(&outside, "tcp", &format!("{lb4}:80"), &[])?.ok, 0);
    assert_eq!(tcp(&c, &inside, &format!("{lb4}:80"), 5)?.ok, 5);
    Ok(())
}

/// One Service with more loadBalancerSourceRanges than their map holds
/// (16,384 entries) is left out alone, with an error naming it; every
/// other Service is programmed, and later changes too (before, every sync
/// failed at its ranges, and nothing on the node was programmed again).
#[test]
fn a_service_with_more_source_ranges_than_the_map_holds_is_left_out_alone() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a", "pod-b"])?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&[&p[0]])))?;
    let ranges: Vec<String> = (0..16385u32).map(|i| format!("\"10.{}.{}.0/24\"", i >> 8, i & 0xff)).collect();
    let extra = format!("  loadBalancerSourceRanges: [{}]\n", ranges.join(", "));
    c.write_object("big.yaml", &service_typed("big", &["10.96.0.40"], "LoadBalancer", &[("http", 80, 8080, "TCP", 30040)], &extra, &["10.100.0.40"]))?;
    c.write_object("big-slice.yaml", &slice_of("big", "big-1", "IPv4", EP, &ready4(&[&p[1]])))?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[0].ip, 8080)])?;
    assert_eq!(c.programmed(1, "10.96.0.40", 80, "TCP")?, None, "big is left out");
    let log = std::fs::read_to_string(c.agent_log(1))?;
    assert!(log.contains("default/big") && log.contains("not programmed"), "{log}");
    let (_, m) = c.http(1, "127.0.0.1:10249", "/metrics")?;
    assert!(m.lines().any(|l| l == "lb_services_not_programmed 1"), "{m}");
    assert_eq!(names(&tcp(&c, &client, "10.96.0.10:80", 5)?), ["pod-a"].into());
    // Later changes are programmed.
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&[&p[1]])))?;
    wait(&c, "10.96.0.10", 80, "TCP", &[be(&p[1].ip, 8080)])?;
    assert_eq!(names(&tcp(&c, &client, "10.96.0.10:80", 5)?), ["pod-b"].into());
    Ok(())
}

/// A connected UDP socket that sends with sendto() to its Service's
/// address all the same (the kernel runs the sendmsg hook for it) gets the
/// backend its connect chose: a connected socket accepts replies from its
/// peer alone (kube-proxy: the datagram has the connected flow's tuple,
/// and conntrack its endpoint). Before, the datagram was balanced anew,
/// and two times in three its reply was dropped.
#[test]
fn sendto_the_service_on_a_connected_udp_socket_keeps_its_backend() -> Result<()> {
    let (mut c, p, client) = one_node(&["pod-a", "pod-b", "pod-c"])?;
    c.write_object("svc.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &ready4(&[&p[0], &p[1], &p[2]])))?;
    c.start_agent(1)?;
    wait(&c, "10.96.0.10", 53, "UDP", &[be(&p[0].ip, 8080), be(&p[1].ip, 8080), be(&p[2].ip, 8080)])?;
    // A new socket each time: connect picks at random.
    let s = udp(&c, &client, "10.96.0.10:53", 30, &["--connected", "--sendto", "--timeout-ms", "500"])?;
    assert_eq!(s.ok, 30, "{s:?}");
    assert!(names(&s).len() >= 2, "connects went to several pods: {s:?}");
    assert_eq!(peers(&s), ["10.96.0.10:53"], "{s:?}");
    Ok(())
}
