//! The network devices of the agent's network namespace, from rtnetlink,
//! and which of them carry traffic from outside the node.
use std::net::IpAddr;

use anyhow::{Context as _, Result};
use netlink_packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkLayerType, LinkMessage, LinkXdp, XdpAttached};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use crate::dataplane::maps::RouteMtus;

/// The driver's own statistics of `iface`, by name, as `ethtool -S` shows
/// them. Only the ethtool ioctl has these (ETHTOOL_GSTRINGS / GSTATS of the
/// ETH_SS_STATS set: netlink's ethtool stats carry the standard groups
/// only, not a driver's counters such as veth's XDP errors).
pub fn driver_stats(iface: &str) -> Result<Vec<(String, u64)>> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    const ETHTOOL_GSSET_INFO: u32 = 0x37;
    const ETHTOOL_GSTRINGS: u32 = 0x1b;
    const ETHTOOL_GSTATS: u32 = 0x1d;
    const ETH_SS_STATS: u32 = 1;
    const ETH_GSTRING_LEN: usize = 32;
    // SAFETY: a plain socket; owned (closed) below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    anyhow::ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: a valid fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let name = iface.as_bytes();
    anyhow::ensure!(name.len() < libc::IFNAMSIZ, "{iface}: name too long");
    // One ethtool command, its buffer passed by pointer in an ifreq.
    let call = |data: *mut libc::c_void| -> Result<()> {
        // SAFETY: a zeroed ifreq is valid; the name fits (checked above).
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in ifr.ifr_name.iter_mut().zip(name) {
            *d = *s as libc::c_char;
        }
        ifr.ifr_ifru.ifru_data = data.cast();
        // SAFETY: SIOCETHTOOL with an ifreq whose data points to a buffer
        // of the size its command says.
        if unsafe { libc::ioctl(fd.as_raw_fd(), SIOCETHTOOL, &mut ifr) } != 0 {
            anyhow::bail!("{iface}: ethtool: {}", std::io::Error::last_os_error());
        }
        Ok(())
    };
    #[repr(C)]
    struct SsetInfo {
        cmd: u32,
        reserved: u32,
        sset_mask: u64,
        data: [u32; 1],
    }
    let mut info = SsetInfo { cmd: ETHTOOL_GSSET_INFO, reserved: 0, sset_mask: 1 << ETH_SS_STATS, data: [0] };
    call((&mut info as *mut SsetInfo).cast())?;
    let n = info.data[0] as usize;
    // struct ethtool_gstrings { u32 cmd, string_set, len; u8 data[]; }
    let mut strings = vec![0u32; 3 + n * ETH_GSTRING_LEN / 4];
    (strings[0], strings[1], strings[2]) = (ETHTOOL_GSTRINGS, ETH_SS_STATS, n as u32);
    call(strings.as_mut_ptr().cast())?;
    // struct ethtool_stats { u32 cmd, n_stats; u64 data[]; }
    let mut stats = vec![0u64; 1 + n];
    stats[0] = u64::from_ne_bytes(bytemuck::cast([ETHTOOL_GSTATS, n as u32]));
    call(stats.as_mut_ptr().cast())?;
    let bytes: Vec<u8> = strings[3..].iter().flat_map(|w| w.to_ne_bytes()).collect();
    Ok(bytes
        .chunks(ETH_GSTRING_LEN)
        .zip(&stats[1..])
        .map(|(s, v)| (String::from_utf8_lossy(s.split(|b| *b == 0).next().unwrap_or_default()).into_owned(), *v))
        .collect())
}

/// A network device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub name: String,
    /// The rtnetlink kind ("vxlan", "veth", "bridge", ...); None for a
    /// physical device.
    pub kind: Option<String>,
    /// Enslaved to a bridge or a bond.
    pub has_master: bool,
    pub up: bool,
    pub loopback: bool,
    /// The kernel's index: a device removed and created again under the
    /// same name has a new one.
    pub ifindex: u32,
    /// An L3 device: its packets start with the IP header, no link-layer
    /// header (WireGuard and TUN: ARPHRD_NONE; IPIP, ip6tnl, SIT, GRE, raw IP).
    pub l3: bool,
    /// An XDP program runs on it in generic mode (after the skb is built).
    pub xdp_generic: bool,
}

/// Every device of this network namespace.
pub fn links() -> Result<Vec<Link>> {
    let mut out = Vec::new();
    dump(RouteNetlinkMessage::GetLink(LinkMessage::default()), |m| {
        if let RouteNetlinkMessage::NewLink(l) = m {
            out.push(link_of(&l));
        }
    })
    .context("rtnetlink link dump")?;
    Ok(out)
}

/// An rtnetlink dump: `request`, then each message of the answer to `each`.
fn dump(request: RouteNetlinkMessage, mut each: impl FnMut(RouteNetlinkMessage)) -> Result<()> {
    let mut sock = Socket::new(NETLINK_ROUTE).context("rtnetlink socket")?;
    sock.bind_auto().context("rtnetlink bind")?;
    sock.connect(&SocketAddr::new(0, 0)).context("rtnetlink connect")?;
    crate::stale::send(&sock, NLM_F_REQUEST | NLM_F_DUMP, request).context("rtnetlink")?;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = sock.recv(&mut &mut buf[..], 0).context("rtnetlink recv")?;
        let mut off = 0;
        while off < n {
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[off..n]).context("rtnetlink parse")?;
            let len = msg.header.length as usize;
            match msg.payload {
                NetlinkPayload::InnerMessage(m) => each(m),
                NetlinkPayload::Done(_) => return Ok(()),
                NetlinkPayload::Error(e) => anyhow::bail!("{e:?}"),
                _ => {}
            }
            if len == 0 {
                break;
            }
            off += len;
        }
    }
}

/// The routes of this network namespace's main table that set an MTU
/// (`ip route ... mtu N`), both families. The stack's forwarding honours
/// them (IPv4 in its forwarding check; IPv6 at output, where a forwarded
/// packet too big for the route's MTU gets "packet too big": measured by
/// `an_unlocked_route_mtu_is_honoured_as_the_stack_does`); the TC
/// programs' FIB lookup sees only locked ones, so the agent
/// gives them these (LB_ROUTE_MTU). Of two routes to one prefix (other
/// metrics), the smaller MTU; a multipath route's device is 0 (any).
pub fn route_mtus() -> Result<RouteMtus> {
    use netlink_packet_route::{AddressFamily, route::RouteMessage};
    let mut out = RouteMtus::new();
    for family in [AddressFamily::Inet, AddressFamily::Inet6] {
        let mut m = RouteMessage::default();
        m.header.address_family = family;
        dump(RouteNetlinkMessage::GetRoute(m), |m| {
            if let RouteNetlinkMessage::NewRoute(r) = m
                && let Some((dst, len, mtu, ifindex)) = route_mtu_of(&r)
            {
                let e = out.entry((dst, len)).or_insert((mtu, ifindex));
                if mtu < e.0 {
                    *e = (mtu, ifindex);
                }
            }
        })
        .context("rtnetlink route dump")?;
    }
    Ok(out)
}

/// (destination, prefix length, MTU, device) of a unicast route of the
/// main table that sets an MTU.
fn route_mtu_of(r: &netlink_packet_route::route::RouteMessage) -> Option<(IpAddr, u8, u32, u32)> {
    use netlink_packet_route::AddressFamily;
    use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteMetric, RouteType};
    if r.header.kind != RouteType::Unicast {
        return None;
    }
    let mut table = r.header.table as u32;
    let (mut dst, mut mtu, mut oif) = (None, None, 0);
    for a in &r.attributes {
        match a {
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Destination(RouteAddress::Inet(v4)) => dst = Some(IpAddr::V4(*v4)),
            RouteAttribute::Destination(RouteAddress::Inet6(v6)) => dst = Some(IpAddr::V6(*v6)),
            RouteAttribute::Oif(i) => oif = *i,
            RouteAttribute::Metrics(ms) => {
                for m in ms {
                    if let RouteMetric::Mtu(v) = m {
                        mtu = Some(*v);
                    }
                }
            }
            _ => {}
        }
    }
    if table != RouteHeader::RT_TABLE_MAIN as u32 {
        return None;
    }
    let mtu = mtu.filter(|m| *m > 0)?;
    // A default route has no destination attribute.
    let dst = match (dst, r.header.address_family) {
        (Some(d), _) => d,
        (None, AddressFamily::Inet6) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        (None, AddressFamily::Inet) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        (None, _) => return None,
    };
    Some((dst, r.header.destination_prefix_length, mtu, oif))
}

fn link_of(l: &LinkMessage) -> Link {
    let mut link = Link {
        name: String::new(),
        kind: None,
        has_master: false,
        up: l.header.flags.contains(LinkFlags::Up),
        loopback: l.header.flags.contains(LinkFlags::Loopback),
        ifindex: l.header.index,
        l3: matches!(
            l.header.link_layer_type,
            LinkLayerType::None
                | LinkLayerType::Tunnel
                | LinkLayerType::Tunnel6
                | LinkLayerType::Sit
                | LinkLayerType::Ipgre
                | LinkLayerType::Ip6gre
                | LinkLayerType::Rawip
        ),
        xdp_generic: false,
    };
    for a in &l.attributes {
        match a {
            LinkAttribute::IfName(n) => link.name = n.clone(),
            LinkAttribute::Controller(_) => link.has_master = true,
            LinkAttribute::Xdp(xdp) => {
                link.xdp_generic = xdp.iter().any(|x| matches!(x, LinkXdp::Attached(XdpAttached::SocketBuffer) | LinkXdp::SkbProgId(_)));
            }
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        link.kind = Some(kind_name(k));
                    }
                }
            }
            _ => {}
        }
    }
    link
}

fn kind_name(k: &InfoKind) -> String {
    match k {
        InfoKind::Vxlan => "vxlan".into(),
        InfoKind::Geneve => "geneve".into(),
        InfoKind::GreTap => "gretap".into(),
        InfoKind::GreTap6 => "ip6gretap".into(),
        InfoKind::Veth => "veth".into(),
        InfoKind::Bridge => "bridge".into(),
        InfoKind::Dummy => "dummy".into(),
        InfoKind::Vlan => "vlan".into(),
        InfoKind::Bond => "bond".into(),
        InfoKind::Team => "team".into(),
        InfoKind::MacVlan => "macvlan".into(),
        InfoKind::IpVlan => "ipvlan".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Whether traffic from outside the node may arrive on a device of this
/// kind: NICs (physical, VLAN, bond, team, macvlan, ipvlan) and the
/// Ethernet overlays (VXLAN, Geneve, GRETAP) that carry pod traffic between
/// nodes. Not pod-facing devices (veth, bridge), not dummies. (L3 tunnels
/// count by their link-layer type: `Link::l3`.)
fn outside_kind(kind: Option<&str>) -> bool {
    matches!(kind, None | Some("vlan" | "bond" | "team" | "macvlan" | "ipvlan" | "vxlan" | "geneve" | "gretap" | "ip6gretap"))
}

/// Where the TC programs go when no `--nodeport-interface` is given: every
/// device that holds one of the node's addresses (`node_addrs`), and every
/// other up device outside traffic or replies of SNATed flows may arrive
/// on: a NIC holding a global address, an Ethernet overlay, or an L3
/// tunnel holding an address (Calico's `tunl0` and `wireguard.cali`,
/// flannel's `flannel-wg`: replies to this node can come back through
/// them). Devices enslaved to a bridge or bond are left out (their master
/// is the device).
pub fn nodeport_devices(links: &[Link], addrs: &[(String, IpAddr)], node_addrs: &[IpAddr]) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for l in links {
        if l.loopback || !l.up || l.has_master {
            continue;
        }
        let holds_node_addr = addrs.iter().any(|(i, a)| *i == l.name && node_addrs.contains(a));
        let holds_addr = addrs.iter().any(|(i, _)| *i == l.name);
        let overlay = matches!(l.kind.as_deref(), Some("vxlan" | "geneve" | "gretap" | "ip6gretap"));
        if holds_node_addr || (outside_kind(l.kind.as_deref()) && (holds_addr || overlay)) || (l.l3 && holds_addr) {
            v.push(l.name.clone());
        }
    }
    v.sort();
    v.dedup();
    v
}

/// Where the pod program (`lb_pod_ingress`, with `--bpf-forward`) goes:
/// the host end of every pod's veth, routed (Calico's `cali*`, Cilium's
/// `lxc*`) or a bridge port (Flannel's and the bridge plugin's `veth*` on
/// `cni0`): every up veth that is not a NodePort device (`nodeport`; a
/// netns node's uplink is a veth too). Name and index.
pub fn pod_devices(links: &[Link], nodeport: &[String]) -> Vec<(String, u32)> {
    let mut v: Vec<(String, u32)> = links
        .iter()
        .filter(|l| l.up && !l.loopback && l.kind.as_deref() == Some("veth") && !nodeport.contains(&l.name))
        .map(|l| (l.name.clone(), l.ifindex))
        .collect();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(name: &str, kind: Option<&str>) -> Link {
        let l3 = matches!(kind, Some("ipip" | "wireguard" | "tun"));
        Link { name: name.into(), kind: kind.map(Into::into), has_master: false, up: true, loopback: false, ifindex: 7, l3, xdp_generic: false }
    }

    fn route(family: netlink_packet_route::AddressFamily, table: u8, len: u8, attrs: Vec<netlink_packet_route::route::RouteAttribute>) -> netlink_packet_route::route::RouteMessage {
        use netlink_packet_route::route::{RouteMessage, RouteType};
        let mut r = RouteMessage::default();
        r.header.address_family = family;
        r.header.table = table;
        r.header.kind = RouteType::Unicast;
        r.header.destination_prefix_length = len;
        r.attributes = attrs;
        r
    }

    #[test]
    fn routes_that_set_an_mtu_are_read_from_the_main_table() {
        use netlink_packet_route::AddressFamily::{Inet, Inet6};
        use netlink_packet_route::route::{RouteAddress as RA, RouteAttribute as A, RouteMetric as M, RouteType};
        let v4: std::net::Ipv4Addr = "10.244.1.0".parse().unwrap();
        let v6: std::net::Ipv6Addr = "fd00:244::".parse().unwrap();
        let r = route(Inet, 254, 24, vec![A::Destination(RA::Inet(v4)), A::Oif(3), A::Metrics(vec![M::Mtu(1300)])]);
        assert_eq!(route_mtu_of(&r), Some((IpAddr::V4(v4), 24, 1300, 3)));
        // A locked MTU too (harmless: the FIB lookup sees it anyway).
        let r = route(Inet6, 254, 64, vec![A::Destination(RA::Inet6(v6)), A::Metrics(vec![M::Lock(1 << 2), M::Mtu(1280)])]);
        assert_eq!(route_mtu_of(&r), Some((IpAddr::V6(v6), 64, 1280, 0)), "multipath or no device: any device");
        // The table as an attribute (tables above 255).
        let r = route(Inet, 0, 24, vec![A::Table(254), A::Destination(RA::Inet(v4)), A::Metrics(vec![M::Mtu(1400)])]);
        assert_eq!(route_mtu_of(&r).map(|r| r.2), Some(1400));
        // A default route has no destination.
        let r = route(Inet, 254, 0, vec![A::Oif(2), A::Metrics(vec![M::Mtu(1400)])]);
        assert_eq!(route_mtu_of(&r), Some((IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0, 1400, 2)));
        // Not ours: no MTU, another table, a local route.
        assert_eq!(route_mtu_of(&route(Inet, 254, 24, vec![A::Destination(RA::Inet(v4)), A::Metrics(vec![M::Advmss(1200)])])), None);
        assert_eq!(route_mtu_of(&route(Inet, 100, 24, vec![A::Destination(RA::Inet(v4)), A::Metrics(vec![M::Mtu(1300)])])), None);
        let mut local = route(Inet, 254, 32, vec![A::Destination(RA::Inet(v4)), A::Metrics(vec![M::Mtu(1300)])]);
        local.header.kind = RouteType::Local;
        assert_eq!(route_mtu_of(&local), None);
    }

    #[test]
    fn nodeport_devices_are_nics_overlays_and_the_node_address_holders() {
        let node: IpAddr = "192.168.77.11".parse().unwrap();
        let links = vec![
            Link { loopback: true, ..link("lo", None) },
            link("eth0", Some("veth")),
            link("eth1", None),
            link("eth2", None),
            link("cni0", Some("bridge")),
            Link { has_master: true, ..link("v10", Some("veth")) },
            link("vx0", Some("vxlan")),
            link("tunl0", Some("ipip")),
            link("wg0", Some("wireguard")),
            link("tun9", Some("tun")),
            link("kube-ipvs0", Some("dummy")),
            Link { up: false, ..link("eth3", None) },
            Link { has_master: true, ..link("eth4", None) },
            link("bond0", Some("bond")),
        ];
        let addrs = vec![
            ("lo".to_string(), "127.0.0.1".parse().unwrap()),
            ("eth0".to_string(), node),
            ("eth1".to_string(), "10.0.0.5".parse().unwrap()),
            ("cni0".to_string(), "10.244.1.1".parse().unwrap()),
            ("kube-ipvs0".to_string(), "10.96.0.10".parse().unwrap()),
            ("tunl0".to_string(), "10.244.1.0".parse().unwrap()),
            ("bond0".to_string(), "10.1.0.5".parse().unwrap()),
        ];
        // eth0: a veth, but it holds the node address (a netns node); eth1
        // and bond0: NICs with addresses; vx0: an overlay; tunl0: an L3
        // tunnel with an address. Not: eth2 (no address), the bridge,
        // bridge ports, the dummy, an L3 device without an address (wg0
        // here), a down device, a bond slave.
        assert_eq!(nodeport_devices(&links, &addrs, &[node]), ["bond0", "eth0", "eth1", "tunl0", "vx0"]);
    }

    #[test]
    fn pod_devices_are_the_veths_that_carry_no_node_port() {
        let links = vec![
            Link { loopback: true, ..link("lo", None) },
            Link { ifindex: 2, ..link("eth0", Some("veth")) },
            link("eth1", None),
            link("cni0", Some("bridge")),
            Link { has_master: true, ifindex: 10, ..link("veth10", Some("veth")) },
            Link { ifindex: 11, ..link("cali11", Some("veth")) },
            Link { up: false, ..link("cali12", Some("veth")) },
            link("vx0", Some("vxlan")),
            link("lb-dummy", Some("dummy")),
        ];
        // eth0 is the node's uplink (a NodePort device); a bridge port and a
        // routed veth are pod devices; a down veth, the bridge itself, NICs,
        // overlays and dummies are not.
        let nodeport = ["eth0".to_string(), "eth1".to_string(), "vx0".to_string()];
        assert_eq!(pod_devices(&links, &nodeport), [("cali11".to_string(), 11), ("veth10".to_string(), 10)]);
        assert_eq!(pod_devices(&links, &[]).len(), 3, "without NodePort devices the uplink veth counts");
    }

    #[test]
    fn links_lists_this_namespaces_devices() {
        let l = links().expect("rtnetlink dump");
        assert!(l.iter().any(|l| l.loopback && l.name == "lo" && !l.l3), "{l:?}");
    }
}
