//! Direct server return for IPv4 (a frontend's `svc_flags::DSR`, for
//! externalTrafficPolicy Cluster): the node a flow arrives at (node A)
//! DNATs it to a backend on another node (node B) but keeps the client's
//! address, and tells node B the frontend in an IPv4 option after the
//! header: type 0x9a (copied into fragments; the number Cilium uses), length
//! 8, the frontend port and address. Node B's ingress program records the
//! flow's reply translation (backend -> client becomes frontend -> client)
//! in its NAT table, strips the option and delivers the packet; the
//! backend's replies leave node B straight to the client, rewritten by its
//! egress program, and never pass node A.
//!
//! The option costs 8 bytes: a packet that no longer fits the route's MTU
//! is answered by node A with "fragmentation needed" for 8 bytes less
//! (TCP's path MTU discovery then sends smaller segments), GSO packets get
//! an 8-byte smaller segment size. IPv4 fragments carry the option each
//! (node A adds it to every fragment of the flow; node B strips it); node B
//! records the flow from the first fragment.
use aya_ebpf::{
    bindings::{__sk_buff, BPF_ANY, TC_ACT_OK},
    programs::TcContext,
};
use lb_common::{NatEntry, NatKey, NodePortKey, SCOPE_ALL, SvcKey, nat_flags, stats, svc_flags};

use super::{A4, ACT_TRANSLATED, Buf, ETH_HLEN, LB4_NAT, csum_add, csum_fold, ld, load_exact, note, parse};
use crate::lb::{self, Family, V4};

pub const OPT_TYPE: u8 = 0x9a;
pub const OPT_LEN: usize = 8;
/// bpf_skb_adjust_room's mode: room between the L3 and L4 headers.
const BPF_ADJ_ROOM_NET: u32 = 0;

/// An IPv4 header with exactly our option (IHL 7).
#[inline(always)]
pub fn carries_option(ctx: &TcContext) -> bool {
    ld::<[u8; 2]>(ctx, ETH_HLEN).is_ok_and(|v| v[0] == 0x47) && ld::<[u8; 2]>(ctx, ETH_HLEN + 20).is_ok_and(|o| o == [OPT_TYPE, OPT_LEN as u8])
}

/// Recompute the IPv4 header checksum of the `N`-byte header in `b`.
#[inline(always)]
fn fix_csum<const N: usize>(b: &mut Buf<N>) {
    b.0[10] = 0;
    b.0[11] = 0;
    let c = csum_fold(csum_add(b.0.as_ptr(), N as u32, 0));
    b.0[10..12].copy_from_slice(&c.to_ne_bytes());
}

/// Node A: insert the option naming the frontend `addr:port` into the
/// (translated) packet. Returns ACT_TRANSLATED, or TC_ACT_SHOT.
#[inline(never)]
pub fn add_option(skb: *mut __sk_buff, addr: A4, port: u16) -> i32 {
    let ctx = &TcContext::new(skb);
    let mut h = Buf([0u8; 20]);
    if load_exact(ctx, ETH_HLEN, h.0.as_mut_ptr(), 20).is_err() || h.0[0] != 0x45 {
        // The client sent IP options of its own: no room for ours.
        lb::event(stats::NAT_DROPPED);
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    if ctx.adjust_room(OPT_LEN as i32, BPF_ADJ_ROOM_NET, 0).is_err() {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    let mut b = Buf([0u8; 28]);
    b.0[..20].copy_from_slice(&h.0);
    b.0[0] = 0x47;
    let len = u16::from_be_bytes([h.0[2], h.0[3]]) + OPT_LEN as u16;
    b.0[2..4].copy_from_slice(&len.to_be_bytes());
    b.0[20] = OPT_TYPE;
    b.0[21] = OPT_LEN as u8;
    b.0[22..24].copy_from_slice(&port.to_be_bytes());
    b.0[24..28].copy_from_slice(&addr);
    fix_csum(&mut b);
    if ctx.store(ETH_HLEN, &b.0, 0).is_err() {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    lb::event(stats::DSR_SENT);
    ACT_TRANSLATED
}

/// Whether `addr:port` is a frontend outside traffic may use here: an
/// external frontend, or a NodePort (of another node's address: the
/// option names the address the client used).
#[inline(always)]
fn known_frontend(addr: A4, port: u16, proto: u8) -> bool {
    if V4::svc(&SvcKey::new(addr, port, proto, SCOPE_ALL, 0)).is_some_and(|f| f.flags & svc_flags::EXTERNAL != 0) {
        return true;
    }
    crate::sock::LB_NODEPORTS.get_ptr(&NodePortKey { port, proto, _pad: 0 }).is_some()
}

/// Node B: a packet of a DSR flow. Record (or refresh) the flow's reply
/// translation, strip the option, and let the packet on. Returns
/// ACT_TRANSLATED (so it is forwarded like a translated packet), TC_ACT_OK
/// for an option naming no frontend of ours (left as it is: the stack
/// ignores options it does not know), or TC_ACT_SHOT.
#[inline(never)]
pub fn receive(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(p) = parse::<V4>(ctx) else { return TC_ACT_OK };
    let mut b = Buf([0u8; 28]);
    if load_exact(ctx, ETH_HLEN, b.0.as_mut_ptr(), 28).is_err() {
        return TC_ACT_OK;
    }
    let port = u16::from_be_bytes([b.0[22], b.0[23]]);
    let addr: A4 = [b.0[24], b.0[25], b.0[26], b.0[27]];
    if !known_frontend(addr, port, p.proto) {
        return TC_ACT_OK;
    }
    if !p.later {
        // The reply tuple: backend -> client.
        let key = NatKey { saddr: p.daddr, daddr: p.saddr, sport: p.dport, dport: p.sport, proto: p.proto, _pad: [0; 3] };
        match LB4_NAT.get_ptr_mut(&key) {
            // SAFETY: a map value, alive for this program run; plain integers.
            Some(e) if unsafe { (*e).to_saddr == addr && (*e).to_sport == port && (*e).flags & nat_flags::DSR != 0 } => {
                // The client's packet keeps the entry alive and notes its
                // FIN / RST; only the backend's own packets (on egress)
                // mark it SEEN, so spoofed options cannot keep entries long.
                note(e, p.tcp_flags, 0);
            }
            _ => {
                // SAFETY: plain helper.
                let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() };
                let v = NatEntry {
                    to_saddr: addr,
                    to_daddr: p.saddr,
                    to_sport: port,
                    to_dport: p.sport,
                    flags: nat_flags::REPLY | nat_flags::DSR,
                    state: 0,
                    rev_nat_id: 0,
                    created_ns: now,
                    last_seen_ns: now,
                };
                if LB4_NAT.insert(&key, &v, BPF_ANY as u64).is_err() {
                    lb::event(stats::NAT_FAILED);
                    return aya_ebpf::bindings::TC_ACT_SHOT;
                }
            }
        }
    }
    // Strip the option: the 8 bytes after the fixed header.
    let mut h = Buf([0u8; 20]);
    h.0.copy_from_slice(&b.0[..20]);
    h.0[0] = 0x45;
    let len = u16::from_be_bytes([b.0[2], b.0[3]]).wrapping_sub(OPT_LEN as u16);
    h.0[2..4].copy_from_slice(&len.to_be_bytes());
    fix_csum(&mut h);
    if ctx.adjust_room(-(OPT_LEN as i32), BPF_ADJ_ROOM_NET, 0).is_err() || ctx.store(ETH_HLEN, &h.0, 0).is_err() {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    lb::event(stats::DSR_RECEIVED);
    ACT_TRANSLATED
}
