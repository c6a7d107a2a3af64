//! The agent's side of NodePort, LoadBalancer IPs and externalIPs: the
//! node's addresses and interfaces, the NAT table's expiry, kube-proxy's
//! health checks for externalTrafficPolicy Local, and keeping NodePorts
//! away from local ephemeral ports.
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use aya::maps::{HashMap, MapData};
use axum::http::{StatusCode, header};
use lb_common::{NatEntry, NatKey, PROTO_UDP, nat_flags, nat_state};

use crate::dataplane::writer::Addr;
use crate::model::{HealthCheck, Pair};

/// The global addresses on this netns' interfaces, with the interface.
pub fn interface_addrs() -> Vec<(String, IpAddr)> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else { return Vec::new() };
    addrs
        .filter_map(|ifa| {
            let sa = ifa.address?;
            let ip = if let Some(v4) = sa.as_sockaddr_in() {
                IpAddr::V4(v4.ip())
            } else if let Some(v6) = sa.as_sockaddr_in6() {
                IpAddr::V6(v6.ip())
            } else {
                return None;
            };
            let global = match ip {
                IpAddr::V4(a) => !a.is_loopback() && !a.is_link_local(),
                IpAddr::V6(a) => !a.is_loopback() && !a.is_unicast_link_local(),
            };
            global.then_some((ifa.interface_name, ip))
        })
        .collect()
}

/// The devices the TC programs go on for a node with addresses `addrs`
/// (see `netdev::nodeport_devices`). Without rtnetlink: the devices that
/// hold `addrs`.
pub fn interfaces_for(addrs: &[IpAddr]) -> Vec<String> {
    let held = interface_addrs();
    match crate::netdev::links() {
        Ok(links) => crate::netdev::nodeport_devices(&links, &held, addrs),
        Err(e) => {
            tracing::warn!("cannot list network devices ({e:#}); NodePort programs go only where the node's addresses are");
            let mut v: Vec<String> = held.into_iter().filter(|(_, a)| addrs.contains(a)).map(|(i, _)| i).collect();
            v.sort();
            v.dedup();
            v
        }
    }
}

/// This network namespace's cookie (SO_NETNS_COOKIE).
pub fn netns_cookie() -> Result<u64> {
    use std::os::fd::AsRawFd as _;
    let s = std::net::UdpSocket::bind("127.0.0.1:0").or_else(|_| std::net::UdpSocket::bind("[::1]:0")).context("socket for SO_NETNS_COOKIE")?;
    let mut cookie: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: valid fd and out buffer of the right size.
    let rc = unsafe {
        libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_NETNS_COOKIE, (&mut cookie as *mut u64).cast(), &mut len)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("getsockopt SO_NETNS_COOKIE (kernel 5.14+)");
    }
    Ok(cookie)
}

/// Keep the NodePort range out of the ephemeral ports the kernel hands out
/// in this netns (ip_local_reserved_ports), so an outgoing connection never
/// takes a NodePort. Explicit bind()s are refused by the post_bind hook.
pub fn reserve_ports(min: u16, max: u16, bpffs: &std::path::Path) -> Result<()> {
    let current = std::fs::read_to_string(RESERVED).with_context(|| format!("read {RESERVED}"))?;
    let range = format!("{min}-{max}");
    if current.split(',').any(|r| r.trim() == range) {
        return Ok(());
    }
    let new = if current.trim().is_empty() { range.clone() } else { format!("{},{range}", current.trim()) };
    std::fs::write(RESERVED, &new).with_context(|| format!("write {RESERVED}"))?;
    // Remember that lb added it, and in which netns (a directory in the pin
    // dir: bpffs holds nothing else), so that teardown takes out exactly
    // that, and only there.
    let marker = bpffs.join(format!("{RESERVED_MARKER}{}_{range}", netns_cookie()?));
    if let Err(e) = std::fs::create_dir_all(&marker) {
        tracing::warn!("cannot record {}: {e}; teardown will leave {range} in {RESERVED}", marker.display());
    }
    Ok(())
}

const RESERVED: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";
/// The pin-dir entry that records a range lb added to ip_local_reserved_ports.
pub const RESERVED_MARKER: &str = "reserved_ports_";

/// Take out the reserved port ranges this agent added (teardown): each has
/// a marker in `bpffs`, removed with it. The sysctl is per network
/// namespace: run in the node's.
pub fn unreserve_ports(bpffs: &std::path::Path) -> Result<()> {
    let Ok(rd) = std::fs::read_dir(bpffs) else { return Ok(()) };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((cookie, range)) = name.strip_prefix(RESERVED_MARKER).and_then(|r| r.split_once('_')) else { continue };
        if cookie != netns_cookie()?.to_string() {
            tracing::warn!("{range} was reserved in another network namespace: run teardown in the node's to take it out of {RESERVED}");
            std::fs::remove_dir(e.path()).with_context(|| format!("remove {}", e.path().display()))?;
            continue;
        }
        let current = std::fs::read_to_string(RESERVED).with_context(|| format!("read {RESERVED}"))?;
        let kept: Vec<&str> = current.trim().split(',').map(str::trim).filter(|r| !r.is_empty() && *r != range).collect();
        // The kernel refuses an empty write; a lone newline clears the list.
        let new = if kept.is_empty() { "\n".to_string() } else { kept.join(",") };
        std::fs::write(RESERVED, &new).with_context(|| format!("write {RESERVED}"))?;
        std::fs::remove_dir(e.path()).with_context(|| format!("remove {}", e.path().display()))?;
    }
    Ok(())
}

/// How long NAT entries live.
#[derive(Clone, Copy, Debug)]
pub struct NatTimeouts {
    /// An established TCP flow without packets.
    pub tcp: Duration,
    /// A TCP flow after FIN in both directions or a RST.
    pub tcp_closed: Duration,
    /// A UDP flow without packets.
    pub udp: Duration,
    /// A flow that was never answered (a SYN flood, a dead backend).
    pub unreplied: Duration,
}

/// Whether a flow (its original-direction entry and its reply entry, when
/// there is one) has expired at `now_ns` (CLOCK_MONOTONIC, as bpf_ktime_get_ns).
pub fn expired<A>(proto: u8, fwd: &NatEntry<A>, reply: Option<&NatEntry<A>>, now_ns: u64, t: &NatTimeouts) -> bool {
    let last = reply.map_or(fwd.last_seen_ns, |r| r.last_seen_ns.max(fwd.last_seen_ns));
    let idle = Duration::from_nanos(now_ns.saturating_sub(last));
    // Assured, in conntrack's words: answered, and for TCP the client went
    // on after its SYN (the handshake's ACK). A SYN flood from spoofed
    // addresses, answered by the backend, never gets there and expires
    // like an unanswered one.
    let replied = reply.is_some_and(|r| r.state & nat_state::SEEN != 0) && (proto == PROTO_UDP || fwd.state & nat_state::SEEN != 0);
    let mut timeout = if proto == PROTO_UDP {
        t.udp
    } else {
        let rst = fwd.state & nat_state::RST != 0 || reply.is_some_and(|r| r.state & nat_state::RST != 0);
        let fin_both = fwd.state & nat_state::FIN != 0 && reply.is_some_and(|r| r.state & nat_state::FIN != 0);
        if rst || fin_both { t.tcp_closed } else { t.tcp }
    };
    if !replied {
        timeout = timeout.min(t.unreplied);
    }
    idle > timeout
}

pub fn monotonic_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC");
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

/// bpf(2)'s BPF_EXIST: update only an element that exists.
const BPF_EXIST: u64 = 2;

/// What one pass over a NAT table did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NatPass {
    /// Flows removed because they expired.
    pub expired: usize,
    /// UDP flows to a backend that left, removed (the next datagram picks
    /// a live backend).
    pub flushed: usize,
    /// TCP flows to a backend that left, marked STALE (the next packet
    /// gets a RST).
    pub marked: usize,
}

/// One pass over a NAT table: expire flows (both entries of each), and end
/// flows to the (frontend, backend) pairs in `left`.
pub fn nat_pass<A: Addr>(nat: &mut HashMap<MapData, NatKey<A>, NatEntry<A>>, t: &NatTimeouts, left: &BTreeSet<Pair>) -> NatPass
where
    NatKey<A>: aya::Pod,
    NatEntry<A>: aya::Pod,
{
    let now = monotonic_ns();
    // In batches: at capacity this is half a million entries.
    let entries: BTreeMap<NatKey<A>, NatEntry<A>> = match crate::dataplane::maps::lookup_all(aya::maps::IterableMap::map(nat)) {
        Ok(all) => all.into_iter().collect(),
        Err(e) => {
            tracing::debug!("NAT batch lookup: {e}; iterating");
            nat.iter().filter_map(|r| r.ok()).collect()
        }
    };
    let mut pass = NatPass::default();
    for (k, e) in &entries {
        if e.flags & nat_flags::REPLY != 0 {
            // An orphaned reply entry (its flow half-removed): no packet can
            // use it once idle.
            if !entries.contains_key(&e.other_key(k.proto)) && expired(k.proto, e, None, now, t) {
                let _ = nat.remove(k);
            }
            continue;
        }
        let rk = e.other_key(k.proto);
        if expired(k.proto, e, entries.get(&rk), now, t) {
            // The reply entry first: a packet never finds a forward entry
            // without its reply entry.
            let _ = nat.remove(&rk);
            let _ = nat.remove(k);
            pass.expired += 1;
            continue;
        }
        if !left.is_empty() && left.contains(&(k.daddr.to_ip(), k.dport, e.to_daddr.to_ip(), e.to_dport)) {
            if k.proto == PROTO_UDP {
                let _ = nat.remove(&rk);
                let _ = nat.remove(k);
                pass.flushed += 1;
            } else if e.state & nat_state::STALE == 0 {
                let mut marked = *e;
                marked.state |= nat_state::STALE;
                // Only if the flow is still there (BPF_EXIST): never revive it.
                if nat.insert(k, marked, BPF_EXIST).is_ok() {
                    pass.marked += 1;
                }
            }
        }
    }
    pass
}

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
    use lb_common::PROTO_TCP;

    const T: NatTimeouts = NatTimeouts {
        tcp: Duration::from_secs(100),
        tcp_closed: Duration::from_secs(10),
        udp: Duration::from_secs(30),
        unreplied: Duration::from_secs(60),
    };
    const S: u64 = 1_000_000_000;
    const SEEN: u8 = nat_state::SEEN;

    fn entry(last: u64, state: u8) -> NatEntry<[u8; 4]> {
        NatEntry { last_seen_ns: last * S, state, ..Default::default() }
    }

    #[test]
    fn expiry_rules() {
        // UDP: idle timeout.
        assert!(!expired(PROTO_UDP, &entry(100, 0), Some(&entry(100, SEEN)), 129 * S, &T));
        assert!(expired(PROTO_UDP, &entry(100, 0), Some(&entry(100, SEEN)), 131 * S, &T));
        // The newest of both directions counts.
        assert!(!expired(PROTO_UDP, &entry(10, 0), Some(&entry(100, SEEN)), 129 * S, &T));
        // TCP open: the long timeout; FIN one way only is still open.
        assert!(!expired(PROTO_TCP, &entry(100, SEEN | nat_state::FIN), Some(&entry(100, SEEN)), 150 * S, &T));
        assert!(expired(PROTO_TCP, &entry(100, SEEN), Some(&entry(100, SEEN)), 201 * S, &T));
        // FIN both ways, or a RST: the close grace period.
        assert!(expired(PROTO_TCP, &entry(100, nat_state::FIN), Some(&entry(100, SEEN | nat_state::FIN)), 111 * S, &T));
        assert!(!expired(PROTO_TCP, &entry(100, nat_state::FIN), Some(&entry(100, SEEN | nat_state::FIN)), 109 * S, &T));
        assert!(expired(PROTO_TCP, &entry(100, 0), Some(&entry(100, SEEN | nat_state::RST)), 111 * S, &T));
    }

    #[test]
    fn unreplied_flows_expire_after_the_unreplied_timeout() {
        // A SYN that was never answered: gone after 60 s, not 100.
        assert!(!expired(PROTO_TCP, &entry(100, 0), Some(&entry(100, 0)), 159 * S, &T));
        assert!(expired(PROTO_TCP, &entry(100, 0), Some(&entry(100, 0)), 161 * S, &T));
        // Answered, and the client went on: the established timeout.
        assert!(!expired(PROTO_TCP, &entry(100, SEEN), Some(&entry(100, SEEN)), 161 * S, &T));
        // Answered, but the client never sent its ACK (a spoofed SYN): unreplied.
        assert!(expired(PROTO_TCP, &entry(100, 0), Some(&entry(100, SEEN)), 161 * S, &T));
        // UDP: an answer is enough.
        assert!(!expired(PROTO_UDP, &entry(100, 0), Some(&entry(100, SEEN)), 129 * S, &T));
        // Never shorter than the UDP timeout when that is shorter.
        assert!(expired(PROTO_UDP, &entry(100, 0), Some(&entry(100, 0)), 131 * S, &T));
        // A forward entry whose reply entry is gone counts as unreplied.
        assert!(expired(PROTO_TCP, &entry(100, 0), None, 161 * S, &T));
    }

    #[test]
    fn other_key_swaps_the_rewritten_tuple() {
        let k = NatKey { saddr: [1u8, 1, 1, 1], daddr: [2, 2, 2, 2], sport: 1000, dport: 30080, proto: 6, _pad: [0; 3] };
        let e = NatEntry { to_saddr: [3, 3, 3, 3], to_daddr: [4, 4, 4, 4], to_sport: 61000, to_dport: 8080, ..Default::default() };
        let r = e.other_key(k.proto);
        assert_eq!((r.saddr, r.daddr, r.sport, r.dport, r.proto), ([4, 4, 4, 4], [3, 3, 3, 3], 8080, 61000, 6));
    }

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
