//! The Maglev tables of the frontends whose outside traffic picks by
//! Maglev (`svc_flags::MAGLEV`): one inner array of backend ids per
//! (frontend, scope) in the family's outer map (`LB4_MAGLEV`,
//! `LB6_MAGLEV`), keyed by `MaglevKey`.
//!
//! A table is derived from what the family's table already holds (the
//! frontend's slots and their backends), after the ops that wrote them:
//! a changed table is built in a new inner array and swapped in with one
//! outer-map update, so a program sees the old table or the new one,
//! never a half-written one. Keys whose backends are the same share one
//! inner array. A table entry whose backend is not (or no
//! longer) in the backends map makes the program fall back to the slots,
//! so the order against the other writes cannot refuse a flow.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::os::fd::{AsFd as _, AsRawFd as _};
use std::path::Path;

use anyhow::{Context as _, Result};
use aya::maps::{HashOfMaps, Map, MapData};
use lb_common::{MaglevKey, SCOPE_ALL, SCOPE_LOCAL, SvcKey, svc_flags};

use super::table::{Addr, Table};
use crate::model::maglev::Maglev;

/// BPF_F_INNER_MAP: an inner array whose size may differ from the template's.
const BPF_F_INNER_MAP: u32 = 1 << 12;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
/// The kernel's ENOTSUPP: no batch operations for maps of maps (before
/// Linux 5.19).
const ENOTSUPP: i32 = 524;
/// Tables built and held open (a file descriptor each) before a batch puts
/// them in: a sync of thousands of tables stays far below a container's
/// usual limit of 1,024 open files.
const FLUSH_TABLES: usize = 256;

/// A removal that found no such key.
fn gone(e: &aya::maps::MapError) -> bool {
    match e {
        aya::maps::MapError::KeyNotFound => true,
        aya::maps::MapError::SyscallError(s) => s.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

/// Run a batch operation over `n` items: `op(from)` works on items
/// `from..n` in order and returns how many it did before a failure, and
/// the failure. An item that fails is skipped and the rest go on. Returns
/// the items that failed, with their errors.
fn run_batches(n: usize, mut op: impl FnMut(usize) -> (usize, std::io::Result<()>)) -> Vec<(usize, std::io::Error)> {
    let mut failed = Vec::new();
    let mut from = 0;
    while from < n {
        let (done, r) = op(from);
        from += done.min(n - from);
        match r {
            // Done (a batch), or one more (one at a time).
            Ok(()) if done == 0 => break,
            Ok(()) => {}
            Err(e) => {
                if from < n {
                    failed.push((from, e));
                }
                from += 1;
            }
        }
    }
    failed
}

/// A frontend and scope: (address, port, protocol, scope).
type Front<A> = (A, u16, u8, u8);

/// What a table is built from: its key and its backends (address, id),
/// in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Want {
    key: MaglevKey,
    backends: Vec<(SocketAddr, u32)>,
}

/// One family's outer map and the tables written into it.
pub struct MaglevTables<A: Addr> {
    outer: HashOfMaps<MapData, MaglevKey, MapData>,
    /// The outer map again, for batch writes (aya's type has none).
    raw: MapData,
    written: BTreeMap<Front<A>, Want>,
    /// Outer keys a full sync has not checked yet (an earlier agent's).
    unchecked: bool,
    /// A table could not be written since the last full sync: the next
    /// resync should be a full one.
    pub failed: bool,
    /// The kernel takes batch writes to the outer map (5.19+); else one
    /// write per key.
    batches: bool,
}

impl<A: Addr> MaglevTables<A> {
    pub fn open(dir: &Path, name: &str) -> Result<Self> {
        let path = super::loader::pin_path(dir, name);
        let data = MapData::from_pin(&path).with_context(|| format!("open pinned map {}", path.display()))?;
        let outer = HashOfMaps::try_from(Map::HashOfMaps(data)).with_context(|| format!("map {name}"))?;
        let raw = MapData::from_pin(&path).with_context(|| format!("open pinned map {}", path.display()))?;
        Ok(Self { outer, raw, written: BTreeMap::new(), unchecked: true, failed: false, batches: true })
    }

    /// Bring the tables of the frontends on `units` (address and port;
    /// None: all) in line with `table`. Returns how many tables were
    /// written or removed.
    pub fn sync(&mut self, maglev: &Maglev, table: &Table<A>, units: Option<&BTreeSet<(A, u16)>>) -> Result<usize> {
        let in_units = |a: &A, p: &u16| units.is_none_or(|u| u.contains(&(*a, *p)));
        if units.is_none() {
            self.failed = false;
        }
        let mut want: BTreeMap<Front<A>, Want> = BTreeMap::new();
        let fronts: Box<dyn Iterator<Item = (&SvcKey<A>, &lb_common::SvcValue)>> = match units {
            None => Box::new(table.services.iter().filter(|(k, _)| k.slot == 0 && k.scope == SCOPE_ALL)),
            Some(u) => Box::new(u.iter().flat_map(|(a, p)| {
                [lb_common::PROTO_TCP, lb_common::PROTO_UDP]
                    .into_iter()
                    .filter_map(move |proto| table.services.get_key_value(&SvcKey::new(*a, *p, proto, SCOPE_ALL, 0)))
            })),
        };
        for (k, v) in fronts {
            if v.flags & svc_flags::MAGLEV == 0 {
                continue;
            }
            for scope in [SCOPE_ALL, SCOPE_LOCAL] {
                let Some(v0) = table.services.get(&SvcKey::new(k.addr, k.port, k.proto, scope, 0)) else { continue };
                let mut backends: Vec<(SocketAddr, u32)> = (1..=v0.count)
                    .filter_map(|slot| table.services.get(&SvcKey::new(k.addr, k.port, k.proto, scope, slot)))
                    .filter_map(|s| table.backends.get(&s.backend_id).map(|b| (SocketAddr::new(b.addr.to_ip(), b.port), s.backend_id)))
                    .collect();
                backends.sort();
                backends.dedup_by_key(|b| b.0);
                if backends.is_empty() {
                    continue;
                }
                let key = MaglevKey { rev_nat_id: v.rev_nat_id, proto: k.proto, scope };
                want.insert((k.addr, k.port, k.proto, scope), Want { key, backends });
            }
        }
        let mut n = 0;
        let wanted: std::collections::HashSet<MaglevKey> = want.values().map(|w| w.key).collect();
        // Removed first: a rev-NAT id freed here may be taken by a frontend
        // written below. Every write to a map of maps waits for the
        // programs running on the old value (an RCU grace period, some
        // milliseconds): one batch waits once, where a write per key made
        // a sync of thousands of tables take minutes.
        let gone: Vec<Front<A>> =
            self.written.keys().filter(|f| in_units(&f.0, &f.1) && !want.contains_key(*f)).copied().collect();
        let mut dead: BTreeSet<MaglevKey> = BTreeSet::new();
        for f in gone {
            let w = self.written.remove(&f).expect("listed above");
            if !wanted.contains(&w.key) {
                dead.insert(w.key);
            }
            n += 1;
        }
        if units.is_none() && std::mem::take(&mut self.unchecked) {
            // An earlier agent's tables that no frontend wants any more.
            let keys: Vec<MaglevKey> = self.outer.keys().filter_map(|k| k.ok()).collect();
            let before = dead.len();
            dead.extend(keys.into_iter().filter(|k| !wanted.contains(k)));
            n += dead.len() - before;
        }
        self.remove_all(&dead.into_iter().collect::<Vec<_>>())?;
        // Frontends with the same backends (a Service port's NodePort on
        // every node address, its LoadBalancer IPs and externalIPs) share
        // one inner array: a table is never changed in place, only
        // swapped, so one can sit under several keys. `have`: a key whose
        // table holds these backends now; `made`: a table this pass built
        // or fetched (an index into `inners`, which keeps them open until
        // the batch has put them in).
        let mut have: HashMap<Vec<(SocketAddr, u32)>, MaglevKey> = self.written.values().map(|w| (w.backends.clone(), w.key)).collect();
        let mut made: HashMap<Vec<(SocketAddr, u32)>, usize> = HashMap::new();
        let mut inners: Vec<MapData> = Vec::new();
        let mut puts: Vec<(Front<A>, Want, usize)> = Vec::new();
        for (f, w) in want {
            let old = self.written.get(&f);
            if old == Some(&w) {
                continue;
            }
            if let Some(old) = old
                && have.get(&old.backends) == Some(&old.key)
            {
                // Its table is about to be swapped.
                have.remove(&old.backends);
            }
            let at = match made.get(&w.backends) {
                Some(at) => *at,
                None => {
                    let shared = have.get(&w.backends).filter(|k| **k != w.key).and_then(|k| self.outer.get(k, 0).ok());
                    match shared.map_or_else(|| build(maglev, &w).context("build its table"), Ok) {
                        Ok(inner) => {
                            inners.push(inner);
                            made.insert(w.backends.clone(), inners.len() - 1);
                            inners.len() - 1
                        }
                        Err(e) => {
                            self.not_written(&f, w.key, &e);
                            continue;
                        }
                    }
                }
            };
            puts.push((f, w, at));
            if inners.len() >= FLUSH_TABLES {
                // Put these in and let their descriptors go; tables put in
                // are shared from the outer map from here on.
                for w in self.put_all(std::mem::take(&mut puts), &inners) {
                    n += 1;
                    have.insert(w.backends, w.key);
                }
                inners.clear();
                made.clear();
            }
        }
        n += self.put_all(puts, &inners).len();
        Ok(n)
    }

    /// Put `puts` (frontend, table, index of its inner array in `inners`)
    /// in the outer map, in batches; a table that cannot be put in is said
    /// and its frontend left on the slots. Returns the tables put in.
    fn put_all(&mut self, puts: Vec<(Front<A>, Want, usize)>, inners: &[MapData]) -> Vec<Want> {
        let keys: Vec<MaglevKey> = puts.iter().map(|(_, w, _)| w.key).collect();
        let fds: Vec<u32> = puts.iter().map(|(_, _, at)| inners[*at].fd().as_fd().as_raw_fd() as u32).collect();
        let fd = self.raw.fd().as_fd().as_raw_fd();
        let failed = run_batches(keys.len(), |from| {
            if self.batches {
                let (done, r) = super::maps::batch::<MaglevKey, u32>(fd, &keys[from..], Some(&fds[from..]));
                match r {
                    Err(e) if done == 0 && e.raw_os_error() == Some(ENOTSUPP) => {
                        tracing::info!("the kernel has no batch writes for maps of maps (Linux 5.19+): Maglev tables are put in one by one");
                        self.batches = false;
                    }
                    // Refused whole (before its first entry): this one
                    // alone, so that only a table that fails itself fails.
                    Err(_) if done == 0 => {}
                    r => return (done, r),
                }
            }
            match self.outer.insert(keys[from], &inners[puts[from].2], 0) {
                Ok(()) => (1, Ok(())),
                Err(e) => (0, Err(std::io::Error::other(e))),
            }
        });
        let failed: BTreeMap<usize, std::io::Error> = failed.into_iter().collect();
        let mut out = Vec::new();
        for (i, (f, w, _)) in puts.into_iter().enumerate() {
            match failed.get(&i) {
                // One frontend's table that cannot be put in (the kernel's
                // memory) leaves that frontend alone on the slots (random);
                // every other one, and the rest of the sync, goes on.
                Some(e) => self.not_written(&f, w.key, &anyhow::anyhow!("{e}").context("swap it in")),
                None => {
                    self.written.insert(f, w.clone());
                    out.push(w);
                }
            }
        }
        out
    }

    /// A frontend's table that could not be written: said, its old table
    /// (under `key`) taken out so that its flows pick from the slots (an
    /// old table would keep a scaled Service's new pods out of them, or,
    /// under a rev-NAT id given to another frontend, send them to its
    /// backends), and tried again at the next full sync.
    fn not_written(&mut self, f: &Front<A>, key: MaglevKey, e: &anyhow::Error) {
        // (Also when the frontend is new here: its rev-NAT id may have been
        // another frontend's, freed in this sync, whose table is still in.)
        self.written.remove(f);
        if let Err(err) = self.outer.remove(&key)
            && !gone(&err)
        {
            tracing::error!(frontend = %SocketAddr::new(f.0.to_ip(), f.1), "cannot take out its old Maglev table: {err}");
        }
        tracing::error!(
            frontend = %SocketAddr::new(f.0.to_ip(), f.1),
            protocol = f.2,
            scope = f.3,
            "Maglev table not written ({e:#}): this frontend's outside flows are balanced at random until a sync writes it"
        );
        self.failed = true;
    }

    /// Remove the tables under `keys` (those already gone too), in batches.
    fn remove_all(&mut self, keys: &[MaglevKey]) -> Result<()> {
        let fd = self.raw.fd().as_fd().as_raw_fd();
        let failed = run_batches(keys.len(), |from| {
            if self.batches {
                let (done, r) = super::maps::batch::<MaglevKey, u32>(fd, &keys[from..], None);
                match r {
                    Err(e) if done == 0 && e.raw_os_error() == Some(ENOTSUPP) => {
                        tracing::info!("the kernel has no batch writes for maps of maps (Linux 5.19+): Maglev tables are removed one by one");
                        self.batches = false;
                    }
                    r => return (done, r),
                }
            }
            match self.outer.remove(&keys[from]) {
                Ok(()) => (1, Ok(())),
                Err(e) if gone(&e) => (0, Err(std::io::Error::from_raw_os_error(libc::ENOENT))),
                Err(e) => (0, Err(std::io::Error::other(e))),
            }
        });
        match failed.into_iter().find(|(_, e)| e.raw_os_error() != Some(libc::ENOENT)) {
            Some((i, e)) => Err(e).with_context(|| format!("remove the Maglev table {:?}", keys[i])),
            None => Ok(()),
        }
    }
}

/// `w`'s table, built in a new inner array.
fn build(maglev: &Maglev, w: &Want) -> Result<MapData> {
    let addrs: Vec<SocketAddr> = w.backends.iter().map(|b| b.0).collect();
    let ids: Vec<u32> = maglev.table(&addrs).into_iter().map(|i| w.backends[i as usize].1).collect();
    let def = aya_obj::Map::new_from_params(BPF_MAP_TYPE_ARRAY, 4, 4, maglev.size(), BPF_F_INNER_MAP);
    let inner = MapData::create(def, "lb_maglev", None).context("create the inner array")?;
    let idx: Vec<u32> = (0..maglev.size()).collect();
    let (done, r) = super::maps::batch::<u32, u32>(inner.fd().as_fd().as_raw_fd(), &idx, Some(&ids));
    r.context("fill the inner array")?;
    anyhow::ensure!(done == ids.len(), "filled {done} of {} entries", ids.len());
    Ok(inner)
}

/// Every table in the outer map pinned as `name` under `dir`, read back:
/// key -> the backend id of each entry (for `lb-agent list`).
pub fn read_tables(dir: &Path, name: &str) -> Result<BTreeMap<MaglevKey, Vec<u32>>> {
    let path = super::loader::pin_path(dir, name);
    let data = MapData::from_pin(&path).with_context(|| format!("open pinned map {}", path.display()))?;
    let outer: HashOfMaps<MapData, MaglevKey, MapData> = HashOfMaps::try_from(Map::HashOfMaps(data))?;
    let mut out = BTreeMap::new();
    for k in outer.keys() {
        let k = k.with_context(|| format!("read {name}"))?;
        // Swapped or removed meanwhile: skip it.
        let Ok(inner) = outer.get(&k, 0) else { continue };
        let mut entries: Vec<(u32, u32)> = super::maps::lookup_all(&inner).with_context(|| format!("read the Maglev table {k:?}"))?;
        entries.sort_unstable();
        out.insert(k, entries.into_iter().map(|(_, id)| id).collect());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::run_batches;

    fn err(code: i32) -> std::io::Error {
        std::io::Error::from_raw_os_error(code)
    }

    /// A batch that fails part-way skips the failing item and goes on;
    /// what the kernel reports done is never taken past the end.
    #[test]
    fn batches_skip_a_failing_item_and_never_run_past_the_end() {
        // All at once.
        assert!(run_batches(5, |from| (5 - from, Ok(()))).is_empty());
        // Items 2 and 4 fail: the batch stops at each and resumes after it.
        let bad = [2usize, 4];
        let mut calls = Vec::new();
        let failed = run_batches(6, |from| {
            calls.push(from);
            match bad.iter().find(|b| **b >= from) {
                Some(b) => (b - from, Err(err(libc::ENOMEM))),
                None => (6 - from, Ok(())),
            }
        });
        assert_eq!(failed.iter().map(|f| f.0).collect::<Vec<_>>(), [2, 4]);
        assert_eq!(calls, [0, 3, 5]);
        // A kernel that refused the call before writing its count (it still
        // says all of them): a count past the end is clamped, no panic, and
        // nothing is reported failed past the end.
        let failed = run_batches(3, |from| (3 - from, Err(err(524))));
        assert!(failed.is_empty());
        // One item at a time (no batch operations): each failing one is named.
        let failed = run_batches(4, |from| if from % 2 == 0 { (1, Ok(())) } else { (0, Err(err(libc::E2BIG))) });
        assert_eq!(failed.iter().map(|f| f.0).collect::<Vec<_>>(), [1, 3]);
    }
}
