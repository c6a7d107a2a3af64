//! One Service's contribution to the desired state: its ClusterIP
//! frontends, its external frontends (NodePort, LoadBalancer IPs,
//! externalIPs) and kube-proxy's health check for externalTrafficPolicy
//! Local. Which endpoints serve a port is `endpoints`' job.
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ServicePort;

use super::endpoints::{PortEndpoints, Sets, conditions};
use super::objects::ServiceSpec;
use super::{
    ANNOTATION_NODEPORT_ALGORITHM, ANNOTATION_NODEPORT_MODE, Algorithm, Backend, DEFAULT_AFFINITY_TIMEOUT, Mode, EndpointSlice, Frontend, FrontendKey, HealthCheck, NodeInfo, Options, Proto, Service, ServiceRef,
    parse_cidr, parse_ip_sloppy, parse_proto, skip_reason, usable_ip, valid_port,
};

/// How a Service claims a frontend. Of two Services that claim one, the
/// lower kind keeps it (then the first by reference): a ClusterIP (which
/// the API server allocated to it alone) is never taken by another
/// Service's externalIP or LoadBalancer IP naming the same address and
/// port, and an externalIP (anyone who may edit a Service can set one:
/// CVE-2020-8554) never takes a NodePort or an ingress IP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Claim {
    ClusterIp,
    /// A NodePort on a node address, or a LoadBalancer ingress IP.
    NodeOrIngress,
    /// The ingress IP of a Service not of type LoadBalancer (one turned
    /// ClusterIP or NodePort whose status its controller has not cleared
    /// yet): a LoadBalancer the controller gave that IP since keeps it.
    OtherTypesIngress,
    ExternalIp,
}

impl Claim {
    pub fn external(self) -> bool {
        self != Claim::ClusterIp
    }
}

/// What one Service contributes to the desired state, before conflicts
/// with other Services are settled.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServiceOut {
    /// Frontends in the order the Service claims them, each key once, and
    /// how it claims each.
    pub frontends: Vec<(FrontendKey, Arc<Frontend>, Claim)>,
    /// The ClusterIPs it serves (empty: the Service is not served).
    pub vips: Vec<IpAddr>,
    pub node_ports: BTreeSet<(u16, Proto)>,
    pub health_check: Option<(u16, HealthCheck)>,
    pub warnings: Vec<String>,
}

impl ServiceOut {
    /// Claim `key` for `front` unless this Service has it already.
    fn claim(&mut self, claimed: &mut BTreeSet<FrontendKey>, sref: &ServiceRef, key: FrontendKey, front: Frontend, how: Claim) {
        if claimed.insert(key) {
            self.frontends.push((key, Arc::new(front), how));
        } else {
            self.warnings.push(lost_warning(sref, &key, how.external()));
        }
    }
}

/// The warning for a frontend that an earlier Service already has.
pub(super) fn lost_warning(sref: &ServiceRef, key: &FrontendKey, external: bool) -> String {
    if external {
        format!("Service {sref}: {key} is already a frontend of another Service, ignored")
    } else {
        format!("Service {sref}: {key} is already a frontend, ignored")
    }
}

/// Sort objects of one name by content, so that duplicates (a mistake in a
/// directory of files) resolve the same way whatever the input order.
pub(super) fn by_content<T: serde::Serialize>(a: &T, b: &T) -> std::cmp::Ordering {
    serde_json::to_string(a).unwrap_or_default().cmp(&serde_json::to_string(b).unwrap_or_default())
}

/// The contribution of the Service `sref`: `services` are its definitions
/// (more than one is a mistake; one is used), `slices` the EndpointSlices
/// labelled with it (FQDN slices already left out). Any order.
pub fn compute_service<S, E>(sref: &ServiceRef, services: &[S], slices: &[E], node: &NodeInfo, opts: &Options) -> ServiceOut
where
    S: std::borrow::Borrow<Service>,
    E: std::borrow::Borrow<EndpointSlice>,
{
    let mut out = ServiceOut::default();
    let mut defs: Vec<&Service> = services.iter().map(|s| s.borrow()).collect();
    if defs.len() > 1 {
        defs.sort_by(|a, b| by_content(*a, *b));
        for _ in 1..defs.len() {
            out.warnings.push(format!("Service {sref} is defined more than once; one definition is used"));
        }
    }
    let Some(svc) = defs.first().copied() else { return out };
    if let Some(reason) = skip_reason(svc) {
        tracing::debug!(service = %sref, reason, "not served");
        return out;
    }
    // Slices in a stable order: by name, identical names by content.
    let mut svc_slices: Vec<&EndpointSlice> = slices.iter().map(|s| s.borrow()).collect();
    svc_slices.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name).then_with(|| by_content(*a, *b)));
    let Some(spec) = svc.spec.as_ref() else { return out };
    let vips = cluster_ips(sref, spec, &mut out.warnings);
    if vips.is_empty() {
        return out;
    }
    let mut claimed: BTreeSet<FrontendKey> = BTreeSet::new();
    let a = &svc.metadata.annotations;
    let algorithm = annotated(sref, a.nodeport_algorithm.as_deref(), ANNOTATION_NODEPORT_ALGORITHM, opts.nodeport_algorithm, &mut out.warnings);
    let mode = annotated(sref, a.nodeport_mode.as_deref(), ANNOTATION_NODEPORT_MODE, opts.nodeport_mode, &mut out.warnings);
    let (maglev, dsr) = (algorithm == Algorithm::Maglev, mode == Mode::Dsr);
    for sp in spec.ports.iter().flatten() {
        let Some(proto) = parse_proto(sp.protocol.as_deref()) else {
            out.warnings.push(format!(
                "Service {sref}: port {} protocol {} is not supported, ignored",
                sp.port,
                sp.protocol.as_deref().unwrap_or("")
            ));
            continue;
        };
        let Some(port) = valid_port(sp.port) else {
            out.warnings.push(format!("Service {sref}: invalid port {}, ignored", sp.port));
            continue;
        };
        let p = Port {
            sref,
            svc,
            spec,
            sp,
            port,
            proto,
            node,
            opts,
            eps: PortEndpoints { slices: &svc_slices, sp, proto, node },
            base: base_frontend(sref, spec, sp),
            maglev,
            dsr,
        };
        cluster_frontends(&mut out, &mut claimed, &p, &vips);
        external_frontends(&mut out, &mut claimed, &p, &vips);
    }
    out.health_check = health_check(sref, spec, &svc_slices, node, &vips);
    out.vips = vips;
    out
}

/// The ClusterIPs, each once, with a warning for each unusable one.
fn cluster_ips(sref: &ServiceRef, spec: &ServiceSpec, warnings: &mut Vec<String>) -> Vec<IpAddr> {
    let mut vips: Vec<IpAddr> = Vec::new();
    let raw: Vec<&String> = match spec.cluster_ips.as_ref().filter(|v| !v.is_empty()) {
        Some(ips) => ips.iter().collect(),
        None => spec.cluster_ip.iter().collect(),
    };
    for ip in raw {
        match parse_ip_sloppy(ip).ok_or(()) {
            Ok(a) if !usable_ip(&a) => warnings.push(format!("Service {sref}: clusterIP {ip:?} is not usable, ignored")),
            Ok(a) if !vips.contains(&a) => vips.push(a),
            Ok(_) => {}
            Err(()) => warnings.push(format!("Service {sref}: invalid clusterIP {ip:?}, ignored")),
        }
    }
    vips
}

/// One Service port and what its frontends are made from.
struct Port<'a> {
    sref: &'a ServiceRef,
    svc: &'a Service,
    spec: &'a ServiceSpec,
    sp: &'a ServicePort,
    port: u16,
    proto: Proto,
    node: &'a NodeInfo,
    opts: &'a Options,
    eps: PortEndpoints<'a>,
    /// What every frontend of the port shares.
    base: Frontend,
    /// Outside traffic picks by Maglev.
    maglev: bool,
    /// Outside traffic to other nodes' backends uses DSR.
    dsr: bool,
}


/// A Service's choice by `annotation` (a value of `T`), else the agent's
/// `default`. An unknown value is warned about, naming the Service and the
/// annotation, and the default is used.
fn annotated<T: std::str::FromStr<Err = String> + std::fmt::Debug + Copy>(
    sref: &ServiceRef,
    value: Option<&str>,
    annotation: &str,
    default: T,
    warnings: &mut Vec<String>,
) -> T {
    let Some(v) = value else { return default };
    v.parse().unwrap_or_else(|e| {
        warnings.push(format!("Service {sref}: annotation {annotation}: {e}; using {default:?}"));
        default
    })
}

/// What every frontend of one Service port shares.
fn base_frontend(sref: &ServiceRef, spec: &ServiceSpec, sp: &ServicePort) -> Frontend {
    let affinity_timeout = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|t| u32::try_from(t).ok())
            .filter(|t| *t > 0)
            .unwrap_or(DEFAULT_AFFINITY_TIMEOUT)
    });
    Frontend { affinity_timeout, ..Frontend::new(sref.clone(), sp.name.clone().unwrap_or_default()) }
}

/// One frontend per ClusterIP, following internalTrafficPolicy (topology
/// applies to cluster-wide traffic only).
fn cluster_frontends(out: &mut ServiceOut, claimed: &mut BTreeSet<FrontendKey>, p: &Port<'_>, vips: &[IpAddr]) {
    let local_only = p.spec.internal_traffic_policy.as_deref() == Some("Local");
    for vip in vips {
        let Sets { cluster, topology, local, extra_ready, extra } = p.eps.sets(vip.is_ipv4(), !local_only);
        warn_too_many(out, p, &cluster, &local);
        let front = Frontend { backends: cluster, local_only, local_backends: local, topology, extra_ready, extra_serving: extra, ..p.base.clone() };
        out.claim(claimed, p.sref, FrontendKey { addr: *vip, port: p.port, proto: p.proto }, front, Claim::ClusterIp);
    }
}

/// A frontend takes at most `MAX_BACKENDS` (its slots are numbered in 16
/// bits): more are warned about, naming the Service (once: the warnings
/// are logged once while they hold).
fn warn_too_many(out: &mut ServiceOut, p: &Port<'_>, cluster: &[Backend], local: &[Backend]) {
    let most = cluster.len().max(local.len());
    if most > crate::model::MAX_BACKENDS {
        let w = format!(
            "Service {}: {most} endpoints for port {}: a frontend takes the first {} (by address), the rest get no traffic",
            p.sref,
            p.port,
            crate::model::MAX_BACKENDS
        );
        if !out.warnings.contains(&w) {
            out.warnings.push(w);
        }
    }
}

/// An address traffic from outside arrives at.
struct External {
    addr: IpAddr,
    port: u16,
    /// In-cluster connects to it are not translated (externalIPs, by
    /// `Options::external_ip_socket`).
    no_socket: bool,
    /// A LoadBalancer ingress IP: loadBalancerSourceRanges apply.
    lb_ip: bool,
    /// 127.0.0.1 (`NodeFacts::localhost_nodeports`): for the node's own
    /// sockets only.
    host_only: bool,
    /// From `spec.externalIPs`.
    external_ip: bool,
}

/// The NodePort on every node address, the LoadBalancer ingress IPs (not
/// those with ipMode Proxy; of any type of Service) and the externalIPs of
/// one Service port.
fn external_addresses(out: &mut ServiceOut, p: &Port<'_>) -> Vec<External> {
    let Port { sref, svc, spec, sp, port, proto, node, opts, .. } = *p;
    let mut external = Vec::new();
    if matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"))
        && let Some(np) = sp.node_port
    {
        match valid_port(np) {
            Some(np) => {
                out.node_ports.insert((np, proto));
                // 127.0.0.1 among them: kube-proxy's localhost NodePorts,
                // for the node's own sockets only.
                external.extend(node.addresses.iter().map(|a| External { addr: *a, port: np, no_socket: false, lb_ip: false, host_only: a.is_loopback(), external_ip: false }));
            }
            None => out.warnings.push(format!("Service {sref}: invalid nodePort {np}, ignored")),
        }
    }
    // Whatever the Service's type, as kube-proxy reads them
    // (`newBaseServiceInfo`): a Service turned from LoadBalancer to
    // ClusterIP keeps its ingress IPs until the load balancer's controller
    // clears its status, and some controllers set it on other types.
    {
        let ingress = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.as_ref());
        for ing in ingress.into_iter().flatten() {
            // ipMode Proxy: the load balancer proxies to the nodes; its IP
            // is not short-circuited.
            if ing.ip_mode.as_deref() == Some("Proxy") {
                continue;
            }
            match ing.ip.as_deref().map(|ip| parse_ip_sloppy(ip).ok_or(())) {
                Some(Ok(a)) if usable_ip(&a) => external.push(External { addr: a, port, no_socket: false, lb_ip: true, host_only: false, external_ip: false }),
                Some(_) => out.warnings.push(format!("Service {sref}: invalid load balancer ingress IP {:?}", ing.ip)),
                None => {}
            }
        }
    }
    for ip in spec.external_ips.iter().flatten() {
        match parse_ip_sloppy(ip) {
            Some(a) if usable_ip(&a) => external.push(External { addr: a, port, no_socket: !opts.external_ip_socket, lb_ip: false, host_only: false, external_ip: true }),
            _ => out.warnings.push(format!("Service {sref}: invalid externalIP {ip:?}, ignored")),
        }
    }
    external
}

/// loadBalancerSourceRanges, with a warning for each invalid one.
fn source_ranges(sref: &ServiceRef, spec: &ServiceSpec, warnings: &mut Vec<String>) -> Vec<(IpAddr, u8)> {
    let mut ranges = Vec::new();
    for r in spec.load_balancer_source_ranges.iter().flatten() {
        match parse_cidr(r) {
            Some(c) => ranges.push(c),
            None => warnings.push(format!("Service {sref}: invalid loadBalancerSourceRange {r:?}, ignored")),
        }
    }
    ranges
}

/// One frontend per external address, following externalTrafficPolicy;
/// only in the families the Service has a ClusterIP of, as kube-proxy's
/// proxier of a family skips a Service without a ClusterIP of its own
/// (`serviceToServiceMap`) and filters externalIPs, ingress IPs and
/// source ranges to its family: a single-stack IPv4 Service has no IPv6
/// NodePort.
fn external_frontends(out: &mut ServiceOut, claimed: &mut BTreeSet<FrontendKey>, p: &Port<'_>, vips: &[IpAddr]) {
    let (external, other): (Vec<External>, Vec<External>) =
        external_addresses(out, p).into_iter().partition(|e| vips.iter().any(|v| v.is_ipv4() == e.addr.is_ipv4()));
    // The node's own addresses of the other family are not worth a line.
    let ignored: Vec<String> = other.iter().filter(|e| !p.node.addresses.contains(&e.addr)).map(|e| e.addr.to_string()).collect();
    if !ignored.is_empty() {
        tracing::debug!(service = %p.sref, ?ignored, "addresses of a family the Service has no ClusterIP of are not served");
    }
    // kube-proxy's `ExternalPolicyLocal`: only for a Service reachable
    // from outside (NodePort, LoadBalancer, or with externalIPs); the
    // ingress IPs of a ClusterIP Service are served with the Cluster
    // policy whatever it says.
    let reachable = matches!(p.spec.type_.as_deref(), Some("NodePort" | "LoadBalancer")) || p.spec.external_ips.as_ref().is_some_and(|e| !e.is_empty());
    let ext_local = reachable && p.spec.external_traffic_policy.as_deref() == Some("Local");
    let ranges = source_ranges(p.sref, p.spec, &mut out.warnings);
    let mut warned_hints = false;
    for e in external {
        // Outside traffic only: a localhost NodePort (the node's own
        // sockets) needs no Maglev table and never leaves by DSR.
        let maglev = p.maglev && !e.host_only;
        // Every node builds a Maglev frontend's table from the same
        // endpoints, so that a flow an upstream router moves to another
        // node keeps its pod: topology hints (which narrow the set per zone
        // or node) are not applied to it, where kube-proxy applies them.
        let mut sets = p.eps.sets(e.addr.is_ipv4(), true);
        if maglev && sets.topology {
            sets = p.eps.sets(e.addr.is_ipv4(), false);
            if !std::mem::replace(&mut warned_hints, true) {
                out.warnings.push(format!(
                    "Service {}: its endpoints' topology hints (trafficDistribution) are not applied to its Maglev frontends \
                     (NodePort, LoadBalancer IPs, externalIPs): every node must pick the same endpoint for a flow",
                    p.sref
                ));
            }
        }
        let Sets { cluster, topology, local, extra_ready, extra } = sets;
        warn_too_many(out, p, &cluster, &local);
        let source_ranges: Vec<(IpAddr, u8)> =
            if e.lb_ip { ranges.iter().filter(|(a, _)| a.is_ipv4() == e.addr.is_ipv4()).copied().collect() } else { Vec::new() };
        let front = Frontend {
            backends: cluster,
            local_backends: local,
            topology,
            external: true,
            ext_local,
            no_socket: e.no_socket,
            host_only: e.host_only,
            source_ranges,
            extra_ready,
            extra_serving: extra,
            maglev,
            // Local never leaves the node.
            dsr: p.dsr && !ext_local && !e.host_only,
            ..p.base.clone()
        };
        let how = if e.external_ip {
            Claim::ExternalIp
        } else if e.lb_ip && p.spec.type_.as_deref() != Some("LoadBalancer") {
            Claim::OtherTypesIngress
        } else {
            Claim::NodeOrIngress
        };
        out.claim(claimed, p.sref, FrontendKey { addr: e.addr, port: e.port, proto: p.proto }, front, how);
    }
}

/// kube-proxy's health check for a LoadBalancer Service with
/// externalTrafficPolicy Local: the ready endpoints on this node.
fn health_check(sref: &ServiceRef, spec: &ServiceSpec, slices: &[&EndpointSlice], node: &NodeInfo, vips: &[IpAddr]) -> Option<(u16, HealthCheck)> {
    if spec.external_traffic_policy.as_deref() != Some("Local") || spec.type_.as_deref() != Some("LoadBalancer") {
        return None;
    }
    let hc = spec.health_check_node_port.and_then(valid_port)?;
    // What kube-proxy's endpoints map holds: endpoints of slices with a
    // port (of any name), each address once, in its own family.
    let local: BTreeSet<IpAddr> = slices
        .iter()
        .filter(|s| s.ports.iter().flatten().any(|p| p.port.and_then(valid_port).is_some()))
        .filter(|s| matches!(s.address_type.as_str(), "IPv4" | "IPv6"))
        .flat_map(|s| s.endpoints.iter().map(move |ep| (s.address_type.as_str() == "IPv4", ep)))
        .filter(|(_, ep)| ep.node_name.as_deref() == Some(node.name.as_str()) && !node.name.is_empty() && conditions(ep).ready)
        .flat_map(|(v4, ep)| ep.addresses.iter().copied().filter(move |a| a.is_ipv4() == v4))
        .collect();
    let local_v4 = local.iter().filter(|a| a.is_ipv4()).count();
    let v4 = vips.iter().any(IpAddr::is_ipv4);
    let single = (v4 != vips.iter().any(IpAddr::is_ipv6)).then_some(v4);
    Some((hc, HealthCheck { service: sref.clone(), local_v4, local_v6: local.len() - local_v4, single }))
}
