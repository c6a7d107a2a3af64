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
//!
//! The tables it plans between are built in `build`; the table and its ops
//! are in `table`. This file is the order.
use foldhash::{HashMap, HashMapExt as _};
use lb_common::{SCOPE_ALL, SCOPE_LOCAL, SvcKey, SvcValue};

pub use super::build::{Cursors, Index, Target, build_part, build_with, extract};
#[cfg(test)]
pub use super::build::build;
use super::build::is_marker;
pub use super::table::{Addr, Op, Table, drift, proto_num};

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
    use std::collections::BTreeSet;

    use lb_common::{PROTO_TCP, RevNat, svc_flags};

    use super::*;
    use crate::model::{self, Desired, Frontend, FrontendKey, Proto, ServiceRef};

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
                .map(|b| model::Backend { addr: b.parse().unwrap(), port: 8080, local: true, terminating: false, pod_terminating: false })
                .collect();
            d.frontends.insert(
                FrontendKey { addr: vip.parse().unwrap(), port: *port, proto: Proto::Tcp },
                std::sync::Arc::new(Frontend {
                    backends: bs.clone(),
                    local_only: *local_only,
                    local_backends: bs,
                    ..Frontend::new(ServiceRef { namespace: "default".into(), name: (*vip).into() }, String::new())
                }),
            );
            d.vips.insert(vip.parse().unwrap());
        }
        d
    }

    /// A frontend's slots are numbered in 16 bits: it takes the first
    /// 65,535 backends, and every one of its slots resolves (a count that
    /// wrapped named 4,464 of 70,000 and left the rest written for none).
    #[test]
    fn a_frontend_takes_at_most_65535_backends_and_every_slot_resolves() {
        let mut d = desired(&[("10.96.0.1", 80, &[], false)]);
        let k = *d.frontends.keys().next().unwrap();
        let bs: Vec<model::Backend> = (0..70_000u32)
            .map(|i| model::Backend { addr: std::net::Ipv4Addr::from(0x0a00_0000 + i).into(), port: 8080, local: false, terminating: false, pod_terminating: false })
            .collect();
        std::sync::Arc::make_mut(d.frontends.get_mut(&k).unwrap()).backends = bs;
        let t = build::<[u8; 4]>(&d, &Table::default(), &mut Cursors::default()).table;
        let Seen::Backends(seen) = resolve(&t, v4("10.96.0.1"), 80, PROTO_TCP) else { panic!("{:?}", resolve(&t, v4("10.96.0.1"), 80, PROTO_TCP)) };
        assert_eq!(seen.len(), 65_535);
        assert!(seen.contains(&(v4("10.0.0.0"), 8080)) && seen.contains(&(v4("10.0.255.254"), 8080)) && !seen.contains(&(v4("10.0.255.255"), 8080)));
        assert_eq!(t.services.keys().filter(|s| s.slot > 0).count(), 65_535, "no slot beyond the count");
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
