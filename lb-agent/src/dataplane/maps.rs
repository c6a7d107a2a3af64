//! Typed access to the pinned maps: read them into tables, apply ops.
use std::path::Path;

use anyhow::{Context as _, Result};
use aya::Pod;
use aya::maps::{HashMap, Map, MapData, PerCpuArray};
use lb_common::{AffinityKey, AffinityMatchKey, AffinityValue, Backend, RevNat, SvcKey, SvcValue, maps, stats};

use super::writer::{Addr, Op, Table};

/// The maps of one address family.
pub struct FamilyMaps<A: Addr>
where
    SvcKey<A>: Pod,
    Backend<A>: Pod,
    RevNat<A>: Pod,
{
    names: [&'static str; 3],
    pub services: HashMap<MapData, SvcKey<A>, SvcValue>,
    pub backends: HashMap<MapData, u32, Backend<A>>,
    pub revnat: HashMap<MapData, u16, RevNat<A>>,
}

/// Every map the agent reads or writes.
pub struct Maps {
    pub v4: FamilyMaps<[u8; 4]>,
    pub v6: FamilyMaps<[u8; 16]>,
    pub affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    pub affinity_match: HashMap<MapData, AffinityMatchKey, u8>,
    pub stats: PerCpuArray<MapData, u64>,
}

fn open_pinned(dir: &Path, name: &str) -> Result<MapData> {
    let path = dir.join(name);
    MapData::from_pin(&path).with_context(|| format!("open pinned map {}", path.display()))
}

fn hash<K: Pod, V: Pod>(dir: &Path, name: &str) -> Result<HashMap<MapData, K, V>> {
    HashMap::try_from(Map::HashMap(open_pinned(dir, name)?)).with_context(|| format!("map {name}"))
}

fn ignore_missing(r: Result<(), aya::maps::MapError>) -> Result<(), aya::maps::MapError> {
    match r {
        Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

impl<A: Addr> FamilyMaps<A>
where
    SvcKey<A>: Pod,
    Backend<A>: Pod,
    RevNat<A>: Pod,
{
    fn open(dir: &Path, names: [&'static str; 3]) -> Result<Self> {
        Ok(Self { names, services: hash(dir, names[0])?, backends: hash(dir, names[1])?, revnat: hash(dir, names[2])? })
    }

    /// Read the full contents (the affinity-match entries of this family too).
    pub fn read_table(&self, matches: &HashMap<MapData, AffinityMatchKey, u8>) -> Result<Table<A>> {
        let mut t = Table::default();
        for kv in self.services.iter() {
            let (k, v) = kv.with_context(|| format!("read {}", self.names[0]))?;
            t.services.insert(k, v);
        }
        for kv in self.backends.iter() {
            let (k, v) = kv.with_context(|| format!("read {}", self.names[1]))?;
            t.backends.insert(k, v);
        }
        for kv in self.revnat.iter() {
            let (k, v) = kv.with_context(|| format!("read {}", self.names[2]))?;
            t.revnat.insert(k, v);
        }
        for k in matches.keys() {
            let k = k.context("read LB_AFFINITY_MATCH")?;
            if k.family == A::FAMILY {
                t.affinity_match.insert(k);
            }
        }
        Ok(t)
    }

    /// Apply one op to the kernel maps.
    pub fn apply(&mut self, op: &Op<A>, matches: &mut HashMap<MapData, AffinityMatchKey, u8>) -> Result<()> {
        let [svc, be, rn] = self.names;
        match op {
            Op::PutBackend(id, b) => self.backends.insert(id, b, 0).with_context(|| format!("{be}: insert backend {id}")),
            Op::PutRevNat(id, r) => self.revnat.insert(id, r, 0).with_context(|| format!("{rn}: insert rev_nat {id}")),
            Op::PutSvc(k, v) => self
                .services
                .insert(k, v, 0)
                .with_context(|| format!("{svc}: insert slot {} of {}:{}", k.slot, k.addr.to_ip(), k.port)),
            Op::DelSvc(k) => ignore_missing(self.services.remove(k))
                .with_context(|| format!("{svc}: delete slot {} of {}:{}", k.slot, k.addr.to_ip(), k.port)),
            Op::DelRevNat(id) => ignore_missing(self.revnat.remove(id)).with_context(|| format!("{rn}: delete rev_nat {id}")),
            Op::DelBackend(id) => ignore_missing(self.backends.remove(id)).with_context(|| format!("{be}: delete backend {id}")),
            Op::PutMatch(m) => matches.insert(m, 0, 0).context("LB_AFFINITY_MATCH: insert"),
            Op::DelMatch(m) => ignore_missing(matches.remove(m)).context("LB_AFFINITY_MATCH: delete"),
        }
    }
}

impl Maps {
    /// Open the maps pinned under `dir` (for `list`, or an agent adopting them).
    pub fn open_pinned(dir: &Path) -> Result<Self> {
        Ok(Self {
            v4: FamilyMaps::open(dir, [maps::SERVICES4, maps::BACKENDS4, maps::REVNAT4])?,
            v6: FamilyMaps::open(dir, [maps::SERVICES6, maps::BACKENDS6, maps::REVNAT6])?,
            affinity: HashMap::try_from(Map::LruHashMap(open_pinned(dir, maps::AFFINITY)?))?,
            affinity_match: hash(dir, maps::AFFINITY_MATCH)?,
            stats: PerCpuArray::try_from(Map::PerCpuArray(open_pinned(dir, maps::STATS)?))?,
        })
    }

    /// Forget the sessionAffinity state of these frontends (affinity turned
    /// off, or the frontend removed), so that it cannot come back stale.
    pub fn purge_affinity(&mut self, family: u8, rev_nat_ids: &std::collections::BTreeSet<u16>) -> Result<usize> {
        if rev_nat_ids.is_empty() {
            return Ok(0);
        }
        let stale: Vec<AffinityKey> = self
            .affinity
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| k.family == family && rev_nat_ids.contains(&k.rev_nat_id))
            .collect();
        for k in &stale {
            ignore_missing(self.affinity.remove(k)).context("LB_AFFINITY: delete")?;
        }
        Ok(stale.len())
    }

    /// The stats counters, summed over CPUs, by name.
    pub fn read_stats(&self) -> Result<Vec<(&'static str, u64)>> {
        let mut out = Vec::new();
        for (i, name) in stats::NAMES.iter().enumerate() {
            let per_cpu = self.stats.get(&(i as u32), 0).with_context(|| format!("read {}", maps::STATS))?;
            out.push((*name, per_cpu.iter().sum()));
        }
        Ok(out)
    }
}
