//! What the node must offer before anything loads, each failure one clear
//! line: root, the capabilities, a bpffs (by file system type), a cgroup v2
//! directory (with the hybrid-host hint).
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use nix::sys::statfs;

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
