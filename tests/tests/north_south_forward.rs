//! `lb-agent run --bpf-forward`: translated outside traffic is forwarded by
//! the TC program (FIB lookup, MACs, TTL, redirect) instead of the stack's
//! routing and netfilter FORWARD path. Proven by iptables FORWARD counters
//! on node-1 that stay at zero for what BPF forwards, on both families, and
//! by the TTL it takes as a router does; and
//! by what still goes through the stack: a hostNetwork endpoint (local
//! delivery). Replies of local pods are forwarded by the pod program on
//! their devices (`lb_pod_ingress`), also on a pod that comes later.
use std::time::Duration;

use anyhow::Result;
use lbtest::{Cluster, Pod};
use lbtest::objects::Endpoint as E;
use lbtest::world::*;

#[test]
fn translated_outside_traffic_skips_the_stacks_forwarding_path() -> Result<()> {
    // Local backends keep the client's address (`--local-masquerade
    // none`): a flow the stack masquerades is handed to it, not forwarded
    // here (north_south::cluster_policy_masquerades_outside_flows_to_local_backends_as_kube_proxy_does).
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &["--bpf-forward", "--local-masquerade", "none"])?;
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

    // A local pod: the requests are forwarded in BPF by the NodePort
    // program, its replies by the pod program on its device
    // (lb_pod_ingress): neither passes FORWARD.
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p1)?;
    let local_pod = |w: &World, pod: &Pod| -> Result<()> {
        count_forwarding(w)?;
        let before = in_bpf(w)?;
        for addr in [hostport(NODE1, 30080), hostport(NODE1_6, 30080)] {
            let s = tcp(&w.c, &w.outside, &addr, 10)?;
            assert_eq!(s.ok, 10, "{addr}: {s:?}");
            assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "replies come from the frontend: {s:?}");
            let client = if addr.starts_with('[') { CLIENT6 } else { CLIENT };
            assert_eq!(keys(&s), [format!("{} {client}", pod.name).as_str()].into(), "the local pod sees the client: {s:?}");
            let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "10"])?;
            assert_eq!(s.ok, 10, "{addr}: {s:?}");
        }
        assert_eq!(forwarded(w)?, (0, 0), "{}: requests and replies skip node-1's FORWARD chain", pod.name);
        // 2 x 10 TCP flows of at least 3 packets each way, 2 x 10 datagrams each way.
        let n = in_bpf(w)? - before;
        assert!(n >= 2 * (10 * 3 * 2 + 10 * 2), "{}: packets forwarded in BPF: {n}", pod.name);
        Ok(())
    };
    local_pod(&w, &w.p1)?;

    // A pod that comes after the agent: its device gets the pod program at
    // the sync its endpoint brings. When the device goes, its pin goes too.
    let p3 = w.c.add_pod(1, "pod-3")?;
    w.c.serve_reporting_peer(&p3, 8080)?;
    set_endpoints(&w, &[(&p3, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &p3)?;
    wait_only(&w.c, NODE1_6, 30080, &p3)?;
    local_pod(&w, &p3)?;
    let dev = |p: &Pod| format!("v{}", p.ip.rsplit('.').next().unwrap_or_default());
    // TCX links are pinned too.
    let tcx = std::env::var("LB_TC_ATTACH").map_or(true, |m| m != "netlink");
    let links = w.c.nodes[0].bpffs.join("links");
    let on_dev = |w: &World, p: &Pod| lbtest::tc_program_on(&w.c.nodes[0].netns, &dev(p), "lb_pod_ingress");
    assert!(on_dev(&w, &p3)?, "the pod program on {}", dev(&p3));
    assert_eq!(links.join(format!("lb_pod_ingress_{}", dev(&p3))).exists(), tcx, "pinned with TCX");
    let pin = links.join(format!("lb_pod_ingress_{}", dev(&p3)));
    w.c.in_netns(&w.c.nodes[0].netns, &["ip", "link", "del", &dev(&p3)])?;
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    w.c.wait_for("the pin of the pod device that went away removed", Duration::from_secs(10), || Ok(!pin.exists()))?;

    // An agent started without --bpf-forward takes the pod program off:
    // the local pod's replies go through the stack again.
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--bpf-forward=false", "--local-masquerade", "none"])?;
    let pod_pins = || -> Result<Vec<String>> {
        Ok(std::fs::read_dir(&links)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("lb_pod_ingress_"))
            .collect())
    };
    assert_eq!(pod_pins()?, Vec::<String>::new(), "no pod program without --bpf-forward");
    // (An unpinned link's program goes after an RCU grace and a work item.)
    w.c.wait_for(&format!("no pod program on {} without --bpf-forward", dev(&w.p1)), Duration::from_secs(3), || Ok(!on_dev(&w, &w.p1)?))?;
    count_forwarding(&w)?;
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    let (_, to_client) = forwarded(&w)?;
    assert!(to_client >= 10 * 3, "without --bpf-forward the local pod's replies go through the stack: {to_client}");
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--bpf-forward", "--local-masquerade", "none"])?;
    w.c.wait_for("the pod program back on pod-1's device", Duration::from_secs(10), || on_dev(&w, &w.p1))?;
    assert_eq!(pod_pins()?, if tcx { vec![format!("lb_pod_ingress_{}", dev(&w.p1))] } else { vec![] }, "node-1 has pod-1 left");
    local_pod(&w, &w.p1)?;

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

/// With `--bpf-forward` and the masquerade (the default), an outside flow
/// to a local backend of an externalTrafficPolicy Cluster Service is
/// masqueraded in BPF, not by the stack's nat hook: SNATed to node-1's
/// address on the pod bridge (what kube-proxy's MASQUERADE picks), its
/// requests forwarded by the NodePort program and its replies translated
/// and forwarded by the pod program, so neither passes FORWARD. Large
/// answers in fragments and the pod's port unreachable come back from the
/// frontend. An agent restarted without `--bpf-forward` keeps the pod
/// programs while such flows live (a connection held across it keeps
/// going), and takes them off once the last one ends.
#[test]
fn flows_to_local_backends_are_masqueraded_in_bpf() -> Result<()> {
    let gc = ["--nat-tcp-close-timeout", "1", "--nat-udp-timeout", "3", "--nat-gc-interval", "1"];
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &[&["--bpf-forward"][..], &gc].concat())?;
    for n in &w.c.nodes {
        w.c.in_netns(&n.netns, &["sysctl", "-qw", "net.ipv4.icmp_ratelimit=0", "net.ipv6.icmp.ratelimit=0"])?;
    }
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p1)?;
    count_forwarding(&w)?;
    let in_bpf = |w: &World| -> Result<u64> { Ok(datapath(&w.c, 1, "forwarded_bpf")? + datapath(&w.c, 1, "forwarded_xdp")?) };
    let before = in_bpf(&w)?;
    let frontends = [(hostport(NODE1, 30080), NODE1_BRIDGE), (hostport(LB_IP, 80), NODE1_BRIDGE), (hostport(NODE1_6, 30080), NODE1_BRIDGE6), (hostport(LB_IP6, 80), NODE1_BRIDGE6)];
    for (addr, bridge) in &frontends {
        let seen = format!("pod-1 {bridge}");
        let s = tcp(&w.c, &w.outside, addr, 10)?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
        assert_eq!(keys(&s), [seen.as_str()].into(), "{addr}: pod-1 sees node-1's address on its bridge: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "replies come from the frontend: {s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", addr, "--count", "10"])?;
        assert_eq!(s.ok, 10, "{addr}: {s:?}");
        assert_eq!(keys(&s), [seen.as_str()].into(), "{addr}: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "{s:?}");
    }
    assert_eq!(forwarded(&w)?, (0, 0), "requests and replies skip node-1's FORWARD chain (the stack's masquerade would not)");
    // 4 x 10 TCP flows of at least 3 packets each way, 4 x 10 datagrams each way.
    let n = in_bpf(&w)? - before;
    assert!(n >= 4 * (10 * 3 * 2 + 10 * 2), "packets forwarded in BPF: {n}");
    // `lb-agent nat` marks them masqueraded, to the bridge's address.
    let flows = flows_from(&w.c, CLIENT)?;
    assert!(!flows.is_empty() && flows.iter().all(|l| l.contains("[MASQUERADE]")), "{flows:?}");
    assert!(flows.iter().any(|l| l.starts_with("ipv4 tcp") && l.contains(&format!("-> src={NODE1_BRIDGE} dst={} ", w.p1.ip))), "{flows:?}");

    // A 4000-byte answer leaves pod-1 in fragments: each is translated by
    // the pod program (the later ones by the first one's ports).
    for (addr, bridge) in [(hostport(NODE1, 30080), NODE1_BRIDGE), (hostport(NODE1_6, 30080), NODE1_BRIDGE6)] {
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "5", "--size", "4000", "--echo", "--connected"])?;
        assert_eq!(s.ok, 5, "{addr}: {s:?}");
        assert_eq!(keys(&s), [format!("pod-1 {bridge} bytes=4000 echo reply=4000").as_str()].into(), "{s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "answers come from the frontend: {s:?}");
    }
    assert_eq!(forwarded(&w)?, (0, 0), "fragments skip FORWARD too");

    // node-1's path to the client narrows to 1300 (a locked route MTU): a
    // 1400-byte answer with DF set is answered to pod-1 ("fragmentation
    // needed" / "packet too big", as the stack would), and pod-1 sends the
    // next ones in fragments, which arrive.
    let n1 = w.c.nodes[0].netns.clone();
    let route_to = |ip: &str, v6: bool| -> Result<Vec<String>> {
        let fam = if v6 { "-6" } else { "-4" };
        let out = w.c.in_netns(&n1, &["ip", fam, "-o", "route", "get", ip])?;
        let words: Vec<&str> = out.split_whitespace().collect();
        let after = |k: &str| words.iter().position(|w| *w == k).and_then(|i| words.get(i + 1)).map(|s| s.to_string());
        let mut r = vec!["ip".to_string(), fam.to_string(), "route".to_string(), "add".to_string(), format!("{ip}/{}", if v6 { 128 } else { 32 })];
        if let Some(via) = after("via") {
            r.extend(["via".to_string(), via]);
        }
        r.extend(["dev".to_string(), after("dev").unwrap_or_default()]);
        Ok(r)
    };
    let too_big = datapath(&w.c, 1, "nat_too_big")?;
    for (client, v6, addr) in [(CLIENT, false, hostport(NODE1, 30080)), (CLIENT6, true, hostport(NODE1_6, 30080))] {
        let mut add = route_to(client, v6)?;
        add.extend(["mtu".to_string(), "lock".to_string(), "1300".to_string()]);
        w.c.in_netns(&n1, &add.iter().map(String::as_str).collect::<Vec<_>>())?;
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "6", "--size", "1400", "--echo", "--connected", "--timeout-ms", "500"])?;
        assert!(s.ok >= 4, "{addr}: after the first, pod-1 fragments its answers to fit: {s:?}");
        assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "{s:?}");
        let fam = if v6 { "-6" } else { "-4" };
        let prefix = format!("{client}/{}", if v6 { 128 } else { 32 });
        w.c.in_netns(&n1, &["ip", fam, "route", "del", &prefix])?;
    }
    assert!(datapath(&w.c, 1, "nat_too_big")? >= too_big + 2, "lb told pod-1 its answers did not fit, on both families");
    // No route back to the client: pod-1's answers are dropped and counted
    // (the stack would deliver them to node-1, whose address they carry).
    let dropped = datapath(&w.c, 1, "nat_dropped")?;
    for (client, v6, addr) in [(CLIENT, false, hostport(LB_IP, 80)), (CLIENT6, true, hostport(LB_IP6, 80))] {
        let fam = if v6 { "-6" } else { "-4" };
        let prefix = format!("{client}/{}", if v6 { 128 } else { 32 });
        w.c.in_netns(&n1, &["ip", fam, "route", "add", "unreachable", &prefix])?;
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "3", "--timeout-ms", "300"])?;
        w.c.in_netns(&n1, &["ip", fam, "route", "del", "unreachable", &prefix])?;
        assert_eq!(s.ok, 0, "{addr}: {s:?}");
        let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "3"])?;
        assert_eq!(s.ok, 3, "{addr}: the route back, the answers back: {s:?}");
    }
    assert!(datapath(&w.c, 1, "nat_dropped")? >= dropped + 6, "pod-1's answers without a route back counted");

    // pod-1 answers with TTL 1: node-1 does not forward them, it tells
    // pod-1 its TTL ran out (as the stack would, from the address pod-1
    // sent them to) and counts them dropped.
    w.c.stop(w.servers[0]);
    let ttl1 = w.c.serve_with(&w.p1, "pod-1", 8080, &["--report-peer", "--ttl", "1"])?;
    let p1_netns = w.p1.netns.clone();
    let time_exceeded = |w: &World, v6: bool| -> Result<u64> {
        let (file, key) = if v6 { ("/proc/net/snmp6", "Icmp6InTimeExcds") } else { ("/proc/net/snmp", "InTimeExcds") };
        let text = w.c.in_netns(&p1_netns, &["cat", file])?;
        if v6 {
            return text.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().parse().ok()).ok_or_else(|| anyhow::anyhow!("{key} in {text}"));
        }
        // "Icmp: Name ..." then "Icmp: values ...".
        let rows: Vec<Vec<&str>> = text.lines().filter(|l| l.starts_with("Icmp: ")).map(|l| l.split_whitespace().collect()).collect();
        let i = rows.first().and_then(|h| h.iter().position(|n| *n == key)).ok_or_else(|| anyhow::anyhow!("{key} in {text}"))?;
        Ok(rows.get(1).and_then(|v| v.get(i)).and_then(|v| v.parse().ok()).unwrap_or(0))
    };
    let dropped = datapath(&w.c, 1, "nat_dropped")?;
    for (lb, v6) in [(LB_IP, false), (LB_IP6, true)] {
        let before = time_exceeded(&w, v6)?;
        let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(lb, 80), "--count", "3", "--timeout-ms", "300"])?;
        assert_eq!(s.ok, 0, "{lb}: {s:?}");
        let told = time_exceeded(&w, v6)? - before;
        assert_eq!(told, 3, "{lb}: pod-1 told, once per answer, that its TTL ran out at node-1");
    }
    assert!(datapath(&w.c, 1, "nat_dropped")? >= dropped + 6, "answers whose TTL ran out counted");
    w.c.stop(ttl1);
    w.servers[0] = w.c.serve_reporting_peer(&w.p1, 8080)?;
    let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(LB_IP, 80), "--count", "3"])?;
    assert_eq!(s.ok, 3, "answers with a TTL that lasts arrive again: {s:?}");

    // A connection held across a restart without --bpf-forward keeps
    // going: the pod program stays on pod-1's device while it lives.
    let links = w.c.nodes[0].bpffs.join("links");
    let pod_pins = || -> Result<usize> { Ok(std::fs::read_dir(&links)?.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("lb_pod_ingress_")).count()) };
    let tcx = std::env::var("LB_TC_ATTACH").map_or(true, |m| m != "netlink");
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(LB_IP6, 80), "--hold-ms", "4000", "--interval-ms", "50"])?;
    std::thread::sleep(Duration::from_millis(500));
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &[&["--bpf-forward=false"][..], &gc].concat())?;
    if tcx {
        assert_eq!(pod_pins()?, 1, "the pod program stays while a flow masqueraded in BPF lives");
    }
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the held connection across the restart: {s:?}");
    assert_eq!(keys(&s), [format!("pod-1 {NODE1_BRIDGE6}").as_str()].into(), "{s:?}");
    // New flows are masqueraded by the stack now.
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 5)?;
    assert_eq!(s.ok, 5, "{s:?}");
    assert_eq!(keys(&s), [format!("pod-1 {NODE1_BRIDGE}").as_str()].into(), "{s:?}");
    // Once the flows masqueraded in BPF have expired, the pod programs go.
    w.c.wait_for("the pod programs taken off after the last flow masqueraded in BPF", Duration::from_secs(30), || {
        let flows = lbtest::run(lbtest::bin("lb-agent").to_str().unwrap_or_default(), &["nat", "--bpffs", w.c.nodes[0].bpffs.to_str().unwrap_or_default()])?;
        Ok(pod_pins()? == 0 && !flows.lines().any(|l| l.contains(&format!("-> src={NODE1_BRIDGE}")) || l.contains(&format!("-> src={NODE1_BRIDGE6}"))))
    })?;
    let _ = &mut w;

    // Back with --bpf-forward: pod-1's server goes away (its endpoint
    // stays); its port unreachable comes back from the frontend.
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &[&["--bpf-forward"][..], &gc].concat())?;
    w.c.wait_for("the pod program back", Duration::from_secs(10), || Ok(!tcx || pod_pins()? == 1))?;
    w.c.stop(w.servers[0]);
    for (lb, unreachable) in [(LB_IP, "icmp type=3 code=3"), (LB_IP6, "icmp6 type=1 code=4")] {
        let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(lb, 80), "--count", "2", "--connected", "--recverr", "--timeout-ms", "2000"])?;
        assert_eq!(s.errors.get("ECONNREFUSED"), Some(&2), "via {lb}: {s:?}");
        let from = format!("{unreachable} from={lb}");
        assert!(s.offenders.keys().all(|k| *k == from) && !s.offenders.is_empty(), "{from}: {s:?}");
    }
    Ok(())
}

/// node-1's node flags, as `bpftool map dump` shows them.
fn node_flags(w: &World) -> Result<u64> {
    let pin = w.c.nodes[0].bpffs.join("LB_NODE_CONFIG");
    let dump = lbtest::run("bpftool", &["-j", "map", "dump", "pinned", pin.to_str().unwrap_or_default()])?;
    let v: serde_json::Value = serde_json::from_str(&dump)?;
    v[0]["formatted"]["value"]["flags"].as_u64().or_else(|| v[0]["value"]["flags"].as_u64()).ok_or_else(|| anyhow::anyhow!("no flags in {dump}"))
}

/// Under `--per-packet-lb` alone, the pod program translates the replies
/// of flows an earlier agent masqueraded in BPF while they live, and skips
/// that lookup once none is left (`NO_BPF_MASQUERADED` in the node flags,
/// set only by a count taken after the agent's own flags, without
/// `--bpf-forward`, were written).
#[test]
fn per_packet_lb_keeps_flows_masqueraded_in_bpf_until_they_end() -> Result<()> {
    const NO_BPF_MASQUERADED: u64 = lb_common::node_flags::NO_BPF_MASQUERADED as u64;
    let gc = ["--nat-tcp-close-timeout", "1", "--nat-udp-timeout", "3", "--nat-gc-interval", "1"];
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP, LB_IP6]), &[&["--bpf-forward"][..], &gc].concat())?;
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    assert_eq!(node_flags(&w)? & NO_BPF_MASQUERADED, 0, "with --bpf-forward the flag is never set");
    for lb in [LB_IP, LB_IP6] {
        let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(lb, 80), "--hold-ms", "4000", "--interval-ms", "50"])?;
        std::thread::sleep(Duration::from_millis(500));
        w.c.kill_agent(1);
        w.c.start_agent_with(1, &[&["--bpf-forward=false", "--per-packet-lb"][..], &gc].concat())?;
        assert_eq!(node_flags(&w)? & NO_BPF_MASQUERADED, 0, "{lb}: a flow masqueraded in BPF lives");
        let s = Cluster::finish(held)?;
        assert_eq!(s.failed(), 0, "{lb}: the held connection across the restart: {s:?}");
        let bridge = if lb == LB_IP { NODE1_BRIDGE } else { NODE1_BRIDGE6 };
        assert_eq!(keys(&s), [format!("pod-1 {bridge}").as_str()].into(), "{s:?}");
        w.c.wait_for("the pod program told no flow masqueraded in BPF is left", Duration::from_secs(30), || {
            Ok(node_flags(&w)? & NO_BPF_MASQUERADED != 0)
        })?;
        // Outside flows are masqueraded by the stack meanwhile, and still
        // answered (the stack translates their replies).
        let s = tcp(&w.c, &w.outside, &hostport(lb, 80), 5)?;
        assert_eq!(s.ok, 5, "{s:?}");
        assert_eq!(keys(&s), [format!("pod-1 {bridge}").as_str()].into(), "{s:?}");
        // Back with --bpf-forward: the flag goes with the agent's first write.
        w.c.kill_agent(1);
        w.c.start_agent_with(1, &[&["--bpf-forward"][..], &gc].concat())?;
        assert_eq!(node_flags(&w)? & NO_BPF_MASQUERADED, 0, "{lb}: --bpf-forward again");
        let s = tcp(&w.c, &w.outside, &hostport(lb, 80), 5)?;
        assert_eq!(s.ok, 5, "{s:?}");
    }
    Ok(())
}
