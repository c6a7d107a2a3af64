//! North-south traffic through L3 devices (WireGuard, IPIP, GRE, TUN:
//! no link-layer header), as on clusters whose nodes reach each other
//! through an encrypted or IP-in-IP tunnel (Calico IPIP and WireGuard,
//! flannel's wireguard backend): kube-proxy's rules do not care which
//! device a packet uses, so lb's programs must not either. The tunnel here
//! is a TUN device on each node, carried by the test (`lbtest::tunnel`).
use std::time::Duration;

use anyhow::Result;
use lbtest::objects::{Endpoint as E, service_typed};
use lbtest::tunnel::Tunnel;
use lbtest::world::*;

const TUN4: [&str; 2] = ["10.99.0.1/32", "10.99.0.2/32"];
const TUN6: [&str; 2] = ["fd00:99::1/128", "fd00:99::2/128"];

/// How many times the agent on `node` attached its programs to wg0.
fn attaches(w: &World, node: usize) -> Result<usize> {
    Ok(std::fs::read_to_string(w.c.agent_log(node))?.lines().filter(|l| l.contains("NodePort programs attached") && l.contains("wg0") && l.contains("l3=true")).count())
}

/// The tunnel "wg0" between node-1 and node-2, the world's agents
/// attached to it, then endpoints `eps`. The agents see the device at once
/// (it gets its addresses, then comes up: a link event), not only at the
/// next Kubernetes change.
fn tunnel(w: &World, eps: &[(&lbtest::Pod, Make)]) -> Result<Tunnel> {
    let (n1, n2) = (&w.c.nodes[0].netns, &w.c.nodes[1].netns);
    // Both agents past their first sync: what attaches below is the link event.
    for (node, addr) in [(1, NODE1), (2, "192.168.77.12")] {
        w.c.wait_for("the NodePort programmed", Duration::from_secs(5), || Ok(w.c.programmed(node, addr, 30080, "TCP")?.is_some_and(|b| !b.is_empty())))?;
    }
    let before = [attaches(w, 1)?, attaches(w, 2)?];
    let t = Tunnel::new(n1, n2, "wg0", [&[TUN4[0], TUN6[0]], &[TUN4[1], TUN6[1]]])?;
    for node in [1, 2] {
        w.c.wait_for("the agent's programs on wg0", Duration::from_secs(20), || Ok(attaches(w, node)? > before[node - 1]))?;
    }
    set_endpoints(w, eps)?;
    Ok(t)
}

fn route(w: &World, node: usize, dst: &str) -> Result<()> {
    let ns = &w.c.nodes[node - 1].netns;
    if dst.contains(':') {
        lbtest::run("ip", &["-n", ns, "-6", "route", "add", &format!("{dst}/128"), "dev", "wg0"])?;
    } else {
        lbtest::run("ip", &["-n", ns, "route", "add", &format!("{dst}/32"), "dev", "wg0"])?;
    }
    Ok(())
}

/// node-1 reaches pod-2 through the tunnel, and node-2 reaches node-1's
/// tunnel addresses through it, as WireGuard and IPIP setups route.
fn routes_through_the_tunnel(w: &World) -> Result<()> {
    for a in [&w.p2.ip, &w.p2.ip6] {
        route(w, 1, a)?;
    }
    for a in [TUN4[0], TUN6[0]] {
        route(w, 2, a.split('/').next().unwrap_or_default())?;
    }
    Ok(())
}

#[test]
fn snated_flows_through_a_tunnel_leave_from_its_address_and_their_replies_are_translated() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    let t = tunnel(&w, &[(&w.p2, E::ready)])?;
    routes_through_the_tunnel(&w)?;
    wait_backends(&w.c, 1, NODE1, 30080, 1)?;
    wait_backends(&w.c, 1, NODE1_6, 30080, 1)?;
    let before = t.carried();
    for (node, tun) in [(NODE1, TUN4[0]), (NODE1_6, TUN6[0])] {
        let np = hostport(node, 30080);
        let tun = tun.split('/').next().unwrap_or_default();
        let s = tcp(&w.c, &w.outside, &np, 20)?;
        assert_eq!(s.ok, 20, "{np}: {s:?}");
        // SNATed as kube-proxy's MASQUERADE does: to the address the route
        // to the backend picks, the tunnel's; the replies come back to it
        // through the tunnel, and are translated on node-1's wg0.
        assert_eq!(keys(&s), [format!("pod-2 {tun}").as_str()].into(), "pod-2 sees node-1's tunnel address: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [np.as_str()], "replies come from the NodePort: {s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &np, "--count", "10"])?;
        assert_eq!(s.ok, 10, "{np} (UDP): {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [np.as_str()], "{s:?}");
    }
    let after = t.carried();
    // Both ways through the tunnel: 40 connections and 20 datagrams at least.
    assert!(after.0 - before.0 >= 60 && after.1 - before.1 >= 60, "the flows went through the tunnel: {before:?} -> {after:?}");
    // Flows through the NIC still leave from the node address.
    lbtest::run("ip", &["-n", &w.c.nodes[0].netns, "route", "del", &format!("{}/32", w.p2.ip), "dev", "wg0"])?;
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 5)?;
    assert_eq!(keys(&s), [format!("pod-2 {NODE1}").as_str()].into(), "{s:?}");
    Ok(())
}

#[test]
fn a_tunnel_created_again_gets_the_programs_again() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    let routed = |t: &Tunnel| -> Result<()> {
        // Routes through a device go with it: set them again each time.
        routes_through_the_tunnel(&w)?;
        let before = t.carried();
        for node in [NODE1, NODE1_6] {
            let np = hostport(node, 30080);
            let s = tcp(&w.c, &w.outside, &np, 10)?;
            assert_eq!(s.ok, 10, "{np}: {s:?}");
        }
        let after = t.carried();
        assert!(after.1 - before.1 >= 20, "the replies came back through the tunnel: {before:?} -> {after:?}");
        Ok(())
    };
    let t = tunnel(&w, &[(&w.p2, E::ready)])?;
    wait_backends(&w.c, 1, NODE1, 30080, 1)?;
    routed(&t)?;
    // The CNI restarts: its tunnel device is deleted and created again
    // under the same name (a new device, without programs).
    drop(t);
    let t = tunnel(&w, &[(&w.p2, E::ready)])?;
    routed(&t)?;
    Ok(())
}

/// 20 connections from the outside client to node `node`'s NodePort all
/// answered by pod-1, which sees `client` (the client's address, or
/// node-1's on the pod bridge where the flow is masqueraded), the replies
/// from the NodePort.
fn served_by_pod1(w: &World, node: &str, client: &str) -> Result<()> {
    let np = hostport(node, 30080);
    let s = tcp(&w.c, &w.outside, &np, 20)?;
    assert_eq!(s.ok, 20, "{np}: {s:?}");
    assert_eq!(keys(&s), [format!("pod-1 {client}").as_str()].into(), "pod-1 sees {client}: {s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), [np.as_str()], "replies come from the NodePort: {s:?}");
    Ok(())
}

#[test]
fn node_port_traffic_through_a_tunnel_is_served_answered_and_rejected() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    // A Service without endpoints, for the REJECT.
    w.c.write_object("empty.yaml", &service_typed("empty", &["10.96.0.11", "fd00:96::11"], "NodePort", &[("http", 80, 8080, "TCP", 30081)], "  ipFamilyPolicy: PreferDualStack\n", &[]))?;
    let t = tunnel(&w, &[(&w.p1, E::ready)])?;
    // Replies of pod-1 (on node-1) to the client leave node-1 through the
    // tunnel (node-2 forwards them on): the egress program on wg0
    // translates them.
    for a in [CLIENT, CLIENT6] {
        route(&w, 1, a)?;
    }
    wait_backends(&w.c, 1, NODE1, 30080, 1)?;
    wait_backends(&w.c, 1, NODE1_6, 30080, 1)?;
    let before = t.carried();
    // Masqueraded (externalTrafficPolicy Cluster, a local backend).
    for (node, seen) in [(NODE1, NODE1_BRIDGE), (NODE1_6, NODE1_BRIDGE6)] {
        served_by_pod1(&w, node, seen)?;
    }
    let mid = t.carried();
    assert!(mid.0 - before.0 >= 40, "pod-1's replies went through the tunnel: {before:?} -> {mid:?}");

    // Now the client's requests reach node-1 through the tunnel too: the
    // client sends node-1's address via node-2, which routes it into wg0.
    let (n2, o) = (&w.c.nodes[1], &w.outside.netns);
    lbtest::run("ip", &["-n", o, "route", "add", &format!("{NODE1}/32"), "via", &n2.ip])?;
    lbtest::run("ip", &["-n", o, "-6", "route", "add", &format!("{NODE1_6}/128"), "via", &n2.ip6])?;
    for a in [NODE1, NODE1_6] {
        route(&w, 2, a)?;
    }
    // Masqueraded (externalTrafficPolicy Cluster, a local backend).
    for (node, seen) in [(NODE1, NODE1_BRIDGE), (NODE1_6, NODE1_BRIDGE6)] {
        served_by_pod1(&w, node, seen)?;
        // No endpoints: REJECTed as kube-proxy does, the answer built on
        // wg0 and sent back through the tunnel.
        let empty = hostport(node, 30081);
        let s = tcp(&w.c, &w.outside, &empty, 3)?;
        assert_eq!(s.errors.get("ECONNREFUSED"), Some(&3), "{empty}: {s:?}");
    }
    let after = t.carried();
    assert!(after.1 - mid.1 >= 40 && after.0 - mid.0 >= 40, "the requests went through the tunnel: {mid:?} -> {after:?}");
    Ok(())
}

/// What `udp --recverr` saw for two datagrams to `addr` with `ttl`.
fn icmp_seen(w: &World, addr: &str, ttl: &str) -> Result<lbtest::Summary> {
    w.c.probe(&w.outside, &["udp", "--addr", addr, "--count", "2", "--connected", "--recverr", "--timeout-ms", "2000", "--ttl", ttl])
}

/// ICMP errors about SNATed flows through a tunnel come back through it,
/// addressed to node-1's tunnel address (the flows' source): node-2's
/// "fragmentation needed" / "packet too big" for a path narrower than the
/// tunnel, and its "time exceeded". lb translates them on wg0 and the
/// client gets them from the frontend. And node-1's own "fragmentation
/// needed" for a tunnel narrower than the client's path (WireGuard's 1420).
#[test]
fn icmp_errors_about_flows_through_a_tunnel_reach_the_client() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let up = w.c.add_outside("up", 101, &[])?;
    let up_narrow_tunnel = w.c.add_outside("up-narrow", 102, &[])?;
    let t = tunnel(&w, &[(&w.p2, E::ready)])?;
    routes_through_the_tunnel(&w)?;
    for n in &w.c.nodes {
        w.c.in_netns(&n.netns, &["sysctl", "-qw", "net.ipv4.icmp_ratelimit=0", "net.ipv6.icmp.ratelimit=0"])?;
    }
    // node-2's path on to pod-2 is narrower than the tunnel.
    let n2 = &w.c.nodes[1].netns;
    w.c.in_netns(n2, &["ip", "route", "add", &w.p2.ip, "dev", "cni0", "mtu", "lock", "1300"])?;
    w.c.in_netns(n2, &["ip", "-6", "route", "add", &w.p2.ip6, "dev", "cni0", "mtu", "lock", "1300"])?;
    wait_backends(&w.c, 1, NODE1, 30080, 1)?;
    wait_backends(&w.c, 1, NODE1_6, 30080, 1)?;
    let before = (t.carried(), datapath(&w.c, 1, "nat_icmp")?);
    for (node, exceeded) in [(NODE1, "icmp type=11 code=0"), (NODE1_6, "icmp6 type=3 code=0")] {
        let addr = hostport(node, 30080);
        let s = w.c.probe(&up, &["upload", "--addr", &addr, "--bytes", "2000000", "--timeout-ms", "10000"])?;
        assert_eq!(s.ok, 1, "upload via {addr}, node-2's fragmentation needed through the tunnel: {s:?}");
        // TTL 2 runs out at node-2.
        let s = icmp_seen(&w, &addr, "2")?;
        assert_eq!(s.errors.get("EHOSTUNREACH"), Some(&2), "ttl 2 via {addr}: {s:?}");
        let from = format!("{exceeded} from={node}");
        assert!(s.offenders.keys().all(|k| *k == from) && !s.offenders.is_empty(), "{from}: {s:?}");
    }
    let after = (t.carried(), datapath(&w.c, 1, "nat_icmp")?);
    // Two "too big" and four "time exceeded" at least, translated on wg0.
    assert!(after.1 - before.1 >= 6, "node-1 translated the errors: {} -> {}", before.1, after.1);
    assert!(after.0.1 > before.0.1, "{:?} -> {:?}", before.0, after.0);

    // node-1's tunnel is the narrow part: lb answers the client itself.
    w.c.in_netns(n2, &["ip", "route", "del", &w.p2.ip, "dev", "cni0"])?;
    w.c.in_netns(n2, &["ip", "-6", "route", "del", &w.p2.ip6, "dev", "cni0"])?;
    w.c.in_netns(&w.c.nodes[0].netns, &["ip", "link", "set", "wg0", "mtu", "1420"])?;
    let too_big = datapath(&w.c, 1, "nat_too_big")?;
    for node in [NODE1, NODE1_6] {
        let addr = hostport(node, 30080);
        let s = w.c.probe(&up_narrow_tunnel, &["upload", "--addr", &addr, "--bytes", "2000000", "--timeout-ms", "10000"])?;
        assert_eq!(s.ok, 1, "upload via {addr} through a tunnel of MTU 1420: {s:?}");
    }
    assert!(datapath(&w.c, 1, "nat_too_big")? >= too_big + 2, "lb said fragmentation needed / packet too big");
    Ok(())
}

/// DSR to a backend whose node is reached through the tunnel: node-1 sends
/// the client's packets through wg0 with the option (IPv4) or destination
/// options header (IPv6), node-2 takes them on its wg0, and pod-2's replies
/// leave node-2 straight to the client, from the frontend.
#[test]
fn dsr_through_a_tunnel_keeps_the_client_address() -> Result<()> {
    let w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--nodeport-mode", "dsr"])?;
    let t = tunnel(&w, &[(&w.p2, E::ready)])?;
    for a in [&w.p2.ip, &w.p2.ip6] {
        route(&w, 1, a)?;
    }
    wait_only(&w.c, LB_IP, 80, &w.p2)?;
    wait_only(&w.c, LB_IP6, 80, &w.p2)?;
    let before = (t.carried(), datapath(&w.c, 2, "dsr_received")?);
    for (addr, client) in [(hostport(LB_IP, 80), CLIENT), (hostport(NODE1, 30080), CLIENT), (hostport(LB_IP6, 80), CLIENT6), (hostport(NODE1_6, 30080), CLIENT6)] {
        let s = tcp(&w.c, &w.outside, &addr, 20)?;
        assert_eq!(s.ok, 20, "{addr}: {s:?}");
        assert_eq!(keys(&s), [format!("pod-2 {client}").as_str()].into(), "pod-2 sees the client: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "replies come from the frontend: {s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "10"])?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
        assert_eq!(keys(&s), [format!("pod-2 {client}").as_str()].into(), "{s:?}");
    }
    // The option's bytes through a tunnel of full MTU: node-1 answers
    // "fragmentation needed" for that much less, the uploads finish.
    let too_big = datapath(&w.c, 1, "nat_too_big")?;
    for addr in [hostport(LB_IP, 80), hostport(LB_IP6, 80)] {
        let s = w.c.probe(&w.outside, &["upload", "--addr", &addr, "--bytes", "2000000", "--timeout-ms", "10000"])?;
        assert_eq!(s.ok, 1, "an upload through DSR and the tunnel via {addr}: {s:?}");
    }
    assert!(datapath(&w.c, 1, "nat_too_big")? >= too_big + 2, "node-1 said fragmentation needed for the option");
    let after = (t.carried(), datapath(&w.c, 2, "dsr_received")?);
    assert!(after.1 - before.1 >= 4 * (20 * 3 + 10), "node-2 took the flows from wg0: {} -> {}", before.1, after.1);
    assert!(after.0.0 - before.0.0 >= 4 * (20 * 3 + 10), "through the tunnel: {:?} -> {:?}", before.0, after.0);
    // The replies leave node-2 by its NIC: next to nothing comes back
    // through the tunnel.
    assert!(after.0.1 - before.0.1 < 5, "no reply through the tunnel: {:?} -> {:?}", before.0, after.0);
    Ok(())
}

/// With `--bpf-forward`, translated packets that arrive through the tunnel
/// are forwarded in BPF as those from a NIC are (the neighbour layer
/// builds the Ethernet header they lack): the replies of SNATed flows,
/// back through wg0 and on to the client by the NIC, and requests that
/// come through wg0 for a local pod. None of them passes node-1's FORWARD
/// chain, on both families.
#[test]
fn translated_traffic_from_a_tunnel_is_forwarded_in_bpf() -> Result<()> {
    // The local pod keeps the client's address: the stack would
    // masquerade its flows (and so forward them).
    let w = world_with(&web("NodePort", "", &[]), &["--bpf-forward", "--local-masquerade", "none"])?;
    let t = tunnel(&w, &[(&w.p2, E::ready)])?;
    routes_through_the_tunnel(&w)?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    let in_bpf = |w: &World| -> Result<u64> { Ok(datapath(&w.c, 1, "forwarded_bpf")? + datapath(&w.c, 1, "forwarded_xdp")?) };
    count_forwarding(&w)?;
    let before = (in_bpf(&w)?, t.carried());
    for (node, tun) in [(NODE1, TUN4[0]), (NODE1_6, TUN6[0])] {
        let np = hostport(node, 30080);
        let tun = tun.split('/').next().unwrap_or_default();
        let s = tcp(&w.c, &w.outside, &np, 20)?;
        assert_eq!(s.ok, 20, "{np}: {s:?}");
        assert_eq!(keys(&s), [format!("pod-2 {tun}").as_str()].into(), "SNATed to the tunnel's address: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [np.as_str()], "replies come from the NodePort: {s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &np, "--count", "10"])?;
        assert_eq!(s.ok, 10, "{np} (UDP): {s:?}");
    }
    let after = (in_bpf(&w)?, t.carried());
    assert!(after.1.1 - before.1.1 >= 2 * (20 * 3 + 10), "the replies came back through the tunnel: {:?} -> {:?}", before.1, after.1);
    assert_eq!(forwarded(&w)?, (0, 0), "SNATed flows skip node-1's FORWARD chain both ways");
    // 2 x 20 TCP flows of at least 3 packets each way, 2 x 10 datagrams each way.
    assert!(after.0 - before.0 >= 2 * (20 * 3 * 2 + 10 * 2), "packets forwarded in BPF: {} -> {}", before.0, after.0);

    // The client's requests reach node-1 through the tunnel (via node-2),
    // for pod-1 on node-1, whose replies go back through it.
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p1)?;
    let (n2, o) = (&w.c.nodes[1], &w.outside.netns);
    lbtest::run("ip", &["-n", o, "route", "add", &format!("{NODE1}/32"), "via", &n2.ip])?;
    lbtest::run("ip", &["-n", o, "-6", "route", "add", &format!("{NODE1_6}/128"), "via", &n2.ip6])?;
    for a in [NODE1, NODE1_6] {
        route(&w, 2, a)?;
    }
    for a in [CLIENT, CLIENT6] {
        route(&w, 1, a)?;
    }
    count_forwarding(&w)?;
    let before = (in_bpf(&w)?, t.carried());
    for (node, client) in [(NODE1, CLIENT), (NODE1_6, CLIENT6)] {
        served_by_pod1(&w, node, client)?;
    }
    let after = (in_bpf(&w)?, t.carried());
    assert!(after.1.1 - before.1.1 >= 40 && after.1.0 - before.1.0 >= 40, "both ways through the tunnel: {:?} -> {:?}", before.1, after.1);
    assert_eq!(forwarded(&w)?, (0, 0), "requests from the tunnel to a local pod and its replies skip node-1's FORWARD chain");
    assert!(after.0 - before.0 >= 2 * 20 * 3 * 2, "packets forwarded in BPF: {} -> {}", before.0, after.0);
    Ok(())
}
