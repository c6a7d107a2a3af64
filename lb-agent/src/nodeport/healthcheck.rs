//! kube-proxy's health check servers, one per healthCheckNodePort of a
//! Service with externalTrafficPolicy Local: 200 with local endpoints, 503
//! without, kube-proxy's JSON body.
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::http::{StatusCode, header};

use crate::model::HealthCheck;

/// A listener on every address of both families (`[::]` with IPV6_V6ONLY
/// off, whatever net.ipv6.bindv6only says); IPv4 alone where the node has
/// no IPv6.
fn dual_stack_listener(port: u16) -> std::io::Result<tokio::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let (sock, addr) = match Socket::new(Domain::IPV6, Type::STREAM, None) {
        Ok(s) => {
            s.set_only_v6(false)?;
            (s, SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)))
        }
        Err(_) => (Socket::new(Domain::IPV4, Type::STREAM, None)?, SocketAddr::from(([0, 0, 0, 0], port))),
    };
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(1024)?;
    tokio::net::TcpListener::from_std(sock.into())
}

/// A listener on `addr` alone.
fn listener_on(addr: IpAddr, port: u16) -> std::io::Result<tokio::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let sa = SocketAddr::new(addr, port);
    let sock = Socket::new(Domain::for_address(sa), Type::STREAM, None)?;
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&sa.into())?;
    sock.listen(1024)?;
    tokio::net::TcpListener::from_std(sock.into())
}

/// One healthCheckNodePort's server: its state, and a task per listener,
/// by the address it listens on (None: every address).
struct Server {
    state: Arc<Mutex<HealthCheck>>,
    app: axum::Router,
    listeners: BTreeMap<Option<IpAddr>, tokio::task::JoinHandle<()>>,
}

/// The kube-proxy health check servers, one per healthCheckNodePort.
#[derive(Default)]
pub struct HealthChecks {
    servers: BTreeMap<u16, Server>,
    /// The listeners that could not be opened (healthCheckNodePort, the
    /// address; None: every address), with why: logged when they fail
    /// and when that changes, not at every sync while they stay failed.
    failed: BTreeMap<(u16, Option<IpAddr>), String>,
}

fn hc_body(hc: &HealthCheck) -> (StatusCode, String) {
    let body = serde_json::json!({
        "service": {"namespace": hc.service.namespace, "name": hc.service.name},
        "localEndpoints": hc.local_endpoints,
        "serviceProxyHealthy": true,
    });
    let code = if hc.local_endpoints > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, body.to_string())
}

impl HealthChecks {
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
        self.servers.retain(|port, s| {
            let keep = want.contains_key(port);
            if !keep {
                s.listeners.values().for_each(tokio::task::JoinHandle::abort);
            }
            keep
        });
        for (port, hc) in want {
            let s = self.servers.entry(*port).or_insert_with(|| {
                let state = Arc::new(Mutex::new(hc.clone()));
                let st = state.clone();
                let app = axum::Router::new().fallback(move || {
                    let s = st.clone();
                    async move {
                        let (code, body) = hc_body(&s.lock().unwrap());
                        (code, [(header::CONTENT_TYPE, "application/json")], body)
                    }
                });
                Server { state, app, listeners: BTreeMap::new() }
            });
            *s.state.lock().unwrap() = hc.clone();
            s.listeners.retain(|k, task| {
                let keep = keys.contains(k);
                if !keep {
                    task.abort();
                }
                keep
            });
            for k in &keys {
                if s.listeners.contains_key(k) {
                    continue;
                }
                let l = match k {
                    None => dual_stack_listener(*port),
                    Some(a) => listener_on(*a, *port),
                };
                let on = k.map_or("every address".to_string(), |a| a.to_string());
                match l {
                    Ok(l) => {
                        let app = s.app.clone();
                        let task = tokio::spawn(async move {
                            let _ = axum::serve(l, app).await;
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
    fn health_check_body_is_kube_proxys() {
        let hc = HealthCheck { service: ServiceRef { namespace: "ns".into(), name: "web".into() }, local_endpoints: 2 };
        let (code, body) = hc_body(&hc);
        assert_eq!(code, StatusCode::OK);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v, serde_json::json!({"service": {"namespace": "ns", "name": "web"}, "localEndpoints": 2, "serviceProxyHealthy": true}));
        assert_eq!(hc_body(&HealthCheck { local_endpoints: 0, ..hc }).0, StatusCode::SERVICE_UNAVAILABLE);
    }
}
