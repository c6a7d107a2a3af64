//! Turns the desired frontends into map contents and applies the difference
//! in an order that never lets a concurrent connect fail or reach a deleted
//! backend.
//!
//! The order (DESIGN.md):
//! 1. add new backends and rev_nat entries;
//! 2. write the slots, then switch the count in slot 0;
//! 3. delete slot 0 of removed frontends, then surplus slots;
//! 4. delete rev_nat entries and backends nothing references any more.
//!
//! Every prefix of a plan is a consistent state, so a plan that stops half
//! way (a full map, say) leaves every frontend either old or new, never
//! broken. The planning is pure and tested without a kernel.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use lb_common::{
    AffinityMatchKey, Backend, FAMILY_V4, FAMILY_V6, PROTO_TCP, PROTO_UDP, RevNat, SCOPE_ALL,
    SCOPE_LOCAL, SvcKey, SvcValue, backend_flags, svc_flags,
};

use crate::model::{self, Desired, Proto, ServiceRef};

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
    pub fn frontend_count(&self) -> usize {
        self.services
            .iter()
            .filter(|(k, v)| k.slot == 0 && k.scope == SCOPE_ALL && v.flags & svc_flags::VIP_MARKER == 0)
            .count()
    }
}

pub fn proto_num(p: Proto) -> u8 {
    match p {
        Proto::Tcp => PROTO_TCP,
        Proto::Udp => PROTO_UDP,
    }
}

/// What the target table was built from, to name a Service in errors.
#[derive(Clone, Debug, Default)]
pub struct Target<A> {
    pub table: Table<A>,
    /// `(addr, port, proto)` of each frontend -> the Service it belongs to.
    pub owners: HashMap<(A, u16, u8), ServiceRef>,
    /// Frontends left out, with the reason.
    pub left_out: Vec<String>,
}

/// Where id allocation goes on from, kept across syncs so that a freed id
/// is not handed out again at once (which makes dumps easier to follow).
#[derive(Clone, Copy, Debug, Default)]
pub struct Cursors {
    pub backend: u32,
    pub revnat: u32,
}

/// Hands out ids that are not in use, going round from a cursor.
struct IdAlloc {
    used: BTreeSet<u32>,
    next: u32,
    max: u32,
}

impl IdAlloc {
    fn new(used: impl IntoIterator<Item = u32>, cursor: u32, max: u32) -> Self {
        let used: BTreeSet<u32> = used.into_iter().collect();
        let after_max = used.last().map_or(1, |m| m.wrapping_add(1));
        Self { used, next: cursor.max(after_max), max }
    }

    fn take(&mut self) -> Option<u32> {
        if self.used.len() as u64 >= self.max as u64 {
            return None;
        }
        loop {
            if self.next == 0 || self.next > self.max {
                self.next = 1;
            }
            let id = self.next;
            self.next += 1;
            if self.used.insert(id) {
                return Some(id);
            }
        }
    }
}

/// Build the map contents of family `A` for `desired`, reusing the ids of
/// `current` wherever the same backend or frontend already has one.
pub fn build<A: Addr>(desired: &Desired, current: &Table<A>, cursors: &mut Cursors) -> Target<A> {
    let mut t = Target { table: Table::default(), owners: HashMap::new(), left_out: Vec::new() };

    // Backend identity is (addr, port, proto); flags may change in place.
    let mut backend_ids: HashMap<(A, u16, u8), u32> = current
        .backends
        .iter()
        .map(|(id, b)| ((b.addr, b.port, b.proto), *id))
        .collect();
    let mut revnat_ids: HashMap<(A, u16), u16> =
        current.revnat.iter().map(|(id, r)| ((r.addr, r.port), *id)).collect();
    let mut backend_alloc = IdAlloc::new(current.backends.keys().copied(), cursors.backend, u32::MAX);
    let mut revnat_alloc =
        IdAlloc::new(current.revnat.keys().map(|k| *k as u32), cursors.revnat, u16::MAX as u32);

    for (key, front) in &desired.frontends {
        let Some(addr) = A::from_ip(key.addr) else { continue };
        let proto = proto_num(key.proto);
        t.owners.insert((addr, key.port, proto), front.service.clone());

        let rev_nat_id = match revnat_ids.get(&(addr, key.port)) {
            Some(id) => *id,
            None => {
                let Some(id) = revnat_alloc.take() else {
                    t.left_out.push(format!("Service {}: {key}: no free rev_nat id", front.service));
                    continue;
                };
                revnat_ids.insert((addr, key.port), id as u16);
                id as u16
            }
        };
        t.table.revnat.insert(rev_nat_id, RevNat { addr, port: key.port, _pad: 0 });

        let affinity = front.affinity_timeout.is_some();
        let mut slots_for = |backends: &[model::Backend], scope: u8, t: &mut Target<A>| -> u16 {
            let mut n = 0u16;
            for b in backends {
                let Some(baddr) = A::from_ip(b.addr) else { continue };
                let ident = (baddr, b.port, proto);
                let id = match backend_ids.get(&ident) {
                    Some(id) => *id,
                    None => {
                        let id = backend_alloc.take().expect("u32 ids do not run out");
                        backend_ids.insert(ident, id);
                        id
                    }
                };
                let mut flags = 0;
                if b.local {
                    flags |= backend_flags::LOCAL;
                }
                if b.terminating {
                    flags |= backend_flags::TERMINATING;
                }
                t.table.backends.insert(id, Backend { addr: baddr, port: b.port, proto, flags });
                if affinity {
                    t.table.affinity_match.insert(AffinityMatchKey {
                        backend_id: id,
                        rev_nat_id,
                        family: A::FAMILY,
                        _pad: 0,
                    });
                }
                n += 1;
                t.table.services.insert(
                    SvcKey::new(addr, key.port, proto, scope, n),
                    SvcValue { backend_id: id, rev_nat_id, ..Default::default() },
                );
            }
            n
        };

        let count = slots_for(&front.backends, SCOPE_ALL, &mut t);
        let mut flags = 0;
        if front.local_only {
            flags |= svc_flags::LOCAL_ONLY;
        }
        if front.external {
            flags |= svc_flags::EXTERNAL;
        }
        if front.ext_local {
            flags |= svc_flags::EXT_LOCAL;
        }
        if front.no_socket {
            flags |= svc_flags::NO_SOCKET;
        }
        if !front.source_ranges.is_empty() && A::FAMILY == FAMILY_V4 {
            flags |= svc_flags::SRC_RANGE;
            for (net, len) in &front.source_ranges {
                if let Some(a) = A::from_ip(*net) {
                    t.table.src_ranges.insert((rev_nat_id, a, *len));
                }
            }
        }
        if front.local_only || front.ext_local {
            let n = slots_for(&front.local_backends, SCOPE_LOCAL, &mut t);
            t.table.services.insert(
                SvcKey::new(addr, key.port, proto, SCOPE_LOCAL, 0),
                SvcValue { count: n, rev_nat_id, ..Default::default() },
            );
        }
        if affinity {
            flags |= svc_flags::AFFINITY;
        }
        if front.topology {
            flags |= svc_flags::TOPOLOGY;
        }
        t.table.services.insert(
            SvcKey::new(addr, key.port, proto, SCOPE_ALL, 0),
            SvcValue {
                backend_id: 0,
                count,
                rev_nat_id,
                flags,
                _pad: 0,
                affinity_timeout: front.affinity_timeout.unwrap_or(0),
            },
        );
    }
    cursors.backend = backend_alloc.next;
    cursors.revnat = revnat_alloc.next;
    for vip in &desired.vips {
        if let Some(v) = A::from_ip(*vip) {
            if let Some(owner) = desired.vip_owners.get(vip) {
                t.owners.insert((v, 0, 0), owner.clone());
            }
            t.table.services.insert(
                SvcKey::new(v, 0, 0, SCOPE_ALL, 0),
                SvcValue { flags: svc_flags::VIP_MARKER, ..Default::default() },
            );
        }
    }
    t
}

fn is_marker<A>(k: &SvcKey<A>) -> bool {
    k.port == 0 && k.proto == 0
}

/// The ops that turn `current` into `target`, in the safe order.
pub fn plan<A: Addr>(current: &Table<A>, target: &Table<A>) -> Vec<Op<A>> {
    let mut ops = Vec::new();
    let changed = |k: &SvcKey<A>, v: &SvcValue| current.services.get(k) != Some(v);

    // 1. New and changed backends, new rev_nat entries.
    for (id, b) in &target.backends {
        if current.backends.get(id) != Some(b) {
            ops.push(Op::PutBackend(*id, *b));
        }
    }
    for (id, r) in &target.revnat {
        if current.revnat.get(id) != Some(r) {
            ops.push(Op::PutRevNat(*id, *r));
        }
    }
    for m in target.affinity_match.difference(&current.affinity_match) {
        ops.push(Op::PutMatch(*m));
    }
    for (id, a, l) in target.src_ranges.difference(&current.src_ranges) {
        ops.push(Op::PutRange(*id, *a, *l));
    }
    // 2. Slots before the slot 0 that counts them; node-local slot 0 before
    //    the frontend's slot 0 that points to it; VIP markers last.
    let puts = |pred: &dyn Fn(&SvcKey<A>) -> bool, ops: &mut Vec<Op<A>>| {
        for (k, v) in &target.services {
            if pred(k) && changed(k, v) {
                ops.push(Op::PutSvc(*k, *v));
            }
        }
    };
    puts(&|k| k.slot != 0, &mut ops);
    puts(&|k| k.slot == 0 && k.scope == SCOPE_LOCAL, &mut ops);
    puts(&|k| k.slot == 0 && k.scope == SCOPE_ALL && !is_marker(k), &mut ops);
    puts(&|k| is_marker(k), &mut ops);

    // 3. Deletions: a frontend's slot 0 before its slots.
    let dels = |pred: &dyn Fn(&SvcKey<A>) -> bool, ops: &mut Vec<Op<A>>| {
        for k in current.services.keys() {
            if pred(k) && !target.services.contains_key(k) {
                ops.push(Op::DelSvc(*k));
            }
        }
    };
    dels(&|k| k.slot == 0 && k.scope == SCOPE_ALL && !is_marker(k), &mut ops);
    dels(&|k| k.slot == 0 && k.scope == SCOPE_LOCAL, &mut ops);
    dels(&|k| k.slot != 0, &mut ops);
    dels(&|k| is_marker(k), &mut ops);
    for m in current.affinity_match.difference(&target.affinity_match) {
        ops.push(Op::DelMatch(*m));
    }
    for (id, a, l) in current.src_ranges.difference(&target.src_ranges) {
        ops.push(Op::DelRange(*id, *a, *l));
    }

    // 4. What nothing references any more.
    for id in current.revnat.keys() {
        if !target.revnat.contains_key(id) {
            ops.push(Op::DelRevNat(*id));
        }
    }
    for id in current.backends.keys() {
        if !target.backends.contains_key(id) {
            ops.push(Op::DelBackend(*id));
        }
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frontend, FrontendKey};

    /// What the BPF program sees when it resolves a frontend in one state.
    #[derive(Debug, PartialEq)]
    enum Seen {
        Pass,
        Refused,
        /// Every slot resolves; these backends.
        Backends(BTreeSet<([u8; 4], u16)>),
        /// Some slot or backend is missing: the program would have to retry.
        Broken(String),
    }

    fn resolve(t: &Table<[u8; 4]>, addr: [u8; 4], port: u16, proto: u8) -> Seen {
        let Some(front) = t.services.get(&SvcKey::new(addr, port, proto, SCOPE_ALL, 0)) else {
            return match t.services.get(&SvcKey::new(addr, 0, 0, SCOPE_ALL, 0)) {
                Some(_) => Seen::Refused,
                None => Seen::Pass,
            };
        };
        let (scope, n) = if front.flags & svc_flags::LOCAL_ONLY != 0 {
            match t.services.get(&SvcKey::new(addr, port, proto, SCOPE_LOCAL, 0)) {
                Some(l) => (SCOPE_LOCAL, l.count),
                None => return Seen::Broken("local slot 0 missing".into()),
            }
        } else {
            (SCOPE_ALL, front.count)
        };
        if n == 0 {
            return Seen::Refused;
        }
        let mut out = BTreeSet::new();
        for slot in 1..=n {
            let Some(s) = t.services.get(&SvcKey::new(addr, port, proto, scope, slot)) else {
                return Seen::Broken(format!("slot {slot} missing"));
            };
            let Some(b) = t.backends.get(&s.backend_id) else {
                return Seen::Broken(format!("backend {} missing", s.backend_id));
            };
            out.insert((b.addr, b.port));
        }
        Seen::Backends(out)
    }

    fn v4(s: &str) -> [u8; 4] {
        s.parse::<std::net::Ipv4Addr>().unwrap().octets()
    }

    fn desired(services: &[(&str, u16, &[&str], bool)]) -> Desired {
        let mut d = Desired::default();
        for (vip, port, backends, local_only) in services {
            let bs: Vec<model::Backend> = backends
                .iter()
                .map(|b| model::Backend { addr: b.parse().unwrap(), port: 8080, local: true, terminating: false })
                .collect();
            d.frontends.insert(
                FrontendKey { addr: vip.parse().unwrap(), port: *port, proto: Proto::Tcp },
                Frontend {
                    service: ServiceRef { namespace: "default".into(), name: vip.to_string() },
                    port_name: String::new(),
                    backends: bs.clone(),
                    local_only: *local_only,
                    local_backends: bs,
                    affinity_timeout: None,
                    topology: false,
                    external: false,
                    ext_local: false,
                    no_socket: false,
                    source_ranges: Vec::new(),
                    serving: Vec::new(),
                },
            );
            d.vips.insert(vip.parse().unwrap());
        }
        d
    }

    /// Apply every step of the plan from `a` to `b` and check, in every
    /// intermediate state, what a connect to each frontend would see.
    fn check_transition(a: &Desired, b: &Desired) -> Table<[u8; 4]> {
        let start = build::<[u8; 4]>(a, &Table::default(), &mut Cursors::default()).table;
        let target = build(b, &start, &mut Cursors::default());
        let ops = plan(&start, &target.table);
        let fronts: BTreeSet<([u8; 4], u16)> = a
            .frontends
            .keys()
            .chain(b.frontends.keys())
            .map(|k| (v4(&k.addr.to_string()), k.port))
            .collect();
        let allowed = |d: &Desired, addr: [u8; 4], port: u16| -> Option<BTreeSet<([u8; 4], u16)>> {
            d.frontends
                .iter()
                .find(|(k, _)| v4(&k.addr.to_string()) == addr && k.port == port)
                .map(|(_, f)| {
                    let bs = if f.local_only { &f.local_backends } else { &f.backends };
                    bs.iter().map(|b| (v4(&b.addr.to_string()), b.port)).collect()
                })
        };
        let mut t = start.clone();
        for (i, op) in std::iter::once(None).chain(ops.iter().map(Some)).enumerate() {
            if let Some(op) = op {
                t.apply(op);
            }
            for (addr, port) in &fronts {
                let seen = resolve(&t, *addr, *port, PROTO_TCP);
                let old = allowed(a, *addr, *port);
                let new = allowed(b, *addr, *port);
                match &seen {
                    Seen::Broken(why) => panic!("step {i} ({op:?}): {addr:?}:{port} broken: {why}"),
                    Seen::Backends(got) => {
                        let ok: BTreeSet<_> =
                            old.iter().chain(new.iter()).flatten().copied().collect();
                        assert!(got.is_subset(&ok), "step {i}: {addr:?}:{port} reaches {got:?}, allowed {ok:?}");
                    }
                    Seen::Pass | Seen::Refused => {
                        // Only acceptable when the frontend is absent or empty
                        // on at least one side of the transition.
                        let empty = |s: &Option<BTreeSet<_>>| s.as_ref().is_none_or(|s| s.is_empty());
                        assert!(empty(&old) || empty(&new), "step {i} ({op:?}): {addr:?}:{port} {seen:?} while both sides have backends");
                    }
                }
            }
        }
        assert_eq!(t, target.table, "the plan reaches the target");
        // Nothing is left that no slot references.
        let referenced: BTreeSet<u32> = t.services.iter().filter(|(k, _)| k.slot != 0).map(|(_, v)| v.backend_id).collect();
        assert_eq!(referenced, t.backends.keys().copied().collect());
        t
    }

    const A: &str = "10.0.0.1";
    const B: &str = "10.0.0.2";
    const C: &str = "10.0.0.3";
    const D: &str = "10.0.0.4";

    #[test]
    fn transitions_are_safe_at_every_step() {
        let cases: Vec<(Desired, Desired)> = vec![
            (desired(&[]), desired(&[("10.96.0.1", 80, &[A, B, C], false)])),
            (desired(&[("10.96.0.1", 80, &[A, B, C], false)]), desired(&[("10.96.0.1", 80, &[B], false)])),
            (desired(&[("10.96.0.1", 80, &[B], false)]), desired(&[("10.96.0.1", 80, &[A, B, C], false)])),
            (desired(&[("10.96.0.1", 80, &[A, B, C], false)]), desired(&[("10.96.0.1", 80, &[D], false)])),
            (desired(&[("10.96.0.1", 80, &[A, B], false)]), desired(&[("10.96.0.1", 80, &[], false)])),
            (desired(&[("10.96.0.1", 80, &[], false)]), desired(&[("10.96.0.1", 80, &[A], false)])),
            (desired(&[("10.96.0.1", 80, &[A, B], false)]), desired(&[])),
            (desired(&[("10.96.0.1", 80, &[A, B], false)]), desired(&[("10.96.0.1", 80, &[A, B], true)])),
            (desired(&[("10.96.0.1", 80, &[A, B], true)]), desired(&[("10.96.0.1", 80, &[C], false)])),
            (desired(&[("10.96.0.1", 80, &[A], true)]), desired(&[("10.96.0.1", 80, &[A, B, C], true)])),
            (desired(&[("10.96.0.1", 80, &[A, B, C], true)]), desired(&[("10.96.0.1", 80, &[D], true)])),
            (
                desired(&[("10.96.0.1", 80, &[A, B], false), ("10.96.0.2", 53, &[A], false)]),
                desired(&[("10.96.0.2", 53, &[C, D], false), ("10.96.0.3", 80, &[B], false)]),
            ),
        ];
        for (a, b) in &cases {
            check_transition(a, b);
            check_transition(b, a);
        }
    }

    #[test]
    fn ids_are_reused_for_unchanged_backends() {
        let a = desired(&[("10.96.0.1", 80, &[A, B], false)]);
        let c = &mut Cursors::default();
        let t1 = build::<[u8; 4]>(&a, &Table::default(), c).table;
        let b = desired(&[("10.96.0.1", 80, &[A, B, C], false), ("10.96.0.2", 80, &[A], false)]);
        let t2 = build(&b, &t1, c).table;
        for (id, be) in &t1.backends {
            assert_eq!(t2.backends.get(id), Some(be));
        }
        assert_eq!(t2.backends.len(), 3, "A is shared by both services");
        // Same input again: nothing to do.
        assert!(plan(&t2, &build(&b, &t2, c).table).is_empty());
    }

    #[test]
    fn freed_ids_are_not_reused_at_once() {
        let c = &mut Cursors::default();
        let t1 = build::<[u8; 4]>(&desired(&[("10.96.0.1", 80, &[A, B], false)]), &Table::default(), c).table;
        let t2 = build(&desired(&[("10.96.0.1", 80, &[A], false)]), &t1, c).table;
        let t3 = build(&desired(&[("10.96.0.1", 80, &[A, C], false)]), &t2, c).table;
        let id_b = t1.backends.iter().find(|(_, b)| b.addr == v4(B)).unwrap().0;
        let id_c = t3.backends.iter().find(|(_, b)| b.addr == v4(C)).unwrap().0;
        assert_ne!(id_b, id_c);
    }

    #[test]
    fn layout_of_one_service() {
        let mut d = desired(&[("10.96.0.10", 80, &[A, B], false)]);
        d.frontends.values_mut().next().unwrap().affinity_timeout = Some(60);
        let t = build::<[u8; 4]>(&d, &Table::default(), &mut Cursors::default()).table;
        let s0 = t.services[&SvcKey::new(v4("10.96.0.10"), 80, PROTO_TCP, SCOPE_ALL, 0)];
        assert_eq!(s0.count, 2);
        assert_eq!(s0.flags, svc_flags::AFFINITY);
        assert_eq!(s0.affinity_timeout, 60);
        assert_eq!(t.revnat[&s0.rev_nat_id], RevNat { addr: v4("10.96.0.10"), port: 80, _pad: 0 });
        let marker = t.services[&SvcKey::new(v4("10.96.0.10"), 0, 0, SCOPE_ALL, 0)];
        assert_eq!(marker.flags, svc_flags::VIP_MARKER);
        assert_eq!(t.frontend_count(), 1);
        assert_eq!(
            resolve(&t, v4("10.96.0.10"), 80, PROTO_TCP),
            Seen::Backends([(v4(A), 8080), (v4(B), 8080)].into())
        );
        assert_eq!(resolve(&t, v4("10.96.0.10"), 81, PROTO_TCP), Seen::Refused);
        assert_eq!(resolve(&t, v4("10.96.0.11"), 80, PROTO_TCP), Seen::Pass);
    }

    #[test]
    fn each_family_gets_its_own_table() {
        let d = desired(&[("fd00::1", 80, &["fd00::2"], false), ("10.96.0.1", 80, &[A], false)]);
        let t4 = build::<[u8; 4]>(&d, &Table::default(), &mut Cursors::default()).table;
        let t6 = build::<[u8; 16]>(&d, &Table::default(), &mut Cursors::default()).table;
        assert_eq!(t4.frontend_count(), 1);
        assert_eq!(t6.frontend_count(), 1);
        let b6: Vec<_> = t6.backends.values().map(|b| b.addr).collect();
        assert_eq!(b6, ["fd00::2".parse::<std::net::Ipv6Addr>().unwrap().octets()]);
    }

    #[test]
    fn affinity_match_entries_follow_the_backends() {
        let mut a = desired(&[("10.96.0.1", 80, &[A, B], false)]);
        a.frontends.values_mut().next().unwrap().affinity_timeout = Some(30);
        let mut b = desired(&[("10.96.0.1", 80, &[B, C], false)]);
        b.frontends.values_mut().next().unwrap().affinity_timeout = Some(30);
        let c = &mut Cursors::default();
        let ta = build::<[u8; 4]>(&a, &Table::default(), c).table;
        assert_eq!(ta.affinity_match.len(), 2);
        let tb = build::<[u8; 4]>(&b, &ta, c).table;
        let ops = plan(&ta, &tb);
        // A new pair exists before a slot can name its backend; an old pair
        // goes only after no slot names it.
        let last_put_match = ops.iter().rposition(|o| matches!(o, Op::PutMatch(_))).unwrap();
        let first_del_match = ops.iter().position(|o| matches!(o, Op::DelMatch(_))).unwrap();
        let first_slot = ops.iter().position(|o| matches!(o, Op::PutSvc(..))).unwrap();
        let last_slot = ops.iter().rposition(|o| matches!(o, Op::PutSvc(..) | Op::DelSvc(_))).unwrap();
        assert!(last_put_match < first_slot && last_slot < first_del_match, "{ops:#?}");
        // Affinity off: no match entries left.
        let off = desired(&[("10.96.0.1", 80, &[B, C], false)]);
        assert!(build::<[u8; 4]>(&off, &tb, c).table.affinity_match.is_empty());
    }
}
