//! Load, pin and attach the BPF programs; adopt what an earlier agent left;
//! tear everything down.
//!
//! Pin layout under `--bpffs DIR` (nothing global, so that several agents can
//! run on one machine):
//!   DIR/<MAP>          every map, reused by the next agent
//!   DIR/links/<PROG>   the cgroup links; they keep the programs attached
//!                      while no agent runs
//!   DIR/links/<PROG>_<IFACE>  the TCX and XDP links of a NodePort device,
//!                      and of a pod device (`lb_pod_ingress`); an L3
//!                      device's links carry the names of the Ethernet
//!                      programs whose place they take (`L3_PROGRAMS`)
use std::collections::BTreeSet;
use std::fs;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use aya::programs::{CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSock, CgroupSockAddr, SchedClassifier, TcAttachType, Xdp, XdpMode, links::FdLink};
use aya::{Ebpf, EbpfLoader};
use lb_common::maps;

use super::maps::Maps;
pub use super::bpflog::{BpfLog, BpfLogSink};
pub use super::checks::{NAT_ENTRY_BYTES, SOCK_STORAGE_BYTES, cgroup2_root, check_bpffs, check_caps, check_cgroup, check_kernel, check_root, memory_limit};
pub use super::upgrade::{live_pin, nat_timer_pin, old_pin, pin_path, staged_pin, upgrade_marks};
use super::upgrade::{
    INPLACE, LATE_DONE, LAYOUT_MARKER, MOVING, NEXT, Pass, Unfinished, carry_ids, carry_state, expected_layout, finish_moved, incompatible, layout_version,
    mark_layout, mark_next, marked, readable_as_ours, remove_next, unfinished,
};

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
pub const SOCK_PROGRAMS: [&str; 3] = ["lb_post_bind4", "lb_post_bind6", "lb_sock_release"];

/// The cgroup egress program: loadBalancerSourceRanges for the sockets the
/// hooks sent to a frontend with ranges.
pub const EGRESS_PROGRAM: &str = "lb_sock_egress";

/// The kernel's own NAT expiry while no agent runs: never attached, run
/// once at each start to arm its timer (`Tc::arm_nat_gc`).
pub const NAT_GC_PROGRAM: &str = "lb_nat_gc_arm";

/// The TC programs, attached to each NodePort interface.
pub const TC_PROGRAMS: [(&str, TcAttachType); 2] =
    [("lb_nodeport_ingress", TcAttachType::Ingress), ("lb_nodeport_egress", TcAttachType::Egress)];

/// The TC programs for NodePort interfaces without a link-layer header
/// (WireGuard, IPIP, GRE, TUN), in the same order as `TC_PROGRAMS`.
pub const L3_PROGRAMS: [(&str, TcAttachType); 2] = [("lb_l3_ingress", TcAttachType::Ingress), ("lb_l3_egress", TcAttachType::Egress)];

/// The XDP program (`--nodeport-acceleration xdp`), on each NodePort
/// interface beside the TC programs.
pub const XDP_PROGRAM: &str = "lb_nodeport_xdp";

/// The TC program on the pod devices with `--bpf-forward` or
/// `--per-packet-lb` (ingress: what the pod sends): it forwards the replies
/// of local backends, and translates what pods send to Service addresses.
pub const POD_PROGRAM: &str = "lb_pod_ingress";

/// The TC program on the pod devices with `--per-packet-lb` (egress: what
/// goes into the pod): it translates the replies of the pod's flows.
pub const POD_EGRESS_PROGRAM: &str = "lb_pod_egress";

/// Both, with where they attach.
pub const POD_PROGRAMS: [(&str, TcAttachType); 2] = [(POD_PROGRAM, TcAttachType::Ingress), (POD_EGRESS_PROGRAM, TcAttachType::Egress)];

/// The programs whose links are pinned per NodePort device (`<PROG>_<IFACE>`).
fn device_programs() -> impl Iterator<Item = &'static str> {
    TC_PROGRAMS.iter().map(|(p, _)| *p).chain([XDP_PROGRAM])
}

/// Why a loopback device gets no NodePort programs.
pub fn loopback_refused(iface: &str) -> String {
    format!(
        "--nodeport-interface {iface}: the loopback device gets no NodePort programs (its packets are the node's own, from its own addresses, which the programs refuse from outside; the socket hooks serve the node's own connections)"
    )
}

/// An interface name as a pin name part (bpffs forbids dots).
fn pin_safe(iface: &str) -> String {
    iface.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

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
    /// `--nodeport-acceleration xdp`: the XDP program goes on each NodePort
    /// interface too; otherwise an earlier agent's is taken off.
    pub xdp: bool,
    /// The veths XDP runs on, and their XDP send errors when last read.
    xdp_veths: std::collections::BTreeMap<String, u64>,
    cgroup: PathBuf,
    ebpf: Ebpf,
    bpffs: PathBuf,
    /// The NodePort devices the TC programs are attached to, by name, with
    /// the index the device had then: a tunnel deleted and created again
    /// (a CNI restart) is a new device and needs them again.
    attached: std::collections::BTreeMap<String, u32>,
    /// The NodePort devices (`pin_safe`) at the last `detach_unserved`.
    served: Option<BTreeSet<String>>,
    /// Devices this agent served that are no NodePort devices now, since
    /// when: their programs stay a grace (`detach_unserved`).
    unserved: std::collections::BTreeMap<String, std::time::Instant>,
    /// The pod devices the pod programs are attached to, by name, with the
    /// index the device had then (a name may come back on a new device).
    pods: std::collections::BTreeMap<String, u32>,
    /// `POD_PROGRAM` goes on the pod devices (`--bpf-forward`,
    /// `--per-packet-lb`, flows masqueraded in BPF).
    pub pod_ingress: bool,
    /// `POD_EGRESS_PROGRAM` goes on the pod devices (`--per-packet-lb`,
    /// DSR frontends).
    pub pod_egress: bool,
    /// This upgrade's new programs see the old NAT tables (`NAT4_PREV`).
    adopt: bool,
    /// When this agent last armed the kernel's NAT expiry (or tried to):
    /// from then on it sees that the timer goes on (`check_nat_gc`).
    nat_gc_armed: Option<std::time::Instant>,
    /// Its last arm failed: the timer counts as stopped whatever it shows
    /// (an earlier agent's callback may look on, on tables the programs
    /// left), and /metrics says not armed.
    pub nat_gc_failed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The timer's last look seen by `nat_gc_stopped` (0: none yet).
    nat_gc_seen: u64,
    /// Held for the agent's lifetime: one agent per --bpffs.
    _lock: fs::File,
}

/// Take an exclusive lock on the pin directory, so that two agents never
/// program the same maps. The kernel drops it when the agent dies and
/// every process holding the directory open has closed it: a child the
/// agent was starting when it was killed (the kube-proxy checks run
/// `iptables-save`) keeps it until it has exec'd. So a lock still held is
/// waited for, up to `LOCK_WAIT`, before it is an error.
fn lock(dir: &Path) -> Result<fs::File> {
    lock_waiting(dir, LOCK_WAIT, "another lb-agent is running with --bpffs")
}

/// `lock`, waiting up to `wait`; `busy` begins the error.
fn lock_waiting(dir: &Path, wait: std::time::Duration, busy: &str) -> Result<fs::File> {
    use std::os::fd::AsRawFd as _;
    use std::os::unix::fs::MetadataExt as _;
    let f = fs::File::open(dir).with_context(|| format!("open {}", dir.display()))?;
    let start = std::time::Instant::now();
    let mut said = false;
    // SAFETY: valid fd.
    while unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let holder = f.metadata().ok().and_then(|m| lock_holder(&fs::read_to_string("/proc/locks").unwrap_or_default(), m.ino()));
        let holder = holder.map(|pid| match fs::read_to_string(format!("/proc/{pid}/comm")) {
            Ok(comm) => format!("pid {pid} ({})", comm.trim()),
            Err(_) => format!("pid {pid}, which has exited (a process it started still holds the directory open)"),
        });
        let holder = holder.unwrap_or_else(|| "another process".into());
        if start.elapsed() >= wait {
            bail!("{busy} {}: its lock is held by {holder}", dir.display());
        }
        if !said {
            tracing::warn!(bpffs = %dir.display(), "the pin directory is locked by {holder}; waiting up to {}s for it to exit", wait.as_secs());
            said = true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Ok(f)
}

/// How long `lock` waits for an earlier agent's lock to go.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The pid that took the FLOCK on inode `ino`, from /proc/locks
/// (`1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF`).
fn lock_holder(locks: &str, ino: u64) -> Option<u32> {
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (kind, pid, dev_ino) = (f.get(1)?, f.get(4)?, f.get(5)?);
        (*kind == "FLOCK" && dev_ino.rsplit(':').next()?.parse::<u64>().ok()? == ino).then(|| pid.parse().ok())?
    })
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
    let mut resumed = None;
    // `next/` markers an agent from before them moved into the pin dir
    // (as pins) when it finished an upgrade: they mean nothing there.
    for e in fs::read_dir(bpffs).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(INPLACE) {
            let _ = fs::remove_file(e.path());
        }
    }
    if next.exists() {
        match unfinished(bpffs, &cap)? {
            Unfinished::Resume(staged) => {
                tracing::warn!(maps = ?staged, "an earlier upgrade to this layout did not finish; this agent resumes it on its staged maps");
                resumed = Some(staged);
            }
            Unfinished::Finish => {
                // Its programs began to move: the staged maps are live.
                let copied = finish_moved(bpffs)?;
                tracing::warn!(
                    entries_carried = copied,
                    "an earlier upgrade stopped after its programs had begun to move to its staged maps: it is finished (those maps put in place, not dropped)"
                );
            }
            Unfinished::Drop => {
                tracing::warn!("an earlier upgrade did not finish; its staged maps are dropped and it starts over");
                remove_next(&next)?;
            }
        }
    }
    // The loader reads the kernel's BTF (about 0.1 s) while the pinned
    // maps' layouts are compared.
    let new_loader = std::thread::spawn(EbpfLoader::new);
    let adopted = bpffs.join(maps::SERVICES4).exists();
    let replaced = match resumed {
        Some(staged) => staged,
        None if adopted => incompatible(bpffs, &cap)?,
        None => Vec::new(),
    };
    if !replaced.is_empty() && !next.exists() {
        fs::create_dir_all(&next).with_context(|| format!("create {}", next.display()))?;
        // The staged maps' layout, for an agent that resumes or finishes
        // this upgrade should this one be killed.
        mark_next(bpffs, &format!("{LAYOUT_MARKER}{}", layout_version()))?;
        // And the maps the pins lack, which the loader pins in place.
        for m in maps::ALL.iter().filter(|m| !replaced.contains(m) && !bpffs.join(m).exists()) {
            mark_next(bpffs, &format!("{INPLACE}{m}"))?;
        }
        tracing::info!(maps = ?replaced, "upgrade: new maps are staged and filled before the programs move to them");
    }

    let pins: Vec<(&str, PathBuf)> =
        maps::ALL.iter().map(|m| (*m, if replaced.contains(m) { next.join(m) } else { bpffs.join(m) })).collect();
    let mut loader = new_loader.join().map_err(|_| anyhow::anyhow!("reading the kernel's BTF panicked"))?;
    for (name, path) in &pins {
        loader.map_pin_path(name, path.as_path());
    }
    for (name, _, _, _, max) in expected_layout(&cap) {
        loader.map_max_entries(name, max);
    }
    // The old NAT tables, for the new programs to take flows from while
    // they move (`LB_ADOPT`), where the upgrade replaces them
    // and they read as this agent's; otherwise an unpinned table of one
    // entry each, never looked at.
    let adopt = [maps::NAT4, maps::NAT6].iter().all(|name| replaced.contains(name) && readable_as_ours(bpffs, name, &cap));
    for (name, prev) in [(maps::NAT4, NAT4_PREV), (maps::NAT6, NAT6_PREV)] {
        if adopt {
            loader.map_pin_path(prev, bpffs.join(name));
        } else {
            loader.map_max_entries(prev, 1);
        }
    }
    if adopt {
        tracing::info!("upgrade: the new programs take flows missing from the new NAT tables from the old ones until the second copy");
    }
    let level = bpf_log.level();
    loader.override_global(aya_log::LEVEL, &level, true);
    let mut ebpf = loader.load(OBJ).context("load the BPF object")?;
    let logs = if level == 0 {
        None
    } else {
        Some(aya_log::EbpfLogger::init_with_logger(&mut ebpf, BpfLogSink).context("--bpf-log: the programs' log ring buffer")?)
    };
    // Verified at every start, `lb_nodeport_ingress` on a thread of its
    // own beside the others (the verifier runs in the loading thread, and
    // that one alone takes about as long as all the others together). The
    // L3, pod and XDP programs are verified when a flag or a first device
    // needs them (`Tc::verify_optional`, `attach_tc`, `attach_pod`,
    // `attach_xdp`): most nodes need none of them, and verifying them cost
    // every start about 0.6 s (`lb_pod_ingress` alone 0.5 s).
    let heavy = TC_PROGRAMS[0].0;
    let names: Vec<&str> = PROGRAMS.iter().chain(&SOCK_PROGRAMS).copied().chain([EGRESS_PROGRAM, NAT_GC_PROGRAM]).chain(TC_PROGRAMS.map(|(n, _)| n)).collect();
    for name in &names {
        ebpf.program(name).with_context(|| format!("program {name} missing from the object"))?;
    }
    let (mut alone, mut rest): (Vec<_>, Vec<_>) =
        ebpf.programs_mut().filter(|(n, _)| names.contains(n)).partition(|(n, _)| *n == heavy);
    std::thread::scope(|scope| -> Result<()> {
        let alone = scope.spawn(move || alone.iter_mut().try_for_each(|(name, prog)| verify_any(name, prog)));
        rest.iter_mut().try_for_each(|(name, prog)| verify_any(name, prog))?;
        alone.join().map_err(|_| anyhow::anyhow!("verifying {heavy} panicked"))?
    })?;
    for name in POD_PROGRAMS.iter().map(|(n, _)| *n).chain(L3_PROGRAMS.iter().map(|(n, _)| *n)).chain([XDP_PROGRAM]) {
        ebpf.program(name).with_context(|| format!("program {name} missing from the object"))?;
    }
    // A resumed upgrade whose programs had begun to move: the staged maps
    // are live and hold the ids (and the state, below) the killed agent
    // carried; what its programs deleted since must not come back.
    if !replaced.is_empty() && !marked(bpffs, MOVING) {
        let n = carry_ids(bpffs, &replaced);
        tracing::info!(entries = n, "upgrade: frontend and backend ids carried into the staged maps");
    }
    let maps = Maps::open_pinned(bpffs)?;
    // The upgrade replaced any other layout of it (`list` alone reads those).
    anyhow::ensure!(maps.svc_stats.is_some(), "{} under {} is not of this agent's layout", lb_common::maps::SVC_STATS, bpffs.display());
    let mut tc = Tc {
        mode: TcAttach::Auto,
        xdp: false,
        xdp_veths: Default::default(),
        cgroup: cgroup.to_path_buf(),
        ebpf,
        bpffs: bpffs.to_path_buf(),
        attached: Default::default(),
        served: None,
        unserved: Default::default(),
        pods: Default::default(),
        pod_ingress: false,
        pod_egress: false,
        adopt,
        nat_gc_armed: None,
        nat_gc_failed: Default::default(),
        nat_gc_seen: 0,
        _lock: lock,
    };
    let upgrade = if replaced.is_empty() {
        tc.attach_cgroup()?;
        tc.unpin_unknown_links(true);
        mark_layout(bpffs, &layout_version())?;
        None
    } else {
        Some(replaced)
    };
    Ok(Dataplane { maps, logs, upgrade, tc, adopted })
}

/// Load program `name` into the kernel (`load`), which verifies it; the
/// time the verifier took is logged (debug): it is most of an agent's
/// start. The verifier gives up with EAGAIN when a signal is pending for
/// the thread (a child the agent ran, nft or iptables, exiting: SIGCHLD);
/// that is tried again, as libbpf does (seen in CI: a tunnel device's
/// programs failed to load while the firewall's nft exited).
fn verify(name: &str, mut load: impl FnMut() -> Result<(), aya::programs::ProgramError>) -> Result<()> {
    let started = std::time::Instant::now();
    let interrupted = |e: &aya::programs::ProgramError| {
        matches!(e, aya::programs::ProgramError::LoadError { io_error, .. } if io_error.raw_os_error() == Some(libc::EAGAIN))
    };
    retry_interrupted(&mut load, interrupted).with_context(|| format!("verify program {name}"))?;
    tracing::debug!(program = name, ms = started.elapsed().as_millis() as u64, "program verified");
    Ok(())
}

/// How many times a program load the verifier gave up on (a signal) is
/// made: libbpf's count.
const LOAD_ATTEMPTS: u32 = 5;

/// `load`, again while it fails `interrupted`, up to `LOAD_ATTEMPTS` in all.
fn retry_interrupted<E>(load: &mut impl FnMut() -> Result<(), E>, interrupted: impl Fn(&E) -> bool) -> Result<(), E> {
    let mut attempt = 1;
    loop {
        match load() {
            Err(e) if interrupted(&e) && attempt < LOAD_ATTEMPTS => {
                tracing::debug!(attempt, "program load interrupted (EAGAIN): trying again");
                attempt += 1;
            }
            r => return r,
        }
    }
}

/// `verify` for a program of any kind this agent loads at start.
fn verify_any(name: &str, prog: &mut aya::programs::Program) -> Result<()> {
    use aya::programs::Program;
    match prog {
        Program::CgroupSockAddr(p) => verify(name, || p.load()),
        Program::CgroupSock(p) => verify(name, || p.load()),
        Program::CgroupSkb(p) => verify(name, || p.load()),
        Program::SchedClassifier(p) => verify(name, || p.load()),
        _ => bail!("program {name}: not a kind the agent loads at start"),
    }
}

/// The index of device `iface`; 0 if there is none.
fn ifindex_of(iface: &str) -> u32 {
    let Ok(c) = std::ffi::CString::new(iface) else { return 0 };
    // SAFETY: a NUL-terminated name.
    unsafe { libc::if_nametoindex(c.as_ptr()) }
}

/// Attach `prog` (`name`) to `iface` as a TCX link pinned as `pin`. Where
/// the link pinned there now (an earlier agent's) is on this device's
/// hook, its program is replaced in place (one atomic link update, as
/// for XDP): no packet meets both. Else a new link, pinned over the old
/// pin (`pin_link`).
///
/// Before 12-05's second half a new link was appended and the earlier
/// one released when its pin went, which the kernel does a moment later
/// (after an RCU grace period, seen taking hundreds of milliseconds on a
/// busy node); meanwhile both ran, the earlier first. Its egress program
/// passed the reply of a flow the new programs had made in new NAT tables
/// (an upgrade's) untranslated and ended the chain, and the first
/// connections of an upgrade to a local backend timed out. (Ahead of it,
/// the earlier program would see what the new one passes on, rewritten:
/// a SNATed packet, with this node's address as its source, it drops.)
fn attach_tcx(prog: &mut SchedClassifier, name: &str, iface: &str, ty: TcAttachType, bpffs: &Path, pin: &str) -> Result<()> {
    use aya::programs::links::PinnedLink;
    use aya::programs::tc::{SchedClassifierLink, TcAttachOptions};
    if let Ok(earlier) = PinnedLink::from_pin(bpffs.join("links").join(pin)).map(FdLink::from) {
        // On this device's hook (not a device renamed since, whose name
        // another took): its program is attached there.
        let prog_id = earlier.info().map(|i| i.program_id()).ok();
        // (A query that fails, a program going away during it, tries the
        // update anyway: a link no longer on a device refuses it.)
        let here = SchedClassifier::query_tcx(iface, ty).map_or(true, |(_, progs)| progs.iter().any(|p| Some(p.id()) == prog_id));
        if here {
            let updated = SchedClassifierLink::try_from(earlier).map_err(anyhow::Error::from).and_then(|l| prog.attach_to_link(l).map_err(anyhow::Error::from));
            match updated {
                Ok(id) => {
                    // The pin keeps it attached; this agent's handle is only an fd.
                    drop(prog.take_link(id)?);
                    return Ok(());
                }
                Err(e) => tracing::debug!(iface, program = name, "the earlier link cannot take the program ({e:#}); a new link"),
            }
        }
    }
    let opts = TcAttachOptions::TcxOrder(Default::default());
    let id = prog.attach_with_options(iface, ty, opts).with_context(|| format!("attach {name} to {iface} (tcx)"))?;
    let fd = FdLink::try_from(prog.take_link(id)?).map_err(|_| anyhow::anyhow!("attach {name} to {iface}: not a TCX link"))?;
    pin_link(bpffs, pin, fd)
}

/// Take lb's program of the other attach mode off `iface`'s hook `ty`,
/// once this one's is on: after TCX, clsact filters of the programs
/// `names` (an agent with `--tc-attach netlink` put them there); after a
/// netlink filter, the TCX link pinned as `pin`. TCX programs run before
/// clsact filters, and lb's pass what they do not take on to the next
/// (TC_ACT_UNSPEC): the leftover would see every packet this one
/// rewrote (a SNATed one, with this node's address as its source, it
/// drops). Nothing there is no error.
fn drop_other_mode(iface: &str, ty: TcAttachType, tcx: bool, bpffs: &Path, pin: &str, names: &[&str]) {
    if tcx {
        for name in names {
            if aya::programs::tc::qdisc_detach_program(iface, ty, name).is_ok() {
                tracing::info!(iface, program = name, "the clsact filter an agent with --tc-attach netlink left is detached");
            }
        }
    } else if fs::remove_file(bpffs.join("links").join(pin)).is_ok() {
        tracing::info!(iface, link = pin, "the TCX link an agent with TCX left is detached");
    }
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
        // The egress program only where an earlier agent attached it (this
        // one's program replaces it without a gap): see `set_sock_egress`.
        if self.sock_egress() {
            self.set_sock_egress(true)?;
        }
        Ok(())
    }

    /// Arm the kernel's NAT expiry timer (`LB_NAT_TIMER`): run
    /// `lb_nat_gc_arm` once (BPF_PROG_TEST_RUN). An earlier agent's timer
    /// is taken over: its callback becomes this load's, which walks this
    /// load's tables. The settings (`LB_NAT_GC`) must be written first;
    /// during an upgrade, only once the programs moved to the new tables
    /// (until then the earlier timer walks the live ones).
    pub fn arm_nat_gc(&mut self) -> Result<()> {
        self.nat_gc_armed = Some(std::time::Instant::now());
        let r = self.run_nat_gc_arm();
        self.nat_gc_failed.store(r.is_err(), std::sync::atomic::Ordering::Relaxed);
        r
    }

    fn run_nat_gc_arm(&mut self) -> Result<()> {
        use aya::programs::{TestRun, TestRunOptions};
        let prog: &mut SchedClassifier = self.ebpf.program_mut(NAT_GC_PROGRAM).context("NAT expiry program")?.try_into()?;
        // A frame's worth of zeros: the program looks at no packet.
        let frame = [0u8; 64];
        let r = prog
            .test_run(TestRunOptions { data_in: Some(&frame), ..TestRunOptions::new() })
            .with_context(|| format!("run {NAT_GC_PROGRAM} (BPF_PROG_TEST_RUN) to arm the kernel's NAT expiry timer"))?;
        let step = ["", "no element in LB_NAT_TIMER", "bpf_timer_init", "bpf_timer_set_callback", "bpf_timer_start"];
        match r.return_value {
            0 => Ok(()),
            1 => anyhow::bail!("{NAT_GC_PROGRAM}: {}", step[1]),
            v => anyhow::bail!(
                "{NAT_GC_PROGRAM}: {} failed: {}",
                step.get((v / 256) as usize).unwrap_or(&"?"),
                std::io::Error::from_raw_os_error((v % 256) as i32)
            ),
        }
    }

    /// Whether the kernel's NAT expiry timer this agent armed stopped (it
    /// did not look for `NAT_TIMER_LOOKS_WITHIN_NS`, though armed longer
    /// ago than that, or this agent's last arm failed), and the last look
    /// this agent saw of it (CLOCK_MONOTONIC; 0: none); `None` before it
    /// was armed, or while it may not have looked yet. Something updating
    /// its element from user space (`bpftool map update`) cancels it.
    pub fn nat_gc_stopped(&mut self) -> Option<u64> {
        let armed = self.nat_gc_armed?;
        let within = std::time::Duration::from_nanos(super::inspect::NAT_TIMER_LOOKS_WITHIN_NS);
        if armed.elapsed() <= within {
            return None;
        }
        let map = self.ebpf.map(lb_common::maps::NAT_TIMER)?;
        let timer = aya::maps::Array::<_, super::inspect::NatTimerRead>::try_from(map).ok()?;
        let t = super::inspect::read_nat_timer(&timer).ok()?;
        let looks = super::inspect::nat_expiry(&t, crate::nodeport::monotonic_ns()).armed;
        if looks {
            self.nat_gc_seen = t.last_look_ns;
        }
        (!looks || self.nat_gc_failed.load(std::sync::atomic::Ordering::Relaxed)).then_some(self.nat_gc_seen)
    }

    /// Whether `lb_sock_egress` is attached (its link pinned).
    pub fn sock_egress(&self) -> bool {
        self.bpffs.join("links").join(EGRESS_PROGRAM).exists()
    }

    /// Attach `lb_sock_egress` (again: this agent's program replaces an
    /// earlier one without a gap), or detach it. It runs for every packet
    /// the cgroup's sockets send, so the agent attaches it only while some
    /// frontend has loadBalancerSourceRanges: until then no packet pays for
    /// it.
    pub fn set_sock_egress(&mut self, on: bool) -> Result<()> {
        if !on {
            let pin = self.bpffs.join("links").join(EGRESS_PROGRAM);
            return match fs::remove_file(&pin) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).with_context(|| format!("unpin {}", pin.display())),
                _ => Ok(()),
            };
        }
        let cg = fs::File::open(&self.cgroup).with_context(|| format!("open cgroup {}", self.cgroup.display()))?;
        let prog: &mut CgroupSkb = self.ebpf.program_mut(EGRESS_PROGRAM).context("cgroup program")?.try_into()?;
        let id = prog
            .attach(cg.as_fd(), CgroupSkbAttachType::Egress, CgroupAttachMode::Single)
            .with_context(|| format!("attach {EGRESS_PROGRAM} to {}", self.cgroup.display()))?;
        let link: FdLink = prog.take_link(id)?.try_into().context("link is not an fd link")?;
        pin_link(&self.bpffs, EGRESS_PROGRAM, link)
    }

    /// Finish an upgrade once the staged maps hold what the agent programs
    /// (its first full sync): carry the state the old programs keep
    /// (sessionAffinity, socket tracking, NAT flows) over where the layout
    /// allows, move every program to the new maps (each link replaced
    /// without a gap, TC ones on every device an earlier agent used), put
    /// the new maps' pins in place of the old ones, and drop links of
    /// programs this agent does not have.
    ///
    /// `serving` and `serving_pods` are the NodePort and pod devices this agent
    /// puts its programs on now: moved here too, before the second copy,
    /// whatever an earlier agent pinned (netlink filters, which are not
    /// links, are found only so; a program still on the old maps after
    /// the second copy makes flows no copy carries).
    pub fn finish_upgrade(&mut self, replaced: &[&'static str], serving: &[String], serving_pods: &[(String, u32)]) -> Result<()> {
        // The first copy was made before the programs began to move (an
        // upgrade resumed from an agent killed after: not again, see `load`).
        let copied = if marked(&self.bpffs, MOVING) { 0 } else { carry_state(&self.bpffs, replaced, Pass::First) };
        if self.adopt {
            self.set_upgrading(true)?;
        }
        if let Some(pause) = upgrade_pause() {
            tracing::info!(ms = pause.as_millis() as u64, "upgrade: paused before the programs move (LB_UPGRADE_PAUSE_MS)");
            std::thread::sleep(pause);
        }
        // From here the staged maps are live: an agent killed from here on
        // leaves an upgrade the next one can only finish.
        mark_next(&self.bpffs, MOVING)?;
        self.attach_cgroup()?;
        // Whether every earlier program moved: the old NAT tables are
        // emptied at the end only then (one left on them still uses them).
        let mut moved_all = true;
        let links = self.bpffs.join("links");
        // Pins name devices as `pin_safe` spells them ("eth0.100" ->
        // "eth0_100"): find each one's device again by that spelling.
        let devices: Vec<(String, u32)> = crate::netdev::links()?.into_iter().map(|l| (l.name, l.ifindex)).collect();
        let device = |safe: &str| devices.iter().find(|(n, _)| pin_safe(n) == safe).cloned();
        let mut ifaces = BTreeSet::new();
        for e in fs::read_dir(&links)?.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            for prog in device_programs() {
                if let Some(safe) = n.strip_prefix(prog).and_then(|r| r.strip_prefix('_')) {
                    ifaces.insert(safe.to_string());
                }
            }
        }
        for safe in ifaces {
            let Some((iface, _)) = device(&safe) else {
                tracing::warn!(iface = safe, "upgrade: no such device any more; its programs stay on the old maps until the device goes");
                moved_all = false;
                continue;
            };
            if let Err(e) = self.attach_tc(&iface) {
                tracing::warn!(iface, "upgrade: {e:#}");
                moved_all = false;
            }
        }
        for iface in serving {
            if let Err(e) = self.attach_tc(iface) {
                tracing::warn!(iface, "upgrade: {e:#}");
                moved_all = false;
            }
        }
        // Then the pods' devices. Meanwhile a flow the moved programs make
        // may have its replies pass a device not moved yet: the new
        // programs write new flows into the old NAT tables too, which the
        // earlier programs read (`share_with_old` in the TC program).
        if let Some(pause) = upgrade_pause_var("LB_UPGRADE_PAUSE_PODS_MS") {
            tracing::info!(ms = pause.as_millis() as u64, "upgrade: paused before the pod devices move (LB_UPGRADE_PAUSE_PODS_MS)");
            std::thread::sleep(pause);
        }
        // The pod devices an earlier agent forwarded from (or translated
        // DSR replies on).
        let pods: BTreeSet<String> = fs::read_dir(&links)?
            .flatten()
            .filter_map(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                POD_PROGRAMS.iter().find_map(|(p, _)| n.strip_prefix(p)?.strip_prefix('_').map(str::to_string))
            })
            .collect();
        for safe in pods {
            let Some((iface, ifindex)) = device(&safe) else { continue };
            if let Err(e) = self.attach_pod(&iface, ifindex) {
                tracing::warn!(iface, "upgrade: {e:#}");
                moved_all = false;
            }
        }
        for (iface, ifindex) in serving_pods {
            if let Err(e) = self.attach_pod(iface, *ifindex) {
                // An earlier agent's programs may still be there (a
                // netlink filter leaves no pin to find it by above).
                tracing::warn!(iface, "upgrade: {e:#}");
                moved_all = false;
            }
        }
        if let Some(pause) = upgrade_pause() {
            tracing::info!(ms = pause.as_millis() as u64, "upgrade: paused before the second copy (LB_UPGRADE_PAUSE_MS)");
            std::thread::sleep(pause);
        }
        // What the old programs added between the copy and the switch.
        // An upgrade resumed from an agent killed after its second copy
        // adds the old counters no second time.
        let done = marked(&self.bpffs, LATE_DONE);
        let names: Vec<&'static str> = replaced.iter().copied().filter(|n| !(done && *n == maps::STATS)).collect();
        let late = carry_state(&self.bpffs, &names, Pass::Late);
        mark_next(&self.bpffs, LATE_DONE)?;
        let adopted = self.adopt;
        if self.adopt {
            // Off also where an earlier program still runs on some device
            // (its move failed) and makes flows in the old NAT table: the
            // NAT thread no longer passes over that table, and flows it
            // ends in the new one would be taken back from there.
            self.set_upgrading(false)?;
            self.adopt = false;
        }
        for name in replaced {
            let staged = self.bpffs.join(NEXT).join(name);
            fs::rename(&staged, self.bpffs.join(name)).with_context(|| format!("move {} in place", staged.display()))?;
        }
        mark_layout(&self.bpffs, &layout_version())?;
        remove_next(&self.bpffs.join(NEXT))?;
        self.unpin_unknown_links(false);
        tracing::info!(maps = ?replaced, entries_carried = copied + late, "upgrade finished: programs moved to the new maps");
        // The upgrade is done (an agent killed before here starts it over
        // from the old tables): once no program uses the old NAT tables,
        // their entries go (the programs hold the maps until the next
        // agent replaces them; their hash buckets stay allocated till then).
        if adopted && moved_all {
            for name in [NAT4_PREV, NAT6_PREV] {
                if let Err(e) = self.empty_prev(name) {
                    tracing::warn!(map = name, "upgrade: emptying the old NAT table: {e:#}");
                }
            }
        } else if adopted {
            tracing::warn!("upgrade: programs of the earlier agent still run on some device: the old NAT tables keep their flows");
        }
        Ok(())
    }

    /// Unpin the links of programs this agent does not have, which keep
    /// them attached: an earlier agent's of another version (a program
    /// renamed or gone), which ran beside this one's, on whatever maps it
    /// was loaded with. At an upgrade's end, every such link; at a plain
    /// start (`cgroup_only`, once this agent's cgroup programs are
    /// attached) the cgroup ones, which ran on every connect (before
    /// 12-05's second half, at upgrades only): a device's link waits for
    /// the next upgrade, since this agent attaches its own to the devices
    /// only after its first sync, and a device would have none meanwhile.
    /// A link that cannot be unpinned is a warning, not a failed start.
    fn unpin_unknown_links(&self, cgroup_only: bool) {
        use aya::programs::links::{FdLink, LinkType, PinnedLink};
        let known: BTreeSet<&str> = PROGRAMS.iter().chain(SOCK_PROGRAMS.iter()).chain([&EGRESS_PROGRAM]).copied().collect();
        for e in fs::read_dir(self.bpffs.join("links")).into_iter().flatten().flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            let tc = device_programs().chain(POD_PROGRAMS.map(|(p, _)| p)).any(|p| n.starts_with(&format!("{p}_")));
            if known.contains(n.as_str()) || tc {
                continue;
            }
            let cgroup = || {
                PinnedLink::from_pin(e.path()).map(FdLink::from).and_then(|l| l.info()).is_ok_and(|i| matches!(i.link_type(), Ok(LinkType::Cgroup)))
            };
            if cgroup_only && !cgroup() {
                continue;
            }
            match fs::remove_file(e.path()) {
                Ok(()) => tracing::info!(link = n, "unpinned the link of a program this agent does not have (it is detached)"),
                Err(err) => tracing::warn!(link = n, "a program this agent does not have stays attached: unpin {}: {err}", e.path().display()),
            }
        }
    }

    /// Set or clear this load's `LB_ADOPT` (only its own programs read it).
    fn set_upgrading(&mut self, on: bool) -> Result<()> {
        let map = self.ebpf.map_mut(ADOPT).with_context(|| format!("map {ADOPT}"))?;
        let mut adopt: aya::maps::Array<_, u32> = aya::maps::Array::try_from(map)?;
        adopt.set(0, on as u32, 0).with_context(|| format!("write {ADOPT}"))
    }

    /// Delete every entry of the programs' old NAT table `name`, in
    /// batches; an entry gone meanwhile (the NAT thread expiring it) is
    /// stepped over.
    fn empty_prev(&mut self, name: &str) -> Result<()> {
        use std::os::fd::{AsFd as _, AsRawFd as _};
        let data = match self.ebpf.map(name).with_context(|| format!("map {name}"))? {
            aya::maps::Map::HashMap(d) => d,
            _ => anyhow::bail!("{name} is no hash map"),
        };
        let fd = data.fd().as_fd().as_raw_fd();
        let n = if name == NAT4_PREV {
            let keys: Vec<lb_common::Nat4Key> = super::maps::lookup_all::<_, lb_common::Nat4Entry>(data)?.into_iter().map(|(k, _)| k).collect();
            delete_all::<_, lb_common::Nat4Entry>(fd, &keys)?
        } else {
            let keys: Vec<lb_common::Nat6Key> = super::maps::lookup_all::<_, lb_common::Nat6Entry>(data)?.into_iter().map(|(k, _)| k).collect();
            delete_all::<_, lb_common::Nat6Entry>(fd, &keys)?
        };
        tracing::debug!(map = name, entries = n, "upgrade: old NAT table emptied");
        Ok(())
    }

    /// Attach the TC programs to `iface` (ingress and egress), once per
    /// device (again if the name now belongs to a new device). With TCX
    /// (kernel 6.6+) the links are pinned like the cgroup ones; otherwise
    /// aya falls back to a clsact qdisc and netlink filters.
    pub fn attach_tc(&mut self, iface: &str) -> Result<()> {
        let ifindex = ifindex_of(iface);
        if ifindex != 0 && self.attached.get(iface) == Some(&ifindex) {
            return Ok(());
        }
        let links = crate::netdev::links()?;
        if links.iter().any(|l| l.name == iface && l.loopback) {
            // An earlier agent's there (named by --nodeport-interface
            // before 12-05's third session) goes: it would drop the node's
            // own packets now.
            let safe = pin_safe(iface);
            for prog in device_programs() {
                if fs::remove_file(self.bpffs.join("links").join(format!("{prog}_{safe}"))).is_ok() {
                    tracing::warn!(iface, program = prog, "an earlier agent's program on the loopback device is detached");
                }
            }
            for (name, ty) in TC_PROGRAMS.into_iter().chain(L3_PROGRAMS) {
                if aya::programs::tc::qdisc_detach_program(iface, ty, name).is_ok() {
                    tracing::warn!(iface, program = name, "an earlier agent's filter on the loopback device is detached");
                }
            }
            anyhow::bail!("{}", loopback_refused(iface));
        }
        let tcx = self.tcx();
        if !tcx {
            // The netlink fallback needs a clsact qdisc.
            // It may exist already; a real failure shows in the attach below.
            if let Err(e) = aya::programs::tc::qdisc_add_clsact(iface) {
                tracing::debug!(iface, "clsact qdisc: {e}");
            }
        }
        let safe = pin_safe(iface);
        // A device without a link-layer header gets the programs built for
        // that layout, in the same places (and pins).
        let l3 = links.iter().any(|l| l.name == iface && l.l3);
        let programs = if l3 { L3_PROGRAMS } else { TC_PROGRAMS };
        // Both verified before either goes on the device (the verifier
        // takes a while the first time)...
        for (name, _) in programs {
            let prog: &mut SchedClassifier = self.ebpf.program_mut(name).context("TC program")?.try_into()?;
            if prog.fd().is_err() {
                verify(name, || prog.load())?;
            }
        }
        // ...and egress before ingress: in an upgrade, the new ingress
        // program makes flows in the new NAT table only, which the old
        // egress program would not find (a local backend's reply would
        // leave untranslated), where the new egress program finds the old
        // ingress program's flows in the old table too (it adopts them).
        for (((name, ty), (place, _)), (l3_name, _)) in programs.into_iter().zip(TC_PROGRAMS).zip(L3_PROGRAMS).rev() {
            let prog: &mut SchedClassifier = self.ebpf.program_mut(name).context("TC program")?.try_into()?;
            let pin = format!("{place}_{safe}");
            if tcx {
                attach_tcx(prog, name, iface, ty, &self.bpffs, &pin)?;
            } else {
                attach_netlink(prog, iface, ty).with_context(|| format!("attach {name} to {iface} (netlink)"))?;
            }
            drop_other_mode(iface, ty, tcx, &self.bpffs, &pin, &[place, l3_name]);
        }
        let xdp = self.attach_xdp(iface, &safe, l3)?;
        // A SNATed flow's packets re-enter the stack with this node's own
        // address as their source: accept them (as Cilium does). Teardown
        // gives back what they were.
        crate::nodeport::set_device_sysctls(iface, &self.bpffs);
        let again = self.attached.insert(iface.to_string(), ifindex).is_some();
        tracing::info!(iface, ifindex, tcx, xdp, l3, again, "NodePort programs attached");
        Ok(())
    }

    /// With `--bpf-forward` or `--per-packet-lb`: put the pod programs on
    /// `devices` (name, index; `netdev::pod_devices`), each once (again if
    /// the name now belongs to a new device), and forget the devices that
    /// went away with their pods (their links went with them; the pins go
    /// here).
    pub fn sync_pod_devices(&mut self, devices: &[(String, u32)]) {
        for (iface, ifindex) in devices {
            if let Err(e) = self.attach_pod(iface, *ifindex) {
                // A pod's device may go away between the listing and here.
                tracing::warn!(iface, "pod device: {e:#}; its pod's packets go through the stack untranslated");
            }
        }
        self.pods.retain(|n, _| devices.iter().any(|(d, _)| d == n));
        // Pins of devices gone, also those an earlier agent left (a pod
        // deleted while no agent ran).
        let kept: BTreeSet<String> = devices.iter().map(|(d, _)| pin_safe(d)).collect();
        for e in fs::read_dir(self.bpffs.join("links")).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(iface) = POD_PROGRAMS.iter().find_map(|(p, _)| name.strip_prefix(p)?.strip_prefix('_'))
                && !kept.contains(iface)
            {
                let path = e.path();
                if let Err(err) = fs::remove_file(&path) {
                    tracing::warn!(iface, "unpin {}: {err}", path.display());
                } else {
                    tracing::debug!(iface, "pod device gone: its link unpinned");
                }
            }
        }
    }

    /// Attach the pod programs to `iface` (with `pod_ingress`, TC ingress:
    /// what its pod sends; with `pod_egress`, TC egress: what goes into
    /// it), replacing an earlier agent's without a gap.
    fn attach_pod(&mut self, iface: &str, ifindex: u32) -> Result<()> {
        if self.pods.get(iface) == Some(&ifindex) {
            return Ok(());
        }
        let tcx = self.tcx();
        let wanted = [self.pod_ingress, self.pod_egress];
        for (name, ty) in POD_PROGRAMS.iter().zip(wanted).filter(|(_, w)| *w).map(|(p, _)| p) {
            let prog: &mut SchedClassifier = self.ebpf.program_mut(name).context("TC program")?.try_into()?;
            if prog.fd().is_err() {
                verify(name, || prog.load())?;
            }
            let pin = format!("{name}_{}", pin_safe(iface));
            if tcx {
                attach_tcx(prog, name, iface, *ty, &self.bpffs, &pin)?;
            } else {
                if let Err(e) = aya::programs::tc::qdisc_add_clsact(iface) {
                    tracing::debug!(iface, "clsact qdisc: {e}");
                }
                attach_netlink(prog, iface, *ty).with_context(|| format!("attach {name} to {iface} (netlink)"))?;
            }
            drop_other_mode(iface, *ty, tcx, &self.bpffs, &pin, &[name]);
        }
        self.pods.insert(iface.to_string(), ifindex);
        match (self.pod_ingress, self.pod_egress) {
            (true, true) => tracing::info!(iface, "pod device: what its pod sends is translated or forwarded here, and what it gets"),
            (true, false) => tracing::info!(iface, "pod device: its pod's replies to outside clients are forwarded in BPF"),
            (false, true) => tracing::info!(iface, "pod device: replies to its pod from flows lb sent by DSR are translated here"),
            (false, false) => {}
        }
        Ok(())
    }

    /// Attach the pod programs again at the next `sync_pod_devices` (the
    /// set `pod_ingress` and `pod_egress` name changed).
    pub fn forget_pods(&mut self) {
        self.pods.clear();
    }

    /// Whether an earlier agent's egress pod programs may run (as
    /// `pod_programs_may_run`).
    pub fn pod_egress_may_run(&self) -> bool {
        self.may_run(POD_EGRESS_PROGRAM)
    }

    /// Whether pod programs an earlier agent attached may run on this
    /// node's pod devices: their TCX links are pinned, or (netlink
    /// filters, which are not pinned) it cannot be told cheaply.
    pub fn pod_programs_may_run(&self) -> bool {
        self.may_run(POD_PROGRAM)
    }

    /// Whether links of program `prog` on some device are pinned (always
    /// may without TCX).
    fn may_run(&self, prog: &str) -> bool {
        if !self.tcx() {
            return true;
        }
        let prefix = format!("{prog}_");
        fs::read_dir(self.bpffs.join("links")).into_iter().flatten().flatten().any(|e| e.file_name().to_string_lossy().starts_with(&prefix))
    }

    /// Whether a device waits out its grace (`detach_unserved`).
    pub fn unserved_waiting(&self) -> bool {
        !self.unserved.is_empty()
    }

    /// Take lb's NodePort programs off every device but `serving`: an
    /// earlier agent's on a device this one does not serve (its
    /// `--nodeport-interface` narrowed, the loopback device), a link
    /// pinned under a temporary name by an agent killed while it renamed
    /// it, and one this agent served that is no NodePort device any more
    /// (its address gone) once it has not been one for `grace` (None: at
    /// once): an address that goes and comes back (a DHCP renewal, a
    /// network manager reapplying) keeps its flows. Their pinned links
    /// (TCX, XDP) are unpinned, which detaches them, their clsact filters
    /// removed, and the device sysctls lb changed on them given back. Run
    /// once `serving` has its programs; again when the set changed or a
    /// device waits out its grace, not at every sync (the filters are
    /// looked for on every device). Nothing is taken off where the
    /// devices cannot be listed, or none is served. Never while an upgrade
    /// moves the devices.
    pub fn detach_unserved(&mut self, serving: &[String], grace: Option<std::time::Duration>) {
        let keep: BTreeSet<String> = serving.iter().map(|s| pin_safe(s)).collect();
        // No device at all is a failed read of the node's addresses more
        // likely than a node without any: nothing is taken off then.
        if keep.is_empty() || self.served.as_ref() == Some(&keep) && self.unserved.is_empty() {
            return;
        }
        let Ok(links) = crate::netdev::links() else { return };
        let now = std::time::Instant::now();
        // The served set unchanged: only the devices in their grace are
        // looked at (not every pod veth's filters again, each second).
        let only_waiting: Option<BTreeSet<String>> = (self.served.as_ref() == Some(&keep)).then(|| self.unserved.keys().cloned().collect());
        // This agent's devices that lost their service wait out the grace.
        let ours: BTreeSet<String> = self.attached.keys().map(|i| pin_safe(i)).collect();
        let mut waiting = std::collections::BTreeMap::new();
        let mut due = |safe: &str| -> bool {
            let Some(g) = grace.filter(|_| ours.contains(safe)) else { return true };
            let since = self.unserved.get(safe).copied().unwrap_or(now);
            let due = now.duration_since(since) >= g;
            if !due {
                waiting.insert(safe.to_string(), since);
            }
            due
        };
        let mut gone = BTreeSet::new();
        for e in fs::read_dir(self.bpffs.join("links")).into_iter().flatten().flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            let Some(safe) = device_programs().find_map(|p| n.strip_prefix(p).and_then(|r| r.strip_prefix('_'))) else { continue };
            if keep.contains(safe) || !due(safe) {
                continue;
            }
            match fs::remove_file(e.path()) {
                Ok(()) => {
                    gone.insert(safe.to_string());
                }
                Err(err) => tracing::warn!(link = n, "lb's program stays on a device it no longer serves: unpin {}: {err}", e.path().display()),
            }
        }
        for l in links.iter().filter(|l| !keep.contains(&pin_safe(&l.name))) {
            let safe = pin_safe(&l.name);
            if only_waiting.as_ref().is_some_and(|w| !w.contains(&safe)) || !due(&safe) {
                continue;
            }
            for (name, ty) in TC_PROGRAMS.into_iter().chain(L3_PROGRAMS) {
                if aya::programs::tc::qdisc_detach_program(&l.name, ty, name).is_ok() {
                    gone.insert(safe.clone());
                }
            }
        }
        self.attached.retain(|iface, _| !gone.contains(&pin_safe(iface)) && (keep.contains(&pin_safe(iface)) || waiting.contains_key(&pin_safe(iface))));
        for dev in &gone {
            tracing::info!(device = dev.as_str(), "lb's NodePort programs are taken off a device it no longer serves");
            if let Some(l) = links.iter().find(|l| pin_safe(&l.name) == *dev) {
                crate::nodeport::restore_device_sysctls_of(&self.bpffs, Some(&l.name));
            }
        }
        self.unserved = waiting;
        self.served = Some(keep);
    }

    /// Take off the pod programs (pinned TCX links, netlink filters) this
    /// agent does not use, an earlier agent's or its own: the ingress one
    /// with `ingress`, the egress one with `egress` (unless `pod_egress`).
    pub fn drop_pod_programs(&mut self, ingress: bool, egress: bool) {
        let mut n = 0;
        for (prog, ty) in POD_PROGRAMS {
            if prog == POD_PROGRAM && !ingress || prog == POD_EGRESS_PROGRAM && (!egress || self.pod_egress) {
                continue;
            }
            let prefix = format!("{prog}_");
            if let Ok(rd) = fs::read_dir(self.bpffs.join("links")) {
                for e in rd.flatten() {
                    if e.file_name().to_string_lossy().starts_with(&prefix) && fs::remove_file(e.path()).is_ok() {
                        n += 1;
                    }
                }
            }
            if let Ok(links) = crate::netdev::links() {
                for l in links.iter().filter(|l| l.kind.as_deref() == Some("veth")) {
                    if aya::programs::tc::qdisc_detach_program(&l.name, ty, prog).is_ok() {
                        n += 1;
                    }
                }
            }
        }
        if ingress || egress {
            self.pods.clear();
        }
        if n > 0 {
            tracing::info!(devices = n, "pod programs an earlier agent attached and this one does not use are detached");
        }
    }

    /// Verify the programs the flags ask for (the pod programs for
    /// `--bpf-forward` and `--per-packet-lb`, the XDP program for
    /// `--nodeport-acceleration xdp`) now, so that a kernel that refuses
    /// one stops the agent at its start, as the others do, and not at a
    /// first device. Set `pod_egress` and `xdp` first.
    pub fn verify_optional(&mut self, pods: bool) -> Result<()> {
        let n = if self.pod_egress { 2 } else { usize::from(pods) };
        for (name, _) in &POD_PROGRAMS[..n] {
            let prog: &mut SchedClassifier = self.ebpf.program_mut(name).context("TC program")?.try_into()?;
            if prog.fd().is_err() {
                verify(name, || prog.load())?;
            }
        }
        if self.xdp {
            let prog: &mut Xdp = self.ebpf.program_mut(XDP_PROGRAM).context("XDP program")?.try_into()?;
            if prog.fd().is_err() {
                verify(XDP_PROGRAM, || prog.load())?;
            }
        }
        Ok(())
    }

    /// Whether TC programs attach as TCX links (else netlink filters).
    fn tcx(&self) -> bool {
        match self.mode {
            TcAttach::Auto => aya::util::KernelVersion::current().is_ok_and(|v| v >= aya::util::KernelVersion::new(6, 6, 0)),
            TcAttach::Tcx => true,
            TcAttach::Netlink => false,
        }
    }

    /// With `--nodeport-acceleration xdp`, put the XDP program on `iface`:
    /// in place of an earlier agent's (one atomic link update: no packet
    /// misses it), else in the driver (native). Without, take an earlier
    /// agent's off. Not on an L3 device (`l3`: the XDP program parses
    /// Ethernet frames) and not where the driver has no native XDP: generic
    /// XDP runs on the skb after GRO, whose merged TCP segments (and a
    /// local sender's or a VM's packets) carry partial checksums that XDP
    /// cannot see and would corrupt; TC carries such a device's traffic.
    /// Returns how it runs there.
    fn attach_xdp(&mut self, iface: &str, safe: &str, l3: bool) -> Result<&'static str> {
        use aya::programs::links::PinnedLink;
        use aya::programs::xdp::XdpLink;
        let pin = self.xdp_pin(safe);
        if self.xdp && l3 {
            tracing::info!(iface, "an L3 device: no XDP acceleration here (the XDP program reads Ethernet frames); the TC programs carry its traffic");
        }
        if !self.xdp || l3 {
            if pin.exists() {
                fs::remove_file(&pin).with_context(|| format!("unpin {}", pin.display()))?;
                tracing::info!(iface, "XDP acceleration off: the XDP program an earlier agent attached is detached");
            }
            return Ok("off");
        }
        // An earlier lb attached generic XDP where the driver had no native
        // one: take it off (see above).
        if pin.exists() && crate::netdev::links()?.iter().any(|l| l.name == iface && l.xdp_generic) {
            fs::remove_file(&pin).with_context(|| format!("unpin {}", pin.display()))?;
            tracing::warn!(iface, "{NO_NATIVE_XDP}; the generic XDP program an earlier agent attached is detached");
        }
        self.set_xdp_dev(iface)?;
        let prog: &mut Xdp = self.ebpf.program_mut(XDP_PROGRAM).context("XDP program")?.try_into()?;
        if prog.fd().is_err() {
            verify(XDP_PROGRAM, || prog.load())?;
        }
        if pin.exists() {
            let replaced = PinnedLink::from_pin(&pin)
                .map_err(anyhow::Error::from)
                .and_then(|old| XdpLink::try_from(FdLink::from(old)).map_err(anyhow::Error::from))
                .and_then(|link| prog.attach_to_link(link).map_err(anyhow::Error::from));
            match replaced {
                Ok(id) => {
                    // The pin keeps it attached; this agent's handle is only an fd.
                    drop(prog.take_link(id)?);
                    return Ok("replaced in place");
                }
                // A link whose device went away (and came back): a new one.
                Err(e) => {
                    tracing::warn!(iface, "the XDP link an earlier agent pinned cannot be updated ({e:#}); attaching anew");
                    fs::remove_file(&pin).with_context(|| format!("unpin {}", pin.display()))?;
                }
            }
        }
        let id = match prog.attach(iface, XdpMode::Driver) {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!(iface, "{NO_NATIVE_XDP} ({e})");
                return Ok("off (no native XDP)");
            }
        };
        let how = "native";
        let link = FdLink::try_from(prog.take_link(id)?)
            .map_err(|_| anyhow::anyhow!("attach {XDP_PROGRAM} to {iface}: the kernel gave no bpf_link (XDP acceleration needs Linux 5.9+)"))?;
        pin_link(&self.bpffs, &format!("{XDP_PROGRAM}_{safe}"), link)?;
        Ok(how)
    }

    /// Where the XDP link of the interface named `safe` (`pin_safe`) is pinned.
    fn xdp_pin(&self, safe: &str) -> PathBuf {
        self.bpffs.join("links").join(format!("{XDP_PROGRAM}_{safe}"))
    }

    /// On a veth, XDP's sends fail (the kernel drops the frames and counts
    /// them) while the peer has no NAPI, which this agent cannot see or set
    /// (the peer is in another network namespace). Check the counters; on
    /// a device where they grew, take XDP off and let TC carry the traffic,
    /// and say why. Called every few seconds.
    pub fn check_xdp(&mut self) {
        let failing: Vec<String> =
            self.xdp_veths.iter_mut().filter_map(|(iface, seen)| {
                let now = xdp_send_errors(iface);
                let grew = now > *seen;
                *seen = now;
                grew.then(|| iface.clone())
            }).collect();
        for iface in failing {
            match fs::remove_file(self.xdp_pin(&pin_safe(&iface))) {
                Ok(()) => tracing::error!(
                    iface,
                    "XDP's sends on this veth are dropped by the kernel (rx_queue_*_drops / xdp_tx_errors / xdp_xmit_errors in ethtool -S): \
                     its peer has no NAPI (ethtool -K PEER gro on, or an XDP program there). XDP is off on it; the TC \
                     programs carry its traffic. Fix the peer and restart the agent to have XDP again"
                ),
                Err(e) => tracing::error!(iface, "XDP's sends on this veth are dropped, and detaching XDP failed: {e}"),
            }
            self.xdp_veths.remove(&iface);
        }
    }

    /// Tell the XDP program how `iface` sends a packet back out: a veth by
    /// a redirect to itself (it flushes XDP_TX frames to its peer only if
    /// the peer runs XDP too; a redirect needs only NAPI there, which GRO
    /// turns on), anything else by XDP_TX.
    fn set_xdp_dev(&mut self, iface: &str) -> Result<()> {
        let veth = crate::netdev::links()?.iter().any(|l| l.name == iface && l.kind.as_deref() == Some("veth"));
        let ifindex = ifindex_of(iface);
        if ifindex == 0 {
            bail!("no interface {iface}");
        }
        let map = self.ebpf.map_mut(maps::XDP_DEVS).context("LB_XDP_DEVS")?;
        let mut devs: aya::maps::HashMap<_, u32, u32> = aya::maps::HashMap::try_from(map)?;
        if veth {
            devs.insert(ifindex, lb_common::xdp_dev::REDIRECT, 0).context("LB_XDP_DEVS: insert")?;
            self.xdp_veths.insert(iface.to_string(), xdp_send_errors(iface));
            // The peer is out of this agent's reach (another netns, often
            // the host's): say what it needs, where an operator looks.
            tracing::warn!(
                iface,
                "a veth: XDP sends packets back out with a redirect, which the kernel drops unless the peer has NAPI \
                 (ethtool -K PEER gro on, or an XDP program there); its senders \
                 must also compute checksums (ethtool -K PEER tx off)"
            );
        } else {
            let _ = devs.remove(&ifindex);
        }
        Ok(())
    }
}

/// The XDP send errors a veth counts (`ethtool -S`): XDP_TX errors, send
/// errors counted on its peer's side, and drops in its receive path, where
/// a redirect the peer cannot take (no NAPI there) ends; 0 if unreadable.
fn xdp_send_errors(iface: &str) -> u64 {
    let counts = |n: &str| {
        n.ends_with("xdp_tx_errors") || n.ends_with("xdp_xmit_errors") || (n.starts_with("rx_queue_") && n.ends_with("_drops") && !n.ends_with("xdp_drops"))
    };
    crate::netdev::driver_stats(iface).map(|s| s.iter().filter(|(n, _)| counts(n)).map(|(_, v)| v).sum()).unwrap_or(0)
}

/// The programs' view of an upgrade's old NAT tables (see `load`), and
/// the switch that has them look there.
const NAT4_PREV: &str = "LB4_NAT_PREV";
const NAT6_PREV: &str = "LB6_NAT_PREV";
const ADOPT: &str = "LB_ADOPT";

/// Delete `keys` from the hash map `fd` in batches, stepping over a key
/// not there (a batch stops at it). Returns how many were deleted.
fn delete_all<K: aya::Pod, V: aya::Pod>(fd: std::os::fd::RawFd, keys: &[K]) -> Result<usize> {
    let (mut at, mut n) = (0, 0);
    while at < keys.len() {
        let (done, r) = super::maps::batch::<K, V>(fd, &keys[at..], None);
        n += done;
        match r {
            Ok(()) => break,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => at += done + 1,
            Err(e) => return Err(e).context("delete in a batch"),
        }
    }
    Ok(n)
}

/// How long `finish_upgrade` waits before the programs move and again
/// before its second copy (`LB_UPGRADE_PAUSE_MS`; 0: not at all). For the
/// upgrade test only, which makes flows in those moments.
fn upgrade_pause() -> Option<std::time::Duration> {
    upgrade_pause_var("LB_UPGRADE_PAUSE_MS")
}

/// A test's pause in `finish_upgrade`, from the variable `var` (ms).
fn upgrade_pause_var(var: &str) -> Option<std::time::Duration> {
    let ms: u64 = std::env::var(var).ok()?.parse().ok()?;
    (ms > 0).then(|| std::time::Duration::from_millis(ms))
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

/// Detach and unpin everything under `bpffs`. Idempotent. An agent still
/// running there (its pod terminating) is waited for, up to `wait`: it
/// would put back what this removes (its firewall rules) and keep
/// programming the maps. Past that, nothing is removed: an error.
/// `last` (the netfilter rules' removal) runs before the pin directory goes,
/// while the lock is held: where it fails, the directory stays, and a
/// teardown run again (the uninstall's init container, restarted) does it
/// again instead of finding nothing to do.
/// Returns whether anything was pinned there.
pub fn teardown(bpffs: &Path, wait: std::time::Duration, last: impl FnOnce() -> Result<()>) -> Result<bool> {
    // Nothing there (a node rebooted since, where nothing mounts a bpffs):
    // nothing to do, whatever file system holds the path.
    if !bpffs.exists() {
        return Ok(false);
    }
    check_bpffs(bpffs)?;
    let _lock = lock_waiting(
        bpffs,
        wait,
        "nothing removed: an lb-agent still runs (stop it first: delete its DaemonSet and wait for its pods to go) with --bpffs",
    )?;
    // The NodePort range lb reserved in this netns goes too.
    crate::nodeport::unreserve_ports(bpffs)?;
    // And the device sysctls lb changed.
    crate::nodeport::restore_device_sysctls(bpffs)?;
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
            for (name, ty) in TC_PROGRAMS.into_iter().chain(L3_PROGRAMS).chain(POD_PROGRAMS) {
                let _ = aya::programs::tc::qdisc_detach_program(&l.name, ty, name);
            }
        }
    }
    let next = bpffs.join(NEXT);
    if next.exists() {
        remove_next(&next)?;
    }
    for e in fs::read_dir(bpffs)?.flatten() {
        if e.file_name().to_string_lossy().starts_with(LAYOUT_MARKER) {
            fs::remove_dir(e.path())?;
        }
    }
    let kept = bpffs.join(crate::stale::kept::DIR);
    if kept.exists() {
        fs::remove_dir_all(&kept).with_context(|| format!("remove {}", kept.display()))?;
    }
    for m in maps::ALL {
        let p = bpffs.join(m);
        if p.exists() {
            fs::remove_file(&p).with_context(|| format!("unpin {}", p.display()))?;
        }
    }
    // Pins this version does not know (an agent of another version made
    // them: the uninstall image lags or leads): lb's directory, so gone too.
    for e in fs::read_dir(bpffs)?.flatten() {
        let p = e.path();
        tracing::info!(pin = %p.display(), "unpinned, though this version of lb does not know it");
        if p.is_dir() { fs::remove_dir_all(&p) } else { fs::remove_file(&p) }.with_context(|| format!("unpin {}", p.display()))?;
    }
    last()?;
    fs::remove_dir(bpffs).with_context(|| format!("remove {} (not empty?)", bpffs.display()))?;
    Ok(true)
}

/// Why a device whose driver has no native XDP gets none.
const NO_NATIVE_XDP: &str = "the driver has no native XDP: no XDP acceleration on this device, the TC programs carry its traffic \
     (generic XDP would run after GRO, on packets whose partial checksums it cannot see and would corrupt: merged TCP \
     segments, a local sender's or a VM's packets)";

#[cfg(test)]
mod tests {
    use super::lock_holder;

    #[test]
    fn a_load_the_verifier_gave_up_on_is_tried_again() {
        let eagain = |e: &std::io::Error| e.raw_os_error() == Some(libc::EAGAIN);
        let fails = |n: u32, errno: i32| {
            let mut left = n;
            move || -> Result<(), std::io::Error> {
                if left == 0 {
                    return Ok(());
                }
                left -= 1;
                Err(std::io::Error::from_raw_os_error(errno))
            }
        };
        assert!(super::retry_interrupted(&mut fails(4, libc::EAGAIN), eagain).is_ok(), "up to 5 attempts");
        assert!(super::retry_interrupted(&mut fails(5, libc::EAGAIN), eagain).is_err(), "not more");
        assert!(super::retry_interrupted(&mut fails(1, libc::EACCES), eagain).is_err(), "a verifier's refusal stands");
    }

    #[test]
    fn the_lock_holder_is_read_from_proc_locks() {
        let locks = "1: POSIX  ADVISORY  WRITE 77 00:1f:42 0 EOF\n2: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF\n2: -> FLOCK  ADVISORY  WRITE 99 00:2a:5678 0 EOF\n";
        assert_eq!(lock_holder(locks, 5678), Some(1234));
        assert_eq!(lock_holder(locks, 42), None, "a POSIX lock is not ours");
        assert_eq!(lock_holder(locks, 1), None);
        assert_eq!(lock_holder("", 5678), None);
    }
}

