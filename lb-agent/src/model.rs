//! The pure model: (Services, EndpointSlices, Node) -> desired frontends.
//!
//! Every Kubernetes rule lives here and nowhere else. No I/O, no BPF: the
//! output is plain data that the dataplane turns into map entries, so unit
//! tests cover the rules without a kernel.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

mod node;
pub mod objects;
pub use node::{NodeFacts, NodeInfo, NodePortAddresses, node_eligible, node_info};
pub use objects::{Endpoint, EndpointSlice, Service};

/// Label that ties an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Services with this label belong to another proxy.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// The EndpointSlice controller's label on a headless Service's slices.
/// kube-proxy's informers leave out Services and slices with either label
/// (the kube source asks the API server to; the model holds any source to
/// it).
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// kube-proxy's default sessionAffinity timeout.
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;

/// Service annotation choosing how outside traffic picks a backend:
/// `random` or `maglev` (see `Algorithm`).
pub const ANNOTATION_NODEPORT_ALGORITHM: &str = "lb.dev/nodeport-algorithm";
/// Service annotation choosing how outside traffic reaches a backend on
/// another node: `snat` or `dsr` (see `Mode`).
pub const ANNOTATION_NODEPORT_MODE: &str = "lb.dev/nodeport-mode";

/// Label that carries a Node's zone.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";

/// Choices the operator makes that change what the model emits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// Translate in-cluster connects to externalIPs too, as kube-proxy does.
    /// Off: only traffic arriving from outside is translated (CVE-2020-8554).
    pub external_ip_socket: bool,
    /// `--nodeport-algorithm`: how outside traffic picks a backend unless
    /// the Service's `lb.dev/nodeport-algorithm` annotation says otherwise.
    pub nodeport_algorithm: Algorithm,
    /// `--nodeport-mode`: SNAT or DSR for outside traffic to a backend on
    /// another node, unless the Service's `lb.dev/nodeport-mode` says
    /// otherwise.
    pub nodeport_mode: Mode,
}

impl Default for Options {
    fn default() -> Self {
        Self { external_ip_socket: true, nodeport_algorithm: Algorithm::Random, nodeport_mode: Mode::Snat }
    }
}

/// How a new outside flow reaches a backend on another node
/// (externalTrafficPolicy Cluster).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// SNAT to this node's address, so the replies come back here (as
    /// kube-proxy does).
    #[default]
    Snat,
    /// Direct server return (both families): the pod sees the client's
    /// address and its node answers the client directly.
    Dsr,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        one_of(s, &[("snat", Mode::Snat), ("dsr", Mode::Dsr)])
    }
}

/// How a new outside flow (NodePort, LoadBalancer IP, externalIP) picks its
/// backend. In-cluster connects always pick at random.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// At random (a hash of the flow, so that a retransmitted first packet
    /// picks the same one), as kube-proxy does.
    #[default]
    Random,
    /// Maglev consistent hashing: every node picks the same backend for a
    /// flow, and a backend joining or leaving moves about 1/N of the flows.
    Maglev,
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        one_of(s, &[("random", Algorithm::Random), ("maglev", Algorithm::Maglev)])
    }
}

/// The value named `s` among `choices`, or an error naming them.
fn one_of<T: Copy>(s: &str, choices: &[(&str, T)]) -> Result<T, String> {
    choices.iter().find(|(name, _)| *name == s).map(|(_, v)| *v).ok_or_else(|| {
        let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
        format!("{s:?} is not {}", names.join(" or "))
    })
}

/// kube-proxy's health check for a Service with externalTrafficPolicy Local.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub service: ServiceRef,
    /// Ready endpoints of the Service on this node, by family (IPv4,
    /// IPv6): the distinct addresses kube-proxy's proxier of that family
    /// counts (`LocalReadyEndpoints`).
    pub local_v4: usize,
    pub local_v6: usize,
    /// The Service's only family (true: IPv4); None: dual-stack.
    pub single: Option<bool>,
}

impl HealthCheck {
    /// The count a client of family `v4` is answered with. kube-proxy up
    /// to 1.35 listens on both families whichever proxier owns the
    /// Service: a single-stack Service's count goes to every client (a
    /// load balancer probing a dual-stack node's IPv4 address for an IPv6
    /// Service gets the IPv6 count; 1.36 refuses it). A dual-stack
    /// Service's: the client's family's, as 1.36's per-family listeners
    /// count (up to 1.35 one family's proxier holds the port).
    pub fn local_endpoints(&self, v4: bool) -> usize {
        if self.single.unwrap_or(v4) { self.local_v4 } else { self.local_v6 }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proto {
    Tcp,
    Udp,
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "TCP",
            Proto::Udp => "UDP",
        })
    }
}

/// `namespace/name` of a Service. Cheap to clone: the names are shared.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ServiceRef {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl fmt::Display for ServiceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One address a client can connect to: `vip:port/proto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrontendKey {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Proto,
}

impl fmt::Display for FrontendKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr {
            IpAddr::V4(a) => write!(f, "{a}:{}/{}", self.port, self.proto),
            IpAddr::V6(a) => write!(f, "[{a}]:{}/{}", self.port, self.proto),
        }
    }
}

/// One backend of a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub addr: IpAddr,
    pub port: u16,
    /// The endpoint's nodeName is this node.
    pub local: bool,
    /// Serving but terminating: only used because nothing is ready.
    pub terminating: bool,
    /// The endpoint's terminating condition (its pod is being deleted),
    /// also where a Service's publishNotReadyAddresses keeps it ready.
    pub pod_terminating: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frontend {
    pub service: ServiceRef,
    /// The Service port's name ("" when unnamed).
    pub port_name: String,
    /// Backends for cluster-wide traffic, sorted and without duplicates.
    pub backends: Vec<Backend>,
    /// internalTrafficPolicy Local: only `local_backends` may be used.
    pub local_only: bool,
    /// Backends on this node (the node-local set, with its own terminating
    /// fallback), sorted and without duplicates.
    pub local_backends: Vec<Backend>,
    /// sessionAffinity ClientIP timeout, in seconds.
    pub affinity_timeout: Option<u32>,
    /// Topology hints narrowed `backends` to this node or its zone.
    pub topology: bool,
    /// A NodePort, LoadBalancer-IP or externalIP frontend.
    pub external: bool,
    /// externalTrafficPolicy Local: outside traffic only to `local_backends`.
    pub ext_local: bool,
    /// In-cluster connects are not translated (see `Options`).
    pub no_socket: bool,
    /// Only the node's own sockets are translated (a localhost NodePort:
    /// `NodeFacts::localhost_nodeports`); never traffic from outside.
    pub host_only: bool,
    /// loadBalancerSourceRanges (LoadBalancer IPs only): (network, prefix length).
    pub source_ranges: Vec<(IpAddr, u8)>,
    /// Ready endpoints in neither backend set (left out by topology
    /// hints, internalTrafficPolicy Local, or externalTrafficPolicy
    /// Local): their connections are not stale. Sorted; usually empty.
    pub extra_ready: Vec<(IpAddr, u16)>,
    /// The other endpoints whose connections are not stale either: serving
    /// while terminating, and for TCP every one the slices list (draining,
    /// or failing its readiness probe: kube-proxy never flushes TCP
    /// conntrack entries). Sorted; usually empty. See `serving`.
    pub extra_serving: Vec<(IpAddr, u16)>,
    /// External frontends only: outside flows pick their backend by Maglev
    /// (`Algorithm::Maglev`).
    pub maglev: bool,
    /// External IPv4 frontends with externalTrafficPolicy Cluster only:
    /// direct server return to backends on other nodes (`Mode::Dsr`).
    pub dsr: bool,
}

impl Frontend {
    /// A frontend of Service port `port_name` with nothing set yet.
    pub fn new(service: ServiceRef, port_name: String) -> Self {
        Frontend {
            service,
            port_name,
            backends: Vec::new(),
            local_only: false,
            local_backends: Vec::new(),
            affinity_timeout: None,
            topology: false,
            external: false,
            ext_local: false,
            no_socket: false,
            host_only: false,
            source_ranges: Vec::new(),
            extra_ready: Vec::new(),
            extra_serving: Vec::new(),
            maglev: false,
            dsr: false,
        }
    }

    /// Every endpoint that still serves, picked or not: connections to the
    /// others are stale. Sorted.
    pub fn serving(&self) -> Vec<(IpAddr, u16)> {
        let all: BTreeSet<(IpAddr, u16)> = self
            .backends
            .iter()
            .chain(&self.local_backends)
            .map(|b| (b.addr, b.port))
            .chain(self.extra_ready.iter().copied())
            .chain(self.extra_serving.iter().copied())
            .collect();
        all.into_iter().collect()
    }

    /// Whether `addr:port` still serves this frontend.
    pub fn serves(&self, addr: IpAddr, port: u16) -> bool {
        find(&self.backends, addr, port).is_some()
            || find(&self.local_backends, addr, port).is_some()
            || self.extra_ready.binary_search(&(addr, port)).is_ok()
            || self.extra_serving.binary_search(&(addr, port)).is_ok()
    }

    /// Whether `addr:port` is a ready endpoint (neither terminating nor
    /// failing its readiness probe). A TCP connection to one that leaves
    /// the Service is kept, as kube-proxy's conntrack keeps it: its pod
    /// still runs (a selector switched to other pods, a blue/green
    /// rollout, a targetPort changed) and its connections are its own to
    /// finish. Those to an endpoint that was not ready when it left (its
    /// pod deleted: terminating first; or failing) are ended.
    pub fn ready(&self, addr: IpAddr, port: u16) -> bool {
        let ready = |v: &[Backend]| find(v, addr, port).is_some_and(|b| !b.terminating && !b.pod_terminating);
        ready(&self.backends) || ready(&self.local_backends) || self.extra_ready.binary_search(&(addr, port)).is_ok()
    }

    /// Whether connections of `proto` to `addr:port` are kept when it
    /// leaves this frontend: TCP ones to a ready endpoint (`ready`).
    pub fn keeps(&self, proto: Proto, addr: IpAddr, port: u16) -> bool {
        proto == Proto::Tcp && self.ready(addr, port)
    }
}

/// The most backends a frontend takes: its slots are numbered in 16 bits.
pub const MAX_BACKENDS: usize = u16::MAX as usize;

/// The backend at `addr:port` in `v` (sorted, each address and port once):
/// a binary search, as a Service may have thousands of endpoints.
pub(crate) fn find(v: &[Backend], addr: IpAddr, port: u16) -> Option<&Backend> {
    let i = v.partition_point(|b| (b.addr, b.port) < (addr, port));
    v.get(i).filter(|b| b.addr == addr && b.port == port)
}

/// The desired dataplane state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    pub frontends: BTreeMap<FrontendKey, Arc<Frontend>>,
    /// Every ClusterIP we serve: a connect to one on a port that is no
    /// service port is refused.
    pub vips: BTreeSet<IpAddr>,
    /// The Service each ClusterIP belongs to.
    pub vip_owners: BTreeMap<IpAddr, ServiceRef>,
    /// Objects we could not use, each with the reason (for the logs).
    pub warnings: Vec<String>,
    /// Health checks to serve, by healthCheckNodePort.
    pub health_checks: BTreeMap<u16, HealthCheck>,
    /// NodePorts in use: local processes may not bind them.
    pub node_ports: BTreeSet<(u16, Proto)>,
}

impl Desired {
    /// (frontend address, port, protocol, backend address, port) for every
    /// endpoint that still serves a frontend.
    pub fn alive_pairs(&self) -> BTreeSet<Pair> {
        self.frontends
            .iter()
            .flat_map(|(k, f)| f.serving().into_iter().map(move |(a, p)| (k.addr, k.port, k.proto, a, p)))
            .collect()
    }

    /// The pairs of `alive_pairs` whose connections end when they leave:
    /// all but the ready TCP endpoints' (`Frontend::keeps`).
    pub fn stale_when_gone(&self) -> BTreeSet<Pair> {
        self.when_gone(false)
    }

    /// The pairs of `alive_pairs` whose connections are kept when they
    /// leave (`Frontend::keeps`).
    pub fn kept_when_gone(&self) -> BTreeSet<Pair> {
        self.when_gone(true)
    }

    fn when_gone(&self, kept: bool) -> BTreeSet<Pair> {
        self.frontends
            .iter()
            .flat_map(|(k, f)| f.serving().into_iter().filter(move |(a, p)| f.keeps(k.proto, *a, *p) == kept).map(move |(a, p)| (k.addr, k.port, k.proto, a, p)))
            .collect()
    }
}

/// An address that can be a frontend or a backend: not unspecified,
/// loopback or multicast (the API server rejects those too).
fn usable_ip(a: &IpAddr) -> bool {
    !a.is_unspecified() && !a.is_loopback() && !a.is_multicast()
}

/// kube-proxy's ParseIPSloppy: as Go's parser did before 1.17, an IPv4
/// octet may have leading zeros, read as decimal (not octal). The API
/// server took such values before its validation tightened, and old
/// objects still hold them: a loadBalancerSourceRange "010.0.0.0/8"
/// read strictly would be dropped, opening the LoadBalancer IP to all.
pub(crate) fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    if let Ok(a) = s.parse() {
        return Some(a);
    }
    let parts: Vec<&str> = s.split('.').collect();
    if parts.len() != 4 || !parts.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())) {
        return None;
    }
    let o: Vec<u8> = parts.iter().map(|p| p.trim_start_matches('0').parse::<u8>().or_else(|e| if p.bytes().all(|b| b == b'0') { Ok(0) } else { Err(e) }).ok()).collect::<Option<_>>()?;
    Some(IpAddr::from([o[0], o[1], o[2], o[3]]))
}

fn parse_cidr(s: &str) -> Option<(IpAddr, u8)> {
    let (a, l) = s.split_once('/').unwrap_or((s, ""));
    let addr: IpAddr = parse_ip_sloppy(a.trim())?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let len: u8 = if l.is_empty() { max } else { l.trim().parse().ok()? };
    if len > max {
        return None;
    }
    Some((network(addr, len), len))
}

/// The network address of `addr` with a prefix of `len` bits: host bits
/// cleared.
fn network(addr: IpAddr, len: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => IpAddr::from(std::net::Ipv4Addr::from(u32::from(a) & u32::MAX.checked_shl(32 - len as u32).unwrap_or(0))),
        IpAddr::V6(a) => IpAddr::from(std::net::Ipv6Addr::from(u128::from(a) & u128::MAX.checked_shl(128 - len as u32).unwrap_or(0))),
    }
}

fn service_ref(svc: &Service) -> ServiceRef {
    ServiceRef {
        namespace: svc.metadata.namespace.as_deref().unwrap_or("default").into(),
        name: svc.metadata.name.as_deref().unwrap_or_default().into(),
    }
}

fn slice_owner(slice: &EndpointSlice) -> Option<ServiceRef> {
    let name = slice.metadata.labels.service_name.as_ref()?;
    Some(ServiceRef { namespace: slice.metadata.namespace.as_deref().unwrap_or("default").into(), name: name.as_str().into() })
}

fn parse_proto(p: Option<&str>) -> Option<Proto> {
    match p.unwrap_or("TCP") {
        "TCP" => Some(Proto::Tcp),
        "UDP" => Some(Proto::Udp),
        _ => None,
    }
}

fn valid_port(p: i32) -> Option<u16> {
    u16::try_from(p).ok().filter(|p| *p != 0)
}

/// Why a Service produces no frontends, or None when it should be served.
fn skip_reason(svc: &Service) -> Option<&'static str> {
    let spec = svc.spec.as_ref()?;
    if spec.type_.as_deref() == Some("ExternalName") {
        return Some("type ExternalName");
    }
    if svc.metadata.labels.proxy_name.is_some() {
        return Some("labelled service.kubernetes.io/service-proxy-name");
    }
    if svc.metadata.labels.headless.is_some() {
        return Some("labelled service.kubernetes.io/headless");
    }
    match spec.cluster_ip.as_deref() {
        Some("None") => Some("headless"),
        None | Some("") if spec.cluster_ips.as_ref().is_none_or(|v| v.is_empty()) => {
            Some("no clusterIP")
        }
        _ => None,
    }
}

/// Compute the desired state of k8s-openapi objects with the default
/// options.
#[cfg(test)]
pub fn compute(
    services: &[k8s_openapi::api::core::v1::Service],
    slices: &[k8s_openapi::api::discovery::v1::EndpointSlice],
    node: &NodeInfo,
) -> Desired {
    let services: Vec<Service> = services.iter().map(Service::from).collect();
    let slices: Vec<EndpointSlice> = slices.iter().map(EndpointSlice::from).collect();
    compute_with(&services, &slices, node, &Options::default())
}

/// The Service an EndpointSlice belongs to: Err(warning) when it has no
/// owner label, Ok(None) when it is ignored (FQDN).
fn slice_group(slice: &EndpointSlice) -> Result<Option<ServiceRef>, String> {
    let l = &slice.metadata.labels;
    if slice.address_type == "FQDN" || l.proxy_name.is_some() || l.headless.is_some() {
        return Ok(None);
    }
    slice_owner(slice).map(Some).ok_or_else(|| {
        format!(
            "EndpointSlice {}/{}: no {LABEL_SERVICE_NAME} label, ignored",
            slice.metadata.namespace.as_deref().unwrap_or("default"),
            slice.metadata.name.as_deref().unwrap_or("<unnamed>"),
        )
    })
}

/// Compute the desired state. Pure: same input, same output, whatever the
/// order of the inputs. Of two Services that claim one frontend, the one
/// whose claim ranks first (`Claim`: a ClusterIP, then a NodePort or an
/// ingress IP, then an externalIP) keeps it, then the first by reference. The agent keeps the same
/// result up to date with `Incremental`; this is the reference it is
/// tested against.
#[cfg(test)]
pub fn compute_with<S, E>(services: &[S], slices: &[E], node: &NodeInfo, opts: &Options) -> Desired
where
    S: std::borrow::Borrow<Service>,
    E: std::borrow::Borrow<EndpointSlice>,
{
    let mut out = Desired::default();
    let mut groups: BTreeMap<ServiceRef, (Vec<&Service>, Vec<&EndpointSlice>)> = BTreeMap::new();
    for slice in slices.iter().map(|s| s.borrow()) {
        match slice_group(slice) {
            Ok(Some(owner)) => groups.entry(owner).or_default().1.push(slice),
            Ok(None) => {}
            Err(w) => out.warnings.push(w),
        }
    }
    for svc in services.iter().map(|s| s.borrow()) {
        groups.entry(service_ref(svc)).or_default().0.push(svc);
    }
    // Every claim of each frontend; the lowest (kind, Service) keeps it.
    let mut claims: BTreeMap<FrontendKey, Vec<(Claim, ServiceRef, Arc<Frontend>)>> = BTreeMap::new();
    for (sref, (defs, slices)) in &groups {
        let o = compute_service(sref, defs, slices, node, opts);
        out.warnings.extend(o.warnings);
        for (key, f, how) in o.frontends {
            claims.entry(key).or_default().push((how, sref.clone(), f));
        }
        out.node_ports.extend(o.node_ports);
        if let Some((port, hc)) = o.health_check {
            out.health_checks.insert(port, hc);
        }
        for v in &o.vips {
            out.vip_owners.insert(*v, sref.clone());
        }
        out.vips.extend(o.vips);
    }
    for (key, mut c) in claims {
        c.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        for (how, sref, _) in &c[1..] {
            out.warnings.push(lost_warning(sref, &key, how.external()));
        }
        out.frontends.insert(key, c.swap_remove(0).2);
    }
    out
}

mod endpoints;
mod incremental;
pub mod maglev;
mod no_local;
mod service;
pub use incremental::{Changes, Incremental, Pair};
pub use no_local::{NoLocalEndpoints, ip_family};
pub use service::{Claim, ServiceOut, compute_service};
use service::lost_warning;

#[cfg(test)]
pub(crate) mod proptests;

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::api::core::v1::ServicePort;
    use k8s_openapi::api::core::v1::{ClientIPConfig, Service, ServiceSpec, SessionAffinityConfig};
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForZone};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn node() -> NodeInfo {
        NodeInfo { name: "node-a".into(), zone: Some("zone-a".into()), addresses: vec!["192.168.0.1".parse().unwrap()], primary: vec![] }
    }

    fn svc(name: &str, ip: &str, ports: &[(Option<&str>, i32, &str)]) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some(ip.into()),
                cluster_ips: Some(vec![ip.into()]),
                ports: Some(
                    ports
                        .iter()
                        .map(|(n, p, proto)| ServicePort {
                            name: n.map(Into::into),
                            port: *p,
                            protocol: Some((*proto).into()),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[derive(Clone, Copy)]
    struct Ep<'a> {
        ip: &'a str,
        node: &'a str,
        ready: Option<bool>,
        serving: Option<bool>,
        terminating: Option<bool>,
        zones: &'a [&'a str],
        nodes: &'a [&'a str],
    }

    fn ep(ip: &str) -> Ep<'_> {
        Ep { ip, node: "node-b", ready: Some(true), serving: Some(true), terminating: Some(false), zones: &[], nodes: &[] }
    }

    fn slice(svc: &str, name: &str, family: &str, ports: &[(Option<&str>, i32, &str)], eps: &[Ep]) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                labels: Some([(LABEL_SERVICE_NAME.to_string(), svc.to_string())].into()),
                ..Default::default()
            },
            address_type: family.into(),
            ports: Some(
                ports
                    .iter()
                    .map(|(n, p, proto)| EndpointPort {
                        name: n.map(Into::into),
                        port: Some(*p),
                        protocol: Some((*proto).into()),
                        ..Default::default()
                    })
                    .collect(),
            ),
            endpoints: eps
                .iter()
                .map(|e| Endpoint {
                    addresses: vec![e.ip.into()],
                    node_name: Some(e.node.into()),
                    conditions: Some(EndpointConditions {
                        ready: e.ready,
                        serving: e.serving,
                        terminating: e.terminating,
                    }),
                    hints: (!e.zones.is_empty() || !e.nodes.is_empty()).then(|| EndpointHints {
                        for_zones: (!e.zones.is_empty()).then(|| e.zones.iter().map(|z| ForZone { name: z.to_string() }).collect()),
                        for_nodes: (!e.nodes.is_empty())
                            .then(|| e.nodes.iter().map(|n| k8s_openapi::api::discovery::v1::ForNode { name: n.to_string() }).collect()),
                    }),
                    ..Default::default()
                })
                .collect(),
        }
    }

    fn fk(ip: &str, port: u16, proto: Proto) -> FrontendKey {
        FrontendKey { addr: ip.parse().unwrap(), port, proto }
    }

    fn addrs(v: &[Backend]) -> Vec<String> {
        v.iter().map(|b| format!("{}:{}", b.addr, b.port)).collect()
    }

    const WEB: &[(Option<&str>, i32, &str)] = &[(Some("http"), 80, "TCP")];
    const WEB_EP: &[(Option<&str>, i32, &str)] = &[(Some("http"), 8080, "TCP")];

    #[test]
    fn port_maps_to_target_port_by_name() {
        let d = compute(
            &[svc("web", "10.96.0.10", WEB)],
            &[slice("web", "web-1", "IPv4", WEB_EP, &[ep("10.244.1.2"), ep("10.244.1.3")])],
            &node(),
        );
        let f = &d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)];
        assert_eq!(addrs(&f.backends), ["10.244.1.2:8080", "10.244.1.3:8080"]);
        assert_eq!(f.service.to_string(), "default/web");
        assert!(d.vips.contains(&"10.96.0.10".parse().unwrap()));
    }

    #[test]
    fn no_slices_means_a_frontend_without_backends() {
        let d = compute(&[svc("web", "10.96.0.10", WEB)], &[], &node());
        assert!(d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends.is_empty());
    }

    #[test]
    fn only_ready_endpoints_when_some_are_ready() {
        let eps = [
            ep("10.0.0.1"),
            Ep { ready: Some(false), serving: Some(false), ..ep("10.0.0.2") },
            Ep { ready: Some(false), serving: Some(true), terminating: Some(true), ..ep("10.0.0.3") },
        ];
        let d = compute(&[svc("web", "10.96.0.10", WEB)], &[slice("web", "s", "IPv4", WEB_EP, &eps)], &node());
        assert_eq!(addrs(&d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends), ["10.0.0.1:8080"]);
    }

    #[test]
    fn serving_terminating_fallback_when_none_ready() {
        let eps = [
            Ep { ready: Some(false), serving: Some(false), terminating: Some(true), ..ep("10.0.0.2") },
            Ep { ready: Some(false), serving: Some(true), terminating: Some(true), ..ep("10.0.0.3") },
            Ep { ready: Some(false), serving: Some(true), terminating: Some(false), ..ep("10.0.0.4") },
        ];
        let d = compute(&[svc("web", "10.96.0.10", WEB)], &[slice("web", "s", "IPv4", WEB_EP, &eps)], &node());
        let f = &d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)];
        assert_eq!(addrs(&f.backends), ["10.0.0.3:8080"]);
        assert!(f.backends[0].terminating);
        // Serving endpoints stay alive, and for TCP terminating ones that
        // no longer serve (their connections drain).
        let serving: Vec<String> = f.serving().iter().map(|(a, p)| format!("{a}:{p}")).collect();
        assert_eq!(serving, ["10.0.0.2:8080", "10.0.0.3:8080", "10.0.0.4:8080"]);
    }

    #[test]
    fn nil_conditions_mean_ready() {
        let eps = [Ep { ready: None, serving: None, terminating: None, ..ep("10.0.0.5") }];
        let d = compute(&[svc("web", "10.96.0.10", WEB)], &[slice("web", "s", "IPv4", WEB_EP, &eps)], &node());
        assert_eq!(addrs(&d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends), ["10.0.0.5:8080"]);
    }

    /// kube-proxy reads a nil `serving` as true, whatever `ready` says: a
    /// terminating endpoint that does not say it serves is the fallback.
    #[test]
    fn nil_serving_means_serving() {
        let eps = [Ep { ready: Some(false), serving: None, terminating: Some(true), ..ep("10.0.0.6") }];
        let d = compute(&[svc("web", "10.96.0.10", WEB)], &[slice("web", "s", "IPv4", WEB_EP, &eps)], &node());
        let f = &d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)];
        assert_eq!(addrs(&f.backends), ["10.0.0.6:8080"]);
        assert!(f.backends[0].terminating);
    }

    /// kube-proxy takes an endpoint's first address only (the API says
    /// consumers use the first; the rest are not looked at).
    #[test]
    fn only_an_endpoints_first_address_is_a_backend() {
        let mut s = slice("web", "s", "IPv4", WEB_EP, &[ep("10.0.0.1")]);
        s.endpoints[0].addresses = vec!["10.0.0.1".into(), "10.0.0.2".into()];
        let d = compute(&[svc("web", "10.96.0.10", WEB)], std::slice::from_ref(&s), &node());
        assert_eq!(addrs(&d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends), ["10.0.0.1:8080"]);
        // A first address that does not parse is no endpoint; the second
        // does not stand in for it.
        s.endpoints[0].addresses = vec!["not-an-ip".into(), "10.0.0.2".into()];
        let d = compute(&[svc("web", "10.96.0.10", WEB)], &[s], &node());
        assert!(d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends.is_empty());
    }

    #[test]
    fn local_set_has_its_own_fallback() {
        let eps = [
            ep("10.0.0.1"), // ready, on node-b
            Ep { node: "node-a", ready: Some(false), serving: Some(true), terminating: Some(true), ..ep("10.0.0.2") },
        ];
        let mut s = svc("web", "10.96.0.10", WEB);
        s.spec.as_mut().unwrap().internal_traffic_policy = Some("Local".into());
        let d = compute(&[s], &[slice("web", "s", "IPv4", WEB_EP, &eps)], &node());
        let f = &d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)];
        assert!(f.local_only);
        assert_eq!(addrs(&f.backends), ["10.0.0.1:8080"]);
        assert_eq!(addrs(&f.local_backends), ["10.0.0.2:8080"]);
        assert!(f.local_backends[0].local && f.local_backends[0].terminating);
    }

    #[test]
    fn multiple_slices_merge_and_duplicates_collapse() {
        let d = compute(
            &[svc("web", "10.96.0.10", WEB)],
            &[
                slice("web", "a", "IPv4", WEB_EP, &[ep("10.0.0.1"), ep("10.0.0.2")]),
                slice("web", "b", "IPv4", WEB_EP, &[ep("10.0.0.2"), ep("10.0.0.3")]),
            ],
            &node(),
        );
        assert_eq!(
            addrs(&d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends),
            ["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"]
        );
    }

    #[test]
    fn named_ports_may_differ_per_slice() {
        let d = compute(
            &[svc("web", "10.96.0.10", WEB)],
            &[
                slice("web", "a", "IPv4", &[(Some("http"), 8080, "TCP")], &[ep("10.0.0.1")]),
                slice("web", "b", "IPv4", &[(Some("http"), 9090, "TCP")], &[ep("10.0.0.2")]),
                slice("web", "c", "IPv4", &[(Some("metrics"), 9100, "TCP")], &[ep("10.0.0.3")]),
            ],
            &node(),
        );
        assert_eq!(
            addrs(&d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends),
            ["10.0.0.1:8080", "10.0.0.2:9090"]
        );
    }

    #[test]
    fn multi_port_and_same_port_on_tcp_and_udp() {
        let ports = &[(Some("dns"), 53, "UDP"), (Some("dns-tcp"), 53, "TCP"), (Some("metrics"), 9153, "TCP")];
        let d = compute(
            &[svc("dns", "10.96.0.53", ports)],
            &[slice("dns", "a", "IPv4", ports, &[ep("10.0.0.9")])],
            &node(),
        );
        assert_eq!(d.frontends.len(), 3);
        assert_eq!(addrs(&d.frontends[&fk("10.96.0.53", 53, Proto::Udp)].backends), ["10.0.0.9:53"]);
        assert_eq!(addrs(&d.frontends[&fk("10.96.0.53", 53, Proto::Tcp)].backends), ["10.0.0.9:53"]);
        assert_eq!(addrs(&d.frontends[&fk("10.96.0.53", 9153, Proto::Tcp)].backends), ["10.0.0.9:9153"]);
    }

    #[test]
    fn protocol_must_match() {
        let d = compute(
            &[svc("web", "10.96.0.10", &[(None, 80, "UDP")])],
            &[slice("web", "a", "IPv4", &[(None, 8080, "TCP")], &[ep("10.0.0.1")])],
            &node(),
        );
        assert!(d.frontends[&fk("10.96.0.10", 80, Proto::Udp)].backends.is_empty());
    }

    #[test]
    fn skipped_services() {
        let mut ext = svc("ext", "10.96.0.1", WEB);
        ext.spec.as_mut().unwrap().type_ = Some("ExternalName".into());
        let mut headless = svc("headless", "None", WEB);
        headless.spec.as_mut().unwrap().cluster_ips = Some(vec!["None".into()]);
        let mut other = svc("other", "10.96.0.3", WEB);
        other.metadata.labels = Some([(LABEL_SERVICE_PROXY_NAME.to_string(), "x".to_string())].into());
        let mut noip = svc("noip", "", WEB);
        noip.spec.as_mut().unwrap().cluster_ips = None;
        let d = compute(&[ext, headless, other, noip], &[], &node());
        assert!(d.frontends.is_empty(), "{:?}", d.frontends.keys());
        assert!(d.vips.is_empty());
    }

    /// kube-proxy's informers leave out slices (and Services) labelled
    /// service-proxy-name or headless; so does the model, whatever source
    /// fed it.
    #[test]
    fn slices_labelled_for_another_proxy_or_headless_are_left_out() {
        let mut other = slice("web", "w-2", "IPv4", WEB_EP, &[ep("10.0.0.8")]);
        other.metadata.labels.as_mut().unwrap().insert(LABEL_SERVICE_PROXY_NAME.into(), "x".into());
        let mut headless = slice("web", "w-3", "IPv4", WEB_EP, &[ep("10.0.0.9")]);
        headless.metadata.labels.as_mut().unwrap().insert(LABEL_HEADLESS.into(), String::new());
        let d = compute(&[svc("web", "10.96.0.10", WEB)], &[slice("web", "w-1", "IPv4", WEB_EP, &[ep("10.0.0.7")]), other, headless], &node());
        assert_eq!(addrs(&d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends), ["10.0.0.7:8080"]);
        let mut s = svc("web", "10.96.0.10", WEB);
        s.metadata.labels = Some([(LABEL_HEADLESS.to_string(), String::new())].into());
        assert!(compute(&[s], &[], &node()).frontends.is_empty());
    }

    #[test]
    fn fqdn_and_unlabelled_slices_are_ignored() {
        let mut unlabelled = slice("web", "u", "IPv4", WEB_EP, &[ep("10.0.0.7")]);
        unlabelled.metadata.labels = None;
        let d = compute(
            &[svc("web", "10.96.0.10", WEB)],
            &[slice("web", "f", "FQDN", WEB_EP, &[ep("example.com")]), unlabelled],
            &node(),
        );
        assert!(d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends.is_empty());
        assert_eq!(d.warnings.len(), 1, "{:?}", d.warnings);
    }

    #[test]
    fn slices_of_other_namespace_do_not_match() {
        let mut s = slice("web", "a", "IPv4", WEB_EP, &[ep("10.0.0.1")]);
        s.metadata.namespace = Some("other".into());
        let d = compute(&[svc("web", "10.96.0.10", WEB)], &[s], &node());
        assert!(d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends.is_empty());
    }

    #[test]
    fn families_do_not_mix() {
        let mut s = svc("web", "10.96.0.10", WEB);
        s.spec.as_mut().unwrap().cluster_ips = Some(vec!["10.96.0.10".into(), "fd00::10".into()]);
        let d = compute(
            &[s],
            &[
                slice("web", "v4", "IPv4", WEB_EP, &[ep("10.0.0.1")]),
                slice("web", "v6", "IPv6", WEB_EP, &[ep("fd00:1::1")]),
                // A mislabelled slice: IPv4 type with an IPv6 address.
                slice("web", "bad", "IPv4", WEB_EP, &[ep("fd00:1::2")]),
            ],
            &node(),
        );
        assert_eq!(addrs(&d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends), ["10.0.0.1:8080"]);
        assert_eq!(addrs(&d.frontends[&fk("fd00::10", 80, Proto::Tcp)].backends), ["fd00:1::1:8080"]);
    }

    #[test]
    fn invalid_input_is_reported_not_fatal() {
        let good = svc("good", "10.96.0.11", WEB);
        let bad_ip = svc("bad-ip", "10.96.0.999", WEB);
        let bad_port = svc("bad-port", "10.96.0.12", &[(None, 70000, "TCP"), (None, 0, "TCP")]);
        let sctp = svc("sctp", "10.96.0.13", &[(None, 80, "SCTP")]);
        let d = compute(
            &[bad_ip, good, bad_port, sctp],
            &[slice("good", "a", "IPv4", WEB_EP, &[ep("10.0.0.1"), ep("not-an-ip")])],
            &node(),
        );
        assert_eq!(d.frontends.len(), 1);
        assert_eq!(addrs(&d.frontends[&fk("10.96.0.11", 80, Proto::Tcp)].backends), ["10.0.0.1:8080"]);
        assert_eq!(d.warnings.len(), 4, "{:#?}", d.warnings);
        assert!(d.warnings.iter().any(|w| w.contains("default/bad-ip") && w.contains("10.96.0.999")));
    }

    #[test]
    fn affinity_timeout_defaults_and_overrides() {
        let mut a = svc("a", "10.96.0.20", WEB);
        a.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into());
        let mut b = svc("b", "10.96.0.21", WEB);
        b.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into());
        b.spec.as_mut().unwrap().session_affinity_config = Some(SessionAffinityConfig {
            client_ip: Some(ClientIPConfig { timeout_seconds: Some(60) }),
        });
        let c = svc("c", "10.96.0.22", WEB);
        let d = compute(&[a, b, c], &[], &node());
        assert_eq!(d.frontends[&fk("10.96.0.20", 80, Proto::Tcp)].affinity_timeout, Some(10800));
        assert_eq!(d.frontends[&fk("10.96.0.21", 80, Proto::Tcp)].affinity_timeout, Some(60));
        assert_eq!(d.frontends[&fk("10.96.0.22", 80, Proto::Tcp)].affinity_timeout, None);
    }

    #[test]
    fn output_does_not_depend_on_input_order() {
        let svcs = [svc("a", "10.96.0.1", WEB), svc("b", "10.96.0.2", WEB)];
        let slices = [
            slice("a", "a1", "IPv4", WEB_EP, &[ep("10.0.0.1")]),
            slice("a", "a2", "IPv4", &[(Some("http"), 9090, "TCP")], &[ep("10.0.0.1")]),
            slice("b", "b1", "IPv4", WEB_EP, &[ep("10.0.0.2")]),
        ];
        let d1 = compute(&svcs, &slices, &node());
        let mut svcs2 = svcs.to_vec();
        svcs2.reverse();
        let mut slices2 = slices.to_vec();
        slices2.reverse();
        assert_eq!(d1, compute(&svcs2, &slices2, &node()));
    }

    fn topo(eps: &[Ep], itp_local: bool, node: &NodeInfo) -> Frontend {
        let mut s = svc("web", "10.96.0.10", WEB);
        if itp_local {
            s.spec.as_mut().unwrap().internal_traffic_policy = Some("Local".into());
        }
        let d = compute(&[s], &[slice("web", "s", "IPv4", WEB_EP, eps)], node);
        (*d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)]).clone()
    }

    #[test]
    fn topology_hints_prefer_this_zone() {
        let eps = [
            Ep { zones: &["zone-a"], ..ep("10.0.0.1") },
            Ep { zones: &["zone-b"], ..ep("10.0.0.2") },
            Ep { zones: &["zone-a", "zone-b"], ..ep("10.0.0.3") },
        ];
        let f = topo(&eps, false, &node());
        assert!(f.topology);
        assert_eq!(addrs(&f.backends), ["10.0.0.1:8080", "10.0.0.3:8080"]);
    }

    #[test]
    fn topology_needs_hints_on_every_ready_endpoint() {
        let eps = [Ep { zones: &["zone-a"], ..ep("10.0.0.1") }, ep("10.0.0.2")];
        let f = topo(&eps, false, &node());
        assert!(!f.topology);
        assert_eq!(f.backends.len(), 2);
        // Not-ready endpoints without hints do not count.
        let eps = [
            Ep { zones: &["zone-a"], ..ep("10.0.0.1") },
            Ep { ready: Some(false), serving: Some(false), ..ep("10.0.0.2") },
            Ep { zones: &["zone-b"], ..ep("10.0.0.3") },
        ];
        let f = topo(&eps, false, &node());
        assert_eq!(addrs(&f.backends), ["10.0.0.1:8080"]);
    }

    #[test]
    fn topology_needs_a_zone_and_an_endpoint_for_it() {
        let eps = [Ep { zones: &["zone-b"], ..ep("10.0.0.1") }, Ep { zones: &["zone-c"], ..ep("10.0.0.2") }];
        let f = topo(&eps, false, &node());
        assert!(!f.topology, "no endpoint hinted for zone-a");
        assert_eq!(f.backends.len(), 2);
        let zoneless = NodeInfo { name: "node-a".into(), zone: None, ..NodeInfo::default() };
        let eps = [Ep { zones: &["zone-a"], ..ep("10.0.0.1") }, Ep { zones: &["zone-b"], ..ep("10.0.0.2") }];
        let f = topo(&eps, false, &zoneless);
        assert!(!f.topology);
        assert_eq!(f.backends.len(), 2);
    }

    #[test]
    fn topology_does_not_apply_to_the_terminating_fallback_or_itp_local() {
        let eps = [
            Ep { zones: &["zone-b"], ready: Some(false), serving: Some(true), terminating: Some(true), ..ep("10.0.0.1") },
        ];
        let f = topo(&eps, false, &node());
        assert_eq!(addrs(&f.backends), ["10.0.0.1:8080"]);
        let eps = [Ep { zones: &["zone-a"], ..ep("10.0.0.1") }, Ep { zones: &["zone-b"], ..ep("10.0.0.2") }];
        let f = topo(&eps, true, &node());
        assert!(!f.topology);
        assert_eq!(f.backends.len(), 2);
    }

    /// trafficDistribution: PreferSameNode (hints.forNodes), with kube-proxy's
    /// fallbacks: zone hints when not every ready endpoint has node hints or
    /// none is for this node; all ready endpoints when neither applies.
    #[test]
    fn node_hints_prefer_this_node_then_fall_back_to_zone_hints_then_to_all() {
        // node() is node-a in zone-a.
        let eps = [
            Ep { nodes: &["node-a"], zones: &["zone-a"], ..ep("10.0.0.1") },
            Ep { nodes: &["node-b"], zones: &["zone-a"], ..ep("10.0.0.2") },
            Ep { nodes: &["node-c"], zones: &["zone-b"], ..ep("10.0.0.3") },
        ];
        let f = topo(&eps, false, &node());
        assert!(f.topology);
        assert_eq!(addrs(&f.backends), ["10.0.0.1:8080"], "only this node's endpoint");
        // No endpoint for this node: the zone hints decide.
        let eps = [
            Ep { nodes: &["node-b"], zones: &["zone-a"], ..ep("10.0.0.2") },
            Ep { nodes: &["node-c"], zones: &["zone-b"], ..ep("10.0.0.3") },
        ];
        let f = topo(&eps, false, &node());
        assert!(f.topology);
        assert_eq!(addrs(&f.backends), ["10.0.0.2:8080"]);
        // One ready endpoint without node hints: node hints are ignored.
        let eps = [
            Ep { nodes: &["node-a"], zones: &["zone-b"], ..ep("10.0.0.1") },
            Ep { zones: &["zone-a"], ..ep("10.0.0.2") },
        ];
        let f = topo(&eps, false, &node());
        assert_eq!(addrs(&f.backends), ["10.0.0.2:8080"], "zone hints");
        // Node hints only, none for this node, no zone hints: every ready one.
        let eps = [Ep { nodes: &["node-b"], ..ep("10.0.0.2") }, Ep { nodes: &["node-c"], ..ep("10.0.0.3") }];
        let f = topo(&eps, false, &node());
        assert!(!f.topology);
        assert_eq!(f.backends.len(), 2);
        // A not-ready endpoint's hints do not count, and it is never used.
        let eps = [
            Ep { nodes: &["node-a"], ready: Some(false), serving: Some(false), ..ep("10.0.0.1") },
            Ep { nodes: &["node-b"], ..ep("10.0.0.2") },
        ];
        let f = topo(&eps, false, &node());
        assert_eq!(addrs(&f.backends), ["10.0.0.2:8080"]);
        // A zoneless node still uses node hints.
        let zoneless = NodeInfo { name: "node-a".into(), zone: None, ..NodeInfo::default() };
        let eps = [Ep { nodes: &["node-a"], ..ep("10.0.0.1") }, Ep { nodes: &["node-b"], ..ep("10.0.0.2") }];
        let f = topo(&eps, false, &zoneless);
        assert_eq!(addrs(&f.backends), ["10.0.0.1:8080"]);
        // internalTrafficPolicy Local: no topology.
        let f = topo(&eps, true, &node());
        assert!(!f.topology);
    }

    #[test]
    fn publish_not_ready_addresses_follows_the_slice_conditions() {
        // The EndpointSlice controller expresses publishNotReadyAddresses by
        // marking every endpoint ready; kube-proxy reads only the slice.
        let mut s = svc("web", "10.96.0.10", WEB);
        s.spec.as_mut().unwrap().publish_not_ready_addresses = Some(true);
        let eps = [ep("10.0.0.1"), Ep { ready: Some(false), serving: Some(false), ..ep("10.0.0.2") }];
        let d = compute(&[s], &[slice("web", "s", "IPv4", WEB_EP, &eps)], &node());
        assert_eq!(addrs(&d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends), ["10.0.0.1:8080"]);
    }

    fn external_svc(ty: &str) -> Service {
        let mut s = svc("web", "10.96.0.10", &[(Some("http"), 80, "TCP")]);
        let spec = s.spec.as_mut().unwrap();
        spec.type_ = Some(ty.into());
        spec.ports.as_mut().unwrap()[0].node_port = Some(30080);
        s
    }

    fn lb_status(s: &mut Service, ips: &[(&str, Option<&str>)]) {
        use k8s_openapi::api::core::v1::{LoadBalancerIngress, LoadBalancerStatus, ServiceStatus};
        s.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(
                    ips.iter()
                        .map(|(ip, mode)| LoadBalancerIngress {
                            ip: Some(ip.to_string()),
                            ip_mode: mode.map(Into::into),
                            ..Default::default()
                        })
                        .collect(),
                ),
            }),
            ..Default::default()
        });
    }

    fn local_and_remote() -> EndpointSlice {
        slice("web", "s", "IPv4", WEB_EP, &[Ep { node: "node-a", ..ep("10.0.0.1") }, ep("10.0.0.2")])
    }

    /// More endpoints than a frontend takes: the Service is warned about by
    /// name, and its frontend holds the first 65,535.
    #[test]
    fn a_service_with_more_endpoints_than_a_frontend_takes_is_warned_about() {
        let ips: Vec<String> = (0..65_536u32).map(|i| std::net::Ipv4Addr::from(0x0a00_0000 + i).to_string()).collect();
        let eps: Vec<Ep> = ips.iter().map(|ip| ep(ip)).collect();
        let d = compute(&[svc("web", "10.96.0.10", &[(Some("http"), 80, "TCP")])], &[slice("web", "s", "IPv4", WEB_EP, &eps)], &node());
        assert_eq!(d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends.len(), 65_536, "the model keeps them all; the maps take the first");
        assert!(d.warnings.iter().any(|w| w.contains("default/web") && w.contains("65536 endpoints") && w.contains("65535")), "{:?}", d.warnings);
        let few = &eps[..65_535];
        let d = compute(&[svc("web", "10.96.0.10", &[(Some("http"), 80, "TCP")])], &[slice("web", "s", "IPv4", WEB_EP, few)], &node());
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
        // Zone hints narrow the ClusterIP's set to one endpoint; the Maglev
        // NodePort takes them all, and is warned about.
        let zoned: Vec<Ep> = eps.iter().enumerate().map(|(i, e)| Ep { zones: if i == 0 { &["zone-a"] } else { &["zone-b"] }, ..*e }).collect();
        let services = [objects::Service::from(&external_svc("NodePort"))];
        let slices = [objects::EndpointSlice::from(&slice("web", "s", "IPv4", WEB_EP, &zoned))];
        let d = compute_with(&services, &slices, &node(), &Options { nodeport_algorithm: Algorithm::Maglev, ..Options::default() });
        assert_eq!(d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].backends.len(), 1);
        assert_eq!(d.frontends[&fk("192.168.0.1", 30080, Proto::Tcp)].backends.len(), 65_536);
        assert_eq!(d.warnings.iter().filter(|w| w.contains("65536 endpoints")).count(), 1, "{:?}", d.warnings);
    }

    /// Every node must build a Maglev frontend's table from the same
    /// endpoints: zone hints narrow the ClusterIP's set, not the
    /// NodePort's, and the Service is warned about by name.
    #[test]
    fn topology_hints_are_not_applied_to_maglev_frontends() {
        let eps = [Ep { zones: &["zone-a"], ..ep("10.0.0.1") }, Ep { zones: &["zone-b"], ..ep("10.0.0.2") }];
        for (algorithm, hinted) in [(Algorithm::Random, true), (Algorithm::Maglev, false)] {
            let services = [objects::Service::from(&external_svc("NodePort"))];
            let slices = [objects::EndpointSlice::from(&slice("web", "s", "IPv4", WEB_EP, &eps))];
            let d = compute_with(&services, &slices, &node(), &Options { nodeport_algorithm: algorithm, ..Options::default() });
            let cluster_ip = &d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)];
            assert!(cluster_ip.topology, "{algorithm:?}");
            assert_eq!(addrs(&cluster_ip.backends), ["10.0.0.1:8080"], "{algorithm:?}");
            let np = &d.frontends[&fk("192.168.0.1", 30080, Proto::Tcp)];
            assert_eq!(np.topology, hinted, "{algorithm:?}");
            let want: &[&str] = if hinted { &["10.0.0.1:8080"] } else { &["10.0.0.1:8080", "10.0.0.2:8080"] };
            assert_eq!(addrs(&np.backends), want, "{algorithm:?}");
            let warned = d.warnings.iter().filter(|w| w.contains("default/web") && w.contains("topology hints")).count();
            assert_eq!(warned, usize::from(!hinted), "{algorithm:?}: {:?}", d.warnings);
        }
    }

    #[test]
    fn maglev_follows_the_flag_and_the_services_annotation_for_external_frontends_only() {
        let with = |annotation: Option<&str>, default: Algorithm| {
            let mut s = external_svc("NodePort");
            if let Some(a) = annotation {
                s.metadata.annotations = Some([(ANNOTATION_NODEPORT_ALGORITHM.to_string(), a.to_string())].into());
            }
            let services = [objects::Service::from(&s)];
            let slices = [objects::EndpointSlice::from(&local_and_remote())];
            compute_with(&services, &slices, &node(), &Options { nodeport_algorithm: default, ..Options::default() })
        };
        let maglev = |d: &Desired| (d.frontends[&fk("192.168.0.1", 30080, Proto::Tcp)].maglev, d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].maglev);
        assert_eq!(maglev(&with(None, Algorithm::Random)), (false, false));
        assert_eq!(maglev(&with(None, Algorithm::Maglev)), (true, false), "the ClusterIP is in-cluster traffic: never Maglev");
        assert_eq!(maglev(&with(Some("maglev"), Algorithm::Random)), (true, false));
        assert_eq!(maglev(&with(Some("random"), Algorithm::Maglev)), (false, false));
        // A value it does not know: warned about by name, the default kept,
        // the Service served.
        let d = with(Some("ring-hash"), Algorithm::Maglev);
        assert_eq!(maglev(&d), (true, false));
        assert!(
            d.warnings.iter().any(|w| w.contains("default/web") && w.contains(ANNOTATION_NODEPORT_ALGORITHM) && w.contains("ring-hash")),
            "{:?}",
            d.warnings
        );
        assert_eq!("maglev".parse::<Algorithm>(), Ok(Algorithm::Maglev));
        assert!("Maglev".parse::<Algorithm>().is_err());
    }

    #[test]
    fn node_ports_listen_on_every_node_address_with_cluster_backends() {
        let node = NodeInfo { addresses: vec!["192.168.0.1".parse().unwrap(), "192.168.1.1".parse().unwrap()], ..node() };
        let d = compute(&[external_svc("NodePort")], &[local_and_remote()], &node);
        for addr in ["192.168.0.1", "192.168.1.1"] {
            let f = &d.frontends[&fk(addr, 30080, Proto::Tcp)];
            assert!(f.external && !f.ext_local && !f.local_only);
            assert_eq!(addrs(&f.backends), ["10.0.0.1:8080", "10.0.0.2:8080"]);
            assert_eq!(addrs(&f.local_backends), ["10.0.0.1:8080"]);
        }
        assert!(!d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].external);
        assert_eq!(d.node_ports, [(30080, Proto::Tcp)].into());
        // Node addresses are not ClusterIPs: other ports on them must work.
        assert!(!d.vips.contains(&"192.168.0.1".parse().unwrap()));
        // A ClusterIP Service has no NodePort frontends, even with a nodePort set.
        let d = compute(&[external_svc("ClusterIP")], &[local_and_remote()], &node);
        assert_eq!(d.frontends.len(), 1);
        assert!(d.node_ports.is_empty());
    }

    #[test]
    fn localhost_node_ports_are_for_the_nodes_own_sockets_on_ipv4_only() {
        let ifaces: Vec<IpAddr> = vec!["192.168.0.1".parse().unwrap(), "fd00::1".parse().unwrap()];
        let facts = NodeFacts { name: "node-a", interface_ips: &ifaces, localhost_nodeports: true, ..Default::default() };
        let node = node_info(&facts, &[] as &[Node]);
        let mut s = dual_stack(external_svc("NodePort"));
        s.metadata.annotations = Some([(ANNOTATION_NODEPORT_ALGORITHM.to_string(), "maglev".to_string()), (ANNOTATION_NODEPORT_MODE.to_string(), "dsr".to_string())].into());
        let d = compute(std::slice::from_ref(&s), &[local_and_remote()], &node);
        let f = &d.frontends[&fk("127.0.0.1", 30080, Proto::Tcp)];
        assert!(f.external && f.host_only && !f.no_socket);
        // Outside traffic never reaches it: no Maglev table, no DSR.
        assert!(!f.maglev && !f.dsr);
        assert!(d.frontends[&fk("192.168.0.1", 30080, Proto::Tcp)].maglev && d.frontends[&fk("192.168.0.1", 30080, Proto::Tcp)].dsr);
        assert_eq!(addrs(&f.backends), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        assert!(!d.frontends[&fk("192.168.0.1", 30080, Proto::Tcp)].host_only);
        assert!(!d.frontends[&fk("fd00::1", 30080, Proto::Tcp)].host_only);
        assert!(!d.frontends.keys().any(|k| k.addr == "::1".parse::<IpAddr>().unwrap()), "no ::1, as kube-proxy");
        let node = node_info(&NodeFacts { localhost_nodeports: false, ..facts.clone() }, &[] as &[Node]);
        let d = compute(std::slice::from_ref(&s), &[local_and_remote()], &node);
        assert!(!d.frontends.contains_key(&fk("127.0.0.1", 30080, Proto::Tcp)));
        // A LoadBalancer's port on its IP is no NodePort: no 127.0.0.1:80.
        let mut lb = external_svc("LoadBalancer");
        lb_status(&mut lb, &[("203.0.113.1", None)]);
        let node = node_info(&facts, &[] as &[Node]);
        let d = compute(&[lb], &[local_and_remote()], &node);
        assert!(d.frontends.contains_key(&fk("127.0.0.1", 30080, Proto::Tcp)) && !d.frontends.contains_key(&fk("127.0.0.1", 80, Proto::Tcp)));
    }

    /// `s` with the IPv6 ClusterIP fd00:96::10 too.
    fn dual_stack(mut s: Service) -> Service {
        s.spec.as_mut().unwrap().cluster_ips.as_mut().unwrap().push("fd00:96::10".into());
        s
    }

    #[test]
    fn external_addresses_are_served_only_in_the_families_of_the_services_cluster_ips() {
        // kube-proxy's proxier of a family skips a Service with no
        // ClusterIP of that family: no NodePort, externalIP or ingress IP
        // of it, whatever the node's addresses.
        let node = NodeInfo { addresses: vec!["192.168.0.1".parse().unwrap(), "fd00::1".parse().unwrap()], ..node() };
        let mut s = external_svc("LoadBalancer");
        lb_status(&mut s, &[("203.0.113.1", None), ("2001:db8::1", None)]);
        let spec = s.spec.as_mut().unwrap();
        spec.external_ips = Some(vec!["198.51.100.7".into(), "2001:db8::7".into()]);
        spec.load_balancer_source_ranges = Some(vec!["192.0.2.0/24".into(), "2001:db8:1::/48".into()]);
        let six = slice("web", "s6", "IPv6", WEB_EP, &[ep("fd00:244::1")]);
        let families = |d: &Desired| -> BTreeSet<(String, u16)> { d.frontends.keys().map(|k| (k.addr.to_string(), k.port)).collect() };
        let set = |v: &[(&str, u16)]| -> BTreeSet<(String, u16)> { v.iter().map(|(a, p)| (a.to_string(), *p)).collect() };
        let v4 = [("10.96.0.10", 80), ("192.168.0.1", 30080), ("203.0.113.1", 80), ("198.51.100.7", 80)];
        let v6 = [("fd00:96::10", 80), ("fd00::1", 30080), ("2001:db8::1", 80), ("2001:db8::7", 80)];
        let d = compute(std::slice::from_ref(&s), &[local_and_remote(), six.clone()], &node);
        assert_eq!(families(&d), set(&v4), "single-stack IPv4");
        assert_eq!(d.node_ports, [(30080, Proto::Tcp)].into());
        let d = compute(&[dual_stack(s.clone())], &[local_and_remote(), six.clone()], &node);
        assert_eq!(families(&d), set(&[v4, v6].concat()), "dual-stack");
        assert_eq!(d.frontends[&fk("2001:db8::1", 80, Proto::Tcp)].source_ranges, [("2001:db8:1::".parse().unwrap(), 48)]);
        assert_eq!(addrs(&d.frontends[&fk("fd00::1", 30080, Proto::Tcp)].backends), ["fd00:244::1:8080"]);
        // Single-stack IPv6: the IPv4 addresses are left out.
        let spec = s.spec.as_mut().unwrap();
        spec.cluster_ip = Some("fd00:96::10".into());
        spec.cluster_ips = Some(vec!["fd00:96::10".into()]);
        let d = compute(&[s], &[local_and_remote(), six], &node);
        assert_eq!(families(&d), set(&v6), "single-stack IPv6");
        assert!(d.warnings.is_empty(), "not worth a warning: {:?}", d.warnings);
    }

    #[test]
    fn load_balancer_ips_skip_proxy_mode_and_carry_source_ranges() {
        let mut s = external_svc("LoadBalancer");
        lb_status(&mut s, &[("203.0.113.1", None), ("203.0.113.2", Some("VIP")), ("203.0.113.3", Some("Proxy"))]);
        s.spec.as_mut().unwrap().load_balancer_source_ranges = Some(vec!["192.168.7.9/24".into(), "bad".into()]);
        let d = compute(&[s], &[local_and_remote()], &node());
        let lb1 = &d.frontends[&fk("203.0.113.1", 80, Proto::Tcp)];
        assert!(lb1.external);
        assert_eq!(lb1.source_ranges, [("192.168.7.0".parse().unwrap(), 24)], "host bits cleared");
        assert!(d.frontends.contains_key(&fk("203.0.113.2", 80, Proto::Tcp)));
        assert!(!d.frontends.contains_key(&fk("203.0.113.3", 80, Proto::Tcp)), "ipMode Proxy is not short-circuited");
        assert!(d.frontends[&fk("192.168.0.1", 30080, Proto::Tcp)].source_ranges.is_empty(), "ranges apply to LB IPs");
        assert!(d.warnings.iter().any(|w| w.contains("\"bad\"")), "{:?}", d.warnings);
    }

    /// kube-proxy reads status.loadBalancer.ingress whatever the type: a
    /// Service turned ClusterIP keeps its ingress IP (and its source
    /// ranges) until the controller clears the status; its NodePort goes
    /// (the API server releases it; kube-proxy has none to serve).
    #[test]
    fn ingress_ips_are_served_whatever_the_services_type() {
        for ty in ["ClusterIP", "NodePort", "LoadBalancer"] {
            let mut s = external_svc(ty);
            if ty == "ClusterIP" {
                s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].node_port = None;
            }
            lb_status(&mut s, &[("203.0.113.1", None), ("203.0.113.3", Some("Proxy"))]);
            s.spec.as_mut().unwrap().load_balancer_source_ranges = Some(vec!["192.0.2.0/24".into()]);
            let d = compute(&[s], &[local_and_remote()], &node());
            let f = d.frontends.get(&fk("203.0.113.1", 80, Proto::Tcp)).unwrap_or_else(|| panic!("{ty}: no ingress IP"));
            assert!(f.external, "{ty}");
            assert_eq!(f.source_ranges, [("192.0.2.0".parse().unwrap(), 24)], "{ty}");
            assert!(!d.frontends.contains_key(&fk("203.0.113.3", 80, Proto::Tcp)), "{ty}: ipMode Proxy");
            assert_eq!(d.frontends.contains_key(&fk("192.168.0.1", 30080, Proto::Tcp)), ty != "ClusterIP", "{ty}");
            assert!(d.warnings.is_empty(), "{ty}: {:?}", d.warnings);
        }
        // externalTrafficPolicy Local holds only where the Service is
        // reachable from outside (kube-proxy's ExternalPolicyLocal): a
        // ClusterIP Service's ingress IP is served with the Cluster policy,
        // unless it has externalIPs.
        for (ty, ext_ips, local) in [("ClusterIP", false, false), ("ClusterIP", true, true), ("LoadBalancer", false, true)] {
            let mut s = external_svc(ty);
            let spec = s.spec.as_mut().unwrap();
            spec.external_traffic_policy = Some("Local".into());
            if ty == "ClusterIP" {
                spec.ports.as_mut().unwrap()[0].node_port = None;
            }
            if ext_ips {
                spec.external_ips = Some(vec!["198.51.100.7".into()]);
            }
            lb_status(&mut s, &[("203.0.113.1", None)]);
            let d = compute(&[s], &[local_and_remote()], &node());
            assert_eq!(d.frontends[&fk("203.0.113.1", 80, Proto::Tcp)].ext_local, local, "{ty}, externalIPs: {ext_ips}");
        }
        // A Service turned ClusterIP keeps its stale ingress IP only until
        // a LoadBalancer is given it, whatever the names' order.
        let mut stale = external_svc("ClusterIP");
        stale.metadata.name = Some("a-was-lb".into());
        stale.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].node_port = None;
        lb_status(&mut stale, &[("203.0.113.1", None)]);
        let mut now = external_svc("LoadBalancer");
        now.metadata.name = Some("b-lb".into());
        now.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.11".into());
        now.spec.as_mut().unwrap().cluster_ips = Some(vec!["10.96.0.11".into()]);
        lb_status(&mut now, &[("203.0.113.1", None)]);
        let d = compute(&[stale.clone(), now], &[local_and_remote()], &node());
        assert_eq!(d.frontends[&fk("203.0.113.1", 80, Proto::Tcp)].service.name.as_ref(), "b-lb");
        let d = compute(&[stale], &[local_and_remote()], &node());
        assert_eq!(d.frontends[&fk("203.0.113.1", 80, Proto::Tcp)].service.name.as_ref(), "a-was-lb");
    }

    /// An externalIP naming another Service's ClusterIP and port never
    /// takes it, whatever the names' order (here the externalIP's Service
    /// sorts first), nor with the externalIP socket switch off (which
    /// would refuse every in-cluster connect to it: cluster DNS, here);
    /// the loser is named in a warning. `Incremental` agrees.
    #[test]
    fn a_cluster_ip_port_is_never_taken_by_another_services_external_ip() {
        let mut dns = svc("kube-dns", "10.96.0.10", &[(Some("dns"), 53, "UDP")]);
        dns.metadata.namespace = Some("kube-system".into());
        let mut x = svc("x", "10.96.0.99", &[(Some("dns"), 53, "UDP")]);
        x.spec.as_mut().unwrap().external_ips = Some(vec!["10.96.0.10".into()]);
        let mut dns_slice = slice("kube-dns", "kube-dns-1", "IPv4", &[(Some("dns"), 53, "UDP")], &[ep("10.244.1.2")]);
        dns_slice.metadata.namespace = Some("kube-system".into());
        for socket in [true, false] {
            let opts = Options { external_ip_socket: socket, ..Options::default() };
            let services = [Arc::new(objects::Service::from(&x)), Arc::new(objects::Service::from(&dns))];
            let slices = [Arc::new(objects::EndpointSlice::from(&dns_slice))];
            let d = compute_with(&services, &slices, &node(), &opts);
            let f = &d.frontends[&fk("10.96.0.10", 53, Proto::Udp)];
            assert_eq!((f.service.to_string().as_str(), f.external, f.no_socket), ("kube-system/kube-dns", false, false));
            assert_eq!(addrs(&f.backends), ["10.244.1.2:53"]);
            assert!(d.warnings.iter().any(|w| w.contains("default/x") && w.contains("10.96.0.10")), "{:?}", d.warnings);
            let mut inc = Incremental::new();
            inc.update(&services, &slices, &node(), &opts);
            assert_eq!(inc.desired(), &d, "external_ip_socket {socket}");
        }
    }

    /// A LoadBalancer Service of externalTrafficPolicy Local, its health
    /// check on 32000.
    fn local_policy_lb() -> Service {
        let mut s = external_svc("LoadBalancer");
        let spec = s.spec.as_mut().unwrap();
        spec.external_traffic_policy = Some("Local".into());
        spec.health_check_node_port = Some(32000);
        s
    }

    /// One endpoint in two slices, a copy on another node first (by slice
    /// name) and one on this node, both ready: the local copy is the one
    /// (outside clients of an externalTrafficPolicy Local Service reach
    /// it, as the health check, which counts it, promises).
    #[test]
    fn of_two_copies_of_an_endpoint_as_usable_the_local_one_counts() {
        let s = local_policy_lb();
        let remote = slice("web", "a", "IPv4", WEB_EP, &[ep("10.0.0.5")]);
        let local = slice("web", "b", "IPv4", WEB_EP, &[Ep { node: "node-a", ..ep("10.0.0.5") }]);
        let d = compute(&[s], &[remote, local], &node());
        let f = &d.frontends[&fk("192.168.0.1", 30080, Proto::Tcp)];
        assert_eq!(addrs(&f.local_backends), ["10.0.0.5:8080"]);
        assert!(f.backends[0].local);
        assert_eq!(d.health_checks[&32000].local_v4, 1);
    }

    /// A copy on this node wins over a readier one elsewhere (an address
    /// a CNI gave again on another node, the old pod still terminating
    /// here): kube-proxy's cache keeps the local copy, so outside traffic
    /// of an externalTrafficPolicy Local Service reaching this node goes
    /// to the terminating local pod, and the health check counts no ready
    /// one (before 12-05's third session lb kept the ready remote copy:
    /// the node's local set was empty and that traffic was dropped).
    #[test]
    fn a_local_copy_wins_over_a_ready_remote_copy() {
        let s = local_policy_lb();
        let remote = slice("web", "a", "IPv4", WEB_EP, &[ep("10.0.0.5")]);
        let local = slice("web", "b", "IPv4", WEB_EP, &[Ep { node: "node-a", ready: Some(false), serving: Some(true), terminating: Some(true), ..ep("10.0.0.5") }]);
        for slices in [[remote.clone(), local.clone()], [local, remote]] {
            let d = compute(std::slice::from_ref(&s), &slices, &node());
            let f = &d.frontends[&fk("192.168.0.1", 30080, Proto::Tcp)];
            assert_eq!(addrs(&f.local_backends), ["10.0.0.5:8080"]);
            assert!(f.local_backends[0].terminating && f.local_backends[0].local);
            assert_eq!(d.health_checks[&32000].local_v4, 0);
        }
    }

    /// Old objects may hold IPv4 addresses with leading zeros, which
    /// kube-proxy reads as decimal (ParseIPSloppy): so does lb, for a
    /// Service's clusterIPs, externalIPs, ingress IPs and source ranges.
    #[test]
    fn addresses_with_leading_zeros_are_read_as_kube_proxy_reads_them() {
        assert_eq!(parse_ip_sloppy("010.001.000.255"), Some("10.1.0.255".parse().unwrap()));
        assert_eq!(parse_ip_sloppy("10.0.0.256"), None);
        assert_eq!(parse_ip_sloppy("1.2.3"), None);
        assert_eq!(parse_ip_sloppy("0x1.2.3.4"), None);
        assert_eq!(parse_cidr("010.0.0.0/8"), Some(("10.0.0.0".parse().unwrap(), 8)));
        let mut s = external_svc("LoadBalancer");
        s.spec.as_mut().unwrap().external_ips = Some(vec!["010.1.2.3".into()]);
        s.spec.as_mut().unwrap().load_balancer_source_ranges = Some(vec!["010.0.0.0/8".into()]);
        lb_status(&mut s, &[("203.0.113.001", None)]);
        let d = compute(&[s], &[local_and_remote()], &node());
        assert!(d.frontends.contains_key(&fk("10.1.2.3", 80, Proto::Tcp)), "{:?}", d.warnings);
        let lb = &d.frontends[&fk("203.0.113.1", 80, Proto::Tcp)];
        assert_eq!(lb.source_ranges, [("10.0.0.0".parse().unwrap(), 8)]);
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
    }

    #[test]
    fn external_ips_and_the_socket_switch() {
        let mut s = svc("web", "10.96.0.10", WEB);
        s.spec.as_mut().unwrap().external_ips = Some(vec!["198.51.100.7".into()]);
        let d = compute(&[s.clone()], &[local_and_remote()], &node());
        let f = &d.frontends[&fk("198.51.100.7", 80, Proto::Tcp)];
        assert!(f.external && !f.no_socket);
        let d = compute_with(
            &[objects::Service::from(&s)],
            &[objects::EndpointSlice::from(&local_and_remote())],
            &node(),
            &Options { external_ip_socket: false, ..Options::default() },
        );
        assert!(d.frontends[&fk("198.51.100.7", 80, Proto::Tcp)].no_socket);
    }

    #[test]
    fn external_traffic_policy_local_and_its_health_check() {
        let mut s = external_svc("LoadBalancer");
        let spec = s.spec.as_mut().unwrap();
        spec.external_traffic_policy = Some("Local".into());
        spec.health_check_node_port = Some(32000);
        let d = compute(&[s.clone()], &[local_and_remote()], &node());
        let f = &d.frontends[&fk("192.168.0.1", 30080, Proto::Tcp)];
        assert!(f.ext_local);
        assert_eq!(addrs(&f.local_backends), ["10.0.0.1:8080"]);
        assert_eq!((d.health_checks[&32000].local_v4, d.health_checks[&32000].local_v6), (1, 0));
        assert_eq!(d.health_checks[&32000].service.to_string(), "default/web");
        // ClusterIP traffic is not affected by externalTrafficPolicy.
        assert!(!d.frontends[&fk("10.96.0.10", 80, Proto::Tcp)].ext_local);
        // Only terminating endpoints here: 0 local endpoints.
        let term = slice("web", "s", "IPv4", WEB_EP, &[Ep { node: "node-a", ready: Some(false), serving: Some(true), terminating: Some(true), ..ep("10.0.0.1") }]);
        let d = compute(&[s.clone()], &[term], &node());
        assert_eq!(d.health_checks[&32000].local_v4, 0);
        // kube-proxy counts what its endpoints map holds: endpoints of
        // slices with a port, each address once per family, whatever
        // ports it serves. A slice without ports (its pods have no port
        // of the targetPort's name) counts nothing.
        fn local(ip: &str) -> Ep<'_> {
            Ep { node: "node-a", ..ep(ip) }
        }
        let slices = [
            slice("web", "a", "IPv4", WEB_EP, &[local("10.0.0.1"), local("10.0.0.2")]),
            slice("web", "b", "IPv4", &[(Some("metrics"), 9090, "TCP")], &[local("10.0.0.2"), local("10.0.0.3")]),
            slice("web", "c", "IPv4", &[], &[local("10.0.0.4")]),
            slice("web", "d", "IPv6", WEB_EP, &[local("fd00::1")]),
        ];
        let d = compute(&[s.clone()], &slices, &node());
        let hc = &d.health_checks[&32000];
        // A single-stack IPv4 Service: its count, whatever the client's
        // family.
        assert_eq!((hc.local_v4, hc.local_v6, hc.local_endpoints(true), hc.local_endpoints(false)), (3, 1, 3, 3));
        // Dual-stack: each family's own.
        let spec = s.spec.as_mut().unwrap();
        spec.cluster_ips = Some(vec!["10.96.0.10".into(), "fd00:96::10".into()]);
        spec.ip_families = Some(vec!["IPv4".into(), "IPv6".into()]);
        let hc = &compute(&[s.clone()], &slices, &node()).health_checks[&32000];
        assert_eq!((hc.local_endpoints(true), hc.local_endpoints(false)), (3, 1));
        // Single-stack IPv6: the IPv6 count, to an IPv4 client too.
        let spec = s.spec.as_mut().unwrap();
        spec.cluster_ip = Some("fd00:96::10".into());
        spec.cluster_ips = Some(vec!["fd00:96::10".into()]);
        spec.ip_families = Some(vec!["IPv6".into()]);
        let hc = &compute(&[s], &slices, &node()).health_checks[&32000];
        assert_eq!((hc.local_endpoints(true), hc.local_endpoints(false)), (1, 1));
    }
}
