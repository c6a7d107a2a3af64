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
use std::collections::{BTreeMap, BTreeSet};

// foldhash: these maps are keyed by small fixed-size ids and addresses,
// hashed hundreds of thousands of times in a first sync.
use foldhash::{HashMap, HashMapExt as _};
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

/// A backend's identity: the same address, port, protocol and flags share
/// one id, whatever the frontends that use it.
type BackendIdent<A> = (A, u16, u8, u8);

/// Reverse indexes over a table, kept in step with it op by op, so that a
/// change of a few frontends needs no scan of the whole table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Index<A: Addr> {
    backend_ids: HashMap<BackendIdent<A>, u32>,
    revnat_ids: HashMap<(A, u16), u16>,
    /// How many slots point at each backend.
    backend_refs: HashMap<u32, u32>,
    frontends: usize,
}

fn is_frontend<A>(k: &SvcKey<A>, v: &SvcValue) -> bool {
    k.slot == 0 && k.scope == SCOPE_ALL && v.flags & svc_flags::VIP_MARKER == 0
}

impl<A: Addr> Index<A> {
    pub fn of(t: &Table<A>) -> Self {
        let mut ix = Index {
            backend_ids: HashMap::with_capacity(t.backends.len()),
            revnat_ids: HashMap::with_capacity(t.revnat.len()),
            backend_refs: HashMap::with_capacity(t.backends.len()),
            frontends: 0,
        };
        for (id, b) in &t.backends {
            ix.backend_ids.insert((b.addr, b.port, b.proto, b.flags), *id);
        }
        for (id, r) in &t.revnat {
            ix.revnat_ids.insert((r.addr, r.port), *id);
        }
        for (k, v) in &t.services {
            if k.slot != 0 {
                *ix.backend_refs.entry(v.backend_id).or_default() += 1;
            } else if is_frontend(k, v) {
                ix.frontends += 1;
            }
        }
        ix
    }

    /// Frontends in the table (slot 0 of scope "all", VIP markers aside).
    pub fn frontends(&self) -> usize {
        self.frontends
    }

    /// Slots that point at backend `id`.
    fn refs(&self, id: u32) -> u32 {
        self.backend_refs.get(&id).copied().unwrap_or(0)
    }

    fn unref(&mut self, id: u32) {
        if let Some(n) = self.backend_refs.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                self.backend_refs.remove(&id);
            }
        }
    }

    /// Follow `op`; call it before `t.apply(op)`.
    pub fn apply(&mut self, t: &Table<A>, op: &Op<A>) {
        match *op {
            Op::PutBackend(id, b) => {
                if let Some(old) = t.backends.get(&id) {
                    self.backend_ids.remove(&(old.addr, old.port, old.proto, old.flags));
                }
                self.backend_ids.insert((b.addr, b.port, b.proto, b.flags), id);
            }
            Op::DelBackend(id) => {
                if let Some(old) = t.backends.get(&id) {
                    self.backend_ids.remove(&(old.addr, old.port, old.proto, old.flags));
                }
            }
            Op::PutRevNat(id, r) => {
                if let Some(old) = t.revnat.get(&id) {
                    self.revnat_ids.remove(&(old.addr, old.port));
                }
                self.revnat_ids.insert((r.addr, r.port), id);
            }
            Op::DelRevNat(id) => {
                if let Some(old) = t.revnat.get(&id) {
                    self.revnat_ids.remove(&(old.addr, old.port));
                }
            }
            Op::PutSvc(k, v) => {
                let old = t.services.get(&k);
                if k.slot != 0 {
                    if let Some(o) = old {
                        self.unref(o.backend_id);
                    }
                    *self.backend_refs.entry(v.backend_id).or_default() += 1;
                } else {
                    self.frontends -= old.is_some_and(|o| is_frontend(&k, o)) as usize;
                    self.frontends += is_frontend(&k, &v) as usize;
                }
            }
            Op::DelSvc(k) => {
                if let Some(o) = t.services.get(&k) {
                    if k.slot != 0 {
                        self.unref(o.backend_id);
                    } else {
                        self.frontends -= is_frontend(&k, o) as usize;
                    }
                }
            }
            Op::PutMatch(_) | Op::DelMatch(_) | Op::PutRange(..) | Op::DelRange(..) => {}
        }
    }
}

/// Hands out ids: the one a backend or frontend already has, else one that
/// is not in use, going round from a cursor.
struct Ids<'a, A: Addr> {
    current: &'a Table<A>,
    index: &'a Index<A>,
    backends: HashMap<BackendIdent<A>, u32>,
    revnats: HashMap<(A, u16), u16>,
    taken_backends: BTreeSet<u32>,
    taken_revnats: BTreeSet<u16>,
    cursors: &'a mut Cursors,
}

impl<'a, A: Addr> Ids<'a, A> {
    fn new(current: &'a Table<A>, index: &'a Index<A>, cursors: &'a mut Cursors) -> Self {
        // A fresh cursor starts after the highest id in use.
        if cursors.backend == 0 {
            cursors.backend = current.backends.keys().next_back().map_or(1, |m| m.wrapping_add(1));
        }
        if cursors.revnat == 0 {
            cursors.revnat = current.revnat.keys().next_back().map_or(1, |m| *m as u32 + 1);
        }
        Self {
            current,
            index,
            backends: HashMap::new(),
            revnats: HashMap::new(),
            taken_backends: BTreeSet::new(),
            taken_revnats: BTreeSet::new(),
            cursors,
        }
    }

    fn backend(&mut self, ident: BackendIdent<A>) -> u32 {
        if let Some(id) = self.index.backend_ids.get(&ident).or_else(|| self.backends.get(&ident)) {
            return *id;
        }
        // u32 ids do not run out: the maps hold far fewer.
        loop {
            if self.cursors.backend == 0 {
                self.cursors.backend = 1;
            }
            let id = self.cursors.backend;
            self.cursors.backend = id.wrapping_add(1);
            if !self.current.backends.contains_key(&id) && self.taken_backends.insert(id) {
                self.backends.insert(ident, id);
                return id;
            }
        }
    }

    fn revnat(&mut self, addr: A, port: u16) -> Option<u16> {
        if let Some(id) = self.index.revnat_ids.get(&(addr, port)).or_else(|| self.revnats.get(&(addr, port))) {
            return Some(*id);
        }
        if self.current.revnat.len() + self.taken_revnats.len() >= u16::MAX as usize {
            return None;
        }
        loop {
            if self.cursors.revnat == 0 || self.cursors.revnat > u16::MAX as u32 {
                self.cursors.revnat = 1;
            }
            let id = self.cursors.revnat as u16;
            self.cursors.revnat += 1;
            if !self.current.revnat.contains_key(&id) && self.taken_revnats.insert(id) {
                self.revnats.insert((addr, port), id);
                return Some(id);
            }
        }
    }
}

/// A target table being built: entries collected in vectors and turned
/// into maps at once, which is several times faster than inserting them one
/// by one and leaves the maps' nodes full.
struct Builder<A: Addr> {
    services: Vec<(SvcKey<A>, SvcValue)>,
    backends: Vec<(u32, Backend<A>)>,
    revnat: Vec<(u16, RevNat<A>)>,
    affinity_match: Vec<AffinityMatchKey>,
    src_ranges: Vec<(u16, A, u8)>,
    owners: HashMap<(A, u16, u8), ServiceRef>,
    left_out: Vec<String>,
}

impl<A: Addr> Builder<A> {
    fn new() -> Self {
        Self {
            services: Vec::new(),
            backends: Vec::new(),
            revnat: Vec::new(),
            affinity_match: Vec::new(),
            src_ranges: Vec::new(),
            owners: HashMap::new(),
            left_out: Vec::new(),
        }
    }

    fn finish(self) -> Target<A> {
        Target {
            table: Table {
                services: self.services.into_iter().collect(),
                backends: self.backends.into_iter().collect(),
                revnat: self.revnat.into_iter().collect(),
                affinity_match: self.affinity_match.into_iter().collect(),
                src_ranges: self.src_ranges.into_iter().collect(),
            },
            owners: self.owners,
            left_out: self.left_out,
        }
    }
}

/// Build the map contents of family `A` for `desired`, reusing the ids of
/// `current` wherever the same backend or frontend already has one.
#[cfg(test)]
pub fn build<A: Addr>(desired: &Desired, current: &Table<A>, cursors: &mut Cursors) -> Target<A> {
    build_with(desired, current, &Index::of(current), cursors)
}

/// `build`, with the indexes of `current` at hand.
pub fn build_with<A: Addr>(desired: &Desired, current: &Table<A>, index: &Index<A>, cursors: &mut Cursors) -> Target<A> {
    let mut t = Builder::new();
    let mut ids = Ids::new(current, index, cursors);
    for (key, front) in &desired.frontends {
        add_frontend(&mut t, key, front, &mut ids);
    }
    for vip in &desired.vips {
        add_marker(&mut t, desired, *vip);
    }
    t.finish()
}

/// The map contents of the frontends on `units` (address and port: the
/// rev-NAT identity, which TCP and UDP share) and of the VIP markers of
/// `vips`, as `desired` wants them.
pub fn build_part<A: Addr>(
    desired: &Desired,
    units: &BTreeSet<(A, u16)>,
    vips: &BTreeSet<A>,
    current: &Table<A>,
    index: &Index<A>,
    cursors: &mut Cursors,
) -> Target<A> {
    let mut t = Builder::new();
    let mut ids = Ids::new(current, index, cursors);
    for (addr, port) in units {
        for proto in [Proto::Tcp, Proto::Udp] {
            let key = model::FrontendKey { addr: addr.to_ip(), port: *port, proto };
            if let Some(front) = desired.frontends.get(&key) {
                add_frontend(&mut t, &key, front, &mut ids);
            }
        }
    }
    for vip in vips {
        if desired.vips.contains(&vip.to_ip()) {
            add_marker(&mut t, desired, vip.to_ip());
        }
    }
    t.finish()
}

/// What `table` holds for the frontends on `units` and the VIP markers of
/// `vips`: the other side of `build_part`.
pub fn extract<A: Addr>(table: &Table<A>, index: &Index<A>, units: &BTreeSet<(A, u16)>, vips: &BTreeSet<A>) -> Table<A> {
    let mut part = Table::default();
    for (addr, port) in units {
        let Some(rev_nat_id) = index.revnat_ids.get(&(*addr, *port)).copied() else { continue };
        if let Some(r) = table.revnat.get(&rev_nat_id) {
            part.revnat.insert(rev_nat_id, *r);
        }
        for proto in [PROTO_TCP, PROTO_UDP] {
            for scope in [SCOPE_ALL, SCOPE_LOCAL] {
                let k0 = SvcKey::new(*addr, *port, proto, scope, 0);
                let Some(v0) = table.services.get(&k0) else { continue };
                part.services.insert(k0, *v0);
                for slot in 1..=v0.count {
                    let k = SvcKey::new(*addr, *port, proto, scope, slot);
                    if let Some(v) = table.services.get(&k) {
                        part.services.insert(k, *v);
                        if let Some(b) = table.backends.get(&v.backend_id) {
                            part.backends.insert(v.backend_id, *b);
                        }
                    }
                }
            }
        }
        // Affinity matches and source ranges belong to the rev-NAT id.
        let slots: Vec<u32> = part
            .services
            .iter()
            .filter(|(k, _)| k.addr == *addr && k.port == *port && k.slot != 0)
            .map(|(_, v)| v.backend_id)
            .collect();
        for backend_id in slots {
            let m = AffinityMatchKey { backend_id, rev_nat_id, family: A::FAMILY, _pad: 0 };
            if table.affinity_match.contains(&m) {
                part.affinity_match.insert(m);
            }
        }
        for r in table.src_ranges.range((rev_nat_id, A::default(), 0)..) {
            if r.0 != rev_nat_id {
                break;
            }
            part.src_ranges.insert(*r);
        }
    }
    for vip in vips {
        let k = SvcKey::new(*vip, 0, 0, SCOPE_ALL, 0);
        if let Some(v) = table.services.get(&k) {
            part.services.insert(k, *v);
        }
    }
    part
}

/// The ops that turn the part `current` of `table` into `target`, in the
/// safe order, without the writes the rest of the table makes needless:
/// a backend another frontend also uses is neither written again nor
/// deleted.
pub fn plan_part<A: Addr>(table: &Table<A>, index: &Index<A>, current: &Table<A>, target: &Table<A>) -> Vec<Op<A>> {
    let mut part_refs: HashMap<u32, u32> = HashMap::new();
    for (k, v) in &current.services {
        if k.slot != 0 {
            *part_refs.entry(v.backend_id).or_default() += 1;
        }
    }
    let mut ops = plan(current, target);
    ops.retain(|op| match op {
        Op::PutBackend(id, b) => table.backends.get(id) != Some(b),
        Op::DelBackend(id) => index.refs(*id) <= part_refs.get(id).copied().unwrap_or(0),
        _ => true,
    });
    ops
}

fn add_frontend<A: Addr>(t: &mut Builder<A>, key: &model::FrontendKey, front: &model::Frontend, ids: &mut Ids<'_, A>) {
    let Some(addr) = A::from_ip(key.addr) else { return };
    let proto = proto_num(key.proto);
    t.owners.insert((addr, key.port, proto), front.service.clone());

    let Some(rev_nat_id) = ids.revnat(addr, key.port) else {
        t.left_out.push(format!("Service {}: {key}: no free rev_nat id", front.service));
        return;
    };
    t.revnat.push((rev_nat_id, RevNat { addr, port: key.port, _pad: 0 }));

    let affinity = front.affinity_timeout.is_some();
    let slots_for = |backends: &[model::Backend], scope: u8, t: &mut Builder<A>, ids: &mut Ids<'_, A>| -> u16 {
        let mut n = 0u16;
        for b in backends {
            let Some(baddr) = A::from_ip(b.addr) else { continue };
            let mut flags = 0;
            if b.local {
                flags |= backend_flags::LOCAL;
            }
            if b.terminating {
                flags |= backend_flags::TERMINATING;
            }
            let id = ids.backend((baddr, b.port, proto, flags));
            t.backends.push((id, Backend { addr: baddr, port: b.port, proto, flags }));
            if affinity {
                t.affinity_match.push(AffinityMatchKey { backend_id: id, rev_nat_id, family: A::FAMILY, _pad: 0 });
            }
            n += 1;
            t.services.push((SvcKey::new(addr, key.port, proto, scope, n), SvcValue { backend_id: id, rev_nat_id, ..Default::default() }));
        }
        n
    };

    let count = slots_for(&front.backends, SCOPE_ALL, t, ids);
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
    if !front.source_ranges.is_empty() {
        flags |= svc_flags::SRC_RANGE;
        for (net, len) in &front.source_ranges {
            if let Some(a) = A::from_ip(*net) {
                t.src_ranges.push((rev_nat_id, a, *len));
            }
        }
    }
    if front.local_only || front.ext_local {
        let n = slots_for(&front.local_backends, SCOPE_LOCAL, t, ids);
        t.services.push((SvcKey::new(addr, key.port, proto, SCOPE_LOCAL, 0), SvcValue { count: n, rev_nat_id, ..Default::default() }));
    }
    if affinity {
        flags |= svc_flags::AFFINITY;
    }
    if front.topology {
        flags |= svc_flags::TOPOLOGY;
    }
    t.services.push((
        SvcKey::new(addr, key.port, proto, SCOPE_ALL, 0),
        SvcValue { backend_id: 0, count, rev_nat_id, flags, _pad: 0, affinity_timeout: front.affinity_timeout.unwrap_or(0) },
    ));
}

/// The marker of a ClusterIP: a connect to it on a port that is no service
/// port is refused.
fn add_marker<A: Addr>(t: &mut Builder<A>, desired: &Desired, vip: IpAddr) {
    let Some(v) = A::from_ip(vip) else { return };
    if let Some(owner) = desired.vip_owners.get(&vip) {
        t.owners.insert((v, 0, 0), owner.clone());
    }
    t.services.push((SvcKey::new(v, 0, 0, SCOPE_ALL, 0), SvcValue { flags: svc_flags::VIP_MARKER, ..Default::default() }));
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
                std::sync::Arc::new(Frontend {
                    service: ServiceRef { namespace: "default".into(), name: (*vip).into() },
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
                    extra_serving: Vec::new(),
                }),
            );
            d.vips.insert(vip.parse().unwrap());
        }
        d
    }

    /// Apply every step of the plan from `a` to `b` and check, in every
    /// intermediate state, what a connect to each frontend would see. The
    /// plan for the changed frontends alone must be as safe and reach the
    /// same table.
    fn check_transition(a: &Desired, b: &Desired) -> Table<[u8; 4]> {
        let start = build::<[u8; 4]>(a, &Table::default(), &mut Cursors::default()).table;
        let target = build(b, &start, &mut Cursors::default());
        let ops = plan(&start, &target.table);
        let t = walk(&start, &ops, a, b);
        assert_eq!(t, target.table, "the plan reaches the target");
        // As the writer really applies it: each batch run may be written by
        // two threads in any order (here: reversed), and is just as safe.
        assert_eq!(walk(&start, &as_written(&ops), a, b), target.table, "written in batch runs");

        let index = Index::of(&start);
        let units: BTreeSet<([u8; 4], u16)> = a
            .frontends
            .keys()
            .chain(b.frontends.keys())
            .filter(|k| a.frontends.get(*k) != b.frontends.get(*k))
            .map(|k| (v4(&k.addr.to_string()), k.port))
            .collect();
        let vips: BTreeSet<[u8; 4]> = a.vips.symmetric_difference(&b.vips).map(|v| v4(&v.to_string())).collect();
        let cur = extract(&start, &index, &units, &vips);
        let part = build_part(b, &units, &vips, &start, &index, &mut Cursors::default());
        let part_ops = plan_part(&start, &index, &cur, &part.table);
        let mut ix = index.clone();
        let mut t2 = start.clone();
        for op in &part_ops {
            ix.apply(&t2, op);
            t2.apply(op);
        }
        assert_eq!(walk(&start, &part_ops, a, b), t2);
        assert_eq!(t2, target.table, "the partial plan reaches the same table");
        assert!(part_ops.len() <= ops.len(), "{part_ops:?} vs {ops:?}");
        assert_eq!(ix, Index::of(&t2), "the index follows the ops");
        t
    }

    /// `ops` in an order the writer may really apply them: the entries of
    /// a batch run (`FamilyMaps::batchable`) go in any order (two threads
    /// for a long run); here each run is reversed.
    fn as_written(ops: &[Op<[u8; 4]>]) -> Vec<Op<[u8; 4]>> {
        let mut out = Vec::with_capacity(ops.len());
        let mut i = 0;
        while i < ops.len() {
            let n = crate::dataplane::maps::FamilyMaps::<[u8; 4]>::batchable(&ops[i..]).max(1);
            out.extend(ops[i..i + n].iter().rev().copied());
            i += n;
        }
        out
    }

    fn walk(start: &Table<[u8; 4]>, ops: &[Op<[u8; 4]>], a: &Desired, b: &Desired) -> Table<[u8; 4]> {
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
        // Nothing is left that no slot references.
        let referenced: BTreeSet<u32> = t.services.iter().filter(|(k, _)| k.slot != 0).map(|(_, v)| v.backend_id).collect();
        assert_eq!(referenced, t.backends.keys().copied().collect());
        t
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(3000))]
        /// Random transitions between small sets of frontends that share
        /// backends, with sessionAffinity and node-local sets.
        #[test]
        fn random_transitions_are_safe(
            a in proptest::collection::vec((0usize..3, proptest::bool::ANY, proptest::collection::vec(0usize..4, 0..4), proptest::bool::ANY), 0..4),
            b in proptest::collection::vec((0usize..3, proptest::bool::ANY, proptest::collection::vec(0usize..4, 0..4), proptest::bool::ANY), 0..4),
        ) {
            let make = |spec: &[(usize, bool, Vec<usize>, bool)]| {
                let vips = ["10.96.0.1", "10.96.0.2", "10.96.0.3"];
                let bes = [A, B, C, D];
                let mut d = Desired::default();
                for (vip, local, backends, affinity) in spec {
                    let list: Vec<&str> = backends.iter().map(|i| bes[*i]).collect();
                    let mut one = desired(&[(vips[*vip], 80, &list, *local)]);
                    if *affinity {
                        for f in one.frontends.values_mut() {
                            std::sync::Arc::make_mut(f).affinity_timeout = Some(30);
                        }
                    }
                    for (k, f) in one.frontends {
                        d.frontends.entry(k).or_insert(f);
                    }
                    d.vips.extend(one.vips);
                }
                d
            };
            check_transition(&make(&a), &make(&b));
        }
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
                desired(&[("10.96.0.1", 80, &[A, B], false), ("10.96.0.2", 80, &[A], false)]),
                desired(&[("10.96.0.1", 80, &[B], false), ("10.96.0.2", 80, &[A], false)]),
            ),
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
        std::sync::Arc::make_mut(d.frontends.values_mut().next().unwrap()).affinity_timeout = Some(60);
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
        std::sync::Arc::make_mut(a.frontends.values_mut().next().unwrap()).affinity_timeout = Some(30);
        let mut b = desired(&[("10.96.0.1", 80, &[B, C], false)]);
        std::sync::Arc::make_mut(b.frontends.values_mut().next().unwrap()).affinity_timeout = Some(30);
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
