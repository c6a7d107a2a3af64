//! The network namespaces to search: one process per netns with processes
//! in the attached cgroup, found through /proc (the agent needs the host's
//! PID namespace), and a sock_diag socket made inside each.
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use anyhow::{Context as _, Result};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};

/// The processes of each network namespace with processes in `cgroup` (and
/// the cgroups below it), the oldest (lowest pid) first.
pub fn netns_pids(cgroup: &Path) -> Vec<Vec<u32>> {
    scan(cgroup).0
}

/// `netns_pids`, and how many of the cgroup's processes the agent cannot
/// see: in a PID namespace of its own (a container without hostPID),
/// `cgroup.procs` lists other namespaces' processes as 0 and /proc has no
/// entry for them, so no pod's sockets could ever be found. (A process
/// that exited since the listing, or is exiting, is not counted: its
/// namespaces are gone, and its files closed; one whose netns cannot be
/// read for another reason is.)
pub fn scan(cgroup: &Path) -> (Vec<Vec<u32>>, usize) {
    let mut pids = Vec::new();
    let mut dirs = vec![cgroup.to_path_buf()];
    while let Some(d) = dirs.pop() {
        if let Ok(s) = std::fs::read_to_string(d.join("cgroup.procs")) {
            pids.extend(s.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
        if let Ok(rd) = std::fs::read_dir(&d) {
            dirs.extend(rd.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
        }
    }
    pids.sort_unstable();
    let mut seen: HashMap<(u64, u64), Vec<u32>> = HashMap::new();
    let mut invisible = 0;
    for pid in pids {
        if pid == 0 {
            invisible += 1;
            continue;
        }
        match std::fs::metadata(format!("/proc/{pid}/ns/net")) {
            Ok(md) => seen.entry((md.dev(), md.ino())).or_default().push(pid),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => invisible += 1,
        }
    }
    (seen.into_values().collect(), invisible)
}

/// Say loudly when the agent cannot see the processes of its cgroup (see
/// `scan`): stale sockets would never be destroyed, silently.
pub(super) fn check_visibility(cgroup: &Path, gauge: &prometheus_client::metrics::gauge::Gauge, logged: &mut bool) {
    let (visible, invisible) = scan(cgroup);
    gauge.set(invisible as i64);
    let blind = visible.is_empty() && invisible > 0;
    if blind && !*logged {
        tracing::error!(
            cgroup = %cgroup.display(),
            processes = invisible,
            "cannot see the processes of the cgroup (the agent runs in a PID namespace of its own?): sockets to endpoints \
             that leave cannot be destroyed; run the agent with hostPID: true (the DaemonSet in deploy/ does)"
        );
    }
    *logged = blind;
}

/// A sock_diag socket in every netns with processes in `cgroup`: a netlink
/// socket stays in the netns it was made in, so each is made on a thread
/// that enters the netns and is then dropped. Also whether every netns
/// listed was entered (its process may have exited meanwhile: its netns
/// may have others).
pub(super) fn netns_sockets(cgroup: &Path) -> (Vec<(u32, Socket)>, bool) {
    let mut out = Vec::new();
    let mut all = true;
    for pids in netns_pids(cgroup) {
        // The first of its processes still there (one may exit meanwhile:
        // an exec probe's).
        let Some((pid, ns)) = pids.iter().find_map(|pid| Some((*pid, std::fs::File::open(format!("/proc/{pid}/ns/net")).ok()?))) else {
            all = false;
            continue;
        };
        let made = std::thread::spawn(move || -> Result<Socket> {
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
            let mut sock = Socket::new(NETLINK_SOCK_DIAG).context("netlink sock_diag socket")?;
            sock.bind_auto()?;
            sock.connect(&SocketAddr::new(0, 0))?;
            Ok(sock)
        })
        .join();
        match made {
            Ok(Ok(sock)) => out.push((pid, sock)),
            Ok(Err(e)) => {
                all = false;
                tracing::warn!("stale sockets: the netns of pid {pid}: {e:#}");
            }
            Err(_) => {
                all = false;
                tracing::warn!("stale sockets: the netns of pid {pid}: thread panicked");
            }
        }
    }
    (out, all)
}
