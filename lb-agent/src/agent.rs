//! `lb-agent run`: watch a source, compute the model, program the maps.
use std::collections::{BTreeSet, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio::signal::unix::{SignalKind, signal};

use crate::dataplane::loader::{self, Capacity};
use crate::dataplane::maps::Maps;
use crate::dataplane::writer::{self, Op, Table};
use crate::model::{self, NodeInfo};
use crate::source::dir::{self, DirState};
use crate::source::{Snapshot, SourceSpec};

pub struct RunConfig {
    pub source: SourceSpec,
    pub node: NodeInfo,
    pub cgroup: PathBuf,
    pub bpffs: PathBuf,
    pub capacity: Capacity,
}

/// Reconciles a snapshot into the maps, remembering what it programmed.
struct Reconciler {
    maps: Maps,
    mirror: Table,
    cursors: writer::Cursors,
    node: NodeInfo,
    logged: HashSet<String>,
}

impl Reconciler {
    /// Bring the maps to the state `snap` asks for. On a write error the
    /// maps stay consistent (every prefix of a plan is) and the error names
    /// the Service; the next call retries.
    fn sync(&mut self, snap: &Snapshot) -> Result<()> {
        let started = Instant::now();
        let desired = model::compute(&snap.services, &snap.slices, &self.node);
        let target = writer::build(&desired, &self.mirror, &mut self.cursors);
        let mut now_logged = HashSet::new();
        for w in desired.warnings.iter().chain(target.skipped.iter()) {
            if !self.logged.contains(w) {
                tracing::warn!("{w}");
            }
            now_logged.insert(w.clone());
        }
        self.logged = now_logged;

        let ops = writer::plan(&self.mirror, &target.table);
        let n = ops.len();
        for op in &ops {
            if let Err(e) = self.maps.apply(op) {
                let who = owner_of(op, &target).unwrap_or_else(|| "a removed service".into());
                anyhow::bail!("programming {who} failed: {e:#}");
            }
            self.mirror.apply(op);
        }
        if n > 0 {
            tracing::info!(
                ops = n,
                frontends = self.mirror.frontend_count(),
                backends = self.mirror.backends.len(),
                elapsed_us = started.elapsed().as_micros() as u64,
                "maps programmed"
            );
        }
        Ok(())
    }
}

/// The Service an op belongs to, for error messages.
fn owner_of(op: &Op, target: &writer::Target) -> Option<String> {
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
    Some(format!("Service {svc} ({}:{}/{})", std::net::Ipv4Addr::from(key.0), key.1, key.2))
}

pub async fn run(cfg: RunConfig) -> Result<()> {
    let SourceSpec::Dir(dir) = &cfg.source;
    // Check the source before touching the kernel.
    let mut state = DirState::new(dir)?;
    let dp = loader::load(&cfg.bpffs, &cfg.cgroup, cfg.capacity)?;
    let mirror = dp.maps.read_table()?;
    if dp.adopted {
        tracing::info!(
            frontends = mirror.frontend_count(),
            backends = mirror.backends.len(),
            "adopted pinned state; programs replaced without a gap"
        );
    }
    tracing::info!(
        cgroup = %cfg.cgroup.display(),
        bpffs = %cfg.bpffs.display(),
        node = %cfg.node.name,
        "programs attached"
    );
    let mut rec = Reconciler { maps: dp.maps, mirror, cursors: Default::default(), node: cfg.node.clone(), logged: HashSet::new() };

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
    tracing::info!(frontends = rec.mirror.frontend_count(), "initial sync complete");

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
