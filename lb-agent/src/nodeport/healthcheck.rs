//! kube-proxy's health check servers, one per healthCheckNodePort of a
//! Service with externalTrafficPolicy Local: 200 with local endpoints, 503
//! without, kube-proxy's JSON body.
use std::collections::BTreeMap;
use std::net::SocketAddr;
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

/// The kube-proxy health check servers, one per healthCheckNodePort.
#[derive(Default)]
pub struct HealthChecks {
    servers: BTreeMap<u16, (Arc<Mutex<HealthCheck>>, tokio::task::JoinHandle<()>)>,
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
    /// Serve exactly `want`: start, update and stop servers.
    pub async fn reconcile(&mut self, want: &BTreeMap<u16, HealthCheck>) {
        self.servers.retain(|port, (_, task)| {
            let keep = want.contains_key(port);
            if !keep {
                task.abort();
            }
            keep
        });
        for (port, hc) in want {
            if let Some((state, _)) = self.servers.get(port) {
                *state.lock().unwrap() = hc.clone();
                continue;
            }
            let l = match dual_stack_listener(*port) {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(service = %hc.service, "cannot serve the health check on healthCheckNodePort {port}: {e}");
                    continue;
                }
            };
            let state = Arc::new(Mutex::new(hc.clone()));
            let s = state.clone();
            let app = axum::Router::new().fallback(move || {
                let s = s.clone();
                async move {
                    let (code, body) = hc_body(&s.lock().unwrap());
                    (code, [(header::CONTENT_TYPE, "application/json")], body)
                }
            });
            let task = tokio::spawn(async move {
                let _ = axum::serve(l, app).await;
            });
            self.servers.insert(*port, (state, task));
        }
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
