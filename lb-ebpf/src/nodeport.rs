//! TC programs for traffic that enters the node from outside: NodePort,
//! LoadBalancer ingress IPs and externalIPs (IPv4).
//!
//! Ingress, first packet of a flow to an EXTERNAL frontend: pick a backend
//! (externalTrafficPolicy decides the slots), DNAT to it, and remember the
//! choice in the `LB4_NAT` LRU table under two keys, the original tuple and
//! the reply tuple. A backend on another node is also SNATed to this node's
//! address with a port claimed atomically in the table, so the reply comes
//! back here. A backend on this node keeps the client's address.
//!
//! Every later packet, and every reply, is rewritten from the table:
//! - replies of SNATed flows arrive on ingress (backend -> node:port);
//! - replies of local backends leave on egress (backend -> client).
//!
//! The agent expires entries (TCP after FIN/RST plus a grace period, UDP and
//! idle TCP after a timeout); the LRU bounds the table meanwhile.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT},
    btf_maps::{LpmTrie, LruHashMap},
    helpers::bpf_ktime_get_ns,
    macros::{btf_map, classifier},
    maps::lpm_trie::Key,
    programs::TcContext,
};
use lb_common::{
    NatEntry, NatKey, PROTO_TCP, PROTO_UDP, SrcRange, backend_flags, capacity,
    nat_flags, nat_state, stats, svc_flags,
};

use crate::lb::{self, V4, Verdict};

#[btf_map]
static LB4_NAT: LruHashMap<NatKey, NatEntry, { capacity::NAT as usize }> = LruHashMap::new();

#[btf_map]
static LB4_SRC_RANGE: LpmTrie<SrcRange, u8, { capacity::SRC_RANGE as usize }> = LpmTrie::new();


const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const IP_CSUM: usize = ETH_HLEN + 10;
const IP_SRC: usize = ETH_HLEN + 12;
const IP_DST: usize = ETH_HLEN + 16;
const TCP_FIN: u8 = 0x01;
const TCP_RST: u8 = 0x04;
/// How many SNAT ports to try for one new flow.
const SNAT_TRIES: u32 = 32;

struct Pkt {
    l4: usize,
    proto: u8,
    saddr: [u8; 4],
    daddr: [u8; 4],
    sport: u16,
    dport: u16,
    tcp_flags: u8,
}

#[inline(always)]
fn parse(ctx: &TcContext) -> Option<Pkt> {
    if u16::from_be(ctx.load::<u16>(12).ok()?) != ETH_P_IP {
        return None;
    }
    let vihl: u8 = ctx.load(ETH_HLEN).ok()?;
    let ihl = ((vihl & 0x0f) as usize) * 4;
    if vihl >> 4 != 4 || ihl < 20 {
        return None;
    }
    // Not the first fragment: no ports to read.
    let frag = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).ok()?);
    if frag & 0x1fff != 0 {
        return None;
    }
    let proto: u8 = ctx.load(ETH_HLEN + 9).ok()?;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    let l4 = ETH_HLEN + ihl;
    Some(Pkt {
        l4,
        proto,
        saddr: ctx.load(IP_SRC).ok()?,
        daddr: ctx.load(IP_DST).ok()?,
        sport: u16::from_be(ctx.load::<u16>(l4).ok()?),
        dport: u16::from_be(ctx.load::<u16>(l4 + 2).ok()?),
        tcp_flags: if proto == PROTO_TCP { ctx.load(l4 + 13).ok()? } else { 0 },
    })
}

impl Pkt {
    fn key(&self) -> NatKey {
        NatKey { saddr: self.saddr, daddr: self.daddr, sport: self.sport, dport: self.dport, proto: self.proto, _pad: [0; 3] }
    }
}

/// Rewrite addresses and ports, keeping the IP and L4 checksums right.
#[inline(always)]
fn rewrite(ctx: &TcContext, p: &Pkt, e: &NatEntry) -> Result<(), i64> {
    let csum = p.l4 + if p.proto == PROTO_TCP { 16 } else { 6 };
    // UDP may carry no checksum (0); it must stay 0.
    let l4_csum = p.proto == PROTO_TCP || ctx.load::<u16>(csum)? != 0;
    let mangled = if p.proto == PROTO_UDP { BPF_F_MARK_MANGLED_0 as u64 } else { 0 };
    for (off, old, new) in [(IP_SRC, p.saddr, e.to_saddr), (IP_DST, p.daddr, e.to_daddr)] {
        if old != new {
            let (from, to) = (u32::from_ne_bytes(old) as u64, u32::from_ne_bytes(new) as u64);
            if l4_csum {
                ctx.l4_csum_replace(csum, from, to, BPF_F_PSEUDO_HDR as u64 | mangled | 4)?;
            }
            ctx.l3_csum_replace(IP_CSUM, from, to, 4)?;
            ctx.store(off, &new, 0)?;
        }
    }
    for (off, old, new) in [(p.l4, p.sport, e.to_sport), (p.l4 + 2, p.dport, e.to_dport)] {
        if old != new {
            if l4_csum {
                ctx.l4_csum_replace(csum, old.to_be() as u64, new.to_be() as u64, mangled | 2)?;
            }
            ctx.store(off, &new.to_be(), 0)?;
        }
    }
    Ok(())
}

/// Note the packet in the entry: time, and FIN/RST for expiry.
#[inline(always)]
fn touch(e: *mut NatEntry, tcp_flags: u8) {
    // SAFETY: e points into a map value; the fields are plain integers.
    unsafe {
        (*e).last_seen_ns = bpf_ktime_get_ns();
        if tcp_flags & TCP_FIN != 0 {
            (*e).state |= nat_state::FIN;
        }
        if tcp_flags & TCP_RST != 0 {
            (*e).state |= nat_state::RST;
        }
    }
}

/// A stable hash of the original tuple, so a retransmitted first packet
/// picks the same backend and the same SNAT port.
#[inline(always)]
fn flow_hash(p: &Pkt) -> u32 {
    let a = u32::from_ne_bytes(p.saddr) as u64;
    let b = u32::from_ne_bytes(p.daddr) as u64;
    lb::mix((a << 32 | b) ^ ((p.sport as u64) << 16 | p.dport as u64) ^ ((p.proto as u64) << 48))
}

#[inline(always)]
fn in_src_range(rev_nat_id: u16, saddr: [u8; 4]) -> bool {
    let key = Key::new(64, SrcRange { rev_nat_id, _pad: 0, addr: saddr });
    LB4_SRC_RANGE.get(&key).is_some()
}

#[inline(always)]
fn drop_packet() -> i32 {
    lb::count(stats::NAT_DROPPED);
    TC_ACT_SHOT
}

/// A new flow from outside to frontend `daddr:dport`.
#[inline(always)]
fn new_flow(ctx: &TcContext, p: &Pkt) -> i32 {
    let h = flow_hash(p);
    let (backend, rev_nat_id, flags) =
        match lb::select::<V4>(core::ptr::null_mut(), p.daddr, p.dport, p.proto, Some(h), true) {
            Verdict::Pass => return TC_ACT_OK,
            // No endpoints, or none on this node with externalTrafficPolicy
            // Local: the packet goes nowhere (kube-proxy DROPs too).
            Verdict::Refuse(_) => return drop_packet(),
            Verdict::Backend { backend, rev_nat_id, flags } => (backend, rev_nat_id, flags),
        };
    if flags & svc_flags::SRC_RANGE != 0 && !in_src_range(rev_nat_id, p.saddr) {
        return drop_packet();
    }
    // SAFETY: plain helper.
    let now = unsafe { bpf_ktime_get_ns() };
    let snat = backend.flags & backend_flags::LOCAL == 0;
    let mut fwd = NatEntry {
        to_saddr: p.saddr,
        to_daddr: backend.addr,
        to_sport: p.sport,
        to_dport: backend.port,
        flags: 0,
        state: 0,
        rev_nat_id,
        created_ns: now,
        last_seen_ns: now,
    };
    let mut reply = NatEntry {
        to_saddr: p.daddr,
        to_daddr: p.saddr,
        to_sport: p.dport,
        to_dport: p.sport,
        flags: nat_flags::REPLY,
        state: 0,
        rev_nat_id,
        created_ns: now,
        last_seen_ns: now,
    };
    let mut rkey = NatKey { saddr: backend.addr, daddr: p.saddr, sport: backend.port, dport: p.sport, proto: p.proto, _pad: [0; 3] };
    if snat {
        let Some(cfg) = lb::node_config() else { return drop_packet() };
        let range = (cfg.snat_port_max as u32).saturating_sub(cfg.snat_port_min as u32) + 1;
        if cfg.snat_port_min == 0 || range == 0 {
            lb::count(stats::NAT_FAILED);
            return TC_ACT_SHOT;
        }
        fwd.flags = nat_flags::SNAT;
        reply.flags |= nat_flags::SNAT;
        fwd.to_saddr = cfg.snat_addr;
        rkey.daddr = cfg.snat_addr;
        // Claim a port: the reply tuple must be unique, and BPF_NOEXIST
        // makes the claim atomic against other CPUs.
        let mut claimed = false;
        let mut i = 0;
        while i < SNAT_TRIES {
            let port = cfg.snat_port_min + ((h.wrapping_add(i.wrapping_mul(7919))) % range) as u16;
            rkey.dport = port;
            if LB4_NAT.insert(&rkey, &reply, BPF_NOEXIST as u64).is_ok() {
                fwd.to_sport = port;
                claimed = true;
                break;
            }
            i += 1;
        }
        if !claimed {
            lb::count(stats::NAT_FAILED);
            return TC_ACT_SHOT;
        }
    } else if LB4_NAT.insert(&rkey, &reply, BPF_NOEXIST as u64).is_err() {
        // Another frontend already maps this client port to this backend.
        lb::count(stats::NAT_FAILED);
        return TC_ACT_SHOT;
    }
    let key = p.key();
    if LB4_NAT.insert(&key, &fwd, BPF_NOEXIST as u64).is_err() {
        // Another CPU set this flow up meanwhile: follow its choice.
        let _ = LB4_NAT.remove(&rkey);
        return match LB4_NAT.get_ptr(&key) {
            // SAFETY: copied out at once.
            Some(e) => match rewrite(ctx, p, &unsafe { core::ptr::read_volatile(e) }) {
                Ok(()) => TC_ACT_OK,
                Err(_) => TC_ACT_SHOT,
            },
            None => TC_ACT_SHOT,
        };
    }
    lb::count(stats::NAT_NEW);
    match rewrite(ctx, p, &fwd) {
        Ok(()) => TC_ACT_OK,
        Err(_) => TC_ACT_SHOT,
    }
}

#[classifier]
pub fn lb_nodeport_ingress(ctx: TcContext) -> i32 {
    let Some(p) = parse(&ctx) else { return TC_ACT_OK };
    if let Some(e) = LB4_NAT.get_ptr_mut(&p.key()) {
        // A known flow from a client, or a reply to a SNATed flow.
        touch(e, p.tcp_flags);
        // SAFETY: copied out at once.
        let entry = unsafe { core::ptr::read_volatile(e) };
        // Replies of flows to local backends are handled on egress.
        if entry.flags & nat_flags::REPLY != 0 && entry.flags & nat_flags::SNAT == 0 {
            return TC_ACT_OK;
        }
        return match rewrite(&ctx, &p, &entry) {
            Ok(()) => TC_ACT_OK,
            Err(_) => TC_ACT_SHOT,
        };
    }
    new_flow(&ctx, &p)
}

#[classifier]
pub fn lb_nodeport_egress(ctx: TcContext) -> i32 {
    let Some(p) = parse(&ctx) else { return TC_ACT_OK };
    // Replies of local backends leave here: backend -> client becomes
    // frontend -> client.
    if let Some(e) = LB4_NAT.get_ptr_mut(&p.key()) {
        // SAFETY: copied out at once.
        let entry = unsafe { core::ptr::read_volatile(e) };
        if entry.flags & nat_flags::REPLY != 0 && entry.flags & nat_flags::SNAT == 0 {
            touch(e, p.tcp_flags);
            if rewrite(&ctx, &p, &entry).is_err() {
                return TC_ACT_SHOT;
            }
        }
    }
    TC_ACT_OK
}
