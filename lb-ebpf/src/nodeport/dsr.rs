//! Direct server return (a frontend's `svc_flags::DSR`, for
//! externalTrafficPolicy Cluster): the node a flow arrives at (node A)
//! DNATs it to a backend on another node (node B) but keeps the client's
//! address, and tells node B the frontend in an IPv4 option after the
//! header: type 0x9a (copied into fragments; the number Cilium uses), length
//! 8, the frontend port and address. IPv6 carries it in a destination
//! options header right after the fixed header (24 bytes): option type
//! 0x1b (a node that does not know it skips it: the two high bits are 00;
//! Cilium's number), length 18, the frontend port and address, and a PadN.
//! Node B's ingress program records the
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
//! records the flow from the first fragment. IPv6: 24 bytes; the header
//! goes before a fragment header (every fragment carries it); a packet
//! with hop-by-hop options (which must stay first) is dropped, counted as
//! `nat_dropped`, as an IPv4 packet with options of its own is.
use aya_ebpf::{
    bindings::{__sk_buff, BPF_EXIST, BPF_NOEXIST, TC_ACT_OK},
    programs::TcContext,
};
use lb_common::{NatEntry, NatKey, NodePortKey, PROTO_TCP, SCOPE_ALL, SvcKey, nat_flags, stats, svc_flags};

use super::{A4, A6, ACT_TRANSLATED, Buf, Ip4, Ip6, IPV6_DSTOPTS, IPV6_HOPOPTS, Net, Pkt, TCP_ACK, TCP_SYN, csum_add, csum_fold, ld, load_exact, note, parse};
use crate::lb;

pub const OPT_TYPE: u8 = 0x9a;
pub const OPT_LEN: usize = 8;
/// IPv6: the option's type, its data length, and the whole header's length.
pub const OPT6_TYPE: u8 = 0x1b;
const OPT6_DATA: u8 = 18;
pub const OPT6_LEN: usize = 24;
/// bpf_skb_adjust_room's mode: room between the L3 and L4 headers.
const BPF_ADJ_ROOM_NET: u32 = 0;

/// An IPv4 header with exactly our option (IHL 7).
#[inline(always)]
pub fn carries_option<const L: usize>(ctx: &TcContext) -> bool {
    ld::<[u8; 2]>(ctx, L).is_ok_and(|v| v[0] == 0x47) && ld::<[u8; 2]>(ctx, L + 20).is_ok_and(|o| o == [OPT_TYPE, OPT_LEN as u8])
}

/// An IPv6 header followed by our destination options header.
#[inline(always)]
pub fn carries_option6<const L: usize>(ctx: &TcContext) -> bool {
    ld::<[u8; 2]>(ctx, L + 6).is_ok_and(|v| v[0] == IPV6_DSTOPTS)
        && ld::<[u8; 4]>(ctx, L + 40).is_ok_and(|o| o[1] == (OPT6_LEN / 8 - 1) as u8 && o[2] == OPT6_TYPE && o[3] == OPT6_DATA)
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
pub fn add_option<const L: usize>(skb: *mut __sk_buff, addr: A4, port: u16) -> i32 {
    let ctx = &TcContext::new(skb);
    let mut h = Buf([0u8; 20]);
    if load_exact(ctx, L, h.0.as_mut_ptr(), 20).is_err() || h.0[0] != 0x45 {
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
    if ctx.store(L, &b.0, 0).is_err() {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    lb::event(stats::DSR_SENT);
    ACT_TRANSLATED
}

/// IPv6, node A: insert the destination options header naming the
/// frontend `addr:port` after the (translated) packet's fixed header.
/// Returns ACT_TRANSLATED, or TC_ACT_SHOT.
#[inline(never)]
pub fn add_option6<const L: usize>(skb: *mut __sk_buff, addr: A6, port: u16) -> i32 {
    let ctx = &TcContext::new(skb);
    let mut h = Buf([0u8; 40]);
    if load_exact(ctx, L, h.0.as_mut_ptr(), 40).is_err() {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    let next = h.0[6];
    if next == IPV6_HOPOPTS {
        // Hop-by-hop options must stay first: no room for ours before them.
        lb::event(stats::NAT_DROPPED);
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    if ctx.adjust_room(OPT6_LEN as i32, BPF_ADJ_ROOM_NET, 0).is_err() {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    let mut b = Buf([0u8; 64]);
    b.0[..40].copy_from_slice(&h.0);
    let len = u16::from_be_bytes([h.0[4], h.0[5]]).wrapping_add(OPT6_LEN as u16);
    b.0[4..6].copy_from_slice(&len.to_be_bytes());
    b.0[6] = IPV6_DSTOPTS;
    b.0[40] = next;
    b.0[41] = (OPT6_LEN / 8 - 1) as u8;
    b.0[42] = OPT6_TYPE;
    b.0[43] = OPT6_DATA;
    b.0[44..46].copy_from_slice(&port.to_be_bytes());
    b.0[46..62].copy_from_slice(&addr);
    // PadN of 2 bytes.
    b.0[62] = 1;
    b.0[63] = 0;
    if ctx.store(L, &b.0, 0).is_err() {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    lb::event(stats::DSR_SENT);
    ACT_TRANSLATED
}

/// Whether `addr:port` is a frontend outside traffic may use here: an
/// external frontend, or a NodePort (of another node's address: the
/// option names the address the client used).
#[inline(always)]
fn known_frontend<F: Net>(addr: F::A, port: u16, proto: u8) -> bool {
    if F::svc(&SvcKey::new(addr, port, proto, SCOPE_ALL, 0)).is_some_and(|f| f.flags & svc_flags::EXTERNAL != 0) {
        return true;
    }
    crate::sock::LB_NODEPORTS.get_ptr(&NodePortKey { port, proto, _pad: 0 }).is_some()
}

/// Whether the flow whose entry `e` is (at `key`) ended, so that a SYN
/// may give its tuple to another translation: a FIN each way, or a RST
/// (or its other entry gone) and quiet since (`super::quiet`).
#[inline(always)]
fn ended<F: Net>(key: &NatKey<F::A>, e: &NatEntry<F::A>) -> bool {
    use lb_common::nat_state::{FIN, FIN_REPLY, RST};
    let (fin_both, rst, last) = if e.flags & nat_flags::DSR != 0 {
        // One entry notes both ways.
        (e.state & (FIN | FIN_REPLY) == FIN | FIN_REPLY, e.state & RST != 0, e.last_seen_ns)
    } else {
        match super::partner::<F>(&e.other_key(key.proto), key) {
            // SAFETY: a map value, alive for this program run; plain integers.
            Some(o) => unsafe { (e.state & (*o).state & FIN != 0, (e.state | (*o).state) & RST != 0, e.last_seen_ns.max((*o).last_seen_ns)) },
            None => (false, true, e.last_seen_ns),
        }
    };
    fin_both || (rst && super::quiet(last))
}

/// Node B: record (or refresh) the reply translation of the DSR flow of
/// packet `p`, whose frontend is `addr:port`. Err: the counter to count
/// the packet's drop under.
#[inline(always)]
fn record<F: Net>(p: &Pkt<F::A>, addr: F::A, port: u16) -> Result<(), u32> {
    // The reply tuple: backend -> client.
    let key = NatKey { saddr: p.daddr, daddr: p.saddr, sport: p.dport, dport: p.sport, proto: p.proto, _pad: [0; 3] };
    let syn = p.proto == PROTO_TCP && p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    // SAFETY: plain helper.
    let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() };
    let how = match F::nat_get(&key) {
        // Another kind of flow holds the tuple (the reply side of a SNATed
        // flow): an option never replaces it. No client collides with one
        // (it would need this node's own address and SNAT port); a
        // stranger forging the tuple would cut the flow. The one it may
        // replace is the same flow's, moved here from this node by the
        // router (Maglev): a local backend's reply entry that already
        // translates to this frontend and this client.
        // A SYN may start over on the tuple of such a flow once it ended
        // (`ended`): a client port used again, first through this node's
        // own NodePort to its local backend (a client behind a NAT
        // gateway, whose ports all frontends see); that flow's entries
        // go. There is nothing left to cut.
        // SAFETY: a map value, alive for this program run; plain integers.
        Some(e) if unsafe {
            (*e).flags & nat_flags::DSR == 0
                && ((*e).to_saddr != addr || (*e).to_sport != port || (*e).to_daddr != p.saddr || (*e).to_dport != p.sport)
        } =>
        {
            // SAFETY: as above.
            let e = unsafe { &*e };
            if !syn || !ended::<F>(&key, e) {
                return Err(stats::NAT_DROPPED);
            }
            super::remove_flow::<F>(&key, e);
            BPF_NOEXIST
        }
        // SAFETY: as above.
        Some(ep) if unsafe { (*ep).flags & nat_flags::DSR != 0 } => {
            use lb_common::nat_state::{FIN, RST};
            // SAFETY: as above.
            let e = unsafe { &*ep };
            let same = e.to_saddr == addr && e.to_sport == port;
            if syn && (ended::<F>(&key, e) || same && e.state & RST != 0) {
                // A new connection on the tuple of one that ended (a client
                // port used again), maybe through another frontend; or
                // through the same frontend on one a RST closed, less than
                // RST_QUIET_NS ago (its state goes, not its translation): a
                // fresh entry. (Not on one FIN: a forged SYN would clear a
                // half-closed flow's FIN, and its close would go unseen.)
                BPF_EXIST
            } else if same {
                // The client's packet keeps the entry alive and notes its
                // FIN / RST; only the backend's own packets (on egress)
                // mark it SEEN, so spoofed options cannot keep entries
                // long. A SYN again (a retransmission, or a forged one)
                // leaves the live flow's state as it is.
                note(ep, p.tcp_flags, 0, FIN);
                return Ok(());
            } else if p.proto != PROTO_TCP {
                // UDP has no connection: the client's last frontend wins.
                BPF_EXIST
            } else {
                // Another frontend for a live TCP flow. A forgery would
                // send the flow's replies from another address (a SYN's
                // challenge ACK from there draws the client's RST, which
                // ends the pod's socket); a client's real new connection
                // with this tuple through another frontend (two clients
                // behind one NAT gateway, which keeps a port per
                // destination) cannot be told from the old at the pod, and
                // waits until the old one ends or its entry expires.
                return Err(stats::NAT_DROPPED);
            }
        }
        // The same flow's entry of a local backend (above): it becomes
        // the DSR flow's.
        Some(_) => BPF_EXIST,
        None => BPF_NOEXIST,
    };
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
    // A packet of the flow on another CPU may have made it meanwhile.
    if F::nat_put(&key, &v, how as u64) {
        // The pod device's earlier program, while an upgrade moves the
        // programs, answers from the old table: a new entry, or this one
        // rewritten (another frontend, a fresh flow).
        super::share_with_old::<F>(&key, &v, if how == BPF_NOEXIST { BPF_NOEXIST } else { aya_ebpf::bindings::BPF_ANY });
        Ok(())
    } else if F::nat_get(&key).is_some() {
        Ok(())
    } else {
        super::gc::refused(F::ID);
        Err(stats::NAT_FAILED)
    }
}

/// Node B: a packet of a DSR flow. Record (or refresh) the flow's reply
/// translation, strip the option, and let the packet on. Returns
/// ACT_TRANSLATED (so it is forwarded like a translated packet), TC_ACT_OK
/// for an option naming no frontend of ours (left as it is: the stack
/// ignores options it does not know), or TC_ACT_SHOT.
#[inline(never)]
pub fn receive<const L: usize>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(p) = parse::<Ip4<L>>(ctx) else { return TC_ACT_OK };
    let mut b = Buf([0u8; 28]);
    if load_exact(ctx, L, b.0.as_mut_ptr(), 28).is_err() {
        return TC_ACT_OK;
    }
    let port = u16::from_be_bytes([b.0[22], b.0[23]]);
    let addr: A4 = [b.0[24], b.0[25], b.0[26], b.0[27]];
    if !known_frontend::<Ip4<L>>(addr, port, p.proto) {
        return TC_ACT_OK;
    }
    // A first fragment leaves its ports for the later ones (which carry
    // the option too: stripped the same).
    if let Some((id, true, true)) = Ip4::<L>::fragment(ctx) {
        Ip4::<L>::frag_put(&p, id);
    }
    if !p.later && let Err(counter) = record::<Ip4<L>>(&p, addr, port) {
        lb::event(counter);
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    // Strip the option: the 8 bytes after the fixed header.
    let mut h = Buf([0u8; 20]);
    h.0.copy_from_slice(&b.0[..20]);
    h.0[0] = 0x45;
    let len = u16::from_be_bytes([b.0[2], b.0[3]]).wrapping_sub(OPT_LEN as u16);
    h.0[2..4].copy_from_slice(&len.to_be_bytes());
    fix_csum(&mut h);
    if ctx.adjust_room(-(OPT_LEN as i32), BPF_ADJ_ROOM_NET, 0).is_err() || ctx.store(L, &h.0, 0).is_err() {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    lb::event(stats::DSR_RECEIVED);
    ACT_TRANSLATED
}

/// IPv6, node B: as `receive`, for a packet carrying our destination
/// options header. A first fragment leaves its ports for the later ones
/// (which carry the header too).
#[inline(never)]
pub fn receive6<const L: usize>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(p) = parse::<Ip6<L>>(ctx) else { return TC_ACT_OK };
    let mut b = Buf([0u8; 64]);
    if load_exact(ctx, L, b.0.as_mut_ptr(), 64).is_err() {
        return TC_ACT_OK;
    }
    let port = u16::from_be_bytes([b.0[44], b.0[45]]);
    let mut addr: A6 = [0; 16];
    addr.copy_from_slice(&b.0[46..62]);
    if !known_frontend::<Ip6<L>>(addr, port, p.proto) {
        return TC_ACT_OK;
    }
    if let Some((id, true, true)) = Ip6::<L>::fragment(ctx) {
        Ip6::<L>::frag_put(&p, id);
    }
    if !p.later && let Err(counter) = record::<Ip6<L>>(&p, addr, port) {
        lb::event(counter);
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    // Strip the header: the 24 bytes after the fixed header.
    let mut h = Buf([0u8; 40]);
    h.0.copy_from_slice(&b.0[..40]);
    h.0[6] = b.0[40];
    let len = u16::from_be_bytes([b.0[4], b.0[5]]).wrapping_sub(OPT6_LEN as u16);
    h.0[4..6].copy_from_slice(&len.to_be_bytes());
    if ctx.adjust_room(-(OPT6_LEN as i32), BPF_ADJ_ROOM_NET, 0).is_err() || ctx.store(L, &h.0, 0).is_err() {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    lb::event(stats::DSR_RECEIVED);
    ACT_TRANSLATED
}
