//! The DaemonSet's container as the test subject: the pod spec read from
//! deploy/daemonset.yaml, translated by `lbtest::podspec` into the `podman
//! run` commands kubelet's view of it becomes, run from the image `cargo
//! xtask image` builds (localhost/lb-agent:dev) inside the netns
//! mini-cluster: hostNetwork is node-1's netns, the ConfigMap names the API
//! stand-in (TLS, in node-1's netns), the service-account directory is
//! mounted where kubelet mounts the projected token, and the hostPaths are
//! a test bpffs directory and the node's test cgroup.
//!
//! Without the image these tests fail (never skip): run `cargo xtask image`.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::apps::v1::DaemonSet;
use lbtest::objects::{SvcPort, node, service, slice};
use lbtest::podspec::{self, IMAGE, PodContext, podman};
use lbtest::{ApiServer, Cluster, Pod, Summary, bin};

const VIP: &str = "10.96.0.10";
const SP: &[SvcPort] = &[("http", 80, 8080, "TCP")];
const EP: &[(&str, u16, &str)] = &[("http", 8080, "TCP")];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn be(p: &Pod) -> String {
    format!("{}:8080", p.ip)
}

fn slice_for(pods: &[&Pod]) -> String {
    let eps: Vec<(&str, &str, bool)> = pods.iter().map(|p| (p.ip.as_str(), "node-1", true)).collect();
    slice("web", "web-1", EP, &eps)
}

fn names(s: &Summary) -> BTreeSet<&str> {
    s.replies.keys().map(String::as_str).collect()
}

fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

fn tcp(c: &Cluster, pod: &Pod, n: u32) -> Result<Summary> {
    c.probe(pod, &["tcp", "--addr", &format!("{VIP}:80"), "--count", &n.to_string()])
}

/// The image must be there: a missing image is a failure that says what to
/// do, never a skipped test.
fn require_image() {
    assert!(
        podspec::image_exists(IMAGE),
        "{IMAGE} is missing: run `cargo xtask image` first (it builds the image from the release binaries, with no \
         registry; `cargo xtask e2e-container` and `cargo xtask test` do it for you)"
    );
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Containers that tests of this file named (lbt-PID-...) in a process that
/// died without removing them. Before the cluster starts: its own reaping
/// removes the dead processes' bpffs directories, which those agents use.
fn reap_dead_containers() {
    let Ok(out) = podman().args(["ps", "-a", "--format", "{{.Names}}"]).output() else { return };
    for name in String::from_utf8_lossy(&out.stdout).lines() {
        let owner = name.strip_prefix("lbt-").and_then(|r| r.split('-').next()).and_then(|p| p.parse::<u32>().ok());
        if owner.is_some_and(|p| !pid_alive(p)) {
            let _ = podman().args(["rm", "-f", "-t", "0", name]).output();
        }
    }
}

/// The podman containers a test named, removed (`podman rm -f`) on drop,
/// also when the test fails; unless the test passed (a panic, or an error
/// returned with `?`), their logs are printed first.
#[derive(Default)]
struct Containers {
    names: Mutex<Vec<String>>,
    passed: AtomicBool,
}

impl Containers {
    fn add(&self, name: &str) {
        self.names.lock().unwrap().push(name.to_string());
    }
}

impl Drop for Containers {
    fn drop(&mut self) {
        let failed = std::thread::panicking() || !self.passed.load(Ordering::SeqCst);
        for name in self.names.lock().unwrap().iter() {
            // Init containers (--rm) are gone already.
            let exists = podman().args(["container", "exists", name]).status().is_ok_and(|s| s.success());
            if !exists {
                continue;
            }
            if failed {
                eprintln!("--- podman logs {name} ---\n{}", logs(name));
            }
            let _ = podman().args(["rm", "-f", "-t", "0", name]).output();
        }
    }
}

/// What the container wrote to stdout and stderr ("" once it is removed).
fn logs(name: &str) -> String {
    match podman().args(["logs", name]).output() {
        Ok(o) => format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
        Err(e) => format!("podman logs {name}: {e}"),
    }
}

fn running(name: &str) -> bool {
    podman()
        .args(["inspect", "--format", "{{.State.Running}}", name])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "true")
}

/// The test's bpffs directory on the host, /sys/fs/bpf/<cluster id>-ctr
/// (the pod's /sys/fs/bpf). On drop, after the containers are gone: `lb-agent
/// teardown` of the pins in it, inside the node's netns (where the TC
/// programs are attached), then the directory is removed.
struct TestBpffs {
    dir: PathBuf,
    netns: String,
}

impl TestBpffs {
    fn create(c: &Cluster) -> Result<Self> {
        let dir = PathBuf::from("/sys/fs/bpf").join(format!("{}-ctr", c.id));
        std::fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
        Ok(TestBpffs { dir, netns: c.nodes[0].netns.clone() })
    }

    /// Where the agent's --bpffs=/sys/fs/bpf/lb lands on the host.
    fn pins(&self) -> PathBuf {
        self.dir.join("lb")
    }
}

impl Drop for TestBpffs {
    fn drop(&mut self) {
        if self.pins().exists()
            && let Err(e) = lbtest::teardown_in(&self.netns, &self.pins())
        {
            eprintln!("{e:#}");
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("remove {}: {e}", self.dir.display());
        }
    }
}

/// One node with pod-a and pod-b serving on 8080 and a client pod; Service
/// web on VIP:80 -> 8080 with both; the API stand-in with TLS in node-1's
/// netns; the test bpffs directory; deploy/daemonset.yaml, parsed.
/// Fields drop in order: containers, then the pins (teardown in the node's
/// netns), then the API server, then the cluster.
struct World {
    ctrs: Containers,
    bpffs: TestBpffs,
    api: ApiServer,
    c: Cluster,
    pods: Vec<Pod>,
    client: Pod,
    ds: DaemonSet,
}

fn setup() -> Result<World> {
    require_image();
    reap_dead_containers();
    let ds = podspec::daemonset_from_yaml(&std::fs::read_to_string(root().join("deploy/daemonset.yaml"))?)?;
    let (c, pods, client) = Cluster::one_node(&["pod-a", "pod-b"])?;
    let bpffs = TestBpffs::create(&c)?;
    c.write_object("node.yaml", &node("node-1", "zone-a"))?;
    c.write_object("svc.yaml", &service("web", VIP, SP))?;
    c.write_object("slice.yaml", &slice_for(&[&pods[0], &pods[1]]))?;
    let api = c.start_apiserver(1, true)?;
    Ok(World { ctrs: Containers::default(), bpffs, api, c, pods, client, ds })
}

impl World {
    /// The end of a test that passed: the containers go without their logs.
    fn pass(&self) -> Result<()> {
        self.ctrs.passed.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// What node-1 gives the pod `pod_name`, as kubelet would.
    fn pod_context(&self, pod_name: &str) -> Result<PodContext> {
        let n = &self.c.nodes[0];
        let mut ctx = PodContext::new(&n.name, pod_name, &n.netns);
        // The ConfigMap lb-agent-config: the stand-in's address, as
        // deploy/kustomization.yaml names the real API server.
        let (host, port) = self.api.addr.rsplit_once(':').context("API server address")?;
        ctx.config_maps.insert(
            "lb-agent-config".into(),
            [("KUBERNETES_SERVICE_HOST", host.trim_matches(['[', ']'])), ("KUBERNETES_SERVICE_PORT", port)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        ctx.host_paths.insert("/sys/fs/bpf".into(), self.bpffs.dir.display().to_string());
        ctx.host_paths.insert("/sys/fs/cgroup".into(), n.cgroup.display().to_string());
        ctx.run_images_as(&self.ds, IMAGE);
        ctx.service_account = Some(self.api.tls_dir.as_ref().context("the stand-in has TLS")?.display().to_string());
        Ok(ctx)
    }

    /// Run the pod `pod_name` as kubelet would: the hostPath directories,
    /// each init container to completion (it must succeed), then the
    /// containers, detached. Returns the agent container's name.
    fn start_pod(&self, pod_name: &str) -> Result<String> {
        let pod = podspec::pod_runs(&self.ds, &self.pod_context(pod_name)?)?;
        for d in &pod.mkdirs {
            assert!(Path::new(d).starts_with(&self.bpffs.dir), "a hostPath outside the test's directories: {d}");
            std::fs::create_dir_all(d)?;
        }
        let mut agent = None;
        for r in &pod.runs {
            self.ctrs.add(&r.name);
            let t = Instant::now();
            let out = Command::new("podman").args(&r.args).output().context("spawn podman")?;
            if !out.status.success() {
                bail!(
                    "{} container {} ({}): {}\n{}{}",
                    if r.init { "init" } else { "the" },
                    r.container,
                    r.name,
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            eprintln!("{} ({}) started in {:.1?}", r.name, if r.init { "init, ran to completion" } else { "detached" }, t.elapsed());
            if r.container == "lb-agent" {
                agent = Some(r.name.clone());
            }
        }
        agent.context("the pod spec has no lb-agent container")
    }

    /// Wait until the container's log holds `what`; fail at once when the
    /// container exits. Returns the log.
    fn wait_log(&self, name: &str, what: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let text = logs(name);
            if text.contains(what) {
                return Ok(text);
            }
            if !running(name) {
                bail!("container {name} is not running (waiting for {what:?}):\n{text}");
            }
            if Instant::now() > deadline {
                bail!("container {name}: no {what:?} within {timeout:?}:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The backends programmed for VIP:80/TCP in the pins on the host, as
    /// `ip:port` (sorted), or None when it is not programmed.
    fn programmed(&self) -> Result<Option<Vec<String>>> {
        let out = lbtest::run(bin("lb-agent").to_str().unwrap(), &["list", "--json", "--bpffs", self.bpffs.pins().to_str().unwrap()])?;
        let v: serde_json::Value = serde_json::from_str(&out)?;
        let f = v["frontends"].as_array().into_iter().flatten().find(|f| f["address"] == VIP && f["port"] == 80 && f["protocol"] == "TCP");
        Ok(f.map(|f| {
            let mut b: Vec<String> = f["backends"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|b| format!("{}:{}", b["address"].as_str().unwrap_or(""), b["port"]))
                .collect();
            b.sort();
            b
        }))
    }

    fn wait_backends(&self, want: &[&Pod], secs: u64) -> Result<()> {
        let mut want: Vec<String> = want.iter().map(|p| be(p)).collect();
        want.sort();
        self.c.wait_for(&format!("{VIP}:80 = {want:?} in the pins"), Duration::from_secs(secs), || Ok(self.programmed()? == Some(want.clone())))
    }

    /// Start the pod and wait for the agent's first full sync and for both
    /// pods to be programmed. Returns the agent container's name and its log.
    fn start_synced(&self, pod_name: &str) -> Result<(String, String)> {
        let t = Instant::now();
        let agent = self.start_pod(pod_name)?;
        let log = self.wait_log(&agent, "initial sync complete", Duration::from_secs(60))?;
        eprintln!("{agent}: initial sync complete {:.1?} after the pod started", t.elapsed());
        Ok((agent, log))
    }
}

/// (1) The pod runs from the spec and serves the ClusterIP; (2) health and
/// metrics answer in the node's netns; (3) the pins are the host's.
#[test]
fn the_daemonset_pod_serves_the_cluster_ip_with_health_metrics_and_pins_on_the_host() -> Result<()> {
    let w = setup()?;
    // kube-proxy's rules left on the node: the image's own iptables finds
    // them (below).
    w.c.in_netns(&w.c.nodes[0].netns, &["iptables-nft", "-t", "nat", "-N", "KUBE-SERVICES"])?;
    let started = Instant::now();
    let (agent, log) = w.start_synced(&w.c.id)?;
    // In-cluster configuration: the URL from the ConfigMap's
    // KUBERNETES_SERVICE_HOST/PORT; the stand-in answers 401 without the
    // mounted token, so the sync also proves the token and CA were read.
    assert!(log.contains(&format!("https://{}", w.api.addr)), "the in-cluster URL: {log}");
    w.wait_backends(&[&w.pods[0], &w.pods[1]], 10)?;
    let s = tcp(&w.c, &w.client, 40)?;
    assert_eq!(s.ok, 40, "{s:?}");
    assert_eq!(names(&s), ["pod-a", "pod-b"].into(), "{s:?}");
    eprintln!("serving {:.1?} after the pod started", started.elapsed());

    // (2) The DaemonSet's --healthz-bind=0.0.0.0:10256 and the default
    // metrics address 127.0.0.1:10249, in the node's network namespace.
    let (code, body) = w.c.http(1, "127.0.0.1:10256", "/healthz")?;
    assert_eq!(code, 200, "{body}");
    let (code, body) = w.c.http(1, "127.0.0.1:10256", "/readyz")?;
    assert_eq!(code, 200, "the pod's readiness probe: {body}");
    let (code, m) = w.c.http(1, "127.0.0.1:10249", "/metrics")?;
    assert_eq!(code, 200, "{m}");
    assert_eq!(metric(&m, "lb_services"), Some(1.0), "{m}");
    assert!(metric(&m, "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}").is_some_and(|n| n >= 1.0), "{m}");
    // hostPID: the agent sees the pods' processes in the cgroup.
    assert_eq!(metric(&m, "lb_cgroup_processes_invisible"), Some(0.0), "{m}");
    // The agent's look for kube-proxy's rules works in the image.
    w.c.wait_for("lb_kube_proxy_rules", Duration::from_secs(10), || {
        Ok(metric(&w.c.http(1, "127.0.0.1:10249", "/metrics")?.1, "lb_kube_proxy_rules{mode=\"iptables-nft\"}") == Some(1.0))
    })?;
    let log = w.wait_log(&agent, "kube-proxy's rules are on this node", Duration::from_secs(10))?;
    assert!(log.contains("iptables-nft (nat KUBE-SERVICES)"), "{log}");

    // (3) --bpffs=/sys/fs/bpf/lb in the container is <dir>/lb on the host,
    // and the host's bpftool reads the entries the agent wrote.
    let pin = w.bpffs.pins().join("LB4_SERVICES");
    assert!(pin.exists(), "{} is not pinned on the host", pin.display());
    let dump = lbtest::run("bpftool", &["-j", "map", "dump", "pinned", pin.to_str().unwrap()])?;
    let entries: Vec<serde_json::Value> = serde_json::from_str(&dump).with_context(|| format!("bpftool output {dump:?}"))?;
    // web: its service slot and one slot per backend, at least.
    assert!(entries.len() >= 3, "LB4_SERVICES as the host sees it: {dump}");

    // The init container's check (not its mount fallback) is what passed:
    // with the init container's own mounts, /sys/fs/bpf is a bpffs.
    let pod = podspec::pod_runs(&w.ds, &w.pod_context(&format!("{}-check", w.c.id))?)?;
    let init = pod.runs.iter().find(|r| r.init).context("the pod spec has no init container")?;
    let mut args = init.args.clone();
    *args.last_mut().unwrap() = "stat -f -c %T /sys/fs/bpf".into();
    w.ctrs.add(&init.name);
    let out = Command::new("podman").args(&args).output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "bpf_fs", "{}", String::from_utf8_lossy(&out.stderr));
    w.pass()
}

/// (4) SIGKILL of the agent's container, and seconds with no agent at all:
/// no connect fails. (5) A new pod from the same spec adopts the pins and
/// then follows an endpoint change.
#[test]
fn a_sigkilled_agent_container_drops_no_connect_and_the_next_pod_adopts_the_pins() -> Result<()> {
    let w = setup()?;
    let (first, _) = w.start_synced(&w.c.id)?;
    w.wait_backends(&[&w.pods[0], &w.pods[1]], 10)?;

    const MAX_MS: u64 = 8000;
    let probe_started = Instant::now();
    let bg = w.c.probe_bg(
        &w.client,
        &["tcp", "--addr", &format!("{VIP}:80"), "--count", "1000000", "--interval-ms", "5", "--max-ms", &MAX_MS.to_string()],
    )?;
    std::thread::sleep(Duration::from_millis(1000));
    let out = podman().args(["kill", "--signal", "KILL", &first]).output()?;
    assert!(out.status.success(), "podman kill: {}", String::from_utf8_lossy(&out.stderr));
    w.c.wait_for("the killed container to stop", Duration::from_secs(10), || Ok(!running(&first)))?;
    let killed = Instant::now();
    // No agent at all for a few seconds; the pinned programs serve alone.
    std::thread::sleep(Duration::from_secs(3));
    assert!(!running(&first));
    let gap_end = probe_started.elapsed();
    assert!(gap_end < Duration::from_millis(MAX_MS - 500), "the client must outlast the gap ({gap_end:?}); raise MAX_MS");

    // (5) The next pod (init container again, then the agent, as a rollout
    // replaces the pod) adopts what the killed one pinned, while the client
    // keeps connecting.
    let second_pod = format!("{}-2", w.c.id);
    let (second, log) = w.start_synced(&second_pod)?;
    let no_agent = killed.elapsed();
    let s = Cluster::finish(bg)?;
    eprintln!(
        "{} connects, {} failed, across the kill, {no_agent:.1?} with no agent (until the new one synced) and after",
        s.attempts,
        s.failed()
    );
    assert!(s.attempts > 300, "{s:?}");
    assert_eq!(s.failed(), 0, "connects failed across the kill, the time with no agent and the new pod's start: {s:?}");
    assert_eq!(names(&s), ["pod-a", "pod-b"].into(), "{s:?}");
    assert!(log.contains("adopted pinned state"), "the new agent adopted the pins: {log}");
    assert_ne!(first, second);
    w.c.write_object("slice.yaml", &slice_for(&[&w.pods[0]]))?;
    w.wait_backends(&[&w.pods[0]], 10)?;
    let s = tcp(&w.c, &w.client, 40)?;
    assert_eq!(s.ok, 40, "{s:?}");
    assert_eq!(names(&s), ["pod-a"].into(), "only pod-a after the change: {s:?}");
    w.pass()
}

/// (6) A connection held through the ClusterIP to a pod whose endpoint
/// leaves (not ready first, as a dying pod's is) is destroyed by the agent
/// in its container (hostPID: it finds the client's netns through /proc):
/// it fails at once with ECONNABORTED or ECONNRESET, not after a timeout.
#[test]
fn the_containerized_agent_destroys_a_held_connection_to_a_removed_endpoint() -> Result<()> {
    let w = setup()?;
    w.start_synced(&w.c.id)?;
    w.wait_backends(&[&w.pods[0], &w.pods[1]], 10)?;

    const HOLD_MS: u64 = 8000;
    let held = w.c.probe_bg(&w.client, &["tcp", "--addr", &format!("{VIP}:80"), "--hold-ms", &HOLD_MS.to_string(), "--interval-ms", "50"])?;
    let held_started = Instant::now();
    // Which pod: the socket LB connected the socket to the pod's address,
    // which sock_diag (ss) shows in the client's netns.
    let mut target = None;
    w.c.wait_for("the held connection in the client's netns", Duration::from_secs(5), || {
        let out = w.c.in_netns(&w.client.netns, &["ss", "-Htn", "state", "established"])?;
        target = w.pods.iter().find(|p| out.split_whitespace().any(|t| t == be(p))).cloned();
        Ok(target.is_some())
    })?;
    let target = target.unwrap();
    let other = w.pods.iter().find(|p| p.name != target.name).unwrap().clone();
    std::thread::sleep(Duration::from_millis(300));

    // Not ready first (kept: kube-proxy keeps TCP to an endpoint that
    // is not ready, and to a ready one that leaves), then gone.
    w.c.write_object("slice.yaml", &slice("web", "web-1", EP, &[(target.ip.as_str(), "node-1", false), (other.ip.as_str(), "node-1", true)]))?;
    w.wait_backends(&[&other], 10)?;
    let removed = Instant::now();
    w.c.write_object("slice.yaml", &slice_for(&[&other]))?;
    w.wait_backends(&[&other], 10)?;
    let s = Cluster::finish(held)?;
    let took = removed.elapsed();
    eprintln!("the connection to {} ended {took:.1?} after its endpoint was removed: {:?}", target.name, s.errors);
    assert!(
        held_started.elapsed() < Duration::from_millis(HOLD_MS - 2000),
        "the held connection lasted to the end of its hold: not destroyed: {s:?}"
    );
    assert!(took < Duration::from_secs(3), "the held connection ended {took:?} after the endpoint left: {s:?}");
    assert!(s.ok > 0, "{s:?}");
    assert_eq!(names(&s), [target.name.as_str()].into(), "{s:?}");
    assert_eq!(s.failed(), 1, "{s:?}");
    assert!(
        s.errors.keys().all(|e| e == "ECONNABORTED" || e == "ECONNRESET"),
        "a prompt error, not a timeout: {s:?}"
    );
    assert!(s.max_fail_ms < 1000, "{s:?}");
    // The client sees the error as the socket is destroyed, a moment
    // before the agent counts it.
    w.c.wait_for("lb_sockets_destroyed_total >= 1", Duration::from_secs(3), || {
        let (_, m) = w.c.http(1, "127.0.0.1:10249", "/metrics")?;
        Ok(metric(&m, "lb_sockets_destroyed_total").is_some_and(|n| n >= 1.0))
    })?;
    // The client's new connections go to the pod that stayed.
    let s = tcp(&w.c, &w.client, 10)?;
    assert_eq!(names(&s), [other.name.as_str()].into(), "{s:?}");
    w.pass()
}

/// Uninstalling: the agent's pod goes (as `kubectl delete -k deploy/`), its
/// programs keep serving from the pins; then the pod spec of
/// deploy/uninstall/ runs on the node and leaves it clean: no pins, no
/// programs on the cgroup, the reserved NodePort range given back.
#[test]
fn the_uninstall_daemon_set_leaves_the_node_clean() -> Result<()> {
    let w = setup()?;
    let (agent, _) = w.start_synced(&w.c.id)?;
    w.wait_backends(&[&w.pods[0], &w.pods[1]], 10)?;
    let netns = &w.c.nodes[0].netns;
    let reserved = || -> Result<String> { Ok(w.c.in_netns(netns, &["cat", "/proc/sys/net/ipv4/ip_local_reserved_ports"])?.trim().to_string()) };
    assert!(reserved()?.contains("30000-32767"), "{}", reserved()?);
    // The DaemonSet is deleted: SIGTERM, the agent exits, traffic goes on.
    let out = podman().args(["stop", "-t", "10", &agent]).output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let s = tcp(&w.c, &w.client, 10)?;
    assert_eq!(s.ok, 10, "the pinned programs serve without an agent: {s:?}");

    let un = podspec::daemonset_from_yaml(&std::fs::read_to_string(root().join("deploy/uninstall/daemonset.yaml"))?)?;
    let pod = podspec::pod_runs(&un, &w.pod_context(&format!("{}-cleanup", w.c.id))?)?;
    for r in &pod.runs {
        w.ctrs.add(&r.name);
        let out = Command::new("podman").args(&r.args).output().context("spawn podman")?;
        assert!(out.status.success(), "{} ({}): {}{}", r.container, r.name, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    assert!(!w.bpffs.pins().exists(), "the pins are gone: {:?}", std::fs::read_dir(&w.bpffs.dir)?.flatten().map(|e| e.file_name()).collect::<Vec<_>>());
    let attached = lbtest::run("bpftool", &["cgroup", "show", w.c.nodes[0].cgroup.to_str().unwrap()])?;
    assert!(!attached.contains("lb_"), "no program left on the cgroup: {attached}");
    assert!(!reserved()?.contains("30000-32767"), "the NodePort range is given back: {}", reserved()?);
    w.pass()
}
