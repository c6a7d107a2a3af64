//! Direct server return (`--nodeport-mode dsr`, or the Service annotation
//! `lb.dev/nodeport-mode`): node-1 takes the outside flow, DNATs it to
//! pod-2 on node-2 keeping the client's address, and names the frontend in
//! an IPv4 option or an IPv6 destination options header; node-2 strips it,
//! and pod-2's replies leave node-2 straight to the client, from the
//! frontend.
use anyhow::Result;
use lbtest::objects::Endpoint as E;
use lbtest::world::*;

fn nat(w: &World, node: usize) -> Result<String> {
    lbtest::run(lbtest::bin("lb-agent").to_str().unwrap(), &["nat", "--bpffs", w.c.nodes[node - 1].bpffs.to_str().unwrap()])
}

/// Packets node-1 forwarded towards the client (replies passing node-1),
/// both families.
fn replies_through_node1(w: &World) -> Result<u64> {
    let mut n = 0;
    for (cmd, client) in [("iptables", CLIENT), ("ip6tables", CLIENT6)] {
        let out = w.c.in_netns(&w.c.nodes[0].netns, &[cmd, "-w", "-L", "FORWARD", "-v", "-x", "-n"])?;
        n += out.lines().filter(|l| l.contains(client)).filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok()).sum::<u64>();
    }
    Ok(n)
}

#[test]
fn dsr_keeps_the_client_address_and_answers_from_the_backends_node() -> Result<()> {
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--nodeport-mode", "dsr"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, LB_IP, 80, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    wait_only(&w.c, LB_IP6, 80, &w.p2)?;
    w.c.in_netns(&w.c.nodes[0].netns, &["iptables", "-w", "-A", "FORWARD", "-d", CLIENT])?;
    w.c.in_netns(&w.c.nodes[0].netns, &["ip6tables", "-w", "-A", "FORWARD", "-d", CLIENT6])?;
    for addr in [hostport(NODE1, 30080), hostport(LB_IP, 80), hostport(NODE1_6, 30080), hostport(LB_IP6, 80)] {
        let client = if addr.starts_with('[') { CLIENT6 } else { CLIENT };
        let pod2_sees_client = [format!("pod-2 {client}")];
        let s = tcp(&w.c, &w.outside, &addr, 20)?;
        assert_eq!(s.ok, 20, "{addr}: {s:?}");
        assert_eq!(keys(&s), pod2_sees_client.iter().map(String::as_str).collect(), "pod-2 sees the client: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "replies come from the frontend: {s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "10"])?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
        assert_eq!(keys(&s), pod2_sees_client.iter().map(String::as_str).collect(), "{s:?}");
    }
    assert_eq!(replies_through_node1(&w)?, 0, "no reply passes node-1");
    assert!(datapath(&w.c, 1, "dsr_sent")? >= 4 * (20 * 3 + 10), "node-1 sent the flows with the option");
    assert!(datapath(&w.c, 2, "dsr_received")? >= 4 * (20 * 3 + 10), "node-2 took them");
    // Both nodes list the flow: node-1 the client's side, node-2 its reply
    // translation, both marked DSR.
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(LB_IP, 80), "--hold-ms", "1500", "--interval-ms", "100"])?;
    std::thread::sleep(std::time::Duration::from_millis(500));
    let n1 = nat(&w, 1)?;
    let n2 = nat(&w, 2)?;
    let line = |n: &str| n.lines().any(|l| l.starts_with("ipv4 tcp  ESTABLISHED") && l.contains(&format!("src={CLIENT} dst={LB_IP}")) && l.contains(&format!("dst={} sport", w.p2.ip)) && l.contains("[DSR]"));
    assert!(line(&n1), "node-1: {n1}");
    assert!(line(&n2), "node-2: {n2}");
    assert_eq!(lbtest::Cluster::finish(held)?.failed(), 0);
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(LB_IP6, 80), "--hold-ms", "1500", "--interval-ms", "100"])?;
    std::thread::sleep(std::time::Duration::from_millis(500));
    let (n1, n2) = (nat(&w, 1)?, nat(&w, 2)?);
    let line = |n: &str| n.lines().any(|l| l.starts_with("ipv6 tcp  ESTABLISHED") && l.contains(&format!("src={CLIENT6} dst={LB_IP6}")) && l.contains(&format!("dst={} sport", w.p2.ip6)) && l.contains("[DSR]"));
    assert!(line(&n1), "node-1: {n1}");
    assert!(line(&n2), "node-2: {n2}");
    assert_eq!(lbtest::Cluster::finish(held)?.failed(), 0);

    // The option's 8 bytes: a full-size upload makes node-1 answer
    // "fragmentation needed" for 8 bytes less, and the transfer goes on.
    let s = w.c.probe(&w.outside, &["upload", "--addr", &hostport(LB_IP, 80), "--bytes", "2000000"])?;
    assert_eq!(s.ok, 1, "an upload through DSR: {s:?}");
    assert!(datapath(&w.c, 1, "nat_too_big")? > 0, "node-1 sent fragmentation needed");
    // UDP datagrams larger than the MTU, from a client that has learnt no
    // path MTU (the uploads taught `outside` one): every fragment carries
    // the option.
    let fresh = w.c.add_outside("fresh", 102, &[(&format!("{LB_IP}/32"), 1), (&format!("{LB_IP6}/128"), 1)])?;
    let s = w.c.probe(&fresh, &["udp", "--addr", &hostport(LB_IP, 80), "--size", "3000", "--count", "5"])?;
    assert_eq!(s.ok, 5, "fragmented datagrams through DSR: {s:?}");
    assert_eq!(keys(&s), [format!("pod-2 {} bytes=3000", fresh.ip).as_str()].into(), "{s:?}");
    // IPv6: the header's 24 bytes, "packet too big" for 24 bytes less;
    // every fragment carries the header (before its fragment header), and
    // large answers leave node-2 as fragments, from the frontend.
    let too_big = datapath(&w.c, 1, "nat_too_big")?;
    let s = w.c.probe(&w.outside, &["upload", "--addr", &hostport(LB_IP6, 80), "--bytes", "2000000"])?;
    assert_eq!(s.ok, 1, "an upload through IPv6 DSR: {s:?}");
    assert!(datapath(&w.c, 1, "nat_too_big")? > too_big, "node-1 sent packet too big");
    // A client that has learnt no path MTU loses its first datagram: its
    // fragments fit its link but not the header's 24 bytes more, and A
    // answers "packet too big" (IPv6 routers do not fragment), which the
    // connected socket reports as EMSGSIZE; the next ones fit.
    let too_big = datapath(&w.c, 1, "nat_too_big")?;
    let s = w.c.probe(&fresh, &["udp", "--addr", &hostport(LB_IP6, 80), "--size", "3000", "--count", "5", "--echo", "--connected"])?;
    assert_eq!((s.ok, s.errors.keys().map(String::as_str).collect::<Vec<_>>()), (4, vec!["EMSGSIZE"]), "fragmented datagrams through IPv6 DSR: {s:?}");
    assert!(datapath(&w.c, 1, "nat_too_big")? > too_big, "node-1 sent packet too big");
    assert_eq!(keys(&s), [format!("pod-2 {} bytes=3000 echo reply=3000", fresh.ip6).as_str()].into(), "{s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), [hostport(LB_IP6, 80).as_str()], "{s:?}");
    // Hop-by-hop options from the client leave no room before them: dropped.
    let dropped = datapath(&w.c, 1, "nat_dropped")?;
    let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(LB_IP6, 80), "--count", "2", "--ip6-ext", "hbh", "--timeout-ms", "300"])?;
    assert_eq!(s.ok, 0, "{s:?}");
    assert!(datapath(&w.c, 1, "nat_dropped")? >= dropped + 2, "counted");
    assert_eq!(replies_through_node1(&w)?, 0, "no reply passes node-1");

    // A local pod needs neither.
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, LB_IP, 80, &w.p1)?;
    let s = tcp(&w.c, &w.outside, &hostport(LB_IP, 80), 5)?;
    assert_eq!(keys(&s), [format!("pod-1 {CLIENT}").as_str()].into(), "{s:?}");

    // The Service opts out: SNAT again.
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    let svc = web("LoadBalancer", "", &[LB_IP, LB_IP6]).replacen("metadata:\n", "metadata:\n  annotations:\n    lb.dev/nodeport-mode: snat\n", 1);
    w.c.write_object("svc.yaml", &svc)?;
    w.c.wait_for("the frontend without dsr", std::time::Duration::from_secs(5), || {
        let l = w.c.list(1)?;
        Ok(l["frontends"].as_array().unwrap().iter().any(|f| f["address"] == LB_IP && !f["flags"].as_array().unwrap().iter().any(|x| x == "dsr")))
    })?;
    wait_only(&w.c, LB_IP, 80, &w.p2)?;
    let s = tcp(&w.c, &w.outside, &hostport(LB_IP, 80), 5)?;
    assert_eq!(keys(&s), [format!("pod-2 {NODE1}").as_str()].into(), "{s:?}");
    Ok(())
}

/// A packet with the option that names no frontend of node-2 is left as it
/// is (the stack ignores the option) and records nothing: options from
/// strangers cannot make node-2 answer from arbitrary addresses.
#[test]
fn an_option_naming_no_frontend_records_nothing() -> Result<()> {
    let w = world_with(&web("LoadBalancer", "", &[LB_IP]), &["--nodeport-mode", "dsr"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    // Straight to pod-2 with a made-up DSR option naming 10.1.2.3:4567.
    w.c.in_netns(&w.outside.netns, &["ip", "route", "add", "10.244.2.0/24", "via", "192.168.77.12"])?;
    let s = w.c.probe(&w.outside, &["udp", "--addr", &format!("{}:8080", w.p2.ip), "--count", "3", "--ip-option", "9a08 11d7 0a010203"])?;
    assert_eq!(s.ok, 3, "delivered as it is: {s:?}");
    // IPv6: a destination options header naming [fd00:1::1]:4567.
    w.c.in_netns(&w.outside.netns, &["ip", "-6", "route", "add", "fd00:244:2::/64", "via", "fd00:77::12"])?;
    let hdr = "dst:00021b12 11d7 fd000001000000000000000000000001 0100";
    let s = w.c.probe(&w.outside, &["udp", "--addr", &format!("[{}]:8080", w.p2.ip6), "--count", "3", "--ip6-ext", hdr])?;
    assert_eq!(s.ok, 3, "delivered as it is: {s:?}");
    assert_eq!(datapath(&w.c, 2, "dsr_received")?, 0);
    let n2 = nat(&w, 2)?;
    assert!(!n2.contains("[DSR]"), "{n2}");
    Ok(())
}

/// A forged packet with the tuple of the reply side of a flow node-1
/// SNATed to pod-2 (node-1's address and SNAT port, to pod-2) and an
/// option: before, its entry became a DSR one, and the connection's
/// replies passed node-1 untranslated (one packet per SNAT port cut every
/// such flow). Such a tuple always names node-1's own address, so the
/// packet is dropped as spoofed (`source_check`) before its option is
/// read, and the SNATed connection goes on. (That an option never takes
/// another flow's entry, with a tuple an outsider can send, is
/// `a_forged_rst_and_option_do_not_take_a_live_local_flow`.)
#[test]
fn a_forged_option_with_a_snat_flows_reply_tuple_is_dropped_as_spoofed() -> Result<()> {
    use lbtest::raw::{ether, ipv4_with_options, mac, send, tcp_segment};
    let w = world_with(&web("NodePort", "", &[]), &[])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--hold-ms", "3000", "--interval-ms", "100"])?;
    std::thread::sleep(std::time::Duration::from_millis(500));
    // node-1's SNAT port of the held flow.
    let n1 = nat(&w, 1)?;
    let flow = n1.lines().find(|l| l.contains(&format!("src={CLIENT} dst={NODE1}")) && l.contains(&format!("src={NODE1} dst={}", w.p2.ip))).unwrap_or_else(|| panic!("{n1}"));
    let snat_port: u16 = flow.split(&format!("src={NODE1} dst={} sport=", w.p2.ip)).nth(1).and_then(|r| r.split(' ').next()).and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("{flow}"));
    // From outside: node-1's address and SNAT port to pod-2, with an
    // option naming 10.1.2.3 and the NodePort.
    let (src, dst): (std::net::Ipv4Addr, std::net::Ipv4Addr) = (NODE1.parse()?, w.p2.ip.parse()?);
    let opt = [0x9a, 8, 0x75, 0x80, 10, 1, 2, 3];
    let seg = tcp_segment(&src.octets(), &dst.octets(), snat_port, 8080, 0x10);
    let frame = ether(mac(&w.c, &w.c.nodes[0].netns, "eth0")?, mac(&w.c, &w.outside.netns, "eth0")?, 0x0800, &ipv4_with_options(src.octets(), dst.octets(), 6, &opt, &seg));
    let dropped = datapath(&w.c, 1, "nat_dropped")?;
    send(&w.outside.netns, "eth0", vec![frame])?;
    let s = lbtest::Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the SNATed connection went on: {s:?}");
    assert!(datapath(&w.c, 1, "nat_dropped")? > dropped, "the forged packet was dropped and counted");
    let n1 = nat(&w, 1)?;
    assert!(!n1.contains("[DSR]") && !n1.contains("10.1.2.3"), "{n1}");
    Ok(())
}

/// A client port used again (the first connection closed with FINs both
/// ways, within the closed timeout): node-2's entry starts anew with the
/// new SYN. Before, it kept the old connection's FIN: `lb-agent nat`
/// showed the live connection FIN_WAIT, and it expired after the closed
/// timeout (10 s) of silence, after which the pod's first packet left
/// node-2 from its own address. (Since 12-07 node-2 tells both FINs
/// apart, and shows the first connection CLOSED.)
#[test]
fn a_client_port_used_again_starts_a_fresh_flow_on_the_backends_node() -> Result<()> {
    let w = world_with(&web("LoadBalancer", "", &[LB_IP]), &["--nodeport-mode", "dsr"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, LB_IP, 80, &w.p2)?;
    // The client may connect from a port in TIME_WAIT a second later.
    w.c.in_netns(&w.outside.netns, &["sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])?;
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &hostport(LB_IP, 80), "--count", "1", "--sport", "41777"])?;
    assert_eq!(s.ok, 1, "{s:?}");
    let tuple = format!("src={CLIENT} dst={LB_IP} sport=41777 dport=80");
    let line = |n: &str| n.lines().find(|l| l.contains(&tuple)).map(str::to_string);
    // Node-2 sees both FINs (the client's, and the pod's as FIN_REPLY).
    w.c.wait_for("node-2's entry of the first connection CLOSED", std::time::Duration::from_secs(3), || Ok(line(&nat(&w, 2)?).is_some_and(|l| l.contains(" CLOSED "))))?;
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(LB_IP, 80), "--sport", "41777", "--hold-ms", "1500", "--interval-ms", "100"])?;
    std::thread::sleep(std::time::Duration::from_millis(700));
    let n2 = nat(&w, 2)?;
    let l = line(&n2).unwrap_or_else(|| panic!("{n2}"));
    assert!(l.contains("ESTABLISHED") && l.contains("[DSR]"), "the second connection's entry: {l}");
    let s = lbtest::Cluster::finish(held)?;
    assert_eq!((s.ok > 0, s.failed()), (true, 0), "{s:?}");
    Ok(())
}

/// A client port used first through node-2's own NodePort (to its local
/// backend; a client behind a NAT gateway uses its ports for every
/// frontend), then, that connection closed, through node-1 with DSR:
/// node-2 takes the new SYN's option in place of the ended flow's
/// entries. Before 12-05's third session the option was dropped as forged
/// (`nat_dropped`) until those entries expired (the closed timeout, 10 s,
/// then the next scan): the paired benchmark's DSR rounds, which
/// alternate with NodePort rounds at node-2, fell to 19 conn/s.
#[test]
fn a_dsr_syn_takes_the_tuple_of_an_ended_flow_to_a_local_backend() -> Result<()> {
    let (w, node2) = dsr_to_pod2()?;
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &hostport(&node2, 30080), "--count", "1", "--sport", "41999"])?;
    assert_eq!(s.ok, 1, "{s:?}");
    let tuple = "sport=41999 dport=30080";
    w.c.wait_for("node-2's flow of the first connection", std::time::Duration::from_secs(3), || Ok(nat(&w, 2)?.lines().any(|l| l.contains(tuple))))?;
    // Its last packets, and the pod's TIME_WAIT accepting a new SYN.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let dropped = datapath(&w.c, 2, "nat_dropped")?;
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--count", "1", "--sport", "41999", "--timeout-ms", "2000"])?;
    assert_eq!(s.ok, 1, "{s:?}");
    assert_eq!(datapath(&w.c, 2, "nat_dropped")?, dropped, "no option dropped");
    let n2 = nat(&w, 2)?;
    assert!(n2.lines().any(|l| l.contains("[DSR]") && l.contains("41999")), "{n2}");
    Ok(())
}

/// A router between the backend's node and the client has a narrower link
/// than the client's own (a VPN, PPPoE): the pod's full-size replies, sent
/// straight from node-2 with the frontend as their source, draw
/// "fragmentation needed" / "packet too big" addressed to the frontend,
/// which reaches node-1 (the node the frontend routes to). node-1 sends
/// it on to the pod, translated to the packet the pod sent, so the pod
/// learns the path's MTU and the download finishes.
#[test]
fn errors_about_dsr_replies_reach_the_pod() -> Result<()> {
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--nodeport-mode", "dsr"])?;
    for n in &w.c.nodes {
        w.c.in_netns(&n.netns, &["sysctl", "-qw", "net.ipv4.icmp_ratelimit=0", "net.ipv6.icmp.ratelimit=0"])?;
    }
    let client = w.c.add_outside_via_router("narrow", 110, 1300, &[(LB_IP, 1), (LB_IP6, 1)])?;
    // The client's own link stays at 1500: it asks for full-size segments.
    w.c.in_netns(&client.netns, &["ip", "link", "set", "eth0", "mtu", "1500"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, LB_IP, 80, &w.p2)?;
    wait_only(&w.c, LB_IP6, 80, &w.p2)?;
    let before = datapath(&w.c, 1, "nat_icmp")?;
    for addr in [hostport(LB_IP, 80), hostport(LB_IP6, 80)] {
        let s = w.c.probe(&client, &["bulk", "--addr", &addr, "--bytes", "2000000"])?;
        assert_eq!(s.ok, 1, "a download through DSR behind a narrow router via {addr}: {s:?}");
    }
    assert!(datapath(&w.c, 1, "nat_icmp")? >= before + 2, "node-1 sent the router's errors on to the pod");
    Ok(())
}

/// A router that spreads a LoadBalancer IP over several nodes (ECMP, the
/// address announced by BGP) may send the frontend's ICMP errors to
/// another node than the flow's: here the router sends ICMP for the
/// frontend to node-3 (no flow there), then to node-2 (the backend's own
/// node), and the flows to node-1. With Maglev that node sends the error
/// on to the backend Maglev picks for the flow, as node-1 did: the pod
/// learns the path's MTU, the download finishes. Without Maglev no node
/// but node-1 can tell the backend (the control at the end).
#[test]
fn with_maglev_errors_about_dsr_replies_reach_the_pod_from_any_node() -> Result<()> {
    let mut w = world_on(3, &web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--nodeport-mode", "dsr", "--nodeport-algorithm", "maglev"])?;
    for n in &w.c.nodes {
        w.c.in_netns(&n.netns, &["sysctl", "-qw", "net.ipv4.icmp_ratelimit=0", "net.ipv6.icmp.ratelimit=0"])?;
    }
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    // A fresh client per case: the pod remembers the path's MTU to each.
    let mut narrow_client = |host: u8, icmp_to: usize| -> Result<lbtest::Pod> {
        let client = w.c.add_outside_via_router(&format!("narrow-{host}"), host, 1300, &[(LB_IP, 1), (LB_IP6, 1)])?;
        w.c.in_netns(&client.netns, &["ip", "link", "set", "eth0", "mtu", "1500"])?;
        let router = client.netns.replace(&format!("-o{host}"), &format!("-r{host}"));
        let (n4, n6) = (&w.c.nodes[icmp_to - 1].ip, &w.c.nodes[icmp_to - 1].ip6);
        for args in [
            vec!["ip", "rule", "add", "ipproto", "icmp", "table", "100"],
            vec!["ip", "route", "add", LB_IP, "via", n4, "table", "100"],
            vec!["ip", "-6", "rule", "add", "ipproto", "ipv6-icmp", "table", "100"],
            vec!["ip", "-6", "route", "add", LB_IP6, "via", n6, "table", "100"],
        ] {
            w.c.in_netns(&router, &args)?;
        }
        Ok(client)
    };
    let clients = [(narrow_client(110, 3)?, 3), (narrow_client(111, 2)?, 2)];
    let control = narrow_client(112, 3)?;
    for node in 1..=3 {
        for (lb, ip) in [(LB_IP, &w.p2.ip), (LB_IP6, &w.p2.ip6)] {
            let want = vec![format!("{ip}:8080")];
            w.c.wait_for(&format!("{lb} on node-{node}"), std::time::Duration::from_secs(5), || Ok(w.c.programmed(node, lb, 80, "TCP")?.is_some_and(|b| b == want)))?;
        }
    }
    for (client, node) in &clients {
        let (before, on_node1) = (datapath(&w.c, *node, "nat_icmp_maglev")?, datapath(&w.c, 1, "nat_icmp")?);
        for addr in [hostport(LB_IP, 80), hostport(LB_IP6, 80)] {
            let s = w.c.probe(client, &["bulk", "--addr", &addr, "--bytes", "2000000"])?;
            assert_eq!(s.ok, 1, "a download via {addr}, the router's errors to node-{node}: {s:?}");
        }
        assert!(datapath(&w.c, *node, "nat_icmp_maglev")? >= before + 2, "node-{node} sent the errors on to pod-2");
        assert_eq!(datapath(&w.c, 1, "nat_icmp")?, on_node1, "none went through node-1");
    }
    // The control: the Service opts out of Maglev. node-3 cannot tell the
    // flow's backend, the pod never learns the path's MTU.
    let svc = web("LoadBalancer", "", &[LB_IP, LB_IP6]).replacen("metadata:\n", "metadata:\n  annotations:\n    lb.dev/nodeport-algorithm: random\n", 1);
    w.c.write_object("svc.yaml", &svc)?;
    w.c.wait_for("the frontend without maglev", std::time::Duration::from_secs(5), || {
        let l = w.c.list(3)?;
        Ok(l["frontends"].as_array().unwrap().iter().any(|f| f["address"] == LB_IP && !f["flags"].as_array().unwrap().iter().any(|x| x == "maglev")))
    })?;
    // The flow itself works (an answer that fits the narrow link), ...
    let s = w.c.probe(&control, &["bulk", "--addr", &hostport(LB_IP, 80), "--bytes", "1000"])?;
    assert_eq!(s.ok, 1, "a small download through the narrow router: {s:?}");
    // ... a full-size one stalls: node-3 sends no error on.
    let before = datapath(&w.c, 3, "nat_icmp_maglev")?;
    let s = w.c.probe(&control, &["bulk", "--addr", &hostport(LB_IP, 80), "--bytes", "2000000", "--timeout-ms", "3000"])?;
    assert_eq!(s.ok, 0, "without Maglev the error is lost: {s:?}");
    assert_eq!(s.errors.keys().collect::<Vec<_>>(), ["EAGAIN"], "it stalled: {s:?}");
    assert_eq!(datapath(&w.c, 3, "nat_icmp_maglev")?, before, "node-3 sent nothing on");
    Ok(())
}

/// DSR where both nodes' FORWARD chains drop (Docker, ufw: policy DROP,
/// with the CNI's rule for its pods' own traffic) and conntrack runs with
/// the common rule against INVALID packets. node-1 forwards the request
/// with the option, node-2 delivers it to pod-2 and pod-2's replies leave
/// node-2 to the client: lb's marks carry them through LB-FORWARD on both
/// nodes, and past conntrack (notrack), on both families.
#[test]
fn dsr_passes_forward_chains_that_drop_and_rules_against_invalid_packets() -> Result<()> {
    let w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--nodeport-mode", "dsr", "--forward-accept-period", "1s"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    for (i, node) in w.c.nodes.iter().enumerate() {
        let pods = [format!("{}.0/24", node.pod_cidr_prefix), format!("fd00:244:{}::/64", i + 1)];
        for (tool, pods) in [("iptables-nft", &pods[0]), ("ip6tables-nft", &pods[1])] {
            w.c.in_netns(&node.netns, &[tool, "-w", "-A", "FORWARD", "-s", pods, "-j", "ACCEPT"])?;
            w.c.in_netns(&node.netns, &[tool, "-w", "-P", "FORWARD", "DROP"])?;
            w.c.in_netns(&node.netns, &[tool, "-w", "-t", "mangle", "-A", "PREROUTING", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"])?;
        }
        // conntrack holds an entry: a datagram to a port of the node's own.
        w.c.probe(&w.outside, &["udp", "--addr", &hostport(&node.ip, 1), "--count", "1", "--timeout-ms", "300"])?;
    }
    let ready = |n: usize| -> Result<bool> {
        let netns = &w.c.nodes[n].netns;
        let jumps = ["iptables-nft", "ip6tables-nft"].iter().map(|t| w.c.in_netns(netns, &[t, "-w", "-S", "FORWARD"])).collect::<Result<Vec<_>>>()?;
        let table = w.c.in_netns(netns, &["nft", "list", "tables"])?;
        Ok(jumps.iter().all(|j| j.lines().any(|l| l.ends_with("-j LB-FORWARD"))) && table.lines().any(|l| l.trim() == "table inet lb"))
    };
    w.c.wait_for("lb's rules on both nodes", std::time::Duration::from_secs(10), || Ok(ready(0)? && ready(1)?))?;
    let received = datapath(&w.c, 2, "dsr_received")?;
    for addr in [hostport(NODE1, 30080), hostport(LB_IP, 80), hostport(NODE1_6, 30080), hostport(LB_IP6, 80)] {
        let client = if addr.starts_with('[') { CLIENT6 } else { CLIENT };
        let s = tcp(&w.c, &w.outside, &addr, 10)?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
        assert_eq!(keys(&s), [format!("pod-2 {client}").as_str()].into(), "{s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "10"])?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
    }
    assert!(datapath(&w.c, 2, "dsr_received")? - received >= 4 * (10 * 3 + 10), "they went by DSR");
    Ok(())
}

/// DSR to pod-2 only, through node-1's NodePort and node-2's own:
/// (the world, node-2's address).
fn dsr_to_pod2() -> Result<(World, String)> {
    let w = world_with(&web("NodePort", "", &[]), &["--nodeport-mode", "dsr"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    let node2 = w.c.nodes[1].ip.clone();
    w.c.wait_for("node-2's NodePort", std::time::Duration::from_secs(5), || Ok(w.c.programmed(2, &node2, 30080, "TCP")?.is_some_and(|b| !b.is_empty())))?;
    Ok((w, node2))
}

/// Send IPv4 packets from the outside client straight to node-2's
/// interface (forged ones).
fn to_node2(w: &World, packets: &[Vec<u8>]) -> Result<()> {
    use lbtest::raw::{ether, mac, send};
    let (to, from) = (mac(&w.c, &w.c.nodes[1].netns, "eth0")?, mac(&w.c, &w.outside.netns, "eth0")?);
    send(&w.outside.netns, "eth0", packets.iter().map(|p| ether(to, from, 0x0800, p)).collect())
}

/// The octets of an IPv4 address.
fn v4(a: &str) -> [u8; 4] {
    a.parse::<std::net::Ipv4Addr>().expect(a).octets()
}

/// Node-2's entry of a live DSR flow, its client port, and its age in
/// seconds: (line, sport, age).
fn dsr_entry(w: &World, frontend: &str) -> Result<Option<(String, u16, u64)>> {
    let n2 = nat(w, 2)?;
    let Some(l) = n2.lines().find(|l| l.contains(&format!("src={CLIENT} dst={frontend} ")) && l.contains("[DSR]")) else { return Ok(None) };
    let field = |name: &str| l.split_whitespace().find_map(|f| f.strip_prefix(name)).map(|v| v.trim_end_matches('s').to_string());
    let sport = field("sport=").and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{l}"));
    let age = field("age=").and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{l}"));
    Ok(Some((l.to_string(), sport, age)))
}

/// Forgeries with a live DSR flow's tuple, sent to the backend's node:
/// a plain SYN straight to the pod, a segment whose option names another
/// frontend (node-2's own NodePort), and such a SYN. The flow keeps its
/// entry (the same age) and its frontend; the two options are dropped
/// (`nat_dropped`). Before 12-07 the SYN to the pod removed the entry (a
/// DSR entry has no partner, and counted as ended: the pod's answers left
/// untranslated until the client's next packet made a new one), and
/// either option rewrote the flow's frontend (its replies then came from
/// node-2's address, which the client drops, until the client's next
/// packet rewrote it back).
#[test]
fn forged_packets_with_a_live_dsr_flows_tuple_leave_it_alone() -> Result<()> {
    use lbtest::raw::{ipv4, ipv4_with_options, tcp_segment, tcp_syn};
    let (w, node2) = dsr_to_pod2()?;
    // Held well past the waits below: a flow that closed (FINs both ways)
    // could be taken.
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--hold-ms", "9000", "--interval-ms", "100"])?;
    // Two seconds old, so that an entry made again would show.
    w.c.wait_for("node-2's entry of the held flow, established", std::time::Duration::from_secs(5), || {
        Ok(dsr_entry(&w, NODE1)?.is_some_and(|(l, _, age)| l.contains("ESTABLISHED") && age >= 2))
    })?;
    let (_, sport, _) = dsr_entry(&w, NODE1)?.unwrap();
    let (client, pod, n2) = (v4(CLIENT), v4(&w.p2.ip), v4(&node2));
    let other = [&[0x9a, 8, 0x75, 0x80][..], &n2[..]].concat();
    let dropped = datapath(&w.c, 2, "nat_dropped")?;
    to_node2(
        &w,
        &[
            ipv4(client, pod, 6, 5, 0x4000, 1, &tcp_syn(&client, &pod, sport, 8080)),
            ipv4_with_options(client, pod, 6, &other, &tcp_segment(&client, &pod, sport, 8080, 0x10)),
            ipv4_with_options(client, pod, 6, &other, &tcp_syn(&client, &pod, sport, 8080)),
        ],
    )?;
    w.c.wait_for("both options dropped", std::time::Duration::from_secs(3), || Ok(datapath(&w.c, 2, "nat_dropped")? - dropped >= 2))?;
    let (l, _, age) = dsr_entry(&w, NODE1)?.unwrap_or_else(|| panic!("node-2's entry is gone: {}", nat(&w, 2).unwrap_or_default()));
    assert!(age >= 2, "the entry was made again: {l}");
    assert!(l.contains(&format!("src={CLIENT} dst={NODE1} sport={sport} dport=30080")), "{l}");
    assert!(dsr_entry(&w, &node2)?.is_none(), "an entry for node-2's NodePort: {}", nat(&w, 2)?);
    assert_eq!(datapath(&w.c, 2, "nat_dropped")? - dropped, 2, "both options dropped");
    let s = lbtest::Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the held flow went on: {s:?}");
    Ok(())
}

/// A half-closed DSR flow: the client sends its request and its FIN, and
/// the pod answers 6 s later. Both nodes keep the flow past the closed
/// timeout (1 s here): node-2 sees only one FIN (the client's; the pod's
/// is `FIN_REPLY`), and node-1, which never sees the pod's, keeps it for
/// `--nat-dsr-fin-timeout`. Before 12-07 one FIN counted as closed on both
/// nodes: the flow's entries went after 1 s of silence and the answer left
/// node-2 from the pod's own address, which the client drops.
#[test]
fn a_half_closed_dsr_flow_lives_past_the_closed_timeout() -> Result<()> {
    let flags = ["--nodeport-mode", "dsr", "--nat-tcp-close-timeout", "1", "--nat-dsr-fin-timeout", "30", "--nat-gc-interval", "1"];
    let w = world_with(&web("NodePort", "", &[]), &flags)?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    let slow = w.c.probe_bg(&w.outside, &["half-closed", "--addr", &hostport(NODE1, 30080), "--wait-ms", "6000"])?;
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let n1 = nat(&w, 1)?;
    assert!(n1.lines().any(|l| l.contains(&format!("src={CLIENT} dst={NODE1} ")) && l.contains("FIN_WAIT")), "node-1 keeps the half-closed flow: {n1}");
    let (l, _, _) = dsr_entry(&w, NODE1)?.unwrap_or_else(|| panic!("node-2's entry is gone: {}", nat(&w, 2).unwrap_or_default()));
    assert!(l.contains("FIN_WAIT"), "{l}");
    let s = lbtest::Cluster::finish(slow)?;
    assert_eq!(s.ok, 1, "the answer after the client's FIN: {s:?}");
    assert_eq!(s.replies.keys().collect::<Vec<_>>(), [&format!("pod-2 {CLIENT}")], "{s:?}");
    Ok(())
}

/// A forged RST and at once a forged SYN whose option names node-1's
/// NodePort, both with the tuple of a live flow through node-2's own
/// NodePort to its local pod-2. The RST (which lb checks against no
/// sequence number) does not let the SYN take the flow's tuple: the flow
/// did not fall quiet after it. Before 12-07 the SYN's option replaced
/// the flow's entries with a DSR one, and the flow's replies left from
/// node-1's address.
#[test]
fn a_forged_rst_and_option_do_not_take_a_live_local_flow() -> Result<()> {
    use lbtest::raw::{ipv4, ipv4_with_options, tcp_segment, tcp_syn};
    let (w, node2) = dsr_to_pod2()?;
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(&node2, 30080), "--hold-ms", "8000", "--interval-ms", "100"])?;
    let front = format!("src={CLIENT} dst={node2} sport=");
    let mut flow = String::new();
    w.c.wait_for("node-2's flow", std::time::Duration::from_secs(5), || {
        flow = nat(&w, 2)?.lines().find(|l| l.contains(&front) && l.contains("ESTABLISHED")).unwrap_or_default().to_string();
        Ok(!flow.is_empty())
    })?;
    let sport: u16 = flow.split_whitespace().find_map(|f| f.strip_prefix("sport=")).unwrap().parse()?;
    let (client, pod, n1, n2) = (v4(CLIENT), v4(&w.p2.ip), v4(NODE1), v4(&node2));
    let option = [&[0x9a, 8, 0x75, 0x80][..], &n1[..]].concat();
    let dropped = datapath(&w.c, 2, "nat_dropped")?;
    to_node2(
        &w,
        &[
            ipv4(client, n2, 6, 5, 0x4000, 1, &tcp_segment(&client, &n2, sport, 30080, 0x04)),
            ipv4_with_options(client, pod, 6, &option, &tcp_syn(&client, &pod, sport, 8080)),
        ],
    )?;
    w.c.wait_for("the option dropped", std::time::Duration::from_secs(3), || Ok(datapath(&w.c, 2, "nat_dropped")? - dropped >= 1))?;
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(datapath(&w.c, 2, "nat_dropped")? - dropped, 1, "the option dropped");
    let n = nat(&w, 2)?;
    assert!(!n.contains("[DSR]"), "{n}");
    let s = lbtest::Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the held flow went on: {s:?}");
    Ok(())
}

/// A pod on the backend's node (node-2) connects to node-1's NodePort, its
/// packets not masqueraded (pod addresses route between the nodes, as with
/// most CNIs for pod-to-node traffic): node-1 sends the flow to pod-2 by
/// DSR, and pod-2's replies go to the client inside node-2, through no
/// NodePort device. They are translated on their way into the client's pod
/// (the pod programs' egress side, attached for DSR), so the client sees
/// the NodePort answer.
#[test]
fn a_pod_on_the_backends_node_reaches_a_dsr_node_port_of_another_node() -> Result<()> {
    let mut w = world_with(&web("NodePort", "", &[]), &["--nodeport-mode", "dsr"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    let client = w.c.add_pod(2, "client")?;
    // The new pod's device gets the egress pod program once it is up.
    w.c.wait_for("the pod program on the new pod's device", std::time::Duration::from_secs(5), || Ok(tcp(&w.c, &client, &hostport(NODE1, 30080), 1)?.ok == 1))?;
    for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080)] {
        let ip = if addr.starts_with('[') { &client.ip6 } else { &client.ip };
        let s = tcp(&w.c, &client, &addr, 5)?;
        assert_eq!(s.ok, 5, "{addr}: {s:?}");
        assert_eq!(keys(&s), [format!("pod-2 {ip}").as_str()].into(), "pod-2 sees the client: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "the answer comes from the NodePort: {s:?}");
        let s = w.c.probe(&client, &["udp", "--addr", &addr, "--count", "5"])?;
        assert_eq!(s.ok, 5, "{addr}: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "{s:?}");
    }
    assert!(datapath(&w.c, 2, "dsr_received")? >= 2 * (5 * 3 + 5), "the flows came by DSR");
    // A restart of node-2's agent keeps the pod devices' programs: a
    // connection held through it goes on.
    let np = hostport(NODE1, 30080);
    let objects = w.c.objects.clone();
    let held_through_restart = |w: &mut World, mode: &str, env: &[(&str, &str)]| -> Result<lbtest::Summary> {
        let held = w.c.probe_bg(&client, &["tcp", "--addr", &np, "--hold-ms", "5000", "--interval-ms", "50"])?;
        std::thread::sleep(std::time::Duration::from_millis(400));
        w.c.kill_agent(2);
        w.c.start_agent_env(2, &objects, &["--nodeport-mode", mode], env)?;
        lbtest::Cluster::finish(held)
    };
    let s = held_through_restart(&mut w, "dsr", &[])?;
    assert_eq!(s.failed(), 0, "through node-2's restart: {s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), [np.as_str()], "{s:?}");
    // Node-2's agent restarted without DSR (a mode switch rolling out,
    // node-1 still sending by DSR): the egress programs stay while DSR
    // flows to node-2's backends live (before, its first sync took them
    // off and such a connection stalled).
    let s = held_through_restart(&mut w, "snat", &[])?;
    assert_eq!(s.failed(), 0, "through node-2's restart without DSR: {s:?}");
    // Likewise through an upgrade (a new layout: the staged tables cannot
    // tell which flows live until the programs move).
    let s = held_through_restart(&mut w, "snat", &[("LB_LAYOUT_VERSION", "99")])?;
    assert_eq!(s.failed(), 0, "through node-2's upgrade without DSR: {s:?}");
    let log = std::fs::read_to_string(w.c.agent_log(2))?;
    assert!(log.contains("an upgrade: DSR flows to backends on this node may live"), "said in the log");
    let log = std::fs::read_to_string(w.c.agent_log(2))?;
    assert!(log.contains("the egress pod programs stay though no frontend here sends by DSR"), "said in the log");
    Ok(())
}
