//! The reconciler: a snapshot in, the model's desired state out, the
//! difference written to the maps in a safe order (and the agent's mirror
//! of them kept in step); Services that do not fit are left out whole.
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Instant;

use anyhow::{Context as _, Result};

use crate::dataplane::loader::Capacity;
use crate::dataplane::maps::{FamilyMaps, Maps};
use crate::dataplane::writer::{self, Addr, Cursors, Op, Table};
use crate::health::Metrics;
use crate::model;
use crate::source::Snapshot;

/// What one family's maps hold, as the agent last programmed them.
pub(super) struct Mirror<A: Addr> {
    pub(super) table: Table<A>,
    pub(super) index: writer::Index<A>,
    pub(super) cursors: Cursors,
}

impl<A: Addr> Mirror<A> {
    pub(super) fn new(table: Table<A>) -> Self {
        Self { index: writer::Index::of(&table), table, cursors: Cursors::default() }
    }

    /// The maps hold `table` now (a built one: its nodes are full).
    fn replace(&mut self, table: Table<A>) {
        self.table = table;
        self.index = writer::Index::of(&self.table);
    }

    /// Follow a write that reached the map.
    fn apply(&mut self, op: &Op<A>) {
        self.index.apply(&self.table, op);
        self.table.apply(op);
    }
}

/// Hand memory freed by a full sync (its temporary tables, a source's
/// parse buffers) back to the system, so that the resident size is what
/// the agent keeps, not what it once needed.
fn release_free_memory() {
    // SAFETY: malloc_trim and mallinfo2 only walk glibc's own lists.
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::malloc_trim(0);
        let m = libc::mallinfo2();
        tracing::debug!(in_use = m.uordblks, mmapped = m.hblkhd, free = m.fordblks, arena = m.arena, "heap after a full sync");
    }
}

/// Frontends whose affinity state must go: affinity switched off, the
/// frontend gone, or a traffic policy turned Local (a client's affine
/// backend may be on another node, where kube-proxy's Local chain, which
/// holds only local endpoints, checks only their `recent` lists).
fn affinity_gone<A: Addr>(before: &Table<A>, after: &Table<A>) -> BTreeSet<u16> {
    use lb_common::svc_flags::{AFFINITY, EXT_LOCAL, LOCAL_ONLY};
    // Each frontend with affinity, and its Local policies (its TCP and
    // UDP frontends share the id).
    let had = |t: &Table<A>| -> std::collections::BTreeMap<u16, u16> {
        let mut m = std::collections::BTreeMap::new();
        for (_, v) in t.services.iter().filter(|(k, v)| k.slot == 0 && v.flags & AFFINITY != 0) {
            *m.entry(v.rev_nat_id).or_insert(0) |= v.flags & (LOCAL_ONLY | EXT_LOCAL);
        }
        m
    };
    let now = had(after);
    had(before).into_iter().filter(|(id, local)| now.get(id).is_none_or(|l| l & !local != 0)).map(|(id, _)| id).collect()
}

/// Write `ops` to the kernel maps in order, stopping at the first failed
/// write: how many were written, and the failure.
fn write_ops<A: Addr>(ops: &[Op<A>], fm: &mut FamilyMaps<A>, shared: &mut crate::dataplane::maps::Shared<'_>) -> (usize, Option<anyhow::Error>)
where
    lb_common::SvcKey<A>: aya::Pod,
    lb_common::Backend<A>: aya::Pod,
    lb_common::RevNat<A>: aya::Pod,
{
    let mut i = 0;
    while i < ops.len() {
        // Runs of one kind of write go in one system call each.
        let run = FamilyMaps::<A>::batchable(&ops[i..]);
        let mut single = 1;
        if run > 1 {
            let done = fm.apply_batch(&ops[i..i + run]);
            i += done;
            if done == run {
                continue;
            }
            // The rest of the run one by one: the failing write is named.
            single = run - done;
        }
        for _ in 0..single {
            if let Err(e) = fm.apply(&ops[i], shared) {
                return (i, Some(e));
            }
            i += 1;
        }
    }
    (i, None)
}

/// The error for a failed write of `op`, naming its Service.
fn write_failed<A: Addr>(op: &Op<A>, target: &writer::Target<A>, e: anyhow::Error) -> WriteFailed {
    let owner = owner_of(op, target);
    let who = owner.as_ref().map_or_else(|| "a removed service".to_string(), |(s, f)| format!("Service {s} ({f})"));
    WriteFailed { service: owner.map(|(s, _)| s), error: e.context(format!("programming {who} failed")), too_many: Vec::new() }
}

/// `write_ops`, with the counters of the ids it frees or hands out anew
/// forgotten (`table`: what the maps held before), so that a later owner
/// of an id starts from zero. An id handed out anew is forgotten before
/// anything can count on it: counts that reached a freed id after its
/// deletion (a NAT flow's last packets, a connection counted once its
/// first packet passed the source ranges) or that an earlier agent left
/// are not its new owner's.
fn write_counted<A: Addr>(
    ops: &[Op<A>],
    table: &Table<A>,
    fm: &mut FamilyMaps<A>,
    shared: &mut crate::dataplane::maps::Shared<'_>,
) -> (usize, Option<anyhow::Error>)
where
    lb_common::SvcKey<A>: aya::Pod,
    lb_common::Backend<A>: aya::Pod,
    lb_common::RevNat<A>: aya::Pod,
{
    for op in ops {
        let new = match op {
            Op::PutRevNat(id, _) => !table.revnat.contains_key(id),
            Op::PutBackend(id, _) => !table.backends.contains_key(id),
            _ => false,
        };
        if new {
            shared.forget_stats(op);
        }
    }
    let (done, err) = write_ops(ops, fm, shared);
    for op in ops[..done].iter().filter(|op| matches!(op, Op::DelRevNat(_) | Op::DelBackend(_))) {
        shared.forget_stats(op);
    }
    (done, err)
}

/// Apply `ops` in order, stopping at the first failed write; the mirror
/// follows every write that reached the maps.
fn apply_ops<A: Addr>(
    ops: &[Op<A>],
    target: &writer::Target<A>,
    mirror: &mut Mirror<A>,
    fm: &mut FamilyMaps<A>,
    shared: &mut crate::dataplane::maps::Shared<'_>,
) -> Result<(), WriteFailed>
where
    lb_common::SvcKey<A>: aya::Pod,
    lb_common::Backend<A>: aya::Pod,
    lb_common::RevNat<A>: aya::Pod,
{
    let (done, err) = write_counted(ops, &mirror.table, fm, shared);
    for op in &ops[..done] {
        mirror.apply(op);
    }
    match err {
        Some(e) => Err(write_failed(&ops[done], target, e)),
        None => Ok(()),
    }
}

/// The (address, port) units of family `A` whose frontends `ch` names.
fn units<A: Addr>(ch: &model::Changes) -> BTreeSet<(A, u16)> {
    ch.frontends.iter().filter_map(|k| A::from_ip(k.addr).map(|a| (a, k.port))).collect()
}

/// Program only what `ch` names: the frontends that changed (with the
/// other protocol on the same address and port, which shares their
/// rev-NAT entry) and the ClusterIPs that came or went. None: it does not
/// fit the maps; a full sync decides what is left out.
fn sync_changes<A: Addr>(
    desired: &model::Desired,
    ch: &model::Changes,
    mirror: &mut Mirror<A>,
    fm: &mut FamilyMaps<A>,
    shared: &mut crate::dataplane::maps::Shared<'_>,
    warnings: &mut Vec<String>,
    cap: &Capacity,
) -> Result<Option<(usize, BTreeSet<u16>)>, WriteFailed>
where
    lb_common::SvcKey<A>: aya::Pod,
    lb_common::Backend<A>: aya::Pod,
    lb_common::RevNat<A>: aya::Pod,
{
    let units = units::<A>(ch);
    let vips: BTreeSet<A> = ch.vips.iter().filter_map(|v| A::from_ip(*v)).collect();
    if units.is_empty() && vips.is_empty() {
        return Ok(Some((0, BTreeSet::new())));
    }
    let current = writer::extract(&mirror.table, &mirror.index, &units, &vips);
    let target = writer::build_part(desired, &units, &vips, &mirror.table, &mirror.index, &mut mirror.cursors);
    let ops = writer::plan_part(&mirror.table, &mirror.index, &current, &target.table);
    let services = mirror.table.services.len() + target.table.services.len() - current.services.len();
    let new_backends = ops.iter().filter(|o| matches!(o, Op::PutBackend(id, _) if !mirror.table.backends.contains_key(id))).count();
    if services > cap.services as usize || mirror.table.backends.len() + new_backends > cap.backends as usize {
        return Ok(None);
    }
    warnings.extend(target.left_out.iter().cloned());
    let stale = affinity_gone(&current, &target.table);
    apply_ops(&ops, &target, mirror, fm, shared)?;
    Ok(Some((ops.len(), stale)))
}

/// Reconciles a snapshot into the maps, remembering what it programmed.
pub(super) struct Reconciler {
    pub(super) maps: Maps,
    /// The trigger times of EndpointSlice changes not programmed yet
    /// (kube-proxy's network programming latency).
    pub(super) triggers: Vec<(std::time::SystemTime, &'static str)>,
    /// kube-proxy's `ip_family` labels this node reports under: the
    /// families of its primary addresses (a dual-stack kube-proxy runs a
    /// proxier for each), IPv4 where it has none.
    pub(super) ip_families: Vec<&'static str>,
    /// The last sync recomputed and wrote everything (kube-proxy's full
    /// sync), not only what changed (its partial sync).
    pub(super) last_full: bool,
    /// Service ports with a Local policy and no endpoint here, kept with
    /// the model's state.
    pub(super) no_local: model::NoLocalEndpoints,
    pub(super) v4: Mirror<[u8; 4]>,
    pub(super) v6: Mirror<[u8; 16]>,
    pub(super) node_name: String,
    pub(super) zone: Option<String>,
    pub(super) node_ips: Vec<std::net::IpAddr>,
    pub(super) nodeport_addresses: model::NodePortAddresses,
    pub(super) localhost_nodeports: bool,
    pub(super) opts: model::Options,
    pub(super) capacity: Capacity,
    pub(super) nodeports: BTreeSet<lb_common::NodePortKey>,
    /// The routes that set an MTU, as LB_ROUTE_MTU holds them.
    pub(super) route_mtus: crate::dataplane::maps::RouteMtus,
    /// The last error writing them, logged once.
    pub(super) route_mtu_error: Option<String>,
    /// The node's IPv4 addresses, as LB_LOCAL4 holds them.
    pub(super) local4: BTreeSet<[u8; 4]>,
    /// The last error writing them, logged once.
    pub(super) local4_error: Option<String>,
    pub(super) snat_ports: (u16, u16),
    pub(super) node_flags: u32,
    /// `lb_sock_egress` is attached: `node_flags::SOCK_EGRESS` goes into
    /// the node config with `node_flags`.
    pub(super) sock_egress: bool,
    /// The node config holds this agent's flags (its first full sync wrote
    /// it).
    pub(super) config_written: bool,
    /// A sweep judged TCP connections (the first full sync's): later
    /// ones judge UDP only (`sweep`).
    pub(super) swept_tcp: bool,
    /// The TCP pairs kept when their ready endpoints left, recorded for the
    /// next agent (`stale::kept`).
    pub(super) kept: std::sync::Arc<crate::stale::kept::Kept>,
    /// An upgrade waits for the first full sync: the programs still use the
    /// old maps, and a sweep sees the staged ones (its census prunes
    /// nothing: the sweep after the programs moved does).
    pub(super) upgrading: bool,
    /// The interface addresses, from rtnetlink events.
    pub(super) addresses: crate::nodeport::Addresses,
    /// Maglev table size and seed, and the tables written per family.
    pub(super) maglev: crate::model::maglev::Maglev,
    pub(super) maglev4: crate::dataplane::maglev::MaglevTables<[u8; 4]>,
    pub(super) maglev6: crate::dataplane::maglev::MaglevTables<[u8; 16]>,
    pub(super) netns_cookie: u64,
    pub(super) logged: HashSet<String>,
    /// What the last sync decided besides the maps.
    pub(super) health_checks: std::collections::BTreeMap<u16, model::HealthCheck>,
    /// Where the health check servers listen: None (every address) unless
    /// `--nodeport-addresses` says where the NodePorts are, as kube-proxy's.
    pub(super) health_check_on: Option<Vec<std::net::IpAddr>>,
    pub(super) node_addresses: Vec<std::net::IpAddr>,
    /// Some frontend takes traffic from outside (NodePort, LB IP,
    /// externalIP; any, with `--external-cluster-ip`).
    pub(super) has_external: bool,
    /// Some frontend sends its outside flows by DSR: the replies of this
    /// node's backends to a client on this node (a pod on another node's
    /// NodePort, not masqueraded) are translated on the pod devices.
    pub(super) has_dsr: bool,
    /// Services left out of the last sync because they could not be written.
    pub(super) not_programmed: usize,
    /// The model, updated one Service at a time.
    pub(super) model: model::Incremental,
    /// The next sync must program everything (the first, or one after a
    /// failure or with Services left out).
    pub(super) full_needed: bool,
    /// Pairs that stopped serving, for the destroyer once the maps hold it.
    pub(super) pending_left: BTreeSet<model::Pair>,
    /// Pairs that started serving since, for the destroyer with them.
    pub(super) pending_joined: BTreeSet<model::Pair>,
    /// UDP frontends that got backends (`Changes::udp_served`), for the
    /// destroyer once programmed.
    pub(super) pending_udp_served: BTreeSet<(std::net::IpAddr, u16)>,
    /// The NAT thread, told of pairs that left so it ends their flows.
    pub(super) nat_left: std::sync::mpsc::Sender<crate::nodeport::Ending>,
    /// Connections to endpoints that stopped serving are destroyed by it,
    /// off the programming path.
    pub(super) destroyer: Option<crate::stale::Destroyer>,
    /// Frontends whose Service name `lb-agent monitor` must learn anew
    /// (None: all of them).
    pub(super) names_changed: Option<BTreeSet<model::FrontendKey>>,
}

impl Reconciler {
    /// Make LB_LOCAL4 hold the node's IPv4 addresses, which the TC
    /// programs refuse as sources from outside. Called at start and at
    /// every address change, without waiting for a Kubernetes snapshot:
    /// an address that left (a VIP keepalived moved to another node) must
    /// not be refused while no sync runs, nor keep the agent from its API
    /// server behind that VIP. Empty where `accept_local` is set for all
    /// devices (by the node's admin): the stack takes such packets then,
    /// and so does lb (but for 127/8 and its SNAT addresses).
    pub(super) fn sync_local4(&mut self) {
        let all_accept = std::fs::read_to_string("/proc/sys/net/ipv4/conf/all/accept_local").is_ok_and(|v| v.trim() == "1");
        let local4: BTreeSet<[u8; 4]> = if all_accept {
            BTreeSet::new()
        } else {
            self.addresses
                .get()
                .into_iter()
                .filter_map(|(_, a)| match a {
                    std::net::IpAddr::V4(v4) => Some(v4.octets()),
                    _ => None,
                })
                .collect()
        };
        if local4 != self.local4 {
            // Not a failed sync: an address left out is not refused (the
            // SNAT address still is, by the node config).
            let r = self.maps.set_local4(&mut self.local4, &local4);
            warn_once(&mut self.local4_error, r, "the node's addresses not all given to the TC programs", "; packets from outside claiming those left out are not dropped");
        }
    }
}

/// Log a failed write that does not fail the sync once per error
/// (`last` holds the last one; a success clears it).
fn warn_once(last: &mut Option<String>, r: anyhow::Result<()>, what: &str, then: &str) {
    match r {
        Ok(()) => *last = None,
        Err(e) => {
            let e = format!("{e:#}");
            if last.as_ref() != Some(&e) {
                tracing::warn!("{what}: {e}{then}");
                *last = Some(e);
            }
        }
    }
}

/// A write that failed, and the Service it was for (None: a deletion).
struct WriteFailed {
    service: Option<model::ServiceRef>,
    error: anyhow::Error,
    /// The map would be over capacity: these Services (not programmed yet)
    /// are left out, all at once.
    too_many: Vec<model::ServiceRef>,
}

/// Services not programmed yet to leave out so that `target` fits the
/// capacities, newest (by name) last in, first out. Empty when it fits.
fn over_capacity<A: Addr>(target: &writer::Target<A>, current: &Table<A>, cap: &Capacity) -> Vec<model::ServiceRef> {
    let fits = |svc: usize, be: usize| svc <= cap.services as usize && be <= cap.backends as usize;
    let (mut svc_n, mut be_n) = (target.table.services.len(), target.table.backends.len());
    if fits(svc_n, be_n) {
        return Vec::new();
    }
    // Entries and backends of each Service, and who else uses a backend.
    let mut per: BTreeMap<model::ServiceRef, (usize, BTreeSet<u32>)> = BTreeMap::new();
    let mut users: BTreeMap<u32, usize> = BTreeMap::new();
    for (k, v) in &target.table.services {
        let owner = target.owners.get(&(k.addr, k.port, k.proto)).or_else(|| target.owners.get(&(k.addr, 0, 0)));
        let Some(owner) = owner else { continue };
        let e = per.entry(owner.clone()).or_default();
        e.0 += 1;
        if k.slot != 0 && e.1.insert(v.backend_id) {
            *users.entry(v.backend_id).or_default() += 1;
        }
    }
    let programmed: BTreeSet<model::ServiceRef> = current
        .services
        .keys()
        .filter(|k| k.slot == 0)
        .filter_map(|k| target.owners.get(&(k.addr, k.port, k.proto)))
        .cloned()
        .collect();
    let mut out = Vec::new();
    for (svc, (entries, backends)) in per.iter().rev() {
        if fits(svc_n, be_n) {
            break;
        }
        if programmed.contains(svc) {
            continue;
        }
        svc_n -= entries;
        for b in backends {
            let u = users.get_mut(b).unwrap();
            *u -= 1;
            if *u == 0 {
                be_n -= 1;
            }
        }
        out.push(svc.clone());
    }
    out
}

/// Plan and apply one family. Stops at the first failed write; every
/// prefix of a plan is consistent, so the maps stay usable.
fn sync_family<A: Addr>(
    desired: &model::Desired,
    mirror: &mut Mirror<A>,
    fm: &mut FamilyMaps<A>,
    shared: &mut crate::dataplane::maps::Shared<'_>,
    warnings: &mut Vec<String>,
    cap: &Capacity,
) -> Result<(usize, BTreeSet<u16>), WriteFailed>
where
    lb_common::SvcKey<A>: aya::Pod,
    lb_common::Backend<A>: aya::Pod,
    lb_common::RevNat<A>: aya::Pod,
{
    let t_build = Instant::now();
    let target = writer::build_with(desired, &mirror.table, &mirror.index, &mut mirror.cursors);
    tracing::debug!(family = A::NAME, us = t_build.elapsed().as_micros() as u64, "sync: build");
    let too_many = over_capacity(&target, &mirror.table, cap);
    if !too_many.is_empty() {
        return Err(WriteFailed {
            service: None,
            error: anyhow::anyhow!("{} Services do not fit the maps", too_many.len()),
            too_many,
        });
    }
    warnings.extend(target.left_out.iter().cloned());
    let t_plan = Instant::now();
    let ops = writer::plan(&mirror.table, &target.table);
    tracing::debug!(family = A::NAME, us = t_plan.elapsed().as_micros() as u64, ops = ops.len(), "sync: plan");
    let stale = affinity_gone(&mirror.table, &target.table);
    let t_write = Instant::now();
    let (done, err) = write_counted(&ops, &mirror.table, fm, shared);
    if let Some(e) = err {
        for op in &ops[..done] {
            mirror.apply(op);
        }
        return Err(write_failed(&ops[done], &target, e));
    }
    if !ops.is_empty() {
        tracing::info!(family = A::NAME, write_us = t_write.elapsed().as_micros() as u64, ops = ops.len(), "maps written in full");
    }
    // The maps now hold exactly the target: it becomes the mirror.
    mirror.replace(target.table);
    Ok((ops.len(), stale))
}

impl Reconciler {
    /// Bring the maps to the state `snap` asks for. Only what changed since
    /// the last sync is recomputed and written; everything is, at first,
    /// when the node's facts change, and after a failure. On a write error
    /// the maps stay consistent and the error names the Service; the next
    /// call retries.
    ///
    /// `attach_egress` attaches `lb_sock_egress` (None while an upgrade
    /// stages new maps): called before the first frontend with
    /// loadBalancerSourceRanges is written, see `wants_source_ranges`.
    pub(super) fn sync(&mut self, snap: &Snapshot, attach_egress: Option<&mut dyn FnMut() -> Result<()>>) -> Result<()> {
        let started = Instant::now();
        let iface_ips: Vec<std::net::IpAddr> = self.addresses.get().into_iter().map(|(_, a)| a).collect();
        let facts = model::NodeFacts {
            name: &self.node_name,
            zone: self.zone.as_deref(),
            ips: &self.node_ips,
            interface_ips: &iface_ips,
            nodeport_addresses: self.nodeport_addresses.clone(),
            localhost_nodeports: self.localhost_nodeports,
        };
        let node = model::node_info(&facts, &snap.nodes);
        let mut families: Vec<&'static str> = node.primary.iter().map(model::ip_family).collect();
        families.sort_unstable();
        families.dedup();
        if families.is_empty() {
            families.push("IPv4");
        }
        self.ip_families = families;
        self.health_check_on = (self.nodeport_addresses != model::NodePortAddresses::default()).then(|| node.addresses.clone());
        let t_model = Instant::now();
        let ch = self.model.update(&snap.services, &snap.slices, &node, &self.opts);
        // Measured when programmed: kept across a failed sync.
        self.triggers.extend(ch.triggers.iter().copied());
        if ch.full {
            self.no_local = model::NoLocalEndpoints::of(self.model.desired());
        } else {
            let desired = self.model.desired();
            for k in &ch.frontends {
                self.no_local.set(k, desired.frontends.get(k).map(|f| &**f));
            }
        }
        tracing::debug!(
            us = t_model.elapsed().as_micros() as u64,
            changed = ch.frontends.len(),
            full = ch.full,
            "sync: model"
        );
        self.pending_left.extend(ch.left.iter().copied());
        for p in &ch.joined {
            self.pending_left.remove(p);
        }
        // Recorded before the maps change: an agent killed in between keeps
        // them too.
        self.kept.add(&ch.kept);
        self.kept.remove(&ch.joined);
        if ch.full {
            self.kept.remove_alive(&self.model.desired().alive_pairs());
        }
        self.pending_joined.extend(ch.joined.iter().copied());
        self.pending_udp_served.extend(ch.udp_served.iter().map(|k| (k.addr, k.port)));
        // loadBalancerSourceRanges on the socket path: the egress program is
        // attached, and the hooks told to mark sockets, before the first
        // frontend with ranges is written, so that no connect to it goes
        // unchecked (after the write, connects in between went through).
        // Not a failed sync if it cannot be: the loop tries again after it.
        if !self.sock_egress && self.wants_source_ranges() && let Some(attach) = attach_egress {
            let program = crate::dataplane::loader::EGRESS_PROGRAM;
            match attach().and_then(|()| self.set_sock_egress(true)) {
                Ok(()) => tracing::info!(attached = true, "loadBalancerSourceRanges on the socket path: {program}"),
                Err(e) => tracing::error!("{program} for loadBalancerSourceRanges: {e:#}"),
            }
        }
        let full = ch.full || self.full_needed;
        let mut ops = None;
        if !full {
            match self.sync_changes(&ch) {
                Ok(n) => ops = n,
                Err(WriteFailed { error, .. }) => {
                    tracing::debug!("{error:#}; falling back to a full sync");
                }
            }
        }
        self.last_full = ops.is_none();
        let ops = match ops {
            Some(n) => n,
            None => {
                self.full_needed = true;
                let n = self.sync_full()?;
                self.full_needed = self.not_programmed > 0 || self.maglev_failed();
                release_free_memory();
                n
            }
        };
        // The node's addresses refused as sources (retried here after a
        // failed write).
        self.sync_local4();
        let desired = self.model.desired();
        if full || ch.node_ports {
            // NodePorts that local processes may not bind.
            let want: BTreeSet<lb_common::NodePortKey> = desired
                .node_ports
                .iter()
                .map(|(p, proto)| lb_common::NodePortKey { port: *p, proto: writer::proto_num(*proto), _pad: 0 })
                .collect();
            self.maps.set_nodeports(&mut self.nodeports, &want)?;
        }
        // The node's primary addresses (SNAT's fallback) change without a
        // full sync: the model does not depend on them.
        if full || node.primary != self.node_addresses {
            let snat_addr = node.primary.iter().find_map(|a| match a {
                std::net::IpAddr::V4(v4) => Some(v4.octets()),
                _ => None,
            });
            let snat_addr6 = node.primary.iter().find_map(|a| match a {
                std::net::IpAddr::V6(v6) => Some(v6.octets()),
                _ => None,
            });
            self.maps.set_node_config(&lb_common::NodeConfig {
                netns_cookie: self.netns_cookie,
                snat_addr: snat_addr.unwrap_or_default(),
                snat_port_min: self.snat_ports.0,
                snat_port_max: self.snat_ports.1,
                snat_addr6: snat_addr6.unwrap_or_default(),
                flags: self.node_flags | if self.sock_egress { lb_common::node_flags::SOCK_EGRESS } else { 0 },
                maglev_size: self.maglev.size(),
            })?;
            self.config_written = true;
            self.node_addresses = node.primary.clone();
        }
        // Routes that set an MTU the TC programs' FIB lookup does not see.
        let routes = self.addresses.route_mtus();
        if routes != self.route_mtus {
            // Not a failed sync: the Services are programmed; a packet too
            // big for a route left out goes to the stack as before.
            let r = self.maps.set_route_mtus(&mut self.route_mtus, &routes);
            warn_once(&mut self.route_mtu_error, r, "routes that set an MTU not all given to the TC programs", "");
        }
        if full || ch.health_checks {
            self.health_checks = desired.health_checks.clone();
        }
        if full || !ch.frontends.is_empty() {
            // ClusterIPs routed here from outside count where they are served.
            let cluster_ips = self.node_flags & lb_common::node_flags::EXTERNAL_CLUSTER_IP != 0;
            self.has_external = desired.frontends.values().any(|f| f.external || cluster_ips);
            self.has_dsr = desired.frontends.values().any(|f| f.dsr);
        }
        match (&mut self.names_changed, full) {
            (_, true) => self.names_changed = None,
            (Some(keys), false) => keys.extend(ch.frontends.iter().copied()),
            (None, false) => {}
        }
        if ops > 0 {
            tracing::info!(
                ops,
                frontends = self.frontends(),
                backends = self.v4.table.backends.len() + self.v6.table.backends.len(),
                zone = node.zone.as_deref().unwrap_or(""),
                elapsed_us = started.elapsed().as_micros() as u64,
                "maps programmed"
            );
        }
        // The maps are programmed: now connections to endpoints that
        // stopped serving can go, in the background. After a full sync the
        // destroyer also looks for sockets to pairs that went while no
        // agent watched.
        // And the NAT tables' flows (outside clients', and pods' under
        // --per-packet-lb) to backends that went meanwhile.
        if full {
            self.sweep(!self.swept_tcp);
            self.swept_tcp = true;
        }
        // After a full sync the sweep judges by the whole state.
        let joined = if full { BTreeSet::new() } else { std::mem::take(&mut self.pending_joined) };
        if full {
            self.pending_joined = BTreeSet::new();
        }
        if !self.pending_left.is_empty() || !joined.is_empty() {
            let left = std::mem::take(&mut self.pending_left);
            // (Whatever frontends are external: pods' flows under
            // --per-packet-lb are in the NAT tables too.)
            if !left.is_empty() {
                let _ = self.nat_left.send(crate::nodeport::Ending::Left(left.clone()));
            }
            if let Some(d) = &self.destroyer {
                d.update(left, joined);
            }
        }
        // Connected UDP sockets connected to those while they had no
        // backend (or did not exist) were not translated: told now, so
        // that they connect again, translated.
        let served = std::mem::take(&mut self.pending_udp_served);
        if !served.is_empty()
            && let Some(d) = &self.destroyer
        {
            d.untranslated_udp(served);
        }
        Ok(())
    }

    /// Judge every translated socket and NAT flow by the whole state (after
    /// a full sync, and after an upgrade moved the programs to maps that
    /// the old ones filled until then): those to a backend no frontend
    /// serves any more are ended. TCP ones only with `tcp`: at the start,
    /// for endpoints that went while no agent watched, whose last state is
    /// not known (those that left while ready, their pods still running,
    /// are ended too, unlike under a watching agent: `Frontend::ready`).
    /// Later, a watching agent has judged each TCP pair as it left, and
    /// kept those of ready endpoints: a sweep must not end them after all.
    /// TCP connections to the pairs an agent kept (`stale::kept`) are kept
    /// by such a sweep too; those it finds none to are forgotten.
    pub(super) fn sweep(&self, tcp: bool) {
        let desired = self.model.desired();
        let census = tcp.then(|| self.kept.census(crate::stale::kept::sources(self.upgrading, self.destroyer.is_some())));
        if let Some(d) = &self.destroyer {
            d.sweep(desired.frontends.iter().map(|(k, f)| (*k, f.clone())).collect(), census.clone());
        }
        let fronts = desired.frontends.keys().map(|k| (k.addr, k.port)).collect();
        let _ = self.nat_left.send(crate::nodeport::Ending::Sweep { fronts, alive: desired.alive_pairs(), census });
    }

    /// Log each warning once, for as long as it holds.
    fn log_warnings(&mut self, warnings: Vec<String>) {
        let mut now_logged = HashSet::new();
        for w in warnings {
            if !self.logged.contains(&w) {
                tracing::warn!("{w}");
            }
            now_logged.insert(w);
        }
        self.logged = now_logged;
    }

    /// Program what changed. None: it takes a full sync.
    fn sync_changes(&mut self, ch: &model::Changes) -> Result<Option<usize>, WriteFailed> {
        let desired = self.model.desired();
        let mut warnings = desired.warnings.clone();
        let cap = self.capacity;
        let mut shared = crate::dataplane::maps::Shared {
            matches: &mut self.maps.affinity_match,
            src_range: &mut self.maps.src_range,
            svc_stats: self.maps.svc_stats.as_mut(),
        };
        let t = Instant::now();
        let Some((n4, stale4)) = sync_changes(desired, ch, &mut self.v4, &mut self.maps.v4, &mut shared, &mut warnings, &cap)? else {
            return Ok(None);
        };
        let Some((n6, stale6)) = sync_changes(desired, ch, &mut self.v6, &mut self.maps.v6, &mut shared, &mut warnings, &cap)? else {
            return Ok(None);
        };
        tracing::debug!(us = t.elapsed().as_micros() as u64, ops = n4 + n6, "sync: changes written");
        let tables = self
            .maglev4
            .sync(&self.maglev, &self.v4.table, Some(&units(ch)))
            .and_then(|_| self.maglev6.sync(&self.maglev, &self.v6.table, Some(&units(ch))));
        if let Err(error) = tables {
            return Err(WriteFailed { service: None, error, too_many: Vec::new() });
        }
        if self.maglev_failed() {
            self.full_needed = true;
        }
        let purged = self
            .maps
            .purge_affinity(lb_common::FAMILY_V4, &stale4)
            .and_then(|_| self.maps.purge_affinity(lb_common::FAMILY_V6, &stale6));
        if let Err(error) = purged {
            return Err(WriteFailed { service: None, error, too_many: Vec::new() });
        }
        self.log_warnings(warnings);
        Ok(Some(n4 + n6))
    }

    /// Program everything the model holds. A Service that cannot be
    /// written (a full map, say) is left out, with an error naming it, and
    /// every other one is programmed: the plan is rebuilt without it, which
    /// also removes what it had half-written. Nothing half-written stays
    /// visible.
    fn sync_full(&mut self) -> Result<usize> {
        let full = self.model.desired();
        let mut excluded: BTreeSet<model::ServiceRef> = BTreeSet::new();
        let mut filtered;
        let (warnings, n4, stale4, n6, stale6) = loop {
            let desired: &model::Desired = if excluded.is_empty() {
                full
            } else {
                filtered = full.clone();
                filtered.frontends.retain(|_, f| !excluded.contains(&f.service));
                let owners = filtered.vip_owners.clone();
                filtered.vips.retain(|v| !owners.get(v).is_some_and(|s| excluded.contains(s)));
                &filtered
            };
            let mut warnings = desired.warnings.clone();
            let mut shared =
                crate::dataplane::maps::Shared {
            matches: &mut self.maps.affinity_match,
            src_range: &mut self.maps.src_range,
            svc_stats: self.maps.svc_stats.as_mut(),
        };
            let cap = self.capacity;
            let r = sync_family(desired, &mut self.v4, &mut self.maps.v4, &mut shared, &mut warnings, &cap).and_then(|(n4, s4)| {
                sync_family(desired, &mut self.v6, &mut self.maps.v6, &mut shared, &mut warnings, &cap).map(|(n6, s6)| (n4, s4, n6, s6))
            });
            match r {
                Ok((n4, s4, n6, s6)) => break (warnings, n4, s4, n6, s6),
                Err(WriteFailed { too_many, .. }) if !too_many.is_empty() => {
                    for s in &too_many {
                        tracing::error!(service = %s, "Service not programmed: the maps are full (raise --max-services / --max-backends)");
                    }
                    excluded.extend(too_many);
                }
                Err(WriteFailed { service: Some(s), error, .. }) if !excluded.contains(&s) => {
                    tracing::error!(service = %s, "{error:#}; this Service is not programmed, every other one is (raise the --max-* capacity flags if a map is full)");
                    excluded.insert(s);
                }
                Err(WriteFailed { error, .. }) => return Err(error),
            }
        };
        self.not_programmed = excluded.len();
        self.log_warnings(warnings);
        self.maglev4.sync(&self.maglev, &self.v4.table, None)?;
        self.maglev6.sync(&self.maglev, &self.v6.table, None)?;
        self.maps.purge_affinity(lb_common::FAMILY_V4, &stale4)?;
        self.maps.purge_affinity(lb_common::FAMILY_V6, &stale6)?;
        // After a full sync: the first after a start (an earlier agent's
        // leftovers), or after a failure.
        self.sweep_stats();
        Ok(n4 + n6)
    }

    pub(super) fn frontends(&self) -> usize {
        self.v4.index.frontends() + self.v6.index.frontends()
    }

    /// Whether some frontend the Services ask for has
    /// loadBalancerSourceRanges (programmed or about to be; one the maps
    /// had no room for keeps the egress program attached too, rather than
    /// attaching and detaching it at every sync).
    pub(super) fn wants_source_ranges(&self) -> bool {
        self.model.desired().frontends.values().any(|f| !f.source_ranges.is_empty())
    }

    /// Tell the socket hooks whether `lb_sock_egress` is attached
    /// (`node_flags::SOCK_EGRESS` in the node config, which holds the rest
    /// once the first full sync wrote it).
    pub(super) fn set_sock_egress(&mut self, on: bool) -> Result<()> {
        self.sock_egress = on;
        let Ok(mut cfg) = self.maps.node_config.get(&0, 0) else { return Ok(()) };
        let bit = lb_common::node_flags::SOCK_EGRESS;
        cfg.flags = if on { cfg.flags | bit } else { cfg.flags & !bit };
        self.maps.set_node_config(&cfg)
    }

    /// Set or clear a bit of the node flags, in the node config too once
    /// it holds this agent's flags (before that, its first write takes it).
    pub(super) fn set_node_flag(&mut self, bit: u32, on: bool) -> Result<()> {
        self.node_flags = if on { self.node_flags | bit } else { self.node_flags & !bit };
        if !self.config_written {
            return Ok(());
        }
        let mut cfg = self.maps.node_config.get(&0, 0).context("read the node config")?;
        cfg.flags = if on { cfg.flags | bit } else { cfg.flags & !bit };
        self.maps.set_node_config(&cfg)
    }

    /// Delete the counters of ids neither family's maps hold (see
    /// `Maps::sweep_svc_stats`). The mirrors are exact here: every write
    /// that reached the maps is in them, and nothing else writes ids. A
    /// failure costs only stale counters: it is logged.
    pub(super) fn sweep_stats(&mut self) {
        use lb_common::{FAMILY_V4, FAMILY_V6, STATS_BACKEND, STATS_FRONTEND};
        let (v4, v6) = (&self.v4.table, &self.v6.table);
        let swept = self.maps.sweep_svc_stats(|k| {
            let front = u16::try_from(k.id).ok();
            match (k.family, k.kind) {
                (FAMILY_V4, STATS_FRONTEND) => front.is_some_and(|id| v4.revnat.contains_key(&id)),
                (FAMILY_V6, STATS_FRONTEND) => front.is_some_and(|id| v6.revnat.contains_key(&id)),
                (FAMILY_V4, STATS_BACKEND) => v4.backends.contains_key(&k.id),
                (FAMILY_V6, STATS_BACKEND) => v6.backends.contains_key(&k.id),
                _ => false,
            }
        });
        match swept {
            Ok(0) => {}
            Ok(n) => tracing::debug!(entries = n, "LB_SVC_STATS: counters of ids no longer in use deleted"),
            Err(e) => tracing::warn!("LB_SVC_STATS: deleting the counters of ids no longer in use: {e:#}"),
        }
    }

    /// Re-read the maps; where they differ from what this agent programmed
    /// (an entry deleted or changed by hand), take them as they are, so
    /// that the next sync plans the way back. Returns how many entries
    /// differ.
    /// A Maglev table could not be written: a full sync tries again.
    pub(super) fn maglev_failed(&self) -> bool {
        self.maglev4.failed || self.maglev6.failed
    }

    pub(super) fn repair_drift(&mut self) -> Result<usize> {
        let t4 = self.maps.v4.read_table(&self.maps.affinity_match, &self.maps.src_range)?;
        let t6 = self.maps.v6.read_table(&self.maps.affinity_match, &self.maps.src_range)?;
        let n = writer::drift(&self.v4.table, &t4) + writer::drift(&self.v6.table, &t6);
        if n > 0 {
            self.v4 = Mirror::new(t4);
            self.v6 = Mirror::new(t6);
            self.full_needed = true;
        }
        Ok(n)
    }
}

/// The frontend key (address, port, protocol) of rev_nat id `id` in `target`.
fn by_revnat<A: Addr>(id: u16, target: &writer::Target<A>) -> Option<(A, u16, u8)> {
    let r = target.table.revnat.get(&id)?;
    target.owners.keys().find(|(a, p, _)| *a == r.addr && *p == r.port).copied()
}

/// The Service an op belongs to, for error messages.
fn owner_of<A: Addr>(op: &Op<A>, target: &writer::Target<A>) -> Option<(model::ServiceRef, String)> {
    let key = match op {
        Op::PutSvc(k, _) | Op::DelSvc(k) => Some((k.addr, k.port, k.proto)),
        Op::PutBackend(id, _) => target
            .table
            .services
            .iter()
            .find(|(k, v)| k.slot != 0 && v.backend_id == *id)
            .map(|(k, _)| (k.addr, k.port, k.proto)),
        Op::PutRevNat(_, r) => target.owners.keys().find(|(a, p, _)| *a == r.addr && *p == r.port).copied(),
        // The side maps keyed by a frontend's rev_nat id (its affinity
        // pairs, its source ranges): that frontend's Service, so that one
        // filling them (16,384 source ranges, say) is left out alone.
        Op::PutMatch(m) => by_revnat(m.rev_nat_id, target),
        Op::PutRange(id, ..) => by_revnat(*id, target),
        _ => None,
    }?;
    let svc = target.owners.get(&key)?;
    Some((svc.clone(), format!("{}:{}/{}", key.0.to_ip(), key.1, key.2)))
}

impl Reconciler {
    pub(super) fn export(&self, m: &Metrics, cap: &Capacity) {
        use lb_common::maps as n;
        m.services.set(self.frontends() as i64);
        m.not_programmed.set(self.not_programmed as i64);
        m.backends.set((self.v4.table.backends.len() + self.v6.table.backends.len()) as i64);
        let entries = [
            (n::SERVICES4, self.v4.table.services.len(), cap.services),
            (n::BACKENDS4, self.v4.table.backends.len(), cap.backends),
            (n::REVNAT4, self.v4.table.revnat.len(), cap.services.min(u16::MAX as u32)),
            (n::SERVICES6, self.v6.table.services.len(), cap.services),
            (n::BACKENDS6, self.v6.table.backends.len(), cap.backends),
            (n::REVNAT6, self.v6.table.revnat.len(), cap.services.min(u16::MAX as u32)),
            (n::AFFINITY_MATCH, self.v4.table.affinity_match.len() + self.v6.table.affinity_match.len(), cap.backends),
        ];
        for (map, len, max) in entries {
            m.map_entries.get_or_create(&[("map", map)]).set(len as i64);
            m.map_capacity.get_or_create(&[("map", map)]).set(max as i64);
        }
    }

    /// Bring the frontend names /frontends serves up to date: only the
    /// frontends that changed, unless a full sync ran.
    pub(super) fn export_names(&mut self, m: &Metrics) {
        let desired = self.model.desired();
        let name = |k: &model::FrontendKey, f: &model::Frontend| crate::monitor::FrontendName {
            service: f.service.to_string(),
            port_name: f.port_name.clone(),
            address: k.addr,
            port: k.port,
            protocol: k.proto.to_string(),
        };
        let mut names = m.frontend_names.lock().unwrap();
        match self.names_changed.replace(BTreeSet::new()) {
            None => {
                names.clear();
                names.extend(desired.frontends.iter().map(|(k, f)| (*k, name(k, f))));
            }
            Some(keys) => {
                for k in keys {
                    match desired.frontends.get(&k) {
                        Some(f) => names.insert(k, name(&k, f)),
                        None => names.remove(&k),
                    };
                }
            }
        }
    }
}
