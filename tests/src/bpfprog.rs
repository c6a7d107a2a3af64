//! Stand-ins for another proxy's programs (Cilium's socket LB left on a
//! cgroup, its NodePort program on a device): the smallest programs there
//! are (a connect4 program that lets the connect go on, a TC program that
//! hands the packet to the next one), loaded and attached with bpf(2)
//! itself, under names of our choosing. They stay attached until their
//! cgroup or network namespace goes (the tests' go with their cluster).
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

/// Load a program of `prog_type` named `name` (15 characters at most)
/// whose whole body is `r0 = ret; exit`.
fn load(prog_type: u32, expected_attach_type: u32, ret: i32, name: &str) -> Result<OwnedFd> {
    let mut insns: [u8; 16] = [0xb7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0];
    insns[4..8].copy_from_slice(&ret.to_ne_bytes());
    let license = b"GPL\0";
    let mut attr = [0u8; 72];
    put32(&mut attr, 0, prog_type);
    put32(&mut attr, 4, 2);
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    let n = name.len().min(15);
    attr[48..48 + n].copy_from_slice(&name.as_bytes()[..n]);
    put32(&mut attr, 68, expected_attach_type);
    let fd = bpf(BPF_PROG_LOAD, &mut attr).with_context(|| format!("load the stand-in program {name}"))?;
    // SAFETY: a new fd the kernel gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A TC program named `name` that hands every packet to the next one
/// (TCX_NEXT), attached first on `dev`'s TCX ingress in `netns` (before
/// lb's, when it comes after).
pub fn attach_tcx_ingress(netns: &str, dev: &str, name: &str) -> Result<()> {
    attach_tcx_ingress_returning(netns, dev, name, -1)
}

/// A TC program named `name` that returns `ret` for every packet (-1
/// TCX_NEXT, 2 TC_ACT_SHOT: a firewall that drops everything), appended
/// to `dev`'s TCX ingress in `netns` (behind lb's, once lb's are there).
pub fn attach_tcx_ingress_returning(netns: &str, dev: &str, name: &str, ret: i32) -> Result<()> {
    const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
    const BPF_TCX_INGRESS: u32 = 46;
    let (netns, dev, name) = (netns.to_string(), dev.to_string(), name.to_string());
    std::thread::spawn(move || -> Result<()> {
        let f = std::fs::File::open(format!("/run/netns/{netns}"))?;
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)?;
        let prog = load(BPF_PROG_TYPE_SCHED_CLS, 0, ret, &name)?;
        let c = std::ffi::CString::new(dev.clone())?;
        // SAFETY: a valid C string.
        let ifindex = unsafe { libc::if_nametoindex(c.as_ptr()) };
        if ifindex == 0 {
            bail!("no device {dev} in {netns}");
        }
        let mut attr = [0u8; 32];
        put32(&mut attr, 0, ifindex);
        put32(&mut attr, 4, prog.as_raw_fd() as u32);
        put32(&mut attr, 8, BPF_TCX_INGRESS);
        bpf(BPF_PROG_ATTACH, &mut attr).with_context(|| format!("attach {name} to {dev}'s TCX ingress"))?;
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("attach thread panicked"))?
}

/// Load a connect4 program named `name` (15 characters at most) that lets
/// every connect go on, and attach it to `cgroup` beside the others.
pub fn attach_connect4(cgroup: &Path, name: &str) -> Result<OwnedFd> {
    let prog = load(BPF_PROG_TYPE_CGROUP_SOCK_ADDR, BPF_CGROUP_INET4_CONNECT, 1, name)?;
    let dir = std::fs::File::open(cgroup).with_context(|| format!("open {}", cgroup.display()))?;
    let mut attr = [0u8; 20];
    put32(&mut attr, 0, dir.as_raw_fd() as u32);
    put32(&mut attr, 4, prog.as_raw_fd() as u32);
    put32(&mut attr, 8, BPF_CGROUP_INET4_CONNECT);
    put32(&mut attr, 12, BPF_F_ALLOW_MULTI);
    bpf(BPF_PROG_ATTACH, &mut attr).with_context(|| format!("attach it to {}", cgroup.display()))?;
    Ok(prog)
}
