//! cgroup sock_addr hooks: the socket-level load balancer.
//!
//! connect4 rewrites a connect to `ClusterIP:port` into a connect to one
//! backend, before any packet exists. sendmsg4 does the same per datagram for
//! unconnected UDP, and recvmsg4 rewrites the source of replies back to the
//! ClusterIP.
use aya_ebpf::{
    helpers::{bpf_get_socket_cookie, bpf_set_retval},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use lb_common::{PROTO_TCP, PROTO_UDP, stats};

use crate::lb::{self, Verdict};

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
fn dst4(ctx: &SockAddrContext) -> ([u8; 4], u16) {
    // SAFETY: reads of the context fields this program type may read.
    unsafe {
        let ip = core::ptr::read_volatile(&(*ctx.sock_addr).user_ip4);
        let port = core::ptr::read_volatile(&(*ctx.sock_addr).user_port);
        (ip.to_ne_bytes(), u16::from_be(port as u16))
    }
}

#[inline(always)]
fn set_dst4(ctx: &SockAddrContext, addr: [u8; 4], port: u16) {
    // SAFETY: writes of the context fields this program type may write.
    unsafe {
        core::ptr::write_volatile(&mut (*ctx.sock_addr).user_ip4, u32::from_ne_bytes(addr));
        core::ptr::write_volatile(&mut (*ctx.sock_addr).user_port, port.to_be() as u32);
    }
}

#[inline(always)]
fn refuse(errno: i32) -> i32 {
    // SAFETY: plain helper; makes the syscall fail with -errno instead of EPERM.
    unsafe { bpf_set_retval(-errno) };
    REJECT
}

#[inline(always)]
fn xlate4(ctx: &SockAddrContext, stable: bool) -> i32 {
    let Some(proto) = proto(ctx) else { return ALLOW };
    let (addr, port) = dst4(ctx);
    // SAFETY: helper valid for sock_addr programs.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    let hash = if stable { Some(lb::mix(cookie)) } else { None };
    match lb::select4(addr, port, proto, hash) {
        Verdict::Pass => ALLOW,
        Verdict::Refuse(errno) => refuse(errno),
        Verdict::Backend { backend, rev_nat_id } => {
            lb::remember4(cookie, &backend, addr, port, rev_nat_id);
            set_dst4(ctx, backend.addr, backend.port);
            lb::count(stats::TRANSLATED);
            ALLOW
        }
    }
}

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    xlate4(&ctx, false)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    // Unconnected UDP: every datagram of one socket goes to the same backend,
    // so that its replies come back from one place.
    xlate4(&ctx, true)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    if proto(&ctx) != Some(PROTO_UDP) {
        return ALLOW;
    }
    let (addr, port) = dst4(&ctx);
    // SAFETY: helper valid for sock_addr programs.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    if let Some((faddr, fport)) = lb::reverse4(cookie, addr, port) {
        set_dst4(&ctx, faddr, fport);
        lb::count(stats::REVERSED);
    }
    // recvmsg hooks must return 1.
    ALLOW
}
