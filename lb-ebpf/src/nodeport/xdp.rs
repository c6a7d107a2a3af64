//! XDP acceleration (`lb-agent run --nodeport-acceleration xdp`): the
//! packets of established SNATed outside flows, both directions, are
//! translated and sent back out of the device they arrived on (XDP_TX)
//! before the kernel builds an skb for them: no TC, no routing, no
//! netfilter, no qdisc. The program shares the NAT table with the TC
//! programs and passes everything else up to them untouched:
//! - a flow's first packet (a TCP SYN, a new UDP flow: the TC program
//!   picks the backend and claims the SNAT port), RSTs and SYNs of known
//!   flows aside, ICMP, fragments, IPv4 options, IPv6 extension headers;
//! - a header the stack would drop (a bad IPv4 header checksum, an IP
//!   length beyond the frame or cutting the L4 header): TC leaves it to
//!   the stack, untranslated and counted nowhere in the flow;
//! - flows to backends on this node, DSR flows;
//! - a flow whose backend left (STALE: TC ends it);
//! - a frame for another host's MAC (the stack drops it);
//! - a packet whose TTL runs out here, or that the route lookup does not
//!   send back out of the same device with a known neighbour (another
//!   device, local delivery, too big for the MTU or for a route's MTU the
//!   lookup does not see: TC and the stack answer as they always have).
//!
//! The checksums are updated in the packet by RFC 1624 arithmetic: XDP
//! sees the bytes only, so it needs the complete checksums a NIC receives
//! from the wire (a veth peer sending partial checksums would corrupt them:
//! see the README).
use aya_ebpf::{
    bindings::{bpf_fib_lookup, xdp_md, xdp_action::{XDP_PASS, XDP_TX}, BPF_FIB_LKUP_RET_SUCCESS},
    btf_maps::HashMap,
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_xdp_get_buff_len},
    macros::{btf_map, xdp},
    programs::XdpContext,
};
use lb_common::{FAMILY_V4, NatEntry, NatKey, PROTO_TCP, PROTO_UDP, nat_flags, nat_state, stats, xdp_dev};

/// Devices that send back out with a redirect (veth), by ifindex; written
/// by the agent when it attaches the program.
#[btf_map]
static LB_XDP_DEVS: HashMap<u32, u32, { xdp_dev::CAPACITY as usize }> = HashMap::new();

use super::{E4, E6, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, Net, TCP_ACK, TCP_RST, TCP_SYN, addr_diff, packet_stats, touch, word_diff};
use crate::lb;

/// The packet's bounds, read once per packet (LLVM emits shifts on a
/// second read of the data pointer, which the verifier refuses).
#[derive(Clone, Copy)]
struct Frame {
    start: usize,
    end: usize,
}

impl Frame {
    #[inline(always)]
    fn new(ctx: &XdpContext) -> Self {
        Frame { start: ctx.data(), end: ctx.data_end() }
    }

    /// A pointer to a `T` at `off` in the packet, if it lies within it.
    #[inline(always)]
    fn at<T>(self, off: usize) -> Option<*mut T> {
        if self.start + off + size_of::<T>() > self.end {
            return None;
        }
        Some((self.start + off) as *mut T)
    }

    #[inline(always)]
    fn get<T: Copy>(self, off: usize) -> Option<T> {
        // SAFETY: within the packet, checked by `at`.
        self.at::<T>(off).map(|p| unsafe { p.read_unaligned() })
    }

    #[inline(always)]
    fn put<T>(self, off: usize, v: T) {
        if let Some(p) = self.at::<T>(off) {
            // SAFETY: within the packet, checked by `at`.
            unsafe { p.write_unaligned(v) }
        }
    }
}

/// The checksum `check` (as in the packet) after the covered words changed
/// by `diff` (RFC 1624, eqn. 3: HC' = ~(~HC + ~m + m')).
#[inline(always)]
fn fix(check: u16, diff: u32) -> u16 {
    let mut s = (!check) as u32 + diff;
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    !(s as u16)
}

/// Where L4 starts in a packet XDP translates (no IPv4 options, not a
/// fragment; no IPv6 extension headers), and its protocol. `len`: the
/// frame's length. The headers must hold as the TC program's `parse`
/// has them hold (else TC passes the packet to the stack, which drops
/// it): an IPv4 header checksum that adds up, an IP length within the
/// frame (not 0: a jumbogram's or BIG TCP's, which XDP never sees whole)
/// that holds the L4 header (TCP's 20 bytes, UDP's 8).
#[inline(always)]
fn l4<F: Net>(pkt: Frame, len: usize) -> Option<(usize, u8)> {
    let ip_len = if F::ID == FAMILY_V4 {
        let h = pkt.get::<[u32; 5]>(ETH_HLEN)?;
        let b0 = h[0].to_ne_bytes();
        let frag = u16::from_be_bytes([h[1].to_ne_bytes()[2], h[1].to_ne_bytes()[3]]);
        if b0[0] != 0x45 || frag & 0x3fff != 0 {
            return None;
        }
        let mut sum: u64 = 0;
        for w in h {
            sum += (w & 0xffff) as u64 + (w >> 16) as u64;
        }
        sum = (sum & 0xffff) + (sum >> 16);
        sum = (sum & 0xffff) + (sum >> 16);
        if sum != 0xffff {
            return None;
        }
        u16::from_be_bytes([b0[2], b0[3]]) as usize
    } else {
        let h = pkt.get::<[u8; 6]>(ETH_HLEN)?;
        if h[0] >> 4 != 6 {
            return None;
        }
        F::IH + u16::from_be_bytes([h[4], h[5]]) as usize
    };
    let [proto, _] = pkt.get::<[u8; 2]>(ETH_HLEN + F::PROTO_OFF)?;
    let hdr = if proto == PROTO_TCP { 20 } else { 8 };
    if ip_len < F::IH + hdr || ETH_HLEN + ip_len > len {
        return None;
    }
    Some((ETH_HLEN + F::IH, proto))
}

/// Offset of the TTL / hop limit.
#[inline(always)]
fn ttl_off<F: Net>() -> usize {
    ETH_HLEN + if F::ID == FAMILY_V4 { 8 } else { 7 }
}

/// One family's packet: is it one of a flow XDP sends on? (Its own BPF
/// function: each family's keys and route lookup get the whole stack.)
#[inline(never)]
fn run<F: Net>(md: *mut xdp_md) -> u32 {
    let pkt = Frame::new(&XdpContext::new(md));
    // SAFETY: a plain helper on this program's own context.
    let len = unsafe { bpf_xdp_get_buff_len(md) } as usize;
    let Some((l4, proto)) = l4::<F>(pkt, len) else { return XDP_PASS };
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return XDP_PASS;
    }
    let tcp_flags = if proto == PROTO_TCP { pkt.get::<[u8; 2]>(l4 + 13).map_or(0, |b| b[0]) } else { 0 };
    // One at a time: LLVM merges a tuple of Options into registers the
    // verifier sees unset on some paths.
    let Some(saddr) = pkt.get::<F::A>(F::SRC) else { return XDP_PASS };
    let Some(daddr) = pkt.get::<F::A>(F::DST) else { return XDP_PASS };
    let Some(ports) = pkt.get::<[u16; 2]>(l4) else { return XDP_PASS };
    let Some([ttl, _]) = pkt.get::<[u8; 2]>(ttl_off::<F>()) else { return XDP_PASS };
    let key = NatKey { saddr, daddr, sport: u16::from_be(ports[0]), dport: u16::from_be(ports[1]), proto, _pad: [0; 3] };
    let Some(e) = F::nat_get(&key) else { return XDP_PASS };
    // SAFETY: a map value, alive for this program run (RCU); one-byte reads.
    let (flags, state) = unsafe { ((*e).flags, (*e).state) };
    // SNATed flows only: the reply side, and the client side while the flow
    // stands (a SYN or RST may start, reuse or end it: TC decides).
    if flags & (nat_flags::SNAT | nat_flags::DSR) != nat_flags::SNAT {
        return XDP_PASS;
    }
    if flags & nat_flags::REPLY == 0
        && (state & nat_state::STALE != 0 || (tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN) || tcp_flags & TCP_RST != 0)
    {
        return XDP_PASS;
    }
    if ttl <= 1 {
        return XDP_PASS;
    }
    send::<F>(md, pkt, e, proto, tcp_flags)
}

/// Translate the packet by entry `e` and send it back out, if the route to
/// its new destination leaves through the device it came in on and the
/// neighbour is known; else pass it up untouched.
#[inline(always)]
fn send<F: Net>(md: *mut xdp_md, pkt: Frame, e: *mut NatEntry<F::A>, proto: u8, tcp_flags: u8) -> u32 {
    // A constant: `l4` took no IPv4 options or IPv6 extension headers.
    let l4 = ETH_HLEN + F::IH;
    let check_off = l4 + if proto == PROTO_TCP { 16 } else { 6 };
    // IPv4: the TTL's word and the header checksum (IPv6 has none).
    let Some(src) = pkt.at::<F::A>(F::SRC) else { return XDP_PASS };
    let Some(dst) = pkt.at::<F::A>(F::DST) else { return XDP_PASS };
    let Some(ports) = pkt.get::<[u16; 2]>(l4) else { return XDP_PASS };
    let Some(check) = pkt.get::<u16>(check_off) else { return XDP_PASS };
    let Some([ttl_word, hc]) = pkt.get::<[u16; 2]>(ETH_HLEN + 8) else { return XDP_PASS };
    let Some([hop, _]) = pkt.get::<[u8; 2]>(ttl_off::<F>()) else { return XDP_PASS };
    // SAFETY: a map value, alive for this program run (RCU).
    let entry = unsafe { &*e };
    // The IP packet's length, from its header.
    let Some(ip_len) = pkt.get::<u16>(ETH_HLEN + if F::ID == FAMILY_V4 { 2 } else { 4 }) else { return XDP_PASS };
    let ip_len = u16::from_be(ip_len) as u32 + if F::ID == FAMILY_V4 { 0 } else { 40 };
    let len = ip_len + ETH_HLEN as u32;
    // SAFETY: an all-zero bpf_fib_lookup is a valid value.
    let mut f: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    // SAFETY: the context's own field.
    let ifindex = unsafe { (*md).ingress_ifindex };
    f.family = F::AF;
    f.l4_protocol = proto;
    f.sport = entry.to_sport.to_be();
    f.dport = entry.to_dport.to_be();
    f.__bindgen_anon_1.tot_len = ip_len as u16;
    f.ifindex = ifindex;
    F::fib_addrs(&mut f, entry.to_saddr, entry.to_daddr);
    // SAFETY: our own context and a stack value of the right size.
    let rc = unsafe { fib_lookup(md.cast(), &mut f, size_of::<bpf_fib_lookup>() as i32, 0) } as u32;
    if rc != BPF_FIB_LKUP_RET_SUCCESS || f.ifindex != ifindex {
        return XDP_PASS;
    }
    // A frame for another host's MAC (flooded, seen in promiscuous mode)
    // is not this node's: up to TC and the stack, which leave it (the
    // lookup's source MAC is the device's own: it sends back out there).
    if pkt.get::<[u8; 6]>(0) != Some(f.smac) {
        return XDP_PASS;
    }
    // Too big for a route's MTU the lookup does not see: TC answers it.
    if ip_len as usize > super::icmp::MTU_CHECK_ABOVE && super::fib::route_mtu::<F>(entry.to_daddr, f.ifindex).is_some_and(|mtu| ip_len > mtu) {
        return XDP_PASS;
    }

    // The packet is ours from here.
    touch(e, tcp_flags);
    let n = (F::BITS / 8) as usize;
    let to_s = &entry.to_saddr as *const F::A as *const u8;
    let to_d = &entry.to_daddr as *const F::A as *const u8;
    let addrs = addr_diff(src as *const u8, to_s, n) + addr_diff(dst as *const u8, to_d, n);
    let (to_sport, to_dport) = (entry.to_sport.to_be(), entry.to_dport.to_be());
    let ports_diff = word_diff(ports[0], to_sport) + word_diff(ports[1], to_dport);
    // A UDP datagram without a checksum (0: IPv4, and IPv6 tunnels, RFC
    // 6935) keeps none, as the TC program's BPF_F_MARK_MANGLED_0 leaves
    // it. A computed 0 is sent as 0xffff (RFC 768).
    if proto == PROTO_TCP || check != 0 {
        let mut c = fix(check, addrs + ports_diff);
        if proto == PROTO_UDP && c == 0 {
            c = 0xffff;
        }
        pkt.put(check_off, c);
    }
    // SAFETY: within the packet (checked by `at`); the entry's addresses.
    unsafe {
        src.write_unaligned(entry.to_saddr);
        dst.write_unaligned(entry.to_daddr);
    }
    pkt.put(l4, [to_sport, to_dport]);
    if F::ID == FAMILY_V4 {
        // TTL and protocol form one word of the header checksum.
        let mut b = ttl_word.to_ne_bytes();
        b[0] = b[0].wrapping_sub(1);
        let new = u16::from_ne_bytes(b);
        pkt.put(ETH_HLEN + 8, new);
        pkt.put(ETH_HLEN + 10, fix(hc, addrs + word_diff(ttl_word, new)));
    } else {
        pkt.put(ttl_off::<F>(), hop.wrapping_sub(1));
    }
    pkt.put(0, f.dmac);
    pkt.put(6, f.smac);
    packet_stats(F::ID, entry.rev_nat_id, len);
    lb::event(stats::FWD_XDP);
    // SAFETY: a map value, read at once.
    if LB_XDP_DEVS.get_ptr(&ifindex).is_some_and(|v| unsafe { *v } & xdp_dev::REDIRECT != 0) {
        // SAFETY: plain helper; XDP_REDIRECT on success.
        return unsafe { bpf_redirect(ifindex, 0) } as u32;
    }
    XDP_TX
}

#[xdp]
pub fn lb_nodeport_xdp(ctx: XdpContext) -> u32 {
    match Frame::new(&ctx).get::<u16>(12).map(u16::from_be) {
        Some(ETH_P_IP) => run::<E4>(ctx.ctx),
        Some(ETH_P_IPV6) => run::<E6>(ctx.ctx),
        _ => XDP_PASS,
    }
}
