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
}

/// `Backend4::flags`.
pub mod backend_flags {
    /// The endpoint runs on this node.
    pub const LOCAL: u8 = 1 << 0;
    /// The endpoint is serving but terminating (used only as a fallback).
    pub const TERMINATING: u8 = 1 << 1;
}

/// Key of the `LB4_SERVICES` map.
///
/// Slot 0 is the frontend entry (count, rev_nat_id, flags); slots `1..=count`
/// each name one backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Svc4Key {
    pub addr: [u8; 4],
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
    pub slot: u16,
    pub _pad: u16,
}

impl Svc4Key {
    pub const fn new(addr: [u8; 4], port: u16, proto: u8, scope: u8, slot: u16) -> Self {
        Self { addr, port, proto, scope, slot, _pad: 0 }
    }
}

/// Value of the `LB4_SERVICES` map.
///
/// On slot 0: `count`, `rev_nat_id`, `flags` and `affinity_timeout` are set and
/// `backend_id` is 0. On slot n > 0: only `backend_id` is set (plus
/// `rev_nat_id`, for readability of dumps).
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

/// Value of the `LB4_BACKENDS` map, keyed by a `u32` backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Backend4 {
    pub addr: [u8; 4],
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

/// Value of the `LB4_REVNAT` map, keyed by a `u16` rev_nat id: the frontend
/// that replies must appear to come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevNat4 {
    pub addr: [u8; 4],
    pub port: u16,
    pub _pad: u16,
}

/// Key of the `LB4_SOCK_REVNAT` LRU map: one socket's translated destination.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNat4Key {
    pub cookie: u64,
    pub addr: [u8; 4],
    pub port: u16,
    pub _pad: u16,
}

/// Value of the `LB4_SOCK_REVNAT` LRU map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNat4Value {
    pub addr: [u8; 4],
    pub port: u16,
    pub rev_nat_id: u16,
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
    pub const COUNT: u32 = 5;
    pub const NAMES: [&str; COUNT as usize] = [
        "translated",
        "refused_no_endpoints",
        "refused_no_port",
        "reversed",
        "retried",
    ];
}

/// Map names, shared by the loader, `lb-agent list` and the pin layout.
pub mod maps {
    pub const SERVICES4: &str = "LB4_SERVICES";
    pub const BACKENDS4: &str = "LB4_BACKENDS";
    pub const REVNAT4: &str = "LB4_REVNAT";
    pub const SOCK_REVNAT4: &str = "LB4_SOCK_REVNAT";
    pub const STATS: &str = "LB_STATS";
    pub const ALL: [&str; 5] = [SERVICES4, BACKENDS4, REVNAT4, SOCK_REVNAT4, STATS];
}

/// Default map capacities; the agent can override them.
pub mod capacity {
    pub const SERVICES: u32 = 65536;
    pub const BACKENDS: u32 = 65536;
    pub const REVNAT: u32 = 65536;
    pub const SOCK_REVNAT: u32 = 262144;
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all of these are #[repr(C)], Copy, with explicit padding fields
    // and no implicit padding; every bit pattern is valid.
    unsafe impl aya::Pod for Svc4Key {}
    unsafe impl aya::Pod for SvcValue {}
    unsafe impl aya::Pod for Backend4 {}
    unsafe impl aya::Pod for RevNat4 {}
    unsafe impl aya::Pod for SockRevNat4Key {}
    unsafe impl aya::Pod for SockRevNat4Value {}
}

// Layouts are part of the pinned-map ABI: a change must be deliberate.
const _: () = {
    assert!(core::mem::size_of::<Svc4Key>() == 12);
    assert!(core::mem::size_of::<SvcValue>() == 16);
    assert!(core::mem::size_of::<Backend4>() == 8);
    assert!(core::mem::size_of::<RevNat4>() == 8);
    assert!(core::mem::size_of::<SockRevNat4Key>() == 16);
    assert!(core::mem::size_of::<SockRevNat4Value>() == 8);
};
