//! The incremental model against the full computation: after every step of
//! a random history of edits, it must hold exactly what `compute_with`
//! computes from scratch.
use proptest::prelude::*;

use super::super::proptests::{node, service, slice};
use super::super::{NodeInfo, Options, compute_with};
use super::*;

type K8sService = k8s_openapi::api::core::v1::Service;
type K8sSlice = k8s_openapi::api::discovery::v1::EndpointSlice;

/// One edit of the snapshot.
#[derive(Clone, Debug)]
enum Edit {
    /// Replace the i-th Service with a new object.
    Service(usize, K8sService),
    Slice(usize, K8sSlice),
    AddService(K8sService),
    AddSlice(K8sSlice),
    DropService(usize),
    DropSlice(usize),
    /// Reverse the order of everything (objects only move).
    Reverse,
    /// Another zone for the node: everything is recomputed.
    Zone,
    /// One of the node's addresses comes or goes (the i-th of a few, the
    /// localhost NodePorts' 127.0.0.1 among them): the Services with
    /// NodePorts are recomputed, and only they.
    Address(usize),
    /// Another primary address: nothing in the model depends on it.
    Primary,
    /// Every object decoded anew with the same content (a relist).
    Relist,
    /// Publish: compare with the full computation.
    Check,
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        3 => (any::<usize>(), service()).prop_map(|(i, s)| Edit::Service(i, s)),
        4 => (any::<usize>(), slice(8)).prop_map(|(i, s)| Edit::Slice(i, s)),
        2 => service().prop_map(Edit::AddService),
        2 => slice(8).prop_map(Edit::AddSlice),
        1 => any::<usize>().prop_map(Edit::DropService),
        1 => any::<usize>().prop_map(Edit::DropSlice),
        1 => Just(Edit::Reverse),
        1 => Just(Edit::Relist),
        1 => Just(Edit::Zone),
        2 => any::<usize>().prop_map(Edit::Address),
        1 => Just(Edit::Primary),
        4 => Just(Edit::Check),
    ]
}

fn sorted(mut d: Desired) -> Desired {
    d.warnings.sort();
    d
}

fn run(services: Vec<K8sService>, slices: Vec<K8sSlice>, edits: Vec<Edit>) -> Result<(), TestCaseError> {
    let opts = Options::default();
    let mut node: NodeInfo = node();
    let mut svcs: Vec<Arc<Service>> = services.iter().map(|s| Arc::new(Service::from(s))).collect();
    let mut eps: Vec<Arc<EndpointSlice>> = slices.iter().map(|s| Arc::new(EndpointSlice::from(s))).collect();
    let mut inc = Incremental::new();
    let ch = inc.update(&svcs, &eps, &node, &opts);
    prop_assert!(ch.full);
    let mut last = compute_with(&svcs, &eps, &node, &opts);
    for e in edits.into_iter().chain([Edit::Check]) {
        match e {
            Edit::Service(i, s) if !svcs.is_empty() => {
                let n = svcs.len();
                svcs[i % n] = Arc::new(Service::from(&s));
            }
            Edit::Slice(i, s) if !eps.is_empty() => {
                let n = eps.len();
                eps[i % n] = Arc::new(EndpointSlice::from(&s));
            }
            Edit::Service(_, s) | Edit::AddService(s) => svcs.push(Arc::new(Service::from(&s))),
            Edit::Slice(_, s) | Edit::AddSlice(s) => eps.push(Arc::new(EndpointSlice::from(&s))),
            Edit::DropService(i) if !svcs.is_empty() => {
                let n = svcs.len();
                svcs.remove(i % n);
            }
            Edit::DropSlice(i) if !eps.is_empty() => {
                let n = eps.len();
                eps.remove(i % n);
            }
            Edit::DropService(_) | Edit::DropSlice(_) => {}
            Edit::Reverse => {
                svcs.reverse();
                eps.reverse();
            }
            Edit::Relist => {
                svcs = svcs.iter().map(|s| Arc::new((**s).clone())).collect();
                eps = eps.iter().map(|e| Arc::new((**e).clone())).collect();
            }
            Edit::Zone => {
                node.zone = if node.zone.as_deref() == Some("zone-a") { Some("zone-b".into()) } else { Some("zone-a".into()) };
            }
            Edit::Address(i) => {
                let some = ["192.168.0.1", "10.0.0.7", "fd00:1::1", "fd00:2::7", "127.0.0.1"];
                let a: IpAddr = some[i % some.len()].parse().unwrap();
                match node.addresses.iter().position(|x| *x == a) {
                    Some(at) => {
                        node.addresses.remove(at);
                    }
                    None => node.addresses.push(a),
                }
            }
            Edit::Primary => {
                node.primary = if node.primary.is_empty() { vec!["192.168.0.1".parse().unwrap()] } else { Vec::new() };
            }
            Edit::Check => {
                let ch = inc.update(&svcs, &eps, &node, &opts);
                let want = compute_with(&svcs, &eps, &node, &opts);
                prop_assert_eq!(sorted(inc.desired().clone()), sorted(want.clone()));
                // The changes name exactly what differs from the last state.
                if !ch.full {
                    let keys: BTreeSet<FrontendKey> = last.frontends.keys().chain(want.frontends.keys()).copied().collect();
                    let differ: BTreeSet<FrontendKey> =
                        keys.into_iter().filter(|k| last.frontends.get(k) != want.frontends.get(k)).collect();
                    prop_assert_eq!(&ch.frontends, &differ);
                    let vips: BTreeSet<IpAddr> = last.vips.symmetric_difference(&want.vips).copied().collect();
                    prop_assert_eq!(&ch.vips, &vips);
                    prop_assert_eq!(ch.node_ports, last.node_ports != want.node_ports);
                    prop_assert_eq!(ch.health_checks, last.health_checks != want.health_checks);
                }
                let gone: BTreeSet<Pair> = last.stale_when_gone().difference(&want.alive_pairs()).copied().collect();
                prop_assert_eq!(&ch.left, &gone);
                let kept: BTreeSet<Pair> = last.kept_when_gone().difference(&want.alive_pairs()).copied().collect();
                prop_assert_eq!(&ch.kept, &kept);
                last = want;
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]
    #[test]
    fn incremental_equals_full(
        services in proptest::collection::vec(service(), 0..5),
        slices in proptest::collection::vec(slice(8), 0..6),
        edits in proptest::collection::vec(edit(), 0..30),
    ) {
        run(services, slices, edits)?;
    }
}

/// An update with nothing new is free and says so.
#[test]
fn nothing_changed_is_empty() {
    let opts = Options::default();
    let svcs: Vec<Arc<Service>> = Vec::new();
    let eps: Vec<Arc<EndpointSlice>> = Vec::new();
    let mut inc = Incremental::new();
    assert!(inc.update(&svcs, &eps, &node(), &opts).full);
    assert!(inc.update(&svcs, &eps, &node(), &opts).is_empty());
}

/// A first sync of many Services (computed on several threads) gives what
/// the full computation gives.
#[test]
fn many_services_at_once_equal_full() {
    let opts = Options::default();
    let mut svcs = Vec::new();
    let mut eps = Vec::new();
    for i in 0..1500u32 {
        let svc: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("s{i}"), "namespace": "default"},
            "spec": {"clusterIP": format!("10.96.{}.{}", i / 250, 1 + i % 250), "ports": [{"name": "http", "port": 80}]}
        }))
        .unwrap();
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("s{i}-1"), "namespace": "default", "labels": {"kubernetes.io/service-name": format!("s{i}")}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": [format!("10.1.{}.{}", i / 250, 1 + i % 250)]}, {"addresses": ["10.2.0.1"], "nodeName": "node-a"}]
        }))
        .unwrap();
        svcs.push(Arc::new(svc));
        eps.push(Arc::new(slice));
    }
    let mut inc = Incremental::new();
    assert!(inc.update(&svcs, &eps, &node(), &opts).full);
    assert_eq!(inc.desired().frontends.len(), 1500);
    assert_eq!(sorted(inc.desired().clone()), sorted(compute_with(&svcs, &eps, &node(), &opts)));
}

/// kube-proxy's change counters and trigger times: objects added, changed
/// and removed are counted once each; only changes after the first update
/// carry a trigger time; moving objects around is no change.
#[test]
fn counts_object_changes_and_collects_trigger_times() {
    let opts = Options::default();
    let svc = |name: &str| {
        let mut s = Service::default();
        s.metadata.name = Some(name.into());
        s.metadata.namespace = Some("ns".into());
        Arc::new(s)
    };
    let slice = |name: &str, trigger: Option<&str>| {
        let mut e = EndpointSlice { address_type: if name.ends_with("-6") { "IPv6" } else { "IPv4" }.into(), ..Default::default() };
        e.metadata.name = Some(name.into());
        e.metadata.namespace = Some("ns".into());
        e.metadata.annotations.last_change_trigger_time = trigger.map(Into::into);
        Arc::new(e)
    };
    let mut inc = Incremental::new();
    let (a, b, s1) = (svc("a"), svc("b"), slice("a-1", Some("2026-12-01T10:00:00Z")));
    let ch = inc.update(&[a.clone(), b.clone()], std::slice::from_ref(&s1), &node(), &opts);
    assert!(ch.triggers.is_empty(), "the initial list's changes predate the agent");
    let ch = inc.update(&[b, a], std::slice::from_ref(&s1), &node(), &opts);
    assert_eq!(ch.triggers.len(), 0, "moved, not changed");
    // A relist (after a 410): every object decoded anew, nothing changed.
    let ch = inc.update(&[svc("b"), svc("a")], &[slice("a-1", Some("2026-12-01T10:00:00Z"))], &node(), &opts);
    assert_eq!(ch.triggers.len(), 0, "decoded anew, not changed");
    assert!(ch.is_empty(), "nothing recomputed: {ch:?}");
    // b removed, a changed, the slice changed with a new trigger time, a
    // second slice without one.
    let s2 = slice("a-1", Some("2026-12-01T10:00:01Z"));
    let a2 = {
        let mut a = (*svc("a")).clone();
        a.metadata.labels.proxy_name = Some("x".into());
        Arc::new(a)
    };
    let ch = inc.update(std::slice::from_ref(&a2), &[s2.clone(), slice("a-2", None)], &node(), &opts);
    assert_eq!(ch.triggers, [(humantime::parse_rfc3339("2026-12-01T10:00:01Z").unwrap(), "IPv4")]);
    // An IPv6 slice's trigger carries its family (kube-proxy's ip_family).
    let ch = inc.update(&[a2], &[s2, slice("a-6", Some("2026-12-01T10:00:02Z"))], &node(), &opts);
    assert_eq!(ch.triggers, [(humantime::parse_rfc3339("2026-12-01T10:00:02Z").unwrap(), "IPv6")]);
}

/// After a relist the model holds the new copies, as the source's store
/// does: the old ones are freed (not held twice), and the next snapshot
/// is the same allocations again (no comparison of content).
#[test]
fn a_relist_leaves_the_model_holding_the_new_copies() {
    let opts = Options::default();
    let svc = || {
        let mut s = Service::default();
        s.metadata.name = Some("a".into());
        s.metadata.namespace = Some("ns".into());
        Arc::new(s)
    };
    let slice = |owned: bool| {
        let mut e = EndpointSlice { address_type: "IPv4".into(), ..Default::default() };
        e.metadata.name = Some(if owned { "a-1" } else { "stray" }.into());
        e.metadata.namespace = Some("ns".into());
        if owned {
            e.metadata.labels.service_name = Some("a".into());
        }
        Arc::new(e)
    };
    let mut inc = Incremental::new();
    let (a, e, stray) = (svc(), slice(true), slice(false));
    inc.update(std::slice::from_ref(&a), &[e.clone(), stray.clone()], &node(), &opts);
    let old = [Arc::downgrade(&a)];
    let old_slices = [Arc::downgrade(&e), Arc::downgrade(&stray)];
    drop((a, e, stray));
    let (a2, e2, stray2) = (svc(), slice(true), slice(false));
    let ch = inc.update(std::slice::from_ref(&a2), &[e2.clone(), stray2.clone()], &node(), &opts);
    assert!(ch.is_empty(), "{ch:?}");
    assert!(old.iter().all(|w| w.upgrade().is_none()), "the old Service is freed");
    assert!(old_slices.iter().all(|w| w.upgrade().is_none()), "the old slices are freed (the group's and the unowned one)");
    // The groups hold the new copies: a change finds them by identity.
    assert_eq!(Arc::strong_count(&a2), 3, "the caller's, the snapshot's, the group's");
    assert_eq!(Arc::strong_count(&e2), 3);
    assert_eq!(Arc::strong_count(&stray2), 3);
    let (gone, added, same) = diff(&inc.services, std::slice::from_ref(&a2), |s: &Service| &s.metadata);
    assert!(gone.is_empty() && added.is_empty() && same.is_empty());
    inc.update(&[], &[], &node(), &opts);
    assert_eq!(Arc::strong_count(&a2), 1, "dropped from the group when deleted");
    assert_eq!(Arc::strong_count(&stray2), 1, "and from the unowned slices");
}

/// A node address that comes or goes recomputes the Services with
/// NodePorts and touches only their frontends on it; a new primary address
/// touches nothing; a new zone recomputes everything.
#[test]
fn a_node_address_recomputes_only_the_services_with_node_ports() {
    let opts = Options::default();
    let svc = |name: &str, ip: &str, ty: &str| -> Arc<Service> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"type": ty, "clusterIP": ip, "ports": [{"name": "http", "port": 80, "nodePort": 30080}]}
            }))
            .unwrap(),
        )
    };
    let slice = |name: &str| -> Arc<EndpointSlice> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": format!("{name}-1"), "namespace": "default", "labels": {"kubernetes.io/service-name": name}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080}],
                "endpoints": [{"addresses": ["10.1.0.1"]}]
            }))
            .unwrap(),
        )
    };
    let svcs = vec![svc("np", "10.96.0.10", "NodePort"), svc("ci", "10.96.0.11", "ClusterIP")];
    let eps = vec![slice("np"), slice("ci")];
    let mut node = node();
    let mut inc = Incremental::new();
    assert!(inc.update(&svcs, &eps, &node, &opts).full);
    let added: IpAddr = "10.0.0.7".parse().unwrap();
    node.addresses.push(added);
    let ch = inc.update(&svcs, &eps, &node, &opts);
    assert!(!ch.full);
    assert_eq!(ch.frontends, BTreeSet::from([FrontendKey { addr: added, port: 30080, proto: crate::model::Proto::Tcp }]));
    assert!(!ch.node_ports && ch.vips.is_empty() && ch.left.is_empty(), "{ch:?}");
    assert_eq!(sorted(inc.desired().clone()), sorted(compute_with(&svcs, &eps, &node, &opts)));
    node.addresses.retain(|a| *a != added);
    let ch = inc.update(&svcs, &eps, &node, &opts);
    // (Its ready endpoint's TCP connections are not ended: `Frontend::ready`.)
    assert!(!ch.full && ch.frontends.len() == 1 && ch.left.is_empty(), "{ch:?}");
    node.primary = vec!["192.168.0.1".parse().unwrap()];
    assert!(inc.update(&svcs, &eps, &node, &opts).is_empty());
    node.zone = Some("zone-b".into());
    assert!(inc.update(&svcs, &eps, &node, &opts).full);
}

/// A terminating endpoint that stops serving (a pod failing its readiness
/// probe on purpose while it drains) keeps its TCP connections until it
/// leaves the slice, as kube-proxy's conntrack keeps them; its connected
/// UDP sockets are stale at once, as kube-proxy flushes their conntrack
/// entries.
#[test]
fn a_draining_endpoint_keeps_its_tcp_connections_until_it_leaves() {
    let opts = Options::default();
    let svc: Arc<Service> = Arc::new(
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"clusterIP": "10.96.0.10", "ports": [
                {"name": "http", "port": 80, "protocol": "TCP"}, {"name": "dns", "port": 53, "protocol": "UDP"},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}
        }))
        .unwrap(),
    );
    let slice = |eps: serde_json::Value| -> Arc<EndpointSlice> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "web-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "dns", "port": 8053, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 8053, "protocol": "TCP"}],
                "endpoints": eps
            }))
            .unwrap(),
        )
    };
    let (a, b): (IpAddr, IpAddr) = ("10.1.0.1".parse().unwrap(), "10.1.0.2".parse().unwrap());
    let vip: IpAddr = "10.96.0.10".parse().unwrap();
    let ready = |ip: &str| serde_json::json!({"addresses": [ip], "conditions": {"ready": true}});
    let draining = |ip: &str| serde_json::json!({"addresses": [ip], "conditions": {"ready": false, "serving": false, "terminating": true}});
    let mut inc = Incremental::new();
    let svcs = [svc];
    inc.update(&svcs, &[slice(serde_json::json!([ready("10.1.0.1"), ready("10.1.0.2")]))], &node(), &opts);
    let ch = inc.update(&svcs, &[slice(serde_json::json!([draining("10.1.0.1"), ready("10.1.0.2")]))], &node(), &opts);
    let (tcp, udp) = (crate::model::Proto::Tcp, crate::model::Proto::Udp);
    // UDP only, also where TCP has the same port (DNS).
    assert_eq!(ch.left, BTreeSet::from([(vip, 53, udp, a, 8053)]), "UDP only");
    let d = inc.desired();
    let web = &d.frontends[&FrontendKey { addr: vip, port: 80, proto: tcp }];
    assert_eq!(web.backends.iter().map(|x| x.addr).collect::<Vec<_>>(), [b], "no new connection goes to it");
    assert!(web.serves(a, 8080));
    // Not ready, not terminating (a readiness failure of a running pod, or
    // its node lost): TCP keeps it too, as kube-proxy's conntrack does.
    let not_ready = serde_json::json!({"addresses": ["10.1.0.1"], "conditions": {"ready": false, "serving": false}});
    let ch = inc.update(&svcs, &[slice(serde_json::json!([not_ready, ready("10.1.0.2")]))], &node(), &opts);
    assert_eq!((ch.left.len(), ch.joined.len()), (0, 0), "{:?}", (&ch.left, &ch.joined));
    let web = &inc.desired().frontends[&FrontendKey { addr: vip, port: 80, proto: tcp }];
    assert_eq!(web.backends.iter().map(|x| x.addr).collect::<Vec<_>>(), [b], "no new connection goes to it");
    assert!(web.serves(a, 8080));
    // Ready again: UDP serves it again.
    let ch = inc.update(&svcs, &[slice(serde_json::json!([ready("10.1.0.1"), ready("10.1.0.2")]))], &node(), &opts);
    assert_eq!(ch.joined, BTreeSet::from([(vip, 53, udp, a, 8053)]));
    assert!(ch.left.is_empty());
    let ch = inc.update(&svcs, &[slice(serde_json::json!([draining("10.1.0.1"), ready("10.1.0.2")]))], &node(), &opts);
    assert_eq!(ch.left, BTreeSet::from([(vip, 53, udp, a, 8053)]), "draining: UDP only");
    // The pod is gone: its endpoint leaves.
    let ch = inc.update(&svcs, &[slice(serde_json::json!([ready("10.1.0.2")]))], &node(), &opts);
    assert_eq!(ch.left, BTreeSet::from([(vip, 80, tcp, a, 8080), (vip, 53, tcp, a, 8053)]));
    assert_eq!(sorted(inc.desired().clone()), sorted(compute_with(&svcs, &[slice(serde_json::json!([ready("10.1.0.2")]))], &node(), &opts)));
    // A ready endpoint that leaves (the selector switched to other pods, a
    // blue/green rollout): its pod still runs, and its TCP connections are
    // kept, as kube-proxy's conntrack keeps them; UDP's end.
    let ch = inc.update(&svcs, &[slice(serde_json::json!([ready("10.1.0.1")]))], &node(), &opts);
    assert_eq!(ch.left, BTreeSet::from([(vip, 53, udp, b, 8053)]), "ready, leaving: UDP only");
    // The Service deleted: likewise.
    let ch = inc.update(&[], &[slice(serde_json::json!([ready("10.1.0.1")]))], &node(), &opts);
    assert_eq!(ch.left, BTreeSet::from([(vip, 53, udp, a, 8053)]), "{ch:?}");
}

/// Which TCP pairs end when their endpoint leaves: not a ready one's (its
/// pod runs on), in every set (picked, narrowed away by topology hints or
/// a Local policy); but one whose pod was terminating, also where
/// publishNotReadyAddresses kept it ready.
#[test]
fn a_tcp_pair_ends_when_its_endpoint_leaves_unless_it_was_ready() {
    let opts = Options::default();
    let svc = |extra: serde_json::Value| -> Arc<Service> {
        let mut spec = serde_json::json!({"type": "NodePort", "clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}]});
        spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        Arc::new(serde_json::from_value(serde_json::json!({"metadata": {"name": "web", "namespace": "default"}, "spec": spec})).unwrap())
    };
    let slice = |eps: serde_json::Value| -> Arc<EndpointSlice> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "web-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                "endpoints": eps
            }))
            .unwrap(),
        )
    };
    let n = node();
    let ep = |ip: &str, node: &str, cond: serde_json::Value| serde_json::json!({"addresses": [ip], "nodeName": node, "conditions": cond});
    let ready = serde_json::json!({"ready": true});
    // publishNotReadyAddresses: the controller publishes a terminating
    // pod as ready.
    let pnr = serde_json::json!({"ready": true, "serving": true, "terminating": true});
    let other = "other-node";
    for (what, extra, cond, node_name, ends) in [
        ("ready, picked", serde_json::json!({}), ready.clone(), n.name.as_str(), false),
        ("ready, elsewhere under internalTrafficPolicy Local", serde_json::json!({"internalTrafficPolicy": "Local"}), ready.clone(), other, false),
        ("ready, elsewhere under externalTrafficPolicy Local", serde_json::json!({"externalTrafficPolicy": "Local"}), ready.clone(), other, false),
        ("terminating, published as ready", serde_json::json!({}), pnr.clone(), n.name.as_str(), true),
        ("terminating under a Local policy, published as ready", serde_json::json!({"internalTrafficPolicy": "Local"}), pnr.clone(), other, true),
    ] {
        let s = [svc(extra)];
        let stay = ep("10.1.0.9", n.name.as_str(), ready.clone());
        let mut inc = Incremental::new();
        inc.update(&s, &[slice(serde_json::json!([ep("10.1.0.1", node_name, cond), stay.clone()]))], &n, &opts);
        let ch = inc.update(&s, &[slice(serde_json::json!([stay]))], &n, &opts);
        let a: IpAddr = "10.1.0.1".parse().unwrap();
        let gone: Vec<&Pair> = ch.left.iter().filter(|p| p.3 == a).collect();
        assert_eq!(!gone.is_empty(), ends, "{what}: {gone:?}");
        // The others are told as kept (the agent records them for the next
        // one), the TCP ones of the pairs that left.
        let kept: Vec<&Pair> = ch.kept.iter().filter(|p| p.3 == a).collect();
        assert_eq!(kept.is_empty(), ends, "{what}: kept {kept:?}");
        assert!(kept.iter().all(|p| p.2 == Proto::Tcp), "{what}: {kept:?}");
    }
}

/// `udp_served`: the UDP frontends the socket hooks translate that got
/// backends, having had none (or not existed); never on a full update,
/// never a TCP frontend, never an externalIP left to the stack.
#[test]
fn udp_frontends_that_get_backends_are_named() {
    let opts = Options { external_ip_socket: false, ..Options::default() };
    let svc = |name: &str, ip: &str, ext: &[&str]| -> Arc<Service> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"clusterIP": ip, "externalIPs": ext, "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}
            }))
            .unwrap(),
        )
    };
    let slice = |name: &str, ips: &[&str]| -> Arc<EndpointSlice> {
        let eps: Vec<serde_json::Value> = ips.iter().map(|ip| serde_json::json!({"addresses": [ip]})).collect();
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": format!("{name}-1"), "namespace": "default", "labels": {"kubernetes.io/service-name": name}},
                "addressType": "IPv4",
                "ports": [{"name": "dns", "port": 5353, "protocol": "UDP"}, {"name": "dns-tcp", "port": 5353, "protocol": "TCP"}],
                "endpoints": eps
            }))
            .unwrap(),
        )
    };
    let udp = |ip: &str| FrontendKey { addr: ip.parse().unwrap(), port: 53, proto: Proto::Udp };
    let mut inc = Incremental::new();
    let a = svc("a", "10.96.0.10", &[]);
    let ch = inc.update(std::slice::from_ref(&a), &[slice("a", &["10.1.0.1"])], &node(), &opts);
    assert!(ch.full && ch.udp_served.is_empty(), "not on a full update: {:?}", ch.udp_served);
    // A new Service with endpoints at once, an externalIP among its frontends.
    let b = svc("b", "10.96.0.11", &["192.0.2.9"]);
    let ch = inc.update(&[a.clone(), b.clone()], &[slice("a", &["10.1.0.1"]), slice("b", &["10.1.0.2"])], &node(), &opts);
    assert_eq!(ch.udp_served, [udp("10.96.0.11")].into(), "the externalIP is left to the stack (--external-ip-socket=false)");
    // Endpoints gone, then back: named again when back only.
    let ch = inc.update(&[a.clone(), b.clone()], &[slice("a", &[]), slice("b", &["10.1.0.2"])], &node(), &opts);
    assert!(ch.udp_served.is_empty());
    let ch = inc.update(&[a.clone(), b.clone()], &[slice("a", &["10.1.0.3"]), slice("b", &["10.1.0.2"])], &node(), &opts);
    assert_eq!(ch.udp_served, [udp("10.96.0.10")].into());
    // Another endpoint beside one it had: not named.
    let ch = inc.update(&[a, b], &[slice("a", &["10.1.0.3", "10.1.0.4"]), slice("b", &["10.1.0.2"])], &node(), &opts);
    assert!(ch.udp_served.is_empty());
}
