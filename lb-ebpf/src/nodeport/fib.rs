//! Forwarding in BPF (`lb-agent run --bpf-forward`): a packet the ingress
//! program has translated is sent on from here instead of through the
//! stack's routing, netfilter FORWARD and neighbour output: a FIB lookup
//! for its new destination, the TTL / hop limit decremented as a router
//! does, the MACs set, and a redirect to the egress device. The kernel's
//! neighbour layer resolves a next hop the lookup does not know yet
//! (`bpf_redirect_neigh`). Anything else the lookup reports (a local
//! destination, no route, forwarding off on the device, a packet too big
//! for the egress MTU) goes to the stack, which answers as it always has.
use aya_ebpf::{
    bindings::{__sk_buff, bpf_fib_lookup, bpf_redir_neigh, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_OK},
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use lb_common::{node_flags, stats};

use super::{ETH_HLEN, Net, parse};
use crate::lb;

/// A translated packet goes on: forwarded here if the agent asked for
/// forwarding in BPF, else through the stack.
#[inline(always)]
pub fn send_on<F: Net>(skb: *mut __sk_buff) -> i32 {
    if lb::node_config().is_some_and(|c| c.flags & node_flags::BPF_FORWARD != 0) { forward::<F>(skb) } else { TC_ACT_OK }
}

/// Send the translated packet on to its destination (see the module).
#[inline(never)]
pub fn forward<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(p) = parse::<F>(ctx) else { return TC_ACT_OK };
    // A TTL that runs out here: the stack answers "time exceeded".
    if F::ttl(ctx) <= 1 {
        return TC_ACT_OK;
    }
    // SAFETY: an all-zero bpf_fib_lookup is a valid value.
    let mut f: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    // SAFETY: fields of our own skb.
    let (len, gso, ifindex) = unsafe { ((*skb).len, (*skb).gso_size, (*skb).ifindex) };
    f.family = F::AF;
    f.l4_protocol = p.proto;
    f.sport = p.sport.to_be();
    f.dport = p.dport.to_be();
    // A GSO packet leaves as segments, each within the MTU: no length check.
    if gso == 0 {
        f.__bindgen_anon_1.tot_len = len.saturating_sub(ETH_HLEN as u32) as u16;
    }
    f.ifindex = ifindex;
    F::fib_addrs(&mut f, p.saddr, p.daddr);
    // SAFETY: our own skb and a stack value of the right size.
    let rc = unsafe { fib_lookup(skb.cast(), &mut f, size_of::<bpf_fib_lookup>() as i32, 0) } as u32;
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        lb::event(stats::FWD_STACK);
        return TC_ACT_OK;
    }
    if F::dec_ttl(ctx).is_err() {
        return TC_ACT_OK;
    }
    lb::event(stats::FWD_BPF);
    if rc == BPF_FIB_LKUP_RET_NO_NEIGH {
        // SAFETY: an all-zero bpf_redir_neigh is a valid value.
        let mut nh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
        nh.nh_family = F::AF as u32;
        F::next_hop(&f, &mut nh);
        // SAFETY: a stack value of the right size.
        return unsafe { bpf_redirect_neigh(f.ifindex, &mut nh, size_of::<bpf_redir_neigh>() as i32, 0) } as i32;
    }
    if ctx.store(0, &f.dmac, 0).is_err() || ctx.store(6, &f.smac, 0).is_err() {
        return TC_ACT_OK;
    }
    // SAFETY: plain helper.
    unsafe { bpf_redirect(f.ifindex, 0) as i32 }
}
