//! `lb-agent monitor`: a live stream of the programs' decisions, one line
//! each, from a ring buffer of its own.
//!
//! Up to `monitor::SLOTS` monitors run at once, each with its own ring
//! buffer (`LB_EVENTS<n>`): a monitor claims a slot by binding an abstract
//! unix socket named after the pin directory and the slot (the kernel lets
//! go of it when the monitor dies, however it dies). It keeps its heartbeat
//! fresh in `LB_MONITOR` (its slot, and index 0 for "any monitor"); the
//! programs send events only to slots whose heartbeat is under a second old,
//! and read nothing but index 0 while no monitor runs. A monitor that exits
//! clears its slot; one that is killed stops beating and gets no more events
//! within a second; the agent's janitor (and the next monitor) zero stale
//! heartbeats, so that even index 0 goes back to 0.
use std::collections::HashMap;
use std::net::IpAddr;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result, bail};
use aya::maps::{Array, Map, MapData, RingBuf};
use lb_common::{FAMILY_V4, MonitorEvent, maps, monitor};
use serde::{Deserialize, Serialize};

use crate::nodeport::monotonic_ns;

/// How often a monitor refreshes its heartbeat.
const BEAT: Duration = Duration::from_millis(200);
/// A heartbeat this old belongs to a monitor that is gone.
const STALE_NS: u64 = 2 * monitor::HEARTBEAT_NS;

fn heartbeats(bpffs: &Path) -> Result<Array<MapData, u64>> {
    let path = crate::dataplane::loader::pin_path(bpffs, maps::MONITOR);
    let data = MapData::from_pin(&path).with_context(|| format!("open pinned map {} (is an agent running with --bpffs {}?)", path.display(), bpffs.display()))?;
    Ok(Array::try_from(Map::Array(data))?)
}

/// The events slot `slot`'s ring buffer lost so far (summed over CPUs);
/// None where the pins have no such counter (an agent from before it).
fn lost(stats: &aya::maps::PerCpuArray<MapData, u64>, slot: u32) -> Option<u64> {
    stats.get(&(lb_common::stats::MONITOR_LOST + slot - 1), 0).ok().map(|v| v.iter().sum())
}

fn open_stats(bpffs: &Path) -> Option<aya::maps::PerCpuArray<MapData, u64>> {
    let path = crate::dataplane::loader::pin_path(bpffs, maps::STATS);
    aya::maps::PerCpuArray::try_from(Map::PerCpuArray(MapData::from_pin(path).ok()?)).ok()
}

/// Zero the heartbeats of monitors that are gone; index 0 follows the
/// freshest remaining one. Returns how many slots were cleared.
pub fn clear_stale(hb: &mut Array<MapData, u64>, now: u64) -> Result<usize> {
    let mut cleared = 0;
    let mut freshest = 0u64;
    for slot in 1..=monitor::SLOTS {
        let v = hb.get(&slot, 0)?;
        if v != 0 && now.saturating_sub(v) > STALE_NS {
            hb.set(slot, 0, 0)?;
            cleared += 1;
        } else {
            freshest = freshest.max(v);
        }
    }
    if hb.get(&0, 0)? != freshest {
        hb.set(0, freshest, 0)?;
    }
    Ok(cleared)
}

/// The agent's janitor: every 2 s, zero what killed monitors left on.
pub fn spawn_janitor(bpffs: &Path) -> Result<()> {
    let mut hb = heartbeats(bpffs)?;
    std::thread::Builder::new().name("monitor-janitor".into()).spawn(move || {
        loop {
            std::thread::sleep(Duration::from_secs(2));
            match clear_stale(&mut hb, monotonic_ns()) {
                Ok(n) if n > 0 => tracing::info!(slots = n, "cleared the heartbeat of a monitor that died"),
                Ok(_) => {}
                Err(e) => tracing::warn!("monitor heartbeats: {e:#}"),
            }
        }
    })?;
    Ok(())
}

/// One frontend and its Service, as the agent serves them on /frontends.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FrontendName {
    pub service: String,
    pub port_name: String,
    pub address: IpAddr,
    pub port: u16,
    pub protocol: String,
}

/// One event, as the monitor prints it.
#[derive(Debug, Serialize)]
pub struct Line {
    pub time: String,
    pub hook: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub netns_cookie: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<IpAddr>,
    pub protocol: &'static str,
    pub frontend: String,
    pub backend: Option<String>,
    pub errno: Option<String>,
    pub why: &'static str,
    pub service: Option<String>,
}

fn addr(family: u8, a: &[u8; 16]) -> IpAddr {
    if family == FAMILY_V4 { IpAddr::from([a[0], a[1], a[2], a[3]]) } else { IpAddr::from(*a) }
}

fn proto(p: u8) -> &'static str {
    match p {
        lb_common::PROTO_TCP => "TCP",
        lb_common::PROTO_UDP => "UDP",
        _ => "?",
    }
}

/// The agent's frontends by name: each frontend's Service (and port name),
/// and each address that belongs to one Service alone (its ClusterIPs,
/// mostly: a node address or a shared LB IP belongs to many), which names
/// an event at a port the Service does not have.
#[derive(Debug, Default)]
pub struct Names {
    exact: HashMap<(IpAddr, u16, String), String>,
    by_addr: HashMap<IpAddr, String>,
}

impl Names {
    pub fn new(list: Vec<FrontendName>) -> Self {
        let mut by_addr: HashMap<IpAddr, Option<String>> = HashMap::new();
        let mut exact = HashMap::new();
        for f in list {
            by_addr
                .entry(f.address)
                .and_modify(|s| {
                    if s.as_ref() != Some(&f.service) {
                        *s = None;
                    }
                })
                .or_insert_with(|| Some(f.service.clone()));
            let name = if f.port_name.is_empty() { f.service } else { format!("{}:{}", f.service, f.port_name) };
            exact.insert((f.address, f.port, f.protocol), name);
        }
        Names { exact, by_addr: by_addr.into_iter().filter_map(|(a, s)| Some((a, s?))).collect() }
    }

    /// The Service (with the port's name) of a frontend; else the Service
    /// its address alone belongs to.
    fn of(&self, addr: IpAddr, port: u16, protocol: &str) -> Option<String> {
        self.exact.get(&(addr, port, protocol.to_string())).or_else(|| self.by_addr.get(&addr)).cloned()
    }
}

/// An event as a line; `wall`: the wall-clock time of monotonic `mono`.
pub fn line(ev: &MonitorEvent, names: &Names, wall: SystemTime, mono: u64) -> Line {
    let x = &ev.x;
    let front = addr(x.family, &x.front);
    let at = wall - Duration::from_nanos(mono.saturating_sub(ev.ts_ns));
    // A drop for loadBalancerSourceRanges has no backend, and an errno
    // only where the sender is told (the node's own sockets: EPERM).
    let dropped = ev.why == monitor::WHY_SOURCE_RANGE;
    let translated = ev.errno == 0 && !dropped;
    let protocol = proto(ev.proto);
    Line {
        time: humantime::format_rfc3339_millis(at).to_string(),
        hook: monitor::hook_name(ev.hook),
        netns_cookie: matches!(ev.hook, monitor::HOOK_CONNECT | monitor::HOOK_SENDMSG).then_some(ev.netns_cookie),
        client: matches!(ev.hook, monitor::HOOK_TC | monitor::HOOK_POD | monitor::HOOK_EGRESS).then(|| addr(x.family, &ev.client)),
        protocol,
        frontend: std::net::SocketAddr::new(front, x.front_port).to_string(),
        backend: translated.then(|| std::net::SocketAddr::new(addr(x.family, &x.backend), x.backend_port).to_string()),
        // The TC and pod programs REJECT where the socket hooks refuse
        // (the client sees ECONNREFUSED), and drop the rest.
        errno: match (translated, ev.errno) {
            (true, _) => None,
            (false, 0) => Some("dropped".to_string()),
            (false, e) if matches!(ev.hook, monitor::HOOK_TC | monitor::HOOK_POD) && e as i32 != libc::ECONNREFUSED => Some("dropped".to_string()),
            (false, e) => Some(format!("{:?}", nix::errno::Errno::from_raw(e as i32))),
        },
        why: monitor::why_name(ev.why),
        service: names.of(front, x.front_port, protocol),
    }
}

pub fn render(l: &Line) -> String {
    let who = match (l.netns_cookie, l.client) {
        (Some(c), _) => format!("netns={c}"),
        (_, Some(a)) => format!("client={a}"),
        _ => String::new(),
    };
    let to = l.backend.clone().or_else(|| l.errno.clone()).unwrap_or_default();
    let svc = l.service.as_deref().map(|s| format!(" [{s}]")).unwrap_or_default();
    format!("{} {:<7} {who} {} {} -> {to} ({}){svc}", l.time, l.hook, l.protocol, l.frontend, l.why)
}

/// The agent's frontend names, from its /frontends endpoint.
async fn fetch_names(agent: &str) -> Result<Names> {
    use http_body_util::{BodyExt as _, Empty};
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let uri: http::Uri = format!("http://{agent}/frontends").parse().with_context(|| format!("--agent {agent}"))?;
    let resp = tokio::time::timeout(Duration::from_secs(3), client.get(uri)).await.context("timed out")??;
    if !resp.status().is_success() {
        bail!("GET /frontends: {}", resp.status());
    }
    let body = resp.into_body().collect().await?.to_bytes();
    let list: Vec<FrontendName> = serde_json::from_slice(&body).context("parse /frontends")?;
    Ok(Names::new(list))
}

/// Claim a free slot: 1..=SLOTS.
fn claim(bpffs: &Path) -> Result<(u32, UnixListener)> {
    use std::os::linux::net::SocketAddrExt as _;
    let dir = std::fs::canonicalize(bpffs).unwrap_or_else(|_| bpffs.to_path_buf());
    for slot in 1..=monitor::SLOTS {
        let name = format!("lb-monitor:{}:{slot}", dir.display());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        if let Ok(l) = UnixListener::bind_addr(&addr) {
            return Ok((slot, l));
        }
    }
    bail!("{} monitors already run for {}; stop one", monitor::SLOTS, bpffs.display())
}

/// Run a monitor until SIGINT or SIGTERM (or `max`, for tests).
pub async fn run(bpffs: &Path, service: Option<&str>, json: bool, agent: &str, max: Option<Duration>) -> Result<()> {
    let mut hb = heartbeats(bpffs)?;
    let (slot, _claim) = claim(bpffs)?;
    let ring_path = crate::dataplane::loader::pin_path(bpffs, maps::EVENTS[slot as usize - 1]);
    let ring = RingBuf::try_from(Map::RingBuf(MapData::from_pin(&ring_path).with_context(|| format!("open {}", ring_path.display()))?))?;
    // SAFETY: the RingBuf owns its descriptor, and the AsyncFd owns the
    // RingBuf: the descriptor stays open for as long as it is registered.
    let mut ring = unsafe { tokio::io::unix::AsyncFd::register(ring) }.map_err(std::io::Error::from)?;
    let mut names = match fetch_names(agent).await {
        Ok(n) => n,
        Err(e) if service.is_some() => bail!("--service needs the agent's frontend names from {agent}: {e:#}"),
        Err(e) => {
            tracing::warn!("no Service names (the agent at {agent}: {e:#}); frontends are shown by address");
            Names::default()
        }
    };
    let mut fetched = tokio::time::Instant::now();
    let want = service.map(|s| s.to_string());
    // Whatever a killed monitor left in this slot's ring is not ours.
    while ring.get_mut().next().is_some() {}
    clear_stale(&mut hb, monotonic_ns())?;
    let beat = |hb: &mut Array<MapData, u64>| -> Result<()> {
        let now = monotonic_ns();
        hb.set(slot, now, 0)?;
        hb.set(0, now, 0)?;
        Ok(())
    };
    beat(&mut hb)?;
    eprintln!("lb-agent monitor: slot {slot}; Ctrl-C to stop");
    // Events lost to a full ring buffer: counted by the programs, said here.
    let stats = open_stats(bpffs);
    let mut lost_seen = stats.as_ref().and_then(|s| lost(s, slot)).unwrap_or(0);
    let mut ticker = tokio::time::interval(BEAT);
    let mut refresh = tokio::time::interval(Duration::from_secs(5));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let deadline = max.map(|d| tokio::time::Instant::now() + d);
    let until = async move {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(until);
    let mut out = std::io::stdout().lock();
    let result: Result<()> = loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break Ok(()),
            _ = term.recv() => break Ok(()),
            _ = &mut until => break Ok(()),
            _ = ticker.tick() => {
                if let Err(e) = beat(&mut hb) {
                    break Err(e);
                }
                if let Some(now) = stats.as_ref().and_then(|s| lost(s, slot))
                    && now > lost_seen
                {
                    eprintln!(
                        "lb-agent monitor: {} events lost (this monitor's ring buffer was full: the output is read too slowly; \
                         --service narrows it, a file takes it faster than a terminal)",
                        now - lost_seen
                    );
                    lost_seen = now;
                }
            }
            _ = refresh.tick() => {
                if let Ok(n) = fetch_names(agent).await {
                    names = n;
                    fetched = tokio::time::Instant::now();
                }
            }
            guard = ring.readable_mut() => {
                let mut guard = match guard {
                    Ok(g) => g,
                    Err(e) => break Err(e.into()),
                };
                let (wall, mono) = (SystemTime::now(), monotonic_ns());
                let mut events = Vec::new();
                while let Some(item) = guard.get_inner_mut().next() {
                    if let Some(bytes) = item.get(..size_of::<MonitorEvent>()) {
                        events.push(bytemuck::pod_read_unaligned::<MonitorEvent>(bytes));
                    }
                }
                guard.clear_ready();
                // A frontend newer than the names: fetch them again (at
                // most once a second), so that it is named (and passes a
                // --service filter) from its first event on.
                let unnamed = events.iter().any(|ev| line(ev, &names, wall, mono).service.is_none());
                if unnamed && fetched.elapsed() >= Duration::from_secs(1) {
                    if let Ok(n) = fetch_names(agent).await {
                        names = n;
                    }
                    fetched = tokio::time::Instant::now();
                }
                let mut reader_gone = false;
                for ev in &events {
                    let l = line(ev, &names, wall, mono);
                    if want.as_ref().is_some_and(|w| l.service.as_ref().is_none_or(|s| s != w && !s.starts_with(&format!("{w}:")))) {
                        continue;
                    }
                    use std::io::Write as _;
                    let text = if json { serde_json::to_string(&l).unwrap_or_default() } else { render(&l) };
                    if writeln!(out, "{text}").and_then(|_| out.flush()).is_err() {
                        reader_gone = true;
                        break;
                    }
                }
                // The reader went away (a closed pipe: `| head`): stop, and
                // switch this slot off below.
                if reader_gone {
                    break Ok(());
                }
            }
        }
    };
    // Switch this slot off; index 0 follows the others.
    hb.set(slot, 0, 0)?;
    settle_any(&mut hb, slot)?;
    result
}

/// The heartbeat array, as `settle_any` sees it (a fake one in the tests).
trait Beats {
    fn beat(&self, i: u32) -> u64;
    fn set_beat(&mut self, i: u32, v: u64) -> Result<()>;
}

impl Beats for Array<MapData, u64> {
    fn beat(&self, i: u32) -> u64 {
        self.get(&i, 0).unwrap_or(0)
    }
    fn set_beat(&mut self, i: u32, v: u64) -> Result<()> {
        Ok(self.set(i, v, 0)?)
    }
}

/// Set index 0 to the freshest other slot, and read the others again after
/// writing it: a monitor stopping at the same moment may have read this
/// slot before it was cleared, read ours, and written its view over ours
/// (leaving index 0 at a heartbeat nobody refreshes). Whoever writes last
/// has read every slot after each stopping monitor cleared its own.
fn settle_any(hb: &mut impl Beats, slot: u32) -> Result<()> {
    let others = |hb: &dyn Beats| (1..=monitor::SLOTS).filter(|s| *s != slot).map(|s| hb.beat(s)).max().unwrap_or(0);
    let mut v = others(hb);
    // Bounded: a live monitor's beat moves its slot every BEAT, and index 0
    // at its value or a newer one is right either way.
    for _ in 0..8 {
        hb.set_beat(0, v)?;
        let again = others(hb);
        if again == v {
            break;
        }
        v = again;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A heartbeat array in memory that, on the first write of index 0,
    /// lets another monitor run its whole stop first (the interleaving
    /// that left index 0 on).
    struct Racing {
        v: [u64; monitor::SLOTS as usize + 1],
        other: Option<u32>,
    }

    impl Beats for Racing {
        fn beat(&self, i: u32) -> u64 {
            self.v[i as usize]
        }
        fn set_beat(&mut self, i: u32, v: u64) -> Result<()> {
            if let (0, Some(other)) = (i, self.other.take()) {
                self.v[other as usize] = 0;
                settle_any(self, other)?;
            }
            self.v[i as usize] = v;
            Ok(())
        }
    }

    fn name(service: &str, port_name: &str, address: &str, port: u16, protocol: &str) -> FrontendName {
        FrontendName { service: service.into(), port_name: port_name.into(), address: address.parse().unwrap(), port, protocol: protocol.into() }
    }

    fn event(hook: u8, front: [u8; 4], port: u16, errno: u8, why: u8) -> MonitorEvent {
        let mut ev: MonitorEvent = bytemuck::Zeroable::zeroed();
        ev.hook = hook;
        ev.proto = lb_common::PROTO_TCP;
        ev.errno = errno;
        ev.why = why;
        ev.x.family = FAMILY_V4;
        ev.x.front[..4].copy_from_slice(&front);
        ev.x.front_port = port;
        ev
    }

    #[test]
    fn an_event_is_named_by_its_frontend_else_by_an_address_of_one_service_alone() {
        let names = Names::new(vec![
            name("default/web", "http", "10.96.0.10", 80, "TCP"),
            name("default/web", "dns", "10.96.0.10", 53, "UDP"),
            name("default/web", "http", "192.168.77.11", 30080, "TCP"),
            name("default/other", "", "192.168.77.11", 30081, "TCP"),
            name("default/other", "", "10.96.0.11", 80, "TCP"),
        ]);
        let named = |front: [u8; 4], port: u16| line(&event(monitor::HOOK_CONNECT, front, port, libc::ECONNREFUSED as u8, monitor::WHY_WRONG_PORT), &names, SystemTime::now(), 0).service;
        assert_eq!(named([10, 96, 0, 10], 80).as_deref(), Some("default/web:http"));
        // A port web does not have, on web's ClusterIP: web's refusal.
        assert_eq!(named([10, 96, 0, 10], 81).as_deref(), Some("default/web"));
        assert_eq!(named([10, 96, 0, 11], 80).as_deref(), Some("default/other"));
        // The node's address belongs to both.
        assert_eq!(named([192, 168, 77, 11], 30081).as_deref(), Some("default/other"));
        assert_eq!(named([192, 168, 77, 11], 30082), None);
        assert_eq!(named([10, 96, 0, 12], 80), None);
    }

    #[test]
    fn the_tc_path_rejects_what_has_no_endpoints_and_drops_the_rest() {
        let names = Names::default();
        let errno = |hook, errno: i32, why| line(&event(hook, [192, 168, 77, 11], 30080, errno as u8, why), &names, SystemTime::now(), 0).errno;
        assert_eq!(errno(monitor::HOOK_TC, libc::ECONNREFUSED, monitor::WHY_NO_ENDPOINTS).as_deref(), Some("ECONNREFUSED"));
        assert_eq!(errno(monitor::HOOK_TC, libc::EHOSTUNREACH, monitor::WHY_NO_LOCAL_ENDPOINT).as_deref(), Some("dropped"));
        assert_eq!(errno(monitor::HOOK_POD, libc::EHOSTUNREACH, monitor::WHY_NO_LOCAL_ENDPOINT).as_deref(), Some("dropped"));
        assert_eq!(errno(monitor::HOOK_TC, 0, monitor::WHY_SOURCE_RANGE).as_deref(), Some("dropped"));
        // A socket is told.
        assert_eq!(errno(monitor::HOOK_CONNECT, libc::EHOSTUNREACH, monitor::WHY_NO_LOCAL_ENDPOINT).as_deref(), Some("EHOSTUNREACH"));
    }

    #[test]
    fn two_monitors_stopping_at_once_leave_nothing_on() {
        // Slot 1 stops: cleared, it reads slot 2 still beating; slot 2
        // then stops whole before slot 1 writes index 0.
        let mut hb = Racing { v: [700, 0, 700, 0, 0], other: Some(2) };
        settle_any(&mut hb, 1).unwrap();
        assert_eq!(hb.v, [0; 5]);
    }

    #[test]
    fn a_stopping_monitor_leaves_index_0_at_the_freshest_live_one() {
        // Slot 4 stopped (cleared); slot 2 still beats.
        let mut hb = Racing { v: [900, 0, 500, 0, 0], other: None };
        settle_any(&mut hb, 4).unwrap();
        assert_eq!(hb.v, [500, 0, 500, 0, 0]);
        // Without the second read, the interleaved stop would leave 700 on.
        let mut hb = Racing { v: [700, 0, 700, 400, 0], other: Some(2) };
        settle_any(&mut hb, 1).unwrap();
        assert_eq!(hb.v, [400, 0, 0, 400, 0]);
    }
}
