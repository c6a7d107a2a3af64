//! Typed access to the pinned maps: read them into tables, apply ops.
use std::path::Path;

use anyhow::{Context as _, Result};
use aya::Pod;
use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray};
use lb_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend, NodeConfig, NodePortKey, RevNat, RouteKey, RouteMtu, SrcRange,
    SvcKey, SvcStats, SvcStatsKey, SvcValue, maps, stats,
};

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
    /// The same three maps, for batch writes (aya has none).
    raw: [MapData; 3],
}

const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// BPF_MAP_UPDATE_BATCH (with `values`) or BPF_MAP_DELETE_BATCH (without):
/// the kernel writes the entries in order, as that many single writes
/// would, in one system call. Returns how many were written before a
/// failure, and the failure.
pub(super) fn batch<K: Pod, V: Pod>(map_fd: std::os::fd::RawFd, keys: &[K], values: Option<&[V]>) -> (usize, std::io::Result<()>) {
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.map_or(0, |v| v.as_ptr() as u64),
        count: keys.len() as u32,
        map_fd: map_fd as u32,
        ..Default::default()
    };
    let cmd = if values.is_some() { BPF_MAP_UPDATE_BATCH } else { BPF_MAP_DELETE_BATCH };
    // SAFETY: `attr` points at `count` keys (and values) of the map's sizes,
    // which live until the call returns.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, &mut attr as *mut BatchAttr, std::mem::size_of::<BatchAttr>()) };
    if r < 0 {
        // The kernel reports how far it got in `count`; a call it refused
        // before the first entry (no batch operations for this map type,
        // no memory) leaves `count` as it was: none done.
        let done = attr.count as usize;
        (if done >= keys.len() { 0 } else { done }, Err(std::io::Error::last_os_error()))
    } else {
        (keys.len(), Ok(()))
    }
}

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// Every entry of a hash map (LRU included), a few thousand per system call
/// (BPF_MAP_LOOKUP_BATCH), not two calls per entry as iterating does.
/// Entries added or removed meanwhile may or may not be seen, as with
/// iterating.
pub fn lookup_all<K: Pod + Default, V: Pod + Default>(map: &MapData) -> std::io::Result<Vec<(K, V)>> {
    let (ks, vs) = (size_of::<K>(), size_of::<V>());
    let (keys, values) = lookup_all_raw(map, ks, vs)?;
    Ok(keys
        .chunks_exact(ks.max(1))
        .zip(values.chunks_exact(vs.max(1)))
        // SAFETY: each chunk holds one K (one V) as the kernel wrote it;
        // both are Pod, read unaligned from the byte buffers.
        .map(|(k, v)| unsafe { (std::ptr::read_unaligned(k.as_ptr().cast::<K>()), std::ptr::read_unaligned(v.as_ptr().cast::<V>())) })
        .collect())
}

/// `lookup_all` for a map whose entry types this agent does not have (an
/// older agent's layout): every key and value as bytes, one after the
/// other (`key_size` and `value_size` each).
pub fn lookup_all_raw(map: &MapData, key_size: usize, value_size: usize) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    const CHUNK: usize = 4096;
    let fd = map.fd().as_fd().as_raw_fd();
    let (mut keys_out, mut values_out) = (Vec::new(), Vec::new());
    let mut keys = vec![0u8; CHUNK * key_size];
    let mut values = vec![0u8; CHUNK * value_size];
    // The hash map's batch token: a bucket index.
    let (mut token_in, mut token_out) = (0u32, 0u32);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { &mut token_in as *mut u32 as u64 },
            out_batch: &mut token_out as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        // SAFETY: the buffers hold CHUNK keys and values of the map's
        // sizes (the caller's) and live until the call returns; the
        // tokens are u32s.
        let r = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_LOOKUP_BATCH, &mut attr as *mut BatchAttr, std::mem::size_of::<BatchAttr>()) };
        let err = (r < 0).then(std::io::Error::last_os_error);
        let n = (attr.count as usize).min(CHUNK);
        keys_out.extend_from_slice(&keys[..n * key_size]);
        values_out.extend_from_slice(&values[..n * value_size]);
        match err {
            None => {}
            // The end of the map.
            Some(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok((keys_out, values_out)),
            Some(e) => return Err(e),
        }
        token_in = token_out;
        first = false;
    }
}

const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;

/// The `elem` member of `union bpf_attr`.
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// Write one entry given as bytes of the map's key and value sizes
/// (`flags`: BPF_ANY, BPF_NOEXIST, BPF_EXIST).
pub fn update_raw(map: &MapData, key: &[u8], value: &[u8], flags: u64) -> std::io::Result<()> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let mut attr = ElemAttr { map_fd: map.fd().as_fd().as_raw_fd() as u32, _pad: 0, key: key.as_ptr() as u64, value: value.as_ptr() as u64, flags };
    // SAFETY: `key` and `value` live until the call returns; the caller
    // gives them the map's sizes (the kernel reads that many bytes).
    let r = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_UPDATE_ELEM, &mut attr as *mut ElemAttr, std::mem::size_of::<ElemAttr>()) };
    if r < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// Runs at least this long are written by two threads, half each: the
/// kernel's hash maps take concurrent writers, and a cold start writes
/// hundreds of thousands of entries.
const PARALLEL_RUN: usize = 16_384;

/// `batch`, split over two threads for long runs. The entries of one run
/// may be written in any order (the plan orders runs, not entries within
/// one). On a failure it says nothing was written: the caller writes the
/// run again one by one (puts and deletions are idempotent).
fn batch_run<K: Pod + Sync, V: Pod + Sync>(map: &MapData, keys: &[K], values: Option<&[V]>) -> (usize, std::io::Result<()>) {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let fd = map.fd().as_fd().as_raw_fd();
    if keys.len() < PARALLEL_RUN {
        return batch(fd, keys, values);
    }
    let mid = keys.len() / 2;
    let (k1, k2) = keys.split_at(mid);
    let (v1, v2) = match values {
        Some(v) => {
            let (a, b) = v.split_at(mid);
            (Some(a), Some(b))
        }
        None => (None, None),
    };
    let (r1, r2) = std::thread::scope(|s| {
        let other = s.spawn(|| batch(fd, k2, v2));
        let r1 = batch(fd, k1, v1);
        (r1, other.join().unwrap_or_else(|_| (0, Err(std::io::Error::other("batch writer panicked")))))
    });
    match (r1, r2) {
        ((_, Ok(())), (_, Ok(()))) => (keys.len(), Ok(())),
        ((_, Err(e)), _) | (_, (_, Err(e))) => (0, Err(e)),
    }
}

/// Which of a family's maps an op writes, and how, for batching.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RunKind {
    PutSvc,
    DelSvc,
    PutBackend,
    DelBackend,
}

fn run_kind<A>(op: &Op<A>) -> Option<RunKind> {
    match op {
        Op::PutSvc(..) => Some(RunKind::PutSvc),
        Op::DelSvc(_) => Some(RunKind::DelSvc),
        Op::PutBackend(..) => Some(RunKind::PutBackend),
        Op::DelBackend(_) => Some(RunKind::DelBackend),
        _ => None,
    }
}

/// The phase of the plan a service-map write belongs to (see
/// `writer::plan`: slots before the slot 0 that counts them, a node-local
/// slot 0 before the frontend's, VIP markers last; deletions the other way
/// round). A batch run never spans two phases: its halves are written by
/// two threads in any order, so a slot 0 could otherwise land before the
/// slots it counts.
fn phase<A>(op: &Op<A>) -> u8 {
    let k = match op {
        Op::PutSvc(k, _) | Op::DelSvc(k) => k,
        _ => return 0,
    };
    if k.port == 0 && k.proto == 0 {
        3
    } else if k.slot != 0 {
        0
    } else if k.scope == lb_common::SCOPE_LOCAL {
        1
    } else {
        2
    }
}

/// `LB_SVC_STATS` values as agents before 12-05 wrote them: conns, refused,
/// unreachable, packets, bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct SvcStatsBeforeSourceRange([u64; 5]);
// SAFETY: five u64s, no padding.
unsafe impl Pod for SvcStatsBeforeSourceRange {}

/// Every counter of the `LB_SVC_STATS` pinned at `pin`: of this layout, or
/// of the one before 12-05 (40 bytes: `source_range` reads 0). Anything
/// else is an error naming the sizes. A key deleted while it is read (its
/// id freed) is left out.
pub fn read_svc_stats_pin(pin: &Path) -> Result<Vec<(SvcStatsKey, SvcStats)>> {
    let size = aya::maps::MapInfo::from_pin(pin).with_context(|| format!("open {}", pin.display()))?.value_size() as usize;
    let data = MapData::from_pin(pin).with_context(|| format!("open {}", pin.display()))?;
    let what = || format!("{}: values of {size} bytes (this agent's are {}, 12-04's were {})", pin.display(), size_of::<SvcStats>(), size_of::<SvcStatsBeforeSourceRange>());
    if size == size_of::<SvcStatsBeforeSourceRange>() {
        let m: HashMap<MapData, SvcStatsKey, SvcStatsBeforeSourceRange> = HashMap::try_from(Map::HashMap(data)).with_context(what)?;
        m.iter()
            .filter(|r| !matches!(r, Err(aya::maps::MapError::KeyNotFound)))
            .map(|r| {
                let (k, SvcStatsBeforeSourceRange([conns, refused, unreachable, packets, bytes])) = r.with_context(what)?;
                Ok((k, SvcStats { conns, refused, unreachable, packets, bytes, source_range: 0 }))
            })
            .collect()
    } else {
        let m: HashMap<MapData, SvcStatsKey, SvcStats> = HashMap::try_from(Map::HashMap(data)).with_context(what)?;
        m.iter().filter(|r| !matches!(r, Err(aya::maps::MapError::KeyNotFound))).map(|r| r.with_context(what)).collect()
    }
}

/// Every map the agent reads or writes.
pub struct Maps {
    pub v4: FamilyMaps<[u8; 4]>,
    pub v6: FamilyMaps<[u8; 16]>,
    pub affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    pub affinity_match: HashMap<MapData, AffinityMatchKey, u8>,
    pub src_range: LpmTrie<MapData, SrcRange, u8>,
    pub nodeports: HashMap<MapData, NodePortKey, u8>,
    pub node_config: Array<MapData, NodeConfig>,
    pub stats: PerCpuArray<MapData, u64>,
    /// None under an older agent's pins (`list`): none, or the narrower
    /// one from before 12-05 (`read_svc_stats_pin` reads it). An agent
    /// always has it: an upgrade replaced an older one.
    pub svc_stats: Option<HashMap<MapData, SvcStatsKey, SvcStats>>,
    /// None under an older agent's pins (`list`): the map came later.
    pub route_mtu: Option<LpmTrie<MapData, RouteKey, RouteMtu>>,
    /// None under an older agent's pins (`list`): the map came later.
    pub local4: Option<HashMap<MapData, [u8; 4], u8>>,
}

/// The maps a family's ops touch besides its own.
pub struct Shared<'a> {
    pub matches: &'a mut HashMap<MapData, AffinityMatchKey, u8>,
    pub src_range: &'a mut LpmTrie<MapData, SrcRange, u8>,
    pub svc_stats: Option<&'a mut HashMap<MapData, SvcStatsKey, SvcStats>>,
}

impl Shared<'_> {
    /// A frontend or backend id was deleted, or is handed out anew: its
    /// counters go, so that a later owner of the id starts from zero.
    pub fn forget_stats<A: Addr>(&mut self, op: &Op<A>) {
        let (kind, id) = match op {
            Op::DelRevNat(id) | Op::PutRevNat(id, _) => (lb_common::STATS_FRONTEND, *id as u32),
            Op::DelBackend(id) | Op::PutBackend(id, _) => (lb_common::STATS_BACKEND, *id),
            _ => return,
        };
        let key = SvcStatsKey { id, kind, family: A::FAMILY, _pad: 0 };
        let Some(svc_stats) = self.svc_stats.as_mut() else { return };
        if let Err(e) = ignore_missing(svc_stats.remove(&key)) {
            tracing::debug!("LB_SVC_STATS: delete {key:?}: {e}");
        }
    }
}

/// Routes that set an MTU: (destination, prefix length) -> (MTU, device).
pub type RouteMtus = std::collections::BTreeMap<(std::net::IpAddr, u8), (u32, u32)>;

/// The LPM key of a route to `addr`/`len` in LB_ROUTE_MTU.
pub fn route_key(addr: std::net::IpAddr, len: u8) -> Key<RouteKey> {
    let (family, wide) = family_wide(addr);
    Key::new(32 + len as u32, RouteKey { family, _pad: [0; 3], addr: wide })
}

/// An address as the LPM keys hold it: its family, and its bytes in 16
/// (IPv4 in the first 4).
fn family_wide(addr: std::net::IpAddr) -> (u8, [u8; 16]) {
    match addr {
        std::net::IpAddr::V4(a) => {
            let mut w = [0u8; 16];
            w[..4].copy_from_slice(&a.octets());
            (lb_common::FAMILY_V4, w)
        }
        std::net::IpAddr::V6(a) => (lb_common::FAMILY_V6, a.octets()),
    }
}

/// The LPM key of a loadBalancerSourceRange of frontend `id`.
pub fn range_key(id: u16, addr: std::net::IpAddr, len: u8) -> Key<SrcRange> {
    let (family, wide) = family_wide(addr);
    Key::new(32 + len as u32, SrcRange { rev_nat_id: id, family, _pad: 0, addr: wide })
}

fn open_pinned(dir: &Path, name: &str) -> Result<MapData> {
    // During an upgrade, the new layout's map is staged beside the old.
    let path = super::loader::pin_path(dir, name);
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
        Ok(Self {
            names,
            services: hash(dir, names[0])?,
            backends: hash(dir, names[1])?,
            revnat: hash(dir, names[2])?,
            raw: [open_pinned(dir, names[0])?, open_pinned(dir, names[1])?, open_pinned(dir, names[2])?],
        })
    }

    /// Read the full contents (the affinity-match and source-range entries
    /// of this family too).
    pub fn read_table(&self, matches: &HashMap<MapData, AffinityMatchKey, u8>, ranges: &LpmTrie<MapData, SrcRange, u8>) -> Result<Table<A>> {
        // In batches (the periodic resync reads all of it).
        let mut t = Table {
            services: lookup_all(&self.raw[0]).with_context(|| format!("read {}", self.names[0]))?.into_iter().collect(),
            backends: lookup_all(&self.raw[1]).with_context(|| format!("read {}", self.names[1]))?.into_iter().collect(),
            revnat: lookup_all(&self.raw[2]).with_context(|| format!("read {}", self.names[2]))?.into_iter().collect(),
            ..Table::default()
        };
        for k in matches.keys() {
            let k = k.context("read LB_AFFINITY_MATCH")?;
            if k.family == A::FAMILY {
                t.affinity_match.insert(k);
            }
        }
        for k in ranges.keys() {
            let k = k.context("read LB_SRC_RANGE")?;
            let d = k.data();
            if d.family != A::FAMILY {
                continue;
            }
            let len = k.prefix_len().saturating_sub(32) as u8;
            let ip = if d.family == lb_common::FAMILY_V4 {
                std::net::IpAddr::from([d.addr[0], d.addr[1], d.addr[2], d.addr[3]])
            } else {
                std::net::IpAddr::from(d.addr)
            };
            if let Some(a) = A::from_ip(ip) {
                t.src_ranges.insert((d.rev_nat_id, a, len));
            }
        }
        Ok(t)
    }

    /// How many ops from the start of `ops` one batch can write: a run of
    /// the same kind of write to the same map.
    pub fn batchable(ops: &[Op<A>]) -> usize {
        let Some(first) = ops.first() else { return 0 };
        let Some(kind) = run_kind(first) else { return 0 };
        let ph = phase(first);
        ops.iter().take_while(|o| run_kind(o) == Some(kind) && phase(*o) == ph).count()
    }

    /// Write a run of `batchable` ops in one system call. Returns how many
    /// were written; on a failure the rest are left to single writes,
    /// which name the failing entry (and skip a deletion of a missing one).
    pub fn apply_batch(&mut self, ops: &[Op<A>]) -> usize {
        let (done, result) = match ops.first().and_then(run_kind) {
            Some(RunKind::PutSvc) => {
                let (k, v): (Vec<SvcKey<A>>, Vec<SvcValue>) =
                    ops.iter().filter_map(|o| if let Op::PutSvc(k, v) = o { Some((*k, *v)) } else { None }).unzip();
                batch_run(&self.raw[0], &k, Some(&v))
            }
            Some(RunKind::DelSvc) => {
                let k: Vec<SvcKey<A>> = ops.iter().filter_map(|o| if let Op::DelSvc(k) = o { Some(*k) } else { None }).collect();
                batch_run::<_, SvcValue>(&self.raw[0], &k, None)
            }
            Some(RunKind::PutBackend) => {
                let (k, v): (Vec<u32>, Vec<Backend<A>>) =
                    ops.iter().filter_map(|o| if let Op::PutBackend(k, v) = o { Some((*k, *v)) } else { None }).unzip();
                batch_run(&self.raw[1], &k, Some(&v))
            }
            Some(RunKind::DelBackend) => {
                let k: Vec<u32> = ops.iter().filter_map(|o| if let Op::DelBackend(k) = o { Some(*k) } else { None }).collect();
                batch_run::<_, Backend<A>>(&self.raw[1], &k, None)
            }
            None => (0, Ok(())),
        };
        if let Err(e) = result {
            tracing::debug!(written = done, of = ops.len(), "batch write stopped: {e}");
        }
        done.min(ops.len())
    }

    /// Apply one op to the kernel maps.
    pub fn apply(&mut self, op: &Op<A>, shared: &mut Shared<'_>) -> Result<()> {
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
            Op::PutMatch(m) => shared.matches.insert(m, 0, 0).context("LB_AFFINITY_MATCH: insert"),
            Op::DelMatch(m) => ignore_missing(shared.matches.remove(m)).context("LB_AFFINITY_MATCH: delete"),
            Op::PutRange(id, a, l) | Op::DelRange(id, a, l) => {
                let key = range_key(*id, a.to_ip(), *l);
                if matches!(op, Op::PutRange(..)) {
                    shared.src_range.insert(&key, 0, 0).context("LB_SRC_RANGE: insert")
                } else {
                    ignore_missing(shared.src_range.remove(&key)).context("LB_SRC_RANGE: delete")
                }
            }
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
            src_range: LpmTrie::try_from(Map::LpmTrie(open_pinned(dir, maps::SRC_RANGE)?))?,
            nodeports: hash(dir, maps::NODEPORTS)?,
            node_config: Array::try_from(Map::Array(open_pinned(dir, maps::NODE_CONFIG)?))?,
            stats: PerCpuArray::try_from(Map::PerCpuArray(open_pinned(dir, maps::STATS)?))?,
            svc_stats: match aya::maps::MapInfo::from_pin(super::loader::pin_path(dir, maps::SVC_STATS)) {
                Ok(info) if info.value_size() as usize == size_of::<SvcStats>() => Some(hash(dir, maps::SVC_STATS)?),
                _ => None,
            },
            route_mtu: open_pinned(dir, maps::ROUTE_MTU).ok().map(|m| LpmTrie::try_from(Map::LpmTrie(m))).transpose()?,
            local4: open_pinned(dir, maps::LOCAL4).ok().map(|m| HashMap::try_from(Map::HashMap(m))).transpose()?,
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

    /// Delete the counters of every frontend and backend id `in_use` does
    /// not hold: ids freed while a packet or connection still counted on
    /// them (a NAT flow's last packets), or left by an earlier agent.
    /// Without it they stay until the id is handed out again, and a map
    /// full of them leaves new ids uncounted. Returns how many went.
    pub fn sweep_svc_stats(&mut self, in_use: impl Fn(&SvcStatsKey) -> bool) -> Result<usize> {
        let Some(svc_stats) = self.svc_stats.as_mut() else { return Ok(0) };
        let stale: Vec<SvcStatsKey> = svc_stats.keys().filter_map(|k| k.ok()).filter(|k| !in_use(k)).collect();
        for k in &stale {
            ignore_missing(svc_stats.remove(k)).with_context(|| format!("{}: delete {k:?}", maps::SVC_STATS))?;
        }
        Ok(stale.len())
    }

    /// Every frontend's and backend's counters.
    pub fn read_svc_stats(&self) -> Result<std::collections::BTreeMap<SvcStatsKey, SvcStats>> {
        let Some(svc_stats) = &self.svc_stats else { anyhow::bail!("{} is missing or of another layout", maps::SVC_STATS) };
        svc_stats.iter().map(|r| r.context("read LB_SVC_STATS")).collect()
    }

    /// The stats counters, summed over CPUs, by name (those the pinned map
    /// has: an older agent's has fewer).
    pub fn read_stats(&self) -> Result<Vec<(&'static str, u64)>> {
        let mut out = Vec::new();
        for (i, name) in stats::NAMES.iter().enumerate().take(self.stats.len() as usize) {
            let per_cpu = self.stats.get(&(i as u32), 0).with_context(|| format!("read {}", maps::STATS))?;
            out.push((*name, per_cpu.iter().sum()));
        }
        Ok(out)
    }
}

impl Maps {
    /// The NodePorts that local processes may not bind.
    pub fn read_nodeports(&self) -> Result<std::collections::BTreeSet<NodePortKey>> {
        self.nodeports.keys().map(|k| k.context("read LB_NODEPORTS")).collect()
    }

    pub fn set_nodeports(&mut self, current: &mut std::collections::BTreeSet<NodePortKey>, want: &std::collections::BTreeSet<NodePortKey>) -> Result<()> {
        for k in want.difference(&current.clone()) {
            self.nodeports.insert(k, 0, 0).context("LB_NODEPORTS: insert")?;
            current.insert(*k);
        }
        for k in current.clone().difference(want) {
            ignore_missing(self.nodeports.remove(k)).context("LB_NODEPORTS: delete")?;
            current.remove(k);
        }
        Ok(())
    }

    /// Make LB_ROUTE_MTU hold `want` (routes that set an MTU: prefix ->
    /// (MTU, device)); `current` is what it holds, kept up to date.
    pub fn set_route_mtus(&mut self, current: &mut RouteMtus, want: &RouteMtus) -> Result<()> {
        let Some(m) = self.route_mtu.as_mut() else { anyhow::bail!("{} is not pinned", maps::ROUTE_MTU) };
        for (k, v) in want {
            if current.get(k) != Some(v) {
                m.insert(&route_key(k.0, k.1), RouteMtu { mtu: v.0, ifindex: v.1 }, 0).with_context(|| format!("{}: insert {}/{}", maps::ROUTE_MTU, k.0, k.1))?;
                current.insert(*k, *v);
            }
        }
        for k in current.clone().keys().filter(|k| !want.contains_key(k)) {
            ignore_missing(m.remove(&route_key(k.0, k.1))).with_context(|| format!("{}: delete {}/{}", maps::ROUTE_MTU, k.0, k.1))?;
            current.remove(k);
        }
        Ok(())
    }

    /// What LB_ROUTE_MTU holds.
    pub fn read_route_mtus(&self) -> Result<RouteMtus> {
        let Some(m) = self.route_mtu.as_ref() else { return Ok(RouteMtus::new()) };
        let mut out = RouteMtus::new();
        for r in m.iter() {
            let (k, v) = r.with_context(|| format!("read {}", maps::ROUTE_MTU))?;
            let d = k.data();
            let addr = if d.family == lb_common::FAMILY_V4 {
                std::net::IpAddr::V4(std::net::Ipv4Addr::new(d.addr[0], d.addr[1], d.addr[2], d.addr[3]))
            } else {
                std::net::IpAddr::V6(std::net::Ipv6Addr::from(d.addr))
            };
            out.insert((addr, (k.prefix_len() - 32) as u8), (v.mtu, v.ifindex));
        }
        Ok(out)
    }

    /// Make LB_LOCAL4 hold `want` (the node's IPv4 addresses); `current`
    /// is what it holds, kept up to date. Removals go first, so that a
    /// full map takes the new addresses of a renumbering.
    pub fn set_local4(&mut self, current: &mut std::collections::BTreeSet<[u8; 4]>, want: &std::collections::BTreeSet<[u8; 4]>) -> Result<()> {
        let Some(m) = self.local4.as_mut() else { anyhow::bail!("{} is not pinned", maps::LOCAL4) };
        for a in current.clone().difference(want) {
            ignore_missing(m.remove(a)).with_context(|| format!("{}: delete {}", maps::LOCAL4, std::net::Ipv4Addr::from(*a)))?;
            current.remove(a);
        }
        for a in want.difference(&current.clone()) {
            m.insert(a, 0, 0).with_context(|| format!("{}: insert {}", maps::LOCAL4, std::net::Ipv4Addr::from(*a)))?;
            current.insert(*a);
        }
        Ok(())
    }

    /// What LB_LOCAL4 holds.
    pub fn read_local4(&self) -> Result<std::collections::BTreeSet<[u8; 4]>> {
        let Some(m) = self.local4.as_ref() else { return Ok(Default::default()) };
        m.keys().map(|k| k.with_context(|| format!("read {}", maps::LOCAL4))).collect()
    }

    pub fn set_node_config(&mut self, cfg: &NodeConfig) -> Result<()> {
        if self.node_config.get(&0, 0).ok().as_ref() != Some(cfg) {
            self.node_config.set(0, cfg, 0).context("LB_NODE_CONFIG: set")?;
        }
        Ok(())
    }
}

/// A new kernel hash map of the given sizes, for tests (root needed).
#[cfg(test)]
pub(crate) fn test_hash_map(key_size: u32, value_size: u32, max_entries: u32) -> MapData {
    use std::os::fd::{FromRawFd as _, OwnedFd};
    #[repr(C)]
    #[derive(Default)]
    struct CreateAttr {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
    }
    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_MAP_TYPE_HASH: u32 = 1;
    let mut attr = CreateAttr { map_type: BPF_MAP_TYPE_HASH, key_size, value_size, max_entries, map_flags: 0 };
    // SAFETY: a plain bpf(2) call with a valid attr of the size given.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, &mut attr as *mut CreateAttr, std::mem::size_of::<CreateAttr>()) };
    assert!(fd >= 0, "BPF_MAP_CREATE: {}", std::io::Error::last_os_error());
    // SAFETY: a new fd we own.
    MapData::from_fd(unsafe { OwnedFd::from_raw_fd(fd as i32) }).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{SCOPE_ALL, SCOPE_LOCAL};

    /// A real kernel hash map (this test needs root, as every test here
    /// may): lookup_all returns every entry, across several batches.
    #[test]
    fn lookup_all_reads_every_entry_of_a_hash_map() {
        let data = test_hash_map(4, 8, 20_000);
        let mut m: HashMap<MapData, u32, u64> = HashMap::try_from(Map::HashMap(data)).unwrap();
        for k in 0..10_000u32 {
            m.insert(k, k as u64 * 3, 0).unwrap();
        }
        let mut got = lookup_all::<u32, u64>(aya::maps::IterableMap::map(&m)).expect("BPF_MAP_LOOKUP_BATCH");
        got.sort();
        assert_eq!(got.len(), 10_000);
        assert!(got.iter().enumerate().all(|(i, (k, v))| *k == i as u32 && *v == i as u64 * 3));
    }

    #[test]
    fn a_batch_run_never_spans_two_phases_of_the_plan() {
        let v = SvcValue::default();
        let slot = |n| Op::PutSvc(SvcKey::new([10, 96, 0, n], 80, 6, SCOPE_ALL, 1), v);
        let head = |n| Op::PutSvc(SvcKey::new([10, 96, 0, n], 80, 6, SCOPE_ALL, 0), v);
        let local = |n| Op::PutSvc(SvcKey::new([10, 96, 0, n], 80, 6, SCOPE_LOCAL, 0), v);
        let marker = |n| Op::PutSvc(SvcKey::new([10, 96, 0, n], 0, 0, SCOPE_ALL, 0), v);
        let ops: Vec<Op<[u8; 4]>> = vec![slot(1), slot(2), slot(3), local(1), head(1), head(2), marker(1)];
        let mut runs = Vec::new();
        let mut i = 0;
        while i < ops.len() {
            let n = FamilyMaps::<[u8; 4]>::batchable(&ops[i..]);
            runs.push(n);
            i += n;
        }
        assert_eq!(runs, [3, 1, 2, 1], "slots, the node-local slot 0, the slot 0s, the markers");
        let dels: Vec<Op<[u8; 4]>> = vec![
            Op::DelSvc(SvcKey::new([10, 96, 0, 1], 80, 6, SCOPE_ALL, 0)),
            Op::DelSvc(SvcKey::new([10, 96, 0, 1], 80, 6, SCOPE_ALL, 1)),
            Op::DelSvc(SvcKey::new([10, 96, 0, 1], 80, 6, SCOPE_ALL, 2)),
        ];
        assert_eq!(FamilyMaps::<[u8; 4]>::batchable(&dels), 1, "the slot 0 alone, then its slots");
    }
}
