//! Maglev for outside traffic (`--nodeport-algorithm maglev`, or the
//! Service annotation `lb.dev/nodeport-algorithm`): every node picks the
//! same backend for a flow, also after the backends changed, so a UDP flow
//! to a LoadBalancer IP that the outside router moves from node-1 to
//! node-2 keeps its pod. The control: the same move with `random`
//! reshuffles flows when the backend set changed.
use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;
use lbtest::objects::Endpoint as E;
use lbtest::world::*;
use lbtest::{Cluster, Pod};

/// The pod that answers each flow (one UDP datagram from each source port
/// in `ports`) to the LB IP, through whichever node the client routes it to.
fn pods_of(c: &Cluster, client: &Pod, ports: std::ops::Range<u16>) -> Result<BTreeMap<u16, String>> {
    let mut out = BTreeMap::new();
    for p in ports {
        let s = c.probe(client, &["udp", "--addr", &hostport(LB_IP, 80), "--sport", &p.to_string(), "--count", "1"])?;
        assert_eq!(s.ok, 1, "flow from port {p}: {s:?}");
        let reply = s.replies.keys().next().unwrap();
        out.insert(p, reply.split_whitespace().next().unwrap().to_string());
    }
    Ok(out)
}

/// How many Maglev tables node `node`'s IPv4 outer map holds.
fn maglev_tables(w: &World, node: usize) -> Result<usize> {
    Ok(inner_ids(w, node)?.len())
}

/// The id of the inner array under each key of node `node`'s `LB4_MAGLEV`.
fn inner_ids(w: &World, node: usize) -> Result<Vec<u32>> {
    let pin = w.c.nodes[node - 1].bpffs.join("LB4_MAGLEV");
    let outer = lbtest::run("bpftool", &["map", "dump", "pinned", pin.to_str().unwrap()])?;
    Ok(outer
        .lines()
        .filter_map(|l| l.split("value:").nth(1))
        .map(|v| {
            let b: Vec<u8> = v.split_whitespace().filter_map(|x| u8::from_str_radix(x, 16).ok()).collect();
            u32::from_le_bytes([b[0], b[1], b[2], b[3]])
        })
        .collect())
}

/// Wait until every Maglev table of node `node` names exactly `n`
/// backends (the tables follow the slots within the same sync, a moment
/// later).
fn wait_tables(w: &World, node: usize, n: usize) -> Result<()> {
    w.c.wait_for(&format!("node-{node}'s Maglev tables with {n} backends"), std::time::Duration::from_secs(5), || {
        let ids = inner_ids(w, node)?;
        for id in &ids {
            // A table swapped meanwhile is gone: look again.
            let Ok(inner) = lbtest::run("bpftool", &["-j", "map", "dump", "id", &id.to_string()]) else { return Ok(false) };
            let v: serde_json::Value = serde_json::from_str(&inner)?;
            let distinct: std::collections::BTreeSet<String> = v.as_array().into_iter().flatten().map(|e| e["value"].to_string()).collect();
            if distinct.len() != n {
                return Ok(false);
            }
        }
        Ok(!ids.is_empty())
    })
}

fn route_lb_ip_to(c: &Cluster, client: &Pod, node: &str) -> Result<()> {
    c.in_netns(&client.netns, &["ip", "route", "replace", &format!("{LB_IP}/32"), "via", node]).map(drop)
}

/// Flows through node-1 with six pods; then pod-6 leaves and the router
/// moves the flows to node-2. Returns (flows that stayed with their pod,
/// flows whose pod is still there).
fn move_after_a_change(w: &mut World, pods: &[Pod], ports: std::ops::Range<u16>, maglev: bool) -> Result<(usize, usize)> {
    let all: Vec<(&Pod, Make)> = pods.iter().map(|p| (p, E::ready as Make)).collect();
    set_endpoints(w, &all)?;
    wait_backends(&w.c, 1, LB_IP, 80, pods.len())?;
    wait_backends(&w.c, 2, LB_IP, 80, pods.len())?;
    if maglev {
        wait_tables(w, 1, pods.len())?;
    }
    route_lb_ip_to(&w.c, &w.outside, NODE1)?;
    let before = pods_of(&w.c, &w.outside, ports.clone())?;
    assert!(before.values().collect::<std::collections::BTreeSet<_>>().len() >= 3, "the flows spread: {before:?}");
    set_endpoints(w, &all[..pods.len() - 1])?;
    wait_backends(&w.c, 2, LB_IP, 80, pods.len() - 1)?;
    if maglev {
        wait_tables(w, 2, pods.len() - 1)?;
    }
    route_lb_ip_to(&w.c, &w.outside, "192.168.77.12")?;
    let after = pods_of(&w.c, &w.outside, ports)?;
    let gone = &pods[pods.len() - 1].name;
    let alive: Vec<u16> = before.iter().filter(|(_, p)| *p != gone).map(|(k, _)| *k).collect();
    let kept = alive.iter().filter(|k| before[k] == after[k]).count();
    Ok((kept, alive.len()))
}

#[test]
fn a_udp_flow_moved_to_another_node_keeps_its_pod_with_maglev() -> Result<()> {
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP]), &["--nodeport-algorithm", "maglev"])?;
    let mut pods = vec![w.p1.clone(), w.p2.clone()];
    for (node, name) in [(1, "pod-3"), (2, "pod-4"), (1, "pod-5"), (2, "pod-6")] {
        let p = w.c.add_pod(node, name)?;
        w.c.serve_reporting_peer(&p, 8080)?;
        pods.push(p);
    }
    // Maglev (the agents' default here): every flow whose pod is still
    // there keeps it on the other node.
    let (kept, alive) = move_after_a_change(&mut w, &pods, 40000..40030, true)?;
    assert_eq!(kept, alive, "with Maglev every flow keeps its pod on node-2");
    assert!(alive >= 20, "{alive}");
    // The tables are in the maps: one per external frontend (the LB IP
    // and the NodePort on each of node-1's IPv4 addresses, its own and its
    // pod bridge's, TCP and UDP); none for the localhost NodePorts, which
    // outside traffic never reaches.
    assert_eq!(maglev_tables(&w, 1)?, 6);
    // Frontends with the same backends share one table: one array for
    // TCP, one for UDP (their backends have ids of their own).
    let arrays: std::collections::BTreeSet<u32> = inner_ids(&w, 1)?.into_iter().collect();
    assert_eq!(arrays.len(), 2, "{:?}", inner_ids(&w, 1)?);
    // `lb-agent list` shows the table as the kernel holds it; its digest
    // (over the backends' addresses) is the same on both nodes.
    let table = |node: usize| -> Result<serde_json::Value> {
        let l = w.c.list(node)?;
        let lb = l["frontends"].as_array().unwrap().iter().find(|f| f["address"] == LB_IP && f["protocol"] == "UDP").unwrap().clone();
        assert!(lb["flags"].as_array().unwrap().iter().any(|f| f == "maglev"), "{lb}");
        Ok(lb["maglev"].clone())
    };
    wait_tables(&w, 1, 5)?;
    let (t1, t2) = (table(1)?, table(2)?);
    assert_eq!(t1["size"], 16381, "{t1}");
    assert_eq!(t1["backends"], 5, "{t1}");
    assert_eq!(t1["digest"], t2["digest"], "node-1 {t1} node-2 {t2}");

    // The Service asks for random: the same move reshuffles flows.
    let svc = web("LoadBalancer", "", &[LB_IP]).replacen("metadata:\n", "metadata:\n  annotations:\n    lb.dev/nodeport-algorithm: random\n", 1);
    w.c.write_object("svc.yaml", &svc)?;
    w.c.wait_for("the Maglev tables removed", std::time::Duration::from_secs(5), || Ok(maglev_tables(&w, 1)? == 0 && maglev_tables(&w, 2)? == 0))?;
    let (kept, alive) = move_after_a_change(&mut w, &pods, 41000..41030, false)?;
    assert!(kept < alive, "with random, a changed backend set moves flows: {kept} of {alive} kept");

    // Maglev turned on again, then the agent restarted without it: the
    // restarted agent's first full sync removes the tables it inherited.
    w.c.write_object("svc.yaml", &web("LoadBalancer", "", &[LB_IP]))?;
    w.c.wait_for("node-1's Maglev tables back", std::time::Duration::from_secs(5), || Ok(maglev_tables(&w, 1)? == 6))?;
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &[])?;
    assert_eq!(maglev_tables(&w, 1)?, 0, "nothing left from the earlier agent");
    route_lb_ip_to(&w.c, &w.outside, NODE1)?;
    let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(LB_IP, 80), "--count", "5"])?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}

/// With Maglev and DSR, a TCP connection an upstream router moves to
/// another node mid-stream goes on: that node takes the connection's next
/// packet (not a SYN) as a flow, Maglev picks the same pod, and DSR keeps
/// the client's address, so the pod's socket never notices.
#[test]
fn with_maglev_and_dsr_a_tcp_connection_moved_to_another_node_goes_on() -> Result<()> {
    let w = world_with(&web("LoadBalancer", "", &[LB_IP]), &["--nodeport-algorithm", "maglev", "--nodeport-mode", "dsr"])?;
    wait_backends(&w.c, 1, LB_IP, 80, 2)?;
    wait_backends(&w.c, 2, LB_IP, 80, 2)?;
    route_lb_ip_to(&w.c, &w.outside, NODE1)?;
    // 14 connections: all on one pod once in 8,192 runs.
    let held: Vec<_> = (0..14)
        .map(|_| w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(LB_IP, 80), "--hold-ms", "3000", "--interval-ms", "100"]))
        .collect::<Result<_>>()?;
    std::thread::sleep(std::time::Duration::from_millis(1000));
    let before = datapath(&w.c, 2, "nat_new")?;
    route_lb_ip_to(&w.c, &w.outside, "192.168.77.12")?;
    let mut pods = std::collections::BTreeSet::new();
    for h in held {
        let s = Cluster::finish(h)?;
        assert_eq!(s.failed(), 0, "the connection goes on through node-2: {s:?}");
        assert_eq!(s.replies.len(), 1, "one pod, which sees the client: {s:?}");
        let reply = s.replies.keys().next().unwrap().clone();
        assert!(reply.ends_with(CLIENT), "{reply}");
        pods.insert(reply);
    }
    assert!(datapath(&w.c, 2, "nat_new")? >= before + 14, "node-2 took the moved connections as flows");
    assert_eq!(pods.len(), 2, "both pods held some: {pods:?}");
    Ok(())
}

/// More Maglev frontends than the outer map held before 12-05 (8,192 keys
/// per family; one per frontend and scope): 100 ports on 90 externalIPs.
/// Every frontend gets its table and the agent's first sync completes
/// (before, the overflow failed every full sync: a restarted agent never
/// wrote its node config, and every SNATed outside flow was dropped).
#[test]
fn more_maglev_frontends_than_the_old_outer_map_held_all_get_their_table() -> Result<()> {
    use lbtest::objects::{service_ips, slice_of};
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP]), &["--nodeport-algorithm", "maglev", "--maglev-table-size", "251"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    let names: Vec<String> = (0..100).map(|i| format!("p{i}")).collect();
    let ports: Vec<(&str, u16, u16, &str)> = names.iter().enumerate().map(|(i, n)| (n.as_str(), 1000 + i as u16, 8080, "TCP")).collect();
    let ips: Vec<String> = (1..=90).map(|i| format!("\"10.201.0.{i}\"")).collect();
    let extra = format!("  externalIPs: [{}]\n", ips.join(", "));
    w.c.write_object("many.yaml", &service_ips("many", &["10.96.0.50"], &ports, &extra))?;
    let ep_ports: Vec<(&str, u16, &str)> = names.iter().map(|n| (n.as_str(), 8080, "TCP")).collect();
    w.c.write_object("many-s.yaml", &slice_of("many", "many-1", "IPv4", &ep_ports, &[E::ready(&w.p2.ip, "node-2")]))?;
    // node-1 starts afresh with them.
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--nodeport-algorithm", "maglev", "--maglev-table-size", "251"])?;
    w.c.wait_for("node-1's Maglev tables", std::time::Duration::from_secs(20), || Ok(maglev_tables(&w, 1)? > 9000))?;
    w.c.in_netns(&w.outside.netns, &["ip", "route", "add", "10.201.0.0/24", "via", NODE1])?;
    for addr in ["10.201.0.90:1099", "10.201.0.1:1000", &hostport(LB_IP, 80)] {
        let s = tcp(&w.c, &w.outside, addr, 3)?;
        assert_eq!(keys(&s), [format!("pod-2 {NODE1}").as_str()].into(), "{addr}: SNATed to pod-2: {s:?}");
    }
    Ok(())
}

/// Hundreds of distinct tables (each port of a Service its own backend)
/// on an agent whose open-file limit it cannot raise (512, soft and
/// hard): a table is an inner array held open until a batch puts it in,
/// so they go in a few hundred at a time. All are written (before, a sync
/// held one descriptor per table: past the limit every further table
/// failed, and its frontend picked at random).
#[test]
fn more_distinct_maglev_tables_than_the_open_file_limit_are_all_written() -> Result<()> {
    use lbtest::objects::{service_ips, slice_of};
    let flags = ["--nodeport-algorithm", "maglev", "--maglev-table-size", "251"];
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP]), &flags)?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    let names: Vec<String> = (0..600).map(|i| format!("p{i}")).collect();
    let ports: Vec<(&str, u16, u16, &str)> = names.iter().enumerate().map(|(i, n)| (n.as_str(), 1000 + i as u16, 8080, "TCP")).collect();
    w.c.write_object("many.yaml", &service_ips("many", &["10.96.0.50"], &ports, "  externalIPs: [\"10.201.0.1\"]\n"))?;
    let ep_ports: Vec<(&str, u16, &str)> = names.iter().enumerate().map(|(i, n)| (n.as_str(), 10000 + i as u16, "TCP")).collect();
    w.c.write_object("many-s.yaml", &slice_of("many", "many-1", "IPv4", &ep_ports, &[E::ready(&w.p2.ip, "node-2")]))?;
    w.c.kill_agent(1);
    w.c.start_agent_nofile(1, 512, &flags)?;
    let distinct = || -> Result<usize> { Ok(inner_ids(&w, 1)?.into_iter().collect::<BTreeSet<_>>().len()) };
    w.c.wait_for("node-1's Maglev tables", std::time::Duration::from_secs(20), || Ok(distinct()? > 600))?;
    let log = std::fs::read_to_string(w.c.agent_log(1))?;
    assert!(!log.contains("Maglev table not written"), "{log}");
    let s = tcp(&w.c, &w.outside, &hostport(LB_IP, 80), 3)?;
    assert_eq!(keys(&s), [format!("pod-2 {NODE1}").as_str()].into(), "{s:?}");
    Ok(())
}
