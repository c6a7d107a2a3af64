//! The NAT table's expiry: idle and closed flows go, flows whose backend
//! left end (UDP removed, TCP marked for a RST).
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use aya::maps::{HashMap, MapData};
use lb_common::{NatEntry, NatKey, PROTO_UDP, nat_flags, nat_state};

use crate::dataplane::writer::Addr;
use crate::model::{Pair, Proto};
use crate::stale::kept::Census;

/// Which flows a pass ends, by their (frontend, backend) pair.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Ending {
    /// None: a pass of expiry only.
    #[default]
    Nothing,
    /// The pairs a sync saw leave (endpoints gone or no longer serving).
    Left(BTreeSet<Pair>),
    /// After a full sync: every pair of these frontends that is not among
    /// the serving ones, so that endpoints that went while no agent
    /// watched (a restart, an upgrade) end their flows too. Flows to an
    /// address no frontend has are left to expire. TCP flows only with a
    /// census of the kept pairs (their flows kept too, and reported:
    /// `Reconciler::sweep`).
    Sweep { fronts: BTreeSet<(std::net::IpAddr, u16)>, alive: BTreeSet<Pair>, census: Option<Census> },
}

impl Ending {
    fn ends(&self, p: &Pair) -> bool {
        match self {
            Ending::Nothing => false,
            Ending::Left(left) => left.contains(p),
            // A frontend at the flow's address and port, of either
            // protocol (one whose protocol went ends its flows).
            Ending::Sweep { fronts, alive, census } => {
                let judged = match census {
                    Some(c) => !c.pairs.contains(p),
                    None => p.2 == Proto::Udp,
                };
                judged && fronts.contains(&(p.0, p.1)) && !alive.contains(p)
            }
        }
    }

    /// The kept pairs of a sweep's census that flows in `entries` (live at
    /// `now`) still use.
    fn kept_in_use<A: Addr>(&self, entries: &BTreeMap<NatKey<A>, NatEntry<A>>, now: u64, t: &NatTimeouts) -> BTreeSet<Pair> {
        let Ending::Sweep { census: Some(c), .. } = self else { return BTreeSet::new() };
        entries
            .iter()
            .filter(|(k, e)| e.flags & nat_flags::REPLY == 0 && c.pairs.contains(&pair_of(k, e)))
            .filter(|(k, e)| {
                let reply = if e.flags & nat_flags::DSR != 0 { None } else { partner(k, e, |ok| entries.get(ok).copied()) };
                !flow_gone(k, e, reply.as_ref(), now, t)
            })
            .map(|(k, e)| pair_of(k, e))
            .collect()
    }
}

/// The (frontend, backend) pair of a flow's original-direction entry.
fn pair_of<A: Addr>(k: &NatKey<A>, e: &NatEntry<A>) -> Pair {
    let proto = if k.proto == PROTO_UDP { Proto::Udp } else { Proto::Tcp };
    (k.daddr.to_ip(), k.dport, proto, e.to_daddr.to_ip(), e.to_dport)
}

/// How long NAT entries live.
#[derive(Clone, Copy, Debug)]
pub struct NatTimeouts {
    /// An established TCP flow without packets.
    pub tcp: Duration,
    /// A TCP flow after FIN in both directions or a RST.
    pub tcp_closed: Duration,
    /// A DSR flow on its frontend's node after the client's FIN (the
    /// backend's FIN never passes there).
    pub dsr_fin: Duration,
    /// A UDP flow without packets.
    pub udp: Duration,
    /// A flow that was never answered (a SYN flood, a dead backend).
    pub unreplied: Duration,
}

impl NatTimeouts {
    /// In nanoseconds, as the rules (`lb_common::nat_expired`) and the
    /// kernel's own expiry (`NatGc`) take them.
    pub fn ns(&self) -> lb_common::NatTimeouts {
        let ns = |d: Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        lb_common::NatTimeouts {
            tcp_ns: ns(self.tcp),
            tcp_closed_ns: ns(self.tcp_closed),
            dsr_fin_ns: ns(self.dsr_fin),
            udp_ns: ns(self.udp),
            unreplied_ns: ns(self.unreplied),
        }
    }
}

/// Whether a flow has expired at `now_ns` (CLOCK_MONOTONIC, as
/// bpf_ktime_get_ns): `lb_common::nat_expired`, the rules the kernel's own
/// expiry applies while no agent runs.
pub fn expired<A>(proto: u8, fwd: &NatEntry<A>, reply: Option<&NatEntry<A>>, now_ns: u64, t: &NatTimeouts) -> bool {
    lb_common::nat_expired(proto, fwd, reply, now_ns, &t.ns())
}

/// Whether a DSR flow's one entry on this node has expired:
/// `lb_common::nat_expired_dsr`.
pub fn expired_dsr<A>(proto: u8, e: &NatEntry<A>, now_ns: u64, t: &NatTimeouts) -> bool {
    lb_common::nat_expired_dsr(proto, e, now_ns, &t.ns())
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
    /// Flows masqueraded in BPF (`bpf_masqueraded`) the table held.
    pub bpf_masqueraded: usize,
    /// Entries the table held before the pass.
    pub entries: usize,
    /// The kept pairs of the sweep's census (`Ending::Sweep`) that live
    /// flows use.
    pub kept_used: BTreeSet<Pair>,
}

/// How many flows in `entries` are masqueraded in BPF to a backend on this
/// node (`nat_flags::LOCAL`, counted by their reply entries): the pod
/// programs translate their replies, so they stay attached while any
/// lives, also under an agent without `--bpf-forward`.
pub fn bpf_masqueraded<'a, A: Addr + 'a>(entries: impl IntoIterator<Item = &'a NatEntry<A>>) -> usize {
    entries.into_iter().filter(|e| e.flags & nat_flags::REPLY != 0 && nat_flags::masqueraded_in_bpf(e.flags)).count()
}

/// What a pass does to one flow, decided from a snapshot of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step<A> {
    /// A reply entry without its forward entry, or a DSR entry, idle.
    RemoveLone(NatKey<A>),
    /// An expired flow: its reply entry, then its forward entry.
    Expire(NatKey<A>),
    /// A UDP flow to a backend that left: removed. `created_ns` names the flow.
    Flush(NatKey<A>, u64),
    /// A TCP flow to a backend that left: marked STALE.
    MarkStale(NatKey<A>, u64),
}

/// The steps of a pass, from a snapshot of the table: expire flows (both
/// entries of each), and end flows to the (frontend, backend) pairs
/// `ending` names. Pure: `apply` checks each step against the table as it
/// is then.
pub fn plan<A: Addr>(entries: &BTreeMap<NatKey<A>, NatEntry<A>>, now: u64, t: &NatTimeouts, ending: &Ending) -> Vec<Step<A>> {
    let mut steps = Vec::new();
    for (k, e) in entries {
        // A DSR flow has one entry per node: the client's on the frontend's
        // node, the reply entry on the backend's.
        let dsr = e.flags & nat_flags::DSR != 0;
        if e.flags & nat_flags::REPLY != 0 {
            // An orphaned reply entry (its flow half-removed) or a DSR one:
            // no packet can use it once idle.
            if lone_gone(k, e, partner(k, e, |ok| entries.get(ok).copied()).is_some(), now, t) {
                steps.push(Step::RemoveLone(*k));
            }
            continue;
        }
        let reply = if dsr { None } else { partner(k, e, |ok| entries.get(ok).copied()) };
        if flow_gone(k, e, reply.as_ref(), now, t) {
            steps.push(Step::Expire(*k));
            continue;
        }
        if ending.ends(&pair_of(k, e)) {
            if k.proto == PROTO_UDP {
                steps.push(Step::Flush(*k, e.created_ns));
            } else if e.state & nat_state::STALE == 0 {
                steps.push(Step::MarkStale(*k, e.created_ns));
            }
        }
    }
    steps
}

/// The other half of the flow whose entry `e` is at `k`, looked up with
/// `get`: the entry at `e`'s other key if its rewrite leads back to `k`. A
/// key that lost its half can be taken by a new flow (a SNAT port freed
/// and claimed again): that entry is not this flow's.
fn partner<A: Addr>(k: &NatKey<A>, e: &NatEntry<A>, get: impl FnOnce(&NatKey<A>) -> Option<NatEntry<A>>) -> Option<NatEntry<A>> {
    get(&e.other_key(k.proto)).filter(|o| o.other_key(k.proto) == *k)
}

fn lone_gone<A>(k: &NatKey<A>, e: &NatEntry<A>, has_forward: bool, now: u64, t: &NatTimeouts) -> bool {
    if e.flags & nat_flags::DSR != 0 { expired_dsr(k.proto, e, now, t) } else { !has_forward && expired(k.proto, e, None, now, t) }
}

fn flow_gone<A>(k: &NatKey<A>, fwd: &NatEntry<A>, reply: Option<&NatEntry<A>>, now: u64, t: &NatTimeouts) -> bool {
    if fwd.flags & nat_flags::DSR != 0 { expired_dsr(k.proto, fwd, now, t) } else { expired(k.proto, fwd, reply, now, t) }
}

type NatMap<A> = HashMap<MapData, NatKey<A>, NatEntry<A>>;

/// Carry out `steps` on the table, each only if it still holds for the
/// entries as they are now. Between the snapshot and a step, the datapath
/// may have gone on with a flow, or replaced a closed one by a new flow
/// under the same keys (a client that reuses its port after a RST gets the
/// same forward key, and often the same backend and SNAT port: the same
/// reply key); removing those entries would cut a live connection. (What
/// is left is the microseconds between this re-read and the delete, not
/// the seconds a pass over the whole table takes.)
pub fn apply<A: Addr>(nat: &mut NatMap<A>, steps: &[Step<A>], now: u64, t: &NatTimeouts) -> NatPass
where
    NatKey<A>: aya::Pod,
    NatEntry<A>: aya::Pod,
{
    let mut pass = NatPass::default();
    for step in steps {
        match *step {
            Step::RemoveLone(k) => {
                let Ok(e) = nat.get(&k, 0) else { continue };
                let dsr = e.flags & nat_flags::DSR != 0;
                let has_forward = !dsr && partner(&k, &e, |ok| nat.get(ok, 0).ok()).is_some();
                if e.flags & nat_flags::REPLY != 0 && lone_gone(&k, &e, has_forward, now, t) {
                    let _ = nat.remove(&k);
                    pass.expired += dsr as usize;
                }
            }
            Step::Expire(k) => {
                let Ok(fwd) = nat.get(&k, 0) else { continue };
                let reply = if fwd.flags & nat_flags::DSR == 0 { partner(&k, &fwd, |ok| nat.get(ok, 0).ok()) } else { None };
                if fwd.flags & nat_flags::REPLY != 0 || !flow_gone(&k, &fwd, reply.as_ref(), now, t) {
                    continue;
                }
                // The reply entry first: a packet never finds a forward
                // entry without its reply entry.
                if reply.is_some() {
                    let _ = nat.remove(&fwd.other_key(k.proto));
                }
                let _ = nat.remove(&k);
                pass.expired += 1;
            }
            Step::Flush(k, created) => {
                let Ok(fwd) = nat.get(&k, 0) else { continue };
                if fwd.created_ns != created {
                    continue;
                }
                if partner(&k, &fwd, |ok| nat.get(ok, 0).ok()).is_some() {
                    let _ = nat.remove(&fwd.other_key(k.proto));
                }
                let _ = nat.remove(&k);
                pass.flushed += 1;
            }
            Step::MarkStale(k, created) => {
                let Ok(mut fwd) = nat.get(&k, 0) else { continue };
                if fwd.created_ns != created {
                    continue;
                }
                fwd.state |= nat_state::STALE;
                // Only if the flow is still there (BPF_EXIST): never revive it.
                if nat.insert(k, fwd, BPF_EXIST).is_ok() {
                    pass.marked += 1;
                }
            }
        }
    }
    pass
}

/// How many DSR flows in `entries` have their backend on this node (the
/// reply entries the backend's node records): a client pod on this node
/// gets their replies through the egress pod program.
pub fn dsr_replies<'a, A: Addr + 'a>(entries: impl IntoIterator<Item = &'a NatEntry<A>>) -> usize {
    let both = nat_flags::REPLY | nat_flags::DSR;
    entries.into_iter().filter(|e| e.flags & both == both).count()
}

/// `bpf_masqueraded` and `dsr_replies` of a whole table, read now.
pub fn count_at_start<A: Addr>(nat: &NatMap<A>) -> (usize, usize)
where
    NatKey<A>: aya::Pod,
    NatEntry<A>: aya::Pod,
{
    let all = snapshot(nat);
    (bpf_masqueraded(all.values()), dsr_replies(all.values()))
}

/// The whole table, read now (in batches: at capacity this is half a
/// million entries; one by one where batches are not supported).
fn snapshot<A: Addr>(nat: &NatMap<A>) -> BTreeMap<NatKey<A>, NatEntry<A>>
where
    NatKey<A>: aya::Pod,
    NatEntry<A>: aya::Pod,
{
    match crate::dataplane::maps::lookup_all(aya::maps::IterableMap::map(nat)) {
        Ok(all) => all.into_iter().collect(),
        Err(e) => {
            tracing::debug!("NAT batch lookup: {e}; iterating");
            nat.iter().filter_map(|r| r.ok()).collect()
        }
    }
}

/// One pass over a NAT table: `plan` from a snapshot, then `apply`.
pub fn nat_pass<A: Addr>(nat: &mut NatMap<A>, t: &NatTimeouts, ending: &Ending) -> NatPass
where
    NatKey<A>: aya::Pod,
    NatEntry<A>: aya::Pod,
{
    let now = monotonic_ns();
    let entries = snapshot(nat);
    let steps = plan(&entries, now, t, ending);
    let mut pass = apply(nat, &steps, now, t);
    pass.bpf_masqueraded = bpf_masqueraded(entries.values());
    pass.entries = entries.len();
    pass.kept_used = ending.kept_in_use(&entries, now, t);
    pass
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::PROTO_TCP;

    const T: NatTimeouts = NatTimeouts {
        tcp: Duration::from_secs(100),
        tcp_closed: Duration::from_secs(10),
        dsr_fin: Duration::from_secs(40),
        udp: Duration::from_secs(30),
        unreplied: Duration::from_secs(60),
    };
    const S: u64 = 1_000_000_000;
    const SEEN: u8 = nat_state::SEEN;

    fn entry(last: u64, state: u8) -> NatEntry<[u8; 4]> {
        NatEntry { last_seen_ns: last * S, state, ..Default::default() }
    }

    #[test]
    fn dsr_flows_whose_backend_is_on_this_node_are_counted_by_their_reply_entries() {
        let f = |flags: u8| NatEntry { flags, ..entry(1, 0) };
        let (r, d, s) = (nat_flags::REPLY, nat_flags::DSR, nat_flags::SNAT);
        // The backend's node's entry; the frontend's node's (no reply
        // entry there); a SNATed flow's two.
        assert_eq!(dsr_replies([f(r | d), f(d), f(s), f(r | s)].iter()), 1);
        assert_eq!(dsr_replies([f(d), f(r)].iter()), 0);
    }

    #[test]
    fn flows_masqueraded_in_bpf_are_counted_by_their_reply_entries() {
        let f = |flags: u8| NatEntry { flags, ..entry(1, 0) };
        let (r, s, l, m) = (nat_flags::REPLY, nat_flags::SNAT, nat_flags::LOCAL, nat_flags::MASQ);
        // One such flow (both entries), a SNATed one to another node, one
        // the stack masquerades, one that kept the client's address.
        let all = [f(s | l), f(r | s | l), f(s), f(r | s), f(m), f(r), f(0), f(r)];
        assert_eq!(bpf_masqueraded(all.iter()), 1);
        assert_eq!(bpf_masqueraded(all[2..].iter()), 0);
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
        assert!(!expired_dsr(PROTO_TCP, &dsr(100, SEEN | nat_state::RST), 109 * S, &T));
        assert!(expired_dsr(PROTO_TCP, &dsr(100, SEEN | nat_state::RST), 111 * S, &T));
        assert!(expired_dsr(PROTO_UDP, &dsr(100, SEEN), 131 * S, &T));
        // The frontend's node: after the client's FIN the backend may still
        // send (half closed), for dsr_fin idle.
        assert!(!expired_dsr(PROTO_TCP, &dsr(100, SEEN | nat_state::FIN), 139 * S, &T));
        assert!(expired_dsr(PROTO_TCP, &dsr(100, SEEN | nat_state::FIN), 141 * S, &T));
        // The backend's node sees both ways: one FIN (either way) is half
        // closed, established as without DSR; both are closed.
        let reply = |last: u64, state: u8| NatEntry { flags: nat_flags::DSR | nat_flags::REPLY, ..entry(last, state) };
        for one in [nat_state::FIN, nat_state::FIN_REPLY] {
            assert!(!expired_dsr(PROTO_TCP, &reply(100, SEEN | one), 199 * S, &T), "{one}");
            assert!(expired_dsr(PROTO_TCP, &reply(100, SEEN | one), 201 * S, &T), "{one}");
        }
        let both = SEEN | nat_state::FIN | nat_state::FIN_REPLY;
        assert!(!expired_dsr(PROTO_TCP, &reply(100, both), 109 * S, &T));
        assert!(expired_dsr(PROTO_TCP, &reply(100, both), 111 * S, &T));
        assert!(expired_dsr(PROTO_TCP, &reply(100, SEEN | nat_state::RST), 111 * S, &T));
    }

    /// A SNATed TCP flow from 1.1.1.1:1000 to 2.2.2.2:30080, sent to
    /// 4.4.4.4:8080 from 3.3.3.3:61000: (forward key, forward entry, reply
    /// key, reply entry).
    type K = NatKey<[u8; 4]>;
    type E = NatEntry<[u8; 4]>;

    fn flow(created: u64, last: u64, state: u8) -> (K, E, K, E) {
        let k = NatKey { saddr: [1, 1, 1, 1], daddr: [2, 2, 2, 2], sport: 1000, dport: 30080, proto: PROTO_TCP, _pad: [0; 3] };
        let e = NatEntry {
            to_saddr: [3, 3, 3, 3],
            to_daddr: [4, 4, 4, 4],
            to_sport: 61000,
            to_dport: 8080,
            flags: nat_flags::SNAT,
            state,
            created_ns: created * S,
            last_seen_ns: last * S,
            ..Default::default()
        };
        let rk = e.other_key(PROTO_TCP);
        let r = NatEntry {
            to_saddr: k.daddr,
            to_daddr: k.saddr,
            to_sport: k.dport,
            to_dport: k.sport,
            flags: nat_flags::REPLY | nat_flags::SNAT,
            ..e
        };
        (k, e, rk, r)
    }

    /// A real kernel NAT table holding `entries` (needs root).
    fn table(entries: &[(K, E)]) -> NatMap<[u8; 4]> {
        let data = crate::dataplane::maps::test_hash_map(
            std::mem::size_of::<NatKey<[u8; 4]>>() as u32,
            std::mem::size_of::<NatEntry<[u8; 4]>>() as u32,
            64,
        );
        let mut m: NatMap<[u8; 4]> = HashMap::try_from(aya::maps::Map::HashMap(data)).unwrap();
        for (k, e) in entries {
            m.insert(k, e, 0).unwrap();
        }
        m
    }

    fn snapshot(m: &NatMap<[u8; 4]>) -> BTreeMap<K, E> {
        m.iter().map(|r| r.unwrap()).collect()
    }

    #[test]
    fn an_expired_flow_goes_with_its_reply_entry() {
        let (k, e, rk, r) = flow(100, 100, SEEN | nat_state::RST);
        let mut m = table(&[(k, e), (rk, r)]);
        let steps = plan(&snapshot(&m), 111 * S, &T, &Ending::Nothing);
        assert_eq!(steps, [Step::Expire(k)]);
        assert_eq!(apply(&mut m, &steps, 111 * S, &T), NatPass { expired: 1, ..Default::default() });
        assert!(snapshot(&m).is_empty());
    }

    /// The race a pass used to lose: a client that reuses its port after a
    /// RST replaces its closed flow by a new one under the same keys while
    /// the pass works from its snapshot. The new flow must stay whole.
    #[test]
    fn a_flow_that_replaced_an_expired_one_after_the_snapshot_stays() {
        let (k, e, rk, r) = flow(100, 100, SEEN | nat_state::RST);
        let mut m = table(&[(k, e), (rk, r)]);
        let steps = plan(&snapshot(&m), 111 * S, &T, &Ending::Nothing);
        assert_eq!(steps, [Step::Expire(k)]);
        // The datapath: the SYN of the new flow removes the closed one and
        // sets up its own, same backend, same SNAT port.
        let (k2, e2, rk2, r2) = flow(111, 111, 0);
        assert_eq!((k2, rk2), (k, rk));
        m.insert(k, e2, 0).unwrap();
        m.insert(rk, r2, 0).unwrap();
        assert_eq!(apply(&mut m, &steps, 111 * S, &T), NatPass::default());
        assert_eq!(snapshot(&m), [(k, e2), (rk, r2)].into());
    }

    #[test]
    fn a_flow_that_went_on_after_the_snapshot_stays() {
        let (k, e, rk, r) = flow(100, 100, SEEN);
        let mut m = table(&[(k, e), (rk, r)]);
        let steps = plan(&snapshot(&m), 201 * S, &T, &Ending::Nothing);
        assert_eq!(steps, [Step::Expire(k)]);
        let r_on = NatEntry { last_seen_ns: 200 * S, ..r };
        m.insert(rk, r_on, 0).unwrap();
        assert_eq!(apply(&mut m, &steps, 201 * S, &T), NatPass::default());
        assert_eq!(snapshot(&m).len(), 2);
    }

    #[test]
    fn a_backend_that_left_ends_its_flows_but_not_a_new_flow_with_their_keys() {
        let (k, e, rk, r) = flow(100, 100, SEEN);
        let left = Ending::Left([pair_of(&k, &e)].into());
        // TCP: marked STALE (the next packet gets a RST) ...
        let mut m = table(&[(k, e), (rk, r)]);
        let steps = plan(&snapshot(&m), 101 * S, &T, &left);
        assert_eq!(steps, [Step::MarkStale(k, 100 * S)]);
        assert_eq!(apply(&mut m, &steps, 101 * S, &T).marked, 1);
        assert_ne!(m.get(&k, 0).unwrap().state & nat_state::STALE, 0);
        // ... unless a new flow took its keys meanwhile.
        let mut m = table(&[(k, e), (rk, r)]);
        let steps = plan(&snapshot(&m), 101 * S, &T, &left);
        let (_, e2, _, _) = flow(101, 101, 0);
        m.insert(k, e2, 0).unwrap();
        assert_eq!(apply(&mut m, &steps, 101 * S, &T), NatPass::default());
        assert_eq!(m.get(&k, 0).unwrap(), e2);
        // UDP: removed, with the same care.
        let udp = |mut k: K| {
            k.proto = PROTO_UDP;
            k
        };
        let (ku, rku) = (udp(k), udp(rk));
        let mut m = table(&[(ku, e), (rku, r)]);
        assert_eq!(plan(&snapshot(&m), 101 * S, &T, &left), [], "the pair left in TCP only");
        let left = Ending::Left([pair_of(&ku, &e)].into());
        let steps = plan(&snapshot(&m), 101 * S, &T, &left);
        assert_eq!(steps, [Step::Flush(ku, 100 * S)]);
        assert_eq!(apply(&mut m, &steps, 101 * S, &T).flushed, 1);
        assert!(snapshot(&m).is_empty());
        let mut m = table(&[(ku, e), (rku, r)]);
        let steps = plan(&snapshot(&m), 101 * S, &T, &left);
        m.insert(ku, e2, 0).unwrap();
        assert_eq!(apply(&mut m, &steps, 101 * S, &T), NatPass::default());
        assert_eq!(snapshot(&m).len(), 2);
    }

    /// After a full sync the sweep ends the flows of a frontend to a
    /// backend that no longer serves it (gone while no agent watched), and
    /// keeps those to serving ones and those to addresses no frontend has.
    #[test]
    fn a_sweep_ends_the_flows_to_backends_that_no_longer_serve() {
        let (k, e, rk, r) = flow(100, 100, SEEN);
        let pair = pair_of(&k, &e);
        let m = table(&[(k, e), (rk, r)]);
        let other = (pair.0, pair.1, pair.2, "10.9.9.9".parse().unwrap(), 80);
        let front = (pair.0, pair.1);
        let dir = std::env::temp_dir().join(format!("lb-nat-sweep-{}", std::process::id()));
        let kept = crate::stale::kept::Kept::load(&dir);
        let sweep_of = |fronts: &[(std::net::IpAddr, u16)], alive: &[Pair], tcp: bool| Ending::Sweep {
            fronts: fronts.iter().copied().collect(),
            alive: alive.iter().copied().collect(),
            census: tcp.then(|| kept.census(&[])),
        };
        let sweep = |fronts: &[(std::net::IpAddr, u16)], alive: &[Pair]| sweep_of(fronts, alive, true);
        assert_eq!(pair.2, Proto::Tcp);
        // A later sweep judges UDP only: a watching agent judged each TCP
        // pair as it left (and kept ready endpoints').
        assert_eq!(plan(&snapshot(&m), 101 * S, &T, &sweep_of(&[front], &[other], false)), []);
        assert_eq!(plan(&snapshot(&m), 101 * S, &T, &sweep(&[front], &[other])), [Step::MarkStale(k, 100 * S)]);
        assert_eq!(plan(&snapshot(&m), 101 * S, &T, &sweep(&[front], &[pair, other])), []);
        // The same pair alive in the other protocol only (a draining
        // endpoint that TCP keeps, UDP not) does not keep a flow.
        let udp = (pair.0, pair.1, Proto::Udp, pair.3, pair.4);
        assert_eq!(plan(&snapshot(&m), 101 * S, &T, &sweep(&[front], &[udp])), [Step::MarkStale(k, 100 * S)]);
        assert_eq!(plan(&snapshot(&m), 101 * S, &T, &sweep(&[], &[])), [], "no frontend at its address: left to expire");
        // A pair an earlier agent kept (its endpoint left while ready) is
        // kept by the sweep, and told in use while its flow lives.
        let mut held = crate::stale::kept::Census::of([pair].into());
        let ending = Ending::Sweep { fronts: [front].into(), alive: [other].into(), census: Some(held.clone()) };
        assert_eq!(plan(&snapshot(&m), 101 * S, &T, &ending), []);
        assert_eq!(ending.kept_in_use(&snapshot(&m), 101 * S, &T), [pair].into());
        assert_eq!(ending.kept_in_use(&snapshot(&m), 201 * S, &T), [].into(), "expired: not in use");
        held = crate::stale::kept::Census::of([other].into());
        let ending = Ending::Sweep { fronts: [front].into(), alive: [].into(), census: Some(held) };
        assert_eq!(plan(&snapshot(&m), 101 * S, &T, &ending), [Step::MarkStale(k, 100 * S)]);
        assert_eq!(ending.kept_in_use(&snapshot(&m), 101 * S, &T), [].into());
    }

    /// A flow whose reply key a new flow took (its SNAT port freed and
    /// claimed again): expiring it leaves the new flow's entry alone.
    #[test]
    fn an_expired_flow_leaves_its_reply_key_to_the_flow_that_took_it() {
        let (k, e, rk, _) = flow(100, 100, SEEN | nat_state::RST);
        // Flow X, from client port 2000, got the same backend and SNAT port.
        let (mut kx, mut ex, rkx, mut rx) = flow(150, 150, SEEN);
        kx.sport = 2000;
        ex.last_seen_ns = 170 * S;
        rx.to_dport = 2000;
        assert_eq!(rkx, rk);
        let mut m = table(&[(k, e), (kx, ex), (rk, rx)]);
        let steps = plan(&snapshot(&m), 171 * S, &T, &Ending::Nothing);
        assert_eq!(steps, [Step::Expire(k)], "X is live; the old flow has no reply entry of its own");
        assert_eq!(apply(&mut m, &steps, 171 * S, &T).expired, 1);
        assert_eq!(snapshot(&m), [(kx, ex), (rk, rx)].into());
    }

    #[test]
    fn a_lone_reply_entry_goes_unless_its_flow_came_back() {
        let (k, e, rk, r) = flow(100, 100, SEEN);
        let mut m = table(&[(rk, r)]);
        let steps = plan(&snapshot(&m), 161 * S, &T, &Ending::Nothing);
        assert_eq!(steps, [Step::RemoveLone(rk)]);
        m.insert(k, e, 0).unwrap();
        apply(&mut m, &steps, 161 * S, &T);
        assert_eq!(snapshot(&m).len(), 2, "its forward entry is back: the pair is a flow again");
        m.remove(&k).unwrap();
        apply(&mut m, &steps, 161 * S, &T);
        assert!(snapshot(&m).is_empty());
    }

    #[test]
    fn other_key_swaps_the_rewritten_tuple() {
        let k = NatKey { saddr: [1u8, 1, 1, 1], daddr: [2, 2, 2, 2], sport: 1000, dport: 30080, proto: 6, _pad: [0; 3] };
        let e = NatEntry { to_saddr: [3, 3, 3, 3], to_daddr: [4, 4, 4, 4], to_sport: 61000, to_dport: 8080, ..Default::default() };
        let r = e.other_key(k.proto);
        assert_eq!((r.saddr, r.daddr, r.sport, r.dport, r.proto), ([4, 4, 4, 4], [3, 3, 3, 3], 8080, 61000, 6));
    }
}
