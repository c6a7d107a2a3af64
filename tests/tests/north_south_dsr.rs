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
    let w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--nodeport-mode", "dsr"])?;
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
    // UDP datagrams larger than the MTU: every fragment carries the option.
    let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(LB_IP, 80), "--size", "3000", "--count", "5"])?;
    assert_eq!(s.ok, 5, "fragmented datagrams through DSR: {s:?}");
    // IPv6: the header's 24 bytes, "packet too big" for 24 bytes less;
    // every fragment carries the header (before its fragment header), and
    // large answers leave node-2 as fragments, from the frontend.
    let too_big = datapath(&w.c, 1, "nat_too_big")?;
    let s = w.c.probe(&w.outside, &["upload", "--addr", &hostport(LB_IP6, 80), "--bytes", "2000000"])?;
    assert_eq!(s.ok, 1, "an upload through IPv6 DSR: {s:?}");
    assert!(datapath(&w.c, 1, "nat_too_big")? > too_big, "node-1 sent packet too big");
    let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(LB_IP6, 80), "--size", "3000", "--count", "5", "--echo", "--connected"])?;
    assert_eq!(s.ok, 5, "fragmented datagrams through IPv6 DSR: {s:?}");
    assert_eq!(keys(&s), [format!("pod-2 {CLIENT6} bytes=3000 echo reply=3000").as_str()].into(), "{s:?}");
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
