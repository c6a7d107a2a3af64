//! `lb-agent run`: watch a source, compute the model, program the maps.
//! The run loop and the threads beside it are here; `reconciler` turns a
//! snapshot into map writes.
mod masq_watch;
mod reconciler;

use reconciler::{Mirror, Reconciler};
use std::collections::{BTreeSet, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use tokio::signal::unix::{SignalKind, signal};

use crate::dataplane::loader::{self, Capacity};
use crate::dataplane::maps::Maps;
use crate::dataplane::writer::Addr;
use crate::model;
use crate::health::{Health, Metrics};
use crate::source::dir::{self, DirState};
use crate::source::{SourceSpec, Update};

pub struct RunConfig {
    pub source: SourceSpec,
    pub kubeconfig: Option<PathBuf>,
    /// TCP keepalive on the API server connections (`source::kube::client`).
    pub api_keepalive: Duration,
    pub healthz_bind: Option<std::net::SocketAddr>,
    pub metrics_bind: Option<std::net::SocketAddr>,
    /// /healthz fails when a change waits longer than this.
    pub stall_after: Duration,
    /// `--resync-period`: how often the maps are re-read and drift repaired.
    pub resync_period: Duration,
    pub node_name: String,
    /// `--zone`: overrides the Node object's zone label.
    pub zone: Option<String>,
    pub cgroup: PathBuf,
    pub bpffs: PathBuf,
    pub capacity: Capacity,
    /// `--node-ip`: the node's primary addresses (else the Node object's,
    /// else the interfaces').
    pub node_ips: Vec<std::net::IpAddr>,
    /// `--nodeport-addresses`.
    pub nodeport_addresses: model::NodePortAddresses,
    /// `--localhost-nodeports`.
    pub localhost_nodeports: bool,
    /// `--nodeport-interface`: where the TC programs attach (else
    /// `netdev::nodeport_devices`).
    pub nodeport_interfaces: Vec<String>,
    /// `--tc-attach`.
    pub tc_attach: loader::TcAttach,
    /// `--nodeport-acceleration xdp`.
    pub xdp: bool,
    /// The NodePort range, kept out of the node's ephemeral ports.
    pub nodeport_range: (u16, u16),
    /// Ports SNATed flows leave from.
    pub snat_ports: (u16, u16),
    /// `lb_common::node_flags` for the programs (`--bpf-forward`).
    pub node_flags: u32,
    /// `--maglev-table-size`, `--maglev-seed`.
    pub maglev: crate::model::maglev::Maglev,
    pub nat_timeouts: crate::nodeport::NatTimeouts,
    pub nat_gc_interval: Duration,
    pub model: model::Options,
    /// Destroy connected sockets to endpoints that left their Service.
    pub destroy_stale_sockets: bool,
    /// `--kube-proxy-check-period` (zero: off).
    pub kube_proxy_check_period: Duration,
    /// `--forward-accept-period`; the mark is in `node_flags` (none: lb's
    /// FORWARD rules are removed).
    pub forward_accept_period: Duration,
    /// kube-proxy's conntrack settings (`--conntrack-*`).
    pub conntrack: crate::conntrack::Args,
    /// Per-frontend and per-backend series in /metrics.
    pub metrics_per_service: bool,
    /// `--bpf-log`.
    pub bpf_log: loader::BpfLog,
}

/// The NAT tables' own thread (off the runtime, whose syncs and /healthz
/// must not wait for a walk of a large table): every `nat_gc_interval` it
/// expires flows, and at once when endpoints leave it ends their flows (UDP
/// removed, TCP marked for a RST). It logs when new flows were refused.
/// A table under pressure (new flows refused since the last look, checked
/// every second, or a pass that found it 90% full) gets a pass at once and
/// then every second that drops unassured flows idle for `EARLY_DROP_IDLE`
/// (never answered, or a TCP client that never acknowledged the answer),
/// as conntrack's early drop makes room for new connections by dropping
/// unassured entries: a spoofed SYN flood that fills the table would
/// otherwise refuse every new flow until its own entries reached
/// `--nat-unreplied-timeout`.
/// Also returns how many flows masqueraded in BPF the tables hold (read
/// at once, then at each pass). What is sent to it starts a pass at once.
fn spawn_nat_gc(cfg: &RunConfig) -> Result<(std::sync::mpsc::Sender<crate::nodeport::Ending>, Arc<BpfMasqueraded>)> {
    use aya::maps::{HashMap, Map, MapData, PerCpuArray};
    let open = |name: &str| MapData::from_pin(loader::pin_path(&cfg.bpffs, name)).with_context(|| format!("open pinned {name}"));
    let open_at = |p: &std::path::Path| MapData::from_pin(p).with_context(|| format!("open pinned {}", p.display()));
    let mut nat4: HashMap<MapData, lb_common::Nat4Key, lb_common::Nat4Entry> = HashMap::try_from(Map::HashMap(open(lb_common::maps::NAT4)?))?;
    let mut nat6: HashMap<MapData, lb_common::Nat6Key, lb_common::Nat6Entry> = HashMap::try_from(Map::HashMap(open(lb_common::maps::NAT6)?))?;
    let stats: PerCpuArray<MapData, u64> = PerCpuArray::try_from(Map::PerCpuArray(open(lb_common::maps::STATS)?))?;
    let (timeouts, every) = (cfg.nat_timeouts, cfg.nat_gc_interval);
    // The kernel's own expiry takes over once this thread's heartbeat is
    // stale (`lb_common::NatGc`).
    let mut gc: aya::maps::Array<MapData, lb_common::NatGc> = aya::maps::Array::try_from(Map::Array(open(lb_common::maps::NAT_GC)?))?;
    let gc_cfg = lb_common::NatGc {
        heartbeat_ns: 0,
        stale_ns: NAT_HEARTBEAT_STALE.as_nanos() as u64,
        interval_ns: every.as_nanos() as u64,
        capacity: cfg.capacity.nat as u64,
        timeouts: timeouts.ns(),
    };
    // During an upgrade that stages new settings, the earlier timer (which
    // walks the live tables until the programs move) reads the old ones:
    // the heartbeat goes there too, where their layout is this agent's,
    // until the upgrade finishes (the staged pin moved in place).
    let staged_gc = loader::staged_pin(&cfg.bpffs, lb_common::maps::NAT_GC);
    let mut old_gc: Option<aya::maps::Array<MapData, lb_common::NatGc>> = loader::old_pin(&cfg.bpffs, lb_common::maps::NAT_GC)
        .and_then(|p| MapData::from_pin(p).ok())
        .and_then(|d| aya::maps::Array::try_from(Map::Array(d)).ok());
    let mut heartbeat = move || {
        let now = lb_common::NatGc { heartbeat_ns: crate::nodeport::monotonic_ns(), ..gc_cfg };
        if let Err(e) = gc.set(0, now, 0) {
            tracing::warn!("NAT: cannot write the heartbeat to {}: {e}", lb_common::maps::NAT_GC);
        }
        if old_gc.is_some() && !staged_gc.as_ref().is_some_and(|p| p.exists()) {
            old_gc = None;
        }
        if let Some(old) = old_gc.as_mut() {
            let _ = old.set(0, now, 0);
        }
    };
    heartbeat();
    let (tx, rx) = std::sync::mpsc::channel::<crate::nodeport::Ending>();
    let failed = move || -> u64 { stats.get(&lb_common::stats::NAT_FAILED, 0).map(|v| v.iter().sum()).unwrap_or(0) };
    // Counters staged by an upgrade: the old agent's are added on when it
    // finishes, which is no new refusal.
    let mut staged = loader::staged_pin(&cfg.bpffs, lb_common::maps::STATS);
    // During an upgrade the old programs make and use the flows of the old
    // tables until they move: those are expired and ended here too (else
    // they only grow while the first sync waits, an API server down, say,
    // until new flows are refused), where their layout is this agent's.
    // (Also while this agent resumes an upgrade whose programs began to
    // move: those not moved yet use the old tables.)
    let staged_nat = loader::staged_pin(&cfg.bpffs, lb_common::maps::NAT4);
    let mut old_nat = match (loader::old_pin(&cfg.bpffs, lb_common::maps::NAT4), loader::old_pin(&cfg.bpffs, lb_common::maps::NAT6)) {
        (Some(p4), Some(p6)) => {
            let o4: HashMap<MapData, lb_common::Nat4Key, lb_common::Nat4Entry> = HashMap::try_from(Map::HashMap(open_at(&p4)?))?;
            let o6: HashMap<MapData, lb_common::Nat6Key, lb_common::Nat6Entry> = HashMap::try_from(Map::HashMap(open_at(&p6)?))?;
            Some((o4, o6))
        }
        _ => None,
    };
    // At start, the flows the running programs hold: during an upgrade
    // the old tables' and (once the programs began to move) the staged
    // ones'.
    let mut counts = vec![crate::nodeport::count_at_start(&nat4), crate::nodeport::count_at_start(&nat6)];
    if let Some((o4, o6)) = &old_nat {
        counts.extend([crate::nodeport::count_at_start(o4), crate::nodeport::count_at_start(o6)]);
    }
    let (at_start, dsr_at_start) = counts.iter().fold((0, 0), |(m, d), (m2, d2)| (m + m2, d + d2));
    let masqueraded = Arc::new(BpfMasqueraded { started: Default::default(), last: std::sync::Mutex::new((0, at_start)), dsr_at_start });
    let count = masqueraded.clone();
    let capacity = cfg.capacity.nat as usize;
    std::thread::Builder::new().name("nat".into()).spawn(move || {
        let mut seen_failed = failed();
        let mut next = Instant::now() + every;
        // Early drop: the refusals last looked at, whether a spell goes on
        // (its last pass dropped flows and left a table nearly full), and
        // whether a spell was logged.
        let (mut drop_seen, mut full, mut dropping) = (seen_failed, false, false);
        let look = every.min(Duration::from_secs(1));
        loop {
            heartbeat();
            let wake = next.min(Instant::now() + look);
            let (left, refused) = match rx.recv_timeout(wake.saturating_duration_since(Instant::now())) {
                Ok(left) => (left, false),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    let now_failed = failed();
                    // (During an upgrade the old agent's counts are added
                    // on: no refusal.)
                    let refused = staged.is_none() && now_failed > drop_seen;
                    drop_seen = now_failed;
                    let due = Instant::now() >= next;
                    if !due && !refused && !full {
                        continue;
                    }
                    if due {
                        next = Instant::now() + every;
                    }
                    (crate::nodeport::Ending::Nothing, refused)
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
            };
            let early = refused || full;
            let timeouts = if early { crate::nodeport::NatTimeouts { unreplied: timeouts.unreplied.min(EARLY_DROP_IDLE), ..timeouts } } else { timeouts };
            let pass = count.started.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            // The old tables first (until the programs move: the staged pin
            // goes when they have), so that what a pass ends there is not
            // taken back into the new ones by the new programs meanwhile.
            if old_nat.is_some() && !staged_nat.as_ref().is_some_and(|p| p.exists()) {
                old_nat = None;
            }
            // (The heartbeat between passes: one over a full table takes
            // seconds.)
            let old_pass = old_nat.as_mut().map(|(o4, o6)| {
                let q4 = crate::nodeport::nat_pass(o4, &timeouts, &left);
                heartbeat();
                let q6 = crate::nodeport::nat_pass(o6, &timeouts, &left);
                heartbeat();
                (q4, q6)
            });
            let p4 = crate::nodeport::nat_pass(&mut nat4, &timeouts, &left);
            heartbeat();
            let p6 = crate::nodeport::nat_pass(&mut nat6, &timeouts, &left);
            // A spell starts only with refusals (a table full of assured
            // flows is no flood: conntrack too early-drops only when an
            // insert fails), and goes on while its passes drop flows and
            // leave a table nearly full: the next look drops early too.
            let nearly_full = [(p4.entries, p4.expired), (p6.entries, p6.expired)].iter().any(|(n, gone)| n.saturating_sub(gone * 2) * 10 >= capacity * 9);
            full = early && nearly_full && p4.expired + p6.expired > 0;
            if early && !dropping {
                tracing::warn!(
                    flows = p4.expired + p6.expired,
                    "NAT: new flows refused (the table full: --max-nat; or no free SNAT port: --snat-ports): dropping \
                     unassured flows idle for {EARLY_DROP_IDLE:?} every second, as conntrack's early drop does, while \
                     refusals go on or the table stays nearly full (NAT table under pressure)"
                );
            } else if !early && dropping {
                tracing::info!("NAT table no longer under pressure");
            }
            dropping = early;
            let (mut expired, mut flushed, mut marked) = (p4.expired + p6.expired, p4.flushed + p6.flushed, p4.marked + p6.marked);
            let mut masq = p4.bpf_masqueraded + p6.bpf_masqueraded;
            let mut kept_used: std::collections::BTreeSet<_> = p4.kept_used.into_iter().chain(p6.kept_used).collect();
            if let Some((q4, q6)) = old_pass {
                (expired, flushed, marked) = (expired + q4.expired + q6.expired, flushed + q4.flushed + q6.flushed, marked + q4.marked + q6.marked);
                masq += q4.bpf_masqueraded + q6.bpf_masqueraded;
                kept_used.extend(q4.kept_used.into_iter().chain(q6.kept_used));
            }
            if let crate::nodeport::Ending::Sweep { census: Some(c), .. } = &left {
                c.report(crate::stale::kept::Source::Nat, kept_used);
            }
            *count.last.lock().unwrap_or_else(|e| e.into_inner()) = (pass, masq);
            if expired > 0 {
                tracing::debug!(flows = expired, "NAT entries expired");
            }
            if flushed + marked > 0 {
                tracing::info!(udp_removed = flushed, tcp_to_reset = marked, "NAT flows to endpoints that left ended");
            }
            // No comparison in a pass that began with the upgrade pending:
            // the counts may be added meanwhile. (The staged map is moved in
            // place only after they were: a pass that sees it moved reads
            // them.)
            let upgrading = staged.is_some();
            if let Some(p) = &staged {
                let finished = !p.exists();
                seen_failed = failed();
                if finished {
                    staged = None;
                    // The old agent's counts added on are no refusal.
                    drop_seen = seen_failed;
                }
            }
            let now_failed = failed();
            if !upgrading && now_failed > seen_failed {
                // (During an early-drop spell, logged once for the spell,
                // not every second.)
                if dropping {
                    tracing::debug!(refused = now_failed - seen_failed, "outside flows refused");
                } else {
                    tracing::warn!(
                        refused = now_failed - seen_failed,
                        "outside flows refused: no free SNAT port for their backend (--snat-ports) or the NAT table is full (--max-nat); see lb_datapath_nat_failed"
                    );
                }
                seen_failed = now_failed;
            }
        }
    })?;
    Ok((tx, masqueraded))
}

/// How old the NAT thread's heartbeat (written every second, and between
/// the passes over each table) may grow before the kernel expires the NAT
/// tables itself.
const NAT_HEARTBEAT_STALE: Duration = Duration::from_secs(10);

/// Arm the kernel's NAT expiry (`Tc::arm_nat_gc`), saying what failing means.
fn arm_nat_gc(tc: &mut loader::Tc) {
    match tc.arm_nat_gc() {
        Ok(()) => tracing::info!("the kernel's NAT expiry is armed: it expires the NAT tables while no agent runs"),
        Err(e) => tracing::warn!(
            "the kernel's NAT expiry is not armed: should this agent go, outside flows expire only by an earlier agent's timer, if one \
             runs, or not at all (new ones are refused once the NAT tables fill): {e:#}"
        ),
    }
}

/// Every 5 s: the kernel's NAT expiry timer this agent armed stopped
/// looking (`Tc::nat_gc_stopped`: its element written from user space,
/// which cancels it, or an arm that failed): arm it again, saying so once
/// until it is seen to go on (`stopped`: it was found stopped last time).
fn check_nat_gc(tc: &mut loader::Tc, stopped: &mut bool) {
    // (An upgrade sharing the earlier agent's timer arms it once the
    // programs moved: nothing to look at until then.)
    let Some(last) = tc.nat_gc_stopped() else {
        *stopped = false;
        return;
    };
    let looked = match last {
        _ if tc.nat_gc_failed.load(std::sync::atomic::Ordering::Relaxed) => "this agent's last arm failed".to_string(),
        0 => "this agent saw it look no time".to_string(),
        ns => format!("this agent last saw it look {:.0} s ago", crate::nodeport::monotonic_ns().saturating_sub(ns) as f64 / 1e9),
    };
    let r = tc.arm_nat_gc();
    let said = std::mem::replace(stopped, true);
    match r {
        Ok(()) if !said => tracing::warn!(
            "the kernel's NAT expiry timer had stopped ({looked}; an update of LB_NAT_TIMER from user space cancels it): armed again"
        ),
        Err(e) if !said => tracing::warn!(
            "the kernel's NAT expiry timer is stopped ({looked}) and cannot be armed (tried again every 5 s): should this agent go, outside \
             flows do not expire and new ones are refused once the NAT tables fill: {e:#}"
        ),
        r => tracing::debug!(ok = r.is_ok(), "the kernel's NAT expiry timer is still stopped; armed again"),
    }
}

/// Under pressure (`spawn_nat_gc`), how long an unassured flow may be idle.
const EARLY_DROP_IDLE: Duration = Duration::from_secs(1);

/// The flows masqueraded in BPF (`nat_flags::LOCAL`) the NAT thread
/// counted, and when.
struct BpfMasqueraded {
    /// Passes started; each reads the tables after it is counted here.
    started: std::sync::atomic::AtomicU64,
    /// The last pass that ended (0: the count read at start) and its count.
    last: std::sync::Mutex<(u64, usize)>,
    /// DSR flows whose backend is on this node the tables held at start
    /// (`nodeport::nat::dsr_replies`).
    dsr_at_start: usize,
}

impl BpfMasqueraded {
    fn last(&self) -> (u64, usize) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn started(&self) -> u64 {
        self.started.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// `--bpf-log`: a thread that waits on the programs' log ring buffer and
/// writes what arrives into the agent's log.
fn spawn_bpf_logs(mut logs: aya_log::EbpfLogger<loader::BpfLogSink>) -> Result<()> {
    use std::os::fd::AsRawFd as _;
    std::thread::Builder::new().name("bpf-log".into()).spawn(move || {
        loop {
            let mut pfd = libc::pollfd { fd: logs.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, 1000) };
            logs.flush();
        }
    })?;
    Ok(())
}

/// The datapath counters for /metrics, read from the pinned maps at each
/// scrape; with `--metrics-per-service` also each frontend's and backend's.
struct PinnedStats {
    stats: std::sync::Mutex<aya::maps::PerCpuArray<aya::maps::MapData, u64>>,
    per_service: Option<std::sync::Mutex<Maps>>,
    /// An upgrade this agent has not finished (it does after its first
    /// sync) that replaces `LB_STATS`: the staged map's pin.
    /// Until it finishes, the programs count into the live map, and the
    /// staged one holds none of it (the old counts are added when it
    /// finishes): a scrape of the staged map would read as a reset, then a
    /// jump. So meanwhile the datapath counters are read from the live map.
    /// (A staged `LB_SVC_STATS` is empty until then: the per-service series
    /// are absent meanwhile, a gap.)
    upgrading: Option<std::path::PathBuf>,
    bpffs: std::path::PathBuf,
    /// This agent's last arm of the kernel's NAT expiry failed
    /// (`Tc::nat_gc_failed`).
    nat_gc_failed: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for PinnedStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PinnedStats")
    }
}

impl crate::health::StatsSource for PinnedStats {
    fn read(&self) -> Vec<(&'static str, u64)> {
        // While an upgrade waits: the old map, where the programs count;
        // once they began to move (an upgrade resumed from an agent killed
        // then), both, until the second copy adds the old to the staged.
        let (moving, late_done) = loader::upgrade_marks(&self.bpffs);
        let old = self.upgrading.as_ref().filter(|staged| staged.exists()).filter(|_| !late_done).and_then(|_| {
            let m = aya::maps::MapData::from_pin(self.bpffs.join(lb_common::maps::STATS)).ok()?;
            aya::maps::PerCpuArray::<_, u64>::try_from(aya::maps::Map::PerCpuArray(m)).ok()
        });
        let staged = self.stats.lock().unwrap();
        let sum = |m: &aya::maps::PerCpuArray<aya::maps::MapData, u64>, i: u32| -> u64 { m.get(&i, 0).map(|v| v.iter().sum()).unwrap_or(0) };
        lb_common::stats::NAMES
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let i = i as u32;
                let v = match &old {
                    Some(o) if moving => sum(o, i) + sum(&staged, i),
                    Some(o) => sum(o, i),
                    None => sum(&staged, i),
                };
                (*n, v)
            })
            .collect()
    }

    /// The timer of the tables the programs use (an upgrade's earlier one
    /// until they move), where its layout is this agent's.
    /// While this agent's last arm failed, not armed, whatever the timer
    /// shows (an earlier agent's callback may look on, walking tables the
    /// programs left).
    fn nat_expiry(&self) -> Option<crate::dataplane::inspect::NatExpiry> {
        let pin = loader::nat_timer_pin(&self.bpffs)?;
        let t = crate::dataplane::inspect::nat_timer_at(&pin).ok()?;
        let mut e = crate::dataplane::inspect::nat_expiry(&t, crate::nodeport::monotonic_ns());
        // (This agent's own timer only: during an upgrade, the earlier
        // agent's may walk the live tables whatever this one's arm did.)
        if pin == loader::pin_path(&self.bpffs, lb_common::maps::NAT_TIMER) {
            e.armed &= !self.nat_gc_failed.load(std::sync::atomic::Ordering::Relaxed);
        }
        Some(e)
    }

    fn per_service(&self) -> Vec<crate::health::ServiceCounters> {
        let Some(maps) = &self.per_service else { return Vec::new() };
        let maps = maps.lock().unwrap();
        let counters = match maps.read_svc_stats() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("per-service metrics: {e:#}");
                return Vec::new();
            }
        };
        // A frontend is named by its address and port (its rev-NAT id,
        // which its TCP and UDP ports share); a backend by its address,
        // port and protocol, summed over the ids it has (one per flags).
        let name = |key: &lb_common::SvcStatsKey| -> Option<(bool, String, Option<&'static str>)> {
            let v4 = key.family == lb_common::FAMILY_V4;
            if key.kind == lb_common::STATS_FRONTEND {
                let id = u16::try_from(key.id).ok()?;
                let (addr, port) = if v4 {
                    maps.v4.revnat.get(&id, 0).ok().map(|r| (r.addr.to_ip(), r.port))?
                } else {
                    maps.v6.revnat.get(&id, 0).ok().map(|r| (r.addr.to_ip(), r.port))?
                };
                Some((true, std::net::SocketAddr::new(addr, port).to_string(), None))
            } else {
                let (addr, port, proto) = if v4 {
                    maps.v4.backends.get(&key.id, 0).ok().map(|b| (b.addr.to_ip(), b.port, b.proto))?
                } else {
                    maps.v6.backends.get(&key.id, 0).ok().map(|b| (b.addr.to_ip(), b.port, b.proto))?
                };
                let protocol = if proto == lb_common::PROTO_UDP { "UDP" } else { "TCP" };
                Some((false, std::net::SocketAddr::new(addr, port).to_string(), Some(protocol)))
            }
        };
        let mut summed: std::collections::BTreeMap<(bool, String, Option<&'static str>), lb_common::SvcStats> = Default::default();
        for (key, c) in &counters {
            // Ids deleted meanwhile have no name: left out.
            if let Some(series) = name(key) {
                let t = summed.entry(series).or_default();
                t.conns += c.conns;
                t.refused += c.refused;
                t.unreachable += c.unreachable;
                t.packets += c.packets;
                t.bytes += c.bytes;
                t.source_range += c.source_range;
            }
        }
        let out: Vec<_> = summed
            .into_iter()
            .map(|((frontend, addr, protocol), counters)| crate::health::ServiceCounters { frontend, addr, protocol, counters })
            .collect();
        out
    }
}

/// A runtime on a thread of its own for what must go on while a sync
/// blocks the agent's thread (a hang, or a sync of a huge cluster): the
/// source, `/healthz` and `/metrics`. kube-proxy's informers and health
/// server run beside its sync loop likewise, so that a hung loop is seen
/// (`/healthz` 503, the queue metrics moving on) rather than unanswered.
fn side_runtime() -> Result<tokio::runtime::Handle> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new().name("lb-side".into()).spawn(move || {
        match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => {
                let _ = tx.send(Ok(rt.handle().clone()));
                rt.block_on(std::future::pending::<()>());
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        }
    })?;
    Ok(rx.recv().context("the side runtime's thread ended")??)
}

pub async fn run(cfg: RunConfig) -> Result<()> {
    tracing::debug!("starting");
    let side = side_runtime()?;
    // Check the source before touching the kernel: bad input fails first.
    let (tx, mut rx): (crate::source::Publisher, crate::source::Subscriber) = tokio::sync::watch::channel(None);
    let source_status = Arc::new(crate::source::Status::default());
    let mut source: tokio::task::JoinHandle<Result<()>> = match &cfg.source {
        SourceSpec::Dir(dir) => {
            let state = DirState::new(dir)?;
            side.spawn(dir::run(state, tx))
        }
        SourceSpec::Kube => {
            // The client is made there too: its request buffer's task runs
            // where it is made.
            let (kubeconfig, keepalive, status) = (cfg.kubeconfig.clone(), cfg.api_keepalive, source_status.clone());
            let (client, server) = side.spawn(async move { crate::source::kube::client(kubeconfig.as_deref(), keepalive, status).await }).await??;
            side.spawn(crate::source::kube::run(client, server, cfg.node_name.clone(), tx, source_status.clone()))
        }
    };

    // A flag naming the loopback device is refused before anything is
    // touched.
    if let Ok(links) = crate::netdev::links()
        && let Some(lo) = cfg.nodeport_interfaces.iter().find(|i| links.iter().any(|l| l.name == **i && l.loopback))
    {
        anyhow::bail!("{}", loader::loopback_refused(lo));
    }
    let dp = loader::load(&cfg.bpffs, &cfg.cgroup, cfg.capacity, cfg.bpf_log)?;
    let loader::Dataplane { maps, logs, mut tc, adopted, mut upgrade } = dp;
    if let Some(logs) = logs {
        spawn_bpf_logs(logs)?;
    }
    tc.mode = cfg.tc_attach;
    tc.xdp = cfg.xdp;
    let v4 = Mirror::new(maps.v4.read_table(&maps.affinity_match, &maps.src_range)?);
    let v6 = Mirror::new(maps.v6.read_table(&maps.affinity_match, &maps.src_range)?);
    let nodeports = maps.read_nodeports()?;
    let route_mtus = maps.read_route_mtus()?;
    let local4 = maps.read_local4()?;
    if let Err(e) = crate::nodeport::reserve_ports(cfg.nodeport_range.0, cfg.nodeport_range.1, &cfg.bpffs) {
        tracing::warn!("cannot reserve the NodePort range for local ports: {e:#}");
    }
    let forward = cfg.node_flags & lb_common::node_flags::BPF_FORWARD != 0;
    let per_packet = cfg.node_flags & lb_common::node_flags::POD_PACKET_LB != 0;
    tc.pod_egress = per_packet;
    // The flags an earlier agent left (they hold until this one's first
    // full sync writes its own).
    // During an upgrade: the live node config, not the staged one (empty
    // until the first sync).
    let earlier_flags = aya::maps::MapData::from_pin(loader::live_pin(&cfg.bpffs, lb_common::maps::NODE_CONFIG))
        .ok()
        .and_then(|d| aya::maps::Array::<_, lb_common::NodeConfig>::try_from(aya::maps::Map::Array(d)).ok())
        .and_then(|a| a.get(&0, 0).ok())
        .map_or(0, |c| c.flags);
    let (nat_left, bpf_masqueraded) = spawn_nat_gc(&cfg)?;
    // The kernel's own NAT expiry, for when this agent is gone (its
    // settings and first heartbeat written by spawn_nat_gc). During an
    // upgrade that stages a timer of its own too (the earlier one, if any,
    // walks the live tables until the programs move, then goes with its
    // map); where the upgrade shares the earlier timer, once the programs
    // moved (taken over now, it would walk only the staged tables), or
    // where they began to move (an upgrade resumed after that: the staged
    // tables are live).
    let moving = loader::upgrade_marks(&cfg.bpffs).0;
    if upgrade.is_none() || moving || loader::staged_pin(&cfg.bpffs, lb_common::maps::NAT_TIMER).is_some() {
        arm_nat_gc(&mut tc);
    }
    // Flows an agent with --bpf-forward masqueraded in BPF: the pod
    // programs translate their replies, so they stay (and are brought up
    // to this agent's) until the last such flow is gone (`MasqWatch`).
    let earlier_masq = earlier_flags & lb_common::node_flags::BPF_FORWARD != 0 && lb_common::node_flags::masq_of(earlier_flags) != 0;
    // An upgrade across a layout change of the node config or the NAT
    // tables: the earlier agent's flags and flows cannot be read as this
    // agent's (the staged maps are empty until the first sync). Such flows
    // may live: the watch waits, and counts them once the upgrade has
    // carried them into this agent's tables.
    let unreadable = |m: &str| {
        upgrade.is_some() && !loader::upgrade_marks(&cfg.bpffs).0 && loader::staged_pin(&cfg.bpffs, m).is_some() && loader::old_pin(&cfg.bpffs, m).is_none()
    };
    // (Only where pod programs run that could translate their replies:
    // on a node where none does, no such flow lives on.)
    let earlier_unknown =
        [lb_common::maps::NODE_CONFIG, lb_common::maps::NAT4, lb_common::maps::NAT6].into_iter().any(unreadable) && tc.pod_programs_may_run();
    if earlier_unknown {
        tracing::info!("an upgrade across a layout change: flows an earlier agent masqueraded in BPF may live; the pod programs stay until the upgrade has carried them and none is left");
    }
    let earlier_masq = earlier_masq || earlier_unknown;
    // Likewise the DSR flows to this node's backends (`dsr_kept`).
    let nat_unreadable = [lb_common::maps::NAT4, lb_common::maps::NAT6].into_iter().any(unreadable);
    let mut masq_watch = masq_watch::MasqWatch::start(forward, bpf_masqueraded.last().1, earlier_masq);
    // Only the watch keeps the pod programs where no flag asks for them.
    let keep_pods = |w: &masq_watch::MasqWatch| w.pending() && !forward && !per_packet;
    if bpf_masqueraded.last().1 > 0 && !forward {
        tracing::info!(
            flows = bpf_masqueraded.last().1,
            "flows masqueraded in BPF by an agent with --bpf-forward live: the pod programs stay until they end"
        );
    }
    tc.pod_ingress = forward || per_packet || keep_pods(&masq_watch);
    tc.verify_optional(tc.pod_ingress)?;
    // (An earlier agent's egress ones stay until the first sync tells
    // whether some frontend sends by DSR: `has_dsr`.)
    if !forward || !per_packet {
        tc.drop_pod_programs(!tc.pod_ingress, false);
    }
    // During an upgrade the programs attach once the new maps are filled.
    if upgrade.is_none() && !cfg.nodeport_interfaces.is_empty() {
        for iface in &cfg.nodeport_interfaces {
            tc.attach_tc(iface)?;
        }
        // An earlier agent's programs on devices these are not go.
        tc.detach_unserved(&cfg.nodeport_interfaces, None);
    }
    if let Some((limit, usage)) = loader::memory_limit() {
        let room = limit.saturating_sub(usage) / loader::SOCK_STORAGE_BYTES;
        let nat_full_mib = (cfg.capacity.nat as u64 * (loader::NAT_ENTRY_BYTES[0] + loader::NAT_ENTRY_BYTES[1])) >> 20;
        tracing::warn!(
            limit_mib = limit >> 20,
            usage_mib = usage >> 20,
            "this agent runs under a memory limit: the kernel charges every translated socket's storage on this node \
             (about {} bytes each) and the NAT entries of outside flows (up to {nat_full_mib} MiB with both tables \
             full, --max-nat) to the memory cgroup of the agent that created lb's maps, past its limit; about {room} \
             more open connections through Services on this node reach the limit, and the agent is then OOM-killed; \
             lb's DaemonSet sets no memory limit: remove it, or size it for the node's connections",
            loader::SOCK_STORAGE_BYTES
        );
    }
    if adopted {
        tracing::info!(
            frontends = v4.index.frontends() + v6.index.frontends(),
            backends = v4.table.backends.len() + v6.table.backends.len(),
            "adopted pinned state; programs replaced without a gap; it stays as it is until the source's first full sync"
        );
    }
    tracing::info!(
        cgroup = %cfg.cgroup.display(),
        bpffs = %cfg.bpffs.display(),
        node = %cfg.node_name,
        "programs attached"
    );

    let stats = aya::maps::PerCpuArray::try_from(aya::maps::Map::PerCpuArray(aya::maps::MapData::from_pin(
        loader::pin_path(&cfg.bpffs, lb_common::maps::STATS),
    )?))?;
    let per_service = if cfg.metrics_per_service { Some(std::sync::Mutex::new(Maps::open_pinned(&cfg.bpffs)?)) } else { None };
    crate::monitor::spawn_janitor(&cfg.bpffs)?;
    let upgrading = loader::staged_pin(&cfg.bpffs, lb_common::maps::STATS);
    let metrics = Metrics::new(Arc::new(PinnedStats {
        stats: std::sync::Mutex::new(stats),
        per_service,
        upgrading,
        bpffs: cfg.bpffs.clone(),
        nat_gc_failed: tc.nat_gc_failed.clone(),
    }));
    let health = Arc::new(Health::new(cfg.stall_after));
    let published = rx.clone();
    health.watch_source(move || published.borrow().as_ref().map(|u| u.since));
    let published = rx.clone();
    metrics.watch_queue(Box::new(move || published.borrow().as_ref().map(|u| (u.queued, u.received))));
    metrics.register_health(&health);
    metrics.register_source(&source_status);
    let (hz, mt) = side.spawn(crate::health::serve(cfg.healthz_bind, cfg.metrics_bind, health.clone(), metrics.clone())).await??;
    tracing::info!(healthz = ?hz, metrics = ?mt, "serving health and metrics");

    let netns_cookie = crate::nodeport::netns_cookie()?;
    let mut rec = Reconciler {
        maps,
        triggers: Vec::new(),
        ip_families: Vec::new(),
        last_full: false,
        no_local: Default::default(),
        v4,
        v6,
        node_name: cfg.node_name.clone(),
        zone: cfg.zone.clone(),
        node_ips: cfg.node_ips.clone(),
        nodeport_addresses: cfg.nodeport_addresses.clone(),
        localhost_nodeports: cfg.localhost_nodeports,
        opts: cfg.model.clone(),
        capacity: cfg.capacity,
        nodeports,
        route_mtus,
        route_mtu_error: None,
        local4,
        local4_error: None,
        snat_ports: cfg.snat_ports,
        node_flags: cfg.node_flags | if forward || masq_watch.pending() { 0 } else { lb_common::node_flags::NO_BPF_MASQUERADED },
        sock_egress: tc.sock_egress(),
        config_written: false,
        swept_tcp: false,
        kept: crate::stale::kept::Kept::load(&cfg.bpffs),
        upgrading: upgrade.is_some(),
        addresses: crate::nodeport::Addresses::watch(forward || per_packet)?,
        maglev: cfg.maglev,
        maglev4: crate::dataplane::maglev::MaglevTables::open(&cfg.bpffs, lb_common::maps::MAGLEV4)?,
        maglev6: crate::dataplane::maglev::MaglevTables::open(&cfg.bpffs, lb_common::maps::MAGLEV6)?,
        netns_cookie,
        logged: HashSet::new(),
        health_checks: Default::default(),
        health_check_on: None,
        node_addresses: Vec::new(),
        has_external: false,
        has_dsr: false,
        not_programmed: 0,
        model: model::Incremental::new(),
        full_needed: true,
        pending_left: BTreeSet::new(),
        pending_joined: BTreeSet::new(),
        pending_udp_served: BTreeSet::new(),
        nat_left,
        names_changed: None,
        destroyer: if cfg.destroy_stale_sockets {
            Some(crate::stale::Destroyer::spawn(
                &cfg.bpffs,
                cfg.cgroup.clone(),
                metrics.sockets_destroyed.clone(),
                metrics.sockets_destroy_failed.clone(),
                metrics.cgroup_invisible.clone(),
            )?)
        } else {
            None
        },
    };
    let mut health_checks = crate::nodeport::HealthChecks::new(health.clone(), side.clone());
    rec.export(&metrics, &cfg.capacity);
    rec.export_names(&metrics);
    // kube-proxy's rules on the node, at start and then every period (off
    // the runtime thread: iptables-save of a large rule set takes a while).
    if !cfg.kube_proxy_check_period.is_zero() {
        let m = metrics.clone();
        every(cfg.kube_proxy_check_period, None, "looking for kube-proxy's rules", move |last| crate::kube_proxy::check(&m.kube_proxy_rules, last));
        // Another proxy's BPF programs on the socket hooks.
        let (m, cgroup) = (metrics.clone(), cfg.cgroup.clone());
        every(cfg.kube_proxy_check_period, None, "looking for other programs on the socket hooks", move |last| {
            crate::dataplane::foreign::check(&cgroup, &m.foreign_programs, last)
        });
        // NetworkPolicy in netfilter, which forwarding in BPF bypasses.
        if cfg.node_flags & lb_common::node_flags::BPF_FORWARD != 0 {
            let m = metrics.clone();
            every(cfg.kube_proxy_check_period, None, "looking for NetworkPolicy in netfilter", move |last| {
                crate::policy_engines::check(&m.bpf_forward_policy_bypassed, last)
            });
        }
    }
    // The FORWARD chains: lb's rules where they may drop what the TC
    // programs hand to the stack (crate::firewall), at start and then every
    // period, off the runtime thread.
    let mark = lb_common::node_flags::mark_of(cfg.node_flags);
    let notrack = lb_common::node_flags::notrack_of(cfg.node_flags);
    let masq = lb_common::node_flags::masq_of(cfg.node_flags);
    let masq_ports = crate::firewall::masquerade_ports(&[cfg.snat_ports, cfg.nodeport_range]);
    if masq != 0 && masq_ports.is_none() {
        tracing::warn!(
            "--snat-ports and --nodeport-range cover 1024-65535: the local masquerade takes any port, so while flows masqueraded in BPF and by the stack live side by side a port may be given twice; narrow --snat-ports"
        );
    }
    let nm = metrics.clone();
    tokio::task::spawn_blocking(move || {
        let errors = if mark == 0 { crate::firewall::remove() } else { Vec::new() };
        for e in errors {
            tracing::warn!("lb's netfilter rules turned off: cannot remove {e}");
        }
        // Both off: the table goes, but for a nat chain an earlier agent's
        // masquerade leaves (its connections keep their translation).
        if notrack == 0 && masq == 0
            && let Some(crate::firewall::State::Failed(e)) = crate::firewall::ensure_table(0, 0, None, &nm)
        {
            tracing::warn!("lb's nftables table could not be written: {e}");
        }
    });
    if mark != 0 || notrack != 0 || masq != 0 {
        // At once where nftables changed (iptables-nft too): a reload.
        let wake = std::sync::Arc::new(tokio::sync::Notify::new());
        let fm = metrics.clone();
        if let Err(e) = crate::firewall::watch_nftables(wake.clone()) {
            tracing::warn!("{e:#}: lb's netfilter rules are looked at every --forward-accept-period only");
        }
        // conntrack starting to hold entries is no nftables change: a look
        // when it does (one read of a /proc file a second).
        if notrack != 0 {
            let wake = wake.clone();
            tokio::spawn(async move {
                let mut held = crate::firewall::conntrack_in_use();
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tick.tick().await;
                    let now = crate::firewall::conntrack_in_use();
                    if now && !held {
                        wake.notify_one();
                    }
                    held = now;
                }
            });
        }
        every(cfg.forward_accept_period, Some(wake), "looking at the FORWARD chains and conntrack", move |last| crate::firewall::ensure(mark, notrack, masq, masq_ports, last, &fm));
    }
    // kube-proxy's conntrack settings, once conntrack is loaded (lb's
    // masquerade loads it; so may anything else, later): a look a second
    // until then.
    {
        let ct = cfg.conntrack.clone();
        tokio::spawn(async move {
            loop {
                let ct = ct.clone();
                if tokio::task::spawn_blocking(move || crate::conntrack::ensure(&ct)).await.unwrap_or(true) {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }
    // How long the watches have been failing, for the metric (beside the
    // source: it goes on while a sync blocks this thread).
    {
        let (status, metrics) = (source_status.clone(), metrics.clone());
        side.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                metrics.source_failing.set(status.failing_for().as_secs_f64());
            }
        });
    }
    let mut resync = tokio::time::interval(if cfg.resync_period.is_zero() { Duration::from_secs(86400 * 365) } else { cfg.resync_period });
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    resync.tick().await;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    // The ticks of a branch that is off are not taken (its interval is not
    // polled): each tick late is skipped, not made up for in a burst when
    // the branch turns on (a failed sync after a quiet month would have
    // run millions of syncs back to back).
    let ticks = |period: Duration| {
        let mut i = tokio::time::interval(period);
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    };
    let mut retry = ticks(Duration::from_secs(1));
    let mut hc_retry = ticks(Duration::from_secs(1));
    // XDP on a veth whose peer cannot take its frames: see Tc::check_xdp.
    let mut xdp_check = ticks(Duration::from_secs(2));
    // Whether the flows masqueraded in BPF that kept the pod programs ended.
    let mut pods_check = ticks(Duration::from_secs(1));
    // Devices waiting out their grace before they lose lb's programs.
    let mut unserved_check = ticks(Duration::from_secs(1));
    // Whether the kernel's NAT expiry timer this agent armed goes on
    // (`check_nat_gc`); whether it was found stopped at the last look.
    let mut nat_gc_check = ticks(Duration::from_secs(5));
    let mut nat_gc_stopped = false;
    let mut last: Option<Arc<Update>> = None;
    let mut dirty = false;
    // Whether load balancers may send here (`model::node_eligible`).
    let mut eligible = true;
    // NodePort devices whose programs could not be attached, with why.
    let mut attach_failed: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut first = true;
    // Whether an earlier agent's egress pod programs were judged (`pod_programs`).
    let mut pod_egress_unjudged = true;
    // Whether they were kept for DSR flows an earlier agent's frontends
    // (or another node's) sent here. During an upgrade, where the tables
    // counted at start held such flows (the old ones where they read as
    // this agent's), or, across a change of the NAT entries' layout (the
    // old tables unreadable, the staged ones empty until the programs
    // move), wherever the earlier agent's egress programs may run; the
    // upgrade moves them with the rest.
    let mut dsr_kept = upgrade.is_some() && (bpf_masqueraded.dsr_at_start > 0 || (nat_unreadable && tc.pod_egress_may_run()));
    if dsr_kept {
        tracing::info!(
            flows = bpf_masqueraded.dsr_at_start,
            "an upgrade: DSR flows to backends on this node may live; the egress pod programs stay and move with the rest"
        );
        tc.pod_egress = true;
    }
    let addresses_changed = rec.addresses.changed();
    // What an earlier agent left in LB_LOCAL4 may be out of date (an
    // address moved while no agent ran): put right before any sync.
    rec.sync_local4();
    loop {
        tokio::select! {
            // A node address came or went: the addresses refused as
            // sources at once, then a sync with the last snapshot.
            _ = addresses_changed.notified() => {
                rec.sync_local4();
                if last.is_none() {
                    continue;
                }
                metrics.queue.lock().unwrap().queued = Some(std::time::SystemTime::now());
            }
            r = rx.changed() => {
                if r.is_err() {
                    // The source task ended; its result says why.
                    return match (&mut source).await {
                        Ok(Err(e)) => Err(e.context("source failed")),
                        _ => Err(anyhow::anyhow!("source stopped")),
                    };
                }
                let Some(upd) = rx.borrow_and_update().clone() else { continue };
                tracing::debug!(waited_us = upd.since.elapsed().as_micros() as u64, "update received");
                health.changed(upd.since);
                let this = upd.snapshot.nodes.iter().find(|n| n.metadata.name.as_deref() == Some(cfg.node_name.as_str()));
                eligible = model::node_eligible(this.map(|n| &**n), eligible);
                health.node_deleting(!eligible);
                last = Some(upd);
            }
            _ = retry.tick(), if dirty => {}
            // A healthCheckNodePort listener that could not be opened
            // (another process held the port) is tried again every second
            // until it opens, also on a quiet cluster: until then the
            // load balancers see this node down for that Service.
            // (kube-proxy tries again at each sync, every syncPeriod at
            // least.)
            _ = hc_retry.tick(), if !dirty && health_checks.failing() > 0 => {
                let failed = health_checks.reconcile(&rec.health_checks, rec.health_check_on.as_deref()).await;
                metrics.health_check_failed.set(failed as i64);
                continue;
            }
            _ = unserved_check.tick(), if upgrade.is_none() && cfg.nodeport_interfaces.is_empty() && tc.unserved_waiting() => {
                let nodeport = crate::nodeport::interfaces_for(rec.addresses.get(), &rec.node_addresses);
                tc.detach_unserved(&nodeport, Some(unserved_grace()));
                continue;
            }
            _ = nat_gc_check.tick() => {
                check_nat_gc(&mut tc, &mut nat_gc_stopped);
                continue;
            }
            _ = xdp_check.tick(), if cfg.xdp => {
                tc.check_xdp();
                continue;
            }
            _ = pods_check.tick(), if masq_watch.pending() => {
                // Not while an upgrade waits: the old tables' flows are
                // counted only where their layout is this agent's, and
                // those of another are carried into the new tables when
                // it finishes (their replies still need the pod programs).
                let written = rec.config_written && upgrade.is_none();
                match masq_watch.look(written, bpf_masqueraded.started(), bpf_masqueraded.last()) {
                    masq_watch::Look::Wait => {}
                    masq_watch::Look::Pass => {
                        let _ = rec.nat_left.send(crate::nodeport::Ending::Nothing);
                    }
                    masq_watch::Look::Done => {
                        if !per_packet {
                            tracing::info!("the last flow masqueraded in BPF ended: the pod programs go");
                            tc.pod_ingress = false;
                            tc.drop_pod_programs(true, false);
                        }
                        // On failure the bit is still in this agent's
                        // flags: its next write of the config has it.
                        if let Err(e) = rec.set_node_flag(lb_common::node_flags::NO_BPF_MASQUERADED, true) {
                            tracing::warn!("no flow masqueraded in BPF is left; the pod programs keep looking for them until the node config is written again: {e:#}");
                        }
                    }
                }
                continue;
            }
            _ = resync.tick(), if !cfg.resync_period.is_zero() && last.is_some() && !dirty => {
                // Counters of freed ids (a NAT flow's last packets) go
                // here, between full syncs.
                rec.sweep_stats();
                if rec.not_programmed > 0 || rec.maglev_failed() {
                    // Services a full map left out (and Maglev tables that
                    // could not be written) are tried again every period,
                    // with a full sync: the room a plan needs while it adds
                    // before it deletes may be there now (kube-proxy
                    // retries a failed sync likewise).
                    tracing::info!(services = rec.not_programmed, maglev = rec.maglev_failed(), "programming the Services left out again");
                } else {
                    let started = Instant::now();
                    match rec.repair_drift() {
                        Ok(0) => {
                            // Every map checked against the model and found
                            // right: a full sync that had nothing to write, as
                            // kube-proxy's periodic one often has. It counts as
                            // one (kubeproxy_sync_proxy_rules_last_timestamp_seconds
                            // moves on a quiet cluster, as kube-proxy's does).
                            if let Some(upd) = &last {
                                health.synced(upd.since, &rec.ip_families);
                            }
                            let took = started.elapsed().as_secs_f64();
                            let now = unix_seconds(std::time::SystemTime::now());
                            for family in &rec.ip_families {
                                let l = [("ip_family", *family)];
                                metrics.kp_sync_duration.get_or_create(&l).observe(took);
                                metrics.kp_sync_full_duration.get_or_create(&l).observe(took);
                                metrics.kp_last_sync.get_or_create(&l).set(now);
                            }
                            continue;
                        }
                        Ok(n) => {
                            metrics.drift_repaired.inc_by(n as u64);
                            tracing::warn!(entries = n, "the maps differed from what this agent programmed (changed by hand?); writing them back");
                        }
                        Err(e) => {
                            tracing::error!("resync: {e:#}");
                            continue;
                        }
                    }
                }
            }
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
        let Some(upd) = last.clone() else { continue };
        // The sync takes the update's changes (kube-proxy's change
        // trackers are checked out as a sync begins, whatever its end).
        metrics.queue.lock().unwrap().taken = upd.received;
        let started = Instant::now();
        let mut attach_egress = || tc.set_sock_egress(true);
        let attach: Option<&mut dyn FnMut() -> Result<()>> = if upgrade.is_none() { Some(&mut attach_egress) } else { None };
        match rec.sync(&upd.snapshot, attach) {
            Ok(()) => {
                dirty = false;
                // Ready only once an upgrade's programs moved (below): one
                // that cannot move them exits, and a rollout that saw it
                // ready would go on to the next node.
                if upgrade.is_none() {
                    health.synced(upd.since, &rec.ip_families);
                }
                let took = started.elapsed().as_secs_f64();
                metrics.sync_duration.observe(took);
                metrics.event_to_programmed.observe(upd.since.elapsed().as_secs_f64());
                let now = std::time::SystemTime::now();
                let kind = if rec.last_full { &metrics.kp_sync_full_duration } else { &metrics.kp_sync_partial_duration };
                for family in &rec.ip_families {
                    let l = [("ip_family", *family)];
                    metrics.kp_sync_duration.get_or_create(&l).observe(took);
                    kind.get_or_create(&l).observe(took);
                    metrics.kp_last_sync.get_or_create(&l).set(unix_seconds(now));
                }
                for (t, family) in rec.triggers.drain(..) {
                    let l = [("ip_family", family)];
                    metrics.kp_network_programming.get_or_create(&l).observe(now.duration_since(t).map_or(0.0, |d| d.as_secs_f64()));
                }
            }
            Err(e) => {
                dirty = true;
                metrics.sync_errors.inc();
                tracing::error!("{e:#}");
                // kube-proxy observes every attempt's duration, failed
                // ones too (not in the full and partial histograms here:
                // which one failed is not known).
                let took = started.elapsed().as_secs_f64();
                for family in &rec.ip_families {
                    metrics.kp_sync_duration.get_or_create(&[("ip_family", *family)]).observe(took);
                }
            }
        }
        rec.export(&metrics, &cfg.capacity);
        rec.export_names(&metrics);
        // kube-proxy's queue gauges are read at each scrape
        // (`Metrics::watch_queue`), per family once a sync knows them.
        metrics.queue.lock().unwrap().families = rec.ip_families.clone();
        let counts = rec.no_local.counts();
        for family in rec.ip_families.iter().copied().chain(counts.keys().map(|(f, _)| *f)) {
            for policy in ["internal", "external"] {
                let n = counts.get(&(family, policy)).copied().unwrap_or(0);
                metrics.kp_no_local_endpoints.get_or_create(&[("ip_family", family), ("traffic_policy", policy)]).set(n as i64);
            }
        }
        // An upgrade: the staged maps hold the first full sync now; move the
        // programs to them (the old ones served from the old maps meanwhile).
        if !dirty && let Some(replaced) = upgrade.take() {
            // Every device this agent serves moves before the second copy
            // (those of netlink filters are known only so).
            // The node's own devices (a netns or kind node's uplink is a
            // veth), never pod devices; NodePort devices where some
            // frontend is external.
            let uplinks = if !cfg.nodeport_interfaces.is_empty() {
                cfg.nodeport_interfaces.clone()
            } else {
                crate::nodeport::interfaces_for(rec.addresses.get(), &rec.node_addresses)
            };
            let nodeport = if !cfg.nodeport_interfaces.is_empty() || rec.has_external { uplinks.clone() } else { Vec::new() };
            let pods = (forward && rec.has_external) || (per_packet && rec.frontends() > 0) || keep_pods(&masq_watch) || rec.has_dsr || dsr_kept;
            let pod_devices = match crate::netdev::links() {
                Ok(links) if pods => crate::netdev::pod_devices(&links, &uplinks),
                _ => Vec::new(),
            };
            pod_programs(&mut tc, forward || per_packet || keep_pods(&masq_watch), per_packet || rec.has_dsr);
            tc.finish_upgrade(&replaced, &nodeport, &pod_devices)?;
            arm_nat_gc(&mut tc);
            for iface in &cfg.nodeport_interfaces {
                tc.attach_tc(iface)?;
            }
            health.synced(upd.since, &rec.ip_families);
            // The earlier agent's devices these are not (moved above with
            // the rest) go now.
            if !cfg.nodeport_interfaces.is_empty() {
                tc.detach_unserved(&cfg.nodeport_interfaces, None);
            }
            // The first sync's sweep judged the staged maps, which held no
            // flow and no socket's UDP entry yet: the old programs' ones
            // came along just now, those to endpoints that left while no
            // agent ran too.
            rec.upgrading = false;
            rec.sweep(true);
        }
        // loadBalancerSourceRanges for the sockets the hooks translate: the
        // egress program is attached while some frontend has them (before
        // the first is written: `Reconciler::sync`; here again if that
        // failed), and the hooks mark sockets only once it is (detached: no
        // longer marked first, after the last is gone), so no other packet
        // pays for it.
        let ranges = rec.wants_source_ranges();
        if upgrade.is_none() && !dirty && ranges != rec.sock_egress {
            let r = if ranges {
                tc.set_sock_egress(true).and_then(|()| rec.set_sock_egress(true))
            } else {
                rec.set_sock_egress(false).and_then(|()| tc.set_sock_egress(false))
            };
            match r {
                Ok(()) => tracing::info!(attached = ranges, "loadBalancerSourceRanges on the socket path: {EGRESS}", EGRESS = loader::EGRESS_PROGRAM),
                Err(e) => {
                    dirty = true;
                    tracing::error!("{} for loadBalancerSourceRanges: {e:#}", loader::EGRESS_PROGRAM);
                }
            }
        }
        let failed = health_checks.reconcile(&rec.health_checks, rec.health_check_on.as_deref()).await;
        metrics.health_check_failed.set(failed as i64);
        // The TC programs go where outside traffic and replies of SNATed
        // flows arrive, unless told, once some Service takes traffic from
        // outside (any, where ClusterIPs routed here from outside are
        // served): until then there is no per-packet work at all. Devices
        // that appear later are picked up at the next sync.
        //
        // With --bpf-forward, the replies of local backends are forwarded
        // from the pod devices; with --per-packet-lb, what pods send to
        // Service addresses is translated there, as soon as a Service
        // exists. New pods' devices are picked up here: a veth coming up
        // wakes this loop (`Addresses`).
        let pods = (forward && rec.has_external) || (per_packet && rec.frontends() > 0) || keep_pods(&masq_watch) || rec.has_dsr;
        if upgrade.is_none() && !dirty && !per_packet && !rec.has_dsr && !tc.pod_egress && std::mem::take(&mut pod_egress_unjudged) {
            if bpf_masqueraded.dsr_at_start > 0 {
                // DSR flows to a backend here live (sent by an earlier
                // agent's frontends, or another node's): a client pod here
                // gets their replies only through these programs, which
                // stay (egress ones stay once attached).
                tracing::info!(
                    flows = bpf_masqueraded.dsr_at_start,
                    "DSR flows to backends on this node live: the egress pod programs stay though no frontend here sends by DSR"
                );
                tc.pod_egress = true;
                dsr_kept = true;
            } else {
                // No frontend sends by DSR: an earlier agent's egress pod
                // programs go.
                tc.drop_pod_programs(false, true);
            }
        }
        let pods = pods || dsr_kept;
        if upgrade.is_none() && (rec.has_external || pods) {
            let nodeport = if cfg.nodeport_interfaces.is_empty() {
                let found = crate::nodeport::interfaces_for(rec.addresses.get(), &rec.node_addresses);
                for iface in found.iter().filter(|_| rec.has_external) {
                    match tc.attach_tc(iface) {
                        Ok(()) => {
                            if attach_failed.remove(iface).is_some() {
                                tracing::info!(iface, "NodePort programs attached after all");
                            }
                        }
                        Err(e) => {
                            // Logged when it fails anew or otherwise; the
                            // retry tick runs this again in a second.
                            let why = format!("{e:#}");
                            if attach_failed.get(iface) != Some(&why) {
                                tracing::error!(iface, "{why}; tried again every second");
                            }
                            attach_failed.insert(iface.clone(), why);
                            dirty = true;
                        }
                    }
                }
                found
            } else {
                cfg.nodeport_interfaces.clone()
            };
            // Devices that are no NodePort devices any more (an upgrade
            // that moved an earlier agent's devices, an address gone for
            // longer than a grace) lose lb's programs, once the ones that
            // are have theirs.
            if rec.has_external && cfg.nodeport_interfaces.is_empty() {
                tc.detach_unserved(&nodeport, Some(unserved_grace()));
            }
            if pods {
                pod_programs(&mut tc, forward || per_packet || keep_pods(&masq_watch), per_packet || rec.has_dsr);
                rec.addresses.track_veths();
                sync_pods(&mut tc, &nodeport);
            }
        }
        if first {
            first = false;
            // The source's first full view is programmed: anything inherited
            // that it does not have is gone now.
            tracing::info!(frontends = rec.frontends(), "initial sync complete");
        }
    }
    source.abort();
    tracing::info!("exiting; programs stay attached and maps stay pinned");
    Ok(())
}

/// How long a device this agent served keeps lb's programs once it is no
/// NodePort device (its address gone): 30 s, so that an address that
/// comes back (a DHCP renewal, a network manager reapplying its
/// configuration) keeps its flows. `LB_UNSERVED_GRACE_MS` sets it (for the
/// tests only).
fn unserved_grace() -> Duration {
    std::env::var("LB_UNSERVED_GRACE_MS").ok().and_then(|v| v.parse().ok()).map_or(Duration::from_secs(30), Duration::from_millis)
}

/// Seconds since the Unix epoch, for kube-proxy's timestamp gauges.
fn unix_seconds(t: std::time::SystemTime) -> f64 {
    t.duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// Which pod programs the pod devices get: the ingress one (what a pod
/// sends: `--bpf-forward`, `--per-packet-lb`, flows masqueraded in BPF),
/// the egress one (what goes into a pod: `--per-packet-lb`, and DSR, whose
/// replies to a client on this node pass no NodePort device). Devices that
/// had another set get the new one at the next `sync_pods`. The egress one
/// stays once attached (a DSR frontend may come back).
fn pod_programs(tc: &mut crate::dataplane::loader::Tc, ingress: bool, egress: bool) {
    let egress = egress || tc.pod_egress;
    if (tc.pod_ingress, tc.pod_egress) != (ingress, egress) {
        tc.pod_ingress = ingress;
        tc.pod_egress = egress;
        tc.forget_pods();
    }
}

/// Put the pod programs on the pod devices: every veth but the NodePort
/// devices `nodeport`.
fn sync_pods(tc: &mut crate::dataplane::loader::Tc, nodeport: &[String]) {
    match crate::netdev::links() {
        Ok(links) => tc.sync_pod_devices(&crate::netdev::pod_devices(&links, nodeport)),
        Err(e) => tracing::warn!("cannot list network devices for the pod programs: {e:#}"),
    }
}

/// Run `check` now and then every `period`, and whenever `wake` is
/// notified, on a blocking thread (it runs commands), handing it what it
/// saw last time (None at first, and after a check that panicked: `what`
/// is logged).
fn every<T: Send + 'static>(
    period: Duration,
    wake: Option<std::sync::Arc<tokio::sync::Notify>>,
    what: &'static str,
    check: impl Fn(&mut Option<T>) + Send + Sync + 'static,
) {
    let check = std::sync::Arc::new(check);
    tokio::spawn(async move {
        let mut last = None;
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            match &wake {
                Some(w) => tokio::select! {
                    _ = tick.tick() => {}
                    _ = w.notified() => tracing::debug!("{what}: something changed"),
                },
                None => {
                    tick.tick().await;
                }
            }
            let check = check.clone();
            match tokio::task::spawn_blocking(move || {
                check(&mut last);
                last
            })
            .await
            {
                Ok(l) => last = l,
                Err(e) => {
                    tracing::warn!(error = %e, "{what} failed");
                    last = None;
                }
            }
        }
    });
}
