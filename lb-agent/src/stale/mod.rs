//! Stale backends: when an endpoint leaves a Service, destroy the connected
//! sockets that our hooks translated to it, so that clients fail fast
//! instead of sending into a black hole (kube-proxy only flushes UDP
//! conntrack; cilium#14844, calico#4509).
//!
//! - Only sockets our translation made: connect4/6 left the translation in
//!   the socket's own storage (`LB_SOCK_XLATE`), which sock_diag returns
//!   with each TCP socket (INET_DIAG_REQ_SK_BPF_STORAGES). The kernel fills
//!   storage only into TCP dumps, so connected UDP sockets are found by
//!   cookie in `LB_SOCK_UDP` (a plain hash their sock_release hook empties:
//!   nothing evicts an idle one), and sockets translated before either
//!   existed (or with that table full) in the socket rev-NAT LRU. A direct
//!   connection to a pod IP has none of them and is never touched.
//! - 100 ms after the maps changed: a connection made just before (its
//!   request under way, the endpoint still answering) may finish; the
//!   sockets still open then are the ones that would hang.
//! - Only connected sockets: unconnected UDP sockets are left alone
//!   (cilium#48564); their next sendto picks a live backend.
//! - In every network namespace that has processes in the attached cgroup
//!   (the node's and each pod's, found through /proc/PID/ns/net), with
//!   netlink sock_diag SOCK_DESTROY.
//! - Cheap whatever the traffic: the kernel lists only connected sockets
//!   (not the TIME_WAIT ones a busy client leaves by the thousand), and the
//!   socket rev-NAT map is looked up per candidate, never walked. A sweep
//!   after a full sync (endpoints removed while no agent ran) lists every
//!   connected socket once, with its storage.
pub mod kept;
mod netns;
mod sock_diag;

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::path::Path;

use anyhow::{Context as _, Result};
use lb_common::{SockRevNat4Key, SockRevNat4Value, SockRevNat6Key, SockRevNat6Value};

pub use crate::model::Pair;
use crate::model::{FrontendKey, Proto};
pub use sock_diag::send;
use netns::{check_visibility, netns_sockets};
use sock_diag::{Conn, Destroyed, connected_to, destroy_one, xlate_pair};

/// A connected socket (named by `T`), its protocol, its peer address and
/// port, and the frontend our hook translated it from (None: not ours).
pub type Candidate<T> = (T, Proto, IpAddr, u16, Option<(IpAddr, u16)>);

/// The candidates to destroy: connected sockets whose peer is a backend
/// that left, with the frontend our hook translated them from (None: the
/// socket-LB did not make this connection). Only those translated from a
/// frontend that this backend left are stale.
pub fn stale<T: Copy>(candidates: &[Candidate<T>], left: &BTreeSet<Pair>) -> Vec<T> {
    candidates
        .iter()
        .filter(|(_, proto, b, bp, from)| from.is_some_and(|(v, vp)| left.contains(&(v, vp, *proto, *b, *bp))))
        .map(|(t, ..)| *t)
        .collect()
}

/// Destroys stale sockets on a thread of its own, off the path that
/// programs the maps: a sync hands it the pairs that stopped serving and
/// goes on.
pub struct Destroyer {
    tx: std::sync::mpsc::Sender<Work>,
}

/// What the destroyer is handed.
enum Work {
    /// Pairs that stopped serving, and pairs that started serving (again)
    /// in the same sync.
    Changed { left: BTreeSet<Pair>, joined: BTreeSet<Pair> },
    /// Every frontend after a full sync: any translated socket to a pair
    /// none of them serves is stale (an endpoint removed while no agent
    /// ran, say). TCP sockets only with a census of the kept pairs (their
    /// connections kept too, and reported: `Reconciler::sweep`).
    Sweep(Vec<(FrontendKey, std::sync::Arc<crate::model::Frontend>)>, Option<kept::Census>),
    /// UDP frontends that got backends: a connected UDP socket whose peer
    /// is one of them itself was connected while it had none (or did not
    /// exist), untranslated, and its datagrams go nowhere.
    UntranslatedUdp(BTreeSet<(IpAddr, u16)>),
}

/// What one round of the destroyer looks for (`merge`).
#[derive(Default)]
struct Round {
    left: BTreeSet<Pair>,
    /// The newest sweep's frontends, the pairs that joined since, and
    /// whether TCP sockets are judged (any sweep merged asked for it: the
    /// newest such sweep's census).
    fronts: Option<(Fronts, BTreeSet<Pair>, Option<kept::Census>)>,
    udp_served: BTreeSet<(IpAddr, u16)>,
}

type SockMap<K, V> = aya::maps::HashMap<aya::maps::MapData, K, V>;

fn open_lru<K: aya::Pod, V: aya::Pod>(bpffs: &Path, name: &str) -> Result<SockMap<K, V>> {
    let data = aya::maps::MapData::from_pin(crate::dataplane::loader::pin_path(bpffs, name)).with_context(|| format!("open pinned map {name}"))?;
    Ok(aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data))?)
}

/// The destroyer's thread: the maps it reads and what it reports to.
struct Worker {
    s4: SockMap<SockRevNat4Key, SockRevNat4Value>,
    s6: SockMap<SockRevNat6Key, SockRevNat6Value>,
    /// `LB_SOCK_XLATE`, whose values sock_diag returns with TCP sockets.
    storage: aya::maps::MapData,
    /// `LB_SOCK_UDP`: connected UDP sockets' translations by cookie.
    udp: SockMap<u64, lb_common::SockXlate>,
    cgroup: std::path::PathBuf,
    destroyed: prometheus_client::metrics::counter::Counter,
    refused: Refused,
    invisible: prometheus_client::metrics::gauge::Gauge,
    /// The "cannot see the processes" error was logged.
    logged_blind: bool,
    /// The errnos of refusals logged as errors (each once).
    logged_refusals: BTreeSet<i32>,
}

/// `lb_sockets_destroy_failed`, by errno.
pub type Refused = prometheus_client::metrics::family::Family<[(&'static str, String); 1], prometheus_client::metrics::counter::Counter>;

/// How long after the maps changed the sockets to endpoints that left are
/// looked for.
const GRACE: std::time::Duration = std::time::Duration::from_millis(100);

/// Everything queued, at once, in order: the pairs that left and did not
/// come back, and the newest sweep's frontends with the pairs that joined
/// after it (a pair that joined since its snapshot is not stale).
fn merge(works: impl Iterator<Item = Work>) -> Round {
    let mut left = BTreeSet::new();
    let mut sweep = None;
    let mut tcp = None;
    let mut back = BTreeSet::new();
    let mut udp_served = BTreeSet::new();
    for w in works {
        match w {
            Work::UntranslatedUdp(s) => udp_served.extend(s),
            Work::Changed { left: l, joined } => {
                for p in &joined {
                    left.remove(p);
                }
                back.retain(|p| !l.contains(p));
                back.extend(joined);
                left.extend(l);
            }
            Work::Sweep(f, t) => {
                tcp = t.or(tcp);
                sweep = Some(f);
                back.clear();
            }
        }
    }
    let fronts = sweep.map(|s| {
        let by_key: Fronts = s.into_iter().collect();
        (by_key, back, tcp)
    });
    Round { left, fronts, udp_served }
}

/// Frontends, to judge every translated socket in a sweep.
type Fronts = HashMap<FrontendKey, std::sync::Arc<crate::model::Frontend>>;

impl Worker {
    fn run(mut self, rx: std::sync::mpsc::Receiver<Work>) {
        check_visibility(&self.cgroup, &self.invisible, &mut self.logged_blind);
        while let Ok(first) = rx.recv() {
            // A connection made just before the change (its request under
            // way, to an endpoint that still answers) may finish: sockets
            // still open after the grace are the ones left hanging.
            std::thread::sleep(GRACE);
            let round = merge(std::iter::once(first).chain(rx.try_iter()));
            if round.left.is_empty() && round.fronts.is_none() && round.udp_served.is_empty() {
                continue;
            }
            check_visibility(&self.cgroup, &self.invisible, &mut self.logged_blind);
            // A census is told only what every netns showed (a process
            // the agent cannot see may hold a kept connection).
            let mut complete = self.invisible.get() == 0;
            let mut used = BTreeSet::new();
            let mut n = 0;
            let (sockets, all) = netns_sockets(&self.cgroup);
            complete &= all;
            for (pid, sock) in sockets {
                match self.netns(pid, &sock, &round, &mut used) {
                    Some(k) => n += k,
                    None => complete = false,
                }
            }
            if let Some((_, _, Some(census))) = &round.fronts
                && complete
            {
                census.report(kept::Source::Sockets, used);
            }
            self.destroyed.inc_by(n);
            if n > 0 {
                tracing::info!(sockets = n, "destroyed sockets connected to removed backends");
            }
        }
    }

    /// Destroy the stale sockets of one netns: connected to a pair in
    /// `left`, or (a sweep) to a pair none of `fronts` serves; and the
    /// connected UDP sockets our hooks did not translate whose peer is a
    /// frontend in `udp_served`.
    /// The kept pairs of a census with sockets go into `used`; false: the
    /// netns could not be listed.
    fn netns(&mut self, pid: u32, sock: &netlink_sys::Socket, round: &Round, used: &mut BTreeSet<Pair>) -> Option<u64> {
        use std::os::fd::AsFd as _;
        let Round { left, fronts, udp_served } = round;
        let fronts = fronts.as_ref();
        let peers: BTreeSet<(IpAddr, u16)> = left.iter().map(|(_, _, _, b, bp)| (*b, *bp)).chain(udp_served.iter().copied()).collect();
        let conns = match connected_to(sock, fronts.is_none().then_some(&peers), self.storage.fd().as_fd()) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("stale sockets: the netns of pid {pid}: {e:#}");
                return None;
            }
        };
        let proto = |c: &Conn| if c.req.protocol == sock_diag::IPPROTO_UDP { Proto::Udp } else { Proto::Tcp };
        let candidates: Vec<Candidate<usize>> = conns.iter().enumerate().map(|(i, c)| (i, proto(c), c.peer, c.port, self.translated_from(c))).collect();
        let mut judged = left.clone();
        if let Some((fronts, back, census)) = fronts {
            let kept = |pair: &Pair| census.as_ref().is_some_and(|c| c.pairs.contains(pair));
            let alive = |pair: &Pair| {
                let (addr, port, proto, b, bp) = *pair;
                (proto == Proto::Tcp && census.is_none())
                    || back.contains(pair)
                    || (!left.contains(pair) && (kept(pair) || fronts.get(&FrontendKey { addr, port, proto }).is_some_and(|f| f.serves(b, bp))))
            };
            let translated = candidates.iter().filter_map(|(_, proto, b, bp, f)| f.map(|(v, vp)| (v, vp, *proto, *b, *bp)));
            for pair in translated {
                if !alive(&pair) {
                    judged.insert(pair);
                } else if kept(&pair) {
                    used.insert(pair);
                }
            }
        }
        let untranslated = candidates
            .iter()
            .filter(|(_, proto, b, bp, from)| from.is_none() && *proto == Proto::Udp && udp_served.contains(&(*b, *bp)))
            .map(|(i, ..)| *i);
        let mut n = 0;
        for i in stale(&candidates, &judged).into_iter().chain(untranslated) {
            let c = &conns[i];
            let refused = match destroy_one(sock, c.req.clone()) {
                Ok(Destroyed::Yes) => {
                    n += 1;
                    false
                }
                Ok(Destroyed::Gone) => false,
                Ok(Destroyed::Refused(errno)) => {
                    self.refused.get_or_create(&[("errno", format!("{errno:?}"))]).inc();
                    if self.logged_refusals.insert(errno as i32) {
                        tracing::error!(
                            errno = ?errno,
                            "the kernel refused to destroy a socket connected to a removed endpoint ({}): such clients wait for \
                             their own timeouts instead of failing at once{}; counted in lb_sockets_destroy_failed_total (logged once)",
                            errno.desc(),
                            if errno == nix::errno::Errno::EOPNOTSUPP { " (a kernel built without CONFIG_INET_DIAG_DESTROY)" } else { "" }
                        );
                    } else {
                        tracing::debug!(errno = ?errno, "SOCK_DESTROY refused");
                    }
                    true
                }
                Err(e) => {
                    tracing::warn!("destroying a stale socket in the netns of pid {pid}: {e:#}");
                    true
                }
            };
            // Gone (or closing): forget its translation (a socket's storage
            // goes with the socket). One the kernel refused (or whose fate
            // is unknown) may live on.
            if c.xlate.is_none() && !refused {
                self.forget(c);
            }
        }
        Some(n)
    }

    /// Which frontend our hook translated a socket from: its storage, else
    /// the LRU by cookie (None: not ours).
    fn translated_from(&self, c: &Conn) -> Option<(IpAddr, u16)> {
        if let Some(x) = &c.xlate {
            return xlate_pair(x, c.peer, c.port);
        }
        if let Ok(x) = self.udp.get(&c.cookie, 0)
            && let Some(pair) = xlate_pair(&x, c.peer, c.port)
        {
            return Some(pair);
        }
        match c.peer {
            IpAddr::V4(a) => {
                let k = SockRevNat4Key { cookie: c.cookie, addr: a.octets(), port: c.port, _pad: 0 };
                if let Ok(v) = self.s4.get(&k, 0) {
                    return Some((IpAddr::from(v.addr), v.port));
                }
                let k = SockRevNat6Key { cookie: c.cookie, addr: a.to_ipv6_mapped().octets(), port: c.port, _pad: 0, _pad2: 0 };
                self.s6.get(&k, 0).ok().map(|v| (IpAddr::from(v.addr), v.port))
            }
            IpAddr::V6(a) => {
                let k = SockRevNat6Key { cookie: c.cookie, addr: a.octets(), port: c.port, _pad: 0, _pad2: 0 };
                self.s6.get(&k, 0).ok().map(|v| (IpAddr::from(v.addr), v.port))
            }
        }
    }

    fn forget(&mut self, c: &Conn) {
        if let IpAddr::V4(a) = c.peer {
            let _ = self.s4.remove(&SockRevNat4Key { cookie: c.cookie, addr: a.octets(), port: c.port, _pad: 0 });
        }
        let a6 = match c.peer {
            IpAddr::V4(a) => a.to_ipv6_mapped(),
            IpAddr::V6(a) => a,
        };
        let _ = self.s6.remove(&SockRevNat6Key { cookie: c.cookie, addr: a6.octets(), port: c.port, _pad: 0, _pad2: 0 });
    }
}

impl Destroyer {
    /// `destroyed` counts the sockets (the `lb_sockets_destroyed` metric),
    /// `refused` those the kernel would not destroy.
    /// `invisible` is the number of the cgroup's processes the agent cannot see
    /// (the `lb_cgroup_processes_invisible` metric).
    pub fn spawn(
        bpffs: &Path,
        cgroup: std::path::PathBuf,
        destroyed: prometheus_client::metrics::counter::Counter,
        refused: Refused,
        invisible: prometheus_client::metrics::gauge::Gauge,
    ) -> Result<Self> {
        use lb_common::maps;
        let worker = Worker {
            s4: open_lru(bpffs, maps::SOCK_REVNAT4)?,
            s6: open_lru(bpffs, maps::SOCK_REVNAT6)?,
            storage: aya::maps::MapData::from_pin(crate::dataplane::loader::pin_path(bpffs, maps::SOCK_XLATE))
                .with_context(|| format!("open pinned map {}", maps::SOCK_XLATE))?,
            udp: {
                let data = aya::maps::MapData::from_pin(crate::dataplane::loader::pin_path(bpffs, maps::SOCK_UDP))
                    .with_context(|| format!("open pinned map {}", maps::SOCK_UDP))?;
                aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data))?
            },
            cgroup,
            destroyed,
            refused,
            invisible,
            logged_blind: false,
            logged_refusals: Default::default(),
        };
        let (tx, rx) = std::sync::mpsc::channel::<Work>();
        std::thread::Builder::new().name("stale-sockets".into()).spawn(move || worker.run(rx))?;
        Ok(Self { tx })
    }

    /// Hand over pairs that stopped serving, and those that started.
    pub fn update(&self, left: BTreeSet<Pair>, joined: BTreeSet<Pair>) {
        let _ = self.tx.send(Work::Changed { left, joined });
    }

    /// Hand over the UDP frontends that got backends (connected UDP
    /// sockets to them that no hook translated are destroyed).
    pub fn untranslated_udp(&self, fronts: BTreeSet<(IpAddr, u16)>) {
        let _ = self.tx.send(Work::UntranslatedUdp(fronts));
    }

    /// Hand over every frontend after a full sync; TCP sockets are judged
    /// with a census of the kept pairs.
    pub fn sweep(&self, fronts: Vec<(FrontendKey, std::sync::Arc<crate::model::Frontend>)>, census: Option<kept::Census>) {
        let _ = self.tx.send(Work::Sweep(fronts, census));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_that_comes_back_before_the_destroyer_looks_is_not_stale() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let (a, b) = ((ip("10.96.0.10"), 80, Proto::Tcp, ip("10.0.0.1"), 8080), (ip("10.96.0.10"), 80, Proto::Tcp, ip("10.0.0.2"), 8080));
        let changed = |l: &[Pair], j: &[Pair]| Work::Changed { left: l.iter().copied().collect(), joined: j.iter().copied().collect() };
        // a leaves, then comes back; b leaves.
        let Round { left, fronts, .. } = merge([changed(&[a, b], &[]), changed(&[], &[a])].into_iter());
        assert_eq!(left, [b].into());
        assert!(fronts.is_none());
        // a comes back, then leaves again: stale.
        let Round { left, .. } = merge([changed(&[a], &[]), changed(&[], &[a]), changed(&[a], &[])].into_iter());
        assert_eq!(left, [a].into());
        // After a sweep, what joined since counts as alive; what joined
        // before it is in the sweep's own snapshot.
        let dir = std::env::temp_dir().join(format!("lb-merge-{}", std::process::id()));
        let census = || Some(kept::Kept::load(&dir).census(&[]));
        let Round { fronts, .. } = merge([changed(&[], &[b]), Work::Sweep(Vec::new(), census()), changed(&[], &[a])].into_iter());
        assert_eq!(fronts.unwrap().1, [a].into());
        // Joined after the sweep, then left again: not alive.
        let Round { left, fronts, .. } = merge([Work::Sweep(Vec::new(), census()), changed(&[], &[a]), changed(&[a], &[])].into_iter());
        assert_eq!((left, fronts.unwrap().1), ([a].into(), BTreeSet::new()));
        // Two sweeps in one round: TCP judged if either asked.
        let Round { fronts, .. } = merge([Work::Sweep(Vec::new(), census()), Work::Sweep(Vec::new(), None)].into_iter());
        assert!(fronts.unwrap().2.is_some());
        let Round { fronts, .. } = merge([Work::Sweep(Vec::new(), None)].into_iter());
        assert!(fronts.unwrap().2.is_none());
        // Frontends that got backends, from every work of the round.
        let served = |v: &[(IpAddr, u16)]| Work::UntranslatedUdp(v.iter().copied().collect());
        let r = merge([served(&[(a.0, 53)]), changed(&[b], &[]), served(&[(b.0, 54)])].into_iter());
        assert_eq!(r.udp_served, [(a.0, 53), (b.0, 54)].into());
    }

    #[test]
    fn only_sockets_to_pairs_that_left_are_stale() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let vip = ip("10.96.0.10");
        let (tcp, udp) = (Proto::Tcp, Proto::Udp);
        let entries = [
            (1, tcp, ip("10.0.0.1"), 8080, Some((vip, 80))), // backend left
            (2, tcp, ip("10.0.0.2"), 8080, Some((vip, 80))), // still serving
            (3, tcp, ip("10.0.0.2"), 8080, Some((ip("10.96.0.11"), 80))), // same backend, other frontend that dropped it
            (5, udp, ip("10.0.0.3"), 53, Some((vip, 53))), // a UDP socket whose pair left
            (6, tcp, ip("10.0.0.3"), 53, Some((vip, 53))), // the same pair in TCP, still kept (draining)
        ];
        let left: BTreeSet<Pair> =
            [(vip, 80, tcp, ip("10.0.0.1"), 8080), (ip("10.96.0.11"), 80, tcp, ip("10.0.0.2"), 8080), (vip, 53, udp, ip("10.0.0.3"), 53)].into();
        assert_eq!(stale(&entries, &left), [1, 3, 5]);
        // A connection the socket-LB did not make is never stale.
        assert!(stale(&[(4, tcp, ip("10.0.0.1"), 8080, None)], &left).is_empty());
    }
}
