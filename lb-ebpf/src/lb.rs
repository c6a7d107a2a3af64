//! Service lookup and backend selection, shared by the socket hooks, for
//! both address families.
//!
//! Map semantics follow DESIGN.md: slot 0 of a frontend holds the backend
//! count; slots 1..=count hold backend ids. Selection is O(1).
use core::ffi::c_void;

use aya_ebpf::{
    btf_maps::{Array, HashMap, HashOfMaps, LruHashMap, PerCpuArray, RingBuf},
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_ktime_get_ns},
    macros::btf_map,
};
use lb_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend, FAMILY_V4, FAMILY_V6, MaglevKey, NodeConfig, RevNat,
    MonitorEvent, PROTO_UDP, SCOPE_ALL, SCOPE_LOCAL, STATS_BACKEND, STATS_FRONTEND, SockRevNat4Key, SockRevNat6Key, SockRevNatValue, SvcKey,
    SvcStats, SvcStatsKey, SvcValue, capacity, monitor, stats, svc_flags,
};

type A4 = [u8; 4];
type A6 = [u8; 16];

/// Hash maps the agent writes are not preallocated: memory follows use,
/// and a deleted element is freed only after an RCU grace period, so a
/// program that still reads it sees the old value, never a reused one.
pub const NO_PREALLOC: usize = aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize;

#[btf_map]
static LB4_SERVICES: HashMap<SvcKey<A4>, SvcValue, { capacity::SERVICES as usize }, NO_PREALLOC> = HashMap::new();
#[btf_map]
static LB4_BACKENDS: HashMap<u32, Backend<A4>, { capacity::BACKENDS as usize }, NO_PREALLOC> = HashMap::new();
#[btf_map]
static LB4_REVNAT: HashMap<u16, RevNat<A4>, { capacity::REVNAT as usize }, NO_PREALLOC> = HashMap::new();
#[btf_map]
static LB4_SOCK_REVNAT: LruHashMap<SockRevNat4Key, SockRevNatValue<A4>, { capacity::SOCK_REVNAT as usize }> =
    LruHashMap::new();

#[btf_map]
static LB6_SERVICES: HashMap<SvcKey<A6>, SvcValue, { capacity::SERVICES as usize }, NO_PREALLOC> = HashMap::new();
#[btf_map]
static LB6_BACKENDS: HashMap<u32, Backend<A6>, { capacity::BACKENDS as usize }, NO_PREALLOC> = HashMap::new();
#[btf_map]
static LB6_REVNAT: HashMap<u16, RevNat<A6>, { capacity::REVNAT as usize }, NO_PREALLOC> = HashMap::new();
#[btf_map]
static LB6_SOCK_REVNAT: LruHashMap<SockRevNat6Key, SockRevNatValue<A6>, { capacity::SOCK_REVNAT as usize }> =
    LruHashMap::new();

/// Maglev tables of the frontends that use Maglev for outside traffic: an
/// inner array of backend ids per (frontend, scope). BPF_F_INNER_MAP: the
/// agent's tables may have another (prime) size than this template.
const INNER_MAP: usize = 1 << 12;
type MaglevTable = Array<u32, { capacity::MAGLEV_TEMPLATE as usize }, INNER_MAP>;
#[btf_map]
static LB4_MAGLEV: HashOfMaps<MaglevKey, MaglevTable, { capacity::MAGLEV as usize }, NO_PREALLOC> = HashOfMaps::new();
#[btf_map]
static LB6_MAGLEV: HashOfMaps<MaglevKey, MaglevTable, { capacity::MAGLEV as usize }, NO_PREALLOC> = HashOfMaps::new();

#[btf_map]
static LB_AFFINITY: LruHashMap<AffinityKey, AffinityValue, { capacity::AFFINITY as usize }> = LruHashMap::new();
#[btf_map]
static LB_AFFINITY_MATCH: HashMap<AffinityMatchKey, u8, { capacity::BACKENDS as usize }, NO_PREALLOC> = HashMap::new();

#[btf_map]
static LB_STATS: PerCpuArray<u64, { stats::COUNT as usize }> = PerCpuArray::new();

#[btf_map]
static LB_NODE_CONFIG: Array<NodeConfig, 1> = Array::new();

/// `lb-agent monitor`: index 0 is the newest heartbeat of any monitor
/// (0: none runs), 1..=SLOTS each monitor's.
#[btf_map]
static LB_MONITOR: Array<u64, { monitor::SLOTS as usize + 1 }> = Array::new();
#[btf_map]
static LB_EVENTS0: RingBuf<MonitorEvent, { monitor::RING_BYTES as usize }> = RingBuf::new();
#[btf_map]
static LB_EVENTS1: RingBuf<MonitorEvent, { monitor::RING_BYTES as usize }> = RingBuf::new();
#[btf_map]
static LB_EVENTS2: RingBuf<MonitorEvent, { monitor::RING_BYTES as usize }> = RingBuf::new();
#[btf_map]
static LB_EVENTS3: RingBuf<MonitorEvent, { monitor::RING_BYTES as usize }> = RingBuf::new();
/// Where an event is put together, one per CPU (not on the stack).
#[btf_map]
static LB_EVENT_BUF: PerCpuArray<MonitorEvent, 1> = PerCpuArray::new();

/// `lb-agent run --bpf-log debug`: a log line per decision. The level is a
/// read-only global the loader sets before the verifier sees the programs,
/// so with logging off (the default) these branches are removed at load.
#[inline(always)]
pub fn logging() -> bool {
    aya_log_ebpf::macro_support::level_enabled(aya_log_ebpf::macro_support::Level::Debug)
}

/// A monitor runs or decisions are logged: put an event together.
#[inline(always)]
pub fn observed() -> bool {
    logging() || monitoring()
}

/// One decision as a debug log line. Few arguments and one string: each
/// multiplies what the verifier walks through aya-log's record writer.
#[inline(always)]
fn log_event(ev: &MonitorEvent) {
    if ev.x.family == FAMILY_V4 { log4(ev) } else { log6(ev) }
}

/// Hook and protocol as one number, `hook << 8 | protocol`: the agent's
/// log sink writes it out as words (`connect TCP`), and the reason too
/// (`why=N`). A string argument picked by a match would multiply the
/// verifier's walk (each arm a path through aya-log's record writer) past
/// its limit in the TC programs.
#[inline(always)]
fn hook_proto(ev: &MonitorEvent) -> u16 {
    (ev.hook as u16) << 8 | ev.proto as u16
}

#[inline(never)]
fn log4(ev: &MonitorEvent) {
    let x = &ev.x;
    let ip4 = |a: &[u8; 16]| u32::from_be_bytes([a[0], a[1], a[2], a[3]]);
    aya_log_ebpf::debug!(&0u8, "{} {:i}:{} -> {:i}:{} why={} errno={}", hook_proto(ev), ip4(&x.front), x.front_port, ip4(&x.backend), x.backend_port, ev.why, ev.errno);
}

#[inline(never)]
fn log6(ev: &MonitorEvent) {
    let x = &ev.x;
    aya_log_ebpf::debug!(&0u8, "{} [{:i}]:{} -> [{:i}]:{} why={} errno={}", hook_proto(ev), x.front, x.front_port, x.backend, x.backend_port, ev.why, ev.errno);
}

/// Whether a monitor runs: one array read while none does.
#[inline(always)]
pub fn monitoring() -> bool {
    let Some(hb) = LB_MONITOR.get_ptr(0) else { return false };
    // SAFETY: an array value; one aligned load.
    let hb = unsafe { core::ptr::read_volatile(hb) };
    // SAFETY: plain helper.
    hb != 0 && unsafe { bpf_ktime_get_ns() }.wrapping_sub(hb) < monitor::HEARTBEAT_NS
}

/// This CPU's event buffer, zeroed, for the caller to fill and `emit`.
#[inline(always)]
pub fn event_buf() -> Option<*mut MonitorEvent> {
    let p = LB_EVENT_BUF.get_ptr_mut(0)?;
    // SAFETY: this CPU's value; nothing else runs on this CPU meanwhile.
    // Zeroed in place (a MonitorEvent::default() would be built on the stack).
    unsafe { core::ptr::write_bytes(p, 0, 1) };
    Some(p)
}

/// This CPU's event buffer as an earlier step of this program run left it.
#[inline(always)]
pub fn event_filled() -> Option<*mut MonitorEvent> {
    LB_EVENT_BUF.get_ptr_mut(0)
}

/// Send the event in `ev` to every monitor whose heartbeat is fresh, and
/// to the debug log when it is on. Inlined into the one frame that fills
/// the event: the log calls then sit one frame below it.
#[inline(always)]
pub fn emit(ev: *mut MonitorEvent) {
    // SAFETY: plain helper.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: ev is this CPU's event buffer.
    let ev = unsafe {
        (*ev).ts_ns = now;
        &*ev
    };
    let fresh = |slot: u32| {
        LB_MONITOR.get_ptr(slot).is_some_and(|hb| {
            // SAFETY: an array value; one aligned load.
            let hb = unsafe { core::ptr::read_volatile(hb) };
            hb != 0 && now.wrapping_sub(hb) < monitor::HEARTBEAT_NS
        })
    };
    // A full ring buffer loses the event: counted for that monitor, which
    // says so.
    if fresh(1) && LB_EVENTS0.output(ev, 0).is_err() {
        event(stats::MONITOR_LOST);
    }
    if fresh(2) && LB_EVENTS1.output(ev, 0).is_err() {
        event(stats::MONITOR_LOST + 1);
    }
    if fresh(3) && LB_EVENTS2.output(ev, 0).is_err() {
        event(stats::MONITOR_LOST + 2);
    }
    if fresh(4) && LB_EVENTS3.output(ev, 0).is_err() {
        event(stats::MONITOR_LOST + 3);
    }
    if logging() {
        log_event(ev);
    }
}

/// Per-frontend and per-backend counters (`lb-agent list --stats`).
#[btf_map]
static LB_SVC_STATS: HashMap<SvcStatsKey, SvcStats, { capacity::SVC_STATS as usize }, NO_PREALLOC> = HashMap::new();

/// Which counter of an `SvcStats` to add to.
#[derive(Clone, Copy)]
pub enum Acct {
    Conn,
    Refused,
    Unreachable,
    /// A packet dropped by loadBalancerSourceRanges.
    SourceRange,
    /// A packet of this many bytes.
    Packet(u32),
}

/// Add to a frontend's (`STATS_FRONTEND`, rev_nat_id) or backend's
/// (`STATS_BACKEND`, backend id) counters, creating them on first use.
#[inline(always)]
pub fn account(kind: u8, family: u8, id: u32, what: Acct) {
    use core::intrinsics::{AtomicOrdering::Relaxed, atomic_xadd};
    let key = SvcStatsKey { id, kind, family, _pad: 0 };
    let p = match LB_SVC_STATS.get_ptr_mut(&key) {
        Some(p) => p,
        None => {
            let _ = LB_SVC_STATS.insert(&key, &SvcStats::default(), aya_ebpf::bindings::BPF_NOEXIST as u64);
            match LB_SVC_STATS.get_ptr_mut(&key) {
                Some(p) => p,
                None => return,
            }
        }
    };
    // SAFETY: a map value, alive for this program run (RCU); other CPUs add
    // to it at the same time, hence the atomic adds.
    unsafe {
        let add = |f: *mut u64, n: u64| {
            atomic_xadd::<u64, u64, { Relaxed }>(f, n);
        };
        match what {
            Acct::Conn => add(core::ptr::addr_of_mut!((*p).conns), 1),
            Acct::Refused => add(core::ptr::addr_of_mut!((*p).refused), 1),
            Acct::Unreachable => add(core::ptr::addr_of_mut!((*p).unreachable), 1),
            Acct::SourceRange => add(core::ptr::addr_of_mut!((*p).source_range), 1),
            Acct::Packet(len) => {
                add(core::ptr::addr_of_mut!((*p).packets), 1);
                add(core::ptr::addr_of_mut!((*p).bytes), len as u64);
            }
        }
    }
}

/// A new connection (or TC flow) of frontend `rev_nat_id` to `backend_id`.
#[inline(always)]
pub fn account_conn(family: u8, rev_nat_id: u16, backend_id: u32) {
    account(STATS_FRONTEND, family, rev_nat_id as u32, Acct::Conn);
    account(STATS_BACKEND, family, backend_id, Acct::Conn);
}

/// This node's configuration, once the agent has written it.
#[inline(always)]
pub fn node_config() -> Option<NodeConfig> {
    LB_NODE_CONFIG.get_ptr(0).map(copy).filter(|c| c.netns_cookie != 0)
}

/// This node's configuration in place (no copy on the stack); zero until
/// the agent has written it.
#[inline(always)]
pub fn node_config_ref() -> Option<&'static NodeConfig> {
    // SAFETY: a map value, alive for this program run (an array's values
    // are never freed).
    LB_NODE_CONFIG.get_ptr(0).map(|c| unsafe { &*c })
}

/// `NodeConfig::flags` alone (0 until the agent has written them), read
/// in place: no copy of the whole value on the stack.
#[inline(always)]
pub fn node_flags() -> u32 {
    // SAFETY: a map value, alive for this program run; one aligned u32.
    LB_NODE_CONFIG.get_ptr(0).map_or(0, |c| unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*c).flags)) })
}

/// Whether ClusterIPs routed to the node from outside are served
/// (`node_flags::EXTERNAL_CLUSTER_IP`).
#[inline(always)]
pub fn external_cluster_ip() -> bool {
    node_flags() & lb_common::node_flags::EXTERNAL_CLUSTER_IP != 0
}

/// Whether `client` is a socket in the node's own network namespace.
#[inline(always)]
pub fn in_node_netns(client: &Client) -> bool {
    match client {
        Client::Sock(ctx) => {
            // SAFETY: helper valid for sock_addr programs.
            let netns = unsafe { bpf_get_netns_cookie(*ctx) };
            node_config().is_some_and(|c| c.netns_cookie == netns)
        }
        Client::Addr(_) => false,
    }
}

/// How often a lookup chain is retried when a concurrent update removed an
/// entry between two lookups (the agent changes a service while we read it).
const RETRIES: u32 = 3;

pub const ECONNREFUSED: i32 = 111;
const EHOSTUNREACH: i32 = 113;

/// Who asks, for sessionAffinity ClientIP.
#[derive(Clone, Copy)]
pub enum Client {
    /// A socket hook's context: the client is its network namespace (a pod,
    /// or the node), since the hook cannot see the source address yet.
    Sock(*mut c_void),
    /// A packet from outside the node: its source address (an IPv4 address
    /// in the first 4 bytes).
    Addr([u8; 16]),
}

pub enum Verdict<A> {
    /// Not a frontend we know: leave the socket alone.
    Pass,
    /// Connect to this backend (`backend_id`) of frontend `rev_nat_id`;
    /// `why`: monitor::WHY_TRANSLATED, WHY_TOPOLOGY or WHY_AFFINITY.
    Backend { backend: Backend<A>, rev_nat_id: u16, backend_id: u32, why: u8 },
    /// Fail the syscall with this errno, for monitor reason `why`.
    Refuse { errno: i32, why: u8, rev_nat_id: u16 },
}

/// Copy a map value out at once: a concurrent agent update replaces whole
/// elements, and the retry loop re-validates what it read.
#[inline(always)]
fn copy<T>(p: *const T) -> T {
    // SAFETY: p comes from a successful map lookup.
    unsafe { core::ptr::read_volatile(p) }
}

/// The maps of one address family.
pub trait Family {
    type A: Copy + PartialEq;
    const ID: u8;
    fn svc(k: &SvcKey<Self::A>) -> Option<SvcValue>;
    fn backend(id: u32) -> Option<Backend<Self::A>>;
    fn revnat(id: u16) -> Option<RevNat<Self::A>>;
    /// Entry `index` of the Maglev table `key`: a backend id.
    fn maglev(key: &MaglevKey, index: u32) -> Option<u32>;
}

pub struct V4;
pub struct V6;

impl Family for V4 {
    type A = A4;
    const ID: u8 = FAMILY_V4;
    #[inline(always)]
    fn svc(k: &SvcKey<A4>) -> Option<SvcValue> {
        LB4_SERVICES.get_ptr(k).map(copy)
    }
    #[inline(always)]
    fn backend(id: u32) -> Option<Backend<A4>> {
        LB4_BACKENDS.get_ptr(id).map(copy)
    }
    #[inline(always)]
    fn revnat(id: u16) -> Option<RevNat<A4>> {
        LB4_REVNAT.get_ptr(id).map(copy)
    }
    #[inline(always)]
    fn maglev(key: &MaglevKey, index: u32) -> Option<u32> {
        // SAFETY: the agent swaps whole inner maps, never writes one in use.
        unsafe { LB4_MAGLEV.get_value(key, &index).copied() }
    }
}

impl Family for V6 {
    type A = A6;
    const ID: u8 = FAMILY_V6;
    #[inline(always)]
    fn svc(k: &SvcKey<A6>) -> Option<SvcValue> {
        LB6_SERVICES.get_ptr(k).map(copy)
    }
    #[inline(always)]
    fn backend(id: u32) -> Option<Backend<A6>> {
        LB6_BACKENDS.get_ptr(id).map(copy)
    }
    #[inline(always)]
    fn revnat(id: u16) -> Option<RevNat<A6>> {
        LB6_REVNAT.get_ptr(id).map(copy)
    }
    #[inline(always)]
    fn maglev(key: &MaglevKey, index: u32) -> Option<u32> {
        // SAFETY: the agent swaps whole inner maps, never writes one in use.
        unsafe { LB6_MAGLEV.get_value(key, &index).copied() }
    }
}

/// Count `n` datapath events at once (`event`).
#[inline(always)]
pub fn events(index: u32, n: u64) {
    if let Some(p) = LB_STATS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe { *p += n };
    }
}

/// Count one datapath event (`lb_common::stats`, the per-CPU `LB_STATS`
/// array behind `lb_datapath_events_total`); not to be confused with a
/// frontend's backend count (`SvcValue::count`) or its connection counters
/// (`account`).
#[inline(always)]
pub fn event(index: u32) {
    events(index, 1);
}

/// The affine backend of this client for frontend `rev_nat_id`, if it is
/// still fresh and still one of the frontend's backends.
#[inline(always)]
fn affine<F: Family>(key: &AffinityKey, timeout_s: u32, now: u64) -> Option<(Backend<F::A>, u32)> {
    let p = LB_AFFINITY.get_ptr_mut(key)?;
    let v = copy(p);
    if now.wrapping_sub(v.last_used_ns) > timeout_s as u64 * 1_000_000_000 {
        return None;
    }
    let m = AffinityMatchKey { backend_id: v.backend_id, rev_nat_id: key.rev_nat_id, family: F::ID, _pad: 0 };
    LB_AFFINITY_MATCH.get_ptr(&m)?;
    let backend = F::backend(v.backend_id)?;
    // Used again: refresh the timestamp in place (one aligned store), not
    // by rewriting the LRU entry.
    // SAFETY: a map value, alive for this program run (RCU).
    unsafe { core::ptr::write_volatile(core::ptr::addr_of_mut!((*p).last_used_ns), now) };
    Some((backend, v.backend_id))
}

/// Pick a backend for `addr:port/proto`. `hash` selects the slot when given
/// (stable per socket, or per flow); otherwise the pick is random per call.
/// `client` is who sessionAffinity keys on. `external`: the TC path, for traffic from
/// outside the node; it serves only EXTERNAL frontends and follows
/// externalTrafficPolicy instead of internalTrafficPolicy.
#[inline(always)]
pub fn select<F: Family>(client: Client, addr: F::A, port: u16, proto: u8, hash: Option<u32>, external: bool) -> Verdict<F::A> {
    select_with::<F>(client, addr, port, proto, hash, external, &mut 0)
}

/// `select`, also telling the chosen frontend's `svc_flags` in
/// `front_flags` (the socket hooks need them; in the TC programs, which
/// pass a scratch value, the compiler drops the store, and the verifier
/// has no value more to track).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn select_with<F: Family>(
    client: Client,
    addr: F::A,
    port: u16,
    proto: u8,
    hash: Option<u32>,
    external: bool,
    front_flags: &mut u16,
) -> Verdict<F::A> {
    let mut retry = 0;
    while retry < RETRIES {
        retry += 1;
        let front = F::svc(&SvcKey::new(addr, port, proto, SCOPE_ALL, 0));
        if external {
            // Outside traffic: NodePort / LB IP / externalIP frontends, and
            // ClusterIPs routed here where the node serves them.
            match front {
                Some(f) if f.flags & svc_flags::EXTERNAL != 0 || external_cluster_ip() => {}
                _ => return Verdict::Pass,
            }
        }
        let Some(front) = front.filter(|f| external || f.flags & svc_flags::NO_SOCKET == 0) else {
            if external {
                return Verdict::Pass;
            }
            // A known ClusterIP on a port that is no service port.
            if let Some(m) = F::svc(&SvcKey::new(addr, 0, 0, SCOPE_ALL, 0))
                && m.flags & svc_flags::VIP_MARKER != 0
            {
                event(stats::REFUSED_NO_PORT);
                return Verdict::Refuse { errno: ECONNREFUSED, why: monitor::WHY_WRONG_PORT, rev_nat_id: 0 };
            }
            return Verdict::Pass;
        };
        // A localhost NodePort: the node's own sockets only (a pod's
        // 127.0.0.1 is its own); never outside traffic.
        if front.flags & svc_flags::HOST_ONLY != 0 && !in_node_netns(&client) {
            return Verdict::Pass;
        }
        // externalTrafficPolicy for outside traffic to an external
        // frontend; internalTrafficPolicy for the rest (a ClusterIP from
        // outside too, as kube-proxy's KUBE-SVL chain serves it).
        let local_flag = if external && front.flags & svc_flags::EXTERNAL != 0 { svc_flags::EXT_LOCAL } else { svc_flags::LOCAL_ONLY };
        let (scope, n) = if front.flags & local_flag != 0 {
            // internalTrafficPolicy Local: the node-local slots. With none,
            // "unreachable" if the Service has endpoints elsewhere, else
            // "refused", as kube-proxy's DROP and REJECT tell them apart.
            let local = F::svc(&SvcKey::new(addr, port, proto, SCOPE_LOCAL, 0)).map_or(0, |v| v.count);
            if local == 0 {
                if front.count == 0 {
                    event(stats::REFUSED_NO_ENDPOINTS);
                    account(STATS_FRONTEND, F::ID, front.rev_nat_id as u32, Acct::Refused);
                    return Verdict::Refuse { errno: ECONNREFUSED, why: monitor::WHY_NO_ENDPOINTS, rev_nat_id: front.rev_nat_id };
                }
                event(stats::UNREACH_NO_LOCAL);
                account(STATS_FRONTEND, F::ID, front.rev_nat_id as u32, Acct::Unreachable);
                return Verdict::Refuse {
                    errno: EHOSTUNREACH,
                    why: monitor::WHY_NO_LOCAL_ENDPOINT,
                    rev_nat_id: front.rev_nat_id,
                };
            }
            (SCOPE_LOCAL, local)
        } else {
            (SCOPE_ALL, front.count)
        };
        if n == 0 {
            event(stats::REFUSED_NO_ENDPOINTS);
            account(STATS_FRONTEND, F::ID, front.rev_nat_id as u32, Acct::Refused);
            return Verdict::Refuse { errno: ECONNREFUSED, why: monitor::WHY_NO_ENDPOINTS, rev_nat_id: front.rev_nat_id };
        }

        let affinity = front.flags & svc_flags::AFFINITY != 0;
        let mut akey = AffinityKey::default();
        // SAFETY: plain helper.
        let now = if affinity { unsafe { bpf_ktime_get_ns() } } else { 0 };
        if affinity {
            akey = AffinityKey { rev_nat_id: front.rev_nat_id, family: F::ID, proto, ..AffinityKey::default() };
            match client {
                // SAFETY: helper valid for sock_addr programs.
                Client::Sock(ctx) => akey.netns_cookie = unsafe { bpf_get_netns_cookie(ctx) },
                Client::Addr(a) => akey.client = a,
            }
            if let Some((backend, backend_id)) = affine::<F>(&akey, front.affinity_timeout, now) {
                event(stats::AFFINITY_HIT);
                *front_flags = front.flags;
                return Verdict::Backend { backend, rev_nat_id: front.rev_nat_id, backend_id, why: monitor::WHY_AFFINITY };
            }
        }

        let r = match hash {
            Some(h) => h,
            // SAFETY: helper without side effects.
            None => unsafe { bpf_get_prandom_u32() },
        };
        let mut why = if front.flags & svc_flags::TOPOLOGY != 0 { monitor::WHY_TOPOLOGY } else { monitor::WHY_TRANSLATED };
        // Maglev (outside flows, hashed): the table names the backend; a
        // table not there yet (or a race with its swap) falls back to the
        // slots.
        let mut backend_id = 0;
        if external && hash.is_some() && front.flags & svc_flags::MAGLEV != 0 {
            backend_id = maglev_pick::<F>(front.rev_nat_id, proto, scope, r);
            if backend_id != 0 {
                why = monitor::WHY_MAGLEV;
            }
        }
        if backend_id == 0 {
            let slot = (r % n as u32) as u16 + 1;
            let Some(sv) = F::svc(&SvcKey::new(addr, port, proto, scope, slot)) else {
                event(stats::RETRIED);
                continue;
            };
            backend_id = sv.backend_id;
        }
        let Some(backend) = F::backend(backend_id) else {
            event(stats::RETRIED);
            continue;
        };
        if affinity {
            let v = AffinityValue { last_used_ns: now, backend_id, _pad: 0 };
            let _ = LB_AFFINITY.insert(&akey, &v, 0);
        }
        *front_flags = front.flags;
        return Verdict::Backend { backend, rev_nat_id: front.rev_nat_id, backend_id, why };
    }
    // Every attempt raced with an update: refuse rather than guess.
    event(stats::REFUSED_NO_ENDPOINTS);
    Verdict::Refuse { errno: ECONNREFUSED, why: monitor::WHY_NO_ENDPOINTS, rev_nat_id: 0 }
}

/// The backend id the Maglev table of (frontend, scope) holds for flow hash
/// `h`; 0 when there is no table or its backend is gone (the agent removes
/// backends after it swapped the tables that name them, but a program may
/// run in between): the caller falls back to the slots.
#[inline(always)]
pub fn maglev_pick<F: Family>(rev_nat_id: u16, proto: u8, scope: u8, h: u32) -> u32 {
    let size = node_config().map_or(0, |c| c.maglev_size);
    if size == 0 {
        return 0;
    }
    let id = F::maglev(&MaglevKey { rev_nat_id, proto, scope }, h % size).unwrap_or(0);
    if id == 0 || F::backend(id).is_none() {
        return 0;
    }
    id
}

/// Remember which frontend a socket's translated destination stands for, so
/// that recvmsg, getpeername (and socket termination) can find it.
#[inline(never)]
pub fn remember4(cookie: u64, backend: &Backend<A4>, front: A4, port: u16, rev_nat_id: u16) {
    let key = SockRevNat4Key { cookie, addr: backend.addr, port: backend.port, _pad: 0 };
    let val = SockRevNatValue { addr: front, port, rev_nat_id };
    // Every datagram of a socket asks again: write only what changed.
    if LB4_SOCK_REVNAT.get_ptr(&key).is_some_and(|p| copy(p) == val) {
        return;
    }
    let _ = LB4_SOCK_REVNAT.insert(&key, &val, 0);
}

#[inline(never)]
pub fn remember6(cookie: u64, backend: &Backend<A6>, front: A6, port: u16, rev_nat_id: u16) {
    let key = SockRevNat6Key { cookie, addr: backend.addr, port: backend.port, _pad: 0, _pad2: 0 };
    let val = SockRevNatValue { addr: front, port, rev_nat_id };
    if LB6_SOCK_REVNAT.get_ptr(&key).is_some_and(|p| copy(p) == val) {
        return;
    }
    let _ = LB6_SOCK_REVNAT.insert(&key, &val, 0);
}

/// The frontend that a reply from `addr:port` on socket `cookie` stands for.
/// The entry counts only while its frontend still exists.
#[inline(always)]
fn still_valid<F: Family>(v: &SockRevNatValue<F::A>) -> bool {
    frontend_alive::<F>(v.rev_nat_id, v.addr, v.port)
}

/// Frontend `rev_nat_id` still is `addr:port`.
#[inline(always)]
pub fn frontend_alive<F: Family>(rev_nat_id: u16, addr: F::A, port: u16) -> bool {
    match F::revnat(rev_nat_id) {
        Some(r) => r.addr == addr && r.port == port,
        None => false,
    }
}

#[inline(always)]
pub fn reverse4(cookie: u64, addr: A4, port: u16) -> Option<(A4, u16)> {
    let key = SockRevNat4Key { cookie, addr, port, _pad: 0 };
    let v = copy(LB4_SOCK_REVNAT.get_ptr(&key)?);
    still_valid::<V4>(&v).then_some((v.addr, v.port))
}

#[inline(always)]
pub fn reverse6(cookie: u64, addr: A6, port: u16) -> Option<(A6, u16)> {
    let key = SockRevNat6Key { cookie, addr, port, _pad: 0, _pad2: 0 };
    let v = copy(LB6_SOCK_REVNAT.get_ptr(&key)?);
    still_valid::<V6>(&v).then_some((v.addr, v.port))
}

/// The frontend with loadBalancerSourceRanges (its rev_nat_id) that socket
/// `cookie` sent an unconnected datagram to, now going to backend
/// `addr:port`; None for a frontend without ranges, or none at all.
#[inline(never)]
pub fn ranged4(cookie: u64, addr: A4, port: u16) -> Option<u16> {
    let v = copy(LB4_SOCK_REVNAT.get_ptr(&SockRevNat4Key { cookie, addr, port, _pad: 0 })?);
    let f = V4::svc(&SvcKey::new(v.addr, v.port, PROTO_UDP, SCOPE_ALL, 0))?;
    (f.rev_nat_id == v.rev_nat_id && f.flags & svc_flags::SRC_RANGE != 0).then_some(v.rev_nat_id)
}

#[inline(never)]
pub fn ranged6(cookie: u64, addr: A6, port: u16) -> Option<u16> {
    let v = copy(LB6_SOCK_REVNAT.get_ptr(&SockRevNat6Key { cookie, addr, port, _pad: 0, _pad2: 0 })?);
    let f = V6::svc(&SvcKey::new(v.addr, v.port, PROTO_UDP, SCOPE_ALL, 0))?;
    (f.rev_nat_id == v.rev_nat_id && f.flags & svc_flags::SRC_RANGE != 0).then_some(v.rev_nat_id)
}

/// A well-mixed 32-bit hash of a socket cookie (murmur3 finalizer), so that
/// sequential cookies spread over the slots.
#[inline(always)]
pub fn mix(cookie: u64) -> u32 {
    let mut h = cookie ^ (cookie >> 33);
    h = h.wrapping_mul(0xff51afd7ed558ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ceb9fe1a85ec53);
    h ^= h >> 33;
    h as u32
}
