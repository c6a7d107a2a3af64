//! TC programs for traffic that enters the node from outside: NodePort,
//! LoadBalancer ingress IPs and externalIPs, IPv4 and IPv6.
//!
//! Ingress, first packet of a flow to an EXTERNAL frontend (a TCP SYN, or
//! any UDP datagram): check loadBalancerSourceRanges, pick a backend
//! (externalTrafficPolicy decides the slots, sessionAffinity keys on the
//! client address), DNAT to it, and remember the choice in the family's NAT
//! table under two keys, the original tuple and the reply tuple. A backend on
//! another node is also SNATed to this node's address with a port claimed
//! atomically in the table, so the reply comes back here. A backend on this
//! node keeps the client's address.
//!
//! Every later packet, and every reply, is rewritten from the table:
//! - replies of SNATed flows arrive on ingress (backend -> node:port);
//! - replies of local backends leave on egress (backend -> client).
//!
//! Like conntrack, and unlike a cache of tuples:
//! - a frontend with no usable endpoint is REJECTed as kube-proxy does:
//!   ICMP port unreachable (ICMPv6 for IPv6) back to the client, so its
//!   connect fails with ECONNREFUSED at once; externalTrafficPolicy Local
//!   with endpoints only elsewhere still drops;
//! - a TCP flow is created only by a SYN; other packets without an entry
//!   pass untouched;
//! - the two entries of a flow are created together and removed together
//!   (a plain hash table: no LRU evicts one of them behind our back); the
//!   agent expires flows, unreplied ones after about a minute;
//! - a reply tuple that clashes with a closed flow replaces it; one held
//!   by a live flow (the client's port reaching the backend through
//!   another frontend) moves the new flow's client port, as conntrack's
//!   NAT does under kube-proxy; a direct client-to-pod TCP flow that
//!   reuses the tuple of a closed NodePort flow removes the leftover, so
//!   its replies pass untouched;
//! - a flow whose backend left (the agent marks it STALE) ends at its next
//!   packet: TCP gets a RST back, so the client reconnects at once (beyond
//!   kube-proxy, which lets it time out); UDP picks a live backend.
use aya_ebpf::{
    bindings::{__sk_buff, bpf_fib_lookup, bpf_redir_neigh, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
    btf_maps::{HashMap, LpmTrie, LruHashMap, PerCpuArray},
    helpers::{bpf_csum_diff, bpf_ktime_get_ns, bpf_redirect, bpf_skb_change_tail, bpf_skb_load_bytes, bpf_skb_store_bytes},
    macros::{btf_map, classifier},
    maps::lpm_trie::Key,
    programs::TcContext,
};
use lb_common::{
    Backend, Frag6Key, FragKey, FragPorts, MaglevKey, NatEntry, NatKey, NodeConfig, RevNat, RouteKey, RouteMtu, SvcValue, PROTO_TCP, PROTO_UDP, SCOPE_ALL, STATS_FRONTEND, SrcRange, SvcKey, backend_flags, capacity,
    nat_flags, nat_state, node_flags, stats, svc_flags,
};

use crate::lb::{self, Client, ECONNREFUSED, Family, NO_PREALLOC, V4, V6, Verdict};

mod dsr;
mod fib;
mod gc;
mod icmp;
mod xdp;

type A4 = [u8; 4];
type A6 = [u8; 16];

/// IPv4 and IPv6 packets behind `L` bytes of link-layer header: the same
/// maps as the socket programs' `V4` and `V6`, a layout per device kind.
pub struct Ip4<const L: usize>;
pub struct Ip6<const L: usize>;
/// On Ethernet devices.
type E4 = Ip4<ETH_HLEN>;
type E6 = Ip6<ETH_HLEN>;

macro_rules! family_of {
    ($t:ident, $f:ident, $a:ty) => {
        impl<const L: usize> Family for $t<L> {
            type A = $a;
            const ID: u8 = $f::ID;
            #[inline(always)]
            fn svc(k: &SvcKey<$a>) -> Option<SvcValue> {
                $f::svc(k)
            }
            #[inline(always)]
            fn backend(id: u32) -> Option<Backend<$a>> {
                $f::backend(id)
            }
            #[inline(always)]
            fn revnat(id: u16) -> Option<RevNat<$a>> {
                $f::revnat(id)
            }
            #[inline(always)]
            fn maglev(key: &MaglevKey, index: u32) -> Option<u32> {
                $f::maglev(key, index)
            }
        }
    };
}
family_of!(Ip4, V4, A4);
family_of!(Ip6, V6, A6);

#[btf_map]
static LB4_NAT: HashMap<NatKey<A4>, NatEntry<A4>, { capacity::NAT as usize }, NO_PREALLOC> = HashMap::new();
#[btf_map]
static LB6_NAT: HashMap<NatKey<A6>, NatEntry<A6>, { capacity::NAT as usize }, NO_PREALLOC> = HashMap::new();

/// During an upgrade that replaces the NAT tables with ones of the same
/// layout, the old tables (the agent points these at their pins when it
/// loads; otherwise they are empty, unpinned and of one entry): while
/// `LB_ADOPT` is set, a flow missing from the new table is looked up here
/// and copied over (`adopt`), so that a connection the old programs made
/// just before the switch keeps its flow before the agent's second copy
/// reaches it.
#[btf_map]
static LB4_NAT_PREV: HashMap<NatKey<A4>, NatEntry<A4>, { capacity::NAT as usize }, NO_PREALLOC> = HashMap::new();
#[btf_map]
static LB6_NAT_PREV: HashMap<NatKey<A6>, NatEntry<A6>, { capacity::NAT as usize }, NO_PREALLOC> = HashMap::new();

/// Copy flow `k` from the old table into the new one (an entry already
/// there wins); whether the new table has it now. (Its own BPF function:
/// the many lookups that call it stay small.)
#[inline(never)]
fn adopt<F: Net>(k: &NatKey<F::A>) -> bool {
    let Some(e) = F::nat_prev(k) else { return false };
    // SAFETY: a map value, alive for this program run (RCU); handed to the
    // helper as it is (no copy on this frame, which the deepest call
    // chains add to theirs).
    if F::nat_put(k, unsafe { &*e }, BPF_NOEXIST as u64) {
        lb::event(stats::NAT_ADOPTED);
    }
    true
}

/// Set (to 1) by the agent that loaded these programs while it moves them
/// to new NAT tables and until its second copy is done (see
/// LB4_NAT_PREV). Unpinned: each load has its own, so that no other
/// agent's programs (an earlier one's, on a device not moved yet) look at
/// their own old tables because of it.
#[btf_map]
static LB_ADOPT: aya_ebpf::btf_maps::Array<u32, 1> = aya_ebpf::btf_maps::Array::new();

/// An upgrade is moving the programs to new NAT tables (see LB4_NAT_PREV).
#[inline(always)]
fn upgrading() -> bool {
    LB_ADOPT.get(0).is_some_and(|v| *v != 0)
}

/// While an upgrade moves the programs, a new flow's entries go into the
/// old table too (`flags` BPF_NOEXIST: a flow the old programs made wins;
/// BPF_ANY where the new table's entry was rewritten, a DSR flow's
/// frontend): the
/// devices move one after another (the pod devices after the NodePort
/// devices), and a flow whose first packet a moved program took may have
/// its replies pass a device whose earlier program reads only the old
/// table (a local backend's SYN-ACK at its pod device with `--bpf-forward`,
/// a remote backend's at the NodePort device with `--per-packet-lb`).
/// Before 12-08 such a reply went to the stack untranslated until that
/// device moved. The old table's entries go once the upgrade is done.
#[inline(always)]
fn share_with_old<F: Net>(k: &NatKey<F::A>, v: &NatEntry<F::A>, flags: u32) {
    if upgrading() {
        F::nat_prev_put(k, v, flags as u64);
    }
}

/// Claim `k` in the NAT table for a new flow (BPF_NOEXIST: atomic against
/// other CPUs). During an upgrade a key the old table holds is taken too
/// (and comes over): a reply tuple is looked up only once its flow's
/// replies come, and a new flow must not take the SNAT port of one the
/// old programs made just before the move.
#[inline(always)]
fn nat_claim<F: Net>(k: &NatKey<F::A>, v: &NatEntry<F::A>) -> bool {
    if upgrading() && adopt::<F>(k) {
        return false;
    }
    F::nat_put(k, v, BPF_NOEXIST as u64)
}

/// The ports of fragmented IPv4 datagrams, from their first fragment, so
/// that the later ones (which carry no L4 header) follow the same flow.
/// Pinned: a datagram whose fragments straddle an agent restart arrives.
#[btf_map]
static LB4_FRAG: LruHashMap<FragKey, FragPorts, { capacity::FRAG as usize }> = LruHashMap::new();

/// The same for IPv6 fragments (a fragment extension header, a 32-bit
/// identification).
#[btf_map]
static LB6_FRAG: LruHashMap<Frag6Key, FragPorts, { capacity::FRAG as usize }> = LruHashMap::new();

#[btf_map]
static LB_SRC_RANGE: LpmTrie<SrcRange, u8, { capacity::SRC_RANGE as usize }> = LpmTrie::new();

/// Routes of the node's main table that set an MTU (`fib::route_mtu`).
#[btf_map]
static LB_ROUTE_MTU: LpmTrie<RouteKey, RouteMtu, { capacity::ROUTE_MTU as usize }> = LpmTrie::new();

/// The node's own IPv4 addresses (`source_check`).
#[btf_map]
static LB_LOCAL4: HashMap<A4, u8, { capacity::LOCAL4 as usize }> = HashMap::new();

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
/// `skb->pkt_type` of a frame for this host's own MAC.
const PACKET_HOST: u32 = 0;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
const PROTO_ICMP: u8 = 1;
const PROTO_ICMPV6: u8 = 58;
/// IPv6 extension headers lb walks past to find L4: hop-by-hop options,
/// destination options, fragment.
const IPV6_HOPOPTS: u8 = 0;
const IPV6_DSTOPTS: u8 = 60;
const IPV6_FRAGMENT: u8 = 44;
/// How many IPv6 extension headers lb walks past (more: not its packet).
const IPV6_EXT_MAX: usize = 3;
/// How many SNAT ports to try for one new flow. Probes are double-hashed
/// (each flow its own stride), so at 70% of the range in use the chance
/// that all of them are taken is 0.7^64, about 1e-10.
const SNAT_TRIES: u32 = 64;

/// What the steps of the ingress program ask it to do next, besides
/// TC_ACT_*. The program calls each step in turn rather than nested, so
/// that each gets the whole 512-byte stack.
/// Answer with ICMP port unreachable (kube-proxy's REJECT).
const ACT_REJECT: i32 = -100;
/// Answer with a TCP RST (a flow whose backend left).
const ACT_RESET: i32 = -101;
/// No flow has the packet's tuple: it may start one.
const ACT_NEW_FLOW: i32 = -102;
/// A backend is picked (in the scratch value): create the flow.
const ACT_ESTABLISH: i32 = -103;
/// A SYN of a flow we do not translate: clear a leftover with its tuple.
const ACT_CLEAR_LEFTOVER: i32 = -104;
/// An ICMP packet: translate it if it is an error about one of our flows.
const ACT_ICMP: i32 = -105;
/// Too big for the path to the backend (the MTU is in the scratch value):
/// answer "fragmentation needed" / "packet too big".
const ACT_TOO_BIG: i32 = -106;
/// A SNATed packet whose TTL runs out on this node: answer "time exceeded".
const ACT_TIME_EXCEEDED: i32 = -107;
/// Translate the packet by the forward entry in the scratch value.
const ACT_FORWARD: i32 = -108;
/// The packet is translated: on ingress, forward it (in BPF or through the
/// stack); on egress, let it go.
const ACT_TRANSLATED: i32 = -109;
/// Translated, a DSR flow: add the option naming the frontend (in the
/// scratch value), then forward it.
const ACT_DSR: i32 = -110;
/// An ICMP error on ingress about no flow of this node (its flow's key in
/// the scratch value): maybe about a Maglev DSR flow's reply.
const ACT_ICMP_NO_FLOW: i32 = -111;
/// Translated, at a pod's device, for that same pod (a pod that reached
/// itself through a Service): back in it goes.
const ACT_HAIRPIN: i32 = -112;

pub struct Pkt<A> {
    l4: usize,
    proto: u8,
    saddr: A,
    daddr: A,
    sport: u16,
    dport: u16,
    tcp_flags: u8,
    /// A later fragment of a datagram: no L4 header; its ports are the
    /// first fragment's.
    later: bool,
}

impl<A: Copy> Pkt<A> {
    fn key(&self) -> NatKey<A> {
        NatKey { saddr: self.saddr, daddr: self.daddr, sport: self.sport, dport: self.dport, proto: self.proto, _pad: [0; 3] }
    }

    /// The key replies of this packet's tuple would have.
    fn reverse_key(&self) -> NatKey<A> {
        NatKey { saddr: self.daddr, daddr: self.saddr, sport: self.dport, dport: self.sport, proto: self.proto, _pad: [0; 3] }
    }
}

/// A stack buffer that helpers may read as 32-bit words.
#[repr(C, align(4))]
struct Buf<const N: usize>([u8; N]);

/// An ICMPv6 error about the packet (`Ip6::icmp_reply`), `N` bytes in
/// all: the IPv6 header (40), the ICMPv6 header (8), and the quote (`N` -
/// 48 bytes of the packet from its IPv6 header on).
#[inline(always)]
fn icmp6_reply<const N: usize, const L: usize>(ctx: &TcContext, kind: (u8, u8), mtu: u32, l4: usize) -> Result<(), i64> {
    let mut b = Buf([0u8; N]);
    // SAFETY: offset 48 of an N-byte buffer, N - 48 bytes.
    load_exact(ctx, L, unsafe { b.0.as_mut_ptr().add(48) }, (N - 48) as u32)?;
    let payload = (N - 40) as u16;
    b.0[0] = 0x60;
    b.0[4..6].copy_from_slice(&payload.to_be_bytes());
    b.0[6] = PROTO_ICMPV6;
    b.0[7] = 64;
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src.copy_from_slice(&b.0[48 + 24..48 + 40]);
    dst.copy_from_slice(&b.0[48 + 8..48 + 24]);
    b.0[8..24].copy_from_slice(&src);
    b.0[24..40].copy_from_slice(&dst);
    (b.0[40], b.0[41]) = kind;
    // The next hop's MTU (packet too big).
    b.0[44..48].copy_from_slice(&mtu.to_be_bytes());
    let pseudo = Buf([0, 0, (payload >> 8) as u8, payload as u8, 0, 0, 0, PROTO_ICMPV6]);
    // SAFETY: offsets inside a 4-aligned buffer of N bytes.
    let s = csum_add(unsafe { b.0.as_ptr().add(8) }, (N - 8) as u32, 0);
    let s = csum_add(pseudo.0.as_ptr(), 8, s);
    b.0[42..44].copy_from_slice(&csum_fold(s).to_ne_bytes());
    emit::<_, L>(ctx, &b, l4)
}

/// Sum `len` bytes at `p` into the running checksum `seed` (not folded).
#[inline(always)]
fn csum_add(p: *const u8, len: u32, seed: u32) -> u32 {
    // SAFETY: p points to at least len readable bytes of a stack buffer.
    unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, p as *mut u32, len, seed) as u32 }
}

/// Read a `T` at `off` straight from the packet's linear data (no helper
/// call: parsing was most of a packet's cost). The programs make the
/// headers linear first (`pull_headers`); what is not there is no header
/// of ours.
#[inline(always)]
fn ld<T: Copy>(ctx: &TcContext, off: usize) -> Result<T, i64> {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + off + size_of::<T>() <= end {
        // SAFETY: within the packet's linear data, checked just above.
        return Ok(unsafe { core::ptr::read_unaligned((start + off) as *const T) });
    }
    Err(-1)
}

/// How much of a packet `pull_headers` makes linear: IPv4 with options and
/// TCP; IPv6 with extension headers and TCP.
const PULLED: usize = ETH_HLEN + 108;

/// The headers the programs read (Ethernet, IP with options, L4) in the
/// linear data, as bpf_skb_pull_data makes them: once per packet, and only
/// when the driver left them elsewhere.
#[inline(always)]
fn pull_headers(ctx: &TcContext) {
    let linear = ctx.data_end() - ctx.data();
    let want = (ctx.len() as usize).min(PULLED);
    if linear < want {
        let _ = ctx.pull_data(want as u32);
    }
}

/// Read the byte at `off` (as two: LLVM turns a one-byte bound check into
/// one the verifier cannot use).
#[inline(always)]
fn ld8(ctx: &TcContext, off: usize) -> Result<u8, i64> {
    ld::<[u8; 2]>(ctx, off).map(|b| b[0])
}

/// Read exactly `len` bytes at `off` into `dst` (a constant length, which the
/// verifier needs; aya's load_bytes clamps it to the packet).
#[inline(always)]
fn load_exact(ctx: &TcContext, off: usize, dst: *mut u8, len: u32) -> Result<(), i64> {
    // SAFETY: dst points to at least len writable bytes of a stack buffer.
    let rc = unsafe { bpf_skb_load_bytes(ctx.skb.skb as *const _, off as u32, dst.cast(), len) };
    if rc == 0 { Ok(()) } else { Err(rc) }
}

/// Write a `T` at `off` straight into the packet's linear data (the
/// program may: the kernel unclones the headers of a program that writes).
#[inline(always)]
fn st<T>(ctx: &TcContext, off: usize, v: T) -> Result<(), i64> {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + off + size_of::<T>() <= end {
        // SAFETY: within the packet's linear data, checked just above.
        unsafe { core::ptr::write_unaligned((start + off) as *mut T, v) };
        return Ok(());
    }
    Err(-1)
}

/// What replacing the 16-bit word `old` by `new` adds to a one's
/// complement sum (RFC 1624: ~m + m'); summed over words, the `diff` the
/// checksum helpers take with a field size of 0.
#[inline(always)]
fn word_diff(old: u16, new: u16) -> u32 {
    (!old) as u32 + new as u32
}

/// The words of the `n` bytes at `old` replaced by those at `new`.
#[inline(always)]
fn addr_diff(old: *const u8, new: *const u8, n: usize) -> u32 {
    let mut d = 0u32;
    let mut i = 0;
    while i < 16 {
        if i < n {
            // SAFETY: the callers pass n readable bytes at each.
            let (o, w) = unsafe { ((old.add(i) as *const u16).read_unaligned(), (new.add(i) as *const u16).read_unaligned()) };
            d += word_diff(o, w);
        }
        i += 2;
    }
    d
}

#[inline(always)]
fn csum_fold(s: u32) -> u16 {
    let mut c = (s & 0xffff) + (s >> 16);
    c = (c & 0xffff) + (c >> 16);
    !(c as u16)
}

/// Whether the packet is a GSO one (segments to be cut later: GRO merged
/// it, or a local sender's offload made it).
#[inline(always)]
fn gso(ctx: &TcContext) -> bool {
    // SAFETY: the context's own field.
    unsafe { (*ctx.skb.skb).gso_size != 0 }
}

/// One address family's packet layout and NAT table.
trait Net: Family<A: Copy + PartialEq + Default> {
    /// Length of the link-layer header before the IP header: 14 on
    /// Ethernet devices, 0 on L3 devices (WireGuard, IPIP, GRE, TUN).
    const L2: usize;
    /// Offsets of the source and destination addresses from the frame start.
    const SRC: usize;
    const DST: usize;
    /// Bits of an address.
    const BITS: u32;
    /// Length of the fixed IP header.
    const IH: usize;
    /// Offset of the protocol (next header) byte in the IP header.
    const PROTO_OFF: usize;
    /// ICMP's protocol number in this family.
    const ICMP: u8;
    /// The socket address family (AF_INET, AF_INET6), for bpf_fib_lookup.
    const AF: u8;
    /// Where L4 starts and which protocol it is (IPv6: after hop-by-hop,
    /// destination options and fragment headers); None: not a packet for
    /// us (another IP version, a malformed header).
    fn l4(ctx: &TcContext) -> Option<(usize, u8)>;
    /// Where the IP packet ends by its header's length (the skb's end for
    /// a GSO packet past 64 KiB, whose length field is 0): the stack trims
    /// what follows (Ethernet padding) before it reads L4.
    fn ip_end(ctx: &TcContext) -> usize;
    fn nat_get(k: &NatKey<Self::A>) -> Option<*mut NatEntry<Self::A>>;
    /// The flow in an upgrade's old table (`LB4_NAT_PREV`).
    fn nat_prev(k: &NatKey<Self::A>) -> Option<*const NatEntry<Self::A>>;
    fn nat_put(k: &NatKey<Self::A>, v: &NatEntry<Self::A>, flags: u64) -> bool;
    /// Write a flow's entry into an upgrade's old table too
    /// (`share_with_old`).
    fn nat_prev_put(k: &NatKey<Self::A>, v: &NatEntry<Self::A>, flags: u64);
    fn nat_del(k: &NatKey<Self::A>);
    fn scratch() -> Option<*mut Scratch<Self::A>>;
    /// The node address SNATed flows leave from (zero: none).
    fn snat_addr(cfg: &NodeConfig) -> Self::A;
    /// Whether `a` is one of the node's own addresses that the stack
    /// refuses as a source from outside (IPv4: any interface's,
    /// `LB_LOCAL4`, and loopback's; IPv6 has no such check).
    fn own(a: Self::A) -> bool;
    /// Whether a packet from `a` is one the stack never forwards (a
    /// martian source: unspecified, loopback, multicast, broadcast; IPv6
    /// link-local and IPv4-mapped too).
    fn martian(a: Self::A) -> bool;
    /// The IP header's protocol (IPv6: next header) and source address;
    /// None when the stack would discard the header before any netfilter
    /// hook (`ip_rcv_core`, `ipv6_rcv`): a wrong version, an IPv4 header
    /// length under 20 bytes, a length in the header beyond the packet
    /// (truncated), an IPv4 header checksum that does not add up; or when
    /// the packet is too short to hold one.
    fn head(ctx: &TcContext) -> Option<(u8, Self::A)>;
    /// The address in 16 bytes (IPv4 in the first 4).
    fn wide(a: Self::A) -> [u8; 16];
    /// Replace the address at `off`, fixing the L4 checksum at `csum` (when
    /// `l4_csum`) and the IP header checksum (IPv4).
    fn set_addr(ctx: &TcContext, off: usize, csum: usize, l4_csum: bool, mangled: u64, old: Self::A, new: Self::A) -> Result<(), i64>;
    /// ICMP (type, code) of port unreachable, fragmentation needed /
    /// packet too big, and time exceeded in transit.
    const PORT_UNREACHABLE: (u8, u8);
    const TOO_BIG: (u8, u8);
    const TIME_EXCEEDED: (u8, u8);
    /// Turn the packet into an ICMP error `kind` to its source, from its
    /// destination, quoting its headers; `mtu` (if not 0) is the next hop's.
    fn icmp_reply(ctx: &TcContext, kind: (u8, u8), mtu: u32, l4: usize) -> Result<(), i64>;
    /// The packet's TTL / hop limit.
    fn ttl(ctx: &TcContext) -> u8;
    /// Whether ICMP type `ty` is an error that quotes the packet it is about.
    fn icmp_is_error(ty: u8) -> bool;
    /// Whether the IP header at the start of `b` is one we translate inside
    /// an ICMP error (no options or extension headers, not a later fragment).
    fn inner_ok(b: &[u8; 60]) -> bool;
    /// Fix the IP header at the start of `b` after its addresses changed
    /// (IPv4: its checksum).
    fn inner_fix(b: &mut [u8; 60]);
    /// The source and destination of a route lookup.
    fn fib_addrs(f: &mut bpf_fib_lookup, src: Self::A, dst: Self::A);
    /// The source address a route lookup chose (`BPF_FIB_LOOKUP_SRC`).
    fn fib_src(f: &bpf_fib_lookup) -> Self::A;
    /// Add the DSR option (IPv4) or header (IPv6) naming the frontend in
    /// the scratch value; `DSR_LEN` bytes.
    fn dsr_add(skb: *mut __sk_buff) -> i32;
    const DSR_LEN: usize;
    /// The next hop a route lookup found, for bpf_redirect_neigh.
    fn next_hop(f: &bpf_fib_lookup, nh: &mut bpf_redir_neigh);
    /// Decrement the TTL / hop limit, as a router does (IPv4: with its
    /// header checksum).
    fn dec_ttl(ctx: &TcContext) -> Result<(), i64>;
    /// Whether routers may fragment the packet (IPv4 without DF).
    fn may_fragment(ctx: &TcContext) -> bool;
    /// The packet's fragment: (identification, offset is 0, more fragments
    /// follow). None: not a fragment.
    fn fragment(ctx: &TcContext) -> Option<(u32, bool, bool)>;
    /// Fragment ports: remember / recall the ports of a fragmented datagram.
    fn frag_put(p: &Pkt<Self::A>, id: u32);
    fn frag_get(saddr: Self::A, daddr: Self::A, proto: u8, id: u32) -> Option<(u16, u16)>;
    /// Turn the packet (a TCP segment of flow `p`) into a RST to its source,
    /// from its destination.
    fn tcp_reset(ctx: &TcContext, p: &Pkt<Self::A>, seq: u32, ack: u32, flags: u8) -> Result<(), i64>;
    /// The TCP payload length of the packet (for the RST's acknowledgement).
    fn tcp_payload(ctx: &TcContext, l4: usize) -> Option<u32>;
}

impl<const L: usize> Net for Ip4<L> {
    const L2: usize = L;
    const SRC: usize = L + 12;
    const DST: usize = L + 16;
    const BITS: u32 = 32;
    const IH: usize = 20;
    const PROTO_OFF: usize = 9;
    const ICMP: u8 = PROTO_ICMP;
    const AF: u8 = 2;
    const PORT_UNREACHABLE: (u8, u8) = (3, 3);
    const TOO_BIG: (u8, u8) = (3, 4);
    const TIME_EXCEEDED: (u8, u8) = (11, 0);
    const DSR_LEN: usize = dsr::OPT_LEN;

    #[inline(always)]
    fn ip_end(ctx: &TcContext) -> usize {
        match ld::<u16>(ctx, L + 2).map(u16::from_be) {
            Ok(0) | Err(_) => ctx.len() as usize,
            Ok(tot) => L + tot as usize,
        }
    }
    #[inline(always)]
    fn l4(ctx: &TcContext) -> Option<(usize, u8)> {
        let vihl = ld8(ctx, L).ok()?;
        let ihl = ((vihl & 0x0f) as usize) * 4;
        if vihl >> 4 != 4 || ihl < 20 {
            return None;
        }
        Some((L + ihl, ld8(ctx, L + 9).ok()?))
    }
    #[inline(always)]
    fn fragment(ctx: &TcContext) -> Option<(u32, bool, bool)> {
        let frag = u16::from_be(ld::<u16>(ctx, L + 6).ok()?);
        if frag & 0x3fff == 0 {
            return None;
        }
        let id = u16::from_be(ctx.load::<u16>(L + 4).ok()?);
        Some((id as u32, frag & 0x1fff == 0, frag & 0x2000 != 0))
    }
    #[inline(always)]
    fn frag_put(p: &Pkt<A4>, id: u32) {
        let k = FragKey { saddr: p.saddr, daddr: p.daddr, id: id as u16, proto: p.proto, _pad: 0 };
        let _ = LB4_FRAG.insert(&k, &FragPorts { sport: p.sport, dport: p.dport }, 0);
    }
    #[inline(always)]
    fn frag_get(saddr: A4, daddr: A4, proto: u8, id: u32) -> Option<(u16, u16)> {
        let k = FragKey { saddr, daddr, id: id as u16, proto, _pad: 0 };
        // SAFETY: a map value, read at once.
        LB4_FRAG.get_ptr(&k).map(|v| unsafe { ((*v).sport, (*v).dport) })
    }
    #[inline(always)]
    fn icmp_is_error(ty: u8) -> bool {
        // Destination unreachable, time exceeded, parameter problem.
        ty == 3 || ty == 11 || ty == 12
    }
    #[inline(always)]
    fn inner_ok(b: &[u8; 60]) -> bool {
        b[0] == 0x45 && (b[6] & 0x1f) == 0 && b[7] == 0
    }
    #[inline(always)]
    fn inner_fix(b: &mut [u8; 60]) {
        b[10] = 0;
        b[11] = 0;
        let c = csum_fold(csum_add(b.as_ptr(), 20, 0));
        b[10..12].copy_from_slice(&c.to_ne_bytes());
    }
    #[inline(always)]
    fn fib_addrs(f: &mut bpf_fib_lookup, src: A4, dst: A4) {
        f.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(src);
        f.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(dst);
    }
    #[inline(always)]
    fn fib_src(f: &bpf_fib_lookup) -> A4 {
        // SAFETY: the IPv4 member of the union, which an IPv4 lookup fills.
        unsafe { f.__bindgen_anon_3.ipv4_src }.to_ne_bytes()
    }
    #[inline(always)]
    fn next_hop(f: &bpf_fib_lookup, nh: &mut bpf_redir_neigh) {
        // SAFETY: the lookup left the next hop (gateway or destination) here.
        nh.__bindgen_anon_1.ipv4_nh = unsafe { f.__bindgen_anon_4.ipv4_dst };
    }
    #[inline(always)]
    fn dsr_add(skb: *mut __sk_buff) -> i32 {
        let Some(sc) = Self::scratch() else { return TC_ACT_SHOT };
        // SAFETY: this CPU's scratch value, set by forward for this packet.
        let (addr, port) = unsafe { ((*sc).front_addr, (*sc).front_port) };
        dsr::add_option::<L>(skb, addr, port)
    }
    #[inline(always)]
    fn dec_ttl(ctx: &TcContext) -> Result<(), i64> {
        // TTL and protocol form one 16-bit word of the header checksum.
        let old: [u8; 2] = ctx.load(L + 8)?;
        let new = [old[0].wrapping_sub(1), old[1]];
        ctx.l3_csum_replace(L + 10, u16::from_ne_bytes(old) as u64, u16::from_ne_bytes(new) as u64, 2)?;
        ctx.store(L + 8, &new, 0)
    }
    #[inline(always)]
    fn may_fragment(ctx: &TcContext) -> bool {
        ctx.load::<u8>(L + 6).is_ok_and(|b| b & 0x40 == 0)
    }
    #[inline(always)]
    fn nat_get(k: &NatKey<A4>) -> Option<*mut NatEntry<A4>> {
        match LB4_NAT.get_ptr_mut(k) {
            None if upgrading() && adopt::<Self>(k) => LB4_NAT.get_ptr_mut(k),
            e => e,
        }
    }
    #[inline(always)]
    fn nat_prev(k: &NatKey<A4>) -> Option<*const NatEntry<A4>> {
        LB4_NAT_PREV.get_ptr(k)
    }
    #[inline(always)]
    fn nat_put(k: &NatKey<A4>, v: &NatEntry<A4>, flags: u64) -> bool {
        LB4_NAT.insert(k, v, flags).is_ok()
    }
    #[inline(always)]
    fn nat_prev_put(k: &NatKey<A4>, v: &NatEntry<A4>, flags: u64) {
        let _ = LB4_NAT_PREV.insert(k, v, flags);
    }
    #[inline(always)]
    fn nat_del(k: &NatKey<A4>) {
        let _ = LB4_NAT.remove(k);
        // Else its next packet would take the old copy back.
        if upgrading() {
            let _ = LB4_NAT_PREV.remove(k);
        }
    }
    #[inline(always)]
    fn scratch() -> Option<*mut Scratch<A4>> {
        LB4_SCRATCH.get_ptr_mut(0)
    }
    #[inline(always)]
    fn snat_addr(cfg: &NodeConfig) -> A4 {
        cfg.snat_addr
    }
    #[inline(always)]
    fn own(a: A4) -> bool {
        // 127/8 too: the stack takes it from outside where route_localnet
        // is set (kube-proxy's iptables mode sets it) with lb's
        // accept_local.
        // SAFETY: a hash lookup; the value is not kept.
        a[0] == 127 || unsafe { LB_LOCAL4.get(&a).is_some() }
    }
    #[inline(always)]
    fn martian(a: A4) -> bool {
        // 0/8, 127/8, multicast (224/4), the limited broadcast; not class
        // E (240/4), which Linux routes (pod ranges use it).
        a[0] == 0 || a[0] == 127 || (a[0] >= 224 && a[0] < 240) || a == [255; 4]
    }
    #[inline(always)]
    fn head(ctx: &TcContext) -> Option<(u8, A4)> {
        // One load of the fixed header (by helper: the caller's frame has
        // no packet pointers), summed as 16-bit words in registers.
        let h: [u32; 5] = ctx.load(L).ok()?;
        let b0 = h[0].to_ne_bytes();
        let ihl = (b0[0] & 0x0f) as usize;
        if b0[0] >> 4 != 4 || ihl < 5 {
            return None;
        }
        // 0 is a GSO packet's past 64 KiB (BIG TCP): its length is the
        // skb's; on any other packet, a header error.
        let tot = u16::from_be_bytes([b0[2], b0[3]]) as usize;
        let bad = if tot == 0 { !gso(ctx) } else { tot < ihl * 4 || tot > (ctx.len() as usize).saturating_sub(L) };
        if bad {
            return None;
        }
        let mut sum: u64 = 0;
        for w in h {
            sum += (w & 0xffff) as u64 + (w >> 16) as u64;
        }
        // Options (a DSR option among them): word by word, rare.
        let mut i = 5;
        while i < 15 {
            if i >= ihl {
                break;
            }
            let w: u32 = ctx.load(L + i * 4).ok()?;
            sum += (w & 0xffff) as u64 + (w >> 16) as u64;
            i += 1;
        }
        // At most 30 halves: two folds carry everything (no loop the
        // verifier would have to walk per value).
        sum = (sum & 0xffff) + (sum >> 16);
        sum = (sum & 0xffff) + (sum >> 16);
        if sum != 0xffff {
            return None;
        }
        let b2 = h[2].to_ne_bytes();
        Some((b2[1], h[3].to_ne_bytes()))
    }
    #[inline(always)]
    fn wide(a: A4) -> [u8; 16] {
        let mut w = [0u8; 16];
        w[..4].copy_from_slice(&a);
        w
    }
    #[inline(always)]
    fn set_addr(ctx: &TcContext, off: usize, csum: usize, l4_csum: bool, mangled: u64, old: A4, new: A4) -> Result<(), i64> {
        let (from, to) = (u32::from_ne_bytes(old) as u64, u32::from_ne_bytes(new) as u64);
        if l4_csum {
            ctx.l4_csum_replace(csum, from, to, BPF_F_PSEUDO_HDR as u64 | mangled | 4)?;
        }
        ctx.l3_csum_replace(L + 10, from, to, 4)?;
        ctx.store(off, &new, 0)
    }
    #[inline(always)]
    fn ttl(ctx: &TcContext) -> u8 {
        ctx.load(L + 8).unwrap_or(0)
    }
    #[inline(always)]
    fn icmp_reply(ctx: &TcContext, kind: (u8, u8), mtu: u32, l4: usize) -> Result<(), i64> {
        // IP header (20), ICMP header (8), the packet's IP header and the
        // first 8 bytes of its L4 header (28). Only packets without IP options.
        let vihl: u8 = ctx.load(L)?;
        if vihl != 0x45 {
            return Err(-1);
        }
        let mut b = Buf([0u8; 56]);
        // SAFETY: offset 28 of a 56-byte buffer.
        load_exact(ctx, L, unsafe { b.0.as_mut_ptr().add(28) }, 28)?;
        b.0[0] = 0x45;
        b.0[2..4].copy_from_slice(&56u16.to_be_bytes());
        b.0[8] = 64;
        b.0[9] = PROTO_ICMP;
        let (src, dst) = (Self::SRC - L + 28, Self::DST - L + 28);
        let (osrc, odst): (A4, A4) = (b.0[src..src + 4].try_into().map_err(|_| -1i64)?, b.0[dst..dst + 4].try_into().map_err(|_| -1i64)?);
        b.0[12..16].copy_from_slice(&odst);
        b.0[16..20].copy_from_slice(&osrc);
        (b.0[20], b.0[21]) = kind;
        // The next hop's MTU (fragmentation needed).
        b.0[26..28].copy_from_slice(&(mtu as u16).to_be_bytes());
        let ip = csum_fold(csum_add(b.0.as_ptr(), 20, 0));
        b.0[10..12].copy_from_slice(&ip.to_ne_bytes());
        // SAFETY: offset 20 of a 4-aligned buffer of 56 bytes.
        let icmp = csum_fold(csum_add(unsafe { b.0.as_ptr().add(20) }, 36, 0));
        b.0[22..24].copy_from_slice(&icmp.to_ne_bytes());
        emit::<_, L>(ctx, &b, l4)
    }
    #[inline(always)]
    fn tcp_reset(ctx: &TcContext, p: &Pkt<A4>, seq: u32, ack: u32, flags: u8) -> Result<(), i64> {
        let mut b = Buf([0u8; 40]);
        b.0[0] = 0x45;
        b.0[2..4].copy_from_slice(&40u16.to_be_bytes());
        b.0[8] = 64;
        b.0[9] = PROTO_TCP;
        b.0[12..16].copy_from_slice(&p.daddr);
        b.0[16..20].copy_from_slice(&p.saddr);
        tcp_rst_header(&mut b.0, 20, p, seq, ack, flags);
        let ip = csum_fold(csum_add(b.0.as_ptr(), 20, 0));
        b.0[10..12].copy_from_slice(&ip.to_ne_bytes());
        let pseudo = Buf([0, PROTO_TCP, 0, 20]);
        // SAFETY: offsets inside a 4-aligned buffer of 40 bytes.
        let s = csum_add(unsafe { b.0.as_ptr().add(12) }, 28, 0);
        let s = csum_add(pseudo.0.as_ptr(), 4, s);
        b.0[36..38].copy_from_slice(&csum_fold(s).to_ne_bytes());
        emit::<_, L>(ctx, &b, p.l4)
    }
    #[inline(always)]
    fn tcp_payload(ctx: &TcContext, l4: usize) -> Option<u32> {
        let total = u16::from_be(ctx.load::<u16>(L + 2).ok()?) as u32;
        let doff = (ctx.load::<u8>(l4 + 12).ok()? >> 4) as u32 * 4;
        Some(total.saturating_sub((l4 - L) as u32 + doff))
    }
}

impl<const L: usize> Net for Ip6<L> {
    const L2: usize = L;
    const SRC: usize = L + 8;
    const DST: usize = L + 24;
    const BITS: u32 = 128;
    const IH: usize = 40;
    const PROTO_OFF: usize = 6;
    const ICMP: u8 = PROTO_ICMPV6;
    const AF: u8 = 10;
    const PORT_UNREACHABLE: (u8, u8) = (1, 4);
    const TOO_BIG: (u8, u8) = (2, 0);
    const TIME_EXCEEDED: (u8, u8) = (3, 0);
    const DSR_LEN: usize = dsr::OPT6_LEN;

    #[inline(always)]
    fn l4(ctx: &TcContext) -> Option<(usize, u8)> {
        v6_walk::<L>(ctx).map(|(l4, proto, _)| (l4, proto))
    }
    #[inline(always)]
    fn ip_end(ctx: &TcContext) -> usize {
        match ld::<u16>(ctx, L + 4).map(u16::from_be) {
            Ok(0) | Err(_) => ctx.len() as usize,
            Ok(payload) => L + 40 + payload as usize,
        }
    }
    #[inline(always)]
    fn fragment(ctx: &TcContext) -> Option<(u32, bool, bool)> {
        let (_, _, at) = v6_walk::<L>(ctx)?;
        if at == 0 {
            return None;
        }
        // Next header, reserved, offset (13 bits) and M, identification.
        let off_m = u16::from_be(ld::<u16>(ctx, at + 2).ok()?);
        let id = u32::from_be(ld::<u32>(ctx, at + 4).ok()?);
        Some((id, off_m & 0xfff8 == 0, off_m & 1 != 0))
    }
    #[inline(always)]
    fn frag_put(p: &Pkt<A6>, id: u32) {
        let k = Frag6Key { saddr: p.saddr, daddr: p.daddr, id, proto: p.proto, _pad: [0; 3] };
        let _ = LB6_FRAG.insert(&k, &FragPorts { sport: p.sport, dport: p.dport }, 0);
    }
    #[inline(always)]
    fn frag_get(saddr: A6, daddr: A6, proto: u8, id: u32) -> Option<(u16, u16)> {
        let k = Frag6Key { saddr, daddr, id, proto, _pad: [0; 3] };
        // SAFETY: a map value, read at once.
        LB6_FRAG.get_ptr(&k).map(|v| unsafe { ((*v).sport, (*v).dport) })
    }
    #[inline(always)]
    fn icmp_is_error(ty: u8) -> bool {
        // Destination unreachable, packet too big, time exceeded, parameter
        // problem (informational messages are 128 and up).
        (1..=4).contains(&ty)
    }
    #[inline(always)]
    fn inner_ok(b: &[u8; 60]) -> bool {
        b[0] >> 4 == 6
    }
    #[inline(always)]
    fn inner_fix(_: &mut [u8; 60]) {}
    #[inline(always)]
    fn fib_addrs(f: &mut bpf_fib_lookup, src: A6, dst: A6) {
        let w = |a: &A6, i: usize| u32::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]);
        f.__bindgen_anon_3.ipv6_src = [w(&src, 0), w(&src, 4), w(&src, 8), w(&src, 12)];
        f.__bindgen_anon_4.ipv6_dst = [w(&dst, 0), w(&dst, 4), w(&dst, 8), w(&dst, 12)];
    }
    #[inline(always)]
    fn fib_src(f: &bpf_fib_lookup) -> A6 {
        // SAFETY: the IPv6 member of the union, which an IPv6 lookup fills.
        let w = unsafe { f.__bindgen_anon_3.ipv6_src };
        let mut a = [0u8; 16];
        for (i, v) in w.iter().enumerate() {
            a[i * 4..i * 4 + 4].copy_from_slice(&v.to_ne_bytes());
        }
        a
    }
    #[inline(always)]
    fn next_hop(f: &bpf_fib_lookup, nh: &mut bpf_redir_neigh) {
        // SAFETY: the lookup left the next hop (gateway or destination) here.
        nh.__bindgen_anon_1.ipv6_nh = unsafe { f.__bindgen_anon_4.ipv6_dst };
    }
    #[inline(always)]
    fn dsr_add(skb: *mut __sk_buff) -> i32 {
        let Some(sc) = Self::scratch() else { return TC_ACT_SHOT };
        // SAFETY: this CPU's scratch value, set by forward for this packet.
        let (addr, port) = unsafe { ((*sc).front_addr, (*sc).front_port) };
        dsr::add_option6::<L>(skb, addr, port)
    }
    #[inline(always)]
    fn dec_ttl(ctx: &TcContext) -> Result<(), i64> {
        let hop: u8 = ctx.load(L + 7)?;
        ctx.store(L + 7, &hop.wrapping_sub(1), 0)
    }
    #[inline(always)]
    fn may_fragment(_: &TcContext) -> bool {
        false
    }
    #[inline(always)]
    fn nat_get(k: &NatKey<A6>) -> Option<*mut NatEntry<A6>> {
        match LB6_NAT.get_ptr_mut(k) {
            None if upgrading() && adopt::<Self>(k) => LB6_NAT.get_ptr_mut(k),
            e => e,
        }
    }
    #[inline(always)]
    fn nat_prev(k: &NatKey<A6>) -> Option<*const NatEntry<A6>> {
        LB6_NAT_PREV.get_ptr(k)
    }
    #[inline(always)]
    fn nat_put(k: &NatKey<A6>, v: &NatEntry<A6>, flags: u64) -> bool {
        LB6_NAT.insert(k, v, flags).is_ok()
    }
    #[inline(always)]
    fn nat_prev_put(k: &NatKey<A6>, v: &NatEntry<A6>, flags: u64) {
        let _ = LB6_NAT_PREV.insert(k, v, flags);
    }
    #[inline(always)]
    fn nat_del(k: &NatKey<A6>) {
        let _ = LB6_NAT.remove(k);
        if upgrading() {
            let _ = LB6_NAT_PREV.remove(k);
        }
    }
    #[inline(always)]
    fn scratch() -> Option<*mut Scratch<A6>> {
        LB6_SCRATCH.get_ptr_mut(0)
    }
    #[inline(always)]
    fn snat_addr(cfg: &NodeConfig) -> A6 {
        cfg.snat_addr6
    }
    #[inline(always)]
    fn own(_: A6) -> bool {
        false
    }
    #[inline(always)]
    fn martian(a: A6) -> bool {
        let hi = u64::from_be_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]);
        let lo = u64::from_be_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]);
        // ::, ::1, ::ffff:0:0/96; ff00::/8; fe80::/10.
        (hi == 0 && (lo <= 1 || lo >> 32 == 0xffff)) || a[0] == 0xff || (a[0] == 0xfe && a[1] & 0xc0 == 0x80)
    }
    #[inline(always)]
    fn head(ctx: &TcContext) -> Option<(u8, A6)> {
        let h: [u8; 24] = ctx.load(L).ok()?;
        if h[0] >> 4 != 6 {
            return None;
        }
        // 0 is a GSO packet's past 64 KiB (BIG TCP), or a jumbogram's
        // (left to the stack, as lb does not read its hop-by-hop option).
        let payload = u16::from_be_bytes([h[4], h[5]]) as usize;
        let bad = if payload == 0 { !gso(ctx) } else { payload + 40 > (ctx.len() as usize).saturating_sub(L) };
        if bad {
            return None;
        }
        let mut a = [0u8; 16];
        a.copy_from_slice(&h[8..24]);
        Some((h[6], a))
    }
    #[inline(always)]
    fn wide(a: A6) -> [u8; 16] {
        a
    }
    #[inline(always)]
    fn set_addr(ctx: &TcContext, off: usize, csum: usize, l4_csum: bool, mangled: u64, old: A6, new: A6) -> Result<(), i64> {
        if l4_csum {
            let (from, to) = (Buf(old), Buf(new));
            // SAFETY: two 16-byte, 4-aligned stack buffers.
            let diff = unsafe { bpf_csum_diff(from.0.as_ptr() as *mut u32, 16, to.0.as_ptr() as *mut u32, 16, 0) };
            ctx.l4_csum_replace(csum, 0, diff as u32 as u64, BPF_F_PSEUDO_HDR as u64 | mangled)?;
        }
        ctx.store(off, &new, 0)
    }
    #[inline(always)]
    fn ttl(ctx: &TcContext) -> u8 {
        ctx.load(L + 7).unwrap_or(0)
    }
    #[inline(always)]
    fn icmp_reply(ctx: &TcContext, kind: (u8, u8), mtu: u32, l4: usize) -> Result<(), i64> {
        // The quote: the packet's IPv6 header and 16 bytes after it where
        // it has them, so that an extension header (a first fragment's)
        // leaves the L4 ports in the quote, which the receiver needs to
        // find the socket (Linux's icmpv6_notify drops an error whose
        // quote ends with the extension header); else 8.
        if ctx.len() as usize >= L + 56 { icmp6_reply::<104, L>(ctx, kind, mtu, l4) } else { icmp6_reply::<96, L>(ctx, kind, mtu, l4) }
    }
    #[inline(always)]
    fn tcp_reset(ctx: &TcContext, p: &Pkt<A6>, seq: u32, ack: u32, flags: u8) -> Result<(), i64> {
        let mut b = Buf([0u8; 60]);
        b.0[0] = 0x60;
        b.0[4..6].copy_from_slice(&20u16.to_be_bytes());
        b.0[6] = PROTO_TCP;
        b.0[7] = 64;
        b.0[8..24].copy_from_slice(&p.daddr);
        b.0[24..40].copy_from_slice(&p.saddr);
        tcp_rst_header(&mut b.0, 40, p, seq, ack, flags);
        let pseudo = Buf([0, 0, 0, 20, 0, 0, 0, PROTO_TCP]);
        // SAFETY: offsets inside a 4-aligned buffer of 60 bytes.
        let s = csum_add(unsafe { b.0.as_ptr().add(8) }, 52, 0);
        let s = csum_add(pseudo.0.as_ptr(), 8, s);
        b.0[56..58].copy_from_slice(&csum_fold(s).to_ne_bytes());
        emit::<_, L>(ctx, &b, p.l4)
    }
    #[inline(always)]
    fn tcp_payload(ctx: &TcContext, l4: usize) -> Option<u32> {
        // The payload length counts extension headers too.
        let payload = u16::from_be(ctx.load::<u16>(L + 4).ok()?) as u32;
        let doff = (ctx.load::<u8>(l4 + 12).ok()? >> 4) as u32 * 4;
        Some(payload.saturating_sub((l4 - L - 40) as u32).saturating_sub(doff))
    }
}

/// Walk an IPv6 packet's extension headers: hop-by-hop and destination
/// options, up to `IPV6_EXT_MAX` headers, the last of them a fragment header.
/// Returns where the next header starts, which it is, and where the
/// fragment header is (0: none). A routing header (the destination the
/// L4 checksum covers would be another address), ESP, AH, or more headers
/// than that end the walk there: their next header is not TCP, UDP or
/// ICMPv6, so the packet is not ours and passes untouched. So do headers
/// that reach past what `pull_headers` makes linear.
#[inline(always)]
fn v6_walk<const L: usize>(ctx: &TcContext) -> Option<(usize, u8, usize)> {
    // SAFETY: our own skb.
    let r = v6_walk_packed::<L>(ctx.skb.skb);
    if r == 0 {
        return None;
    }
    Some((((r >> 16) & 0xff) as usize, r as u8, ((r >> 8) & 0xff) as usize))
}

/// `v6_walk` as one BPF function (each caller would inline the loop
/// otherwise), its answer packed: L4 offset << 16 | fragment header offset
/// << 8 | next header; 0 for not IPv6.
#[inline(never)]
fn v6_walk_packed<const L: usize>(skb: *mut __sk_buff) -> u32 {
    let ctx = &TcContext::new(skb);
    // Through a helper, which needs the skb itself: LLVM would otherwise
    // pass this function the packet pointers instead (argument promotion),
    // and the verifier refuses arithmetic on a passed packet end.
    let Ok(v) = ctx.load::<u8>(L) else { return 0 };
    if v >> 4 != 6 {
        return 0;
    }
    let Ok(mut nh) = ld8(ctx, L + 6) else { return 0 };
    let mut off = L + 40;
    let mut frag = 0;
    for _ in 0..IPV6_EXT_MAX {
        match nh {
            IPV6_HOPOPTS | IPV6_DSTOPTS => {
                let Ok([next, len]) = ld::<[u8; 2]>(ctx, off) else { return 0 };
                nh = next;
                off += (len as usize + 1) * 8;
            }
            // The last one walked: after it comes the fragmentable part,
            // which only the first fragment starts with. A fragmentable
            // part that starts with another extension header (destination
            // options after the fragment header) is not ours, in every
            // fragment alike.
            IPV6_FRAGMENT => {
                let Ok(next) = ld8(ctx, off) else { return 0 };
                nh = next;
                frag = off;
                off += 8;
                break;
            }
            _ => break,
        }
        if off > PULLED {
            return 0;
        }
    }
    ((off as u32) << 16) | ((frag as u32) << 8) | nh as u32
}

/// A RST's TCP header at `at`: from the packet's destination to its source.
#[inline(always)]
fn tcp_rst_header<A, const N: usize>(b: &mut [u8; N], at: usize, p: &Pkt<A>, seq: u32, ack: u32, flags: u8) {
    b[at..at + 2].copy_from_slice(&p.dport.to_be_bytes());
    b[at + 2..at + 4].copy_from_slice(&p.sport.to_be_bytes());
    b[at + 4..at + 8].copy_from_slice(&seq.to_be_bytes());
    b[at + 8..at + 12].copy_from_slice(&ack.to_be_bytes());
    b[at + 12] = 5 << 4;
    b[at + 13] = flags;
}

/// bpf_skb_adjust_room's mode: room between the L2 and L3 headers.
const BPF_ADJ_ROOM_MAC: u32 = 1;
/// bpf_skb_store_bytes: keep a CHECKSUM_COMPLETE skb's sum right.
const BPF_F_RECOMPUTE_CSUM: u64 = 1;

/// Make the packet exactly the frame header plus `b`, then send it back out
/// of the interface it came in on, with the MAC addresses swapped. `l4`:
/// where the L4 header of the packet being answered starts.
///
/// The answer is made from that packet's skb, and with it its checksum
/// state. A packet with a partial checksum (CHECKSUM_PARTIAL: every GRO'd
/// TCP packet from a NIC, a local sender's segments) would leave with it:
/// the device sending the answer would finish "its" checksum at the old L4
/// header's offset, over the checksums computed here (a RST's would be
/// wrong, an ICMP error's quote or MTU overwritten). Pulling the frame
/// past that offset is what drops the partial state in the kernel
/// (skb_postpull_rcsum), and the pull also drops CHECKSUM_UNNECESSARY: so
/// the frame is grown to `l4 + 2` bytes more than the answer, those bytes
/// are removed behind the MAC header, and the answer leaves with
/// CHECKSUM_NONE and checksums complete.
#[inline(always)]
fn emit<const N: usize, const L: usize>(ctx: &TcContext, b: &Buf<N>, l4: usize) -> Result<(), i64> {
    let mut mac = [0u8; 12];
    if L != 0 {
        load_exact(ctx, 0, mac.as_mut_ptr(), 12)?;
    }
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&mac[6..]);
    swapped[6..].copy_from_slice(&mac[..6]);
    let pull = l4 + 2;
    // SAFETY: helpers on the program's own skb, stack buffers of the given sizes.
    unsafe {
        let rc = bpf_skb_change_tail(ctx.skb.skb, (L + pull + N) as u32, 0);
        if rc != 0 {
            return Err(rc);
        }
    }
    ctx.adjust_room(-(pull as i32), BPF_ADJ_ROOM_MAC, 0)?;
    // SAFETY: as above.
    unsafe {
        if L != 0 {
            let rc = bpf_skb_store_bytes(ctx.skb.skb, 0, swapped.as_ptr().cast(), 12, BPF_F_RECOMPUTE_CSUM);
            if rc != 0 {
                return Err(rc);
            }
        }
        let rc = bpf_skb_store_bytes(ctx.skb.skb, L as u32, b.0.as_ptr().cast(), N as u32, BPF_F_RECOMPUTE_CSUM);
        if rc != 0 {
            return Err(rc);
        }
    }
    Ok(())
}

/// Send the rebuilt packet back where it came from.
#[inline(always)]
fn bounce(ctx: &TcContext) -> i32 {
    // SAFETY: reading the skb's ifindex; a plain helper.
    unsafe { bpf_redirect((*ctx.skb.skb).ifindex, 0) as i32 }
}

#[inline(always)]
fn parse<F: Net>(ctx: &TcContext) -> Option<Pkt<F::A>> {
    let (l4, proto) = F::l4(ctx)?;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    let (saddr, daddr) = (ld(ctx, F::SRC).ok()?, ld(ctx, F::DST).ok()?);
    let frag = F::fragment(ctx);
    // A whole L4 header within the IP length, or it is not ours (RFC
    // 1858's tiny first fragment included; a runt whose IP length cuts its
    // L4 header, padded behind, which the stack trims and drops: before
    // 12-08 it made a flow).
    let hdr = if proto == PROTO_TCP { 20 } else { 8 };
    if !matches!(frag, Some((_, false, _))) && F::ip_end(ctx).min(ctx.len() as usize) < l4 + hdr {
        return None;
    }
    if let Some((id, false, _)) = frag {
        // A later fragment: the ports its first fragment carried (that one
        // came first on this path; if not, it passes untouched).
        let (sport, dport) = F::frag_get(saddr, daddr, proto, id)?;
        return Some(Pkt { l4, proto, saddr, daddr, sport, dport, tcp_flags: 0, later: true });
    }
    Some(Pkt {
        l4,
        proto,
        saddr,
        daddr,
        sport: u16::from_be(ld::<u16>(ctx, l4).ok()?),
        dport: u16::from_be(ld::<u16>(ctx, l4 + 2).ok()?),
        tcp_flags: if proto == PROTO_TCP { ld8(ctx, l4 + 13).ok()? } else { 0 },
        later: false,
    })
}

/// Parse the packet for the first step of a program: remember the ports
/// of a first fragment for the fragments after it; ICMP errors go to
/// their own step.
#[inline(always)]
fn parse_first<F: Net>(ctx: &TcContext) -> Result<Pkt<F::A>, i32> {
    let Some(p) = parse::<F>(ctx) else {
        return Err(if F::l4(ctx).is_some_and(|(_, proto)| proto == F::ICMP) { ACT_ICMP } else { TC_ACT_OK });
    };
    if let Some((id, true, true)) = F::fragment(ctx) {
        F::frag_put(&p, id);
    }
    Ok(p)
}

/// Rewrite addresses and ports, keeping the IP and L4 checksums right.
#[inline(always)]
fn rewrite<F: Net>(ctx: &TcContext, p: &Pkt<F::A>, e: &NatEntry<F::A>) -> Result<(), i64> {
    if p.later {
        // No L4 header here: the first fragment's checksum covers the
        // whole datagram, and was fixed with it.
        if p.saddr != e.to_saddr {
            F::set_addr(ctx, F::SRC, 0, false, 0, p.saddr, e.to_saddr)?;
        }
        if p.daddr != e.to_daddr {
            F::set_addr(ctx, F::DST, 0, false, 0, p.daddr, e.to_daddr)?;
        }
        return Ok(());
    }
    let csum = p.l4 + if p.proto == PROTO_TCP { 16 } else { 6 };
    // UDP over IPv4 may carry no checksum (0); it must stay 0.
    let l4_csum = p.proto == PROTO_TCP || ld::<u16>(ctx, csum)? != 0;
    let mangled = if p.proto == PROTO_UDP { BPF_F_MARK_MANGLED_0 as u64 } else { 0 };
    // Both addresses at once, the ports at once: one checksum diff each
    // (the address one covers the pseudo-header, which a partial checksum
    // holds; the port one not), then plain writes.
    let n = (F::BITS / 8) as usize;
    let bytes = |a: &F::A| a as *const F::A as *const u8;
    if p.saddr != e.to_saddr || p.daddr != e.to_daddr {
        let d = addr_diff(bytes(&p.saddr), bytes(&e.to_saddr), n) + addr_diff(bytes(&p.daddr), bytes(&e.to_daddr), n);
        if l4_csum {
            ctx.l4_csum_replace(csum, 0, d as u64, BPF_F_PSEUDO_HDR as u64 | mangled)?;
        }
        if F::ID == lb_common::FAMILY_V4 {
            ctx.l3_csum_replace(F::L2 + 10, 0, d as u64, 0)?;
        }
        st(ctx, F::SRC, e.to_saddr)?;
        st(ctx, F::DST, e.to_daddr)?;
    }
    if p.sport != e.to_sport || p.dport != e.to_dport {
        let (sport, dport) = (e.to_sport.to_be(), e.to_dport.to_be());
        if l4_csum {
            let d = word_diff(p.sport.to_be(), sport) + word_diff(p.dport.to_be(), dport);
            ctx.l4_csum_replace(csum, 0, d as u64, mangled)?;
        }
        st(ctx, p.l4, [sport, dport])?;
    }
    Ok(())
}

/// Rewrite a packet of a translated flow by `e`, and count it for the
/// flow's frontend.
#[inline(always)]
fn translate<F: Net>(ctx: &TcContext, p: &Pkt<F::A>, e: &NatEntry<F::A>) -> i32 {
    let rev_nat_id = e.rev_nat_id;
    // A packet that arrived (a client's, or a reply to a SNATed flow) goes
    // on through the stack unless forwarded in BPF: mark it for the
    // agent's netfilter rules (`fib::mark_for_stack`). Replies of local
    // backends leave on egress, past netfilter.
    let untracked = e.flags & (nat_flags::SNAT | nat_flags::DSR) != 0;
    let arrived = e.flags & nat_flags::REPLY == 0 || untracked;
    let masq = e.flags & nat_flags::MASQ != 0;
    let r = rewrite::<F>(ctx, p, e);
    match r {
        Ok(()) => {
            if arrived {
                fib::mark_for_stack(ctx.skb.skb, lb::node_flags(), untracked, masq);
            }
            packet_stats(F::ID, rev_nat_id, ctx.len());
            ACT_TRANSLATED
        }
        Err(_) => TC_ACT_SHOT,
    }
}

#[inline(never)]
fn packet_stats(family: u8, rev_nat_id: u16, len: u32) {
    lb::account(STATS_FRONTEND, family, rev_nat_id as u32, lb::Acct::Packet(len));
}

#[inline(never)]
fn flow_stats(family: u8, rev_nat_id: u16, backend_id: u32) {
    lb::account_conn(family, rev_nat_id, backend_id);
}

/// Note a packet (not the first) of the flow in its direction's entry.
#[inline(always)]
fn touch<A>(e: *mut NatEntry<A>, tcp_flags: u8) {
    // A SYN again (a retransmission, or a spoofed source's second) does not
    // assure the flow: what follows an answer does.
    let seen = if tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN { 0 } else { nat_state::SEEN };
    note(e, tcp_flags, seen, nat_state::FIN)
}

/// Note a backend's reply in entry `e` (flags `flags`). On the backend's
/// node of a DSR flow, where the client's handshake is never seen, a
/// SYN-ACK does not assure the flow: a backend answers every SYN, also a
/// flood's from spoofed sources, whose entries would otherwise live as
/// long as established ones (a day) and fill the table. There, the one
/// entry notes both ways: the backend's FIN is `FIN_REPLY`.
#[inline(always)]
fn touch_reply<A>(e: *mut NatEntry<A>, flags: u8, tcp_flags: u8) {
    let dsr = flags & nat_flags::DSR != 0;
    let syn = dsr && tcp_flags & TCP_SYN != 0;
    note(e, tcp_flags, if syn { 0 } else { nat_state::SEEN }, if dsr { nat_state::FIN_REPLY } else { nat_state::FIN })
}

/// Note a packet in entry `e`: its time, its FIN (as `fin`) / RST, and
/// `seen` (SEEN, or 0 for a packet that must not assure the flow: a DSR
/// client's packet on the backend's node).
#[inline(always)]
fn note<A>(e: *mut NatEntry<A>, tcp_flags: u8, seen: u8, fin: u8) {
    // SAFETY: e points into a map value; the fields are plain integers.
    unsafe {
        (*e).last_seen_ns = bpf_ktime_get_ns();
        let mut state = (*e).state | seen;
        if tcp_flags & TCP_FIN != 0 {
            state |= fin;
        }
        if tcp_flags & TCP_RST != 0 {
            state = (state | nat_state::RST) & !nat_state::AFTER_RST;
        } else if state & nat_state::RST != 0 {
            if state & nat_state::AFTER_RST == nat_state::AFTER_RST {
                // The side that sent the RST goes on: it did not send it.
                state &= !(nat_state::RST | nat_state::AFTER_RST);
            } else {
                // Maybe a packet sent before the RST (it stands).
                state += nat_state::AFTER_RST_ONE;
            }
        }
        if state != (*e).state {
            (*e).state = state;
        }
    }
}

/// How long a flow ended by a RST must have been quiet before a SYN gives
/// its tuple to another translation, where that would cut a live flow (a
/// DSR flow's entry; an option's SYN for a local flow's tuple, `dsr.rs`).
/// No sequence check vets a RST here: a forged RST and at once a forged
/// SYN would take a live flow's tuple; a live flow's packets keep it from
/// falling quiet. A client's real SYN right after its RST is dropped (or
/// follows the old entry) once: its retransmission, a second later, finds
/// the flow quiet (0.9 s: the RST went before the SYN, and a timer may
/// fire a little early).
const RST_QUIET_NS: u64 = 900_000_000;

/// Whether a flow whose last packet was at `last` fell quiet
/// (`RST_QUIET_NS`).
#[inline(always)]
fn quiet(last: u64) -> bool {
    // SAFETY: plain helper.
    unsafe { bpf_ktime_get_ns() }.saturating_sub(last) >= RST_QUIET_NS
}

/// Whether a flow has ended: a RST, or a FIN each way.
#[inline(always)]
fn closed(a: u8, b: u8) -> bool {
    (a | b) & nat_state::RST != 0 || (a & b) & nat_state::FIN != 0
}

/// Remove both entries of the flow that `e` (at `key`) belongs to.
#[inline(always)]
fn remove_flow<F: Net>(key: &NatKey<F::A>, e: &NatEntry<F::A>) {
    let other = e.other_key(key.proto);
    if partner::<F>(&other, key).is_some() {
        F::nat_del(&other);
    }
    F::nat_del(key);
}

/// The entry at `other` if it is the other half of the flow whose entry is
/// at `key` (its rewrite leads back to `key`). A key that has lost its half
/// can be taken by a new flow (a SNAT port freed and claimed again); that
/// flow's entry is not this flow's to read or remove.
#[inline(always)]
fn partner<F: Net>(other: &NatKey<F::A>, key: &NatKey<F::A>) -> Option<*mut NatEntry<F::A>> {
    let o = F::nat_get(other)?;
    // SAFETY: a map value, alive for this program run (RCU).
    (unsafe { &*o }.other_key(key.proto) == *key).then_some(o)
}

/// A stable hash of the original tuple, so a retransmitted first packet
/// picks the same backend and the same SNAT port.
#[inline(always)]
fn flow_hash<F: Net>(p: &Pkt<F::A>) -> u32 {
    let w = F::wide(p.saddr);
    let d = F::wide(p.daddr);
    let mut h = ((p.sport as u64) << 16 | p.dport as u64) ^ ((p.proto as u64) << 48);
    let mut i = 0;
    while i < 16 {
        h = h.rotate_left(13) ^ u32::from_ne_bytes([w[i], w[i + 1], w[i + 2], w[i + 3]]) as u64;
        h = h.rotate_left(13) ^ ((u32::from_ne_bytes([d[i], d[i + 1], d[i + 2], d[i + 3]]) as u64) << 32);
        i += 4;
    }
    lb::mix(h)
}

#[inline(always)]
fn in_src_range<F: Net>(rev_nat_id: u16, saddr: F::A) -> bool {
    let key = Key::new(32 + F::BITS, SrcRange { rev_nat_id, family: F::ID, _pad: 0, addr: F::wide(saddr) });
    LB_SRC_RANGE.get(&key).is_some()
}

/// Whether frontend `rev_nat_id`'s loadBalancerSourceRanges hold `addr`
/// (an IPv4 address in the first 4 bytes), for the socket hooks' check.
#[inline(always)]
pub(crate) fn src_allowed(rev_nat_id: u16, family: u8, addr: [u8; 16]) -> bool {
    let bits = if family == lb_common::FAMILY_V4 { 32 } else { 128 };
    LB_SRC_RANGE.get(&Key::new(32 + bits, SrcRange { rev_nat_id, family, _pad: 0, addr })).is_some()
}

#[inline(always)]
fn drop_packet() -> i32 {
    lb::event(stats::NAT_DROPPED);
    TC_ACT_SHOT
}

/// kube-proxy's REJECT: the client's connect fails with ECONNREFUSED at
/// once. TCP gets a RST (a client whose connect() still holds its socket
/// lock when an ICMP error arrives only notes it as a soft error and waits
/// for the SYN retransmit, a second later; a RST is always processed); UDP
/// gets ICMP port unreachable, as from iptables' REJECT. (Its own BPF
/// function: the packet buffers get a stack frame of their own.)
#[inline(never)]
fn reject<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    lb::event(stats::NAT_REJECTED);
    let Some((l4, proto)) = F::l4(ctx) else { return TC_ACT_SHOT };
    if proto == PROTO_TCP {
        return send_reset::<F>(ctx);
    }
    if !icmp_allowed() {
        return TC_ACT_SHOT;
    }
    match F::icmp_reply(ctx, F::PORT_UNREACHABLE, 0, l4) {
        Ok(()) => bounce(ctx),
        Err(_) => TC_ACT_SHOT,
    }
}

/// The ICMP errors lb sends in the stack's place (port unreachable, time
/// exceeded; not "fragmentation needed" / "packet too big", which path
/// MTU discovery needs) are limited as the kernel limits its own, with
/// its defaults (net.ipv4.icmp_msgs_per_sec 1000, icmp_msgs_burst 50),
/// per CPU: a flood to a Service without endpoints, from spoofed sources,
/// is not reflected one for one. What goes over is dropped, counted as
/// `icmp_limited`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IcmpCredit {
    /// When the credit was last taken from (ns, bpf_ktime_get_ns).
    last: u64,
    /// Nanoseconds of credit, a message costing `ICMP_COST_NS`.
    credit: u64,
}

#[btf_map]
static LB_ICMP_CREDIT: PerCpuArray<IcmpCredit, 1> = PerCpuArray::new();

const ICMP_COST_NS: u64 = 1_000_000;
const ICMP_BURST_NS: u64 = 50 * ICMP_COST_NS;

#[inline(always)]
fn icmp_allowed() -> bool {
    let Some(c) = LB_ICMP_CREDIT.get_ptr_mut(0) else { return false };
    // SAFETY: plain helper.
    let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() };
    // SAFETY: this CPU's map value, alive for this program run.
    unsafe {
        let credit = (*c).credit.saturating_add(now.wrapping_sub((*c).last)).min(ICMP_BURST_NS);
        (*c).last = now;
        if credit < ICMP_COST_NS {
            (*c).credit = credit;
            lb::event(stats::ICMP_LIMITED);
            return false;
        }
        (*c).credit = credit - ICMP_COST_NS;
    }
    true
}

/// End a TCP flow whose backend left: a RST to the client, as the backend
/// would have sent had it still been there to say no.
#[inline(never)]
fn reset<F: Net>(skb: *mut __sk_buff) -> i32 {
    lb::event(stats::NAT_RESET);
    send_reset::<F>(&TcContext::new(skb))
}

/// Answer the TCP segment with a RST, as RFC 9293 says a closed port does.
#[inline(always)]
fn send_reset<F: Net>(ctx: &TcContext) -> i32 {
    let Some(p) = parse::<F>(ctx) else { return TC_ACT_SHOT };
    let p = &p;
    let (Ok(seq), Ok(ack)) = (ctx.load::<u32>(p.l4 + 4), ctx.load::<u32>(p.l4 + 8)) else { return TC_ACT_SHOT };
    let (seq, ack) = (u32::from_be(seq), u32::from_be(ack));
    let r = if p.tcp_flags & TCP_ACK != 0 {
        F::tcp_reset(ctx, p, ack, 0, TCP_RST)
    } else {
        let Some(len) = F::tcp_payload(ctx, p.l4) else { return TC_ACT_SHOT };
        let syn_fin = (p.tcp_flags & TCP_SYN != 0) as u32 + (p.tcp_flags & TCP_FIN != 0) as u32;
        F::tcp_reset(ctx, p, 0, seq.wrapping_add(len + syn_fin), TCP_RST | TCP_ACK)
    };
    match r {
        Ok(()) => bounce(ctx),
        Err(_) => TC_ACT_SHOT,
    }
}

/// Working memory of the new-flow path, one per CPU: IPv6 keys and entries
/// are too large for the 512-byte BPF stack when several are live at once.
/// A TC program runs to its end on one CPU before the next starts there.
#[repr(C)]
pub struct Scratch<A> {
    backend: Backend<A>,
    backend_id: u32,
    rev_nat_id: u16,
    hash: u32,
    key: NatKey<A>,
    rkey: NatKey<A>,
    fwd: NatEntry<A>,
    reply: NatEntry<A>,
    /// The path MTU for ACT_TOO_BIG.
    mtu: u32,
    /// The new flow's frontend asks for DSR (and this family has it).
    dsr: u8,
    /// The frontend a DSR packet's option names.
    front_addr: A,
    front_port: u16,
    /// The address a new SNATed flow leaves from (`snat_source`); zero:
    /// the node address.
    snat_src: A,
    /// The new flow comes from a pod on this node (`--per-packet-lb`): no
    /// SNAT, except to itself.
    pod: u8,
    /// The new flow is an outside client's to a frontend that masquerades
    /// outside flows to local backends (externalTrafficPolicy Cluster,
    /// no DSR), as kube-proxy's KUBE-EXT-* chains do.
    masq: u8,
}

#[btf_map]
static LB4_SCRATCH: PerCpuArray<Scratch<A4>, 1> = PerCpuArray::new();
#[btf_map]
static LB6_SCRATCH: PerCpuArray<Scratch<A6>, 1> = PerCpuArray::new();

/// A new flow to `daddr:dport`, if that is a frontend: pick its backend
/// into the scratch value. Returns ACT_ESTABLISH, or what to do instead.
/// From outside (`pod` false): a NodePort, LB IP or externalIP, or a
/// ClusterIP routed here. From a pod the socket hooks did not see (`pod`:
/// `--per-packet-lb`): any Service address, as the socket hooks decide it
/// (internalTrafficPolicy, the refusals, no Maglev, no DSR), and
/// loadBalancerSourceRanges, as kube-proxy applies them to pods.
#[inline(never)]
fn new_flow<F: Net>(skb: *mut __sk_buff, pod: bool) -> i32 {
    let Some(p) = parse::<F>(&TcContext::new(skb)) else { return TC_ACT_OK };
    let syn = p.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN;
    // Only a first fragment creates a UDP flow; anything else without an
    // entry is not ours to rewrite.
    if p.later || (p.proto == PROTO_TCP && p.tcp_flags & TCP_RST != 0) {
        return TC_ACT_OK;
    }
    // A pod's TCP flow starts with a SYN, whatever its frontend: the
    // packets of its other connections cost no more lookups.
    if pod && p.proto == PROTO_TCP && !syn {
        return TC_ACT_OK;
    }
    let Some(sc) = F::scratch() else { return TC_ACT_SHOT };
    let front = F::svc(&SvcKey::new(p.daddr, p.dport, p.proto, SCOPE_ALL, 0));
    // A pod's packet to a known ClusterIP on a port that is no service
    // port is the socket hooks' refusal too: select tells.
    let front = if pod && front.is_none() { F::svc(&SvcKey::new(p.daddr, 0, 0, SCOPE_ALL, 0)) } else { front };
    let Some(front) = front.filter(|f| pod || f.flags & svc_flags::EXTERNAL != 0 || lb::external_cluster_ip()) else {
        return if syn { ACT_CLEAR_LEFTOVER } else { TC_ACT_OK };
    };
    // Only a SYN creates a TCP flow, but with Maglev and DSR any packet
    // does: a connection an upstream router moved here from another node
    // (ECMP rehash, a node failing) reaches the backend Maglev picked there
    // too, with the client's address, and goes on.
    let moved_ok = !pod && front.flags & (svc_flags::MAGLEV | svc_flags::DSR) == svc_flags::MAGLEV | svc_flags::DSR;
    if p.proto == PROTO_TCP && !syn && !moved_ok {
        return TC_ACT_OK;
    }
    // loadBalancerSourceRanges first: a client outside them learns nothing
    // (a pod too: kube-proxy's KUBE-PROXY-FIREWALL drops pods' packets
    // outside them as well).
    if front.flags & svc_flags::SRC_RANGE != 0 && !in_src_range::<F>(front.rev_nat_id, p.saddr) {
        if lb::observed() {
            let why = lb_common::monitor::WHY_SOURCE_RANGE;
            let hook = if pod { lb_common::monitor::HOOK_POD } else { lb_common::monitor::HOOK_TC };
            report::<F>(&p, &Verdict::Refuse { errno: 0, why, rev_nat_id: front.rev_nat_id }, hook);
        }
        lb::event(stats::SRC_RANGE_DROPPED);
        lb::account(lb_common::STATS_FRONTEND, F::ID, front.rev_nat_id as u32, lb::Acct::SourceRange);
        return drop_packet();
    }
    let h = flow_hash::<F>(&p);
    let v = lb::select::<F>(Client::Addr(F::wide(p.saddr)), p.daddr, p.dport, p.proto, Some(h), !pod);
    if lb::observed() {
        report::<F>(&p, &v, if pod { lb_common::monitor::HOOK_POD } else { lb_common::monitor::HOOK_TC });
    }
    match v {
        Verdict::Pass => {
            if syn {
                ACT_CLEAR_LEFTOVER
            } else {
                TC_ACT_OK
            }
        }
        // No usable endpoint: REJECT, as kube-proxy does.
        Verdict::Refuse { errno: ECONNREFUSED, .. } => ACT_REJECT,
        // externalTrafficPolicy (or internalTrafficPolicy) Local and no
        // endpoint on this node: dropped (kube-proxy DROPs too; the LB's
        // health check steers away).
        Verdict::Refuse { .. } => drop_packet(),
        Verdict::Backend { backend, rev_nat_id, backend_id, .. } => {
            // SAFETY: this CPU's scratch value.
            unsafe {
                (*sc).backend = backend;
                (*sc).backend_id = backend_id;
                (*sc).rev_nat_id = rev_nat_id;
                (*sc).hash = h;
                (*sc).dsr = (!pod && front.flags & svc_flags::DSR != 0) as u8;
                (*sc).pod = pod as u8;
                (*sc).masq = (!pod && front.flags & (svc_flags::EXT_LOCAL | svc_flags::DSR) == 0) as u8;
                // snat_source sets it for outside flows; a pod's hairpin
                // takes the node address, never an earlier flow's choice.
                (*sc).snat_src = F::A::default();
            }
            ACT_ESTABLISH
        }
    }
}

/// Tell the monitors what became of a new flow (from outside, or from a
/// pod at its device: `hook`).
#[inline(never)]
fn report<F: Net>(p: &Pkt<F::A>, v: &Verdict<F::A>, hook: u8) {
    let Some(ev) = lb::event_buf() else { return };
    // SAFETY: this CPU's event buffer.
    unsafe {
        (*ev).client = F::wide(p.saddr);
        (*ev).x.front = F::wide(p.daddr);
        (*ev).x.front_port = p.dport;
        (*ev).x.family = F::ID;
        (*ev).proto = p.proto;
        (*ev).hook = hook;
        match v {
            Verdict::Pass => return,
            Verdict::Refuse { errno, why, rev_nat_id } => {
                (*ev).errno = *errno as u8;
                (*ev).why = *why;
                (*ev).x.rev_nat_id = *rev_nat_id;
            }
            Verdict::Backend { backend, rev_nat_id, why, .. } => {
                (*ev).x.backend = F::wide(backend.addr);
                (*ev).x.backend_port = backend.port;
                (*ev).why = *why;
                (*ev).x.rev_nat_id = *rev_nat_id;
            }
        }
    }
    lb::emit(ev);
}

/// The address a new flow to a backend on another node is SNATed to, into
/// the scratch value: the one the route to the backend picks, as
/// kube-proxy's MASQUERADE does (a tunnel's own address where the route
/// runs through one, so that the replies come back through it); zero, for
/// the node address, where the kernel cannot say. A step of its own: the
/// route lookup's stack does not fit beside establish's.
///
/// Also for a flow to a backend on this node that kube-proxy would
/// masquerade, with `--bpf-forward` (the pod programs translate its
/// replies): the pod bridge's address, say, which MASQUERADE picks too.
/// Zero there (the kernel cannot say, or the backend is the node itself:
/// delivered locally, past MASQUERADE) leaves the masquerade to the stack.
#[inline(never)]
fn snat_source<F: Net>(skb: *mut __sk_buff) {
    let Some(sc) = F::scratch() else { return };
    // SAFETY: this CPU's scratch value, filled by new_flow for this packet.
    let sc = unsafe { &mut *sc };
    sc.snat_src = F::A::default();
    if sc.dsr != 0 || sc.pod != 0 {
        return;
    }
    if sc.backend.flags & backend_flags::LOCAL != 0 && !(sc.masq != 0 && bpf_masquerade(lb::node_flags())) {
        return;
    }
    let Some(p) = parse::<F>(&TcContext::new(skb)) else { return };
    if let Some(a) = fib::route_source::<F>(skb, p.proto, p.saddr, sc.backend.addr, sc.backend.port) {
        sc.snat_src = a;
    }
}

/// Create the flow's two entries (for the backend in the scratch value);
/// its first packet is translated by the forward step.
#[inline(never)]
fn establish<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(p) = parse::<F>(ctx) else { return TC_ACT_OK };
    let Some(sc) = F::scratch() else { return TC_ACT_SHOT };
    // SAFETY: this CPU's scratch value, filled by new_flow for this packet.
    let sc = unsafe { &mut *sc };
    // SAFETY: plain helper.
    let now = unsafe { bpf_ktime_get_ns() };
    // A pod's flow keeps its address (pod addresses route in the cluster),
    // except to the pod itself, whose kernel would drop a packet from its
    // own address (kube-proxy masquerades that hairpin too). A local
    // backend's flow that snat_source found an address for is masqueraded
    // here, in BPF.
    let local = sc.backend.flags & backend_flags::LOCAL != 0;
    let local_snat = sc.pod == 0 && local && sc.snat_src != F::A::default();
    let snat = if sc.pod != 0 { sc.backend.addr == p.saddr } else { !local || local_snat };
    sc.reply = NatEntry {
        to_saddr: p.daddr,
        to_daddr: p.saddr,
        to_sport: p.dport,
        to_dport: p.sport,
        flags: nat_flags::REPLY,
        state: 0,
        rev_nat_id: sc.rev_nat_id,
        created_ns: now,
        last_seen_ns: now,
    };
    sc.rkey = NatKey { saddr: sc.backend.addr, daddr: p.saddr, sport: sc.backend.port, dport: p.sport, proto: p.proto, _pad: [0; 3] };
    sc.fwd = NatEntry {
        to_saddr: p.saddr,
        to_daddr: sc.backend.addr,
        to_sport: p.sport,
        to_dport: sc.backend.port,
        flags: 0,
        state: 0,
        rev_nat_id: sc.rev_nat_id,
        created_ns: now,
        last_seen_ns: now,
    };
    let dsr = snat && sc.dsr != 0;
    if dsr {
        // Direct server return: the client's address stays; the backend's
        // node answers the client itself, so there is no reply entry here.
        sc.fwd.flags = nat_flags::DSR;
    } else if snat {
        let Some(cfg) = lb::node_config() else { return drop_packet() };
        let addr = if sc.snat_src != F::A::default() { sc.snat_src } else { F::snat_addr(&cfg) };
        if cfg.snat_port_min == 0 || addr == F::A::default() {
            // (No SNAT address: no room the early drop could make.)
            lb::event(stats::NAT_FAILED);
            return TC_ACT_SHOT;
        }
        let flags = if local_snat { nat_flags::SNAT | nat_flags::LOCAL } else { nat_flags::SNAT };
        sc.reply.flags |= flags;
        sc.fwd.flags = flags;
        sc.rkey.daddr = addr;
        sc.fwd.to_saddr = addr;
        let port = claim_port::<F>(&mut sc.rkey, &sc.reply, sc.hash, cfg.snat_port_min, cfg.snat_port_max);
        if port == 0 {
            // Counted; the agent logs it. The client retries its SYN.
            lb::event(stats::NAT_FAILED);
            gc::refused(F::ID);
            return TC_ACT_SHOT;
        }
        sc.fwd.to_sport = port;
    } else {
        if sc.masq != 0 && node_flags::masq_of(lb::node_flags()) != 0 {
            // A local backend of an externalTrafficPolicy Cluster Service:
            // the stack masquerades the flow (its packets carry the mark,
            // `translate`), and conntrack reverses the replies before the
            // egress program sees them (backend -> client, the reply entry).
            sc.fwd.flags = nat_flags::MASQ;
        }
        if !take_tuple::<F>(&sc.rkey, &sc.reply) {
            // The client's port already reaches this backend through
            // another frontend (a client behind a NAT that keeps its
            // ports, one socket sending to the NodePort and the LB IP; a
            // pod's port to two Services with one backend). Under
            // kube-proxy both flows DNAT to one reply tuple, and conntrack
            // moves the second one's source port where it binds the flow
            // at POSTROUTING (its MASQUERADE, or the null binding it
            // gives a flow no rule NATs there). So does lb: the client's
            // port moves to one whose reply tuple is free, from the SNAT
            // port range; the reply entry gives the client its own back.
            let Some(cfg) = lb::node_config() else { return drop_packet() };
            let port = if cfg.snat_port_min == 0 { 0 } else { claim_port::<F>(&mut sc.rkey, &sc.reply, sc.hash, cfg.snat_port_min, cfg.snat_port_max) };
            if port == 0 {
                lb::event(stats::NAT_FAILED);
                gc::refused(F::ID);
                return TC_ACT_SHOT;
            }
            sc.fwd.to_sport = port;
        }
    }
    sc.key = p.key();
    if !F::nat_put(&sc.key, &sc.fwd, BPF_NOEXIST as u64) {
        // Another CPU set this flow up meanwhile: follow its choice.
        if !dsr {
            F::nat_del(&sc.rkey);
        }
        return match F::nat_get(&sc.key) {
            Some(e) => {
                // SAFETY: copied out at once.
                sc.fwd = unsafe { core::ptr::read_volatile(e) };
                ACT_FORWARD
            }
            None => {
                // The table refused it: full (a DSR flow has no reply
                // entry to be refused first; another flow may have taken
                // the last slot between the two inserts), or rarely out
                // of memory (NO_PREALLOC).
                lb::event(stats::NAT_FAILED);
                gc::refused(F::ID);
                TC_ACT_SHOT
            }
        };
    }
    if !dsr {
        share_with_old::<F>(&sc.rkey, &sc.reply, BPF_NOEXIST);
    }
    share_with_old::<F>(&sc.key, &sc.fwd, BPF_NOEXIST);
    lb::event(stats::NAT_NEW);
    flow_stats(F::ID, sc.rev_nat_id, sc.backend_id);
    ACT_FORWARD
}

/// Translate a client's packet by the forward entry in the scratch value
/// (or a backend's reply of a SNATed flow by its reply entry). A SNATed
/// packet leaves this node again, and what the stack would answer about
/// it goes to its translated source, this node, where nobody listens: a
/// TTL that runs out here, a packet too big for the path on. Answer those
/// to the sender, from the address it sent to, as kube-proxy's node does
/// (path MTU discovery through a NodePort needs it, both ways).
#[inline(never)]
fn forward<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(p) = parse::<F>(ctx) else { return TC_ACT_OK };
    let Some(sc) = F::scratch() else { return TC_ACT_SHOT };
    // SAFETY: this CPU's scratch value, filled by an earlier step for this packet.
    let sc = unsafe { &mut *sc };
    let dsr = sc.fwd.flags & nat_flags::DSR != 0;
    // The DSR option's 8 bytes must fit too.
    let extra = if dsr { F::DSR_LEN as u32 } else { 0 };
    if sc.fwd.flags & (nat_flags::SNAT | nat_flags::DSR) != 0 && !p.later {
        if F::ttl(ctx) <= 1 {
            return ACT_TIME_EXCEEDED;
        }
        if ctx.len() as usize + extra as usize > F::L2 + icmp::MTU_CHECK_ABOVE {
            let mtu = icmp::path_mtu::<F>(skb, &p, &sc.fwd, extra);
            if mtu != 0 {
                sc.mtu = mtu - extra;
                return ACT_TOO_BIG;
            }
        }
    }
    let act = to_stack_if_masqueraded(translate::<F>(ctx, &p, &sc.fwd), sc.fwd.flags);
    if dsr && act == ACT_TRANSLATED {
        sc.front_addr = p.daddr;
        sc.front_port = p.dport;
        return ACT_DSR;
    }
    act
}

/// Claim a SNAT port for a reply tuple (`rkey.dport`): the reply tuple must
/// be unique, and BPF_NOEXIST makes the claim atomic against other CPUs.
/// Returns the port, or 0 when none of the tries was free.
#[inline(never)]
fn claim_port<F: Net>(rkey: &mut NatKey<F::A>, reply: &NatEntry<F::A>, h: u32, min: u16, max: u16) -> u16 {
    let range = (max as u32).saturating_sub(min as u32) + 1;
    // One stride per flow: with a common stride, flows whose first probes
    // collide would walk the same taken ports (linear probing's clusters).
    let stride = lb::mix(h as u64 ^ 0x9e37_79b9_7f4a_7c15) | 1;
    let mut i = 0;
    while i < SNAT_TRIES {
        let port = min + ((h.wrapping_add(i.wrapping_mul(stride))) % range) as u16;
        rkey.dport = port;
        if nat_claim::<F>(rkey, reply) {
            return port;
        }
        i += 1;
    }
    0
}

/// Take a reply tuple without SNAT. If it is taken: by a closed flow,
/// replace that (as conntrack does); by a live one, fail (the caller
/// moves the client's port).
#[inline(always)]
fn take_tuple<F: Net>(rkey: &NatKey<F::A>, reply: &NatEntry<F::A>) -> bool {
    if nat_claim::<F>(rkey, reply) {
        return true;
    }
    // The same flow's DSR entry: an upstream router moved the flow here
    // from the node that sent it on with DSR, and Maglev picked the same
    // backend, here on this node. Its replies keep their translation; this
    // flow's entry takes over.
    if let Some(e) = F::nat_get(rkey)
        // SAFETY: a map value, alive for this program run; plain integers.
        && unsafe {
            (*e).flags & nat_flags::DSR != 0
                && (*e).to_saddr == reply.to_saddr
                && (*e).to_sport == reply.to_sport
                && (*e).to_daddr == reply.to_daddr
                && (*e).to_dport == reply.to_dport
        }
    {
        let taken = F::nat_put(rkey, reply, aya_ebpf::bindings::BPF_EXIST as u64);
        if taken {
            share_with_old::<F>(rkey, reply, aya_ebpf::bindings::BPF_ANY);
        }
        return taken;
    }
    if !drop_if_closed::<F>(rkey) {
        return false;
    }
    F::nat_put(rkey, reply, BPF_NOEXIST as u64)
}

/// Remove the flow whose entry is at `key` if that flow has ended (or is
/// half gone). Returns whether `key` is free now.
#[inline(never)]
fn drop_if_closed<F: Net>(key: &NatKey<F::A>) -> bool {
    let Some(e) = F::nat_get(key) else { return true };
    // SAFETY: a map value, alive for this program run (RCU).
    let e = unsafe { &*e };
    let other = e.other_key(key.proto);
    let partner = partner::<F>(&other, key);
    let ended = match partner {
        // SAFETY: a map value; one byte read.
        Some(o) => closed(e.state, unsafe { core::ptr::read_volatile(&(*o).state) }),
        // A DSR flow's one entry on a node, partnerless by design: by its
        // own state (a SYN with a live DSR flow's tuple, forged or not,
        // straight to the pod, ended it before 12-07), a RST once the flow
        // fell quiet after it (`RST_QUIET_NS`).
        None if e.flags & nat_flags::DSR != 0 => {
            nat_state::dsr_fin_closed(e.state, e.flags) || (e.state & nat_state::RST != 0 && quiet(e.last_seen_ns))
        }
        // Half gone.
        None => true,
    };
    if !ended {
        return false;
    }
    if partner.is_some() {
        F::nat_del(&other);
    }
    F::nat_del(key);
    lb::event(stats::NAT_REPLACED);
    true
}

/// A TCP SYN that starts a flow we do not translate (a direct connection
/// to a pod, say): a reply entry left by a closed NodePort flow with the
/// same tuple would rewrite its replies. Remove such a leftover.
#[inline(never)]
fn clear_leftover<F: Net>(skb: *mut __sk_buff) -> i32 {
    let Some(p) = parse::<F>(&TcContext::new(skb)) else { return TC_ACT_OK };
    let rk = p.reverse_key();
    if let Some(r) = F::nat_get(&rk) {
        // SAFETY: a map value; one byte read.
        let flags = unsafe { core::ptr::read_volatile(&(*r).flags) };
        if flags & nat_flags::REPLY != 0 && flags & nat_flags::SNAT == 0 {
            drop_if_closed::<F>(&rk);
        }
    }
    TC_ACT_OK
}

/// A packet that arrives: from outside, or from a pod on this node, at its
/// device (`lb_pod_ingress`, with `--per-packet-lb`).
#[inline(never)]
fn ingress<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let p = match parse_first::<F>(ctx) {
        Ok(p) => p,
        Err(act) => return act,
    };
    let key = p.key();
    if let Some(e) = F::nat_get(&key) {
        // SAFETY: a map value, alive for this program run (RCU); the agent
        // replaces whole values, so a field may be old or new, never torn
        // in a way that matters.
        let entry = unsafe { &*e };
        if entry.flags & nat_flags::REPLY != 0 {
            // Replies of flows to local backends are handled on egress.
            if entry.flags & nat_flags::SNAT == 0 {
                return TC_ACT_OK;
            }
            // A reply to a SNATed flow, from the backend's node; at a
            // pod's device, from a pod that answered itself (a hairpin).
            // It leaves this node again: the forward step checks it as it
            // checks a client's packet. What the stack would answer about
            // the translated reply (too big for the path to the client, a
            // TTL that runs out here) would go to its new source, the
            // frontend (this node); under kube-proxy it goes to the
            // backend, whose source conntrack restores only after the
            // forwarding (POSTROUTING). So lb answers the backend, from
            // the SNAT address, quoting the reply as the backend sent it.
            touch(e, p.tcp_flags);
            let Some(sc) = F::scratch() else { return TC_ACT_SHOT };
            // SAFETY: this CPU's scratch value; a copy of the map value.
            unsafe { (*sc).fwd = *entry };
            return ACT_FORWARD;
        }
        // A packet from a client of a known flow.
        if entry.state & nat_state::STALE != 0 {
            // Its backend left the Service.
            remove_flow::<F>(&key, entry);
            if p.proto == PROTO_TCP {
                return if p.tcp_flags & TCP_RST != 0 { TC_ACT_SHOT } else { ACT_RESET };
            }
            return ACT_NEW_FLOW;
        }
        let syn = p.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN;
        if syn && drop_if_closed::<F>(&key) {
            // The client reuses the port of a finished flow: a new flow.
            return ACT_NEW_FLOW;
        }
        // A SNATed or DSR flow leaves this node again: the forward step
        // checks it.
        if entry.flags & (nat_flags::SNAT | nat_flags::DSR) != 0
            && let Some(sc) = F::scratch()
        {
            touch(e, p.tcp_flags);
            // SAFETY: this CPU's scratch value; a copy of the map value.
            unsafe { (*sc).fwd = *entry };
            return ACT_FORWARD;
        }
        touch(e, p.tcp_flags);
        return to_stack_if_masqueraded(translate::<F>(ctx, &p, entry), entry.flags);
    }
    ACT_NEW_FLOW
}

/// Whether new flows to local backends that kube-proxy would masquerade
/// are masqueraded in BPF (`nat_flags::LOCAL`): with the masquerade on and
/// `--bpf-forward`, whose pod programs translate the replies. Else the
/// stack masquerades them (`nat_flags::MASQ`).
#[inline(always)]
fn bpf_masquerade(flags: u32) -> bool {
    node_flags::masq_of(flags) != 0 && flags & node_flags::BPF_FORWARD != 0
}

/// A client's packet of a flow the stack masquerades (`nat_flags::MASQ`)
/// goes to the stack, whose nat hook holds the flow's translation: it is
/// not forwarded in BPF, also after an agent turned the masquerade off
/// (the flows masqueraded before keep it).
#[inline(always)]
fn to_stack_if_masqueraded(act: i32, flags: u8) -> i32 {
    if act == ACT_TRANSLATED && flags & nat_flags::MASQ != 0 { TC_ACT_OK } else { act }
}

#[inline(never)]
fn egress<F: Net>(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let p = match parse_first::<F>(ctx) {
        Ok(p) => p,
        Err(act) => return act,
    };
    // Replies of local backends leave here: backend -> client becomes
    // frontend -> client.
    if let Some(e) = F::nat_get(&p.key()) {
        // SAFETY: a map value, alive for this program run (RCU); the agent
        // replaces whole values, so a field may be old or new, never torn
        // in a way that matters.
        let entry = unsafe { &*e };
        if entry.flags & nat_flags::REPLY != 0 && entry.flags & nat_flags::SNAT == 0 {
            touch_reply(e, entry.flags, p.tcp_flags);
            return translate::<F>(ctx, &p, entry);
        }
    }
    TC_ACT_OK
}

#[inline(always)]
fn ethertype(ctx: &TcContext) -> u16 {
    ld::<u16>(ctx, 12).map(u16::from_be).unwrap_or(0)
}

/// The packet's protocol as the device handed it up (an L3 device's
/// packets have no Ethernet header to read it from).
#[inline(always)]
fn skb_protocol(ctx: &TcContext) -> u16 {
    // SAFETY: a field of our own skb.
    u16::from_be(unsafe { (*ctx.skb.skb).protocol } as u16)
}

#[inline(always)]
fn ingress_then<F: Net>(skb: *mut __sk_buff) -> i32 {
    // One call after another, not nested: each gets the whole stack.
    let mut act = ingress::<F>(skb);
    if act == ACT_NEW_FLOW {
        act = new_flow::<F>(skb, false);
    }
    if act == ACT_ESTABLISH {
        snat_source::<F>(skb);
        act = establish::<F>(skb);
    }
    if act == ACT_FORWARD {
        act = forward::<F>(skb);
    }
    if act == ACT_DSR {
        act = F::dsr_add(skb);
    }
    match act {
        ACT_CLEAR_LEFTOVER => clear_leftover::<F>(skb),
        ACT_REJECT => reject::<F>(skb),
        ACT_RESET => reset::<F>(skb),
        ACT_ICMP => match icmp::translate_error::<F>(skb, true, false, 0) {
            ACT_ICMP_NO_FLOW if icmp::maglev_dsr_backend::<F>() => icmp::translate_error::<F>(skb, true, true, 0),
            ACT_ICMP_NO_FLOW => TC_ACT_OK,
            act => act,
        },
        ACT_TOO_BIG => icmp::too_big::<F>(skb),
        ACT_TIME_EXCEEDED => icmp::time_exceeded::<F>(skb),
        ACT_TRANSLATED => fib::send_on::<F>(skb),
        act => act,
    }
}

#[inline(always)]
fn egress_then<F: Net>(skb: *mut __sk_buff) -> i32 {
    match egress::<F>(skb) {
        ACT_ICMP => icmp::translate_error::<F>(skb, false, false, 0),
        ACT_TRANSLATED => TC_ACT_OK,
        act => act,
    }
}

/// What lb's TC programs return for a packet they pass on (TC_ACT_OK
/// inside): TC_ACT_UNSPEC, which lets the programs after lb's on the hook
/// see it too (TCX_NEXT; on clsact, the next filter), and then the stack,
/// as it would without lb. TC_ACT_OK ends the chain: before 12-05's second
/// half every program behind lb's (a host firewall's, an observability
/// tool's) never saw a packet on a NodePort device. Drops and redirects
/// stand. An internal step code (`ACT_*`, negative) that got this far
/// passes the packet on likewise.
#[inline(always)]
fn verdict(act: i32) -> i32 {
    if act == TC_ACT_OK || act < 0 { TC_ACT_UNSPEC } else { act }
}

#[classifier]
pub fn lb_nodeport_ingress(ctx: TcContext) -> i32 {
    verdict(nodeport_ingress_run(ctx))
}

#[inline(always)]
fn nodeport_ingress_run(ctx: TcContext) -> i32 {
    // A frame for another host's MAC (flooded by a switch or a bridge,
    // seen by a device in promiscuous mode: tcpdump, a VM's vSwitch), or
    // for a broadcast or multicast MAC, is not this node's to forward: the
    // stack drops it (ip_rcv, ip_forward), so kube-proxy never translates
    // it. Translated here, a LoadBalancer IP's traffic would be answered
    // by every node that sees it. A frame of a VLAN (its tag taken off
    // before TC) is the VLAN device's: lb's programs there translate it
    // (here, a redirect would send it on with the tag of the VLAN it came
    // from).
    // SAFETY: the context's own fields.
    if unsafe { (*ctx.skb.skb).pkt_type != PACKET_HOST || ((*ctx.skb.skb).vlan_present != 0 && (*ctx.skb.skb).vlan_tci & 0x0fff != 0) } {
        return TC_ACT_OK;
    }
    pull_headers(&ctx);
    let proto = ethertype(&ctx);
    ingress_on::<ETH_HLEN>(&ctx, proto)
}

/// `lb_nodeport_ingress` on an L3 device (WireGuard, IPIP, GRE, TUN: the
/// packet starts with its IP header): replies of SNATed flows whose route
/// back runs through a tunnel, and NodePort traffic that arrives through
/// one. With `--bpf-forward`, translated packets are forwarded in BPF
/// from here too (`fib::send`: through the neighbour layer).
#[classifier]
pub fn lb_l3_ingress(ctx: TcContext) -> i32 {
    verdict(l3_ingress_run(ctx))
}

#[inline(always)]
fn l3_ingress_run(ctx: TcContext) -> i32 {
    pull_headers(&ctx);
    let proto = skb_protocol(&ctx);
    ingress_on::<0>(&ctx, proto)
}

/// `source_check`: the packet goes on to be translated.
const ACT_GO_ON: i32 = -113;

/// A packet from a source the stack never forwards from (kube-proxy's
/// DNATed packet meets the route lookup's martian check) is left to the
/// stack, which drops it: no flow. One from an address of this node's
/// own (any interface's IPv4 address: `LB_LOCAL4`, which the agent keeps
/// as the interfaces' addresses change; 127/8; and its SNAT addresses) is
/// dropped here, as the stack drops it (`fib_validate_source`) without
/// the accept_local lb sets on these devices for its SNATed packets,
/// which re-enter the stack from them with the node's address as their
/// source. Pods' packets to Service addresses with `--per-packet-lb`
/// (`lb_pod_ingress`) are checked too: with `--bpf-forward` lb's redirect
/// skips the stack's check on the pod's device. Its own BPF function, off
/// the deep call chain.
/// ICMP errors are left to their own path (translated like the flow they
/// are about, as conntrack relates them). A header the stack would
/// discard before netfilter (`Net::head`) is left to it first: kube-proxy's
/// rules never see such a packet, and lb made flows of them (before 12-05:
/// a DSR node rebuilt a corrupted header with a valid checksum).
#[inline(never)]
fn source_check<F: Net>(skb: *mut __sk_buff) -> i32 {
    // Loaded by helper (the context stays this function's argument).
    let ctx = &TcContext::new(skb);
    // A header the stack discards is the stack's to discard (and count:
    // InHdrErrors, InCsumErrors, InTruncatedPkts), not a flow's packet.
    let Some((proto, saddr)) = F::head(ctx) else { return TC_ACT_OK };
    if proto == F::ICMP {
        return ACT_GO_ON;
    }
    // Before the martian test: 127/8 is one of the node's own.
    if F::own(saddr) {
        lb::event(stats::NAT_DROPPED);
        return TC_ACT_SHOT;
    }
    if F::martian(saddr) {
        return TC_ACT_OK;
    }
    // After it: a family without a SNAT address has the unspecified one
    // there.
    if lb::node_config_ref().is_some_and(|cfg| F::snat_addr(cfg) == saddr) {
        lb::event(stats::NAT_DROPPED);
        return TC_ACT_SHOT;
    }
    ACT_GO_ON
}

#[inline(always)]
fn ingress_on<const L: usize>(ctx: &TcContext, proto: u16) -> i32 {
    let skb = ctx.skb.skb;
    let checked = match proto {
        ETH_P_IP => source_check::<Ip4<L>>(skb),
        ETH_P_IPV6 => source_check::<Ip6<L>>(skb),
        _ => TC_ACT_OK,
    };
    if checked != ACT_GO_ON {
        return checked;
    }
    match proto {
        // A DSR flow's packet for a backend on this node.
        ETH_P_IP if dsr::carries_option::<L>(ctx) => match dsr::receive::<L>(skb) {
            ACT_TRANSLATED => fib::send_on::<Ip4<L>>(skb),
            act => act,
        },
        ETH_P_IP => ingress_then::<Ip4<L>>(skb),
        ETH_P_IPV6 if dsr::carries_option6::<L>(ctx) => match dsr::receive6::<L>(skb) {
            ACT_TRANSLATED => fib::send_on::<Ip6<L>>(skb),
            act => act,
        },
        ETH_P_IPV6 => ingress_then::<Ip6<L>>(skb),
        _ => TC_ACT_OK,
    }
}

/// On the pod devices (the host end of each pod's veth), with
/// `--bpf-forward` or `--per-packet-lb`: what a pod sends.
/// - With `--bpf-forward`, replies of backends on this node to outside
///   clients are translated and forwarded here (`fib::reply`).
/// - With `--per-packet-lb`, a packet to a Service address, which a pod's
///   own socket would have had translated by the socket hooks, is
///   translated here (a VM's or a sandbox's kernel sent it: KubeVirt,
///   Kata, gVisor): its flow is made as for an outside client, without
///   SNAT (pod addresses route in the cluster). Its replies are translated
///   on their way into the pod (`lb_pod_egress`).
///
/// Everything else passes.
#[classifier]
pub fn lb_pod_ingress(ctx: TcContext) -> i32 {
    verdict(pod_ingress_run(ctx))
}

#[inline(always)]
fn pod_ingress_run(ctx: TcContext) -> i32 {
    pull_headers(&ctx);
    match ethertype(&ctx) {
        ETH_P_IP => pod_then::<E4>(ctx.skb.skb),
        ETH_P_IPV6 => pod_then::<E6>(ctx.skb.skb),
        _ => TC_ACT_OK,
    }
}

#[inline(always)]
fn pod_then<F: Net>(skb: *mut __sk_buff) -> i32 {
    // Replies of flows masqueraded in BPF are translated here whatever the
    // other flags say (the agent keeps these programs while such flows
    // live); with --bpf-forward the other replies of local backends too.
    // Skipped once the agent knows no such flow lives (--per-packet-lb
    // alone: the lookup is the ingress step's again).
    let flags = lb::node_flags();
    let mut act = TC_ACT_OK;
    if flags & node_flags::BPF_FORWARD != 0 || flags & node_flags::NO_BPF_MASQUERADED == 0 {
        act = fib::reply::<F>(skb);
        if act == ACT_ICMP {
            act = fib::reply_error::<F>(skb);
        }
    }
    if act != TC_ACT_OK || flags & node_flags::POD_PACKET_LB == 0 {
        return pod_finish::<F>(skb, act);
    }
    // A pod claiming the node's address (or a martian source) makes no
    // flow.
    let checked = source_check::<F>(skb);
    if checked != ACT_GO_ON {
        return pod_finish::<F>(skb, checked);
    }
    // One call after another, not nested: each gets the whole stack.
    act = ingress::<F>(skb);
    if act == ACT_NEW_FLOW {
        act = new_flow::<F>(skb, true);
    }
    if act == ACT_ESTABLISH {
        act = establish::<F>(skb);
    }
    if act == ACT_FORWARD {
        act = forward::<F>(skb);
        // A SNATed flow of a pod is one to itself.
        if act == ACT_TRANSLATED
            && let Some(sc) = F::scratch()
            // SAFETY: this CPU's scratch value; one byte read.
            && unsafe { (*sc).fwd.flags } & nat_flags::SNAT != 0
        {
            act = ACT_HAIRPIN;
        }
    }
    pod_finish::<F>(skb, act)
}

#[inline(always)]
fn pod_finish<F: Net>(skb: *mut __sk_buff, act: i32) -> i32 {
    match act {
        ACT_CLEAR_LEFTOVER => clear_leftover::<F>(skb),
        ACT_REJECT => reject::<F>(skb),
        ACT_RESET => reset::<F>(skb),
        // Errors a pod sends go on as they are: an error about a reply it
        // got is about a flow's translated side, which the peer knows.
        ACT_ICMP => TC_ACT_OK,
        ACT_TOO_BIG => icmp::too_big::<F>(skb),
        ACT_TIME_EXCEEDED => icmp::time_exceeded::<F>(skb),
        ACT_HAIRPIN => hairpin(skb),
        ACT_TRANSLATED => fib::send_on::<F>(skb),
        act => act,
    }
}

/// Send a translated packet back into the pod it came from: the stack
/// would drop it (it carries this node's address as its source, or goes
/// out where it came in).
#[inline(never)]
fn hairpin(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let (Ok(dst), Ok(src)) = (ld::<[u8; 6]>(ctx, 0), ld::<[u8; 6]>(ctx, 6)) else { return TC_ACT_SHOT };
    if st(ctx, 0, src).is_err() || st(ctx, 6, dst).is_err() {
        return TC_ACT_SHOT;
    }
    bounce(ctx)
}

/// On the pod devices, with `--per-packet-lb`: what goes into a pod.
/// Replies to the pod's translated flows (from a backend on this node or
/// another) become replies from the Service address, and ICMP errors about
/// them are translated, as the egress program does for outside clients.
#[classifier]
pub fn lb_pod_egress(ctx: TcContext) -> i32 {
    verdict(pod_egress_run(ctx))
}

#[inline(always)]
fn pod_egress_run(ctx: TcContext) -> i32 {
    pull_headers(&ctx);
    match ethertype(&ctx) {
        ETH_P_IP => egress_then::<E4>(ctx.skb.skb),
        ETH_P_IPV6 => egress_then::<E6>(ctx.skb.skb),
        _ => TC_ACT_OK,
    }
}

#[classifier]
pub fn lb_nodeport_egress(ctx: TcContext) -> i32 {
    verdict(nodeport_egress_run(ctx))
}

#[inline(always)]
fn nodeport_egress_run(ctx: TcContext) -> i32 {
    pull_headers(&ctx);
    let proto = ethertype(&ctx);
    egress_on::<ETH_HLEN>(&ctx, proto)
}

/// `lb_nodeport_egress` on an L3 device: replies of backends on this node
/// to clients whose route runs through a tunnel.
#[classifier]
pub fn lb_l3_egress(ctx: TcContext) -> i32 {
    verdict(l3_egress_run(ctx))
}

#[inline(always)]
fn l3_egress_run(ctx: TcContext) -> i32 {
    pull_headers(&ctx);
    let proto = skb_protocol(&ctx);
    egress_on::<0>(&ctx, proto)
}

#[inline(always)]
fn egress_on<const L: usize>(ctx: &TcContext, proto: u16) -> i32 {
    match proto {
        ETH_P_IP => egress_then::<Ip4<L>>(ctx.skb.skb),
        ETH_P_IPV6 => egress_then::<Ip6<L>>(ctx.skb.skb),
        _ => TC_ACT_OK,
    }
}
