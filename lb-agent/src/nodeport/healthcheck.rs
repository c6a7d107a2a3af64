//! kube-proxy's health check servers, one per healthCheckNodePort of a
//! Service with externalTrafficPolicy Local: 200 with local endpoints while
//! the agent keeps its maps up to date, 503 otherwise (no local endpoint,
//! or a change waiting past `--healthz-stall-seconds`: the load balancer
//! should not rely on a node whose maps are stale), kube-proxy's JSON body
//! and headers.
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::extract::ConnectInfo;
use axum::http::{StatusCode, header};

use crate::health::Health;
use crate::model::HealthCheck;

/// A listener on `addr` alone.
fn listener_on(addr: IpAddr, port: u16) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let sa = SocketAddr::new(addr, port);
    let sock = Socket::new(Domain::for_address(sa), Type::STREAM, None)?;
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&sa.into())?;
    sock.listen(1024)?;
    Ok(sock.into())
}

/// One healthCheckNodePort's server: its state, and a task per listener,
/// by the address it listens on (None: every address).
struct Server {
    state: Arc<Mutex<HealthCheck>>,
    app: axum::Router,
    listeners: BTreeMap<Option<IpAddr>, tokio::task::JoinHandle<()>>,
}

/// The kube-proxy health check servers, one per healthCheckNodePort.
pub struct HealthChecks {
    servers: BTreeMap<u16, Server>,
    /// The listeners that could not be opened (healthCheckNodePort, the
    /// address; None: every address), with why: logged when they fail
    /// and when that changes, not at every sync while they stay failed.
    failed: BTreeMap<(u16, Option<IpAddr>), String>,
    /// The agent's own health: `serviceProxyHealthy`.
    health: Arc<Health>,
    /// Where the servers run: not the sync loop's thread.
    rt: tokio::runtime::Handle,
}

/// kube-proxy's answer (`service_health.go`): 200 when there are local
/// endpoints and the proxy is healthy (its `/livez` sense: the Node's
/// deletion does not count here), else 503; the count is the Service's
/// (for a dual-stack Service, that of the asking client's family, `v4`:
/// `HealthCheck::local_endpoints`).
fn hc_answer(hc: &HealthCheck, v4: bool, proxy_healthy: bool) -> (StatusCode, usize, String) {
    let n = hc.local_endpoints(v4);
    let body = serde_json::json!({
        "service": {"namespace": hc.service.namespace, "name": hc.service.name},
        "localEndpoints": n,
        "serviceProxyHealthy": proxy_healthy,
    });
    let code = if n > 0 && proxy_healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, n, body.to_string())
}

impl HealthChecks {
    /// Servers answering from `health`, run on `rt`.
    pub fn new(health: Arc<Health>, rt: tokio::runtime::Handle) -> Self {
        Self { servers: BTreeMap::new(), failed: BTreeMap::new(), health, rt }
    }

    /// How many listeners could not be opened at the last `reconcile`.
    pub fn failing(&self) -> usize {
        self.failed.len()
    }

    /// Serve exactly `want`, on the addresses `on` (None: all of them, as
    /// kube-proxy does without `--nodeport-addresses`; with it, where the
    /// NodePorts are): start, update and stop servers, and open and close
    /// listeners as addresses come and go (a listener that could not be
    /// opened is tried again at the next call).
    ///
    /// Returns how many listeners could not be opened.
    pub async fn reconcile(&mut self, want: &BTreeMap<u16, HealthCheck>, on: Option<&[IpAddr]>) -> usize {
        let keys: Vec<Option<IpAddr>> = match on {
            None => vec![None],
            Some(addrs) => addrs.iter().filter(|a| !a.is_loopback()).map(|a| Some(*a)).collect(),
        };
        // Listeners stopped here close on the side runtime's thread: waited
        // for (briefly) before anything binds again, so that an address
        // and port given up and wanted again in one call (an address that
        // comes back) is free.
        let mut stopped = Vec::new();
        self.servers.retain(|port, s| {
            let keep = want.contains_key(port);
            if !keep {
                for (_, task) in std::mem::take(&mut s.listeners) {
                    task.abort();
                    stopped.push(task);
                }
            }
            keep
        });
        for (port, hc) in want {
            let s = self.servers.entry(*port).or_insert_with(|| {
                let state = Arc::new(Mutex::new(hc.clone()));
                let (st, health) = (state.clone(), self.health.clone());
                let app = axum::Router::new().fallback(move |ConnectInfo(peer): ConnectInfo<SocketAddr>| {
                    let (s, health) = (st.clone(), health.clone());
                    async move {
                        let v4 = match peer.ip() {
                            IpAddr::V4(_) => true,
                            IpAddr::V6(a) => a.to_ipv4_mapped().is_some(),
                        };
                        let (code, n, body) = hc_answer(&s.lock().unwrap(), v4, health.report(crate::health::Probe::Livez).0);
                        let headers = [
                            (header::CONTENT_TYPE, "application/json".to_string()),
                            (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_string()),
                            (header::HeaderName::from_static("x-load-balancing-endpoint-weight"), n.to_string()),
                        ];
                        (code, headers, body)
                    }
                });
                Server { state, app, listeners: BTreeMap::new() }
            });
            *s.state.lock().unwrap() = hc.clone();
            for k in s.listeners.keys().filter(|k| !keys.contains(k)).copied().collect::<Vec<_>>() {
                if let Some(task) = s.listeners.remove(&k) {
                    task.abort();
                    stopped.push(task);
                }
            }
        }
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(1);
        for task in stopped {
            let _ = tokio::time::timeout_at(deadline, task).await;
        }
        for (port, hc) in want {
            let Some(s) = self.servers.get_mut(port) else { continue };
            for k in &keys {
                if s.listeners.contains_key(k) {
                    continue;
                }
                let l = match k {
                    None => crate::health::dual_stack_socket(*port),
                    Some(a) => listener_on(*a, *port),
                };
                // Registered with the side runtime's reactor, where it is
                // served.
                let l = l.and_then(|l| {
                    let _rt = self.rt.enter();
                    tokio::net::TcpListener::from_std(l)
                });
                let on = k.map_or("every address".to_string(), |a| a.to_string());
                match l {
                    Ok(l) => {
                        let app = s.app.clone();
                        let task = self.rt.spawn(async move {
                            let _ = axum::serve(l, app.into_make_service_with_connect_info::<SocketAddr>()).await;
                        });
                        s.listeners.insert(*k, task);
                        if self.failed.remove(&(*port, *k)).is_some() {
                            tracing::info!(service = %hc.service, "the health check is served on healthCheckNodePort {port} ({on}) now");
                        }
                    }
                    Err(e) => {
                        let why = e.to_string();
                        if self.failed.get(&(*port, *k)) != Some(&why) {
                            tracing::error!(service = %hc.service, "cannot serve the health check on healthCheckNodePort {port} ({on}): {why}; tried again at each sync, logged again when the error changes");
                        }
                        self.failed.insert((*port, *k), why);
                    }
                }
            }
        }
        // Failures of listeners no longer wanted are no failures.
        self.failed.retain(|(port, k), _| self.servers.get(port).is_some_and(|s| keys.contains(k) && !s.listeners.contains_key(k)));
        self.failed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ServiceRef;

    #[test]
    fn health_check_answer_is_kube_proxys() {
        let hc = HealthCheck { service: ServiceRef { namespace: "ns".into(), name: "web".into() }, local_v4: 2, local_v6: 1, single: None };
        let (code, n, body) = hc_answer(&hc, true, true);
        assert_eq!((code, n), (StatusCode::OK, 2));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v, serde_json::json!({"service": {"namespace": "ns", "name": "web"}, "localEndpoints": 2, "serviceProxyHealthy": true}));
        assert_eq!(hc_answer(&hc, false, true).1, 1, "the IPv6 proxier's count");
        assert_eq!(hc_answer(&HealthCheck { local_v4: 0, ..hc.clone() }, true, true).0, StatusCode::SERVICE_UNAVAILABLE);
        // Local endpoints, but the proxy is not keeping up: 503.
        let (code, n, body) = hc_answer(&hc, true, false);
        assert_eq!((code, n), (StatusCode::SERVICE_UNAVAILABLE, 2));
        assert_eq!(serde_json::from_str::<serde_json::Value>(&body).unwrap()["serviceProxyHealthy"], false);
    }

    /// Over HTTP on loopback: the answer follows the agent's health (a
    /// change waiting past the stall limit turns it 503) and carries
    /// kube-proxy's headers.
    #[tokio::test]
    async fn the_server_answers_with_the_agents_health() {
        let health = Arc::new(Health::new(std::time::Duration::from_millis(200)));
        health.synced(std::time::Instant::now(), &["IPv4"]);
        let mut hcs = HealthChecks::new(health.clone(), tokio::runtime::Handle::current());
        // A free port on loopback.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let hc = HealthCheck { service: ServiceRef { namespace: "ns".into(), name: "web".into() }, local_v4: 3, local_v6: 0, single: Some(true) };
        assert_eq!(hcs.reconcile(&[(port, hc)].into(), None).await, 0);
        let get = || async move {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
            let mut out = String::new();
            c.read_to_string(&mut out).await.unwrap();
            out.to_ascii_lowercase()
        };
        let r = get().await;
        assert!(r.starts_with("http/1.1 200"), "{r}");
        assert!(r.contains("x-load-balancing-endpoint-weight: 3") && r.contains("x-content-type-options: nosniff"), "{r}");
        assert!(r.contains("\"serviceproxyhealthy\":true"), "{r}");
        // A change the agent has not programmed for longer than the limit.
        health.changed(std::time::Instant::now() - std::time::Duration::from_secs(1));
        let r = get().await;
        assert!(r.starts_with("http/1.1 503") && r.contains("\"serviceproxyhealthy\":false") && r.contains("\"localendpoints\":3"), "{r}");
        health.synced(std::time::Instant::now(), &["IPv4"]);
        assert!(get().await.starts_with("http/1.1 200"));
        // The Node being deleted fails /healthz, not the health check.
        health.node_deleting(true);
        assert!(get().await.starts_with("http/1.1 200"));
    }
}
