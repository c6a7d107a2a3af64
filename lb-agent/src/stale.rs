//! Stale backends: when an endpoint leaves a Service, destroy the connected
//! sockets that our hooks translated to it, so that clients fail fast
//! instead of sending into a black hole (kube-proxy only flushes UDP
//! conntrack; cilium#14844, calico#4509).
//!
//! - Only sockets our translation made: connect4/6 left the translation in
//!   the socket's own storage (`LB_SOCK_XLATE`), which sock_diag returns
//!   with each TCP socket (INET_DIAG_REQ_SK_BPF_STORAGES). The kernel fills
//!   storage only into TCP dumps, so connected UDP sockets (and sockets
//!   translated before the storage existed) are found in the socket rev-NAT
//!   LRU by cookie. A direct connection to a pod IP has neither and is never
//!   touched.
//! - Only connected sockets: unconnected UDP sockets are left alone
//!   (cilium#48564); their next sendto picks a live backend.
//! - In every network namespace that has processes in the attached cgroup
//!   (the node's and each pod's, found through /proc/PID/ns/net), with
//!   netlink sock_diag SOCK_DESTROY.
//! - Cheap whatever the traffic: the kernel lists only connected sockets
//!   (not the TIME_WAIT ones a busy client leaves by the thousand), and the
//!   socket rev-NAT map is looked up per candidate, never walked. A sweep
//!   after a full sync (endpoints removed while no agent ran) lists every
//!   connected socket once, with its storage.
use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use anyhow::{Context as _, Result};
use netlink_packet_core::{
    Emitable as _, NLA_F_NESTED, NLA_TYPE_MASK, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
    NetlinkSerializable, Nla as _, NlasIterator,
};
use netlink_packet_sock_diag::inet::nlas::Nla as InetNla;
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP};
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_packet_sock_diag::{SockDiagDestroy, SockDiagMessage};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};

/// A (frontend, backend) pair: `vip:vport` translated to `backend:bport`.
pub type Pair = (IpAddr, u16, IpAddr, u16);

/// A connected socket (named by `T`), its peer address and port, and the
/// frontend our hook translated it from (None: not ours).
pub type Candidate<T> = (T, IpAddr, u16, Option<(IpAddr, u16)>);

/// The candidates to destroy: connected sockets whose peer is a backend
/// that left, with the frontend our hook translated them from (None: the
/// socket-LB did not make this connection). Only those translated from a
/// frontend that this backend left are stale.
pub fn stale<T: Copy>(candidates: &[Candidate<T>], left: &BTreeSet<Pair>) -> Vec<T> {
    candidates
        .iter()
        .filter(|(_, b, bp, from)| from.is_some_and(|(v, vp)| left.contains(&(v, vp, *b, *bp))))
        .map(|(t, ..)| *t)
        .collect()
}

/// One process per network namespace with processes in `cgroup` (and the
/// cgroups below it).
pub fn netns_pids(cgroup: &Path) -> Vec<u32> {
    scan(cgroup).0
}

/// `netns_pids`, and how many of the cgroup's processes the agent cannot
/// see: in a PID namespace of its own (a container without hostPID),
/// `cgroup.procs` lists other namespaces' processes as 0 and /proc has no
/// entry for them, so no pod's sockets could ever be found.
pub fn scan(cgroup: &Path) -> (Vec<u32>, usize) {
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
    let mut invisible = 0;
    for pid in pids {
        match std::fs::metadata(format!("/proc/{pid}/ns/net")) {
            Ok(md) => {
                seen.entry((md.dev(), md.ino())).or_insert(pid);
            }
            Err(_) => invisible += 1,
        }
    }
    (seen.into_values().collect(), invisible)
}

/// Say loudly when the agent cannot see the processes of its cgroup (see
/// `scan`): stale sockets would never be destroyed, silently.
fn check_visibility(cgroup: &Path, gauge: &prometheus_client::metrics::gauge::Gauge, logged: &mut bool) {
    let (visible, invisible) = scan(cgroup);
    gauge.set(invisible as i64);
    let blind = visible.is_empty() && invisible > 0;
    if blind && !*logged {
        tracing::error!(
            cgroup = %cgroup.display(),
            processes = invisible,
            "cannot see the processes of the cgroup (the agent runs in a PID namespace of its own?): sockets to endpoints \
             that leave cannot be destroyed; run the agent with hostPID: true (the DaemonSet in deploy/ does)"
        );
    }
    *logged = blind;
}

/// One netlink request on `sock` (sock_diag here, rtnetlink in netdev).
pub fn send<T: netlink_packet_core::NetlinkSerializable + std::fmt::Debug>(sock: &Socket, flags: u16, payload: T) -> Result<()> {
    let mut hdr = NetlinkHeader::default();
    hdr.flags = flags;
    let mut msg = NetlinkMessage::new(hdr, NetlinkPayload::InnerMessage(payload));
    msg.finalize();
    let mut buf = vec![0; msg.buffer_len()];
    msg.serialize(&mut buf);
    sock.send(&buf, 0).context("netlink send")?;
    Ok(())
}

/// A connected socket, as sock_diag names it.
struct Conn {
    req: InetRequest,
    cookie: u64,
    /// The peer, an IPv4-mapped address as IPv4.
    peer: IpAddr,
    port: u16,
    /// The translation in the socket's storage, if connect4/6 made one.
    xlate: Option<lb_common::SockXlate>,
}

// sock_diag's BPF socket storage attributes (linux/inet_diag.h,
// linux/sock_diag.h), which netlink-packet-sock-diag does not model.
const INET_DIAG_REQ_SK_BPF_STORAGES: u16 = 2;
const SK_DIAG_BPF_STORAGE_REQ_MAP_FD: u16 = 1;
const INET_DIAG_SK_BPF_STORAGES: u16 = 20;
const SK_DIAG_BPF_STORAGE: u16 = 1;
const SK_DIAG_BPF_STORAGE_MAP_VALUE: u16 = 3;

/// A dump request that also asks for each socket's value in one socket
/// storage map.
#[derive(Debug)]
struct DumpWithStorage {
    req: InetRequest,
    map_fd: u32,
}

impl NetlinkSerializable for DumpWithStorage {
    fn message_type(&self) -> u16 {
        netlink_packet_sock_diag::constants::SOCK_DIAG_BY_FAMILY
    }
    fn buffer_len(&self) -> usize {
        self.req.buffer_len() + 4 + 8
    }
    fn serialize(&self, buf: &mut [u8]) {
        let n = self.req.buffer_len();
        self.req.emit(&mut buf[..n]);
        // One nested attribute holding one map fd.
        let attr = &mut buf[n..];
        attr[0..2].copy_from_slice(&12u16.to_ne_bytes());
        attr[2..4].copy_from_slice(&(INET_DIAG_REQ_SK_BPF_STORAGES | NLA_F_NESTED).to_ne_bytes());
        attr[4..6].copy_from_slice(&8u16.to_ne_bytes());
        attr[6..8].copy_from_slice(&SK_DIAG_BPF_STORAGE_REQ_MAP_FD.to_ne_bytes());
        attr[8..12].copy_from_slice(&self.map_fd.to_ne_bytes());
    }
}

/// The socket's value in the storage map the dump asked for.
fn storage_value(nlas: &[InetNla]) -> Option<lb_common::SockXlate> {
    let outer = nlas.iter().find_map(|n| match n {
        InetNla::Other(a) if a.kind() & NLA_TYPE_MASK == INET_DIAG_SK_BPF_STORAGES => {
            let mut v = vec![0u8; a.value_len()];
            a.emit_value(&mut v);
            Some(v)
        }
        _ => None,
    })?;
    for stg in NlasIterator::new(&outer[..]).flatten() {
        if stg.kind() & NLA_TYPE_MASK != SK_DIAG_BPF_STORAGE {
            continue;
        }
        for f in NlasIterator::new(stg.value()).flatten() {
            if f.kind() & NLA_TYPE_MASK == SK_DIAG_BPF_STORAGE_MAP_VALUE {
                let v = f.value();
                if v.len() >= size_of::<lb_common::SockXlate>() {
                    // SAFETY: SockXlate is plain old data; the read is unaligned.
                    return Some(unsafe { std::ptr::read_unaligned(v.as_ptr().cast()) });
                }
            }
        }
    }
    None
}

/// The frontend of a socket's stored translation, if it was translated to
/// the peer it has now (a UDP socket may connect again, elsewhere).
fn xlate_pair(x: &lb_common::SockXlate, peer: IpAddr, port: u16) -> Option<(IpAddr, u16)> {
    let (front, backend) = match x.family {
        lb_common::FAMILY_V4 => {
            let v4 = |a: &[u8; 16]| IpAddr::from([a[0], a[1], a[2], a[3]]);
            (v4(&x.front), v4(&x.backend))
        }
        lb_common::FAMILY_V6 => (IpAddr::from(x.front), IpAddr::from(x.backend)),
        _ => return None,
    };
    (backend == peer && x.backend_port == port).then_some((front, x.front_port))
}

/// The connected TCP and UDP sockets of `sock`'s netns whose peer is in
/// `peers` (all of them: None), each with its storage in map `storage`.
/// The kernel leaves out listening, TIME_WAIT and closed sockets (for UDP:
/// unconnected ones, which are CLOSE, and never touched).
fn connected_to(sock: &Socket, peers: Option<&BTreeSet<(IpAddr, u16)>>, storage: std::os::fd::BorrowedFd<'_>) -> Result<Vec<Conn>> {
    use std::os::fd::AsRawFd as _;
    let tcp = StateFlags::ESTABLISHED
        | StateFlags::SYN_SENT
        | StateFlags::SYN_RECV
        | StateFlags::FIN_WAIT1
        | StateFlags::FIN_WAIT2
        | StateFlags::CLOSE_WAIT
        | StateFlags::LAST_ACK
        | StateFlags::CLOSING;
    let mut found = Vec::new();
    for (family, proto) in [(AF_INET, IPPROTO_TCP), (AF_INET6, IPPROTO_TCP), (AF_INET, IPPROTO_UDP), (AF_INET6, IPPROTO_UDP)] {
        let id = if family == AF_INET { SocketId::new_v4() } else { SocketId::new_v6() };
        let states = if proto == IPPROTO_TCP { StateFlags::from_bits_truncate(tcp.bits()) } else { StateFlags::ESTABLISHED };
        let req = InetRequest { family, protocol: proto, extensions: ExtensionFlags::empty(), states, socket_id: id };
        send(sock, NLM_F_REQUEST | NLM_F_DUMP, DumpWithStorage { req, map_fd: storage.as_raw_fd() as u32 })?;
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
                        let peer = match h.socket_id.destination_address {
                            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
                            a => a,
                        };
                        let port = h.socket_id.destination_port;
                        if peers.is_none_or(|p| p.contains(&(peer, port))) {
                            found.push(Conn {
                                xlate: storage_value(&r.nlas),
                                req: InetRequest {
                                    family,
                                    protocol: proto,
                                    extensions: ExtensionFlags::empty(),
                                    states: StateFlags::all(),
                                    socket_id: h.socket_id.clone(),
                                },
                                cookie: u64::from_ne_bytes(h.socket_id.cookie),
                                peer,
                                port,
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

/// Destroy one socket; false when it had closed meanwhile.
fn destroy_one(sock: &Socket, req: InetRequest) -> Result<bool> {
    send(sock, NLM_F_REQUEST | NLM_F_ACK, SockDiagDestroy::new(SockDiagMessage::InetRequest(req)))?;
    let mut buf = vec![0u8; 4096];
    let len = sock.recv(&mut &mut buf[..], 0)?;
    let msg = NetlinkMessage::<SockDiagMessage>::deserialize(&buf[..len]).context("sock_diag ack")?;
    match msg.payload {
        NetlinkPayload::Error(e) if e.code.is_some() => {
            // ENOENT: it closed meanwhile.
            tracing::debug!("SOCK_DESTROY: {e:?}");
            Ok(false)
        }
        _ => Ok(true),
    }
}

/// A sock_diag socket in every netns with processes in `cgroup`: a netlink
/// socket stays in the netns it was made in, so each is made on a thread
/// that enters the netns and is then dropped.
fn netns_sockets(cgroup: &Path) -> Vec<(u32, Socket)> {
    let mut out = Vec::new();
    for pid in netns_pids(cgroup) {
        let Ok(ns) = std::fs::File::open(format!("/proc/{pid}/ns/net")) else { continue };
        let made = std::thread::spawn(move || -> Result<Socket> {
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
            let mut sock = Socket::new(NETLINK_SOCK_DIAG).context("netlink sock_diag socket")?;
            sock.bind_auto()?;
            sock.connect(&SocketAddr::new(0, 0))?;
            Ok(sock)
        })
        .join();
        match made {
            Ok(Ok(sock)) => out.push((pid, sock)),
            Ok(Err(e)) => tracing::warn!("stale sockets: the netns of pid {pid}: {e:#}"),
            Err(_) => tracing::warn!("stale sockets: the netns of pid {pid}: thread panicked"),
        }
    }
    out
}

/// Destroys stale sockets on a thread of its own, off the path that
/// programs the maps: a sync hands it the pairs that stopped serving and
/// goes on.
pub struct Destroyer {
    tx: std::sync::mpsc::Sender<Work>,
}

/// What the destroyer is handed.
enum Work {
    /// Pairs that stopped serving.
    Left(BTreeSet<Pair>),
    /// Every frontend after a full sync: any translated socket to a pair
    /// none of them serves is stale (an endpoint removed while no agent
    /// ran, say).
    Sweep(Vec<(IpAddr, u16, std::sync::Arc<crate::model::Frontend>)>),
}

type SockMap<K, V> = aya::maps::HashMap<aya::maps::MapData, K, V>;

fn open_lru<K: aya::Pod, V: aya::Pod>(bpffs: &Path, name: &str) -> Result<SockMap<K, V>> {
    let data = aya::maps::MapData::from_pin(crate::dataplane::loader::pin_path(bpffs, name)).with_context(|| format!("open pinned map {name}"))?;
    Ok(aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data))?)
}

impl Destroyer {
    /// `destroyed` counts the sockets (the `lb_sockets_destroyed` metric).
    /// `invisible` is the number of the cgroup's processes the agent cannot see
    /// (the `lb_cgroup_processes_invisible` metric).
    pub fn spawn(
        bpffs: &Path,
        cgroup: std::path::PathBuf,
        destroyed: prometheus_client::metrics::counter::Counter,
        invisible: prometheus_client::metrics::gauge::Gauge,
    ) -> Result<Self> {
        use lb_common::{SockRevNat4Key, SockRevNat4Value, SockRevNat6Key, SockRevNat6Value, maps};
        let mut s4: SockMap<SockRevNat4Key, SockRevNat4Value> = open_lru(bpffs, maps::SOCK_REVNAT4)?;
        let mut s6: SockMap<SockRevNat6Key, SockRevNat6Value> = open_lru(bpffs, maps::SOCK_REVNAT6)?;
        let storage = aya::maps::MapData::from_pin(crate::dataplane::loader::pin_path(bpffs, maps::SOCK_XLATE))
            .with_context(|| format!("open pinned map {}", maps::SOCK_XLATE))?;
        let (tx, rx) = std::sync::mpsc::channel::<Work>();
        let counter = destroyed;
        std::thread::Builder::new().name("stale-sockets".into()).spawn(move || {
            use std::os::fd::AsFd as _;
            let mut logged = false;
            check_visibility(&cgroup, &invisible, &mut logged);
            while let Ok(first) = rx.recv() {
                // Everything queued, at once.
                let mut left = BTreeSet::new();
                let mut sweep = None;
                for w in std::iter::once(first).chain(rx.try_iter()) {
                    match w {
                        Work::Left(l) => left.extend(l),
                        Work::Sweep(f) => sweep = Some(f),
                    }
                }
                // A sweep judges every translated socket by the frontends
                // that exist now (by address and port: TCP and UDP share them).
                let mut by_addr: HashMap<(IpAddr, u16), Vec<std::sync::Arc<crate::model::Frontend>>> = HashMap::new();
                let sweeping = sweep.is_some();
                for (a, p, f) in sweep.into_iter().flatten() {
                    by_addr.entry((a, p)).or_default().push(f);
                }
                let alive = |(v, vp, b, bp): &Pair| by_addr.get(&(*v, *vp)).is_some_and(|fs| fs.iter().any(|f| f.serves(*b, *bp)));
                if left.is_empty() && !sweeping {
                    continue;
                }
                check_visibility(&cgroup, &invisible, &mut logged);
                let peers: BTreeSet<(IpAddr, u16)> = left.iter().map(|(_, _, b, bp)| (*b, *bp)).collect();
                let mut n = 0;
                for (pid, sock) in netns_sockets(&cgroup) {
                    let conns = match connected_to(&sock, (!sweeping).then_some(&peers), storage.fd().as_fd()) {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::warn!("stale sockets: the netns of pid {pid}: {e:#}");
                            continue;
                        }
                    };
                    // Which frontend our hook translated each from: the
                    // socket's storage, else the LRU by cookie.
                    let from = |c: &Conn| -> Option<(IpAddr, u16)> {
                        if let Some(x) = &c.xlate {
                            return xlate_pair(x, c.peer, c.port);
                        }
                        match c.peer {
                            IpAddr::V4(a) => {
                                let k = SockRevNat4Key { cookie: c.cookie, addr: a.octets(), port: c.port, _pad: 0 };
                                if let Ok(v) = s4.get(&k, 0) {
                                    return Some((IpAddr::from(v.addr), v.port));
                                }
                                let k = SockRevNat6Key { cookie: c.cookie, addr: a.to_ipv6_mapped().octets(), port: c.port, _pad: 0, _pad2: 0 };
                                s6.get(&k, 0).ok().map(|v| (IpAddr::from(v.addr), v.port))
                            }
                            IpAddr::V6(a) => {
                                let k = SockRevNat6Key { cookie: c.cookie, addr: a.octets(), port: c.port, _pad: 0, _pad2: 0 };
                                s6.get(&k, 0).ok().map(|v| (IpAddr::from(v.addr), v.port))
                            }
                        }
                    };
                    let candidates: Vec<Candidate<usize>> =
                        conns.iter().enumerate().map(|(i, c)| (i, c.peer, c.port, from(c))).collect();
                    let mut judged = left.clone();
                    if sweeping {
                        judged.extend(
                            candidates.iter().filter_map(|(_, b, bp, f)| f.map(|(v, vp)| (v, vp, *b, *bp))).filter(|pair| !alive(pair)),
                        );
                    }
                    for i in stale(&candidates, &judged) {
                        let c = &conns[i];
                        match destroy_one(&sock, c.req.clone()) {
                            Ok(true) => n += 1,
                            Ok(false) => {}
                            Err(e) => tracing::warn!("destroying a stale socket in the netns of pid {pid}: {e:#}"),
                        }
                        if c.xlate.is_some() {
                            // Its storage goes with the socket.
                            continue;
                        }
                        // Gone (or closing): forget its translation.
                        if let IpAddr::V4(a) = c.peer {
                            let _ = s4.remove(&SockRevNat4Key { cookie: c.cookie, addr: a.octets(), port: c.port, _pad: 0 });
                        }
                        let a6 = match c.peer {
                            IpAddr::V4(a) => a.to_ipv6_mapped(),
                            IpAddr::V6(a) => a,
                        };
                        let _ = s6.remove(&SockRevNat6Key { cookie: c.cookie, addr: a6.octets(), port: c.port, _pad: 0, _pad2: 0 });
                    }
                }
                counter.inc_by(n as u64);
                if n > 0 {
                    tracing::info!(sockets = n, "destroyed sockets connected to removed backends");
                }
            }
        })?;
        Ok(Self { tx })
    }

    /// Hand over pairs that stopped serving.
    pub fn update(&self, left: BTreeSet<Pair>) {
        let _ = self.tx.send(Work::Left(left));
    }

    /// Hand over every frontend after a full sync.
    pub fn sweep(&self, fronts: Vec<(IpAddr, u16, std::sync::Arc<crate::model::Frontend>)>) {
        let _ = self.tx.send(Work::Sweep(fronts));
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
            (1, ip("10.0.0.1"), 8080, Some((vip, 80))), // backend left
            (2, ip("10.0.0.2"), 8080, Some((vip, 80))), // still serving
            (3, ip("10.0.0.2"), 8080, Some((ip("10.96.0.11"), 80))), // same backend, other frontend that dropped it
        ];
        let left: BTreeSet<Pair> = [(vip, 80, ip("10.0.0.1"), 8080), (ip("10.96.0.11"), 80, ip("10.0.0.2"), 8080)].into();
        assert_eq!(stale(&entries, &left), [1, 3]);
        // A connection the socket-LB did not make is never stale.
        assert!(stale(&[(4, ip("10.0.0.1"), 8080, None)], &left).is_empty());
    }
}
