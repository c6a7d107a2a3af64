//! Forwarding in BPF (`lb-agent run --bpf-forward`): a packet the ingress
//! program has translated is sent on from here instead of through the
//! stack's routing, netfilter FORWARD and neighbour output: a FIB lookup
//! for its new destination, the TTL / hop limit decremented as a router
//! does, the MACs set, and a redirect to the egress device. The kernel's
//! neighbour layer resolves a next hop the lookup does not know yet
//! (`bpf_redirect_neigh`), and builds the link-layer header of a packet
//! that arrived on an L3 device (WireGuard, IPIP, GRE, TUN: no Ethernet
//! header to set MACs in). Anything else the lookup reports (a local
//! destination, no route, forwarding off on the device, a packet too big
//! for the egress MTU or for a route's MTU the lookup does not see:
//! `route_mtu`) goes to the stack, which answers as it always has, and so
//! do fragments (`forward`).
use aya_ebpf::{
    bindings::{
        __sk_buff, bpf_fib_lookup, bpf_redir_neigh, BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_SKIP_NEIGH, BPF_FIB_LOOKUP_SRC,
        TC_ACT_OK, TC_ACT_SHOT,
    },
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh, bpf_skb_change_head},
    maps::lpm_trie::Key,
    programs::TcContext,
};
use lb_common::{RouteKey, nat_flags, node_flags, stats};

use super::{ACT_ICMP, ACT_TIME_EXCEEDED, ACT_TOO_BIG, ACT_TRANSLATED, ETH_HLEN, Net, icmp, parse, touch_reply, translate};
use crate::lb;

/// A translated packet goes on: forwarded here if the agent asked for
/// forwarding in BPF, else through the stack (marked: `mark_for_stack`).
#[inline(always)]
pub fn send_on<F: Net>(skb: *mut __sk_buff) -> i32 {
    let flags = lb::node_flags();
    let act = if flags & node_flags::BPF_FORWARD != 0 { forward::<F>(skb) } else { TC_ACT_OK };
    if act == TC_ACT_OK {
        mark_for_stack(skb, flags, false, false);
    }
    act
}

/// A packet lb translated goes to the stack, which forwards it: set the
/// mark bit the agent's iptables rule (`LB-FORWARD`, in the FORWARD
/// chain) accepts, so that a FORWARD chain that drops by default (Docker,
/// ufw, a hardened node) passes lb's flows as kube-proxy's KUBE-FORWARD
/// passes its own (its masquerade mark, and conntrack for replies: lb's
/// replies are translated before conntrack sees them, so they carry the
/// mark too). A packet of a SNATed or DSR flow (`untracked`) also gets the
/// notrack bit: conntrack would see only one half of such a flow in each
/// tuple (its replies are translated first, into a tuple of their own) and
/// call the rest INVALID, which rules against INVALID packets drop (the
/// agent's `inet lb` table exempts them where conntrack runs). A client's
/// packet of a flow to a local backend that kube-proxy would masquerade
/// (`masq`: `nat_flags::MASQ`) gets the masquerade bit, for the nat rule
/// in the same table. The other bits of the mark stay.
#[inline(always)]
pub fn mark_for_stack(skb: *mut __sk_buff, flags: u32, untracked: bool, masq: bool) {
    let mut mark = node_flags::mark_of(flags);
    if untracked {
        mark |= node_flags::notrack_of(flags);
    }
    if masq {
        mark |= node_flags::masq_of(flags);
    }
    if mark != 0 {
        // SAFETY: a writable field of our own skb (TC programs may set it).
        unsafe { (*skb).mark |= mark };
    }
}

/// Send the translated packet on to its destination (see the module).
#[inline(never)]
pub fn forward<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    // A datagram's fragments all go to the stack: one the lookup sends
    // there (too big once a DSR option is added) would wait forever for
    // the rest where conntrack runs (it reassembles before it forwards).
    if F::fragment(ctx).is_some() {
        lb::event(stats::FWD_STACK);
        return TC_ACT_OK;
    }
    let Some(p) = parse::<F>(ctx) else { return TC_ACT_OK };
    // A TTL that runs out here: the stack answers "time exceeded".
    if F::ttl(ctx) <= 1 {
        return TC_ACT_OK;
    }
    // SAFETY: an all-zero bpf_fib_lookup is a valid value.
    let mut f: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    let rc = lookup::<F>(skb, &mut f, p.proto, (p.saddr, p.sport), (p.daddr, p.dport));
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        lb::event(stats::FWD_STACK);
        return TC_ACT_OK;
    }
    send::<F>(ctx, &mut f, rc)
}

/// On the pod devices (`lb_pod_ingress`): a reply of a backend on this
/// node to an outside client (or to a DSR flow's client) is translated
/// and sent on from here, so that it skips the stack's forwarding path as
/// the requests do. The lookup comes first, for the translated addresses:
/// what it cannot place goes to the stack untouched, and is translated on
/// its way out by the egress program, as without forwarding in BPF (a
/// packet with the node's own address as its source would not pass the
/// stack's source check on a pod device). Fragments go that way too: the
/// egress program keeps the fragment map for them.
///
/// A reply of a flow masqueraded in BPF (`nat_flags::LOCAL`: to the pod
/// bridge's address, say) has no such way: the stack would deliver it to
/// the node. It is translated and sent on here whatever the flags say
/// (an agent that no longer forwards in BPF keeps the pod programs while
/// such flows live), fragments included (the first one's ports kept for
/// the rest), and what the lookup cannot place is answered as the stack
/// would answer the pod (a TTL that ran out, too big for the path with
/// DF set or over IPv6; a GSO packet is not checked, as the other replies
/// forwarded here are not) or
/// dropped and counted (`stats::NAT_DROPPED`: no route to the client,
/// forwarding off, too big for the path with DF clear: the stack would
/// fragment it). ICMP packets go to `reply_error`.
#[inline(never)]
pub fn reply<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let frag = F::fragment(ctx);
    let Some(p) = parse::<F>(ctx) else {
        return if F::l4(ctx).is_some_and(|(_, proto)| proto == F::ICMP) { ACT_ICMP } else { TC_ACT_OK };
    };
    let Some(e) = F::nat_get(&p.key()) else { return TC_ACT_OK };
    // SAFETY: a map value, alive for this program run (RCU); the agent
    // replaces whole values, so a field may be old or new, never torn in a
    // way that matters.
    let entry = unsafe { &*e };
    if entry.flags & nat_flags::REPLY == 0 {
        return TC_ACT_OK;
    }
    let local = nat_flags::masqueraded_in_bpf(entry.flags);
    if !local {
        if frag.is_some() || entry.flags & nat_flags::SNAT != 0 || lb::node_flags() & node_flags::BPF_FORWARD == 0 || F::ttl(ctx) <= 1 {
            return TC_ACT_OK;
        }
    } else {
        if let Some((id, true, true)) = frag {
            F::frag_put(&p, id);
        }
        if F::ttl(ctx) <= 1 {
            return ACT_TIME_EXCEEDED;
        }
    }
    // SAFETY: an all-zero bpf_fib_lookup is a valid value.
    let mut f: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    let rc = lookup::<F>(skb, &mut f, p.proto, (entry.to_saddr, entry.to_sport), (entry.to_daddr, entry.to_dport));
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        if local {
            // Too big for the path, and not to be fragmented on the way:
            // "fragmentation needed" / "packet too big" to the pod.
            if rc == BPF_FIB_LKUP_RET_FRAG_NEEDED
                && !F::may_fragment(ctx)
                && let Some(sc) = F::scratch()
            {
                // SAFETY: this CPU's scratch value; the lookup set the MTU
                // (a union with tot_len).
                unsafe { (*sc).mtu = f.__bindgen_anon_1.mtu_result as u32 };
                return ACT_TOO_BIG;
            }
            lb::event(stats::NAT_DROPPED);
            return TC_ACT_SHOT;
        }
        lb::event(stats::FWD_STACK);
        return TC_ACT_OK;
    }
    touch_reply(e, entry.flags, p.tcp_flags);
    if translate::<F>(ctx, &p, entry) != ACT_TRANSLATED {
        return TC_ACT_SHOT;
    }
    send::<F>(ctx, &mut f, rc)
}

/// On the pod devices: an ICMP error a pod sends about a packet of a flow
/// masqueraded in BPF (port unreachable, say)
/// is translated as conntrack would translate it (`icmp::translate_error`:
/// to the client, from the frontend) and sent on from here, or dropped
/// and counted where the lookup cannot place it (the stack would deliver
/// it to the node, its source being the node's). Other ICMP packets go on
/// as before: an error about a packet to a local backend that kept the
/// client's address is translated on its way out by the egress program.
#[inline(never)]
pub fn reply_error<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Ok(before) = ctx.load::<F::A>(F::DST) else { return TC_ACT_OK };
    let act = icmp::translate_error::<F>(skb, true, false, nat_flags::REPLY | nat_flags::SNAT | nat_flags::LOCAL);
    if act != TC_ACT_OK {
        return if act == super::ACT_ICMP_NO_FLOW { TC_ACT_OK } else { act };
    }
    match ctx.load::<F::A>(F::DST) {
        Ok(dst) if dst == before => TC_ACT_OK,
        Ok(_) => send_error::<F>(skb),
        Err(_) => TC_ACT_SHOT,
    }
}

/// Send on an ICMP error `reply_error` translated (a step of its own: the
/// lookup's stack does not fit beside the translation's).
#[inline(never)]
fn send_error<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let (Ok(src), Ok(dst)) = (ctx.load::<F::A>(F::SRC), ctx.load::<F::A>(F::DST)) else { return TC_ACT_SHOT };
    let Some((_, proto)) = F::l4(ctx) else { return TC_ACT_SHOT };
    // SAFETY: an all-zero bpf_fib_lookup is a valid value.
    let mut f: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    let rc = lookup::<F>(skb, &mut f, proto, (src, 0), (dst, 0));
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        lb::event(stats::NAT_DROPPED);
        return TC_ACT_SHOT;
    }
    send::<F>(ctx, &mut f, rc)
}

/// The source address the route from `src` (a client) to `dst` (a
/// backend) picks for this node: the route's preferred source, else the egress device's address
/// for it (`BPF_FIB_LOOKUP_SRC`, Linux 6.8+). None where the kernel cannot
/// say (older kernels, no route, forwarding off on the packet's device).
/// kube-proxy's MASQUERADE picks the same, except that it ignores a
/// route's `src` (lb follows it, as the node's own connections do).
#[inline(always)]
pub fn route_source<F: Net>(skb: *mut __sk_buff, proto: u8, src: F::A, dst: F::A, dport: u16) -> Option<F::A> {
    // SAFETY: an all-zero bpf_fib_lookup is a valid value.
    let mut f: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    f.family = F::AF;
    f.l4_protocol = proto;
    f.dport = dport.to_be();
    // SAFETY: a field of our own skb.
    f.ifindex = unsafe { (*skb).ifindex };
    // The client's address: policy routing sees what it will see when
    // the packet is forwarded (SNAT comes after routing, as in netfilter).
    F::fib_addrs(&mut f, src, dst);
    let flags = (BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_SKIP_NEIGH) as u32;
    // SAFETY: our own skb and a stack value of the right size.
    let rc = unsafe { fib_lookup(skb.cast(), &mut f, size_of::<bpf_fib_lookup>() as i32, flags) };
    let src = F::fib_src(&f);
    (rc == BPF_FIB_LKUP_RET_SUCCESS as i64 && src != F::A::default()).then_some(src)
}

/// The MTU a route of the node's main table sets for `dst`, if that route
/// leaves by `ifindex` (the device the FIB lookup chose). The stack's
/// forwarding path honours a route's `mtu`; bpf_fib_lookup reads it only
/// when it is locked, so the agent copies those routes into LB_ROUTE_MTU.
/// (Its own BPF function: the key gets a stack frame of its own, beside
/// the rewrite's, not under it.)
#[inline(never)]
pub fn route_mtu<F: Net>(dst: F::A, ifindex: u32) -> Option<u32> {
    let key = Key::new(32 + F::BITS, RouteKey { family: F::ID, _pad: [0; 3], addr: F::wide(dst) });
    let r = super::LB_ROUTE_MTU.get(&key)?;
    (r.ifindex == 0 || r.ifindex == ifindex).then_some(r.mtu)
}

/// The FIB lookup for a packet from `src` to `dst` that arrived on the
/// skb's device; `f` holds the answer. A packet too big for a route's MTU
/// that the lookup does not see (`route_mtu`) is reported as too big, so
/// it goes to the stack, which answers it.
#[inline(always)]
fn lookup<F: Net>(skb: *mut __sk_buff, f: &mut bpf_fib_lookup, proto: u8, src: (F::A, u16), dst: (F::A, u16)) -> u32 {
    // SAFETY: fields of our own skb.
    let (len, gso, ifindex) = unsafe { ((*skb).len, (*skb).gso_size, (*skb).ifindex) };
    f.family = F::AF;
    f.l4_protocol = proto;
    f.sport = src.1.to_be();
    f.dport = dst.1.to_be();
    // A GSO packet leaves as segments, each within the MTU: no length check.
    if gso == 0 {
        f.__bindgen_anon_1.tot_len = len.saturating_sub(F::L2 as u32) as u16;
    }
    f.ifindex = ifindex;
    F::fib_addrs(f, src.0, dst.0);
    // SAFETY: our own skb and a stack value of the right size.
    let rc = unsafe { fib_lookup(skb.cast(), f, size_of::<bpf_fib_lookup>() as i32, 0) as u32 };
    if (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH)
        && gso == 0
        && len.saturating_sub(F::L2 as u32) as usize > super::icmp::MTU_CHECK_ABOVE
        && let Some(mtu) = route_mtu::<F>(dst.0, f.ifindex).filter(|mtu| len.saturating_sub(F::L2 as u32) > *mtu)
    {
        f.__bindgen_anon_1.mtu_result = mtu as u16;
        return BPF_FIB_LKUP_RET_FRAG_NEEDED;
    }
    rc
}

/// Send the packet on as the lookup `f` (result `rc`) says: TTL, MACs,
/// redirect (through the neighbour layer when the next hop's MAC is not
/// known yet). A packet from an L3 device first gets an Ethernet header
/// pushed in front of its IP header, as the redirect into an Ethernet
/// device and the neighbour layer both need; a redirect into another L3
/// device takes it off again (the kernel pulls what lies before the
/// network header).
#[inline(always)]
fn send<F: Net>(ctx: &TcContext, f: &mut bpf_fib_lookup, rc: u32) -> i32 {
    if F::dec_ttl(ctx).is_err() {
        return TC_ACT_OK;
    }
    if F::L2 == 0 && push_ethernet(ctx).is_err() {
        // The TTL is already taken: the packet cannot go back to the stack.
        return TC_ACT_SHOT;
    }
    if rc == BPF_FIB_LKUP_RET_NO_NEIGH {
        lb::event(stats::FWD_BPF);
        // SAFETY: an all-zero bpf_redir_neigh is a valid value.
        let mut nh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
        nh.nh_family = F::AF as u32;
        F::next_hop(f, &mut nh);
        // SAFETY: a stack value of the right size.
        return unsafe { bpf_redirect_neigh(f.ifindex, &mut nh, size_of::<bpf_redir_neigh>() as i32, 0) } as i32;
    }
    if ctx.store(0, &f.dmac, 0).is_err() || ctx.store(6, &f.smac, 0).is_err() {
        // The TTL is already taken (the stack would take it again).
        lb::event(stats::NAT_DROPPED);
        return TC_ACT_SHOT;
    }
    lb::event(stats::FWD_BPF);
    // SAFETY: plain helper.
    unsafe { bpf_redirect(f.ifindex, 0) as i32 }
}

/// Put an Ethernet header (addresses zero, the packet's ethertype) in
/// front of a packet that arrived on an L3 device.
#[inline(always)]
fn push_ethernet(ctx: &TcContext) -> Result<(), i64> {
    // SAFETY: fields of our own skb; the helper checks the room it makes.
    let proto = unsafe { (*ctx.skb.skb).protocol } as u16;
    let rc = unsafe { bpf_skb_change_head(ctx.skb.skb, ETH_HLEN as u32, 0) };
    if rc != 0 {
        return Err(rc);
    }
    ctx.store(12, &proto, 0)
}
