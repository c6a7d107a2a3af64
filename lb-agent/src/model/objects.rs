//! The parts of Services and EndpointSlices the model reads, and nothing
//! else.
//!
//! A k8s-openapi EndpointSlice with 10 endpoints takes about 5 KB (each
//! Endpoint carries a target reference, deprecated topology, hostname...);
//! at 10,000 Services that alone is 50 MB. These types keep the same field
//! names and the same JSON shape, so they deserialize straight from what
//! `kubectl get -o yaml` prints or the API server sends, but drop what the
//! model never reads:
//! - labels other than the two the model looks at;
//! - annotations, managed fields, owner references;
//! - endpoint addresses that are not IP addresses (the model would skip
//!   them anyway), kept parsed.
//!
//! `From` the k8s-openapi types gives the same value as deserializing
//! their JSON (tested).
use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock};

use k8s_openapi::api::core::v1::{ServicePort, ServiceStatus, SessionAffinityConfig};
use k8s_openapi::api::discovery::v1::{EndpointConditions, EndpointHints, EndpointPort};
use serde::{Deserialize, Deserializer, Serialize};
use smallvec::SmallVec;

use super::{LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME};

/// The EndpointSlice annotation kube-proxy measures programming latency from.
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// Object metadata: name, namespace, and the labels the model reads.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub labels: Labels,
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "Annotations::is_empty")]
    pub annotations: Annotations,
}

/// The annotations the agent reads; the others are dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Annotations {
    /// `lb.dev/nodeport-algorithm` on a Service: how outside traffic picks
    /// a backend (`random` or `maglev`), overriding `--nodeport-algorithm`.
    #[serde(rename = "lb.dev/nodeport-algorithm", default, skip_serializing_if = "Option::is_none")]
    pub nodeport_algorithm: Option<Box<str>>,
    /// `lb.dev/nodeport-mode` on a Service: `snat` or `dsr`, overriding
    /// `--nodeport-mode`.
    #[serde(rename = "lb.dev/nodeport-mode", default, skip_serializing_if = "Option::is_none")]
    pub nodeport_mode: Option<Box<str>>,
    /// `endpoints.kubernetes.io/last-change-trigger-time` (RFC 3339) on an
    /// EndpointSlice: when the change it carries happened, for kube-proxy's
    /// network programming latency.
    #[serde(rename = "endpoints.kubernetes.io/last-change-trigger-time", default, skip_serializing_if = "Option::is_none")]
    pub last_change_trigger_time: Option<String>,
}

impl Annotations {
    fn is_empty(&self) -> bool {
        self.last_change_trigger_time.is_none() && self.nodeport_algorithm.is_none() && self.nodeport_mode.is_none()
    }
}

/// The labels the model reads; the others are dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Labels {
    /// `kubernetes.io/service-name`: the Service an EndpointSlice belongs to.
    #[serde(rename = "kubernetes.io/service-name", default, skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
    /// `service.kubernetes.io/service-proxy-name`: another proxy serves it.
    #[serde(rename = "service.kubernetes.io/service-proxy-name", default, skip_serializing_if = "Option::is_none")]
    pub proxy_name: Option<String>,
    /// `service.kubernetes.io/headless`: the EndpointSlice controller's mark
    /// on a headless Service's slices.
    #[serde(rename = "service.kubernetes.io/headless", default, skip_serializing_if = "Option::is_none")]
    pub headless: Option<String>,
}

fn null_as_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

impl From<&k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta> for Meta {
    fn from(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        let label = |k: &str| m.labels.as_ref().and_then(|l| l.get(k)).cloned();
        let annotation = |k: &str| m.annotations.as_ref().and_then(|a| a.get(k)).cloned();
        Meta {
            name: m.name.clone(),
            namespace: m.namespace.clone(),
            labels: Labels {
                service_name: label(LABEL_SERVICE_NAME),
                proxy_name: label(LABEL_SERVICE_PROXY_NAME),
                headless: label(super::LABEL_HEADLESS),
            },
            annotations: Annotations {
                nodeport_algorithm: annotation(super::ANNOTATION_NODEPORT_ALGORITHM).map(Into::into),
                nodeport_mode: annotation(super::ANNOTATION_NODEPORT_MODE).map(Into::into),
                last_change_trigger_time: annotation(LAST_CHANGE_TRIGGER_TIME),
            },
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Service {
    #[serde(default)]
    pub metadata: Meta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<ServiceSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ServiceStatus>,
}

/// The fields of a ServiceSpec the model reads.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceSpec {
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    #[serde(rename = "clusterIP", default, skip_serializing_if = "Option::is_none")]
    pub cluster_ip: Option<String>,
    #[serde(rename = "clusterIPs", default, skip_serializing_if = "Option::is_none")]
    pub cluster_ips: Option<Vec<String>>,
    #[serde(rename = "externalIPs", default, skip_serializing_if = "Option::is_none")]
    pub external_ips: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_traffic_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check_node_port: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub internal_traffic_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balancer_source_ranges: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<ServicePort>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_affinity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_affinity_config: Option<SessionAffinityConfig>,
}

impl From<&k8s_openapi::api::core::v1::Service> for Service {
    fn from(s: &k8s_openapi::api::core::v1::Service) -> Self {
        Service {
            metadata: Meta::from(&s.metadata),
            spec: s.spec.as_ref().map(|p| ServiceSpec {
                type_: p.type_.clone(),
                cluster_ip: p.cluster_ip.clone(),
                cluster_ips: p.cluster_ips.clone(),
                external_ips: p.external_ips.clone(),
                external_traffic_policy: p.external_traffic_policy.clone(),
                health_check_node_port: p.health_check_node_port,
                internal_traffic_policy: p.internal_traffic_policy.clone(),
                load_balancer_source_ranges: p.load_balancer_source_ranges.clone(),
                ports: p.ports.clone(),
                session_affinity: p.session_affinity.clone(),
                session_affinity_config: p.session_affinity_config.clone(),
            }),
            status: s.status.clone(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointSlice {
    #[serde(default)]
    pub metadata: Meta,
    #[serde(default)]
    pub address_type: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub endpoints: Vec<Endpoint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<EndpointPort>>,
}

/// An endpoint: its IP addresses (others dropped; nearly always one, kept
/// inline), conditions, zone hints and node (names shared: a cluster has
/// few nodes and many endpoints).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    #[serde(default, deserialize_with = "ip_addresses")]
    pub addresses: SmallVec<[IpAddr; 1]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<EndpointConditions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hints: Option<Box<EndpointHints>>,
    #[serde(default, deserialize_with = "node_name", skip_serializing_if = "Option::is_none")]
    pub node_name: Option<Arc<str>>,
}

/// An endpoint's address: its first, as kube-proxy takes it (the API
/// says consumers use the first and may ignore the rest), parsed as
/// kube-proxy parses it (`ParseIPSloppy`: an IPv4 address with leading
/// zeros, `10.244.001.005`, is 10.244.1.5); none when that one does not
/// parse.
fn parse_ips<'a>(v: impl IntoIterator<Item = &'a String>) -> SmallVec<[IpAddr; 1]> {
    v.into_iter().next().and_then(|a| crate::model::parse_ip_sloppy(a)).into_iter().collect()
}

fn ip_addresses<'de, D: Deserializer<'de>>(d: D) -> Result<SmallVec<[IpAddr; 1]>, D::Error> {
    let v: Option<Vec<String>> = Option::deserialize(d)?;
    Ok(parse_ips(v.iter().flatten()))
}

/// One shared copy of each node name. Names no object holds any more are
/// dropped whenever the set has doubled since the last pass (node names
/// come and go with autoscaled nodes): the set stays within twice the
/// names in use, at amortised constant cost.
struct Names {
    set: HashSet<Arc<str>>,
    prune_at: usize,
}

fn names() -> std::sync::MutexGuard<'static, Names> {
    static NAMES: OnceLock<Mutex<Names>> = OnceLock::new();
    NAMES.get_or_init(|| Mutex::new(Names { set: HashSet::new(), prune_at: 1024 })).lock().unwrap_or_else(|e| e.into_inner())
}

fn intern(name: &str) -> Arc<str> {
    let mut names = names();
    if let Some(n) = names.set.get(name) {
        return n.clone();
    }
    if names.set.len() >= names.prune_at {
        names.set.retain(|n| Arc::strong_count(n) > 1);
        names.prune_at = (names.set.len() * 2).max(1024);
    }
    let n: Arc<str> = Arc::from(name);
    names.set.insert(n.clone());
    n
}

fn node_name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Arc<str>>, D::Error> {
    let v: Option<std::borrow::Cow<'de, str>> = Option::deserialize(d)?;
    Ok(v.map(|n| intern(&n)))
}

impl From<&k8s_openapi::api::discovery::v1::EndpointSlice> for EndpointSlice {
    fn from(s: &k8s_openapi::api::discovery::v1::EndpointSlice) -> Self {
        EndpointSlice {
            metadata: Meta::from(&s.metadata),
            address_type: s.address_type.clone(),
            endpoints: s
                .endpoints
                .iter()
                .map(|e| Endpoint {
                    addresses: parse_ips(&e.addresses),
                    conditions: e.conditions.clone(),
                    hints: e.hints.clone().map(Box::new),
                    node_name: e.node_name.as_deref().map(intern),
                })
                .collect(),
            ports: s.ports.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use std::collections::BTreeMap;

    use super::super::proptests::{service, slice};
    use super::*;

    proptest! {
        /// Converting a k8s-openapi object and deserializing its JSON give
        /// the same value.
        #[test]
        fn from_equals_deserialize(s in service(), e in slice(6)) {
            let mut s = s;
            let mut e = e;
            let labels: BTreeMap<String, String> = [("app".to_string(), "x".to_string()), (LABEL_SERVICE_PROXY_NAME.to_string(), "other".to_string())].into();
            s.metadata.labels = Some(labels);
            e.metadata.annotations = Some([("a".to_string(), "b".to_string()), (LAST_CHANGE_TRIGGER_TIME.to_string(), "2026-12-01T10:00:00Z".to_string())].into());
            let via_json: Service = serde_json::from_value(serde_json::to_value(&s).unwrap()).unwrap();
            prop_assert_eq!(via_json, Service::from(&s));
            let via_json: EndpointSlice = serde_json::from_value(serde_json::to_value(&e).unwrap()).unwrap();
            prop_assert_eq!(via_json, EndpointSlice::from(&e));
        }
    }

    #[test]
    fn only_relevant_labels_and_ip_addresses_are_kept() {
        let e: EndpointSlice = serde_json::from_str(
            r#"{"metadata": {"name": "s", "labels": {"kubernetes.io/service-name": "web", "app": "x"}, "annotations": {"a": "b"}},
                "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1", "10.0.0.2"], "targetRef": {"kind": "Pod", "name": "p"}},
                                                     {"addresses": ["not-an-ip", "10.0.0.3"]}]}"#,
        )
        .unwrap();
        assert_eq!(e.metadata.labels, Labels { service_name: Some("web".into()), proxy_name: None, headless: None });
        assert_eq!(e.endpoints[0].addresses.as_slice(), ["10.0.0.1".parse::<IpAddr>().unwrap()]);
        assert!(e.endpoints[1].addresses.is_empty(), "the first address only");
        // Leading zeros, as kube-proxy's ParseIPSloppy reads them.
        let e: EndpointSlice =
            serde_json::from_str(r#"{"metadata": {"name": "s"}, "addressType": "IPv4", "endpoints": [{"addresses": ["10.244.001.005"]}]}"#).unwrap();
        assert_eq!(e.endpoints[0].addresses.as_slice(), ["10.244.1.5".parse::<IpAddr>().unwrap()]);
        let e: EndpointSlice = serde_json::from_str(r#"{"metadata": {"name": "s"}, "addressType": "IPv4", "endpoints": null}"#).unwrap();
        assert!(e.endpoints.is_empty());
    }

    /// Node names no object holds are dropped: a cluster whose nodes are
    /// replaced every day does not grow the agent for good; a name in use
    /// stays one shared copy.
    #[test]
    fn node_names_no_object_holds_are_dropped() {
        let kept = intern("node-kept-by-this-test");
        for i in 0..10_000 {
            drop(intern(&format!("node-autoscaled-{i}")));
        }
        let len = names().set.len();
        // Other tests of this process intern names too, a few at a time.
        assert!(len < 2_500, "{len} names held");
        assert!(Arc::ptr_eq(&kept, &intern("node-kept-by-this-test")), "one copy of a name in use");
    }
}
