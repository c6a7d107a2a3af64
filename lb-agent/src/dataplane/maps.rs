//! Typed access to the pinned maps: read them into a `Table`, apply ops.
use std::path::Path;

use anyhow::{Context as _, Result};
use aya::maps::{HashMap, Map, MapData, PerCpuArray};
use lb_common::{Backend4, RevNat4, Svc4Key, SvcValue, maps, stats};

use super::writer::{Op, Table};

/// The maps the agent writes, plus the stats it reads.
pub struct Maps {
    pub services: HashMap<MapData, Svc4Key, SvcValue>,
    pub backends: HashMap<MapData, u32, Backend4>,
    pub revnat: HashMap<MapData, u16, RevNat4>,
    pub stats: PerCpuArray<MapData, u64>,
}

fn open_pinned(dir: &Path, name: &str) -> Result<MapData> {
    let path = dir.join(name);
    MapData::from_pin(&path).with_context(|| format!("open pinned map {}", path.display()))
}

impl Maps {
    /// Open the maps pinned under `dir` (for `list`, or an agent adopting them).
    pub fn open_pinned(dir: &Path) -> Result<Self> {
        Ok(Self {
            services: HashMap::try_from(Map::HashMap(open_pinned(dir, maps::SERVICES4)?))?,
            backends: HashMap::try_from(Map::HashMap(open_pinned(dir, maps::BACKENDS4)?))?,
            revnat: HashMap::try_from(Map::HashMap(open_pinned(dir, maps::REVNAT4)?))?,
            stats: PerCpuArray::try_from(Map::PerCpuArray(open_pinned(dir, maps::STATS)?))?,
        })
    }

    /// Read the full contents of the maps we own.
    pub fn read_table(&self) -> Result<Table> {
        let mut t = Table::default();
        for kv in self.services.iter() {
            let (k, v) = kv.context("read LB4_SERVICES")?;
            t.services.insert(k, v);
        }
        for kv in self.backends.iter() {
            let (k, v) = kv.context("read LB4_BACKENDS")?;
            t.backends.insert(k, v);
        }
        for kv in self.revnat.iter() {
            let (k, v) = kv.context("read LB4_REVNAT")?;
            t.revnat.insert(k, v);
        }
        Ok(t)
    }

    /// Apply one op to the kernel maps.
    pub fn apply(&mut self, op: &Op) -> Result<()> {
        match op {
            Op::PutBackend(id, b) => self.backends.insert(id, b, 0).with_context(|| format!("{}: insert backend {id}", maps::BACKENDS4)),
            Op::PutRevNat(id, r) => self.revnat.insert(id, r, 0).with_context(|| format!("{}: insert rev_nat {id}", maps::REVNAT4)),
            Op::PutSvc(k, v) => self.services.insert(k, v, 0).with_context(|| format!("{}: insert slot {} of {:?}:{}", maps::SERVICES4, k.slot, k.addr, k.port)),
            Op::DelSvc(k) => ignore_missing(self.services.remove(k)).with_context(|| format!("{}: delete slot {} of {:?}:{}", maps::SERVICES4, k.slot, k.addr, k.port)),
            Op::DelRevNat(id) => ignore_missing(self.revnat.remove(id)).with_context(|| format!("{}: delete rev_nat {id}", maps::REVNAT4)),
            Op::DelBackend(id) => ignore_missing(self.backends.remove(id)).with_context(|| format!("{}: delete backend {id}", maps::BACKENDS4)),
        }
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

fn ignore_missing(r: Result<(), aya::maps::MapError>) -> Result<(), aya::maps::MapError> {
    match r {
        Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}
