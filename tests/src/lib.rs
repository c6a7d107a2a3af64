//! The netns mini-cluster: nodes, pods and clients made of network
//! namespaces on one machine, with one `lb-agent` per node.
//!
//! - a fabric netns: the physical network, a bridge with no uplink;
//! - a node netns per node, with its own cgroup and bpffs directory;
//! - pod netns behind veth pairs on the node's bridge, with routes between
//!   the nodes' pod CIDRs.
//!
//! No netns has a route off the machine. Everything is torn down on drop,
//! also when a test panics; leftovers of test processes that died are
//! removed by the next cluster that starts.
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

/// Every document of a YAML stream as JSON values. The inputs are this
/// project's own fixtures (up to 10,000 Services in a file), so
/// serde-saphyr's budgets for untrusted config files are off.
pub fn yaml_docs(text: &str) -> std::result::Result<Vec<serde_json::Value>, serde_saphyr::Error> {
    let mut o = serde_saphyr::Options::default();
    o.budget = None;
    serde_saphyr::from_multiple_with_options(text, o)
}

pub mod bpfprog;
pub mod btfmap;
pub mod objects;
pub mod podspec;
pub mod raw;
pub mod tunnel;
pub mod world;

static COUNTER: AtomicU32 = AtomicU32::new(0);
const PREFIX: &str = "lbt";

/// Run a command; fail with its stderr.
pub fn run(cmd: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(cmd).args(args).output().with_context(|| format!("spawn {cmd}"))?;
    if !out.status.success() {
        bail!("{cmd} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `lb-agent teardown --bpffs BPFFS` inside network namespace `netns`,
/// where the agent ran: its TC filters and its reserved ports are there.
pub fn teardown_in(netns: &str, bpffs: &Path) -> Result<()> {
    let bpffs = bpffs.to_str().context("bpffs path")?;
    run("nsenter", &[&format!("--net=/run/netns/{netns}"), "--", bin("lb-agent").to_str().context("lb-agent path")?, "teardown", "--bpffs", bpffs])
        .map(drop)
}

fn ip(args: &[&str]) -> Result<()> {
    run("ip", args).map(|_| ())
}

fn cgroup2_root() -> Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts")?;
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && f[2] == "cgroup2").then(|| PathBuf::from(f[1]))
        })
        .context("no cgroup2 mount")
}

/// A memory cgroup of the test's own, with a limit, in the hierarchy that
/// holds the memory controller for this process (cgroup v1 on a hybrid
/// host, else v2), below this process's own; removed on drop (after the
/// processes in it have ended).
pub struct MemCgroup {
    pub dir: PathBuf,
    usage_file: &'static str,
}

impl MemCgroup {
    pub fn new(limit: u64) -> Result<Self> {
        let own = std::fs::read_to_string("/proc/self/cgroup")?;
        let v1 = own.lines().find_map(|l| {
            let f: Vec<&str> = l.splitn(3, ':').collect();
            (f.len() == 3 && f[1].split(',').any(|c| c == "memory")).then(|| f[2].to_string())
        });
        let name = format!("{PREFIX}-mem-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::SeqCst));
        let (dir, limit_file, usage_file) = match v1 {
            Some(path) => (Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/')).join(name), "memory.limit_in_bytes", "memory.usage_in_bytes"),
            None => {
                let path = own.lines().find_map(|l| l.strip_prefix("0::")).context("no cgroup v2 line in /proc/self/cgroup")?;
                let parent = cgroup2_root()?.join(path.trim_start_matches('/'));
                let ctl = std::fs::read_to_string(parent.join("cgroup.subtree_control")).unwrap_or_default();
                if !ctl.split_whitespace().any(|c| c == "memory") {
                    bail!("no memory controller below {}: its cgroup.subtree_control has no memory", parent.display());
                }
                (parent.join(name), "memory.max", "memory.current")
            }
        };
        std::fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
        let m = MemCgroup { dir, usage_file };
        std::fs::write(m.dir.join(limit_file), limit.to_string()).with_context(|| format!("set {limit_file}"))?;
        Ok(m)
    }

    /// Bytes charged to the cgroup now.
    pub fn usage(&self) -> Result<u64> {
        Ok(std::fs::read_to_string(self.dir.join(self.usage_file))?.trim().parse()?)
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("could not remove {}", self.dir.display());
    }
}

/// Make sure /sys/fs/bpf is a bpffs (idempotent).
fn ensure_bpffs() -> Result<()> {
    let ok = Command::new("mountpoint").args(["-q", "/sys/fs/bpf"]).status()?.success();
    if !ok {
        run("mount", &["-t", "bpf", "bpf", "/sys/fs/bpf"])?;
    }
    Ok(())
}

/// Find a binary built next to this one (target/<profile>/NAME).
pub fn bin(name: &str) -> PathBuf {
    let var = format!("LB_{}_BIN", name.to_uppercase().replace('-', "_"));
    if let Ok(p) = std::env::var(&var) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().map(Path::to_path_buf);
    while let Some(d) = dir {
        let cand = d.join(name);
        if cand.is_file() {
            return cand;
        }
        dir = d.parent().map(Path::to_path_buf);
        if dir.as_ref().is_some_and(|d| d.ends_with("target")) {
            break;
        }
    }
    panic!("{name} not found next to {}; build it first (cargo xtask test does), or set {var}", exe.display());
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Remove what clusters of dead test processes left behind.
fn reap_leftovers() {
    let owner = |name: &str| -> Option<u32> {
        let rest = name.strip_prefix(PREFIX)?.strip_prefix('-')?;
        rest.split('-').next()?.parse().ok()
    };
    let dead = |name: &str| owner(name).is_some_and(|p| !pid_alive(p));
    if let Ok(rd) = std::fs::read_dir("/sys/fs/bpf") {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if dead(&n) {
                let _ = Command::new(bin("lb-agent")).args(["teardown", "--bpffs"]).arg(e.path()).output();
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    if let Ok(out) = run("ip", &["netns", "list"]) {
        for l in out.lines() {
            let n = l.split_whitespace().next().unwrap_or("");
            if dead(n) {
                let _ = ip(&["netns", "del", n]);
            }
        }
    }
    if let Ok(root) = cgroup2_root()
        && let Ok(rd) = std::fs::read_dir(&root)
    {
        for e in rd.flatten() {
            if dead(&e.file_name().to_string_lossy()) {
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir(std::env::temp_dir()) {
        for e in rd.flatten() {
            if dead(&e.file_name().to_string_lossy()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// `LB_NODEPORT_ACCELERATION=xdp`: the whole suite runs with XDP
/// acceleration (agents get `--nodeport-acceleration xdp`, and the fabric
/// carries complete checksums).
pub fn xdp_from_env() -> bool {
    std::env::var("LB_NODEPORT_ACCELERATION").is_ok_and(|v| v == "xdp")
}

/// `LB_BPF_FORWARD=1`: every agent forwards translated outside traffic in
/// BPF (`--bpf-forward`; the XDP pass of `cargo xtask test` sets it, as
/// XDP acceleration is meant to run with it).
pub fn bpf_forward_from_env() -> bool {
    std::env::var("LB_BPF_FORWARD").is_ok_and(|v| v == "1")
}

/// No IPv6 duplicate address detection in a test netns: a link-local
/// address stays tentative for a second after its link comes up, and the
/// first packets to a new neighbour are lost meanwhile.
fn no_dad(netns: &str) -> Result<()> {
    run(
        "nsenter",
        &[&format!("--net=/run/netns/{netns}"), "sysctl", "-qw", "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0"],
    )
    .map(drop)
}

pub struct Node {
    pub index: usize,
    pub name: String,
    pub netns: String,
    pub ip: String,
    pub ip6: String,
    pub cgroup: PathBuf,
    pub bpffs: PathBuf,
    pub pod_cidr_prefix: String,
    agent: Option<Child>,
    next_pod: u32,
}

#[derive(Clone, Debug)]
pub struct Pod {
    pub name: String,
    pub netns: String,
    pub ip: String,
    pub ip6: String,
    pub node: usize,
    pub cgroup: PathBuf,
}

/// What a probe client saw.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Summary {
    pub attempts: u32,
    pub ok: u32,
    pub replies: BTreeMap<String, u32>,
    pub errors: BTreeMap<String, u32>,
    pub peers: BTreeMap<String, u32>,
    pub max_fail_ms: u64,
    /// `udp --recverr`: error-queue entries, "icmp type=T code=C from=ADDR".
    #[serde(default)]
    pub offenders: BTreeMap<String, u32>,
}

impl Summary {
    pub fn failed(&self) -> u32 {
        self.attempts - self.ok
    }
}

/// How `Cluster::launch_agent` runs `lb-agent run`.
#[derive(Default)]
struct AgentLaunch {
    /// `--source`.
    source: String,
    /// More flags before the caller's.
    flags: Vec<String>,
    env: Vec<(String, String)>,
    env_remove: Vec<String>,
    /// Show this directory at /var/run/secrets/kubernetes.io/serviceaccount,
    /// in a private mount namespace.
    service_account: Option<PathBuf>,
    /// No `--node-ip`: the agent takes the node's addresses from its
    /// interfaces.
    interface_addresses: bool,
    /// Return once the agent has logged this (default: its first sync).
    ready: Option<&'static str>,
    /// Start the agent in this memory cgroup (its directory).
    memory_cgroup: Option<PathBuf>,
    /// Start the agent with this open-file limit (soft and hard).
    nofile: Option<u64>,
}

/// Run `f` on a thread inside netns `netns` (None: this one): sockets it
/// opens live there. The caller's threads stay where they are.
/// Whether lb's TC program `prog` is on `dev`'s ingress in `netns`: asked
/// of the kernel, as TCX links (this machine's bpftool does not list them)
/// unless the tests run with `LB_TC_ATTACH=netlink`, then as clsact filters.
pub fn tc_program_on(netns: &str, dev: &str, prog: &str) -> Result<bool> {
    let tcx = std::env::var("LB_TC_ATTACH").map_or(true, |m| m != "netlink");
    if tcx {
        use aya::programs::{SchedClassifier, TcAttachType};
        let (_, progs) = with_netns(Some(netns), || Ok(SchedClassifier::query_tcx(dev, TcAttachType::Ingress)?))?;
        // The kernel keeps 15 bytes of a program's name.
        let cut = &prog[..prog.len().min(15)];
        return Ok(progs.iter().any(|i| i.name_as_str() == Some(cut)));
    }
    let out = run("nsenter", &[&format!("--net=/run/netns/{netns}"), "--", "bpftool", "net", "show", "dev", dev])?;
    Ok(out.contains(prog))
}

pub fn with_netns<T: Send>(netns: Option<&str>, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            if let Some(ns) = netns {
                let fd = std::fs::File::open(format!("/run/netns/{ns}")).with_context(|| format!("open netns {ns}"))?;
                nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET).with_context(|| format!("setns {ns}"))?;
            }
            f()
        });
        h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// A running `lb-apiserver` (tests/src/bin/lb-apiserver.rs), killed on drop.
pub struct ApiServer {
    /// `IP:PORT` it listens on, inside `netns`.
    pub addr: String,
    /// None: the test's own netns.
    pub netns: Option<String>,
    /// A kubeconfig for it (with TLS: CA data and the token).
    pub kubeconfig: PathBuf,
    /// With TLS: ca.crt, token and namespace, as a service account has them.
    pub tls_dir: Option<PathBuf>,
    pub log: PathBuf,
    child: Child,
}

impl ApiServer {
    /// Start it serving `objects` on 127.0.0.1 (any port) in `netns`
    /// (None: here); HTTPS when `tls_dir` is given. Returns once it listens.
    pub fn start(netns: Option<&str>, objects: &Path, tls_dir: Option<&Path>, kubeconfig: &Path, log: &Path) -> Result<Self> {
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg("--").arg(bin("lb-apiserver"));
                c
            }
            None => Command::new(bin("lb-apiserver")),
        };
        cmd.arg("--objects").arg(objects).args(["--listen", "127.0.0.1:0"]).arg("--kubeconfig-out").arg(kubeconfig);
        if let Some(d) = tls_dir {
            cmd.arg("--tls-dir").arg(d);
        }
        let f = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
        let mut child = cmd.stdout(Stdio::piped()).stderr(f).spawn().context("spawn lb-apiserver")?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line)?;
        let Some(addr) = line.trim().strip_prefix("ready ").map(str::to_string) else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("lb-apiserver did not start: {line:?}: {}", std::fs::read_to_string(log).unwrap_or_default());
        };
        Ok(ApiServer {
            addr,
            netns: netns.map(str::to_string),
            kubeconfig: kubeconfig.to_path_buf(),
            tls_dir: tls_dir.map(Path::to_path_buf),
            log: log.to_path_buf(),
            child,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A plain-HTTP request (no TLS) from inside its netns: (status, body).
    pub fn request(&self, method: &str, path: &str) -> Result<(u16, String)> {
        use std::io::{Read as _, Write as _};
        if self.tls_dir.is_some() {
            bail!("ApiServer::request speaks plain HTTP only");
        }
        let addr: std::net::SocketAddr = self.addr.parse()?;
        let req = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n");
        let raw = with_netns(self.netns.as_deref(), || {
            let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.write_all(req.as_bytes())?;
            let mut out = Vec::new();
            s.read_to_end(&mut out)?;
            Ok(out)
        })?;
        let text = String::from_utf8_lossy(&raw);
        let (head, body) = text.split_once("\r\n\r\n").context("no HTTP header")?;
        let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).context("no HTTP status")?;
        Ok((code, body.to_string()))
    }

    /// POST a test control (`/lbtest/compact`, `/lbtest/fail?code=500&count=3`, ...).
    pub fn control(&self, path: &str) -> Result<()> {
        let (code, body) = self.request("POST", path)?;
        if code != 200 {
            bail!("POST {path}: {code} {body}");
        }
        Ok(())
    }

    /// The requests it saw, as "METHOD /path?query" (the query as sent).
    pub fn requests(&self) -> Result<Vec<String>> {
        let (code, body) = self.request("GET", "/lbtest/requests")?;
        if code != 200 {
            bail!("GET /lbtest/requests: {code} {body}");
        }
        Ok(serde_json::from_str(&body)?)
    }

    /// `GET /lbtest/state`: resourceVersion, compacted, failRemaining, ...
    pub fn state(&self) -> Result<serde_json::Value> {
        let (code, body) = self.request("GET", "/lbtest/state")?;
        if code != 200 {
            bail!("GET /lbtest/state: {code} {body}");
        }
        Ok(serde_json::from_str(&body)?)
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- lb-apiserver log ---\n{}", std::fs::read_to_string(&self.log).unwrap_or_default());
        }
    }
}

pub struct Cluster {
    pub id: String,
    pub nodes: Vec<Node>,
    pub objects: PathBuf,
    fabric: String,
    /// The fabric carries complete checksums, as a wire does (see
    /// `wire_checksums`).
    wired: bool,
    logs: PathBuf,
    children: Mutex<Vec<Child>>,
    pods: Vec<Pod>,
}

impl Cluster {
    /// One node with backend pods `names` serving on 8080 (answering with
    /// their names) and a client pod; no agent yet.
    pub fn one_node(names: &[&str]) -> Result<(Self, Vec<Pod>, Pod)> {
        let mut c = Cluster::new(1)?;
        let mut pods = Vec::new();
        for n in names {
            let p = c.add_pod(1, n)?;
            c.serve(&p, 8080)?;
            pods.push(p);
        }
        let client = c.add_pod(1, "client")?;
        Ok((c, pods, client))
    }

    /// A cluster of `n` nodes, with no pods and no agents yet.
    pub fn new(n: usize) -> Result<Self> {
        assert!((1..=20).contains(&n));
        ensure_bpffs()?;
        reap_leftovers();
        let id = format!("{PREFIX}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::SeqCst));
        let tmp = std::env::temp_dir().join(&id);
        let objects = tmp.join("objects");
        let logs = tmp.join("logs");
        std::fs::create_dir_all(&objects)?;
        std::fs::create_dir_all(&logs)?;
        let mut c = Cluster {
            fabric: format!("{id}-fab"),
            // The whole suite can run with XDP acceleration, which needs them.
            wired: xdp_from_env(),
            id: id.clone(),
            nodes: Vec::new(),
            objects,
            logs,
            children: Mutex::new(Vec::new()),
            pods: Vec::new(),
        };
        c.build(n)?;
        Ok(c)
    }

    /// Make the fabric carry complete checksums, as a wire does: every
    /// veth on it (both ends) computes checksums in software instead of
    /// handing the next device a partial one (CHECKSUM_PARTIAL, which XDP
    /// cannot see or finish: a NIC never receives one), and the nodes'
    /// fabric ports get NAPI (GRO), which XDP_TX into them needs. Outside
    /// clients (`add_outside`) made before are included; routers must come
    /// after. Devices added later get the same. XDP acceleration needs
    /// this here.
    pub fn wire_checksums(&mut self) -> Result<()> {
        // Outside clients on the fabric (`add_outside`): netns "{id}-o<host>",
        // fabric port "o<host>". A router's clients sit behind it: too late.
        let prefix = format!("{}-", self.id);
        if self.pods.iter().any(|p| p.netns.starts_with(&format!("{prefix}r"))) {
            bail!("wire_checksums: call it before adding routers");
        }
        self.wired = true;
        for n in &self.nodes {
            self.wire(&n.netns, "eth0", &self.fabric, &format!("n{}", n.index), true)?;
        }
        for p in self.pods.iter().filter(|p| p.node == 0) {
            let port = p.netns.strip_prefix(&prefix).unwrap_or_default();
            self.wire(&p.netns, "eth0", &self.fabric, port, false)?;
        }
        Ok(())
    }

    /// The netns of the fabric (the bridge every node and outside client
    /// hangs off; node `i`'s port there is "n{i}").
    pub fn fabric_netns(&self) -> &str {
        &self.fabric
    }

    /// `wire_checksums` for one veth pair: `dev` in `netns` and `peer` in
    /// `peer_netns`; `napi`: the peer gets GRO (NAPI) for XDP_TX.
    fn wire(&self, netns: &str, dev: &str, peer_netns: &str, peer: &str, napi: bool) -> Result<()> {
        if !self.wired {
            return Ok(());
        }
        self.in_netns(netns, &["ethtool", "-K", dev, "tx", "off"])?;
        self.in_netns(peer_netns, &["ethtool", "-K", peer, "tx", "off"])?;
        if napi {
            self.in_netns(peer_netns, &["ethtool", "-K", peer, "gro", "on"])?;
        }
        Ok(())
    }

    fn build(&mut self, n: usize) -> Result<()> {
        let fab = self.fabric.clone();
        ip(&["netns", "add", &fab])?;
        ip(&["-n", &fab, "link", "set", "lo", "up"])?;
        ip(&["-n", &fab, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &fab, "link", "set", "br0", "up"])?;
        // The physical network is a switch: it forwards frames, whatever
        // their IP headers. br_netfilter, where loaded, runs the bridge's
        // IPv4 and IPv6 frames through the stack's header checks first
        // (and drops a bad header before any node saw it) unless the
        // fabric's own namespace turns it off.
        for family in ["iptables", "ip6tables", "arptables"] {
            let knob = format!("/proc/sys/net/bridge/bridge-nf-call-{family}");
            self.in_netns(&fab, &["sh", "-c", &format!("[ ! -e {knob} ] || echo 0 > {knob}")])?;
        }
        let root = cgroup2_root()?;
        for i in 1..=n {
            let netns = format!("{}-n{i}", self.id);
            let node = Node {
                index: i,
                name: format!("node-{i}"),
                netns: netns.clone(),
                ip: format!("192.168.77.{}", 10 + i),
                ip6: format!("fd00:77::{}", 10 + i),
                cgroup: root.join(&netns),
                bpffs: PathBuf::from("/sys/fs/bpf").join(&netns),
                pod_cidr_prefix: format!("10.244.{i}"),
                agent: None,
                next_pod: 10,
            };
            // Register first, so that drop cleans up a half-built node.
            self.nodes.push(node);
            let node = self.nodes.last().unwrap();
            ip(&["netns", "add", &netns])?;
            no_dad(&netns)?;
            ip(&["-n", &netns, "link", "set", "lo", "up"])?;
            std::fs::create_dir_all(&node.cgroup)?;
            let fab_if = format!("n{i}");
            ip(&["-n", &fab, "link", "add", &fab_if, "type", "veth", "peer", "name", "eth0", "netns", &netns])?;
            ip(&["-n", &fab, "link", "set", &fab_if, "master", "br0", "up"])?;
            ip(&["-n", &netns, "addr", "add", &format!("{}/24", node.ip), "dev", "eth0"])?;
            ip(&["-n", &netns, "addr", "add", &format!("{}/64", node.ip6), "dev", "eth0", "nodad"])?;
            ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
            self.wire(&netns, "eth0", &fab, &fab_if, true)?;
            ip(&["-n", &netns, "link", "add", "cni0", "type", "bridge"])?;
            ip(&["-n", &netns, "addr", "add", &format!("{}.1/24", node.pod_cidr_prefix), "dev", "cni0"])?;
            ip(&["-n", &netns, "addr", "add", &format!("fd00:244:{i}::1/64"), "dev", "cni0", "nodad"])?;
            ip(&["-n", &netns, "link", "set", "cni0", "up"])?;
            run(
                "nsenter",
                &[&format!("--net=/run/netns/{netns}"), "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"],
            )?;
        }
        // Routes between the nodes' pod CIDRs; no default route anywhere.
        for a in &self.nodes {
            for b in &self.nodes {
                if a.index != b.index {
                    ip(&["-n", &a.netns, "route", "add", &format!("{}.0/24", b.pod_cidr_prefix), "via", &b.ip])?;
                    ip(&["-n", &a.netns, "-6", "route", "add", &format!("fd00:244:{}::/64", b.index), "via", &b.ip6])?;
                }
            }
        }
        Ok(())
    }

    /// A pod on node `node` (1-based): a netns behind a veth on the node's
    /// bridge. Its processes join the node's cgroup.
    pub fn add_pod(&mut self, node: usize, name: &str) -> Result<Pod> {
        let n = &mut self.nodes[node - 1];
        let k = n.next_pod;
        n.next_pod += 1;
        let netns = format!("{}-p{node}x{k}", self.id);
        let pod = Pod {
            name: name.to_string(),
            netns: netns.clone(),
            ip: format!("{}.{k}", n.pod_cidr_prefix),
            ip6: format!("fd00:244:{node}::{k}"),
            node,
            cgroup: n.cgroup.clone(),
        };
        self.pods.push(pod.clone());
        let node_ns = n.netns.clone();
        let gw = format!("{}.1", n.pod_cidr_prefix);
        ip(&["netns", "add", &netns])?;
        ip(&["-n", &netns, "link", "set", "lo", "up"])?;
        let host_if = format!("v{k}");
        ip(&["-n", &node_ns, "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &netns])?;
        ip(&["-n", &node_ns, "link", "set", &host_if, "master", "cni0", "up"])?;
        ip(&["-n", &netns, "addr", "add", &format!("{}/24", pod.ip), "dev", "eth0"])?;
        ip(&["-n", &netns, "addr", "add", &format!("{}/64", pod.ip6), "dev", "eth0", "nodad"])?;
        ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &netns, "route", "add", "default", "via", &gw])?;
        ip(&["-n", &netns, "-6", "route", "add", "default", "via", &format!("fd00:244:{node}::1")])?;
        Ok(pod)
    }

    /// A client outside the cluster: a netns on the fabric at 192.168.77.`host`
    /// and fd00:77::`host`,
    /// with no cgroup of ours. `routes` are (destination, node) pairs: send
    /// that destination (a LoadBalancer IP, an externalIP) to that node.
    pub fn add_outside(&mut self, name: &str, host: u8, routes: &[(&str, usize)]) -> Result<Pod> {
        let netns = format!("{}-o{host}", self.id);
        let pod = Pod {
            name: name.to_string(),
            netns: netns.clone(),
            ip: format!("192.168.77.{host}"),
            ip6: format!("fd00:77::{host}"),
            node: 0,
            cgroup: PathBuf::new(),
        };
        self.pods.push(pod.clone());
        ip(&["netns", "add", &netns])?;
        no_dad(&netns)?;
        ip(&["-n", &netns, "link", "set", "lo", "up"])?;
        let fab_if = format!("o{host}");
        ip(&["-n", &self.fabric, "link", "add", &fab_if, "type", "veth", "peer", "name", "eth0", "netns", &netns])?;
        ip(&["-n", &self.fabric, "link", "set", &fab_if, "master", "br0", "up"])?;
        ip(&["-n", &netns, "addr", "add", &format!("{}/24", pod.ip), "dev", "eth0"])?;
        ip(&["-n", &netns, "addr", "add", &format!("{}/64", pod.ip6), "dev", "eth0", "nodad"])?;
        ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
        self.wire(&netns, "eth0", &self.fabric, &fab_if, false)?;
        for (dst, node) in routes {
            if dst.contains(':') {
                ip(&["-n", &netns, "-6", "route", "add", dst, "via", &self.nodes[node - 1].ip6])?;
            } else {
                ip(&["-n", &netns, "route", "add", dst, "via", &self.nodes[node - 1].ip])?;
            }
        }
        Ok(pod)
    }

    /// An outside client behind a router. The router, netns "{id}-r`host`",
    /// sits on the fabric at 192.168.77.`host` / fd00:77::`host` (`host`
    /// must not be a node's: 11..=30); the client, netns "{id}-o`host`", is
    /// at 172.30.`host`.2 / fd00:30:`host`::2 on a link of MTU `mtu` to the
    /// router (IPv6 needs at least 1280). Every node routes the client's
    /// subnets via the router; `routes` are (destination, node) pairs for
    /// the router, as in `add_outside`.
    pub fn add_outside_via_router(&mut self, name: &str, host: u8, mtu: u32, routes: &[(&str, usize)]) -> Result<Pod> {
        let router = Pod {
            name: format!("{name}-router"),
            netns: format!("{}-r{host}", self.id),
            ip: format!("192.168.77.{host}"),
            ip6: format!("fd00:77::{host}"),
            node: 0,
            cgroup: PathBuf::new(),
        };
        let client = Pod {
            name: name.to_string(),
            netns: format!("{}-o{host}", self.id),
            ip: format!("172.30.{host}.2"),
            ip6: format!("fd00:30:{host}::2"),
            node: 0,
            cgroup: PathBuf::new(),
        };
        // Register both first, so that drop cleans up a half-built pair.
        self.pods.push(router.clone());
        self.pods.push(client.clone());
        self.add_router(&router, host)?;
        self.add_routed_client(&router.netns, &client, host, mtu)?;
        for (dst, node) in routes {
            if dst.contains(':') {
                ip(&["-n", &router.netns, "-6", "route", "add", dst, "via", &self.nodes[node - 1].ip6])?;
            } else {
                ip(&["-n", &router.netns, "route", "add", dst, "via", &self.nodes[node - 1].ip])?;
            }
        }
        for n in &self.nodes {
            ip(&["-n", &n.netns, "route", "add", &format!("172.30.{host}.0/24"), "via", &router.ip])?;
            ip(&["-n", &n.netns, "-6", "route", "add", &format!("fd00:30:{host}::/64"), "via", &router.ip6])?;
        }
        Ok(client)
    }

    /// The router of `add_outside_via_router`: a forwarding netns on the
    /// fabric bridge.
    fn add_router(&self, router: &Pod, host: u8) -> Result<()> {
        let netns = &router.netns;
        ip(&["netns", "add", netns])?;
        no_dad(netns)?;
        ip(&["-n", netns, "link", "set", "lo", "up"])?;
        let fab_if = format!("r{host}");
        ip(&["-n", &self.fabric, "link", "add", &fab_if, "type", "veth", "peer", "name", "eth0", "netns", netns])?;
        ip(&["-n", &self.fabric, "link", "set", &fab_if, "master", "br0", "up"])?;
        ip(&["-n", netns, "addr", "add", &format!("{}/24", router.ip), "dev", "eth0"])?;
        ip(&["-n", netns, "addr", "add", &format!("{}/64", router.ip6), "dev", "eth0", "nodad"])?;
        ip(&["-n", netns, "link", "set", "eth0", "up"])?;
        self.wire(netns, "eth0", &self.fabric, &fab_if, false)?;
        run(
            "nsenter",
            &[&format!("--net=/run/netns/{netns}"), "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"],
        )
        .map(drop)
    }

    /// The client of `add_outside_via_router`: a netns behind a veth pair
    /// of MTU `mtu` to `router`, with default routes via it.
    fn add_routed_client(&self, router: &str, client: &Pod, host: u8, mtu: u32) -> Result<()> {
        let netns = &client.netns;
        let mtu = mtu.to_string();
        ip(&["netns", "add", netns])?;
        no_dad(netns)?;
        ip(&["-n", netns, "link", "set", "lo", "up"])?;
        ip(&["-n", router, "link", "add", "c0", "type", "veth", "peer", "name", "eth0", "netns", netns])?;
        ip(&["-n", router, "link", "set", "c0", "mtu", &mtu])?;
        ip(&["-n", netns, "link", "set", "eth0", "mtu", &mtu])?;
        ip(&["-n", router, "addr", "add", &format!("172.30.{host}.1/24"), "dev", "c0"])?;
        ip(&["-n", router, "addr", "add", &format!("fd00:30:{host}::1/64"), "dev", "c0", "nodad"])?;
        ip(&["-n", router, "link", "set", "c0", "up"])?;
        self.wire(netns, "eth0", router, "c0", false)?;
        ip(&["-n", netns, "addr", "add", &format!("{}/24", client.ip), "dev", "eth0"])?;
        ip(&["-n", netns, "addr", "add", &format!("{}/64", client.ip6), "dev", "eth0", "nodad"])?;
        ip(&["-n", netns, "link", "set", "eth0", "up"])?;
        ip(&["-n", netns, "route", "add", "default", "via", &format!("172.30.{host}.1")])?;
        ip(&["-n", netns, "-6", "route", "add", "default", "via", &format!("fd00:30:{host}::1")])?;
        Ok(())
    }

    /// Run a command inside `pod`'s netns (or a node's), e.g. `ip addr add`.
    pub fn in_netns(&self, netns: &str, cmd: &[&str]) -> Result<String> {
        let mut args = vec![format!("--net=/run/netns/{netns}"), "--".to_string()];
        args.extend(cmd.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run("nsenter", &args)
    }

    /// A hostNetwork "pod": processes in node `node`'s own netns and cgroup.
    pub fn host(&self, node: usize) -> Pod {
        let n = &self.nodes[node - 1];
        Pod {
            name: format!("{}-host", n.name),
            netns: n.netns.clone(),
            ip: n.ip.clone(),
            ip6: n.ip6.clone(),
            node,
            cgroup: n.cgroup.clone(),
        }
    }

    pub fn probe_cmd(&self, pod: &Pod) -> Command {
        let mut c = Command::new(bin("lbprobe"));
        c.arg("--netns").arg(&pod.netns);
        if !pod.cgroup.as_os_str().is_empty() {
            c.arg("--cgroup").arg(&pod.cgroup);
        }
        c
    }

    /// Run a backend server in `pod` that answers with the pod's name on TCP
    /// and UDP `port`. Returns once it listens.
    pub fn serve(&self, pod: &Pod, port: u16) -> Result<u32> {
        self.serve_as(pod, &pod.name, port)
    }

    /// Like `serve`, answering with `name`.
    pub fn serve_as(&self, pod: &Pod, name: &str, port: u16) -> Result<u32> {
        self.serve_with(pod, name, port, &[])
    }

    /// A server for tens of thousands of connections at once (one epoll
    /// thread), answering "NAME CLIENT-IP" like `serve_reporting_peer`.
    pub fn serve_many(&self, pod: &Pod, port: u16) -> Result<u32> {
        self.serve_with(pod, &pod.name, port, &["--many", "--report-peer"])
    }

    /// The benchmark server (1 byte in, 1 byte out), pinned to `cpu`.
    pub fn serve_tiny(&self, pod: &Pod, port: u16, cpu: usize) -> Result<u32> {
        self.serve_with(pod, &pod.name, port, &["--tiny", &cpu.to_string()])
    }

    /// A server answering "NAME CLIENT-IP": the address it saw the client at.
    pub fn serve_reporting_peer(&self, pod: &Pod, port: u16) -> Result<u32> {
        self.serve_with(pod, &pod.name, port, &["--report-peer"])
    }

    /// A server answering with `name`, with `extra` arguments of `lbprobe
    /// serve`.
    pub fn serve_with(&self, pod: &Pod, name: &str, port: u16, extra: &[&str]) -> Result<u32> {
        let mut child = self
            .probe_cmd(pod)
            .args(["serve", "--name", name, "--port", &port.to_string()])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line)?;
        if line.trim() != "ready" {
            let _ = child.kill();
            let _ = child.wait();
            bail!("server in {} did not start", pod.name);
        }
        let pid = child.id();
        self.children.lock().unwrap().push(child);
        Ok(pid)
    }

    /// Stop a process this cluster started, by PID.
    pub fn stop(&self, pid: u32) {
        let mut ch = self.children.lock().unwrap();
        if let Some(i) = ch.iter().position(|c| c.id() == pid) {
            let mut c = ch.remove(i);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Run a client in `pod`: `args` after the subcommand, e.g.
    /// `["tcp", "--addr", "10.96.0.10:80", "--count", "10"]`.
    pub fn probe(&self, pod: &Pod, args: &[&str]) -> Result<Summary> {
        let out = self.probe_cmd(pod).args(args).stderr(Stdio::inherit()).output()?;
        if !out.status.success() {
            bail!("lbprobe {args:?} in {} failed: {}", pod.name, out.status);
        }
        let s = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(s.trim()).with_context(|| format!("lbprobe output {s:?}"))
    }

    /// HTTP GET from inside node `node`'s netns (no cgroup): (status, body).
    pub fn http(&self, node: usize, addr: &str, path: &str) -> Result<(u16, String)> {
        self.http_from(&self.nodes[node - 1].netns, addr, path)
    }

    /// HTTP GET from inside netns `netns`: (status, body).
    pub fn http_from(&self, netns: &str, addr: &str, path: &str) -> Result<(u16, String)> {
        let out = Command::new(bin("lbprobe"))
            .arg("--netns")
            .arg(netns)
            .args(["http", "--addr", addr, "--path", path])
            .output()?;
        if !out.status.success() {
            bail!("http {addr}{path}: {}", String::from_utf8_lossy(&out.stderr));
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        Ok((v["status"].as_u64().unwrap_or(0) as u16, v["body"].as_str().unwrap_or("").to_string()))
    }

    /// Start a client in the background; collect it with `finish`.
    pub fn probe_bg(&self, pod: &Pod, args: &[&str]) -> Result<Child> {
        Ok(self.probe_cmd(pod).args(args).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn()?)
    }

    pub fn finish(child: Child) -> Result<Summary> {
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("background lbprobe failed: {}", out.status);
        }
        let s = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(s.trim()).with_context(|| format!("lbprobe output {s:?}"))
    }

    pub fn agent_log(&self, node: usize) -> PathBuf {
        self.logs.join(format!("agent-n{node}.log"))
    }

    /// Start `lb-agent run` in node `node`'s netns, attached to its cgroup,
    /// and wait for its first full sync.
    pub fn start_agent(&mut self, node: usize) -> Result<()> {
        self.start_agent_with(node, &[])
    }

    /// `start_agent` with extra `lb-agent run` flags.
    pub fn start_agent_with(&mut self, node: usize, extra: &[&str]) -> Result<()> {
        let dir = self.objects.clone();
        self.start_agent_from(node, &dir, extra)
    }

    /// The agent's PID on node `node`, while it runs.
    pub fn agent_pid(&self, node: usize) -> Option<u32> {
        self.nodes[node - 1].agent.as_ref().map(|c| c.id())
    }

    /// `start_agent_with`, reading objects from `dir` instead of the
    /// cluster's shared directory.
    pub fn start_agent_from(&mut self, node: usize, dir: &Path, extra: &[&str]) -> Result<()> {
        self.start_agent_env(node, dir, extra, &[])
    }

    /// `start_agent_with`, without `--node-ip`: the agent takes the node's
    /// addresses from its interfaces (there is no Node object either).
    pub fn start_agent_from_interfaces(&mut self, node: usize, extra: &[&str]) -> Result<()> {
        let launch = AgentLaunch { source: format!("dir:{}", self.objects.display()), interface_addresses: true, ..Default::default() };
        self.launch_agent(node, launch, extra)
    }

    /// `start_agent_with`, the agent in memory cgroup `mem` (from its
    /// first allocation: the maps it creates are charged there).
    pub fn start_agent_in(&mut self, node: usize, mem: &MemCgroup, extra: &[&str]) -> Result<()> {
        let launch = AgentLaunch { source: format!("dir:{}", self.objects.display()), memory_cgroup: Some(mem.dir.clone()), ..Default::default() };
        self.launch_agent(node, launch, extra)
    }

    /// `start_agent_with`, the agent limited to `nofile` open files (soft
    /// and hard: it cannot raise it).
    pub fn start_agent_nofile(&mut self, node: usize, nofile: u64, extra: &[&str]) -> Result<()> {
        let launch = AgentLaunch { source: format!("dir:{}", self.objects.display()), nofile: Some(nofile), ..Default::default() };
        self.launch_agent(node, launch, extra)
    }

    /// `start_agent_from` with extra environment variables for the agent.
    pub fn start_agent_env(&mut self, node: usize, dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Result<()> {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.launch_agent(node, AgentLaunch { source: format!("dir:{}", dir.display()), env, ..Default::default() }, extra)
    }

    /// `start_agent_env`, returning once the agent has logged `ready`.
    pub fn start_agent_env_until(&mut self, node: usize, dir: &Path, extra: &[&str], env: &[(&str, &str)], ready: &'static str) -> Result<()> {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.launch_agent(node, AgentLaunch { source: format!("dir:{}", dir.display()), env, ready: Some(ready), ..Default::default() }, extra)
    }

    /// `start_agent_with`, with `--source kube --kubeconfig KUBECONFIG`:
    /// the agent lists and watches an API server (see `start_apiserver`).
    pub fn start_agent_kube(&mut self, node: usize, kubeconfig: &Path, extra: &[&str]) -> Result<()> {
        let launch = AgentLaunch {
            source: "kube".into(),
            flags: vec!["--kubeconfig".into(), kubeconfig.display().to_string()],
            ..Default::default()
        };
        self.launch_agent(node, launch, extra)
    }

    /// `start_agent_kube` with environment variables, returning once the
    /// agent serves health and metrics, before its first sync (for what it
    /// shows meanwhile).
    pub fn start_agent_kube_unsynced(&mut self, node: usize, kubeconfig: &Path, extra: &[&str], env: &[(&str, &str)]) -> Result<()> {
        let launch = AgentLaunch {
            source: "kube".into(),
            flags: vec!["--kubeconfig".into(), kubeconfig.display().to_string()],
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ready: Some("serving health and metrics"),
            ..Default::default()
        };
        self.launch_agent(node, launch, extra)
    }

    /// `start_agent_with`, with `--source kube` and nothing but the
    /// in-cluster configuration of a pod: `KUBERNETES_SERVICE_HOST`/`_PORT`
    /// name `api` (a TLS one), and its service-account files appear at
    /// /var/run/secrets/kubernetes.io/serviceaccount in a private mount
    /// namespace of the agent (a tmpfs over /var there), so nothing on the
    /// machine changes. No KUBECONFIG, and a HOME without ~/.kube.
    pub fn start_agent_in_cluster(&mut self, node: usize, api: &ApiServer, extra: &[&str]) -> Result<()> {
        let sa = api.tls_dir.clone().context("the in-cluster configuration needs an API server with TLS")?;
        let (host, port) = api.addr.rsplit_once(':').context("API server address")?;
        let home = self.objects.parent().context("cluster directory")?.join("agent-home");
        std::fs::create_dir_all(&home)?;
        let launch = AgentLaunch {
            source: "kube".into(),
            env: vec![
                ("KUBERNETES_SERVICE_HOST".into(), host.trim_matches(['[', ']']).to_string()),
                ("KUBERNETES_SERVICE_PORT".into(), port.to_string()),
                ("HOME".into(), home.display().to_string()),
            ],
            env_remove: vec!["KUBECONFIG".into()],
            service_account: Some(sa),
            ..Default::default()
        };
        self.launch_agent(node, launch, extra)
    }

    /// Start `lb-agent run` as `launch` says in node `node`'s netns,
    /// attached to its cgroup, and wait for its first full sync.
    fn launch_agent(&mut self, node: usize, launch: AgentLaunch, extra: &[&str]) -> Result<()> {
        let log = self.agent_log(node);
        let ready = launch.ready.unwrap_or("initial sync complete");
        let before = std::fs::read_to_string(&log).map(|s| s.matches(ready).count()).unwrap_or(0);
        let n = &self.nodes[node - 1];
        let f = std::fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", n.netns)).arg("--");
        if let Some(mem) = &launch.memory_cgroup {
            // $0 is the cgroup's process list, "$@" what runs in it.
            cmd.args(["sh", "-c", "echo $$ > \"$0\" && exec \"$@\""]).arg(mem.join("cgroup.procs"));
        }
        if let Some(sa) = &launch.service_account {
            // $0 is the directory, "$@" the agent's command line.
            cmd.args(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c"])
                .arg(
                    "mount -t tmpfs -o size=1m,mode=0755 lb-serviceaccount /var && \
                     mkdir -p /var/run/secrets/kubernetes.io && \
                     ln -s \"$0\" /var/run/secrets/kubernetes.io/serviceaccount && exec \"$@\"",
                )
                .arg(sa);
        }
        if let Some(n) = launch.nofile {
            cmd.args(["prlimit", &format!("--nofile={n}:{n}"), "--"]);
        }
        cmd.arg(bin("lb-agent"))
            .arg("run")
            .arg("--source")
            .arg(&launch.source)
            .args(&launch.flags)
            .arg("--node-name")
            .arg(&n.name)
            .arg("--cgroup")
            .arg(&n.cgroup)
            .arg("--bpffs")
            .arg(&n.bpffs)
            .args(if launch.interface_addresses { vec![] } else { vec!["--node-ip", &n.ip, "--node-ip", &n.ip6] })
            // The whole suite can run with another TC attach mode.
            .args(
                std::env::var("LB_TC_ATTACH")
                    .ok()
                    .filter(|_| !extra.contains(&"--tc-attach"))
                    .map(|m| vec!["--tc-attach".to_string(), m])
                    .unwrap_or_default(),
            )
            // ... and with XDP acceleration.
            .args(if xdp_from_env() && !extra.contains(&"--nodeport-acceleration") {
                vec!["--nodeport-acceleration", "xdp"]
            } else {
                vec![]
            })
            // ... and with forwarding in BPF.
            .args(if bpf_forward_from_env() && !extra.iter().any(|a| a.starts_with("--bpf-forward")) { vec!["--bpf-forward"] } else { vec![] })
            .args(extra)
            .env("RUST_LOG", std::env::var("LB_AGENT_RUST_LOG").unwrap_or_else(|_| "info".into()))
            .env("NO_COLOR", "1");
        for k in &launch.env_remove {
            cmd.env_remove(k);
        }
        cmd.envs(launch.env.iter().map(|(k, v)| (k, v)));
        let child = cmd.stdout(f.try_clone()?).stderr(f).spawn()?;
        self.nodes[node - 1].agent = Some(child);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.matches(ready).count() > before {
                return Ok(());
            }
            if let Some(c) = self.nodes[node - 1].agent.as_mut()
                && let Some(st) = c.try_wait()?
            {
                bail!("lb-agent on node {node} exited with {st}:\n{text}");
            }
            if Instant::now() > deadline {
                bail!("lb-agent on node {node} did not sync within 120s:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Start `lb-apiserver` (the wire-level list/watch stand-in) on this
    /// cluster's object directory, inside node `node`'s netns on
    /// 127.0.0.1, where that node's agent reaches it (127.0.0.1 is each
    /// netns' own loopback). `tls`: HTTPS with a bearer token, and the
    /// service-account files in `ApiServer::tls_dir`.
    pub fn start_apiserver(&self, node: usize, tls: bool) -> Result<ApiServer> {
        let k = COUNTER.fetch_add(1, Ordering::SeqCst);
        let dir = self.objects.parent().context("cluster directory")?.join(format!("apiserver-{k}"));
        std::fs::create_dir_all(&dir)?;
        let log = self.logs.join(format!("apiserver-{k}.log"));
        let tls_dir = tls.then(|| dir.join("serviceaccount"));
        ApiServer::start(Some(&self.nodes[node - 1].netns), &self.objects, tls_dir.as_deref(), &dir.join("kubeconfig"), &log)
    }

    /// Kill node `node`'s agent with SIGKILL (the pins stay).
    pub fn kill_agent(&mut self, node: usize) {
        if let Some(mut c) = self.nodes[node - 1].agent.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `lb-agent list --json` for node `node`.
    pub fn list(&self, node: usize) -> Result<serde_json::Value> {
        self.list_with(node, &[])
    }

    /// `lb-agent list --json` with more flags (`--stats`).
    pub fn list_with(&self, node: usize, flags: &[&str]) -> Result<serde_json::Value> {
        let mut args = vec!["list", "--json", "--bpffs", self.nodes[node - 1].bpffs.to_str().unwrap()];
        args.extend(flags);
        let out = run(bin("lb-agent").to_str().unwrap(), &args)?;
        Ok(serde_json::from_str(&out)?)
    }

    /// Frontend `addr:port/proto`'s counters on node `node` (`lb-agent list
    /// --stats`: conns, refused, unreachable, source_range, packets, bytes)
    /// and the sum of its backends' connections.
    pub fn frontend_stats(&self, node: usize, addr: &str, port: u16, proto: &str) -> Result<(serde_json::Value, u64)> {
        let l = self.list_with(node, &["--stats"])?;
        let f = l["frontends"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|f| f["address"] == addr && f["port"] == port && f["protocol"] == proto)
            .with_context(|| format!("no frontend {addr}:{port}/{proto} on node-{node}: {l}"))?;
        let backends = f["backends"].as_array().into_iter().flatten().filter_map(|b| b["stats"]["conns"].as_u64()).sum();
        Ok((f["stats"].clone(), backends))
    }

    /// The backends programmed for `addr:port/proto` on node `node`, as
    /// `ip:port` strings, or None when the frontend is not programmed.
    pub fn programmed(&self, node: usize, addr: &str, port: u16, proto: &str) -> Result<Option<Vec<String>>> {
        let v = self.list(node)?;
        let f = v["frontends"].as_array().into_iter().flatten().find(|f| {
            f["address"] == addr && f["port"] == port && f["protocol"] == proto
        });
        Ok(f.map(|f| {
            f["backends"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|b| format!("{}:{}", b["address"].as_str().unwrap_or(""), b["port"]))
                .collect()
        }))
    }

    /// Wait until `cond` holds, polling; fail with `what` after `timeout`.
    pub fn wait_for(&self, what: &str, timeout: Duration, mut cond: impl FnMut() -> Result<bool>) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if cond()? {
                return Ok(());
            }
            if Instant::now() > deadline {
                // The agents' last lines: a test that fails by returning an
                // error (not a panic) shows nothing else of them.
                let logs: String = (1..=self.nodes.len())
                    .filter_map(|n| {
                        let text = std::fs::read_to_string(self.agent_log(n)).ok()?;
                        let lines: Vec<&str> = text.lines().collect();
                        let tail = &lines[lines.len().saturating_sub(40)..];
                        Some(format!("\n--- node-{n}'s agent log, last {} lines ---\n{}", tail.len(), tail.join("\n")))
                    })
                    .collect();
                bail!("timed out after {timeout:?} waiting for {what}{logs}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait until every running agent has programmed `addr:port/proto` with
    /// exactly `backends` (as `ip:port`, any order); None: not programmed.
    pub fn wait_programmed(&self, addr: &str, port: u16, proto: &str, backends: Option<&[&str]>) -> Result<()> {
        let want = backends.map(|b| {
            let mut v: Vec<String> = b.iter().map(|s| s.to_string()).collect();
            v.sort();
            v
        });
        for n in &self.nodes {
            if n.agent.is_none() {
                continue;
            }
            self.wait_for(&format!("{addr}:{port}/{proto} = {want:?} on {}", n.name), Duration::from_secs(5), || {
                let got = self.programmed(n.index, addr, port, proto)?.map(|mut v| {
                    v.sort();
                    v
                });
                Ok(got == want)
            })?;
        }
        Ok(())
    }

    /// Write an object file into the source directory (atomically).
    pub fn write_object(&self, file: &str, yaml: &str) -> Result<()> {
        let tmp = self.objects.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, yaml)?;
        std::fs::rename(&tmp, self.objects.join(file))?;
        Ok(())
    }

    pub fn remove_object(&self, file: &str) -> Result<()> {
        std::fs::remove_file(self.objects.join(file))?;
        Ok(())
    }

    fn cleanup(&mut self) {
        if std::thread::panicking() {
            for n in &self.nodes {
                let log = std::fs::read_to_string(self.agent_log(n.index)).unwrap_or_default();
                eprintln!("--- lb-agent log of {} ---\n{log}", n.name);
            }
        }
        for c in self.children.lock().unwrap().iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for i in 1..=self.nodes.len() {
            self.kill_agent(i);
        }
        for n in &self.nodes {
            if n.bpffs.exists() && teardown_in(&n.netns, &n.bpffs).is_err() {
                let _ = std::fs::remove_dir_all(&n.bpffs);
            }
        }
        for p in &self.pods {
            let _ = ip(&["netns", "del", &p.netns]);
        }
        for n in &self.nodes {
            let _ = ip(&["netns", "del", &n.netns]);
            // Killed processes leave the cgroup asynchronously.
            for _ in 0..100 {
                if !n.cgroup.exists() || std::fs::remove_dir(&n.cgroup).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = ip(&["netns", "del", &self.fabric]);
        if let Some(tmp) = self.objects.parent() {
            let _ = std::fs::remove_dir_all(tmp);
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.cleanup();
    }
}

/// One thread of a process stopped by ptrace (the others go on), until
/// dropped: a thread that hangs, as on a stuck syscall. The agent's main
/// thread (`Cluster::agent_pid`) runs its sync loop.
pub struct ThreadStopped(nix::unistd::Pid);

impl ThreadStopped {
    pub fn new(tid: u32) -> Result<Self> {
        use nix::sys::{ptrace, wait};
        let tid = nix::unistd::Pid::from_raw(tid as i32);
        ptrace::seize(tid, ptrace::Options::empty())?;
        let stopped = ThreadStopped(tid);
        ptrace::interrupt(tid)?;
        wait::waitpid(tid, Some(wait::WaitPidFlag::__WALL))?;
        Ok(stopped)
    }
}

impl Drop for ThreadStopped {
    fn drop(&mut self) {
        let _ = nix::sys::ptrace::detach(self.0, None);
    }
}
