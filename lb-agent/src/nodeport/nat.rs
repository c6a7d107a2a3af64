//! The NAT table's expiry: idle and closed flows go, flows whose backend
//! left end (UDP removed, TCP marked for a RST).
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use aya::maps::{HashMap, MapData};
use lb_common::{NatEntry, NatKey, PROTO_UDP, nat_flags, nat_state};

use crate::dataplane::writer::Addr;
use crate::model::Pair;

/// How long NAT entries live.
#[derive(Clone, Copy, Debug)]
pub struct NatTimeouts {
    /// An established TCP flow without packets.
    pub tcp: Duration,
    /// A TCP flow after FIN in both directions or a RST.
    pub tcp_closed: Duration,
    /// A UDP flow without packets.
    pub udp: Duration,
    /// A flow that was never answered (a SYN flood, a dead backend).
    pub unreplied: Duration,
}

/// Whether a flow (its original-direction entry and its reply entry, when
/// there is one) has expired at `now_ns` (CLOCK_MONOTONIC, as bpf_ktime_get_ns).
pub fn expired<A>(proto: u8, fwd: &NatEntry<A>, reply: Option<&NatEntry<A>>, now_ns: u64, t: &NatTimeouts) -> bool {
    let last = reply.map_or(fwd.last_seen_ns, |r| r.last_seen_ns.max(fwd.last_seen_ns));
    let idle = Duration::from_nanos(now_ns.saturating_sub(last));
    // Assured, in conntrack's words: answered, and for TCP the client went
    // on after its SYN (the handshake's ACK). A SYN flood from spoofed
    // addresses, answered by the backend, never gets there and expires
    // like an unanswered one.
    let replied = reply.is_some_and(|r| r.state & nat_state::SEEN != 0) && (proto == PROTO_UDP || fwd.state & nat_state::SEEN != 0);
    let mut timeout = if proto == PROTO_UDP {
        t.udp
    } else {
        let rst = fwd.state & nat_state::RST != 0 || reply.is_some_and(|r| r.state & nat_state::RST != 0);
        let fin_both = fwd.state & nat_state::FIN != 0 && reply.is_some_and(|r| r.state & nat_state::FIN != 0);
        if rst || fin_both { t.tcp_closed } else { t.tcp }
    };
    if !replied {
        timeout = timeout.min(t.unreplied);
    }
    idle > timeout
}

/// Whether a DSR flow's one entry on this node has expired. The frontend's
/// node sees only the client's packets: SEEN (the client went on after its
/// SYN, so it was answered) assures the flow. The backend's node marks its
/// reply entry SEEN only from the backend's packets; the client's refresh
/// it (and note FIN / RST) but cannot assure it.
pub fn expired_dsr<A>(proto: u8, e: &NatEntry<A>, now_ns: u64, t: &NatTimeouts) -> bool {
    let idle = Duration::from_nanos(now_ns.saturating_sub(e.last_seen_ns));
    let mut timeout = if proto == PROTO_UDP {
        t.udp
    } else if e.state & (nat_state::RST | nat_state::FIN) != 0 {
        t.tcp_closed
    } else {
        t.tcp
    };
    if e.state & nat_state::SEEN == 0 {
        timeout = timeout.min(t.unreplied);
    }
    idle > timeout
}

pub fn monotonic_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC");
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

/// bpf(2)'s BPF_EXIST: update only an element that exists.
const BPF_EXIST: u64 = 2;

/// What one pass over a NAT table did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NatPass {
    /// Flows removed because they expired.
    pub expired: usize,
    /// UDP flows to a backend that left, removed (the next datagram picks
    /// a live backend).
    pub flushed: usize,
    /// TCP flows to a backend that left, marked STALE (the next packet
    /// gets a RST).
    pub marked: usize,
}

/// One pass over a NAT table: expire flows (both entries of each), and end
/// flows to the (frontend, backend) pairs in `left`.
pub fn nat_pass<A: Addr>(nat: &mut HashMap<MapData, NatKey<A>, NatEntry<A>>, t: &NatTimeouts, left: &BTreeSet<Pair>) -> NatPass
where
    NatKey<A>: aya::Pod,
    NatEntry<A>: aya::Pod,
{
    let now = monotonic_ns();
    // In batches: at capacity this is half a million entries.
    let entries: BTreeMap<NatKey<A>, NatEntry<A>> = match crate::dataplane::maps::lookup_all(aya::maps::IterableMap::map(nat)) {
        Ok(all) => all.into_iter().collect(),
        Err(e) => {
            tracing::debug!("NAT batch lookup: {e}; iterating");
            nat.iter().filter_map(|r| r.ok()).collect()
        }
    };
    let mut pass = NatPass::default();
    for (k, e) in &entries {
        // A DSR flow has one entry per node: the client's on the frontend's
        // node, the reply entry on the backend's.
        let dsr = e.flags & nat_flags::DSR != 0;
        if e.flags & nat_flags::REPLY != 0 {
            // An orphaned reply entry (its flow half-removed) or a DSR one:
            // no packet can use it once idle.
            let gone = if dsr { expired_dsr(k.proto, e, now, t) } else { !entries.contains_key(&e.other_key(k.proto)) && expired(k.proto, e, None, now, t) };
            if gone {
                let _ = nat.remove(k);
                pass.expired += dsr as usize;
            }
            continue;
        }
        let rk = (!dsr).then(|| e.other_key(k.proto));
        let gone = match &rk {
            Some(rk) => expired(k.proto, e, entries.get(rk), now, t),
            None => expired_dsr(k.proto, e, now, t),
        };
        if gone {
            // The reply entry first: a packet never finds a forward entry
            // without its reply entry.
            if let Some(rk) = &rk {
                let _ = nat.remove(rk);
            }
            let _ = nat.remove(k);
            pass.expired += 1;
            continue;
        }
        if !left.is_empty() && left.contains(&(k.daddr.to_ip(), k.dport, e.to_daddr.to_ip(), e.to_dport)) {
            if k.proto == PROTO_UDP {
                if let Some(rk) = &rk {
                    let _ = nat.remove(rk);
                }
                let _ = nat.remove(k);
                pass.flushed += 1;
            } else if e.state & nat_state::STALE == 0 {
                let mut marked = *e;
                marked.state |= nat_state::STALE;
                // Only if the flow is still there (BPF_EXIST): never revive it.
                if nat.insert(k, marked, BPF_EXIST).is_ok() {
                    pass.marked += 1;
                }
            }
        }
    }
    pass
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::PROTO_TCP;

    const T: NatTimeouts = NatTimeouts {
        tcp: Duration::from_secs(100),
        tcp_closed: Duration::from_secs(10),
        udp: Duration::from_secs(30),
        unreplied: Duration::from_secs(60),
    };
    const S: u64 = 1_000_000_000;
    const SEEN: u8 = nat_state::SEEN;

    fn entry(last: u64, state: u8) -> NatEntry<[u8; 4]> {
        NatEntry { last_seen_ns: last * S, state, ..Default::default() }
    }

    #[test]
    fn expiry_rules() {
        // UDP: idle timeout.
        assert!(!expired(PROTO_UDP, &entry(100, 0), Some(&entry(100, SEEN)), 129 * S, &T));
        assert!(expired(PROTO_UDP, &entry(100, 0), Some(&entry(100, SEEN)), 131 * S, &T));
        // The newest of both directions counts.
        assert!(!expired(PROTO_UDP, &entry(10, 0), Some(&entry(100, SEEN)), 129 * S, &T));
        // TCP open: the long timeout; FIN one way only is still open.
        assert!(!expired(PROTO_TCP, &entry(100, SEEN | nat_state::FIN), Some(&entry(100, SEEN)), 150 * S, &T));
        assert!(expired(PROTO_TCP, &entry(100, SEEN), Some(&entry(100, SEEN)), 201 * S, &T));
        // FIN both ways, or a RST: the close grace period.
        assert!(expired(PROTO_TCP, &entry(100, nat_state::FIN), Some(&entry(100, SEEN | nat_state::FIN)), 111 * S, &T));
        assert!(!expired(PROTO_TCP, &entry(100, nat_state::FIN), Some(&entry(100, SEEN | nat_state::FIN)), 109 * S, &T));
        assert!(expired(PROTO_TCP, &entry(100, 0), Some(&entry(100, SEEN | nat_state::RST)), 111 * S, &T));
    }

    #[test]
    fn unreplied_flows_expire_after_the_unreplied_timeout() {
        // A SYN that was never answered: gone after 60 s, not 100.
        assert!(!expired(PROTO_TCP, &entry(100, 0), Some(&entry(100, 0)), 159 * S, &T));
        assert!(expired(PROTO_TCP, &entry(100, 0), Some(&entry(100, 0)), 161 * S, &T));
        // Answered, and the client went on: the established timeout.
        assert!(!expired(PROTO_TCP, &entry(100, SEEN), Some(&entry(100, SEEN)), 161 * S, &T));
        // Answered, but the client never sent its ACK (a spoofed SYN): unreplied.
        assert!(expired(PROTO_TCP, &entry(100, 0), Some(&entry(100, SEEN)), 161 * S, &T));
        // UDP: an answer is enough.
        assert!(!expired(PROTO_UDP, &entry(100, 0), Some(&entry(100, SEEN)), 129 * S, &T));
        // Never shorter than the UDP timeout when that is shorter.
        assert!(expired(PROTO_UDP, &entry(100, 0), Some(&entry(100, 0)), 131 * S, &T));
        // A forward entry whose reply entry is gone counts as unreplied.
        assert!(expired(PROTO_TCP, &entry(100, 0), None, 161 * S, &T));
    }

    #[test]
    fn dsr_entries_expire_on_their_own_state() {
        let dsr = |last: u64, state: u8| NatEntry { flags: nat_flags::DSR, ..entry(last, state) };
        // Never assured (a SYN only, or spoofed options): the unreplied timeout.
        assert!(!expired_dsr(PROTO_TCP, &dsr(100, 0), 159 * S, &T));
        assert!(expired_dsr(PROTO_TCP, &dsr(100, 0), 161 * S, &T));
        // Assured: the TCP timeout; FIN or RST: the close timeout.
        assert!(!expired_dsr(PROTO_TCP, &dsr(100, SEEN), 161 * S, &T));
        assert!(expired_dsr(PROTO_TCP, &dsr(100, SEEN | nat_state::FIN), 111 * S, &T));
        assert!(!expired_dsr(PROTO_TCP, &dsr(100, SEEN | nat_state::RST), 109 * S, &T));
        assert!(expired_dsr(PROTO_UDP, &dsr(100, SEEN), 131 * S, &T));
    }

    #[test]
    fn other_key_swaps_the_rewritten_tuple() {
        let k = NatKey { saddr: [1u8, 1, 1, 1], daddr: [2, 2, 2, 2], sport: 1000, dport: 30080, proto: 6, _pad: [0; 3] };
        let e = NatEntry { to_saddr: [3, 3, 3, 3], to_daddr: [4, 4, 4, 4], to_sport: 61000, to_dport: 8080, ..Default::default() };
        let r = e.other_key(k.proto);
        assert_eq!((r.saddr, r.daddr, r.sport, r.dport, r.proto), ([4, 4, 4, 4], [3, 3, 3, 3], 8080, 61000, 6));
    }
}
