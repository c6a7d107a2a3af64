//! cgroup sock_addr hooks: the socket-level load balancer.
//!
//! connect4/6 rewrite a connect to `ClusterIP:port` into a connect to one
//! backend, before any packet exists. sendmsg4/6 do the same per datagram for
//! unconnected UDP. recvmsg4/6 rewrite the source of UDP replies, and
//! getpeername4/6 the peer of a connected socket, back to the ClusterIP.
//!
//! An AF_INET6 socket that connects to a v4-mapped address
//! (`::ffff:a.b.c.d`) runs only the *6 hooks; it is balanced with the IPv4
//! maps, like an AF_INET socket.
use core::ffi::c_void;

use aya_ebpf::{
    btf_maps::HashMap,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    macros::{btf_map, cgroup_sock, cgroup_sock_addr},
    programs::{SockAddrContext, SockContext},
};
use lb_common::{NodePortKey, PROTO_TCP, PROTO_UDP, capacity, stats};

/// The NodePorts in use: processes in the node's network namespace may not
/// bind() them.
#[btf_map]
static LB_NODEPORTS: HashMap<NodePortKey, u8, { capacity::NODEPORTS as usize }, { aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize }> =
    HashMap::new();

const EADDRINUSE: i32 = 98;

use crate::lb::{self, Client, V4, V6, Verdict};

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

/// Translate the destination of a connect (stable = false) or of an
/// unconnected UDP datagram (stable = true: one backend per socket).
#[inline(always)]
fn xlate4(ctx: &SockAddrContext, stable: bool) -> i32 {
    let Some(proto) = proto(ctx) else { return ALLOW };
    let (addr, port) = (ip4(ctx), port(ctx));
    let cookie = cookie(ctx);
    let hash = if stable { Some(lb::mix(cookie)) } else { None };
    match lb::select::<V4>(Client::Sock(ctx.sock_addr.cast::<c_void>()), addr, port, proto, hash, false) {
        Verdict::Pass => ALLOW,
        Verdict::Refuse(errno) => refuse(errno),
        Verdict::Backend { backend, rev_nat_id, .. } => {
            lb::remember4(cookie, &backend, addr, port, rev_nat_id);
            set_ip4(ctx, backend.addr);
            set_port(ctx, backend.port);
            lb::count(stats::TRANSLATED);
            ALLOW
        }
    }
}

#[inline(always)]
fn xlate6(ctx: &SockAddrContext, stable: bool) -> i32 {
    let Some(proto) = proto(ctx) else { return ALLOW };
    let words = ip6_words(ctx);
    let port = port(ctx);
    let cookie = cookie(ctx);
    let hash = if stable { Some(lb::mix(cookie)) } else { None };
    if let Some(addr) = v4_mapped(&words) {
        return match lb::select::<V4>(Client::Sock(ctx.sock_addr.cast::<c_void>()), addr, port, proto, hash, false) {
            Verdict::Pass => ALLOW,
            Verdict::Refuse(errno) => refuse(errno),
            Verdict::Backend { backend, rev_nat_id, .. } => {
                lb::remember4(cookie, &backend, addr, port, rev_nat_id);
                set_ip6_word(ctx, 3, u32::from_ne_bytes(backend.addr));
                set_port(ctx, backend.port);
                lb::count(stats::TRANSLATED);
                ALLOW
            }
        };
    }
    let addr = bytes16(&words);
    match lb::select::<V6>(Client::Sock(ctx.sock_addr.cast::<c_void>()), addr, port, proto, hash, false) {
        Verdict::Pass => ALLOW,
        Verdict::Refuse(errno) => refuse(errno),
        Verdict::Backend { backend, rev_nat_id, .. } => {
            lb::remember6(cookie, &backend, addr, port, rev_nat_id);
            set_ip6(ctx, backend.addr);
            set_port(ctx, backend.port);
            lb::count(stats::TRANSLATED);
            ALLOW
        }
    }
}

/// Rewrite a backend address the socket sees (reply source, peer) back to
/// the frontend it connected to.
#[inline(always)]
fn reverse4(ctx: &SockAddrContext) {
    if let Some((a, p)) = lb::reverse4(cookie(ctx), ip4(ctx), port(ctx)) {
        set_ip4(ctx, a);
        set_port(ctx, p);
        lb::count(stats::REVERSED);
    }
}

#[inline(always)]
fn reverse6(ctx: &SockAddrContext) {
    let words = ip6_words(ctx);
    let (cookie, port) = (cookie(ctx), port(ctx));
    if let Some(addr) = v4_mapped(&words) {
        if let Some((a, p)) = lb::reverse4(cookie, addr, port) {
            set_ip6_word(ctx, 3, u32::from_ne_bytes(a));
            set_port(ctx, p);
            lb::count(stats::REVERSED);
        }
    } else if let Some((a, p)) = lb::reverse6(cookie, bytes16(&words), port) {
        set_ip6(ctx, a);
        set_port(ctx, p);
        lb::count(stats::REVERSED);
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
    // Unconnected UDP: every datagram of one socket goes to the same backend,
    // so that its replies come back from one place.
    xlate4(&ctx, true)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn lb_sendmsg6(ctx: SockAddrContext) -> i32 {
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
            lb::count(stats::BIND_REFUSED);
            refuse(EADDRINUSE)
        }
        _ => ALLOW,
    }
}

#[cgroup_sock(post_bind4)]
pub fn lb_post_bind4(ctx: SockContext) -> i32 {
    post_bind(&ctx)
}

#[cgroup_sock(post_bind6)]
pub fn lb_post_bind6(ctx: SockContext) -> i32 {
    post_bind(&ctx)
}
