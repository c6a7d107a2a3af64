//! The model, kept up to date one Service at a time.
//!
//! `compute_with` recomputes everything; at 10,000 Services that takes
//! about 100 ms, far too slow for a change of one endpoint. `Incremental`
//! gives the same result (a property test holds it to that) but recomputes
//! only the Services whose objects changed. Sources share objects between
//! snapshots (`Arc`): an unchanged object is the same allocation, so a
//! changed one is found by pointer, without looking inside.
//!
//! Conflicts between Services are settled as `compute_with` settles them:
//! of the Services that claim a frontend, the first by how it claims it
//! (`Claim`) and then by reference keeps it;
//! a ClusterIP and a health check port belong to the last.
use std::collections::BTreeSet;

use foldhash::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use super::{
    Claim, Desired, EndpointSlice, Frontend, Service, FrontendKey, NodeInfo, Options, Proto, ServiceOut, ServiceRef, compute_service, lost_warning, service_ref,
    slice_group,
};

/// A frontend's address, port and protocol, with a backend address and
/// port it translates to. (With the protocol: a Service with one port
/// number in TCP and UDP, DNS, can keep an endpoint for one and not the
/// other: a terminating endpoint that no longer serves, `sets`.)
pub type Pair = (IpAddr, u16, Proto, IpAddr, u16);

/// What one update changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Anything may have changed: the first update, or the node's facts or
    /// the options changed.
    pub full: bool,
    /// Frontends added, removed or changed.
    pub frontends: BTreeSet<FrontendKey>,
    /// ClusterIPs that appeared or went.
    pub vips: BTreeSet<IpAddr>,
    /// The set of NodePorts changed.
    pub node_ports: bool,
    /// The health checks changed.
    pub health_checks: bool,
    /// (frontend, backend) pairs that stopped serving: connections
    /// translated to them are stale.
    pub left: BTreeSet<Pair>,
    /// (frontend, backend) pairs that started serving (again): a pair that
    /// left a moment ago and is back is not stale.
    pub joined: BTreeSet<Pair>,
    /// (frontend, backend) pairs that stopped serving whose TCP
    /// connections are kept (`Frontend::keeps`): their endpoint was ready
    /// when it left.
    pub kept: BTreeSet<Pair>,
    /// UDP frontends the socket hooks translate that have backends now and
    /// had none (or did not exist) before: a connected UDP socket connected
    /// to one meanwhile was not translated, and never will be (kube-proxy
    /// flushes such a Service's conntrack entries at this change). Not on
    /// a full update.
    pub udp_served: BTreeSet<FrontendKey>,
    /// The `endpoints.kubernetes.io/last-change-trigger-time` of every
    /// added or changed EndpointSlice that has one (none on the first
    /// update: those changes predate the agent), for kube-proxy's network
    /// programming latency, with the slice's address type (kube-proxy's
    /// `ip_family` label).
    pub triggers: Vec<(std::time::SystemTime, &'static str)>,
}

impl Changes {
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        !self.full && self.frontends.is_empty() && self.vips.is_empty() && !self.node_ports && !self.health_checks
    }
}

/// The objects of one Service reference, and what they contribute.
#[derive(Default)]
struct Group {
    /// Nearly always one definition and one slice: kept inline.
    services: smallvec::SmallVec<[Arc<Service>; 1]>,
    slices: smallvec::SmallVec<[Arc<EndpointSlice>; 1]>,
    out: ServiceOut,
}

/// The desired state, updated from snapshot to snapshot.
#[derive(Default)]
pub struct Incremental {
    primed: bool,
    node: NodeInfo,
    opts: Options,
    /// The last snapshot's objects: holding them keeps their addresses
    /// from being reused by new objects.
    services: Vec<Arc<Service>>,
    slices: Vec<Arc<EndpointSlice>>,
    /// Boxed: the table's empty buckets (a third of them) then cost a
    /// pointer each, not a whole Group.
    groups: HashMap<ServiceRef, Box<Group>>,
    /// EndpointSlices without an owner label, with their warning.
    unowned: Vec<(Arc<EndpointSlice>, String)>,
    /// The Services that claim each frontend, sorted by how they claim it
    /// (`Claim`) and reference; the first has it.
    claims: HashMap<FrontendKey, FrontClaims>,
    /// Frontends claimed by more than one Service.
    contested: BTreeSet<FrontendKey>,
    /// The Services that serve each ClusterIP, sorted; the last owns it.
    vip_claims: HashMap<IpAddr, Claims>,
    node_port_claims: HashMap<(u16, Proto), usize>,
    health_check_claims: HashMap<u16, BTreeSet<ServiceRef>>,
    /// Services with warnings of their own.
    warned: BTreeSet<ServiceRef>,
    desired: Desired,
}

/// Services that claim one thing, sorted: nearly always one, kept inline.
type Claims = smallvec::SmallVec<[ServiceRef; 1]>;

fn claim(c: &mut Claims, r: &ServiceRef) {
    if let Err(i) = c.binary_search(r) {
        c.insert(i, r.clone());
    }
}

fn unclaim(c: &mut Claims, r: &ServiceRef) {
    if let Ok(i) = c.binary_search(r) {
        c.remove(i);
    }
}

/// The claims of one frontend, sorted: nearly always one.
type FrontClaims = smallvec::SmallVec<[(Claim, ServiceRef); 1]>;

fn claim_front(c: &mut FrontClaims, how: Claim, r: &ServiceRef) {
    let x = (how, r.clone());
    if let Err(i) = c.binary_search(&x) {
        c.insert(i, x);
    }
}

fn unclaim_front(c: &mut FrontClaims, r: &ServiceRef) {
    c.retain(|(_, x)| x != r);
}

/// The objects of `old` that are not in `new`, and those of `new` that are
/// not in `old`, by identity. Linear, and cheap when the order is kept.
/// The objects that went and came from one snapshot to the next.
struct ObjectDiff {
    gone_svcs: Vec<Arc<Service>>,
    new_svcs: Vec<Arc<Service>>,
    gone_slices: Vec<Arc<EndpointSlice>>,
    new_slices: Vec<Arc<EndpointSlice>>,
    /// Objects decoded anew with the same content: (the copy the groups
    /// hold, the new copy that takes its place).
    same_svcs: Vec<(Arc<Service>, Arc<Service>)>,
    same_slices: Vec<(Arc<EndpointSlice>, Arc<EndpointSlice>)>,
}

impl ObjectDiff {
    fn of(old_svcs: &[Arc<Service>], svcs: &[Arc<Service>], old_slices: &[Arc<EndpointSlice>], slices: &[Arc<EndpointSlice>]) -> Self {
        let (gone_svcs, new_svcs, same_svcs) = diff(old_svcs, svcs, |s: &Service| &s.metadata);
        let (gone_slices, new_slices, same_slices) = diff(old_slices, slices, |s: &EndpointSlice| &s.metadata);
        ObjectDiff { gone_svcs, new_svcs, gone_slices, new_slices, same_svcs, same_slices }
    }
}

/// Put `new` where `old` is in `held` (by identity).
fn swap_in<T>(held: &mut [Arc<T>], old: &Arc<T>, new: &Arc<T>) {
    if let Some(x) = held.iter_mut().find(|x| Arc::ptr_eq(x, old)) {
        *x = new.clone();
    }
}

/// The objects of `old` not in `new`, and those of `new` not in `old`: the
/// same object (pointer) anywhere in both, or an object of the same name
/// and content (a relist after a 410 decodes every object anew), is no
/// change. kube-proxy likewise drops an update that changes nothing it
/// uses (its change trackers compare with DeepEqual), so a relist neither
/// recomputes every Service nor observes every slice's old trigger time
/// in `kubeproxy_network_programming_duration_seconds`. The third part
/// pairs each such old object with its new copy, which takes its place in
/// the model: the source's store holds the new one, so the next snapshot
/// is the same allocation again (keeping the old one would compare it in
/// full on every later sync, and hold both copies).
#[allow(clippy::type_complexity)]
fn diff<T: PartialEq>(old: &[Arc<T>], new: &[Arc<T>], meta: fn(&T) -> &super::objects::Meta) -> (Vec<Arc<T>>, Vec<Arc<T>>, Vec<(Arc<T>, Arc<T>)>) {
    let (mut gone, mut added, mut same) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..old.len().max(new.len()) {
        match (old.get(i), new.get(i)) {
            (Some(a), Some(b)) if Arc::ptr_eq(a, b) => {}
            (a, b) => {
                gone.extend(a.cloned());
                added.extend(b.cloned());
            }
        }
    }
    if !gone.is_empty() && !added.is_empty() {
        // Objects that only moved.
        let g: HashSet<*const T> = gone.iter().map(Arc::as_ptr).collect();
        let a: HashSet<*const T> = added.iter().map(Arc::as_ptr).collect();
        gone.retain(|x| !a.contains(&Arc::as_ptr(x)));
        added.retain(|x| !g.contains(&Arc::as_ptr(x)));
    }
    if !gone.is_empty() && !added.is_empty() {
        // Objects decoded anew with the same content.
        let key = |o: &Arc<T>| {
            let m = meta(o);
            (m.namespace.clone(), m.name.clone())
        };
        // Each new copy matched to one old object of its name (a name may
        // be defined twice) with the same content.
        let mut was: HashMap<_, Vec<usize>> = HashMap::default();
        for (i, o) in gone.iter().enumerate() {
            was.entry(key(o)).or_default().push(i);
        }
        let mut matched = vec![false; gone.len()];
        let mut paired: HashSet<*const T> = HashSet::default();
        for o in &added {
            let Some(candidates) = was.get(&key(o)) else { continue };
            if let Some(&i) = candidates.iter().find(|&&i| !matched[i] && *gone[i] == **o) {
                matched[i] = true;
                paired.insert(Arc::as_ptr(o));
                same.push((gone[i].clone(), o.clone()));
            }
        }
        if !same.is_empty() {
            let mut i = 0;
            gone.retain(|_| {
                i += 1;
                !matched[i - 1]
            });
            added.retain(|o| !paired.contains(&Arc::as_ptr(o)));
        }
    }
    (gone, added, same)
}

/// The contributions of the Services `refs` (empty for a reference with
/// objects but no Service). Many at once (a first sync) are spread over the
/// cores: each Service is computed on its own.
fn compute_all(refs: &BTreeSet<ServiceRef>, groups: &HashMap<ServiceRef, Box<Group>>, node: &NodeInfo, opts: &Options) -> Vec<ServiceOut> {
    let one = |r: &ServiceRef| match groups.get(r) {
        Some(g) if !g.services.is_empty() => compute_service(r, &g.services, &g.slices, node, opts),
        _ => ServiceOut::default(),
    };
    let refs: Vec<&ServiceRef> = refs.iter().collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if refs.len() < 512 || threads < 2 {
        return refs.into_iter().map(one).collect();
    }
    let chunk = refs.len().div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> = refs.chunks(chunk).map(|part| s.spawn(move || part.iter().map(|r| one(r)).collect::<Vec<_>>())).collect();
        parts.into_iter().flat_map(|p| p.join().expect("a model thread panicked")).collect()
    })
}

impl Incremental {
    pub fn new() -> Self {
        Self::default()
    }

    /// The desired state for the last snapshot, warnings included.
    pub fn desired(&self) -> &Desired {
        &self.desired
    }

    /// Bring the desired state to `services` and `slices` (each object
    /// once) on `node`, and say what changed.
    pub fn update(&mut self, services: &[Arc<Service>], slices: &[Arc<EndpointSlice>], node: &NodeInfo, opts: &Options) -> Changes {
        let mut ch = Changes::default();
        let objs = ObjectDiff::of(&self.services, services, &self.slices, slices);
        if self.primed {
            ch.triggers = objs
                .new_slices
                .iter()
                .filter_map(|e| {
                    let family = match e.address_type.as_str() {
                        "IPv4" => "IPv4",
                        "IPv6" => "IPv6",
                        _ => return None,
                    };
                    let t = humantime::parse_rfc3339_weak(e.metadata.annotations.last_change_trigger_time.as_deref()?).ok()?;
                    Some((t, family))
                })
                .collect();
        }
        // The node's addresses matter only to the Services with NodePorts
        // (one frontend per address), its primary addresses to none: a
        // change of either recomputes only those. Its name and zone touch
        // every Service (local endpoints, topology), as the options do.
        let NodeInfo { name, zone, addresses: _, primary: _ } = node;
        let same_node = self.node.name == *name && self.node.zone == *zone;
        if !self.primed || !same_node || self.opts != *opts {
            let before = self.primed.then(|| (self.desired.stale_when_gone(), self.desired.kept_when_gone()));
            *self = Incremental { primed: true, node: node.clone(), opts: opts.clone(), ..Default::default() };
            ch.full = true;
            let all = ObjectDiff::of(&[], services, &[], slices);
            self.apply(services, slices, all, BTreeSet::new(), &mut ch);
            // Everything "joined": meaningless, and a full sync's sweep
            // carries the whole state anyway. Nothing newly served either:
            // sockets an earlier agent or kube-proxy left are not touched.
            ch.joined = BTreeSet::new();
            ch.udp_served = BTreeSet::new();
            if let Some((stale, kept)) = before {
                let alive = self.desired.alive_pairs();
                ch.left = stale.difference(&alive).copied().collect();
                ch.kept = kept.difference(&alive).copied().collect();
            }
        } else {
            let mut affected = BTreeSet::new();
            if self.node.addresses != node.addresses {
                affected.extend(self.groups.iter().filter(|(_, g)| !g.out.node_ports.is_empty()).map(|(r, _)| r.clone()));
            }
            self.node = node.clone();
            self.apply(services, slices, objs, affected, &mut ch);
        }
        ch
    }

    /// Take in the objects that went and came, and recompute the Services
    /// they touch and those in `affected`.
    fn apply(&mut self, services: &[Arc<Service>], slices: &[Arc<EndpointSlice>], objs: ObjectDiff, mut affected: BTreeSet<ServiceRef>, ch: &mut Changes) {
        let ObjectDiff { gone_svcs, new_svcs, gone_slices, new_slices, same_svcs, same_slices } = objs;
        self.services = services.to_vec();
        self.slices = slices.to_vec();
        // Unchanged objects decoded anew: the new copy in the old one's
        // place, nothing recomputed.
        for (old, new) in &same_svcs {
            if let Some(g) = self.groups.get_mut(&service_ref(new)) {
                swap_in(&mut g.services, old, new);
            }
        }
        for (old, new) in &same_slices {
            match slice_group(new) {
                Ok(Some(r)) => {
                    if let Some(g) = self.groups.get_mut(&r) {
                        swap_in(&mut g.slices, old, new);
                    }
                }
                Ok(None) => {}
                Err(_) => {
                    if let Some(x) = self.unowned.iter_mut().find(|(x, _)| Arc::ptr_eq(x, old)) {
                        x.0 = new.clone();
                    }
                }
            }
        }
        for s in gone_svcs {
            let r = service_ref(&s);
            if let Some(g) = self.groups.get_mut(&r) {
                g.services.retain(|x| !Arc::ptr_eq(x, &s));
            }
            affected.insert(r);
        }
        for s in new_svcs {
            let r = service_ref(&s);
            self.groups.entry(r.clone()).or_default().services.push(s);
            affected.insert(r);
        }
        let mut unowned_changed = false;
        for e in gone_slices {
            match slice_group(&e) {
                Ok(Some(r)) => {
                    if let Some(g) = self.groups.get_mut(&r) {
                        g.slices.retain(|x| !Arc::ptr_eq(x, &e));
                    }
                    affected.insert(r);
                }
                Ok(None) => {}
                Err(_) => {
                    self.unowned.retain(|(x, _)| !Arc::ptr_eq(x, &e));
                    unowned_changed = true;
                }
            }
        }
        for e in new_slices {
            match slice_group(&e) {
                Ok(Some(r)) => {
                    self.groups.entry(r.clone()).or_default().slices.push(e);
                    affected.insert(r);
                }
                Ok(None) => {}
                Err(w) => {
                    self.unowned.push((e, w));
                    unowned_changed = true;
                }
            }
        }

        // Recompute the affected Services and move their claims.
        let (mut keys, mut vips, mut ports) = (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
        let mut warnings_changed = unowned_changed;
        // Whether each NodePort touched was in use before.
        let mut node_ports_before: std::collections::BTreeMap<(u16, Proto), bool> = Default::default();
        let outs = compute_all(&affected, &self.groups, &self.node, &self.opts);
        for (r, out) in affected.iter().zip(outs) {
            let Some(g) = self.groups.get_mut(r) else { continue };
            let old = std::mem::replace(&mut g.out, out);
            let new = &g.out;
            for (k, _, _) in &old.frontends {
                if let Some(c) = self.claims.get_mut(k) {
                    unclaim_front(c, r);
                }
                keys.insert(*k);
            }
            for (k, _, how) in &new.frontends {
                claim_front(self.claims.entry(*k).or_default(), *how, r);
                keys.insert(*k);
            }
            for v in &old.vips {
                if let Some(c) = self.vip_claims.get_mut(v) {
                    unclaim(c, r);
                }
                vips.insert(*v);
            }
            for v in &new.vips {
                claim(self.vip_claims.entry(*v).or_default(), r);
                vips.insert(*v);
            }
            for np in old.node_ports.difference(&new.node_ports) {
                node_ports_before.entry(*np).or_insert(true);
                let n = self.node_port_claims.get_mut(np).expect("claimed before");
                *n -= 1;
                if *n == 0 {
                    self.node_port_claims.remove(np);
                    self.desired.node_ports.remove(np);
                }
            }
            for np in new.node_ports.difference(&old.node_ports) {
                let n = self.node_port_claims.entry(*np).or_default();
                node_ports_before.entry(*np).or_insert(*n > 0);
                *n += 1;
                if *n == 1 {
                    self.desired.node_ports.insert(*np);
                }
            }
            if old.health_check != new.health_check {
                if let Some((p, _)) = &old.health_check {
                    if let Some(c) = self.health_check_claims.get_mut(p) {
                        c.remove(r);
                    }
                    ports.insert(*p);
                }
                if let Some((p, _)) = &new.health_check {
                    self.health_check_claims.entry(*p).or_default().insert(r.clone());
                    ports.insert(*p);
                }
            }
            if old.warnings != new.warnings {
                warnings_changed = true;
            }
            if new.warnings.is_empty() {
                self.warned.remove(r);
            } else {
                self.warned.insert(r.clone());
            }
            if g.services.is_empty() && g.slices.is_empty() {
                self.groups.remove(r);
            }
        }

        ch.node_ports |= node_ports_before.iter().any(|(np, was)| self.desired.node_ports.contains(np) != *was);

        // Settle the frontends, ClusterIPs and health checks they touched.
        let mut left = Vec::new();
        for k in keys {
            let claimants = self.claims.get(&k);
            let winner = claimants.and_then(|c| c.first()).map(|(_, r)| r);
            let now = winner.map(|r| {
                let f = self.groups[r].out.frontends.iter().find(|(x, _, _)| *x == k).expect("the claimant has it");
                f.1.clone()
            });
            let n = claimants.map_or(0, |c| c.len());
            // Who loses a contested frontend may change without the set
            // of contested frontends changing.
            let was_contested = if n > 1 { !self.contested.insert(k) } else { self.contested.remove(&k) };
            warnings_changed |= n > 1 || was_contested;
            if n == 0 {
                self.claims.remove(&k);
            }
            let before = match &now {
                Some(f) => self.desired.frontends.insert(k, f.clone()),
                None => self.desired.frontends.remove(&k),
            };
            if before != now {
                ch.frontends.insert(k);
                if let Some(b) = &before {
                    for (a, p) in b.serving() {
                        if now.as_ref().is_some_and(|f| f.serves(a, p)) {
                            continue;
                        }
                        // A ready TCP endpoint that leaves keeps its
                        // connections (`Frontend::keeps`).
                        if b.keeps(k.proto, a, p) {
                            ch.kept.insert((k.addr, k.port, k.proto, a, p));
                        } else {
                            left.push((k, a, p));
                        }
                    }
                }
                if let Some(n) = &now {
                    for (a, p) in n.serving() {
                        if !before.as_ref().is_some_and(|f| f.serves(a, p)) {
                            ch.joined.insert((k.addr, k.port, k.proto, a, p));
                        }
                    }
                    let has = |f: &Frontend| !f.backends.is_empty() || !f.local_backends.is_empty();
                    if k.proto == Proto::Udp && !n.no_socket && has(n) && !before.as_deref().is_some_and(has) {
                        ch.udp_served.insert(k);
                    }
                }
            }
        }
        for (k, a, p) in left {
            ch.left.insert((k.addr, k.port, k.proto, a, p));
        }
        for v in vips {
            match self.vip_claims.get(&v).and_then(|c| c.last()) {
                Some(owner) => {
                    if self.desired.vips.insert(v) {
                        ch.vips.insert(v);
                    }
                    self.desired.vip_owners.insert(v, owner.clone());
                }
                None => {
                    self.vip_claims.remove(&v);
                    if self.desired.vips.remove(&v) {
                        ch.vips.insert(v);
                    }
                    self.desired.vip_owners.remove(&v);
                }
            }
        }
        for p in ports {
            let now = self
                .health_check_claims
                .get(&p)
                .and_then(|c| c.last())
                .and_then(|r| self.groups[r].out.health_check.as_ref())
                .map(|(_, hc)| hc.clone());
            let before = match now.clone() {
                Some(hc) => self.desired.health_checks.insert(p, hc),
                None => {
                    self.health_check_claims.remove(&p);
                    self.desired.health_checks.remove(&p)
                }
            };
            ch.health_checks |= before != now;
        }
        if warnings_changed || ch.full {
            self.desired.warnings = self.warnings();
        }
    }

    fn warnings(&self) -> Vec<String> {
        let mut w: Vec<String> = self.unowned.iter().map(|(_, w)| w.clone()).collect();
        for r in &self.warned {
            w.extend(self.groups[r].out.warnings.iter().cloned());
        }
        for k in &self.contested {
            for (how, r) in self.claims[k].iter().skip(1) {
                w.push(lost_warning(r, k, how.external()));
            }
        }
        w
    }
}

#[cfg(test)]
mod tests;
