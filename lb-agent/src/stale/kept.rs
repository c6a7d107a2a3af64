//! TCP pairs whose endpoint left while ready: their connections are kept
//! (`Frontend::keeps`), as kube-proxy's conntrack keeps them. A watching
//! agent judges each pair as it leaves; the next agent (a restart, an
//! upgrade) starts blind, and its first sweep ends every TCP connection to
//! a pair no frontend serves. So each kept pair is recorded in the pin dir
//! (`kept_tcp/`, one empty directory per pair: bpffs holds nothing else),
//! and sweeps keep the recorded pairs' connections too.
//!
//! A record goes when its pair serves again (its connections are alive by
//! the model then), and when a sweep that judges TCP finds no connection
//! to it left: neither a translated socket (the destroyer) nor a NAT flow
//! (the NAT thread) told that sweep's census they saw one.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::model::{Pair, Proto};

/// The directory of the records, in the pin dir.
pub const DIR: &str = "kept_tcp";

/// Who reports to a census.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The stale-socket destroyer: translated TCP sockets.
    Sockets = 1,
    /// The NAT thread: outside clients' flows (and pods' under
    /// --per-packet-lb).
    Nat = 2,
}

/// Who reports to a census: the NAT thread, and the destroyer where it
/// runs (`--destroy-stale-sockets`). Nobody during an upgrade: its first
/// sweep sees the staged maps, which may not show the old tables' flows
/// (a NAT entry layout changed), and the sweep after the programs moved
/// judges them.
pub fn sources(upgrading: bool, destroyer: bool) -> &'static [Source] {
    match (upgrading, destroyer) {
        (true, _) => &[],
        (false, true) => &[Source::Sockets, Source::Nat],
        (false, false) => &[Source::Nat],
    }
}

/// The kept pairs, on disk and in memory.
pub struct Kept {
    dir: PathBuf,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Each pair with the generation it was recorded in.
    pairs: BTreeMap<Pair, u64>,
    generation: u64,
    /// The census under way: its generation, the sources yet to report,
    /// and the pairs reported in use.
    census: Option<(u64, u8, BTreeSet<Pair>)>,
    /// A record could not be written or removed (logged once).
    warned: bool,
}

/// One census: the pairs a sweep keeps, to report which of them still
/// have connections.
#[derive(Clone)]
pub struct Census {
    pub pairs: Arc<BTreeSet<Pair>>,
    generation: u64,
    kept: Arc<Kept>,
}

impl std::fmt::Debug for Census {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Census").field("pairs", &self.pairs).field("generation", &self.generation).finish()
    }
}

impl PartialEq for Census {
    fn eq(&self, o: &Self) -> bool {
        self.generation == o.generation && self.pairs == o.pairs
    }
}

impl Eq for Census {}

impl Census {
    /// A census of `pairs` that nobody awaits (tests).
    #[cfg(test)]
    pub fn of(pairs: BTreeSet<Pair>) -> Self {
        Census { pairs: Arc::new(pairs), generation: 0, kept: Arc::new(Kept { dir: PathBuf::new(), inner: Mutex::default() }) }
    }

    /// `source` saw connections to `used` (of `pairs`). Only a source that
    /// saw everything reports: one that could not (a netns it could not
    /// list) tells nothing, and nothing is pruned.
    pub fn report(&self, source: Source, used: impl IntoIterator<Item = Pair>) {
        self.kept.report(self.generation, source, used);
    }
}

impl Kept {
    /// The records an earlier agent left in `bpffs` (none: a new node).
    pub fn load(bpffs: &Path) -> Arc<Self> {
        let kept = Kept { dir: bpffs.join(DIR), inner: Mutex::default() };
        let pairs = kept.on_disk();
        if !pairs.is_empty() {
            tracing::info!(pairs = pairs.len(), "TCP connections kept when their ready endpoints left, recorded by an earlier agent: kept");
        }
        kept.lock().pairs = pairs.into_iter().map(|p| (p, 0)).collect();
        Arc::new(kept)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn on_disk(&self) -> BTreeSet<Pair> {
        std::fs::read_dir(&self.dir).into_iter().flatten().flatten().filter_map(|e| parse(&e.file_name().to_string_lossy())).collect()
    }

    /// How many pairs are recorded.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().pairs.len()
    }

    /// Record pairs whose TCP connections were kept as they left.
    pub fn add(&self, pairs: &BTreeSet<Pair>) {
        if pairs.is_empty() {
            return;
        }
        let mut inner = self.lock();
        inner.generation += 1;
        let generation = inner.generation;
        for p in pairs.iter().filter(|p| p.2 == Proto::Tcp) {
            inner.pairs.insert(*p, generation);
            let path = self.dir.join(name(p));
            if let Err(e) = std::fs::create_dir_all(&path) {
                warn_once(&mut inner, &path, &e);
            }
        }
    }

    /// Forget the pairs that serve again (or whose connections are gone).
    pub fn remove<'a>(&self, pairs: impl IntoIterator<Item = &'a Pair>) {
        let mut inner = self.lock();
        self.remove_locked(&mut inner, pairs);
    }

    fn remove_locked<'a>(&self, inner: &mut Inner, pairs: impl IntoIterator<Item = &'a Pair>) {
        if inner.pairs.is_empty() {
            return;
        }
        for p in pairs {
            if inner.pairs.remove(p).is_some() {
                let path = self.dir.join(name(p));
                if let Err(e) = std::fs::remove_dir(&path)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    warn_once(inner, &path, &e);
                }
            }
        }
    }

    /// Forget the recorded pairs in `alive`: they serve again.
    pub fn remove_alive(&self, alive: &BTreeSet<Pair>) {
        let serving: Vec<Pair> = self.lock().pairs.keys().filter(|p| alive.contains(p)).copied().collect();
        self.remove(&serving);
    }

    /// Start a census for a sweep that judges TCP, to be reported by
    /// `sources`: the recorded pairs (with those another agent recorded
    /// meanwhile: the old one during an upgrade), whose connections the
    /// sweep keeps. With no sources, a census that prunes nothing.
    pub fn census(self: &Arc<Self>, sources: &[Source]) -> Census {
        let mut inner = self.lock();
        let disk = self.on_disk();
        inner.generation += 1;
        let generation = inner.generation;
        // Those another agent recorded meanwhile are judged by this census
        // too (they are in its pairs).
        for p in disk {
            inner.pairs.entry(p).or_insert(generation - 1);
        }
        let waiting = sources.iter().fold(0, |m, s| m | *s as u8);
        inner.census = Some((generation, waiting, BTreeSet::new()));
        Census { pairs: Arc::new(inner.pairs.keys().copied().collect()), generation, kept: self.clone() }
    }

    fn report(&self, generation: u64, source: Source, used: impl IntoIterator<Item = Pair>) {
        let mut inner = self.lock();
        let Some((g, waiting, seen)) = inner.census.as_mut() else { return };
        if *g != generation || *waiting & source as u8 == 0 {
            return;
        }
        *waiting &= !(source as u8);
        seen.extend(used);
        if *waiting != 0 {
            return;
        }
        let (_, _, seen) = inner.census.take().expect("a census");
        // Pairs recorded after the census began are not judged by it.
        let unused: Vec<Pair> = inner.pairs.iter().filter(|(p, g)| **g < generation && !seen.contains(p)).map(|(p, _)| *p).collect();
        if !unused.is_empty() {
            tracing::debug!(pairs = unused.len(), "kept TCP pairs without connections forgotten");
            self.remove_locked(&mut inner, &unused);
        }
    }
}

fn warn_once(inner: &mut Inner, path: &Path, e: &std::io::Error) {
    if !std::mem::replace(&mut inner.warned, true) {
        tracing::warn!(
            "cannot record {} ({e}): TCP connections kept when a ready endpoint left the Service may be cut at the next restart of the agent (logged once)",
            path.display()
        );
    }
}

/// A pair's record: `tcp_FRONTEND_PORT_BACKEND_PORT`, the addresses with
/// `-` for `.` (bpffs refuses names with dots; no IPv6 address has `-`).
fn name(p: &Pair) -> String {
    let a = |ip: &IpAddr| ip.to_string().replace('.', "-");
    format!("tcp_{}_{}_{}_{}", a(&p.0), p.1, a(&p.3), p.4)
}

fn parse(name: &str) -> Option<Pair> {
    let mut it = name.strip_prefix("tcp_")?.split('_');
    let ip = |s: &str| s.replace('-', ".").parse::<IpAddr>().ok();
    let pair = (ip(it.next()?)?, it.next()?.parse().ok()?, Proto::Tcp, ip(it.next()?)?, it.next()?.parse().ok()?);
    it.next().is_none().then_some(pair)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(v: &str, b: &str) -> Pair {
        (v.parse().unwrap(), 80, Proto::Tcp, b.parse().unwrap(), 8080)
    }

    #[test]
    fn a_record_names_its_pair_without_dots() {
        for p in [pair("10.96.0.10", "10.244.1.5"), pair("fd00:96::a", "fd00:244:1::5"), pair("::ffff:10.0.0.1", "10.244.1.5")] {
            let n = name(&p);
            assert!(!n.contains('.') && n.len() < 256, "{n}");
            assert_eq!(parse(&n), Some(p), "{n}");
        }
        assert_eq!(name(&pair("10.96.0.10", "10.244.1.5")), "tcp_10-96-0-10_80_10-244-1-5_8080");
        for bad in ["tcp_10-96-0-10_80_10-244-1-5", "tcp_10-96-0-10_80_10-244-1-5_8080_1", "udp_10-96-0-10_80_10-244-1-5_8080", "tcp_x_80_10-244-1-5_8080"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_census_forgets_only_pairs_no_source_saw_that_were_recorded_before_it() {
        let dir = std::env::temp_dir().join(format!("lb-kept-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let kept = Kept::load(&dir);
        let (a, b, c, d) = (pair("10.96.0.1", "10.1.0.1"), pair("10.96.0.1", "10.1.0.2"), pair("10.96.0.1", "10.1.0.3"), pair("10.96.0.1", "10.1.0.4"));
        kept.add(&[a, b, c].into());
        assert_eq!(Kept::load(&dir).len(), 3, "on disk, for the next agent");
        let census = kept.census(&[Source::Sockets, Source::Nat]);
        assert_eq!(*census.pairs, [a, b, c].into());
        // Recorded after the census began: not judged by it.
        kept.add(&[d].into());
        census.report(Source::Sockets, [a]);
        assert_eq!(kept.len(), 4, "one source has not reported");
        census.report(Source::Nat, [b]);
        assert_eq!(kept.on_disk(), [a, b, d].into(), "c had no connection left");
        assert_eq!(kept.len(), 3);
        // A pair that serves again is forgotten; an older census's report
        // prunes nothing.
        kept.remove_alive(&[b].into());
        let old = census.clone();
        let _new = kept.census(&[Source::Nat]);
        old.report(Source::Nat, []);
        assert_eq!(kept.on_disk(), [a, d].into());
        // A record another agent made is taken in by the next census, and
        // judged by it.
        std::fs::create_dir(dir.join(DIR).join(name(&c))).unwrap();
        let census = kept.census(&[Source::Nat]);
        assert_eq!(*census.pairs, [a, c, d].into());
        census.report(Source::Nat, [a, d]);
        assert_eq!(kept.on_disk(), [a, d].into());
        std::fs::create_dir(dir.join(DIR).join(name(&c))).unwrap();
        let census = kept.census(&[Source::Nat]);
        census.report(Source::Nat, [a, c, d]);
        assert_eq!(kept.len(), 3);
        // A census without sources (during an upgrade, whose first sweep
        // sees the staged maps) prunes nothing; without the destroyer, the
        // NAT thread alone judges.
        assert_eq!(sources(true, true), []);
        assert_eq!(sources(false, false), [Source::Nat]);
        assert_eq!(sources(false, true), [Source::Sockets, Source::Nat]);
        let census = kept.census(sources(true, true));
        census.report(Source::Nat, []);
        census.report(Source::Sockets, []);
        assert_eq!(kept.on_disk(), [a, c, d].into());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
