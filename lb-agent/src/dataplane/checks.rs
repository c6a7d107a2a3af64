//! What the node must offer before anything loads, each failure one clear
//! line: root, the capabilities, a bpffs (by file system type), a cgroup v2
//! directory (with the hybrid-host hint); and this process's memory limit,
//! which the node's translated sockets count against.
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

/// The oldest kernel lb runs on: its cgroup hooks refuse a connect with
/// the errno kube-proxy's REJECT gives through `bpf_set_retval` (5.18).
pub const MIN_KERNEL: (u32, u32) = (5, 18);

/// One line when the kernel `release` (as `uname -r` prints it) is older
/// than `MIN_KERNEL`; an unreadable one is let through (the loader's
/// verifier then says what it lacks).
pub fn check_kernel_release(release: &str) -> Result<()> {
    let mut nums = release.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty()).map(|s| s.parse::<u32>().unwrap_or(0));
    let (Some(major), Some(minor)) = (nums.next(), nums.next()) else { return Ok(()) };
    if (major, minor) < MIN_KERNEL {
        bail!(
            "this node runs Linux {release}; lb needs {}.{} or later (its cgroup hooks refuse connects with bpf_set_retval): \
             keep kube-proxy on this node",
            MIN_KERNEL.0,
            MIN_KERNEL.1
        );
    }
    Ok(())
}

/// `check_kernel_release` of this node's kernel.
pub fn check_kernel() -> Result<()> {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").context("read /proc/sys/kernel/osrelease")?;
    check_kernel_release(release.trim())
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

/// What the kernel charges for one translated socket's storage
/// (`LB_SOCK_XLATE`; Linux 6.18: a 192-byte element and the socket's
/// 192-byte `bpf_local_storage`). BPF map memory is charged to the memory
/// cgroup of the process that created the map, whichever process's socket
/// it serves, and a charge made from a BPF program is forced past the
/// limit (an atomic allocation): the cgroup goes over, and its own next
/// allocation reclaims or meets the OOM killer.
pub const SOCK_STORAGE_BYTES: u64 = 384;

/// The same for one entry of the NAT tables of outside flows (two per
/// flow), allocated as flows arrive (`BPF_F_NO_PREALLOC`): a 48-byte hash
/// element with its key and value, IPv4 and IPv6 (Linux 6.18 sizes).
pub const NAT_ENTRY_BYTES: [u64; 2] = [96, 144];

/// This process's memory cgroup limit and usage in bytes (None: no limit),
/// from /proc/self/cgroup and the memory controller's files (cgroup v1 or v2).
pub fn memory_limit() -> Option<(u64, u64)> {
    let cgroup = fs::read_to_string("/proc/self/cgroup").ok()?;
    memory_limit_in(&cgroup, |p| fs::read_to_string(p).ok())
}

/// `memory_limit` from a /proc/self/cgroup text, reading files with `read`.
/// The memory controller on a v1 hierarchy (a hybrid host) comes first;
/// each path is tried as seen from the host, then as the root of a
/// container's own cgroup mount.
pub fn memory_limit_in(cgroup: &str, read: impl Fn(&Path) -> Option<String>) -> Option<(u64, u64)> {
    let v1 = cgroup.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        controllers.split(',').any(|c| c == "memory").then_some(path)
    });
    let (base, path, limit, usage) = match v1 {
        Some(path) => ("/sys/fs/cgroup/memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes"),
        None => ("/sys/fs/cgroup", cgroup.lines().find_map(|l| l.strip_prefix("0::"))?, "memory.max", "memory.current"),
    };
    for dir in [Path::new(base).join(path.trim_start_matches('/')), PathBuf::from(base)] {
        let Some(l) = read(&dir.join(limit)) else { continue };
        let l = l.trim();
        // v2 says "max"; v1 a number of the order of 2^63 (no limit).
        let l: u64 = l.parse().ok().filter(|l| *l < 1 << 62)?;
        let u = read(&dir.join(usage)).and_then(|u| u.trim().parse().ok()).unwrap_or(0);
        return Some((l, u));
    }
    None
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_kernel_older_than_lb_needs_is_one_clear_line() {
        let e = check_kernel_release("5.15.0-91-generic").unwrap_err().to_string();
        assert!(e.contains("this node runs Linux 5.15.0-91-generic; lb needs 5.18 or later") && e.contains("keep kube-proxy"), "{e}");
        assert!(check_kernel_release("4.19.0").is_err());
        for ok in ["5.18.0", "6.1.0-13-amd64", "6.18.44-fc-v1252", "10.0", "weird"] {
            assert!(check_kernel_release(ok).is_ok(), "{ok}");
        }
    }
    use super::*;
    use std::collections::HashMap;

    fn files(f: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
        let m: HashMap<PathBuf, String> = f.iter().map(|(p, v)| (PathBuf::from(p), v.to_string())).collect();
        move |p| m.get(p).cloned()
    }

    #[test]
    fn a_v2_limit_and_its_usage() {
        let r = files(&[("/sys/fs/cgroup/kubepods/pod1/c1/memory.max", "268435456\n"), ("/sys/fs/cgroup/kubepods/pod1/c1/memory.current", "1048576\n")]);
        assert_eq!(memory_limit_in("0::/kubepods/pod1/c1\n", r), Some((268435456, 1048576)));
    }

    #[test]
    fn no_v2_limit() {
        let r = files(&[("/sys/fs/cgroup/a/memory.max", "max\n")]);
        assert_eq!(memory_limit_in("0::/a\n", r), None);
    }

    #[test]
    fn a_container_sees_its_own_cgroup_at_the_mount_root() {
        // cgroup namespace: /proc/self/cgroup says "/", or a host path the
        // container's mount does not show.
        let r = files(&[("/sys/fs/cgroup/memory.max", "1000\n"), ("/sys/fs/cgroup/memory.current", "10\n")]);
        assert_eq!(memory_limit_in("0::/\n", &r), Some((1000, 10)));
        assert_eq!(memory_limit_in("0::/kubepods/x\n", &r), Some((1000, 10)));
    }

    #[test]
    fn the_v1_memory_controller_of_a_hybrid_host_comes_first() {
        let cg = "4:memory:/process_api/x\n3:cpu,cpuacct:/y\n0::/\n";
        let r = files(&[
            ("/sys/fs/cgroup/memory/process_api/x/memory.limit_in_bytes", "524288\n"),
            ("/sys/fs/cgroup/memory/process_api/x/memory.usage_in_bytes", "4096\n"),
            ("/sys/fs/cgroup/memory.max", "1\n"),
        ]);
        assert_eq!(memory_limit_in(cg, r), Some((524288, 4096)));
        // v1 with no limit: a page-rounded 2^63.
        let r = files(&[("/sys/fs/cgroup/memory/process_api/x/memory.limit_in_bytes", "9223372036854771712\n")]);
        assert_eq!(memory_limit_in(cg, r), None);
    }

    #[test]
    fn nothing_readable_is_no_limit() {
        assert_eq!(memory_limit_in("0::/a\n", files(&[])), None);
        assert_eq!(memory_limit_in("", files(&[])), None);
        let r = files(&[("/sys/fs/cgroup/a/memory.max", "garbage\n")]);
        assert_eq!(memory_limit_in("0::/a\n", r), None);
    }
}
