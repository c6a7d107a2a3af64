//! Upgrades that change the pinned maps' layout: a `--max-*` flag changed
//! on a running node, and a new layout version (a change of meaning at the
//! same size). The new agent stages new maps beside the old ones, fills
//! them, moves every program over without a gap and carries the NAT and
//! affinity state; connections never notice, and no pin is left behind.
use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Result;
use lbtest::Cluster;
use lbtest::objects::Endpoint as E;
use lbtest::world::*;

fn pins(c: &Cluster) -> Result<BTreeSet<String>> {
    Ok(std::fs::read_dir(&c.nodes[0].bpffs)?.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
}

fn max_entries(c: &Cluster, map: &str) -> Result<u32> {
    Ok(aya::maps::MapInfo::from_pin(c.nodes[0].bpffs.join(map))?.max_entries())
}

fn upgrades_in_log(c: &Cluster) -> Result<usize> {
    Ok(std::fs::read_to_string(c.agent_log(1))?.matches("upgrade finished").count())
}

#[test]
fn upgrades_to_new_map_layouts_drop_no_connection_and_leave_no_pins() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    // Under load: short ClusterIP connections from a pod, one long NodePort
    // flow from outside (its NAT entries must survive), through two upgrades.
    let conns = w.c.probe_bg(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "1000000", "--interval-ms", "2", "--max-ms", "7000", "--timeout-ms", "1000"])?;
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--hold-ms", "7000", "--interval-ms", "20", "--timeout-ms", "1000"])?;
    std::thread::sleep(Duration::from_millis(700));
    let objects = w.c.objects.clone();

    // 1. --max-services changes on a running node: those maps get the new size.
    w.c.kill_agent(1);
    w.c.start_agent_env(1, &objects, &["--max-services", "100000"], &[])?;
    w.c.wait_for("the first upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    assert_eq!(max_entries(&w.c, lb_common::maps::SERVICES4)?, 100000);
    assert_eq!(max_entries(&w.c, lb_common::maps::REVNAT4)?, 65535, "REVNAT is capped at u16");
    std::thread::sleep(Duration::from_millis(700));

    // 2. A new layout version: every map is replaced, state carried over,
    // and the counters too (none goes back).
    let counted_conns = |w: &World| -> Result<u64> { Ok(w.c.frontend_stats(1, "10.96.0.10", 80, "TCP")?.0["conns"].as_u64().unwrap_or_default()) };
    let (translated, counted) = (datapath(&w.c, 1, "translated")?, counted_conns(&w)?);
    assert!(translated > 0 && counted > 0, "{translated} {counted}");
    w.c.kill_agent(1);
    w.c.start_agent_env(1, &objects, &["--max-services", "100000"], &[("LB_LAYOUT_VERSION", "99")])?;
    w.c.wait_for("the second upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 2))?;
    assert!(datapath(&w.c, 1, "translated")? >= translated && counted_conns(&w)? >= counted, "the counters came along");
    let log = std::fs::read_to_string(w.c.agent_log(1))?;
    let last = log.lines().rfind(|l| l.contains("upgrade finished")).unwrap();
    assert!(!last.contains("entries_carried=0"), "the NAT flow and the socket tracking came along: {last}");

    let s = Cluster::finish(conns)?;
    assert_eq!(s.failed(), 0, "no connect failed across both upgrades: {s:?}");
    assert!(s.ok > 500, "{s:?}");
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the NodePort flow kept going: {s:?}");

    // Nothing left of the old layout.
    let got = pins(&w.c)?;
    let mut want: BTreeSet<String> = lb_common::maps::ALL.iter().map(|m| m.to_string()).collect();
    want.insert("links".into());
    want.insert("layout-99".into());
    let extra: Vec<&String> = got.iter().filter(|p| !want.contains(*p) && !p.starts_with("reserved_ports_") && !p.starts_with("sysctl:")).collect();
    assert!(extra.is_empty(), "leftover pins: {extra:?}");
    let links: BTreeSet<String> =
        std::fs::read_dir(w.c.nodes[0].bpffs.join("links"))?.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert!(links.iter().all(|l| !l.ends_with("_new")), "{links:?}");
    Ok(())
}

fn lines_with(c: &Cluster, pat: &str) -> Result<Vec<String>> {
    Ok(std::fs::read_to_string(c.agent_log(1))?.lines().filter(|l| l.contains(pat)).map(String::from).collect())
}

/// A map whose key and value BTF changed meaning at the same sizes (what a
/// struct edit without a LAYOUT_VERSION bump would leave) is replaced; a
/// restart of the same build replaces nothing.
#[test]
fn a_map_of_another_btf_layout_is_replaced_and_the_same_layout_is_kept() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let objects = w.c.objects.clone();
    let backends = w.c.nodes[0].bpffs.join(lb_common::maps::BACKENDS4);

    // The same build again: every map is kept.
    w.c.kill_agent(1);
    w.c.start_agent_env(1, &objects, &[], &[])?;
    assert_eq!(lines_with(&w.c, "gets a new layout")?, Vec::<String>::new(), "a plain restart replaced maps");

    // The backends map now carries another BTF layout at the same sizes.
    w.c.kill_agent(1);
    lbtest::btfmap::replace_with_bogus_btf(&backends)?;
    // and the affinity table too: same sizes, other meaning, so its entries
    // must not be copied over byte for byte.
    lbtest::btfmap::replace_with_bogus_btf(&w.c.nodes[0].bpffs.join(lb_common::maps::AFFINITY))?;
    let conns = w.c.probe_bg(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "1000000", "--interval-ms", "5", "--max-ms", "4000", "--timeout-ms", "1000"])?;
    std::thread::sleep(Duration::from_millis(300));
    w.c.start_agent_env(1, &objects, &[], &[])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let replaced = lines_with(&w.c, "gets a new layout")?;
    let changed: Vec<&String> = replaced.iter().filter(|l| l.contains("btf_changed=true")).collect();
    assert_eq!(changed.len(), 2, "{replaced:?}");
    for (line, map) in changed.iter().zip([lb_common::maps::BACKENDS4, lb_common::maps::AFFINITY]) {
        assert!(line.contains(map), "{replaced:?}");
    }
    // The maps that hold the backends' and frontends' ids go with them,
    // so that the old programs read one numbering until they move; and
    // the counters keyed by those ids.
    use lb_common::maps as m;
    let along: BTreeSet<&str> = [m::SERVICES4, m::SERVICES6, m::BACKENDS6, m::REVNAT4, m::REVNAT6, m::AFFINITY_MATCH, m::SRC_RANGE, m::MAGLEV4, m::MAGLEV6]
        .into_iter()
        .filter(|name| replaced.iter().any(|l| l.contains(&format!("map=\"{name}\"")) && l.contains("goes with the services maps")))
        .collect();
    assert_eq!(along.len(), 9, "{replaced:?}");
    assert!(replaced.iter().any(|l| l.contains(m::SVC_STATS) && l.contains("renumbered")), "{replaced:?}");
    // The socket storage of pending connections, which names backends by
    // id (the storage of translations names frontends only: it stays).
    assert!(replaced.iter().any(|l| l.contains(m::SOCK_PENDING) && l.contains("numbered afresh")), "{replaced:?}");
    assert_eq!(replaced.len(), 13, "nothing else: {replaced:?}");
    let refused = lines_with(&w.c, "not carried over")?;
    assert!(refused.len() == 1 && refused[0].contains(lb_common::maps::AFFINITY), "{refused:?}");
    let s = Cluster::finish(conns)?;
    assert_eq!(s.failed(), 0, "no connect failed: {s:?}");
    assert!(s.ok > 100, "{s:?}");
    // bpftool reads the new map with the agent's own field names.
    let dump = lbtest::run("bpftool", &["-j", "map", "dump", "pinned", backends.to_str().unwrap()])?;
    assert!(dump.contains("\"port\""), "{dump}");
    let s = w.c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "5"])?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}

/// sessionAffinity entries of an agent from before `AffinityKey::proto`
/// (12-05; a TCP and a UDP frontend on one address and port shared them)
/// are carried over with the protocol of their backend: a client keeps
/// its pod across the upgrade.
#[test]
fn affinity_from_before_its_protocol_field_is_carried_with_each_entrys_protocol() -> Result<()> {
    use aya::maps::{HashMap, Map, MapData};
    let affinity = "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 10800\n";
    let mut w = world(&web("NodePort", affinity, &[]))?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let before = tcp(&w.c, &client, "10.96.0.10:80", 10)?;
    assert_eq!((before.ok, before.replies.len()), (10, 1), "one pod, by affinity: {before:?}");
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    let pin = w.c.nodes[0].bpffs.join(lb_common::maps::AFFINITY);
    let read = |pin: &std::path::Path| -> Result<Vec<([u8; 32], [u8; 16])>> {
        let m: HashMap<MapData, [u8; 32], [u8; 16]> = HashMap::try_from(Map::LruHashMap(MapData::from_pin(pin)?))?;
        Ok(m.iter().collect::<Result<_, _>>()?)
    };
    let entries = read(&pin)?;
    // The key's byte 27 is the protocol (TCP, 6).
    let tcp_entries: Vec<_> = entries.iter().filter(|(k, _)| k[27] == 6).copied().collect();
    assert_eq!(tcp_entries.len(), 1, "{entries:?}");

    // The map as the older agent had it: its key without `proto`, the
    // entry written there with that byte zero.
    lbtest::btfmap::replace_with_layout(
        &pin,
        &[("netns_cookie", "u64"), ("client", "[u8;16]"), ("rev_nat_id", "u16"), ("family", "u8"), ("_pad", "[u8;5]")],
        &[("last_used_ns", "u64"), ("backend_id", "u32"), ("_pad", "u32")],
    )?;
    {
        let mut old: HashMap<MapData, [u8; 32], [u8; 16]> = HashMap::try_from(Map::LruHashMap(MapData::from_pin(&pin)?))?;
        let (mut k, v) = tcp_entries[0];
        k[27] = 0;
        old.insert(k, v, 0)?;
    }
    w.c.start_agent_env(1, &objects, &[], &[])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let replaced = lines_with(&w.c, "gets a new layout")?;
    assert!(replaced.len() == 1 && replaced[0].contains(lb_common::maps::AFFINITY), "{replaced:?}");
    assert_eq!(lines_with(&w.c, "not carried over")?, Vec::<String>::new());
    // Carried, with TCP's protocol, before any new connect.
    assert_eq!(read(&pin)?, tcp_entries, "the entry in the new map");
    let after = tcp(&w.c, &client, "10.96.0.10:80", 10)?;
    assert_eq!(after.replies.keys().collect::<Vec<_>>(), before.replies.keys().collect::<Vec<_>>(), "the same pod: {after:?}");
    Ok(())
}

/// Pin node-1's IPv4 NAT table as an agent of another layout would have
/// it (entries without `created_ns`: 24 bytes where this agent's have
/// 32), holding the flows it held. Returns them, in this layout.
fn pin_nat4_without_created_ns(pin: &std::path::Path) -> Result<Vec<([u8; 16], [u8; 32])>> {
    use aya::maps::{HashMap, Map, MapData};
    let entries: Vec<([u8; 16], [u8; 32])> = {
        let m: HashMap<MapData, [u8; 16], [u8; 32]> = HashMap::try_from(Map::HashMap(MapData::from_pin(pin)?))?;
        m.iter().collect::<Result<_, _>>()?
    };
    lbtest::btfmap::replace_with_layout_sized(
        pin,
        &[("saddr", "[u8;4]"), ("daddr", "[u8;4]"), ("sport", "u16"), ("dport", "u16"), ("proto", "u8"), ("_pad", "[u8;3]")],
        &[
            ("to_saddr", "[u8;4]"),
            ("to_daddr", "[u8;4]"),
            ("to_sport", "u16"),
            ("to_dport", "u16"),
            ("flags", "u8"),
            ("state", "u8"),
            ("rev_nat_id", "u16"),
            ("last_seen_ns", "u64"),
        ],
    )?;
    let mut old: HashMap<MapData, [u8; 16], [u8; 24]> = HashMap::try_from(Map::HashMap(MapData::from_pin(pin)?))?;
    for (k, v) in &entries {
        let mut narrow = [0u8; 24];
        narrow[..16].copy_from_slice(&v[..16]);
        narrow[16..].copy_from_slice(&v[24..]);
        old.insert(k, narrow, 0)?;
    }
    Ok(entries)
}

/// `--max-nat` lowered below the flows the table holds (four held
/// connections, eight entries, into a table of four): the upgrade
/// carries what fits, and says how many entries it could not (before
/// 12-06's second session they were dropped without a word).
#[test]
fn an_upgrade_that_cannot_carry_every_flow_says_so() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    // Held connections: their flows stay while the upgrade copies them.
    let held: Vec<_> = (0..4)
        .map(|_| w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--hold-ms", "4000", "--interval-ms", "100", "--timeout-ms", "1000"]))
        .collect::<Result<_>>()?;
    let outside = w.outside.ip.clone();
    w.c.wait_for("their flows", Duration::from_secs(5), || Ok(flows_from(&w.c, &outside)?.len() >= 4))?;
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--max-nat", "4"])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let lost = lines_with(&w.c, "entries not carried into the new map")?;
    assert!(lost.iter().any(|l| l.contains("LB4_NAT") && l.contains("entries=")), "{lost:?}");
    // (Some of them are reset: what did not fit.)
    for h in held {
        let _ = Cluster::finish(h);
    }
    Ok(())
}

/// An upgrade across a change of the NAT entry's layout, to an agent
/// without `--bpf-forward`, after an agent without it too (whose flags no
/// longer say `BPF_FORWARD`) kept the pod programs for flows an agent with
/// it masqueraded in BPF: those flows cannot be counted in tables of
/// another layout until the upgrade carries them, so the pod programs
/// stay, and a connection masqueraded so goes on. Before 12-06's second
/// session the new agent counted none, took the pod programs off at its
/// start, and the connection's replies went to the node untranslated.
#[test]
fn an_upgrade_across_a_nat_layout_keeps_the_pod_programs_for_flows_masqueraded_in_bpf() -> Result<()> {
    let gc = ["--nat-tcp-close-timeout", "1", "--nat-udp-timeout", "3", "--nat-gc-interval", "1"];
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP]), &[&["--bpf-forward"][..], &gc].concat())?;
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(LB_IP, 80), "--hold-ms", "6000", "--interval-ms", "50", "--timeout-ms", "1000"])?;
    let outside = w.outside.ip.clone();
    w.c.wait_for("its flow", Duration::from_secs(5), || Ok(!flows_from(&w.c, &outside)?.is_empty()))?;
    // An agent without --bpf-forward: the pod programs stay for the flow.
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &[&["--bpf-forward=false"][..], &gc].concat())?;
    w.c.kill_agent(1);
    let objects = w.c.objects.clone();
    pin_nat4_without_created_ns(&w.c.nodes[0].bpffs.join(lb_common::maps::NAT4))?;
    w.c.start_agent_env(1, &objects, &[&["--bpf-forward=false"][..], &gc].concat(), &[])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the connection masqueraded in BPF across the upgrade: {s:?}");
    assert_eq!(s.replies.keys().map(|k| k.split(' ').next().unwrap_or_default()).collect::<Vec<_>>(), ["pod-1"], "{s:?}");
    Ok(())
}

/// NAT flows pinned by an agent whose flow entry had a field fewer (here
/// without `created_ns`, 24 bytes where this agent's have 32) are carried
/// into this agent's table field by field, the new field at zero: outside
/// connections through the node go on across the upgrade (before 12-08
/// an entry of another layout was left behind, and every such connection
/// was reset once the programs moved). The connections are made first;
/// the old table, as the older agent would have pinned it, holds their
/// flows.
#[test]
fn nat_flows_of_an_entry_layout_with_a_field_fewer_are_carried_by_name() -> Result<()> {
    use aya::maps::{HashMap, Map, MapData};
    let mut w = world(&web("NodePort", "", &[]))?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let started = std::time::Instant::now();
    let held: Vec<_> = (0..4)
        .map(|_| w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--hold-ms", "10000", "--interval-ms", "20", "--timeout-ms", "1000"]))
        .collect::<Result<_>>()?;
    let outside = w.outside.ip.clone();
    w.c.wait_for("their flows", Duration::from_secs(5), || Ok(flows_from(&w.c, &outside)?.len() >= 4))?;
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    let pin = w.c.nodes[0].bpffs.join(lb_common::maps::NAT4);
    let entries = pin_nat4_without_created_ns(&pin)?;
    assert!(entries.len() >= 8, "two entries per flow: {}", entries.len());
    // One more flow, written after the first copy (while the upgrade waits
    // before the programs move): the second copy carries it.
    // A UDP flow to pod-1, both its entries, seen now (CLOCK_MONOTONIC,
    // the programs' clock).
    let late: [u8; 16] = [192, 168, 77, 100, 192, 168, 77, 11, 0x99, 0x99, 0x75, 0x80, 17, 0, 0, 0];
    let late_reply: [u8; 16] = [10, 244, 1, 10, 192, 168, 77, 100, 0x1f, 0x90, 0x99, 0x99, 17, 0, 0, 0];
    let seen = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)?;
    let seen_ns = (seen.tv_sec() as u64 * 1_000_000_000 + seen.tv_nsec() as u64).to_ne_bytes();
    let (mut late_value, mut reply_value) = ([0u8; 24], [0u8; 24]);
    late_value[..12].copy_from_slice(&[192, 168, 77, 100, 10, 244, 1, 10, 0x99, 0x99, 0x1f, 0x90]);
    reply_value[..12].copy_from_slice(&[192, 168, 77, 11, 192, 168, 77, 100, 0x75, 0x80, 0x99, 0x99]);
    reply_value[12] = 1; // nat_flags::REPLY
    late_value[16..].copy_from_slice(&seen_ns);
    reply_value[16..].copy_from_slice(&seen_ns);
    w.c.start_agent_env_until(1, &objects, &[], &[("LB_UPGRADE_PAUSE_MS", "1500")], "paused before the programs move")?;
    {
        let mut old: HashMap<MapData, [u8; 16], [u8; 24]> = HashMap::try_from(Map::HashMap(MapData::from_pin(&pin)?))?;
        old.insert(late, late_value, 0)?;
        old.insert(late_reply, reply_value, 0)?;
    }
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    assert!(started.elapsed() < Duration::from_secs(9), "upgraded while the connections were held: {:?}", started.elapsed());
    assert_eq!(lines_with(&w.c, "carried field by field")?.len(), 1, "{:?}", lines_with(&w.c, "upgrade:")?);
    assert_eq!(lines_with(&w.c, "not carried over")?, Vec::<String>::new());
    // In the new table: each flow's translation, its creation time unknown
    // (the new programs add none on a flow they found).
    let now: std::collections::HashMap<[u8; 16], [u8; 32]> = {
        let m: HashMap<MapData, [u8; 16], [u8; 32]> = HashMap::try_from(Map::HashMap(MapData::from_pin(&pin)?))?;
        m.iter().collect::<Result<_, _>>()?
    };
    assert_eq!(now.get(&late).map(|v| &v[..16]), Some(&late_value[..16]), "the flow added after the first copy");
    for (k, v) in &entries {
        let got = now.get(k).unwrap_or_else(|| panic!("flow {k:?} carried: {now:?}"));
        // Addresses, ports and flags (the state may move on).
        assert_eq!((&got[..13], &got[16..24]), (&v[..13], &[0u8; 8][..]), "{k:?}");
    }
    for h in held {
        let s = Cluster::finish(h)?;
        assert_eq!(s.failed(), 0, "the connection kept going across the upgrade: {s:?}");
        assert!(s.ok > 100, "{s:?}");
    }
    Ok(())
}

/// An upgrade that replaces the backends map (a `--max-backends` change)
/// replaces every map holding backend and frontend ids with it, and keeps
/// every id: the old programs read one numbering until they move (before,
/// the first sync wrote the new numbering's ids into the live services map,
/// which the old programs resolved in the old backends map: a connect went
/// to another Service's backend holding that id, or was refused), and the
/// sockets, flows and affinity that name ids keep them. Ids here are not
/// 1..n: a Service came and went before "late".
#[test]
fn an_upgrade_that_replaces_the_backends_map_keeps_every_id() -> Result<()> {
    use lbtest::objects::{Endpoint as E, service_ips, slice_of};
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    w.c.serve_as(&w.p1, "gone-8081", 8081)?;
    w.c.serve_as(&w.p1, "late-8082", 8082)?;
    w.c.write_object("gone.yaml", &service_ips("gone", &["10.96.0.20"], &[("http", 80, 8081, "TCP")], ""))?;
    w.c.write_object("gone-slice.yaml", &slice_of("gone", "gone-1", "IPv4", &[("http", 8081, "TCP")], &[E::ready(&w.p1.ip, "node-1")]))?;
    wait_backends(&w.c, 1, "10.96.0.20", 80, 1)?;
    w.c.remove_object("gone.yaml")?;
    w.c.remove_object("gone-slice.yaml")?;
    w.c.write_object("late.yaml", &service_ips("late", &["10.96.0.30"], &[("http", 80, 8082, "TCP")], ""))?;
    w.c.write_object("late-slice.yaml", &slice_of("late", "late-1", "IPv4", &[("http", 8082, "TCP")], &[E::ready(&w.p1.ip, "node-1")]))?;
    wait_backends(&w.c, 1, "10.96.0.30", 80, 1)?;
    // Every frontend's rev_nat_id and its backends' ids.
    let ids = |w: &World| -> Result<BTreeSet<String>> {
        let l = w.c.list(1)?;
        Ok(l["frontends"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|f| {
                let b: Vec<String> = f["backends"].as_array().into_iter().flatten().map(|b| format!("{}={}", b["address"], b["id"])).collect();
                format!("{}:{}/{} rev={} {b:?}", f["address"], f["port"], f["protocol"], f["rev_nat_id"])
            })
            .collect())
    };
    let before = ids(&w)?;
    assert!(before.iter().any(|l| l.contains("10.96.0.30")), "{before:?}");
    let late = w.c.probe_bg(&client, &["tcp", "--addr", "10.96.0.30:80", "--count", "1000000", "--interval-ms", "2", "--max-ms", "4000", "--timeout-ms", "1000"])?;
    std::thread::sleep(Duration::from_millis(500));
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    w.c.start_agent_env(1, &objects, &["--max-backends", "70000"], &[])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    assert_eq!(max_entries(&w.c, lb_common::maps::BACKENDS4)?, 70000);
    assert!(lines_with(&w.c, "goes with the services maps")?.iter().any(|l| l.contains(lb_common::maps::SERVICES4)));
    assert_eq!(ids(&w)?, before, "every frontend and backend kept its id");
    let s = Cluster::finish(late)?;
    assert_eq!((s.failed(), keys(&s)), (0, ["late-8082"].into()), "only late's pod answered, throughout: {s:?}");
    assert!(s.ok > 300, "{s:?}");
    Ok(())
}

#[test]
fn a_half_finished_upgrade_is_started_over() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    // What an agent killed in the middle of an upgrade leaves: a staged map.
    w.c.kill_agent(1);
    let next = w.c.nodes[0].bpffs.join("next");
    std::fs::create_dir_all(&next)?;
    lbtest::run(
        "bpftool",
        &["map", "create", next.join(lb_common::maps::SERVICES4).to_str().unwrap(), "type", "hash", "key", "12", "value", "16", "entries", "16", "name", "staged"],
    )?;
    let objects = w.c.objects.clone();
    w.c.start_agent_env(1, &objects, &[], &[])?;
    assert!(std::fs::read_to_string(w.c.agent_log(1))?.contains("an earlier upgrade did not finish"));
    assert!(!next.exists(), "the staged leftovers are gone");
    let s = w.c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "5"])?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}

/// Pins name a device as a pin name can hold it ("eth0.100", a VLAN, as
/// "eth0_100"). An upgrade finds each device again by that spelling and
/// moves its program to the new maps: here a pod device named "vp.3" with
/// the pod program (`--bpf-forward`).
#[test]
fn an_upgrade_moves_the_programs_of_devices_whose_pins_spell_them_otherwise() -> Result<()> {
    use lbtest::objects::Endpoint as E;
    let mut w = world_with(&web("NodePort", "", &[]), &["--bpf-forward"])?;
    let p3 = w.c.add_pod(1, "pod-3")?;
    let node = w.c.nodes[0].netns.clone();
    let dev = format!("v{}", p3.ip.rsplit('.').next().unwrap_or_default());
    for args in [vec!["link", "set", &dev, "down"], vec!["link", "set", &dev, "name", "vp.3"], vec!["link", "set", "vp.3", "up"]] {
        let mut cmd = vec!["ip"];
        cmd.extend(args);
        w.c.in_netns(&node, &cmd)?;
    }
    w.c.serve_reporting_peer(&p3, 8080)?;
    set_endpoints(&w, &[(&p3, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &p3)?;
    let pin = w.c.nodes[0].bpffs.join("links").join("lb_pod_ingress_vp_3");
    w.c.wait_for("the pod program pinned for vp.3", Duration::from_secs(10), || Ok(pin.exists()))?;

    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    w.c.start_agent_env(1, &objects, &["--bpf-forward"], &[("LB_LAYOUT_VERSION", "99")])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let warned: Vec<String> = lines_with(&w.c, "upgrade:")?.into_iter().filter(|l| l.contains("WARN")).collect();
    assert!(warned.is_empty(), "every pinned device was found again: {warned:?}");
    // The program on vp.3 reads the maps now pinned.
    let nat = aya::maps::MapInfo::from_pin(w.c.nodes[0].bpffs.join(lb_common::maps::NAT4))?.id();
    let (_, progs) = lbtest::with_netns(Some(&node), || {
        Ok(aya::programs::SchedClassifier::query_tcx("vp.3", aya::programs::TcAttachType::Ingress)?)
    })?;
    let maps: Vec<u32> = progs.iter().filter(|p| p.name_as_str() == Some("lb_pod_ingress")).flat_map(|p| p.map_ids().ok().flatten().unwrap_or_default()).collect();
    assert!(maps.contains(&nat), "the pod program on vp.3 uses the new {} ({nat}): {maps:?}", lb_common::maps::NAT4);
    let s = tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    Ok(())
}

/// An upgrade on a node with no external frontend (ClusterIPs only, not
/// served from outside: `--external-cluster-ip=false`), whose pod
/// programs run for `--per-packet-lb`, moves them to the pods' devices
/// only: the node's uplink, a veth here as on a kind node, gets none.
/// Before, the upgrade listed pod devices excluding NodePort devices only,
/// none without an external frontend, and put the pod programs on the
/// uplink too, where they saw every packet of the node.
#[test]
fn an_upgrade_without_nodeport_devices_leaves_the_uplink_veth_alone() -> Result<()> {
    let svc = lbtest::objects::service_ips("web", &["10.96.0.10"], &[("http", 80, 8080, "TCP")], "");
    let flags = ["--per-packet-lb", "--external-cluster-ip=false"];
    let mut w = world_with(&svc, &flags)?;
    let node = w.c.nodes[0].netns.clone();
    let pod_dev = format!("v{}", w.p1.ip.rsplit('.').next().unwrap_or_default());
    let on = |dev: &str| lbtest::tc_program_on(&node, dev, "lb_pod_ingress");
    w.c.wait_for("the pod program on pod-1's device", Duration::from_secs(10), || on(&pod_dev))?;
    assert!(!on("eth0")?, "none on the uplink before the upgrade");
    assert!(lines_with(&w.c, "NodePort programs attached")?.is_empty(), "no NodePort device: no external frontend");
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    w.c.start_agent_env(1, &objects, &flags, &[("LB_LAYOUT_VERSION", "99")])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    assert!(on(&pod_dev)?, "the pod program moved on pod-1's device");
    assert!(!on("eth0")?, "none on the uplink after the upgrade");
    // Not even for the moment until the sync after the move took them
    // off again.
    let on_uplink = lines_with(&w.c, "pod device:")?.into_iter().filter(|l| l.contains(r#"iface="eth0""#)).collect::<Vec<_>>();
    assert!(on_uplink.is_empty(), "{on_uplink:?}");
    let s = tcp(&w.c, &w.p2, "10.96.0.10:80", 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    Ok(())
}

/// Counters pinned by an agent from before `SvcStats::source_range` (12-05:
/// `LB_SVC_STATS` values of 40 bytes) and before `sock_tracked` (24
/// datapath counters) come along into the wider maps: no counter goes back
/// (a Prometheus counter that drops reads as a reset). `lb-agent list
/// --stats` reads such pins too.
#[test]
fn counters_from_before_the_source_range_counter_are_carried_over() -> Result<()> {
    use aya::maps::{HashMap, Map, MapData};
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    assert_eq!(tcp(&w.c, &client, "10.96.0.10:80", 10)?.ok, 10);
    let (stats, backends) = w.c.frontend_stats(1, "10.96.0.10", 80, "TCP")?;
    assert_eq!((stats["conns"].as_u64(), backends), (Some(10), 10), "{stats}");
    let translated = datapath(&w.c, 1, "translated")?;
    assert!(translated >= 10, "{translated}");
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);

    // The same counters in the old layout: the first five fields.
    let pin = w.c.nodes[0].bpffs.join(lb_common::maps::SVC_STATS);
    let entries: Vec<([u8; 8], [u8; 48])> = {
        let wide: HashMap<MapData, [u8; 8], [u8; 48]> = HashMap::try_from(Map::HashMap(MapData::from_pin(&pin)?))?;
        wide.iter().collect::<Result<_, _>>()?
    };
    assert!(entries.len() >= 3, "the frontend and its two backends: {entries:?}");
    std::fs::remove_file(&pin)?;
    let max = (lb_common::capacity::REVNAT + lb_common::capacity::BACKENDS).to_string();
    lbtest::run("bpftool", &["map", "create", pin.to_str().unwrap(), "type", "hash", "key", "8", "value", "40", "entries", &max, "name", "LB_SVC_STATS"])?;
    {
        let mut narrow: HashMap<MapData, [u8; 8], [u8; 40]> = HashMap::try_from(Map::HashMap(MapData::from_pin(&pin)?))?;
        for (k, v) in &entries {
            narrow.insert(k, <[u8; 40]>::try_from(&v[..40])?, 0)?;
        }
    }

    // And the datapath counters as they were before sock_tracked and
    // sock_untracked: 24 of them.
    let stats_pin = w.c.nodes[0].bpffs.join(lb_common::maps::STATS);
    let per_cpu: Vec<aya::maps::PerCpuValues<u64>> = {
        let wide: aya::maps::PerCpuArray<MapData, u64> = aya::maps::PerCpuArray::try_from(Map::PerCpuArray(MapData::from_pin(&stats_pin)?))?;
        (0..24).map(|i| wide.get(&i, 0)).collect::<Result<_, _>>()?
    };
    std::fs::remove_file(&stats_pin)?;
    lbtest::run("bpftool", &["map", "create", stats_pin.to_str().unwrap(), "type", "percpu_array", "key", "4", "value", "8", "entries", "24", "name", "LB_STATS"])?;
    {
        let mut narrow: aya::maps::PerCpuArray<MapData, u64> = aya::maps::PerCpuArray::try_from(Map::PerCpuArray(MapData::from_pin(&stats_pin)?))?;
        for (i, v) in per_cpu.into_iter().enumerate() {
            narrow.set(i as u32, v, 0)?;
        }
    }

    // This `lb-agent list` reads the older agent's pins as they are (an
    // operator's newer CLI, no agent running).
    let (stats, backends) = w.c.frontend_stats(1, "10.96.0.10", 80, "TCP")?;
    assert_eq!((stats["conns"].as_u64(), stats["source_range"].as_u64(), backends), (Some(10), Some(0), 10), "listed from the old pins: {stats}");

    w.c.start_agent_env(1, &objects, &[], &[])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let replaced = lines_with(&w.c, "gets a new layout")?;
    assert!(
        replaced.len() == 2 && [lb_common::maps::STATS, lb_common::maps::SVC_STATS].iter().all(|m| replaced.iter().any(|l| l.contains(m))),
        "{replaced:?}"
    );
    assert_eq!(aya::maps::MapInfo::from_pin(&pin)?.value_size(), 48);
    assert_eq!(aya::maps::MapInfo::from_pin(&stats_pin)?.max_entries(), lb_common::stats::COUNT);
    assert_eq!(datapath(&w.c, 1, "translated")?, translated, "the datapath counters came along, once");
    let (stats, backends) = w.c.frontend_stats(1, "10.96.0.10", 80, "TCP")?;
    assert_eq!((stats["conns"].as_u64(), stats["source_range"].as_u64(), backends), (Some(10), Some(0), 10), "carried over: {stats}");
    assert_eq!(tcp(&w.c, &client, "10.96.0.10:80", 5)?.ok, 5);
    let (stats, backends) = w.c.frontend_stats(1, "10.96.0.10", 80, "TCP")?;
    assert_eq!((stats["conns"].as_u64(), backends), (Some(15), 15), "and counting on: {stats}");
    Ok(())
}

/// Per-frontend counters follow their frontend, not its id: an upgrade that
/// cannot carry the frontends' ids (the rev-NAT map's layout changed)
/// numbers them afresh ("extra", numbered after "web"'s frontends, comes
/// second by address); its counters come along to its new id, web's to
/// theirs, and none lands on another frontend.
/// And a socket held across it, whose translation storage went with the
/// old storage map, no longer counts in `lb_sockets_tracked`.
#[test]
fn counters_follow_their_frontend_not_its_id_across_an_upgrade() -> Result<()> {
    use lbtest::objects::{Endpoint as E, service_ips, slice_of};
    const EXTRA: &str = "10.96.0.20";
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    // A backend of its own: pod-1 on another port.
    w.c.serve(&w.p1, 8081)?;
    w.c.write_object("extra.yaml", &service_ips("extra", &[EXTRA], &[("http", 80, 8081, "TCP")], ""))?;
    w.c.write_object("extra-slice.yaml", &slice_of("extra", "extra-1", "IPv4", &[("http", 8081, "TCP")], &[E::ready(&w.p1.ip, "node-1")]))?;
    wait_backends(&w.c, 1, EXTRA, 80, 1)?;
    let id = |w: &World| -> Result<u64> {
        let l = w.c.list(1)?;
        let f = l["frontends"].as_array().into_iter().flatten().find(|f| f["address"] == EXTRA);
        Ok(f.and_then(|f| f["rev_nat_id"].as_u64()).unwrap_or_default())
    };
    let before = id(&w)?;
    assert_eq!(tcp(&w.c, &client, &format!("{EXTRA}:80"), 7)?.ok, 7);
    assert_eq!(tcp(&w.c, &client, "10.96.0.10:80", 4)?.ok, 4);
    let held = w.c.probe_bg(&client, &["tcp", "--addr", &format!("{EXTRA}:80"), "--hold-ms", "5000", "--interval-ms", "100", "--timeout-ms", "1000"])?;
    let live = |w: &World| -> Result<i64> { Ok(datapath(&w.c, 1, "sock_tracked")? as i64 - datapath(&w.c, 1, "sock_untracked")? as i64) };
    w.c.wait_for("the held socket tracked", Duration::from_secs(5), || Ok(live(&w)? == 1))?;
    assert_eq!(w.c.frontend_stats(1, EXTRA, 80, "TCP")?.0["conns"].as_u64(), Some(8));

    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    // The IPv4 rev-NAT map in another layout, holding the same bytes.
    {
        use aya::maps::{HashMap, Map, MapData};
        let pin = w.c.nodes[0].bpffs.join(lb_common::maps::REVNAT4);
        let entries: Vec<([u8; 2], [u8; 8])> = {
            let m: HashMap<MapData, [u8; 2], [u8; 8]> = HashMap::try_from(Map::HashMap(MapData::from_pin(&pin)?))?;
            m.iter().collect::<Result<_, _>>()?
        };
        lbtest::btfmap::replace_with_layout(&pin, &[("id", "u16")], &[("address", "[u8;4]"), ("port", "u16"), ("unused", "u16")])?;
        let mut m: HashMap<MapData, [u8; 2], [u8; 8]> = HashMap::try_from(Map::HashMap(MapData::from_pin(&pin)?))?;
        for (k, v) in &entries {
            m.insert(k, v, 0)?;
        }
    }
    w.c.start_agent_env(1, &objects, &[], &[("LB_LAYOUT_VERSION", "99")])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let after = id(&w)?;
    assert!(before > 0 && after > 0 && after != before, "the upgrade numbered the frontend afresh: {before} -> {after}");
    let (stats, backends) = w.c.frontend_stats(1, EXTRA, 80, "TCP")?;
    assert_eq!((stats["conns"].as_u64(), backends), (Some(8), 8), "its counters followed it: {stats}");
    let l = w.c.list_with(1, &["--stats"])?;
    let mut others = 0;
    for f in l["frontends"].as_array().into_iter().flatten().filter(|f| f["address"] != EXTRA) {
        // (A frontend's TCP and UDP share its rev_nat_id, and so its counters.)
        let web = f["address"] == "10.96.0.10" && f["port"] == 80;
        assert_eq!(f["stats"]["conns"].as_u64(), Some(if web { 4 } else { 0 }), "no other frontend got its counters: {f}");
        others += 1;
    }
    assert!(others >= 4, "web's frontends are there: {l}");
    assert_eq!(live(&w)?, 0, "the held socket's storage went with the old map");
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "{s:?}");
    assert_eq!(live(&w)?, 0, "and its release is not counted");
    Ok(())
}

/// An upgrade that replaces the socket storage map alone (its BTF layout
/// changed at the same sizes: a field renamed) counts the storage the old
/// map held as released: it goes with the old map, and no release program
/// will see it. The datapath counters are replaced with it for that, so
/// that what the old programs counted is told apart from the new ones'.
#[test]
fn sockets_of_a_replaced_storage_map_leave_lb_sockets_tracked() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let live = |w: &World| -> Result<i64> { Ok(datapath(&w.c, 1, "sock_tracked")? as i64 - datapath(&w.c, 1, "sock_untracked")? as i64) };
    let base = live(&w)?;
    let held = w.c.probe_bg(&client, &["tcp", "--addr", "10.96.0.10:80", "--hold-ms", "5000", "--interval-ms", "100", "--timeout-ms", "1000"])?;
    w.c.wait_for("the held socket tracked", Duration::from_secs(5), || Ok(live(&w)? == base + 1))?;
    let translated = datapath(&w.c, 1, "translated")?;

    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    lbtest::btfmap::replace_with_bogus_btf(&w.c.nodes[0].bpffs.join(lb_common::maps::SOCK_XLATE))?;
    w.c.start_agent_env(1, &objects, &[], &[])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let replaced = lines_with(&w.c, "gets a new layout")?;
    assert!(
        replaced.len() == 2 && replaced[0].contains(lb_common::maps::SOCK_XLATE) && replaced[1].contains(lb_common::maps::STATS),
        "the storage map, and the counters with it: {replaced:?}"
    );
    assert_eq!(live(&w)?, base, "the held socket's storage went with the old map");
    assert_eq!(datapath(&w.c, 1, "translated")?, translated, "the other counters came along");
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "{s:?}");
    assert_eq!(live(&w)?, base, "and its release is not counted");
    // Sockets of the new storage map count as before.
    assert_eq!(tcp(&w.c, &client, "10.96.0.10:80", 3)?.ok, 3);
    assert_eq!((live(&w)?, datapath(&w.c, 1, "translated")?), (base, translated + 3));
    Ok(())
}

/// Until an upgrade finishes (after the new agent's first sync, which an
/// API server failing every request holds back here), the old programs
/// still count into the old maps: the metrics read those, not the staged
/// maps' zeros (a reset, then a jump, to Prometheus), and the per-service
/// series are absent (the staged map is empty: a gap); when it finishes, no
/// counter goes back or jumps.
#[test]
fn metrics_read_the_live_counters_while_an_upgrade_waits_for_its_first_sync() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    assert_eq!(tcp(&w.c, &client, "10.96.0.10:80", 10)?.ok, 10);
    let scrape = |w: &World| -> Result<(u64, bool)> {
        let (_, m) = w.c.http(1, "127.0.0.1:10249", "/metrics")?;
        let translated = m.lines().find_map(|l| l.strip_prefix("lb_datapath_events_total{result=\"translated\"} ")?.trim().parse().ok());
        Ok((translated.unwrap_or_default(), m.contains("lb_frontend_connections_total{")))
    };
    let api = w.c.start_apiserver(1, false)?;
    w.c.kill_agent(1);
    w.c.start_agent_kube(1, &api.kubeconfig, &["--metrics-per-service"])?;
    let (before, per_service) = scrape(&w)?;
    assert!(before >= 10 && per_service, "{before}");
    api.control("/lbtest/fail?code=500&count=1000000")?;
    w.c.kill_agent(1);
    w.c.start_agent_kube_unsynced(1, &api.kubeconfig, &["--metrics-per-service"], &[("LB_LAYOUT_VERSION", "99")])?;
    assert!(w.c.nodes[0].bpffs.join("next").join(lb_common::maps::STATS).exists(), "staged, not finished");
    assert_eq!(scrape(&w)?, (before, false), "the live counters; no per-service series");
    assert_eq!(tcp(&w.c, &client, "10.96.0.10:80", 5)?.ok, 5);
    assert_eq!(scrape(&w)?, (before + 5, false), "the old programs count on");
    api.control("/lbtest/fail?code=500&count=0")?;
    w.c.wait_for("the upgrade", Duration::from_secs(30), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    assert_eq!(scrape(&w)?, (before + 5, true), "carried over: no jump, no reset");
    assert_eq!(tcp(&w.c, &client, "10.96.0.10:80", 5)?.ok, 5);
    assert_eq!(scrape(&w)?.0, before + 10);
    Ok(())
}

/// Endpoints that leave while no agent runs, and the next agent upgrades
/// the maps: the first sync's sweep judged the staged maps, still empty,
/// so the sweep runs again once the upgrade brought the old programs'
/// flows and sockets along. An outside NodePort flow to pod-1 is reset
/// (before, it went on to the pod that left, and a UDP flow would have,
/// for as long as its client kept sending), and a pod's connected UDP
/// socket to pod-1 is told (its entry in `LB_SOCK_UDP`, by which the
/// destroyer finds it, now comes along too), and so is its TCP socket
/// through the ClusterIP (since 12-06 the socket storage that names its
/// frontend is kept across a layout-version upgrade: before, it went with
/// the old storage map, and the socket went on to the pod that left).
#[test]
fn flows_and_sockets_to_endpoints_that_left_before_an_upgrade_are_ended_after_it() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    set_endpoints(&w, &[(&w.p1, lbtest::objects::Endpoint::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--hold-ms", "6000", "--interval-ms", "20", "--timeout-ms", "1000"])?;
    let udp = w.c.probe_bg(&client, &["udp-stream", "--addr", "10.96.0.10:80", "--keep-on-timeout", "--interval-ms", "20", "--max-ms", "6000"])?;
    let via_vip = w.c.probe_bg(&client, &["tcp", "--addr", "10.96.0.10:80", "--hold-ms", "6000", "--interval-ms", "20", "--timeout-ms", "1000"])?;
    std::thread::sleep(Duration::from_millis(700));
    // No agent: pod-1 leaves the Service (it still answers); the next
    // agent upgrades every map.
    w.c.kill_agent(1);
    set_endpoints(&w, &[(&w.p2, lbtest::objects::Endpoint::ready)])?;
    let objects = w.c.objects.clone();
    w.c.start_agent_env(1, &objects, &[], &[("LB_LAYOUT_VERSION", "99")])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let s = Cluster::finish(held)?;
    assert!(!s.replies.is_empty() && s.replies.keys().all(|r| r.starts_with("pod-1")), "{s:?}");
    assert_eq!(s.errors.keys().collect::<Vec<_>>(), ["ECONNRESET"], "the flow to pod-1 was reset after the upgrade: {s:?}");
    let u = Cluster::finish(udp)?;
    assert!(u.replies.iter().any(|(r, n)| r.starts_with("pod-2") && *n > 10), "the client connected again, to pod-2: {u:?}");
    assert!(u.errors.contains_key("ECONNABORTED") || u.errors.contains_key("EDESTADDRREQ"), "told by an error: {u:?}");
    let t = Cluster::finish(via_vip)?;
    assert!(!t.replies.is_empty() && t.replies.keys().all(|r| r.starts_with("pod-1")), "{t:?}");
    assert_eq!(t.errors.keys().collect::<Vec<_>>(), ["ECONNABORTED"], "the socket to pod-1 was destroyed after the upgrade: {t:?}");
    Ok(())
}

/// Entries in the pinned map `name` of node-1 (the one the running
/// programs use, not a staged one).
/// While an upgrade waits for its first sync (an API server failing every
/// request here), the old programs still make flows in the old NAT
/// tables: the new agent expires them there too (before, only the staged
/// tables were, so the live ones only grew until new flows were refused).
#[test]
fn the_live_nat_tables_are_expired_while_an_upgrade_waits_for_its_first_sync() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let api = w.c.start_apiserver(1, false)?;
    let flags = ["--nat-udp-timeout", "2", "--nat-gc-interval", "1"];
    w.c.kill_agent(1);
    w.c.start_agent_kube(1, &api.kubeconfig, &flags)?;
    api.control("/lbtest/fail?code=500&count=1000000")?;
    w.c.kill_agent(1);
    let killed = std::time::Instant::now();
    w.c.start_agent_kube_unsynced(1, &api.kubeconfig, &flags, &[("LB_LAYOUT_VERSION", "99")])?;
    assert!(w.c.nodes[0].bpffs.join("next").join(lb_common::maps::NAT4).exists(), "staged, not finished");
    let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(NODE1, 30080), "--count", "3"])?;
    assert_eq!(s.ok, 3, "the old programs serve: {s:?}");
    assert!(map_entries(&w.c, 1, lb_common::maps::NAT4)? >= 3, "their flows are in the old table");
    // ... which `lb-agent nat` shows (before 12-05: the staged one, empty).
    let outside = w.outside.ip.clone();
    assert_eq!(flows_from(&w.c, &outside)?.len(), 3, "{:?}", flows_from(&w.c, &outside)?);
    w.c.wait_for("the old table's idle flows to expire", Duration::from_secs(8), || Ok(map_entries(&w.c, 1, lb_common::maps::NAT4)? == 0))?;
    // The old agent's kernel timer walks the live tables once its
    // heartbeat is 10 s old: the new agent writes that one too, so it
    // stays idle while an agent runs (the metrics read the live counters).
    let walks = datapath(&w.c, 1, "nat_walks_without_agent")?;
    std::thread::sleep(Duration::from_secs(13).saturating_sub(killed.elapsed()));
    assert_eq!(datapath(&w.c, 1, "nat_walks_without_agent")?, walks, "no walk of the live tables while the new agent runs");
    assert!(w.c.nodes[0].bpffs.join("next").exists(), "still waiting for the first sync");
    api.control("/lbtest/fail?code=500&count=0")?;
    w.c.wait_for("the upgrade", Duration::from_secs(30), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    // The kernel's own expiry was armed on the new maps once the programs
    // moved (the old timer went with the old maps): with no agent, it
    // expires their flows.
    kernel_expires_them(&mut w)
}

/// An upgrade that replaces only the NAT tables (`--max-nat` changed)
/// shares the earlier kernel expiry timer: the new agent takes it over
/// once the programs moved to the new tables, so that it then walks
/// those (not the old ones, which its earlier program would go on walking
/// and holding), and their flows expire once no agent runs.
#[test]
fn the_kernel_expiry_follows_nat_tables_an_upgrade_replaced() -> Result<()> {
    let flags = ["--nat-udp-timeout", "2", "--nat-gc-interval", "1"];
    let mut w = world_with(&web("NodePort", "", &[]), &flags)?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let timer = aya::maps::MapInfo::from_pin(w.c.nodes[0].bpffs.join(lb_common::maps::NAT_TIMER))?.id();
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &[&flags[..], &["--max-nat", "100000"]].concat())?;
    w.c.wait_for("the upgrade", Duration::from_secs(20), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    assert_eq!(max_entries(&w.c, lb_common::maps::NAT4)?, 100000);
    let same = aya::maps::MapInfo::from_pin(w.c.nodes[0].bpffs.join(lb_common::maps::NAT_TIMER))?.id();
    assert_eq!(same, timer, "the timer's map was kept (shared by the upgrade)");
    kernel_expires_them(&mut w)
}

/// An upgrade from a release whose `LB_NAT_TIMER` values were smaller (56
/// bytes: before 12-06's sixth session added the timer's last look and
/// its IPv6 half-round) replaces that map alone, and arms its own timer at
/// start, which walks the NAT tables it keeps: `lb-agent nat` says armed,
/// and once no agent runs their flows expire. (The earlier release's
/// timer, faked here by a bare array of its size, went when its pin did.)
#[test]
fn an_upgrade_from_a_smaller_timer_value_replaces_the_timer_alone() -> Result<()> {
    let flags = ["--nat-udp-timeout", "2", "--nat-gc-interval", "1"];
    let mut w = world_with(&web("NodePort", "", &[]), &flags)?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    let armed_before = lines_with(&w.c, "the kernel's NAT expiry is armed")?.len();
    let pin = w.c.nodes[0].bpffs.join(lb_common::maps::NAT_TIMER);
    std::fs::remove_file(&pin)?;
    lbtest::run("bpftool", &["map", "create", pin.to_str().unwrap(), "type", "array", "key", "4", "value", "56", "entries", "1", "name", "LB_NAT_TIMER"])?;
    // Held before the programs move: the staged timer, armed at start,
    // runs (it walks the live tables, which the upgrade keeps).
    w.c.start_agent_env_until(1, &objects, &flags, &[("LB_UPGRADE_PAUSE_MS", "8000")], "paused before the programs move")?;
    assert!(w.c.nodes[0].bpffs.join("next").join(lb_common::maps::NAT_TIMER).exists(), "staged");
    assert_eq!(lines_with(&w.c, "the kernel's NAT expiry is armed")?.len(), armed_before + 1, "armed at start");
    let expiry = || -> Result<String> {
        let nat = lbtest::run(lbtest::bin("lb-agent").to_str().unwrap(), &["nat", "--bpffs", w.c.nodes[0].bpffs.to_str().unwrap()])?;
        Ok(nat.lines().find(|l| l.starts_with("kernel expiry: ")).unwrap_or_default().to_string())
    };
    w.c.wait_for("lb-agent nat to say armed, the upgrade waiting", Duration::from_secs(2), || Ok(expiry()?.starts_with("kernel expiry: armed")))?;
    assert!(lines_with(&w.c, "upgrade finished")?.is_empty(), "still waiting");
    w.c.wait_for("the upgrade", Duration::from_secs(20), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let changed = lines_with(&w.c, "pinned map gets a new layout")?;
    assert!(changed.len() == 1 && changed[0].contains(r#"map="LB_NAT_TIMER""#), "that map alone: {changed:?}");
    assert!(lines_with(&w.c, "not armed")?.is_empty());
    w.c.wait_for("lb-agent nat to say armed", Duration::from_secs(5), || Ok(expiry()?.starts_with("kernel expiry: armed")))?;
    assert_eq!(aya::maps::MapInfo::from_pin(&pin)?.value_size() as usize, size_of::<lb_common::NatTimer>());
    kernel_expires_them(&mut w)
}

/// New UDP flows through node-1's NodePort (3), then node-1's agent
/// killed: the kernel's NAT expiry removes them (`--nat-udp-timeout 2`).
fn kernel_expires_them(w: &mut World) -> Result<()> {
    let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(NODE1, 30080), "--count", "3"])?;
    assert_eq!(s.ok, 3, "{s:?}");
    assert!(map_entries(&w.c, 1, lb_common::maps::NAT4)? >= 3);
    w.c.kill_agent(1);
    w.c.wait_for("the kernel to expire the new table's flows", Duration::from_secs(30), || Ok(map_entries(&w.c, 1, lb_common::maps::NAT4)? == 0))
}

/// Connections the old programs make just before they move to new NAT
/// tables (after the first copy) have no flow there until the second
/// copy: the new programs take such a flow from the old table on its
/// first packet (`node_flags::UPGRADING`, `LB4_NAT_PREV`), so that the
/// connection goes on (before, its packets went to the stack, which reset
/// it). `LB_UPGRADE_PAUSE_MS` holds the upgrade in those moments (a few
/// milliseconds otherwise) for the connections to be made in them.
#[test]
fn connections_made_just_before_the_programs_move_keep_their_flows() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    let env = [("LB_LAYOUT_VERSION", "99"), ("LB_UPGRADE_PAUSE_MS", "1500")];
    w.c.start_agent_env_until(1, &objects, &[], &env, "paused before the programs move")?;
    // Made by the old programs, after the first copy: in the old table only.
    let held: Vec<_> = (0..4)
        .map(|_| w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--hold-ms", "4000", "--interval-ms", "20", "--timeout-ms", "1000"]))
        .collect::<Result<_>>()?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    for h in held {
        let s = Cluster::finish(h)?;
        assert_eq!(s.failed(), 0, "the connection kept going across the move: {s:?}");
        assert!(s.ok > 100, "{s:?}");
    }
    assert!(datapath(&w.c, 1, "nat_adopted")? >= 4, "the new programs took their flows from the old table");
    Ok(())
}

/// With `--bpf-forward` the pod devices move after the NodePort devices:
/// meanwhile a new connection to a local backend is made by a moved
/// NodePort program (its flow in the new NAT table), and the pod's SYN-ACK
/// passes the pod device's earlier program, which reads the old table
/// only. The new programs write new flows into the old table too while
/// they move (since 12-08; before, the SYN-ACK went to the stack
/// untranslated, and the connection waited for the pod devices to move).
/// `LB_UPGRADE_PAUSE_PODS_MS` holds the upgrade between the two.
#[test]
fn with_bpf_forward_connections_made_while_the_devices_move_are_answered_at_once() -> Result<()> {
    use lbtest::objects::Endpoint as E;
    let mut w = world_with(&web("NodePort", "", &[]), &["--bpf-forward"])?;
    set_endpoints(&w, &[(&w.p1, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    let env = [("LB_LAYOUT_VERSION", "99"), ("LB_UPGRADE_PAUSE_PODS_MS", "6000")];
    w.c.start_agent_env_until(1, &objects, &["--bpf-forward"], &env, "paused before the pod devices move")?;
    // A SYN-ACK lost is a connect of a second or more (the SYN's retransmit).
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--count", "10", "--timeout-ms", "700"])?;
    let done = upgrades_in_log(&w.c)?;
    assert_eq!(s.ok, 10, "{s:?}");
    assert_eq!(done, 0, "made while the pod devices had not moved");
    assert_eq!(keys(&s), [format!("pod-1 {NODE1_BRIDGE}").as_str()].into(), "masqueraded in BPF to the local backend: {s:?}");
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--count", "5", "--timeout-ms", "700"])?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}

/// Kill node-1's agent in an upgrade to layout 99 after its programs
/// moved to the staged maps (in the wait before its second copy), with
/// four NodePort connections made there, by the moved programs: their
/// flows are in the staged NAT tables only.
fn kill_after_the_move(w: &mut World, added: Option<&str>) -> Result<Vec<std::process::Child>> {
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    // A map the upgrade adds: the earlier agent had none.
    if let Some(m) = added {
        std::fs::remove_file(w.c.nodes[0].bpffs.join(m))?;
    }
    let env = [("LB_LAYOUT_VERSION", "99"), ("LB_UPGRADE_PAUSE_MS", "2500")];
    w.c.start_agent_env_until(1, &objects, &[], &env, "paused before the second copy")?;
    let held: Vec<_> = (0..4)
        .map(|_| w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--hold-ms", "6000", "--interval-ms", "20", "--timeout-ms", "1000"]))
        .collect::<Result<_>>()?;
    std::thread::sleep(Duration::from_millis(600));
    w.c.kill_agent(1);
    assert!(w.c.nodes[0].bpffs.join("next").join(lb_common::maps::NAT4).exists(), "killed before the staged maps were put in place");
    Ok(held)
}

fn all_kept_going(held: Vec<std::process::Child>) -> Result<()> {
    for h in held {
        let s = Cluster::finish(h)?;
        assert_eq!(s.failed(), 0, "the connection kept going across the kill and the next agent's start: {s:?}");
        assert!(s.ok > 100, "{s:?}");
    }
    Ok(())
}

/// An agent killed in an upgrade after its programs moved: the staged maps
/// are the live ones, holding the flows its programs made since. The next
/// agent of the same version resumes that upgrade on them (before 12-05's
/// second half it dropped them and started over from the old maps, which
/// lack those flows: the connections were reset once its programs moved).
/// Also where the upgrade adds a map (pinned in place, not staged: before
/// 12-06 the next agent then found the staging incomplete and finished the
/// upgrade instead, leaving the devices not moved yet on unpinned maps).
#[test]
fn an_upgrade_killed_after_its_programs_moved_is_resumed_by_the_next_agent() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let held = kill_after_the_move(&mut w, Some(lb_common::maps::LOCAL4))?;
    let objects = w.c.objects.clone();
    w.c.start_agent_env(1, &objects, &[], &[("LB_LAYOUT_VERSION", "99")])?;
    assert_eq!(lines_with(&w.c, "this agent resumes it on its staged maps")?.len(), 1);
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    all_kept_going(held)?;
    assert_eq!(lines_with(&w.c, "new maps are staged")?.len(), 1, "not staged again");
    assert!(!w.c.nodes[0].bpffs.join("next").exists());
    let got = pins(&w.c)?;
    assert!(got.contains("layout-99") && !got.iter().any(|p| p.starts_with("layout-") && p != "layout-99"), "{got:?}");
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--count", "5"])?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}

/// A staging cut short before the programs moved (the agent killed, or
/// out of memory, between two pins; here a staged map unpinned): the next
/// agent of the same version drops it and starts over, rather than resume
/// with the missing maps left old (a new services map beside the old
/// backends map, which numbers its ids otherwise). Only a map this version
/// adds, marked `next/inplace-NAME` by the staging agent, counts as staged
/// in place.
#[test]
fn a_staging_cut_short_is_started_over_not_resumed() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let api = w.c.start_apiserver(1, false)?;
    w.c.kill_agent(1);
    w.c.start_agent_kube(1, &api.kubeconfig, &[])?;
    api.control("/lbtest/fail?code=500&count=1000000")?;
    w.c.kill_agent(1);
    std::fs::remove_file(w.c.nodes[0].bpffs.join(lb_common::maps::LOCAL4))?;
    w.c.start_agent_kube_unsynced(1, &api.kubeconfig, &[], &[("LB_LAYOUT_VERSION", "99")])?;
    let next = w.c.nodes[0].bpffs.join("next");
    assert!(next.join(lb_common::maps::SERVICES4).exists() && next.join(format!("inplace-{}", lb_common::maps::LOCAL4)).symlink_metadata().is_ok());
    w.c.kill_agent(1);
    std::fs::remove_file(next.join(lb_common::maps::BACKENDS4))?;
    api.control("/lbtest/fail?code=500&count=0")?;
    w.c.start_agent_kube_unsynced(1, &api.kubeconfig, &[], &[("LB_LAYOUT_VERSION", "99")])?;
    assert_eq!(lines_with(&w.c, "its staged maps are dropped and it starts over")?.len(), 1);
    assert!(lines_with(&w.c, "this agent resumes it")?.is_empty());
    w.c.wait_for("the upgrade", Duration::from_secs(30), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--count", "5"])?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}

/// The same, with a next agent of another version (a rollback in the
/// middle of a rollout): it finishes the killed agent's upgrade as that
/// one would have (its staged maps put in place, with their layout
/// version), then upgrades from them to its own layout, carrying their
/// flows.
#[test]
fn an_upgrade_killed_after_its_programs_moved_is_finished_by_an_agent_of_another_version() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let held = kill_after_the_move(&mut w, None)?;
    let objects = w.c.objects.clone();
    w.c.start_agent_env(1, &objects, &[], &[])?;
    assert_eq!(lines_with(&w.c, "it is finished (those maps put in place")?.len(), 1);
    w.c.wait_for("the upgrade back", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    all_kept_going(held)?;
    assert_eq!(lines_with(&w.c, "new maps are staged")?.len(), 2, "staged by each agent");
    let got = pins(&w.c)?;
    let ours = format!("layout-{}", lb_common::LAYOUT_VERSION);
    assert!(got.contains(&ours) && !got.iter().any(|p| p.starts_with("layout-") && *p != ours), "{got:?}");
    Ok(())
}

/// The programs of node-1's cgroup attached for `attach_type` (bpftool's
/// name: "cgroup_inet4_connect").
fn cgroup_programs(c: &Cluster, attach_type: &str) -> Result<usize> {
    let out = lbtest::run("bpftool", &["-j", "cgroup", "show", c.nodes[0].cgroup.to_str().unwrap()])?;
    Ok(serde_json::from_str::<Vec<serde_json::Value>>(&out)?.iter().filter(|p| p["attach_type"] == attach_type).count())
}

/// A pinned link of a program this agent does not have (an earlier
/// version's, renamed or gone; here `lb_connect4`'s link pinned again as
/// `lb_connect4_v0`) keeps that program attached. A plain restart unpins
/// it, so the cgroup runs this agent's connect4 program alone (before
/// 12-05's second half only an upgrade did, and the earlier program ran
/// beside it on every connect, on the maps it was loaded with).
#[test]
fn a_restart_detaches_programs_whose_links_it_does_not_know() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    assert_eq!(cgroup_programs(&w.c, "cgroup_inet4_connect")?, 1);
    let links = w.c.nodes[0].bpffs.join("links");
    let out = lbtest::run("bpftool", &["-j", "link", "show", "pinned", links.join("lb_connect4").to_str().unwrap()])?;
    let id = serde_json::from_str::<serde_json::Value>(&out)?["id"].to_string();
    let unknown = links.join("lb_connect4_v0");
    lbtest::run("bpftool", &["link", "pin", "id", &id, unknown.to_str().unwrap()])?;
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    w.c.start_agent_env(1, &objects, &[], &[])?;
    assert_eq!(cgroup_programs(&w.c, "cgroup_inet4_connect")?, 1, "the earlier agent's program is detached");
    assert!(!unknown.exists());
    assert!(lines_with(&w.c, "lb_connect4_v0")?.iter().any(|l| l.contains("does not have")));
    let s = w.c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "5"])?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}

/// When a TCX link's pin is replaced, the kernel releases the earlier
/// link a moment later (after an RCU grace period; on this machine
/// sometimes hundreds of milliseconds), and until then both programs run.
/// Here the earlier agent's links on node-1's devices are held (pinned
/// again) across an upgrade to new NAT tables, as the kernel holds a
/// replaced one for that moment: an upgrade replaces the program inside
/// each link (one atomic update), so the held links run the new programs
/// and every connection, to the local pod-1 and to pod-2 on node-2 (SNAT),
/// is served. Before 12-05's second half a new link was appended behind
/// the earlier one, whose egress program passed the replies of local
/// backends to flows in the new tables untranslated and ended the chain
/// (every connection to pod-1 timed out here; about one upgrade in ten
/// lost its first ones so in the upgrade tests).
#[test]
fn an_upgrade_replaces_the_programs_inside_their_tcx_links() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let bpffs = w.c.nodes[0].bpffs.clone();
    let mut held = Vec::new();
    for e in std::fs::read_dir(bpffs.join("links"))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("lb_nodeport_egress_") || name.starts_with("lb_nodeport_ingress_") {
            let out = lbtest::run("bpftool", &["-j", "link", "show", "pinned", e.path().to_str().unwrap()])?;
            let id = serde_json::from_str::<serde_json::Value>(&out)?["id"].to_string();
            let pin = bpffs.join(format!("held_{name}"));
            lbtest::run("bpftool", &["link", "pin", "id", &id, pin.to_str().unwrap()])?;
            held.push(pin);
        }
    }
    assert!(held.len() >= 2, "node-1 has NodePort devices: {held:?}");
    let objects = w.c.objects.clone();
    w.c.kill_agent(1);
    w.c.start_agent_env(1, &objects, &[], &[("LB_LAYOUT_VERSION", "99")])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--count", "30", "--timeout-ms", "1000"])?;
    for p in &held {
        std::fs::remove_file(p)?;
    }
    assert_eq!(s.failed(), 0, "{s:?}");
    assert!(s.replies.keys().any(|r| r.starts_with("pod-1")) && s.replies.keys().any(|r| r.starts_with("pod-2")), "both backends: {s:?}");
    Ok(())
}

/// lb's programs of the other attach mode go when lb attaches to a
/// device: an agent with `--tc-attach netlink`, then one with TCX, then
/// netlink again, on node-1. Each time node-1's eth0 has lb's programs of
/// one mode only (TCX programs run before clsact filters, and lb's pass on
/// what they do not take: a leftover would see every packet the other
/// rewrote), and NodePort connections are served throughout.
#[test]
fn switching_the_attach_mode_leaves_lbs_programs_of_one_mode_on_a_device() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let objects = w.c.objects.clone();
    let ns = w.c.nodes[0].netns.clone();
    let links = w.c.nodes[0].bpffs.join("links");
    let filters = |w: &World| -> Result<usize> {
        let mut n = 0;
        for dir in ["ingress", "egress"] {
            let out = w.c.in_netns(&ns, &["tc", "filter", "show", "dev", "eth0", dir])?;
            n += out.lines().filter(|l| l.contains("lb_nodeport")).count();
        }
        Ok(n)
    };
    let tcx_pins = || -> Result<usize> {
        Ok(std::fs::read_dir(&links)?.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("lb_nodeport_") && e.file_name().to_string_lossy().ends_with("_eth0") && !e.file_name().to_string_lossy().contains("xdp")).count())
    };
    for (mode, want_filters, want_pins) in [("netlink", 2, 0), ("tcx", 0, 2), ("netlink", 2, 0)] {
        let on_eth0 = |w: &World| -> Result<usize> { Ok(lines_with(&w.c, "NodePort programs attached")?.iter().filter(|l| l.contains("eth0")).count()) };
        let before = on_eth0(&w)?;
        w.c.kill_agent(1);
        w.c.start_agent_env(1, &objects, &["--tc-attach", mode], &[])?;
        w.c.wait_for("the NodePort programs on eth0", Duration::from_secs(10), || Ok(on_eth0(&w)? > before))?;
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!((filters(&w)?, tcx_pins()?), (want_filters, want_pins), "after an agent with {mode}");
        let s = w.c.probe(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--count", "10", "--timeout-ms", "1000"])?;
        assert_eq!(s.failed(), 0, "{mode}: {s:?}");
    }
    Ok(())
}

/// TCP connections kept when their ready pod was switched out of the
/// Service (recorded in the pin dir) outlive an upgrade that replaces every
/// map (a new layout version): both the first sync's sweep and the one
/// after the programs moved keep them. (Where the NAT entries' layout
/// changes too, the first sweep cannot see the old tables' flows: its
/// census prunes nothing during an upgrade, `Reconciler::upgrading`; not
/// shown here.)
#[test]
fn connections_kept_on_a_selector_switch_outlive_an_upgrade_of_every_map() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    set_endpoints(&w, &[(&w.p1, lbtest::objects::Endpoint::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p1)?;
    let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--hold-ms", "7000", "--interval-ms", "20", "--timeout-ms", "1000"])?;
    let via_vip = w.c.probe_bg(&client, &["tcp", "--addr", "10.96.0.10:80", "--hold-ms", "7000", "--interval-ms", "20", "--timeout-ms", "1000"])?;
    std::thread::sleep(Duration::from_millis(700));
    // pod-1, ready, is switched out of the Service: its connections stay.
    set_endpoints(&w, &[(&w.p2, lbtest::objects::Endpoint::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    std::thread::sleep(Duration::from_millis(300));
    w.c.kill_agent(1);
    let objects = w.c.objects.clone();
    w.c.start_agent_env(1, &objects, &[], &[("LB_LAYOUT_VERSION", "99")])?;
    w.c.wait_for("the upgrade", Duration::from_secs(10), || Ok(upgrades_in_log(&w.c)? >= 1))?;
    std::thread::sleep(Duration::from_millis(800));
    let s = Cluster::finish(held)?;
    assert_eq!(s.failed(), 0, "the NodePort flow to pod-1 went on through the upgrade: {s:?}");
    assert!(!s.replies.is_empty() && s.replies.keys().all(|r| r.starts_with("pod-1")), "{s:?}");
    let t = Cluster::finish(via_vip)?;
    assert_eq!(t.failed(), 0, "the ClusterIP connection to pod-1 too: {t:?}");
    assert!(!t.replies.is_empty() && t.replies.keys().all(|r| r.starts_with("pod-1")), "{t:?}");
    Ok(())
}
