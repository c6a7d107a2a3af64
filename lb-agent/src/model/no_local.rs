//! kube-proxy's `kubeproxy_sync_proxy_rules_no_local_endpoints_total`: the
//! Service ports with a Local traffic policy whose endpoints are all on
//! other nodes, by IP family and policy. kube-proxy counts a Service port
//! when it has usable endpoints, its policy is Local, and none of them is
//! on this node: "internal" for internalTrafficPolicy Local (its ClusterIP
//! then refuses in-cluster traffic here), "external" for
//! externalTrafficPolicy Local on a Service reachable from outside (its
//! NodePorts, LoadBalancer IPs and externalIPs drop outside traffic here).
//! A Service port with no endpoints at all is not counted (it is refused
//! everywhere).
//!
//! Kept up to date frontend by frontend (`set`), so that a sync that
//! changed a few frontends does not walk them all.
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use super::{Desired, Frontend, FrontendKey, Proto, ServiceRef};

/// kube-proxy's `ip_family` label for an address.
pub fn ip_family(a: &IpAddr) -> &'static str {
    if a.is_ipv4() { "IPv4" } else { "IPv6" }
}

/// What one frontend counts toward: (family, policy, Service, port name,
/// protocol); a Service port has several frontends (its ClusterIPs; its
/// NodePorts on every node address, its LoadBalancer IPs, externalIPs).
type PortKey = (&'static str, &'static str, ServiceRef, String, Proto);

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NoLocalEndpoints {
    /// Each frontend that counts, with the Service port it counts toward.
    frontends: HashMap<FrontendKey, PortKey>,
    /// How many frontends count toward each Service port.
    ports: BTreeMap<PortKey, usize>,
}

/// The Service port and policy frontend `f` at `k` counts toward, if any.
fn counted(k: &FrontendKey, f: &Frontend) -> Option<PortKey> {
    // Endpoints somewhere (the cluster-wide set), none here.
    if f.backends.is_empty() || !f.local_backends.is_empty() {
        return None;
    }
    let policy = match (f.external, f.ext_local, f.local_only) {
        (true, true, _) => "external",
        (false, _, true) => "internal",
        _ => return None,
    };
    Some((ip_family(&k.addr), policy, f.service.clone(), f.port_name.clone(), k.proto))
}

impl NoLocalEndpoints {
    /// Counted from every frontend of `d`.
    pub fn of(d: &Desired) -> Self {
        let mut n = Self::default();
        for (k, f) in &d.frontends {
            n.set(k, Some(f));
        }
        n
    }

    /// Frontend `k` is now `f` (None: gone).
    pub fn set(&mut self, k: &FrontendKey, f: Option<&Frontend>) {
        if let Some(old) = self.frontends.remove(k)
            && let Some(n) = self.ports.get_mut(&old)
        {
            *n -= 1;
            if *n == 0 {
                self.ports.remove(&old);
            }
        }
        if let Some(port) = f.and_then(|f| counted(k, f)) {
            *self.ports.entry(port.clone()).or_default() += 1;
            self.frontends.insert(*k, port);
        }
    }

    /// Service ports by (family, policy); a pair with none is absent.
    pub fn counts(&self) -> BTreeMap<(&'static str, &'static str), usize> {
        let mut out = BTreeMap::new();
        for (family, policy, ..) in self.ports.keys() {
            *out.entry((*family, *policy)).or_default() += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Backend;

    fn key(addr: &str, port: u16) -> FrontendKey {
        FrontendKey { addr: addr.parse().unwrap(), port, proto: Proto::Tcp }
    }

    fn backend(addr: &str, local: bool) -> Backend {
        Backend { addr: addr.parse().unwrap(), port: 8080, local, terminating: false, pod_terminating: false }
    }

    fn svc(name: &str) -> ServiceRef {
        ServiceRef { namespace: "default".into(), name: name.into() }
    }

    /// A frontend of Service `name`, port "http", with a remote endpoint
    /// (and a local one if `local`).
    fn front(name: &str, external: bool, local_policy: bool, local: bool) -> Frontend {
        let mut f = Frontend::new(svc(name), "http".into());
        f.backends = vec![backend("10.244.2.5", false)];
        if local {
            f.backends.push(backend("10.244.1.5", true));
            f.local_backends = vec![backend("10.244.1.5", true)];
        }
        f.external = external;
        if external {
            f.ext_local = local_policy;
        } else {
            f.local_only = local_policy;
        }
        f
    }

    #[test]
    fn counts_local_policies_with_endpoints_elsewhere_only() {
        // (external, Local policy, a local endpoint) -> counted as
        let cases = [
            (false, true, false, Some("internal")),
            (false, true, true, None),
            (false, false, false, None),
            (true, true, false, Some("external")),
            (true, true, true, None),
            (true, false, false, None),
        ];
        for (external, local_policy, local, want) in cases {
            let mut n = NoLocalEndpoints::default();
            n.set(&key("10.96.0.10", 80), Some(&front("web", external, local_policy, local)));
            let got: Vec<_> = n.counts().into_iter().collect();
            let want: Vec<_> = want.map(|p| (("IPv4", p), 1)).into_iter().collect();
            assert_eq!(got, want, "external {external}, Local {local_policy}, local endpoint {local}");
        }
        // No endpoints at all: refused everywhere, not counted.
        let mut f = front("web", false, true, false);
        f.backends.clear();
        let mut n = NoLocalEndpoints::default();
        n.set(&key("10.96.0.10", 80), Some(&f));
        assert!(n.counts().is_empty());
    }

    #[test]
    fn each_service_port_counts_once_per_family_and_policy() {
        let mut n = NoLocalEndpoints::default();
        // One Service port: NodePort on two node addresses and an LB IP
        // (external), its ClusterIP with internalTrafficPolicy Local too.
        let mut both = front("web", true, true, false);
        for k in [key("192.168.0.1", 30080), key("10.0.0.1", 30080), key("203.0.113.7", 80)] {
            n.set(&k, Some(&both));
        }
        n.set(&key("10.96.0.10", 80), Some(&front("web", false, true, false)));
        // Its IPv6 NodePort, and another Service's ClusterIP.
        n.set(&key("fd00::1", 30080), Some(&both));
        n.set(&key("10.96.0.11", 80), Some(&front("db", false, true, false)));
        let want = BTreeMap::from([(("IPv4", "external"), 1), (("IPv4", "internal"), 2), (("IPv6", "external"), 1)]);
        assert_eq!(n.counts(), want);
        // A second port of the same Service counts on its own.
        both.port_name = "https".into();
        n.set(&key("192.168.0.1", 30443), Some(&both));
        assert_eq!(n.counts()[&("IPv4", "external")], 2);
        // The port's last frontend going takes it out; one of several not.
        n.set(&key("192.168.0.1", 30443), None);
        n.set(&key("192.168.0.1", 30080), None);
        n.set(&key("10.0.0.1", 30080), Some(&front("web", true, true, true)));
        assert_eq!(n.counts()[&("IPv4", "external")], 1, "the LB IP still counts");
        n.set(&key("203.0.113.7", 80), None);
        assert!(!n.counts().contains_key(&("IPv4", "external")));
    }

    #[test]
    fn kept_up_to_date_frontend_by_frontend_equals_counting_afresh() {
        // Every sequence of changes to four frontends over the six kinds
        // (and none): the tracker equals a fresh count of the end state.
        let keys = [key("10.96.0.10", 80), key("10.96.0.11", 80), key("192.168.0.1", 30080), key("fd00::1", 30080)];
        let kinds: Vec<Option<Frontend>> = std::iter::once(None)
            .chain([(false, true, false), (false, true, true), (true, true, false), (true, true, true), (true, false, false)].map(|(e, p, l)| {
                // Two Services, so that ports both differ and coincide.
                Some(front(if l { "web" } else { "db" }, e, p, l))
            }))
            .collect();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            let mut n = NoLocalEndpoints::default();
            let mut d = Desired::default();
            for _ in 0..8 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let k = keys[(seed % keys.len() as u64) as usize];
                let f = &kinds[((seed >> 8) % kinds.len() as u64) as usize];
                n.set(&k, f.as_ref());
                match f {
                    Some(f) => d.frontends.insert(k, std::sync::Arc::new(f.clone())),
                    None => d.frontends.remove(&k),
                };
                assert_eq!(n.counts(), NoLocalEndpoints::of(&d).counts());
            }
        }
    }
}
