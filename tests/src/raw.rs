//! Hand-made frames for the malformed-packet and SYN-flood tests, sent from
//! inside a test netns with an AF_PACKET socket: whatever bytes we like,
//! bad headers included, which no socket API would send.
use anyhow::{Context as _, Result, bail};

/// Sum 16-bit words, folded and complemented (the Internet checksum).
pub fn csum(data: &[u8], seed: u32) -> u16 {
    let mut s = seed;
    for c in data.chunks(2) {
        s += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

fn pseudo_sum(src: &[u8], dst: &[u8], proto: u8, len: usize) -> u32 {
    let mut s = 0u32;
    for c in src.chunks(2).chain(dst.chunks(2)) {
        s += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    s + u32::from(proto) + len as u32
}

/// A TCP SYN header (20 bytes) with a correct checksum.
pub fn tcp_syn(src: &[u8], dst: &[u8], sport: u16, dport: u16) -> Vec<u8> {
    tcp_segment(src, dst, sport, dport, 0x02)
}

/// A TCP header (20 bytes) with `flags` and a made-up sequence number (as
/// an attacker who guessed the ports would send it), checksum right.
pub fn tcp_segment(src: &[u8], dst: &[u8], sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    let mut t = vec![0u8; 20];
    t[0..2].copy_from_slice(&sport.to_be_bytes());
    t[2..4].copy_from_slice(&dport.to_be_bytes());
    t[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = flags;
    t[14..16].copy_from_slice(&64240u16.to_be_bytes());
    let c = csum(&t, pseudo_sum(src, dst, 6, t.len()));
    t[16..18].copy_from_slice(&c.to_be_bytes());
    t
}

/// A UDP datagram (header and `payload`) from `src` to `dst`, checksum
/// right (for fragmenting by hand).
pub fn udp_datagram(src: &[u8], dst: &[u8], sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let mut u = vec![0u8; 8];
    u[0..2].copy_from_slice(&sport.to_be_bytes());
    u[2..4].copy_from_slice(&dport.to_be_bytes());
    u[4..6].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    u.extend_from_slice(payload);
    let c = csum(&u, pseudo_sum(src, dst, 17, u.len()));
    u[6..8].copy_from_slice(&(if c == 0 { 0xffff } else { c }).to_be_bytes());
    u
}

/// An IPv6 fragment header (8 bytes) for a fragment of `next` at byte
/// `offset` (a multiple of 8) of datagram `id`.
pub fn ipv6_frag_header(next: u8, offset: usize, more: bool, id: u32) -> Vec<u8> {
    let mut h = vec![next, 0];
    h.extend_from_slice(&((offset as u16) | more as u16).to_be_bytes());
    h.extend_from_slice(&id.to_be_bytes());
    h
}

/// An IPv4 packet: `ihl` words of header (5 unless testing bad ones), the
/// given fragment field and ID, and `payload`.
pub fn ipv4(src: [u8; 4], dst: [u8; 4], proto: u8, ihl: u8, frag: u16, id: u16, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; 20];
    h[0] = 0x40 | (ihl & 0x0f);
    let total = 20 + payload.len();
    h[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    h[4..6].copy_from_slice(&id.to_be_bytes());
    h[6..8].copy_from_slice(&frag.to_be_bytes());
    h[8] = 64;
    h[9] = proto;
    h[12..16].copy_from_slice(&src);
    h[16..20].copy_from_slice(&dst);
    let c = csum(&h, 0);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h.extend_from_slice(payload);
    h
}

/// An IPv4 packet with `options` (padded to a multiple of 4 bytes) after
/// the fixed header, and `payload`.
pub fn ipv4_with_options(src: [u8; 4], dst: [u8; 4], proto: u8, options: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut opts = options.to_vec();
    opts.resize(options.len().div_ceil(4) * 4, 0);
    let ihl = 5 + opts.len() / 4;
    let mut h = vec![0u8; 20];
    h[0] = 0x40 | ihl as u8;
    h[2..4].copy_from_slice(&((4 * ihl + payload.len()) as u16).to_be_bytes());
    h[8] = 64;
    h[9] = proto;
    h[12..16].copy_from_slice(&src);
    h[16..20].copy_from_slice(&dst);
    h.extend_from_slice(&opts);
    let c = csum(&h, 0);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h.extend_from_slice(payload);
    h
}

/// An IPv6 packet with next header `next` and `payload`.
pub fn ipv6(src: [u8; 16], dst: [u8; 16], next: u8, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; 40];
    h[0] = 0x60;
    h[4..6].copy_from_slice(&(payload.len() as u16).to_be_bytes());
    h[6] = next;
    h[7] = 64;
    h[8..24].copy_from_slice(&src);
    h[24..40].copy_from_slice(&dst);
    h.extend_from_slice(payload);
    h
}

/// An Ethernet frame.
pub fn ether(dst: [u8; 6], src: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + payload.len());
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The MAC address of `dev` in `netns`.
pub fn mac(c: &crate::Cluster, netns: &str, dev: &str) -> Result<[u8; 6]> {
    let out = c.in_netns(netns, &["ip", "-j", "link", "show", "dev", dev])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let s = v[0]["address"].as_str().context("no MAC address")?;
    let b: Vec<u8> = s.split(':').map(|h| u8::from_str_radix(h, 16)).collect::<Result<_, _>>()?;
    b.try_into().map_err(|_| anyhow::anyhow!("bad MAC {s}"))
}

/// Send `frames` as they are out of `dev` in `netns` (from a thread of its
/// own that enters the netns; the caller's thread stays where it is).
pub fn send(netns: &str, dev: &str, frames: Vec<Vec<u8>>) -> Result<()> {
    let (netns, dev) = (netns.to_string(), dev.to_string());
    std::thread::spawn(move || -> Result<()> {
        let f = std::fs::File::open(format!("/run/netns/{netns}"))?;
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)?;
        let name = std::ffi::CString::new(dev.clone())?;
        // SAFETY: plain syscalls with valid arguments; the socket is closed below.
        unsafe {
            let ifindex = libc::if_nametoindex(name.as_ptr());
            if ifindex == 0 {
                bail!("no device {dev} in {netns}");
            }
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0);
            if fd < 0 {
                bail!("AF_PACKET socket: {}", std::io::Error::last_os_error());
            }
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_ifindex = ifindex as i32;
            sll.sll_halen = 6;
            let mut result = Ok(());
            for fr in &frames {
                sll.sll_addr[..6].copy_from_slice(&fr[..6]);
                let n = libc::sendto(
                    fd,
                    fr.as_ptr().cast(),
                    fr.len(),
                    0,
                    (&sll as *const libc::sockaddr_ll).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                );
                if n < 0 {
                    result = Err(anyhow::anyhow!("sendto: {}", std::io::Error::last_os_error()));
                    break;
                }
            }
            libc::close(fd);
            result
        }
    })
    .join()
    .map_err(|_| anyhow::anyhow!("sender thread panicked"))?
}

/// Whether the TCP, UDP, ICMP or ICMPv6 checksum (and the IPv4 header
/// checksum) of an Ethernet frame holds; None: not a packet we check
/// (other protocols, fragments, IPv4 options, IPv6 extension headers, UDP
/// without a checksum).
pub fn checksums_hold(f: &[u8]) -> Option<bool> {
    let et = u16::from_be_bytes([*f.get(12)?, *f.get(13)?]);
    let (l3, l4, proto, pseudo) = match et {
        0x0800 => {
            let ip = f.get(14..34)?;
            let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
            if ip[0] != 0x45 || u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0 {
                return None;
            }
            let l4 = f.get(34..14 + total)?;
            (Some(ip), l4, ip[9], pseudo_sum(&ip[12..16], &ip[16..20], ip[9], l4.len()))
        }
        0x86dd => {
            let ip = f.get(14..54)?;
            let len = u16::from_be_bytes([ip[4], ip[5]]) as usize;
            let l4 = f.get(54..54 + len)?;
            (None, l4, ip[6], pseudo_sum(&ip[8..24], &ip[24..40], ip[6], l4.len()))
        }
        _ => return None,
    };
    // ICMP's checksum covers the message alone, ICMPv6's a pseudo header too.
    let pseudo = if proto == 1 && et == 0x0800 { 0 } else { pseudo };
    if !matches!((proto, et), (6 | 17, _) | (1, 0x0800) | (58, 0x86dd)) || (proto == 17 && et == 0x0800 && l4.get(6..8)? == [0, 0]) {
        return None;
    }
    Some(l3.is_none_or(|ip| csum(ip, 0) == 0) && csum(l4, pseudo) == 0)
}

/// Run `f` while capturing what arrives at every device of `netns`:
/// returns its result and how many TCP/UDP/ICMP packets arrived with valid and
/// with broken checksums (`checksums_hold`). Only meaningful where senders
/// compute complete checksums (`Cluster::wire_checksums`): a partial one
/// is broken on the wire by design.
pub fn count_checksums<T>(netns: &str, f: impl FnOnce() -> Result<T>) -> Result<(T, u64, u64)> {
    let (r, (ok, bad)) = capture(netns, (0, 0), |(ok, bad): &mut (u64, u64), frame| match checksums_hold(frame) {
        Some(true) => *ok += 1,
        Some(false) => *bad += 1,
        None => {}
    }, f)?;
    Ok((r, ok, bad))
}

/// Run `f` while capturing what arrives at every device of `netns`: returns
/// its result and the frames `keep` kept.
pub fn capture_frames<T>(netns: &str, keep: impl Fn(&[u8]) -> bool + Send + 'static, f: impl FnOnce() -> Result<T>) -> Result<(T, Vec<Vec<u8>>)> {
    capture(netns, Vec::new(), move |v: &mut Vec<Vec<u8>>, frame| {
        if keep(frame) {
            v.push(frame.to_vec());
        }
    }, f)
}

/// Run `f` while a thread in `netns` hands every frame arriving there (not
/// those sent from it) to `on_frame` with `state`; returns `f`'s result
/// and the state.
fn capture<S: Send + 'static, T>(netns: &str, state: S, mut on_frame: impl FnMut(&mut S, &[u8]) + Send + 'static, f: impl FnOnce() -> Result<T>) -> Result<(T, S)> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (netns_s, stop2) = (netns.to_string(), stop.clone());
    let t = std::thread::spawn(move || -> Result<S> {
        let mut state = state;
        let file = std::fs::File::open(format!("/run/netns/{netns_s}"))?;
        nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET)?;
        // SAFETY: plain syscalls with valid arguments; the socket is closed below.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, (libc::ETH_P_ALL as u16).to_be() as i32) };
        if fd < 0 {
            bail!("AF_PACKET socket: {}", std::io::Error::last_os_error());
        }
        let tv = libc::timeval { tv_sec: 0, tv_usec: 100_000 };
        // SAFETY: a valid fd and a timeval of the right size.
        unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&tv as *const libc::timeval).cast(), size_of::<libc::timeval>() as u32) };
        let _ = ready_tx.send(());
        let mut buf = vec![0u8; 65536];
        while !stop2.load(Ordering::SeqCst) {
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut len = size_of::<libc::sockaddr_ll>() as u32;
            // SAFETY: a valid fd, buffer and address of the given sizes.
            let n = unsafe { libc::recvfrom(fd, buf.as_mut_ptr().cast(), buf.len(), 0, (&mut from as *mut libc::sockaddr_ll).cast(), &mut len) };
            if n <= 0 || from.sll_pkttype == libc::PACKET_OUTGOING {
                continue;
            }
            on_frame(&mut state, &buf[..n as usize]);
        }
        // SAFETY: our fd.
        unsafe { libc::close(fd) };
        Ok(state)
    });
    let _ = ready_rx.recv();
    let r = f();
    stop.store(true, Ordering::SeqCst);
    let state = t.join().map_err(|_| anyhow::anyhow!("capture thread panicked"))??;
    Ok((r?, state))
}
