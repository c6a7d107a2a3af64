//! Which endpoints serve a Service port: the EndpointSlices' conditions
//! with the API's defaults, the serving-terminating fallback (KEP-1669),
//! topology hints with kube-proxy's rules, and the node-local set.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use k8s_openapi::api::core::v1::ServicePort;

use super::{Backend, Endpoint, EndpointSlice, NodeInfo, Proto, parse_proto, usable_ip, valid_port};

/// The endpoints of one Service port, from its slices in a stable order.
pub(super) struct PortEndpoints<'a> {
    pub(super) slices: &'a [&'a EndpointSlice],
    pub(super) sp: &'a ServicePort,
    pub(super) proto: Proto,
    pub(super) node: &'a NodeInfo,
}

/// What a frontend of one family uses.
pub(super) struct Sets {
    /// For cluster-wide traffic.
    pub(super) cluster: Vec<Backend>,
    /// Topology hints narrowed `cluster`.
    pub(super) topology: bool,
    /// On this node (the node-local set, with its own terminating fallback).
    pub(super) local: Vec<Backend>,
    /// In neither set, yet not stale (`sets`): ready ones, and the others.
    pub(super) extra_ready: Vec<(IpAddr, u16)>,
    pub(super) extra: Vec<(IpAddr, u16)>,
}

impl PortEndpoints<'_> {
    /// Every endpoint of this port in family `v4` (IPv4) or IPv6, each once.
    fn all(&self, v4: bool) -> Vec<(Backend, Conditions)> {
        let node = self.node;
        let mut all = Vec::new();
        for slice in self.slices {
            let family_ok = match slice.address_type.as_str() {
                "IPv4" => v4,
                "IPv6" => !v4,
                _ => false,
            };
            if !family_ok {
                continue;
            }
            let Some(target) = slice_port(slice, self.sp, self.proto) else { continue };
            for ep in &slice.endpoints {
                let local = ep.node_name.as_deref() == Some(node.name.as_str()) && !node.name.is_empty();
                for addr in ep.addresses.iter().copied() {
                    if addr.is_ipv4() != v4 || !usable_ip(&addr) {
                        continue;
                    }
                    let c = conditions(ep);
                    all.push((Backend { addr, port: target, local, terminating: false, pod_terminating: c.terminating }, c));
                }
            }
        }
        dedup(all)
    }

    /// The sets of family `v4`; `topology`: hints may narrow the cluster set.
    pub(super) fn sets(&self, v4: bool, topology: bool) -> Sets {
        let all = self.all(v4);
        let hint = if topology { topology_hint(&all, self.node) } else { None };
        let cluster = usable(&all, hint);
        let local_candidates: Vec<_> = all.iter().filter(|(b, _)| b.local).cloned().collect();
        let local = usable(&local_candidates, None);
        let picked = |a: IpAddr, p: u16| super::find(&cluster, a, p).is_some() || super::find(&local, a, p).is_some();
        // Not picked, yet not stale. For TCP, every endpoint the slices
        // still list: a pod that fails its readiness probe (a passing
        // failure, or on purpose to drain while it shuts down) still runs,
        // and its established connections are its own to finish, as they
        // are under kube-proxy, whose conntrack never flushes TCP (nor
        // does Cilium destroy TCP sockets); they go stale when the
        // endpoint leaves the slice, once the pod is gone. For UDP only
        // endpoints that serve: kube-proxy flushes the conntrack entries
        // of an endpoint that stopped serving, and lb destroys the
        // connected sockets likewise.
        let keeps = |c: &Conditions| c.serving || self.proto == Proto::Tcp;
        let (extra_ready, extra) = all
            .iter()
            .filter(|(b, c)| keeps(c) && !picked(b.addr, b.port))
            .partition::<Vec<_>, _>(|(_, c)| c.ready && !c.terminating);
        let pairs = |v: Vec<&(Backend, Conditions)>| v.into_iter().map(|(b, _)| (b.addr, b.port)).collect();
        Sets { cluster, topology: hint.is_some(), local, extra_ready: pairs(extra_ready), extra: pairs(extra) }
    }
}

/// The endpoint conditions, with kube-proxy's defaults: a nil `ready` or
/// `serving` means true, a nil `terminating` false (pkg/proxy
/// endpointslicecache.go; a nil `serving` beside `ready: false,
/// terminating: true` is a serving-terminating endpoint).
#[derive(Clone)]
pub(super) struct Conditions {
    pub(super) ready: bool,
    pub(super) serving: bool,
    pub(super) terminating: bool,
    /// The zones of the endpoint's topology hints (empty: no hints).
    zones: BTreeSet<String>,
    /// The nodes of its hints (`hints.forNodes`, PreferSameNode; empty: none).
    nodes: BTreeSet<String>,
}

pub(super) fn conditions(ep: &Endpoint) -> Conditions {
    let c = ep.conditions.as_ref();
    let ready = c.and_then(|c| c.ready).unwrap_or(true);
    let h = ep.hints.as_ref();
    Conditions {
        ready,
        serving: c.and_then(|c| c.serving).unwrap_or(true),
        terminating: c.and_then(|c| c.terminating).unwrap_or(false),
        zones: h.and_then(|h| h.for_zones.as_ref()).map(|z| z.iter().map(|z| z.name.clone()).collect()).unwrap_or_default(),
        nodes: h.and_then(|h| h.for_nodes.as_ref()).map(|n| n.iter().map(|n| n.name.clone()).collect()).unwrap_or_default(),
    }
}

/// Which topology hints narrow the cluster set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hint<'a> {
    /// `forNodes` (trafficDistribution: PreferSameNode): endpoints hinted
    /// for this node.
    Node(&'a str),
    /// `forZones` (PreferSameZone, PreferClose, or the topology-aware-routing
    /// annotation): endpoints hinted for this node's zone.
    Zone(&'a str),
}

impl Hint<'_> {
    fn admits(&self, c: &Conditions) -> bool {
        match self {
            Hint::Node(n) => c.nodes.contains(*n),
            Hint::Zone(z) => c.zones.contains(*z),
        }
    }
}

/// kube-proxy's rule for topology hints (pkg/proxy/topology.go,
/// topologyModeFromHints): node hints when every ready endpoint has them and
/// one is for this node; else zone hints when every ready endpoint has them
/// and one is for this node's zone; else none (all ready endpoints). Hints
/// come from the EndpointSlice controller, which reads trafficDistribution:
/// a value it does not know gives no hints, and so changes nothing here.
fn topology_hint<'a>(candidates: &[(Backend, Conditions)], node: &'a NodeInfo) -> Option<Hint<'a>> {
    let zone = node.zone.as_deref();
    let (mut all_nodes, mut for_node, mut all_zones, mut for_zone) = (true, false, true, false);
    for (_, c) in candidates.iter().filter(|(_, c)| c.ready) {
        if c.nodes.is_empty() {
            all_nodes = false;
        } else if c.nodes.contains(&node.name) {
            for_node = true;
        }
        if c.zones.is_empty() {
            all_zones = false;
        } else if zone.is_some_and(|z| c.zones.contains(z)) {
            for_zone = true;
        }
    }
    if all_nodes && for_node {
        return Some(Hint::Node(&node.name));
    }
    if all_zones && for_zone {
        return zone.map(Hint::Zone);
    }
    None
}

/// KEP-1669: the ready endpoints (those the hint admits, when topology
/// applies), or when there are none, the serving and terminating ones
/// (whatever their hints: a best effort not to drop connections).
fn usable(candidates: &[(Backend, Conditions)], hint: Option<Hint<'_>>) -> Vec<Backend> {
    let ready: BTreeSet<Backend> = candidates
        .iter()
        .filter(|(_, c)| c.ready && hint.is_none_or(|h| h.admits(c)))
        .map(|(b, _)| Backend { terminating: false, ..*b })
        .collect();
    if !ready.is_empty() {
        return ready.into_iter().collect();
    }
    candidates
        .iter()
        .filter(|(_, c)| c.serving && c.terminating)
        .map(|(b, _)| Backend { terminating: true, ..*b })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// Deduplicate by address and port: the same endpoint listed twice (in two
/// slices, say) is one backend. A copy on this node wins, as in
/// kube-proxy's cache (a local copy replaces any other, whatever its
/// conditions: the health check counts it, so the node's outside traffic
/// must find it in the local set); of copies both local or both not, the
/// more usable (kube-proxy keeps whichever slice it met first: random).
fn dedup(v: Vec<(Backend, Conditions)>) -> Vec<(Backend, Conditions)> {
    let mut by_addr: BTreeMap<(IpAddr, u16), (Backend, Conditions)> = BTreeMap::new();
    for (b, c) in v {
        let rank = |b: &Backend, c: &Conditions| (b.local, c.ready, c.serving, !c.terminating);
        match by_addr.get(&(b.addr, b.port)) {
            Some((old_b, old)) if rank(old_b, old) >= rank(&b, &c) => {}
            _ => {
                by_addr.insert((b.addr, b.port), (b, c));
            }
        }
    }
    by_addr.into_values().collect()
}

/// The EndpointSlice port that a Service port maps to: matched by name
/// (both unnamed counts as a match) and protocol.
fn slice_port(slice: &EndpointSlice, sp: &ServicePort, proto: Proto) -> Option<u16> {
    let want = sp.name.as_deref().unwrap_or("");
    slice.ports.as_ref()?.iter().find_map(|p| {
        let name = p.name.as_deref().unwrap_or("");
        (name == want && parse_proto(p.protocol.as_deref()) == Some(proto))
            .then_some(p.port)
            .flatten()
            .and_then(valid_port)
    })
}
