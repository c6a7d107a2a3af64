//! sock_diag: list a netns' connected sockets (with each TCP socket's
//! translation from its BPF storage) and destroy one.
use std::collections::BTreeSet;
use std::net::IpAddr;

use anyhow::{Context as _, Result};
use netlink_packet_core::{
    Emitable as _, NLA_F_NESTED, NLA_TYPE_MASK, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
    NetlinkSerializable, Nla as _, NlasIterator,
};
pub(super) use netlink_packet_sock_diag::constants::IPPROTO_UDP;
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP};
use netlink_packet_sock_diag::inet::nlas::Nla as InetNla;
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_packet_sock_diag::{SockDiagDestroy, SockDiagMessage};
use netlink_sys::Socket;

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
pub(super) struct Conn {
    pub(super) req: InetRequest,
    pub(super) cookie: u64,
    /// The peer, an IPv4-mapped address as IPv4.
    pub(super) peer: IpAddr,
    pub(super) port: u16,
    /// The translation in the socket's storage, if connect4/6 made one.
    pub(super) xlate: Option<lb_common::SockXlate>,
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
            if f.kind() & NLA_TYPE_MASK == SK_DIAG_BPF_STORAGE_MAP_VALUE
                && let Some(v) = f.value().get(..size_of::<lb_common::SockXlate>())
            {
                return Some(bytemuck::pod_read_unaligned(v));
            }
        }
    }
    None
}

/// The frontend of a socket's stored translation, if it was translated to
/// the peer it has now (a UDP socket may connect again, elsewhere).
pub(super) fn xlate_pair(x: &lb_common::SockXlate, peer: IpAddr, port: u16) -> Option<(IpAddr, u16)> {
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
pub(super) fn connected_to(sock: &Socket, peers: Option<&BTreeSet<(IpAddr, u16)>>, storage: std::os::fd::BorrowedFd<'_>) -> Result<Vec<Conn>> {
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

/// What became of one SOCK_DESTROY.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Destroyed {
    Yes,
    /// It had closed meanwhile (ENOENT).
    Gone,
    /// The kernel refused, with this errno (EOPNOTSUPP: built without
    /// CONFIG_INET_DIAG_DESTROY).
    Refused(nix::errno::Errno),
}

/// Destroy one socket.
pub(super) fn destroy_one(sock: &Socket, req: InetRequest) -> Result<Destroyed> {
    send(sock, NLM_F_REQUEST | NLM_F_ACK, SockDiagDestroy::new(SockDiagMessage::InetRequest(req)))?;
    let mut buf = vec![0u8; 4096];
    let len = sock.recv(&mut &mut buf[..], 0)?;
    let msg = NetlinkMessage::<SockDiagMessage>::deserialize(&buf[..len]).context("sock_diag ack")?;
    Ok(ack(&msg.payload))
}

fn ack(payload: &NetlinkPayload<SockDiagMessage>) -> Destroyed {
    match payload {
        NetlinkPayload::Error(e) => match e.code {
            None => Destroyed::Yes,
            Some(code) => match nix::errno::Errno::from_raw(-code.get()) {
                nix::errno::Errno::ENOENT => Destroyed::Gone,
                errno => Destroyed::Refused(errno),
            },
        },
        _ => Destroyed::Yes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ACK destroyed it; ENOENT: it had closed; any other errno is a
    /// refusal to report (EOPNOTSUPP: no CONFIG_INET_DIAG_DESTROY).
    #[test]
    fn destroy_acks_are_told_apart() {
        let err = |code: i32| {
            let mut e = netlink_packet_core::ErrorMessage::default();
            e.code = std::num::NonZeroI32::new(code);
            NetlinkPayload::<SockDiagMessage>::Error(e)
        };
        assert_eq!(ack(&err(0)), Destroyed::Yes);
        assert_eq!(ack(&err(-2)), Destroyed::Gone);
        assert_eq!(ack(&err(-95)), Destroyed::Refused(nix::errno::Errno::EOPNOTSUPP));
        assert_eq!(ack(&err(-1)), Destroyed::Refused(nix::errno::Errno::EPERM));
    }
}
