//! `lb-agent run --nodeport-acceleration xdp`: the packets of established
//! SNATed outside flows are translated and sent back out at XDP, before
//! the stack. Proven by node-1's iptables FORWARD counters (no
//! `--bpf-forward` here, so whatever the TC program translates goes
//! through them): only each TCP flow's first packet (the SYN, which the
//! TC program sets up) passes there, none of the replies; by the
//! `forwarded_xdp` counter; and by `ip link`, which shows the program in
//! the driver (native XDP on veth). The program survives agent restarts
//! (replaced in place, a stream goes on), goes when the flag does, and
//! is not put on a device without native XDP (a bridge: generic XDP would
//! corrupt the partial checksums of GRO-merged segments).
use std::time::Duration;

use anyhow::Result;
use lbtest::objects::Endpoint as E;
use lbtest::world::*;

/// `ip -d link show DEV` in node-1.
fn link(w: &World, dev: &str) -> Result<String> {
    w.c.in_netns(&w.c.nodes[0].netns, &["ip", "-d", "link", "show", dev])
}

/// The id of the XDP program on node-1's `dev` and whether it runs in the
/// driver (None: no XDP program).
fn xdp_prog(w: &World, dev: &str) -> Result<Option<(u32, bool)>> {
    let out = link(w, dev)?;
    let Some(rest) = out.split("prog/xdp id ").nth(1) else { return Ok(None) };
    let id = rest.split_whitespace().next().unwrap_or_default().parse()?;
    let native = out.lines().next().is_some_and(|l| l.contains(" xdp ") || l.contains(" xdp/id:"));
    Ok(Some((id, native && !out.contains("xdpgeneric"))))
}

#[test]
fn established_snat_flows_are_sent_on_at_xdp() -> Result<()> {
    let xdp = ["--nodeport-acceleration", "xdp"];
    let mut w = world_wired(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &xdp)?;
    let (id, native) = xdp_prog(&w, "eth0")?.expect("an XDP program on node-1's eth0");
    assert!(native, "native XDP on veth: {}", link(&w, "eth0")?);
    assert!(link(&w, "eth0")?.contains("name lb_nodeport_xd"), "{}", link(&w, "eth0")?);
    // pod-2 only: every flow is SNATed to node-2, both directions cross
    // node-1's eth0.
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    count_forwarding(&w)?;
    let before = datapath(&w.c, 1, "forwarded_xdp")?;
    let addrs = [hostport(NODE1, 30080), hostport(NODE1_6, 30080), hostport(LB_IP, 80), hostport(LB_IP6, 80)];
    // Every checksum XDP rewrote holds where the packets arrive: at the
    // client (replies) and at pod-2 (requests). (A veth's receiver may not
    // check them itself: the capture does.)
    let traffic = || -> Result<()> {
        for addr in &addrs {
            let s = tcp(&w.c, &w.outside, addr, 20)?;
            assert_eq!(s.ok, 20, "{addr}: {s:?}");
            assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr], "replies come from the frontend: {s:?}");
            assert_eq!(keys(&s), [format!("pod-2 {}", if addr.starts_with('[') { NODE1_6 } else { NODE1 }).as_str()].into());
            let s = w.c.probe(&w.outside, &["udp", "--addr", addr, "--count", "10"])?;
            assert_eq!(s.ok, 10, "{addr}: {s:?}");
        }
        // One stream of 4 MB each way.
        let s = w.c.probe(&w.outside, &["bulk", "--addr", &hostport(NODE1, 30080), "--bytes", "4194304"])?;
        assert_eq!(s.ok, 1, "{s:?}");
        Ok(())
    };
    // 4 x (20 connections of 5+ packets, 10 datagrams) to pod-2; 3+ packets
    // of each connection and the datagrams back.
    checksums_hold(&w, &w.p2, (4 * (20 * 5 + 10), 4 * (20 * 3 + 10)), traffic)?;
    let (to_pods, to_client) = forwarded(&w)?;
    assert_eq!(to_client, 0, "no reply went through node-1's stack");
    // 81 SYNs (a few retransmitted at most); through TC alone it is
    // every packet of every flow. With --bpf-forward (LB_BPF_FORWARD=1)
    // TC forwards the SYNs too.
    if lbtest::bpf_forward_from_env() {
        assert_eq!(to_pods, 0, "nothing went through node-1's stack");
    } else {
        assert!((81..=90).contains(&to_pods), "only the SYNs went through node-1's stack: {to_pods}");
    }
    let n = datapath(&w.c, 1, "forwarded_xdp")? - before;
    assert!(n >= 4 * (20 * 6 + 10 * 2 - 1) + 2000, "packets sent on at XDP: {n}");

    // An agent restart replaces the program in place: a stream running
    // meanwhile goes on.
    let bulk = w.c.probe_bg(&w.outside, &["bulk", "--addr", &hostport(NODE1, 30080), "--bytes", "268435456"])?;
    std::thread::sleep(std::time::Duration::from_millis(300));
    w.c.kill_agent(1);
    assert_eq!(xdp_prog(&w, "eth0")?.map(|p| p.0), Some(id), "the pinned link keeps it attached while no agent runs");
    w.c.start_agent_with(1, &xdp)?;
    let s = lbtest::Cluster::finish(bulk)?;
    assert_eq!(s.ok, 1, "the stream across the restart: {s:?}");
    let (id2, native) = xdp_prog(&w, "eth0")?.expect("XDP after the restart");
    assert!(id2 != id && native, "the new agent's program, in the driver: {id} -> {id2}");

    // Without it, the program goes; the TC programs carry on.
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--nodeport-acceleration", "none"])?;
    // (An unpinned link's program goes after an RCU grace and a work item.)
    w.c.wait_for("the XDP program off eth0", Duration::from_secs(3), || Ok(xdp_prog(&w, "eth0")?.is_none())).map_err(|e| e.context(link(&w, "eth0").unwrap_or_default()))?;
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 10)?;
    assert_eq!(s.ok, 10, "{s:?}");

    // A device without native XDP (a bridge) gets none, logged: generic
    // XDP runs after GRO, on partial checksums it cannot see.
    w.c.in_netns(&w.c.nodes[0].netns, &["ip", "link", "add", "xbr0", "type", "bridge"])?;
    w.c.in_netns(&w.c.nodes[0].netns, &["ip", "link", "set", "xbr0", "up"])?;
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--nodeport-acceleration", "xdp", "--nodeport-interface", "eth0", "--nodeport-interface", "xbr0"])?;
    assert!(matches!(xdp_prog(&w, "eth0")?, Some((_, true))), "{}", link(&w, "eth0")?);
    assert_eq!(xdp_prog(&w, "xbr0")?, None, "{}", link(&w, "xbr0")?);
    let log = std::fs::read_to_string(w.c.agent_log(1))?;
    assert!(log.contains("the driver has no native XDP: no XDP acceleration on this device, the TC programs carry its traffic"), "{log}");
    assert!(log.contains(r#"iface="xbr0" ifindex"#) && log.contains(r#"xdp="off (no native XDP)""#), "{log}");
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    // `lb-agent teardown` takes XDP off every device too.
    w.c.kill_agent(1);
    lbtest::teardown_in(&w.c.nodes[0].netns, &w.c.nodes[0].bpffs)?;
    w.c.wait_for("XDP off every device", Duration::from_secs(3), || Ok((xdp_prog(&w, "eth0")?, xdp_prog(&w, "xbr0")?) == (None, None)))
        .map_err(|e| e.context(link(&w, "eth0").unwrap_or_default()))?;
    Ok(())
}

/// A veth whose peer has no NAPI drops every frame XDP sends on (the
/// kernel counts them, nothing else tells): the agent sees the counters
/// grow, takes XDP off that device, says why, and the TC programs carry
/// the traffic.
#[test]
fn xdp_on_a_veth_whose_peer_cannot_take_its_frames_is_taken_off() -> Result<()> {
    let w = world_wired(&web("NodePort", "", &[]), &["--nodeport-acceleration", "xdp"])?;
    // node-1's port on the fabric loses its NAPI.
    lbtest::run("ip", &["netns", "exec", &format!("{}-fab", w.c.id), "ethtool", "-K", "n1", "gro", "off"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    assert!(xdp_prog(&w, "eth0")?.is_some());
    // The first connections' later packets go to XDP and are lost.
    let _ = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 3)?;
    w.c.wait_for("XDP taken off node-1's eth0", std::time::Duration::from_secs(10), || Ok(xdp_prog(&w, "eth0")?.is_none()))?;
    let log = std::fs::read_to_string(w.c.agent_log(1))?;
    assert!(log.contains("XDP is off on it; the TC programs carry its traffic"), "{log}");
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 20)?;
    assert_eq!(s.ok, 20, "{s:?}");
    Ok(())
}

/// A UDP datagram without a checksum (0: allowed over IPv4, and over IPv6
/// for tunnels, RFC 6935) still has none where XDP translates it, as the
/// TC program leaves it: a checksum computed from 0 is garbage the pod's
/// stack drops, and a tunnel endpoint that takes zero checksums would no
/// longer take it.
#[test]
fn udp_without_a_checksum_still_has_none_after_xdp() -> Result<()> {
    use lbtest::raw::{capture_frames, ether, ipv4, ipv6, mac, send, udp_datagram};
    use std::net::IpAddr;
    let w = world_wired(&web("NodePort", "", &[]), &["--nodeport-acceleration", "xdp"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    let (node_mac, client_mac) = (mac(&w.c, &w.c.nodes[0].netns, "eth0")?, mac(&w.c, &w.outside.netns, "eth0")?);
    for (client, node) in [(CLIENT, NODE1), (CLIENT6, NODE1_6)] {
        let (client_ip, node_ip): (IpAddr, IpAddr) = (client.parse()?, node.parse()?);
        // Five datagrams of one flow: the first through TC, which makes
        // the flow; the rest at XDP.
        let frames: Vec<Vec<u8>> = (0..5)
            .map(|i| {
                let payload = format!("zero checksum {i}\n");
                match (client_ip, node_ip) {
                    (IpAddr::V4(c), IpAddr::V4(d)) => {
                        let mut u = udp_datagram(&c.octets(), &d.octets(), 40123, 30080, payload.as_bytes());
                        u[6..8].copy_from_slice(&[0, 0]);
                        ether(node_mac, client_mac, 0x0800, &ipv4(c.octets(), d.octets(), 17, 5, 0, 0x77 + i, &u))
                    }
                    (IpAddr::V6(c), IpAddr::V6(d)) => {
                        let mut u = udp_datagram(&c.octets(), &d.octets(), 40123, 30080, payload.as_bytes());
                        u[6..8].copy_from_slice(&[0, 0]);
                        ether(node_mac, client_mac, 0x86dd, &ipv6(c.octets(), d.octets(), 17, &u))
                    }
                    _ => unreachable!(),
                }
            })
            .collect();
        // The UDP checksum field of each datagram to port 8080 that
        // reaches pod-2.
        let to_pod = |f: &[u8]| -> Option<[u8; 2]> {
            let l4 = match u16::from_be_bytes([*f.get(12)?, *f.get(13)?]) {
                0x0800 if *f.get(23)? == 17 => 14 + 4 * (f[14] & 0x0f) as usize,
                0x86dd if *f.get(20)? == 17 => 54,
                _ => return None,
            };
            (f.get(l4 + 2..l4 + 4)? == 8080u16.to_be_bytes()).then(|| f.get(l4 + 6..l4 + 8)?.try_into().ok())?
        };
        let before = datapath(&w.c, 1, "forwarded_xdp")?;
        let outside = w.outside.netns.clone();
        let ((), got) = capture_frames(&w.p2.netns, move |f| to_pod(f).is_some(), || {
            for f in frames {
                send(&outside, "eth0", vec![f])?;
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            std::thread::sleep(std::time::Duration::from_millis(300));
            Ok(())
        })?;
        let at_xdp = datapath(&w.c, 1, "forwarded_xdp")? - before;
        assert!(at_xdp >= 4, "{node}: datagrams sent on at XDP: {at_xdp}");
        let sums: Vec<[u8; 2]> = got.iter().filter_map(|f| to_pod(f)).collect();
        assert_eq!(sums, vec![[0, 0]; 5], "{node}: the UDP checksums of the datagrams at pod-2 (SNATed)");
    }
    Ok(())
}

/// An established flow's frames for another host's MAC (flooded by a
/// switch, seen in promiscuous mode) are not sent on at XDP: they go up
/// to TC and the stack, which leave them, as kube-proxy's node would. A
/// UDP stream to the LB IP (pod-2 only: XDP carries both directions on
/// node-1) is answered until the client's neighbour entry for node-1
/// names a MAC no one has, then never.
#[test]
fn an_established_flows_frames_for_another_hosts_mac_are_not_sent_on_at_xdp() -> Result<()> {
    #[derive(serde::Deserialize)]
    struct Attempt {
        t_ms: u64,
        reply: Option<String>,
    }
    let w = world_wired(&web("LoadBalancer", "", &[LB_IP]), &["--nodeport-acceleration", "xdp"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, LB_IP, 80, &w.p2)?;
    let trace = std::env::temp_dir().join(format!("{}-mac-stream.jsonl", w.c.id));
    let lb = hostport(LB_IP, 80);
    let bg = w.c.probe_bg(
        &w.outside,
        &["udp-stream", "--addr", &lb, "--interval-ms", "50", "--max-ms", "3000", "--keep-on-timeout", "--trace-file", trace.to_str().unwrap()],
    )?;
    std::thread::sleep(std::time::Duration::from_millis(1200));
    let xdp_before = datapath(&w.c, 1, "forwarded_xdp")?;
    let switched = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis() as u64;
    w.c.in_netns(&w.outside.netns, &["ip", "neigh", "replace", NODE1, "lladdr", "02:00:00:00:00:99", "dev", "eth0", "nud", "permanent"])?;
    let s = lbtest::Cluster::finish(bg)?;
    let text = std::fs::read_to_string(&trace);
    let _ = std::fs::remove_file(&trace);
    let attempts: Vec<Attempt> = text?.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    let answered = |f: &dyn Fn(u64) -> bool| attempts.iter().filter(|a| f(a.t_ms) && a.reply.is_some()).count();
    assert!(answered(&|t| t < switched) >= 10, "answered (at XDP) before: {s:?}");
    assert!(datapath(&w.c, 1, "forwarded_xdp")? > 0, "the stream was carried at XDP");
    assert_eq!(answered(&|t| t > switched + 20), 0, "no frame for another MAC answered: {s:?}");
    assert!(datapath(&w.c, 1, "forwarded_xdp")? - xdp_before <= 2, "none sent on at XDP after the switch");
    // With the right MAC again, served.
    w.c.in_netns(&w.outside.netns, &["ip", "neigh", "del", NODE1, "dev", "eth0"])?;
    let s = w.c.probe(&w.outside, &["udp", "--addr", &lb, "--count", "5"])?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}

/// Packets of an established flow whose headers the stack would drop (a
/// bad IPv4 header checksum, an IP length cutting the UDP header or
/// beyond the frame; an IPv6 payload length likewise): XDP leaves them to
/// TC, which leaves them to the stack, as it leaves a flow's first packet.
/// Before 12-06's second session XDP translated them, sent them on to the
/// backend and refreshed the flow with them.
#[test]
fn packets_of_a_flow_with_headers_the_stack_drops_are_not_sent_on_at_xdp() -> Result<()> {
    use lbtest::raw::{ether, ipv4, ipv6, udp_datagram};
    let w = world_wired(&web("NodePort", "", &[]), &["--nodeport-acceleration", "xdp"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    let (dst, src) = (lbtest::raw::mac(&w.c, &w.c.nodes[0].netns, "eth0")?, lbtest::raw::mac(&w.c, &w.outside.netns, "eth0")?);
    let send = |ethertype: u16, packets: Vec<Vec<u8>>| lbtest::raw::send(&w.outside.netns, "eth0", packets.iter().map(|p| ether(dst, src, ethertype, p)).collect());
    let v6 = |s: &str| s.parse::<std::net::Ipv6Addr>().unwrap().octets();
    let (client, node): ([u8; 4], [u8; 4]) = ([192, 168, 77, 100], [192, 168, 77, 11]);
    let (client6, node6) = (v6(&w.outside.ip6), v6(NODE1_6));
    let d4 = |payload: &[u8]| ipv4(client, node, 17, 5, 0x4000, 7, &udp_datagram(&client, &node, 45000, 30080, payload));
    let d6 = |payload: &[u8]| ipv6(client6, node6, 17, &udp_datagram(&client6, &node6, 45001, 30080, payload));
    // The flows (TC makes them), then one more datagram each, sent on at XDP.
    send(0x0800, vec![d4(b"one")])?;
    send(0x86dd, vec![d6(b"one")])?;
    w.c.wait_for("the flows", std::time::Duration::from_secs(3), || {
        Ok(!flows_from(&w.c, "192.168.77.100")?.is_empty() && !flows_from(&w.c, &w.outside.ip6)?.is_empty())
    })?;
    let before = datapath(&w.c, 1, "forwarded_xdp")?;
    send(0x0800, vec![d4(b"two")])?;
    send(0x86dd, vec![d6(b"two")])?;
    w.c.wait_for("both sent on at XDP", std::time::Duration::from_secs(3), || Ok(datapath(&w.c, 1, "forwarded_xdp")? >= before + 2))?;
    let sent = datapath(&w.c, 1, "forwarded_xdp")?;
    let fix4 = |mut p: Vec<u8>| {
        p[10..12].copy_from_slice(&[0, 0]);
        let c = lbtest::raw::csum(&p[..20], 0);
        p[10..12].copy_from_slice(&c.to_be_bytes());
        p
    };
    let bad_csum = {
        let mut p = d4(b"three");
        p[10] ^= 0x5a;
        p
    };
    let with_len4 = |len: u16| {
        let mut p = d4(b"three");
        p[2..4].copy_from_slice(&len.to_be_bytes());
        fix4(p)
    };
    let with_len6 = |len: u16| {
        let mut p = d6(b"three");
        p[4..6].copy_from_slice(&len.to_be_bytes());
        p
    };
    send(0x0800, vec![bad_csum, with_len4(24), with_len4(200)])?;
    send(0x86dd, vec![with_len6(4), with_len6(200)])?;
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(datapath(&w.c, 1, "forwarded_xdp")?, sent, "none of them sent on at XDP");
    Ok(())
}
