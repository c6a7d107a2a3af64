//! The target tables: what the maps must hold for the desired frontends,
//! with backend and rev-NAT ids kept stable across syncs (`Index`,
//! `Cursors`), for all frontends or a changed part.
use std::collections::BTreeSet;
use std::net::IpAddr;

// foldhash: these maps are keyed by small fixed-size ids and addresses,
// hashed hundreds of thousands of times in a first sync.
use foldhash::{HashMap, HashMapExt as _};
use lb_common::{AffinityMatchKey, Backend, PROTO_TCP, PROTO_UDP, RevNat, SCOPE_ALL, SCOPE_LOCAL, SvcKey, SvcValue, backend_flags, svc_flags};

use super::table::{Addr, Op, Table, proto_num};
use crate::model::{self, Desired, Proto, ServiceRef};

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
    pub(super) fn refs(&self, id: u32) -> u32 {
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
            // Slots are numbered in 16 bits: the first 65,535 backends
            // (a count that wrapped would name a few and overwrite them).
            if usize::from(n) == crate::model::MAX_BACKENDS {
                break;
            }
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
    if front.host_only {
        flags |= svc_flags::HOST_ONLY;
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
    if front.maglev && front.external {
        flags |= svc_flags::MAGLEV;
    }
    if front.dsr && front.external {
        flags |= svc_flags::DSR;
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

pub(super) fn is_marker<A>(k: &SvcKey<A>) -> bool {
    k.port == 0 && k.proto == 0
}
