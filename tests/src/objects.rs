//! Kubernetes objects as YAML, the way `kubectl get -o yaml` prints them.

/// A Service port: (name, port, targetPort, protocol).
pub type SvcPort<'a> = (&'a str, u16, u16, &'a str);

pub fn service(name: &str, cluster_ip: &str, ports: &[SvcPort]) -> String {
    service_with(name, cluster_ip, ports, "")
}

/// A Service with extra lines appended under `spec:` (indented by 2).
pub fn service_with(name: &str, cluster_ip: &str, ports: &[SvcPort], extra_spec: &str) -> String {
    let mut s = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  type: ClusterIP\n  clusterIP: {cluster_ip}\n  clusterIPs: [{cluster_ip}]\n  ports:\n"
    );
    for (pname, port, target, proto) in ports {
        s += &format!("  - name: {pname}\n    port: {port}\n    targetPort: {target}\n    protocol: {proto}\n");
    }
    s += extra_spec;
    s
}

/// An endpoint: (ip, nodeName, ready).
pub type Ep<'a> = (&'a str, &'a str, bool);

/// An EndpointSlice for Service `svc`, with ports (name, port, protocol).
pub fn slice(svc: &str, name: &str, ports: &[(&str, u16, &str)], eps: &[Ep]) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {svc}\naddressType: IPv4\nports:\n"
    );
    for (pname, port, proto) in ports {
        s += &format!("- name: {pname}\n  port: {port}\n  protocol: {proto}\n");
    }
    if eps.is_empty() {
        s += "endpoints: []\n";
    } else {
        s += "endpoints:\n";
    }
    for (ip, node, ready) in eps {
        s += &format!(
            "- addresses: [\"{ip}\"]\n  nodeName: {node}\n  conditions:\n    ready: {ready}\n    serving: {ready}\n    terminating: false\n"
        );
    }
    s
}
