//! The spine on a real kernel: ClusterIP load balancing at the socket, in a
//! netns mini-cluster with one lb-agent per node.
use std::time::Duration;

use anyhow::Result;
use lbtest::objects::{service, slice};
use lbtest::{Cluster, Pod};

const VIP: &str = "10.96.0.10";
const WEB_PORTS: &[(&str, u16, u16, &str)] = &[("http", 80, 8080, "TCP"), ("dns", 53, 8080, "UDP")];
const WEB_EP_PORTS: &[(&str, u16, &str)] = &[("http", 8080, "TCP"), ("dns", 8080, "UDP")];

/// One node, three backend pods serving on 8080, a client pod, the agent,
/// and Service web (80/TCP and 53/UDP -> 8080) with all three endpoints.
struct Web {
    c: Cluster,
    backends: Vec<Pod>,
    client: Pod,
}

fn web_slice(c: &Cluster, pods: &[&Pod]) -> String {
    let eps: Vec<(&str, &str, bool)> = pods.iter().map(|p| (p.ip.as_str(), c.nodes[p.node - 1].name.as_str(), true)).collect();
    slice("web", "web-1", WEB_EP_PORTS, &eps)
}

fn web() -> Result<Web> {
    let mut c = Cluster::new(1)?;
    let mut backends = Vec::new();
    for name in ["pod-a", "pod-b", "pod-c"] {
        let p = c.add_pod(1, name)?;
        c.serve(&p, 8080)?;
        backends.push(p);
    }
    let client = c.add_pod(1, "client")?;
    c.write_object("web-svc.yaml", &service("web", VIP, WEB_PORTS))?;
    let refs: Vec<&Pod> = backends.iter().collect();
    c.write_object("web-slice.yaml", &web_slice(&c, &refs))?;
    c.start_agent(1)?;
    let want: Vec<String> = backends.iter().map(|p| format!("{}:8080", p.ip)).collect();
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    c.wait_programmed(VIP, 80, "TCP", Some(&want))?;
    Ok(Web { c, backends, client })
}

fn tcp(c: &Cluster, pod: &Pod, addr: &str, count: u32) -> Result<lbtest::Summary> {
    c.probe(pod, &["tcp", "--addr", addr, "--count", &count.to_string()])
}

#[test]
fn tcp_through_the_cluster_ip_reaches_a_pod_on_its_target_port() -> Result<()> {
    let w = web()?;
    let s = tcp(&w.c, &w.client, "10.96.0.10:80", 1)?;
    assert_eq!(s.ok, 1, "{s:?}");
    let reply = s.replies.keys().next().unwrap();
    assert!(["pod-a", "pod-b", "pod-c"].contains(&reply.as_str()), "{s:?}");
    // Nothing listens on port 80 of the pods: the port was translated too.
    let direct = tcp(&w.c, &w.client, &format!("{}:80", w.backends[0].ip), 1)?;
    assert_eq!(direct.errors.get("ECONNREFUSED"), Some(&1), "{direct:?}");
    Ok(())
}

#[test]
fn connections_spread_over_the_three_pods() -> Result<()> {
    let w = web()?;
    let s = tcp(&w.c, &w.client, "10.96.0.10:80", 300)?;
    assert_eq!(s.ok, 300, "{s:?}");
    for pod in ["pod-a", "pod-b", "pod-c"] {
        let n = s.replies.get(pod).copied().unwrap_or(0);
        assert!((60..=141).contains(&n), "{pod} got {n} of 300 (want 20%..47%): {s:?}");
    }
    Ok(())
}

#[test]
fn an_address_that_is_no_cluster_ip_is_left_alone() -> Result<()> {
    let w = web()?;
    let s = tcp(&w.c, &w.client, &format!("{}:8080", w.backends[1].ip), 20)?;
    assert_eq!(s.replies.get("pod-b"), Some(&20), "{s:?}");
    Ok(())
}

#[test]
fn no_endpoints_is_connection_refused_not_a_timeout() -> Result<()> {
    let mut c = Cluster::new(1)?;
    let client = c.add_pod(1, "client")?;
    let backend = c.add_pod(1, "pod-a")?;
    c.serve(&backend, 8080)?;
    c.write_object("empty.yaml", &service("empty", "10.96.0.11", &[("http", 80, 8080, "TCP")]))?;
    c.start_agent(1)?;
    c.wait_programmed("10.96.0.11", 80, "TCP", Some(&[]))?;
    let s = tcp(&c, &client, "10.96.0.11:80", 5)?;
    assert_eq!(s.ok, 0, "{s:?}");
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&5), "ECONNREFUSED, not EPERM nor ETIMEDOUT: {s:?}");

    // Adding the endpoint file turns refused into success...
    c.write_object("empty-slice.yaml", &slice("empty", "empty-1", &[("http", 8080, "TCP")], &[(&backend.ip, "node-1", true)]))?;
    c.wait_programmed("10.96.0.11", 80, "TCP", Some(&[&format!("{}:8080", backend.ip)]))?;
    let s = tcp(&c, &client, "10.96.0.11:80", 5)?;
    assert_eq!(s.replies.get("pod-a"), Some(&5), "{s:?}");

    // ...and removing it turns success back into refused.
    c.remove_object("empty-slice.yaml")?;
    c.wait_programmed("10.96.0.11", 80, "TCP", Some(&[]))?;
    let s = tcp(&c, &client, "10.96.0.11:80", 5)?;
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&5), "{s:?}");
    Ok(())
}

#[test]
fn a_cluster_ip_on_a_port_that_is_no_service_port_is_refused() -> Result<()> {
    let w = web()?;
    let s = tcp(&w.c, &w.client, "10.96.0.10:81", 3)?;
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&3), "{s:?}");
    Ok(())
}

#[test]
fn udp_sendto_and_recvfrom_see_the_cluster_ip() -> Result<()> {
    let w = web()?;
    // A new socket per datagram: each is balanced, each reply's source is the ClusterIP.
    let s = w.c.probe(&w.client, &["udp", "--addr", "10.96.0.10:53", "--count", "60"])?;
    assert_eq!(s.ok, 60, "{s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), ["10.96.0.10:53"], "recvfrom must report the ClusterIP: {s:?}");
    assert_eq!(s.replies.len(), 3, "60 sockets reach all three pods: {s:?}");

    // One unconnected socket sends every datagram to the same backend.
    let s = w.c.probe(&w.client, &["udp", "--addr", "10.96.0.10:53", "--count", "20", "--one-socket"])?;
    assert_eq!(s.ok, 20, "{s:?}");
    assert_eq!(s.replies.len(), 1, "stable per socket: {s:?}");
    assert_eq!(s.peers.keys().collect::<Vec<_>>(), ["10.96.0.10:53"], "{s:?}");
    Ok(())
}

#[test]
fn connected_udp_works() -> Result<()> {
    let w = web()?;
    let s = w.c.probe(&w.client, &["udp", "--addr", "10.96.0.10:53", "--count", "30", "--connected"])?;
    assert_eq!(s.ok, 30, "{s:?}");
    assert!(s.replies.keys().all(|r| r.starts_with("pod-")), "{s:?}");
    Ok(())
}

#[test]
fn a_tight_loop_sees_no_failure_while_endpoints_go_3_1_3() -> Result<()> {
    let mut w = web()?;
    let checker = w.c.add_pod(1, "checker")?;
    let c = &w.c;
    let all: Vec<&Pod> = w.backends.iter().collect();
    let bg = c.probe_bg(&w.client, &["tcp", "--addr", "10.96.0.10:80", "--count", "1000000", "--max-ms", "6000"])?;
    for _ in 0..3 {
        c.write_object("web-slice.yaml", &web_slice(c, &all[1..2]))?;
        c.wait_programmed(VIP, 80, "TCP", Some(&[&format!("{}:8080", all[1].ip)]))?;
        // Once programmed, no connect reaches a removed backend.
        let s = tcp(c, &checker, "10.96.0.10:80", 30)?;
        assert_eq!(s.replies.get("pod-b"), Some(&30), "{s:?}");
        c.write_object("web-slice.yaml", &web_slice(c, &all))?;
        let want: Vec<String> = all.iter().map(|p| format!("{}:8080", p.ip)).collect();
        let want: Vec<&str> = want.iter().map(String::as_str).collect();
        c.wait_programmed(VIP, 80, "TCP", Some(&want))?;
        std::thread::sleep(Duration::from_millis(300));
    }
    let s = Cluster::finish(bg)?;
    assert!(s.attempts > 100, "the loop ran: {s:?}");
    assert_eq!(s.failed(), 0, "{s:?}");
    Ok(())
}

#[test]
fn sigkill_keeps_traffic_flowing_and_a_restart_removes_what_vanished() -> Result<()> {
    let mut w = web()?;
    w.c.write_object("gone.yaml", &service("gone", "10.96.0.12", &[("http", 80, 8080, "TCP")]))?;
    w.c.wait_programmed("10.96.0.12", 80, "TCP", Some(&[]))?;

    // An established connection lives through the kill and the restart.
    let held = w.c.probe_bg(&w.client, &["tcp", "--addr", "10.96.0.10:80", "--hold-ms", "3000", "--interval-ms", "20"])?;
    std::thread::sleep(Duration::from_millis(300));
    w.c.kill_agent(1);
    let s = tcp(&w.c, &w.client, "10.96.0.10:80", 30)?;
    assert_eq!(s.ok, 30, "no agent, the pinned programs still balance: {s:?}");

    // Deleted while no agent runs.
    w.c.remove_object("gone.yaml")?;
    w.c.start_agent(1)?;
    assert_eq!(w.c.programmed(1, "10.96.0.12", 80, "TCP")?, None);
    let list = w.c.list(1)?;
    assert!(!list["vips"].as_array().unwrap().iter().any(|v| v == "10.96.0.12"), "{list}");
    let s = tcp(&w.c, &w.client, "10.96.0.10:80", 30)?;
    assert_eq!(s.ok, 30, "{s:?}");
    let h = Cluster::finish(held)?;
    assert!(h.attempts > 20 && h.failed() == 0, "the held connection kept working: {h:?}");
    assert_eq!(h.replies.len(), 1, "one connection, one pod: {h:?}");
    // The deleted Service's ClusterIP is no longer translated (and no longer refused):
    // the connect goes to the network, which has no route for it.
    let s = tcp(&w.c, &w.client, "10.96.0.12:80", 1)?;
    assert!(s.errors.contains_key("EHOSTUNREACH") || s.errors.contains_key("ENETUNREACH"), "{s:?}");
    Ok(())
}

#[test]
fn a_malformed_file_is_reported_and_others_keep_working() -> Result<()> {
    let w = web()?;
    w.c.write_object("broken.yaml", "apiVersion: v1\nkind: Service\nspec: [\n")?;
    w.c.write_object("other.yaml", &service("other", "10.96.0.13", &[("http", 80, 8080, "TCP")]))?;
    w.c.wait_programmed("10.96.0.13", 80, "TCP", Some(&[]))?;
    let s = tcp(&w.c, &w.client, "10.96.0.10:80", 10)?;
    assert_eq!(s.ok, 10, "{s:?}");
    let log = std::fs::read_to_string(w.c.agent_log(1))?;
    assert!(log.lines().any(|l| l.contains("ERROR") && l.contains("broken.yaml")), "{log}");
    Ok(())
}

#[test]
fn two_nodes_two_agents_reach_pods_across_nodes() -> Result<()> {
    let mut c = Cluster::new(2)?;
    let remote = c.add_pod(2, "remote")?;
    c.serve(&remote, 8080)?;
    let client1 = c.add_pod(1, "client1")?;
    let client2 = c.add_pod(2, "client2")?;
    c.write_object("svc.yaml", &service("web", VIP, WEB_PORTS))?;
    c.write_object("slice.yaml", &slice("web", "web-1", WEB_EP_PORTS, &[(&remote.ip, "node-2", true)]))?;
    c.start_agent(1)?;
    c.start_agent(2)?;
    c.wait_programmed(VIP, 80, "TCP", Some(&[&format!("{}:8080", remote.ip)]))?;
    for client in [&client1, &client2] {
        let s = tcp(&c, client, "10.96.0.10:80", 10)?;
        assert_eq!(s.replies.get("remote"), Some(&10), "{s:?}");
    }
    // Each agent owns its pins: tearing node 2 down leaves node 1 working.
    c.kill_agent(2);
    lbtest::run(lbtest::bin("lb-agent").to_str().unwrap(), &["teardown", "--bpffs", c.nodes[1].bpffs.to_str().unwrap()])?;
    // (An unpinned link's program goes after an RCU grace and a work item.)
    c.wait_for("node 2's programs off its cgroup", Duration::from_secs(3), || {
        Ok(!lbtest::run("bpftool", &["cgroup", "show", c.nodes[1].cgroup.to_str().unwrap()])?.contains("lb_connect4"))
    })?;
    let s = tcp(&c, &client1, "10.96.0.10:80", 10)?;
    assert_eq!(s.replies.get("remote"), Some(&10), "{s:?}");
    let s = tcp(&c, &client2, "10.96.0.10:80", 1)?;
    assert_eq!(s.ok, 0, "node 2 no longer translates: {s:?}");
    Ok(())
}

#[test]
fn teardown_detaches_and_unpins_everything() -> Result<()> {
    let mut w = web()?;
    let bpffs = w.c.nodes[0].bpffs.clone();
    // Not while an agent runs there (it would put its rules back): an
    // error naming it, and nothing removed.
    let out = std::process::Command::new(lbtest::bin("lb-agent"))
        .args(["teardown", "--wait-seconds", "1", "--bpffs", bpffs.to_str().unwrap()])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("an lb-agent still runs") && err.contains("lb-agent"), "{err}");
    assert!(bpffs.join(lb_common::maps::SERVICES4).exists());
    assert_eq!(tcp(&w.c, &w.client, "10.96.0.10:80", 3)?.ok, 3, "still translated");
    w.c.kill_agent(1);
    // A pin this version does not know (an agent of a newer version made
    // it; the uninstall image lags): lb's directory goes all the same.
    let future = bpffs.join("LB_FROM_A_NEWER_LB");
    lbtest::run("bpftool", &["map", "create", future.to_str().unwrap(), "type", "array", "key", "4", "value", "4", "entries", "1", "name", "lb_future"])?;
    lbtest::run(lbtest::bin("lb-agent").to_str().unwrap(), &["teardown", "--bpffs", bpffs.to_str().unwrap()])?;
    assert!(!bpffs.exists());
    // Again, or on a node where nothing is pinned and no bpffs is mounted
    // (a reboot since): nothing to do, said, and no error.
    for dir in [bpffs.clone(), std::path::PathBuf::from("/tmp/lb-never-pinned-here")] {
        let out = std::process::Command::new(lbtest::bin("lb-agent")).args(["teardown", "--bpffs", dir.to_str().unwrap()]).output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && err.contains("nothing is pinned under"), "{}: {err}", dir.display());
    }
    // (An unpinned link's program goes after an RCU grace and a work item.)
    w.c.wait_for("the programs off the cgroup", Duration::from_secs(3), || {
        Ok(!lbtest::run("bpftool", &["cgroup", "show", w.c.nodes[0].cgroup.to_str().unwrap()])?.contains("lb_connect4"))
    })?;
    let s = tcp(&w.c, &w.client, "10.96.0.10:80", 1)?;
    assert_eq!(s.ok, 0, "no longer translated: {s:?}");
    Ok(())
}

#[test]
fn bpftool_dumps_the_pinned_maps_with_field_names() -> Result<()> {
    let w = web()?;
    let dir = w.c.nodes[0].bpffs.clone();
    let dump = lbtest::run("bpftool", &["map", "dump", "pinned", dir.join("LB4_SERVICES").to_str().unwrap()])?;
    for field in ["\"addr\": [10,96,0,10", "\"port\": 80", "\"proto\": 6", "\"slot\": 0", "\"count\": 3", "\"rev_nat_id\""] {
        assert!(dump.contains(field), "{field} missing from:\n{dump}");
    }
    let dump = lbtest::run("bpftool", &["map", "dump", "pinned", dir.join("LB4_BACKENDS").to_str().unwrap()])?;
    assert!(dump.contains("\"port\": 8080") && dump.contains(&format!("\"addr\": [{}", w.backends[0].ip.replace('.', ","))), "{dump}");
    Ok(())
}

#[test]
fn a_second_agent_on_the_same_pins_is_refused() -> Result<()> {
    let w = web()?;
    let n = &w.c.nodes[0];
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", n.netns))
        .arg(lbtest::bin("lb-agent"))
        .args(["run", "--source", &format!("dir:{}", w.c.objects.display())])
        .arg("--cgroup")
        .arg(&n.cgroup)
        .arg("--bpffs")
        .arg(&n.bpffs)
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("another lb-agent is running"), "{err}");
    // It waited for the lock to go (an agent just killed may leave it to a
    // child for a moment), then named the agent that holds it.
    let pid = w.c.agent_pid(1).expect("the first agent runs");
    assert!(err.contains(&format!("held by pid {pid} (lb-agent)")), "{err}");
    assert!(err.contains("waiting up to 5s"), "{err}");
    // The first agent's programs are untouched.
    let s = tcp(&w.c, &w.client, "10.96.0.10:80", 5)?;
    assert_eq!(s.ok, 5, "{s:?}");
    Ok(())
}
