//! The node's iptables FORWARD chains. Without `--bpf-forward`, what the TC
//! programs translate goes on through the stack's forwarding path, and so
//! through netfilter's FORWARD hook: NodePort requests for a backend on
//! another node or in a local pod, their replies on the way back to the
//! client, ICMP errors about them. Docker sets the FORWARD policy to DROP,
//! ufw does by default, hardened nodes end the chain with a REJECT.
//! kube-proxy's iptables mode lets its own flows through such a chain with
//! KUBE-FORWARD, which it jumps to first: its masquerade mark (0x4000)
//! accepts a flow's first packets, conntrack (ESTABLISHED) the rest.
//!
//! lb does the same with a mark: the TC programs set bit
//! `--forward-mark-bit` (default 12: 0x1000; kube-proxy's are 14 and 15,
//! Calico's 16-31) on every packet they translate and hand to the stack,
//! and the agent keeps `-A FORWARD -j LB-FORWARD` first in each FORWARD
//! chain that may not accept everything (a policy other than ACCEPT, or a
//! rule that drops, rejects or jumps to a chain), with `LB-FORWARD`
//! accepting that mark. It looks at
//! start, at every nftables change (`watch_nftables`: iptables-nft's rules
//! are nftables', so a firewall reload or `nft flush ruleset` is seen at
//! once) and every `--forward-accept-period` (iptables-legacy has no
//! change events), in every backend and family
//! the node uses (iptables-legacy only where its filter table exists:
//! looking at it would create it), and puts back what an operator or a
//! firewall service removed. Replies of local pods are not lb's to accept:
//! the pod's own traffic, which a working CNI accepts (flannel's
//! `-s POD_CIDR -j ACCEPT`, Calico's workload chains); kube-proxy's
//! conntrack rule would accept them too.
//!
//! Where conntrack runs (Docker's rules, a firewall's, a CNI's use it),
//! it sees only half of a SNATed or DSR flow in each tuple: lb translates
//! the replies before conntrack sees them, so they start a tuple of their
//! own with a SYN-ACK, and the client's ACKs never see an answer. It calls
//! those packets INVALID, and the common rule against INVALID packets
//! (`-t mangle -A PREROUTING -m conntrack --ctstate INVALID -j DROP`)
//! drops every such TCP handshake, which kube-proxy's flows pass; each
//! flow also takes conntrack entries for nothing. So the TC programs set
//! a second bit (`--notrack-mark-bit`, default 13) on those packets, both
//! ways, and once conntrack holds entries the agent adds the nftables
//! table `inet lb`, whose raw-priority prerouting chain exempts them
//! (`notrack`). Flows to local backends stay tracked: their replies are
//! conntrack's replies, and a CNI's MASQUERADE for the pods' own traffic
//! must not take them for new connections.
//!
//! The same table holds the masquerade rule (`--local-masquerade`): an
//! outside client's packets to a backend on this node of an
//! externalTrafficPolicy Cluster Service carry `--masquerade-mark-bit`
//! (default 11), and a nat postrouting chain masquerades them to the
//! address of the device they leave by, with random ports, as
//! kube-proxy's KUBE-EXT-* chains (KUBE-MARK-MASQ, then MASQUERADE
//! --random-fully in KUBE-POSTROUTING) do for every outside flow of such
//! a Service; lb SNATs the flows to other nodes itself. Unlike
//! kube-proxy's, the rule gives TCP and UDP ports outside lb's SNAT and
//! NodePort ranges only (`masquerade_ports`). conntrack reverses
//! the replies before the egress program translates them. A nat chain
//! makes conntrack run, so the notrack rule is written with it at once.
//!
//! The rules stay when the agent stops or restarts (traffic keeps
//! flowing through an upgrade); `lb-agent teardown` removes them, and
//! `--forward-accept none` / `--notrack none` their part. A native
//! nftables ruleset (not iptables-nft's tables) with a forward chain that
//! may drop cannot be overridden from another table: the agent names such
//! a chain in a warning.
use std::process::Command;
use std::sync::Arc;

use anyhow::Context as _;

/// nfnetlink's multicast group for nftables changes (tables, chains,
/// rules, sets; iptables-nft's too).
const NFNLGRP_NFTABLES: u32 = 7;

/// Wake `wake` at every nftables change in this network namespace, a burst
/// (a reload) as one, so that lb's rules are put back at once instead of
/// at the next period. lb's own writes wake it too; the look after them
/// finds everything in place and writes nothing. Err where the events
/// cannot be had (the period still covers everything).
pub fn watch_nftables(wake: Arc<tokio::sync::Notify>) -> anyhow::Result<()> {
    use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};
    let mut sock = Socket::new(NETLINK_NETFILTER).context("nfnetlink socket")?;
    sock.bind(&SocketAddr::new(0, 1 << (NFNLGRP_NFTABLES - 1))).context("subscribe to nftables changes")?;
    std::thread::Builder::new()
        .name("nftables".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                // A lost message (ENOBUFS) is a change too.
                if let Err(e) = sock.recv(&mut &mut buf[..], 0)
                    && e.raw_os_error() != Some(libc::ENOBUFS)
                {
                    tracing::warn!("nftables change events: {e}; lb's netfilter rules are looked at every --forward-accept-period only");
                    return;
                }
                // A reload is many changes: one look once it settles.
                std::thread::sleep(std::time::Duration::from_millis(100));
                while sock.recv(&mut &mut buf[..], libc::MSG_DONTWAIT).is_ok() {}
                wake.notify_one();
                // At most one look a second however often another program
                // writes its rules (each look runs six tools); what comes
                // meanwhile waits in the socket (a lost message, ENOBUFS,
                // is a change too).
                std::thread::sleep(std::time::Duration::from_millis(900));
            }
        })
        .context("spawn the nftables watcher")?;
    Ok(())
}

/// lb's chain in the filter table.
pub const CHAIN: &str = "LB-FORWARD";
const JUMP_COMMENT: &str = "lb: translated Service traffic";

/// A backend and family: its save and restore tools, and where the legacy
/// backend lists its tables (None: nft).
pub struct Backend {
    pub name: &'static str,
    save: &'static str,
    restore: &'static str,
    legacy_tables: Option<&'static str>,
}

pub const BACKENDS: [Backend; 4] = [
    Backend { name: "iptables-legacy (IPv4)", save: "iptables-legacy-save", restore: "iptables-legacy-restore", legacy_tables: Some("/proc/net/ip_tables_names") },
    Backend { name: "iptables-legacy (IPv6)", save: "ip6tables-legacy-save", restore: "ip6tables-legacy-restore", legacy_tables: Some("/proc/net/ip6_tables_names") },
    Backend { name: "iptables-nft (IPv4)", save: "iptables-nft-save", restore: "iptables-nft-restore", legacy_tables: None },
    Backend { name: "iptables-nft (IPv6)", save: "ip6tables-nft-save", restore: "ip6tables-nft-restore", legacy_tables: None },
];

/// lb's rule in `LB-FORWARD`, as iptables-save prints it.
fn accept_rule(mark: u32) -> String {
    format!("-A {CHAIN} -m comment --comment \"lb: accept what lb translated (mark {mark:#x})\" -m mark --mark {mark:#x}/{mark:#x} -j ACCEPT")
}

/// What `iptables-save -t filter` says of FORWARD and lb's chain.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Forward {
    /// FORWARD's policy ("ACCEPT", "DROP").
    pub policy: String,
    /// FORWARD's rules, other than lb's jump, that may drop a packet
    /// (`may_drop_rule`).
    pub others: usize,
    /// lb's jump is in FORWARD.
    pub jump: bool,
    /// lb's chain exists, with these rules.
    pub chain: Option<Vec<String>>,
}

impl Forward {
    /// Whether FORWARD could refuse what lb forwards.
    pub fn may_drop(&self) -> bool {
        self.policy != "ACCEPT" || self.others > 0
    }
}

/// Whether a rule may drop a packet: its target is DROP, REJECT or a
/// chain of rules (Docker's DOCKER-USER, ufw's, kube-proxy's), not one
/// that only accepts, returns, counts (no target) or logs.
fn may_drop_rule(rule: &str) -> bool {
    let mut w = rule.split_whitespace();
    let mut target = None;
    while let Some(t) = w.next() {
        if matches!(t, "-j" | "-g" | "--jump" | "--goto") {
            target = w.next();
        }
    }
    target.is_some_and(|t| !matches!(t, "ACCEPT" | "RETURN" | "LOG" | "NFLOG" | "MARK" | "CONNMARK" | "TRACE" | "CT" | "NOTRACK" | "TCPMSS" | "CLASSIFY"))
}

/// FORWARD and lb's chain in `iptables-save` output (the filter table).
pub fn forward_in_save(save: &str) -> Forward {
    let mut f = Forward { policy: "ACCEPT".into(), ..Default::default() };
    let mut table = "";
    let mut rules = Vec::new();
    let mut declared = false;
    for line in save.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.trim();
        } else if table != "filter" {
            continue;
        } else if let Some(decl) = line.strip_prefix(':') {
            let mut w = decl.split_whitespace();
            match (w.next(), w.next()) {
                (Some("FORWARD"), Some(policy)) => f.policy = policy.to_string(),
                (Some(CHAIN), _) => declared = true,
                _ => {}
            }
        } else if line.starts_with("-A FORWARD ") {
            if line.trim_end().ends_with(&format!("-j {CHAIN}")) {
                f.jump = true;
            } else if may_drop_rule(line) {
                f.others += 1;
            }
        } else if line.starts_with(&format!("-A {CHAIN} ")) {
            rules.push(line.trim_end().to_string());
        }
    }
    if declared {
        f.chain = Some(rules);
    }
    f
}

/// The `iptables-restore --noflush` script that makes `f` accept mark
/// `mark` first thing in FORWARD, or None if nothing is to be done
/// (FORWARD accepts everything, or lb's rules are in place).
pub fn ensure_script(f: &Forward, mark: u32) -> Option<String> {
    let want = vec![accept_rule(mark)];
    if !f.may_drop() || (f.jump && f.chain.as_ref() == Some(&want)) {
        return None;
    }
    // Declaring the chain flushes it (also with --noflush).
    let mut s = format!("*filter\n:{CHAIN} - [0:0]\n{}\n", want[0]);
    if !f.jump {
        s += &format!("-I FORWARD 1 -m comment --comment \"{JUMP_COMMENT}\" -j {CHAIN}\n");
    }
    s += "COMMIT\n";
    Some(s)
}

/// The script that removes lb's jumps and chain from `save`, or None.
pub fn removal_script(save: &str) -> Option<String> {
    let f = forward_in_save(save);
    if f.chain.is_none() && !f.jump {
        return None;
    }
    let mut s = String::from("*filter\n");
    let mut table = "";
    for line in save.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.trim();
        } else if table == "filter" && line.starts_with("-A ") && line.trim_end().ends_with(&format!("-j {CHAIN}")) {
            s += &format!("-D {}\n", &line.trim_end()[3..]);
        }
    }
    if f.chain.is_some() {
        s += &format!("-F {CHAIN}\n-X {CHAIN}\n");
    }
    s += "COMMIT\n";
    Some(s)
}

/// The filter table of `b` (`*-save -t filter`), or None where the
/// backend is not in use or its tool is missing. The legacy filter table
/// is read only if it exists: asking for it would create it.
fn save(b: &Backend) -> Option<String> {
    if let Some(names) = b.legacy_tables
        && !std::fs::read_to_string(names).is_ok_and(|t| t.lines().any(|l| l.trim() == "filter"))
    {
        return None;
    }
    match Command::new(b.save).args(["-t", "filter"]).output() {
        Ok(o) if o.status.success() => Some(String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(o) => {
            tracing::debug!(tool = b.save, status = %o.status, stderr = %String::from_utf8_lossy(&o.stderr).trim(), "cannot read the FORWARD chain");
            None
        }
        Err(e) => {
            tracing::debug!(tool = b.save, error = %e, "cannot read the FORWARD chain");
            None
        }
    }
}

fn restore(b: &Backend, script: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut child = Command::new(b.restore)
        .args(["--noflush", "-w", "5"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("run {}", b.restore))?;
    child.stdin.take().context("stdin")?.write_all(script.as_bytes()).with_context(|| format!("write to {}", b.restore))?;
    let out = child.wait_with_output()?;
    anyhow::ensure!(out.status.success(), "{} --noflush: {} ({}) on:\n{script}", b.restore, String::from_utf8_lossy(&out.stderr).trim(), out.status);
    Ok(())
}

/// What one look found, by backend or chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// An iptables FORWARD chain that may drop, with lb's rules in place.
    InPlace,
    /// An iptables FORWARD chain that may drop, where lb's rules could
    /// not be put (why).
    Failed(String),
    /// A native nftables forward chain that may drop (why): lb cannot
    /// accept its traffic there from another table.
    Native(&'static str),
}

pub type Seen = Vec<(String, State)>;

/// Look at every backend's FORWARD chain and put lb's rules where they
/// are needed (`mark`; 0: not), and lb's nftables table: its notrack rule
/// where conntrack runs (`notrack`; 0: not), its masquerade rule
/// (`masq`; 0: not) with its TCP and UDP ports (`masq_ports`); warn
/// about what changed since `last`, and count into `m`
/// (`lb_netfilter_rules_written_total`, `lb_netfilter_problems`).
pub fn ensure(mark: u32, notrack: u32, masq: u32, masq_ports: Option<(u16, u16)>, last: &mut Option<Seen>, m: &crate::health::Metrics) {
    let mut now = Seen::new();
    if (notrack != 0 || masq != 0)
        && let Some(state) = ensure_table(notrack, masq, masq_ports, m)
    {
        now.push((format!("nftables {NFT_TABLE}"), state));
    }
    if mark == 0 {
        report(mark, &now, last, m);
        return;
    }
    for b in &BACKENDS {
        let Some(text) = save(b) else { continue };
        let f = forward_in_save(&text);
        if !f.may_drop() {
            continue;
        }
        let state = match ensure_script(&f, mark) {
            None => State::InPlace,
            Some(script) => match restore(b, &script) {
                Ok(()) => {
                    m.netfilter_written.get_or_create(&[("kind", "forward")]).inc();
                    tracing::info!(
                        backend = b.name,
                        policy = f.policy,
                        rules = f.others,
                        "the FORWARD chain may drop what lb forwards through the stack: {CHAIN} accepts it (mark {mark:#x}), jumped to first, as kube-proxy's KUBE-FORWARD does"
                    );
                    State::InPlace
                }
                Err(e) => State::Failed(format!("{e:#}")),
            },
        };
        now.push((b.name.to_string(), state));
    }
    for (table, chain, why) in native_forward_drops(mark) {
        now.push((format!("nftables {table} {chain}"), State::Native(why)));
    }
    report(mark, &now, last, m);
}

/// Warn about what changed since `last`, and keep `now` as the last.
fn report(mark: u32, now: &Seen, last: &mut Option<Seen>, m: &crate::health::Metrics) {
    m.netfilter_problems.set(now.iter().filter(|(_, s)| *s != State::InPlace).count() as i64);
    for (name, state) in now {
        if last.as_ref().and_then(|l| l.iter().find(|(n, _)| n == name)).map(|(_, s)| s) == Some(state) {
            continue;
        }
        match state {
            State::Native(why) => tracing::warn!(
                chain = name,
                "an nftables forward chain may drop what lb forwards through the stack (NodePort traffic for backends on other nodes, and its replies): {why}. An accept in another table cannot override it: add `meta mark & {mark:#x} == {mark:#x} accept` first in that chain, or run with --bpf-forward"
            ),
            State::Failed(e) if name.starts_with("nftables ") => tracing::warn!(table = name, "lb's nftables table could not be written: {e}"),
            State::Failed(e) => tracing::warn!(
                backend = name,
                "the FORWARD chain may drop what lb forwards through the stack (NodePort traffic for backends on other nodes, and its replies), and lb's rules could not be put there: {e}. Run with --bpf-forward, or accept mark {mark:#x} in FORWARD"
            ),
            State::InPlace => {}
        }
    }
    *last = Some(now.clone());
}

/// lb's nftables table: the notrack rule and the masquerade rule.
pub const NFT_TABLE: &str = "inet lb";

fn notrack_comment(mark: u32) -> String {
    format!("lb: SNATed and DSR flows skip conntrack (mark {mark:#x})")
}

/// The comment of the masquerade rule that matches nothing (`table_script`).
const KEEP_COMMENT: &str = "lb: matches nothing; keeps connections masqueraded before --local-masquerade none (lb-agent teardown removes it)";

fn masquerade_comment(mark: u32, ports: Option<(u16, u16)>) -> String {
    let ports = ports.map_or(String::new(), |(lo, hi)| format!(", ports {lo}-{hi}"));
    format!("lb: outside flows to local backends of externalTrafficPolicy Cluster Services are masqueraded (mark {mark:#x}{ports})")
}

/// The source ports the masquerade rule gives TCP and UDP flows: the
/// longest run of 1024-65535 outside the ranges in `avoid` (None where
/// nothing is left: then any port, as kube-proxy's rule gives). lb passes
/// its SNAT range (`--snat-ports`) and the NodePort range:
/// - lb's masquerade in BPF (`--bpf-forward`) takes its ports from the
///   SNAT range, checking its own NAT table, not conntrack: a port the
///   stack gave a flow to the same pod, while both kinds of flow live
///   (after `--bpf-forward` is turned on or off), would be given twice.
/// - With `--per-packet-lb` the pod program sees a pod's reply before
///   conntrack does: one to a NodePort (the stack's masquerade gave the
///   flow that port) would look like a new connection to it.
pub fn masquerade_ports(avoid: &[(u16, u16)]) -> Option<(u16, u16)> {
    let mut ranges: Vec<(u32, u32)> = avoid.iter().map(|&(a, b)| (u32::from(a.min(b)), u32::from(a.max(b)))).collect();
    ranges.sort();
    let mut best: Option<(u32, u32)> = None;
    let mut consider = |lo: u32, hi: u32| {
        if lo <= hi && best.is_none_or(|(a, b)| hi - lo > b - a) {
            best = Some((lo, hi));
        }
    };
    let mut next = 1024u32;
    for (a, b) in ranges {
        if a > next {
            consider(next, a - 1);
        }
        next = next.max(b + 1);
    }
    consider(next, 65535);
    best.map(|(lo, hi)| (lo as u16, hi as u16))
}

/// The `nft -f` script that makes `inet lb` hold exactly what is asked
/// for, replacing what the table held (one transaction: the table is
/// created if missing, deleted, and written again):
/// - `notrack` (a mark; 0: none): packets carrying it skip conntrack.
///   Priority raw (-300): before conntrack (-200).
/// - `masq` (a mark; 0: none): packets carrying it are masqueraded to
///   the address of the device they leave by, with random ports
///   (kube-proxy's `MASQUERADE --random-fully` for its masquerade mark),
///   TCP and UDP within `ports` (`masquerade_ports`; None: any).
/// - `keep_nat` (with `masq` 0): the nat chain stays, with a masquerade
///   rule that matches nothing, so that the connections masqueraded
///   before the masquerade was turned off keep their translation. The
///   kernel applies NAT only while some nat chain exists in the network
///   namespace, and when its last masquerade rule goes it deletes every
///   masqueraded conntrack entry (unregistering its device notifier
///   replays a "device down" for each device), which resets those
///   connections.
pub fn table_script(notrack: u32, masq: u32, ports: Option<(u16, u16)>, keep_nat: bool) -> String {
    let mut s = format!("add table {NFT_TABLE}\ndelete table {NFT_TABLE}\nadd table {NFT_TABLE}\n");
    if notrack != 0 {
        s += &format!(
            "add chain {NFT_TABLE} prerouting {{ type filter hook prerouting priority raw; policy accept; }}\n\
             add rule {NFT_TABLE} prerouting meta mark & {notrack:#x} == {notrack:#x} notrack comment \"{}\"\n",
            notrack_comment(notrack)
        );
    }
    if masq != 0 || keep_nat {
        s += &format!("add chain {NFT_TABLE} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}\n");
    }
    if masq == 0 && keep_nat {
        s += &format!("add rule {NFT_TABLE} postrouting meta nfproto ipv4 meta nfproto ipv6 masquerade comment \"{KEEP_COMMENT}\"\n");
    }
    if masq != 0 {
        // Ports need a transport protocol; lb marks TCP and UDP flows only.
        let action = ports.map_or("masquerade".to_string(), |(lo, hi)| format!("meta l4proto {{ tcp, udp }} masquerade to :{lo}-{hi}"));
        s += &format!(
            "add rule {NFT_TABLE} postrouting meta mark & {masq:#x} == {masq:#x} {action} fully-random comment \"{}\"\n",
            masquerade_comment(masq, ports)
        );
    }
    s
}

/// The comments of a table's rules (`nft list table` output), sorted:
/// what the table holds, as lb wrote it.
fn rule_comments(table: &str) -> Vec<String> {
    let mut out: Vec<String> = table.lines().filter_map(|l| l.split_once("comment \"").and_then(|(_, c)| c.rsplit_once('"')).map(|(c, _)| c.to_string())).collect();
    out.sort();
    out
}

/// Whether conntrack holds entries in this network namespace (Docker's
/// rules, a firewall's or a CNI's use it): then lb's SNATed and DSR flows
/// are exempted from it.
pub fn conntrack_in_use() -> bool {
    std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_count").is_ok_and(|n| n.trim().parse::<u64>().is_ok_and(|n| n > 0))
}

fn nft(args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
    use std::io::Write as _;
    let mut child = Command::new("nft")
        .args(args)
        .stdin(if stdin.is_some() { std::process::Stdio::piped() } else { std::process::Stdio::null() })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("run nft")?;
    if let Some(text) = stdin {
        child.stdin.take().context("stdin")?.write_all(text.as_bytes()).context("write to nft")?;
    }
    let out = child.wait_with_output()?;
    anyhow::ensure!(out.status.success(), "nft {}: {} ({})", args.join(" "), String::from_utf8_lossy(&out.stderr).trim(), out.status);
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The nat chain's line in `nft list table` output.
const NAT_CHAIN: &str = "type nat hook postrouting";

/// lb's table: in place (None where it is not needed: no masquerade,
/// conntrack holds nothing here and the table is not there), put there,
/// or why not. The masquerade rule makes conntrack run, so the notrack
/// rule comes with it. A nat chain lb wrote stays, with a rule that
/// matches nothing, when the masquerade is turned off (`table_script`);
/// with nothing else to hold, a table without one is removed.
pub fn ensure_table(notrack: u32, masq: u32, masq_ports: Option<(u16, u16)>, m: &crate::health::Metrics) -> Option<State> {
    let table: Vec<&str> = NFT_TABLE.split_whitespace().collect();
    let current = nft(&["list", "table", table[0], table[1]], None).ok();
    let keep_nat = masq == 0 && current.as_deref().is_some_and(|t| t.contains(NAT_CHAIN));
    let notrack = if masq != 0 || current.is_some() || conntrack_in_use() { notrack } else { 0 };
    if notrack == 0 && masq == 0 && !keep_nat {
        if current.is_some() {
            for e in remove_table() {
                tracing::warn!("lb's netfilter rules turned off: cannot remove {e}");
            }
        }
        return None;
    }
    let mut want: Vec<String> = [(notrack, notrack_comment(notrack)), (masq, masquerade_comment(masq, masq_ports)), (keep_nat as u32, KEEP_COMMENT.to_string())]
        .into_iter()
        .filter(|(m, _)| *m != 0)
        .map(|(_, c)| c)
        .collect();
    want.sort();
    if current.as_deref().is_some_and(|t| rule_comments(t) == want) {
        return Some(State::InPlace);
    }
    Some(match nft(&["-f", "-"], Some(&table_script(notrack, masq, masq_ports, keep_nat))) {
        Ok(_) => {
            if notrack != 0 {
                m.netfilter_written.get_or_create(&[("kind", "notrack")]).inc();
                let why = if masq != 0 { "the masquerade rule makes conntrack run" } else { "conntrack runs on this node" };
                tracing::info!(
                    "{why}: lb's SNATed and DSR flows skip it (nftables table {NFT_TABLE}: notrack for mark {notrack:#x}), so that rules dropping INVALID packets pass them and they take no conntrack entries"
                );
            }
            if keep_nat {
                tracing::info!(
                    "outside flows to local backends are no longer masqueraded; table {NFT_TABLE} keeps its nat chain, with a masquerade rule that matches nothing, so that connections masqueraded before keep their translation (lb-agent teardown removes it)"
                );
            }
            if masq != 0 {
                m.netfilter_written.get_or_create(&[("kind", "masquerade")]).inc();
                let ports = masq_ports.map_or(String::new(), |(lo, hi)| format!(", TCP and UDP ports {lo}-{hi}: outside --snat-ports and the NodePort range"));
                tracing::info!(
                    "outside flows to backends on this node of externalTrafficPolicy Cluster Services are masqueraded to the node's address, as kube-proxy does (nftables table {NFT_TABLE}: masquerade for mark {masq:#x}{ports})"
                );
            }
            State::InPlace
        }
        Err(e) => {
            let e = format!("{e:#}");
            let mut why = Vec::new();
            if notrack != 0 {
                why.push("lb's SNATed and DSR flows are tracked, and a rule that drops INVALID packets drops their TCP handshakes");
            }
            if masq != 0 {
                why.push("backends on this node see the outside clients' addresses, where kube-proxy's would see the node's");
            }
            State::Failed(if why.is_empty() { e } else { format!("{e}; {}", why.join("; ")) })
        }
    })
}

/// Remove lb's nftables table (`lb-agent teardown`, `--notrack none` with
/// `--local-masquerade none`).
pub fn remove_table() -> Vec<String> {
    let table: Vec<&str> = NFT_TABLE.split_whitespace().collect();
    if nft(&["list", "table", table[0], table[1]], None).is_err() {
        return Vec::new();
    }
    match nft(&["delete", "table", table[0], table[1]], None) {
        Ok(_) => {
            tracing::info!("nftables table {NFT_TABLE} removed");
            Vec::new()
        }
        Err(e) => vec![format!("nftables table {NFT_TABLE}: {e:#}")],
    }
}

/// Native nftables forward chains (not iptables-nft's filter tables, not
/// kube-proxy's, not lb's) that may drop: table ("inet firewalld"), chain,
/// and why.
fn native_forward_drops(mark: u32) -> Vec<(String, String, &'static str)> {
    let nft = |args: &[&str]| nft(args, None).ok();
    let Some(list) = nft(&["list", "chains"]) else { return Vec::new() };
    let mut out = Vec::new();
    for (table, chain, policy_drop) in forward_chains_in_nft(&list) {
        let mut args = vec!["list", "chain"];
        args.extend(table.split_whitespace());
        args.push(&chain);
        let rules = nft(&args).unwrap_or_default();
        // The operator put the rule the warning gives first: lb's flows pass.
        if accepts_mark_first(&rules, mark) {
            continue;
        }
        if policy_drop {
            out.push((table, chain, "its policy is drop"));
        } else if rules_may_drop(&rules) {
            out.push((table, chain, "it has rules that drop, reject or jump to other chains"));
        }
    }
    out
}

/// The rule lines of a chain (`nft list chain` output).
fn rule_lines(chain: &str) -> impl Iterator<Item = &str> {
    chain
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("type ") && !l.starts_with("table ") && !l.starts_with("chain ") && *l != "}")
}

/// Whether a chain's first rule accepts packets carrying `mark` (the rule
/// the warning asks for: `meta mark & MARK == MARK accept`, a counter or a
/// comment in it or not).
pub fn accepts_mark_first(chain: &str, mark: u32) -> bool {
    let m = format!("{mark:#010x}");
    rule_lines(chain).next().is_some_and(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        w.len() >= 7 && w[..6] == ["meta", "mark", "&", m.as_str(), "==", m.as_str()] && w.iter().take_while(|x| **x != "comment").any(|x| *x == "accept")
    })
}

/// The native forward base chains in `nft list chains` output: table,
/// chain, and whether its policy is drop.
pub fn forward_chains_in_nft(list: &str) -> Vec<(String, String, bool)> {
    let mut out = Vec::new();
    let (mut table, mut chain) = (String::new(), String::new());
    for line in list.lines() {
        let mut w = line.split_whitespace();
        match (w.next(), w.next(), w.next()) {
            (Some("table"), Some(family), Some(name)) => table = format!("{family} {name}"),
            (Some("chain"), Some(name), _) => chain = name.to_string(),
            // iptables-nft's own tables are handled through iptables.
            (Some("type"), _, _)
                if line.contains("hook forward")
                    && table != "ip filter"
                    && table != "ip6 filter"
                    && !table.ends_with(" kube-proxy")
                    && table != NFT_TABLE =>
            {
                out.push((table.clone(), chain.clone(), line.contains("policy drop")));
            }
            _ => {}
        }
    }
    out
}

/// Whether a chain's rules (`nft list chain` output) may drop a packet: a
/// rule that drops, rejects, queues, or jumps or goes to another chain.
pub fn rules_may_drop(chain: &str) -> bool {
    rule_lines(chain).any(|l| l.split_whitespace().any(|w| matches!(w, "drop" | "reject" | "queue" | "jump" | "goto")))
}

/// Remove lb's rules from every backend (`lb-agent teardown`,
/// `--forward-accept none`); errors are returned, each naming its tool.
pub fn remove() -> Vec<String> {
    let mut errors = Vec::new();
    for b in &BACKENDS {
        let Some(script) = save(b).as_deref().and_then(removal_script) else { continue };
        match restore(b, &script) {
            Ok(()) => tracing::info!(backend = b.name, "{CHAIN} removed"),
            Err(e) => errors.push(format!("{}: {e:#}", b.name)),
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOCKER: &str = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n:DOCKER-USER - [0:0]\n\
                          -A FORWARD -j DOCKER-USER\n-A DOCKER-USER -j RETURN\nCOMMIT\n";

    #[test]
    fn a_forward_chain_that_may_drop_gets_lbs_rules_first() {
        let f = forward_in_save(DOCKER);
        assert_eq!(f, Forward { policy: "DROP".into(), others: 1, jump: false, chain: None });
        let s = ensure_script(&f, 0x1000).unwrap();
        assert_eq!(
            s,
            "*filter\n:LB-FORWARD - [0:0]\n\
             -A LB-FORWARD -m comment --comment \"lb: accept what lb translated (mark 0x1000)\" -m mark --mark 0x1000/0x1000 -j ACCEPT\n\
             -I FORWARD 1 -m comment --comment \"lb: translated Service traffic\" -j LB-FORWARD\nCOMMIT\n"
        );
        // In place: nothing to do.
        let done = "*filter\n:FORWARD DROP [0:0]\n:LB-FORWARD - [0:0]\n\
                    -A FORWARD -m comment --comment \"lb: translated Service traffic\" -j LB-FORWARD\n-A FORWARD -j DOCKER-USER\n\
                    -A LB-FORWARD -m comment --comment \"lb: accept what lb translated (mark 0x1000)\" -m mark --mark 0x1000/0x1000 -j ACCEPT\nCOMMIT\n";
        let f = forward_in_save(done);
        assert!(f.jump && f.others == 1);
        assert_eq!(ensure_script(&f, 0x1000), None);
        // Another mark: the chain is rewritten, the jump stays.
        let s = ensure_script(&f, 0x2000).unwrap();
        assert!(s.contains("--mark 0x2000/0x2000") && !s.contains("-I FORWARD"), "{s}");
        // The chain flushed by an operator: filled again.
        let flushed = done.replace("-A LB-FORWARD -m comment --comment \"lb: accept what lb translated (mark 0x1000)\" -m mark --mark 0x1000/0x1000 -j ACCEPT\n", "");
        assert!(ensure_script(&forward_in_save(&flushed), 0x1000).is_some_and(|s| !s.contains("-I FORWARD")));
    }

    #[test]
    fn a_forward_chain_that_accepts_everything_is_left_alone() {
        let open = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";
        assert!(!forward_in_save(open).may_drop());
        assert_eq!(ensure_script(&forward_in_save(open), 0x1000), None);
        // Rules (a REJECT at the end, RHEL's) under an ACCEPT policy.
        let reject = "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -j REJECT --reject-with icmp-host-prohibited\nCOMMIT\n";
        assert!(forward_in_save(reject).may_drop());
        // Rules that cannot drop: counting, accepting, logging.
        let counting = "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -p tcp -m tcp --dport 8080\n-A FORWARD -s 10.244.0.0/16 -j ACCEPT\n\
                        -A FORWARD -j LOG --log-prefix \"fwd \"\nCOMMIT\n";
        assert!(!forward_in_save(counting).may_drop());
        assert!(forward_in_save("*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -j DOCKER-USER\nCOMMIT\n").may_drop(), "a chain may drop");
        assert!(forward_in_save("*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -i eth0 -j DROP\nCOMMIT\n").may_drop());
        // Other tables' FORWARD chains do not count.
        let mangle = "*mangle\n:FORWARD ACCEPT [0:0]\n-A FORWARD -j MARK --set-mark 1\nCOMMIT\n*filter\n:FORWARD ACCEPT [0:0]\nCOMMIT\n";
        assert!(!forward_in_save(mangle).may_drop());
    }

    #[test]
    fn removal_takes_lbs_jumps_and_chain_only() {
        let save = "*filter\n:FORWARD DROP [0:0]\n:LB-FORWARD - [0:0]\n:DOCKER-USER - [0:0]\n\
                    -A FORWARD -m comment --comment \"lb: translated Service traffic\" -j LB-FORWARD\n-A FORWARD -j DOCKER-USER\n\
                    -A LB-FORWARD -m mark --mark 0x1000/0x1000 -j ACCEPT\nCOMMIT\n";
        assert_eq!(
            removal_script(save).unwrap(),
            "*filter\n-D FORWARD -m comment --comment \"lb: translated Service traffic\" -j LB-FORWARD\n-F LB-FORWARD\n-X LB-FORWARD\nCOMMIT\n"
        );
        assert_eq!(removal_script(DOCKER), None);
    }

    #[test]
    fn the_table_is_replaced_whole() {
        let notrack = "add chain inet lb prerouting { type filter hook prerouting priority raw; policy accept; }\n\
                       add rule inet lb prerouting meta mark & 0x2000 == 0x2000 notrack comment \"lb: SNATed and DSR flows skip conntrack (mark 0x2000)\"\n";
        let masq = "add chain inet lb postrouting { type nat hook postrouting priority srcnat; policy accept; }\n\
                    add rule inet lb postrouting meta mark & 0x800 == 0x800 masquerade fully-random comment \"lb: outside flows to local backends of externalTrafficPolicy Cluster Services are masqueraded (mark 0x800)\"\n";
        let head = "add table inet lb\ndelete table inet lb\nadd table inet lb\n";
        assert_eq!(table_script(0x2000, 0, None, false), format!("{head}{notrack}"));
        assert_eq!(table_script(0, 0x800, None, false), format!("{head}{masq}"));
        assert_eq!(table_script(0x2000, 0x800, None, false), format!("{head}{notrack}{masq}"));
        assert_eq!(table_script(0x2000, 0x800, None, true), format!("{head}{notrack}{masq}"), "the chain once");
        let (chain, _) = masq.split_once("add rule").unwrap();
        let keep = format!("add rule inet lb postrouting meta nfproto ipv4 meta nfproto ipv6 masquerade comment \"{KEEP_COMMENT}\"\n");
        assert_eq!(table_script(0x2000, 0, None, true), format!("{head}{notrack}{chain}{keep}"), "the nat chain kept, with a rule that matches nothing");
        assert_eq!(table_script(0, 0, None, true), format!("{head}{chain}{keep}"));
        assert_eq!(table_script(0x2000, 0, Some((32768, 65535)), true), format!("{head}{notrack}{chain}{keep}"), "no ports without the masquerade");
        let ported = "add rule inet lb postrouting meta mark & 0x800 == 0x800 meta l4proto { tcp, udp } masquerade to :32768-65535 fully-random \
                      comment \"lb: outside flows to local backends of externalTrafficPolicy Cluster Services are masqueraded (mark 0x800, ports 32768-65535)\"\n";
        assert_eq!(table_script(0, 0x800, Some((32768, 65535)), false), format!("{head}{chain}{ported}"));
    }

    #[test]
    fn the_masquerade_keeps_out_of_lbs_port_ranges() {
        // The defaults: --snat-ports 1024-29999, NodePorts 30000-32767.
        assert_eq!(masquerade_ports(&[(1024, 29999), (30000, 32767)]), Some((32768, 65535)));
        assert_eq!(masquerade_ports(&[(30000, 32767), (1024, 29999)]), Some((32768, 65535)), "in any order");
        assert_eq!(masquerade_ports(&[]), Some((1024, 65535)));
        // The longest run wins: 1024-29999 over 32768-39999 and 50001-65535.
        assert_eq!(masquerade_ports(&[(40000, 50000), (30000, 32767)]), Some((1024, 29999)));
        // Overlapping, nested, below 1024, reversed.
        assert_eq!(masquerade_ports(&[(100, 2000), (1500, 40000), (2000, 3000)]), Some((40001, 65535)));
        assert_eq!(masquerade_ports(&[(60000, 50000), (1024, 49999)]), Some((60001, 65535)));
        // Up to the top, and a single port left.
        assert_eq!(masquerade_ports(&[(1025, 65535)]), Some((1024, 1024)));
        assert_eq!(masquerade_ports(&[(1024, 65535)]), None, "nothing left");
        assert_eq!(masquerade_ports(&[(1, 65535), (30000, 32767)]), None);
    }

    #[test]
    fn the_table_is_read_back_by_its_rules_comments() {
        // As `nft list table inet lb` prints what table_script wrote.
        let listed = "table inet lb {\n\tchain prerouting {\n\t\ttype filter hook prerouting priority raw; policy accept;\n\
                      \t\tmeta mark & 0x00002000 == 0x00002000 notrack comment \"lb: SNATed and DSR flows skip conntrack (mark 0x2000)\"\n\t}\n\n\
                      \tchain postrouting {\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n\
                      \t\tmeta mark & 0x00000800 == 0x00000800 masquerade fully-random comment \"lb: outside flows to local backends of externalTrafficPolicy Cluster Services are masqueraded (mark 0x800)\"\n\t}\n}\n";
        let mut want = vec![notrack_comment(0x2000), masquerade_comment(0x800, None)];
        want.sort();
        assert_eq!(rule_comments(listed), want);
        assert_eq!(rule_comments("table inet lb {\n}\n"), Vec::<String>::new());
    }

    #[test]
    fn native_nftables_forward_chains_that_may_drop_are_found() {
        let list = "table ip filter {\n\tchain FORWARD {\n\t\ttype filter hook forward priority filter; policy drop;\n\t}\n}\n\
                    table inet firewall {\n\tchain fwd {\n\t\ttype filter hook forward priority filter; policy drop;\n\t}\n\
                    \tchain input {\n\t\ttype filter hook input priority filter; policy drop;\n\t}\n}\n\
                    table inet open {\n\tchain forward {\n\t\ttype filter hook forward priority filter; policy accept;\n\t}\n}\n\
                    table ip kube-proxy {\n\tchain filter-forward {\n\t\ttype filter hook forward priority -110; policy accept;\n\t}\n}\n";
        assert_eq!(
            forward_chains_in_nft(list),
            [("inet firewall".to_string(), "fwd".to_string(), true), ("inet open".to_string(), "forward".to_string(), false)]
        );
        // firewalld's: policy accept, then a reject at the end.
        let firewalld = "table inet firewalld {\n\tchain filter_FORWARD {\n\t\ttype filter hook forward priority filter + 10; policy accept;\n\
                         \t\tct state { established, related } accept\n\t\tct status dnat accept\n\t\tiifname \"lo\" accept\n\
                         \t\tct state invalid drop\n\t\treject with icmpx admin-prohibited\n\t}\n}\n";
        assert!(rules_may_drop(firewalld));
        let open = "table inet filter {\n\tchain forward {\n\t\ttype filter hook forward priority filter; policy accept;\n\
                    \t\tct state established counter accept\n\t\tcounter\n\t}\n}\n";
        assert!(!rules_may_drop(open));
    }

    #[test]
    fn the_rule_the_warning_asks_for_counts_only_first_and_for_lbs_mark() {
        // As `nft list chain` prints the rule `meta mark & 0x1000 == 0x1000 accept`.
        let chain = |rules: &str| format!("table inet hostfw {{\n\tchain fwd {{\n\t\ttype filter hook forward priority filter; policy drop;\n{rules}\t}}\n}}\n");
        let ours = "\t\tmeta mark & 0x00001000 == 0x00001000 accept\n";
        let other = "\t\tct state established accept\n";
        assert!(accepts_mark_first(&chain(ours), 0x1000));
        assert!(accepts_mark_first(&chain(&format!("{ours}{other}\t\treject\n")), 0x1000));
        assert!(!accepts_mark_first(&chain(&format!("{other}{ours}")), 0x1000), "not first");
        assert!(!accepts_mark_first(&chain(ours), 0x2000), "another mark");
        assert!(accepts_mark_first(&chain("\t\tmeta mark & 0x00001000 == 0x00001000 counter packets 3 bytes 180 accept\n"), 0x1000));
        assert!(!accepts_mark_first(&chain("\t\tmeta mark & 0x00001000 == 0x00001000 drop\n"), 0x1000));
        assert!(!accepts_mark_first(&chain(""), 0x1000));
    }
}
