//! `lb-agent run --bpf-forward`: translated outside traffic is forwarded by
//! the TC program (FIB lookup, MACs, TTL, redirect) instead of the stack's
//! routing and netfilter FORWARD path. Proven by iptables FORWARD counters
//! on node-1 that stay at zero for what BPF forwards, on both families, and
//! by the TTL it takes as a router does; and
//! by what still goes through the stack: replies of local pods (they do
//! not pass lb's TC ingress) and a hostNetwork endpoint (local delivery).
use anyhow::Result;
use lbtest::objects::Endpoint as E;
use lbtest::world::*;

#[test]
fn translated_outside_traffic_skips_the_stacks_forwarding_path() -> Result<()> {
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--bpf-forward"])?;
    // pod-2 only: every flow is SNATed to node-2, both directions pass
    // node-1's TC ingress.
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    count_forwarding(&w)?;
    // No neighbour known yet: the first packets go out through
    // bpf_redirect_neigh, which resolves it.
    w.c.in_netns(&w.c.nodes[0].netns, &["ip", "neigh", "flush", "all"])?;
    w.c.in_netns(&w.c.nodes[0].netns, &["ip", "-6", "neigh", "flush", "all"])?;
    // Forwarded in BPF: by the TC program, or before it at XDP when the
    // suite runs with XDP acceleration.
    let in_bpf = |w: &World| -> Result<u64> { Ok(datapath(&w.c, 1, "forwarded_bpf")? + datapath(&w.c, 1, "forwarded_xdp")?) };
    let before = in_bpf(&w)?;
    for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080), hostport(LB_IP, 80), hostport(LB_IP6, 80)] {
        let s = tcp(&w.c, &w.outside, &addr, 20)?;
        assert_eq!(s.ok, 20, "{addr}: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "replies come from the frontend: {s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "10"])?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
    }
    // One stream of 4 MB each way through BPF forwarding (GSO packets).
    let s = w.c.probe(&w.outside, &["bulk", "--addr", &hostport(NODE1, 30080), "--bytes", "4194304"])?;
    assert_eq!(s.ok, 1, "{s:?}");
    assert_eq!(forwarded(&w)?, (0, 0), "nothing went through node-1's FORWARD chain");
    // 4 x 20 TCP flows of at least 5 packets each way, 4 x 10 datagrams each way.
    let n = in_bpf(&w)? - before;
    assert!(n >= 4 * (20 * 10 + 10 * 2), "packets forwarded in BPF: {n}");
    // A router's TTL: node-1 takes one hop and node-2 another, so a
    // datagram sent with 2 hops left dies at node-2 and one with 3 reaches
    // the pod, on both families (as through the stack).
    for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080)] {
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "2", "--ttl", "3"])?;
        assert_eq!(s.ok, 2, "{addr}, 3 hops: {s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "2", "--ttl", "2", "--timeout-ms", "300"])?;
        assert_eq!(s.ok, 0, "{addr}, 2 hops: node-1 counts one: {s:?}");
    }

    // A local pod: the requests are forwarded in BPF, its replies (which
    // leave through the stack and are translated on egress) are not.
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p1)?;
    count_forwarding(&w)?;
    for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080)] {
        let s = tcp(&w.c, &w.outside, &addr, 10)?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
        let client = if addr.starts_with('[') { CLIENT6 } else { CLIENT };
        assert_eq!(keys(&s), [format!("pod-1 {client}").as_str()].into(), "the local pod sees the client: {s:?}");
    }
    let (to_pods, to_client) = forwarded(&w)?;
    assert_eq!(to_pods, 0, "requests to the local pod skip FORWARD");
    assert!(to_client >= 2 * 10 * 3, "the local pod's replies go through the stack: {to_client}");

    // A hostNetwork endpoint on node-1: the lookup says "local", the stack
    // delivers it.
    let host = w.c.host(1);
    w.c.serve_reporting_peer(&host, 8080)?;
    set_endpoints(&w, &[(&host, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &host)?;
    let before = datapath(&w.c, 1, "forwarded_stack")?;
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    assert_eq!(keys(&s), [format!("node-1-host {CLIENT}").as_str()].into(), "{s:?}");
    assert!(datapath(&w.c, 1, "forwarded_stack")? > before, "local delivery is left to the stack");
    let _ = &mut w;
    Ok(())
}
