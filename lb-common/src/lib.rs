//! Map keys and values shared by the BPF programs and the agent.
//!
//! Every type is `#[repr(C)]` with explicit padding, so that the layout is the
//! same on both sides and `bpftool map dump` prints named fields (the maps are
//! BTF maps). Addresses are stored in network byte order (`[u8; 4]`), ports in
//! host byte order, so that a dump reads `"port": 80`.
#![no_std]

/// IP protocol numbers used in keys.
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// `SvcKey::scope`: every backend of the service.
pub const SCOPE_ALL: u8 = 0;
/// `SvcKey::scope`: only backends on this node (internalTrafficPolicy Local).
pub const SCOPE_LOCAL: u8 = 1;

/// `SvcValue::flags` on slot 0.
pub mod svc_flags {
    /// The frontend is a "known VIP" marker (port 0, proto 0): the address is a
    /// ClusterIP, but the connect did not match any service port. Refuse.
    pub const VIP_MARKER: u16 = 1 << 0;
    /// Use the `SCOPE_LOCAL` slots (internalTrafficPolicy Local).
    pub const LOCAL_ONLY: u16 = 1 << 1;
    /// sessionAffinity ClientIP.
    pub const AFFINITY: u16 = 1 << 2;
    /// Topology hints narrowed the backends to this node's zone (display only).
    pub const TOPOLOGY: u16 = 1 << 3;
}

/// `Backend::flags`.
pub mod backend_flags {
    /// The endpoint runs on this node.
    pub const LOCAL: u8 = 1 << 0;
    /// The endpoint is serving but terminating (used only as a fallback).
    pub const TERMINATING: u8 = 1 << 1;
}

/// Key of the `LB4_SERVICES` / `LB6_SERVICES` maps (`A` is `[u8; 4]` or
/// `[u8; 16]`).
///
/// Slot 0 is the frontend entry (count, rev_nat_id, flags); slots `1..=count`
/// each name one backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SvcKey<A> {
    pub addr: A,
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
    pub slot: u16,
    pub _pad: u16,
}

pub type Svc4Key = SvcKey<[u8; 4]>;
pub type Svc6Key = SvcKey<[u8; 16]>;

impl<A> SvcKey<A> {
    pub const fn new(addr: A, port: u16, proto: u8, scope: u8, slot: u16) -> Self {
        Self { addr, port, proto, scope, slot, _pad: 0 }
    }
}

/// Value of the services maps.
///
/// On slot 0: `count`, `rev_nat_id`, `flags` and `affinity_timeout` are set and
/// `backend_id` is 0. On slot n > 0: `backend_id` (and `rev_nat_id`, for
/// readable dumps).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SvcValue {
    pub backend_id: u32,
    pub count: u16,
    pub rev_nat_id: u16,
    pub flags: u16,
    pub _pad: u16,
    /// sessionAffinity timeout in seconds (0: no affinity).
    pub affinity_timeout: u32,
}

/// Value of the backends maps, keyed by a `u32` backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Backend<A> {
    pub addr: A,
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

pub type Backend4 = Backend<[u8; 4]>;
pub type Backend6 = Backend<[u8; 16]>;

/// Value of the rev_nat maps, keyed by a `u16` rev_nat id: the frontend
/// that replies must appear to come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevNat<A> {
    pub addr: A,
    pub port: u16,
    pub _pad: u16,
}

pub type RevNat4 = RevNat<[u8; 4]>;
pub type RevNat6 = RevNat<[u8; 16]>;

/// Key of the `LB4_SOCK_REVNAT` LRU map: one socket's translated destination.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNat4Key {
    pub cookie: u64,
    pub addr: [u8; 4],
    pub port: u16,
    pub _pad: u16,
}

/// Key of the `LB6_SOCK_REVNAT` LRU map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNat6Key {
    pub cookie: u64,
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad: u16,
    pub _pad2: u32,
}

/// Value of the socket rev_nat LRU maps: the frontend a socket asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNatValue<A> {
    pub addr: A,
    pub port: u16,
    pub rev_nat_id: u16,
}

pub type SockRevNat4Value = SockRevNatValue<[u8; 4]>;
pub type SockRevNat6Value = SockRevNatValue<[u8; 16]>;

/// `AffinityKey::family` / `AffinityMatchKey::family`.
pub const FAMILY_V4: u8 = 4;
pub const FAMILY_V6: u8 = 6;

/// Key of the `LB_AFFINITY` LRU map: one client (a network namespace, i.e.
/// one pod or the node) and one frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct AffinityKey {
    pub netns_cookie: u64,
    pub rev_nat_id: u16,
    pub family: u8,
    pub _pad: [u8; 5],
}

/// Value of the `LB_AFFINITY` LRU map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct AffinityValue {
    /// bpf_ktime_get_ns() of the last connect that used this entry.
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub _pad: u32,
}

/// Key of the `LB_AFFINITY_MATCH` hash map: backend `backend_id` is one of
/// the backends of frontend `rev_nat_id`. An affinity entry counts only while
/// its pair is here. The value is unused (0).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct AffinityMatchKey {
    pub backend_id: u32,
    pub rev_nat_id: u16,
    pub family: u8,
    pub _pad: u8,
}

/// Indexes of the per-CPU `LB_STATS` array.
pub mod stats {
    /// connect/sendmsg rewritten to a backend.
    pub const TRANSLATED: u32 = 0;
    /// Refused: the service has no endpoints.
    pub const REFUSED_NO_ENDPOINTS: u32 = 1;
    /// Refused: a ClusterIP on a port that is no service port.
    pub const REFUSED_NO_PORT: u32 = 2;
    /// Replies whose source was rewritten back to the frontend (recvmsg).
    pub const REVERSED: u32 = 3;
    /// A lookup failed in the middle of a concurrent update and was retried.
    pub const RETRIED: u32 = 4;
    /// Refused with EHOSTUNREACH: internalTrafficPolicy Local, no local endpoint.
    pub const UNREACH_NO_LOCAL: u32 = 5;
    /// A connect that reused its client's affine backend.
    pub const AFFINITY_HIT: u32 = 6;
    pub const COUNT: u32 = 7;
    pub const NAMES: [&str; COUNT as usize] = [
        "translated",
        "refused_no_endpoints",
        "refused_no_port",
        "reversed",
        "retried",
        "unreachable_no_local",
        "affinity_hit",
    ];
}

/// Map names, shared by the loader, `lb-agent list` and the pin layout.
pub mod maps {
    pub const SERVICES4: &str = "LB4_SERVICES";
    pub const BACKENDS4: &str = "LB4_BACKENDS";
    pub const REVNAT4: &str = "LB4_REVNAT";
    pub const SOCK_REVNAT4: &str = "LB4_SOCK_REVNAT";
    pub const SERVICES6: &str = "LB6_SERVICES";
    pub const BACKENDS6: &str = "LB6_BACKENDS";
    pub const REVNAT6: &str = "LB6_REVNAT";
    pub const SOCK_REVNAT6: &str = "LB6_SOCK_REVNAT";
    pub const AFFINITY: &str = "LB_AFFINITY";
    pub const AFFINITY_MATCH: &str = "LB_AFFINITY_MATCH";
    pub const STATS: &str = "LB_STATS";
    pub const ALL: [&str; 11] = [
        SERVICES4, BACKENDS4, REVNAT4, SOCK_REVNAT4, SERVICES6, BACKENDS6, REVNAT6, SOCK_REVNAT6,
        AFFINITY, AFFINITY_MATCH, STATS,
    ];
}

/// Default map capacities; the agent can override them.
pub mod capacity {
    pub const SERVICES: u32 = 65536;
    pub const BACKENDS: u32 = 65536;
    pub const REVNAT: u32 = 65536;
    pub const SOCK_REVNAT: u32 = 262144;
    pub const AFFINITY: u32 = 65536;
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all of these are #[repr(C)], Copy, with explicit padding fields
    // and no implicit padding; every bit pattern is valid.
    unsafe impl aya::Pod for Svc4Key {}
    unsafe impl aya::Pod for Svc6Key {}
    unsafe impl aya::Pod for SvcValue {}
    unsafe impl aya::Pod for Backend4 {}
    unsafe impl aya::Pod for Backend6 {}
    unsafe impl aya::Pod for RevNat4 {}
    unsafe impl aya::Pod for RevNat6 {}
    unsafe impl aya::Pod for SockRevNat4Key {}
    unsafe impl aya::Pod for SockRevNat6Key {}
    unsafe impl aya::Pod for SockRevNat4Value {}
    unsafe impl aya::Pod for SockRevNat6Value {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for AffinityMatchKey {}
}

// Layouts are part of the pinned-map ABI: a change must be deliberate.
const _: () = {
    assert!(core::mem::size_of::<Svc4Key>() == 12);
    assert!(core::mem::size_of::<SvcValue>() == 16);
    assert!(core::mem::size_of::<Backend4>() == 8);
    assert!(core::mem::size_of::<RevNat4>() == 8);
    assert!(core::mem::size_of::<SockRevNat4Key>() == 16);
    assert!(core::mem::size_of::<SockRevNat4Value>() == 8);
    assert!(core::mem::size_of::<Svc6Key>() == 24);
    assert!(core::mem::size_of::<Backend6>() == 20);
    assert!(core::mem::size_of::<RevNat6>() == 20);
    assert!(core::mem::size_of::<SockRevNat6Key>() == 32);
    assert!(core::mem::size_of::<SockRevNat6Value>() == 20);
    assert!(core::mem::size_of::<AffinityKey>() == 16);
    assert!(core::mem::size_of::<AffinityValue>() == 16);
    assert!(core::mem::size_of::<AffinityMatchKey>() == 8);
};
