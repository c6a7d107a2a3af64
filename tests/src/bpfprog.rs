//! A stand-in for another proxy's socket program (Cilium's socket LB left
//! on a cgroup): the smallest connect4 program there is (`return 1`: let
//! the connect go on), loaded and attached with bpf(2) itself, under a
//! name of our choosing. It stays attached until the cgroup goes (the
//! tests' cgroups go with their cluster).
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::path::Path;

use anyhow::{Context as _, Result, bail};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
const BPF_CGROUP_INET4_CONNECT: u32 = 10;
const BPF_F_ALLOW_MULTI: u32 = 2;

fn bpf(cmd: libc::c_long, attr: &mut [u8]) -> Result<i64> {
    // SAFETY: `attr` is a bpf_attr of the command's layout, alive for the call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if r < 0 {
        bail!("bpf({cmd}): {}", std::io::Error::last_os_error());
    }
    Ok(r)
}

fn put32(a: &mut [u8], off: usize, v: u32) {
    a[off..off + 4].copy_from_slice(&v.to_ne_bytes());
}

/// Load a connect4 program named `name` (15 characters at most) that lets
/// every connect go on, and attach it to `cgroup` beside the others.
pub fn attach_connect4(cgroup: &Path, name: &str) -> Result<OwnedFd> {
    // r0 = 1; exit
    let insns: [u8; 16] = [0xb7, 0, 0, 0, 1, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0];
    let license = b"GPL\0";
    let mut attr = [0u8; 72];
    put32(&mut attr, 0, BPF_PROG_TYPE_CGROUP_SOCK_ADDR);
    put32(&mut attr, 4, 2);
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    let n = name.len().min(15);
    attr[48..48 + n].copy_from_slice(&name.as_bytes()[..n]);
    put32(&mut attr, 68, BPF_CGROUP_INET4_CONNECT);
    let fd = bpf(BPF_PROG_LOAD, &mut attr).context("load the stand-in connect4 program")?;
    // SAFETY: a new fd the kernel gave us.
    let prog = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let dir = std::fs::File::open(cgroup).with_context(|| format!("open {}", cgroup.display()))?;
    let mut attr = [0u8; 20];
    put32(&mut attr, 0, dir.as_raw_fd() as u32);
    put32(&mut attr, 4, prog.as_raw_fd() as u32);
    put32(&mut attr, 8, BPF_CGROUP_INET4_CONNECT);
    put32(&mut attr, 12, BPF_F_ALLOW_MULTI);
    bpf(BPF_PROG_ATTACH, &mut attr).with_context(|| format!("attach it to {}", cgroup.display()))?;
    Ok(prog)
}
