//! The node the agent runs on: its zone, its primary addresses, and the
//! addresses its NodePorts are on (`--nodeport-addresses`, kube-proxy's
//! flag and rules).
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1::Node;

use super::{LABEL_ZONE, network, parse_cidr};

/// What the model knows about the node it runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// The node's zone, for topology hints.
    pub zone: Option<String>,
    /// The addresses NodePorts are on (`NodePortAddresses`), 127.0.0.1
    /// among them for localhost NodePorts.
    pub addresses: Vec<IpAddr>,
    /// The node's primary addresses: `--node-ip`, else the Node object's
    /// InternalIPs then ExternalIPs, else the interfaces'. The first of
    /// each family is `--nodeport-addresses primary`, and where SNAT
    /// falls back to when the kernel cannot say.
    pub primary: Vec<IpAddr>,
}

/// The taint cluster-autoscaler puts on a node it is about to delete.
pub const TAINT_TO_BE_DELETED: &str = "ToBeDeletedByClusterAutoscaler";

/// Whether load balancers should send new connections to this node
/// (kube-proxy's `/healthz` "nodeEligible", proxy_health.go `SyncNode`,
/// KEP-3836): not while its Node object is being deleted or carries
/// cluster-autoscaler's `ToBeDeletedByClusterAutoscaler` taint. `node`:
/// the Node object, None once it is gone; then its last state stands
/// (kube-proxy syncs the deleted object), `was` here.
pub fn node_eligible(node: Option<&Node>, was: bool) -> bool {
    let Some(n) = node else { return was };
    let tainted = n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == TAINT_TO_BE_DELETED));
    n.metadata.deletion_timestamp.is_none() && !tainted
}

/// `--nodeport-addresses`, as kube-proxy reads its flag of that name: the
/// node's addresses within these CIDRs get the NodePorts; a family with
/// no CIDR of its own gets them on all its addresses (so does every
/// family when the flag is not given: kube-proxy's iptables mode).
/// `primary` alone means the node's primary address of each family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePortAddresses {
    /// (network, prefix length).
    pub cidrs: Vec<(IpAddr, u8)>,
    /// `primary`: the first primary address of each family.
    pub primary: bool,
}

impl NodePortAddresses {
    /// The flag's values (each may hold several, comma-separated), with
    /// an error naming the flag and the value that is wrong.
    pub fn parse<S: AsRef<str>>(values: &[S]) -> Result<Self, String> {
        let items: Vec<&str> = values.iter().flat_map(|v| v.as_ref().split(',')).map(str::trim).filter(|s| !s.is_empty()).collect();
        if items.contains(&"primary") {
            if items.len() > 1 {
                return Err(format!("--nodeport-addresses: \"primary\" cannot be combined with other values ({})", items.join(",")));
            }
            return Ok(Self { cidrs: Vec::new(), primary: true });
        }
        let cidrs = items
            .iter()
            .map(|s| match s.split_once('/') {
                Some(_) => parse_cidr(s).ok_or_else(|| format!("--nodeport-addresses: {s:?} is not a CIDR (like 10.0.0.0/8 or fd00::/64) or \"primary\"")),
                None => Err(format!("--nodeport-addresses: {s:?} has no prefix length (write {s}/32 or {s}/128)")),
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { cidrs, primary: false })
    }

    /// The CIDRs that apply, "primary" resolved against `primary`.
    fn resolved(&self, primary: &[IpAddr]) -> Vec<(IpAddr, u8)> {
        if !self.primary {
            return self.cidrs.clone();
        }
        let first = |v4: bool| primary.iter().find(|a| a.is_ipv4() == v4 && !a.is_loopback()).copied();
        [first(true).map(|a| (a, 32)), first(false).map(|a| (a, 128))].into_iter().flatten().collect()
    }

    /// Whether `addr` may have the NodePorts: within one of the CIDRs of
    /// its family, or its family has none.
    fn admits(cidrs: &[(IpAddr, u8)], addr: &IpAddr) -> bool {
        let mut same = cidrs.iter().filter(|(net, _)| net.is_ipv4() == addr.is_ipv4()).peekable();
        same.peek().is_none() || same.any(|(net, len)| contains(net, *len, addr))
    }
}

/// Whether `addr` is in the network `net/len` (`net` as `parse_cidr`
/// gives it: host bits cleared).
fn contains(net: &IpAddr, len: u8, addr: &IpAddr) -> bool {
    net.is_ipv4() == addr.is_ipv4() && network(*addr, len) == *net
}

/// Where the node's facts come from, strongest first.
#[derive(Clone, Debug, Default)]
pub struct NodeFacts<'a> {
    pub name: &'a str,
    /// `--zone`.
    pub zone: Option<&'a str>,
    /// `--node-ip`.
    pub ips: &'a [IpAddr],
    /// The global and IPv4 link-local addresses on the node's interfaces:
    /// NodePorts are on these (and on the primary addresses), as far as
    /// `nodeport_addresses` lets them be; the global ones are the primary
    /// addresses when neither `--node-ip` nor the Node object gives any.
    pub interface_ips: &'a [IpAddr],
    /// `--nodeport-addresses`.
    pub nodeport_addresses: NodePortAddresses,
    /// `--localhost-nodeports`: 127.0.0.1 too, where `nodeport_addresses`
    /// admits it (kube-proxy's iptables mode: IPv4 only).
    pub localhost_nodeports: bool,
}

/// This node's facts: the zone comes from `--zone` when given, else from the
/// `topology.kubernetes.io/zone` label of the Node object named `name`. The
/// primary addresses come from `--node-ip`, else the Node's InternalIP and
/// ExternalIP addresses (InternalIPs first, as kube-proxy picks its node
/// IP), else the interfaces. The NodePorts are on the primary and the
/// interface addresses that `--nodeport-addresses` admits, and on
/// 127.0.0.1 for localhost NodePorts.
pub fn node_info<N: std::borrow::Borrow<Node>>(facts: &NodeFacts, nodes: &[N]) -> NodeInfo {
    let this = nodes.iter().map(|n| n.borrow()).find(|n| n.metadata.name.as_deref() == Some(facts.name));
    let zone = facts
        .zone
        .map(str::to_string)
        .or_else(|| this.and_then(|n| n.metadata.labels.as_ref()?.get(LABEL_ZONE).cloned()));
    let listed = this.and_then(|n| n.status.as_ref()?.addresses.as_ref());
    let of_type = |ty: &'static str| listed.into_iter().flatten().filter(move |a| a.type_ == ty).filter_map(|a| a.address.parse::<IpAddr>().ok());
    let from_node: Vec<IpAddr> = of_type("InternalIP").chain(of_type("ExternalIP")).collect();
    let primary = if !facts.ips.is_empty() {
        facts.ips.to_vec()
    } else if !from_node.is_empty() {
        from_node
    } else {
        // A link-local address is no node address to SNAT from or to
        // pick as `primary`.
        facts.interface_ips.iter().filter(|a| !matches!(a, IpAddr::V4(v4) if v4.is_link_local())).copied().collect()
    };
    let cidrs = facts.nodeport_addresses.resolved(&primary);
    let mut addresses: Vec<IpAddr> = Vec::new();
    for a in primary.iter().chain(facts.interface_ips) {
        if !addresses.contains(a) && NodePortAddresses::admits(&cidrs, a) {
            addresses.push(*a);
        }
    }
    let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
    if facts.localhost_nodeports && NodePortAddresses::admits(&cidrs, &localhost) {
        addresses.push(localhost);
    }
    NodeInfo { name: facts.name.to_string(), zone: zone.filter(|z| !z.is_empty()), addresses, primary }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_node_is_eligible_unless_being_deleted_or_tainted_for_it() {
        use k8s_openapi::api::core::v1::{NodeSpec, Taint};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let plain = Node::default();
        assert!(node_eligible(Some(&plain), false));
        let mut deleting = Node::default();
        deleting.metadata.deletion_timestamp = Some(Time(Default::default()));
        assert!(!node_eligible(Some(&deleting), true));
        let taint = |key: &str| Taint { key: key.into(), effect: "NoSchedule".into(), ..Default::default() };
        let mut tainted = Node { spec: Some(NodeSpec { taints: Some(vec![taint("other"), taint(TAINT_TO_BE_DELETED)]), ..Default::default() }), ..Default::default() };
        assert!(!node_eligible(Some(&tainted), true));
        tainted.spec.as_mut().unwrap().taints = Some(vec![taint("other")]);
        assert!(node_eligible(Some(&tainted), false));
        // Gone: as it was last seen.
        assert!(!node_eligible(None, false));
        assert!(node_eligible(None, true));
    }

    use super::*;
    use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};

    fn ips(s: &[&str]) -> Vec<IpAddr> {
        s.iter().map(|a| a.parse().unwrap()).collect()
    }

    fn node_with(addresses: &[(&str, &str)]) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("node-a".into());
        n.status = Some(NodeStatus {
            addresses: Some(addresses.iter().map(|(t, a)| NodeAddress { type_: (*t).into(), address: (*a).into() }).collect()),
            ..Default::default()
        });
        n
    }

    #[test]
    fn zone_comes_from_the_flag_or_the_node_label() {
        let mut n = Node::default();
        n.metadata.name = Some("node-a".into());
        n.metadata.labels = Some([(LABEL_ZONE.to_string(), "zone-x".to_string())].into());
        let mut other = Node::default();
        other.metadata.name = Some("node-b".into());
        other.metadata.labels = Some([(LABEL_ZONE.to_string(), "zone-y".to_string())].into());
        let nodes = [other, n];
        let facts = |name, zone| NodeFacts { name, zone, ..Default::default() };
        assert_eq!(node_info(&facts("node-a", None), &nodes).zone.as_deref(), Some("zone-x"));
        assert_eq!(node_info(&facts("node-a", Some("zone-f")), &nodes).zone.as_deref(), Some("zone-f"));
        assert_eq!(node_info(&facts("node-c", None), &nodes).zone, None);
    }

    #[test]
    fn primary_addresses_from_flag_node_object_internal_first_or_interfaces() {
        let n = node_with(&[("ExternalIP", "203.0.113.5"), ("InternalIP", "192.168.5.5"), ("Hostname", "node-a")]);
        let flag = ips(&["10.1.1.1"]);
        let ifaces = ips(&["172.16.0.1"]);
        let with = |ips: &[IpAddr], nodes: &[Node]| node_info(&NodeFacts { name: "node-a", ips, interface_ips: &ifaces, ..Default::default() }, nodes).primary;
        assert_eq!(with(&flag, std::slice::from_ref(&n)), flag);
        assert_eq!(with(&[], std::slice::from_ref(&n)), ips(&["192.168.5.5", "203.0.113.5"]));
        assert_eq!(with(&[], &[]), ifaces);
    }

    /// kube-proxy's iptables mode with no `--nodeport-addresses`: every
    /// local address (`-m addrtype --dst-type LOCAL`), a second NIC's too.
    #[test]
    fn by_default_node_ports_are_on_every_address_of_the_node() {
        let n = node_with(&[("InternalIP", "192.168.5.5")]);
        let ifaces = ips(&["192.168.5.5", "172.16.0.1", "fd00::5"]);
        let facts = NodeFacts { name: "node-a", interface_ips: &ifaces, ..Default::default() };
        assert_eq!(node_info(&facts, std::slice::from_ref(&n)).addresses, ips(&["192.168.5.5", "172.16.0.1", "fd00::5"]));
        // A primary address not on an interface (a flag, a NATed
        // ExternalIP) keeps them too.
        let flag = ips(&["10.1.1.1"]);
        let facts = NodeFacts { ips: &flag, ..facts };
        assert_eq!(node_info(&facts, std::slice::from_ref(&n)).addresses, ips(&["10.1.1.1", "192.168.5.5", "172.16.0.1", "fd00::5"]));
        // An IPv4 link-local address (NodeLocal DNSCache's on its dummy
        // device) has them, as kube-proxy's LOCAL match gives them; it is
        // never a primary address.
        let with_link_local = ips(&["169.254.20.10", "192.168.5.5"]);
        let ll = NodeFacts { name: "node-a", interface_ips: &with_link_local, ..Default::default() };
        let info = node_info(&ll, &[] as &[Node]);
        assert_eq!((info.primary, info.addresses), (ips(&["192.168.5.5"]), ips(&["192.168.5.5", "169.254.20.10"])));
        let ll = NodeFacts { nodeport_addresses: NodePortAddresses::parse(&["primary"]).unwrap(), ..ll };
        assert_eq!(node_info(&ll, &[] as &[Node]).addresses, ips(&["192.168.5.5"]));
        // Localhost NodePorts: 127.0.0.1, last.
        let facts = NodeFacts { localhost_nodeports: true, ..facts };
        assert_eq!(node_info(&facts, &[] as &[Node]).addresses.last(), Some(&"127.0.0.1".parse().unwrap()));
    }

    #[test]
    fn cidrs_pick_addresses_per_family_and_a_family_without_one_keeps_all() {
        let ifaces = ips(&["192.168.5.5", "10.8.0.1", "172.16.0.1", "fd00::5", "fd01::5"]);
        let with = |flag: &[&str]| {
            let nodeport_addresses = NodePortAddresses::parse(flag).unwrap();
            node_info(&NodeFacts { name: "node-a", interface_ips: &ifaces, nodeport_addresses, localhost_nodeports: true, ..Default::default() }, &[] as &[Node]).addresses
        };
        // IPv4 restricted, IPv6 unrestricted (kube-proxy: "::/0" for the
        // family with no CIDR), and no 127.0.0.1 outside the CIDRs.
        assert_eq!(with(&["10.0.0.0/8,172.16.0.0/12"]), ips(&["10.8.0.1", "172.16.0.1", "fd00::5", "fd01::5"]));
        assert_eq!(with(&["10.0.0.0/8", "fd01::/16"]), ips(&["10.8.0.1", "fd01::5"]));
        // 127.0.0.0/8 among them: localhost NodePorts stay.
        assert_eq!(with(&["192.168.5.0/24", "127.0.0.0/8"]), ips(&["192.168.5.5", "fd00::5", "fd01::5", "127.0.0.1"]));
        // 0.0.0.0/0: all, 127.0.0.1 too.
        assert_eq!(with(&["0.0.0.0/0", "fd00::/16"]), ips(&["192.168.5.5", "10.8.0.1", "172.16.0.1", "fd00::5", "127.0.0.1"]));
        // A CIDR no address is in: no NodePorts on that family.
        assert_eq!(with(&["198.51.100.0/24"]), ips(&["fd00::5", "fd01::5"]));
        // Host bits in a CIDR are ignored, as kube-proxy's parser does.
        assert_eq!(with(&["10.8.0.9/16"])[..1], ips(&["10.8.0.1"]));
    }

    #[test]
    fn primary_is_the_first_primary_address_of_each_family() {
        let n = node_with(&[("InternalIP", "192.168.5.5"), ("InternalIP", "192.168.6.6"), ("InternalIP", "fd00::5")]);
        let ifaces = ips(&["192.168.5.5", "192.168.6.6", "172.16.0.1", "fd00::5", "fd01::5"]);
        let facts = NodeFacts {
            name: "node-a",
            interface_ips: &ifaces,
            nodeport_addresses: NodePortAddresses::parse(&["primary"]).unwrap(),
            localhost_nodeports: true,
            ..Default::default()
        };
        assert_eq!(node_info(&facts, std::slice::from_ref(&n)).addresses, ips(&["192.168.5.5", "fd00::5"]));
        // A single-stack node: IPv6 has no primary address, so kube-proxy's
        // rule leaves that family unrestricted.
        let n = node_with(&[("InternalIP", "192.168.5.5")]);
        assert_eq!(node_info(&facts, std::slice::from_ref(&n)).addresses, ips(&["192.168.5.5", "fd00::5", "fd01::5"]));
    }

    #[test]
    fn bad_values_name_the_flag_and_the_value() {
        for (flag, want) in [
            (&["primary", "10.0.0.0/8"][..], "\"primary\" cannot be combined"),
            (&["10.0.0.0/33"], "\"10.0.0.0/33\" is not a CIDR"),
            (&["eth0/24"], "\"eth0/24\" is not a CIDR"),
            (&["10.0.0.1"], "\"10.0.0.1\" has no prefix length"),
        ] {
            let e = NodePortAddresses::parse(flag).unwrap_err();
            assert!(e.starts_with("--nodeport-addresses: ") && e.contains(want), "{flag:?}: {e}");
        }
        assert_eq!(NodePortAddresses::parse(&[] as &[&str]).unwrap(), NodePortAddresses::default());
        assert_eq!(NodePortAddresses::parse(&[""]).unwrap(), NodePortAddresses::default());
    }
}
