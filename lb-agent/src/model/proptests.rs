//! The model against arbitrary, often invalid, Services and EndpointSlices:
//! invalid IPs, ports 0 and 65536, duplicate endpoints, huge slices,
//! mismatched address families, missing fields.
use proptest::prelude::*;

use k8s_openapi::api::core::v1::{LoadBalancerIngress, LoadBalancerStatus, Service, ServicePort, ServiceSpec, ServiceStatus};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForZone};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::*;

// Mostly valid values, so that the interesting paths run, with the
// invalid ones mixed in.
fn ip() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => (0u8..3, 1u8..4).prop_map(|(a, b)| format!("10.0.{a}.{b}")),
        3 => (1u8..4).prop_map(|a| format!("fd00::{a}")),
        1 => Just("::ffff:10.0.0.1".to_string()),
        1 => Just("not-an-ip".to_string()),
        1 => Just(String::new()),
        1 => Just("300.1.1.1".to_string()),
        1 => Just("None".to_string()),
        1 => Just("0.0.0.0".to_string()),
    ]
}

fn port() -> impl Strategy<Value = i32> {
    prop_oneof![1 => Just(0), 1 => Just(65536), 1 => Just(-1), 4 => Just(80), 2 => Just(8080), 2 => 1..70000i32]
}

fn name() -> impl Strategy<Value = Option<String>> {
    prop_oneof![3 => Just(None), 3 => Just(Some("http".to_string())), 1 => Just(Some("dns".to_string())), 1 => Just(Some(String::new()))]
}

fn proto() -> impl Strategy<Value = Option<String>> {
    prop_oneof![3 => Just(None), 3 => Just(Some("TCP".into())), 2 => Just(Some("UDP".into())), 1 => Just(Some("SCTP".into())), 1 => Just(Some("tcp".into()))]
}

fn opt_bool() -> impl Strategy<Value = Option<bool>> {
    prop_oneof![Just(None), Just(Some(true)), Just(Some(false))]
}

pub(crate) fn service() -> impl Strategy<Value = Service> {
    (
        prop_oneof![Just("a"), Just("b"), Just("c")],
        prop_oneof![Just(None), Just(Some("ClusterIP")), Just(Some("NodePort")), Just(Some("LoadBalancer")), Just(Some("ExternalName"))],
        proptest::collection::vec(ip(), 1..3),
        proptest::collection::vec((name(), port(), proto(), proptest::option::of(port())), 1..4),
        (opt_bool(), opt_bool(), opt_bool()),
        proptest::collection::vec(ip(), 0..2),
        proptest::collection::vec(prop_oneof![Just("10.0.0.0/8".to_string()), Just("bad".to_string()), Just("fd00::/200".to_string())], 0..2),
        proptest::option::of(port()),
    )
        .prop_map(|(n, ty, ips, ports, (itp, etp, aff), ext, ranges, hc)| Service {
            metadata: ObjectMeta { name: Some(n.into()), namespace: Some("default".into()), ..Default::default() },
            spec: Some(ServiceSpec {
                type_: ty.map(Into::into),
                cluster_ip: ips.first().cloned(),
                cluster_ips: Some(ips),
                ports: Some(
                    ports
                        .into_iter()
                        .map(|(name, port, protocol, node_port)| ServicePort { name, port, protocol, node_port, ..Default::default() })
                        .collect(),
                ),
                internal_traffic_policy: itp.map(|b| if b { "Local".into() } else { "Cluster".into() }),
                external_traffic_policy: etp.map(|b| if b { "Local".into() } else { "Cluster".into() }),
                session_affinity: aff.map(|b| if b { "ClientIP".into() } else { "None".into() }),
                external_ips: Some(ext.clone()),
                load_balancer_source_ranges: Some(ranges),
                health_check_node_port: hc,
                ..Default::default()
            }),
            status: Some(ServiceStatus {
                load_balancer: Some(LoadBalancerStatus {
                    ingress: Some(ext.into_iter().map(|ip| LoadBalancerIngress { ip: Some(ip), ..Default::default() }).collect()),
                }),
                ..Default::default()
            }),
        })
}

fn endpoint() -> impl Strategy<Value = Endpoint> {
    (
        proptest::collection::vec(ip(), 1..3),
        (opt_bool(), opt_bool(), opt_bool()),
        prop_oneof![Just(None), Just(Some("node-a".to_string())), Just(Some("node-b".to_string()))],
        prop_oneof![Just(None), Just(Some("zone-a")), Just(Some("zone-b"))],
    )
        .prop_map(|(addresses, (ready, serving, terminating), node_name, zone)| Endpoint {
            addresses,
            conditions: Some(EndpointConditions { ready, serving, terminating }),
            node_name,
            hints: zone.map(|z| EndpointHints { for_zones: Some(vec![ForZone { name: z.into() }]), ..Default::default() }),
            ..Default::default()
        })
}

pub(crate) fn slice(max_eps: usize) -> impl Strategy<Value = EndpointSlice> {
    (
        prop_oneof![1 => Just(None), 3 => Just(Some("a")), 3 => Just(Some("b")), 3 => Just(Some("c"))],
        0u32..1000,
        prop_oneof![5 => Just("IPv4"), 3 => Just("IPv6"), 1 => Just("FQDN"), 1 => Just("bogus")],
        proptest::collection::vec((name(), port().prop_map(Some), proto()), 1..3),
        proptest::collection::vec(endpoint(), 0..max_eps),
    )
        .prop_map(|(svc, id, family, ports, endpoints)| EndpointSlice {
            metadata: ObjectMeta {
                name: Some(format!("s{id}")),
                namespace: Some("default".into()),
                labels: svc.map(|s| [(LABEL_SERVICE_NAME.to_string(), s.to_string())].into()),
                ..Default::default()
            },
            address_type: family.into(),
            ports: Some(ports.into_iter().map(|(name, port, protocol)| EndpointPort { name, port, protocol, ..Default::default() }).collect()),
            endpoints,
        })
}

pub(crate) fn node() -> NodeInfo {
    NodeInfo { name: "node-a".into(), zone: Some("zone-a".into()), addresses: vec!["192.168.0.1".parse().unwrap(), "fd00:1::1".parse().unwrap()], primary: vec![] }
}

/// Everything but the warnings, whose order follows the input's.
fn essence(d: &Desired) -> Desired {
    Desired { warnings: Vec::new(), ..d.clone() }
}

fn check(services: &[Service], slices: &[EndpointSlice]) -> Result<(), TestCaseError> {
    let d = compute(services, slices, &node());
    for (k, f) in &d.frontends {
        prop_assert!(k.port != 0);
        for set in [&f.backends, &f.local_backends] {
            let mut seen = BTreeSet::new();
            for b in set {
                prop_assert!(b.port != 0, "{k}: backend port 0");
                prop_assert_eq!(b.addr.is_ipv4(), k.addr.is_ipv4(), "{}: family mismatch {}", k, b.addr);
                prop_assert!(!b.addr.is_unspecified(), "{k}: unspecified backend");
                prop_assert!(seen.insert((b.addr, b.port)), "{k}: duplicate backend {}:{}", b.addr, b.port);
            }
        }
        prop_assert!(f.local_backends.iter().all(|b| b.local));
    }
    // The output does not depend on the order of the slices or Services.
    let mut rs = slices.to_vec();
    rs.reverse();
    let mut rv = services.to_vec();
    rv.reverse();
    prop_assert_eq!(essence(&d), essence(&compute(&rv, &rs, &node())));
    Ok(())
}

proptest! {
    #[test]
    fn never_panics_and_emits_only_valid_backends(
        services in proptest::collection::vec(service(), 0..5),
        slices in proptest::collection::vec(slice(12), 0..6),
    ) {
        check(&services, &slices)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]
    #[test]
    fn huge_slices(
        services in proptest::collection::vec(service(), 1..3),
        slices in proptest::collection::vec(slice(1000), 1..3),
    ) {
        check(&services, &slices)?;
    }
}

/// The generators reach the interesting cases: frontends with backends,
/// external frontends, duplicates collapsed.
#[test]
fn the_generators_cover_real_cases() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut with_backends, mut external) = (0, 0);
    for _ in 0..300 {
        let services = proptest::collection::vec(service(), 1..5).new_tree(&mut runner).unwrap().current();
        let slices = proptest::collection::vec(slice(12), 1..6).new_tree(&mut runner).unwrap().current();
        let d = compute(&services, &slices, &node());
        with_backends += d.frontends.values().filter(|f| !f.backends.is_empty()).count();
        external += d.frontends.values().filter(|f| f.external).count();
    }
    assert!(with_backends > 20, "{with_backends}");
    assert!(external > 20, "{external}");
}
