//! `lb-agent monitor`: a live stream of decisions from the programs, with
//! the reason of each; two at once; nothing left switched on by a monitor
//! killed with SIGKILL.
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Result;
use lbtest::objects::{Endpoint as E, SvcPort, service_ips, slice_of};
use lbtest::{Cluster, bin};

const SP: &[SvcPort] = &[("http", 80, 8080, "TCP")];
const EP: &[(&str, u16, &str)] = &[("http", 8080, "TCP")];

/// `lb-agent monitor` in node-1's network namespace (where the agent's
/// /frontends listens), its stdout piped.
fn monitor(c: &Cluster, args: &[&str]) -> Result<Child> {
    Ok(Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", c.nodes[0].netns))
        .arg("--")
        .arg(bin("lb-agent"))
        .args(["monitor", "--bpffs", c.nodes[0].bpffs.to_str().unwrap()])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?)
}

/// LB_MONITOR: [any monitor, slot 1, .., slot 4].
fn heartbeats(c: &Cluster) -> Result<Vec<u64>> {
    let data = aya::maps::MapData::from_pin(c.nodes[0].bpffs.join(lb_common::maps::MONITOR))?;
    let a: aya::maps::Array<_, u64> = aya::maps::Array::try_from(aya::maps::Map::Array(data))?;
    Ok((0..=lb_common::monitor::SLOTS).map(|i| a.get(&i, 0).unwrap_or(0)).collect())
}

fn lines(child: Child) -> Result<Vec<serde_json::Value>> {
    let out = child.wait_with_output()?;
    assert!(out.status.success(), "monitor failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?.lines().map(|l| serde_json::from_str(l).unwrap()).collect())
}

#[test]
fn the_monitor_shows_each_decision_with_its_reason_two_at_once_and_a_killed_one_leaves_nothing_on() -> Result<()> {
    let (mut c, p, client) = Cluster::one_node(&["pod-a"])?;
    let ep = |svc: &str, node: &str| slice_of(svc, &format!("{svc}-1"), "IPv4", EP, &[E::ready(&p[0].ip, node)]);
    c.write_object("web.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    c.write_object("web-s.yaml", &ep("web", "node-1"))?;
    c.write_object("empty.yaml", &service_ips("empty", &["10.96.0.11"], SP, ""))?;
    c.write_object("local.yaml", &service_ips("local", &["10.96.0.12"], SP, "  internalTrafficPolicy: Local\n"))?;
    c.write_object("local-s.yaml", &ep("local", "node-2"))?;
    c.write_object("aff.yaml", &service_ips("aff", &["10.96.0.13"], SP, "  sessionAffinity: ClientIP\n"))?;
    c.write_object("aff-s.yaml", &ep("aff", "node-1"))?;
    c.start_agent(1)?;
    let pod_a = format!("{}:8080", p[0].ip);
    c.wait_programmed("10.96.0.13", 80, "TCP", Some(&[&pod_a]))?;
    assert_eq!(heartbeats(&c)?, vec![0; 5], "nothing is on before a monitor runs");

    let all = monitor(&c, &["--json", "--seconds", "4"])?;
    let web = monitor(&c, &["--json", "--seconds", "4", "--service", "default/web"])?;
    c.wait_for("two monitors beating", Duration::from_secs(5), || Ok(heartbeats(&c)?.iter().filter(|h| **h != 0).count() == 3))?;
    let tcp = |addr: &str, n: u32| c.probe(&client, &["tcp", "--addr", addr, "--count", &n.to_string(), "--timeout-ms", "500"]);
    assert_eq!(tcp("10.96.0.10:80", 3)?.ok, 3);
    assert_eq!(tcp("10.96.0.11:80", 1)?.errors.get("ECONNREFUSED"), Some(&1));
    assert_eq!(tcp("10.96.0.10:81", 1)?.errors.get("ECONNREFUSED"), Some(&1));
    assert_eq!(tcp("10.96.0.12:80", 1)?.errors.get("EHOSTUNREACH"), Some(&1));
    assert_eq!(tcp("10.96.0.13:80", 2)?.ok, 2);

    let got = lines(all)?;
    let find = |front: &str| -> Vec<&serde_json::Value> { got.iter().filter(|l| l["frontend"] == front).collect() };
    let web_lines = find("10.96.0.10:80");
    assert_eq!(web_lines.len(), 3, "{got:#?}");
    for l in &web_lines {
        assert_eq!((l["hook"].as_str(), l["backend"].as_str(), l["why"].as_str()), (Some("connect"), Some(pod_a.as_str()), Some("translated")), "{l}");
        assert_eq!(l["service"], "default/web:http", "{l}");
        assert!(l["netns_cookie"].as_u64().unwrap() != 0, "{l}");
        assert!(l["errno"].is_null(), "{l}");
    }
    let one = |front: &str| -> serde_json::Value {
        let v = find(front);
        assert_eq!(v.len(), 1, "{front}: {got:#?}");
        v[0].clone()
    };
    let l = one("10.96.0.11:80");
    assert_eq!((l["errno"].as_str(), l["why"].as_str(), l["backend"].is_null()), (Some("ECONNREFUSED"), Some("no endpoints"), true), "{l}");
    let l = one("10.96.0.10:81");
    assert_eq!((l["errno"].as_str(), l["why"].as_str()), (Some("ECONNREFUSED"), Some("wrong port")), "{l}");
    let l = one("10.96.0.12:80");
    assert_eq!((l["errno"].as_str(), l["why"].as_str()), (Some("EHOSTUNREACH"), Some("no local endpoint")), "{l}");
    let aff: Vec<&str> = find("10.96.0.13:80").iter().map(|l| l["why"].as_str().unwrap()).collect();
    assert_eq!(aff, ["translated", "affinity hit"], "{got:#?}");

    // The second monitor saw the same decisions of its Service only, the
    // refusal at a port web does not have included (named by web's
    // ClusterIP).
    let only_web = lines(web)?;
    assert_eq!(only_web.len(), 4, "{only_web:#?}");
    assert_eq!(only_web.iter().filter(|l| l["service"] == "default/web:http").count(), 3, "{only_web:#?}");
    let l = &only_web[3];
    assert_eq!((l["service"].as_str(), l["frontend"].as_str(), l["why"].as_str()), (Some("default/web"), Some("10.96.0.10:81"), Some("wrong port")), "{l}");
    // Both stopped: both switched themselves off.
    assert_eq!(heartbeats(&c)?, vec![0; 5]);

    // A monitor killed with SIGKILL: its heartbeat goes stale at once (no
    // more events for it) and the agent zeroes it.
    let killed = monitor(&c, &[])?;
    c.wait_for("the monitor beating", Duration::from_secs(5), || Ok(heartbeats(&c)?[0] != 0))?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(killed.id() as i32), nix::sys::signal::Signal::SIGKILL)?;
    let mut killed = killed;
    killed.wait()?;
    c.wait_for("the agent clearing the dead monitor's heartbeat", Duration::from_secs(6), || Ok(heartbeats(&c)? == vec![0; 5]))?;
    // And a new monitor takes the free slot.
    let again = monitor(&c, &["--json", "--seconds", "2"])?;
    c.wait_for("the new monitor beating", Duration::from_secs(5), || Ok(heartbeats(&c)?[0] != 0))?;
    assert_eq!(tcp("10.96.0.10:80", 1)?.ok, 1);
    assert_eq!(lines(again)?.len(), 1);

    // A monitor whose reader goes away (`lb-agent monitor | head -1`)
    // stops at its next event and switches itself off.
    let mut piped = monitor(&c, &[])?;
    c.wait_for("the monitor beating", Duration::from_secs(5), || Ok(heartbeats(&c)?[0] != 0))?;
    assert_eq!(tcp("10.96.0.10:80", 1)?.ok, 1);
    let mut reader = std::io::BufReader::new(piped.stdout.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut reader, &mut first)?;
    assert!(first.contains("TCP 10.96.0.10:80 -> "), "{first}");
    drop(reader);
    assert_eq!(tcp("10.96.0.10:80", 1)?.ok, 1);
    c.wait_for("the monitor stopping once its reader is gone", Duration::from_secs(3), || Ok(piped.try_wait()?.is_some()))?;
    assert!(piped.wait()?.success());
    assert_eq!(heartbeats(&c)?, vec![0; 5]);
    Ok(())
}

/// An outside client's flow to an externalTrafficPolicy Local NodePort on a
/// node without a local endpoint is dropped, as kube-proxy drops it (the
/// client is told nothing): the monitor says so, not an errno nobody got.
#[test]
fn the_monitor_shows_outside_flows_dropped_for_want_of_a_local_endpoint() -> Result<()> {
    use lbtest::world::*;
    let w = world_with(&web("NodePort", "  externalTrafficPolicy: Local\n", &[]), &[])?;
    set_endpoints(&w, &[(&w.p2, E::ready)])?;
    wait_backends(&w.c, 2, "192.168.77.12", 30080, 1)?;
    // Node-1's agent, probed below, takes the same change on its own.
    wait_backends(&w.c, 1, NODE1, 30080, 1)?;
    let m = monitor(&w.c, &["--seconds", "3"])?;
    w.c.wait_for("the monitor beating", Duration::from_secs(5), || Ok(heartbeats(&w.c)?[0] != 0))?;
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &hostport(NODE1, 30080), "--count", "1", "--timeout-ms", "500"])?;
    assert_eq!(s.ok, 0, "{s:?}");
    let out = m.wait_with_output()?;
    let text = String::from_utf8(out.stdout)?;
    let tc: Vec<&str> = text.lines().filter(|l| l.contains(" tc ")).collect();
    assert!(!tc.is_empty() && tc.iter().all(|l| l.contains(&format!("TCP {NODE1}:30080 -> dropped (no local endpoint) [default/web:http]"))), "{text}");
    Ok(())
}

#[test]
fn a_malformed_service_filter_is_a_clear_error() -> Result<()> {
    let (mut c, _p, _client) = Cluster::one_node(&[])?;
    c.write_object("web.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    c.start_agent(1)?;
    let out = monitor(&c, &["--service", "web"])?.wait_with_output()?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--service web: expected NAMESPACE/NAME"), "{}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// The TC path reports new outside flows too, with the client's address,
/// in the text format by default; and `--bpf-log debug` logs them.
#[test]
fn the_monitor_shows_outside_flows_with_the_client_address() -> Result<()> {
    use lbtest::world::*;
    let w = world_with(&web("NodePort", "", &[]), &["--bpf-log", "debug"])?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let m = monitor(&w.c, &["--seconds", "3"])?;
    w.c.wait_for("the monitor beating", Duration::from_secs(5), || Ok(heartbeats(&w.c)?[0] != 0))?;
    assert_eq!(tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 2)?.ok, 2);
    let out = m.wait_with_output()?;
    let text = String::from_utf8(out.stdout)?;
    let tc: Vec<&str> = text.lines().filter(|l| l.contains(" tc ")).collect();
    assert_eq!(tc.len(), 2, "{text}");
    for l in tc {
        assert!(l.contains(&format!("client={}", w.outside.ip)) && l.contains(&format!("TCP {NODE1}:30080 -> ")), "{l}");
        assert!(l.contains(":8080 (translated) [default/web:http]"), "{l}");
    }
    let want = format!("tc TCP {NODE1}:30080 -> ");
    w.c.wait_for("the TC decisions in the agent's log", Duration::from_secs(5), || {
        Ok(std::fs::read_to_string(w.c.agent_log(1))?.lines().filter(|l| l.contains("lb_bpf") && l.contains(&want)).count() == 2)
    })?;
    Ok(())
}

/// The program's translated size of `name` attached to node-1's cgroup.
fn xlated(c: &Cluster, name: &str) -> Result<u64> {
    let out = lbtest::run("bpftool", &["-j", "cgroup", "show", c.nodes[0].cgroup.to_str().unwrap()])?;
    let v: Vec<serde_json::Value> = serde_json::from_str(&out)?;
    let id = v.iter().find(|p| p["name"] == name).unwrap_or_else(|| panic!("{name} not attached: {out}"))["id"].as_u64().unwrap();
    let p: serde_json::Value = serde_json::from_str(&lbtest::run("bpftool", &["-j", "prog", "show", "id", &id.to_string()])?)?;
    Ok(p["bytes_xlated"].as_u64().unwrap())
}

/// `--bpf-log debug`: one aya-log line per decision in the agent's log.
/// Off (the default), the log records are compiled in but removed when the
/// programs load: the loaded program is smaller, and nothing is logged.
#[test]
fn bpf_log_debug_logs_each_decision_and_off_removes_the_records() -> Result<()> {
    let (mut c, p, client) = Cluster::one_node(&["pod-a"])?;
    c.write_object("web.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    c.write_object("web-s.yaml", &slice_of("web", "web-1", "IPv4", EP, &[E::ready(&p[0].ip, "node-1")]))?;
    c.write_object("empty.yaml", &service_ips("empty", &["10.96.0.11"], SP, ""))?;
    c.start_agent(1)?;
    let pod_a = format!("{}:8080", p[0].ip);
    c.wait_programmed("10.96.0.10", 80, "TCP", Some(&[&pod_a]))?;
    let off = xlated(&c, "lb_connect4")?;
    assert_eq!(c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "2"])?.ok, 2);
    assert!(!std::fs::read_to_string(c.agent_log(1))?.contains("lb_bpf"), "nothing is logged by default");

    c.kill_agent(1);
    c.start_agent_with(1, &["--bpf-log", "debug"])?;
    c.wait_programmed("10.96.0.10", 80, "TCP", Some(&[&pod_a]))?;
    let on = xlated(&c, "lb_connect4")?;
    assert!(on > off, "the log records are removed at load when off: {off} bytes off, {on} bytes on");
    assert_eq!(c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "2"])?.ok, 2);
    assert_eq!(c.probe(&client, &["tcp", "--addr", "10.96.0.11:80", "--count", "1"])?.errors.get("ECONNREFUSED"), Some(&1));
    let want_ok = format!("connect TCP 10.96.0.10:80 -> {pod_a} (translated)");
    c.wait_for("the decisions in the agent's log", Duration::from_secs(5), || {
        let log = std::fs::read_to_string(c.agent_log(1))?;
        let bpf: Vec<&str> = log.lines().filter(|l| l.contains("lb_bpf")).collect();
        Ok(bpf.iter().filter(|l| l.contains(&want_ok)).count() == 2
            && bpf.iter().any(|l| l.contains("connect TCP 10.96.0.11:80 -> ECONNREFUSED (no endpoints)")))
    })?;
    Ok(())
}

/// The programs only some flags use (the pod programs: `--per-packet-lb`,
/// `--bpf-forward`; the XDP program: `--nodeport-acceleration xdp`) are
/// verified at the start of an agent with those flags, not of every agent
/// (they were about 0.6 s of each start); with the flags, a start verifies
/// them before it attaches anything, so a kernel that refused one would
/// stop the agent at once; and they fit the verifier with `--bpf-log debug`.
#[test]
fn optional_programs_are_verified_only_by_an_agent_whose_flags_use_them() -> Result<()> {
    let (mut c, p, client) = Cluster::one_node(&["pod-a"])?;
    c.write_object("web.yaml", &service_ips("web", &["10.96.0.10"], SP, ""))?;
    c.write_object("web-s.yaml", &slice_of("web", "web-1", "IPv4", EP, &[E::ready(&p[0].ip, "node-1")]))?;
    let dir = c.objects.clone();
    let debug = [("RUST_LOG", "lb_agent=debug")];
    // The programs each start verified, from its part of the log.
    let mut seen = 0;
    let mut start = |c: &mut Cluster, flags: &[&str]| -> Result<Vec<String>> {
        c.kill_agent(1);
        c.start_agent_env(1, &dir, flags, &debug)?;
        let log = std::fs::read_to_string(c.agent_log(1))?;
        let mine = &log[seen..];
        seen = log.len();
        let mut v: Vec<String> = mine
            .lines()
            .filter(|l| l.contains("program verified"))
            .filter_map(|l| Some(l.split("program=\"").nth(1)?.split('"').next()?.to_string()))
            .collect();
        v.sort();
        Ok(v)
    };
    let always = ["lb_connect4", "lb_connect6", "lb_nodeport_egress", "lb_nodeport_ingress", "lb_sock_egress", "lb_sock_release"];
    let optional = ["lb_nodeport_xdp", "lb_pod_egress", "lb_pod_ingress"];
    let plain = start(&mut c, &[])?;
    for name in always {
        assert!(plain.contains(&name.to_string()), "{name} is verified at every start: {plain:?}");
    }
    for name in optional {
        assert!(!plain.contains(&name.to_string()), "{name} is not verified without its flag: {plain:?}");
    }
    assert_eq!(c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "2"])?.ok, 2);

    let all = start(&mut c, &["--per-packet-lb", "--nodeport-acceleration", "xdp", "--bpf-log", "debug"])?;
    for name in always.iter().chain(&optional) {
        assert!(all.contains(&name.to_string()), "{name} is verified with the flags (and --bpf-log debug): {all:?}");
    }
    assert_eq!(c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "2"])?.ok, 2);

    let forward = start(&mut c, &["--bpf-forward"])?;
    assert!(forward.contains(&"lb_pod_ingress".to_string()), "{forward:?}");
    assert!(!forward.iter().any(|n| n == "lb_pod_egress" || n == "lb_nodeport_xdp"), "{forward:?}");
    assert_eq!(c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "2"])?.ok, 2);
    Ok(())
}

/// `--per-packet-lb`: a pod's new flows translated at its device show as
/// `pod`, with the pod's address (its network namespace cookie is no
/// socket's here); a refusal with its errno.
#[test]
fn the_monitor_shows_per_packet_pod_flows_with_the_pods_address() -> Result<()> {
    use lbtest::world::*;
    let mut w = world_with(&web("ClusterIP", "", &[]), &["--per-packet-lb"])?;
    wait_backends(&w.c, 1, "10.96.0.10", 80, 2)?;
    let vm = w.c.add_pod(1, "vm")?;
    let guest = lbtest::Pod { cgroup: Default::default(), ..vm.clone() };
    w.c.wait_for("the pod programs on the new pod's device", Duration::from_secs(5), || Ok(tcp(&w.c, &guest, "10.96.0.10:80", 1)?.ok == 1))?;
    let m = monitor(&w.c, &["--seconds", "3"])?;
    w.c.wait_for("the monitor beating", Duration::from_secs(5), || Ok(heartbeats(&w.c)?[0] != 0))?;
    assert_eq!(tcp(&w.c, &guest, "10.96.0.10:80", 2)?.ok, 2);
    assert_eq!(tcp(&w.c, &guest, "10.96.0.10:81", 1)?.errors.get("ECONNREFUSED"), Some(&1));
    let out = m.wait_with_output()?;
    let text = String::from_utf8(out.stdout)?;
    let pod: Vec<&str> = text.lines().filter(|l| l.contains(" pod ")).collect();
    assert_eq!(pod.len(), 3, "{text}");
    for l in &pod[..2] {
        assert!(l.contains(&format!("pod     client={} TCP 10.96.0.10:80 -> ", vm.ip)) && l.contains(":8080 (translated) [default/web:http]"), "{l}");
    }
    assert!(pod[2].contains(&format!("client={} TCP 10.96.0.10:81 -> ECONNREFUSED (wrong port)", vm.ip)), "{}", pod[2]);
    Ok(())
}

/// Drops for loadBalancerSourceRanges show with the client and the
/// frontend: an outside client's at the TC program, a pod's and the
/// node's own at the cgroup egress program (the socket hooks translated
/// them before the source was known); the node's sender is told EPERM.
#[test]
fn the_monitor_shows_source_range_drops_with_the_client_address() -> Result<()> {
    use lbtest::world::*;
    let w = world_with(&web("LoadBalancer", "  loadBalancerSourceRanges: [\"192.0.2.0/24\"]\n", &[LB_IP]), &[])?;
    wait_backends(&w.c, 1, LB_IP, 80, 2)?;
    let m = monitor(&w.c, &["--seconds", "3"])?;
    w.c.wait_for("the monitor beating", Duration::from_secs(5), || Ok(heartbeats(&w.c)?[0] != 0))?;
    let lb = format!("{LB_IP}:80");
    let short = |pod: &lbtest::Pod, proto: &str| w.c.probe(pod, &[proto, "--addr", &lb, "--count", "1", "--timeout-ms", "300"]);
    assert_eq!(short(&w.outside, "tcp")?.ok, 0);
    assert_eq!(short(&w.p1, "tcp")?.ok, 0);
    assert_eq!(short(&w.c.host(1), "udp")?.errors.get("EPERM"), Some(&1));
    let out = m.wait_with_output()?;
    let text = String::from_utf8(out.stdout)?;
    let has = |want: &str| text.lines().any(|l| l.contains(want) && l.ends_with("(source range) [default/web:http]"));
    assert!(has(&format!("tc      client={CLIENT} TCP {lb} -> dropped")), "{text}");
    assert!(has(&format!("egress  client={} TCP {lb} -> dropped", w.p1.ip)), "{text}");
    // The node's source: its address toward pod-2's node, the pod
    // bridge's toward pod-1.
    let node = |ip: &str| text.lines().any(|l| l.contains(&format!("egress  client={ip} UDP {lb} -> EPERM (source range) [default/web:dns]")));
    assert!(node(NODE1) || node("10.244.1.1"), "{text}");
    Ok(())
}

/// A monitor whose reader falls behind loses events once its ring buffer
/// (256 KiB, about 2,700 events) is full: the programs count them for
/// that monitor and the monitor says how many, on stderr. Here it is
/// stopped (SIGSTOP) while a burst of datagrams runs: its heartbeat stays
/// fresh for up to a second, so the programs go on sending to it.
#[test]
fn a_monitor_says_how_many_events_its_full_ring_buffer_lost() -> Result<()> {
    use nix::sys::signal::{Signal, kill};
    let (mut c, p, client) = Cluster::one_node(&["pod-a"])?;
    c.serve_tiny(&p[0], 9000, 1)?;
    c.write_object("tiny.yaml", &service_ips("tiny", &["10.96.0.20"], &[("t", 80, 9000, "TCP"), ("u", 53, 9053, "UDP")], ""))?;
    c.write_object("tiny-s.yaml", &slice_of("tiny", "tiny-1", "IPv4", &[("t", 9000, "TCP"), ("u", 9053, "UDP")], &[E::ready(&p[0].ip, "node-1")]))?;
    c.start_agent(1)?;
    c.wait_programmed("10.96.0.20", 53, "UDP", Some(&[&format!("{}:9053", p[0].ip)]))?;
    let mut m = monitor(&c, &[])?;
    c.wait_for("the monitor beating", Duration::from_secs(5), || Ok(heartbeats(&c)?[0] != 0))?;
    // Its output read as it comes (else the pipe, not the ring, would fill).
    let mut out = m.stdout.take().unwrap();
    let drain = std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    let pid = nix::unistd::Pid::from_raw(m.id() as i32);
    kill(pid, Signal::SIGSTOP)?;
    // Unconnected datagrams, each an event of the sendmsg hook: tens of
    // thousands in 0.7 s. (Connects, about 2,500 of them in 0.7 s on a busy
    // run and 1,800 a second per client on a busier one, did not always
    // outnumber the ring's 2,700 events.)
    let o = c.probe_cmd(&client).args(["udp-blast", "--addr", "10.96.0.20:53", "--secs", "0.7"]).output()?;
    kill(pid, Signal::SIGCONT)?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).map_err(|e| anyhow::anyhow!("{e}: {}", String::from_utf8_lossy(&o.stderr)))?;
    let made = v["sent"].as_u64().unwrap_or(0);
    assert!(made > 10_000, "a burst larger than the ring buffer: {v}");
    std::thread::sleep(Duration::from_millis(1500));
    kill(pid, Signal::SIGTERM)?;
    let out = m.wait_with_output()?;
    let _ = drain.join();
    let err = String::from_utf8_lossy(&out.stderr);
    let lost: u64 = err
        .lines()
        .find_map(|l| l.strip_prefix("lb-agent monitor: ")?.split_once(" events lost")?.0.parse().ok())
        .unwrap_or_else(|| panic!("no lost events said: {err}"));
    assert!(lost > 0 && lost < made, "{lost} of {made}: {err}");
    let (_, metrics) = c.http(1, "127.0.0.1:10249", "/metrics")?;
    assert!(metrics.contains("lb_datapath_events_total{result=\"monitor_lost_1\"}"), "{metrics}");
    Ok(())
}
