//! cgroup sock_addr hooks: the socket-level load balancer.
//!
//! connect4/6 rewrite a connect to `ClusterIP:port` into a connect to one
//! backend, before any packet exists. sendmsg4/6 do the same per datagram for
//! unconnected UDP. recvmsg4/6 rewrite the source of UDP replies, and
//! getpeername4/6 the peer of a connected socket, back to the ClusterIP.
//!
//! A connected socket keeps its translation in its own storage
//! (`LB_SOCK_XLATE`, freed with the socket); a connected UDP socket also in
//! `LB_SOCK_UDP` by cookie (sock_diag returns storage only with TCP
//! sockets, and the stale-socket destroyer must find it), removed by the
//! sock_release hook when the socket goes; unconnected UDP, which may send
//! to many frontends from one socket, in the `LB*_SOCK_REVNAT` LRUs.
//!
//! An AF_INET6 socket that connects to a v4-mapped address
//! (`::ffff:a.b.c.d`) runs only the *6 hooks; it is balanced with the IPv4
//! maps, like an AF_INET socket.
use core::ffi::c_void;

use aya_ebpf::{
    bindings::__sk_buff,
    btf_maps::{HashMap, SkStorage},
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval, generated::bpf_sk_storage_get},
    macros::{btf_map, cgroup_skb, cgroup_sock, cgroup_sock_addr},
    programs::{SkBuffContext, SockAddrContext, SockContext},
};
use lb_common::{FAMILY_V4, FAMILY_V6, NodePortKey, PROTO_TCP, PROTO_UDP, SockCheck, SockXlate, capacity, monitor, node_flags, sock_check, sock_xlate, stats, svc_flags};

/// The NodePorts in use: processes in the node's network namespace may not
/// bind() them.
#[btf_map]
pub(crate) static LB_NODEPORTS: HashMap<NodePortKey, u8, { capacity::NODEPORTS as usize }, { aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize }> =
    HashMap::new();

/// Each connected socket's translation, for as long as the socket lives.
#[btf_map]
static LB_SOCK_XLATE: SkStorage<SockXlate> = SkStorage::new();

/// Connected UDP sockets' translations by socket cookie, for the
/// stale-socket destroyer: a plain hash (nothing evicts an idle socket's
/// entry), each entry removed by `lb_sock_release` with its socket.
#[btf_map]
static LB_SOCK_UDP: HashMap<u64, SockXlate, { capacity::SOCK_REVNAT as usize }, { aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize }> =
    HashMap::new();

/// Sockets sent to a frontend with loadBalancerSourceRanges before the
/// kernel picked their source address, for `lb_sock_egress`.
#[btf_map]
static LB_SOCK_CHECK: SkStorage<SockCheck> = SkStorage::new();

/// The backend id of a connection marked in `LB_SOCK_CHECK` that has not
/// been counted yet: a connection its frontend's ranges refuse is no
/// connection, so it is counted (`account_conn`) when its first packet
/// passes them, and this storage goes. (A socket an agent from before it
/// marked has none: that agent counted it at connect.) 64 bits, so that
/// `count_pending` can swap it atomically (the BPF target's cpu has no
/// 32-bit exchange).
#[btf_map]
static LB_SOCK_PENDING: SkStorage<u64> = SkStorage::new();

const EADDRINUSE: i32 = 98;
const EPERM: i32 = 1;

/// Remember a connected socket's translation in its storage; false when
/// the kernel refused the storage. (Its own frame: a leaf, so that the
/// hooks' frames stay small for the monitor and log calls below them.)
#[inline(never)]
fn track(ctx: &SockAddrContext, x: &SockXlate) -> bool {
    let x = *x;
    // Created with a family no translation has, so that a new storage is
    // told from an earlier connect's (UDP, or TCP after a failed connect,
    // may connect again) and counted once (`stats::SOCK_TRACKED`).
    let mut v = SockXlate { family: NEW_STORAGE, ..x };
    // SAFETY: ctx is this program's context; the helper checks the socket.
    let p = unsafe { LB_SOCK_XLATE.get_or_insert_ptr_mut(ctx, Some(&mut v)) };
    if p.is_null() {
        return false;
    }
    // SAFETY: p points to this socket's storage.
    let counted = if unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*p).family)) } == NEW_STORAGE {
        lb::event(stats::SOCK_TRACKED);
        sock_xlate::COUNTED
    } else {
        // Connected again: counted or not, as it was (a storage an agent
        // from before the count created is not, and its release is not
        // counted either).
        // SAFETY: as above.
        (unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*p)._pad)) } & sock_xlate::COUNTED)
    };
    // SAFETY: as above.
    unsafe { core::ptr::write_volatile(p, SockXlate { _pad: counted, ..x }) };
    true
}

/// `SockXlate::family` of a storage `track` has just created.
const NEW_STORAGE: u8 = 0xff;

/// The translation connect gave this socket; `family` 0 when none. (Not an
/// Option: LLVM reads the fields of a None speculatively, and the verifier
/// refuses the uninitialised registers.)
#[inline(always)]
fn tracked(ctx: &SockAddrContext) -> SockXlate {
    // SAFETY: ctx is this program's context.
    let p = unsafe { LB_SOCK_XLATE.get_ptr_mut(ctx) };
    if p.is_null() {
        return SockXlate::default();
    }
    // SAFETY: p points to this socket's storage.
    unsafe { core::ptr::read_volatile(p) }
}

/// A datagram sent with an address (sendto) on a socket connected to that
/// same frontend (`asked`: its address as words, IPv4 in the first, and
/// `port`) goes to the backend connect chose, while the frontend lives, so
/// that the reply comes from the peer a connected socket accepts
/// (kube-proxy: the datagram has the connected flow's tuple, and conntrack
/// its endpoint). The backend's address goes to `out`; returns its port
/// with bit 16 set, or 0 when the socket is not connected there: the
/// storage outlives a disconnect (`connect(AF_UNSPEC)`, or the agent's
/// destroying of a socket whose backend left, which disconnects a UDP
/// socket) and a connect to an address no Service has, and the socket
/// must still be connected to that backend (else a datagram the
/// application sends with the frontend's address after such an error
/// would go to the backend that left, for good).
#[inline(always)]
fn connected_backend(ctx: &SockAddrContext, family: u8, asked: &[u32; 4], port: u16, out: &mut [u32; 4]) -> u32 {
    use core::ptr::{addr_of, read_volatile};
    // SAFETY: ctx is this program's context.
    let p = unsafe { LB_SOCK_XLATE.get_ptr_mut(ctx) };
    if p.is_null() {
        return 0;
    }
    // SAFETY: p points to this socket's storage, alive for this run; its
    // addresses start at 4-byte aligned offsets (0 and 16).
    let (fam, front_port, rev_nat_id, front) = unsafe {
        (
            read_volatile(addr_of!((*p).family)),
            read_volatile(addr_of!((*p).front_port)),
            read_volatile(addr_of!((*p).rev_nat_id)),
            read_volatile(addr_of!((*p).front).cast::<[u32; 4]>()),
        )
    };
    if fam != family || front_port != port {
        return 0;
    }
    let alive = if family == FAMILY_V4 {
        asked[0] == front[0] && lb::frontend_alive::<V4>(rev_nat_id, asked[0].to_ne_bytes(), port)
    } else {
        *asked == front && lb::frontend_alive::<V6>(rev_nat_id, bytes16(asked), port)
    };
    if !alive {
        return 0;
    }
    // SAFETY: as above.
    let backend_port = unsafe {
        *out = read_volatile(addr_of!((*p).backend).cast::<[u32; 4]>());
        read_volatile(addr_of!((*p).backend_port))
    };
    // SAFETY: ctx is this program's context; its socket (PTR_TO_SOCKET,
    // never null) is readable field by field, each at its own size.
    unsafe {
        let sk = (*ctx.sock_addr).__bindgen_anon_1.sk;
        // TCP_ESTABLISHED: a connected UDP socket's state. (Its port in
        // network order; the storage's in host order.)
        if read_volatile(addr_of!((*sk).state)) != 1 || u16::from_be(read_volatile(addr_of!((*sk).dst_port))) != backend_port {
            return 0;
        }
        if family == FAMILY_V4 {
            if read_volatile(addr_of!((*sk).dst_ip4)) != out[0] {
                return 0;
            }
        } else {
            let d = addr_of!((*sk).dst_ip6).cast::<u32>();
            for i in 0..4 {
                if read_volatile(d.add(i)) != out[i] {
                    return 0;
                }
            }
        }
    }
    backend_port as u32 | 1 << 16
}

/// `connected_backend` for an AF_INET socket's datagram: the address
/// rewritten when it applies. (Three functions of their own frames, each
/// reading and writing the context at constant offsets: the sendmsg hooks'
/// frames are near the limit, and a shared one with the offset chosen at
/// run time is refused by the verifier.)
#[inline(never)]
fn sendto_connected4(ctx: &SockAddrContext) -> bool {
    let mut b = [0u32; 4];
    let found = connected_backend(ctx, FAMILY_V4, &[u32::from_ne_bytes(ip4(ctx)), 0, 0, 0], port(ctx), &mut b);
    if found == 0 {
        return false;
    }
    set_ip4(ctx, b[0].to_ne_bytes());
    set_port(ctx, found as u16);
    lb::event(stats::TRANSLATED);
    true
}

/// The same for an AF_INET6 socket's datagram (to an IPv6 address, or to
/// `::ffff:a.b.c.d`).
#[inline(never)]
fn sendto_connected6(ctx: &SockAddrContext) -> bool {
    let mut b = [0u32; 4];
    let words = ip6_words(ctx);
    if v4_mapped(&words).is_some() {
        let found = connected_backend(ctx, FAMILY_V4, &[words[3], 0, 0, 0], port(ctx), &mut b);
        if found == 0 {
            return false;
        }
        set_ip6_word(ctx, 3, b[0]);
        set_port(ctx, found as u16);
    } else {
        let found = connected_backend(ctx, FAMILY_V6, &words, port(ctx), &mut b);
        if found == 0 {
            return false;
        }
        set_ip6_word(ctx, 0, b[0]);
        set_ip6_word(ctx, 1, b[1]);
        set_ip6_word(ctx, 2, b[2]);
        set_ip6_word(ctx, 3, b[3]);
        set_port(ctx, found as u16);
    }
    lb::event(stats::TRANSLATED);
    true
}

#[inline(always)]
fn wide4(a: [u8; 4]) -> [u8; 16] {
    let mut w = [0u8; 16];
    w[..4].copy_from_slice(&a);
    w
}

#[inline(always)]
fn narrow4(w: &[u8; 16]) -> [u8; 4] {
    [w[0], w[1], w[2], w[3]]
}

/// Remember where connect (stable = false: the socket's storage) or an
/// unconnected datagram (the LRU, by cookie) went. A connected UDP socket
/// goes into `LB_SOCK_UDP` too (sock_diag reports storage only with TCP
/// sockets), or, that table full, into the LRU as before. A socket the
/// kernel refuses storage (its optmem limit, or an allocation failure)
/// goes into the LRU, counted: getpeername, recvmsg and the
/// destroyer look there next. `lru` writes the LRU entry of the family
/// (`lb::remember4` or `lb::remember6`); `x` is the storage value.
#[inline(always)]
fn remember(ctx: &SockAddrContext, stable: bool, proto: u8, cookie: u64, lru: impl FnOnce(u64), x: &SockXlate) {
    if stable {
        lru(cookie);
        return;
    }
    let stored = track(ctx, x);
    if stored && proto != PROTO_UDP {
        return;
    }
    let c = self::cookie(ctx);
    let in_udp = proto == PROTO_UDP && track_udp(c, x);
    if !stored {
        lb::event(stats::SOCK_STORAGE_FAILED);
    }
    if !stored || !in_udp {
        lru(c);
    }
}

/// A connected UDP socket's translation into `LB_SOCK_UDP`; false when the
/// table is full. (Its own frame, like `track`.)
#[inline(never)]
fn track_udp(cookie: u64, x: &SockXlate) -> bool {
    let x = *x;
    LB_SOCK_UDP.insert(&cookie, &x, 0).is_ok()
}

/// `mark_check`'s packed arguments (a call passes five at most).
#[inline(always)]
fn check_meta(stable: bool, ranged: bool, family: u8, rev_nat_id: u16, backend_port: u16) -> u64 {
    family as u64 | (stable as u64) << 8 | (ranged as u64) << 9 | (rev_nat_id as u64) << 16 | (backend_port as u64) << 32
}

/// loadBalancerSourceRanges on the socket path. connect and sendmsg run
/// before the kernel picks the socket's source address, so a translation
/// to a frontend with ranges (`ranged`) marks the socket in
/// `LB_SOCK_CHECK` (while `lb_sock_egress` is attached: node flag
/// SOCK_EGRESS), and `lb_sock_egress` checks the source of its packets: a
/// connected socket's packets to its backend until one passes; an
/// unconnected socket's datagrams one by one. A connect to a frontend
/// without ranges clears what an earlier connect of the socket (UDP may
/// connect again) marked. MARK_REFUSE: the kernel refused the socket its
/// storage, and the connect or datagram is refused (EPERM) rather than let
/// through unchecked; MARK_DEFERRED: a connection marked for the check,
/// with `backend_id` kept in `LB_SOCK_PENDING`, is counted by
/// `lb_sock_egress` once a packet of it passes; MARK_COUNT: count it now.
/// (Its own frame, like `track`.)
#[inline(never)]
fn mark_check(ctx: &SockAddrContext, meta: u64, backend: &[u8; 16], backend_id: u32) -> u8 {
    let (family, stable, ranged) = (meta as u8, meta & 1 << 8 != 0, meta & 1 << 9 != 0);
    let (rev_nat_id, backend_port) = ((meta >> 16) as u16, (meta >> 32) as u16);
    if !ranged {
        if !stable {
            // SAFETY: ctx is this program's context; the helper checks the socket.
            let p = unsafe { LB_SOCK_CHECK.get_ptr_mut(ctx) };
            if !p.is_null() {
                // SAFETY: p points to this socket's storage.
                unsafe {
                    let mut c = core::ptr::read_volatile(p);
                    c.state &= !sock_check::CONNECTED;
                    core::ptr::write_volatile(p, c);
                }
            }
        }
        return MARK_COUNT;
    }
    if lb::node_flags() & node_flags::SOCK_EGRESS == 0 {
        return MARK_COUNT;
    }
    let mut v = SockCheck::default();
    // SAFETY: ctx is this program's context; the helper checks the socket.
    let p = unsafe { LB_SOCK_CHECK.get_or_insert_ptr_mut(ctx, Some(&mut v)) };
    if p.is_null() {
        lb::event(stats::SOCK_STORAGE_FAILED);
        return MARK_REFUSE;
    }
    let mut out = MARK_COUNT;
    if !stable {
        let mut id = backend_id as u64;
        // SAFETY: as above.
        let pending = unsafe { LB_SOCK_PENDING.get_or_insert_ptr_mut(ctx, Some(&mut id)) };
        if !pending.is_null() {
            // SAFETY: this socket's storage (an earlier connect's, when
            // the socket connects again: overwritten).
            unsafe { core::ptr::write_volatile(pending, backend_id as u64) };
            out = MARK_DEFERRED;
        }
    }
    // SAFETY: p points to this socket's storage.
    let mut c = unsafe { core::ptr::read_volatile(p) };
    if stable {
        c.state |= sock_check::UNCONNECTED;
    } else {
        c.state = (c.state & sock_check::UNCONNECTED) | sock_check::CONNECTED;
        c.backend = *backend;
        c.backend_port = backend_port;
        c.rev_nat_id = rev_nat_id;
        c.family = family;
    }
    if lb::in_node_netns(&Client::Sock(ctx.sock_addr.cast::<c_void>())) {
        c.state |= sock_check::NODE;
    }
    // SAFETY: p points to this socket's storage.
    unsafe { core::ptr::write_volatile(p, c) };
    out
}

/// `mark_check`'s verdicts.
const MARK_REFUSE: u8 = 0;
const MARK_COUNT: u8 = 1;
const MARK_DEFERRED: u8 = 2;

/// The first packet of a connection marked in `LB_SOCK_CHECK` passed:
/// count the connection, if its connect left that to this program. (Its
/// own frame.)
#[inline(never)]
fn count_pending(sk: *mut aya_ebpf::bindings::bpf_sock, family: u8, rev_nat_id: u16) {
    let map = core::ptr::from_ref(&LB_SOCK_PENDING).cast_mut().cast::<c_void>();
    // SAFETY: the helper checks the socket (a full socket, or NULL back).
    let p = unsafe { bpf_sk_storage_get(map, sk.cast(), core::ptr::null_mut(), 0) }.cast::<u64>();
    if p.is_null() {
        return;
    }
    // Two threads sending a connected UDP socket's first datagrams at once
    // may both get here (sending takes no socket lock), and both find the
    // storage (the kernel's delete answers 0 to both when both looked it up
    // before either unlinked it): the run that swaps the backend id out
    // counts the connection, the other finds it claimed.
    // SAFETY: p points to this socket's storage, a u64 (RCU keeps it alive
    // for this run).
    let backend_id = unsafe { core::intrinsics::atomic_xchg::<u64, { core::intrinsics::AtomicOrdering::Relaxed }>(p, PENDING_CLAIMED) };
    if backend_id == PENDING_CLAIMED {
        return;
    }
    lb::account_conn(family, rev_nat_id, backend_id as u32);
    // SAFETY: sk is the packet's full socket (the lookup above found its
    // storage).
    let _ = unsafe { LB_SOCK_PENDING.delete(sk) };
}

/// `LB_SOCK_PENDING` of a connection already counted (no backend id is
/// this large).
const PENDING_CLAIMED: u64 = u64::MAX;

/// cgroup_skb egress verdicts. DROP_CN: dropped, and the sender told of
/// congestion, which UDP's sendmsg reports as success (a pod's packets
/// outside the ranges vanish, as on the node's FORWARD path under
/// kube-proxy); DROP fails the send with EPERM, as a DROP in OUTPUT does
/// for the node's own sockets.
const SKB_PASS: i32 = 1;
const SKB_DROP: i32 = 0;
const SKB_DROP_CN: i32 = 2;
/// Or-ed into `check_source`'s verdict: it filled this CPU's monitor event.
const EVENT_FILLED: i32 = 0x100;

const ETH_P_IPV6: u16 = 0x86dd;
/// IPv6 extension headers (next-header values).
const IPV6_HOPOPTS: u8 = 0;
const IPV6_ROUTING: u8 = 43;
const IPV6_AH: u8 = 51;
const IPV6_DSTOPTS: u8 = 60;

/// A packet of a socket in the cgroup leaves. Sockets the hooks sent to a
/// frontend with loadBalancerSourceRanges (`mark_check`) have their source
/// checked; every other socket has no `LB_SOCK_CHECK` storage and passes
/// after one lookup.
#[cgroup_skb(egress)]
pub fn lb_sock_egress(ctx: SkBuffContext) -> i32 {
    let skb = ctx.skb.skb;
    // SAFETY: a context field this program type may read.
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return SKB_PASS;
    }
    let map = core::ptr::from_ref(&LB_SOCK_CHECK).cast_mut().cast::<c_void>();
    // SAFETY: the helper checks the socket (a full socket, or NULL back).
    let p = unsafe { bpf_sk_storage_get(map, sk.cast(), core::ptr::null_mut(), 0) }.cast::<SockCheck>();
    if p.is_null() {
        return SKB_PASS;
    }
    let verdict = check_source(skb, sk, p);
    if verdict & EVENT_FILLED != 0 {
        report_denied();
    }
    verdict & !EVENT_FILLED
}

/// What `lb_sock_egress` needs of a packet.
#[derive(Default)]
struct Hdr {
    src: [u8; 16],
    dst: [u8; 16],
    /// Protocol << 16 | destination port when the header after the IP
    /// header (and IPv6's extension headers) is TCP or UDP; else 0.
    l4: u32,
    family: u8,
}

/// The packet's addresses into `h`; false when they cannot be read. (Its
/// own frame: the loads' temporaries stay off `check_source`'s stack.)
#[inline(never)]
fn addresses(skb: *mut __sk_buff, h: &mut Hdr) -> bool {
    let ctx = SkBuffContext::new(skb);
    let Ok(hdr): Result<[u8; 16], _> = ctx.load(0) else { return false };
    if ctx.skb.protocol() == ETH_P_IPV6.to_be() as u32 {
        let (Ok(src), Ok(dst)) = (ctx.load(8), ctx.load(24)) else { return false };
        (h.src, h.dst, h.family) = (src, dst, FAMILY_V6);
        // The extension headers a socket can put before its TCP or UDP
        // header (IPV6_HOPOPTS, IPV6_DSTOPTS, IPV6_RTHDR, IPV6_RTHDRDSTOPTS,
        // and AH from a transport-mode policy): at most five. A datagram
        // is not fragmented yet where this runs.
        let (mut nh, mut off) = (hdr[6], 40usize);
        for _ in 0..6 {
            match nh {
                PROTO_TCP | PROTO_UDP => {
                    let Ok(port) = ctx.load::<u16>(off + 2) else { return false };
                    h.l4 = (nh as u32) << 16 | u16::from_be(port) as u32;
                    break;
                }
                IPV6_HOPOPTS | IPV6_DSTOPTS | IPV6_ROUTING | IPV6_AH => {
                    let Ok(ext): Result<[u8; 4], _> = ctx.load(off) else { return false };
                    // A routing header (type 2, Mobile IPv6's; type 4, a
                    // segment list) holds the destination the socket sent
                    // to at its offset 8; the IPv6 header holds the first
                    // hop.
                    if nh == IPV6_ROUTING && (ext[2] == 2 || ext[2] == 4) {
                        let Ok(final_dst) = ctx.load(off + 8) else { return false };
                        h.dst = final_dst;
                    }
                    off += if nh == IPV6_AH { (ext[1] as usize + 2) * 4 } else { (ext[1] as usize + 1) * 8 };
                    nh = ext[0];
                }
                _ => break,
            }
        }
        return true;
    }
    let Ok(d): Result<[u8; 4], _> = ctx.load(16) else { return false };
    h.src[..4].copy_from_slice(&hdr[12..16]);
    h.dst[..4].copy_from_slice(&d);
    h.family = FAMILY_V4;
    let proto = hdr[9];
    if proto == PROTO_TCP || proto == PROTO_UDP {
        let Ok(port) = ctx.load::<u16>(((hdr[0] & 0x0f) as usize) * 4 + 2) else { return false };
        h.l4 = (proto as u32) << 16 | u16::from_be(port) as u32;
    }
    true
}

/// `lb_sock_egress` for a marked socket. (Its own frame: the addresses
/// stay off the entry point's stack.)
#[inline(never)]
fn check_source(skb: *mut __sk_buff, sk: *mut aya_ebpf::bindings::bpf_sock, p: *mut SockCheck) -> i32 {
    // SAFETY: p points to this socket's storage.
    let mut c = unsafe { core::ptr::read_volatile(p) };
    if c.state & (sock_check::CONNECTED | sock_check::UNCONNECTED) == 0 {
        return SKB_PASS;
    }
    let drop = if c.state & sock_check::NODE != 0 { SKB_DROP } else { SKB_DROP_CN };
    let mut h = Hdr::default();
    if !addresses(skb, &mut h) {
        return SKB_PASS;
    }
    let Hdr { src, dst, l4, family } = h;
    let port = l4 as u16;
    // The connection's packets: to the backend it connected to.
    if c.state & sock_check::CONNECTED != 0 && family == c.family && dst == c.backend && (port == 0 || port == c.backend_port) {
        // The first packet the ranges allow opens the connection; until
        // then each one is checked, so that a SYN sent again after the
        // ranges changed gets through, as kube-proxy's firewall (on new
        // flows) lets it.
        if allowed(c.state, c.rev_nat_id, family, &src) || !still_ranged(family, c.rev_nat_id, (l4 >> 16) as u8) {
            c.state &= !sock_check::CONNECTED;
            // SAFETY: p points to this socket's storage.
            unsafe { core::ptr::write_volatile(p, c) };
            count_pending(sk, c.family, c.rev_nat_id);
            return SKB_PASS;
        }
        return denied(family, &src, c.rev_nat_id, l4, drop);
    }
    if c.state & sock_check::UNCONNECTED == 0 || port == 0 {
        return SKB_PASS;
    }
    // An unconnected datagram: the frontend it was sent to, if that one has
    // ranges.
    // SAFETY: helper valid for cgroup_skb programs.
    let cookie = unsafe { bpf_get_socket_cookie(skb.cast()) };
    let ranged = if family == FAMILY_V4 { lb::ranged4(cookie, narrow4(&dst), port) } else { lb::ranged6(cookie, dst, port) };
    match ranged {
        Some(id) if !allowed(c.state, id, family, &src) => denied(family, &src, id, l4, drop),
        _ => SKB_PASS,
    }
}

/// Whether frontend `rev_nat_id`'s ranges allow a packet from `src`. The
/// node's own sockets are also allowed when the ranges hold the node's
/// address: kube-proxy checks the source the node picks for the LB IP
/// (the node's address, by its default route), where a translated socket
/// picks the source for the backend (for a local pod, the pod bridge's
/// address).
#[inline(never)]
fn allowed(state: u8, rev_nat_id: u16, family: u8, src: &[u8; 16]) -> bool {
    crate::nodeport::src_allowed(rev_nat_id, family, *src) || (state & sock_check::NODE != 0 && node_allowed(rev_nat_id, family))
}

/// Whether frontend `rev_nat_id` still exists with loadBalancerSourceRanges
/// (a connection marked for it checks nothing once they are gone, or the
/// Service is). Asked only of packets the ranges would drop.
#[inline(never)]
fn still_ranged(family: u8, rev_nat_id: u16, proto: u8) -> bool {
    let ranged = |f: lb_common::SvcValue| f.rev_nat_id == rev_nat_id && f.flags & svc_flags::SRC_RANGE != 0;
    if family == FAMILY_V4 {
        V4::revnat(rev_nat_id).and_then(|r| V4::svc(&lb_common::SvcKey::new(r.addr, r.port, proto, lb_common::SCOPE_ALL, 0))).is_some_and(ranged)
    } else {
        V6::revnat(rev_nat_id).and_then(|r| V6::svc(&lb_common::SvcKey::new(r.addr, r.port, proto, lb_common::SCOPE_ALL, 0))).is_some_and(ranged)
    }
}

/// The node's address (the one SNATed flows leave from) in frontend
/// `rev_nat_id`'s ranges. (Its own frame: the node config's copy stays
/// off `check_source`'s stack.)
#[inline(never)]
fn node_allowed(rev_nat_id: u16, family: u8) -> bool {
    let Some(cfg) = lb::node_config() else { return false };
    let addr = if family == FAMILY_V4 { wide4(cfg.snat_addr) } else { cfg.snat_addr6 };
    addr != [0u8; 16] && crate::nodeport::src_allowed(rev_nat_id, family, addr)
}

/// A packet dropped for loadBalancerSourceRanges: count it, and, when
/// monitors listen, fill this CPU's event with the client
/// (`lb_sock_egress` adds the frontend and sends it, a frame away from
/// this one's stack, when the verdict says EVENT_FILLED); `l4` is
/// protocol << 16 | port, `verdict` what the program returns. (Its own
/// frame: the counters' key and value stay off `check_source`'s stack.)
#[inline(never)]
fn denied(family: u8, src: &[u8; 16], rev_nat_id: u16, l4: u32, verdict: i32) -> i32 {
    lb::event(stats::SRC_RANGE_DROPPED);
    lb::account(lb_common::STATS_FRONTEND, family, rev_nat_id as u32, lb::Acct::SourceRange);
    if lb::observed()
        && let Some(ev) = lb::event_buf()
    {
        // SAFETY: this CPU's event buffer.
        unsafe {
            (*ev).client = *src;
            (*ev).x.family = family;
            (*ev).x.rev_nat_id = rev_nat_id;
            (*ev).proto = (l4 >> 16) as u8;
            (*ev).hook = monitor::HOOK_EGRESS;
            (*ev).why = monitor::WHY_SOURCE_RANGE;
            (*ev).errno = if verdict == SKB_DROP { EPERM as u8 } else { 0 };
        }
        return verdict | EVENT_FILLED;
    }
    verdict
}

/// Send the event `denied` filled, with its frontend (from the rev-NAT
/// entry).
#[inline(never)]
fn report_denied() {
    let Some(ev) = lb::event_filled() else { return };
    // SAFETY: this CPU's event buffer, filled by `denied` in this run.
    let (family, rev_nat_id) = unsafe { ((*ev).x.family, (*ev).x.rev_nat_id) };
    let front = if family == FAMILY_V4 {
        V4::revnat(rev_nat_id).map(|r| (wide4(r.addr), r.port))
    } else {
        V6::revnat(rev_nat_id).map(|r| (r.addr, r.port))
    };
    let Some((addr, port)) = front else { return };
    // SAFETY: as above.
    unsafe {
        (*ev).x.front = addr;
        (*ev).x.front_port = port;
    }
    lb::emit(ev);
}

/// A refused connect or datagram: tell the monitors and the log (when they
/// listen), and fail the syscall with `errno`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn refused(ctx: &SockAddrContext, stable: bool, family: u8, proto: u8, front: *const u8, port: u16, errno: i32, why: u8, rev_nat_id: u16) -> i32 {
    if lb::observed() {
        report(ctx.sock_addr.cast(), meta(family, proto, stable, why, errno, rev_nat_id), front, core::ptr::null(), (port as u32) << 16);
    }
    refuse(errno)
}

/// A translated connect or datagram: tell the monitors and the log (when
/// they listen) and count the connection for its frontend and backend
/// (`count`: not left to `lb_sock_egress`, `mark_check`'s MARK_COUNT).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn translated(ctx: &SockAddrContext, stable: bool, count: bool, family: u8, proto: u8, front: *const u8, port: u16, to: (*const u8, u16), v: (u16, u32, u8)) {
    let (rev_nat_id, backend_id, why) = v;
    if lb::observed() {
        report(ctx.sock_addr.cast(), meta(family, proto, stable, why, 0, rev_nat_id), front, to.0, (port as u32) << 16 | to.1 as u32);
    }
    if !stable && count {
        lb::account_conn(family, rev_nat_id, backend_id);
    }
}

use crate::lb::{self, Client, Family as _, V4, V6, Verdict};

const ALLOW: i32 = 1;
const REJECT: i32 = 0;

/// The socket's protocol as used in keys (TCP or UDP), or None for others.
#[inline(always)]
fn proto(ctx: &SockAddrContext) -> Option<u8> {
    // SAFETY: ctx.sock_addr is the kernel-provided context.
    let p = unsafe { core::ptr::read_volatile(&(*ctx.sock_addr).protocol) };
    match p as u8 {
        PROTO_TCP => Some(PROTO_TCP),
        PROTO_UDP => Some(PROTO_UDP),
        _ => None,
    }
}

#[inline(always)]
fn cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: helper valid for sock_addr programs.
    unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) }
}

#[inline(always)]
fn port(ctx: &SockAddrContext) -> u16 {
    // SAFETY: a context field this program type may read.
    let p = unsafe { core::ptr::read_volatile(&(*ctx.sock_addr).user_port) };
    u16::from_be(p as u16)
}

#[inline(always)]
fn set_port(ctx: &SockAddrContext, port: u16) {
    // SAFETY: a context field this program type may write.
    unsafe { core::ptr::write_volatile(&mut (*ctx.sock_addr).user_port, port.to_be() as u32) };
}

#[inline(always)]
fn ip4(ctx: &SockAddrContext) -> [u8; 4] {
    // SAFETY: a context field this program type may read.
    unsafe { core::ptr::read_volatile(&(*ctx.sock_addr).user_ip4) }.to_ne_bytes()
}

#[inline(always)]
fn set_ip4(ctx: &SockAddrContext, a: [u8; 4]) {
    // SAFETY: a context field this program type may write.
    unsafe { core::ptr::write_volatile(&mut (*ctx.sock_addr).user_ip4, u32::from_ne_bytes(a)) };
}

/// user_ip6, one 32-bit word at a time (the verifier rejects wider access).
#[inline(always)]
fn ip6_words(ctx: &SockAddrContext) -> [u32; 4] {
    // SAFETY: context fields this program type may read, as 4-byte loads.
    unsafe {
        let p = &(*ctx.sock_addr).user_ip6;
        [
            core::ptr::read_volatile(&p[0]),
            core::ptr::read_volatile(&p[1]),
            core::ptr::read_volatile(&p[2]),
            core::ptr::read_volatile(&p[3]),
        ]
    }
}

#[inline(always)]
fn set_ip6_word(ctx: &SockAddrContext, i: usize, w: u32) {
    // SAFETY: a context field this program type may write, as a 4-byte store.
    unsafe {
        let p = &mut (*ctx.sock_addr).user_ip6;
        match i {
            0 => core::ptr::write_volatile(&mut p[0], w),
            1 => core::ptr::write_volatile(&mut p[1], w),
            2 => core::ptr::write_volatile(&mut p[2], w),
            _ => core::ptr::write_volatile(&mut p[3], w),
        }
    }
}

#[inline(always)]
fn set_ip6(ctx: &SockAddrContext, a: [u8; 16]) {
    set_ip6_word(ctx, 0, u32::from_ne_bytes([a[0], a[1], a[2], a[3]]));
    set_ip6_word(ctx, 1, u32::from_ne_bytes([a[4], a[5], a[6], a[7]]));
    set_ip6_word(ctx, 2, u32::from_ne_bytes([a[8], a[9], a[10], a[11]]));
    set_ip6_word(ctx, 3, u32::from_ne_bytes([a[12], a[13], a[14], a[15]]));
}

/// `::ffff:a.b.c.d` -> `a.b.c.d`.
#[inline(always)]
fn v4_mapped(w: &[u32; 4]) -> Option<[u8; 4]> {
    (w[0] == 0 && w[1] == 0 && w[2] == 0xffffu32.to_be()).then(|| w[3].to_ne_bytes())
}

#[inline(always)]
fn bytes16(w: &[u32; 4]) -> [u8; 16] {
    let mut a = [0u8; 16];
    let (b0, b1, b2, b3) = (w[0].to_ne_bytes(), w[1].to_ne_bytes(), w[2].to_ne_bytes(), w[3].to_ne_bytes());
    a[..4].copy_from_slice(&b0);
    a[4..8].copy_from_slice(&b1);
    a[8..12].copy_from_slice(&b2);
    a[12..].copy_from_slice(&b3);
    a
}

#[inline(always)]
fn refuse(errno: i32) -> i32 {
    // SAFETY: plain helper; makes the syscall fail with -errno instead of EPERM.
    unsafe { bpf_set_retval(-errno) };
    REJECT
}

/// Tell the monitors, when one runs, what became of a connect or datagram.
/// `meta` packs what `meta()` packs; `front` and `backend` point to 4 or 16
/// bytes by family (`backend` null when refused); `ports` is the frontend
/// port << 16 | the backend port. (Five scalar arguments: a call passes no
/// more, and the arrays stay where they are instead of on a second stack.)
#[inline(never)]
fn report(sock: *mut c_void, meta: u64, front: *const u8, backend: *const u8, ports: u32) {
    let Some(ev) = lb::event_buf() else { return };
    let family = meta as u8;
    let n = if family == FAMILY_V4 { 4 } else { 16 };
    // SAFETY: this CPU's event buffer; front/backend point to n bytes;
    // helper valid for sock_addr programs.
    unsafe {
        (*ev).netns_cookie = bpf_get_netns_cookie(sock);
        let mut i = 0;
        while i < n {
            (*ev).x.front[i] = *front.add(i);
            if !backend.is_null() {
                (*ev).x.backend[i] = *backend.add(i);
            }
            i += 1;
        }
        (*ev).x.front_port = (ports >> 16) as u16;
        (*ev).x.backend_port = ports as u16;
        (*ev).x.family = family;
        (*ev).proto = (meta >> 8) as u8;
        (*ev).hook = (meta >> 16) as u8;
        (*ev).why = (meta >> 24) as u8;
        (*ev).errno = (meta >> 32) as u8;
        (*ev).x.rev_nat_id = (meta >> 40) as u16;
    }
    lb::emit(ev);
}

/// `report`'s packed fields.
#[inline(always)]
fn meta(family: u8, proto: u8, stable: bool, why: u8, errno: i32, rev_nat_id: u16) -> u64 {
    let hook = if stable { monitor::HOOK_SENDMSG } else { monitor::HOOK_CONNECT };
    family as u64 | (proto as u64) << 8 | (hook as u64) << 16 | (why as u64) << 24 | (errno as u8 as u64) << 32 | (rev_nat_id as u64) << 40
}

/// Translate the destination of a connect (stable = false) or of an
/// unconnected UDP datagram (stable = true: one backend per socket).
#[inline(always)]
fn xlate4(ctx: &SockAddrContext, stable: bool) -> i32 {
    let Some(proto) = proto(ctx) else { return ALLOW };
    xlate4_to(ctx, stable, proto, ip4(ctx), port(ctx), false)
}

/// An IPv4 frontend: `mapped` when an AF_INET6 socket asked for it as
/// `::ffff:a.b.c.d`.
#[inline(always)]
fn xlate4_to(ctx: &SockAddrContext, stable: bool, proto: u8, addr: [u8; 4], port: u16, mapped: bool) -> i32 {
    let cookie = if stable { cookie(ctx) } else { 0 };
    let hash = if stable { Some(lb::mix(cookie)) } else { None };
    let mut front_flags = 0;
    match lb::select_with::<V4>(Client::Sock(ctx.sock_addr.cast::<c_void>()), addr, port, proto, hash, false, &mut front_flags) {
        Verdict::Pass => ALLOW,
        Verdict::Refuse { errno, why, rev_nat_id } => refused(ctx, stable, FAMILY_V4, proto, addr.as_ptr(), port, errno, why, rev_nat_id),
        Verdict::Backend { backend, rev_nat_id, backend_id, why } => {
            let ranged = front_flags & svc_flags::SRC_RANGE != 0;
            let mark = mark_check(ctx, check_meta(stable, ranged, FAMILY_V4, rev_nat_id, backend.port), &wide4(backend.addr), backend_id);
            if mark == MARK_REFUSE {
                return refuse(EPERM);
            }
            translated(ctx, stable, mark == MARK_COUNT, FAMILY_V4, proto, addr.as_ptr(), port, (backend.addr.as_ptr(), backend.port), (rev_nat_id, backend_id, why));
            let x = SockXlate {
                front: wide4(addr),
                backend: wide4(backend.addr),
                front_port: port,
                backend_port: backend.port,
                rev_nat_id,
                family: FAMILY_V4,
                _pad: 0,
            };
            remember(ctx, stable, proto, cookie, |c| lb::remember4(c, &backend, addr, port, rev_nat_id), &x);
            if mapped {
                set_ip6_word(ctx, 3, u32::from_ne_bytes(backend.addr));
            } else {
                set_ip4(ctx, backend.addr);
            }
            set_port(ctx, backend.port);
            lb::event(stats::TRANSLATED);
            ALLOW
        }
    }
}

#[inline(always)]
fn xlate6(ctx: &SockAddrContext, stable: bool) -> i32 {
    let Some(proto) = proto(ctx) else { return ALLOW };
    let words = ip6_words(ctx);
    let port = port(ctx);
    if let Some(addr) = v4_mapped(&words) {
        return xlate4_to(ctx, stable, proto, addr, port, true);
    }
    let addr = bytes16(&words);
    let cookie = if stable { cookie(ctx) } else { 0 };
    let hash = if stable { Some(lb::mix(cookie)) } else { None };
    let mut front_flags = 0;
    match lb::select_with::<V6>(Client::Sock(ctx.sock_addr.cast::<c_void>()), addr, port, proto, hash, false, &mut front_flags) {
        Verdict::Pass => ALLOW,
        Verdict::Refuse { errno, why, rev_nat_id } => refused(ctx, stable, FAMILY_V6, proto, addr.as_ptr(), port, errno, why, rev_nat_id),
        Verdict::Backend { backend, rev_nat_id, backend_id, why } => {
            let ranged = front_flags & svc_flags::SRC_RANGE != 0;
            let mark = mark_check(ctx, check_meta(stable, ranged, FAMILY_V6, rev_nat_id, backend.port), &backend.addr, backend_id);
            if mark == MARK_REFUSE {
                return refuse(EPERM);
            }
            translated(ctx, stable, mark == MARK_COUNT, FAMILY_V6, proto, addr.as_ptr(), port, (backend.addr.as_ptr(), backend.port), (rev_nat_id, backend_id, why));
            let x = SockXlate {
                front: addr,
                backend: backend.addr,
                front_port: port,
                backend_port: backend.port,
                rev_nat_id,
                family: FAMILY_V6,
                _pad: 0,
            };
            remember(ctx, stable, proto, cookie, |c| lb::remember6(c, &backend, addr, port, rev_nat_id), &x);
            set_ip6(ctx, backend.addr);
            set_port(ctx, backend.port);
            lb::event(stats::TRANSLATED);
            ALLOW
        }
    }
}

/// The frontend a connected socket's peer `addr:port` stands for, from the
/// socket's storage (None: not translated there, or the frontend is gone).
#[inline(always)]
fn tracked4(x: &SockXlate, addr: [u8; 4], port: u16) -> Option<Option<([u8; 4], u16)>> {
    if x.family != FAMILY_V4 || narrow4(&x.backend) != addr || x.backend_port != port {
        return None;
    }
    let front = narrow4(&x.front);
    Some(lb::frontend_alive::<V4>(x.rev_nat_id, front, x.front_port).then_some((front, x.front_port)))
}

/// Rewrite a backend address the socket sees (reply source, peer) back to
/// the frontend it connected to: the socket's storage first (connected
/// sockets), then the LRU (unconnected UDP, and sockets translated before
/// the storage existed).
#[inline(always)]
fn reverse4(ctx: &SockAddrContext) {
    let (addr, port) = (ip4(ctx), port(ctx));
    let found = match tracked4(&tracked(ctx), addr, port) {
        Some(f) => f,
        None => lb::reverse4(cookie(ctx), addr, port),
    };
    if let Some((a, p)) = found {
        set_ip4(ctx, a);
        set_port(ctx, p);
        lb::event(stats::REVERSED);
    }
}

#[inline(always)]
fn reverse6(ctx: &SockAddrContext) {
    let words = ip6_words(ctx);
    let port = port(ctx);
    let x = tracked(ctx);
    if let Some(addr) = v4_mapped(&words) {
        let found = match tracked4(&x, addr, port) {
            Some(f) => f,
            None => lb::reverse4(cookie(ctx), addr, port),
        };
        if let Some((a, p)) = found {
            set_ip6_word(ctx, 3, u32::from_ne_bytes(a));
            set_port(ctx, p);
            lb::event(stats::REVERSED);
        }
        return;
    }
    let addr = bytes16(&words);
    let found = match x {
        x if x.family == FAMILY_V6 && x.backend == addr && x.backend_port == port => {
            lb::frontend_alive::<V6>(x.rev_nat_id, x.front, x.front_port).then_some((x.front, x.front_port))
        }
        _ => lb::reverse6(cookie(ctx), addr, port),
    };
    if let Some((a, p)) = found {
        set_ip6(ctx, a);
        set_port(ctx, p);
        lb::event(stats::REVERSED);
    }
}

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    xlate4(&ctx, false)
}

#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    xlate6(&ctx, false)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    // sendto() on a socket connected to this frontend: its backend.
    if sendto_connected4(&ctx) {
        return ALLOW;
    }
    // Unconnected UDP: every datagram of one socket goes to the same backend,
    // so that its replies come back from one place.
    xlate4(&ctx, true)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn lb_sendmsg6(ctx: SockAddrContext) -> i32 {
    if sendto_connected6(&ctx) {
        return ALLOW;
    }
    xlate6(&ctx, true)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx);
    // recvmsg hooks must return 1.
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn lb_recvmsg6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx);
    // getpeername hooks must return 1.
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn lb_getpeername6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx);
    ALLOW
}

/// Refuse a bind() in the node's netns to a port that is a NodePort, so no
/// local process can steal it.
#[inline(always)]
fn post_bind(ctx: &SockContext) -> i32 {
    // SAFETY: context fields this program type may read.
    let (port, proto) = unsafe {
        (core::ptr::read_volatile(&(*ctx.sock).src_port) as u16, core::ptr::read_volatile(&(*ctx.sock).protocol) as u8)
    };
    if LB_NODEPORTS.get_ptr(&NodePortKey { port, proto, _pad: 0 }).is_none() {
        return ALLOW;
    }
    // SAFETY: helper valid for cgroup sock programs.
    let netns = unsafe { bpf_get_netns_cookie(ctx.sock.cast()) };
    match lb::node_config() {
        Some(cfg) if cfg.netns_cookie == netns => {
            lb::event(stats::BIND_REFUSED);
            refuse(EADDRINUSE)
        }
        _ => ALLOW,
    }
}

/// A socket of the cgroup goes away: a connected UDP one takes its entry in
/// `LB_SOCK_UDP` with it; one whose translation storage was counted
/// (`sock_xlate::COUNTED`) is counted again (`stats::SOCK_UNTRACKED`: the
/// kernel frees the storage with the socket), once: the flag is cleared,
/// for while an agent starting replaces the links, its program and the
/// earlier agent's both run, one after the other, for the same release.
#[cgroup_sock(sock_release)]
pub fn lb_sock_release(ctx: SockContext) -> i32 {
    // SAFETY: a context field this program type may read.
    let proto = unsafe { core::ptr::read_volatile(&(*ctx.sock).protocol) } as u8;
    if proto == PROTO_UDP {
        // SAFETY: helper valid for cgroup sock programs.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.sock.cast()) };
        let _ = LB_SOCK_UDP.remove(&cookie);
    }
    let map = core::ptr::from_ref(&LB_SOCK_XLATE).cast_mut().cast::<c_void>();
    // SAFETY: a cgroup sock program passes its context (the socket); a
    // socket with no storage at all answers at once.
    let p = unsafe { bpf_sk_storage_get(map, ctx.sock.cast(), core::ptr::null_mut(), 0) }.cast::<SockXlate>();
    if p.is_null() {
        return ALLOW;
    }
    // SAFETY: p points to this socket's storage, which no other program
    // run touches meanwhile (a socket is released once, its programs run
    // in turn).
    let flags = unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*p)._pad)) };
    if flags & sock_xlate::COUNTED != 0 {
        // SAFETY: as above.
        unsafe { core::ptr::write_volatile(core::ptr::addr_of_mut!((*p)._pad), flags & !sock_xlate::COUNTED) };
        lb::event(stats::SOCK_UNTRACKED);
    }
    ALLOW
}

#[cgroup_sock(post_bind4)]
pub fn lb_post_bind4(ctx: SockContext) -> i32 {
    post_bind(&ctx)
}

#[cgroup_sock(post_bind6)]
pub fn lb_post_bind6(ctx: SockContext) -> i32 {
    post_bind(&ctx)
}
