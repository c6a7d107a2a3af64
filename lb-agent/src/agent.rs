//! `lb-agent run`: watch a source, compute the model, program the maps.
use std::collections::{BTreeSet, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio::signal::unix::{SignalKind, signal};

use crate::dataplane::loader::{self, Capacity};
use crate::dataplane::maps::Maps;
use crate::dataplane::maps::FamilyMaps;
use crate::dataplane::writer::{self, Addr, Cursors, Op, Table};
use crate::model;
use crate::source::dir::{self, DirState};
use crate::source::{Snapshot, SourceSpec};

pub struct RunConfig {
    pub source: SourceSpec,
    pub node_name: String,
    /// `--zone`: overrides the Node object's zone label.
    pub zone: Option<String>,
    pub cgroup: PathBuf,
    pub bpffs: PathBuf,
    pub capacity: Capacity,
}

/// What one family's maps hold, as the agent last programmed them.
struct Mirror<A> {
    table: Table<A>,
    cursors: Cursors,
}

/// Reconciles a snapshot into the maps, remembering what it programmed.
struct Reconciler {
    maps: Maps,
    v4: Mirror<[u8; 4]>,
    v6: Mirror<[u8; 16]>,
    node_name: String,
    zone: Option<String>,
    logged: HashSet<String>,
}

/// Plan and apply one family. Stops at the first failed write; every
/// prefix of a plan is consistent, so the maps stay usable.
fn sync_family<A: Addr>(
    desired: &model::Desired,
    mirror: &mut Mirror<A>,
    fm: &mut FamilyMaps<A>,
    matches: &mut aya::maps::HashMap<aya::maps::MapData, lb_common::AffinityMatchKey, u8>,
    warnings: &mut Vec<String>,
) -> Result<(usize, BTreeSet<u16>)>
where
    lb_common::SvcKey<A>: aya::Pod,
    lb_common::Backend<A>: aya::Pod,
    lb_common::RevNat<A>: aya::Pod,
{
    let target = writer::build(desired, &mirror.table, &mut mirror.cursors);
    warnings.extend(target.skipped.iter().cloned());
    let ops = writer::plan(&mirror.table, &target.table);
    // Frontends whose affinity state must go: affinity switched off, or gone.
    let had_affinity = |t: &Table<A>| -> BTreeSet<u16> {
        t.services
            .iter()
            .filter(|(k, v)| k.slot == 0 && v.flags & lb_common::svc_flags::AFFINITY != 0)
            .map(|(_, v)| v.rev_nat_id)
            .collect()
    };
    let stale: BTreeSet<u16> =
        had_affinity(&mirror.table).difference(&had_affinity(&target.table)).copied().collect();
    for op in &ops {
        if let Err(e) = fm.apply(op, matches) {
            let who = owner_of(op, &target).unwrap_or_else(|| "a removed service".into());
            anyhow::bail!("programming {who} failed: {e:#}");
        }
        mirror.table.apply(op);
    }
    Ok((ops.len(), stale))
}

impl Reconciler {
    /// Bring the maps to the state `snap` asks for. On a write error the
    /// maps stay consistent and the error names the Service; the next call
    /// retries.
    fn sync(&mut self, snap: &Snapshot) -> Result<()> {
        let started = Instant::now();
        let node = model::node_info(&self.node_name, self.zone.as_deref(), &snap.nodes);
        let desired = model::compute(&snap.services, &snap.slices, &node);
        let mut warnings = desired.warnings.clone();
        let r4 = sync_family(&desired, &mut self.v4, &mut self.maps.v4, &mut self.maps.affinity_match, &mut warnings);
        let r6 = sync_family(&desired, &mut self.v6, &mut self.maps.v6, &mut self.maps.affinity_match, &mut warnings);
        let mut now_logged = HashSet::new();
        for w in warnings {
            if !self.logged.contains(&w) {
                tracing::warn!("{w}");
            }
            now_logged.insert(w);
        }
        self.logged = now_logged;
        let (n4, stale4) = r4?;
        let (n6, stale6) = r6?;
        self.maps.purge_affinity(lb_common::FAMILY_V4, &stale4)?;
        self.maps.purge_affinity(lb_common::FAMILY_V6, &stale6)?;
        if n4 + n6 > 0 {
            tracing::info!(
                ops = n4 + n6,
                frontends = self.v4.table.frontend_count() + self.v6.table.frontend_count(),
                backends = self.v4.table.backends.len() + self.v6.table.backends.len(),
                zone = node.zone.as_deref().unwrap_or(""),
                elapsed_us = started.elapsed().as_micros() as u64,
                "maps programmed"
            );
        }
        Ok(())
    }

    fn frontends(&self) -> usize {
        self.v4.table.frontend_count() + self.v6.table.frontend_count()
    }
}

/// The Service an op belongs to, for error messages.
fn owner_of<A: Addr>(op: &Op<A>, target: &writer::Target<A>) -> Option<String> {
    let key = match op {
        Op::PutSvc(k, _) | Op::DelSvc(k) => Some((k.addr, k.port, k.proto)),
        Op::PutBackend(id, _) => target
            .table
            .services
            .iter()
            .find(|(k, v)| k.slot != 0 && v.backend_id == *id)
            .map(|(k, _)| (k.addr, k.port, k.proto)),
        Op::PutRevNat(_, r) => target.owners.keys().find(|(a, p, _)| *a == r.addr && *p == r.port).copied(),
        _ => None,
    }?;
    let svc = target.owners.get(&key)?;
    Some(format!("Service {svc} ({}:{}/{})", key.0.to_ip(), key.1, key.2))
}

pub async fn run(cfg: RunConfig) -> Result<()> {
    let SourceSpec::Dir(dir) = &cfg.source;
    // Check the source before touching the kernel.
    let mut state = DirState::new(dir)?;
    let dp = loader::load(&cfg.bpffs, &cfg.cgroup, cfg.capacity)?;
    let v4 = Mirror { table: dp.maps.v4.read_table(&dp.maps.affinity_match)?, cursors: Cursors::default() };
    let v6 = Mirror { table: dp.maps.v6.read_table(&dp.maps.affinity_match)?, cursors: Cursors::default() };
    if dp.adopted {
        tracing::info!(
            frontends = v4.table.frontend_count() + v6.table.frontend_count(),
            backends = v4.table.backends.len() + v6.table.backends.len(),
            "adopted pinned state; programs replaced without a gap"
        );
    }
    tracing::info!(
        cgroup = %cfg.cgroup.display(),
        bpffs = %cfg.bpffs.display(),
        node = %cfg.node_name,
        "programs attached"
    );
    let mut rec = Reconciler { maps: dp.maps, v4, v6, node_name: cfg.node_name, zone: cfg.zone, logged: HashSet::new() };

    let (_watcher, mut events) = dir::watch(state.dir())?;
    state.rescan(&BTreeSet::new())?;
    // The first full sync: this also removes what disappeared while no agent ran.
    let mut dirty = match rec.sync(&state.snapshot()) {
        Ok(()) => false,
        Err(e) => {
            tracing::error!("{e:#}");
            true
        }
    };
    tracing::info!(frontends = rec.frontends(), "initial sync complete");

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    // A rescan (stat only) also runs on a timer, in case a watch event is lost.
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        let mut touched = BTreeSet::new();
        tokio::select! {
            Some(paths) = events.recv() => {
                touched.extend(paths);
                // Coalesce a burst of events (an editor's write + rename).
                tokio::time::sleep(Duration::from_millis(20)).await;
                while let Ok(p) = events.try_recv() {
                    touched.extend(p);
                }
            }
            _ = tick.tick() => {}
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
        let changed = match state.rescan(&touched) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!("{e:#}");
                continue;
            }
        };
        if changed || dirty {
            dirty = match rec.sync(&state.snapshot()) {
                Ok(()) => false,
                Err(e) => {
                    tracing::error!("{e:#}");
                    true
                }
            };
        }
    }
    tracing::info!("exiting; programs stay attached and maps stay pinned");
    Ok(())
}
