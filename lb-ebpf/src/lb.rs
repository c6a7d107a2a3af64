//! Service lookup and backend selection, shared by the socket hooks.
//!
//! Map semantics follow DESIGN.md: slot 0 of a frontend holds the backend
//! count; slots 1..=count hold backend ids. Selection is O(1).
use aya_ebpf::{
    btf_maps::{HashMap, LruHashMap, PerCpuArray},
    helpers::bpf_get_prandom_u32,
    macros::btf_map,
};
use lb_common::{
    Backend4, RevNat4, SCOPE_ALL, SCOPE_LOCAL, SockRevNat4Key, SockRevNat4Value, Svc4Key,
    SvcValue, capacity, stats, svc_flags,
};

#[btf_map]
pub static LB4_SERVICES: HashMap<Svc4Key, SvcValue, { capacity::SERVICES as usize }> =
    HashMap::new();

#[btf_map]
pub static LB4_BACKENDS: HashMap<u32, Backend4, { capacity::BACKENDS as usize }> = HashMap::new();

#[btf_map]
pub static LB4_REVNAT: HashMap<u16, RevNat4, { capacity::REVNAT as usize }> = HashMap::new();

#[btf_map]
pub static LB4_SOCK_REVNAT: LruHashMap<
    SockRevNat4Key,
    SockRevNat4Value,
    { capacity::SOCK_REVNAT as usize },
> = LruHashMap::new();

#[btf_map]
pub static LB_STATS: PerCpuArray<u64, { stats::COUNT as usize }> = PerCpuArray::new();

/// How often a lookup chain is retried when a concurrent update removed an
/// entry between two lookups (the agent changes a service while we read it).
const RETRIES: u32 = 3;

pub enum Verdict {
    /// Not a frontend we know: leave the socket alone.
    Pass,
    /// Connect to this backend; replies must look like they come from `frontend`.
    Backend { backend: Backend4, rev_nat_id: u16 },
    /// Fail the syscall with this errno.
    Refuse(i32),
}

const ECONNREFUSED: i32 = 111;
const EHOSTUNREACH: i32 = 113;

#[inline(always)]
pub fn count(index: u32) {
    if let Some(p) = LB_STATS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe { *p += 1 };
    }
}

#[inline(always)]
fn get_svc(key: &Svc4Key) -> Option<SvcValue> {
    // SAFETY: copied out at once; a concurrent agent update replaces whole
    // elements, and we re-validate through the retry loop below.
    LB4_SERVICES.get_ptr(key).map(|p| unsafe { core::ptr::read_volatile(p) })
}

/// Pick a backend for `addr:port/proto`. `hash` selects the slot when given
/// (stable per socket); otherwise the pick is random per call.
#[inline(always)]
pub fn select4(addr: [u8; 4], port: u16, proto: u8, hash: Option<u32>) -> Verdict {
    let mut retry = 0;
    while retry < RETRIES {
        retry += 1;
        let front = match get_svc(&Svc4Key::new(addr, port, proto, SCOPE_ALL, 0)) {
            Some(v) => v,
            None => {
                // A known ClusterIP on a port that is no service port.
                let marker = Svc4Key::new(addr, 0, 0, SCOPE_ALL, 0);
                if let Some(m) = get_svc(&marker)
                    && m.flags & svc_flags::VIP_MARKER != 0
                {
                    count(stats::REFUSED_NO_PORT);
                    return Verdict::Refuse(ECONNREFUSED);
                }
                return Verdict::Pass;
            }
        };
        let (scope, n) = if front.flags & svc_flags::LOCAL_ONLY != 0 {
            // The count of node-local backends lives in the scope-local slot 0.
            match get_svc(&Svc4Key::new(addr, port, proto, SCOPE_LOCAL, 0)) {
                Some(v) if v.count > 0 => (SCOPE_LOCAL, v.count),
                _ => {
                    count(stats::REFUSED_NO_ENDPOINTS);
                    return Verdict::Refuse(EHOSTUNREACH);
                }
            }
        } else {
            (SCOPE_ALL, front.count)
        };
        if n == 0 {
            count(stats::REFUSED_NO_ENDPOINTS);
            return Verdict::Refuse(ECONNREFUSED);
        }
        let r = match hash {
            Some(h) => h,
            // SAFETY: helper without side effects.
            None => unsafe { bpf_get_prandom_u32() },
        };
        let slot = (r % n as u32) as u16 + 1;
        let Some(sv) = get_svc(&Svc4Key::new(addr, port, proto, scope, slot)) else {
            count(stats::RETRIED);
            continue;
        };
        let Some(bp) = LB4_BACKENDS.get_ptr(sv.backend_id) else {
            count(stats::RETRIED);
            continue;
        };
        // SAFETY: copied out at once.
        let backend = unsafe { core::ptr::read_volatile(bp) };
        return Verdict::Backend { backend, rev_nat_id: front.rev_nat_id };
    }
    // Every attempt raced with an update: refuse rather than guess.
    count(stats::REFUSED_NO_ENDPOINTS);
    Verdict::Refuse(ECONNREFUSED)
}

/// Remember which frontend a socket's translated destination stands for, so
/// that recvmsg (and later getpeername and socket termination) can find it.
#[inline(always)]
pub fn remember4(cookie: u64, backend: &Backend4, front_addr: [u8; 4], front_port: u16, rev_nat_id: u16) {
    let key = SockRevNat4Key { cookie, addr: backend.addr, port: backend.port, _pad: 0 };
    let val = SockRevNat4Value { addr: front_addr, port: front_port, rev_nat_id };
    let _ = LB4_SOCK_REVNAT.insert(&key, &val, 0);
}

/// Look up the frontend a reply from `addr:port` on socket `cookie` stands
/// for. The entry counts only while its frontend still exists.
#[inline(always)]
pub fn reverse4(cookie: u64, addr: [u8; 4], port: u16) -> Option<(  [u8; 4], u16)> {
    let key = SockRevNat4Key { cookie, addr, port, _pad: 0 };
    let p = LB4_SOCK_REVNAT.get_ptr(&key)?;
    // SAFETY: copied out at once.
    let v = unsafe { core::ptr::read_volatile(p) };
    let rp = LB4_REVNAT.get_ptr(v.rev_nat_id)?;
    // SAFETY: copied out at once.
    let rev = unsafe { core::ptr::read_volatile(rp) };
    if rev.addr != v.addr || rev.port != v.port {
        return None;
    }
    Some((v.addr, v.port))
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
