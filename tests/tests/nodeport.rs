//! Traffic from outside the cluster: NodePort, LoadBalancer IPs and
//! externalIPs through the TC program, on two nodes with pods on each and
//! an outside client on the fabric.
use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Result;
use lbtest::objects::{Endpoint as E, service_typed, slice_of};
use lbtest::{Cluster, Pod, Summary};

const EP: &[(&str, u16, &str)] = &[("http", 8080, "TCP"), ("dns", 8080, "UDP")];
const LB_IP: &str = "10.100.0.10";
const EXT_IP: &str = "10.100.0.20";

/// Two nodes, pod-1 on node-1 and pod-2 on node-2 (answering with the
/// client address they see), an outside client that routes the LB IP and
/// the externalIP to node-1, agents on both nodes.
struct World {
    c: Cluster,
    p1: Pod,
    p2: Pod,
    outside: Pod,
}

fn world(svc: &str, extra_agent: &[&str]) -> Result<World> {
    let mut c = Cluster::new(2)?;
    let p1 = c.add_pod(1, "pod-1")?;
    let p2 = c.add_pod(2, "pod-2")?;
    c.serve_reporting_peer(&p1, 8080)?;
    c.serve_reporting_peer(&p2, 8080)?;
    let outside = c.add_outside("outside", 100, &[(&format!("{LB_IP}/32"), 1), (&format!("{EXT_IP}/32"), 1)])?;
    c.write_object("svc.yaml", svc)?;
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &[E::ready(&p1.ip, "node-1"), E::ready(&p2.ip, "node-2")]))?;
    c.start_agent_with(1, extra_agent)?;
    c.start_agent_with(2, extra_agent)?;
    Ok(World { c, p1, p2, outside })
}

fn web(ty: &str, extra: &str, lb_ips: &[&str]) -> String {
    service_typed("web", &["10.96.0.10"], ty, &[("http", 80, 8080, "TCP", 30080), ("dns", 80, 8080, "UDP", 30080)], extra, lb_ips)
}

fn tcp(c: &Cluster, pod: &Pod, addr: &str, n: u32) -> Result<Summary> {
    c.probe(pod, &["tcp", "--addr", addr, "--count", &n.to_string(), "--timeout-ms", "1000"])
}

fn wait_nodeport(c: &Cluster, node: usize, n: usize) -> Result<()> {
    let ip = c.nodes[node - 1].ip.clone();
    c.wait_for(&format!("{ip}:30080 programmed with {n} backends"), Duration::from_secs(5), || {
        Ok(c.programmed(node, &ip, 30080, "TCP")?.is_some_and(|b| b.len() == n))
    })
}

fn keys(s: &Summary) -> BTreeSet<&str> {
    s.replies.keys().map(String::as_str).collect()
}

#[test]
fn cluster_policy_reaches_both_nodes_and_snats_to_the_remote_one() -> Result<()> {
    let w = world(&web("NodePort", "", &[]), &[])?;
    wait_nodeport(&w.c, 1, 2)?;
    let s = tcp(&w.c, &w.outside, "192.168.77.11:30080", 60)?;
    assert_eq!(s.ok, 60, "{s:?}");
    // pod-1 is local to node-1: masqueraded as kube-proxy does, it sees
    // node-1's address on the device towards it (cni0). pod-2 is remote:
    // it sees node-1, which SNATed the flow so that the reply comes back.
    assert_eq!(keys(&s), ["pod-1 10.244.1.1", "pod-2 192.168.77.11"].into(), "{s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), ["192.168.77.11:30080"], "replies come from the NodePort: {s:?}");

    // UDP both ways: the reply's source is the NodePort.
    let s = w.c.probe(&w.outside, &["udp", "--addr", "192.168.77.11:30080", "--count", "20"])?;
    assert_eq!(s.ok, 20, "{s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), ["192.168.77.11:30080"], "{s:?}");

    // A pod on node-1 reaches node-2's NodePort (handled by node-2).
    let s = tcp(&w.c, &w.p1, "192.168.77.12:30080", 20)?;
    assert_eq!(s.ok, 20, "{s:?}");

    // `lb-agent nat` lists the flows like conntrack -L.
    let nat = lbtest::run(lbtest::bin("lb-agent").to_str().unwrap(), &["nat", "--bpffs", w.c.nodes[0].bpffs.to_str().unwrap()])?;
    assert!(nat.contains("src=192.168.77.100 dst=192.168.77.11") && nat.contains("[SNAT]"), "{nat}");
    assert!(nat.contains(&format!("dst={}", w.p2.ip)), "{nat}");
    Ok(())
}

#[test]
fn local_policy_keeps_the_client_ip_and_drops_on_nodes_without_endpoints() -> Result<()> {
    let svc = web("LoadBalancer", "  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n", &[LB_IP]);
    let w = world(&svc, &[])?;
    // Only pod-1 (node-1) is an endpoint.
    w.c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &[E::ready(&w.p1.ip, "node-1")]))?;
    wait_nodeport(&w.c, 1, 1)?;
    wait_nodeport(&w.c, 2, 1)?;
    let s = tcp(&w.c, &w.outside, "192.168.77.11:30080", 10)?;
    assert_eq!(keys(&s), ["pod-1 192.168.77.100"].into(), "the pod sees the client's IP: {s:?}");
    let s = tcp(&w.c, &w.outside, "192.168.77.12:30080", 2)?;
    assert_eq!(s.ok, 0, "{s:?}");
    assert_eq!(s.errors.get("ETIMEDOUT"), Some(&2), "node-2 has no local endpoint: dropped, as kube-proxy does: {s:?}");

    // kube-proxy's health check on healthCheckNodePort.
    let (code, body) = w.c.http_from(&w.outside.netns, "192.168.77.11:32000", "/")?;
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(v, serde_json::json!({"service": {"namespace": "default", "name": "web"}, "localEndpoints": 1, "serviceProxyHealthy": true}));
    let (code, body) = w.c.http_from(&w.outside.netns, "192.168.77.12:32000", "/")?;
    assert_eq!(code, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(v["localEndpoints"], 0);

    // Only terminating local endpoints: 503 too.
    w.c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &[E::terminating(&w.p1.ip, "node-1"), E::ready(&w.p2.ip, "node-2")]))?;
    w.c.wait_for("health 503 on node-1", Duration::from_secs(5), || Ok(w.c.http_from(&w.outside.netns, "192.168.77.11:32000", "/")?.0 == 503))?;
    Ok(())
}

#[test]
fn load_balancer_ip_and_external_ip_work_from_outside_and_inside() -> Result<()> {
    let svc = web("LoadBalancer", &format!("  externalIPs: [\"{EXT_IP}\"]\n"), &[LB_IP]);
    let w = world(&svc, &[])?;
    wait_nodeport(&w.c, 1, 2)?;
    for vip in [LB_IP, EXT_IP] {
        let s = tcp(&w.c, &w.outside, &format!("{vip}:80"), 30)?;
        assert_eq!(s.ok, 30, "{vip}: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [format!("{vip}:80").as_str()], "{s:?}");
        // From a pod, the socket path translates them too.
        let s = tcp(&w.c, &w.p2, &format!("{vip}:80"), 10)?;
        assert_eq!(s.ok, 10, "{vip} from a pod: {s:?}");
    }
    Ok(())
}

#[test]
fn external_ips_in_cluster_translation_can_be_turned_off() -> Result<()> {
    let svc = web("ClusterIP", &format!("  externalIPs: [\"{EXT_IP}\"]\n"), &[]);
    let w = world(&svc, &["--external-ip-socket-lb", "false"])?;
    w.c.wait_programmed(EXT_IP, 80, "TCP", Some(&[&format!("{}:8080", w.p1.ip), &format!("{}:8080", w.p2.ip)]))?;
    // From outside it is handled on arrival...
    let s = tcp(&w.c, &w.outside, &format!("{EXT_IP}:80"), 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    // ...from a pod it is not translated (CVE-2020-8554): it goes to the network.
    let s = tcp(&w.c, &w.p1, &format!("{EXT_IP}:80"), 1)?;
    assert_eq!(s.ok, 0, "{s:?}");
    Ok(())
}

#[test]
fn load_balancer_source_ranges_drop_other_sources() -> Result<()> {
    let svc = web("LoadBalancer", "  loadBalancerSourceRanges: [\"192.168.77.100/32\"]\n", &[LB_IP]);
    let mut w = world(&svc, &["--metrics-per-service"])?;
    let other = w.c.add_outside("other", 101, &[(&format!("{LB_IP}/32"), 1)])?;
    wait_nodeport(&w.c, 1, 2)?;
    let s = tcp(&w.c, &w.outside, &format!("{LB_IP}:80"), 10)?;
    assert_eq!(s.ok, 10, "inside the range: {s:?}");
    let s = tcp(&w.c, &other, &format!("{LB_IP}:80"), 2)?;
    assert_eq!(s.errors.get("ETIMEDOUT"), Some(&2), "outside the range: dropped: {s:?}");
    // Counted for the frontend (`lb-agent list --stats`): the 10 flows
    // served, and the dropped SYNs (one or two per connect in its second).
    let (stats, backends) = w.c.frontend_stats(1, LB_IP, 80, "TCP")?;
    assert_eq!((stats["conns"].as_u64(), backends), (Some(10), 10), "{stats}");
    let dropped = stats["source_range"].as_u64().unwrap_or_default();
    assert!((2..=4).contains(&dropped), "{stats}");
    assert_eq!(lbtest::world::datapath(&w.c, 1, "source_range_dropped")?, dropped, "the node's counter");
    let (_, m) = w.c.http(1, "127.0.0.1:10249", "/metrics")?;
    let name = format!("lb_frontend_source_range_dropped_packets_total{{frontend=\"{LB_IP}:80\"}} ");
    let exported: Option<u64> = m.lines().find_map(|l| l.strip_prefix(&name)?.parse().ok());
    assert_eq!(exported, Some(dropped), "{m}");
    Ok(())
}

#[test]
fn a_50_mb_transfer_arrives_byte_exact_and_1000_flows_get_distinct_snat_ports() -> Result<()> {
    let w = world(&web("NodePort", "", &[]), &[])?;
    // Only pod-2 (remote from node-1): every flow through node-1 is SNATed.
    w.c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &[E::ready(&w.p2.ip, "node-2")]))?;
    wait_nodeport(&w.c, 1, 1)?;
    let s = w.c.probe(&w.outside, &["bulk", "--addr", "192.168.77.11:30080", "--bytes", "52428800"])?;
    assert_eq!(s.ok, 1, "{s:?}");

    let s = w.c.probe(&w.outside, &["concurrent", "--addr", "192.168.77.11:30080", "--count", "1000"])?;
    assert_eq!(s.ok, 1000, "{:?}", s.errors);
    let nat = lbtest::run(lbtest::bin("lb-agent").to_str().unwrap(), &["nat", "--json", "--bpffs", w.c.nodes[0].bpffs.to_str().unwrap()])?;
    let flows: Vec<serde_json::Value> = serde_json::from_str(&nat)?;
    let snat_sports: BTreeSet<String> = flows
        .iter()
        .filter(|f| f["snat"] == true)
        .map(|f| f["rewritten"].as_str().unwrap().split_whitespace().find(|p| p.starts_with("sport=")).unwrap().to_string())
        .collect();
    assert!(snat_sports.len() >= 1000, "{} distinct SNAT ports for {} flows", snat_sports.len(), flows.len());
    Ok(())
}

#[test]
fn closed_flows_leave_the_nat_table_after_their_timeout() -> Result<()> {
    let w = world(&web("NodePort", "", &[]), &["--nat-tcp-close-timeout", "1", "--nat-udp-timeout", "1", "--nat-gc-interval", "1"])?;
    wait_nodeport(&w.c, 1, 2)?;
    let bpffs = w.c.nodes[0].bpffs.to_str().unwrap().to_string();
    let count = || -> Result<usize> {
        let nat = lbtest::run(lbtest::bin("lb-agent").to_str().unwrap(), &["nat", "--json", "--bpffs", &bpffs])?;
        Ok(serde_json::from_str::<Vec<serde_json::Value>>(&nat)?.len())
    };
    let s = tcp(&w.c, &w.outside, "192.168.77.11:30080", 20)?;
    assert_eq!(s.ok, 20);
    let s = w.c.probe(&w.outside, &["udp", "--addr", "192.168.77.11:30080", "--count", "5"])?;
    assert_eq!(s.ok, 5);
    assert!(count()? >= 20, "the flows are tracked");
    w.c.wait_for("the NAT table to empty", Duration::from_secs(10), || Ok(count()? == 0))?;
    Ok(())
}

#[test]
fn node_ports_cannot_be_taken_by_local_processes() -> Result<()> {
    let w = world(&web("NodePort", "", &[]), &[])?;
    wait_nodeport(&w.c, 1, 2)?;
    let host = w.c.host(1);
    let s = w.c.probe(&host, &["bind", "--port", "30080"])?;
    assert_eq!(s.errors.get("EADDRINUSE"), Some(&2), "TCP and UDP bind refused: {s:?}");
    let s = w.c.probe(&host, &["bind", "--port", "30081"])?;
    assert_eq!(s.ok, 2, "other ports are free: {s:?}");
    let reserved = lbtest::run("nsenter", &[&format!("--net=/run/netns/{}", w.c.nodes[0].netns), "cat", "/proc/sys/net/ipv4/ip_local_reserved_ports"])?;
    assert!(reserved.contains("30000-32767"), "{reserved}");
    Ok(())
}

#[test]
fn netlink_filters_are_replaced_in_place_on_restart_and_removed_by_teardown() -> Result<()> {
    let netlink = ["--tc-attach", "netlink"];
    let mut w = world(&web("NodePort", "", &[]), &netlink)?;
    wait_nodeport(&w.c, 1, 2)?;
    let netns = w.c.nodes[0].netns.clone();
    let filters = |c: &Cluster| -> Result<usize> {
        let mut n = 0;
        for dir in ["ingress", "egress"] {
            n += c.in_netns(&netns, &["tc", "filter", "show", "dev", "eth0", dir])?.lines().filter(|l| l.contains(" lb_nodeport_")).count();
        }
        Ok(n)
    };
    w.c.wait_for("the clsact filters", Duration::from_secs(5), || Ok(filters(&w.c)? == 2))?;
    // A held connection through the NodePort while the agent restarts: the
    // new agent swaps its programs into the same filters.
    let np = format!("{}:30080", w.c.nodes[0].ip);
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &np, "--hold-ms", "3000", "--interval-ms", "20"])?;
    std::thread::sleep(Duration::from_millis(500));
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &netlink)?;
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "no gap: {s:?}");
    assert_eq!(filters(&w.c)?, 2, "replaced, not doubled");
    let s = tcp(&w.c, &w.outside, &np, 5)?;
    assert_eq!(s.ok, 5, "{s:?}");
    // Netlink filters are no links: teardown removes them.
    w.c.kill_agent(1);
    lbtest::teardown_in(&netns, &w.c.nodes[0].bpffs)?;
    assert_eq!(filters(&w.c)?, 0);
    Ok(())
}

/// The agent takes the node's addresses from its interfaces (no
/// `--node-ip`, no Node object) and follows rtnetlink address events: an
/// address added to eth0 gets the NodePort at once, with no Kubernetes
/// change to trigger a sync, and loses it when removed.
#[test]
fn a_node_address_added_later_gets_the_node_port_at_once() -> Result<()> {
    let mut c = Cluster::new(1)?;
    let p = c.add_pod(1, "pod-1")?;
    c.serve(&p, 8080)?;
    c.write_object("svc.yaml", &web("NodePort", "", &[]))?;
    c.write_object("slice.yaml", &slice_of("web", "web-1", "IPv4", EP, &[E::ready(&p.ip, "node-1")]))?;
    // The client first, as in the other worlds: a fresh fabric port may
    // drop the first packets.
    let outside = c.add_outside("outside", 100, &[])?;
    c.start_agent_from_interfaces(1, &[])?;
    let node = c.nodes[0].ip.clone();
    c.wait_for("the NodePort on the node's address", Duration::from_secs(5), || Ok(c.programmed(1, &node, 30080, "TCP")?.is_some()))?;
    // kube-proxy's count of full syncs (every Service recomputed): an
    // address recomputes only the Services with NodePorts.
    let full_syncs = |c: &Cluster| -> Result<f64> {
        let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
        let name = "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} ";
        Ok(m.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok()).unwrap_or(0.0))
    };
    let full = full_syncs(&c)?;
    assert!(full >= 1.0, "the first sync is a full one");
    let netns = c.nodes[0].netns.clone();
    c.in_netns(&netns, &["ip", "addr", "add", "192.168.77.61/24", "dev", "eth0"])?;
    c.wait_for("the NodePort on the added address", Duration::from_secs(3), || Ok(c.programmed(1, "192.168.77.61", 30080, "TCP")?.is_some()))?;
    assert_eq!(full_syncs(&c)?, full, "no full sync for an address");
    let s = c.probe(&outside, &["tcp", "--addr", "192.168.77.61:30080", "--count", "3", "--timeout-ms", "1000"])?;
    assert_eq!(s.ok, 3, "{s:?}");
    c.in_netns(&netns, &["ip", "addr", "del", "192.168.77.61/24", "dev", "eth0"])?;
    c.wait_for("the NodePort gone with the address", Duration::from_secs(3), || Ok(c.programmed(1, "192.168.77.61", 30080, "TCP")?.is_none()))?;
    assert!(c.programmed(1, &node, 30080, "TCP")?.is_some());
    Ok(())
}

/// kube-proxy's localhost NodePorts (iptables mode, IPv4 only): the node's
/// own connections to 127.0.0.1:nodePort reach the Service, TCP and UDP,
/// and see 127.0.0.1:nodePort as their peer. A pod's 127.0.0.1 stays its
/// own: a server of its own on that port answers, not the Service.
/// `--localhost-nodeports false` turns them off.
#[test]
fn localhost_node_ports_serve_the_nodes_own_connections_only() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]), &[])?;
    wait_nodeport(&w.c, 1, 2)?;
    let host = w.c.host(1);
    let s = tcp(&w.c, &host, "127.0.0.1:30080", 30)?;
    assert_eq!(s.ok, 30, "{s:?}");
    let pods: BTreeSet<&str> = s.replies.keys().filter_map(|k| k.split_whitespace().next()).collect();
    assert_eq!(pods, ["pod-1", "pod-2"].into(), "{s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), ["127.0.0.1:30080"], "getpeername: {s:?}");
    let s = w.c.probe(&host, &["udp", "--addr", "127.0.0.1:30080", "--count", "10"])?;
    assert_eq!(s.ok, 10, "{s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), ["127.0.0.1:30080"], "recvfrom: {s:?}");
    // pod-1 listens on 30080 itself: its own 127.0.0.1:30080 is its own.
    w.c.serve_reporting_peer(&w.p1, 30080)?;
    let s = tcp(&w.c, &w.p1, "127.0.0.1:30080", 5)?;
    assert_eq!(keys(&s), ["pod-1 127.0.0.1"].into(), "{s:?}");
    // Off: nothing listens on the node's 127.0.0.1:30080.
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--localhost-nodeports", "false"])?;
    let s = w.c.probe(&host, &["tcp", "--addr", "127.0.0.1:30080", "--count", "3", "--timeout-ms", "500"])?;
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&3), "{s:?}");
    // The node address still works.
    let s = tcp(&w.c, &host, &format!("{}:30080", w.c.nodes[0].ip), 5)?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}

/// kube-proxy's iptables mode serves NodePorts on every local address
/// (`--nodeport-addresses` unset): a second address (as a second NIC's) has
/// them though it is not the node IP (`--node-ip`), and so has the pod
/// bridge's address. `--nodeport-addresses` CIDRs and `primary` narrow them
/// as kube-proxy's do, 127.0.0.1 included.
#[test]
fn node_ports_are_on_every_node_address_unless_nodeport_addresses_narrow_them() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]), &[])?;
    wait_nodeport(&w.c, 1, 2)?;
    let netns = w.c.nodes[0].netns.clone();
    let node = format!("{}:30080", w.c.nodes[0].ip);
    let gateway = format!("{}.1:30080", w.c.nodes[0].pod_cidr_prefix);
    w.c.in_netns(&netns, &["ip", "addr", "add", "192.168.77.61/24", "dev", "eth0"])?;
    w.c.wait_for("the NodePort on the second address", Duration::from_secs(5), || Ok(w.c.programmed(1, "192.168.77.61", 30080, "TCP")?.is_some()))?;
    let s = tcp(&w.c, &w.outside, "192.168.77.61:30080", 5)?;
    assert_eq!(s.ok, 5, "{s:?}");
    let s = tcp(&w.c, &w.p1, &gateway, 5)?;
    assert_eq!(s.ok, 5, "a pod to its node's bridge address: {s:?}");
    // An IPv4 link-local address (NodeLocal DNSCache's 169.254.20.10, on a
    // device of its own in a real node) has them too, as kube-proxy's
    // `--dst-type LOCAL` match gives them: from outside (through the TC
    // program) and from a pod of the node (its socket).
    w.c.in_netns(&netns, &["ip", "addr", "add", "169.254.20.10/32", "dev", "eth0"])?;
    lbtest::run("ip", &["-n", &w.outside.netns, "route", "add", "169.254.20.10/32", "via", &w.c.nodes[0].ip])?;
    w.c.wait_for("the NodePort on the link-local address", Duration::from_secs(5), || Ok(w.c.programmed(1, "169.254.20.10", 30080, "TCP")?.is_some()))?;
    let s = tcp(&w.c, &w.outside, "169.254.20.10:30080", 5)?;
    assert_eq!(s.ok, 5, "{s:?}");
    let s = tcp(&w.c, &w.p1, "169.254.20.10:30080", 5)?;
    assert_eq!(s.ok, 5, "{s:?}");
    // The IPv6 link-local addresses every veth has get none.
    let l = w.c.list(1)?;
    let link_local: Vec<&serde_json::Value> = l["frontends"].as_array().unwrap().iter().filter(|f| f["address"].as_str().is_some_and(|a| a.starts_with("fe80"))).collect();
    assert!(link_local.is_empty(), "{link_local:?}");
    let refused = |w: &World, from: &Pod, addr: &str| -> Result<()> {
        let s = w.c.probe(from, &["tcp", "--addr", addr, "--count", "3", "--timeout-ms", "500"])?;
        assert_eq!(s.errors.get("ECONNREFUSED"), Some(&3), "{addr} from {}: {s:?}", from.name);
        Ok(())
    };
    for flag in ["192.168.77.11/32,fd00::/8", "primary"] {
        w.c.kill_agent(1);
        w.c.start_agent_with(1, &["--nodeport-addresses", flag])?;
        w.c.wait_for("the NodePort off the second address", Duration::from_secs(5), || Ok(w.c.programmed(1, "192.168.77.61", 30080, "TCP")?.is_none()))?;
        refused(&w, &w.outside, "192.168.77.61:30080")?;
        refused(&w, &w.outside, "169.254.20.10:30080")?;
        refused(&w, &w.p1, &gateway)?;
        // 127.0.0.1 is in neither: no localhost NodePorts.
        refused(&w, &w.c.host(1), "127.0.0.1:30080")?;
        let s = tcp(&w.c, &w.outside, &node, 5)?;
        assert_eq!(s.ok, 5, "--nodeport-addresses {flag}: {s:?}");
    }
    Ok(())
}

/// A device that is no NodePort device any more loses lb's programs: one
/// whose address went (a macvlan NIC, found by its address) once it has
/// been gone a grace (30 s; 1.5 s here), its device sysctls given back;
/// an address that goes and comes back within it keeps them (a DHCP
/// renewal: the flows through it go on); and one an earlier agent served
/// that `--nodeport-interface` leaves out, at once. The served device
/// keeps them and its NodePort answers. Before 12-06's second session
/// they stayed on such a device for good.
#[test]
fn devices_no_longer_served_lose_lbs_programs() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]), &[])?;
    wait_nodeport(&w.c, 1, 2)?;
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    w.c.start_agent_env(1, &objects, &[], &[("LB_UNSERVED_GRACE_MS", "1500")])?;
    let n1 = w.c.nodes[0].netns.clone();
    for cmd in [
        vec!["ip", "link", "add", "link", "eth0", "name", "np2", "type", "macvlan", "mode", "bridge"],
        vec!["ip", "link", "set", "np2", "up"],
        vec!["ip", "addr", "add", "192.168.88.11/24", "dev", "np2"],
    ] {
        w.c.in_netns(&n1, &cmd)?;
    }
    let has = |_: &World, dev: &str| lbtest::tc_program_on(&n1, dev, "lb_nodeport_ingress");
    let accept_local = |w: &World| -> Result<String> { Ok(w.c.in_netns(&n1, &["cat", "/proc/sys/net/ipv4/conf/np2/accept_local"])?.trim().to_string()) };
    w.c.wait_for("lb's programs on the device with an address", Duration::from_secs(5), || has(&w, "np2"))?;
    // The agent sets the sysctls and logs just after it attaches.
    let attached = |w: &World| -> Result<usize> { Ok(std::fs::read_to_string(w.c.agent_log(1))?.matches(r#"NodePort programs attached iface="np2""#).count()) };
    w.c.wait_for("accept_local set, the attach logged", Duration::from_secs(1), || Ok(accept_local(&w)? == "1" && attached(&w)? == 1))?;
    // The address goes and comes back within the grace: they stay, never
    // taken off and attached again.
    let once = attached(&w)?;
    w.c.in_netns(&n1, &["ip", "addr", "del", "192.168.88.11/24", "dev", "np2"])?;
    std::thread::sleep(Duration::from_millis(500));
    assert!(has(&w, "np2")?, "still there within the grace");
    w.c.in_netns(&n1, &["ip", "addr", "add", "192.168.88.11/24", "dev", "np2"])?;
    std::thread::sleep(Duration::from_millis(2500));
    assert!(has(&w, "np2")?, "an address back within the grace keeps them");
    assert_eq!(attached(&w)?, once, "not taken off and attached again");
    // Gone for longer: off, and accept_local back as it was.
    w.c.in_netns(&n1, &["ip", "addr", "del", "192.168.88.11/24", "dev", "np2"])?;
    w.c.wait_for("lb's programs off the device whose address went", Duration::from_secs(6), || Ok(!has(&w, "np2")?))?;
    assert!(has(&w, "eth0")?);
    // The agent gives the sysctl back just after it detaches: a few ms.
    w.c.wait_for("accept_local given back", Duration::from_secs(1), || Ok(accept_local(&w)? == "0"))?;
    // Back; then an agent told to serve eth0 only: at once.
    w.c.in_netns(&n1, &["ip", "addr", "add", "192.168.88.11/24", "dev", "np2"])?;
    w.c.wait_for("lb's programs on the device again", Duration::from_secs(5), || has(&w, "np2"))?;
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--nodeport-interface", "eth0"])?;
    wait_nodeport(&w.c, 1, 2)?;
    // At once: within 3 s (the grace for a device it served is 30 s).
    w.c.wait_for("an earlier agent's programs off a device this one does not serve", Duration::from_secs(3), || Ok(!has(&w, "np2")?))?;
    assert!(has(&w, "eth0")?);
    let s = tcp(&w.c, &w.outside, "192.168.77.11:30080", 5)?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}

/// lb sets accept_local and rp_filter on its NodePort devices (its SNATed
/// packets come back with the node's own address as their source);
/// teardown gives each back the value it had before lb, also after a
/// restart (which finds lb's values there, and keeps what it recorded).
#[test]
fn teardown_gives_back_the_device_sysctls_lb_changed() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]), &[])?;
    wait_nodeport(&w.c, 1, 2)?;
    let n1 = w.c.nodes[0].netns.clone();
    let get = |w: &World, knob: &str| -> Result<String> { Ok(w.c.in_netns(&n1, &["cat", &format!("/proc/sys/net/ipv4/conf/eth0/{knob}")])?.trim().to_string()) };
    // Start over from an operator's values.
    w.c.kill_agent(1);
    lbtest::teardown_in(&n1, &w.c.nodes[0].bpffs)?;
    w.c.in_netns(&n1, &["sysctl", "-qw", "net.ipv4.conf.eth0.rp_filter=2", "net.ipv4.conf.eth0.accept_local=0"])?;
    w.c.start_agent(1)?;
    wait_nodeport(&w.c, 1, 2)?;
    assert_eq!((get(&w, "accept_local")?, get(&w, "rp_filter")?), ("1".to_string(), "0".to_string()));
    w.c.kill_agent(1);
    w.c.start_agent(1)?;
    wait_nodeport(&w.c, 1, 2)?;
    w.c.kill_agent(1);
    lbtest::teardown_in(&n1, &w.c.nodes[0].bpffs)?;
    assert_eq!((get(&w, "accept_local")?, get(&w, "rp_filter")?), ("0".to_string(), "2".to_string()), "as before lb");
    Ok(())
}

/// kube-proxy's health check servers listen where the NodePorts are: on
/// every address without `--nodeport-addresses`, on the addresses it
/// admits with it; an address added later gets its listener.
#[test]
fn health_check_node_ports_listen_where_the_node_ports_are() -> Result<()> {
    let svc = web("LoadBalancer", "  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n", &[LB_IP]);
    let mut w = world(&svc, &[])?;
    wait_nodeport(&w.c, 1, 2)?;
    let netns = w.c.nodes[0].netns.clone();
    w.c.in_netns(&netns, &["ip", "addr", "add", "192.168.77.61/24", "dev", "eth0"])?;
    let code = |w: &World, addr: &str| -> u16 { w.c.http_from(&w.outside.netns, &format!("{addr}:32000"), "/").map_or(0, |(c, _)| c) };
    w.c.wait_for("the health check on every address", Duration::from_secs(5), || Ok(code(&w, "192.168.77.11") == 200 && code(&w, "192.168.77.61") == 200))?;
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--nodeport-addresses", "192.168.77.0/28,192.168.77.96/27"])?;
    w.c.wait_for("the health check on the node address", Duration::from_secs(5), || Ok(code(&w, "192.168.77.11") == 200))?;
    assert_eq!(code(&w, "192.168.77.61"), 0, "not on an address outside --nodeport-addresses");
    // An address inside them, added later: the NodePort and its health check.
    w.c.in_netns(&netns, &["ip", "addr", "add", "192.168.77.101/24", "dev", "eth0"])?;
    w.c.wait_for("the health check on the added address", Duration::from_secs(5), || Ok(code(&w, "192.168.77.101") == 200))?;
    assert_eq!(code(&w, "192.168.77.11"), 200);
    Ok(())
}

/// Another process holds a healthCheckNodePort: the load balancer's check
/// fails there, so the node looks down for that Service. The agent says so
/// once (not at every sync) and counts it in
/// `lb_health_check_listeners_failed`; it tries again every second (also
/// with nothing changing), and serves the check once the port is free.
#[test]
fn a_health_check_node_port_another_process_holds_is_reported_once_and_served_when_free() -> Result<()> {
    let svc = web("LoadBalancer", "  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n", &[LB_IP]);
    let mut w = world(&svc, &[])?;
    wait_nodeport(&w.c, 1, 2)?;
    let code = |w: &World| -> u16 { w.c.http_from(&w.outside.netns, "192.168.77.11:32000", "/").map_or(0, |(c, _)| c) };
    w.c.wait_for("the health check", Duration::from_secs(5), || Ok(code(&w) == 200))?;
    w.c.kill_agent(1);
    // A process of the node (outside lb's cgroup) takes the port meanwhile.
    let holder = Pod { cgroup: Default::default(), ..w.c.host(1) };
    let pid = w.c.serve_as(&holder, "holder", 32000)?;
    w.c.start_agent_with(1, &[])?;
    wait_nodeport(&w.c, 1, 2)?;
    let metric = |w: &World| -> Result<u64> {
        let (_, m) = w.c.http(1, "127.0.0.1:10249", "/metrics")?;
        Ok(m.lines().find_map(|l| l.strip_prefix("lb_health_check_listeners_failed ")?.parse().ok()).unwrap_or(u64::MAX))
    };
    w.c.wait_for("the failed listener counted", Duration::from_secs(5), || Ok(metric(&w)? == 1))?;
    // More syncs (endpoint changes): tried again each time, logged once.
    let slice = |eps: &[E]| slice_of("web", "web-1", "IPv4", EP, eps);
    w.c.write_object("slice.yaml", &slice(&[E::ready(&w.p1.ip, "node-1")]))?;
    wait_nodeport(&w.c, 1, 1)?;
    w.c.write_object("slice.yaml", &slice(&[E::ready(&w.p1.ip, "node-1"), E::ready(&w.p2.ip, "node-2")]))?;
    wait_nodeport(&w.c, 1, 2)?;
    let log = std::fs::read_to_string(w.c.agent_log(1))?;
    assert_eq!(log.matches("cannot serve the health check on healthCheckNodePort 32000").count(), 1, "{log}");
    assert_eq!(metric(&w)?, 1);
    // The port is free again: served within a second or two, with no
    // change to the objects (a quiet cluster).
    w.c.stop(pid);
    w.c.wait_for("the health check served after the port was freed", Duration::from_secs(5), || Ok(code(&w) == 200))?;
    assert_eq!(metric(&w)?, 0);
    let log = std::fs::read_to_string(w.c.agent_log(1))?;
    assert!(log.contains("the health check is served on healthCheckNodePort 32000"), "{log}");
    Ok(())
}
