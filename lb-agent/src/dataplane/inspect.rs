//! `lb-agent list`: what the pinned maps hold, like `ipvsadm -Ln`.
use std::fmt::Write as _;

use lb_common::{
    PROTO_TCP, PROTO_UDP, SCOPE_ALL, SCOPE_LOCAL, STATS_BACKEND, STATS_FRONTEND, SvcKey, SvcStats, SvcStatsKey, backend_flags,
    svc_flags,
};
use serde::Serialize;

use super::writer::{Addr, Table};

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct BackendView {
    pub id: u32,
    pub address: String,
    pub port: u16,
    pub local: bool,
    /// "active", "terminating" (serving while terminating: used only
    /// because no endpoint is ready), or "missing" (a slot, or the backend
    /// its id names, is not in the maps: drift the agent repairs).
    pub state: &'static str,
    /// `--stats`: connections translated to it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats: Option<Counters>,
}

/// One frontend's or backend's counters (`lb-agent list --stats`).
#[derive(Debug, Serialize, PartialEq, Eq, Clone, Copy, Default)]
pub struct Counters {
    pub conns: u64,
    pub refused: u64,
    pub unreachable: u64,
    /// Packets dropped by loadBalancerSourceRanges.
    pub source_range: u64,
    pub packets: u64,
    pub bytes: u64,
}

impl From<SvcStats> for Counters {
    fn from(s: SvcStats) -> Self {
        let SvcStats { conns, refused, unreachable, packets, bytes, source_range } = s;
        Self { conns, refused, unreachable, source_range, packets, bytes }
    }
}

/// The counters of every frontend and backend, when asked for.
pub type SvcCounters = std::collections::BTreeMap<SvcStatsKey, SvcStats>;

fn counters(svc: Option<&SvcCounters>, kind: u8, family: u8, id: u32) -> Option<Counters> {
    svc.map(|m| m.get(&SvcStatsKey { id, kind, family, _pad: 0 }).copied().unwrap_or_default().into())
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct FrontendView {
    pub family: &'static str,
    pub address: String,
    pub port: u16,
    pub protocol: &'static str,
    pub rev_nat_id: u16,
    /// affinity, itp-local, topology, external, etp-local, no-socket,
    /// source-ranges, maglev, dsr.
    pub flags: Vec<&'static str>,
    pub affinity_timeout: Option<u32>,
    pub backends: Vec<BackendView>,
    /// For internalTrafficPolicy Local (the node's own connections) and
    /// externalTrafficPolicy Local (outside clients): the node-local
    /// backends used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_backends: Option<Vec<BackendView>>,
    /// `--stats`: its counters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats: Option<Counters>,
    /// A Maglev frontend: its table (scope "all") as the kernel holds it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maglev: Option<MaglevView>,
}

/// A Maglev table as the kernel holds it. The digest covers the backend
/// address of every entry in order: every node with the same backends
/// and seed shows the same digest, whatever its backend ids.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct MaglevView {
    pub size: usize,
    /// Distinct backends named by the table.
    pub backends: usize,
    pub digest: String,
}

/// The `MaglevView` of a table of backend ids, given the family's table
/// (for the ids' addresses).
pub fn maglev_view<A: Addr>(t: &Table<A>, ids: &[u32]) -> MaglevView {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for id in ids {
        let name = t.backends.get(id).map_or_else(|| format!("?{id}"), |b| format!("{}:{}", b.addr.to_ip(), b.port));
        for byte in name.bytes().chain([0]) {
            h = (h ^ byte as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    let distinct: std::collections::BTreeSet<&u32> = ids.iter().collect();
    MaglevView { size: ids.len(), backends: distinct.len(), digest: format!("{h:016x}") }
}

#[derive(Debug, Serialize)]
pub struct ListView {
    pub frontends: Vec<FrontendView>,
    /// Addresses known as ClusterIPs: other ports on them are refused.
    pub vips: Vec<String>,
    pub stats: std::collections::BTreeMap<&'static str, u64>,
}

fn proto_name(p: u8) -> &'static str {
    match p {
        PROTO_TCP => "TCP",
        PROTO_UDP => "UDP",
        _ => "?",
    }
}

/// The backends of a frontend's `count` slots in `scope`. A slot that is
/// missing, or names a backend id the backends map does not hold, is
/// shown as "missing" (id 0 for a missing slot): the programs pick it
/// and try again, and a connect can be refused; the agent repairs such
/// drift at its next resync.
fn backends<A: Addr>(t: &Table<A>, k: &SvcKey<A>, scope: u8, count: u16, svc: Option<&SvcCounters>) -> Vec<BackendView> {
    (1..=count)
        .map(|slot| {
            let missing = |id: u32| BackendView { id, address: "?".into(), port: 0, local: false, state: "missing", stats: None };
            let Some(s) = t.services.get(&SvcKey::new(k.addr, k.port, k.proto, scope, slot)) else { return missing(0) };
            let Some(b) = t.backends.get(&s.backend_id) else { return missing(s.backend_id) };
            BackendView {
                id: s.backend_id,
                address: b.addr.to_ip().to_string(),
                port: b.port,
                local: b.flags & backend_flags::LOCAL != 0,
                state: if b.flags & backend_flags::TERMINATING != 0 { "terminating" } else { "active" },
                stats: counters(svc, STATS_BACKEND, A::FAMILY, s.backend_id),
            }
        })
        .collect()
}

fn add<A: Addr>(t: &Table<A>, out: &mut ListView, svc: Option<&SvcCounters>) {
    for (k, v) in &t.services {
        if k.slot != 0 || k.scope != SCOPE_ALL {
            continue;
        }
        if v.flags & svc_flags::VIP_MARKER != 0 {
            out.vips.push(k.addr.to_ip().to_string());
            continue;
        }
        let local_only = v.flags & svc_flags::LOCAL_ONLY != 0;
        let ext_local = v.flags & svc_flags::EXT_LOCAL != 0;
        let mut flags = Vec::new();
        if v.flags & svc_flags::AFFINITY != 0 {
            flags.push("affinity");
        }
        if local_only {
            flags.push("itp-local");
        }
        if v.flags & svc_flags::TOPOLOGY != 0 {
            flags.push("topology");
        }
        if v.flags & svc_flags::EXTERNAL != 0 {
            flags.push("external");
        }
        if v.flags & svc_flags::EXT_LOCAL != 0 {
            flags.push("etp-local");
        }
        if v.flags & svc_flags::NO_SOCKET != 0 {
            flags.push("no-socket");
        }
        if v.flags & svc_flags::HOST_ONLY != 0 {
            flags.push("host-only");
        }
        if v.flags & svc_flags::SRC_RANGE != 0 {
            flags.push("source-ranges");
        }
        if v.flags & svc_flags::MAGLEV != 0 {
            flags.push("maglev");
        }
        if v.flags & svc_flags::DSR != 0 {
            flags.push("dsr");
        }
        let local_backends = (local_only || ext_local).then(|| {
            let n = t.services.get(&SvcKey::new(k.addr, k.port, k.proto, SCOPE_LOCAL, 0)).map_or(0, |l| l.count);
            backends(t, k, SCOPE_LOCAL, n, svc)
        });
        out.frontends.push(FrontendView {
            family: A::NAME,
            address: k.addr.to_ip().to_string(),
            port: k.port,
            protocol: proto_name(k.proto),
            rev_nat_id: v.rev_nat_id,
            flags,
            affinity_timeout: (v.flags & svc_flags::AFFINITY != 0).then_some(v.affinity_timeout),
            backends: backends(t, k, SCOPE_ALL, v.count, svc),
            local_backends,
            stats: counters(svc, STATS_FRONTEND, A::FAMILY, v.rev_nat_id as u32),
            maglev: None,
        });
    }
}

/// What `lb-agent list` shows; `svc`: with each frontend's and backend's
/// counters (`--stats`).
pub fn view(v4: &Table<[u8; 4]>, v6: &Table<[u8; 16]>, stats: Vec<(&'static str, u64)>, svc: Option<&SvcCounters>) -> ListView {
    let mut out = ListView { frontends: Vec::new(), vips: Vec::new(), stats: stats.into_iter().collect() };
    add(v4, &mut out, svc);
    add(v6, &mut out, svc);
    out
}

pub fn render_text(v: &ListView) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "Fam  Prot Frontend                          Backends  Flags");
    for f in &v.frontends {
        let mut flags: Vec<String> = f.flags.iter().map(|f| f.to_string()).collect();
        if let Some(t) = f.affinity_timeout {
            flags.retain(|f| f != "affinity");
            flags.insert(0, format!("affinity={t}s"));
        }
        let shown = match &f.local_backends {
            Some(local) if f.flags.contains(&"itp-local") => local,
            _ => &f.backends,
        };
        let front = if f.family == "IPv6" { format!("[{}]:{}", f.address, f.port) } else { format!("{}:{}", f.address, f.port) };
        let fam = if f.family == "IPv6" { "ip6" } else { "ip4" };
        let counted = f.stats.map_or(String::new(), |c| {
            format!(
                "  conns={} refused={} unreachable={} source_range={} packets={} bytes={}",
                c.conns, c.refused, c.unreachable, c.source_range, c.packets, c.bytes
            )
        });
        let maglev = f.maglev.as_ref().map_or(String::new(), |m| format!("  maglev={}x{} digest={}", m.size, m.backends, m.digest));
        let _ = writeln!(s, "{fam:<4} {:<4} {:<33} {:<9} {}{maglev}{counted}", f.protocol, front, shown.len(), flags.join(","));
        if shown.is_empty() {
            let why = if f.flags.contains(&"itp-local") && !f.backends.is_empty() {
                "no local endpoints: connect fails with EHOSTUNREACH"
            } else {
                "no endpoints: connect is refused"
            };
            let _ = writeln!(s, "  ({why})");
        }
        for b in shown {
            let addr = match (b.state, f.family) {
                ("missing", _) if b.id == 0 => "(a slot missing)".to_string(),
                ("missing", _) => "(its backend missing)".to_string(),
                (_, "IPv6") => format!("[{}]:{}", b.address, b.port),
                _ => format!("{}:{}", b.address, b.port),
            };
            let local = if b.local { " local" } else { "" };
            let counted = b.stats.map_or(String::new(), |c| format!("  conns={}", c.conns));
            let _ = writeln!(s, "  -> {:<33} id={:<6} {}{local}{counted}", addr, b.id, b.state);
        }
        // externalTrafficPolicy Local: outside clients reach the local
        // endpoints only (the list above serves the cluster's own traffic).
        if let Some(local) = f.local_backends.as_ref().filter(|_| f.flags.contains(&"etp-local") && !f.flags.contains(&"itp-local")) {
            if local.is_empty() {
                let _ = writeln!(s, "  (outside clients: no local endpoint: their packets are dropped)");
            } else {
                let ids: Vec<String> = local.iter().map(|b| b.id.to_string()).collect();
                let _ = writeln!(s, "  (outside clients: the local endpoints only: id={})", ids.join(","));
            }
        }
    }
    let stats: Vec<String> = v.stats.iter().map(|(k, n)| format!("{k}={n}")).collect();
    let _ = writeln!(s, "stats: {}", stats.join(" "));
    s
}

/// One flow of the NAT table, as `lb-agent nat` prints it.
#[derive(Debug, Serialize)]
pub struct NatFlow {
    /// "IPv4" or "IPv6".
    pub family: &'static str,
    pub protocol: &'static str,
    /// The tuple as the client sent it.
    pub original: String,
    /// The tuple as the backend sees it.
    pub rewritten: String,
    pub snat: bool,
    /// Direct server return: on the frontend's node, the client's flow to
    /// a backend elsewhere (its replies do not come back here); on the
    /// backend's node, the flow as its option described it.
    pub dsr: bool,
    /// A flow to a backend on this node masqueraded to the node's address
    /// (externalTrafficPolicy Cluster, as kube-proxy does): by the stack
    /// (`snat` false: `conntrack -L` shows its second half), or with
    /// `--bpf-forward` in BPF (`snat` true: `rewritten` holds the address).
    pub masquerade: bool,
    /// A packet came back (conntrack's [UNREPLIED] when false).
    pub replied: bool,
    pub state: &'static str,
    pub age_s: u64,
    pub idle_s: u64,
}

pub fn nat_flows<A: crate::dataplane::writer::Addr>(
    nat: &aya::maps::HashMap<aya::maps::MapData, lb_common::NatKey<A>, lb_common::NatEntry<A>>,
    now_ns: u64,
) -> Vec<NatFlow>
where
    lb_common::NatKey<A>: aya::Pod,
    lb_common::NatEntry<A>: aya::Pod,
{
    use lb_common::{nat_flags, nat_state};
    let entries: std::collections::BTreeMap<_, _> = match super::maps::lookup_all(aya::maps::IterableMap::map(nat)) {
        Ok(all) => all.into_iter().collect(),
        Err(_) => nat.iter().filter_map(|r| r.ok()).collect(),
    };
    let tuple = |s: A, sp: u16, d: A, dp: u16| format!("src={} dst={} sport={sp} dport={dp}", s.to_ip(), d.to_ip());
    // The backend's node of a DSR flow holds only the reply entry.
    let dsr_in = entries.iter().filter(|(_, e)| e.flags & nat_flags::REPLY != 0 && e.flags & nat_flags::DSR != 0).map(|(k, e)| {
        let state = match k.proto {
            _ if e.state & nat_state::RST != 0 => "CLOSE(RST)",
            lb_common::PROTO_UDP => "UDP",
            // One entry notes both ways: FIN_REPLY is the backend's FIN.
            _ if e.state & (nat_state::FIN | nat_state::FIN_REPLY) == nat_state::FIN | nat_state::FIN_REPLY => "CLOSED",
            _ if e.state & (nat_state::FIN | nat_state::FIN_REPLY) != 0 => "FIN_WAIT",
            _ if e.state & nat_state::SEEN == 0 => "SYN_SENT",
            _ => "ESTABLISHED",
        };
        NatFlow {
            family: A::NAME,
            protocol: proto_name(k.proto),
            original: tuple(e.to_daddr, e.to_dport, e.to_saddr, e.to_sport),
            rewritten: tuple(e.to_daddr, e.to_dport, k.saddr, k.sport),
            snat: false,
            dsr: true,
            masquerade: false,
            replied: e.state & nat_state::SEEN != 0,
            state,
            age_s: now_ns.saturating_sub(e.created_ns) / 1_000_000_000,
            idle_s: now_ns.saturating_sub(e.last_seen_ns) / 1_000_000_000,
        }
    });
    let dsr_in: Vec<NatFlow> = dsr_in.collect();
    entries
        .iter()
        .filter(|(_, e)| e.flags & nat_flags::REPLY == 0)
        .map(|(k, e)| {
            let dsr = e.flags & nat_flags::DSR != 0;
            let reply = entries.get(&e.other_key(k.proto));
            let states = e.state | reply.map_or(0, |r| r.state);
            let fin_both = e.state & nat_state::FIN != 0 && reply.is_some_and(|r| r.state & nat_state::FIN != 0);
            let state = match (k.proto, states) {
                (_, s) if s & nat_state::STALE != 0 => "STALE",
                (lb_common::PROTO_UDP, _) => "UDP",
                (_, s) if s & nat_state::RST != 0 => "CLOSE(RST)",
                _ if fin_both => "CLOSED",
                (_, s) if s & nat_state::FIN != 0 => "FIN_WAIT",
                // DSR: the client went on after its SYN, so it was answered.
                _ if dsr && e.state & nat_state::SEEN != 0 => "ESTABLISHED",
                _ if reply.is_none_or(|r| r.state & nat_state::SEEN == 0) => "SYN_SENT",
                // Answered, but the client never went on after its SYN.
                _ if e.state & nat_state::SEEN == 0 => "SYN_RECV",
                _ => "ESTABLISHED",
            };
            let last = reply.map_or(e.last_seen_ns, |r| r.last_seen_ns.max(e.last_seen_ns));
            NatFlow {
                family: A::NAME,
                protocol: proto_name(k.proto),
                original: tuple(k.saddr, k.sport, k.daddr, k.dport),
                rewritten: tuple(e.to_saddr, e.to_sport, e.to_daddr, e.to_dport),
                snat: e.flags & nat_flags::SNAT != 0,
                dsr,
                masquerade: e.flags & nat_flags::MASQ != 0 || nat_flags::masqueraded_in_bpf(e.flags),
                replied: reply.is_some_and(|r| r.state & nat_state::SEEN != 0) || (dsr && e.state & nat_state::SEEN != 0),
                state,
                age_s: now_ns.saturating_sub(e.created_ns) / 1_000_000_000,
                idle_s: now_ns.saturating_sub(last) / 1_000_000_000,
            }
        })
        .chain(dsr_in)
        .collect()
}

pub fn render_nat(flows: &[NatFlow]) -> String {
    let mut s = String::new();
    for f in flows {
        let snat = if f.masquerade {
            " [MASQUERADE]"
        } else if f.snat {
            " [SNAT]"
        } else if f.dsr {
            " [DSR]"
        } else {
            ""
        };
        let unreplied = if f.replied { "" } else { " [UNREPLIED]" };
        let family = if f.family == "IPv6" { "ipv6" } else { "ipv4" };
        let _ = writeln!(
            s,
            "{family} {:<4} {:<11} {} -> {}{snat}{unreplied} age={}s idle={}s",
            f.protocol.to_lowercase(),
            f.state,
            f.original,
            f.rewritten,
            f.age_s,
            f.idle_s
        );
    }
    let _ = writeln!(s, "{} flows", flows.len());
    s
}

/// `LB_NAT_TIMER`'s value, to be read only: an update of an array element
/// from user space cancels its timer, so `NatTimer` is no `aya::Pod` and
/// nothing may write this.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct NatTimerRead(pub lb_common::NatTimer);
// SAFETY: `NatTimer` is repr(C) and all u64 (the timer two of them): no
// padding, any bytes valid.
unsafe impl aya::Pod for NatTimerRead {}

/// Read the kernel's NAT expiry timer from its map (`Tc`'s own, or a pin).
pub fn read_nat_timer<T: std::borrow::Borrow<aya::maps::MapData>>(a: &aya::maps::Array<T, NatTimerRead>) -> anyhow::Result<lb_common::NatTimer> {
    Ok(a.get(&0, 0)?.0)
}

/// The same from the pin `path`.
pub fn nat_timer_at(path: &std::path::Path) -> anyhow::Result<lb_common::NatTimer> {
    use anyhow::Context as _;
    let data = aya::maps::MapData::from_pin(path).with_context(|| format!("open pinned map {}", path.display()))?;
    let a = aya::maps::Array::<_, NatTimerRead>::try_from(aya::maps::Map::Array(data)).with_context(|| format!("{}: not this agent's layout", path.display()))?;
    read_nat_timer(&a)
}

/// How long after its last look the kernel's NAT expiry timer still counts
/// as armed: it looks every second; the rest is room for a busy machine.
pub const NAT_TIMER_LOOKS_WITHIN_NS: u64 = 3_000_000_000;

/// The kernel's NAT expiry as its timer shows it (`lb-agent nat`, /metrics).
#[derive(Debug, Serialize, PartialEq, Clone, Copy)]
pub struct NatExpiry {
    /// Its timer looked within `NAT_TIMER_LOOKS_WITHIN_NS`: should the
    /// agent go, it expires the NAT tables.
    pub armed: bool,
    /// Seconds since its last look; `None`: it never looked (never armed,
    /// or armed less than a second ago).
    pub looked_s: Option<f64>,
    /// Seconds since its last walk of the tables (it walks only while no
    /// agent's heartbeat is fresh); `None`: never.
    pub walked_s: Option<f64>,
    /// How long that walk took, in seconds.
    pub walk_took_s: f64,
    /// An early-drop spell goes on (new flows were refused and its walks
    /// leave a table 90% full), or an early walk is due.
    pub early_drop: bool,
}

/// What `t` says at CLOCK_MONOTONIC `now_ns`.
pub fn nat_expiry(t: &lb_common::NatTimer, now_ns: u64) -> NatExpiry {
    let ago = |ns: u64| (ns != 0).then(|| now_ns.saturating_sub(ns) as f64 / 1e9);
    NatExpiry {
        armed: t.last_look_ns != 0 && now_ns.saturating_sub(t.last_look_ns) <= NAT_TIMER_LOOKS_WITHIN_NS,
        looked_s: ago(t.last_look_ns),
        walked_s: ago(t.last_walk_ns),
        walk_took_s: t.last_walk_took_ns as f64 / 1e9,
        early_drop: t.pressure != 0,
    }
}

/// `lb-agent nat`'s line on the kernel's expiry, with the walks it made
/// and the flows it expired (`nat_walks_without_agent`,
/// `nat_expired_without_agent`); `None`: its timer could not be read,
/// `upgrading`: because an upgrade waits whose earlier timer is of another
/// layout (`nat_timer_pin` found none to read).
pub fn render_nat_expiry(e: Option<&NatExpiry>, upgrading: bool, walks: u64, expired: u64) -> String {
    let Some(e) = e else {
        return if upgrading {
            "kernel expiry: unknown (while this upgrade waits, the earlier agent's timer walks the live tables; its LB_NAT_TIMER is of another layout)\n".into()
        } else {
            "kernel expiry: unknown (LB_NAT_TIMER unreadable: not this version's layout?)\n".into()
        };
    };
    let not = "with no agent, outside flows do not expire and new ones are refused once the tables fill";
    let state = match e.looked_s {
        Some(s) if e.armed => format!("armed (looked {s:.1}s ago)"),
        Some(s) => format!("NOT ARMED (its timer last looked {s:.0}s ago): {not}"),
        None => format!("NOT ARMED (its timer never looked): {not}"),
    };
    let walk = match e.walked_s {
        Some(s) => format!("last walk {s:.0}s ago, took {:.1}ms", e.walk_took_s * 1e3),
        None => "never walked".into(),
    };
    let early = if e.early_drop { ", dropping early" } else { "" };
    format!("kernel expiry: {state}; {walk}{early}; {walks} walks (a table each) and {expired} flows expired while no agent ran\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{Backend, SvcValue};

    fn put(t: &mut Table<[u8; 4]>, port: u16, scope: u8, slot: u16, v: SvcValue) {
        t.services.insert(SvcKey::new([192, 168, 77, 11], port, PROTO_TCP, scope, slot), v);
    }

    fn slot(backend_id: u32) -> SvcValue {
        SvcValue { backend_id, ..Default::default() }
    }

    #[test]
    fn list_shows_what_outside_clients_of_an_etp_local_frontend_reach_and_missing_slots() {
        let mut t = Table::<[u8; 4]>::default();
        t.backends.insert(1, Backend { addr: [10, 244, 1, 10], port: 8080, proto: PROTO_TCP, flags: backend_flags::LOCAL });
        t.backends.insert(2, Backend { addr: [10, 244, 2, 10], port: 8080, proto: PROTO_TCP, flags: 0 });
        let ext_local = svc_flags::EXTERNAL | svc_flags::EXT_LOCAL;
        // 30080: two endpoints, the local one for outside clients.
        put(&mut t, 30080, SCOPE_ALL, 0, SvcValue { count: 2, rev_nat_id: 1, flags: ext_local, ..Default::default() });
        put(&mut t, 30080, SCOPE_ALL, 1, slot(1));
        put(&mut t, 30080, SCOPE_ALL, 2, slot(2));
        put(&mut t, 30080, SCOPE_LOCAL, 0, SvcValue { count: 1, rev_nat_id: 1, flags: ext_local, ..Default::default() });
        put(&mut t, 30080, SCOPE_LOCAL, 1, slot(1));
        // 30081: no local endpoint; 30082: three slots, one missing and one
        // naming a backend the map does not hold.
        put(&mut t, 30081, SCOPE_ALL, 0, SvcValue { count: 1, rev_nat_id: 2, flags: ext_local, ..Default::default() });
        put(&mut t, 30081, SCOPE_ALL, 1, slot(2));
        put(&mut t, 30082, SCOPE_ALL, 0, SvcValue { count: 3, rev_nat_id: 3, flags: svc_flags::EXTERNAL, ..Default::default() });
        put(&mut t, 30082, SCOPE_ALL, 1, slot(2));
        put(&mut t, 30082, SCOPE_ALL, 3, slot(9));
        let text = render_text(&view(&t, &Table::default(), Vec::new(), None));
        let block = |port: u16| -> String {
            let from = text.find(&format!("192.168.77.11:{port}")).unwrap_or_else(|| panic!("{text}"));
            let rest = &text[from..];
            let end = rest[1..].find("\nip4").map_or(rest.len(), |e| e + 1);
            rest[..end].to_string()
        };
        let b = block(30080);
        assert!(b.contains("10.244.1.10:8080") && b.contains("10.244.2.10:8080"), "{b}");
        assert!(b.contains("(outside clients: the local endpoints only: id=1)"), "{b}");
        let b = block(30081);
        assert!(b.contains("(outside clients: no local endpoint: their packets are dropped)"), "{b}");
        let b = block(30082);
        assert!(b.contains(" 3 ") && b.contains("(a slot missing)") && b.contains("(its backend missing)") && b.contains("id=9"), "{b}");
        assert_eq!(b.matches("missing").count(), 4, "{b}");
        let json = serde_json::to_value(view(&t, &Table::default(), Vec::new(), None)).unwrap();
        let states: Vec<&str> = json["frontends"][2]["backends"].as_array().unwrap().iter().map(|b| b["state"].as_str().unwrap()).collect();
        assert_eq!(states, ["active", "missing", "missing"], "{json}");
    }

    #[test]
    fn the_kernel_expiry_is_armed_while_its_timer_looks() {
        let now = 100_000_000_000;
        let t = |look: u64, walk: u64| lb_common::NatTimer { last_look_ns: look, last_walk_ns: walk, last_walk_took_ns: 10_200_000, ..Default::default() };
        // Looked 0.5 s ago; 3 s (the edge) still armed; 3 s and a bit not.
        let e = nat_expiry(&t(now - 500_000_000, 0), now);
        assert_eq!(e, NatExpiry { armed: true, looked_s: Some(0.5), walked_s: None, walk_took_s: 0.0102, early_drop: false });
        assert!(nat_expiry(&t(now - NAT_TIMER_LOOKS_WITHIN_NS, 0), now).armed);
        assert!(!nat_expiry(&t(now - NAT_TIMER_LOOKS_WITHIN_NS - 1, 0), now).armed);
        // Never looked: never armed (or less than a second ago).
        let never = nat_expiry(&t(0, 0), now);
        assert_eq!((never.armed, never.looked_s), (false, None));
        // A clock behind the look (read on another CPU): armed, 0 s.
        assert_eq!(nat_expiry(&t(now + 5, 0), now).looked_s, Some(0.0));
        let text = render_nat_expiry(Some(&nat_expiry(&t(now - 400_000_000, now - 12_000_000_000), now)), false, 3, 1000);
        assert_eq!(text, "kernel expiry: armed (looked 0.4s ago); last walk 12s ago, took 10.2ms; 3 walks (a table each) and 1000 flows expired while no agent ran\n");
        let text = render_nat_expiry(Some(&nat_expiry(&lb_common::NatTimer { pressure: 1, ..t(now - 41_000_000_000, 0) }, now)), false, 0, 0);
        assert!(text.starts_with("kernel expiry: NOT ARMED (its timer last looked 41s ago): with no agent") && text.contains("never walked, dropping early;"), "{text}");
        assert!(render_nat_expiry(Some(&never), false, 0, 0).starts_with("kernel expiry: NOT ARMED (its timer never looked)"));
        assert!(render_nat_expiry(None, false, 0, 0).starts_with("kernel expiry: unknown (LB_NAT_TIMER unreadable"));
        assert!(render_nat_expiry(None, true, 0, 0).starts_with("kernel expiry: unknown (while this upgrade waits, the earlier agent's timer walks"));
    }
}
