//! Kubernetes objects as YAML, the way `kubectl get -o yaml` prints them.

/// A Service port: (name, port, targetPort, protocol).
pub type SvcPort<'a> = (&'a str, u16, u16, &'a str);

pub fn service(name: &str, cluster_ip: &str, ports: &[SvcPort]) -> String {
    service_ips(name, &[cluster_ip], ports, "")
}

/// An endpoint: (ip, nodeName, ready).
pub type Ep<'a> = (&'a str, &'a str, bool);

/// An IPv4 EndpointSlice for Service `svc`, with ports (name, port, protocol).
pub fn slice(svc: &str, name: &str, ports: &[(&str, u16, &str)], eps: &[Ep]) -> String {
    let eps: Vec<Endpoint> = eps
        .iter()
        .map(|(ip, node, ready)| if *ready { Endpoint::ready(ip, node) } else { Endpoint::not_ready(ip, node) })
        .collect();
    slice_of(svc, name, "IPv4", ports, &eps)
}

/// A Service with several clusterIPs (dual-stack), with extra `spec:` lines.
pub fn service_ips(name: &str, cluster_ips: &[&str], ports: &[SvcPort], extra_spec: &str) -> String {
    let mut s = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  type: ClusterIP\n  clusterIP: {}\n  clusterIPs: [{}]\n  ports:\n",
        cluster_ips[0],
        cluster_ips.iter().map(|ip| format!("\"{ip}\"")).collect::<Vec<_>>().join(", ")
    );
    for (pname, port, target, proto) in ports {
        s += &format!("  - name: {pname}\n    port: {port}\n    targetPort: {target}\n    protocol: {proto}\n");
    }
    s += extra_spec;
    s
}

/// An endpoint with every condition spelled out.
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub ip: String,
    pub node: String,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub zones: Vec<String>,
    /// `hints.forNodes` (PreferSameNode).
    pub for_nodes: Vec<String>,
}

impl Endpoint {
    pub fn ready(ip: &str, node: &str) -> Self {
        Self { ip: ip.into(), node: node.into(), ready: true, serving: true, terminating: false, zones: vec![], for_nodes: vec![] }
    }
    pub fn not_ready(ip: &str, node: &str) -> Self {
        Self { ready: false, serving: false, ..Self::ready(ip, node) }
    }
    pub fn terminating(ip: &str, node: &str) -> Self {
        Self { ready: false, serving: true, terminating: true, ..Self::ready(ip, node) }
    }
    /// Terminating and no longer serving: a pod that fails its readiness
    /// probe on purpose while it shuts down (to drain).
    pub fn draining(ip: &str, node: &str) -> Self {
        Self { ready: false, serving: false, terminating: true, ..Self::ready(ip, node) }
    }
    pub fn zone(mut self, z: &str) -> Self {
        self.zones.push(z.into());
        self
    }
    pub fn for_node(mut self, n: &str) -> Self {
        self.for_nodes.push(n.into());
        self
    }
}

/// An EndpointSlice of `family` ("IPv4" or "IPv6").
pub fn slice_of(svc: &str, name: &str, family: &str, ports: &[(&str, u16, &str)], eps: &[Endpoint]) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {svc}\naddressType: {family}\nports:\n"
    );
    for (pname, port, proto) in ports {
        s += &format!("- name: {pname}\n  port: {port}\n  protocol: {proto}\n");
    }
    s += if eps.is_empty() { "endpoints: []\n" } else { "endpoints:\n" };
    for e in eps {
        s += &format!(
            "- addresses: [\"{}\"]\n  nodeName: {}\n  conditions:\n    ready: {}\n    serving: {}\n    terminating: {}\n",
            e.ip, e.node, e.ready, e.serving, e.terminating
        );
        if !e.zones.is_empty() || !e.for_nodes.is_empty() {
            s += "  hints:\n";
        }
        if !e.zones.is_empty() {
            s += "    forZones:\n";
            for z in &e.zones {
                s += &format!("    - name: {z}\n");
            }
        }
        if !e.for_nodes.is_empty() {
            s += "    forNodes:\n";
            for n in &e.for_nodes {
                s += &format!("    - name: {n}\n");
            }
        }
    }
    s
}

/// A Node object with a zone label.
pub fn node(name: &str, zone: &str) -> String {
    format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels:\n    topology.kubernetes.io/zone: {zone}\n")
}

/// A Service port with a nodePort: (name, port, targetPort, protocol, nodePort).
pub type NodePortSpec<'a> = (&'a str, u16, u16, &'a str, u16);

/// A NodePort or LoadBalancer Service with `cluster_ips` (the first is
/// `clusterIP`; give one of each family for a dual-stack one). `extra_spec` lines go under `spec:`;
/// `lb_ips` become `status.loadBalancer.ingress`.
pub fn service_typed(name: &str, cluster_ips: &[&str], ty: &str, ports: &[NodePortSpec], extra_spec: &str, lb_ips: &[&str]) -> String {
    let ips: Vec<String> = cluster_ips.iter().map(|ip| format!("\"{ip}\"")).collect();
    let mut s = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  type: {ty}\n  clusterIP: {}\n  clusterIPs: [{}]\n  ports:\n",
        cluster_ips[0],
        ips.join(", ")
    );
    for (pname, port, target, proto, np) in ports {
        s += &format!("  - name: {pname}\n    port: {port}\n    targetPort: {target}\n    protocol: {proto}\n    nodePort: {np}\n");
    }
    s += extra_spec;
    if !lb_ips.is_empty() {
        s += "status:\n  loadBalancer:\n    ingress:\n";
        for ip in lb_ips {
            s += &format!("    - ip: {ip}\n");
        }
    }
    s
}
