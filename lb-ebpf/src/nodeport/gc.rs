//! The NAT tables' own expiry while no agent runs. The tables are plain
//! hash maps (a flow's two entries live and die together, no LRU evicts
//! one), which the agent's NAT thread expires. Without an agent (a crash
//! loop, a rollout's image pull, a node whose agent cannot reach the API
//! server and exits) nothing would, and a node taking new outside flows
//! would fill them within minutes, then refuse new flows. conntrack
//! expires in the kernel; so does this.
//!
//! A timer (`LB_NAT_TIMER`, armed by the agent through `lb_nat_gc_arm`,
//! which it runs once with BPF_PROG_TEST_RUN) fires every second. While
//! the agent's heartbeat (`NatGc`, written by its NAT thread every
//! second) is fresh it does nothing more. Once it is older than
//! `stale_ns`, the timer walks both tables every `interval_ns` and removes
//! the flows that expired by the agent's rules (`lb_common::nat_expired`,
//! `nat_expired_dsr`, with the agent's timeouts): both entries of a flow,
//! the reply entry first. A table under pressure (new flows refused) is
//! walked at once and its unassured flows idle for a second dropped, as
//! the agent's early drop does. What only the agent knows (which
//! endpoints left: their flows are not ended) waits for an agent.
//! The timer lives as long as the pinned maps: `lb-agent teardown`
//! unpinning them cancels it.
use core::ffi::c_void;

use aya_ebpf::{
    btf_maps::Array,
    helpers::{bpf_for_each_map_elem, bpf_ktime_get_ns, bpf_timer_init, bpf_timer_set_callback, bpf_timer_start},
    macros::{btf_map, classifier},
    programs::TcContext,
};
use lb_common::{NatEntry, NatGc, NatKey, NatTimeouts, NatTimer, nat_expired, nat_expired_dsr, nat_flags, stats};

use super::{A4, A6, LB4_NAT, LB6_NAT};

#[btf_map]
static LB_NAT_GC: Array<NatGc, 1> = Array::new();
#[btf_map]
static LB_NAT_TIMER: Array<NatTimer, 1> = Array::new();

const CLOCK_MONOTONIC: u64 = 1;
const EBUSY: i64 = 16;
/// How often the timer looks at the agent's heartbeat.
const LOOK_NS: u64 = 1_000_000_000;

/// Arm the timer (or take it over from an earlier agent's programs: the
/// callback becomes this load's). Returns 0, or the step that failed
/// (1: no element; 2 init, 3 callback, 4 start: times 256, plus the errno).
#[classifier]
pub fn lb_nat_gc_arm(_ctx: TcContext) -> i32 {
    let Some(t) = LB_NAT_TIMER.get_ptr_mut(0) else { return 1 };
    // SAFETY: a map value, alive while the map is (RCU for this run).
    let timer = unsafe { core::ptr::addr_of_mut!((*t).timer) }.cast();
    let map = core::ptr::addr_of!(LB_NAT_TIMER).cast_mut().cast();
    let r = unsafe { bpf_timer_init(timer, map, CLOCK_MONOTONIC) };
    if r != 0 && r != -EBUSY {
        return 2 * 256 + (-r) as i32;
    }
    let r = unsafe { bpf_timer_set_callback(timer, tick as *const () as *mut c_void) };
    if r != 0 {
        return 3 * 256 + (-r) as i32;
    }
    let r = unsafe { bpf_timer_start(timer, LOOK_NS, 0) };
    if r != 0 {
        return 4 * 256 + (-r) as i32;
    }
    0
}

/// A new flow of family `family` (`F::ID`) was refused (counted as
/// `nat_failed` too): the timer's early drop of that table starts at its
/// next look.
#[inline(always)]
pub(super) fn refused(family: u8) {
    use core::intrinsics::{AtomicOrdering::Relaxed, atomic_xadd};
    if let Some(t) = LB_NAT_TIMER.get_ptr_mut(0) {
        // SAFETY: a map value, alive for this run; other CPUs add to it
        // at the same time, hence the atomic add.
        let count = if family == lb_common::FAMILY_V6 { unsafe { core::ptr::addr_of_mut!((*t).refused6) } } else { unsafe { core::ptr::addr_of_mut!((*t).refused) } };
        unsafe { atomic_xadd::<u64, u64, { Relaxed }>(count, 1) };
    }
}

/// What a walk carries to each entry, and what it counts in a table.
#[repr(C)]
struct Walk {
    now: u64,
    t: NatTimeouts,
    /// Entries the walk left in the table (a flow's two counted at its
    /// forward entry).
    kept: u64,
    /// Flows it removed.
    expired: u64,
}

/// Under pressure, how long an unassured flow may be idle (the agent's
/// `EARLY_DROP_IDLE`).
const EARLY_DROP_IDLE_NS: u64 = 1_000_000_000;

/// Whether a table of `capacity` that a walk left holding `kept` entries
/// is still 90% full (the agent's rule).
#[inline(always)]
fn nearly_full(kept: u64, capacity: u64) -> bool {
    kept * 10 >= capacity * 9
}

/// The timer: walk the tables when the agent's heartbeat is stale, then
/// fire again in a second. One table a look at most (each walk visits
/// every bucket of its table in softirq: the longest stall is one
/// table's): a round every `interval_ns` (at least every 2 s), the IPv4
/// table at one look and the IPv6 one at a later one; a table whose new
/// flows were refused since the last look (`refused`: full, no free SNAT
/// port) at the next look (or the one after, where a round's IPv6 walk or
/// the other table's early walk takes that one), as the agent's early
/// drop does (unassured flows idle for a second go), and again while such
/// walks drop flows and leave it 90% full. Where both tables are due, the
/// one the last walk did not take (neither starves).
#[inline(never)]
extern "C" fn tick(_map: *mut c_void, _key: *mut u32, t: *mut NatTimer) -> i64 {
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: the timer's own map value, alive for this run.
    unsafe { (*t).last_look_ns = now };
    if let Some(cfg) = LB_NAT_GC.get_ptr(0) {
        // SAFETY: map values, alive for this run.
        let (cfg, t) = unsafe { (*cfg, &mut *t) };
        let seen4 = unsafe { core::ptr::read_volatile(core::ptr::addr_of!(t.refused)) };
        let seen6 = unsafe { core::ptr::read_volatile(core::ptr::addr_of!(t.refused6)) };
        // The tables due an early walk: under pressure, or refusing since
        // the last look (kept until walked: one table a look).
        let early = t.pressure | (seen4 != t.refused_seen) as u64 | ((seen6 != t.refused6_seen) as u64) << 1;
        let (early4, early6) = (early & 1 != 0, early & 2 != 0);
        (t.refused_seen, t.refused6_seen) = (seen4, seen6);
        t.pressure = early;
        if cfg.interval_ns != 0 && now.saturating_sub(cfg.heartbeat_ns) > cfg.stale_ns {
            let round = t.v6_next == 0 && now.saturating_sub(t.round_ns) >= cfg.interval_ns;
            let (due4, due6) = (early4 || round, early6 || t.v6_next != 0);
            if due4 || due6 {
                let v6 = due6 && (!due4 || t.last_table == 0);
                let early = if v6 { early6 } else { early4 };
                let mut w = Walk { now, t: cfg.timeouts, kept: 0, expired: 0 };
                if early && w.t.unreplied_ns > EARLY_DROP_IDLE_NS {
                    w.t.unreplied_ns = EARLY_DROP_IDLE_NS;
                }
                let (kept, expired) = if v6 { walk6_all(&mut w) } else { walk4_all(&mut w) };
                // Still under pressure: it dropped flows and left the
                // table 90% full.
                let bit = if v6 { 2 } else { 1 };
                let spell = early && expired > 0 && nearly_full(kept, cfg.capacity);
                t.pressure = if spell { t.pressure | bit } else { t.pressure & !bit };
                if v6 {
                    t.v6_next = 0;
                } else if round {
                    t.round_ns = now;
                    t.v6_next = 1;
                }
                t.last_table = v6 as u64;
                t.last_walk_ns = now;
                t.last_walk_took_ns = unsafe { bpf_ktime_get_ns() }.saturating_sub(now);
                crate::lb::event(stats::NAT_WALKS_WITHOUT_AGENT);
                crate::lb::events(stats::NAT_EXPIRED_WITHOUT_AGENT, expired);
            }
        } else {
            // (A round's IPv6 walk still waits: at the next stale look.)
            t.pressure = 0;
        }
    }
    unsafe { bpf_timer_start(core::ptr::addr_of_mut!((*t).timer).cast(), LOOK_NS, 0) };
    0
}

/// Walk the whole IPv4 table: (entries kept, flows expired).
#[inline(always)]
fn walk4_all(w: &mut Walk) -> (u64, u64) {
    (w.kept, w.expired) = (0, 0);
    unsafe { bpf_for_each_map_elem(core::ptr::addr_of!(LB4_NAT).cast_mut().cast(), walk4 as *const () as *mut c_void, (w as *mut Walk).cast(), 0) };
    (w.kept, w.expired)
}

/// The same for the IPv6 table.
#[inline(always)]
fn walk6_all(w: &mut Walk) -> (u64, u64) {
    (w.kept, w.expired) = (0, 0);
    unsafe { bpf_for_each_map_elem(core::ptr::addr_of!(LB6_NAT).cast_mut().cast(), walk6 as *const () as *mut c_void, (w as *mut Walk).cast(), 0) };
    (w.kept, w.expired)
}

/// One entry of a walk: remove its flow if it expired. A reply entry is
/// judged with its forward entry (skipped while that one is there), a DSR
/// entry on its own.
macro_rules! walk_fn {
    ($name:ident, $a:ty, $map:ident) => {
        #[inline(never)]
        extern "C" fn $name(_map: *mut c_void, k: *mut NatKey<$a>, e: *mut NatEntry<$a>, w: *mut Walk) -> i64 {
            // SAFETY: the helper's key, value and context, alive for this call.
            let (k, e, w) = unsafe { (*k, *e, &mut *w) };
            let proto = k.proto;
            if e.flags & nat_flags::DSR != 0 {
                if nat_expired_dsr(proto, &e, w.now, &w.t) {
                    let _ = $map.remove(&k);
                    w.expired += 1;
                } else {
                    w.kept += 1;
                }
                return 0;
            }
            let other = e.other_key(proto);
            // The other half only if its rewrite leads back here (a key
            // that lost its half may have been taken by a new flow).
            let partner = match $map.get_ptr(&other) {
                Some(p) => {
                    let o = unsafe { *p };
                    if o.other_key(proto) == k { Some(o) } else { None }
                }
                None => None,
            };
            if e.flags & nat_flags::REPLY != 0 {
                // An orphaned reply entry (its flow half-removed).
                if partner.is_none() {
                    if nat_expired(proto, &e, None, w.now, &w.t) {
                        let _ = $map.remove(&k);
                    } else {
                        w.kept += 1;
                    }
                }
                return 0;
            }
            if nat_expired(proto, &e, partner.as_ref(), w.now, &w.t) {
                // The reply entry first: a packet never finds a forward
                // entry without its reply entry.
                if partner.is_some() {
                    let _ = $map.remove(&other);
                }
                let _ = $map.remove(&k);
                w.expired += 1;
            } else {
                w.kept += 1 + partner.is_some() as u64;
            }
            0
        }
    };
}
walk_fn!(walk4, A4, LB4_NAT);
walk_fn!(walk6, A6, LB6_NAT);
