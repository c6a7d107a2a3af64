//! The two-node world of the north-south tests: a Service "web" with
//! NodePort 30080 (TCP and UDP, target port 8080), dual-stack, pod-1
//! on node-1 and pod-2 on node-2 answering with the client address they
//! see, an outside client, and helpers to look at what happened.
use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Result;

use crate::objects::{Endpoint as E, service_typed, slice_of};
use crate::{Cluster, Pod, Summary};

pub const EP: &[(&str, u16, &str)] = &[("http", 8080, "TCP"), ("dns", 8080, "UDP")];
/// The IPv6 ClusterIP of "web" (dual-stack: its IPv6 NodePorts exist).
pub const WEB6: &str = "fd00:96::10";
pub const LB_IP: &str = "10.100.0.10";
pub const LB_IP6: &str = "fd00:100::10";
pub const NODE1: &str = "192.168.77.11";
pub const NODE1_6: &str = "fd00:77::11";
pub const CLIENT: &str = "192.168.77.100";
pub const CLIENT6: &str = "fd00:77::100";
/// node-1's addresses on its pod bridge (cni0): the source its local pods
/// see on an outside flow the stack masquerades (externalTrafficPolicy
/// Cluster: `--local-masquerade`, as kube-proxy's MASQUERADE picks the
/// address of the device the packet leaves by).
pub const NODE1_BRIDGE: &str = "10.244.1.1";
pub const NODE1_BRIDGE6: &str = "fd00:244:1::1";

pub struct World {
    pub c: Cluster,
    pub p1: Pod,
    pub p2: Pod,
    pub outside: Pod,
    /// The servers of pod-1 and pod-2.
    pub servers: [u32; 2],
}

/// Two nodes, pod-1 on node-1 and pod-2 on node-2 (answering with the
/// client address they see), an outside client with both families that
/// routes the LB IPs to node-1, agents on both nodes with both node IPs.
pub fn world(svc: &str) -> Result<World> {
    world_with(svc, &[])
}

/// `world` with extra `lb-agent run` flags for both agents.
pub fn world_with(svc: &str, agent_args: &[&str]) -> Result<World> {
    world_of(Cluster::new(2)?, svc, agent_args)
}

/// `world_with` on `nodes` nodes (pod-1 on node-1, pod-2 on node-2), an
/// agent on each.
pub fn world_on(nodes: usize, svc: &str, agent_args: &[&str]) -> Result<World> {
    world_of(Cluster::new(nodes)?, svc, agent_args)
}

/// `world_with` on a fabric that carries complete checksums, as XDP
/// acceleration needs (`Cluster::wire_checksums`).
pub fn world_wired(svc: &str, agent_args: &[&str]) -> Result<World> {
    let mut c = Cluster::new(2)?;
    c.wire_checksums()?;
    world_of(c, svc, agent_args)
}

fn world_of(mut c: Cluster, svc: &str, agent_args: &[&str]) -> Result<World> {
    let p1 = c.add_pod(1, "pod-1")?;
    let p2 = c.add_pod(2, "pod-2")?;
    let servers = [c.serve_reporting_peer(&p1, 8080)?, c.serve_reporting_peer(&p2, 8080)?];
    let outside = c.add_outside("outside", 100, &[(&format!("{LB_IP}/32"), 1), (&format!("{LB_IP6}/128"), 1)])?;
    c.write_object("svc.yaml", svc)?;
    let mut w = World { c, p1, p2, outside, servers };
    set_endpoints(&w, &[(&w.p1, E::ready), (&w.p2, E::ready)])?;
    for node in 1..=w.c.nodes.len() {
        w.c.start_agent_with(node, agent_args)?;
    }
    Ok(w)
}

pub type Make = fn(&str, &str) -> E;

/// The Service's endpoints, in both families.
pub fn set_endpoints(w: &World, eps: &[(&Pod, Make)]) -> Result<()> {
    let node = |p: &Pod| format!("node-{}", p.node);
    let v4: Vec<E> = eps.iter().map(|(p, f)| f(&p.ip, &node(p))).collect();
    let v6: Vec<E> = eps.iter().map(|(p, f)| f(&p.ip6, &node(p))).collect();
    w.c.write_object("slice4.yaml", &slice_of("web", "web-v4", "IPv4", EP, &v4))?;
    w.c.write_object("slice6.yaml", &slice_of("web", "web-v6", "IPv6", EP, &v6))
}

pub fn web(ty: &str, extra: &str, lb_ips: &[&str]) -> String {
    let extra = format!("  ipFamilyPolicy: PreferDualStack\n{extra}");
    service_typed("web", &["10.96.0.10", WEB6], ty, &[("http", 80, 8080, "TCP", 30080), ("dns", 80, 8080, "UDP", 30080)], &extra, lb_ips)
}

pub fn wait_backends(c: &Cluster, node: usize, addr: &str, port: u16, n: usize) -> Result<()> {
    c.wait_for(&format!("{addr}:{port} on node-{node} programmed with {n} backends"), Duration::from_secs(5), || {
        Ok(c.programmed(node, addr, port, "TCP")?.is_some_and(|b| b.len() == n))
    })
}

/// Wait until node-1's agent programmed `addr:port` (TCP) with exactly
/// `pod`'s address of the same family as its one backend (port 8080).
pub fn wait_only(c: &Cluster, addr: &str, port: u16, pod: &Pod) -> Result<()> {
    let ip = if addr.contains(':') { &pod.ip6 } else { &pod.ip };
    let want = vec![format!("{ip}:8080")];
    c.wait_for(&format!("{addr}:{port} on node-1 programmed with only {want:?}"), Duration::from_secs(5), || {
        Ok(c.programmed(1, addr, port, "TCP")?.is_some_and(|b| b == want))
    })
}

pub fn hostport(addr: &str, port: u16) -> String {
    if addr.contains(':') { format!("[{addr}]:{port}") } else { format!("{addr}:{port}") }
}

pub fn tcp(c: &Cluster, pod: &Pod, addr: &str, n: u32) -> Result<Summary> {
    c.probe(pod, &["tcp", "--addr", addr, "--count", &n.to_string(), "--timeout-ms", "1000"])
}

pub fn keys(s: &Summary) -> BTreeSet<&str> {
    s.replies.keys().map(String::as_str).collect()
}

/// A datapath counter from the agent's /metrics.
pub fn datapath(c: &Cluster, node: usize, result: &str) -> Result<u64> {
    let (_, m) = c.http(node, "127.0.0.1:10249", "/metrics")?;
    let name = format!("lb_datapath_events_total{{result=\"{result}\"}} ");
    Ok(m.lines().find_map(|l| l.strip_prefix(&name)?.parse().ok()).unwrap_or(0))
}

/// A metric of node `node`'s agent by its full name and labels (as
/// `/metrics` prints them, e.g. `lb_netfilter_problems`); 0 when absent.
pub fn agent_metric(c: &Cluster, node: usize, series: &str) -> Result<u64> {
    let (_, m) = c.http(node, "127.0.0.1:10249", "/metrics")?;
    let name = format!("{series} ");
    Ok(m.lines().find_map(|l| l.strip_prefix(&name)?.parse().ok()).unwrap_or(0))
}

/// How many entries the map pinned as `name` on node `node` holds (a
/// table's raw entries, both of each flow).
pub fn map_entries(c: &Cluster, node: usize, name: &str) -> Result<usize> {
    let out = crate::run("bpftool", &["-j", "map", "dump", "pinned", c.nodes[node - 1].bpffs.join(name).to_str().unwrap()])?;
    Ok(serde_json::from_str::<Vec<serde_json::Value>>(&out)?.len())
}

/// The NAT flows node-1 lists (`lb-agent nat`) from source `src`.
pub fn flows_from(c: &Cluster, src: &str) -> Result<Vec<String>> {
    let nat = crate::run(crate::bin("lb-agent").to_str().unwrap(), &["nat", "--bpffs", c.nodes[0].bpffs.to_str().unwrap()])?;
    Ok(nat.lines().filter(|l| l.contains(&format!("src={src} "))).map(String::from).collect())
}

/// Run `traffic` while capturing at the outside client and at `pod`, and
/// check every TCP, UDP and ICMP checksum that arrives (`raw::count_checksums`):
/// none broken, and at least `min` (pod, client) packets seen, so that the
/// capture cannot pass by seeing nothing.
pub fn checksums_hold(w: &World, pod: &Pod, min: (u64, u64), traffic: impl FnOnce() -> Result<()>) -> Result<()> {
    let ((_, pod_ok, pod_bad), client_ok, client_bad) =
        crate::raw::count_checksums(&w.outside.netns, || crate::raw::count_checksums(&pod.netns, traffic))?;
    assert_eq!((pod_bad, client_bad), (0, 0), "broken checksums at {} ({pod_ok} good) or at the client ({client_ok} good)", pod.name);
    assert!(pod_ok >= min.0 && client_ok >= min.1, "checksums seen: {pod_ok} at {}, {client_ok} at the client; want {min:?}", pod.name);
    Ok(())
}

/// FORWARD counters on node-1: (TCP packets to the pods' port 8080,
/// packets to the outside client), summed over IPv4 and IPv6. Rules set up
/// by `count_forwarding`.
pub fn forwarded(w: &World) -> Result<(u64, u64)> {
    let netns = &w.c.nodes[0].netns;
    let mut to_pods = 0;
    let mut to_client = 0;
    for cmd in ["iptables", "ip6tables"] {
        let out = w.c.in_netns(netns, &[cmd, "-w", "-L", "FORWARD", "-v", "-x", "-n"])?;
        for l in out.lines() {
            let f: Vec<&str> = l.split_whitespace().collect();
            let Some(n) = f.first().and_then(|n| n.parse::<u64>().ok()) else { continue };
            if l.contains("dpt:8080") {
                to_pods += n;
            } else if l.contains(CLIENT6) || l.contains(&format!(" {CLIENT} ")) || l.ends_with(CLIENT) {
                to_client += n;
            }
        }
    }
    Ok((to_pods, to_client))
}

/// Count what node-1's stack forwards (`forwarded`), from zero.
pub fn count_forwarding(w: &World) -> Result<()> {
    let netns = &w.c.nodes[0].netns;
    for (cmd, client) in [("iptables", CLIENT), ("ip6tables", CLIENT6)] {
        w.c.in_netns(netns, &[cmd, "-w", "-Z", "FORWARD"]).ok();
        w.c.in_netns(netns, &[cmd, "-w", "-F", "FORWARD"])?;
        w.c.in_netns(netns, &[cmd, "-w", "-A", "FORWARD", "-p", "tcp", "--dport", "8080"])?;
        w.c.in_netns(netns, &[cmd, "-w", "-A", "FORWARD", "-d", client])?;
    }
    Ok(())
}
