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

#[test]
fn snated_flows_through_a_tunnel_leave_from_its_address_and_their_replies_are_translated() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    let t = tunnel(&w, &[(&w.p2, E::ready)])?;
    // node-1 reaches pod-2 through the tunnel, and node-2 reaches node-1's
    // tunnel address through it, as WireGuard and IPIP setups route.
    for a in [&w.p2.ip, &w.p2.ip6] {
        route(&w, 1, a)?;
    }
    for a in [TUN4[0], TUN6[0]] {
        route(&w, 2, a.split('/').next().unwrap_or_default())?;
    }
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
        for a in [&w.p2.ip, &w.p2.ip6] {
            route(&w, 1, a)?;
        }
        for a in [TUN4[0], TUN6[0]] {
            route(&w, 2, a.split('/').next().unwrap_or_default())?;
        }
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
/// answered by pod-1, which sees `client`, the replies from the NodePort.
fn served_by_pod1(w: &World, node: &str, client: &str) -> Result<()> {
    let np = hostport(node, 30080);
    let s = tcp(&w.c, &w.outside, &np, 20)?;
    assert_eq!(s.ok, 20, "{np}: {s:?}");
    assert_eq!(keys(&s), [format!("pod-1 {client}").as_str()].into(), "pod-1 sees the client: {s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), [np.as_str()], "replies come from the NodePort: {s:?}");
    Ok(())
}

#[test]
fn node_port_traffic_through_a_tunnel_is_served_answered_and_rejected() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    // A Service without endpoints, for the REJECT.
    w.c.write_object("empty.yaml", &service_typed("empty", "10.96.0.11", "NodePort", &[("http", 80, 8080, "TCP", 30081)], "  ipFamilyPolicy: PreferDualStack\n", &[]))?;
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
    for (node, client) in [(NODE1, CLIENT), (NODE1_6, CLIENT6)] {
        served_by_pod1(&w, node, client)?;
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
    for (node, client) in [(NODE1, CLIENT), (NODE1_6, CLIENT6)] {
        served_by_pod1(&w, node, client)?;
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
