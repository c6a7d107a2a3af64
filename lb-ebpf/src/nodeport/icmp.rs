//! ICMP for translated flows, as conntrack's NAT does it for kube-proxy:
//!
//! - an ICMP error about a packet of a translated flow (fragmentation
//!   needed / packet too big, unreachable, time exceeded, parameter problem)
//!   is translated too: the quoted packet back to what its sender sent (its
//!   IP header checksum recomputed, its L4 checksum fixed when quoted), the
//!   outer destination to that sender, the outer source to the frontend
//!   where the flow's translation changed the source (as conntrack does),
//!   and the ICMP checksum fixed for all of it;
//! - a packet of a SNATed flow that is too big for the path to its backend
//!   gets "fragmentation needed" / "packet too big" back to the client, from
//!   the frontend: the stack would send it to the SNAT address (this node),
//!   where nobody listens, and path MTU discovery through the NodePort would
//!   stall. Likewise "time exceeded" when its TTL runs out here. And the
//!   same for a backend's reply too big for the path to the client (a
//!   narrower link towards the clients than towards the pods): to the
//!   backend, from the SNAT address, where the stack would tell the
//!   frontend (this node) and the backend would never learn.
//! - an error about a reply of a Maglev DSR flow that reaches a node
//!   without the flow (ECMP spreading the frontend over the nodes) goes on
//!   to the backend Maglev picks for the flow, as the flow's node does.
use aya_ebpf::{
    bindings::{__sk_buff, BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_OK, TC_ACT_SHOT, bpf_fib_lookup},
    helpers::{bpf_csum_diff, bpf_fib_lookup as fib_lookup},
    programs::TcContext,
};
use lb_common::{NatEntry, NatKey, PROTO_TCP, PROTO_UDP, SCOPE_ALL, SvcKey, nat_flags, stats, svc_flags};

use super::{ACT_ICMP_NO_FLOW, Buf, Net, Pkt, bounce, load_exact};
use crate::lb;

/// Packets up to this size (IP header and all) fit every IPv6 path and
/// skip the route MTU lookup.
pub const MTU_CHECK_ABOVE: usize = 1280;

/// `!c + d` folded and complemented: checksum `c` after the data it covers
/// changed by `d` (a bpf_csum_diff result).
#[inline(always)]
fn csum_update(c: u16, d: u32) -> u16 {
    let mut s = (!c) as u64 + d as u64;
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    !(s as u16)
}

/// The sum of `to` minus the sum of `from` (`len` bytes each, a multiple of
/// 4, at 4-aligned offsets of stack buffers), added to `seed`.
#[inline(always)]
fn diff(from: *const u8, to: *const u8, len: u32, seed: u32) -> u32 {
    // SAFETY: both point to at least len readable bytes of stack buffers.
    unsafe { bpf_csum_diff(from as *mut u32, len, to as *mut u32, len, seed) as u32 }
}

#[inline(always)]
fn read_addr<A: Copy>(b: &[u8; 60], off: usize) -> A {
    // SAFETY: callers pass offsets of whole addresses inside the buffer.
    unsafe { core::ptr::read_unaligned(b.as_ptr().add(off) as *const A) }
}

#[inline(always)]
fn write_addr<A: Copy>(b: &mut [u8; 60], off: usize, a: A) {
    // SAFETY: callers pass offsets of whole addresses inside the buffer.
    unsafe { core::ptr::write_unaligned(b.as_mut_ptr().add(off) as *mut A, a) }
}

/// An ICMP packet on the NodePort interface (`ingress` or egress): if it
/// is an error about a packet of one of our flows (whose entry has the
/// `nat_flags` in `need`), translate it.
#[inline(never)]
pub fn translate_error<F: Net>(skb: *mut __sk_buff, ingress: bool, maglev: bool, need: u8) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some((l4, _)) = F::l4(ctx) else { return TC_ACT_OK };
    let Ok(ty) = ctx.load::<u8>(l4) else { return TC_ACT_OK };
    if !F::icmp_is_error(ty) {
        return TC_ACT_OK;
    }
    // The quote: the IP header, then at least the first 8 bytes of L4 (the
    // ports, and a UDP checksum); a TCP checksum only if 20 are there.
    let quoted = (ctx.len() as usize).saturating_sub(l4 + 8 + F::IH);
    // An IPv6 datagram's first fragment: a fragment header between its
    // IPv6 and UDP headers (a router's "packet too big" about a large
    // answer a pod sent in fragments).
    if F::IH == 40 && quoted >= 16 && ctx.load::<u8>(l4 + 8 + 6).ok() == Some(super::IPV6_FRAGMENT) {
        return translate::<F, 8, 8>(ctx, l4, ingress, maglev, need);
    }
    if quoted >= 20 {
        translate::<F, 20, 0>(ctx, l4, ingress, maglev, need)
    } else if quoted >= 8 {
        translate::<F, 8, 0>(ctx, l4, ingress, maglev, need)
    } else {
        TC_ACT_OK
    }
}

/// Translate an error quoting `Q` bytes of L4 header after the IP header
/// and `FH` bytes of IPv6 fragment header (0: none).
#[inline(always)]
fn translate<F: Net, const Q: usize, const FH: usize>(ctx: &TcContext, l4: usize, ingress: bool, maglev: bool, need: u8) -> i32 {
    let ih = F::IH + FH;
    let n = ih + Q;
    let inner = l4 + 8;
    let (src, dst) = (F::SRC - F::L2, F::DST - F::L2);
    let alen = F::DST - F::SRC;
    let mut old = Buf([0u8; 60]);
    if load_exact(ctx, inner, old.0.as_mut_ptr(), n as u32).is_err() || !F::inner_ok(&old.0) {
        return TC_ACT_OK;
    }
    // With a fragment header: the first fragment only (a later one
    // carries no ports), its next header the L4 protocol.
    if FH != 0 && (old.0[F::IH + 2] != 0 || old.0[F::IH + 3] & 0xf8 != 0) {
        return TC_ACT_OK;
    }
    let proto = if FH != 0 { old.0[F::IH] } else { old.0[F::PROTO_OFF] };
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return TC_ACT_OK;
    }
    let isrc: F::A = read_addr(&old.0, src);
    let idst: F::A = read_addr(&old.0, dst);
    let isport = u16::from_be_bytes([old.0[ih], old.0[ih + 1]]);
    let idport = u16::from_be_bytes([old.0[ih + 2], old.0[ih + 3]]);
    // The quoted packet went out translated; the flow's entry for the
    // other direction has the reverse of its tuple.
    let key = NatKey { saddr: idst, daddr: isrc, sport: idport, dport: isport, proto, _pad: [0; 3] };
    let e: &NatEntry<F::A> = if maglev {
        // The entry maglev_dsr_backend made for this error's flow.
        let Some(sc) = F::scratch() else { return TC_ACT_OK };
        // SAFETY: this CPU's scratch value, filled for this packet.
        unsafe { &(*sc).fwd }
    } else {
        let Some(e) = F::nat_get(&key) else {
            // No flow here: maybe an error about a Maglev DSR flow's
            // reply (the caller's next step), its key in the scratch value.
            if !ingress {
                return TC_ACT_OK;
            }
            let Some(sc) = F::scratch() else { return TC_ACT_OK };
            // SAFETY: this CPU's scratch value.
            unsafe { (*sc).key = key };
            return ACT_ICMP_NO_FLOW;
        };
        // SAFETY: a map value, alive for this program run (RCU).
        let e: &NatEntry<F::A> = unsafe { &*e };
        let (reply, snat) = (e.flags & nat_flags::REPLY != 0, e.flags & nat_flags::SNAT != 0);
        // Errors about SNATed packets and about replies arrive on ingress;
        // errors about packets to local backends leave on egress.
        if ingress != (!reply || snat) || e.flags & need != need {
            return TC_ACT_OK;
        }
        e
    };
    // The quoted packet as its sender sent it: the reverse of what the
    // entry rewrites to.
    let mut new = Buf(old.0);
    write_addr(&mut new.0, src, e.to_daddr);
    write_addr(&mut new.0, dst, e.to_saddr);
    new.0[ih..ih + 2].copy_from_slice(&e.to_dport.to_be_bytes());
    new.0[ih + 2..ih + 4].copy_from_slice(&e.to_sport.to_be_bytes());
    // Its L4 checksum, if quoted (and, for UDP, in use): the pseudo header
    // and the ports changed.
    let csum = ih + if proto == PROTO_TCP { 16 } else { 6 };
    if csum + 2 <= n {
        let c = u16::from_ne_bytes([old.0[csum], old.0[csum + 1]]);
        if proto == PROTO_TCP || c != 0 {
            // SAFETY: offsets of whole, 4-aligned fields inside 60-byte buffers.
            let d = unsafe { diff(old.0.as_ptr().add(src), new.0.as_ptr().add(src), 2 * alen as u32, 0) };
            // SAFETY: as above.
            let d = unsafe { diff(old.0.as_ptr().add(ih), new.0.as_ptr().add(ih), 4, d) };
            let mut c = csum_update(c, d);
            if proto == PROTO_UDP && c == 0 {
                c = 0xffff;
            }
            new.0[csum..csum + 2].copy_from_slice(&c.to_ne_bytes());
        }
    }
    F::inner_fix(&mut new.0);
    // The ICMP checksum covers the quote.
    let d = diff(old.0.as_ptr(), new.0.as_ptr(), n as u32, 0);
    if ctx.l4_csum_replace(l4 + 2, 0, d as u64, 0).is_err() {
        return TC_ACT_SHOT;
    }
    // SAFETY: a stack buffer of at least n bytes; the helper on our own skb.
    let rc = unsafe { aya_ebpf::helpers::bpf_skb_store_bytes(ctx.skb.skb, inner as u32, new.0.as_ptr().cast(), n as u32, 0) };
    if rc != 0 {
        return TC_ACT_SHOT;
    }
    // The outer header: to the quoted packet's sender; from the frontend
    // where the flow's translation changed the source (conntrack's rule).
    let icmp6 = F::ICMP != super::PROTO_ICMP;
    let (Ok(osrc), Ok(odst)) = (ctx.load::<F::A>(F::SRC), ctx.load::<F::A>(F::DST)) else { return TC_ACT_SHOT };
    if odst != e.to_daddr && F::set_addr(ctx, F::DST, l4 + 2, icmp6, 0, odst, e.to_daddr).is_err() {
        return TC_ACT_SHOT;
    }
    if e.to_saddr != key.saddr && osrc != e.to_saddr && F::set_addr(ctx, F::SRC, l4 + 2, icmp6, 0, osrc, e.to_saddr).is_err() {
        return TC_ACT_SHOT;
    }
    lb::event(if maglev { stats::NAT_ICMP_MAGLEV } else { stats::NAT_ICMP });
    // An error for a client is forwarded by the stack (kube-proxy's
    // KUBE-FORWARD passes it as RELATED).
    if ingress {
        super::fib::mark_for_stack(ctx.skb.skb, lb::node_flags(), e.flags & (nat_flags::SNAT | nat_flags::DSR) != 0, false);
    }
    TC_ACT_OK
}

/// After translate_error found no flow for an ICMP error on ingress (its
/// key, client to frontend, in the scratch value): if the frontend is
/// external and uses Maglev and DSR (and no session affinity, which is per
/// node), the flow's entry towards the backend Maglev picks for it, as
/// every node running lb picks it, into the scratch value; then
/// translate_error with `maglev` sends the error on to that backend.
/// Such an error is about a DSR reply sent to the frontend and routed to
/// a node that does not hold the flow (a router spreading the frontend
/// over the nodes by ECMP). False: not such a frontend, or no backend.
#[inline(never)]
pub fn maglev_dsr_backend<F: Net>() -> bool {
    let Some(sc) = F::scratch() else { return false };
    // SAFETY: this CPU's scratch value, its key set by translate_error.
    let sc = unsafe { &mut *sc };
    let key = &sc.key;
    let want = svc_flags::EXTERNAL | svc_flags::MAGLEV | svc_flags::DSR;
    let Some(front) = F::svc(&SvcKey::new(key.daddr, key.dport, key.proto, SCOPE_ALL, 0)) else { return false };
    if front.flags & want != want || front.flags & (svc_flags::AFFINITY | svc_flags::EXT_LOCAL) != 0 {
        return false;
    }
    let p = Pkt { l4: 0, proto: key.proto, saddr: key.saddr, daddr: key.daddr, sport: key.sport, dport: key.dport, tcp_flags: 0, later: false };
    let id = lb::maglev_pick::<F>(front.rev_nat_id, key.proto, SCOPE_ALL, super::flow_hash::<F>(&p));
    let Some(b) = (if id == 0 { None } else { F::backend(id) }) else { return false };
    sc.fwd.to_saddr = key.saddr;
    sc.fwd.to_sport = key.sport;
    sc.fwd.to_daddr = b.addr;
    sc.fwd.to_dport = b.port;
    sc.fwd.flags = 0;
    true
}

/// The MTU of the route the translated packet `p` of flow `e` will take,
/// if the packet does not fit it and may not be fragmented on the way;
/// else 0.
#[inline(never)]
pub fn path_mtu<F: Net>(skb: *mut __sk_buff, p: &Pkt<F::A>, e: &NatEntry<F::A>, extra: u32) -> u32 {
    let ctx = &TcContext::new(skb);
    if F::may_fragment(ctx) {
        return 0;
    }
    // SAFETY: fields of our own skb.
    let (len, gso, ifindex) = unsafe { ((*skb).len, (*skb).gso_size, (*skb).ifindex) };
    // A GSO packet leaves as segments: each must fit.
    let mut need = len.saturating_sub(F::L2 as u32) + extra;
    if gso != 0 {
        let l4_hdr = if p.proto == PROTO_TCP {
            match ctx.load::<u8>(p.l4 + 12) {
                Ok(b) => (b >> 4) as u32 * 4,
                Err(_) => return 0,
            }
        } else {
            8
        };
        need = (p.l4 - F::L2) as u32 + l4_hdr + gso + extra;
    }
    if need as usize <= MTU_CHECK_ABOVE || need > u16::MAX as u32 {
        return 0;
    }
    // SAFETY: an all-zero bpf_fib_lookup is a valid value.
    let mut f: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    f.family = F::AF;
    f.l4_protocol = p.proto;
    f.sport = e.to_sport.to_be();
    f.dport = e.to_dport.to_be();
    f.__bindgen_anon_1.tot_len = need as u16;
    f.ifindex = ifindex;
    F::fib_addrs(&mut f, e.to_saddr, e.to_daddr);
    // SAFETY: our own skb and a stack value of the right size.
    let rc = unsafe { fib_lookup(skb.cast(), &mut f, size_of::<bpf_fib_lookup>() as i32, 0) };
    if rc as u32 == BPF_FIB_LKUP_RET_FRAG_NEEDED {
        // SAFETY: the kernel set mtu_result (a union with tot_len).
        return unsafe { f.__bindgen_anon_1.mtu_result } as u32;
    }
    // A route's MTU the lookup does not see (not locked): the stack would
    // answer the packet, to the SNAT address.
    if rc as u32 == BPF_FIB_LKUP_RET_SUCCESS || rc as u32 == BPF_FIB_LKUP_RET_NO_NEIGH {
        return super::fib::route_mtu::<F>(e.to_daddr, f.ifindex).filter(|mtu| need > *mtu).unwrap_or(0);
    }
    0
}

/// Answer a packet too big for the path to its backend (ACT_TOO_BIG): an
/// ICMP "fragmentation needed" / ICMPv6 "packet too big" to the client,
/// from the frontend, quoting the packet as the client sent it.
#[inline(never)]
pub fn too_big<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(sc) = F::scratch() else { return TC_ACT_SHOT };
    // SAFETY: this CPU's scratch value, set by ingress for this packet.
    let mtu = unsafe { (*sc).mtu };
    lb::event(stats::NAT_TOO_BIG);
    let Some((l4, _)) = F::l4(ctx) else { return TC_ACT_SHOT };
    match F::icmp_reply(ctx, F::TOO_BIG, mtu, l4) {
        Ok(()) => bounce(ctx),
        Err(_) => TC_ACT_SHOT,
    }
}

/// Answer a SNATed packet whose TTL runs out here (ACT_TIME_EXCEEDED):
/// the stack would tell the SNAT address, this node. Tell the client, from
/// the frontend, as kube-proxy's node does.
#[inline(never)]
pub fn time_exceeded<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    lb::event(stats::NAT_DROPPED);
    let Some((l4, _)) = F::l4(ctx) else { return TC_ACT_SHOT };
    if !super::icmp_allowed() {
        return TC_ACT_SHOT;
    }
    match F::icmp_reply(ctx, F::TIME_EXCEEDED, 0, l4) {
        Ok(()) => bounce(ctx),
        Err(_) => TC_ACT_SHOT,
    }
}
