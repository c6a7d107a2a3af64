//! Load, pin and attach the BPF programs; adopt what an earlier agent left;
//! tear everything down.
//!
//! Pin layout under `--bpffs DIR` (nothing global, so that several agents can
//! run on one machine):
//!   DIR/<MAP>          every map, reused by the next agent
//!   DIR/links/<PROG>   the cgroup links; they keep the programs attached
//!                      while no agent runs
use std::collections::BTreeSet;
use std::fs;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};

use nix::sys::statfs;

use anyhow::{Context as _, Result, bail};
use aya::programs::{CgroupAttachMode, CgroupSock, CgroupSockAddr, SchedClassifier, TcAttachType, links::FdLink};
use aya::{Ebpf, EbpfLoader};
use lb_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend4, Backend6, Nat4Entry, Nat4Key, Nat6Entry, Nat6Key, NodeConfig,
    NodePortKey, RevNat4,
    RevNat6, SockRevNat4Key, SockRevNat4Value, SockRevNat6Key, SockRevNat6Value, Svc4Key, Svc6Key, SvcValue, maps,
};

use super::maps::Maps;

/// The BPF object, built by build.rs.
pub(super) static OBJ: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb"));

/// The cgroup sock_addr programs, in attach order.
pub const PROGRAMS: [&str; 8] = [
    "lb_connect4",
    "lb_connect6",
    "lb_sendmsg4",
    "lb_sendmsg6",
    "lb_recvmsg4",
    "lb_recvmsg6",
    "lb_getpeername4",
    "lb_getpeername6",
];

/// The cgroup sock programs (NodePort bind protection).
pub const SOCK_PROGRAMS: [&str; 2] = ["lb_post_bind4", "lb_post_bind6"];

/// The TC programs, attached to each NodePort interface.
pub const TC_PROGRAMS: [(&str, TcAttachType); 2] =
    [("lb_nodeport_ingress", TcAttachType::Ingress), ("lb_nodeport_egress", TcAttachType::Egress)];


/// Map capacities (max_entries), overridable by flags.
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    pub services: u32,
    pub backends: u32,
    pub sock_revnat: u32,
    pub nat: u32,
}

impl Default for Capacity {
    fn default() -> Self {
        Self {
            services: lb_common::capacity::SERVICES,
            backends: lb_common::capacity::BACKENDS,
            sock_revnat: lb_common::capacity::SOCK_REVNAT,
            nat: lb_common::capacity::NAT,
        }
    }
}

fn fs_type(p: &Path) -> nix::Result<statfs::FsType> {
    statfs::statfs(p).map(|s| s.filesystem_type())
}

/// The cgroup v2 mount point, from /proc/mounts.
pub fn cgroup2_root() -> Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/mounts").context("read /proc/mounts")?;
    mounts
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            let (_, mnt, ty) = (f.next()?, f.next()?, f.next()?);
            (ty == "cgroup2").then(|| PathBuf::from(mnt))
        })
        .context("no cgroup v2: no cgroup2 mount in /proc/mounts (mount one with `mount -t cgroup2 none /sys/fs/cgroup`)")
}

pub fn check_root() -> Result<()> {
    // SAFETY: trivial syscall.
    if unsafe { libc::geteuid() } != 0 {
        bail!("not root: lb-agent needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN) to load and attach BPF programs");
    }
    Ok(())
}

/// The capabilities the agent needs, with what each is for.
const CAPS: [(caps::Capability, &str); 3] = [
    (caps::Capability::CAP_BPF, "load programs and create maps"),
    (caps::Capability::CAP_NET_ADMIN, "attach to cgroups and interfaces, destroy sockets"),
    (caps::Capability::CAP_SYS_ADMIN, "enter network namespaces and pin to bpffs"),
];

/// One line naming the first missing capability.
pub fn check_caps() -> Result<()> {
    for (cap, why) in CAPS {
        if !caps::has_cap(None, caps::CapSet::Effective, cap).context("read the process's capabilities")? {
            bail!("missing capability {cap} (needed to {why}); run lb-agent privileged, or grant CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_SYS_RESOURCE and CAP_PERFMON");
        }
    }
    Ok(())
}

/// `dir` must be on a bpffs, or be a directory we can create on one.
pub fn check_bpffs(dir: &Path) -> Result<()> {
    let probe = if dir.exists() { dir } else { dir.parent().unwrap_or(dir) };
    match fs_type(probe) {
        Ok(t) if t == statfs::BPF_FS_MAGIC => Ok(()),
        Ok(_) => bail!(
            "no bpffs: {} is not on a BPF filesystem (mount one with `mount -t bpf bpf /sys/fs/bpf`, or pass --bpffs)",
            probe.display()
        ),
        Err(e) => bail!("no bpffs: {}: {e} (mount one with `mount -t bpf bpf /sys/fs/bpf`)", probe.display()),
    }
}

pub fn check_cgroup(dir: &Path) -> Result<()> {
    let t = match fs_type(dir) {
        Ok(t) => t,
        Err(e) => bail!("no cgroup v2: {}: {e}", dir.display()),
    };
    if t == statfs::CGROUP2_SUPER_MAGIC {
        return Ok(());
    }
    if t == statfs::CGROUP_SUPER_MAGIC || (t == statfs::TMPFS_MAGIC && dir.starts_with("/sys/fs/cgroup")) {
        bail!(
            "no cgroup v2: {} is a cgroup v1 hierarchy; lb needs cgroup v2 (boot with the unified hierarchy, or pass \
             --cgroup with its mount, e.g. /sys/fs/cgroup/unified on a hybrid host)",
            dir.display()
        );
    }
    if t == statfs::TMPFS_MAGIC {
        bail!(
            "no cgroup v2: {} is a tmpfs, the top of a hybrid or cgroup v1 hierarchy; lb needs the cgroup v2 mount: \
             on a hybrid host pass its unified mount (usually /sys/fs/cgroup/unified; in the DaemonSet, the hostPath of \
             the `cgroup` volume)",
            dir.display()
        );
    }
    bail!("no cgroup v2: {} is not a cgroup v2 directory", dir.display())
}

/// The staging directory of an upgrade: new maps wait here, pinned, until
/// the agent has filled them and swaps them in.
const NEXT: &str = "next";
/// The pin-dir entry that records the layout version of the pins.
const LAYOUT_MARKER: &str = "layout-";

/// Where the pin of map `name` is now: staged in `next/` during an upgrade
/// that replaces it, else in `bpffs`.
pub fn pin_path(bpffs: &Path, name: &str) -> PathBuf {
    let staged = bpffs.join(NEXT).join(name);
    if staged.exists() { staged } else { bpffs.join(name) }
}

/// The layout version of the maps this agent uses (lb_common::LAYOUT_VERSION;
/// LB_LAYOUT_VERSION overrides it, for the upgrade test only).
fn layout_version() -> String {
    std::env::var("LB_LAYOUT_VERSION").unwrap_or_else(|_| lb_common::LAYOUT_VERSION.to_string())
}

/// The layout version the pins in `dir` carry ("1": pinned by an agent from
/// before versions were recorded).
fn pinned_layout_version(dir: &Path) -> String {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .find_map(|e| e.file_name().to_string_lossy().strip_prefix(LAYOUT_MARKER).map(String::from))
        .unwrap_or_else(|| "1".into())
}

/// Record `version` as the layout of the pins in `dir`.
fn mark_layout(dir: &Path, version: &str) -> Result<()> {
    for e in fs::read_dir(dir)?.flatten() {
        if e.file_name().to_string_lossy().starts_with(LAYOUT_MARKER) {
            fs::remove_dir(e.path())?;
        }
    }
    fs::create_dir_all(dir.join(format!("{LAYOUT_MARKER}{version}"))).context("record the layout version")
}

/// Every map with the type, key size, value size and max_entries this agent
/// gives it.
fn expected_layout(cap: &Capacity) -> [(&'static str, aya::maps::MapType, usize, usize, u32); 23] {
    use aya::maps::MapType as T;
    use lb_common::capacity as c;
    let revnat = cap.services.min(u16::MAX as u32);
    [
        (maps::NAT4, T::Hash, size_of::<Nat4Key>(), size_of::<Nat4Entry>(), cap.nat),
        (maps::NAT6, T::Hash, size_of::<Nat6Key>(), size_of::<Nat6Entry>(), cap.nat),
        (maps::SRC_RANGE, T::LpmTrie, 4 + size_of::<lb_common::SrcRange>(), size_of::<u8>(), c::SRC_RANGE),
        (maps::NODE_CONFIG, T::Array, size_of::<u32>(), size_of::<NodeConfig>(), 1),
        (maps::NODEPORTS, T::Hash, size_of::<NodePortKey>(), size_of::<u8>(), c::NODEPORTS),
        (maps::SERVICES4, T::Hash, size_of::<Svc4Key>(), size_of::<SvcValue>(), cap.services),
        (maps::BACKENDS4, T::Hash, size_of::<u32>(), size_of::<Backend4>(), cap.backends),
        (maps::REVNAT4, T::Hash, size_of::<u16>(), size_of::<RevNat4>(), revnat),
        (maps::SOCK_REVNAT4, T::LruHash, size_of::<SockRevNat4Key>(), size_of::<SockRevNat4Value>(), cap.sock_revnat),
        (maps::SERVICES6, T::Hash, size_of::<Svc6Key>(), size_of::<SvcValue>(), cap.services),
        (maps::BACKENDS6, T::Hash, size_of::<u32>(), size_of::<Backend6>(), cap.backends),
        (maps::REVNAT6, T::Hash, size_of::<u16>(), size_of::<RevNat6>(), revnat),
        (maps::SOCK_REVNAT6, T::LruHash, size_of::<SockRevNat6Key>(), size_of::<SockRevNat6Value>(), cap.sock_revnat),
        (maps::AFFINITY, T::LruHash, size_of::<AffinityKey>(), size_of::<AffinityValue>(), c::AFFINITY),
        (maps::AFFINITY_MATCH, T::Hash, size_of::<AffinityMatchKey>(), size_of::<u8>(), cap.backends),
        (maps::STATS, T::PerCpuArray, size_of::<u32>(), size_of::<u64>(), lb_common::stats::COUNT),
        (maps::SOCK_XLATE, T::SkStorage, size_of::<i32>(), size_of::<lb_common::SockXlate>(), 0),
        (maps::SVC_STATS, T::Hash, size_of::<lb_common::SvcStatsKey>(), size_of::<lb_common::SvcStats>(), revnat + cap.backends),
        (maps::MONITOR, T::Array, size_of::<u32>(), size_of::<u64>(), lb_common::monitor::SLOTS + 1),
        (maps::EVENTS[0], T::RingBuf, 0, 0, lb_common::monitor::RING_BYTES),
        (maps::EVENTS[1], T::RingBuf, 0, 0, lb_common::monitor::RING_BYTES),
        (maps::EVENTS[2], T::RingBuf, 0, 0, lb_common::monitor::RING_BYTES),
        (maps::EVENTS[3], T::RingBuf, 0, 0, lb_common::monitor::RING_BYTES),
    ]
}

/// The pinned maps in `dir` this agent cannot use as they are: another map
/// type, key or value size, or max_entries (a `--max-*` flag changed),
/// another BTF layout of key or value (a change of meaning at the same
/// size: fields swapped, renamed or retyped), or all of them when the pins
/// carry another layout version. Each is replaced by an upgrade.
fn incompatible(dir: &Path, cap: &Capacity) -> Result<Vec<&'static str>> {
    let version_changed = pinned_layout_version(dir) != layout_version();
    let ours = super::btf::object_layouts(OBJ).context("read the BTF of this agent's maps")?;
    let mut out = Vec::new();
    for (name, ty, k, v, max) in expected_layout(cap) {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let info = aya::maps::MapInfo::from_pin(&path).with_context(|| format!("inspect pinned map {}", path.display()))?;
        let got = info.map_type().ok();
        let same = got == Some(ty) && info.key_size() as usize == k && info.value_size() as usize == v && info.max_entries() == max;
        // A map pinned without BTF (by an agent from before BTF maps) is
        // judged by its sizes and the layout version alone.
        let btf_changed = match (super::btf::pinned_layout(&path), ours.get(name)) {
            (Ok(Some(pinned)), Some(want)) if pinned != *want => {
                tracing::info!(map = name, pinned = ?pinned, wanted = ?want, "pinned map's BTF layout differs");
                true
            }
            (Err(e), _) => {
                tracing::warn!(map = name, error = format!("{e:#}"), "cannot read the pinned map's BTF; it is replaced");
                true
            }
            _ => false,
        };
        if version_changed || btf_changed || !same {
            tracing::info!(
                map = name,
                pinned = format!("{got:?} {}/{} x{}", info.key_size(), info.value_size(), info.max_entries()),
                wanted = format!("{ty:?} {k}/{v} x{max}"),
                version_changed,
                btf_changed,
                "pinned map gets a new layout"
            );
            out.push(name);
        }
    }
    Ok(out)
}

/// The loaded dataplane. Dropping it leaves everything pinned and attached.
pub struct Dataplane {
    pub maps: Maps,
    /// `--bpf-log`: the programs' log records, when logging is on.
    pub logs: Option<aya_log::EbpfLogger<BpfLogSink>>,
    /// Maps replaced by an upgrade, staged until the agent has filled them;
    /// the programs attach when `Tc::finish_upgrade` swaps them in.
    pub upgrade: Option<Vec<&'static str>>,
    /// Keeps the object, the TC programs and the pin-dir lock for the
    /// agent's lifetime.
    pub tc: Tc,
    pub adopted: bool,
}

/// `--bpf-log`: the level of the programs' aya-log records (`off`: none;
/// the records are compiled in, and removed at load).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BpfLog {
    #[default]
    Off,
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl BpfLog {
    /// aya-log's level number (Error = 1 .. Trace = 5); 0 turns all off.
    fn level(self) -> u8 {
        match self {
            BpfLog::Off => 0,
            BpfLog::Error => aya_log::Level::Error as u8,
            BpfLog::Warn => aya_log::Level::Warn as u8,
            BpfLog::Info => aya_log::Level::Info as u8,
            BpfLog::Debug => aya_log::Level::Debug as u8,
            BpfLog::Trace => aya_log::Level::Trace as u8,
        }
    }
}

/// The programs' log records, into the agent's log (target `lb_bpf`, at
/// info level whatever their own, so that RUST_LOG=info shows what
/// `--bpf-log` asked for).
pub struct BpfLogSink;

impl log::Log for BpfLogSink {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, r: &log::Record<'_>) {
        let msg = r.args().to_string();
        tracing::info!(target: "lb_bpf", level = %r.level(), "{}", hook_words(&msg));
    }
    fn flush(&self) {}
}

/// The programs' decision lines start with `hook << 8 | protocol` as a
/// number and end with ` errno=N` (arguments the verifier walks cheaply):
/// write them as the monitor does, `connect TCP FRONT -> BACKEND (why)` or
/// `... -> ECONNREFUSED (why)`.
fn hook_words(msg: &str) -> String {
    let Some((code, rest)) = msg.split_once(' ') else { return msg.to_string() };
    let Ok(code) = code.parse::<u16>() else { return msg.to_string() };
    let proto = match code as u8 {
        lb_common::PROTO_TCP => "TCP",
        lb_common::PROTO_UDP => "UDP",
        _ => return msg.to_string(),
    };
    let mut rest = rest.to_string();
    if let Some((head, errno)) = rest.rsplit_once(" errno=")
        && let Ok(errno) = errno.parse::<i32>()
    {
        rest = match (errno, head.split_once(" -> "), head.rfind(" (")) {
            (0, _, _) => head.to_string(),
            (e, Some((front, _)), Some(why)) => format!("{front} -> {:?}{}", nix::errno::Errno::from_raw(e), &head[why..]),
            _ => head.to_string(),
        };
    }
    format!("{} {proto} {rest}", lb_common::monitor::hook_name((code >> 8) as u8))
}

/// How the TC programs attach (`--tc-attach`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TcAttach {
    /// TCX where the kernel has it (6.6+), else netlink.
    #[default]
    Auto,
    /// TCX links, pinned like the cgroup links.
    Tcx,
    /// A clsact qdisc and netlink filters (what kernels before 6.6 have).
    Netlink,
}

/// The loaded object, for attaching the TC programs to interfaces.
pub struct Tc {
    pub mode: TcAttach,
    cgroup: PathBuf,
    ebpf: Ebpf,
    bpffs: PathBuf,
    attached: std::collections::BTreeSet<String>,
    /// Held for the agent's lifetime: one agent per --bpffs.
    _lock: fs::File,
}

/// Take an exclusive lock on the pin directory, so that two agents never
/// program the same maps. The kernel drops it when the agent dies.
fn lock(dir: &Path) -> Result<fs::File> {
    use std::os::fd::AsRawFd as _;
    let f = fs::File::open(dir).with_context(|| format!("open {}", dir.display()))?;
    // SAFETY: valid fd.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        bail!("another lb-agent is running with --bpffs {}", dir.display());
    }
    Ok(f)
}

/// Load the programs, reusing pinned maps, and attach them to `cgroup`,
/// replacing links an earlier agent pinned without a gap. Pinned maps of
/// another layout are not touched: new ones are staged beside them, and
/// nothing is attached until `Tc::finish_upgrade`.
pub fn load(bpffs: &Path, cgroup: &Path, cap: Capacity, bpf_log: BpfLog) -> Result<Dataplane> {
    check_bpffs(bpffs)?;
    check_cgroup(cgroup)?;
    fs::create_dir_all(bpffs.join("links")).with_context(|| format!("create {}", bpffs.display()))?;
    let lock = lock(bpffs)?;
    // An upgrade an earlier agent did not finish (killed in the middle): its
    // staged maps were never used; start over.
    let next = bpffs.join(NEXT);
    if next.exists() {
        tracing::warn!("an earlier upgrade did not finish; its staged maps are dropped and it starts over");
        for e in fs::read_dir(&next)?.flatten() {
            fs::remove_file(e.path()).with_context(|| format!("unpin {}", e.path().display()))?;
        }
        fs::remove_dir(&next)?;
    }
    let adopted = bpffs.join(maps::SERVICES4).exists();
    let replaced = if adopted { incompatible(bpffs, &cap)? } else { Vec::new() };
    if !replaced.is_empty() {
        fs::create_dir_all(&next).with_context(|| format!("create {}", next.display()))?;
        tracing::info!(maps = ?replaced, "upgrade: new maps are staged and filled before the programs move to them");
    }

    let pins: Vec<(&str, PathBuf)> =
        maps::ALL.iter().map(|m| (*m, if replaced.contains(m) { next.join(m) } else { bpffs.join(m) })).collect();
    let mut loader = EbpfLoader::new();
    for (name, path) in &pins {
        loader.map_pin_path(name, path.as_path());
    }
    for (name, _, _, _, max) in expected_layout(&cap) {
        loader.map_max_entries(name, max);
    }
    let level = bpf_log.level();
    loader.override_global(aya_log::LEVEL, &level, true);
    let mut ebpf = loader.load(OBJ).context("load the BPF object")?;
    let logs = if level == 0 {
        None
    } else {
        Some(aya_log::EbpfLogger::init_with_logger(&mut ebpf, BpfLogSink).context("--bpf-log: the programs' log ring buffer")?)
    };
    for name in PROGRAMS {
        let prog: &mut CgroupSockAddr = ebpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the object"))?
            .try_into()?;
        prog.load().with_context(|| format!("verify program {name}"))?;
    }
    for name in SOCK_PROGRAMS {
        let prog: &mut CgroupSock = ebpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the object"))?
            .try_into()?;
        prog.load().with_context(|| format!("verify program {name}"))?;
    }
    for (name, _) in TC_PROGRAMS {
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the object"))?
            .try_into()?;
        prog.load().with_context(|| format!("verify program {name}"))?;
    }
    let maps = Maps::open_pinned(bpffs)?;
    let mut tc = Tc {
        mode: TcAttach::Auto,
        cgroup: cgroup.to_path_buf(),
        ebpf,
        bpffs: bpffs.to_path_buf(),
        attached: Default::default(),
        _lock: lock,
    };
    let upgrade = if replaced.is_empty() {
        tc.attach_cgroup()?;
        mark_layout(bpffs, &layout_version())?;
        None
    } else {
        Some(replaced)
    };
    Ok(Dataplane { maps, logs, upgrade, tc, adopted })
}

/// Pin a new link beside the old one, then rename it over the old one: the
/// old link is released (detached) only once the new one is attached. Both
/// programs translate idempotently meanwhile.
fn pin_link(bpffs: &Path, name: &str, link: FdLink) -> Result<()> {
    let final_path = bpffs.join("links").join(name);
    // bpffs forbids dots in names.
    let tmp = bpffs.join("links").join(format!("{name}_new"));
    let _ = fs::remove_file(&tmp);
    link.pin(&tmp).with_context(|| format!("pin link {}", tmp.display()))?;
    fs::rename(&tmp, &final_path).with_context(|| format!("pin link {}", final_path.display()))?;
    Ok(())
}

impl Tc {
    /// Attach the cgroup programs, each replacing an earlier agent's link
    /// without a gap.
    fn attach_cgroup(&mut self) -> Result<()> {
        let cg = fs::File::open(&self.cgroup).with_context(|| format!("open cgroup {}", self.cgroup.display()))?;
        for name in PROGRAMS {
            let prog: &mut CgroupSockAddr = self.ebpf.program_mut(name).context("cgroup program")?.try_into()?;
            // A cgroup bpf_link is always multi-attach; the kernel rejects any
            // flag on link_create, and Single passes none.
            let id = prog
                .attach(cg.as_fd(), CgroupAttachMode::Single)
                .with_context(|| format!("attach {name} to {}", self.cgroup.display()))?;
            let link: FdLink = prog.take_link(id)?.try_into().context("link is not an fd link")?;
            pin_link(&self.bpffs, name, link)?;
        }
        for name in SOCK_PROGRAMS {
            let prog: &mut CgroupSock = self.ebpf.program_mut(name).context("cgroup program")?.try_into()?;
            let id = prog
                .attach(cg.as_fd(), CgroupAttachMode::Single)
                .with_context(|| format!("attach {name} to {}", self.cgroup.display()))?;
            let link: FdLink = prog.take_link(id)?.try_into().context("link is not an fd link")?;
            pin_link(&self.bpffs, name, link)?;
        }
        Ok(())
    }

    /// Finish an upgrade once the staged maps hold what the agent programs
    /// (its first full sync): carry the state the old programs keep
    /// (sessionAffinity, socket tracking, NAT flows) over where the layout
    /// allows, move every program to the new maps (each link replaced
    /// without a gap, TC ones on every device an earlier agent used), put
    /// the new maps' pins in place of the old ones, and drop links of
    /// programs this agent does not have.
    pub fn finish_upgrade(&mut self, replaced: &[&'static str]) -> Result<()> {
        let copied = carry_state(&self.bpffs, replaced, true);
        self.attach_cgroup()?;
        let links = self.bpffs.join("links");
        let mut ifaces = BTreeSet::new();
        for e in fs::read_dir(&links)?.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            for (prog, _) in TC_PROGRAMS {
                if let Some(iface) = n.strip_prefix(prog).and_then(|r| r.strip_prefix('_')) {
                    ifaces.insert(iface.to_string());
                }
            }
        }
        for iface in ifaces {
            if let Err(e) = self.attach_tc(&iface) {
                tracing::warn!(iface, "upgrade: {e:#}");
            }
        }
        // What the old programs added between the copy and the switch.
        let late = carry_state(&self.bpffs, replaced, false);
        for name in replaced {
            let staged = self.bpffs.join(NEXT).join(name);
            fs::rename(&staged, self.bpffs.join(name)).with_context(|| format!("move {} in place", staged.display()))?;
        }
        fs::remove_dir(self.bpffs.join(NEXT))?;
        let known: BTreeSet<&str> = PROGRAMS.iter().chain(SOCK_PROGRAMS.iter()).copied().collect();
        for e in fs::read_dir(&links)?.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            let tc = TC_PROGRAMS.iter().any(|(p, _)| n.starts_with(&format!("{p}_")));
            if !known.contains(n.as_str()) && !tc {
                tracing::info!(link = n, "upgrade: unpinning the link of a program this agent does not have");
                fs::remove_file(e.path())?;
            }
        }
        mark_layout(&self.bpffs, &layout_version())?;
        tracing::info!(maps = ?replaced, entries_carried = copied + late, "upgrade finished: programs moved to the new maps");
        Ok(())
    }

    /// Attach the TC programs to `iface` (ingress and egress), once per agent.
    /// With TCX (kernel 6.6+) the links are pinned like the cgroup ones;
    /// otherwise aya falls back to a clsact qdisc and netlink filters.
    pub fn attach_tc(&mut self, iface: &str) -> Result<()> {
        if self.attached.contains(iface) {
            return Ok(());
        }
        let tcx = match self.mode {
            TcAttach::Auto => aya::util::KernelVersion::current().is_ok_and(|v| v >= aya::util::KernelVersion::new(6, 6, 0)),
            TcAttach::Tcx => true,
            TcAttach::Netlink => false,
        };
        if !tcx {
            // The netlink fallback needs a clsact qdisc.
            // It may exist already; a real failure shows in the attach below.
            if let Err(e) = aya::programs::tc::qdisc_add_clsact(iface) {
                tracing::debug!(iface, "clsact qdisc: {e}");
            }
        }
        let safe: String = iface.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
        for (name, ty) in TC_PROGRAMS {
            let prog: &mut SchedClassifier = self.ebpf.program_mut(name).context("TC program")?.try_into()?;
            if !tcx {
                attach_netlink(prog, iface, ty).with_context(|| format!("attach {name} to {iface} (netlink)"))?;
                continue;
            }
            let opts = aya::programs::tc::TcAttachOptions::TcxOrder(Default::default());
            let id = prog.attach_with_options(iface, ty, opts).with_context(|| format!("attach {name} to {iface} (tcx)"))?;
            let link = prog.take_link(id)?;
            let fd = FdLink::try_from(link).map_err(|_| anyhow::anyhow!("attach {name} to {iface}: not a TCX link"))?;
            pin_link(&self.bpffs, &format!("{name}_{safe}"), fd)?;
        }
        // A SNATed flow's packets re-enter the stack with this node's own
        // address as their source: accept them (as Cilium does).
        for (knob, value) in [("accept_local", "1"), ("rp_filter", "0")] {
            let path = format!("/proc/sys/net/ipv4/conf/{iface}/{knob}");
            if let Err(e) = fs::write(&path, value) {
                tracing::warn!(iface, "cannot set {path} to {value}: {e}; SNATed NodePort flows may be dropped");
            }
        }
        self.attached.insert(iface.to_string());
        tracing::info!(iface, tcx, "NodePort programs attached");
        Ok(())
    }
}

/// The netlink filters' place: one priority and handle for lb, so that a
/// new agent replaces the filters of the one before atomically (no gap, no
/// second copy) and teardown finds them.
const NL_PRIORITY: u16 = 0x4c42;
const NL_HANDLE: u32 = 1;

/// Attach `prog` as the clsact filter at lb's place on `iface`, replacing
/// what an earlier agent put there. The filter stays after the agent exits
/// (netlink filters are not links); `lb-agent teardown` removes it.
fn attach_netlink(prog: &mut SchedClassifier, iface: &str, ty: TcAttachType) -> Result<()> {
    use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle};
    let handle = TcHandle::from(NL_HANDLE);
    let opts = TcAttachOptions::Netlink(NlOptions { priority: NL_PRIORITY, handle, ..Default::default() });
    let id = match prog.attach_with_options(iface, ty, opts) {
        Ok(id) => id,
        // An earlier agent's filter is there: swap the program in place.
        Err(_) => {
            let old = SchedClassifierLink::attached(iface, ty, NL_PRIORITY, handle, None)?;
            prog.attach_to_link(old)?
        }
    };
    // Dropping the link would detach the filter: keep it attached.
    std::mem::forget(prog.take_link(id)?);
    Ok(())
}

/// Copy the entries of the state maps the datapath writes (sessionAffinity,
/// socket tracking, NAT) from their old pins to the staged new maps, where
/// key and value sizes and their BTF layouts agree (the new map may be
/// larger or smaller: a `--max-*` change); entries already in the new map
/// win. `warn`: say which maps' entries cannot come along. Returns how many
/// were copied.
fn carry_state(bpffs: &Path, replaced: &[&'static str], warn: bool) -> usize {
    fn copy<K: aya::Pod, V: aya::Pod>(old: &Path, new: &Path, lru: bool) -> Result<usize> {
        use aya::maps::{HashMap, Map, MapData};
        let wrap = |d: MapData| if lru { Map::LruHashMap(d) } else { Map::HashMap(d) };
        let from: HashMap<MapData, K, V> = HashMap::try_from(wrap(MapData::from_pin(old)?))?;
        let mut to: HashMap<MapData, K, V> = HashMap::try_from(wrap(MapData::from_pin(new)?))?;
        let mut n = 0;
        for (k, v) in from.iter().filter_map(|r| r.ok()) {
            // BPF_NOEXIST: never overwrite what the new programs wrote.
            if to.insert(k, v, 1).is_ok() {
                n += 1;
            }
        }
        Ok(n)
    }
    let mut total = 0;
    for name in replaced {
        let (old, new) = (bpffs.join(name), bpffs.join(NEXT).join(name));
        let same_sizes = match (aya::maps::MapInfo::from_pin(&old), aya::maps::MapInfo::from_pin(&new)) {
            (Ok(a), Ok(b)) => a.key_size() == b.key_size() && a.value_size() == b.value_size() && a.map_type().ok() == b.map_type().ok(),
            _ => false,
        };
        // Same sizes but another BTF layout: the bytes mean something else.
        let same_btf = match (super::btf::pinned_layout(&old), super::btf::pinned_layout(&new)) {
            (Ok(Some(a)), Ok(Some(b))) => a == b,
            (Ok(None), Ok(_)) | (Ok(_), Ok(None)) => true,
            _ => false,
        };
        if !same_sizes || !same_btf {
            if warn && [maps::AFFINITY, maps::SOCK_REVNAT4, maps::SOCK_REVNAT6, maps::NAT4, maps::NAT6].contains(name) {
                tracing::warn!(map = name, "upgrade: its entries have another layout and are not carried over");
            }
            continue;
        }
        let r = match *name {
            maps::AFFINITY => copy::<AffinityKey, AffinityValue>(&old, &new, true),
            maps::SOCK_REVNAT4 => copy::<SockRevNat4Key, SockRevNat4Value>(&old, &new, true),
            maps::SOCK_REVNAT6 => copy::<SockRevNat6Key, SockRevNat6Value>(&old, &new, true),
            maps::NAT4 => copy::<Nat4Key, Nat4Entry>(&old, &new, false),
            maps::NAT6 => copy::<Nat6Key, Nat6Entry>(&old, &new, false),
            _ => Ok(0),
        };
        match r {
            Ok(n) => total += n,
            Err(e) => tracing::warn!(map = name, "upgrade: carrying entries over: {e:#}"),
        }
    }
    total
}

/// Detach and unpin everything under `bpffs`. Idempotent.
pub fn teardown(bpffs: &Path) -> Result<()> {
    check_bpffs(bpffs)?;
    if !bpffs.exists() {
        return Ok(());
    }
    // The NodePort range lb reserved in this netns goes too.
    crate::nodeport::unreserve_ports(bpffs)?;
    // Links first, so that nothing reads the maps while they go away.
    let links = bpffs.join("links");
    if links.exists() {
        for e in fs::read_dir(&links)? {
            let p = e?.path();
            fs::remove_file(&p).with_context(|| format!("unpin {}", p.display()))?;
        }
        fs::remove_dir(&links).with_context(|| format!("remove {}", links.display()))?;
    }
    // Netlink filters (--tc-attach netlink) are not links: remove ours from
    // this network namespace's devices.
    if let Ok(links) = crate::netdev::links() {
        for l in links {
            for (name, ty) in TC_PROGRAMS {
                let _ = aya::programs::tc::qdisc_detach_program(&l.name, ty, name);
            }
        }
    }
    let next = bpffs.join(NEXT);
    if next.exists() {
        for e in fs::read_dir(&next)?.flatten() {
            fs::remove_file(e.path()).with_context(|| format!("unpin {}", e.path().display()))?;
        }
        fs::remove_dir(&next)?;
    }
    for e in fs::read_dir(bpffs)?.flatten() {
        if e.file_name().to_string_lossy().starts_with(LAYOUT_MARKER) {
            fs::remove_dir(e.path())?;
        }
    }
    for m in maps::ALL {
        let p = bpffs.join(m);
        if p.exists() {
            fs::remove_file(&p).with_context(|| format!("unpin {}", p.display()))?;
        }
    }
    fs::remove_dir(bpffs).with_context(|| format!("remove {} (not empty?)", bpffs.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn decision_lines_name_their_hook_and_protocol() {
        assert_eq!(super::hook_words("262 10.96.0.10:80 -> 10.0.0.1:8080 (translated) errno=0"), "connect TCP 10.96.0.10:80 -> 10.0.0.1:8080 (translated)");
        assert_eq!(super::hook_words("785 [fd00::1]:53 -> [::]:0 (no endpoints) errno=111"), "tc UDP [fd00::1]:53 -> ECONNREFUSED (no endpoints)");
        assert_eq!(super::hook_words("something else"), "something else");
        assert_eq!(super::hook_words("12 not a hook"), "12 not a hook");
    }
}
