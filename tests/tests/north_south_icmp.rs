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
            // pod-1 the stack's own one is translated on its way out.
            let s = upload(&w.c, up, &addr)?;
            assert_eq!(s.ok, 1, "{} upload via {addr}: {s:?}", pod.name);
            assert!(s.replies.keys().all(|r| r.starts_with(&pod.name) && r.ends_with(&format!("upload {BYTES} ok"))), "{s:?}");
            // Download through the narrow router.
            let s = download(&w.c, down, &addr)?;
            assert_eq!(s.ok, 1, "{} download via {addr} behind a narrow router: {s:?}", pod.name);
        }
    }
    assert!(datapath(&w.c, 1, "nat_too_big")? >= 2, "lb told the clients of SNATed flows");
    assert!(datapath(&w.c, 1, "nat_icmp")? >= 4, "errors of the other cases were translated");
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
        for (addr, client, node) in [(&np, CLIENT, NODE1), (&np6, CLIENT6, NODE1_6)] {
            // A local pod sees the client, a remote one node-1 (SNAT).
            let seen = if pod.node == 1 { client } else { node };
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
