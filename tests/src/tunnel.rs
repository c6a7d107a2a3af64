//! An L3 tunnel between two network namespaces, as a node sees WireGuard
//! or IPIP: a device without a link-layer header (a TUN device, like
//! WireGuard's ARPHRD_NONE) on each side, and this process carrying each
//! IP packet one side sends to the other side's device.
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use anyhow::{Context as _, Result, bail};

use crate::with_netns;

pub struct Tunnel {
    stop: Arc<AtomicBool>,
    /// Packets carried from the first namespace to the second, and back.
    counts: [Arc<AtomicU64>; 2],
    threads: Vec<JoinHandle<()>>,
}

/// Create TUN device `name` in netns `netns` (gone when its fd closes).
fn tun_in(netns: &str, name: &str) -> Result<OwnedFd> {
    with_netns(Some(netns), || {
        // SAFETY: a plain open of a path literal.
        let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            bail!("open /dev/net/tun: {}", std::io::Error::last_os_error());
        }
        // SAFETY: a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an all-zero ifreq is valid.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in req.ifr_name.iter_mut().zip(name.bytes().take(15)) {
            *d = s as libc::c_char;
        }
        req.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
        // A device of the same name still attached to a file is busy: the
        // one a dropped Tunnel closed can still be held for a moment by a
        // child another thread forked and has not yet exec'd (the fd is
        // close-on-exec, not close-on-fork). Try again for a while.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            // SAFETY: TUNSETIFF takes a struct ifreq.
            if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut req) } == 0 {
                return Ok(fd);
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EBUSY) || std::time::Instant::now() > deadline {
                bail!("TUNSETIFF {name} in {netns}: {e}");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    })
    .with_context(|| format!("tun device {name} in {netns}"))
}

/// Copy packets from `from` to `to` until `stop`.
fn carry(from: Arc<OwnedFd>, to: Arc<OwnedFd>, stop: Arc<AtomicBool>, count: Arc<AtomicU64>) {
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd { fd: from.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd.
        if unsafe { libc::poll(&mut pfd, 1, 100) } <= 0 {
            continue;
        }
        // SAFETY: reading into our own buffer.
        let n = unsafe { libc::read(from.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            continue;
        }
        // SAFETY: writing what was read; a TUN write takes one packet.
        if unsafe { libc::write(to.as_raw_fd(), buf.as_ptr().cast(), n as usize) } == n {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Tunnel {
    /// Device `name` in `a` and in `b`, up, with `addrs` (one list per
    /// side, prefixes such as "10.99.0.1/32"), carried between them.
    pub fn new(a: &str, b: &str, name: &str, addrs: [&[&str]; 2]) -> Result<Self> {
        let fa = Arc::new(tun_in(a, name)?);
        let fb = Arc::new(tun_in(b, name)?);
        let stop = Arc::new(AtomicBool::new(false));
        let counts = [Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0))];
        let threads = vec![
            {
                let (f, t, s, c) = (fa.clone(), fb.clone(), stop.clone(), counts[0].clone());
                std::thread::spawn(move || carry(f, t, s, c))
            },
            {
                let (f, t, s, c) = (fb, fa, stop.clone(), counts[1].clone());
                std::thread::spawn(move || carry(f, t, s, c))
            },
        ];
        let t = Tunnel { stop, counts, threads };
        for (ns, addrs) in [(a, addrs[0]), (b, addrs[1])] {
            for addr in addrs {
                let mut args = vec!["-n", ns, "addr", "add", addr, "dev", name];
                if addr.contains(':') {
                    args.push("nodad");
                }
                crate::run("ip", &args)?;
            }
            crate::run("ip", &["-n", ns, "link", "set", name, "up"])?;
        }
        Ok(t)
    }

    /// Packets carried so far: (first to second namespace, back).
    pub fn carried(&self) -> (u64, u64) {
        (self.counts[0].load(Ordering::Relaxed), self.counts[1].load(Ordering::Relaxed))
    }
}

impl Drop for Tunnel {
    /// Stop carrying and close both devices' fds, which removes them.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
