//! kube-proxy's rules on this node: kube-proxy still running next to lb, or
//! its rules left behind when its DaemonSet was deleted without
//! `kube-proxy --cleanup`. They go on acting on whatever lb passes (a
//! Service lb has not programmed yet, traffic on a device without lb's
//! programs) with the endpoints kube-proxy last saw. Nothing fails
//! outright, so the agent looks for them, at start and then every
//! `--kube-proxy-check-period`, and says what it found: a warning naming
//! each mode's tables and chains, and `lb_kube_proxy_rules{mode}`.
//! `lb-agent cleanup-kube-proxy` removes them (`cleanup`).
//!
//! A kube-proxy still running also holds the ports lb's health and metrics
//! servers want (10256, 10249): the agent's error then names the process
//! holding the port (`port_holder`).
//!
//! Only kube-proxy's own chains count: kubelet's (KUBE-FIREWALL,
//! KUBE-KUBELET-CANARY, KUBE-MARK-DROP) stay out of it. KUBE-MARK-MASQ and
//! KUBE-POSTROUTING are kube-proxy's since Kubernetes 1.28, but kubelets
//! before it made them too (a node upgraded in place keeps them until it
//! reboots), and alone they act on nothing: they are not reported alone,
//! and the clean-up removes them, as `kube-proxy --cleanup` does.
use std::process::Command;

/// The modes kube-proxy's rules can be in, as the metric names them.
pub const MODES: [&str; 4] = ["iptables-legacy", "iptables-nft", "nftables", "ipvs"];

/// Chains only kube-proxy creates (iptables and ipvs modes).
const CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
    "KUBE-LOAD-BALANCER",
    "KUBE-NODE-PORT",
    // IPVS mode's filter chains.
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];

/// kube-proxy's too, removed by `kube-proxy --cleanup` (iptables and IPVS
/// modes), but not reported alone (see the module).
const CLEANUP_TOO: &[&str] = &["KUBE-POSTROUTING", "KUBE-MARK-MASQ"];

/// The ipsets of kube-proxy's IPVS mode (pkg/proxy/ipvs `ipsetInfo`). An
/// IPv6 set's name has "KUBE-6-" for "KUBE-", cut to ipset's 31
/// characters (`newIPv6Set`: `KUBE-6-LOAD-BALANCER-SOURCE-CID`).
const IPSETS: &[&str] = &[
    "KUBE-LOOP-BACK",
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-SOURCE-IP",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP",
    "KUBE-NODE-PORT-LOCAL-TCP",
    "KUBE-NODE-PORT-UDP",
    "KUBE-NODE-PORT-LOCAL-UDP",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    "KUBE-HEALTH-CHECK-NODE-PORT",
    "KUBE-IPVS-IPS",
];

/// kube-proxy's ipsets in `ipset list -n` output, in its order. Others
/// named KUBE-* (kube-router's network policy sets, say) are not.
pub fn ipsets_in_list(list: &str) -> Vec<String> {
    let v6 = |s: &str| -> String {
        let mut n = format!("KUBE-6-{}", s.strip_prefix("KUBE-").unwrap_or(s));
        n.truncate(31);
        n
    };
    list.lines().map(str::trim).filter(|n| IPSETS.contains(n) || IPSETS.iter().any(|s| v6(s) == *n)).map(str::to_string).collect()
}

/// kube-proxy's per-Service and per-endpoint chains (iptables mode).
const PER_SERVICE: &[&str] = &["KUBE-SVC-", "KUBE-SEP-", "KUBE-EXT-", "KUBE-FW-", "KUBE-XLB-", "KUBE-SVL-"];

/// What one mode left: "nat KUBE-SERVICES", ... and how many per-Service
/// chains.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Found {
    pub chains: Vec<String>,
    pub per_service: usize,
}

impl Found {
    fn is_empty(&self) -> bool {
        self.chains.is_empty() && self.per_service == 0
    }

    fn merge(&mut self, other: Found) {
        for c in other.chains {
            if !self.chains.contains(&c) {
                self.chains.push(c);
            }
        }
        self.chains.sort();
        self.per_service += other.per_service;
    }
}

impl std::fmt::Display for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.chains.join(", "))?;
        if self.per_service > 0 {
            write!(f, "{}{} per-Service chains", if self.chains.is_empty() { "" } else { "; " }, self.per_service)?;
        }
        Ok(())
    }
}

/// kube-proxy's chains in `iptables-save` output (one family): the
/// table and name of each fixed one (sorted), and a count of the rest.
pub fn chains_in_save(save: &str) -> Found {
    let mut found = Found::default();
    let mut table = "";
    for line in save.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.trim();
        } else if let Some(decl) = line.strip_prefix(':') {
            let name = decl.split_whitespace().next().unwrap_or_default();
            if CHAINS.contains(&name) {
                let c = format!("{table} {name}");
                if !found.chains.contains(&c) {
                    found.chains.push(c);
                }
            } else if PER_SERVICE.iter().any(|p| name.starts_with(p)) {
                found.per_service += 1;
            }
        }
    }
    found.chains.sort();
    found
}

fn is_kube_proxys(chain: &str) -> bool {
    CHAINS.contains(&chain) || CLEANUP_TOO.contains(&chain) || PER_SERVICE.iter().any(|p| chain.starts_with(p))
}

/// An `iptables-restore --noflush` script that removes kube-proxy's chains
/// from the rule set `save` (`iptables-save` output) and nothing else:
/// per table, the rules of other chains that jump (or go) to one of them,
/// then every one of them flushed, then deleted. None: nothing to remove.
pub fn cleanup_script(save: &str) -> Option<String> {
    let mut out = String::new();
    let (mut table, mut chains, mut jumps) = ("", Vec::new(), Vec::new());
    for line in save.lines() {
        if let Some(t) = line.strip_prefix('*') {
            (table, chains, jumps) = (t.trim(), Vec::new(), Vec::new());
        } else if let Some(decl) = line.strip_prefix(':') {
            let name = decl.split_whitespace().next().unwrap_or_default();
            if is_kube_proxys(name) {
                chains.push(name.to_string());
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let mut w = rule.split_whitespace();
            let chain = w.next().unwrap_or_default();
            let mut target = None;
            while let Some(t) = w.next() {
                if t == "-j" || t == "-g" || t == "--jump" || t == "--goto" {
                    target = w.next();
                }
            }
            if !is_kube_proxys(chain) && target.is_some_and(is_kube_proxys) {
                jumps.push(format!("-D {rule}"));
            }
        } else if line.trim() == "COMMIT" && !chains.is_empty() {
            out += &format!("*{table}\n");
            for j in &jumps {
                out += &format!("{j}\n");
            }
            for c in &chains {
                out += &format!("-F {c}\n");
            }
            for c in &chains {
                out += &format!("-X {c}\n");
            }
            out += "COMMIT\n";
        }
    }
    (!out.is_empty()).then_some(out)
}

/// `lb-agent cleanup-kube-proxy`: remove kube-proxy's rules from this
/// node (`kube-proxy --cleanup`'s job), saying what goes.
pub fn cleanup(dry_run: bool) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use std::io::Write as _;
    let mut removed = 0;
    for (save, restore) in [
        ("iptables-legacy-save", "iptables-legacy-restore"),
        ("ip6tables-legacy-save", "ip6tables-legacy-restore"),
        ("iptables-nft-save", "iptables-nft-restore"),
        ("ip6tables-nft-save", "ip6tables-nft-restore"),
    ] {
        let Some(script) = output(save, &[]).as_deref().and_then(cleanup_script) else { continue };
        println!("{restore} --noflush:\n{script}");
        removed += 1;
        if dry_run {
            continue;
        }
        let mut child = Command::new(restore)
            .arg("--noflush")
            .stdin(std::process::Stdio::piped())
            .spawn()
            .with_context(|| format!("run {restore}"))?;
        child.stdin.take().context("stdin")?.write_all(script.as_bytes()).with_context(|| format!("write to {restore}"))?;
        let st = child.wait()?;
        anyhow::ensure!(st.success(), "{restore} --noflush failed ({st}) on the script above");
    }
    for table in output("nft", &["list", "tables"]).map(|l| tables_in_nft(&l).chains).unwrap_or_default() {
        // "table ip kube-proxy"
        let args: Vec<&str> = ["delete"].into_iter().chain(table.split_whitespace()).collect();
        println!("nft {}", args.join(" "));
        removed += 1;
        if !dry_run {
            let st = Command::new("nft").args(&args).status().context("run nft")?;
            anyhow::ensure!(st.success(), "nft {} failed ({st})", args.join(" "));
        }
    }
    if crate::netdev::links()?.iter().any(|l| l.name == "kube-ipvs0") {
        println!("ip link del kube-ipvs0");
        removed += 1;
        if !dry_run {
            let st = Command::new("ip").args(["link", "del", "kube-ipvs0"]).status().context("run ip")?;
            anyhow::ensure!(st.success(), "ip link del kube-ipvs0 failed ({st})");
        }
    }
    // IPVS mode's ipsets, once no rule refers to them (as kube-proxy
    // destroys them after its iptables clean-up); the IPv6 ones too.
    let mut failed = Vec::new();
    for set in output("ipset", &["list", "-n"]).map(|l| ipsets_in_list(&l)).unwrap_or_default() {
        println!("ipset destroy {set}");
        removed += 1;
        if !dry_run {
            // One still in use (by a rule of another tool) does not keep
            // the others.
            let st = Command::new("ipset").args(["destroy", &set]).status().context("run ipset")?;
            if !st.success() {
                failed.push(format!("{set} ({st})"));
            }
        }
    }
    anyhow::ensure!(failed.is_empty(), "ipset destroy failed for {}", failed.join(", "));
    if removed == 0 {
        println!("no kube-proxy rules on this node");
    }
    Ok(())
}

/// kube-proxy's tables (nftables mode: `kube-proxy` in the ip and ip6
/// families) in `nft list tables` output.
pub fn tables_in_nft(list: &str) -> Found {
    let chains = list
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            match (w.next(), w.next(), w.next()) {
                (Some("table"), Some(family), Some("kube-proxy")) => Some(format!("table {family} kube-proxy")),
                _ => None,
            }
        })
        .collect();
    Found { chains, per_service: 0 }
}

/// The output of `cmd args`, or None where the tool is not installed or
/// fails (said at debug level: each mode is looked for with its own tool).
pub(crate) fn output(cmd: &str, args: &[&str]) -> Option<String> {
    match Command::new(cmd).args(args).output() {
        Ok(o) if o.status.success() => Some(String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(o) => {
            tracing::debug!(cmd, status = %o.status, stderr = %String::from_utf8_lossy(&o.stderr).trim(), "cannot look at the node's rules");
            None
        }
        Err(e) => {
            tracing::debug!(cmd, error = %e, "cannot look at the node's rules");
            None
        }
    }
}

/// Look on this node (its network namespace): each mode with what it left.
pub fn detect() -> Vec<(&'static str, Found)> {
    let mut out = Vec::new();
    for (mode, tools) in [
        ("iptables-legacy", ["iptables-legacy-save", "ip6tables-legacy-save"]),
        ("iptables-nft", ["iptables-nft-save", "ip6tables-nft-save"]),
    ] {
        let mut found = Found::default();
        for tool in tools {
            if let Some(save) = output(tool, &[]) {
                found.merge(chains_in_save(&save));
            }
        }
        out.push((mode, found));
    }
    out.push(("nftables", output("nft", &["list", "tables"]).map(|l| tables_in_nft(&l)).unwrap_or_default()));
    // IPVS mode's dummy device, which holds every ClusterIP as a local
    // address.
    let ipvs: Vec<String> = match crate::netdev::links() {
        Ok(links) => links.iter().filter(|l| l.name == "kube-ipvs0").map(|l| format!("device {}", l.name)).collect(),
        Err(e) => {
            tracing::debug!(error = format!("{e:#}"), "cannot list devices to look for kube-ipvs0");
            Vec::new()
        }
    };
    // (Its ipsets are not looked for: alone, without the rules that use
    // them, they act on nothing, and `kube-proxy --cleanup` itself leaves
    // the IPv6 ones; `cleanup` destroys them.)
    out.push(("ipvs", Found { chains: ipvs, per_service: 0 }));
    out.retain(|(_, f)| !f.is_empty());
    out
}

/// Look, set the metric, and say what changed since `last`: a warning for
/// what is there, a note when it is gone.
pub fn check(metric: &prometheus_client::metrics::family::Family<[(&'static str, &'static str); 1], prometheus_client::metrics::gauge::Gauge>, last: &mut Option<Vec<(&'static str, Found)>>) {
    let now = detect();
    for mode in MODES {
        metric.get_or_create(&[("mode", mode)]).set(now.iter().any(|(m, _)| *m == mode) as i64);
    }
    if last.as_ref() == Some(&now) {
        return;
    }
    if now.is_empty() {
        if last.is_some() {
            tracing::info!("kube-proxy's rules are gone from this node");
        }
    } else {
        let what: Vec<String> = now.iter().map(|(m, f)| format!("{m} ({f})")).collect();
        tracing::warn!(
            "kube-proxy's rules are on this node: {}. kube-proxy is still running or its rules were left behind; they act on \
             traffic lb passes (a Service lb has not programmed yet, a device without lb's programs) with the endpoints kube-proxy \
             last saw. Delete kube-proxy's DaemonSet, then run `kube-proxy --cleanup` or `lb-agent cleanup-kube-proxy` on the node (README: Installing on a cluster)",
            what.join("; ")
        );
    }
    *last = Some(now);
}

/// Who listens on TCP port `port` in this network namespace ("NAME (pid
/// N)"), as `ss` tells it; None if it cannot (no ss, no process found).
pub fn port_holder(port: u16) -> Option<String> {
    holder_in_ss(&output("ss", &["-ltnpH", "sport", "=", &format!(":{port}")])?)
}

/// The first process `ss -ltnp` names: `users:(("NAME",pid=N,fd=M))`.
pub fn holder_in_ss(out: &str) -> Option<String> {
    let users = out.split("users:((\"").nth(1)?;
    let (name, rest) = users.split_once('"')?;
    let pid: String = rest.split("pid=").nth(1)?.chars().take_while(char::is_ascii_digit).collect();
    (!pid.is_empty()).then(|| format!("{name} (pid {pid})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_holding_a_port_is_read_from_ss() {
        let out = "LISTEN 0      4096         0.0.0.0:10256      0.0.0.0:*    users:((\"kube-proxy\",pid=1234,fd=10))\n";
        assert_eq!(holder_in_ss(out).as_deref(), Some("kube-proxy (pid 1234)"));
        let two = "LISTEN 0 128 *:10256 *:* users:((\"kube-proxy\",pid=7,fd=3),(\"kube-proxy\",pid=8,fd=3))\n";
        assert_eq!(holder_in_ss(two).as_deref(), Some("kube-proxy (pid 7)"));
        // No process column (no permission to see it), or nothing there.
        assert_eq!(holder_in_ss("LISTEN 0 4096 0.0.0.0:10256 0.0.0.0:*\n"), None);
        assert_eq!(holder_in_ss(""), None);
    }

    #[test]
    fn kube_proxys_chains_are_found_and_kubelets_are_not() {
        let save = "# Generated by iptables-save\n*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n\
                    *filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n:KUBE-FORWARD - [0:0]\n:KUBE-EXTERNAL-SERVICES - [0:0]\n-A FORWARD -j KUBE-FORWARD\nCOMMIT\n\
                    *nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n\
                    :KUBE-SVC-ABCDEFGHIJKLMNOP - [0:0]\n:KUBE-SEP-ABCDEFGHIJKLMNOP - [0:0]\n:KUBE-EXT-ABCDEFGHIJKLMNOP - [0:0]\n\
                    -A PREROUTING -j KUBE-SERVICES\n-A KUBE-SERVICES -j KUBE-SVC-ABCDEFGHIJKLMNOP\nCOMMIT\n";
        let f = chains_in_save(save);
        assert_eq!(f.chains, ["filter KUBE-EXTERNAL-SERVICES", "filter KUBE-FORWARD", "mangle KUBE-PROXY-CANARY", "nat KUBE-NODEPORTS", "nat KUBE-SERVICES"]);
        assert_eq!(f.per_service, 3);
        assert_eq!(
            f.to_string(),
            "filter KUBE-EXTERNAL-SERVICES, filter KUBE-FORWARD, mangle KUBE-PROXY-CANARY, nat KUBE-NODEPORTS, nat KUBE-SERVICES; 3 per-Service chains"
        );
        // Rules naming a chain ("-A ... -j KUBE-SERVICES") do not count twice.
        assert_eq!(chains_in_save("*nat\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n"), Found::default());
    }

    #[test]
    fn kubelets_chains_alone_are_not_kube_proxys() {
        let save = "*mangle\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n*filter\n:KUBE-FIREWALL - [0:0]\nCOMMIT\n\
                    *nat\n:KUBE-MARK-DROP - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-HOSTPORTS - [0:0]\nCOMMIT\n";
        assert!(chains_in_save(save).is_empty());
        assert!(chains_in_save("").is_empty());
    }

    #[test]
    fn both_families_merge_into_one_finding() {
        let mut f = chains_in_save("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-A - [0:0]\nCOMMIT\n");
        f.merge(chains_in_save("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-B - [0:0]\n:KUBE-SVC-C - [0:0]\nCOMMIT\n"));
        assert_eq!(f.chains, ["nat KUBE-SERVICES"]);
        assert_eq!(f.per_service, 3);
        assert_eq!(Found { chains: vec![], per_service: 2 }.to_string(), "2 per-Service chains");
    }

    #[test]
    fn the_cleanup_removes_kube_proxys_chains_and_the_jumps_to_them_only() {
        let save = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n:KUBE-FORWARD - [0:0]\n\
                    -A INPUT -j KUBE-FIREWALL\n-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
                    -A FORWARD -s 10.0.0.0/8 -j ACCEPT\n-A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT\nCOMMIT\n\
                    *mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n\
                    *nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-AAAA - [0:0]\n:KUBE-SEP-BBBB - [0:0]\n\
                    -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n-A OUTPUT -g KUBE-SERVICES\n\
                    -A PREROUTING -p tcp --dport 8080 -j REDIRECT --to-ports 80\n\
                    -A KUBE-SERVICES -d 10.96.0.10/32 -j KUBE-SVC-AAAA\n-A KUBE-SVC-AAAA -j KUBE-SEP-BBBB\nCOMMIT\n";
        let script = cleanup_script(save).unwrap();
        assert_eq!(
            script,
            "*filter\n-D FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n-F KUBE-FORWARD\n-X KUBE-FORWARD\nCOMMIT\n\
             *nat\n-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n-D OUTPUT -g KUBE-SERVICES\n\
             -F KUBE-SERVICES\n-F KUBE-SVC-AAAA\n-F KUBE-SEP-BBBB\n-X KUBE-SERVICES\n-X KUBE-SVC-AAAA\n-X KUBE-SEP-BBBB\nCOMMIT\n"
        );
        // kubelet's chains alone: nothing to do.
        assert_eq!(cleanup_script("*filter\n:KUBE-FIREWALL - [0:0]\n-A INPUT -j KUBE-FIREWALL\nCOMMIT\n"), None);
        assert_eq!(cleanup_script(""), None);
    }

    #[test]
    fn the_cleanup_also_removes_kube_proxys_masquerade_chains_and_ipvs_filters() {
        let save = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-IPVS-FILTER - [0:0]\n:KUBE-SOURCE-RANGES-FIREWALL - [0:0]\n\
                    -A INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER\nCOMMIT\n\
                    *nat\n:POSTROUTING ACCEPT [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n\
                    -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
                    -A KUBE-POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE\nCOMMIT\n";
        assert_eq!(
            cleanup_script(save).unwrap(),
            "*filter\n-D INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER\n-F KUBE-IPVS-FILTER\n\
             -F KUBE-SOURCE-RANGES-FIREWALL\n-X KUBE-IPVS-FILTER\n-X KUBE-SOURCE-RANGES-FIREWALL\nCOMMIT\n\
             *nat\n-D POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n-F KUBE-POSTROUTING\n\
             -F KUBE-MARK-MASQ\n-X KUBE-POSTROUTING\n-X KUBE-MARK-MASQ\nCOMMIT\n"
        );
        // The IPVS filter chains are reported; the masquerade ones alone not.
        assert_eq!(chains_in_save(save).chains, ["filter KUBE-IPVS-FILTER", "filter KUBE-SOURCE-RANGES-FIREWALL"]);
    }

    #[test]
    fn kube_proxys_ipsets_are_found_by_name_in_both_families() {
        let list = "KUBE-CLUSTER-IP\nKUBE-6-CLUSTER-IP\nKUBE-NODE-PORT-LOCAL-SCTP-HASH\nKUBE-SRC-ABCDEF\nKUBE-6-SRC-ABC\nmy-set\n KUBE-IPVS-IPS \nKUBE-CLUSTER-IPX\n\
                    KUBE-6-LOAD-BALANCER-SOURCE-CID\nKUBE-6-NODE-PORT-LOCAL-SCTP-HAS\nKUBE-6-LOAD-BALANCER-SOURCE-CIDR\n";
        assert_eq!(
            ipsets_in_list(list),
            [
                "KUBE-CLUSTER-IP",
                "KUBE-6-CLUSTER-IP",
                "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
                "KUBE-IPVS-IPS",
                "KUBE-6-LOAD-BALANCER-SOURCE-CID",
                "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS"
            ],
            "IPv6 names are cut to 31 characters"
        );
        assert!(ipsets_in_list("").is_empty());
    }

    #[test]
    fn nftables_modes_tables_are_found_by_name() {
        let list = "table ip filter\ntable ip kube-proxy\ntable ip6 kube-proxy\ntable inet cilium\ntable ip nat\n";
        assert_eq!(tables_in_nft(list).chains, ["table ip kube-proxy", "table ip6 kube-proxy"]);
        assert!(tables_in_nft("table ip filter\ntable ip kube-proxy-other\n").is_empty());
        assert!(tables_in_nft("").is_empty());
    }
}
