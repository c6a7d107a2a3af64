//! Map keys and values shared by the BPF programs and the agent.
//!
//! Every type is `#[repr(C)]` with explicit padding, so that the layout is the
//! same on both sides and `bpftool map dump` prints named fields (the maps are
//! BTF maps). Addresses are stored in network byte order (`[u8; 4]`), ports in
//! host byte order, so that a dump reads `"port": 80`.
#![no_std]

/// IP protocol numbers used in keys.
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// `SvcKey::scope`: every backend of the service.
pub const SCOPE_ALL: u8 = 0;
/// `SvcKey::scope`: only backends on this node (internalTrafficPolicy Local).
pub const SCOPE_LOCAL: u8 = 1;

/// `SvcValue::flags` on slot 0.
pub mod svc_flags {
    /// The frontend is a "known VIP" marker (port 0, proto 0): the address is a
    /// ClusterIP, but the connect did not match any service port. Refuse.
    pub const VIP_MARKER: u16 = 1 << 0;
    /// Use the `SCOPE_LOCAL` slots (internalTrafficPolicy Local).
    pub const LOCAL_ONLY: u16 = 1 << 1;
    /// sessionAffinity ClientIP.
    pub const AFFINITY: u16 = 1 << 2;
    /// Topology hints narrowed the backends to this node's zone (display only).
    pub const TOPOLOGY: u16 = 1 << 3;
    /// A NodePort, LoadBalancer-IP or externalIP frontend: the TC program
    /// handles it for traffic that arrives from outside.
    pub const EXTERNAL: u16 = 1 << 4;
    /// externalTrafficPolicy Local: outside traffic uses only the
    /// `SCOPE_LOCAL` slots and is dropped when there are none.
    pub const EXT_LOCAL: u16 = 1 << 5;
    /// The socket hooks leave this frontend alone (externalIPs when their
    /// in-cluster translation is turned off).
    pub const NO_SOCKET: u16 = 1 << 6;
    /// loadBalancerSourceRanges: the client must match `LB4_SRC_RANGE`.
    pub const SRC_RANGE: u16 = 1 << 7;
    /// Outside flows pick their backend from the frontend's Maglev table
    /// (`LB4_MAGLEV` / `LB6_MAGLEV`, keyed by `MaglevKey`) instead of at
    /// random: every node picks the same one for a flow.
    pub const MAGLEV: u16 = 1 << 8;
    /// Outside flows to a backend on another node keep the client's address
    /// and are answered by that node directly (direct server return, IPv4).
    pub const DSR: u16 = 1 << 9;
    /// Only sockets in the node's own network namespace are translated (a
    /// localhost NodePort, 127.0.0.1): a pod's own 127.0.0.1 is its own.
    pub const HOST_ONLY: u16 = 1 << 10;
}

/// `Backend::flags`.
pub mod backend_flags {
    /// The endpoint runs on this node.
    pub const LOCAL: u8 = 1 << 0;
    /// The endpoint is serving but terminating (used only as a fallback).
    pub const TERMINATING: u8 = 1 << 1;
}

/// Key of the `LB4_SERVICES` / `LB6_SERVICES` maps (`A` is `[u8; 4]` or
/// `[u8; 16]`).
///
/// Slot 0 is the frontend entry (count, rev_nat_id, flags); slots `1..=count`
/// each name one backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SvcKey<A> {
    pub addr: A,
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
    pub slot: u16,
    pub _pad: u16,
}

pub type Svc4Key = SvcKey<[u8; 4]>;
pub type Svc6Key = SvcKey<[u8; 16]>;

impl<A> SvcKey<A> {
    pub const fn new(addr: A, port: u16, proto: u8, scope: u8, slot: u16) -> Self {
        Self { addr, port, proto, scope, slot, _pad: 0 }
    }
}

/// Value of the services maps.
///
/// On slot 0: `count`, `rev_nat_id`, `flags` and `affinity_timeout` are set and
/// `backend_id` is 0. On slot n > 0: `backend_id` (and `rev_nat_id`, for
/// readable dumps).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SvcValue {
    pub backend_id: u32,
    pub count: u16,
    pub rev_nat_id: u16,
    pub flags: u16,
    pub _pad: u16,
    /// sessionAffinity timeout in seconds (0: no affinity).
    pub affinity_timeout: u32,
}

/// Value of the backends maps, keyed by a `u32` backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Backend<A> {
    pub addr: A,
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

pub type Backend4 = Backend<[u8; 4]>;
pub type Backend6 = Backend<[u8; 16]>;

/// Value of the rev_nat maps, keyed by a `u16` rev_nat id: the frontend
/// that replies must appear to come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevNat<A> {
    pub addr: A,
    pub port: u16,
    pub _pad: u16,
}

pub type RevNat4 = RevNat<[u8; 4]>;
pub type RevNat6 = RevNat<[u8; 16]>;

/// Key of the `LB4_SOCK_REVNAT` LRU map: one socket's translated destination.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNat4Key {
    pub cookie: u64,
    pub addr: [u8; 4],
    pub port: u16,
    pub _pad: u16,
}

/// Key of the `LB6_SOCK_REVNAT` LRU map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNat6Key {
    pub cookie: u64,
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad: u16,
    pub _pad2: u32,
}

/// Value of the socket rev_nat LRU maps: the frontend a socket asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNatValue<A> {
    pub addr: A,
    pub port: u16,
    pub rev_nat_id: u16,
}

/// Value of the `LB_SOCK_XLATE` socket storage: the translation connect4/6
/// gave one connected socket (TCP, or connected UDP). The kernel keeps it
/// with the socket and frees it with the socket: nothing evicts it, and no
/// capacity flag bounds it. getpeername and recvmsg read it; the agent reads
/// it through sock_diag to destroy stale sockets. An IPv4 translation (also
/// for an AF_INET6 socket connecting to `::ffff:a.b.c.d`) has its addresses
/// in the first 4 bytes. The storage map survives a new `LAYOUT_VERSION`
/// (its entries cannot be copied): a change of what a field means must
/// change this struct's BTF (a field's name), so that an upgrade replaces
/// the map rather than misread it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockXlate {
    /// The frontend the socket asked for.
    pub front: [u8; 16],
    /// The backend it was sent to.
    pub backend: [u8; 16],
    pub front_port: u16,
    pub backend_port: u16,
    pub rev_nat_id: u16,
    /// FAMILY_V4 or FAMILY_V6: which maps `rev_nat_id` belongs to.
    pub family: u8,
    /// `sock_xlate` flags in the socket storage (0 in `LB_SOCK_UDP`). Still
    /// named `_pad`, as when it was: a new name would change the pinned
    /// map's BTF layout, and an upgrade would replace the storage map (and
    /// lose every live socket's translation) for a name.
    pub _pad: u8,
}

/// Flags in `SockXlate::_pad` of a socket's storage.
pub mod sock_xlate {
    /// `stats::SOCK_TRACKED` counted this storage, so its release counts
    /// `SOCK_UNTRACKED` (storage an agent from before 12-05 created was
    /// never counted, and is not at its release either).
    pub const COUNTED: u8 = 1;
}

/// Value of the `LB_SOCK_CHECK` socket storage: a socket the hooks sent to
/// a frontend with loadBalancerSourceRanges, whose source address was not
/// known yet when they translated it (connect and sendmsg run before the
/// kernel picks the source). `lb_sock_egress` checks its packets' source.
/// Kept across a new `LAYOUT_VERSION`, as `SockXlate` is (see there).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockCheck {
    /// The backend the socket is connected to (`sock_check::CONNECTED`):
    /// packets to it are the connection's. An IPv4 address fills the first
    /// 4 bytes.
    pub backend: [u8; 16],
    pub backend_port: u16,
    /// The connected frontend whose ranges apply.
    pub rev_nat_id: u16,
    /// FAMILY_V4 or FAMILY_V6: which maps `rev_nat_id` belongs to.
    pub family: u8,
    /// `sock_check::*` bits.
    pub state: u8,
    pub _pad: u16,
}

/// `SockCheck::state` bits.
pub mod sock_check {
    /// The socket is connected to a ranged frontend and no packet of the
    /// connection has passed yet: each is checked (dropped outside the
    /// ranges, as kube-proxy's KUBE-PROXY-FIREWALL drops new flows); the
    /// first one inside them clears the bit. (2 is unused.)
    pub const CONNECTED: u8 = 1;
    /// The socket sent unconnected datagrams to a ranged frontend: each
    /// datagram's destination is looked up in the socket rev-NAT LRU.
    pub const UNCONNECTED: u8 = 4;
    /// The socket is in the node's network namespace: a drop fails the
    /// send with EPERM, as kube-proxy's DROP in OUTPUT does (a pod's
    /// packets are dropped silently, as on the node's FORWARD path).
    pub const NODE: u8 = 8;
}

/// `SvcStatsKey::kind`.
pub const STATS_FRONTEND: u8 = 0;
pub const STATS_BACKEND: u8 = 1;

/// Key of the `LB_SVC_STATS` map: one frontend (`id` = its rev_nat_id) or
/// one backend (`id` = its backend id), of one family.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct SvcStatsKey {
    pub id: u32,
    pub kind: u8,
    pub family: u8,
    pub _pad: u16,
}

/// Value of the `LB_SVC_STATS` map, like `ipvsadm -L --stats`: added to
/// atomically by the programs.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SvcStats {
    /// Connections translated (connect; a new TC flow). Unconnected UDP
    /// datagrams are not counted here.
    pub conns: u64,
    /// Frontends: refused, no endpoints (ECONNREFUSED / ICMP reject).
    pub refused: u64,
    /// Frontends: no local endpoint (EHOSTUNREACH; TC: dropped).
    pub unreachable: u64,
    /// TC: packets of translated flows, both directions.
    pub packets: u64,
    /// TC: bytes of those packets (as on the wire, Ethernet header included).
    pub bytes: u64,
    /// Frontends: packets dropped by its loadBalancerSourceRanges (TC: from
    /// outside sources; socket path: the packets of a connection, or
    /// unconnected datagrams, from a source outside them). Such a
    /// connection is counted in `conns` only once a packet of it passes.
    pub source_range: u64,
}

/// `lb-agent monitor`: one decision of a program, sent through the ring
/// buffer of each monitor that runs (`LB_EVENTS<n>`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MonitorEvent {
    /// bpf_ktime_get_ns (CLOCK_MONOTONIC).
    pub ts_ns: u64,
    /// Socket hooks: the client's network namespace.
    pub netns_cookie: u64,
    /// TC: the client's address (an IPv4 address in the first 4 bytes).
    pub client: [u8; 16],
    /// The frontend asked for and the backend chosen (zero when refused).
    pub x: SockXlate,
    pub proto: u8,
    /// `monitor::HOOK_*`.
    pub hook: u8,
    /// `monitor::WHY_*`.
    pub why: u8,
    /// The errno a refused connect gets (0: translated).
    pub errno: u8,
    pub _pad: [u8; 4],
}

/// `lb-agent monitor`'s constants.
pub mod monitor {
    /// Monitors that can run at once (ring buffers `LB_EVENTS0..`).
    pub const SLOTS: u32 = 4;
    /// Bytes of each ring buffer.
    pub const RING_BYTES: u32 = 256 * 1024;
    /// A monitor whose heartbeat is older than this gets no events (it
    /// died without saying so): it refreshes it every 200 ms.
    pub const HEARTBEAT_NS: u64 = 1_000_000_000;
    pub const HOOK_CONNECT: u8 = 1;
    pub const HOOK_SENDMSG: u8 = 2;
    pub const HOOK_TC: u8 = 3;
    /// A pod's packet at its device (`--per-packet-lb`).
    pub const HOOK_POD: u8 = 4;
    /// A packet of a socket the hooks translated, leaving (`lb_sock_egress`).
    pub const HOOK_EGRESS: u8 = 5;
    pub const WHY_TRANSLATED: u8 = 1;
    /// Translated to a backend topology hints chose (this node or zone).
    pub const WHY_TOPOLOGY: u8 = 2;
    /// sessionAffinity: the client's earlier backend.
    pub const WHY_AFFINITY: u8 = 3;
    pub const WHY_NO_ENDPOINTS: u8 = 4;
    /// internalTrafficPolicy / externalTrafficPolicy Local, none here.
    pub const WHY_NO_LOCAL_ENDPOINT: u8 = 5;
    /// A ClusterIP on a port that is no service port.
    pub const WHY_WRONG_PORT: u8 = 6;
    /// Translated to the backend the frontend's Maglev table names.
    pub const WHY_MAGLEV: u8 = 7;
    /// Dropped: the source is outside the frontend's
    /// loadBalancerSourceRanges (errno EPERM where the sender is told).
    pub const WHY_SOURCE_RANGE: u8 = 8;
    pub fn hook_name(h: u8) -> &'static str {
        match h {
            HOOK_CONNECT => "connect",
            HOOK_SENDMSG => "sendmsg",
            HOOK_TC => "tc",
            HOOK_POD => "pod",
            HOOK_EGRESS => "egress",
            _ => "?",
        }
    }
    pub fn why_name(w: u8) -> &'static str {
        match w {
            WHY_TRANSLATED => "translated",
            WHY_TOPOLOGY => "translated (topology)",
            WHY_AFFINITY => "affinity hit",
            WHY_NO_ENDPOINTS => "no endpoints",
            WHY_NO_LOCAL_ENDPOINT => "no local endpoint",
            WHY_WRONG_PORT => "wrong port",
            WHY_MAGLEV => "translated (maglev)",
            WHY_SOURCE_RANGE => "source range",
            _ => "?",
        }
    }
}

pub type SockRevNat4Value = SockRevNatValue<[u8; 4]>;
pub type SockRevNat6Value = SockRevNatValue<[u8; 16]>;

/// `AffinityKey::family` / `AffinityMatchKey::family`.
pub const FAMILY_V4: u8 = 4;
pub const FAMILY_V6: u8 = 6;

/// Key of the `LB_AFFINITY` LRU map: one client and one frontend. A client
/// inside the node is its network namespace (one pod, or the node):
/// `netns_cookie`, with `client` zero. A client outside (the TC path) is its
/// address: `client` (an IPv4 address in the first 4 bytes), with
/// `netns_cookie` zero. `proto` keeps a TCP and a UDP frontend on one
/// address and port apart (they share a rev_nat id): kube-proxy keeps
/// affinity per endpoint chain, whose name holds the protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct AffinityKey {
    pub netns_cookie: u64,
    pub client: [u8; 16],
    pub rev_nat_id: u16,
    pub family: u8,
    pub proto: u8,
    pub _pad: [u8; 4],
}

/// Value of the `LB_AFFINITY` LRU map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct AffinityValue {
    /// bpf_ktime_get_ns() of the last connect that used this entry.
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub _pad: u32,
}

/// Key of the `LB_AFFINITY_MATCH` hash map: backend `backend_id` is one of
/// the backends of frontend `rev_nat_id`. An affinity entry counts only while
/// its pair is here. The value is unused (0).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct AffinityMatchKey {
    pub backend_id: u32,
    pub rev_nat_id: u16,
    pub family: u8,
    pub _pad: u8,
}

/// Key of the `LB4_NAT` / `LB6_NAT` hash maps: a packet's 5-tuple as seen on
/// the wire (ports in host order).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct NatKey<A> {
    pub saddr: A,
    pub daddr: A,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}

pub type Nat4Key = NatKey<[u8; 4]>;
pub type Nat6Key = NatKey<[u8; 16]>;

/// `NatEntry::flags`.
pub mod nat_flags {
    /// The entry rewrites replies (backend -> client); else the original direction.
    pub const REPLY: u8 = 1 << 0;
    /// The flow is SNATed to this node's address (a backend on another node).
    pub const SNAT: u8 = 1 << 1;
    /// Direct server return: on the frontend's node, the client's entry
    /// (no reply entry: replies do not come back); on the backend's node,
    /// the reply entry recorded from the packet's option.
    pub const DSR: u8 = 1 << 2;
    /// An outside flow of an externalTrafficPolicy Cluster Service to a
    /// backend on this node: its packets carry the masquerade mark
    /// (`node_flags::masq_of`), so that the agent's nftables rule
    /// masquerades them to the node's address, as kube-proxy's KUBE-EXT-*
    /// chains do (on the client's entry only: conntrack reverses the
    /// replies before the egress program sees them).
    pub const MASQ: u8 = 1 << 3;
    /// With SNAT: the same masquerade done in BPF (`--bpf-forward`), the
    /// flow SNATed to the address the route to its backend on this node
    /// picks (the pod bridge's, as kube-proxy's MASQUERADE picks it). Its
    /// replies arrive on the pod's device, where `lb_pod_ingress`
    /// translates and forwards them; it is not marked for the stack.
    pub const LOCAL: u8 = 1 << 4;

    /// Whether an entry's flow is masqueraded in BPF (`SNAT` with `LOCAL`).
    pub const fn masqueraded_in_bpf(flags: u8) -> bool {
        flags & (SNAT | LOCAL) == SNAT | LOCAL
    }
}

/// `NatEntry::state` bits, per direction (each entry records its own).
pub mod nat_state {
    /// A FIN went this way.
    pub const FIN: u8 = 1 << 0;
    /// A RST went this way. Cleared again when the flow goes on well after
    /// it (a RST the peer did not accept), so a forged RST cannot close a
    /// live flow: by the fourth packet this way after it (`AFTER_RST`
    /// counts the three before).
    pub const RST: u8 = 1 << 1;
    /// Packets this way since its RST (bits 4-5). Packets sent before a
    /// RST can arrive after it: a pure ACK the receive path sent from
    /// another CPU's softirq while the application's close() sent the RST
    /// from its own. Those must not reopen the flow (a closed flow that
    /// looks live keeps its entries for the established timeout, and its
    /// reply entry rewrites the replies of a direct connection that
    /// reuses the tuple).
    pub const AFTER_RST: u8 = 0b11 << 4;
    /// One in `AFTER_RST`.
    pub const AFTER_RST_ONE: u8 = 1 << 4;
    /// A packet went this way after the first one. On the reply entry: the
    /// flow was answered (else it expires as unreplied).
    pub const SEEN: u8 = 1 << 2;
    /// Set by the agent on the original-direction entry: the backend left
    /// the Service. The next packet ends the flow (TCP: a RST to the client;
    /// UDP: a new backend is picked).
    pub const STALE: u8 = 1 << 3;
    /// On the backend's node of a DSR flow, whose one entry notes both
    /// ways: a FIN went the backend's way (`FIN` is the client's).
    pub const FIN_REPLY: u8 = 1 << 6;

    /// Whether a DSR flow was closed by FINs, by its one entry's state and
    /// flags (the entry has no partner: on the frontend's node only the
    /// client's packets pass, so the client's FIN closes it there; on the
    /// backend's node (`nat_flags::REPLY`), a FIN each way does).
    pub const fn dsr_fin_closed(state: u8, flags: u8) -> bool {
        state & FIN != 0 && (flags & super::nat_flags::REPLY == 0 || state & FIN_REPLY != 0)
    }
}

/// Value of the NAT maps: how to rewrite packets of this tuple.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatEntry<A> {
    pub to_saddr: A,
    pub to_daddr: A,
    pub to_sport: u16,
    pub to_dport: u16,
    pub flags: u8,
    pub state: u8,
    pub rev_nat_id: u16,
    /// bpf_ktime_get_ns() (CLOCK_MONOTONIC) of the first and the last packet.
    pub created_ns: u64,
    pub last_seen_ns: u64,
}

impl<A: Copy> NatEntry<A> {
    /// The key of the other direction of the flow this entry belongs to:
    /// the reverse of the tuple it rewrites to.
    pub fn other_key(&self, proto: u8) -> NatKey<A> {
        NatKey { saddr: self.to_daddr, daddr: self.to_saddr, sport: self.to_dport, dport: self.to_sport, proto, _pad: [0; 3] }
    }
}

pub type Nat4Entry = NatEntry<[u8; 4]>;
pub type Nat6Entry = NatEntry<[u8; 16]>;

/// How long NAT flows live, in nanoseconds (the agent's `--nat-*-timeout`
/// flags), for the expiry rules both the agent and the kernel's own expiry
/// apply (`nat_expired`, `nat_expired_dsr`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatTimeouts {
    /// An established TCP flow without packets.
    pub tcp_ns: u64,
    /// A TCP flow after FIN in both directions or a RST.
    pub tcp_closed_ns: u64,
    /// A DSR flow on its frontend's node after the client's FIN.
    pub dsr_fin_ns: u64,
    /// A UDP flow without packets.
    pub udp_ns: u64,
    /// A flow that was never answered (a SYN flood, a dead backend).
    pub unreplied_ns: u64,
}

/// Whether a flow (its original-direction entry and its reply entry, when
/// there is one) has expired at `now_ns` (CLOCK_MONOTONIC, as
/// bpf_ktime_get_ns): idle longer than its state's timeout. Assured, in
/// conntrack's words (answered, and for TCP the client went on after its
/// SYN: the handshake's ACK), or it lives `unreplied_ns` at most: a SYN
/// flood from spoofed addresses, answered by the backend, never gets
/// there and expires like an unanswered one.
#[inline(always)]
pub fn nat_expired<A>(proto: u8, fwd: &NatEntry<A>, reply: Option<&NatEntry<A>>, now_ns: u64, t: &NatTimeouts) -> bool {
    let last = match reply {
        Some(r) if r.last_seen_ns > fwd.last_seen_ns => r.last_seen_ns,
        _ => fwd.last_seen_ns,
    };
    let idle = now_ns.saturating_sub(last);
    let reply_state = match reply {
        Some(r) => r.state,
        None => 0,
    };
    let replied = reply.is_some() && reply_state & nat_state::SEEN != 0 && (proto == PROTO_UDP || fwd.state & nat_state::SEEN != 0);
    let mut timeout = if proto == PROTO_UDP {
        t.udp_ns
    } else {
        let rst = (fwd.state | reply_state) & nat_state::RST != 0;
        let fin_both = fwd.state & nat_state::FIN != 0 && reply_state & nat_state::FIN != 0;
        if rst || fin_both { t.tcp_closed_ns } else { t.tcp_ns }
    };
    if !replied && t.unreplied_ns < timeout {
        timeout = t.unreplied_ns;
    }
    idle > timeout
}

/// Whether a DSR flow's one entry on this node has expired. The frontend's
/// node sees only the client's packets: SEEN (the client went on after its
/// SYN, so it was answered) assures the flow, and after the client's FIN
/// the flow may still be half open (the backend sending), so it lives
/// `dsr_fin_ns` idle. The backend's node (a reply entry) marks it SEEN only
/// from the backend's packets; the client's refresh it (and note FIN /
/// RST) but cannot assure it. It sees both ways' FINs (`FIN_REPLY` is the
/// backend's): one FIN leaves the flow established, as without DSR.
#[inline(always)]
pub fn nat_expired_dsr<A>(proto: u8, e: &NatEntry<A>, now_ns: u64, t: &NatTimeouts) -> bool {
    let idle = now_ns.saturating_sub(e.last_seen_ns);
    let backends_node = e.flags & nat_flags::REPLY != 0;
    let both_fins = nat_state::FIN | nat_state::FIN_REPLY;
    let mut timeout = if proto == PROTO_UDP {
        t.udp_ns
    } else if e.state & nat_state::RST != 0 || backends_node && e.state & both_fins == both_fins {
        t.tcp_closed_ns
    } else if !backends_node && e.state & nat_state::FIN != 0 {
        if t.dsr_fin_ns < t.tcp_ns { t.dsr_fin_ns } else { t.tcp_ns }
    } else {
        t.tcp_ns
    };
    if e.state & nat_state::SEEN == 0 && t.unreplied_ns < timeout {
        timeout = t.unreplied_ns;
    }
    idle > timeout
}

/// Value of the `LB_NAT_GC` array (index 0), written by the agent: what
/// the kernel's own NAT expiry needs. The NAT tables are plain hash maps
/// that the agent expires; while no agent runs (a crash loop, a rollout's
/// image pull) a timer in the kernel (`LB_NAT_TIMER`) expires them by the
/// same rules, so new outside flows do not fill them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatGc {
    /// CLOCK_MONOTONIC of the agent's NAT thread's last look (it looks
    /// every second).
    pub heartbeat_ns: u64,
    /// The kernel expires flows itself once the heartbeat is older than
    /// this.
    pub stale_ns: u64,
    /// How often it walks the tables then (the agent's
    /// `--nat-gc-interval`); 0: never (not configured yet).
    pub interval_ns: u64,
    /// The entries each table holds at most (`--max-nat`): a walk that
    /// leaves one 90% full goes on dropping early.
    pub capacity: u64,
    pub timeouts: NatTimeouts,
}

/// `struct bpf_timer` as the kernel's BTF names it (the kernel finds a
/// map value's timer by that name and size).
#[allow(non_camel_case_types)]
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct bpf_timer {
    pub opaque: [u64; 2],
}

/// Value of the `LB_NAT_TIMER` array (index 0): the kernel's NAT expiry
/// timer, armed by the agent (`lb_nat_gc_arm`). Never written from user
/// space: an update of an array element cancels its timer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatTimer {
    pub timer: bpf_timer,
    /// CLOCK_MONOTONIC of the kernel's last walk of a NAT table.
    pub last_walk_ns: u64,
    /// How long that walk took.
    pub last_walk_took_ns: u64,
    /// New IPv4 flows the TC programs refused (where they count
    /// `nat_failed`), added to atomically: the per-CPU counter's sum
    /// cannot be read from BPF before Linux 5.19.
    pub refused: u64,
    /// `refused` when the timer last looked: more now means new flows were
    /// refused since.
    pub refused_seen: u64,
    /// An early-drop spell goes on (its last walk dropped flows and left
    /// the table 90% full), or an early walk is due (new flows refused
    /// since a look that walked the other table): bit 0 the IPv4 table,
    /// bit 1 the IPv6 one.
    pub pressure: u64,
    /// CLOCK_MONOTONIC of the timer's last look (every second while it is
    /// armed): how the agent, `lb-agent nat` and /metrics tell a running
    /// timer from one never armed or cancelled.
    pub last_look_ns: u64,
    /// 1 while a round's IPv6 walk waits (a round walks the IPv4 table at
    /// one look, the IPv6 one at a later one).
    pub v6_next: u64,
    /// `refused` of the IPv6 table.
    pub refused6: u64,
    /// `refused_seen` of the IPv6 table.
    pub refused6_seen: u64,
    /// CLOCK_MONOTONIC of the last round's start.
    pub round_ns: u64,
    /// The table the last walk took: 0 IPv4, 1 IPv6.
    pub last_table: u64,
}

/// Data of the `LB_SRC_RANGE` LPM trie key (after its prefix length): the
/// prefix length counts bits of `rev_nat_id`, `family`, `_pad` and `addr`,
/// so the entry for prefix a/n of frontend `rev_nat_id` has prefix length
/// 32 + n. An IPv4 address fills the first 4 bytes of `addr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SrcRange {
    pub rev_nat_id: u16,
    pub family: u8,
    pub _pad: u8,
    pub addr: [u8; 16],
}

/// Data of the `LB_ROUTE_MTU` LPM trie key (after its prefix length): a
/// route's destination, so the entry for route a/n has prefix length
/// 32 + n (the family and padding fill the first 32 bits). An IPv4 address
/// fills the first 4 bytes of `addr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct RouteKey {
    pub family: u8,
    pub _pad: [u8; 3],
    pub addr: [u8; 16],
}

/// Value of `LB_ROUTE_MTU`: the MTU a route of the node's main table sets
/// (`ip route ... mtu N`, locked or not), and the device it leaves by (0:
/// any, a multipath route). The stack's forwarding path honours such an
/// MTU; `bpf_fib_lookup` sees it only when it is locked.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct RouteMtu {
    pub mtu: u32,
    pub ifindex: u32,
}

/// Key of the `LB_NODEPORTS` hash map: a NodePort in use, which local
/// processes in the cgroup may not bind().
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct NodePortKey {
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}

/// Indexes of the per-CPU `LB_STATS` array.
pub mod stats {
    /// connect/sendmsg rewritten to a backend.
    pub const TRANSLATED: u32 = 0;
    /// Refused: the service has no endpoints.
    pub const REFUSED_NO_ENDPOINTS: u32 = 1;
    /// Refused: a ClusterIP on a port that is no service port.
    pub const REFUSED_NO_PORT: u32 = 2;
    /// Replies whose source was rewritten back to the frontend (recvmsg).
    pub const REVERSED: u32 = 3;
    /// A lookup failed in the middle of a concurrent update and was retried.
    pub const RETRIED: u32 = 4;
    /// Refused with EHOSTUNREACH: internalTrafficPolicy Local, no local endpoint.
    pub const UNREACH_NO_LOCAL: u32 = 5;
    /// A connect that reused its client's affine backend.
    pub const AFFINITY_HIT: u32 = 6;
    /// TC: new outside flows translated to a backend.
    pub const NAT_NEW: u32 = 7;
    /// TC: outside packets dropped (no endpoints, no local endpoint with
    /// externalTrafficPolicy Local, or a source outside loadBalancerSourceRanges;
    /// a TTL that ran out; a reply of a flow masqueraded in BPF that the
    /// FIB cannot send on: no route to the client, forwarding off).
    pub const NAT_DROPPED: u32 = 8;
    /// TC: no free SNAT port, or the NAT table refused the flow.
    pub const NAT_FAILED: u32 = 9;
    /// bind() to a NodePort refused.
    pub const BIND_REFUSED: u32 = 10;
    /// TC: outside flows rejected with ICMP port unreachable (no endpoints,
    /// as kube-proxy's REJECT).
    pub const NAT_REJECTED: u32 = 11;
    /// TC: flows to a backend that left, ended with a TCP RST to the client.
    pub const NAT_RESET: u32 = 12;
    /// TC: a new outside flow replaced a closed one with the same tuple.
    pub const NAT_REPLACED: u32 = 13;
    /// TC: ICMP errors about packets of translated flows, translated.
    pub const NAT_ICMP: u32 = 14;
    /// TC: "fragmentation needed" / "packet too big" sent to a client whose
    /// SNATed packet did not fit the path to its backend.
    pub const NAT_TOO_BIG: u32 = 15;
    /// TC, `--bpf-forward`: translated packets sent on by BPF (FIB lookup
    /// and redirect), skipping the stack's forwarding path.
    pub const FWD_BPF: u32 = 16;
    /// TC, `--bpf-forward`: translated packets left to the stack because the
    /// FIB lookup said so (local delivery, no route, too big for the MTU).
    pub const FWD_STACK: u32 = 17;
    /// TC: packets of DSR flows sent on with the frontend in an IPv4 option.
    pub const DSR_SENT: u32 = 18;
    /// TC: packets of DSR flows received for a local backend (option stripped).
    pub const DSR_RECEIVED: u32 = 19;
    /// XDP, `--nodeport-acceleration xdp`: packets of established SNATed
    /// flows translated and sent back out (XDP_TX) before the stack.
    pub const FWD_XDP: u32 = 20;
    /// connect: the kernel refused the socket its storage (the socket's
    /// optmem limit, `net.core.optmem_max`, or an allocation failure); the
    /// translation went into the socket rev-NAT LRU instead, which can
    /// evict it.
    pub const SOCK_STORAGE_FAILED: u32 = 21;
    /// TC: ICMP errors about replies of a Maglev DSR flow this node does
    /// not hold (ECMP sent the error to another node than the flow),
    /// translated and sent on to the backend Maglev picks for the flow.
    pub const NAT_ICMP_MAGLEV: u32 = 22;
    /// Packets dropped by a frontend's loadBalancerSourceRanges: on the
    /// socket path, packets of sockets translated to it whose source is
    /// outside them (`lb_sock_egress`); since 12-05 also TC's (outside
    /// clients and, under `--per-packet-lb`, pods: also counted in
    /// `nat_dropped`).
    pub const SRC_RANGE_DROPPED: u32 = 23;
    /// connect: a socket's translation storage (`LB_SOCK_XLATE`) created;
    /// less SOCK_UNTRACKED: the sockets holding one now
    /// (`lb_sockets_tracked`).
    pub const SOCK_TRACKED: u32 = 24;
    /// sock_release: a socket with such storage closed.
    pub const SOCK_UNTRACKED: u32 = 25;
    /// `lb-agent monitor`: events lost because a monitor's ring buffer was
    /// full (its reader too slow), one counter per monitor slot (1..=4:
    /// `MONITOR_LOST + slot - 1`).
    pub const MONITOR_LOST: u32 = 26;
    /// TC: an ICMP error (port unreachable, time exceeded) not sent: over
    /// the kernel's default rate (1,000 a second, bursts of 50), per CPU.
    pub const ICMP_LIMITED: u32 = 30;
    /// TC/XDP: a flow an upgrade's old NAT table held, missing from the new
    /// one (made just before the programs moved), copied over on its first
    /// packet (`LB_ADOPT`).
    pub const NAT_ADOPTED: u32 = 31;
    /// NAT flows the kernel expired itself while no agent ran (its
    /// heartbeat stale: `NatGc`).
    pub const NAT_EXPIRED_WITHOUT_AGENT: u32 = 32;
    /// The kernel's walks of the NAT tables while no agent ran.
    pub const NAT_WALKS_WITHOUT_AGENT: u32 = 33;
    pub const COUNT: u32 = 34;
    pub const NAMES: [&str; COUNT as usize] = [
        "translated",
        "refused_no_endpoints",
        "refused_no_port",
        "reversed",
        "retried",
        "unreachable_no_local",
        "affinity_hit",
        "nat_new",
        "nat_dropped",
        "nat_failed",
        "bind_refused",
        "nat_rejected",
        "nat_reset",
        "nat_replaced",
        "nat_icmp",
        "nat_too_big",
        "forwarded_bpf",
        "forwarded_stack",
        "dsr_sent",
        "dsr_received",
        "forwarded_xdp",
        "sock_storage_failed",
        "nat_icmp_maglev",
        "source_range_dropped",
        "sock_tracked",
        "sock_untracked",
        "monitor_lost_1",
        "monitor_lost_2",
        "monitor_lost_3",
        "monitor_lost_4",
        "icmp_limited",
        "nat_adopted",
        "nat_expired_without_agent",
        "nat_walks_without_agent",
    ];
}

/// The version of the pinned maps' layout: bump it whenever a map changes
/// meaning without changing size (the loader compares sizes, types and
/// max_entries by itself). Pins of another version are replaced by an
/// upgrade, and the state maps' entries carried over where sizes agree.
pub const LAYOUT_VERSION: u32 = 5;

/// Map names, shared by the loader, `lb-agent list` and the pin layout.
pub mod maps {
    pub const SERVICES4: &str = "LB4_SERVICES";
    pub const BACKENDS4: &str = "LB4_BACKENDS";
    pub const REVNAT4: &str = "LB4_REVNAT";
    pub const SOCK_REVNAT4: &str = "LB4_SOCK_REVNAT";
    pub const SERVICES6: &str = "LB6_SERVICES";
    pub const BACKENDS6: &str = "LB6_BACKENDS";
    pub const REVNAT6: &str = "LB6_REVNAT";
    pub const SOCK_REVNAT6: &str = "LB6_SOCK_REVNAT";
    pub const AFFINITY: &str = "LB_AFFINITY";
    pub const AFFINITY_MATCH: &str = "LB_AFFINITY_MATCH";
    pub const STATS: &str = "LB_STATS";
    pub const NAT4: &str = "LB4_NAT";
    pub const NAT6: &str = "LB6_NAT";
    pub const SRC_RANGE: &str = "LB_SRC_RANGE";
    pub const NODEPORTS: &str = "LB_NODEPORTS";
    pub const NODE_CONFIG: &str = "LB_NODE_CONFIG";
    pub const SOCK_XLATE: &str = "LB_SOCK_XLATE";
    pub const SOCK_UDP: &str = "LB_SOCK_UDP";
    /// Sockets whose packets' source loadBalancerSourceRanges must allow
    /// (`SockCheck`).
    pub const SOCK_CHECK: &str = "LB_SOCK_CHECK";
    /// Connections to a frontend with loadBalancerSourceRanges not counted
    /// yet (socket -> the backend id they were sent to): counted when their
    /// first packet passes the ranges.
    pub const SOCK_PENDING: &str = "LB_SOCK_PENDING";
    pub const SVC_STATS: &str = "LB_SVC_STATS";
    pub const MAGLEV4: &str = "LB4_MAGLEV";
    pub const MAGLEV6: &str = "LB6_MAGLEV";
    /// The devices the XDP program runs on that need a redirect to send a
    /// packet back out (ifindex -> `xdp_dev::*`).
    pub const XDP_DEVS: &str = "LB_XDP_DEVS";
    /// `lb-agent monitor`: heartbeats (index 0: any monitor; 1..=SLOTS:
    /// each monitor's) and one ring buffer per monitor.
    pub const MONITOR: &str = "LB_MONITOR";
    pub const EVENTS: [&str; 4] = ["LB_EVENTS0", "LB_EVENTS1", "LB_EVENTS2", "LB_EVENTS3"];
    /// The ports of datagrams in fragments, from their first fragment.
    pub const FRAG4: &str = "LB4_FRAG";
    pub const FRAG6: &str = "LB6_FRAG";
    /// Routes that set an MTU (`RouteKey` -> `RouteMtu`).
    pub const ROUTE_MTU: &str = "LB_ROUTE_MTU";
    /// The node's own IPv4 addresses (address -> 0): a packet from outside
    /// claiming one is dropped, as the stack drops it without the
    /// accept_local lb sets.
    pub const LOCAL4: &str = "LB_LOCAL4";
    /// The kernel's own NAT expiry while no agent runs: its settings and
    /// the agent's heartbeat (`NatGc`), and its timer (`NatTimer`).
    pub const NAT_GC: &str = "LB_NAT_GC";
    pub const NAT_TIMER: &str = "LB_NAT_TIMER";
    pub const ALL: [&str; 35] = [
        SERVICES4, BACKENDS4, REVNAT4, SOCK_REVNAT4, SERVICES6, BACKENDS6, REVNAT6, SOCK_REVNAT6,
        AFFINITY, AFFINITY_MATCH, STATS, NAT4, NAT6, SRC_RANGE, NODEPORTS, NODE_CONFIG, SOCK_XLATE,
        SVC_STATS, MONITOR, EVENTS[0], EVENTS[1], EVENTS[2], EVENTS[3], MAGLEV4, MAGLEV6, SOCK_UDP, XDP_DEVS,
        FRAG4, FRAG6, ROUTE_MTU, SOCK_CHECK, SOCK_PENDING, LOCAL4, NAT_GC, NAT_TIMER,
    ];
}

/// Default map capacities; the agent can override them.
pub mod capacity {
    /// Frontend and slot entries: 10,000 Services x 10 endpoints need 120,000.
    pub const SERVICES: u32 = 262144;
    pub const BACKENDS: u32 = 262144;
    pub const REVNAT: u32 = 65535;
    pub const SOCK_REVNAT: u32 = 262144;
    pub const AFFINITY: u32 = 65536;
    pub const NAT: u32 = 262144;
    pub const SRC_RANGE: u32 = 16384;
    /// Every port, TCP and UDP: a NodePort range of any size fits
    /// (NO_PREALLOC: only the entries in use take memory).
    pub const NODEPORTS: u32 = 2 * 65536;
    /// Per-frontend and per-backend counters: frontends plus backends.
    pub const SVC_STATS: u32 = REVNAT + BACKENDS;
    /// Maglev tables (frontends with Maglev, per scope), per family: one
    /// key per rev-NAT id, protocol and scope, so every frontend fits
    /// (the agent sizes it from `--max-services` as it does rev-NAT;
    /// NO_PREALLOC). Each table takes 4 bytes per entry (64 KiB at the
    /// default 16381); frontends with the same backends share one.
    pub const MAGLEV: u32 = 4 * REVNAT;
    /// The inner map template's size; tables of other (prime) sizes are
    /// accepted too (BPF_F_INNER_MAP).
    pub const MAGLEV_TEMPLATE: u32 = 16381;
    /// Datagrams in fragments under way at once, per family.
    pub const FRAG: u32 = 8192;
    /// Routes that set an MTU (a tunnelling CNI may set one per node).
    pub const ROUTE_MTU: u32 = 65536;
    /// The node's own IPv4 addresses (a node holding more leaves the rest
    /// unchecked, with a warning).
    pub const LOCAL4: u32 = 16384;
}

/// Value of the `LB_NODE_CONFIG` array (index 0): facts about this node
/// that the programs need.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NodeConfig {
    /// The node's network namespace: NodePorts are protected from bind() there.
    pub netns_cookie: u64,
    /// The node address SNATed flows leave from.
    pub snat_addr: [u8; 4],
    /// SNAT ports: outside the node's ephemeral range, so SNATed flows never
    /// collide with the node's own sockets.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// The node address SNATed IPv6 flows leave from (zero: none).
    pub snat_addr6: [u8; 16],
    /// `node_flags`.
    pub flags: u32,
    /// Entries in each Maglev table (a prime; 0: no Maglev tables).
    pub maglev_size: u32,
}

/// Key of the Maglev maps (`LB4_MAGLEV`, `LB6_MAGLEV`): one table per
/// frontend and scope (all backends, or the node-local ones for
/// externalTrafficPolicy Local). The value is an inner array of
/// `NodeConfig::maglev_size` backend ids, swapped in whole by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct MaglevKey {
    pub rev_nat_id: u16,
    pub proto: u8,
    pub scope: u8,
}

/// Key of `LB4_FRAG`: an IPv4 datagram in fragments. The value
/// (`FragPorts`) holds the ports its first fragment carried, so that the
/// later ones, which carry no L4 header, follow the same flow.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FragKey {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub id: u16,
    pub proto: u8,
    pub _pad: u8,
}

/// Key of `LB6_FRAG`: the same for IPv6 (a fragment extension header, a
/// 32-bit identification).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Frag6Key {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub id: u32,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// Value of `LB4_FRAG` and `LB6_FRAG` (host byte order).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FragPorts {
    pub sport: u16,
    pub dport: u16,
}

/// Values of `LB_XDP_DEVS`.
pub mod xdp_dev {
    /// Send packets back out with a redirect to the device itself, not
    /// XDP_TX: a veth flushes XDP_TX frames to its peer only when the peer
    /// runs XDP itself, while a redirect needs only NAPI there (GRO).
    pub const REDIRECT: u32 = 1;
    /// Entries of the map: devices of one node.
    pub const CAPACITY: u32 = 64;
}

/// `NodeConfig::flags`.
pub mod node_flags {
    /// Forward translated outside traffic in BPF (FIB lookup and redirect)
    /// instead of through the stack (`lb-agent run --bpf-forward`).
    pub const BPF_FORWARD: u32 = 1 << 0;
    /// ClusterIPs routed to the node from outside (a router advertising
    /// the Service CIDR) are served on arrival, as kube-proxy's
    /// KUBE-SERVICES in PREROUTING serves them (`lb-agent run
    /// --external-cluster-ip`).
    pub const EXTERNAL_CLUSTER_IP: u32 = 1 << 1;
    /// Packets pods send to a Service address (the socket hooks did not
    /// translate them: a VM's or a sandbox's own kernel sent them) are
    /// translated at the pod's device, and their replies on the way back
    /// in (`lb-agent run --per-packet-lb`), as kube-proxy's PREROUTING
    /// rules serve them.
    pub const POD_PACKET_LB: u32 = 1 << 2;
    /// `lb_sock_egress` is attached (the agent attaches it while some
    /// frontend has loadBalancerSourceRanges, and sets this after): the
    /// socket hooks mark the sockets it must check. Without it they mark
    /// none, so that no connection is marked whose first packet the
    /// program could miss.
    pub const SOCK_EGRESS: u32 = 1 << 3;
    /// No flow masqueraded in BPF (`nat_flags::LOCAL`) lives: the agent
    /// forwards without BPF and saw none left after it wrote flags without
    /// `BPF_FORWARD` (so none can be made). `lb_pod_ingress` then skips the
    /// reply lookup that only such flows need without `BPF_FORWARD`
    /// (`--per-packet-lb` alone). Set this way round so that the flags of
    /// an agent that does not know it (never set) keep the lookup.
    pub const NO_BPF_MASQUERADED: u32 = 1 << 4;
    /// Bits 8-13: the skb mark bit the TC programs set on what they
    /// translate and hand to the stack to forward, plus one (0: none), so
    /// that the agent's iptables rule (`LB-FORWARD`) accepts it in a
    /// FORWARD chain that would drop it (`lb-agent run --forward-mark-bit`).
    pub const FWD_MARK: u32 = 0x3f << FWD_MARK_SHIFT;
    pub const FWD_MARK_SHIFT: u32 = 8;

    /// The flags that set mark bit `bit` (0-31).
    pub const fn fwd_mark(bit: u32) -> u32 {
        flags_of(bit, FWD_MARK_SHIFT)
    }

    /// The mark (a single bit) `flags` asks for; 0: none.
    pub const fn mark_of(flags: u32) -> u32 {
        bit_of(flags, FWD_MARK_SHIFT)
    }

    /// Bits 14-19: the skb mark bit (plus one; 0: none) the TC programs
    /// also set on the packets of SNATed and DSR flows, both ways, so that
    /// the agent's nftables rule (table `inet lb`) exempts them from
    /// conntrack (`lb-agent run --notrack-mark-bit`).
    pub const NOTRACK_MARK: u32 = 0x3f << NOTRACK_MARK_SHIFT;
    pub const NOTRACK_MARK_SHIFT: u32 = 14;

    /// The flags that set notrack mark bit `bit` (0-31).
    pub const fn notrack_mark(bit: u32) -> u32 {
        flags_of(bit, NOTRACK_MARK_SHIFT)
    }

    /// The notrack mark `flags` asks for; 0: none.
    pub const fn notrack_of(flags: u32) -> u32 {
        bit_of(flags, NOTRACK_MARK_SHIFT)
    }

    /// Bits 20-25: the skb mark bit (plus one; 0: none) the TC programs
    /// set on the packets outside clients send to a backend on this node
    /// of an externalTrafficPolicy Cluster Service (`nat_flags::MASQ`), so
    /// that the agent's nftables rule (table `inet lb`, nat postrouting)
    /// masquerades them as kube-proxy does (`lb-agent run
    /// --masquerade-mark-bit`).
    pub const MASQ_MARK: u32 = 0x3f << MASQ_MARK_SHIFT;
    pub const MASQ_MARK_SHIFT: u32 = 20;

    /// The flags that set masquerade mark bit `bit` (0-31).
    pub const fn masq_mark(bit: u32) -> u32 {
        flags_of(bit, MASQ_MARK_SHIFT)
    }

    /// The masquerade mark `flags` asks for; 0: none (local backends keep
    /// the client's address).
    pub const fn masq_of(flags: u32) -> u32 {
        bit_of(flags, MASQ_MARK_SHIFT)
    }

    const fn flags_of(bit: u32, shift: u32) -> u32 {
        ((bit & 31) + 1) << shift
    }

    const fn bit_of(flags: u32, shift: u32) -> u32 {
        let b = (flags >> shift) & 0x3f;
        if b == 0 { 0 } else { 1 << ((b - 1) & 31) }
    }
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all of these are #[repr(C)], Copy, with explicit padding fields
    // and no implicit padding; every bit pattern is valid.
    unsafe impl aya::Pod for Svc4Key {}
    unsafe impl aya::Pod for Svc6Key {}
    unsafe impl aya::Pod for SvcValue {}
    unsafe impl aya::Pod for Backend4 {}
    unsafe impl aya::Pod for Backend6 {}
    unsafe impl aya::Pod for RevNat4 {}
    unsafe impl aya::Pod for RevNat6 {}
    unsafe impl aya::Pod for SockRevNat4Key {}
    unsafe impl aya::Pod for SockRevNat6Key {}
    unsafe impl aya::Pod for SockRevNat4Value {}
    unsafe impl aya::Pod for SockRevNat6Value {}
    unsafe impl aya::Pod for SockXlate {}
    unsafe impl aya::Pod for SockCheck {}
    unsafe impl aya::Pod for SvcStatsKey {}
    unsafe impl aya::Pod for SvcStats {}
    unsafe impl aya::Pod for MonitorEvent {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for AffinityMatchKey {}
    unsafe impl aya::Pod for Nat4Key {}
    unsafe impl aya::Pod for Nat6Key {}
    unsafe impl aya::Pod for Nat4Entry {}
    unsafe impl aya::Pod for Nat6Entry {}
    unsafe impl aya::Pod for SrcRange {}
    unsafe impl aya::Pod for RouteKey {}
    unsafe impl aya::Pod for RouteMtu {}
    unsafe impl aya::Pod for NodePortKey {}
    unsafe impl aya::Pod for NodeConfig {}
    unsafe impl aya::Pod for MaglevKey {}
    unsafe impl aya::Pod for FragKey {}
    unsafe impl aya::Pod for Frag6Key {}
    unsafe impl aya::Pod for FragPorts {}
    unsafe impl aya::Pod for NatGc {}
}

// Layouts are part of the pinned-map ABI: a change must be deliberate.
const _: () = {
    assert!(core::mem::size_of::<NatGc>() == 72);
    assert!(core::mem::size_of::<NatTimer>() == 104);
    assert!(core::mem::size_of::<bpf_timer>() == 16);
    assert!(core::mem::size_of::<Svc4Key>() == 12);
    assert!(core::mem::size_of::<SvcValue>() == 16);
    assert!(core::mem::size_of::<Backend4>() == 8);
    assert!(core::mem::size_of::<RevNat4>() == 8);
    assert!(core::mem::size_of::<SockRevNat4Key>() == 16);
    assert!(core::mem::size_of::<SockRevNat4Value>() == 8);
    assert!(core::mem::size_of::<Svc6Key>() == 24);
    assert!(core::mem::size_of::<Backend6>() == 20);
    assert!(core::mem::size_of::<RevNat6>() == 20);
    assert!(core::mem::size_of::<SockRevNat6Key>() == 32);
    assert!(core::mem::size_of::<SockRevNat6Value>() == 20);
    assert!(core::mem::size_of::<SockXlate>() == 40);
    assert!(core::mem::size_of::<SvcStatsKey>() == 8);
    assert!(core::mem::size_of::<SvcStats>() == 48);
    assert!(core::mem::size_of::<MonitorEvent>() == 80);
    assert!(core::mem::size_of::<AffinityKey>() == 32);
    assert!(core::mem::size_of::<AffinityValue>() == 16);
    assert!(core::mem::size_of::<AffinityMatchKey>() == 8);
    assert!(core::mem::size_of::<Nat4Key>() == 16);
    assert!(core::mem::size_of::<Nat4Entry>() == 32);
    assert!(core::mem::size_of::<Nat6Key>() == 40);
    assert!(core::mem::size_of::<Nat6Entry>() == 56);
    assert!(core::mem::size_of::<SrcRange>() == 20);
    assert!(core::mem::size_of::<RouteKey>() == 20);
    assert!(core::mem::size_of::<RouteMtu>() == 8);
    assert!(core::mem::size_of::<NodePortKey>() == 4);
    assert!(core::mem::size_of::<NodeConfig>() == 40);
    assert!(core::mem::size_of::<MaglevKey>() == 4);
    assert!(core::mem::size_of::<FragKey>() == 12);
    assert!(core::mem::size_of::<Frag6Key>() == 40);
    assert!(core::mem::size_of::<FragPorts>() == 4);
};

#[cfg(test)]
mod layout_tests {
    use super::*;

    #[test]
    fn mark_bits_ride_in_the_node_flags() {
        use node_flags::*;
        let f = BPF_FORWARD | fwd_mark(12) | notrack_mark(13);
        assert_eq!((mark_of(f), notrack_of(f), f & BPF_FORWARD), (0x1000, 0x2000, BPF_FORWARD));
        assert_eq!((mark_of(fwd_mark(0)), mark_of(fwd_mark(31)), notrack_of(notrack_mark(31))), (1, 0x8000_0000, 0x8000_0000));
        assert_eq!((mark_of(BPF_FORWARD), notrack_of(fwd_mark(5))), (0, 0), "no bit asked for: no mark");
        let f = f | masq_mark(11);
        assert_eq!((mark_of(f), notrack_of(f), masq_of(f)), (0x1000, 0x2000, 0x800), "each mark has its own bits");
        assert_eq!((masq_of(masq_mark(31)), masq_of(notrack_mark(11) | fwd_mark(11))), (0x8000_0000, 0), "no masquerade bit asked for: none");
    }

    /// Every pinned struct's size and field offsets, hashed. A change that
    /// keeps sizes (a field moved, two swapped) is invisible to the loader's
    /// size check: it must bump LAYOUT_VERSION, so that an upgrade replaces
    /// the pinned maps instead of misreading them. Update the expected value
    /// below together with the version. A change of a value's size alone
    /// (`SvcStats` growing `source_range`, 12-05) needs no bump: the loader
    /// replaces that one map, where a bump would replace them all (but the
    /// socket storage maps, which a bump alone keeps: a change of their
    /// meaning must change their BTF). Nor does
    /// a new field the map's BTF names (`AffinityKey::proto` in what was
    /// padding, 12-05): the loader compares BTF layouts and replaces that
    /// map alone (and `upgrade::copy_affinity_adding_proto` carries its
    /// entries).
    #[test]
    fn the_layout_fingerprint_goes_with_the_layout_version() {
        let layouts: &[(&str, usize, &[usize])] = &[
            ("Svc4Key", core::mem::size_of::<Svc4Key>(), &[core::mem::offset_of!(Svc4Key, addr), core::mem::offset_of!(Svc4Key, port), core::mem::offset_of!(Svc4Key, proto), core::mem::offset_of!(Svc4Key, scope), core::mem::offset_of!(Svc4Key, slot), core::mem::offset_of!(Svc4Key, _pad)]),
            ("Svc6Key", core::mem::size_of::<Svc6Key>(), &[core::mem::offset_of!(Svc6Key, addr), core::mem::offset_of!(Svc6Key, port), core::mem::offset_of!(Svc6Key, proto), core::mem::offset_of!(Svc6Key, scope), core::mem::offset_of!(Svc6Key, slot), core::mem::offset_of!(Svc6Key, _pad)]),
            ("SvcValue", core::mem::size_of::<SvcValue>(), &[core::mem::offset_of!(SvcValue, backend_id), core::mem::offset_of!(SvcValue, count), core::mem::offset_of!(SvcValue, rev_nat_id), core::mem::offset_of!(SvcValue, flags), core::mem::offset_of!(SvcValue, _pad), core::mem::offset_of!(SvcValue, affinity_timeout)]),
            ("Backend4", core::mem::size_of::<Backend4>(), &[core::mem::offset_of!(Backend4, addr), core::mem::offset_of!(Backend4, port), core::mem::offset_of!(Backend4, proto), core::mem::offset_of!(Backend4, flags)]),
            ("Backend6", core::mem::size_of::<Backend6>(), &[core::mem::offset_of!(Backend6, addr), core::mem::offset_of!(Backend6, port), core::mem::offset_of!(Backend6, proto), core::mem::offset_of!(Backend6, flags)]),
            ("RevNat4", core::mem::size_of::<RevNat4>(), &[core::mem::offset_of!(RevNat4, addr), core::mem::offset_of!(RevNat4, port), core::mem::offset_of!(RevNat4, _pad)]),
            ("RevNat6", core::mem::size_of::<RevNat6>(), &[core::mem::offset_of!(RevNat6, addr), core::mem::offset_of!(RevNat6, port), core::mem::offset_of!(RevNat6, _pad)]),
            ("SockRevNat4Key", core::mem::size_of::<SockRevNat4Key>(), &[core::mem::offset_of!(SockRevNat4Key, cookie), core::mem::offset_of!(SockRevNat4Key, addr), core::mem::offset_of!(SockRevNat4Key, port), core::mem::offset_of!(SockRevNat4Key, _pad)]),
            ("SockRevNat6Key", core::mem::size_of::<SockRevNat6Key>(), &[core::mem::offset_of!(SockRevNat6Key, cookie), core::mem::offset_of!(SockRevNat6Key, addr), core::mem::offset_of!(SockRevNat6Key, port), core::mem::offset_of!(SockRevNat6Key, _pad), core::mem::offset_of!(SockRevNat6Key, _pad2)]),
            ("SockRevNat4Value", core::mem::size_of::<SockRevNat4Value>(), &[core::mem::offset_of!(SockRevNat4Value, addr), core::mem::offset_of!(SockRevNat4Value, port), core::mem::offset_of!(SockRevNat4Value, rev_nat_id)]),
            ("SockRevNat6Value", core::mem::size_of::<SockRevNat6Value>(), &[core::mem::offset_of!(SockRevNat6Value, addr), core::mem::offset_of!(SockRevNat6Value, port), core::mem::offset_of!(SockRevNat6Value, rev_nat_id)]),
            ("SockXlate", core::mem::size_of::<SockXlate>(), &[core::mem::offset_of!(SockXlate, front), core::mem::offset_of!(SockXlate, backend), core::mem::offset_of!(SockXlate, front_port), core::mem::offset_of!(SockXlate, backend_port), core::mem::offset_of!(SockXlate, rev_nat_id), core::mem::offset_of!(SockXlate, family), core::mem::offset_of!(SockXlate, _pad)]),
            ("SvcStatsKey", core::mem::size_of::<SvcStatsKey>(), &[core::mem::offset_of!(SvcStatsKey, id), core::mem::offset_of!(SvcStatsKey, kind), core::mem::offset_of!(SvcStatsKey, family), core::mem::offset_of!(SvcStatsKey, _pad)]),
            ("SvcStats", core::mem::size_of::<SvcStats>(), &[core::mem::offset_of!(SvcStats, conns), core::mem::offset_of!(SvcStats, refused), core::mem::offset_of!(SvcStats, unreachable), core::mem::offset_of!(SvcStats, packets), core::mem::offset_of!(SvcStats, bytes), core::mem::offset_of!(SvcStats, source_range)]),
            ("AffinityKey", core::mem::size_of::<AffinityKey>(), &[core::mem::offset_of!(AffinityKey, netns_cookie), core::mem::offset_of!(AffinityKey, client), core::mem::offset_of!(AffinityKey, rev_nat_id), core::mem::offset_of!(AffinityKey, family), core::mem::offset_of!(AffinityKey, proto), core::mem::offset_of!(AffinityKey, _pad)]),
            ("AffinityValue", core::mem::size_of::<AffinityValue>(), &[core::mem::offset_of!(AffinityValue, last_used_ns), core::mem::offset_of!(AffinityValue, backend_id), core::mem::offset_of!(AffinityValue, _pad)]),
            ("AffinityMatchKey", core::mem::size_of::<AffinityMatchKey>(), &[core::mem::offset_of!(AffinityMatchKey, backend_id), core::mem::offset_of!(AffinityMatchKey, rev_nat_id), core::mem::offset_of!(AffinityMatchKey, family), core::mem::offset_of!(AffinityMatchKey, _pad)]),
            ("Nat4Key", core::mem::size_of::<Nat4Key>(), &[core::mem::offset_of!(Nat4Key, saddr), core::mem::offset_of!(Nat4Key, daddr), core::mem::offset_of!(Nat4Key, sport), core::mem::offset_of!(Nat4Key, dport), core::mem::offset_of!(Nat4Key, proto), core::mem::offset_of!(Nat4Key, _pad)]),
            ("Nat6Key", core::mem::size_of::<Nat6Key>(), &[core::mem::offset_of!(Nat6Key, saddr), core::mem::offset_of!(Nat6Key, daddr), core::mem::offset_of!(Nat6Key, sport), core::mem::offset_of!(Nat6Key, dport), core::mem::offset_of!(Nat6Key, proto), core::mem::offset_of!(Nat6Key, _pad)]),
            ("Nat4Entry", core::mem::size_of::<Nat4Entry>(), &[core::mem::offset_of!(Nat4Entry, to_saddr), core::mem::offset_of!(Nat4Entry, to_daddr), core::mem::offset_of!(Nat4Entry, to_sport), core::mem::offset_of!(Nat4Entry, to_dport), core::mem::offset_of!(Nat4Entry, flags), core::mem::offset_of!(Nat4Entry, state), core::mem::offset_of!(Nat4Entry, rev_nat_id), core::mem::offset_of!(Nat4Entry, created_ns), core::mem::offset_of!(Nat4Entry, last_seen_ns)]),
            ("Nat6Entry", core::mem::size_of::<Nat6Entry>(), &[core::mem::offset_of!(Nat6Entry, to_saddr), core::mem::offset_of!(Nat6Entry, to_daddr), core::mem::offset_of!(Nat6Entry, to_sport), core::mem::offset_of!(Nat6Entry, to_dport), core::mem::offset_of!(Nat6Entry, flags), core::mem::offset_of!(Nat6Entry, state), core::mem::offset_of!(Nat6Entry, rev_nat_id), core::mem::offset_of!(Nat6Entry, created_ns), core::mem::offset_of!(Nat6Entry, last_seen_ns)]),
            ("SrcRange", core::mem::size_of::<SrcRange>(), &[core::mem::offset_of!(SrcRange, rev_nat_id), core::mem::offset_of!(SrcRange, family), core::mem::offset_of!(SrcRange, _pad), core::mem::offset_of!(SrcRange, addr)]),
            ("NodePortKey", core::mem::size_of::<NodePortKey>(), &[core::mem::offset_of!(NodePortKey, port), core::mem::offset_of!(NodePortKey, proto), core::mem::offset_of!(NodePortKey, _pad)]),
            ("NodeConfig", core::mem::size_of::<NodeConfig>(), &[core::mem::offset_of!(NodeConfig, netns_cookie), core::mem::offset_of!(NodeConfig, snat_addr), core::mem::offset_of!(NodeConfig, snat_port_min), core::mem::offset_of!(NodeConfig, snat_port_max), core::mem::offset_of!(NodeConfig, snat_addr6), core::mem::offset_of!(NodeConfig, flags), core::mem::offset_of!(NodeConfig, maglev_size)]),
            ("MaglevKey", core::mem::size_of::<MaglevKey>(), &[core::mem::offset_of!(MaglevKey, rev_nat_id), core::mem::offset_of!(MaglevKey, proto), core::mem::offset_of!(MaglevKey, scope)]),
            ("FragKey", core::mem::size_of::<FragKey>(), &[core::mem::offset_of!(FragKey, saddr), core::mem::offset_of!(FragKey, daddr), core::mem::offset_of!(FragKey, id), core::mem::offset_of!(FragKey, proto), core::mem::offset_of!(FragKey, _pad)]),
            ("Frag6Key", core::mem::size_of::<Frag6Key>(), &[core::mem::offset_of!(Frag6Key, saddr), core::mem::offset_of!(Frag6Key, daddr), core::mem::offset_of!(Frag6Key, id), core::mem::offset_of!(Frag6Key, proto), core::mem::offset_of!(Frag6Key, _pad)]),
            ("FragPorts", core::mem::size_of::<FragPorts>(), &[core::mem::offset_of!(FragPorts, sport), core::mem::offset_of!(FragPorts, dport)]),
            ("NatGc", core::mem::size_of::<NatGc>(), &[core::mem::offset_of!(NatGc, heartbeat_ns), core::mem::offset_of!(NatGc, stale_ns), core::mem::offset_of!(NatGc, interval_ns), core::mem::offset_of!(NatGc, capacity), core::mem::offset_of!(NatGc, timeouts)]),
            ("NatTimeouts", core::mem::size_of::<NatTimeouts>(), &[core::mem::offset_of!(NatTimeouts, tcp_ns), core::mem::offset_of!(NatTimeouts, tcp_closed_ns), core::mem::offset_of!(NatTimeouts, dsr_fin_ns), core::mem::offset_of!(NatTimeouts, udp_ns), core::mem::offset_of!(NatTimeouts, unreplied_ns)]),
            ("NatTimer", core::mem::size_of::<NatTimer>(), &[core::mem::offset_of!(NatTimer, timer), core::mem::offset_of!(NatTimer, last_walk_ns), core::mem::offset_of!(NatTimer, last_walk_took_ns), core::mem::offset_of!(NatTimer, refused), core::mem::offset_of!(NatTimer, refused_seen), core::mem::offset_of!(NatTimer, pressure), core::mem::offset_of!(NatTimer, last_look_ns), core::mem::offset_of!(NatTimer, v6_next), core::mem::offset_of!(NatTimer, refused6), core::mem::offset_of!(NatTimer, refused6_seen), core::mem::offset_of!(NatTimer, round_ns), core::mem::offset_of!(NatTimer, last_table)]),
        ];
        // FNV-1a over names, sizes and offsets.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |b: &[u8]| {
            for x in b {
                h ^= *x as u64;
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        };
        for (name, size, offsets) in layouts {
            eat(name.as_bytes());
            eat(&size.to_le_bytes());
            for o in *offsets {
                eat(&o.to_le_bytes());
            }
        }
        assert_eq!((LAYOUT_VERSION, h), (5, FINGERPRINT), "the pinned layout changed: bump LAYOUT_VERSION (unless only sizes changed, or the BTF of the maps shows the change) and set FINGERPRINT to {h:#x}");
    }

    const FINGERPRINT: u64 = 0x66fa_ce24_0737_5670;
}
