//! ICMP and fragments through the TC path, from outside, on both families:
//! path MTU discovery through a NodePort both ways (the node's own
//! "fragmentation needed" and a router's beyond it), time exceeded, host
//! and port unreachable translated back to the client with the frontend as
//! their source (conntrack's rule), and fragmented IPv4 datagrams arriving
//! whole.
use anyhow::Result;
use lbtest::objects::Endpoint as E;
use lbtest::world::*;
use lbtest::{Cluster, Pod, Summary};

const BYTES: &str = "2000000";

/// Give node-1's routes to both pods an MTU of 1300 (the pods and the
/// outside keep 1500): packets from outside that fit the client's path do
/// not fit the path on to the pod. Locked: bpf_fib_lookup, like the
/// stack's path MTU, honours a route's MTU only when locked (a device's
/// MTU always).
fn narrow_paths_to_pods(w: &World) -> Result<()> {
    let n1 = &w.c.nodes[0].netns;
    for args in [
        vec!["ip", "route", "change", "10.244.2.0/24", "via", "192.168.77.12", "mtu", "lock", "1300"],
        vec!["ip", "-6", "route", "change", "fd00:244:2::/64", "via", "fd00:77::12", "mtu", "lock", "1300"],
        vec!["ip", "route", "add", &w.p1.ip, "dev", "cni0", "mtu", "lock", "1300"],
        vec!["ip", "-6", "route", "add", &w.p1.ip6, "dev", "cni0", "mtu", "lock", "1300"],
    ] {
        w.c.in_netns(n1, &args)?;
    }
    Ok(())
}

fn upload(c: &Cluster, from: &Pod, addr: &str) -> Result<Summary> {
    c.probe(from, &["upload", "--addr", addr, "--bytes", BYTES, "--timeout-ms", "10000"])
}

fn download(c: &Cluster, from: &Pod, addr: &str) -> Result<Summary> {
    c.probe(from, &["bulk", "--addr", addr, "--bytes", BYTES])
}

#[test]
fn path_mtu_discovery_works_through_a_node_port_in_both_directions() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    narrow_paths_to_pods(&w)?;
    // Fresh clients per case: each keeps what it learnt about the path.
    let up_remote = w.c.add_outside("up-remote", 101, &[])?;
    let up_local = w.c.add_outside("up-local", 102, &[])?;
    // Downloads: the clients sit behind a router whose last link has MTU
    // 1300; its "fragmentation needed" goes to the frontend, and must reach
    // the pod that sends.
    let down_remote = w.c.add_outside_via_router("down-remote", 110, 1300, &[])?;
    let down_local = w.c.add_outside_via_router("down-local", 111, 1300, &[])?;
    for (pod, up, down) in [(&w.p2, &up_remote, &down_remote), (&w.p1, &up_local, &down_local)] {
        set_endpoints(&w, &[(pod, E::ready)])?;
        wait_only(&w.c, NODE1, 30080, pod)?;
        wait_only(&w.c, NODE1_6, 30080, pod)?;
        for node in [NODE1, NODE1_6] {
            let addr = hostport(node, 30080);
            // Upload: node-1 forwards to the pod over the narrow path. For
            // pod-2 (SNATed) lb answers "fragmentation needed" itself; for
            // pod-1 the stack's own one is translated on its way out (with
            // --bpf-forward lb masquerades pod-1's flows itself, and
            // answers it itself too).
            let s = upload(&w.c, up, &addr)?;
            assert_eq!(s.ok, 1, "{} upload via {addr}: {s:?}", pod.name);
            assert!(s.replies.keys().all(|r| r.starts_with(&pod.name) && r.ends_with(&format!("upload {BYTES} ok"))), "{s:?}");
            // Download through the narrow router.
            let s = download(&w.c, down, &addr)?;
            assert_eq!(s.ok, 1, "{} download via {addr} behind a narrow router: {s:?}", pod.name);
        }
    }
    // pod-2's uploads (both families) answered by lb; pod-1's by the stack,
    // its errors translated, or with --bpf-forward (pod-1's flows
    // masqueraded in BPF) by lb too.
    let (too_big, icmp) = (datapath(&w.c, 1, "nat_too_big")?, datapath(&w.c, 1, "nat_icmp")?);
    assert!(too_big >= 2, "lb told the clients of SNATed flows: {too_big}");
    if lbtest::bpf_forward_from_env() {
        assert!(too_big >= 4, "lb told the clients of the flows it masqueraded too: {too_big}");
    } else {
        assert!(icmp >= 4, "errors of the other cases were translated: {icmp}");
    }
    Ok(())
}

/// The path from node-1 to a client is narrower than the one to the pods
/// (node-1's route to the client has a locked MTU of 1300): a remote
/// backend's replies of a SNATed flow are too big for it. The stack would
/// tell the translated reply's source, the frontend (node-1 itself), and
/// the backend would never learn: the download stalls. Under kube-proxy
/// the stack tells the backend (conntrack restores the source only after
/// the forwarding); so does lb, from the SNAT address, quoting the reply
/// as the backend sent it, and the download goes on in smaller segments.
#[test]
fn a_reply_too_big_for_the_path_to_the_client_is_answered_to_the_backend() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let down = w.c.add_outside("down-narrow", 112, &[])?;
    let n1 = w.c.nodes[0].netns.clone();
    w.c.in_netns(&n1, &["ip", "route", "add", &down.ip, "dev", "eth0", "mtu", "lock", "1300"])?;
    w.c.in_netns(&n1, &["ip", "-6", "route", "add", &down.ip6, "dev", "eth0", "mtu", "lock", "1300"])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    for node in [NODE1, NODE1_6] {
        let before = datapath(&w.c, 1, "nat_too_big")?;
        let s = c_download(&w.c, &down, &hostport(node, 30080))?;
        assert_eq!(s.ok, 1, "download via {node} over a narrow path to the client: {s:?}");
        let told = datapath(&w.c, 1, "nat_too_big")?;
        assert!(told > before, "lb told the backend, via {node}: {told}");
    }
    Ok(())
}

/// A download with a short read timeout: a stalled one fails in 3 s.
fn c_download(c: &Cluster, from: &Pod, addr: &str) -> Result<Summary> {
    c.probe(from, &["bulk", "--addr", addr, "--bytes", BYTES, "--timeout-ms", "3000"])
}

/// A client's IPv6 datagram, fragmented by the client, whose first
/// fragment is too big for the path on to the backend: lb's "packet too
/// big" quotes the fragment header and the UDP header after it, so that
/// the client's kernel finds the socket and lowers its path MTU (Linux
/// drops an error whose quote ends before the L4 header), and the next
/// datagrams, fragmented smaller, arrive. Before 12-06's second session
/// the quote ended with the fragment header and every datagram was lost.
#[test]
fn packet_too_big_about_a_clients_first_fragment_teaches_the_client() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    narrow_paths_to_pods(&w)?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    let client = w.c.add_outside("frag6", 112, &[])?;
    let before = datapath(&w.c, 1, "nat_too_big")?;
    let s = w.c.probe(&client, &["udp", "--addr", &hostport(NODE1_6, 30080), "--count", "5", "--size", "4000", "--timeout-ms", "500"])?;
    assert!(datapath(&w.c, 1, "nat_too_big")? > before, "lb told the client");
    assert!(s.ok >= 3, "the datagrams after the first arrive, fragmented for the path: {s:?}");
    let route = w.c.in_netns(&client.netns, &["ip", "-6", "route", "get", NODE1_6])?;
    assert!(route.contains("mtu 1300"), "the client's path MTU: {route}");
    Ok(())
}

/// The routes LB_ROUTE_MTU of node-1 holds, as bpftool dumps them.
fn route_mtu_entries(w: &World) -> Result<Vec<serde_json::Value>> {
    let pin = w.c.nodes[0].bpffs.join("LB_ROUTE_MTU");
    let out = lbtest::run("bpftool", &["-j", "map", "dump", "pinned", pin.to_str().unwrap_or_default()])?;
    Ok(serde_json::from_str::<Vec<serde_json::Value>>(&out)?)
}

/// A route's MTU that is not locked (`ip route ... mtu 1300`, as some CNIs
/// set on their routes to other nodes' pods): the stack's forwarding
/// honours it, bpf_fib_lookup does not. lb reads such routes (and follows
/// their changes) and answers a SNATed packet too big for one itself, as
/// for a locked one; before, the stack's answer went to the SNAT address,
/// node-1 itself, and uploads stalled. On both families: IPv6's forwarding
/// check reads only a locked route MTU, but its output path sends "packet
/// too big" for an unlocked one (without lb's answer the IPv6 upload
/// stalls as well).
#[test]
fn an_unlocked_route_mtu_is_honoured_as_the_stack_does() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    let n1 = w.c.nodes[0].netns.clone();
    w.c.in_netns(&n1, &["ip", "route", "change", "10.244.2.0/24", "via", "192.168.77.12", "mtu", "1300"])?;
    w.c.in_netns(&n1, &["ip", "-6", "route", "change", "fd00:244:2::/64", "via", "fd00:77::12", "mtu", "1300"])?;
    w.c.wait_for("node-1's routes with an MTU in LB_ROUTE_MTU", std::time::Duration::from_secs(5), || Ok(route_mtu_entries(&w)?.len() == 2))?;
    let up = w.c.add_outside("up", 101, &[])?;
    let too_big = datapath(&w.c, 1, "nat_too_big")?;
    for node in [NODE1, NODE1_6] {
        let addr = hostport(node, 30080);
        let s = upload(&w.c, &up, &addr)?;
        assert_eq!(s.ok, 1, "upload via {addr} over a route of MTU 1300 (not locked): {s:?}");
    }
    assert!(datapath(&w.c, 1, "nat_too_big")? >= too_big + 2, "lb said fragmentation needed / packet too big");
    // The MTU taken off the routes: the entries go.
    w.c.in_netns(&n1, &["ip", "route", "change", "10.244.2.0/24", "via", "192.168.77.12"])?;
    w.c.in_netns(&n1, &["ip", "-6", "route", "change", "fd00:244:2::/64", "via", "fd00:77::12"])?;
    w.c.wait_for("LB_ROUTE_MTU emptied", std::time::Duration::from_secs(5), || Ok(route_mtu_entries(&w)?.is_empty()))?;
    Ok(())
}

/// What `udp --recverr` saw: the errors and which ICMP said so, from where.
fn icmp_seen(c: &Cluster, from: &Pod, addr: &str, ttl: Option<&str>) -> Result<Summary> {
    let mut args = vec!["udp", "--addr", addr, "--count", "2", "--connected", "--recverr", "--timeout-ms", "2000"];
    if let Some(t) = ttl {
        args.extend(["--ttl", t]);
    }
    c.probe(from, &args)
}

#[test]
fn time_exceeded_host_and_port_unreachable_come_back_from_the_frontend() -> Result<()> {
    let w = world(&web("LoadBalancer", "", &[LB_IP, LB_IP6]))?;
    // The nodes' stacks rate-limit the ICMP errors they send to one host;
    // this test is about what happens to the errors, not how many.
    for n in &w.c.nodes {
        w.c.in_netns(&n.netns, &["sysctl", "-qw", "net.ipv4.icmp_ratelimit=0", "net.ipv6.icmp.ratelimit=0"])?;
    }
    let cases = [(LB_IP, "icmp type=11 code=0", "icmp type=3 code=3"), (LB_IP6, "icmp6 type=3 code=0", "icmp6 type=1 code=4")];
    for (pod, server) in [(&w.p2, w.servers[1]), (&w.p1, w.servers[0])] {
        set_endpoints(&w, &[(pod, E::ready)])?;
        wait_only(&w.c, LB_IP, 80, pod)?;
        wait_only(&w.c, LB_IP6, 80, pod)?;
        for (lb, exceeded, _) in cases {
            let addr = hostport(lb, 80);
            // TTL 1 runs out at node-1 (for pod-2's SNATed flow lb answers;
            // for pod-1 the stack does and lb translates), TTL 2 at node-2
            // (pod-2 only: pod-1 is one hop away).
            let ttls: &[&str] = if pod.node == 2 { &["1", "2"] } else { &["1"] };
            for ttl in ttls {
                let s = icmp_seen(&w.c, &w.outside, &addr, Some(ttl))?;
                assert_eq!(s.errors.get("EHOSTUNREACH"), Some(&2), "{} ttl {ttl} via {addr}: {s:?}", pod.name);
                let from = format!("{exceeded} from={lb}");
                assert!(s.offenders.keys().all(|k| *k == from) && !s.offenders.is_empty(), "{} ttl {ttl}: {from}: {s:?}", pod.name);
            }
            let s = icmp_seen(&w.c, &w.outside, &addr, None)?;
            assert_eq!(s.ok, 2, "{s:?}");
        }
        // pod-2's node loses its route to pod-2: its "host unreachable"
        // reaches the client, from the frontend.
        if pod.node == 2 {
            let n2 = &w.c.nodes[1].netns;
            w.c.in_netns(n2, &["ip", "route", "add", "unreachable", &format!("{}/32", pod.ip)])?;
            w.c.in_netns(n2, &["ip", "-6", "route", "add", "unreachable", &format!("{}/128", pod.ip6)])?;
            // IPv6's "no route" is ENETUNREACH to the socket. IPv4's comes
            // from ip_error, which sends one per second per host whatever
            // the ICMP sysctls say (net.ipv4.route.error_cost is global):
            // one datagram, a second after node-2's last error to node-1.
            for (lb, host_unreachable, errno) in [(LB_IP, "icmp type=3 code=1", "EHOSTUNREACH"), (LB_IP6, "icmp6 type=1 code=0", "ENETUNREACH")] {
                std::thread::sleep(std::time::Duration::from_millis(1100));
                let s = w.c.probe(&w.outside, &["udp", "--addr", &hostport(lb, 80), "--count", "1", "--connected", "--recverr", "--timeout-ms", "2000"])?;
                assert_eq!(s.errors.get(errno), Some(&1), "{} via {lb}: {s:?}", pod.name);
                let from = format!("{host_unreachable} from={lb}");
                assert!(s.offenders.keys().all(|k| *k == from) && !s.offenders.is_empty(), "{from}: {s:?}");
            }
            w.c.in_netns(n2, &["ip", "route", "del", "unreachable", &format!("{}/32", pod.ip)])?;
            w.c.in_netns(n2, &["ip", "-6", "route", "del", "unreachable", &format!("{}/128", pod.ip6)])?;
        }
        // The pod's server goes away (its endpoint stays): the pod's port
        // unreachable reaches the client, from the frontend.
        w.c.stop(server);
        for (lb, _, unreachable) in cases {
            let s = icmp_seen(&w.c, &w.outside, &hostport(lb, 80), None)?;
            assert_eq!(s.errors.get("ECONNREFUSED"), Some(&2), "{} via {lb}: {s:?}", pod.name);
            let from = format!("{unreachable} from={lb}");
            assert!(s.offenders.keys().all(|k| *k == from) && !s.offenders.is_empty(), "{from}: {s:?}");
        }
    }
    assert!(datapath(&w.c, 1, "nat_icmp")? >= 6);
    Ok(())
}

#[test]
fn fragmented_datagrams_and_ipv6_extension_headers_are_translated_both_ways() -> Result<()> {
    let w = world(&web("NodePort", "", &[]))?;
    let np = hostport(NODE1, 30080);
    let np6 = hostport(NODE1_6, 30080);
    for pod in [&w.p1, &w.p2] {
        set_endpoints(&w, &[(pod, E::ready)])?;
        wait_only(&w.c, NODE1, 30080, pod)?;
        wait_only(&w.c, NODE1_6, 30080, pod)?;
        for (addr, bridge, node) in [(&np, NODE1_BRIDGE, NODE1), (&np6, NODE1_BRIDGE6, NODE1_6)] {
            // A local pod sees node-1's address on the pod bridge
            // (masqueraded: conntrack reassembles and fragments the
            // datagrams again), a remote one node-1 (SNAT).
            let seen = if pod.node == 1 { bridge } else { node };
            // 4000 bytes: three fragments; only the first carries the ports
            // (IPv6: in a fragment extension header).
            let s = w.c.probe(&w.outside, &["udp", "--addr", addr, "--count", "5", "--size", "4000"])?;
            assert_eq!(s.ok, 5, "{} {addr}: {s:?}", pod.name);
            assert_eq!(keys(&s), [format!("{} {seen} bytes=4000", pod.name).as_str()].into(), "{s:?}");
            // ... and as large an answer: the pod's fragments are
            // translated back (on egress for a local pod, at node-1's
            // ingress for a remote one), from the frontend.
            let s = w.c.probe(&w.outside, &["udp", "--addr", addr, "--count", "5", "--size", "4000", "--echo", "--connected"])?;
            assert_eq!(s.ok, 5, "{} {addr}: {s:?}", pod.name);
            assert_eq!(keys(&s), [format!("{} {seen} bytes=4000 echo reply=4000", pod.name).as_str()].into(), "{s:?}");
            assert_eq!(s.peers.keys().collect::<Vec<_>>(), [addr.as_str()], "answers come from the frontend: {s:?}");
        }
        // IPv6 extension headers before UDP: hop-by-hop options, and
        // destination options (Linux puts both before the fragment header
        // of a large datagram).
        for (ext, size) in [("hbh", "0"), ("hbh", "4000"), ("dst", "0"), ("dst", "4000")] {
            let s = w.c.probe(&w.outside, &["udp", "--addr", &np6, "--count", "3", "--size", size, "--ip6-ext", ext, "--connected"])?;
            assert_eq!(s.ok, 3, "{} {ext} {size}: {s:?}", pod.name);
            assert_eq!(s.peers.keys().collect::<Vec<_>>(), [np6.as_str()], "{s:?}");
        }
    }
    // (Headers lb leaves alone, a routing header, destination options
    // after a fragment header, are in north_south_abuse's malformed test.)
    let s = tcp(&w.c, &w.outside, &np6, 5)?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}

/// The answers lb builds itself (REJECT's RST and port unreachable, the RST
/// of a flow whose backend left, "fragmentation needed", "time exceeded")
/// are made from the packet they answer, and that packet's checksum may be
/// partial: a NIC's GRO'd segments and a local sender's are. The device
/// that sends the answer must not finish a checksum over it. Here the
/// client's checksums are partial (its offload on, TSO too, and the
/// fabric's port to node-1 passes them on as they are) and node-1's eth0
/// finishes checksums in software (its offload off), as a NIC does in
/// hardware; the client's stack checks every one it receives, and a
/// capture there (and at pod-2) checks them all again.
#[test]
fn answers_lb_builds_from_partially_checksummed_packets_hold_on_the_wire() -> Result<()> {
    let w = world_wired(&web("NodePort", "", &[]), &["--nodeport-acceleration", "none"])?;
    w.c.in_netns(&w.outside.netns, &["ethtool", "-K", "eth0", "tx", "on", "tso", "on"])?;
    w.c.in_netns(w.c.fabric_netns(), &["ethtool", "-K", "n1", "tx", "on", "tso", "on"])?;
    for n in &w.c.nodes {
        w.c.in_netns(&n.netns, &["sysctl", "-qw", "net.ipv4.icmp_ratelimit=0", "net.ipv6.icmp.ratelimit=0"])?;
    }
    narrow_paths_to_pods(&w)?;
    let traffic = || -> Result<()> {
        for node in [NODE1, NODE1_6] {
            let addr = hostport(node, 30080);
            set_endpoints(&w, &[(&w.p2, E::ready)])?;
            wait_only(&w.c, node, 30080, &w.p2)?;
            // "Fragmentation needed" / "packet too big" for the client's
            // TSO segments: the upload finishes.
            let s = upload(&w.c, &w.outside, &addr)?;
            assert_eq!(s.ok, 1, "{addr}: lb's fragmentation needed reached the client: {s:?}");
            // "Time exceeded" for a datagram whose TTL runs out at node-1.
            let s = icmp_seen(&w.c, &w.outside, &addr, Some("1"))?;
            assert_eq!(s.errors.get("EHOSTUNREACH"), Some(&2), "{addr}: {s:?}");
            // pod-2 goes (draining, then out of the slice) while a
            // connection to it is open: its next segment gets lb's RST.
            let held = w.c.probe_bg(&w.outside, &["tcp", "--addr", &addr, "--hold-ms", "3000", "--interval-ms", "50", "--timeout-ms", "5000"])?;
            std::thread::sleep(std::time::Duration::from_millis(500));
            set_endpoints(&w, &[(&w.p2, E::draining), (&w.p1, E::ready)])?;
            wait_only(&w.c, node, 30080, &w.p1)?;
            set_endpoints(&w, &[(&w.p1, E::ready)])?;
            let s = Cluster::finish(held)?;
            assert_eq!(s.errors.keys().collect::<Vec<_>>(), ["ECONNRESET"], "{addr}: lb's RST was taken: {s:?}");
            assert!(s.max_fail_ms < 1000, "{addr}: at once: {s:?}");
            // No endpoints: REJECT (a RST for TCP, port unreachable for UDP).
            set_endpoints(&w, &[])?;
            w.c.wait_for("no backends", std::time::Duration::from_secs(5), || {
                Ok(w.c.programmed(1, node, 30080, "TCP")?.is_some_and(|b| b.is_empty()))
            })?;
            let s = w.c.probe(&w.outside, &["tcp", "--addr", &addr, "--count", "3", "--timeout-ms", "2000"])?;
            assert_eq!(s.errors.get("ECONNREFUSED"), Some(&3), "{addr}: {s:?}");
            assert!(s.max_fail_ms < 500, "{addr}: at once, not after a timeout: {s:?}");
            let s = w.c.probe(&w.outside, &["udp", "--addr", &addr, "--count", "2", "--connected", "--timeout-ms", "2000"])?;
            assert_eq!(s.errors.get("ECONNREFUSED"), Some(&2), "{addr}: {s:?}");
        }
        Ok(())
    };
    // Every checksum at the client, and at pod-2 (the uploads), holds.
    checksums_hold(&w, &w.p2, (100, 100), traffic)?;
    for event in ["nat_too_big", "nat_reset", "nat_rejected"] {
        assert!(datapath(&w.c, 1, event)? >= 2, "{event}");
    }
    Ok(())
}

/// A datagram in fragments whose first fragment went through the old
/// agent's programs and the rest through the new one's: the ports the
/// first fragment carried are pinned with the flows, so the later
/// fragments still follow it and the pod gets the datagram whole.
#[test]
fn a_datagram_whose_fragments_straddle_an_agent_restart_arrives_whole() -> Result<()> {
    use lbtest::raw::{ether, ipv4, ipv6, ipv6_frag_header, udp_datagram};
    use std::net::{IpAddr, UdpSocket};
    let mut w = world(&web("NodePort", "", &[]))?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, NODE1, 30080, &w.p2)?;
    wait_only(&w.c, NODE1_6, 30080, &w.p2)?;
    let (node_mac, client_mac) = (lbtest::raw::mac(&w.c, &w.c.nodes[0].netns, "eth0")?, lbtest::raw::mac(&w.c, &w.outside.netns, "eth0")?);
    for (n, (client, node)) in [(CLIENT, NODE1), (CLIENT6, NODE1_6)].into_iter().enumerate() {
        let (client_ip, node_ip): (IpAddr, IpAddr) = (client.parse()?, node.parse()?);
        // A socket at the client to receive the pod's answer.
        let sock = lbtest::with_netns(Some(&w.outside.netns), || Ok(UdpSocket::bind((client_ip, 0))?))?;
        sock.set_read_timeout(Some(std::time::Duration::from_secs(3)))?;
        let sport = sock.local_addr()?.port();
        // A "big" datagram: the server answers with its length if every
        // pattern byte (lbprobe's bulk pattern) arrived right.
        let payload: Vec<u8> = b"big\n".iter().copied().chain((0..1996u64).map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)).collect();
        let (first, rest) = match (client_ip, node_ip) {
            (IpAddr::V4(c), IpAddr::V4(d)) => {
                let d4 = udp_datagram(&c.octets(), &d.octets(), sport, 30080, &payload);
                let id = 0x4242 + n as u16;
                let f1 = ipv4(c.octets(), d.octets(), 17, 5, 0x2000, id, &d4[..1480]);
                let f2 = ipv4(c.octets(), d.octets(), 17, 5, (1480 / 8) as u16, id, &d4[1480..]);
                (ether(node_mac, client_mac, 0x0800, &f1), ether(node_mac, client_mac, 0x0800, &f2))
            }
            (IpAddr::V6(c), IpAddr::V6(d)) => {
                let d6 = udp_datagram(&c.octets(), &d.octets(), sport, 30080, &payload);
                let id = 0x4242_0000 + n as u32;
                let f1 = [ipv6_frag_header(17, 0, true, id), d6[..1448].to_vec()].concat();
                let f2 = [ipv6_frag_header(17, 1448, false, id), d6[1448..].to_vec()].concat();
                (ether(node_mac, client_mac, 0x86dd, &ipv6(c.octets(), d.octets(), 44, &f1)), ether(node_mac, client_mac, 0x86dd, &ipv6(c.octets(), d.octets(), 44, &f2)))
            }
            _ => unreachable!(),
        };
        lbtest::raw::send(&w.outside.netns, "eth0", vec![first])?;
        std::thread::sleep(std::time::Duration::from_millis(200));
        w.c.kill_agent(1);
        w.c.start_agent(1)?;
        lbtest::raw::send(&w.outside.netns, "eth0", vec![rest])?;
        let mut buf = [0u8; 512];
        let (len, from) = sock.recv_from(&mut buf).map_err(|e| anyhow::anyhow!("{node}: no answer to the datagram sent across the restart: {e}"))?;
        let answer = String::from_utf8_lossy(&buf[..len]);
        assert_eq!(answer, format!("pod-2 {node} bytes=2000"), "{node}: the datagram arrived whole at pod-2 (SNATed)");
        assert_eq!(from.ip(), node_ip, "from the frontend");
    }
    Ok(())
}

/// A pod answers a large UDP datagram with as large a one, which it sends
/// in IPv6 fragments; a router on the way to the client has a narrower
/// link and answers the first fragment with "packet too big", to the
/// frontend. lb translates it, fragment header and all, so the pod learns
/// the path's MTU and its next answers arrive (IPv6 routers never
/// fragment: without it every answer would be lost).
#[test]
fn packet_too_big_about_a_pods_fragmented_answer_reaches_the_pod() -> Result<()> {
    let mut w = world(&web("NodePort", "", &[]))?;
    let addr = hostport(NODE1_6, 30080);
    for (pod, host) in [(w.p2.clone(), 120), (w.p1.clone(), 121)] {
        let client = w.c.add_outside_via_router(&format!("narrow-{}", pod.node), host, 1300, &[])?;
        set_endpoints(&w, &[(&pod, E::ready)])?;
        wait_only(&w.c, NODE1_6, 30080, &pod)?;
        let before = datapath(&w.c, 1, "nat_icmp")?;
        // One socket: the first answer is lost (it taught the pod the
        // path's MTU), the next ones arrive.
        let s = w.c.probe(&client, &["udp", "--addr", &addr, "--count", "5", "--size", "4000", "--echo", "--one-socket", "--timeout-ms", "1000"])?;
        assert!(s.ok >= 4, "{}: {s:?}", pod.name);
        assert!(keys(&s).iter().all(|k| k.starts_with(&pod.name) && k.ends_with("echo reply=4000")), "{s:?}");
        assert!(datapath(&w.c, 1, "nat_icmp")? > before, "{}: the router's packet too big was translated", pod.name);
    }
    Ok(())
}

/// `--per-packet-lb`: a pod whose packets no socket hook sees (a VM's own
/// kernel) uploads to a ClusterIP, and an IPv6 LoadBalancer IP, whose
/// backend is behind a narrower path. Node-1's "fragmentation needed" /
/// "packet too big" quotes the translated packet (pod -> backend); it
/// reaches the pod translated back (pod -> Service address), so the pod's
/// kernel lowers its path MTU for that connection and the upload goes on,
/// as through kube-proxy's DNAT. Untranslated, the pod's kernel would find
/// no socket for it and the upload would stall.
#[test]
fn path_mtu_discovery_works_for_pods_the_socket_hooks_cannot_see() -> Result<()> {
    let mut w = world_with(&web("LoadBalancer", "", &[LB_IP6]), &["--per-packet-lb"])?;
    narrow_paths_to_pods(&w)?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_only(&w.c, "10.96.0.10", 80, &w.p2)?;
    wait_only(&w.c, LB_IP6, 80, &w.p2)?;
    let vm = w.c.add_pod(1, "vm")?;
    let guest = Pod { cgroup: Default::default(), ..vm };
    let icmp = datapath(&w.c, 1, "nat_icmp")?;
    w.c.wait_for("the pod programs on the new pod's device", std::time::Duration::from_secs(5), || {
        Ok(w.c.probe(&guest, &["tcp", "--addr", "10.96.0.10:80", "--count", "1"])?.ok == 1)
    })?;
    for addr in ["10.96.0.10:80".to_string(), hostport(LB_IP6, 80)] {
        let s = upload(&w.c, &guest, &addr)?;
        assert_eq!(s.ok, 1, "upload via {addr}: {s:?}");
        assert!(s.replies.keys().all(|r| r.starts_with("pod-2") && r.ends_with(&format!("upload {BYTES} ok"))), "{s:?}");
    }
    assert!(datapath(&w.c, 1, "nat_icmp")? >= icmp + 2, "the errors were translated");
    Ok(())
}
