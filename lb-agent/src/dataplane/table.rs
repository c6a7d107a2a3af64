//! The agent's copy of one family's maps (`Table`), the writes that change
//! it (`Op`), and the address families (`Addr`).
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use lb_common::{AffinityMatchKey, Backend, FAMILY_V4, FAMILY_V6, PROTO_TCP, PROTO_UDP, RevNat, SvcKey, SvcValue};

use crate::model::Proto;

/// An address family, by the byte array its maps store addresses in.
pub trait Addr: Copy + Ord + std::hash::Hash + std::fmt::Debug + Default + Send + Sync + 'static {
    const FAMILY: u8;
    const NAME: &'static str;
    fn from_ip(ip: IpAddr) -> Option<Self>;
    fn to_ip(self) -> IpAddr;
}

impl Addr for [u8; 4] {
    const FAMILY: u8 = FAMILY_V4;
    const NAME: &'static str = "IPv4";
    fn from_ip(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V4(a) => Some(a.octets()),
            IpAddr::V6(_) => None,
        }
    }
    fn to_ip(self) -> IpAddr {
        IpAddr::from(self)
    }
}

impl Addr for [u8; 16] {
    const FAMILY: u8 = FAMILY_V6;
    const NAME: &'static str = "IPv6";
    fn from_ip(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V6(a) => Some(a.octets()),
            IpAddr::V4(_) => None,
        }
    }
    fn to_ip(self) -> IpAddr {
        IpAddr::from(self)
    }
}

/// The exact contents of the maps the agent owns, for one family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table<A> {
    pub services: BTreeMap<SvcKey<A>, SvcValue>,
    pub backends: BTreeMap<u32, Backend<A>>,
    pub revnat: BTreeMap<u16, RevNat<A>>,
    /// (rev_nat_id, backend_id) pairs of frontends with sessionAffinity.
    pub affinity_match: BTreeSet<AffinityMatchKey>,
    /// loadBalancerSourceRanges: (rev_nat_id, network, prefix length). IPv4
    /// only: the TC path is IPv4.
    pub src_ranges: BTreeSet<(u16, A, u8)>,
}

/// How many entries of `a` and `b` differ: in one and not the other, or
/// with another value.
pub fn drift<A: Ord + Copy>(a: &Table<A>, b: &Table<A>) -> usize {
    fn maps<K: Ord, V: PartialEq>(x: &BTreeMap<K, V>, y: &BTreeMap<K, V>) -> usize {
        x.iter().filter(|(k, v)| y.get(k) != Some(v)).count() + y.keys().filter(|k| !x.contains_key(k)).count()
    }
    fn sets<K: Ord>(x: &BTreeSet<K>, y: &BTreeSet<K>) -> usize {
        x.symmetric_difference(y).count()
    }
    maps(&a.services, &b.services)
        + maps(&a.backends, &b.backends)
        + maps(&a.revnat, &b.revnat)
        + sets(&a.affinity_match, &b.affinity_match)
        + sets(&a.src_ranges, &b.src_ranges)
}

/// One map write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op<A> {
    PutBackend(u32, Backend<A>),
    PutRevNat(u16, RevNat<A>),
    PutMatch(AffinityMatchKey),
    PutRange(u16, A, u8),
    PutSvc(SvcKey<A>, SvcValue),
    DelSvc(SvcKey<A>),
    DelMatch(AffinityMatchKey),
    DelRange(u16, A, u8),
    DelRevNat(u16),
    DelBackend(u32),
}

impl<A: Addr> Table<A> {
    /// Apply one op to this in-memory mirror.
    pub fn apply(&mut self, op: &Op<A>) {
        match *op {
            Op::PutBackend(id, b) => {
                self.backends.insert(id, b);
            }
            Op::PutRevNat(id, r) => {
                self.revnat.insert(id, r);
            }
            Op::PutSvc(k, v) => {
                self.services.insert(k, v);
            }
            Op::DelSvc(k) => {
                self.services.remove(&k);
            }
            Op::DelRevNat(id) => {
                self.revnat.remove(&id);
            }
            Op::DelBackend(id) => {
                self.backends.remove(&id);
            }
            Op::PutMatch(m) => {
                self.affinity_match.insert(m);
            }
            Op::DelMatch(m) => {
                self.affinity_match.remove(&m);
            }
            Op::PutRange(id, a, l) => {
                self.src_ranges.insert((id, a, l));
            }
            Op::DelRange(id, a, l) => {
                self.src_ranges.remove(&(id, a, l));
            }
        }
    }

    /// Number of frontends (slot-0 entries of scope "all", without VIP markers).
    #[cfg(test)]
    pub fn frontend_count(&self) -> usize {
        self.services
            .iter()
            .filter(|(k, v)| k.slot == 0 && k.scope == lb_common::SCOPE_ALL && v.flags & lb_common::svc_flags::VIP_MARKER == 0)
            .count()
    }
}

pub fn proto_num(p: Proto) -> u8 {
    match p {
        Proto::Tcp => PROTO_TCP,
        Proto::Udp => PROTO_UDP,
    }
}
