//! Stale backends: when an endpoint leaves a Service, destroy the connected
//! sockets that our hooks translated to it, so that clients fail fast
//! instead of sending into a black hole (kube-proxy only flushes UDP
//! conntrack; cilium#14844, calico#4509).
//!
//! - Only sockets our translation made: their cookie is in the socket
//!   rev-NAT map with that backend. A direct connection to a pod IP has no
//!   entry and is never touched.
//! - Only connected sockets: unconnected UDP sockets are left alone
//!   (cilium#48564); their next sendto picks a live backend.
//! - In every network namespace that has processes in the attached cgroup
//!   (the node's and each pod's, found through /proc/PID/ns/net), with
//!   netlink sock_diag SOCK_DESTROY.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use anyhow::{Context as _, Result};
use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP};
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_packet_sock_diag::{SockDiagDestroy, SockDiagMessage};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};

/// A (frontend, backend) pair: `vip:vport` translated to `backend:bport`.
pub type Pair = (IpAddr, u16, IpAddr, u16);

/// The socket cookies to destroy: sockets translated to a pair that
/// stopped serving. `entries` are the socket rev-NAT map's (cookie,
/// backend, bport, vip, vport); `left` the pairs whose backend left.
pub fn stale_cookies(entries: &[(u64, IpAddr, u16, IpAddr, u16)], left: &BTreeSet<Pair>) -> BTreeMap<u64, (IpAddr, u16)> {
    entries
        .iter()
        .filter(|(_, b, bp, v, vp)| left.contains(&(*v, *vp, *b, *bp)))
        .map(|(c, b, bp, _, _)| (*c, (*b, *bp)))
        .collect()
}

/// One process per network namespace with processes in `cgroup` (and the
/// cgroups below it).
pub fn netns_pids(cgroup: &Path) -> Vec<u32> {
    let mut pids = Vec::new();
    let mut dirs = vec![cgroup.to_path_buf()];
    while let Some(d) = dirs.pop() {
        if let Ok(s) = std::fs::read_to_string(d.join("cgroup.procs")) {
            pids.extend(s.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
        if let Ok(rd) = std::fs::read_dir(&d) {
            dirs.extend(rd.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
        }
    }
    let mut seen: HashMap<(u64, u64), u32> = HashMap::new();
    for pid in pids {
        if let Ok(md) = std::fs::metadata(format!("/proc/{pid}/ns/net")) {
            seen.entry((md.dev(), md.ino())).or_insert(pid);
        }
    }
    seen.into_values().collect()
}

fn send<T: netlink_packet_core::NetlinkSerializable + std::fmt::Debug>(sock: &Socket, flags: u16, payload: T) -> Result<()> {
    let mut hdr = NetlinkHeader::default();
    hdr.flags = flags;
    let mut msg = NetlinkMessage::new(hdr, NetlinkPayload::InnerMessage(payload));
    msg.finalize();
    let mut buf = vec![0; msg.buffer_len()];
    msg.serialize(&mut buf);
    sock.send(&buf, 0).context("sock_diag send")?;
    Ok(())
}

/// Connected TCP and UDP sockets whose cookie is in `targets`, in this netns.
fn find(sock: &Socket, targets: &BTreeMap<u64, (IpAddr, u16)>) -> Result<Vec<InetRequest>> {
    let mut found = Vec::new();
    for (family, proto) in [(AF_INET, IPPROTO_TCP), (AF_INET6, IPPROTO_TCP), (AF_INET, IPPROTO_UDP), (AF_INET6, IPPROTO_UDP)] {
        let id = if family == AF_INET { SocketId::new_v4() } else { SocketId::new_v6() };
        let req = InetRequest { family, protocol: proto, extensions: ExtensionFlags::empty(), states: StateFlags::all(), socket_id: id };
        send(sock, NLM_F_REQUEST | NLM_F_DUMP, SockDiagMessage::InetRequest(req))?;
        let mut buf = vec![0u8; 65536];
        'recv: loop {
            let n = sock.recv(&mut &mut buf[..], 0).context("sock_diag recv")?;
            let mut off = 0;
            while off < n {
                let msg = NetlinkMessage::<SockDiagMessage>::deserialize(&buf[off..n]).context("sock_diag parse")?;
                let len = msg.header.length as usize;
                match msg.payload {
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                        let h = &r.header;
                        let cookie = u64::from_ne_bytes(h.socket_id.cookie);
                        // UDP: connected sockets are ESTABLISHED (1);
                        // unconnected ones are CLOSE (7) and never touched.
                        // TCP: not LISTEN, TIME_WAIT or CLOSE.
                        let connected = if proto == IPPROTO_TCP { matches!(h.state, 1..=5 | 8 | 9 | 11) } else { h.state == 1 };
                        let dst_matches = targets.get(&cookie).is_some_and(|(b, bp)| {
                            let dst = match h.socket_id.destination_address {
                                IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
                                a => a,
                            };
                            dst == *b && h.socket_id.destination_port == *bp
                        });
                        if connected && dst_matches {
                            found.push(InetRequest {
                                family,
                                protocol: proto,
                                extensions: ExtensionFlags::empty(),
                                states: StateFlags::all(),
                                socket_id: h.socket_id.clone(),
                            });
                        }
                    }
                    NetlinkPayload::Done(_) => break 'recv,
                    NetlinkPayload::Error(e) => return Err(anyhow::anyhow!("sock_diag dump: {e:?}")),
                    _ => {}
                }
                if len == 0 {
                    break 'recv;
                }
                off += len;
            }
        }
    }
    Ok(found)
}

/// Destroy the sockets in this thread's netns; returns how many went.
fn destroy_here(targets: &BTreeMap<u64, (IpAddr, u16)>) -> Result<usize> {
    let mut sock = Socket::new(NETLINK_SOCK_DIAG).context("netlink sock_diag socket")?;
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    let found = find(&sock, targets)?;
    let mut n = 0;
    for req in found {
        send(&sock, NLM_F_REQUEST | NLM_F_ACK, SockDiagDestroy::new(SockDiagMessage::InetRequest(req)))?;
        let mut buf = vec![0u8; 4096];
        let len = sock.recv(&mut &mut buf[..], 0)?;
        let msg = NetlinkMessage::<SockDiagMessage>::deserialize(&buf[..len]).context("sock_diag ack")?;
        match msg.payload {
            NetlinkPayload::Error(e) if e.code.is_some() => {
                // ENOENT: it closed meanwhile.
                tracing::debug!("SOCK_DESTROY: {e:?}");
            }
            _ => n += 1,
        }
    }
    Ok(n)
}

/// Destroy the target sockets in every netns with processes in `cgroup`.
/// Each netns is entered on a thread of its own, which is then dropped.
pub fn destroy(cgroup: &Path, targets: &BTreeMap<u64, (IpAddr, u16)>) -> Result<usize> {
    if targets.is_empty() {
        return Ok(0);
    }
    let mut total = 0;
    for pid in netns_pids(cgroup) {
        let path = format!("/proc/{pid}/ns/net");
        let Ok(ns) = std::fs::File::open(&path) else { continue };
        let t = targets.clone();
        let r = std::thread::spawn(move || -> Result<usize> {
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
            destroy_here(&t)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("socket destroy thread panicked"))?;
        match r {
            Ok(n) => total += n,
            Err(e) => tracing::warn!("destroying stale sockets in the netns of pid {pid}: {e:#}"),
        }
    }
    Ok(total)
}

/// Destroys stale sockets on a thread of its own, off the path that
/// programs the maps: a sync hands it the pairs that stopped serving and
/// goes on.
pub struct Destroyer {
    tx: std::sync::mpsc::Sender<BTreeSet<Pair>>,
}

type SockMap<K, V> = aya::maps::HashMap<aya::maps::MapData, K, V>;

fn open_lru<K: aya::Pod, V: aya::Pod>(bpffs: &Path, name: &str) -> Result<SockMap<K, V>> {
    let data = aya::maps::MapData::from_pin(bpffs.join(name)).with_context(|| format!("open pinned map {name}"))?;
    Ok(aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data))?)
}

impl Destroyer {
    /// `destroyed` counts the sockets (the `lb_sockets_destroyed` metric).
    pub fn spawn(bpffs: &Path, cgroup: std::path::PathBuf, destroyed: prometheus_client::metrics::counter::Counter) -> Result<Self> {
        use lb_common::{SockRevNat4Key, SockRevNat4Value, SockRevNat6Key, SockRevNat6Value, maps};
        let mut s4: SockMap<SockRevNat4Key, SockRevNat4Value> = open_lru(bpffs, maps::SOCK_REVNAT4)?;
        let mut s6: SockMap<SockRevNat6Key, SockRevNat6Value> = open_lru(bpffs, maps::SOCK_REVNAT6)?;
        let (tx, rx) = std::sync::mpsc::channel::<BTreeSet<Pair>>();
        let counter = destroyed;
        std::thread::Builder::new().name("stale-sockets".into()).spawn(move || {
            while let Ok(mut left) = rx.recv() {
                // Everything queued, at once.
                while let Ok(more) = rx.try_recv() {
                    left.extend(more);
                }
                let entries: Vec<(u64, IpAddr, u16, IpAddr, u16)> = s4
                    .iter()
                    .filter_map(|r| r.ok())
                    .map(|(k, v)| (k.cookie, k.addr.into(), k.port, v.addr.into(), v.port))
                    .chain(s6.iter().filter_map(|r| r.ok()).map(|(k, v)| (k.cookie, k.addr.into(), k.port, v.addr.into(), v.port)))
                    .collect();
                let targets = stale_cookies(&entries, &left);
                if targets.is_empty() {
                    continue;
                }
                match destroy(&cgroup, &targets) {
                    Ok(n) => {
                        counter.inc_by(n as u64);
                        if n > 0 {
                            tracing::info!(sockets = n, "destroyed sockets connected to removed backends");
                        }
                    }
                    Err(e) => tracing::warn!("destroying stale sockets: {e:#}"),
                }
                // These sockets are gone (or were never connected): forget them.
                let k4: Vec<_> = s4.keys().filter_map(|k| k.ok()).filter(|k| targets.contains_key(&k.cookie)).collect();
                for k in k4 {
                    let _ = s4.remove(&k);
                }
                let k6: Vec<_> = s6.keys().filter_map(|k| k.ok()).filter(|k| targets.contains_key(&k.cookie)).collect();
                for k in k6 {
                    let _ = s6.remove(&k);
                }
            }
        })?;
        Ok(Self { tx })
    }

    /// Hand over pairs that stopped serving.
    pub fn update(&self, left: BTreeSet<Pair>) {
        let _ = self.tx.send(left);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sockets_to_pairs_that_left_are_stale() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let vip = ip("10.96.0.10");
        let entries = [
            (1, ip("10.0.0.1"), 8080, vip, 80), // backend left
            (2, ip("10.0.0.2"), 8080, vip, 80), // still serving
            (3, ip("10.0.0.2"), 8080, ip("10.96.0.11"), 80), // same backend, other frontend that dropped it
        ];
        let left: BTreeSet<Pair> = [(vip, 80, ip("10.0.0.1"), 8080), (ip("10.96.0.11"), 80, ip("10.0.0.2"), 8080)].into();
        let stale = stale_cookies(&entries, &left);
        assert_eq!(stale.keys().copied().collect::<Vec<_>>(), [1, 3]);
        assert_eq!(stale[&1], (ip("10.0.0.1"), 8080));
    }
}
