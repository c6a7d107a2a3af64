//! North-south parity with kube-proxy, from a client outside the cluster,
//! on IPv4 and IPv6: IPv6 NodePorts / LB IPs with SNAT and Local policy,
//! REJECT when a Service has no endpoints, sessionAffinity keyed by client
//! address, and flows to endpoints that left (UDP re-picks, TCP gets a RST).
use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context as _, Result};
use lbtest::Cluster;
use lbtest::objects::Endpoint as E;
use lbtest::world::*;

#[test]
fn ipv6_node_ports_and_lb_ips_snat_to_the_nodes_ipv6_address() -> Result<()> {
    let w = world(&web("LoadBalancer", "", &[LB_IP6]))?;
    wait_backends(&w.c, 1, NODE1_6, 30080, 2)?;
    let np6 = hostport(NODE1_6, 30080);
    let s = tcp(&w.c, &w.outside, &np6, 60)?;
    assert_eq!(s.ok, 60, "{s:?}");
    // pod-1 is local to node-1: masqueraded as kube-proxy does, it sees
    // node-1's IPv6 address on cni0. pod-2 is remote: it sees node-1's IPv6
    // address, which SNATed the flow so that replies come back.
    assert_eq!(keys(&s), [format!("pod-1 {NODE1_BRIDGE6}").as_str(), format!("pod-2 {NODE1_6}").as_str()].into(), "{s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), [np6.as_str()], "replies come from the NodePort: {s:?}");

    let s = w.c.probe(&w.outside, &["udp", "--addr", &np6, "--count", "20"])?;
    assert_eq!(s.ok, 20, "{s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), [np6.as_str()], "{s:?}");

    // The IPv6 LoadBalancer ingress IP, routed to node-1.
    let lb6 = hostport(LB_IP6, 80);
    let s = tcp(&w.c, &w.outside, &lb6, 30)?;
    assert_eq!(s.ok, 30, "{s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), [lb6.as_str()], "{s:?}");

    // IPv4 is untouched by all this.
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 20)?;
    assert_eq!(s.ok, 20, "{s:?}");

    // `lb-agent nat` lists IPv6 flows like conntrack -L.
    let nat = lbtest::run(lbtest::bin("lb-agent").to_str().unwrap(), &["nat", "--bpffs", w.c.nodes[0].bpffs.to_str().unwrap()])?;
    assert!(nat.lines().any(|l| l.starts_with("ipv6 tcp") && l.contains(&format!("src={CLIENT6} dst={NODE1_6}")) && l.contains("[SNAT]")), "{nat}");
    assert!(nat.lines().any(|l| l.starts_with("ipv4 tcp")), "{nat}");
    Ok(())
}

#[test]
fn ipv6_local_policy_keeps_the_client_with_health_checks_and_source_ranges() -> Result<()> {
    // Overlapping ranges: fd00:77::100/128 inside fd00:77::100/120.
    let extra = format!(
        "  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n  loadBalancerSourceRanges: [\"{CLIENT6}/128\", \"fd00:77::100/120\", \"{CLIENT}/32\"]\n"
    );
    let mut w = world(&web("LoadBalancer", &extra, &[LB_IP6]))?;
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_backends(&w.c, 1, NODE1_6, 30080, 1)?;
    wait_backends(&w.c, 2, "fd00:77::12", 30080, 1)?;
    let s = tcp(&w.c, &w.outside, &hostport(LB_IP6, 80), 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    assert_eq!(keys(&s), [format!("pod-1 {CLIENT6}").as_str()].into(), "the pod sees the client's IPv6 address: {s:?}");
    // node-2 has no local endpoint: dropped, as kube-proxy does.
    let s = tcp(&w.c, &w.outside, &hostport("fd00:77::12", 30080), 2)?;
    assert_eq!(s.errors.get("ETIMEDOUT"), Some(&2), "{s:?}");
    // The health check answers on the nodes' IPv6 addresses too.
    let (code, body) = w.c.http_from(&w.outside.netns, &hostport(NODE1_6, 32000), "/")?;
    assert_eq!(code, 200, "{body}");
    let (code, _) = w.c.http_from(&w.outside.netns, &hostport("fd00:77::12", 32000), "/")?;
    assert_eq!(code, 503);
    // loadBalancerSourceRanges for IPv6 prefixes: fd00:77::101 is inside
    // the /120, fd00:77::200 in none of them.
    let inside = w.c.add_outside("inside", 101, &[(&format!("{LB_IP6}/128"), 1)])?;
    let s = tcp(&w.c, &inside, &hostport(LB_IP6, 80), 2)?;
    assert_eq!(s.ok, 2, "{s:?}");
    let outside_ranges = w.c.add_outside("other", 200, &[(&format!("{LB_IP6}/128"), 1)])?;
    let s = tcp(&w.c, &outside_ranges, &hostport(LB_IP6, 80), 2)?;
    assert_eq!(s.errors.get("ETIMEDOUT"), Some(&2), "outside the ranges: dropped: {s:?}");
    Ok(())
}

#[test]
fn a_service_without_endpoints_is_rejected_at_once_on_both_families() -> Result<()> {
    let w = world(&web("LoadBalancer", "", &[LB_IP, LB_IP6]))?;
    set_endpoints(&w, &[])?;
    // Both families: the IPv6 slice is written after the IPv4 one.
    w.c.wait_for("no backends", Duration::from_secs(5), || {
        let empty = |a: &str| -> Result<bool> { Ok(w.c.programmed(1, a, 30080, "TCP")?.is_some_and(|b| b.is_empty())) };
        Ok(empty(NODE1)? && empty(NODE1_6)?)
    })?;
    for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080), hostport(LB_IP, 80), hostport(LB_IP6, 80)] {
        let s = w.c.probe(&w.outside, &["tcp", "--addr", &addr, "--count", "3", "--timeout-ms", "2000"])?;
        assert_eq!(s.errors.get("ECONNREFUSED"), Some(&3), "{addr}: REJECT, as kube-proxy: {s:?}");
        assert!(s.max_fail_ms < 500, "{addr}: at once, not after a timeout: {s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "2", "--connected", "--timeout-ms", "2000"])?;
        assert_eq!(s.errors.get("ECONNREFUSED"), Some(&2), "{addr}: UDP gets ICMP port unreachable: {s:?}");
    }
    assert!(datapath(&w.c, 1, "nat_rejected")? >= 20, "counted");
    // Endpoints come back: served again.
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_backends(&w.c, 1, NODE1_6, 30080, 1)?;
    let s = tcp(&w.c, &w.outside, &hostport(NODE1_6, 30080), 3)?;
    assert_eq!(s.ok, 3, "{s:?}");
    Ok(())
}

/// kube-proxy's proxier of a family skips a Service with no ClusterIP of
/// that family: a single-stack IPv4 Service has no IPv6 NodePort, even
/// when IPv6 endpoints are listed for it: outside IPv6 clients reach the
/// node's stack, where nothing listens (lb refuses node processes binds
/// to NodePorts in any family).
#[test]
fn a_single_stack_service_has_no_node_ports_in_the_other_family() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    let ports = [("http", 80, 8080, "TCP", 30082)];
    w.c.write_object("v4.yaml", &lbtest::objects::service_typed("v4", &["10.96.0.12"], "NodePort", &ports, "", &[]))?;
    let ep = [("http", 8080, "TCP")];
    w.c.write_object("v4-s.yaml", &lbtest::objects::slice_of("v4", "v4-4", "IPv4", &ep, &[E::ready(&w.p1.ip, "node-1")]))?;
    w.c.write_object("v4-s6.yaml", &lbtest::objects::slice_of("v4", "v4-6", "IPv6", &ep, &[E::ready(&w.p1.ip6, "node-1")]))?;
    wait_backends(&w.c, 1, NODE1, 30082, 1)?;
    // The dual-stack "web" has its IPv6 NodePort on the same node.
    wait_backends(&w.c, 1, NODE1_6, 30080, 2)?;
    assert_eq!(w.c.programmed(1, NODE1_6, 30082, "TCP")?, None, "no IPv6 NodePort for a single-stack IPv4 Service");
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30082), 5)?;
    assert_eq!(keys(&s), [format!("pod-1 {NODE1_BRIDGE}").as_str()].into(), "{s:?}");
    let s = tcp(&w.c, &w.outside, &hostport(NODE1_6, 30082), 5)?;
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&5), "refused by the node's stack: {s:?}");
    // Made dual-stack, the Service takes the IPv6 NodePort.
    w.c.write_object("v4.yaml", &lbtest::objects::service_typed("v4", &["10.96.0.12", "fd00:96::12"], "NodePort", &ports, "", &[]))?;
    wait_backends(&w.c, 1, NODE1_6, 30082, 1)?;
    let s = tcp(&w.c, &w.outside, &hostport(NODE1_6, 30082), 5)?;
    assert_eq!(keys(&s), [format!("pod-1 {NODE1_BRIDGE6}").as_str()].into(), "{s:?}");
    Ok(())
}

#[test]
fn session_affinity_keys_on_the_outside_clients_address() -> Result<()> {
    let extra = "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 60\n";
    let w = world(&web("NodePort", extra, &[]))?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080)] {
        let s = tcp(&w.c, &w.outside, &addr, 30)?;
        assert_eq!(s.ok, 30, "{s:?}");
        assert_eq!(s.replies.len(), 1, "{addr}: every connection of one client to one pod: {s:?}");
        // That pod leaves: never reused; the client moves to the other.
        let first = s.replies.keys().next().unwrap().split(' ').next().unwrap().to_string();
        let stay = if first == "pod-1" { &w.p2 } else { &w.p1 };
        set_endpoints(&w, &[(stay, E::ready)])?;
        // Both families' slices changed: wait for the one tested (the IPv6
        // frontend can lag the IPv4 one by a sync).
        wait_backends(&w.c, 1, NODE1, 30080, 1)?;
        wait_backends(&w.c, 1, NODE1_6, 30080, 1)?;
        let s = tcp(&w.c, &w.outside, &addr, 10)?;
        assert_eq!(s.ok, 10, "{s:?}");
        assert!(s.replies.keys().all(|k| k.starts_with(&stay.name)), "{addr}: {s:?}");
        set_endpoints(&w, &[(&w.p1, E::ready), (&w.p2, E::ready)])?;
        wait_backends(&w.c, 1, NODE1, 30080, 2)?;
        wait_backends(&w.c, 1, NODE1_6, 30080, 2)?;
    }
    Ok(())
}

#[test]
fn a_udp_flow_moves_off_an_endpoint_that_left() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    for (addr, node_addr) in [(hostport(NODE1, 30080), NODE1), (hostport(NODE1_6, 30080), NODE1_6)] {
        set_endpoints(&w, &[(&w.p1, E::ready)])?;
        wait_only(&w.c, node_addr, 30080, &w.p1)?;
        // One socket, one flow: a datagram every 100 ms for 4 s.
        let udp = w.c.probe_bg(&w.outside, &["udp", "--addr", &addr, "--one-socket", "--count", "40", "--interval-ms", "100"])?;
        std::thread::sleep(Duration::from_millis(1000));
        // pod-1 leaves the Service (it still answers: only the flow's NAT
        // entry would keep sending to it).
        set_endpoints(&w, &[(&w.p2, E::ready)])?;
        let s = Cluster::finish(udp)?;
        let to = |p: &str| s.replies.iter().filter(|(k, _)| k.starts_with(p)).map(|(_, n)| *n).sum::<u32>();
        assert!(to("pod-1") >= 5, "{addr}: {s:?}");
        assert!(to("pod-2") >= 10, "{addr}: the flow's next datagrams pick a live backend within 2 s: {s:?}");
        assert!(s.failed() <= 1, "{addr}: {s:?}");
    }
    Ok(())
}

/// An endpoint that leaves while no agent runs (a restart, an upgrade):
/// the next agent's first full sync ends its flows in the NAT table too,
/// as kube-proxy's conntrack cleanup does at its first sync.
#[test]
fn a_udp_flow_moves_off_an_endpoint_that_left_while_no_agent_ran() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let addr = hostport(NODE1, 30080);
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    // One socket, one flow: a datagram every 100 ms for 6 s.
    let udp = w.c.probe_bg(&w.outside, &["udp", "--addr", &addr, "--one-socket", "--count", "60", "--interval-ms", "100"])?;
    std::thread::sleep(Duration::from_millis(1000));
    w.c.kill_agent(1);
    // pod-1 leaves the Service (it still answers: only the flow's NAT
    // entry would keep sending to it, refreshed by every datagram).
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    std::thread::sleep(Duration::from_millis(500));
    w.c.start_agent_with(1, &[])?;
    let s = Cluster::finish(udp)?;
    let to = |p: &str| s.replies.iter().filter(|(k, _)| k.starts_with(p)).map(|(_, n)| *n).sum::<u32>();
    assert!(to("pod-1") >= 5, "{s:?}");
    assert!(to("pod-2") >= 10, "the flow's next datagrams after the restart pick a live backend: {s:?}");
    Ok(())
}

#[test]
fn a_tcp_flow_to_an_endpoint_that_left_gets_a_reset_and_a_draining_one_keeps_going() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    for (addr, node_addr) in [(hostport(NODE1, 30080), NODE1), (hostport(NODE1_6, 30080), NODE1_6)] {
        set_endpoints(&w, &[(&w.p1, E::ready)])?;
        wait_only(&w.c, node_addr, 30080, &w.p1)?;
        // Terminating but still serving: the held connection drains.
        let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &addr, "--hold-ms", "2500", "--interval-ms", "50"])?;
        std::thread::sleep(Duration::from_millis(500));
        set_endpoints(&w, &[(&w.p1, E::terminating), (&w.p2, E::ready)])?;
        let s = Cluster::finish(held)?;
        assert_eq!(s.failed(), 0, "{addr}: a serving, terminating endpoint keeps its flows: {s:?}");
        // Masqueraded (externalTrafficPolicy Cluster, a local backend).
        assert_eq!(s.replies.keys().collect::<Vec<_>>(), [format!("pod-1 {}", if node_addr == NODE1 { NODE1_BRIDGE } else { NODE1_BRIDGE6 }).as_str()]);

        // Gone for good (draining, then out of the slice: a deleted pod):
        // the next packet of the flow is answered with a RST.
        set_endpoints(&w, &[(&w.p1, E::ready)])?;
        wait_only(&w.c, node_addr, 30080, &w.p1)?;
        let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &addr, "--hold-ms", "3000", "--interval-ms", "50", "--timeout-ms", "5000"])?;
        std::thread::sleep(Duration::from_millis(500));
        set_endpoints(&w, &[(&w.p1, E::draining), (&w.p2, E::ready)])?;
        wait_only(&w.c, node_addr, 30080, &w.p2)?;
        set_endpoints(&w, &[(&w.p2, E::ready)])?;
        let s = Cluster::finish(held)?;
        assert!(s.replies.keys().all(|k| k.starts_with("pod-1")), "{s:?}");
        assert_eq!(s.errors.keys().collect::<Vec<_>>(), ["ECONNRESET"], "{addr}: reset, not left to time out: {s:?}");
        assert!(s.max_fail_ms < 1000, "{addr}: at once: {s:?}");
        // A new connection goes to the live endpoint.
        let s = tcp(&w.c, &w.outside, &addr, 3)?;
        assert!(s.ok == 3 && s.replies.keys().all(|k| k.starts_with("pod-2")), "{s:?}");
    }
    assert!(datapath(&w.c, 1, "nat_reset")? >= 2);
    Ok(())
}

/// kube-proxy's conntrack keeps a TCP flow to an endpoint that fails its
/// readiness probe, and to a ready one that leaves the Service (its pod
/// still runs: the selector switched to other pods, a blue/green rollout);
/// it flushes UDP flows to an endpoint that stops serving. So does lb.
#[test]
fn node_port_tcp_flows_outlive_a_readiness_failure_and_a_selector_switch_and_udp_flows_move() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    let addr = hostport(NODE1, 30080);
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &addr, "--hold-ms", "3000", "--interval-ms", "50"])?;
    let udp = w.c.probe_bg(&w.outside, &["udp", "--addr", &addr, "--one-socket", "--count", "30", "--interval-ms", "100"])?;
    std::thread::sleep(Duration::from_millis(600));
    // pod-1 fails its readiness probe (listed, not ready, not terminating):
    // kube-proxy's conntrack keeps its TCP flows and flushes its UDP ones.
    set_endpoints(&w, &[(&w.p1, E::not_ready), (&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    let s = tcp(&w.c, &w.outside, &addr, 5)?;
    assert!(s.ok == 5 && s.replies.keys().all(|k| k.starts_with("pod-2")), "new connections go to the ready pod: {s:?}");
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the held connection keeps going: {s:?}");
    assert!(s.replies.keys().all(|k| k.starts_with("pod-1")), "{s:?}");
    let u = Cluster::finish(udp)?;
    let to = |p: &str| u.replies.iter().filter(|(k, _)| k.starts_with(p)).map(|(_, n)| *n).sum::<u32>();
    assert!(to("pod-1") >= 3 && to("pod-2") >= 10, "the UDP flow moves to the ready pod: {u:?}");

    // Ready, switched out of the Service: the flow goes on.
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &addr, "--hold-ms", "3000", "--interval-ms", "50"])?;
    let udp = w.c.probe_bg(&w.outside, &["udp", "--addr", &addr, "--one-socket", "--count", "30", "--interval-ms", "100"])?;
    std::thread::sleep(Duration::from_millis(600));
    let resets = datapath(&w.c, 1, "nat_reset")?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the held connection keeps going: {s:?}");
    assert!(s.replies.keys().all(|k| k.starts_with("pod-1")), "{s:?}");
    let u = Cluster::finish(udp)?;
    let to = |p: &str| u.replies.iter().filter(|(k, _)| k.starts_with(p)).map(|(_, n)| *n).sum::<u32>();
    assert!(to("pod-1") >= 3 && to("pod-2") >= 10, "the UDP flow moves: {u:?}");
    assert_eq!(datapath(&w.c, 1, "nat_reset")?, resets, "no flow was reset");
    Ok(())
}

/// An outside client's TCP flow kept when its ready pod was switched out
/// of the Service outlives a restart of the agent: the new agent's first
/// sweep of the NAT table keeps the pair the old one recorded.
#[test]
fn a_node_port_tcp_flow_kept_on_a_selector_switch_outlives_an_agent_restart() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    let addr = hostport(NODE1, 30080);
    let started = std::time::Instant::now();
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &addr, "--hold-ms", "6000", "--interval-ms", "50"])?;
    std::thread::sleep(Duration::from_millis(600));
    let resets = datapath(&w.c, 1, "nat_reset")?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    w.c.kill_agent(1);
    w.c.start_agent(1)?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    std::thread::sleep(Duration::from_millis(600));
    assert!(started.elapsed() < Duration::from_millis(5500), "restarted too late to judge: {:?}", started.elapsed());
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the held connection keeps going through the restart: {s:?}");
    assert!(!s.replies.is_empty() && s.replies.keys().all(|k| k.starts_with("pod-1")), "{s:?}");
    assert_eq!(datapath(&w.c, 1, "nat_reset")?, resets, "no flow was reset");
    Ok(())
}

#[test]
fn a_direct_flow_to_a_pod_may_reuse_the_source_port_of_a_finished_node_port_flow() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_backends(&w.c, 1, NODE1, 30080, 1)?;
    // Routable pod IPs (a BGP or VPC CNI): this client reaches pod-1 directly.
    let direct = w.c.add_outside("direct", 101, &[("10.244.1.0/24", 1), ("fd00:244:1::/64", 1)])?;
    let client = |fam6: bool| if fam6 { "fd00:77::101" } else { "192.168.77.101" };
    for (np, pod, fam6) in [(hostport(NODE1, 30080), hostport(&w.p1.ip, 8080), false), (hostport(NODE1_6, 30080), hostport(&w.p1.ip6, 8080), true)] {
        // Closed with a RST and with FINs: both leave a closed flow behind.
        for (sport, linger) in [("40000", true), ("40001", false)] {
            let mut args = vec!["tcp", "--addr", np.as_str(), "--count", "1", "--sport", sport];
            if linger {
                args.push("--linger0");
            }
            let s = w.c.probe(&direct, &args)?;
            assert_eq!(s.ok, 1, "via the NodePort: {s:?}");
            // Same client port, straight to the pod: its replies must not be
            // rewritten to the NodePort by the old flow's leftover.
            let s = w.c.probe(&direct, &["tcp", "--addr", &pod, "--count", "1", "--sport", sport, "--timeout-ms", "2000"])?;
            assert_eq!(s.ok, 1, "direct, port {sport}: {s:?}");
            assert_eq!(keys(&s), [format!("pod-1 {}", client(fam6)).as_str()].into(), "{s:?}");
            assert_eq!(s.peers.keys().collect::<Vec<_>>(), [pod.as_str()], "the pod answers as itself: {s:?}");
        }
    }
    Ok(())
}

/// A closed flow whose reply key a newer flow took (its SNAT port was
/// freed and claimed again): a SYN that reuses the closed flow's client
/// port replaces the closed flow and leaves the newer flow's entry alone
/// (removing it stalled that flow: its replies had nowhere to go).
#[test]
fn a_syn_reusing_a_closed_flows_port_leaves_its_old_reply_key_to_the_flow_that_took_it() -> Result<()> {
    use aya::maps::{HashMap, Map, MapData};
    use lb_common::{Nat4Entry, Nat4Key, nat_state};
    let w = world(&web("NodePort", "", &[]))?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_backends(&w.c, 1, NODE1, 30080, 1)?;
    let np = hostport(NODE1, 30080);
    let once = || w.c.probe(&w.outside, &["tcp", "--addr", &np, "--count", "1", "--sport", "40000", "--linger0"]);
    let s = once()?;
    assert_eq!(s.ok, 1, "{s:?}");
    let pin = w.c.nodes[0].bpffs.join(lb_common::maps::NAT4);
    let mut nat: HashMap<_, Nat4Key, Nat4Entry> = HashMap::try_from(Map::HashMap(MapData::from_pin(&pin)?))?;
    let ip = |a: &str| -> Result<[u8; 4]> { Ok(a.parse::<std::net::Ipv4Addr>()?.octets()) };
    let k = Nat4Key { saddr: ip(CLIENT)?, daddr: ip(NODE1)?, sport: 40000, dport: 30080, proto: 6, _pad: [0; 3] };
    let e = nat.get(&k, 0)?;
    assert_ne!(e.state & nat_state::RST, 0, "the client closed it with a RST: {e:?}");
    let rk = e.other_key(6);
    let r = nat.get(&rk, 0)?;
    // Flow X, from client port 41000, holds the reply key now.
    let kx = Nat4Key { sport: 41000, ..k };
    let seen = nat_state::SEEN;
    nat.insert(kx, Nat4Entry { state: seen, created_ns: e.created_ns + 1, ..e }, 0)?;
    nat.insert(rk, Nat4Entry { to_dport: 41000, state: seen, created_ns: e.created_ns + 1, ..r }, 0)?;
    let s = once()?;
    assert_eq!(s.ok, 1, "the port's new flow: {s:?}");
    let now = nat.get(&rk, 0)?;
    assert_eq!(now.to_dport, 41000, "X's reply entry is still X's: {now:?}");
    let new = nat.get(&k, 0)?;
    assert_ne!(new.to_sport, e.to_sport, "the new flow got another SNAT port: {new:?}");
    Ok(())
}

#[test]
fn twenty_thousand_concurrent_snat_flows_to_one_backend() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    // Only pod-2, on the other node: every flow is SNATed to node-1.
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_backends(&w.c, 1, NODE1, 30080, 1)?;
    // One process holds at most 20,000 sockets here (RLIMIT_NOFILE): two
    // servers share pod-2's port (SO_REUSEPORT), two clients share the
    // outside host, each holding 10,000 connections open at once.
    w.c.stop(w.servers[1]);
    w.c.serve_many(&w.p2, 8080)?;
    w.c.serve_many(&w.p2, 8080)?;
    let np = hostport(NODE1, 30080);
    let args = ["concurrent", "--addr", np.as_str(), "--count", "10000", "--hold-ms", "20000"];
    let clients = [w.c.probe_bg(&w.outside, &args)?, w.c.probe_bg(&w.outside, &args)?];
    // All 20,000 live in node-1's NAT table at once, each with its own port.
    let bpffs = w.c.nodes[0].bpffs.to_str().unwrap().to_string();
    let mut ports = BTreeSet::new();
    w.c.wait_for("20,000 established SNAT flows", Duration::from_secs(60), || {
        let nat = lbtest::run(lbtest::bin("lb-agent").to_str().unwrap(), &["nat", "--bpffs", &bpffs])?;
        ports = nat
            .lines()
            .filter(|l| l.starts_with("ipv4 tcp  ESTABLISHED") && l.contains(&format!("src={CLIENT}")) && l.contains("[SNAT]"))
            .filter_map(|l| l.split_whitespace().filter(|f| f.starts_with("sport=")).nth(1).map(str::to_string))
            .collect();
        Ok(ports.len() >= 20000)
    })?;
    for c in clients {
        let s = Cluster::finish(c)?;
        let failed = datapath(&w.c, 1, "nat_failed")?;
        assert_eq!(s.ok, 10000, "each answered: {:?} of {}; nat_failed {failed}", s.errors, s.attempts);
        assert_eq!(keys(&s), [format!("pod-2 {NODE1}").as_str()].into());
    }
    assert_eq!(datapath(&w.c, 1, "nat_failed")?, 0, "no flow lacked a SNAT port");
    Ok(())
}

/// Packets node-1 received on `dev`.
fn rx_packets(c: &Cluster, netns: &str, dev: &str) -> Result<u64> {
    let out = c.in_netns(netns, &["ip", "-j", "-s", "link", "show", "dev", dev])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    Ok(v[0]["stats64"]["rx"]["packets"].as_u64().unwrap_or(0))
}

#[test]
fn replies_of_snated_flows_arriving_on_an_overlay_device_are_translated() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    // A VXLAN between the nodes (over a second address of each node's NIC)
    // carries pod traffic, and node-2 reaches node-1's addresses over it:
    // the replies of flows SNATed to node-1 (to its vx0 address, the
    // source the route to pod-2 picks) come back on vx0, not on eth0.
    for (n, other) in [(&w.c.nodes[0], &w.c.nodes[1]), (&w.c.nodes[1], &w.c.nodes[0])] {
        let (i, j) = (n.index, other.index);
        for args in [
            vec!["ip".to_string(), "addr".into(), "add".into(), format!("192.168.78.{}/24", 10 + i), "dev".into(), "eth0".into()],
            format!("ip link add vx0 type vxlan id 42 dstport 4789 local 192.168.78.{} dev eth0", 10 + i).split(' ').map(String::from).collect(),
            format!("bridge fdb append 00:00:00:00:00:00 dev vx0 dst 192.168.78.{}", 10 + j).split(' ').map(String::from).collect(),
            format!("ip addr add 10.250.0.{i}/24 dev vx0").split(' ').map(String::from).collect(),
            format!("ip addr add fd00:250::{i}/64 dev vx0 nodad").split(' ').map(String::from).collect(),
            "ip link set vx0 up".split(' ').map(String::from).collect(),
            format!("ip route replace 10.244.{j}.0/24 via 10.250.0.{j} dev vx0").split(' ').map(String::from).collect(),
            format!("ip -6 route replace fd00:244:{j}::/64 via fd00:250::{j} dev vx0").split(' ').map(String::from).collect(),
        ] {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            w.c.in_netns(&n.netns, &args)?;
        }
    }
    let n2 = &w.c.nodes[1].netns;
    w.c.in_netns(n2, &["ip", "route", "add", "192.168.77.11/32", "via", "10.250.0.1", "dev", "vx0"])?;
    w.c.in_netns(n2, &["ip", "-6", "route", "add", "fd00:77::11/128", "via", "fd00:250::1", "dev", "vx0"])?;
    // Only pod-2: SNATed. The next sync attaches to the new device.
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_backends(&w.c, 1, NODE1, 30080, 1)?;
    w.c.wait_for("the programs on vx0", Duration::from_secs(10), || {
        let log = std::fs::read_to_string(w.c.agent_log(1))?;
        Ok(log.lines().any(|l| l.contains("NodePort programs attached") && l.contains("vx0")))
    })?;
    let before = rx_packets(&w.c, &w.c.nodes[0].netns, "vx0")?;
    // SNATed as kube-proxy's MASQUERADE does: to the address the route to
    // pod-2 picks, node-1's on vx0 (flannel's pods see flannel.1's).
    for (np, vx) in [(hostport(NODE1, 30080), "10.250.0.1"), (hostport(NODE1_6, 30080), "fd00:250::1")] {
        let s = tcp(&w.c, &w.outside, &np, 10)?;
        assert_eq!(s.ok, 10, "{np}: {s:?}");
        assert_eq!(keys(&s), [format!("pod-2 {vx}").as_str()].into(), "{s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &np, "--count", "10"])?;
        assert_eq!(s.ok, 10, "{np}: {s:?}");
    }
    assert!(rx_packets(&w.c, &w.c.nodes[0].netns, "vx0")? >= before + 40, "the replies came over the overlay");
    Ok(())
}

/// The TC programs' checksum updates hold on the wire, for both kinds of
/// packets they meet: the client's are partial (its offload is on, and the
/// fabric's port to node-1 passes them on as they are: only the
/// pseudo-header sum, finished in software where node-1's eth0 sends them
/// on without offload), pod-2's replies arrive complete (node-2's eth0
/// finished them). A capture at pod-2 and at the client checks every TCP
/// and UDP checksum, both families.
#[test]
fn translated_packets_carry_valid_checksums() -> Result<()> {
    let w = world_wired(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--nodeport-acceleration", "none"])?;
    w.c.in_netns(&w.outside.netns, &["ethtool", "-K", "eth0", "tx", "on"])?;
    w.c.in_netns(w.c.fabric_netns(), &["ethtool", "-K", "n1", "tx", "on"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    let traffic = || -> Result<()> {
        for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080), hostport(LB_IP, 80), hostport(LB_IP6, 80)] {
            let s = tcp(&w.c, &w.outside, &addr, 10)?;
            assert_eq!(s.ok, 10, "{addr}: {s:?}");
            let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "10"])?;
            assert_eq!(s.ok, 10, "{addr}: {s:?}");
            let s = w.c.probe(&w.outside, &["bulk", "--addr", &addr, "--bytes", "1048576"])?;
            assert_eq!(s.ok, 1, "{addr}: {s:?}");
        }
        Ok(())
    };
    // 4 x (10 connections of 5+ packets, 10 datagrams) each way at least.
    checksums_hold(&w, &w.p2, (4 * (10 * 5 + 10), 4 * (10 * 3 + 10)), traffic)?;
    Ok(())
}

/// A client that connects both straight to a pod and through the NodePort
/// of the pod's node (its backend local: no SNAT, so both kinds of flow
/// have the same tuple at the pod), at full speed, reusing its ports as
/// fast as the kernel hands them out: no connection stalls or fails.
#[test]
fn direct_and_node_port_connections_to_a_local_backend_mixed_at_full_speed() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    w.c.serve_tiny(&w.p1, 9000, 1)?;
    let port = [("t", 80, 9000, "TCP", 30090)];
    w.c.write_object("tiny.yaml", &lbtest::objects::service_typed("tiny", &["10.96.0.20"], "NodePort", &port, "", &[]))?;
    w.c.write_object("tiny-s.yaml", &lbtest::objects::slice_of("tiny", "tiny-1", "IPv4", &[("t", 9000, "TCP")], &[E::ready(&w.p1.ip, "node-1")]))?;
    wait_backends(&w.c, 1, NODE1, 30090, 1)?;
    let client = w.c.add_outside("direct", 101, &[("10.244.1.0/24", 1)])?;
    w.c.in_netns(&client.netns, &["sysctl", "-qw", "net.ipv4.ip_local_port_range=20000 23000"])?;
    let rate = |addr: &str| -> Result<serde_json::Value> {
        let out = w.c.probe_cmd(&client).args(["rate", "--addr", addr, "--secs", "1", "--cpu", "0"]).output()?;
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    let (np, pod) = (hostport(NODE1, 30090), hostport(&w.p1.ip, 9000));
    // A round each way before the measured ones: the client is a new host
    // (node-1 and pod-1 learn its address), and on a loaded machine (the
    // suite's other tests run beside this one) that first exchange can
    // take longer than the rounds' 1 s timeout, which is for stalls.
    for addr in [&np, &pod] {
        rate(addr)?;
    }
    for round in 0..8 {
        for addr in [&np, &pod] {
            let v = rate(addr)?;
            assert!(v["ok"].as_u64().unwrap_or(0) > 100, "round {round}, {addr}: {v}");
            assert!(v["errors"].as_object().is_some_and(|e| e.is_empty()), "round {round}, {addr}: {v}");
            assert!(v["slowest_ms"].as_f64().unwrap_or(0.0) < 900.0, "round {round}, {addr}: a stalled connection: {v}");
        }
    }
    // Every NodePort flow ended with the client's RST: none is left looking
    // live (it would stay for the established timeout).
    let v = rate(&np)?;
    assert!(v["errors"].as_object().is_some_and(|e| e.is_empty()), "last round, {np}: {v}");
    let flows = flows_from(&w.c, "192.168.77.101")?;
    assert!(flows.len() > 100, "{flows:#?}");
    let open: Vec<&String> = flows.iter().filter(|l| !l.contains("CLOSE(RST)")).collect();
    assert!(open.is_empty(), "{} of {} flows left open: {open:#?}", open.len(), flows.len());
    Ok(())
}

/// The iptables FORWARD chain of node-1 drops by default, as Docker and
/// ufw leave it (IPv4 in iptables-nft, IPv6 in iptables-legacy: each
/// backend as a node may use it), with Docker's conntrack rule and a
/// CNI's rule for the pods' own traffic (flannel's `-s POD_CIDR -j
/// ACCEPT`). kube-proxy's KUBE-FORWARD
/// passes its NodePort flows there; lb's LB-FORWARD passes what the TC
/// programs translate (their mark): requests SNATed to pod-2 and their
/// replies, requests to the local pod-1. The agent puts its rules back
/// when they are flushed, removes them with `--forward-accept none` (then
/// those flows are dropped) and on teardown.
#[test]
fn a_forward_chain_that_drops_passes_translated_traffic_as_kube_proxys_would() -> Result<()> {
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--forward-accept-period", "1s"])?;
    let n1 = w.c.nodes[0].netns.clone();
    let tools = [("iptables-nft", &w.p1.ip), ("ip6tables-legacy", &w.p1.ip6)];
    // Docker's conntrack rule too: it passes kube-proxy's replies, not
    // lb's (translated before conntrack sees them, they start a tuple of
    // their own).
    let rules = |w: &World| -> Result<()> {
        for (tool, pod) in tools {
            w.c.in_netns(&n1, &[tool, "-w", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"])?;
            w.c.in_netns(&n1, &[tool, "-w", "-A", "FORWARD", "-s", pod, "-j", "ACCEPT"])?;
        }
        Ok(())
    };
    rules(&w)?;
    for (tool, _) in tools {
        w.c.in_netns(&n1, &[tool, "-w", "-P", "FORWARD", "DROP"])?;
    }
    let jumps = |w: &World| -> Result<usize> {
        let mut n = 0;
        for (tool, _) in tools {
            n += w.c.in_netns(&n1, &[tool, "-w", "-S", "FORWARD"])?.lines().filter(|l| l.ends_with("-j LB-FORWARD")).count();
        }
        Ok(n)
    };
    w.c.wait_for("LB-FORWARD in both FORWARD chains", Duration::from_secs(10), || Ok(jumps(&w)? == 2))?;
    let log = std::fs::read_to_string(w.c.agent_log(1))?;
    for backend in ["iptables-nft (IPv4)", "iptables-legacy (IPv6)"] {
        assert!(log.contains(backend) && log.contains("LB-FORWARD accepts it (mark 0x1000)"), "the agent says where and why: {log}");
    }
    let accepted = |w: &World| -> Result<u64> {
        let mut n = 0;
        for (tool, _) in tools {
            let out = w.c.in_netns(&n1, &[tool, "-w", "-L", "LB-FORWARD", "-v", "-x", "-n"])?;
            n += out.lines().filter(|l| l.contains("ACCEPT")).filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok()).sum::<u64>();
        }
        Ok(n)
    };
    let flows = |w: &World, n: u32| -> Result<()> {
        for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080), hostport(LB_IP, 80), hostport(LB_IP6, 80)] {
            let s = tcp(&w.c, &w.outside, &addr, n)?;
            assert_eq!(s.ok, n, "{addr}: {s:?}");
            let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", &n.to_string()])?;
            assert_eq!(s.ok, n, "{addr}: {s:?}");
        }
        Ok(())
    };
    // pod-2 only: both directions are forwarded by node-1 (SNAT).
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    let before = accepted(&w)?;
    flows(&w, 10)?;
    let forwarding = !lbtest::bpf_forward_from_env();
    if forwarding {
        // 4 x 10 TCP flows of at least 5 packets each way, 4 x 10 datagrams each way.
        let n = accepted(&w)? - before;
        assert!(n >= 4 * (10 * 10 + 10 * 2), "packets LB-FORWARD accepted: {n}");
    }
    // The local pod-1: requests are lb's, replies the CNI's rule's.
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p1)?;
    flows(&w, 5)?;

    // A firewall reload flushes FORWARD: the jump comes back.
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    for (tool, _) in tools {
        w.c.in_netns(&n1, &[tool, "-w", "-F", "FORWARD"])?;
    }
    rules(&w)?;
    w.c.wait_for("LB-FORWARD back in both FORWARD chains", Duration::from_secs(10), || Ok(jumps(&w)? == 2))?;
    flows(&w, 5)?;

    // Native nftables forward chains that may drop (a drop policy, or
    // firewalld's shape: accept, then a reject at the end): no rule in
    // another table overrides them, so the agent names them in a warning
    // with the rule they need, and that rule lets the flows through.
    w.c.in_netns(&n1, &["nft", "add", "table", "inet", "hostfw"])?;
    w.c.in_netns(&n1, &["nft", "add chain inet hostfw FORWARD_drop { type filter hook forward priority 0; policy drop; }"])?;
    w.c.in_netns(&n1, &["nft", "add chain inet hostfw FORWARD_reject { type filter hook forward priority 10; policy accept; }"])?;
    w.c.in_netns(&n1, &["nft", "add rule inet hostfw FORWARD_reject reject"])?;
    let log1 = w.c.agent_log(1);
    w.c.wait_for("the nftables chains named", Duration::from_secs(10), || {
        let log = std::fs::read_to_string(&log1)?;
        Ok(log.contains("chain=\"nftables inet hostfw FORWARD_drop\"") && log.contains("chain=\"nftables inet hostfw FORWARD_reject\""))
    })?;
    let log = std::fs::read_to_string(&log1)?;
    for want in ["its policy is drop", "it has rules that drop, reject or jump", "add `meta mark & 0x1000 == 0x1000 accept` first in that chain"] {
        assert!(log.contains(want), "the warnings say {want:?}: {log}");
    }
    if forwarding {
        let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(NODE1, 30080), "--count", "3", "--timeout-ms", "300"])?;
        assert_eq!(s.ok, 0, "the nftables chains drop them: {s:?}");
    }
    // `lb_netfilter_problems` counts them until the rule is in each.
    assert_eq!(agent_metric(&w.c, 1, "lb_netfilter_problems")?, 2);
    for (chain, left) in [("FORWARD_drop", 1), ("FORWARD_reject", 0)] {
        w.c.in_netns(&n1, &["nft", &format!("insert rule inet hostfw {chain} meta mark & 0x1000 == 0x1000 accept")])?;
        w.c.wait_for(&format!("{left} problems left"), Duration::from_secs(5), || Ok(agent_metric(&w.c, 1, "lb_netfilter_problems")? == left))?;
    }
    flows(&w, 3)?;
    w.c.in_netns(&n1, &["nft", "delete", "table", "inet", "hostfw"])?;
    flows(&w, 3)?;

    // --forward-accept none: no mark, no rules; what the stack forwards is
    // dropped (BPF forwarding does not pass FORWARD).
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--forward-accept", "none"])?;
    w.c.wait_for("LB-FORWARD gone", Duration::from_secs(10), || Ok(jumps(&w)? == 0))?;
    if forwarding {
        for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080)] {
            let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "3", "--timeout-ms", "300"])?;
            assert_eq!(s.ok, 0, "{addr}: dropped by FORWARD: {s:?}");
        }
    }
    // Teardown removes them too.
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--forward-accept-period", "1s"])?;
    w.c.wait_for("LB-FORWARD again", Duration::from_secs(10), || Ok(jumps(&w)? == 2))?;
    flows(&w, 3)?;
    w.c.kill_agent(1);
    lbtest::teardown_in(&n1, &w.c.nodes[0].bpffs)?;
    assert_eq!(jumps(&w)?, 0, "teardown removes lb's FORWARD rules");
    for (tool, _) in tools {
        let save = w.c.in_netns(&n1, &[tool, "-w", "-S"])?;
        assert!(!save.contains("LB-FORWARD"), "{tool}: {save}");
        assert!(save.contains("-P FORWARD DROP"), "the node's own policy stays: {save}");
    }
    Ok(())
}

/// A router that advertises the Service CIDR (Calico's serviceClusterIPs,
/// BGP) sends outside clients' packets for a ClusterIP to a node, where
/// kube-proxy serves them (KUBE-SERVICES runs in PREROUTING). lb does too,
/// on arrival: a backend on another node is SNATed (its replies come back
/// here), the local one is masqueraded (kube-proxy with its cluster CIDR
/// masquerades sources outside it), and
/// internalTrafficPolicy Local applies as kube-proxy applies it.
/// `--external-cluster-ip false` leaves them to the stack (here: no route).
#[test]
fn cluster_ips_routed_to_a_node_from_outside_are_served_as_kube_proxy_serves_them() -> Result<()> {
    // A ClusterIP-only Service: the TC programs go on for it too.
    let mut w = world(&web("ClusterIP", "", &[]))?;
    wait_backends(&w.c, 1, "10.96.0.10", 80, 2)?;
    w.c.in_netns(&w.outside.netns, &["ip", "route", "add", "10.96.0.0/16", "via", NODE1])?;
    let vip = "10.96.0.10:80";
    let s = tcp(&w.c, &w.outside, vip, 30)?;
    assert_eq!(s.ok, 30, "{s:?}");
    assert_eq!(keys(&s), [format!("pod-1 {NODE1_BRIDGE}").as_str(), "pod-2 192.168.77.11"].into(), "pod-1 masqueraded, pod-2 node-1 (SNAT): {s:?}");
    let s = w.c.probe(&w.outside, &["udp", "--addr", vip, "--count", "10"])?;
    assert_eq!(s.ok, 10, "{s:?}");
    assert!(flows_from(&w.c, CLIENT)?.iter().any(|l| l.contains("dst=10.96.0.10 ")), "{:?}", flows_from(&w.c, CLIENT)?);
    // internalTrafficPolicy Local: node-1's endpoint only.
    w.c.write_object("svc.yaml", &web("ClusterIP", "  internalTrafficPolicy: Local\n", &[]))?;
    w.c.wait_for("the node-local set", Duration::from_secs(5), || {
        let l = w.c.list(1)?;
        Ok(l["frontends"].as_array().into_iter().flatten().any(|f| f["address"] == "10.96.0.10" && f["flags"].as_array().is_some_and(|a| a.iter().any(|x| x == "itp-local"))))
    })?;
    let s = tcp(&w.c, &w.outside, vip, 10)?;
    assert_eq!(keys(&s), [format!("pod-1 {NODE1_BRIDGE}").as_str()].into(), "{s:?}");
    // Off: the packets go on to node-1's stack, which has no route for them.
    w.c.write_object("svc.yaml", &web("ClusterIP", "", &[]))?;
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--external-cluster-ip", "false"])?;
    wait_backends(&w.c, 1, "10.96.0.10", 80, 2)?;
    let s = w.c.probe(&w.outside, &["tcp", "--addr", vip, "--count", "3", "--timeout-ms", "500"])?;
    assert_eq!(s.ok, 0, "{s:?}");
    Ok(())
}

/// A firewall reload takes lb's rules with it: `iptables-restore` of the
/// node's saved rules (netfilter-persistent) flushes the filter table,
/// LB-FORWARD and the jump to it included; `nft flush ruleset` and the
/// rules again (nftables.service) removes the `inet lb` table too. The
/// agent sees nftables change (iptables-nft's rules are nftables') and
/// puts its rules back at once, not at its next look (an hour here), so
/// flows through the stack are dropped for a moment at most.
#[test]
fn a_firewall_reload_is_repaired_at_once_not_at_the_next_period() -> Result<()> {
    let w = world_with(&web("NodePort", "", &[]), &["--forward-accept-period", "3600s"])?;
    let n1 = w.c.nodes[0].netns.clone();
    // pod-2 only: SNATed flows, forwarded by node-1 both ways.
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    let saved = std::env::temp_dir().join(format!("lbt-{}-rules.v4", std::process::id()));
    std::fs::write(
        &saved,
        format!(
            "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n-A FORWARD -s {}/32 -j ACCEPT\nCOMMIT\n*mangle\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -m conntrack --ctstate INVALID -j DROP\nCOMMIT\n",
            w.p1.ip
        ),
    )?;
    let reload = || w.c.in_netns(&n1, &["iptables-nft-restore", "-w", "5", saved.to_str().unwrap()]);
    let jump = || -> Result<bool> { Ok(w.c.in_netns(&n1, &["iptables-nft", "-w", "-S", "FORWARD"])?.lines().any(|l| l.ends_with("-j LB-FORWARD"))) };
    let table = || -> Result<bool> { Ok(w.c.in_netns(&n1, &["nft", "list", "tables"])?.lines().any(|l| l.trim() == "table inet lb")) };
    let flows = || -> Result<()> {
        let addr = hostport(NODE1, 30080);
        let s = tcp(&w.c, &w.outside, &addr, 10)?;
        assert_eq!(s.ok, 10, "{s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "10"])?;
        assert_eq!(s.ok, 10, "{s:?}");
        Ok(())
    };
    let result = (|| -> Result<()> {
        // The firewall comes after the agent.
        reload()?;
        w.c.wait_for("LB-FORWARD after the firewall started", Duration::from_secs(5), jump)?;
        // conntrack holds an entry (a datagram to a port of node-1's own).
        w.c.probe(&w.outside, &["udp", "--addr", &hostport(NODE1, 1), "--count", "1", "--timeout-ms", "300"])?;
        // netfilter-persistent reloads: the filter table is rewritten.
        reload()?;
        w.c.wait_for("LB-FORWARD and table inet lb after the reload", Duration::from_secs(5), || Ok(jump()? && table()?))?;
        flows()?;
        // nftables.service restarts: everything goes, then the rules again.
        w.c.in_netns(&n1, &["nft", "flush", "ruleset"])?;
        reload()?;
        w.c.wait_for("LB-FORWARD and table inet lb after nft flush ruleset", Duration::from_secs(5), || Ok(jump()? && table()?))?;
        flows()?;
        // Each load removed them and each was repaired once: the agent's
        // own writes (nftables changes too) start no loop of repairs.
        let log = std::fs::read_to_string(w.c.agent_log(1))?;
        assert_eq!(log.matches("LB-FORWARD accepts it").count(), 3, "{log}");
        // table inet lb: written at the start (the masquerade rule, and
        // with it the notrack rule), and again after `nft flush ruleset`;
        // the iptables reloads left it alone.
        assert_eq!(log.matches("lb's SNATed and DSR flows skip it").count(), 2, "{log}");
        // The metrics count them, and see no problem left.
        assert_eq!(agent_metric(&w.c, 1, "lb_netfilter_rules_written_total{kind=\"forward\"}")?, 3);
        assert_eq!(agent_metric(&w.c, 1, "lb_netfilter_rules_written_total{kind=\"notrack\"}")?, 2);
        assert_eq!(agent_metric(&w.c, 1, "lb_netfilter_rules_written_total{kind=\"masquerade\"}")?, 2);
        assert_eq!(agent_metric(&w.c, 1, "lb_netfilter_problems")?, 0);
        Ok(())
    })();
    let _ = std::fs::remove_file(&saved);
    result
}

/// externalTrafficPolicy Cluster: kube-proxy masquerades every outside
/// flow of such a Service (`KUBE-EXT-*` jumps to `KUBE-MARK-MASQ`), so a
/// backend on the node the flow reached sees the node's address, as the
/// ones on other nodes do (lb SNATs those itself). lb marks the client's
/// packets of such flows and its nftables table masquerades them to the
/// address of the device they leave by (node-1's on its pod bridge):
/// NodePort and LB IP, TCP and UDP, both families, replies from the
/// frontend. externalTrafficPolicy Local keeps the client's address, as
/// does `--local-masquerade none` (Cilium's behaviour); a connection made
/// before an agent restart that turns the masquerade off keeps going.
#[test]
fn cluster_policy_masquerades_outside_flows_to_local_backends_as_kube_proxy_does() -> Result<()> {
    let mut w = world(&web("LoadBalancer", "", &[LB_IP, LB_IP6]))?;
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p1)?;
    let n1 = w.c.nodes[0].netns.clone();
    let rules = |w: &World| w.c.in_netns(&n1, &["nft", "list", "table", "inet", "lb"]).unwrap_or_default();
    // At once, before conntrack held anything: the masquerade rule, and
    // the notrack rule with it (the nat hook makes conntrack run).
    w.c.wait_for("table inet lb with its masquerade rule", Duration::from_secs(5), || Ok(rules(&w).contains("fully-random")))?;
    let r = rules(&w);
    // Ports outside lb's SNAT range (1024-29999) and the NodePorts.
    let rule = "meta mark & 0x00000800 == 0x00000800 meta l4proto { tcp, udp } masquerade to :32768-65535 fully-random";
    assert!(r.contains("hook postrouting priority srcnat") && r.contains(rule), "{r}");
    assert!(r.contains("notrack"), "{r}");
    let frontends = [(hostport(NODE1, 30080), NODE1_BRIDGE), (hostport(LB_IP, 80), NODE1_BRIDGE), (hostport(NODE1_6, 30080), NODE1_BRIDGE6), (hostport(LB_IP6, 80), NODE1_BRIDGE6)];
    for (addr, bridge) in &frontends {
        let s = tcp(&w.c, &w.outside, addr, 10)?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
        assert_eq!(keys(&s), [format!("pod-1 {bridge}").as_str()].into(), "{addr}: pod-1 sees node-1's address: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "replies come from the frontend: {s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", addr, "--count", "10"])?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
        assert_eq!(keys(&s), [format!("pod-1 {bridge}").as_str()].into(), "{addr}: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "{s:?}");
    }
    // `lb-agent nat` says which flows the stack masquerades.
    let flows = flows_from(&w.c, CLIENT)?;
    assert!(flows.iter().any(|l| l.starts_with("ipv4 tcp") && l.contains(&format!("dst={} ", w.p1.ip)) && l.contains("[MASQUERADE]")), "{flows:?}");
    assert!(flows.iter().all(|l| l.contains("[MASQUERADE]")), "{flows:?}");
    // The ports pod-1 sees: 20 connections and 20 datagrams per family,
    // all from the masquerade's range (by chance, below 32768 about half
    // the time each); with --bpf-forward (the XDP pass) lb masquerades in
    // BPF, from its SNAT range: the two never meet.
    let range = if lbtest::bpf_forward_from_env() { 1024..=29999 } else { 32768..=65535 };
    w.c.stop(w.servers[0]);
    let ported = w.c.serve_with(&w.p1, "pod-1", 8080, &["--report-peer", "--report-port"])?;
    for addr in [hostport(NODE1, 30080), hostport(LB_IP6, 80)] {
        let t = tcp(&w.c, &w.outside, &addr, 20)?;
        let u = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "20"])?;
        assert_eq!((t.ok, u.ok), (20, 20), "{addr}: {t:?} {u:?}");
        for (seen, n) in t.replies.iter().chain(u.replies.iter()) {
            let port: u32 = seen.rsplit_once("port=").and_then(|(_, p)| p.parse().ok()).unwrap_or(0);
            assert!(range.contains(&port), "{addr}: {n} x {seen}: outside the masquerade's ports {range:?}");
        }
    }
    w.c.stop(ported);
    w.servers[0] = w.c.serve_reporting_peer(&w.p1, 8080)?;

    // A hostNetwork endpoint on node-1: delivered locally, past the nat
    // postrouting hook (as past kube-proxy's MASQUERADE): it sees the client.
    let host = w.c.host(1);
    w.c.serve_reporting_peer(&host, 8080)?;
    set_endpoints(&w, &[(&host, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &host)?;
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 5)?;
    assert_eq!(keys(&s), [format!("node-1-host {CLIENT}").as_str()].into(), "{s:?}");
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;

    // externalTrafficPolicy Local: the client's address, as kube-proxy keeps it.
    w.c.write_object("svc.yaml", &web("LoadBalancer", "  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n", &[LB_IP, LB_IP6]))?;
    w.c.wait_for("externalTrafficPolicy Local", Duration::from_secs(5), || {
        let l = w.c.list(1)?;
        Ok(l["frontends"].as_array().into_iter().flatten().any(|f| f["address"] == LB_IP && f["flags"].as_array().is_some_and(|a| a.iter().any(|x| x == "etp-local"))))
    })?;
    for (addr, client) in [(hostport(LB_IP, 80), CLIENT), (hostport(LB_IP6, 80), CLIENT6)] {
        let s = tcp(&w.c, &w.outside, &addr, 10)?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
        assert_eq!(keys(&s), [format!("pod-1 {client}").as_str()].into(), "{addr}: {s:?}");
    }
    w.c.write_object("svc.yaml", &web("LoadBalancer", "", &[LB_IP, LB_IP6]))?;
    w.c.wait_for("externalTrafficPolicy Cluster again", Duration::from_secs(5), || {
        let l = w.c.list(1)?;
        Ok(l["frontends"].as_array().into_iter().flatten().any(|f| f["address"] == LB_IP && f["flags"].as_array().is_some_and(|a| !a.iter().any(|x| x == "etp-local"))))
    })?;

    // An agent restart (an upgrade) leaves masqueraded connections alone,
    // also where it rewrites the table (another SNAT range: the
    // masquerade's ports move to 1024-29999).
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1_6, 30080), "--hold-ms", "3000", "--interval-ms", "50"])?;
    std::thread::sleep(Duration::from_millis(500));
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--snat-ports", "40000-60000"])?;
    w.c.wait_for("the masquerade's ports moved", Duration::from_secs(10), || Ok(rules(&w).contains("masquerade to :1024-29999 fully-random")))?;
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the held connection across a restart: {s:?}");
    assert_eq!(keys(&s), [format!("pod-1 {NODE1_BRIDGE6}").as_str()].into(), "{s:?}");

    // --local-masquerade none: the masquerade rule goes, local backends
    // see the client. A connection made before the restart keeps going,
    // still masqueraded (conntrack keeps its binding).
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--hold-ms", "4000", "--interval-ms", "50"])?;
    std::thread::sleep(Duration::from_millis(500));
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--local-masquerade", "none"])?;
    w.c.wait_for("the masquerade rule gone", Duration::from_secs(10), || Ok(!rules(&w).contains("fully-random")))?;
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the held connection across the restart: {s:?}");
    assert_eq!(keys(&s), [format!("pod-1 {NODE1_BRIDGE}").as_str()].into(), "{s:?}");
    let r = rules(&w);
    assert!(r.contains("notrack"), "conntrack still runs: the notrack rule stays: {r}");
    // Without a nat chain the kernel would stop translating the
    // connections masqueraded before, and without a masquerade rule it
    // would delete them: the chain stays, with a rule that matches nothing.
    assert!(r.contains("type nat hook postrouting") && r.contains("meta nfproto ipv4 meta nfproto ipv6 masquerade"), "{r}");
    for (addr, client) in [(hostport(NODE1, 30080), CLIENT), (hostport(LB_IP6, 80), CLIENT6)] {
        let s = tcp(&w.c, &w.outside, &addr, 10)?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
        assert_eq!(keys(&s), [format!("pod-1 {client}").as_str()].into(), "{addr}: pod-1 sees the client: {s:?}");
    }
    Ok(())
}

/// One client port sending to two frontends of a Service whose backend is
/// on the node (a client behind a NAT that keeps its ports, one socket
/// to the NodePort and the LB IP): kube-proxy's DNAT makes both flows one
/// tuple to the backend, and conntrack gives the second a port of its own
/// at POSTROUTING (its MASQUERADE; with externalTrafficPolicy Local the
/// null binding it gives a flow no rule NATs), so both are served. lb
/// DNATs before conntrack sees the flow: without moving the second flow's
/// client port itself, it dropped the second flow while the first lived
/// (found as one lost datagram in ten when the kernel happened to pick one
/// port twice).
#[test]
fn one_client_port_reaches_a_local_backend_through_two_frontends() -> Result<()> {
    let w = world(&web("LoadBalancer", "", &[LB_IP, LB_IP6]))?;
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p1)?;
    two_frontends_from_one_port(&w, true, ["41001", "41002"])?;
    // externalTrafficPolicy Local: no masquerade, and under kube-proxy
    // conntrack's null binding moves the second flow's port: so does lb.
    w.c.write_object("svc.yaml", &web("LoadBalancer", "  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n", &[LB_IP, LB_IP6]))?;
    w.c.wait_for("externalTrafficPolicy Local", Duration::from_secs(5), || {
        let l = w.c.list(1)?;
        Ok(l["frontends"].as_array().into_iter().flatten().any(|f| f["address"] == LB_IP && f["flags"].as_array().is_some_and(|a| a.iter().any(|x| x == "etp-local"))))
    })?;
    two_frontends_from_one_port(&w, false, ["41003", "41004"])
}

/// From one client port (per family), to node-1's NodePort and to the LB
/// IP, both reaching pod-1 on node-1: a TCP connection held to the first
/// while one goes to the second, then UDP to each.
fn two_frontends_from_one_port(w: &World, masquerade: bool, sports: [&str; 2]) -> Result<()> {
    let families = [(NODE1, LB_IP, NODE1_BRIDGE, CLIENT, &w.p1.ip), (NODE1_6, LB_IP6, NODE1_BRIDGE6, CLIENT6, &w.p1.ip6)];
    for ((node, lb_ip, bridge, client, pod), sport) in families.into_iter().zip(sports) {
        let (first, second) = (hostport(node, 30080), hostport(lb_ip, 80));
        // The address pod-1 sees: the node's, or the client's.
        let seen = format!("pod-1 {}", if masquerade { bridge } else { client });
        // TCP: a connection held from the port while a second one from
        // it goes to the other frontend.
        let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &first, "--sport", sport, "--hold-ms", "2500", "--interval-ms", "50"])?;
        std::thread::sleep(Duration::from_millis(500));
        let s = w.c.probe(&w.outside, &["tcp", "--addr", &second, "--sport", sport, "--count", "1", "--timeout-ms", "1500"])?;
        assert_eq!(s.ok, 1, "{second} from port {sport} while a connection from it to {first} lives: {s:?}");
        assert_eq!(keys(&s), [seen.as_str()].into(), "{s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [second.as_str()], "the reply comes from the frontend, to the client's port: {s:?}");
        let h = Cluster::finish(held)?;
        assert_eq!(h.failed(), 0, "the first connection: {h:?}");
        assert_eq!(keys(&h), [seen.as_str()].into(), "{h:?}");
        assert_eq!(h.peers.keys().collect::<Vec<_>>(), [first.as_str()], "{h:?}");
        // UDP: a datagram to each frontend from the port, both answered
        // from the frontend each went to.
        for addr in [&first, &second, &first] {
            let s = w.c.probe(&w.outside, &["udp", "--addr", addr, "--sport", sport, "--count", "1", "--timeout-ms", "1500"])?;
            assert_eq!(s.ok, 1, "UDP to {addr} from port {sport}: {s:?}");
            assert_eq!(keys(&s), [seen.as_str()].into(), "{s:?}");
            assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "{s:?}");
        }
        // `lb-agent nat` shows the second flow's client port moved.
        let flows = flows_from(&w.c, client)?;
        let udp: Vec<_> = flows.iter().filter(|l| l.contains(" udp ") && l.contains(&format!("sport={sport} "))).collect();
        assert_eq!(udp.len(), 2, "{flows:?}");
        if masquerade && lbtest::bpf_forward_from_env() {
            // Masqueraded in BPF: both to the bridge's address, each with
            // a port of its own.
            let ports: std::collections::BTreeSet<_> = udp.iter().filter_map(|l| l.split(&format!("-> src={bridge} dst={pod} sport=")).nth(1)?.split(' ').next()).collect();
            assert_eq!(ports.len(), 2, "{udp:?}");
        } else {
            assert_eq!(udp.iter().filter(|l| l.contains(&format!("-> src={client} dst={pod} sport={sport} "))).count(), 1, "one keeps its port: {udp:?}");
        }
        assert!(udp.iter().all(|l| l.contains("[MASQUERADE]") == masquerade), "{udp:?}");
    }
    Ok(())
}

/// An upgrade from an agent that never masqueraded (an lb from before
/// `--local-masquerade`: here `none`, on a node where conntrack held
/// nothing, so no table at all) to one that does: its nat chain makes
/// conntrack start on the node in the middle of live flows. A connection
/// held to the local backend (not masqueraded when it began) keeps going
/// and keeps its client address; one held to a backend on node-2
/// (SNATed in BPF, then exempted from conntrack) keeps going; new flows
/// to the local backend are masqueraded.
#[test]
fn upgrading_to_the_masquerade_keeps_the_connections_made_before_it() -> Result<()> {
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--local-masquerade", "none"])?;
    // IPv4 to the local pod-1, IPv6 to pod-2 on node-2.
    let slice = |family: &str, name: &str, ep: E| lbtest::objects::slice_of("web", name, family, EP, &[ep]);
    w.c.write_object("slice4.yaml", &slice("IPv4", "web-v4", E::ready(&w.p1.ip, "node-1")))?;
    w.c.write_object("slice6.yaml", &slice("IPv6", "web-v6", E::ready(&w.p2.ip6, "node-2")))?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    let n1 = w.c.nodes[0].netns.clone();
    let tables = |w: &World| w.c.in_netns(&n1, &["nft", "list", "tables"]).unwrap_or_default();
    assert!(!tables(&w).contains("inet lb"), "no masquerade, conntrack idle: no table: {}", tables(&w));
    let local = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--hold-ms", "4000", "--interval-ms", "50"])?;
    let remote = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1_6, 30080), "--hold-ms", "4000", "--interval-ms", "50"])?;
    std::thread::sleep(Duration::from_millis(700));
    w.c.kill_agent(1);
    w.c.start_agent(1)?;
    w.c.wait_for("the masquerade rule", Duration::from_secs(5), || {
        Ok(w.c.in_netns(&n1, &["nft", "list", "table", "inet", "lb"]).unwrap_or_default().contains("fully-random"))
    })?;
    let s = Cluster::finish(local)?;
    assert_eq!(s.failed(), 0, "the connection to the local backend across the upgrade: {s:?}");
    assert!(s.ok >= 40, "it went on exchanging: {s:?}");
    assert_eq!(keys(&s), [format!("pod-1 {CLIENT}").as_str()].into(), "made before the masquerade, it keeps the client's address: {s:?}");
    let s = Cluster::finish(remote)?;
    assert_eq!(s.failed(), 0, "the SNATed connection across the upgrade: {s:?}");
    assert!(s.ok >= 40, "it went on exchanging: {s:?}");
    assert_eq!(keys(&s), [format!("pod-2 {NODE1_6}").as_str()].into(), "{s:?}");
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    assert_eq!(keys(&s), [format!("pod-1 {NODE1_BRIDGE}").as_str()].into(), "new flows are masqueraded: {s:?}");
    let s = tcp(&w.c, &w.outside, &hostport(NODE1_6, 30080), 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    assert_eq!(keys(&s), [format!("pod-2 {NODE1_6}").as_str()].into(), "{s:?}");
    Ok(())
}

/// conntrack runs on node-1 with the common rule against INVALID packets
/// (`-t mangle -A PREROUTING -m conntrack --ctstate INVALID -j DROP`;
/// IPv4 in iptables-nft, IPv6 in iptables-legacy). conntrack would see
/// only half of a SNATed flow in each tuple (lb translates its replies
/// first) and call the handshake INVALID: kube-proxy's flows pass such a
/// rule, and lb's must too. The agent's `inet lb` table exempts SNATed
/// flows from conntrack (they then take no entries), flows to the local
/// pod stay tracked; `--notrack none` and teardown remove the table.
#[test]
fn snated_flows_skip_conntrack_where_it_runs_so_invalid_drops_pass_them() -> Result<()> {
    // The period at an hour: the table comes when conntrack starts to hold
    // entries, not at the next look. No masquerade rule, which would make
    // conntrack run (and bring the table) at once.
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--forward-accept-period", "3600s", "--local-masquerade", "none"])?;
    let n1 = w.c.nodes[0].netns.clone();
    for tool in ["iptables-nft", "ip6tables-legacy"] {
        w.c.in_netns(&n1, &[tool, "-w", "-t", "mangle", "-A", "PREROUTING", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"])?;
    }
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    let table = |w: &World| -> Result<bool> { Ok(w.c.in_netns(&n1, &["nft", "list", "tables"])?.lines().any(|l| l.trim() == "table inet lb")) };
    // conntrack holds entries once packets pass it: a datagram to a port
    // of node-1's own (local delivery; nothing listens there).
    // The agent's look at the rules' nftables change is over (conntrack
    // held nothing then): what comes next is conntrack's first entry.
    std::thread::sleep(Duration::from_millis(500));
    assert!(!table(&w)?, "conntrack holds nothing yet: no table");
    w.c.probe(&w.outside, &["udp", "--addr", &hostport(NODE1, 1), "--count", "1", "--timeout-ms", "300"])?;
    w.c.wait_for("table inet lb", Duration::from_secs(5), || table(&w))?;
    let rules = w.c.in_netns(&n1, &["nft", "list", "table", "inet", "lb"])?;
    assert!(rules.contains("hook prerouting priority raw") && rules.contains("notrack"), "{rules}");
    // Said once the table is written (the table can be seen first).
    let log = w.c.agent_log(1);
    w.c.wait_for("the agent saying so", Duration::from_secs(5), || Ok(std::fs::read_to_string(&log)?.contains("lb's SNATed and DSR flows skip it")))?;
    let count = |w: &World| -> Result<u64> { Ok(w.c.in_netns(&n1, &["cat", "/proc/sys/net/netfilter/nf_conntrack_count"])?.trim().parse()?) };
    let before = count(&w)?;
    for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080), hostport(LB_IP, 80), hostport(LB_IP6, 80)] {
        let s = tcp(&w.c, &w.outside, &addr, 10)?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "10"])?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
    }
    // 80 SNATed flows, none of them in conntrack.
    let after = count(&w)?;
    assert!(after <= before + 5, "conntrack entries: {before} -> {after}");
    // The local pod-1: tracked, its replies are conntrack's replies.
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p1)?;
    let before = count(&w)?;
    for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080)] {
        let s = tcp(&w.c, &w.outside, &addr, 10)?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
    }
    let forwarding = !lbtest::bpf_forward_from_env();
    if forwarding {
        let after = count(&w)?;
        assert!(after >= before + 20, "flows to a local pod are tracked: {before} -> {after}");
    }

    // --notrack none: the table goes, and the SNATed handshakes are
    // dropped as INVALID (where the stack forwards them).
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--notrack", "none", "--local-masquerade", "none"])?;
    w.c.wait_for("table inet lb gone", Duration::from_secs(10), || Ok(!table(&w)?))?;
    if forwarding {
        let s = w.c.probe(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--count", "2", "--timeout-ms", "500"])?;
        assert_eq!(s.ok, 0, "INVALID handshakes dropped: {s:?}");
    }
    // Back, then teardown removes it.
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--forward-accept-period", "1s"])?;
    w.c.wait_for("table inet lb again", Duration::from_secs(10), || table(&w))?;
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 5)?;
    assert_eq!(s.ok, 5, "{s:?}");
    // A teardown of a directory nothing is pinned under (a typo) removes
    // nothing, not the running agent's netfilter rules either.
    let typo = format!("{}-typo", w.c.nodes[0].bpffs.display());
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{n1}"))
        .arg("--")
        .arg(lbtest::bin("lb-agent"))
        .args(["teardown", "--bpffs", &typo])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains(&format!("nothing is pinned under {typo}: nothing removed")), "{err}");
    assert!(table(&w)?, "the running agent's table stays");
    w.c.kill_agent(1);
    lbtest::teardown_in(&n1, &w.c.nodes[0].bpffs)?;
    assert!(!table(&w)?, "teardown removes table inet lb");
    Ok(())
}

/// `--per-packet-lb`: a pod whose packets no socket hook sees (a VM's or
/// a sandbox's own kernel sends them: KubeVirt, Kata, gVisor; here a
/// client outside the node's cgroup, in the pod's netns) reaches Service
/// addresses as kube-proxy's PREROUTING rules serve them: translated at
/// the pod's device, its own address kept (backends see the pod), its
/// replies translated on their way back in (its kernel would drop them
/// otherwise), REJECTed without endpoints, and a pod that reaches itself
/// through a Service is seen from the node's address (kube-proxy's
/// hairpin masquerade), and loadBalancerSourceRanges apply to it as
/// kube-proxy applies them to pods. One port of it reaches one backend
/// through two Service addresses (the second flow's port moves). Pods the socket hooks serve make no
/// flow. Without the flag such a pod reaches nothing.
#[test]
fn pods_the_socket_hooks_cannot_see_reach_services_per_packet() -> Result<()> {
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP6]), &["--per-packet-lb"])?;
    wait_backends(&w.c, 1, "10.96.0.10", 80, 2)?;
    let vm = w.c.add_pod(1, "vm")?;
    // Its processes run outside the node's cgroup: no socket hook.
    let guest = lbtest::Pod { cgroup: Default::default(), ..vm.clone() };
    let vip = "10.96.0.10:80";
    let lb6 = hostport(LB_IP6, 80);
    // The new pod's device gets the programs when it comes up.
    w.c.wait_for("the pod programs on the new pod's device", Duration::from_secs(5), || Ok(tcp(&w.c, &guest, vip, 1)?.ok == 1))?;
    let s = tcp(&w.c, &guest, vip, 30)?;
    assert_eq!(s.ok, 30, "{s:?}");
    let seen = |name: &str, ip: &str| format!("{name} {ip}");
    assert_eq!(keys(&s), [seen("pod-1", &vm.ip).as_str(), seen("pod-2", &vm.ip).as_str()].into(), "both backends see the pod: {s:?}");
    let s = w.c.probe(&guest, &["udp", "--addr", vip, "--count", "10"])?;
    assert_eq!(s.ok, 10, "{s:?}");
    let s = tcp(&w.c, &guest, &lb6, 20)?;
    assert_eq!(s.ok, 20, "{s:?}");
    assert_eq!(keys(&s), [seen("pod-1", &vm.ip6).as_str(), seen("pod-2", &vm.ip6).as_str()].into(), "{s:?}");
    let s = w.c.probe(&guest, &["udp", "--addr", &lb6, "--count", "10"])?;
    assert_eq!(s.ok, 10, "{s:?}");
    assert!(flows_from(&w.c, &vm.ip)?.iter().any(|l| l.contains("dst=10.96.0.10 ")), "{:?}", flows_from(&w.c, &vm.ip)?);
    // A guest claiming node-1's address makes no flow: dropped, as the
    // stack drops it on the pod's device (with --bpf-forward lb's redirect
    // would skip that check).
    {
        use lbtest::raw::{ether, ipv4, mac, send, tcp_syn};
        let (to, from) = (mac(&w.c, &w.c.nodes[0].netns, "cni0")?, mac(&w.c, &vm.netns, "eth0")?);
        let (src, dst): (std::net::Ipv4Addr, std::net::Ipv4Addr) = (NODE1.parse()?, "10.96.0.10".parse()?);
        let syn = ether(to, from, 0x0800, &ipv4(src.octets(), dst.octets(), 6, 5, 0, 1, &tcp_syn(&src.octets(), &dst.octets(), 45000, 80)));
        let (made, dropped) = (datapath(&w.c, 1, "nat_new")?, datapath(&w.c, 1, "nat_dropped")?);
        send(&vm.netns, "eth0", vec![syn])?;
        w.c.wait_for("the guest's SYN from node-1's address dropped", Duration::from_secs(3), || Ok(datapath(&w.c, 1, "nat_dropped")? == dropped + 1))?;
        assert_eq!(datapath(&w.c, 1, "nat_new")?, made, "no flow");
    }
    // loadBalancerSourceRanges that leave pods out: the pod's packets to
    // the LB IP are dropped, as kube-proxy's firewall chain drops them.
    let ranges = format!("  loadBalancerSourceRanges: [\"{CLIENT6}/128\", \"{CLIENT}/32\"]\n");
    w.c.write_object("svc.yaml", &web("LoadBalancer", &ranges, &[LB_IP6]))?;
    let ranged = |on: bool| -> Result<bool> {
        let l = w.c.list(1)?;
        Ok(l["frontends"].as_array().into_iter().flatten().any(|f| {
            f["address"] == LB_IP6 && f["flags"].as_array().is_some_and(|a| a.iter().any(|x| x == "source-ranges")) == on
        }))
    };
    w.c.wait_for("the source ranges", Duration::from_secs(5), || ranged(true))?;
    let s = w.c.probe(&guest, &["tcp", "--addr", &lb6, "--count", "3", "--timeout-ms", "500"])?;
    assert_eq!(s.ok, 0, "{s:?}");
    assert_eq!(tcp(&w.c, &guest, vip, 3)?.ok, 3);
    w.c.write_object("svc.yaml", &web("LoadBalancer", "", &[LB_IP6, LB_IP]))?;
    w.c.wait_for("no source ranges", Duration::from_secs(5), || ranged(false))?;
    // While no agent runs (a restart, an upgrade), the programs and the
    // maps stay: the pod's flows and new ones go on.
    w.c.kill_agent(1);
    let s = tcp(&w.c, &guest, vip, 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    w.c.start_agent_with(1, &["--per-packet-lb"])?;
    wait_backends(&w.c, 1, "10.96.0.10", 80, 2)?;
    // A pod the socket hooks serve: translated at connect, no flow.
    let s = tcp(&w.c, &w.p1, vip, 5)?;
    assert_eq!(s.ok, 5, "{s:?}");
    assert_eq!(flows_from(&w.c, &w.p1.ip)?, Vec::<String>::new());
    // pod-2 alone, its server gone: its kernel's port unreachable about
    // the datagram reaches the pod translated, from the Service address.
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, "10.96.0.10", 80, &w.p2)?;
    wait_only(&w.c, LB_IP6, 80, &w.p2)?;
    // One port of the pod to two Service addresses with one backend: the
    // second flow's port moves (as conntrack's null binding moves it under
    // kube-proxy); both are answered, from the address each went to.
    wait_only(&w.c, LB_IP, 80, &w.p2)?;
    let lb4 = hostport(LB_IP, 80);
    for addr in [vip, lb4.as_str(), vip] {
        let s = w.c.probe(&guest, &["udp", "--addr", addr, "--sport", "20001", "--count", "1", "--timeout-ms", "1500"])?;
        assert_eq!((s.ok, keys(&s)), (1, [seen("pod-2", &vm.ip).as_str()].into()), "{addr} from port 20001: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr], "{s:?}");
    }
    let udp: Vec<_> = flows_from(&w.c, &vm.ip)?.into_iter().filter(|l| l.contains(" udp ") && l.contains("sport=20001 ")).collect();
    assert_eq!(udp.len(), 2, "{udp:?}");
    assert_eq!(udp.iter().filter(|l| l.contains(&format!("-> src={} dst={} sport=20001 ", vm.ip, w.p2.ip))).count(), 1, "one keeps its port: {udp:?}");
    w.c.stop(w.servers[1]);
    w.c.in_netns(&w.p2.netns, &["sysctl", "-qw", "net.ipv4.icmp_ratelimit=0", "net.ipv6.icmp.ratelimit=0"])?;
    for (addr, front, unreachable) in [(vip.to_string(), "10.96.0.10", "icmp type=3 code=3"), (lb6.clone(), LB_IP6, "icmp6 type=1 code=4")] {
        let s = w.c.probe(&guest, &["udp", "--addr", &addr, "--count", "2", "--connected", "--recverr", "--timeout-ms", "2000"])?;
        assert_eq!(s.errors.get("ECONNREFUSED"), Some(&2), "{s:?}");
        let from = format!("{unreachable} from={front}");
        assert!(s.offenders.keys().all(|k| *k == from) && !s.offenders.is_empty(), "{from}: {s:?}");
    }
    // The pod is the only endpoint: it reaches itself, from node-1.
    w.c.serve_reporting_peer(&vm, 8080)?;
    set_endpoints(&w, &[(&vm, E::ready)])?;
    // By address: pod-2 alone was one backend too (its server stopped),
    // and the IPv6 slice can land a sync after the IPv4 one.
    wait_only(&w.c, "10.96.0.10", 80, &vm)?;
    wait_only(&w.c, LB_IP6, 80, &vm)?;
    let s = tcp(&w.c, &guest, vip, 10)?;
    assert_eq!((s.ok, keys(&s)), (10, [seen("vm", NODE1).as_str()].into()), "{s:?}");
    let s = tcp(&w.c, &guest, &lb6, 10)?;
    assert_eq!((s.ok, keys(&s)), (10, [seen("vm", NODE1_6).as_str()].into()), "{s:?}");
    let s = w.c.probe(&guest, &["udp", "--addr", vip, "--count", "10"])?;
    assert_eq!(s.ok, 10, "{s:?}");
    // No endpoints: refused at once, as kube-proxy's REJECT.
    set_endpoints(&w, &[])?;
    wait_backends(&w.c, 1, "10.96.0.10", 80, 0)?;
    let s = tcp(&w.c, &guest, vip, 3)?;
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&3), "{s:?}");
    // Without the flag: nothing translates the pod's packets.
    set_endpoints(&w, &[(&w.p1, E::ready), (&w.p2, E::ready)])?;
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &[])?;
    wait_backends(&w.c, 1, "10.96.0.10", 80, 2)?;
    let s = w.c.probe(&guest, &["tcp", "--addr", vip, "--count", "3", "--timeout-ms", "500"])?;
    assert_eq!(s.ok, 0, "{s:?}");
    Ok(())
}

/// A frame for another host's MAC (a switch flooding an unknown unicast,
/// a device in promiscuous mode), or for a broadcast or multicast MAC, is
/// not the node's to forward: the stack drops it (ip_rcv, ip_forward), so
/// kube-proxy never translates it. Here the outside client's neighbour
/// entries for node-1 name such a MAC, so the fabric's bridge floods its
/// frames to every node: neither translates them (no flow on either,
/// `nat_new` unchanged) and nothing is answered, as under kube-proxy;
/// with the right MAC again they are served.
#[test]
fn a_frame_for_another_hosts_mac_is_left_to_the_stack_as_kube_proxy_leaves_it() -> Result<()> {
    let w = world(&web("LoadBalancer", "", &[LB_IP, LB_IP6]))?;
    wait_backends(&w.c, 1, LB_IP, 80, 2)?;
    wait_backends(&w.c, 2, LB_IP, 80, 2)?;
    let addrs = [hostport(LB_IP, 80), hostport(LB_IP6, 80), hostport(NODE1, 30080), hostport(NODE1_6, 30080)];
    for addr in &addrs {
        let s = tcp(&w.c, &w.outside, addr, 2)?;
        assert_eq!(s.ok, 2, "{addr}: {s:?}");
    }
    let new = |node| datapath(&w.c, node, "nat_new");
    let before = (new(1)?, new(2)?);
    // Another host's, broadcast, multicast (IPv4's and IPv6's).
    for (mac4, mac6) in [("02:00:00:00:00:99", "02:00:00:00:00:99"), ("ff:ff:ff:ff:ff:ff", "ff:ff:ff:ff:ff:ff"), ("01:00:5e:00:00:01", "33:33:00:00:00:01")] {
        for (node, mac) in [(NODE1, mac4), (NODE1_6, mac6)] {
            w.c.in_netns(&w.outside.netns, &["ip", "neigh", "replace", node, "lladdr", mac, "dev", "eth0", "nud", "permanent"])?;
        }
        for addr in &addrs {
            let s = tcp(&w.c, &w.outside, addr, 1)?;
            assert_eq!(s.ok, 0, "{mac4}, {addr}: {s:?}");
            let s = w.c.probe(&w.outside, &["udp", "--addr", addr, "--count", "1", "--timeout-ms", "300"])?;
            assert_eq!(s.ok, 0, "{mac4}, {addr}: {s:?}");
        }
        assert_eq!((new(1)?, new(2)?), before, "{mac4}: no node made a flow of these frames");
    }
    for node in [NODE1, NODE1_6] {
        w.c.in_netns(&w.outside.netns, &["ip", "neigh", "del", node, "dev", "eth0"])?;
    }
    for addr in &addrs {
        let s = tcp(&w.c, &w.outside, addr, 2)?;
        assert_eq!(s.ok, 2, "{addr} with the right MAC: {s:?}");
    }
    Ok(())
}

/// A frame of a VLAN (802.1Q, id 100) on node-1's eth0, which has no VLAN
/// device for it: the kernel takes the tag off before TC, then drops the
/// frame as another host's. lb's program on eth0 leaves it, makes no flow
/// of it: a VLAN's traffic is its VLAN device's to translate (lb attaches
/// there; from eth0 a `--bpf-forward` redirect sent it on with the VLAN's
/// tag). A priority-tagged frame (VLAN 0) and an untagged one are eth0's
/// and make flows. (This kernel has no 802.1Q devices: the frames are
/// sent raw.)
#[test]
fn a_frame_of_a_vlan_is_left_to_the_vlan_device() -> Result<()> {
    use lbtest::raw::{ether, ipv4, mac, send, tcp_syn};
    let w = world(&web("LoadBalancer", "", &[LB_IP]))?;
    wait_backends(&w.c, 1, LB_IP, 80, 2)?;
    let (src, dst): (std::net::Ipv4Addr, std::net::Ipv4Addr) = (CLIENT.parse()?, LB_IP.parse()?);
    let packet = |sport| ipv4(src.octets(), dst.octets(), 6, 5, 0, 1, &tcp_syn(&src.octets(), &dst.octets(), sport, 80));
    let (to, from) = (mac(&w.c, &w.c.nodes[0].netns, "eth0")?, mac(&w.c, &w.outside.netns, "eth0")?);
    let tagged = |sport, vid: u16| {
        let mut p = vid.to_be_bytes().to_vec();
        p.extend(0x0800u16.to_be_bytes());
        p.extend(packet(sport));
        ether(to, from, 0x8100, &p)
    };
    let new = || datapath(&w.c, 1, "nat_new");
    let before = new()?;
    send(&w.outside.netns, "eth0", vec![tagged(40001, 100)])?;
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(new()?, before, "no flow of VLAN 100's frame on eth0");
    send(&w.outside.netns, "eth0", vec![tagged(40002, 0)])?;
    w.c.wait_for("a flow of the priority-tagged frame", Duration::from_secs(3), || Ok(new()? == before + 1))?;
    send(&w.outside.netns, "eth0", vec![ether(to, from, 0x0800, &packet(40003))])?;
    w.c.wait_for("a flow of the untagged frame", Duration::from_secs(3), || Ok(new()? == before + 2))?;
    Ok(())
}

/// Packets from sources the stack never forwards from (loopback,
/// unspecified, multicast, the limited broadcast; IPv6 link-local and
/// IPv4-mapped)
/// make no flow: kube-proxy's DNATed packet meets the route lookup's
/// martian check, and the stack drops these. One from any of node-1's
/// own IPv4 addresses (its SNAT address, its pod bridge's, 127.0.0.1,
/// one added to a device while the agent runs; not once it is removed)
/// or its SNAT address of IPv6 is dropped and counted (`nat_dropped`):
/// lb sets accept_local on its devices for its SNATed packets, so the
/// stack would take it. A
/// SYN from the client makes a flow, and one from class E (240/4).
/// `--nodeport-interface lo` is refused.
#[test]
fn packets_from_martian_sources_make_no_flow() -> Result<()> {
    use lbtest::raw::{ether, ipv4, ipv6, mac, send, tcp_syn};
    let mut w = world(&web("LoadBalancer", "", &[LB_IP, LB_IP6]))?;
    wait_backends(&w.c, 1, LB_IP, 80, 2)?;
    let (to, from) = (mac(&w.c, &w.c.nodes[0].netns, "eth0")?, mac(&w.c, &w.outside.netns, "eth0")?);
    let syn4 = |src: &str, sport| -> Result<Vec<u8>> {
        let (s, d): (std::net::Ipv4Addr, std::net::Ipv4Addr) = (src.parse()?, LB_IP.parse()?);
        Ok(ether(to, from, 0x0800, &ipv4(s.octets(), d.octets(), 6, 5, 0, 1, &tcp_syn(&s.octets(), &d.octets(), sport, 80))))
    };
    let syn6 = |src: &str, sport| -> Result<Vec<u8>> {
        let (s, d): (std::net::Ipv6Addr, std::net::Ipv6Addr) = (src.parse()?, LB_IP6.parse()?);
        Ok(ether(to, from, 0x86dd, &ipv6(s.octets(), d.octets(), 6, &tcp_syn(&s.octets(), &d.octets(), sport, 80))))
    };
    let new = || datapath(&w.c, 1, "nat_new");
    let (before, dropped) = (new()?, datapath(&w.c, 1, "nat_dropped")?);
    let mut frames = Vec::new();
    for (i, src) in ["127.0.0.1", "0.0.0.1", "224.0.0.9", "255.255.255.255", NODE1, NODE1_BRIDGE].into_iter().enumerate() {
        frames.push(syn4(src, 41000 + i as u16)?);
    }
    for (i, src) in ["::1", "::", "ff02::1", "fe80::1", "::ffff:1.2.3.4", NODE1_6].into_iter().enumerate() {
        frames.push(syn6(src, 42000 + i as u16)?);
    }
    send(&w.outside.netns, "eth0", frames)?;
    w.c.wait_for("node-1's own addresses dropped", Duration::from_secs(3), || Ok(datapath(&w.c, 1, "nat_dropped")? - dropped >= 4))?;
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(new()?, before, "no flow from a martian source");
    assert_eq!(datapath(&w.c, 1, "nat_dropped")? - dropped, 4, "node-1's own addresses, dropped");
    // An address node-1 takes while the agent runs (on a device lb's
    // programs are not on) is refused too, once the agent has seen it.
    const ADDED: &str = "10.99.0.1";
    let pin = w.c.nodes[0].bpffs.join("LB_LOCAL4");
    let local4 = || -> Result<Vec<serde_json::Value>> {
        let out = lbtest::run("bpftool", &["-j", "map", "dump", "pinned", pin.to_str().unwrap_or_default()])?;
        Ok(serde_json::from_str(&out)?)
    };
    let has = |addr: &str| -> Result<bool> {
        let want: Vec<String> = addr.parse::<std::net::Ipv4Addr>()?.octets().iter().map(|b| format!("0x{b:02x}")).collect();
        Ok(local4()?.iter().any(|e| e["key"] == serde_json::json!(want)))
    };
    let held = || has(ADDED);
    w.c.in_netns(&w.c.nodes[0].netns, &["ip", "addr", "add", &format!("{ADDED}/32"), "dev", "lo"])?;
    w.c.wait_for("node-1's new address in LB_LOCAL4", Duration::from_secs(5), &held)?;
    send(&w.outside.netns, "eth0", vec![syn4(ADDED, 44000)?])?;
    w.c.wait_for("a SYN from node-1's new address dropped", Duration::from_secs(3), || Ok(datapath(&w.c, 1, "nat_dropped")? - dropped == 5))?;
    assert_eq!(new()?, before, "no flow from node-1's new address");
    // Once node-1 gives it up, the address is another host's again.
    w.c.in_netns(&w.c.nodes[0].netns, &["ip", "addr", "del", &format!("{ADDED}/32"), "dev", "lo"])?;
    w.c.wait_for("the address gone from LB_LOCAL4", Duration::from_secs(5), || Ok(!held()?))?;
    send(&w.outside.netns, "eth0", vec![syn4(ADDED, 44001)?])?;
    w.c.wait_for("a flow of the address node-1 gave up", Duration::from_secs(3), || Ok(new()? == before + 1))?;
    let before = before + 1;
    // The client, and class E (240/4), which Linux routes.
    send(&w.outside.netns, "eth0", vec![syn4(CLIENT, 43000)?, syn6(CLIENT6, 43001)?, syn4("240.0.0.1", 43002)?])?;
    w.c.wait_for("the client's flows", Duration::from_secs(3), || Ok(new()? == before + 3))?;
    // The loopback device carries the node's packets to itself, all from
    // its own addresses: lb's programs never go there, and naming it is
    // an error that says so.
    w.c.kill_agent(1);
    let err = w.c.start_agent_with(1, &["--nodeport-interface", "lo"]).err().map(|e| format!("{e:#}")).unwrap_or_default();
    assert!(err.contains("--nodeport-interface lo: the loopback device gets no NodePort programs"), "{err}");
    // An agent whose Kubernetes source has not answered yet (its API
    // server down) already refuses the node's addresses: a VIP that moved
    // away meanwhile is not refused either.
    let dead = w.c.objects.parent().context("cluster directory")?.join("dead-kubeconfig");
    std::fs::write(
        &dead,
        "apiVersion: v1\nkind: Config\ncurrent-context: dead\nclusters: [{name: dead, cluster: {server: 'http://127.0.0.1:9'}}]\n\
         contexts: [{name: dead, context: {cluster: dead, user: u}}]\nusers: [{name: u, user: {}}]\n",
    )?;
    w.c.in_netns(&w.c.nodes[0].netns, &["ip", "addr", "add", &format!("{ADDED}/32"), "dev", "lo"])?;
    w.c.start_agent_kube_unsynced(1, &dead, &[], &[])?;
    w.c.wait_for("LB_LOCAL4 without a snapshot", Duration::from_secs(5), || Ok(has(ADDED)? && has(NODE1_BRIDGE)?))?;
    w.c.kill_agent(1);
    w.c.in_netns(&w.c.nodes[0].netns, &["ip", "addr", "del", &format!("{ADDED}/32"), "dev", "lo"])?;
    // Where the node's admin lets every device take packets from the
    // node's own addresses, lb does too (but for 127/8 and its SNAT
    // addresses): LB_LOCAL4 is empty.
    w.c.in_netns(&w.c.nodes[0].netns, &["sysctl", "-qw", "net.ipv4.conf.all.accept_local=1"])?;
    let started = w.c.start_agent_with(1, &[]);
    let empty = started.and_then(|()| Ok(local4()?.is_empty()));
    w.c.in_netns(&w.c.nodes[0].netns, &["sysctl", "-qw", "net.ipv4.conf.all.accept_local=0"])?;
    assert!(empty?, "LB_LOCAL4 empty where all/accept_local is 1");
    Ok(())
}

/// The ICMP port unreachables answering a Service without endpoints are
/// limited as the kernel limits its own (its defaults: 1,000 a second,
/// bursts of 50; per CPU): a burst of 300 datagrams, which spoofed
/// sources would have reflected one for one, gets about 50 answers, the
/// rest counted as `icmp_limited`. A moment later the next datagram is
/// refused again. (TCP gets RSTs, which the kernel does not limit either.)
#[test]
fn icmp_errors_are_rate_limited_as_the_kernels_are() -> Result<()> {
    use lbtest::raw::{capture_frames, ether, ipv4, mac, send, udp_datagram};
    let w = world(&web("NodePort", "", &[]))?;
    set_endpoints(&w, &[])?;
    w.c.wait_for("no backends", Duration::from_secs(5), || Ok(w.c.programmed(1, NODE1, 30080, "UDP")?.is_some_and(|b| b.is_empty())))?;
    let (to, from) = (mac(&w.c, &w.c.nodes[0].netns, "eth0")?, mac(&w.c, &w.outside.netns, "eth0")?);
    let (src, dst): (std::net::Ipv4Addr, std::net::Ipv4Addr) = (CLIENT.parse()?, NODE1.parse()?);
    let frames: Vec<Vec<u8>> = (0..300u16)
        .map(|i| ether(to, from, 0x0800, &ipv4(src.octets(), dst.octets(), 17, 5, 0, i, &udp_datagram(&src.octets(), &dst.octets(), 50000 + i, 30080, b"hi"))))
        .collect();
    let limited = datapath(&w.c, 1, "icmp_limited")?;
    let unreachable = |f: &[u8]| f.len() > 35 && f[12..14] == [0x08, 0x00] && f[23] == 1 && f[34] == 3 && f[35] == 3;
    let (_, got) = capture_frames(&w.outside.netns, unreachable, || {
        send(&w.outside.netns, "eth0", frames)?;
        std::thread::sleep(Duration::from_millis(300));
        Ok(())
    })?;
    assert!((20..=120).contains(&got.len()), "port unreachables for 300 datagrams: {}", got.len());
    assert!(datapath(&w.c, 1, "icmp_limited")? - limited >= 150, "the rest counted");
    std::thread::sleep(Duration::from_millis(100));
    let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(NODE1, 30080), "--count", "2", "--connected", "--timeout-ms", "2000"])?;
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&2), "refused again: {s:?}");
    Ok(())
}
