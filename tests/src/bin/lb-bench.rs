//! `cargo xtask bench`: lb against kube-proxy's iptables and nftables rule
//! shapes, side by side in one run, in network namespaces only.
//!
//! Every client pod sits on a node netns of its own; node 2 holds the
//! server pod (10 addresses, the 10 endpoints of the tested Service). The
//! rule sets are loaded once per node; the rounds interleave the cases
//! (A B C ... A B C ...), and each ratio is taken within its round.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use lbtest::{Cluster, Pod, bin};

#[derive(Parser)]
struct Args {
    /// Rounds of every datapath case.
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Seconds per datapath measurement.
    #[arg(long, default_value_t = 1.5)]
    secs: f64,
    /// The large scale: services (x 10 endpoints).
    #[arg(long, default_value_t = 10_000)]
    services: usize,
    /// Endpoint changes for the latency measurement.
    #[arg(long, default_value_t = 1000)]
    changes: usize,
    /// Bytes for the throughput measurement.
    #[arg(long, default_value_t = 200 << 20)]
    bulk_bytes: u64,
    /// Only lb's control plane (cold start, change latency, memory): for
    /// profiling; the full run needs the rest.
    #[arg(long)]
    lb_only: bool,
    /// Where the JSON results go.
    #[arg(long, default_value = "target/bench/results.json")]
    out: PathBuf,
}

const VIP_NET: &str = "10.96";
/// The NodePort Service of the NodePort cases.
const NP_VIP: &str = "10.96.250.1";
/// Its IPv6 ClusterIP: dual-stack, so that it has IPv6 NodePorts.
const NP_VIP6: &str = "fd00:96::fa01";
const NP_HTTP: u16 = 30080;
const NP_BULK: u16 = 30090;
const POD_CIDR: &str = "10.244.0.0/16";

/// The i-th service's ClusterIP; the tested one is the last.
fn vip(i: usize) -> String {
    format!("{VIP_NET}.{}.{}", 1 + i / 250, 1 + i % 250)
}

/// The endpoints of service i: the tested (last) one gets the server's 10
/// addresses, the others addresses nobody answers (never used).
fn endpoints(i: usize, n: usize, server: &[String]) -> Vec<String> {
    if i == n - 1 {
        server.to_vec()
    } else {
        (0..10)
            .map(|k| {
                let q = i * 10 + k;
                format!("10.{}.{}.{}", 128 + q / 62_500, (q / 250) % 250, 1 + q % 250)
            })
            .collect()
    }
}

/// The start of kube-proxy's nat table: its own chains (and `chains`), the
/// jumps from the built-in chains, and the masquerade marking.
fn nat_table(chains: &str) -> String {
    let mut s = String::from("*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-POSTROUTING - [0:0]\n");
    s += chains;
    s += "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n";
    s += "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n";
    s += "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n";
    s += "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n";
    s += "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n";
    s += "-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0\n";
    s += "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n";
    s
}

/// A `KUBE-SVC-{svc}` chain: masquerade from outside the pod CIDR, then one
/// endpoint at random (`-m statistic`), each in its `KUBE-SEP-{svc}-{k}`.
fn service_chain(s: &mut String, svc: &str, vip: &str, port: u16, eps: &[String], target: u16, proto: &str) {
    let _ = writeln!(s, "-A KUBE-SVC-{svc} ! -s {POD_CIDR} -d {vip}/32 -p {proto} -m {proto} --dport {port} -j KUBE-MARK-MASQ");
    for (k, ep) in eps.iter().enumerate() {
        let rest = eps.len() - k;
        if rest > 1 {
            let _ = writeln!(s, "-A KUBE-SVC-{svc} -m statistic --mode random --probability {:.11} -j KUBE-SEP-{svc}-{k}", 1.0 / rest as f64);
        } else {
            let _ = writeln!(s, "-A KUBE-SVC-{svc} -j KUBE-SEP-{svc}-{k}");
        }
        let _ = writeln!(s, "-A KUBE-SEP-{svc}-{k} -s {ep}/32 -j KUBE-MARK-MASQ");
        let _ = writeln!(s, "-A KUBE-SEP-{svc}-{k} -p {proto} -m {proto} -j DNAT --to-destination {ep}:{target}");
    }
}

fn iptables_rules(n: usize, server: &[String]) -> String {
    let mut chains = String::new();
    for i in 0..n {
        let _ = writeln!(chains, ":KUBE-SVC-{i} - [0:0]");
        for k in 0..10 {
            let _ = writeln!(chains, ":KUBE-SEP-{i}-{k} - [0:0]");
        }
    }
    let mut s = nat_table(&chains);
    // The tested service last in KUBE-SERVICES: the worst case.
    for i in 0..n {
        let v = vip(i);
        let _ = writeln!(s, "-A KUBE-SERVICES -d {v}/32 -p tcp -m comment --comment \"default/svc-{i}:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-{i}");
    }
    for i in 0..n {
        service_chain(&mut s, &i.to_string(), &vip(i), 80, &endpoints(i, n, server), 8080, "tcp");
    }
    s += "COMMIT\n";
    s
}

fn nft_rules(n: usize, server: &[String]) -> String {
    let mut s = String::from("table ip kube-proxy {\n");
    s += "  chain mark-for-masquerade { mark set mark or 0x4000; }\n";
    s += "  chain masquerading { meta mark & 0x4000 == 0 return; meta mark set mark xor 0x4000; masquerade fully-random; }\n";
    for i in 0..n {
        let eps = endpoints(i, n, server);
        for (k, ep) in eps.iter().enumerate() {
            let _ = writeln!(s, "  chain endpoint-{i}-{k} {{ ip saddr {ep} jump mark-for-masquerade; meta l4proto tcp dnat to {ep}:8080; }}");
        }
        let arms: Vec<String> = (0..eps.len()).map(|k| format!("{k} : goto endpoint-{i}-{k}")).collect();
        let _ = writeln!(
            s,
            "  chain service-{i} {{ ip daddr {} tcp dport 80 ip saddr != {POD_CIDR} jump mark-for-masquerade; numgen random mod {} vmap {{ {} }}; }}",
            vip(i),
            eps.len(),
            arms.join(", ")
        );
    }
    s += "  map service-ips {\n    type ipv4_addr . inet_proto . inet_service : verdict\n    elements = {\n";
    let elems: Vec<String> = (0..n).map(|i| format!("      {} . tcp . 80 : goto service-{i}", vip(i))).collect();
    s += &elems.join(",\n");
    s += "\n    }\n  }\n";
    s += "  chain services { ip daddr . meta l4proto . th dport vmap @service-ips; }\n";
    s += "  chain nat-prerouting { type nat hook prerouting priority -100; policy accept; jump services; }\n";
    s += "  chain nat-output { type nat hook output priority -100; policy accept; jump services; }\n";
    s += "  chain nat-postrouting { type nat hook postrouting priority 100; policy accept; jump masquerading; }\n";
    s += "}\n";
    s
}

/// Services and EndpointSlices for the dir source, in files of 1,000 (YAML
/// as `kubectl get -o yaml` prints them, or JSON lists as `-o json` and the
/// API server give them), plus the tested service in a YAML file of its own
/// (the one the latency run edits).
fn write_objects(dir: &Path, n: usize, server: &[String], json: bool) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut chunk = String::new();
    let mut file = 0;
    let flush = |chunk: &mut String, file: &mut usize| -> Result<()> {
        if chunk.is_empty() {
            return Ok(());
        }
        if json {
            let mut items = Vec::new();
            for v in lbtest::yaml_docs(chunk)? {
                if !v.is_null() {
                    items.push(v);
                }
            }
            let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
            std::fs::write(dir.join(format!("svc-{file:03}.json")), list.to_string())?;
        } else {
            std::fs::write(dir.join(format!("svc-{file:03}.yaml")), &*chunk)?;
        }
        chunk.clear();
        *file += 1;
        Ok(())
    };
    for i in 0..n {
        let doc = objects(i, &endpoints(i, n, server));
        if i == n - 1 {
            std::fs::write(dir.join("tested.yaml"), &doc)?;
            continue;
        }
        chunk += &doc;
        if (i + 1) % 1000 == 0 {
            flush(&mut chunk, &mut file)?;
        }
    }
    flush(&mut chunk, &mut file)
}

/// kube-proxy's iptables rules for one NodePort Service (externalTrafficPolicy
/// Cluster) with `eps` endpoints on (name, port, nodePort, targetPort,
/// protocol), after `services` other ClusterIP Services (10 endpoints each)
/// whose KUBE-SERVICES rules NodePort traffic walks first.
fn nodeport_rules(ports: &[(&str, u16, u16, u16, &str)], np_vip: &str, eps: &[String], services: usize) -> String {
    let mut chains = String::from(":KUBE-NODEPORTS - [0:0]\n");
    for i in 0..services {
        let _ = writeln!(chains, ":KUBE-SVC-{i} - [0:0]");
        for k in 0..10 {
            let _ = writeln!(chains, ":KUBE-SEP-{i}-{k} - [0:0]");
        }
    }
    for (p, ..) in ports {
        let _ = writeln!(chains, ":KUBE-SVC-{p} - [0:0]\n:KUBE-EXT-{p} - [0:0]");
        for k in 0..eps.len() {
            let _ = writeln!(chains, ":KUBE-SEP-{p}-{k} - [0:0]");
        }
    }
    let mut s = nat_table(&chains);
    for i in 0..services {
        let v = vip(i);
        let _ = writeln!(s, "-A KUBE-SERVICES -d {v}/32 -p tcp -m comment --comment \"default/svc-{i}:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-{i}");
    }
    for (p, port, np, target, proto) in ports {
        let _ = writeln!(s, "-A KUBE-SERVICES -d {np_vip}/32 -p {proto} -m comment --comment \"default/np:{p} cluster IP\" -m {proto} --dport {port} -j KUBE-SVC-{p}");
        let _ = writeln!(s, "-A KUBE-NODEPORTS -p {proto} -m comment --comment \"default/np:{p}\" -m {proto} --dport {np} -j KUBE-EXT-{p}");
        let _ = writeln!(s, "-A KUBE-EXT-{p} -m comment --comment \"masquerade traffic for default/np:{p} external destinations\" -j KUBE-MARK-MASQ");
        let _ = writeln!(s, "-A KUBE-EXT-{p} -j KUBE-SVC-{p}");
        service_chain(&mut s, p, np_vip, *port, eps, *target, proto);
    }
    for i in 0..services {
        // services + 1: none of them is the tested one; fake endpoints.
        service_chain(&mut s, &i.to_string(), &vip(i), 80, &endpoints(i, services + 1, &[]), 8080, "tcp");
    }
    s += "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n";
    s += "COMMIT\n";
    s
}

/// Two `*nat` tables from `nat_table` in one: the second's own chains and
/// rules (not the shared start) go before the first's COMMIT, with its
/// KUBE-NODEPORTS jump dropped (the first has it, last in KUBE-SERVICES).
fn merge_nat(a: &str, b: &str) -> String {
    let start = nat_table(":KUBE-NODEPORTS - [0:0]\n");
    let common: std::collections::HashSet<&str> = start.lines().collect();
    let (chains, rules): (Vec<&str>, Vec<&str>) = b
        .lines()
        .filter(|l| !common.contains(l) && *l != "COMMIT" && !l.contains("--dst-type LOCAL"))
        .partition(|l| l.starts_with(':'));
    let mut out = String::new();
    for l in a.lines() {
        if l == "COMMIT" {
            continue;
        }
        // The second table's chains go with the first's declarations.
        if l == ":KUBE-NODEPORTS - [0:0]" {
            out += l;
            out += "\n";
            for c in &chains {
                out += c;
                out += "\n";
            }
            continue;
        }
        // Its rules go before the final KUBE-NODEPORTS jump.
        if l.contains("--dst-type LOCAL") {
            for r in &rules {
                out += r;
                out += "\n";
            }
        }
        out += l;
        out += "\n";
    }
    out + "COMMIT\n"
}

fn objects(i: usize, eps: &[String]) -> String {
    let mut s = lbtest::objects::service(&format!("svc-{i}"), &vip(i), &[("http", 80, 8080, "TCP")]);
    s += "---\n";
    let e: Vec<(&str, &str, bool)> = eps.iter().map(|ip| (ip.as_str(), "node-2", true)).collect();
    s += &lbtest::objects::slice(&format!("svc-{i}"), &format!("svc-{i}-1"), &[("http", 8080, "TCP")], &e);
    s += "---\n";
    s
}

fn timed(netns: &str, cmd: &str, args: &[&str], input: &Path) -> Result<f64> {
    let t = Instant::now();
    let st = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .arg("--")
        .arg(cmd)
        .args(args)
        .stdin(std::fs::File::open(input)?)
        .status()?;
    if !st.success() {
        bail!("{cmd} {args:?} failed in {netns}");
    }
    Ok(t.elapsed().as_secs_f64())
}

fn rate(c: &Cluster, client: &Pod, addr: &str, secs: f64) -> Result<f64> {
    let mut cmd = Command::new(bin("lbprobe"));
    cmd.args(["--netns", &client.netns]);
    if !client.cgroup.as_os_str().is_empty() {
        cmd.arg("--cgroup").arg(&client.cgroup);
    }
    let out = cmd.args(["rate", "--addr", addr, "--secs", &secs.to_string(), "--cpu", "0"]).output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| String::from_utf8_lossy(&out.stderr).into_owned())?;
    if v["ok"].as_u64().unwrap_or(0) == 0 {
        bail!("no connection through {addr}: {v}");
    }
    // A stalled connection (a lost SYN waits 1 s for its retransmission)
    // sinks a round: say so, with what the probe saw.
    if v["slowest_ms"].as_f64().unwrap_or(0.0) > 200.0 || v["errors"].as_object().is_some_and(|e| !e.is_empty()) {
        eprintln!("bench: {addr}: slowest connection {:.0} ms (client port {}), errors {}", v["slowest_ms"].as_f64().unwrap_or(0.0), v["slowest_port"], v["errors"]);
        if std::env::var("LB_BENCH_STALL_DUMP").is_ok() {
            let port = format!("sport={} ", v["slowest_port"]);
            for n in &c.nodes {
                if let Ok(nat) = lbtest::run(bin("lb-agent").to_str().unwrap(), &["nat", "--bpffs", n.bpffs.to_str().unwrap()]) {
                    for l in nat.lines().filter(|l| l.contains(&port)) {
                        eprintln!("bench:   {}: {l}", n.name);
                    }
                }
                if let Ok((_, m)) = c.http(n.index, "127.0.0.1:10249", "/metrics") {
                    let ev: Vec<&str> = m.lines().filter(|l| l.starts_with("lb_datapath_events_total") && !l.ends_with(" 0")).collect();
                    if !ev.is_empty() {
                        eprintln!("bench:   {}: {}", n.name, ev.join(" "));
                    }
                }
            }
        }
    }
    Ok(v["rate"].as_f64().unwrap_or(0.0))
}

/// Short connections to `addr` and to `baseline` from one client,
/// alternating every 20 connections, each timed on its own: (rate, baseline rate).
fn rate_pair(client: &Pod, addr: &str, baseline: &str, secs: f64) -> Result<(f64, f64)> {
    let mut cmd = Command::new(bin("lbprobe"));
    cmd.args(["--netns", &client.netns]);
    if !client.cgroup.as_os_str().is_empty() {
        cmd.arg("--cgroup").arg(&client.cgroup);
    }
    let out = cmd.args(["rate-pair", "--addr", addr, "--baseline", baseline, "--secs", &secs.to_string(), "--cpu", "0"]).output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| String::from_utf8_lossy(&out.stderr).into_owned())?;
    if v["ok"].as_u64().unwrap_or(0) == 0 || v["baseline_ok"].as_u64().unwrap_or(0) == 0 {
        bail!("no connection through {addr} or {baseline}: {v}");
    }
    Ok((v["rate"].as_f64().unwrap_or(0.0), v["baseline_rate"].as_f64().unwrap_or(0.0)))
}

/// `rounds` of `rate_pair` for each (case, address, baseline address),
/// interleaved; each ratio is the case's rate over its baseline's in the
/// same run.
fn paired_rounds(client: &Pod, pairs: &[(String, String, String)], secs: f64, rounds: usize) -> Result<BTreeMap<String, Series>> {
    let mut paired: BTreeMap<String, Series> = BTreeMap::new();
    for _ in 0..rounds {
        for (name, addr, base) in pairs {
            let (l, d) = rate_pair(client, addr, base, secs)?;
            let s = paired.entry(name.clone()).or_default();
            s.values.push(l);
            s.ratios.push(l / d);
        }
    }
    Ok(paired)
}

/// Small UDP datagrams delivered per second (one core sending).
fn udp_rate(client: &Pod, addr: &str, secs: f64) -> Result<f64> {
    let out = Command::new(bin("lbprobe"))
        .args(["--netns", &client.netns, "udp-rate", "--addr", addr, "--secs", &secs.to_string(), "--cpu", "0"])
        .output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| String::from_utf8_lossy(&out.stderr).into_owned())?;
    if v["received"].as_u64().unwrap_or(0) == 0 {
        bail!("no datagram through {addr}: {v}");
    }
    Ok(v["rate"].as_f64().unwrap_or(0.0))
}

fn bulk_rate(c: &Cluster, client: &Pod, addr: &str, bytes: u64) -> Result<f64> {
    let t = Instant::now();
    let s = c.probe(client, &["bulk", "--addr", addr, "--bytes", &bytes.to_string()])?;
    if s.ok != 1 {
        bail!("bulk through {addr}: {s:?}");
    }
    Ok(bytes as f64 / t.elapsed().as_secs_f64() / 1e6)
}

#[derive(Default, serde::Serialize)]
struct Series {
    values: Vec<f64>,
    ratios: Vec<f64>,
}

/// NodePort figures of a list of cases: conn/s, small UDP datagrams/s and
/// one stream, each with its ratio to the "direct" case before it.
#[derive(Default, serde::Serialize)]
struct NodePortRun {
    conn: BTreeMap<String, Series>,
    udp: BTreeMap<String, Series>,
    throughput: BTreeMap<String, Series>,
}

/// (case, short-connection and UDP address, bulk address).
type NpCase = (String, String, String);

/// Interleaved rounds of every case from `client`: `rounds` of conn/s,
/// then up to 3 of UDP; `between` runs after those (program costs), then up
/// to 3 rounds of one stream.
fn nodeport_rounds(c: &Cluster, client: &Pod, cases: &[NpCase], a: &Args, rounds: usize, between: impl FnOnce() -> Result<()>) -> Result<NodePortRun> {
    let mut run = NodePortRun::default();
    let measure = |m: &mut BTreeMap<String, Series>, n: usize, f: &dyn Fn(&NpCase) -> Result<f64>| -> Result<()> {
        for _ in 0..n {
            let mut direct = 0.0;
            for case in cases {
                let v = f(case)?;
                if case.0.starts_with("direct") {
                    direct = v;
                }
                let s = m.entry(case.0.clone()).or_default();
                s.values.push(v);
                s.ratios.push(v / direct);
            }
        }
        Ok(())
    };
    measure(&mut run.conn, rounds, &|(_, addr, _)| rate(c, client, addr, a.secs))?;
    measure(&mut run.udp, rounds.min(3), &|(_, addr, _)| udp_rate(client, addr, a.secs))?;
    between()?;
    measure(&mut run.throughput, rounds.min(3), &|(_, _, addr)| bulk_rate(c, client, addr, a.bulk_bytes))?;
    Ok(run)
}

/// The markdown rows of `run` ("vs iptables": per-round ratios to the case
/// `ipt`).
fn nodeport_table(md: &mut String, run: &NodePortRun, cases: &[NpCase], ipt: &str) {
    let vs = |m: &BTreeMap<String, Series>, name: &str| -> String {
        let (Some(x), Some(b)) = (m.get(name), m.get(ipt)) else { return "-".into() };
        if name.contains("IPv6") {
            return "-".into();
        }
        let r: Vec<f64> = x.values.iter().zip(&b.values).map(|(x, b)| x / b).collect();
        format!("{:.2}", median(&r))
    };
    let _ = writeln!(md, "| case | conn/s (median) | min–max | ratio to direct (median) | lowest | vs iptables | UDP datagrams/s (median) | ratio to direct | vs iptables | MB/s, one stream | ratio |\n|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, _, _) in cases {
        let Some(s) = run.conn.get(name) else { continue };
        let (lo, hi) = minmax(&s.values);
        let t = run.throughput.get(name);
        let u = run.udp.get(name);
        let _ = writeln!(
            md,
            "| {name} | {:.0} | {:.0}–{:.0} | {:.2} | {:.2} | {} | {:.0} | {:.2} | {} | {:.0} | {:.2} |",
            median(&s.values),
            lo,
            hi,
            median(&s.ratios),
            minmax(&s.ratios).0,
            vs(&run.conn, name),
            u.map_or(0.0, |u| median(&u.values)),
            u.map_or(0.0, |u| median(&u.ratios)),
            vs(&run.udp, name),
            t.map_or(0.0, |t| median(&t.values)),
            t.map_or(0.0, |t| median(&t.ratios))
        );
    }
}

/// The markdown rows of NodePort program costs (`np_prog_cost`), one column
/// per node.
fn program_table(md: &mut String, title: &str, columns: &[&str], costs: &[BTreeMap<String, f64>]) {
    let _ = writeln!(md, "\n{title} (ns per run; runs):\n\n| program | {} |\n|---|{}", columns.join(" | "), "---|".repeat(columns.len()));
    let names: std::collections::BTreeSet<&String> = costs.iter().flat_map(|m| m.keys()).filter(|k| !k.ends_with(" runs")).collect();
    for p in names {
        let f = |m: &BTreeMap<String, f64>| {
            m.get(p).map_or("-".to_string(), |v| format!("{v:.0}; {:.0}", m.get(&format!("{p} runs")).copied().unwrap_or(0.0)))
        };
        let cells: Vec<String> = costs.iter().map(f).collect();
        let _ = writeln!(md, "| {p} | {} |", cells.join(" | "));
    }
}

/// Run time and run count of every program attached to `cgroup`, by name
/// (from bpf_stats, which must be on).
/// Run time and run count of the TC programs attached (TCX) to eth0 in
/// `netns`, by name (from bpf_stats, which must be on).
fn tc_prog_stats(netns: &str) -> Result<BTreeMap<String, (u64, u64)>> {
    tc_dev_prog_stats(netns, "eth0")
}

/// `tc_prog_stats` for device `dev` (on a pod device: `lb_pod_ingress`).
fn tc_dev_prog_stats(netns: &str, dev: &str) -> Result<BTreeMap<String, (u64, u64)>> {
    use aya::programs::{SchedClassifier, TcAttachType};
    lbtest::with_netns(Some(netns), || {
        let mut got = BTreeMap::new();
        for dir in [TcAttachType::Ingress, TcAttachType::Egress] {
            let (_, progs) = SchedClassifier::query_tcx(dev, dir)?;
            for info in progs {
                // Program names are cut at 15 bytes: name ours in full.
                let name = match (info.name_as_str().unwrap_or("?"), dir) {
                    (n, TcAttachType::Ingress) if n.starts_with("lb_nodeport") => "lb_nodeport_ingress".to_string(),
                    (n, _) if n.starts_with("lb_nodeport") => "lb_nodeport_egress".to_string(),
                    (n, _) => n.to_string(),
                };
                got.insert(name, (info.run_time().as_nanos() as u64, info.run_count()));
            }
        }
        // The XDP program, if one is on eth0 (`ip link` names its id).
        let link = lbtest::run("ip", &["-d", "link", "show", "eth0"])?;
        if let Some(id) = link.split("prog/xdp id ").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|i| i.parse::<u32>().ok()) {
            for info in aya::programs::loaded_programs().flatten() {
                if info.id() == id {
                    got.insert("lb_nodeport_xdp".to_string(), (info.run_time().as_nanos() as u64, info.run_count()));
                }
            }
        }
        Ok(got)
    })
}

/// `prog_cost`, and each program's runs in between ("NAME runs").
fn np_prog_cost(before: &BTreeMap<String, (u64, u64)>, after: &BTreeMap<String, (u64, u64)>) -> BTreeMap<String, f64> {
    let mut m = prog_cost(before, after);
    for (k, (_, n)) in after {
        let n0 = before.get(k).map_or(0, |b| b.1);
        m.insert(format!("{k} runs"), n.saturating_sub(n0) as f64);
    }
    m
}

fn prog_stats(cgroup: &Path) -> Result<BTreeMap<String, (u64, u64)>> {
    let out = lbtest::run("bpftool", &["-j", "cgroup", "show", cgroup.to_str().unwrap()])?;
    let attached: Vec<serde_json::Value> = serde_json::from_str(&out).with_context(|| format!("bpftool cgroup show: {out}"))?;
    let ids: BTreeMap<u32, String> =
        attached.iter().filter_map(|p| Some((p["id"].as_u64()? as u32, p["name"].as_str()?.to_string()))).collect();
    let mut got = BTreeMap::new();
    for info in aya::programs::loaded_programs().flatten() {
        if let Some(name) = ids.get(&info.id()) {
            got.insert(name.clone(), (info.run_time().as_nanos() as u64, info.run_count()));
        }
    }
    Ok(got)
}

/// ns per run of each program between two `prog_stats` snapshots.
fn prog_cost(before: &BTreeMap<String, (u64, u64)>, after: &BTreeMap<String, (u64, u64)>) -> BTreeMap<String, f64> {
    after
        .iter()
        .filter_map(|(k, (t, n))| {
            let (t0, n0) = before.get(k).copied().unwrap_or((0, 0));
            (n > &n0).then(|| (k.clone(), (t - t0) as f64 / (n - n0) as f64))
        })
        .collect()
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn minmax(v: &[f64]) -> (f64, f64) {
    v.iter().fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)))
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() { 0.0 } else { v[((v.len() as f64 - 1.0) * p).round() as usize] }
}

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("VmRSS:").map(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())).flatten())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Fill a fresh BPF hash map (the services map's shape) with `n` entries
/// through aya, the baseline for our map writing.
fn raw_map_fill(n: usize) -> Result<f64> {
    let pin = format!("/sys/fs/bpf/lbt-{}-mapfill", std::process::id());
    let ok = Command::new("bpftool")
        .args(["map", "create", &pin, "type", "hash", "key", "12", "value", "16", "entries", &(n + 1024).to_string(), "name", "mapfill"])
        .status()?
        .success();
    if !ok {
        bail!("bpftool map create failed");
    }
    let r = (|| -> Result<f64> {
        let data = aya::maps::MapData::from_pin(&pin)?;
        let mut m: aya::maps::HashMap<_, [u8; 12], [u8; 16]> = aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data))?;
        let t = Instant::now();
        for i in 0..n as u32 {
            let mut k = [0u8; 12];
            k[..4].copy_from_slice(&i.to_ne_bytes());
            m.insert(k, [1u8; 16], 0)?;
        }
        Ok(t.elapsed().as_secs_f64())
    })();
    let _ = std::fs::remove_file(&pin);
    r
}

/// The server pod on `node`, with 10 addresses (the 10 endpoints of a
/// tested Service): 1-byte exchanges on 8080, bulk transfers on 9090.
fn server_pod(c: &mut Cluster, node: usize) -> Result<(Pod, Vec<String>)> {
    let server = c.add_pod(node, if node == 2 { "server".to_string() } else { format!("server-{node}") }.as_str())?;
    let mut ips = vec![server.ip.clone()];
    for k in 1..10 {
        let extra = format!("10.244.{node}.{}", 100 + k);
        c.in_netns(&server.netns, &["ip", "addr", "add", &format!("{extra}/24"), "dev", "eth0"])?;
        ips.push(extra);
    }
    c.serve_tiny(&server, 8080, 1)?;
    c.serve(&server, 9090)?;
    Ok((server, ips))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let n = a.services.max(11);
    let small = 10;
    let t0 = Instant::now();
    eprintln!("bench: building the namespaces");
    // 1 direct, 2 server, 3 lb-10, 4 lb-large, 5/6 iptables-legacy,
    // 7/8 iptables-nft, 9/10 nftables, 11 lb NodePort, 12 iptables NodePort,
    // 13 lb-large from YAML (cold start only), 14 lb NodePort with
    // --bpf-forward, 15 iptables NodePort behind the large rule set, 16 lb
    // NodePort with DSR, 17 lb NodePort with Maglev, 18 lb NodePort with
    // XDP acceleration and BPF forwarding, 19 iptables NodePort with its
    // backends on the node (lb's counterpart: node 2, the server's node),
    // 20 lb with --per-packet-lb (10 services).
    let mut c = Cluster::new(20)?;
    let (server, server_ips) = server_pod(&mut c, 2)?;
    // The same server on node 19, behind kube-proxy's NodePort rules there.
    let (server19, server19_ips) = server_pod(&mut c, 19)?;
    // The tight topology: a server pod on the client's node (node 4).
    let server4 = c.add_pod(4, "server-4")?;
    c.serve_tiny(&server4, 8080, 1)?;
    let mut clients = BTreeMap::new();
    for node in [1usize, 3, 4, 5, 6, 7, 8, 9, 10, 20] {
        let p = c.add_pod(node, &format!("client-{node}"))?;
        c.in_netns(&p.netns, &["sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000"])?;
        clients.insert(node, p);
    }
    // Key 0: client-20's netns, its process outside the node's cgroup: no
    // socket hook sees it, as none sees a VM's or a sandbox's kernel.
    let guest = Pod { cgroup: PathBuf::new(), ..clients[&20].clone() };
    clients.insert(0, guest);
    let guest_dev = format!("v{}", clients[&20].ip.rsplit('.').next().unwrap_or_default());
    let work = c.objects.parent().unwrap().to_path_buf();

    // Control plane: load the kube-proxy rule sets (timed) and lb's maps.
    let mut cp: BTreeMap<String, f64> = BTreeMap::new();
    for (size, suffix) in [(small, "10"), (n, "large")] {
        if a.lb_only {
            break;
        }
        let ipt = work.join(format!("ipt-{suffix}.rules"));
        std::fs::write(&ipt, iptables_rules(size, &server_ips))?;
        let nft = work.join(format!("nft-{suffix}.nft"));
        std::fs::write(&nft, nft_rules(size, &server_ips))?;
        let (legacy, ipnft, nftn) = if size == small { (5, 7, 9) } else { (6, 8, 10) };
        eprintln!("bench: loading kube-proxy rules for {size} services");
        cp.insert(format!("iptables-legacy-restore {size}"), timed(&c.nodes[legacy - 1].netns, "iptables-legacy-restore", &[], &ipt)?);
        cp.insert(format!("iptables-nft-restore {size}"), timed(&c.nodes[ipnft - 1].netns, "iptables-nft-restore", &[], &ipt)?);
        cp.insert(format!("nft -f {size}"), timed(&c.nodes[nftn - 1].netns, "nft", &["-f", "-"], &nft)?);
    }
    let small_dir = work.join("objects-10");
    write_objects(&small_dir, small, &server_ips, false)?;
    let large_dir = work.join("objects-large");
    write_objects(&large_dir, n, &server_ips, true)?;
    let yaml_dir = work.join("objects-large-yaml");
    write_objects(&yaml_dir, n, &server_ips, false)?;
    const BULK_VIP: &str = "10.96.255.250";
    let mut bulk = lbtest::objects::service("bulk", BULK_VIP, &[("http", 80, 9090, "TCP")]);
    bulk += "---\n";
    bulk += &lbtest::objects::slice("bulk", "bulk-1", &[("http", 9090, "TCP")], &[(server.ip.as_str(), "node-2", true)]);
    std::fs::write(large_dir.join("bulk.yaml"), bulk)?;
    const TIGHT_VIP: &str = "10.96.255.249";
    let mut tight = lbtest::objects::service("tight", TIGHT_VIP, &[("http", 80, 8080, "TCP")]);
    tight += "---\n";
    tight += &lbtest::objects::slice("tight", "tight-1", &[("http", 8080, "TCP")], &[(server4.ip.as_str(), "node-4", true)]);
    std::fs::write(large_dir.join("tight.yaml"), tight)?;
    c.start_agent_from(3, &small_dir, &[])?;
    c.start_agent_from(20, &small_dir, &["--per-packet-lb"])?;
    let rss_small = c.agent_pid(3).map_or(0.0, rss_mib);
    // Cold starts: a fresh agent on fresh maps, 3 times each (the median
    // is reported); the last JSON one stays up for the datapath rounds.
    eprintln!("bench: lb-agent cold starts with {n} services x 10 endpoints");
    let field = |line: &str, name: &str| -> Option<f64> { line.split(&format!("{name}=")).nth(1)?.split_whitespace().next()?.parse().ok() };
    let last_field = |log: &str, what: &str, name: &str| log.lines().rev().find(|l| l.contains(what)).and_then(|l| field(l, name));
    let (mut json_starts, mut yaml_starts, mut syncs, mut writes) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut written_ops = 0.0;
    const COLD_STARTS: usize = 3;
    for round in 0..COLD_STARTS {
        for (node, dir, starts) in [(13usize, &yaml_dir, &mut yaml_starts), (4usize, &large_dir, &mut json_starts)] {
            let t = Instant::now();
            c.start_agent_from(node, dir, &[])?;
            starts.push(t.elapsed().as_secs_f64());
            if node == 4 {
                let log = std::fs::read_to_string(c.agent_log(4))?;
                syncs.extend(last_field(&log, "maps programmed", "elapsed_us").map(|us| us / 1e6));
                writes.extend(last_field(&log, "maps written in full", "write_us").map(|us| us / 1e6));
                written_ops = last_field(&log, "maps written in full", "ops").unwrap_or(0.0);
                if round + 1 == COLD_STARTS {
                    continue;
                }
            }
            c.kill_agent(node);
            lbtest::run(bin("lb-agent").to_str().unwrap(), &["teardown", "--bpffs", c.nodes[node - 1].bpffs.to_str().unwrap()])?;
        }
    }
    cp.insert(format!("lb-agent cold start {n} (JSON)"), median(&json_starts));
    cp.insert(format!("lb-agent cold start {n} (YAML)"), median(&yaml_starts));
    cp.insert(format!("lb-agent first sync {n}"), median(&syncs));
    let written = (!writes.is_empty()).then(|| (median(&writes), written_ops));
    let rss = c.agent_pid(4).map_or(0.0, rss_mib);
    // The same objects from the API server stand-in, through the kube
    // source (kube-rs watchers and reflector stores).
    let rss_kube = {
        eprintln!("bench: lb-agent with --source kube, {n} services x 10 endpoints");
        let api_dir = work.join("apiserver-large");
        std::fs::create_dir_all(&api_dir)?;
        let api = lbtest::ApiServer::start(Some(&c.nodes[12].netns), &large_dir, None, &api_dir.join("kubeconfig"), &api_dir.join("log"))?;
        c.start_agent_kube(13, &api.kubeconfig, &[])?;
        let rss = c.agent_pid(13).map_or(0.0, rss_mib);
        c.kill_agent(13);
        lbtest::run(bin("lb-agent").to_str().unwrap(), &["teardown", "--bpffs", c.nodes[12].bpffs.to_str().unwrap()])?;
        drop(api);
        rss
    };
    let entries = n * (10 + 2);
    let raw = raw_map_fill(entries)?;
    cp.insert(format!("raw BPF map fill {entries}"), raw);
    // Our map writing against the raw fill, per entry.
    let write_ratio = written.map(|(secs, ops)| (secs / ops) / (raw / entries as f64));
    if let Some((secs, ops)) = written {
        cp.insert(format!("lb-agent map writing, {ops} entries"), secs);
    }

    // Datapath: interleaved rounds of short connections.
    let tested = format!("{}:80", vip(n - 1));
    let tested_small = format!("{}:80", vip(small - 1));
    // (case, client's node, address); a "direct" case is the baseline of
    // the cases after it.
    let cases: Vec<(String, usize, String)> = vec![
        ("direct (pod IP)".into(), 1, format!("{}:8080", server.ip)),
        (format!("lb, {small} services"), 3, tested_small.clone()),
        (format!("lb, {small} services, --per-packet-lb (its programs on the client's device)"), 20, tested_small.clone()),
        (format!("lb per packet, {small} services: a client no socket hook sees (a VM)"), 0, tested_small.clone()),
        (format!("lb, {n} services"), 4, tested.clone()),
        (format!("iptables-legacy, {small} services"), 5, tested_small.clone()),
        (format!("iptables-legacy, {n} services"), 6, tested.clone()),
        (format!("iptables-nft, {small} services"), 7, tested_small.clone()),
        (format!("iptables-nft, {n} services"), 8, tested.clone()),
        (format!("nftables, {small} services"), 9, tested_small),
        (format!("nftables, {n} services"), 10, tested.clone()),
        ("direct, server on the client's node (pod IP)".into(), 4, format!("{}:8080", server4.ip)),
        (format!("lb, server on the client's node, {n} services"), 4, format!("{TIGHT_VIP}:80")),
    ];
    let mut series: BTreeMap<String, Series> = BTreeMap::new();
    let rounds = if a.lb_only { 0 } else { a.rounds };
    let cases: Vec<_> = if a.lb_only { Vec::new() } else { cases };
    // What each socket program costs per run during these rounds.
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).context("enable bpf_stats")?;
    let stats_before = [prog_stats(&c.nodes[2].cgroup)?, prog_stats(&c.nodes[3].cgroup)?];
    let guest_before = tc_dev_prog_stats(&c.nodes[19].netns, &guest_dev)?;
    for round in 0..rounds {
        eprintln!("bench: round {} of {}", round + 1, a.rounds);
        let mut direct = 0.0;
        for (name, node, addr) in &cases {
            let r = rate(&c, &clients[node], addr, a.secs)?;
            if name.starts_with("direct") {
                direct = r;
            }
            let s = series.entry(name.clone()).or_default();
            s.values.push(r);
            s.ratios.push(r / direct);
        }
    }
    let prog_ns = [
        prog_cost(&stats_before[0], &prog_stats(&c.nodes[2].cgroup)?),
        prog_cost(&stats_before[1], &prog_stats(&c.nodes[3].cgroup)?),
    ];
    let per_packet_ns = np_prog_cost(&guest_before, &tc_dev_prog_stats(&c.nodes[19].netns, &guest_dev)?);
    // Paired rounds: lb and direct from one client, alternating every 20
    // connections (lbprobe rate-pair), so that both see the same moments
    // of the machine; the interleaved rounds above compare 1.5 s runs one
    // after the other, which drift by several percent on a shared 2-core
    // machine. The direct side passes through the same hooks (a miss).
    let pairs = [
        (format!("lb, {n} services"), tested.clone(), format!("{}:8080", server.ip)),
        (format!("lb, server on the client's node, {n} services"), format!("{TIGHT_VIP}:80"), format!("{}:8080", server4.ip)),
    ];
    let paired = paired_rounds(&clients[&4], &pairs, a.secs, rounds)?;
    // Throughput of one established stream.
    let mut tput: BTreeMap<String, Series> = BTreeMap::new();
    for _ in 0..rounds.min(3) {
        let d = bulk_rate(&c, &clients[&1], &format!("{}:9090", server.ip), a.bulk_bytes)?;
        let l = bulk_rate(&c, &clients[&4], &format!("{BULK_VIP}:80"), a.bulk_bytes)?;
        for (k, v) in [("direct (pod IP)", d), ("lb, ClusterIP", l)] {
            let s = tput.entry(k.to_string()).or_default();
            s.values.push(v);
            s.ratios.push(v / d);
        }
    }

    // NodePort from outside: lb's TC path (node 11; node 14 with BPF
    // forwarding; DSR, Maglev) against kube-proxy's iptables NodePort rules
    // behind 10 (node 12) and the large number of (node 15) other Services,
    // and direct to the pod. Then XDP (node 18) on a fabric that carries
    // complete checksums, as it needs, against direct, TC and iptables
    // there.
    let mut np = NodePortRun::default();
    let mut np_wired = NodePortRun::default();
    let mut np_local = NodePortRun::default();
    let mut np_paired: BTreeMap<String, Series> = BTreeMap::new();
    let mut pod_ns: BTreeMap<String, f64> = BTreeMap::new();
    // Program costs during the conn/s and UDP rounds: lb (TC), lb (TC, BPF
    // forwarding); on the wired fabric lb (TC, BPF forwarding) and lb (XDP
    // + TC, BPF forwarding).
    let mut tc_ns: [BTreeMap<String, f64>; 2] = Default::default();
    let mut wired_ns: [BTreeMap<String, f64>; 2] = Default::default();
    // Each "direct" case is the baseline of the cases after it (IPv4, then IPv6).
    let node_case = |name: String, node: usize, v6: bool| {
        let ip = if v6 { format!("[{}]", c.nodes[node - 1].ip6) } else { c.nodes[node - 1].ip.clone() };
        (name, format!("{ip}:{NP_HTTP}"), format!("{ip}:{NP_BULK}"))
    };
    let ipt_name = format!("iptables-legacy, {small} services, nodeIP:nodePort");
    let direct4: NpCase = ("direct (pod IP)".into(), format!("{}:8080", server.ip), format!("{}:9090", server.ip));
    let np_cases: Vec<NpCase> = vec![
        direct4.clone(),
        node_case("lb (TC), nodeIP:nodePort".into(), 11, false),
        node_case("lb (TC, BPF forwarding), nodeIP:nodePort".into(), 14, false),
        node_case("lb (TC, DSR), nodeIP:nodePort".into(), 16, false),
        node_case("lb (TC, Maglev), nodeIP:nodePort".into(), 17, false),
        node_case(ipt_name.clone(), 12, false),
        node_case(format!("iptables-legacy, {n} services, nodeIP:nodePort"), 15, false),
        ("direct (pod IPv6)".into(), format!("[{}]:8080", server.ip6), format!("[{}]:9090", server.ip6)),
        node_case("lb (TC), [nodeIPv6]:nodePort".into(), 11, true),
        node_case("lb (TC, BPF forwarding), [nodeIPv6]:nodePort".into(), 14, true),
    ];
    // NodePort at a node with the backends (no node hop more than direct:
    // what a load balancer does with externalTrafficPolicy Local, or
    // luck with Cluster): lb on the server's node (node 2), kube-proxy's
    // rules on node 19, each after direct to its own server. Both
    // masquerade the flow (the Service is externalTrafficPolicy Cluster:
    // lb's --local-masquerade, kube-proxy's KUBE-EXT-*).
    let ipt_local = format!("iptables-legacy, {small} services, nodeIP:nodePort of the backends' node");
    let local_cases: Vec<NpCase> = vec![
        ("direct (pod IP)".into(), format!("{}:8080", server.ip), format!("{}:9090", server.ip)),
        node_case("lb (TC), nodeIP:nodePort of the backends' node".into(), 2, false),
        ("direct (pod IP on node 19)".into(), format!("{}:8080", server19.ip), format!("{}:9090", server19.ip)),
        node_case(ipt_local.clone(), 19, false),
    ];
    let wired_cases: Vec<NpCase> = vec![
        direct4,
        node_case("lb (TC), nodeIP:nodePort".into(), 11, false),
        node_case("lb (TC, BPF forwarding), nodeIP:nodePort".into(), 14, false),
        node_case("lb (XDP + TC, BPF forwarding), nodeIP:nodePort".into(), 18, false),
        node_case(ipt_name.clone(), 12, false),
    ];
    if rounds > 0 {
        eprintln!("bench: NodePort");
        let np_dir = work.join("objects-np");
        std::fs::create_dir_all(&np_dir)?;
        let ports = [("http", 80, 8080, "TCP", NP_HTTP), ("bulk", 90, 9090, "TCP", NP_BULK), ("udp", 80, 8080, "UDP", NP_HTTP)];
        let mut doc = lbtest::objects::service_typed("np", &[NP_VIP, NP_VIP6], "NodePort", &ports, "  ipFamilyPolicy: PreferDualStack\n", &[]);
        doc += "---\n";
        let ep_ports = [("http", 8080, "TCP"), ("bulk", 9090, "TCP"), ("udp", 8080, "UDP")];
        let e: Vec<(&str, &str, bool)> = server_ips.iter().map(|ip| (ip.as_str(), "node-2", true)).collect();
        doc += &lbtest::objects::slice("np", "np-1", &ep_ports[..2], &e);
        doc += "---\n";
        // UDP: the server's first address only (a wildcard UDP socket
        // answers from the primary address, not the one it was sent to).
        doc += &lbtest::objects::slice("np", "np-udp", &ep_ports[2..], &e[..1]);
        doc += "---\n";
        let e6 = [lbtest::objects::Endpoint::ready(&server.ip6, "node-2")];
        doc += &lbtest::objects::slice_of("np", "np-6", "IPv6", &ep_ports, &e6);
        std::fs::write(np_dir.join("np.yaml"), doc)?;
        c.start_agent_from(11, &np_dir, &[])?;
        c.start_agent_from(14, &np_dir, &["--bpf-forward"])?;
        c.start_agent_from(16, &np_dir, &["--nodeport-mode", "dsr"])?;
        c.start_agent_from(17, &np_dir, &["--nodeport-algorithm", "maglev"])?;
        c.start_agent_from(18, &np_dir, &["--nodeport-acceleration", "xdp", "--bpf-forward"])?;
        // DSR needs lb on the backend's node (it strips the option and
        // answers the client); every case's packets pass it alike.
        c.start_agent_from(2, &np_dir, &[])?;
        let ipt_ports = [("http", 80, NP_HTTP, 8080, "tcp"), ("bulk", 90, NP_BULK, 9090, "tcp")];
        for (node, services, eps) in [(12, small, &server_ips), (15, n, &server_ips), (19, small, &server19_ips)] {
            let rules = work.join(format!("ipt-np-{node}.rules"));
            let mut text = nodeport_rules(&ipt_ports, NP_VIP, eps, services);
            // The UDP port, with the one endpoint lb has too.
            let udp = nodeport_rules(&[("udp", 80, NP_HTTP, 8080, "udp")], NP_VIP, &eps[..1], 0);
            text = merge_nat(&text, &udp);
            std::fs::write(&rules, text)?;
            timed(&c.nodes[node - 1].netns, "iptables-legacy-restore", &[], &rules)?;
        }
        let outside = c.add_outside("outside", 100, &[("10.244.2.0/24", 2), ("fd00:244:2::/64", 2), ("10.244.19.0/24", 19)])?;
        c.in_netns(&outside.netns, &["sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000"])?;
        let before = [tc_prog_stats(&c.nodes[10].netns)?, tc_prog_stats(&c.nodes[13].netns)?];
        np = nodeport_rounds(&c, &outside, &np_cases, &a, rounds, || {
            tc_ns = [np_prog_cost(&before[0], &tc_prog_stats(&c.nodes[10].netns)?), np_prog_cost(&before[1], &tc_prog_stats(&c.nodes[13].netns)?)];
            Ok(())
        })?;
        eprintln!("bench: NodePort at the backends' node");
        np_local = nodeport_rounds(&c, &outside, &local_cases, &a, rounds, || Ok(()))?;
        // Paired, as for the ClusterIP cases: each NodePort case against
        // direct to its pod and against kube-proxy's rules, from the outside
        // client, alternating every 20 connections (the interleaved rounds
        // above drift by up to 15% between cases here).
        eprintln!("bench: NodePort, paired");
        let np_at = |node: usize| format!("{}:{NP_HTTP}", c.nodes[node - 1].ip);
        let (direct, direct19) = (format!("{}:8080", server.ip), format!("{}:8080", server19.ip));
        let mut pairs: Vec<(String, String, String)> = Vec::new();
        for (name, node) in [("lb (TC)", 11), ("lb (TC, BPF forwarding)", 14), ("lb (TC, DSR)", 16), ("lb (TC, Maglev)", 17)] {
            pairs.push((format!("{name} / direct"), np_at(node), direct.clone()));
            pairs.push((format!("{name} / iptables"), np_at(node), np_at(12)));
        }
        pairs.push(("iptables / direct".into(), np_at(12), direct.clone()));
        pairs.push(("lb (TC) at the backends' node / direct".into(), np_at(2), direct.clone()));
        pairs.push(("lb (TC) at the backends' node / iptables at the backends' node".into(), np_at(2), np_at(19)));
        pairs.push(("iptables at the backends' node / direct".into(), np_at(19), direct19.clone()));
        np_paired = paired_rounds(&outside, &pairs, a.secs, rounds)?;
        // lb with BPF forwarding at the backends' node: masquerading in
        // BPF (the default), then keeping the client's address (as
        // externalTrafficPolicy Local does): node 2's agent restarted with
        // the flags (the pins and the flows stay), then back.
        let fwd_masq = [
            ("lb (TC, BPF forwarding, masquerading in BPF) at the backends' node / direct".to_string(), np_at(2), direct.clone()),
            ("lb (TC, BPF forwarding, masquerading in BPF) at the backends' node / iptables at the backends' node".to_string(), np_at(2), np_at(19)),
        ];
        let fwd_local = [
            ("lb (TC, BPF forwarding, client address kept) at the backends' node / direct".to_string(), np_at(2), direct.clone()),
            ("lb (TC, BPF forwarding, client address kept) at the backends' node / iptables at the backends' node".to_string(), np_at(2), np_at(19)),
        ];
        c.kill_agent(2);
        c.start_agent_from(2, &np_dir, &["--bpf-forward"])?;
        np_paired.extend(paired_rounds(&outside, &fwd_masq, a.secs, rounds)?);
        c.kill_agent(2);
        c.start_agent_from(2, &np_dir, &["--bpf-forward", "--local-masquerade", "none"])?;
        // The pod program on the server's device carries its replies.
        let server_dev = format!("v{}", server.ip.rsplit('.').next().unwrap_or_default());
        let before = tc_dev_prog_stats(&c.nodes[1].netns, &server_dev)?;
        np_paired.extend(paired_rounds(&outside, &fwd_local, a.secs, rounds)?);
        pod_ns = np_prog_cost(&before, &tc_dev_prog_stats(&c.nodes[1].netns, &server_dev)?);
        c.kill_agent(2);
        c.start_agent_from(2, &np_dir, &[])?;
        eprintln!("bench: NodePort on a fabric with complete checksums (XDP)");
        c.wire_checksums()?;
        let before = [tc_prog_stats(&c.nodes[13].netns)?, tc_prog_stats(&c.nodes[17].netns)?];
        np_wired = nodeport_rounds(&c, &outside, &wired_cases, &a, rounds, || {
            wired_ns = [np_prog_cost(&before[0], &tc_prog_stats(&c.nodes[13].netns)?), np_prog_cost(&before[1], &tc_prog_stats(&c.nodes[17].netns)?)];
            Ok(())
        })?;
    }

    // One endpoint change at a time, with the large set loaded: from the
    // file write to the maps holding it. Files are replaced the way a
    // writer should (write aside, rename over), so that the agent never
    // reads one half-written.
    eprintln!("bench: {} endpoint changes", a.changes);
    let maps = PathBuf::from(&c.nodes[3].bpffs).join(lb_common::maps::SERVICES4);
    let mut lat = Vec::new();
    let data = aya::maps::MapData::from_pin(&maps)?;
    let svc: aya::maps::HashMap<_, [u8; 12], [u8; 16]> = aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data))?;
    let vipb: Vec<u8> = vip(n - 1).split('.').map(|p| p.parse().unwrap()).collect();
    let mut key = [0u8; 12];
    key[..4].copy_from_slice(&vipb);
    key[4..6].copy_from_slice(&80u16.to_ne_bytes());
    key[6] = 6;
    let count = |svc: &aya::maps::HashMap<aya::maps::MapData, [u8; 12], [u8; 16]>| svc.get(&key, 0).map(|v| u16::from_ne_bytes([v[4], v[5]])).unwrap_or(0);
    for i in 0..a.changes {
        let want = if i % 2 == 0 { 9 } else { 10 };
        let doc = objects(n - 1, &server_ips[..want]);
        let tmp = large_dir.join(".tested.yaml.tmp");
        std::fs::write(&tmp, doc)?;
        let t = Instant::now();
        std::fs::rename(&tmp, large_dir.join("tested.yaml"))?;
        loop {
            if count(&svc) as usize == want {
                break;
            }
            if t.elapsed() > Duration::from_secs(5) {
                bail!("change {i} not programmed within 5 s");
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        lat.push(t.elapsed().as_secs_f64() * 1e3);
    }

    // Report.
    let mut md = String::new();
    let _ = writeln!(md, "Short connections (connect + 1-byte request/response + close), {} rounds of {} s, interleaved:\n", a.rounds, a.secs);
    let _ = writeln!(md, "| case | conn/s (median) | min–max | ratio to direct (median) | lowest ratio |\n|---|---|---|---|---|");
    for (name, _, _) in &cases {
        let s = &series[name];
        let (lo, hi) = minmax(&s.values);
        let _ = writeln!(md, "| {name} | {:.0} | {:.0}–{:.0} | {:.2} | {:.2} |", median(&s.values), lo, hi, median(&s.ratios), minmax(&s.ratios).0);
    }
    let _ = writeln!(md, "\nPaired with direct from the same client (node 4), alternating every 20 connections, {} rounds of {} s:\n\n| case | conn/s (median) | ratio to direct (median) | lowest ratio |\n|---|---|---|---|", a.rounds, a.secs);
    for (name, s) in &paired {
        let _ = writeln!(md, "| {name} | {:.0} | {:.3} | {:.3} |", median(&s.values), median(&s.ratios), minmax(&s.ratios).0);
    }
    let _ = writeln!(md, "\nBPF program cost during these rounds (bpf_stats run time / run count, ns per run):\n\n| program | {small} services | {n} services |\n|---|---|---|");
    let names: std::collections::BTreeSet<&String> = prog_ns.iter().flat_map(|m| m.keys()).collect();
    for p in names {
        let f = |m: &BTreeMap<String, f64>| m.get(p).map_or("-".to_string(), |v| format!("{v:.0}"));
        let _ = writeln!(md, "| {p} | {} | {} |", f(&prog_ns[0]), f(&prog_ns[1]));
    }
    for prog in ["lb_pod_ingress", "lb_pod_egress"] {
        if let Some(ns) = per_packet_ns.get(prog) {
            let runs = per_packet_ns.get(&format!("{prog} runs")).copied().unwrap_or(0.0);
            let _ = writeln!(md, "\n`{prog}` on client-20's device (`--per-packet-lb`) during the rounds of both its cases: {ns:.0} ns per run; {runs:.0} runs.");
        }
    }
    let _ = writeln!(md, "\nOne established TCP stream ({} MB):\n\n| case | MB/s (median) | ratio |\n|---|---|---|", a.bulk_bytes >> 20);
    for (k, s) in &tput {
        let _ = writeln!(md, "| {k} | {:.0} | {:.2} |", median(&s.values), median(&s.ratios));
    }
    let _ = writeln!(md, "\nNodePort from an outside client, {} rounds of {} s, interleaved (UDP and streams: {} rounds; \"vs iptables\": the median of per-round ratios to iptables-legacy with {small} services):\n", a.rounds, a.secs, a.rounds.min(3));
    nodeport_table(&mut md, &np, &np_cases, &ipt_name);
    program_table(&mut md, "NodePort program cost during the conn/s and UDP rounds", &["lb (TC)", "lb (TC, BPF forwarding)"], &tc_ns);
    let _ = writeln!(md, "\nNodePort at a node with the backends (no node hop more than direct; \"vs iptables\": against kube-proxy's rules on a node with its own backends):\n");
    nodeport_table(&mut md, &np_local, &local_cases, &ipt_local);
    let _ = writeln!(md, "\nNodePort paired: each case against a baseline from the outside client, alternating every 20 connections, {} rounds of {} s (\"direct\": the pod the case reaches; \"iptables\": kube-proxy's rules, 10 Services, on the node the case names):\n\n| case / baseline | conn/s (median) | ratio (median) | lowest | highest |\n|---|---|---|---|---|", a.rounds, a.secs);
    for (name, s) in &np_paired {
        let (lo, hi) = minmax(&s.ratios);
        let _ = writeln!(md, "| {name} | {:.0} | {:.3} | {lo:.3} | {hi:.3} |", median(&s.values), median(&s.ratios));
    }
    if let Some(ns) = pod_ns.get("lb_pod_ingress") {
        let runs = pod_ns.get("lb_pod_ingress runs").copied().unwrap_or(0.0);
        let _ = writeln!(md, "\n`lb_pod_ingress` on the server's device during the BPF forwarding rounds at the backends' node: {ns:.0} ns per run; {runs:.0} runs.");
    }
    let _ = writeln!(md, "\nNodePort on a fabric that carries complete checksums (checksum offload off on every fabric veth, as XDP needs; same rounds):\n");
    nodeport_table(&mut md, &np_wired, &wired_cases, &ipt_name);
    program_table(&mut md, "Program cost on that fabric", &["lb (TC, BPF forwarding)", "lb (XDP + TC, BPF forwarding)"], &wired_ns);
    let _ = writeln!(md, "\nControl plane ({n} services x 10 endpoints unless noted; lb-agent: median of {COLD_STARTS} cold starts):\n\n| step | seconds |\n|---|---|");
    for (k, v) in &cp {
        let _ = writeln!(md, "| {k} | {v:.3} |");
    }
    let _ = writeln!(
        md,
        "\nOne endpoint change, file write to programmed maps, {} changes with {n} services loaded: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms.\n\nlb-agent resident memory after the full sync: {rss:.1} MiB ({rss_small:.1} MiB with {small} services; {rss_kube:.1} MiB with {n} services from an API server, `--source kube`).",
        lat.len(),
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.iter().cloned().fold(0.0, f64::max)
    );
    if let Some(r) = write_ratio {
        let _ = writeln!(md, "\nlb-agent map writing per entry: {r:.2} of the raw single-insert fill's.");
    }
    let _ = writeln!(md, "\nTotal bench time {:.0} s.", t0.elapsed().as_secs_f64());
    print!("{md}");
    let json = serde_json::json!({
        "rounds": a.rounds, "secs": a.secs, "services": n,
        "datapath": series, "paired": paired, "throughput": tput, "control_plane": cp,
        "nodeport": np.conn, "nodeport_throughput": np.throughput, "nodeport_udp": np.udp, "nodeport_program_ns": tc_ns,
        "nodeport_wired": np_wired, "nodeport_local": np_local, "nodeport_paired": np_paired, "pod_program_ns": pod_ns, "per_packet_program_ns": per_packet_ns, "nodeport_wired_program_ns": wired_ns, "map_write_ratio_to_raw": write_ratio,
        "change_latency_ms": {"p50": percentile(&lat, 0.5), "p99": percentile(&lat, 0.99), "samples": lat},
        "agent_rss_mib": rss,
        "program_ns": {"small": prog_ns[0], "large": prog_ns[1]},
        "agent_rss_mib_small": rss_small,
        "agent_rss_mib_kube": rss_kube,
    });
    if let Some(d) = a.out.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(&a.out, serde_json::to_string_pretty(&json)?)?;
    eprintln!("bench: results in {}", a.out.display());
    if std::env::var_os("LB_BENCH_AGENT_LOG").is_some() {
        eprintln!("{}", std::fs::read_to_string(c.agent_log(4)).unwrap_or_default());
    }
    drop(c);
    Ok(())
}
