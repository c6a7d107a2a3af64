//! The node: its addresses and interfaces, its network namespace, and its
//! ephemeral port range kept clear of NodePorts.
use std::net::IpAddr;

use anyhow::{Context as _, Result};

use crate::dataplane::maps::RouteMtus;

/// The addresses on this netns' interfaces that get NodePorts (with the
/// interface): the global ones, and IPv4 link-local ones, which
/// kube-proxy's `--dst-type LOCAL` match takes too (NodeLocal DNSCache's
/// 169.254.20.10 on its dummy device, say). IPv6 link-local addresses get
/// none: every veth has one. And the interfaces holding a global address
/// that are up, sorted.
fn interface_state() -> (Vec<(String, IpAddr)>, Vec<String>) {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else { return Default::default() };
    let mut up = Vec::new();
    let held = addrs
        .filter_map(|ifa| {
            let sa = ifa.address?;
            let ip = if let Some(v4) = sa.as_sockaddr_in() {
                IpAddr::V4(v4.ip())
            } else if let Some(v6) = sa.as_sockaddr_in6() {
                IpAddr::V6(v6.ip())
            } else {
                return None;
            };
            let global = match ip {
                IpAddr::V4(a) => !a.is_loopback() && !a.is_link_local(),
                IpAddr::V6(a) => !a.is_loopback() && !a.is_unicast_link_local(),
            };
            if global && ifa.flags.contains(nix::net::if_::InterfaceFlags::IFF_UP) {
                up.push(ifa.interface_name.clone());
            }
            (global || link_local_v4(&ip)).then_some((ifa.interface_name, ip))
        })
        .collect();
    up.sort();
    up.dedup();
    (held, up)
}

/// The veths that are up (name, index): pods' devices among them.
fn up_veths() -> Vec<(String, u32)> {
    crate::netdev::pod_devices(&crate::netdev::links().unwrap_or_default(), &[])
}

/// rtnetlink multicast groups: links (a device created, up or down), IPv4
/// and IPv6 address changes, IPv4 and IPv6 route changes.
const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;

/// The routes that set an MTU (`netdev::route_mtus`); empty, with a
/// warning, where they cannot be read.
fn route_mtus() -> RouteMtus {
    crate::netdev::route_mtus().unwrap_or_else(|e| {
        tracing::warn!("cannot read the routes: {e:#}; route MTUs are not given to the TC programs");
        RouteMtus::new()
    })
}

/// The node's interface addresses, kept current by rtnetlink address
/// events (a thread listens) instead of read at every sync; each change
/// wakes the agent (`changed`), so a new or removed node address takes
/// effect at once, without waiting for a Kubernetes event. So does a
/// device holding an address going up or down (link events): a tunnel
/// usually gets its address before it comes up, and the TC programs go on
/// it then. So does a route that sets an MTU, added, changed or removed
/// (`route_mtus`). With `veths` (the pod programs are in use; or later,
/// `track_veths`), so does a veth coming up or going: a pod's device, which
/// they go on.
pub struct Addresses {
    current: std::sync::Arc<std::sync::Mutex<Vec<(String, IpAddr)>>>,
    routes: std::sync::Arc<std::sync::Mutex<RouteMtus>>,
    changed: std::sync::Arc<tokio::sync::Notify>,
    veths: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Addresses {
    /// Subscribe first, then read: no change falls between the two.
    pub fn watch(veths: bool) -> Result<Self> {
        use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
        let mut sock = Socket::new(NETLINK_ROUTE).context("rtnetlink socket")?;
        let groups = RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE;
        sock.bind(&SocketAddr::new(0, groups)).context("rtnetlink bind to the link, address and route groups")?;
        let (addrs, mut up) = interface_state();
        let track = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(veths));
        let tracking = track.clone();
        let mut veths = if veths { up_veths() } else { Vec::new() };
        let current = std::sync::Arc::new(std::sync::Mutex::new(addrs));
        let routes = std::sync::Arc::new(std::sync::Mutex::new(route_mtus()));
        let changed = std::sync::Arc::new(tokio::sync::Notify::new());
        let (cur, rts, ch) = (current.clone(), routes.clone(), changed.clone());
        std::thread::Builder::new()
            .name("addresses".into())
            .spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    // Any message (or a lost one: ENOBUFS) means: read again.
                    if let Err(e) = sock.recv(&mut &mut buf[..], 0)
                        && e.raw_os_error() != Some(libc::ENOBUFS)
                    {
                        tracing::warn!("rtnetlink address events: {e}; reading the addresses every second");
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                    // A burst of events (routes come and go with pods) is
                    // one read.
                    while sock.recv(&mut &mut buf[..], libc::MSG_DONTWAIT).is_ok() {}
                    let now_routes = route_mtus();
                    let mut held_routes = rts.lock().unwrap_or_else(|e| e.into_inner());
                    if *held_routes != now_routes {
                        tracing::info!(routes = ?now_routes.iter().map(|((a, l), (m, i))| format!("{a}/{l} mtu {m} dev {i}")).collect::<Vec<_>>(), "routes that set an MTU changed");
                        *held_routes = now_routes;
                        ch.notify_one();
                    }
                    drop(held_routes);
                    let (now, now_up) = interface_state();
                    let mut held = cur.lock().unwrap_or_else(|e| e.into_inner());
                    if *held != now {
                        tracing::info!(addresses = ?now.iter().map(|(i, a)| format!("{i}:{a}")).collect::<Vec<_>>(), "interface addresses changed");
                        *held = now;
                        up = now_up;
                        ch.notify_one();
                    } else if up != now_up {
                        tracing::info!(up = ?now_up, "devices holding an address went up or down");
                        up = now_up;
                        ch.notify_one();
                    }
                    drop(held);
                    let now_veths = if tracking.load(std::sync::atomic::Ordering::Relaxed) { up_veths() } else { Vec::new() };
                    if veths != now_veths {
                        tracing::debug!(veths = ?now_veths, "veths came up or went");
                        veths = now_veths;
                        ch.notify_one();
                    }
                }
            })
            .context("spawn the address watcher")?;
        Ok(Self { current, routes, changed, veths: track })
    }

    /// Wake the agent at veths coming up or going from now on too (the pod
    /// programs came into use).
    pub fn track_veths(&self) {
        self.veths.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The routes that set an MTU, as of the last event.
    pub fn route_mtus(&self) -> RouteMtus {
        self.routes.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The addresses as of the last event.
    pub fn get(&self) -> Vec<(String, IpAddr)> {
        self.current.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Notified at every change.
    pub fn changed(&self) -> std::sync::Arc<tokio::sync::Notify> {
        self.changed.clone()
    }
}

/// An IPv4 link-local address (169.254.0.0/16).
fn link_local_v4(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V4(a) if a.is_link_local())
}

/// The devices the TC programs go on for a node with addresses `addrs`
/// (see `netdev::nodeport_devices`), given the addresses each interface
/// holds. Without rtnetlink: the devices that hold `addrs`. A link-local
/// address gives its device no programs (a CNI may put the same one on
/// every pod's device); packets to it come in by the devices that have
/// them.
pub fn interfaces_for(held: Vec<(String, IpAddr)>, addrs: &[IpAddr]) -> Vec<String> {
    let held: Vec<(String, IpAddr)> = held.into_iter().filter(|(_, a)| !link_local_v4(a)).collect();
    match crate::netdev::links() {
        Ok(links) => crate::netdev::nodeport_devices(&links, &held, addrs),
        Err(e) => {
            tracing::warn!("cannot list network devices ({e:#}); NodePort programs go only where the node's addresses are");
            let mut v: Vec<String> = held.into_iter().filter(|(_, a)| addrs.contains(a)).map(|(i, _)| i).collect();
            v.sort();
            v.dedup();
            v
        }
    }
}

/// This network namespace's cookie (SO_NETNS_COOKIE).
pub fn netns_cookie() -> Result<u64> {
    use std::os::fd::AsRawFd as _;
    let s = std::net::UdpSocket::bind("127.0.0.1:0").or_else(|_| std::net::UdpSocket::bind("[::1]:0")).context("socket for SO_NETNS_COOKIE")?;
    let mut cookie: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: valid fd and out buffer of the right size.
    let rc = unsafe {
        libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_NETNS_COOKIE, (&mut cookie as *mut u64).cast(), &mut len)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("getsockopt SO_NETNS_COOKIE (kernel 5.14+)");
    }
    Ok(cookie)
}

/// A port list as the kernel writes and reads it ("2000-2001,30000"):
/// which ports it holds. None: not such a list.
fn port_set(list: &str) -> Option<Box<[bool; 65536]>> {
    let mut set = Box::new([false; 65536]);
    for r in list.trim().split(',').map(str::trim).filter(|r| !r.is_empty()) {
        let (a, b) = r.split_once('-').unwrap_or((r, r));
        let (a, b): (u16, u16) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        if a > b {
            return None;
        }
        set[a as usize..=b as usize].fill(true);
    }
    Some(set)
}

/// The ports of `set` as the kernel writes them: ascending ranges.
fn port_list(set: &[bool; 65536]) -> String {
    let mut out = Vec::new();
    let mut p = 0usize;
    while p < set.len() {
        if !set[p] {
            p += 1;
            continue;
        }
        let start = p;
        while p + 1 < set.len() && set[p + 1] {
            p += 1;
        }
        out.push(if start == p { start.to_string() } else { format!("{start}-{p}") });
        p += 1;
    }
    out.join(",")
}

/// What reserving `min..=max` in the list `current` makes: the new list,
/// and the ports it adds (those not reserved before), as lists; None where
/// it adds nothing.
fn reserve_in(current: &str, min: u16, max: u16) -> Option<(String, String)> {
    let mut set = port_set(current)?;
    let mut added = Box::new([false; 65536]);
    for p in min as usize..=max as usize {
        added[p] = !set[p];
        set[p] = true;
    }
    added.contains(&true).then(|| (port_list(&set), port_list(&added)))
}

/// The list `current` without the ports of the list `added`.
fn unreserve_in(current: &str, added: &str) -> Option<String> {
    let mut set = port_set(current)?;
    let added = port_set(added)?;
    for (s, a) in set.iter_mut().zip(added.iter()) {
        *s &= !a;
    }
    Some(port_list(&set))
}

/// Keep the NodePort range out of the ephemeral ports the kernel hands out
/// in this netns (ip_local_reserved_ports), so an outgoing connection never
/// takes a NodePort. Explicit bind()s are refused by the post_bind hook.
/// What it adds is recorded by port, not as the range: the kernel merges a
/// range touching or overlapping the operator's into one, and teardown
/// takes out exactly the ports lb added, wherever they now lie.
pub fn reserve_ports(min: u16, max: u16, bpffs: &std::path::Path) -> Result<()> {
    let current = std::fs::read_to_string(RESERVED).with_context(|| format!("read {RESERVED}"))?;
    let Some((new, added)) = reserve_in(&current, min, max) else {
        if port_set(&current).is_none() {
            anyhow::bail!("{RESERVED} holds {:?}, not a port list", current.trim());
        }
        return Ok(());
    };
    std::fs::write(RESERVED, &new).with_context(|| format!("write {RESERVED}"))?;
    // Remember what lb added, and in which netns (a directory in the pin
    // dir: bpffs holds nothing else), so that teardown takes out exactly
    // that, and only there.
    // One marker per piece of the list that fits a file name (an
    // operator's many ranges inside lb's leave many pieces).
    let cookie = netns_cookie()?;
    for piece in marker_pieces(&added) {
        let marker = bpffs.join(format!("{RESERVED_MARKER}{cookie}_{piece}"));
        if let Err(e) = std::fs::create_dir_all(&marker) {
            tracing::warn!("cannot record {}: {e}; teardown will leave {piece} in {RESERVED}", marker.display());
        }
    }
    Ok(())
}

/// A port list cut between its ranges into pieces of at most 200 bytes,
/// each a marker's name (a file name has at most 255).
fn marker_pieces(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in list.split(',').filter(|r| !r.is_empty()) {
        match out.last_mut() {
            Some(p) if p.len() + 1 + r.len() <= 200 => {
                p.push(',');
                p.push_str(r);
            }
            _ => out.push(r.to_string()),
        }
    }
    out
}

const RESERVED: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";
/// The pin-dir entry that records the ports lb added to
/// ip_local_reserved_ports.
pub const RESERVED_MARKER: &str = "reserved_ports_";

/// Take out the reserved ports this agent added (teardown): each marker in
/// `bpffs` names them, and goes with them. The sysctl is per network
/// namespace: run in the node's.
pub fn unreserve_ports(bpffs: &std::path::Path) -> Result<()> {
    let Ok(rd) = std::fs::read_dir(bpffs) else { return Ok(()) };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((cookie, added)) = name.strip_prefix(RESERVED_MARKER).and_then(|r| r.split_once('_')) else { continue };
        if cookie != netns_cookie()?.to_string() {
            tracing::warn!("{added} was reserved in another network namespace: run teardown in the node's to take it out of {RESERVED}");
            std::fs::remove_dir(e.path()).with_context(|| format!("remove {}", e.path().display()))?;
            continue;
        }
        let current = std::fs::read_to_string(RESERVED).with_context(|| format!("read {RESERVED}"))?;
        let new = unreserve_in(&current, added).with_context(|| format!("{RESERVED} holds {:?}, or {} names no ports", current.trim(), e.path().display()))?;
        // The kernel refuses an empty write; a lone newline clears the list.
        let new = if new.is_empty() { "\n".to_string() } else { new };
        std::fs::write(RESERVED, &new).with_context(|| format!("write {RESERVED}"))?;
        std::fs::remove_dir(e.path()).with_context(|| format!("remove {}", e.path().display()))?;
    }
    Ok(())
}

/// The device sysctls lb sets on its NodePort devices, with its values: a
/// SNATed flow's packets re-enter the stack with this node's own address
/// as their source; accept them (as Cilium does).
pub const DEVICE_SYSCTLS: [(&str, &str); 2] = [("accept_local", "1"), ("rp_filter", "0")];

/// The pin-dir entry that records a device sysctl lb changed, with its
/// value before: `sysctl:<netns cookie>:<knob>:<value>:<device>`. bpffs
/// refuses a name with a dot, which a device's may have (a VLAN's
/// `eth0.100`), and no device's has a colon: a dot there is a colon.
pub const SYSCTL_MARKER: &str = "sysctl:";

fn sysctl_marker_name(cookie: &str, knob: &str, before: &str, iface: &str) -> String {
    format!("{SYSCTL_MARKER}{cookie}:{knob}:{before}:{}", iface.replace('.', ":"))
}

/// A sysctl marker's netns cookie, knob, value before and device.
fn sysctl_marker(name: &str) -> Option<(String, String, String, String)> {
    let mut w = name.strip_prefix(SYSCTL_MARKER)?.splitn(4, ':');
    Some((w.next()?.into(), w.next()?.into(), w.next()?.into(), w.next()?.replace(':', ".")))
}

/// Set `DEVICE_SYSCTLS` on `iface`, first recording each one's value
/// before in `bpffs` (once: a restarted agent finds lb's own value), so
/// that teardown gives it back.
pub fn set_device_sysctls(iface: &str, bpffs: &std::path::Path) {
    let cookie = match netns_cookie() {
        Ok(c) => c.to_string(),
        Err(e) => {
            tracing::warn!("{e:#}: the device sysctls lb changes are not recorded, and teardown leaves them");
            String::new()
        }
    };
    for (knob, value) in DEVICE_SYSCTLS {
        let path = format!("/proc/sys/net/ipv4/conf/{iface}/{knob}");
        let before = std::fs::read_to_string(&path).map(|v| v.trim().to_string()).unwrap_or_default();
        if before == value {
            continue;
        }
        let recorded = std::fs::read_dir(bpffs).into_iter().flatten().flatten().any(|e| {
            sysctl_marker(&e.file_name().to_string_lossy()).is_some_and(|(c, k, _, d)| c == cookie && k == knob && d == iface)
        });
        if !recorded && !cookie.is_empty() && !before.is_empty() {
            let marker = bpffs.join(sysctl_marker_name(&cookie, knob, &before, iface));
            if let Err(e) = std::fs::create_dir_all(&marker) {
                tracing::warn!("cannot record {}: {e}; teardown will leave {path} at {value}", marker.display());
            }
        }
        if let Err(e) = std::fs::write(&path, value) {
            tracing::warn!(iface, "cannot set {path} to {value}: {e}; SNATed NodePort flows may be dropped");
        }
    }
}

/// Give back the device sysctls lb changed (teardown): each to its value
/// before, where lb's value is still there (an operator's change since
/// stays) and the device still is. What cannot be given back is said,
/// and keeps nothing else back.
pub fn restore_device_sysctls(bpffs: &std::path::Path) -> Result<()> {
    restore_device_sysctls_of(bpffs, None);
    Ok(())
}

/// `restore_device_sysctls` for device `only` (None: every one), whose
/// markers go.
pub fn restore_device_sysctls_of(bpffs: &std::path::Path, only: Option<&str>) {
    let Ok(rd) = std::fs::read_dir(bpffs) else { return };
    let mut cookie: Option<String> = None;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((c, knob, before, iface)) = sysctl_marker(&name) else { continue };
        if only.is_some_and(|o| o != iface) {
            continue;
        }
        let path = format!("/proc/sys/net/ipv4/conf/{iface}/{knob}");
        let ours = DEVICE_SYSCTLS.iter().find(|(k, _)| *k == knob).map(|(_, v)| *v);
        if cookie.is_none() {
            match netns_cookie() {
                Ok(c) => cookie = Some(c.to_string()),
                Err(err) => {
                    // Which netns the markers are of cannot be told: they
                    // stay, for a teardown that can.
                    tracing::warn!("{err:#}: the device sysctls lb changed are not given back");
                    return;
                }
            }
        }
        let here = cookie.as_deref().unwrap_or_default();
        if c != here {
            tracing::warn!("{path} was changed in another network namespace: run teardown in the node's to give it back {before}");
        } else if let Ok(now) = std::fs::read_to_string(&path) {
            if Some(now.trim()) != ours {
                tracing::info!("{path} is {} now, not lb's {}: left", now.trim(), ours.unwrap_or("?"));
            } else if let Err(err) = std::fs::write(&path, &before) {
                tracing::warn!("cannot give {path} back its {before}: {err}");
            } else {
                tracing::info!("{path} is {before} again, as before lb");
            }
        }
        if let Err(err) = std::fs::remove_dir(e.path()) {
            tracing::warn!("remove {}: {err}", e.path().display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lbs_ports_are_added_and_taken_out_by_port_whatever_the_kernel_merges() {
        // Nothing before; then teardown leaves nothing.
        assert_eq!(reserve_in("\n", 30000, 32767), Some(("30000-32767".into(), "30000-32767".into())));
        assert_eq!(unreserve_in("30000-32767", "30000-32767").as_deref(), Some(""));
        // Apart from the operator's: as before.
        let (new, added) = reserve_in("2000-2001", 30000, 32767).unwrap();
        assert_eq!((new.as_str(), added.as_str()), ("2000-2001,30000-32767", "30000-32767"));
        assert_eq!(unreserve_in(&new, &added).as_deref(), Some("2000-2001"));
        // Touching and inside: the kernel prints one range; the operator's
        // ports stay, lb's go.
        let (new, added) = reserve_in("29000-29999,31000-31010", 30000, 32767).unwrap();
        assert_eq!((new.as_str(), added.as_str()), ("29000-32767", "30000-30999,31011-32767"));
        assert_eq!(unreserve_in("29000-32767", &added).as_deref(), Some("29000-29999,31000-31010"));
        // Overlapping at both ends, single ports.
        let (_, added) = reserve_in("29990-30005,32767", 30000, 32767).unwrap();
        assert_eq!(added, "30006-32766");
        assert_eq!(unreserve_in("29990-32767", &added).as_deref(), Some("29990-30005,32767"));
        // Many pieces: markers of at most 200 bytes, which give back the whole.
        let holes: Vec<String> = (0..100).map(|i| (30001 + 20 * i).to_string()).collect();
        let (_, added) = reserve_in(&holes.join(","), 30000, 32767).unwrap();
        let pieces = marker_pieces(&added);
        assert!(pieces.len() > 1 && pieces.iter().all(|p| p.len() <= 200), "{pieces:?}");
        assert_eq!(pieces.join(","), added);
        let mut left = "30000-32767".to_string();
        for p in &pieces {
            left = unreserve_in(&left, p).unwrap();
        }
        assert_eq!(left, holes.join(","), "the operator's ports stay");
        // Already all reserved: nothing added, nothing recorded.
        assert_eq!(reserve_in("1-40000", 30000, 32767), None);
        // An older agent's marker (one range) reads the same.
        assert_eq!(unreserve_in("2000-2001,30000-32767", "30000-32767").as_deref(), Some("2000-2001"));
        // Not a port list.
        assert_eq!(reserve_in("30000-x", 30000, 32767), None);
        assert!(port_set("5-4").is_none() && port_set("70000").is_none());
        assert_eq!(port_list(&port_set(" 1, 3-4 ,65535").unwrap()), "1,3-4,65535");
    }

    #[test]
    fn a_sysctl_marker_names_the_netns_knob_value_and_device() {
        let name = sysctl_marker_name("4096", "rp_filter", "2", "eth0.100");
        assert_eq!(name, "sysctl:4096:rp_filter:2:eth0:100");
        assert!(!name.contains('.'), "bpffs refuses dots");
        let s = |v: &str| v.to_string();
        assert_eq!(sysctl_marker(&name), Some((s("4096"), s("rp_filter"), s("2"), s("eth0.100"))));
        assert_eq!(sysctl_marker("sysctl:4096:accept_local:0:eth0"), Some((s("4096"), s("accept_local"), s("0"), s("eth0"))));
        assert_eq!(sysctl_marker("sysctl:4096:rp_filter"), None);
        assert_eq!(sysctl_marker("reserved_ports_1_30000-32767"), None);
    }
}
