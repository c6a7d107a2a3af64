//! lb-agent: a kube-proxy replacement that balances Service traffic at the
//! socket with cgroup BPF programs.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

mod agent;
mod conntrack;
mod dataplane;
mod health;
mod firewall;
mod kube_proxy;
mod kube_proxy_config;
mod model;
mod monitor;
mod netdev;
mod nodeport;
mod policy_engines;
mod source;
mod stale;

use dataplane::{inspect, loader, maps::Maps};

#[derive(Parser)]
#[command(name = "lb-agent", version, about = "Socket-level Service load balancer (kube-proxy replacement)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
// Parsed once at start: the size of the `run` variant does not matter.
#[allow(clippy::large_enum_variant)]
enum Cmd {
    /// Load and attach the programs, then program the maps from a source.
    Run {
        /// Where objects come from: kube (the API server) or dir:PATH (a
        /// directory of YAML/JSON files).
        #[arg(long, default_value = "kube")]
        source: String,
        /// kubeconfig for the kube source. Default: $KUBECONFIG, ~/.kube/config, then in-cluster.
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// kube-proxy's configuration file (KubeProxyConfiguration, the
        /// config.conf of kubeadm's kube-proxy ConfigMap): its settings
        /// become lb's flags of the same meaning (a flag given here wins).
        #[arg(long)]
        kube_proxy_config: Option<PathBuf>,
        /// TCP keepalive on the API server connections: a connection that
        /// answers no probe for this long plus 3 probes (a fifth of it
        /// apart, at least 1 s) is closed, and the watches start again
        /// (client-go notices a dead server in about 45 s by HTTP/2
        /// pings); 0 turns it off (the watch then ends only at its 290 s
        /// timeout).
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        api_keepalive: std::time::Duration,
        /// Serve /healthz and /livez here ("" to disable).
        #[arg(long, default_value = "0.0.0.0:10256")]
        healthz_bind: String,
        /// Serve /metrics here ("" to disable). Loopback only by default,
        /// as kube-proxy's metricsBindAddress.
        #[arg(long, default_value = "127.0.0.1:10249")]
        metrics_bind: String,
        /// Re-read the maps this often and write back what differs from
        /// what the agent programmed (an entry deleted or changed by hand),
        /// like kube-proxy's periodic sync; 0 turns it off.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        resync_period: std::time::Duration,
        /// /healthz turns 503 when a change waits longer than this many
        /// seconds. Default: twice --resync-period, as kube-proxy's is
        /// twice its syncPeriod (60 with the defaults, and where
        /// --resync-period is 0).
        #[arg(long)]
        healthz_stall_seconds: Option<u64>,
        /// This node's name (matches EndpointSlice nodeName). Default: $NODE_NAME, else the hostname;
        /// trimmed and lowercased, as kube-proxy and kubelet take it.
        #[arg(long, env = "NODE_NAME")]
        node_name: Option<String>,
        /// This node's zone, for topology hints. Default: the Node object's
        /// topology.kubernetes.io/zone label.
        #[arg(long)]
        zone: Option<String>,
        /// The cgroup v2 directory to attach to. Default: the cgroup v2 root.
        #[arg(long)]
        cgroup: Option<PathBuf>,
        /// bpffs directory for this agent's pins.
        #[arg(long, default_value = "/sys/fs/bpf/lb")]
        bpffs: PathBuf,
        /// Capacity of the services map (frontend and slot entries).
        #[arg(long, default_value_t = lb_common::capacity::SERVICES)]
        max_services: u32,
        /// Capacity of the backends map.
        #[arg(long, default_value_t = lb_common::capacity::BACKENDS)]
        max_backends: u32,
        /// Capacity of the socket reverse-translation LRU map.
        #[arg(long, default_value_t = lb_common::capacity::SOCK_REVNAT)]
        max_sock_revnat: u32,
        /// Capacity of each NAT table (IPv4, IPv6) for outside traffic, in
        /// entries (two per flow). A full table refuses new flows (counted
        /// as nat_failed, and logged), as conntrack does, and the agent
        /// then drops its unassured flows idle for a second every second
        /// until it is no longer under pressure (conntrack's early drop).
        #[arg(long, default_value_t = lb_common::capacity::NAT)]
        max_nat: u32,
        /// This node's primary address (repeatable, both families): where
        /// SNAT falls back to, and `--nodeport-addresses primary`. Default:
        /// the Node object's InternalIP then ExternalIP addresses, else the
        /// interfaces'.
        #[arg(long = "node-ip")]
        node_ips: Vec<std::net::IpAddr>,
        /// The node addresses NodePorts are on, as kube-proxy's flag: CIDRs
        /// (comma-separated or repeated), a family without one keeping all
        /// its addresses; or `primary` (the first primary address of each
        /// family). Default: every address of the node (kube-proxy's
        /// iptables mode).
        #[arg(long = "nodeport-addresses", value_delimiter = ',')]
        nodeport_addresses: Vec<String>,
        /// Interface to handle NodePort/LoadBalancer/externalIP traffic on
        /// (repeatable). Default: the devices that hold the node's
        /// addresses, every other NIC with an address (a second NIC), and
        /// every Ethernet overlay (VXLAN, Geneve, GRETAP), where replies of
        /// SNATed flows may arrive. Pod devices (veth, bridge) are left out.
        #[arg(long = "nodeport-interface")]
        nodeport_interfaces: Vec<String>,
        /// How the TC programs attach: tcx (bpf_link, kernel 6.6+), netlink
        /// (a clsact qdisc and filters, any kernel), or auto (tcx where the
        /// kernel has it).
        #[arg(long, default_value = "auto", value_parser = ["auto", "tcx", "netlink"])]
        tc_attach: String,
        /// The NodePort range, kept out of local ephemeral ports.
        #[arg(long, default_value = "30000-32767")]
        nodeport_range: String,
        /// Source ports for SNATed outside flows: below the NodePort range
        /// and outside the kernel's ephemeral range (32768-60999 by default),
        /// so they never collide with the node's own connections. Each
        /// backend can take this many flows through one node at once.
        #[arg(long, default_value = "1024-29999")]
        snat_ports: String,
        /// Forward translated outside traffic in BPF: a FIB lookup and a
        /// redirect to the egress device after translation, skipping the
        /// stack's routing, netfilter FORWARD and neighbour output (TTL
        /// decremented as a router does). Packets the lookup cannot place
        /// (local delivery, no route, too big) still go through the stack.
        /// The replies of backends on this node are forwarded from a TC
        /// program on each pod device (every veth that is not a NodePort
        /// interface). `--bpf-forward=false` is the default.
        #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
        bpf_forward: bool,
        /// Run the NodePort / LoadBalancer IP / externalIP path at XDP too
        /// (xdp): packets of established SNATed flows are translated and
        /// sent back out of the interface they came in on (XDP_TX) before
        /// the kernel builds an skb; everything else goes on to the TC
        /// programs. Native XDP where the driver has it (veth included),
        /// generic otherwise (logged). Needs the complete checksums a NIC
        /// receives (see README, "XDP acceleration").
        #[arg(long, default_value = "none", value_parser = ["none", "xdp"])]
        nodeport_acceleration: String,
        /// How a new outside flow (NodePort, LoadBalancer IP, externalIP)
        /// picks its backend: random (as kube-proxy), or maglev (consistent
        /// hashing: every node picks the same backend for a flow, so a flow
        /// an upstream router moves to another node keeps it). A Service's
        /// annotation lb.dev/nodeport-algorithm overrides it.
        #[arg(long, default_value = "random", value_parser = ["random", "maglev"])]
        nodeport_algorithm: String,
        /// Entries in each Maglev table: a prime between 251 and 131071;
        /// about 100 times the largest backend count or more. Each table
        /// takes 4 bytes per entry in kernel memory.
        #[arg(long, default_value_t = model::maglev::DEFAULT_SIZE)]
        maglev_table_size: u32,
        /// Seed of the Maglev hashes: the same on every node of a cluster
        /// (nodes with another seed pick other backends).
        #[arg(long, default_value = "lb")]
        maglev_seed: String,
        /// How outside traffic (externalTrafficPolicy Cluster) reaches a
        /// backend on another node: snat (to this node's address, so the
        /// replies come back here, as kube-proxy does) or dsr (direct server
        /// return: the pod sees the client's address and its node,
        /// which must run lb too, answers the client directly). A Service's
        /// annotation lb.dev/nodeport-mode overrides it.
        #[arg(long, default_value = "snat", value_parser = ["snat", "dsr"])]
        nodeport_mode: String,
        /// Translate in-cluster connects to externalIPs too (kube-proxy does;
        /// see CVE-2020-8554). false: only traffic from outside is translated.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        external_ip_socket_lb: bool,
        /// Serve ClusterIPs routed to the node from outside (a router
        /// advertising the Service CIDR: Calico's serviceClusterIPs, BGP),
        /// as kube-proxy does; backends on other nodes are SNATed. false:
        /// such packets go on to the stack untouched (Cilium's default).
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        external_cluster_ip: bool,
        /// Translate, at each pod's device, the packets pods send to Service
        /// addresses that no socket hook saw: a VM's or a sandbox's own
        /// kernel sends them (KubeVirt, Kata Containers, gVisor), as
        /// kube-proxy's PREROUTING rules serve them; their replies are
        /// translated on the way back into the pod. Costs a map lookup per
        /// packet pods send and receive. false (the default): only what
        /// the node's sockets connect to is translated (Cilium too, unless
        /// told socketLB.hostNamespaceOnly).
        #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
        per_packet_lb: bool,
        /// NodePorts also on 127.0.0.1 for the node's own connections (the
        /// host network namespace; a pod's 127.0.0.1 stays its own), as
        /// kube-proxy's iptables mode has them
        /// (--iptables-localhost-nodeports, IPv4 only), where
        /// --nodeport-addresses admits 127.0.0.1.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        localhost_nodeports: bool,
        /// NAT: seconds an idle established TCP flow is kept (1 day: the
        /// conntrack timeout kube-proxy sets, --conntrack-tcp-timeout-established).
        #[arg(long, default_value_t = 86400)]
        nat_tcp_timeout: u64,
        /// NAT: seconds a TCP flow is kept after FIN both ways or RST.
        #[arg(long, default_value_t = 10)]
        nat_tcp_close_timeout: u64,
        /// NAT: seconds a DSR flow is kept idle on its frontend's node
        /// after the client's FIN (that node never sees the backend's, so
        /// the flow may still be half open there: the backend sending).
        /// Conntrack's FIN_WAIT and TIME_WAIT timeouts are 120 s.
        #[arg(long, default_value_t = 120)]
        nat_dsr_fin_timeout: u64,
        /// NAT: seconds an idle UDP flow is kept (the kernel's
        /// nf_conntrack_udp_timeout_stream, which kube-proxy leaves alone).
        #[arg(long, default_value_t = 120)]
        nat_udp_timeout: u64,
        /// NAT: seconds a flow that was never answered is kept (a SYN
        /// flood cannot fill the table for longer).
        #[arg(long, default_value_t = 60)]
        nat_unreplied_timeout: u64,
        /// NAT: seconds between expiry scans.
        #[arg(long, default_value_t = 5)]
        nat_gc_interval: u64,
        /// Destroy connected sockets whose backend left its Service, so
        /// clients fail fast instead of sending into a black hole.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        destroy_stale_sockets: bool,
        /// Look for kube-proxy's rules on the node (kube-proxy still
        /// running, or its rules left behind) at start and then this often;
        /// what is found is warned about and exported as
        /// lb_kube_proxy_rules{mode}. With --bpf-forward, also for
        /// NetworkPolicy enforced in netfilter, which it bypasses
        /// (lb_bpf_forward_policy_bypassed{engine}). 0 turns it off.
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        kube_proxy_check_period: std::time::Duration,
        /// Where the node's iptables FORWARD chain may drop forwarded
        /// traffic (a DROP policy or rules: Docker, ufw, a hardened node),
        /// accept what lb translates and forwards through the stack, as
        /// kube-proxy's KUBE-FORWARD does: `iptables` keeps a jump to
        /// LB-FORWARD first in FORWARD (legacy and nft, both families),
        /// accepting --forward-mark-bit; `none` sets no mark and removes
        /// those rules.
        #[arg(long, default_value = "iptables", value_parser = ["iptables", "none"])]
        forward_accept: String,
        /// The skb mark bit (0-31) the TC programs set on what they hand to
        /// the stack to forward (kube-proxy uses 14 and 15, Calico 16-31).
        #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u32).range(0..32))]
        forward_mark_bit: u32,
        /// Where conntrack runs on the node (Docker, a firewall, rules that
        /// drop INVALID packets), exempt lb's SNATed and DSR flows from it:
        /// conntrack sees only half of such a flow in each tuple (lb
        /// translates the replies first) and calls the rest INVALID.
        /// `auto` adds the nftables table `inet lb` (notrack for
        /// --notrack-mark-bit) once conntrack holds entries; `none` sets no
        /// mark and removes that table.
        #[arg(long, default_value = "auto", value_parser = ["auto", "none"])]
        notrack: String,
        /// The skb mark bit (0-31) set on the packets of SNATed and DSR flows
        /// for that rule (besides --forward-mark-bit).
        #[arg(long, default_value_t = 13, value_parser = clap::value_parser!(u32).range(0..32))]
        notrack_mark_bit: u32,
        /// Outside flows of externalTrafficPolicy Cluster Services (NodePort,
        /// LB IP, externalIP, a ClusterIP routed in) that go to a backend on
        /// this node are masqueraded to the node's address, as kube-proxy's
        /// KUBE-EXT-* chains masquerade every outside flow of such a Service
        /// (flows to other nodes are SNATed in BPF either way): `nftables`
        /// marks their packets (--masquerade-mark-bit) and adds a nat
        /// postrouting chain to the nftables table `inet lb` (`masquerade
        /// fully-random`, kube-proxy's --random-fully), so conntrack runs
        /// on the node. `none` keeps the client's address at local backends
        /// (Cilium's behaviour; beyond kube-proxy) and removes that chain.
        #[arg(long, default_value = "nftables", value_parser = ["nftables", "none"])]
        local_masquerade: String,
        /// The skb mark bit (0-31) set on the packets --local-masquerade
        /// masquerades (kube-proxy's masquerade mark is bit 14: 0x4000).
        #[arg(long, default_value_t = 11, value_parser = clap::value_parser!(u32).range(0..32))]
        masquerade_mark_bit: u32,
        #[command(flatten)]
        conntrack: conntrack::Args,
        /// How often the FORWARD chains (and conntrack) are looked at (lb's rules put back
        /// where something removed them, or where a firewall came later).
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        forward_accept_period: std::time::Duration,
        /// Export each frontend's and backend's counters in /metrics
        /// (lb_frontend_*, lb_backend_*; one series per frontend and
        /// backend, so off by default).
        #[arg(long)]
        metrics_per_service: bool,
        /// Log the programs' decisions (aya-log) at this level into the
        /// agent's log: `debug` gives one line per connect and new flow.
        /// Off costs nothing: the records are removed when the programs load.
        #[arg(long, value_enum, default_value_t = dataplane::loader::BpfLog::Off)]
        bpf_log: dataplane::loader::BpfLog,
    },
    /// A live stream of the programs' decisions, one line each: time, hook,
    /// client (netns cookie, or address on the TC path), frontend, backend
    /// or errno, and why. Costs nothing while no monitor runs; up to 4 at once.
    Monitor {
        #[arg(long, default_value = "/sys/fs/bpf/lb")]
        bpffs: PathBuf,
        /// Only this Service's frontends (NAMESPACE/NAME); needs the agent's
        /// /frontends (see --agent).
        #[arg(long)]
        service: Option<String>,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// The agent's metrics address, for Service names.
        #[arg(long, default_value = "127.0.0.1:10249")]
        agent: String,
        /// Stop after this many seconds (default: run until SIGINT/SIGTERM).
        #[arg(long)]
        seconds: Option<u64>,
    },
    /// Print the NAT table of outside flows, like `conntrack -L`.
    Nat {
        #[arg(long, default_value = "/sys/fs/bpf/lb")]
        bpffs: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Print the programmed services from the pinned maps (works without an agent).
    List {
        #[arg(long, default_value = "/sys/fs/bpf/lb")]
        bpffs: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// With each frontend's and backend's counters, like `ipvsadm -L
        /// --stats`: connections, refusals by reason, TC packets and bytes.
        #[arg(long)]
        stats: bool,
    },
    /// Detach the programs, unpin every map, and remove lb's FORWARD rules
    /// (`--forward-accept`) and nftables table (`--notrack`).
    Teardown {
        #[arg(long, default_value = "/sys/fs/bpf/lb")]
        bpffs: PathBuf,
        /// How long to wait for an agent still running with these pins
        /// (its pod terminating) to exit; past that, nothing is removed.
        #[arg(long, default_value_t = 60)]
        wait_seconds: u64,
    },
    /// Remove kube-proxy's rules from this node, as `kube-proxy --cleanup`
    /// does: its iptables chains (legacy and nft, both families; the
    /// jumps to them first), its nftables tables and IPVS mode's
    /// kube-ipvs0 device. kubelet's chains and everything else stay.
    CleanupKubeProxy {
        /// Print what would be removed, change nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

fn port_range(flag: &str, s: &str) -> anyhow::Result<(u16, u16)> {
    let (a, b) = s.split_once('-').ok_or_else(|| anyhow::anyhow!("{flag} {s:?}: want MIN-MAX"))?;
    let (a, b): (u16, u16) = (
        a.trim().parse().map_err(|e| anyhow::anyhow!("{flag} {s:?}: {e}"))?,
        b.trim().parse().map_err(|e| anyhow::anyhow!("{flag} {s:?}: {e}"))?,
    );
    if a == 0 || a > b {
        anyhow::bail!("{flag} {s:?}: want 1 <= MIN <= MAX");
    }
    Ok((a, b))
}

/// A warning when the SNAT ports overlap the kernel's ephemeral ports
/// (`ip_local_port_range`'s contents) outside the ports reserved from them
/// (`ip_local_reserved_ports`'s: "8080,9000-9100", or empty): a
/// connection of the node's own to a backend from such a port can have the
/// tuple of a SNATed flow, and lose its replies to it. Reserving the SNAT
/// range there is the other cure, so a range the reserved ports cover is
/// no overlap.
fn snat_overlaps_ephemeral(snat: (u16, u16), range: &str, reserved: &str) -> Option<String> {
    let mut it = range.split_whitespace().map(|p| p.parse::<u16>().ok());
    let (lo, hi) = (it.next()??, it.next()??);
    let (from, to) = (snat.0.max(lo), snat.1.min(hi));
    if from > to {
        return None;
    }
    let reserved: Vec<(u16, u16)> = reserved
        .trim()
        .split(',')
        .filter_map(|r| {
            let r = r.trim();
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
        })
        .collect();
    let open = (from..=to).filter(|p| !reserved.iter().any(|(a, b)| (a..=b).contains(&p))).count();
    (open > 0).then(|| {
        format!(
            "--snat-ports {}-{} overlaps the kernel's ephemeral ports (net.ipv4.ip_local_port_range {lo} {hi}) in {open} \
             port(s) not in net.ipv4.ip_local_reserved_ports: a connection the node makes to a backend from one of those \
             ports can have the tuple of a SNATed flow and lose its replies to it; narrow --snat-ports or the range so that \
             they are apart, or reserve --snat-ports in ip_local_reserved_ports",
            snat.0, snat.1
        )
    })
}

/// Raise the soft open-file limit to the hard one, as Go's runtime does
/// for kube-proxy and Cilium: a container's soft limit is often 1,024
/// (containerd 2 no longer raises it), and a sync of thousands of Maglev
/// tables, or many pinned maps and sockets, holds more descriptors.
fn raise_open_files() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain system calls on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            let soft = lim.rlim_cur;
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                tracing::warn!("cannot raise the open-file limit from {soft} to {}: {}", lim.rlim_max, std::io::Error::last_os_error());
            }
        }
    }
}

/// How long a change may wait before /healthz fails: `--healthz-stall-seconds`,
/// else twice the resync period (kube-proxy's healthz timeout is twice its
/// syncPeriod), else 60 s.
fn stall_after(flag: Option<u64>, resync: std::time::Duration) -> std::time::Duration {
    match flag {
        Some(s) => std::time::Duration::from_secs(s),
        None if resync.is_zero() => std::time::Duration::from_secs(60),
        None => resync * 2,
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default()
}

/// The node's name as kube-proxy takes it (`GetHostname`): `--node-name`
/// or the hostname, trimmed and lowercased, as kubelet names its Node. An
/// empty one is an error: no endpoint would ever be local.
fn node_name(flag: Option<String>) -> anyhow::Result<String> {
    let name = flag.unwrap_or_else(hostname).trim().to_lowercase();
    anyhow::ensure!(!name.is_empty(), "--node-name: empty, and so is the hostname");
    Ok(name)
}

fn main() -> ExitCode {
    // Large temporary buffers (a file's text, a full sync's list of writes)
    // come from mmap and go back to the system when freed. glibc otherwise
    // raises this threshold after the first such free, and later ones land
    // between long-lived objects, which keeps the heap large for good.
    // SAFETY: mallopt only sets a glibc tunable, before any thread starts.
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = match kube_proxy_config::expand(std::env::args_os().collect()) {
        Ok(args) => Cli::parse_from(args),
        Err(e) => {
            eprintln!("lb-agent: {e:#}");
            return ExitCode::from(2);
        }
    };
    match real_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lb-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Run {
            source,
            kubeconfig,
            // Read before the command line is parsed (kube_proxy_config::expand).
            kube_proxy_config: _,
            api_keepalive,
            healthz_bind,
            metrics_bind,
            healthz_stall_seconds,
            resync_period,
            node_name: node_name_flag,
            zone,
            cgroup,
            bpffs,
            max_services,
            max_backends,
            max_sock_revnat,
            max_nat,
            node_ips,
            nodeport_addresses,
            nodeport_interfaces,
            tc_attach,
            nodeport_range,
            snat_ports,
            bpf_forward,
            nodeport_acceleration,
            nodeport_algorithm,
            maglev_table_size,
            maglev_seed,
            nodeport_mode,
            external_ip_socket_lb,
            external_cluster_ip,
            per_packet_lb,
            localhost_nodeports,
            nat_tcp_timeout,
            nat_tcp_close_timeout,
            nat_dsr_fin_timeout,
            nat_udp_timeout,
            nat_unreplied_timeout,
            nat_gc_interval,
            destroy_stale_sockets,
            kube_proxy_check_period,
            forward_accept,
            forward_mark_bit,
            forward_accept_period,
            notrack,
            notrack_mark_bit,
            local_masquerade,
            masquerade_mark_bit,
            conntrack,
            metrics_per_service,
            bpf_log,
        } => {
            loader::check_root()?;
            loader::check_kernel()?;
            loader::check_caps()?;
            let source: source::SourceSpec = source.parse().map_err(|e| anyhow::anyhow!("--source: {e}"))?;
            let cgroup = match cgroup {
                Some(c) => c,
                None => {
                    let root = loader::cgroup2_root()?;
                    // Only a cgroup below the hierarchy's root has
                    // cgroup.type: in a container with a cgroup namespace of
                    // its own, the mount is the container's cgroup, and lb
                    // would balance only the processes in it.
                    if root.join("cgroup.type").exists() {
                        tracing::warn!(
                            cgroup = %root.display(),
                            "--cgroup not given and the cgroup v2 mount here is not the hierarchy's root (a container's cgroup \
                             namespace?): only processes in it are balanced. For the whole node pass --cgroup with the host's \
                             cgroup v2 root (the DaemonSet mounts it at /run/lb/cgroupv2)"
                        );
                    }
                    root
                }
            };
            let bind = |flag: &str, v: &str| -> anyhow::Result<Option<std::net::SocketAddr>> {
                if v.is_empty() {
                    return Ok(None);
                }
                v.parse().map(Some).map_err(|e| anyhow::anyhow!("{flag} {v:?}: {e}"))
            };
            anyhow::ensure!(
                forward_accept == "none" || notrack == "none" || forward_mark_bit != notrack_mark_bit,
                "--notrack-mark-bit {notrack_mark_bit}: the same bit as --forward-mark-bit; give each its own"
            );
            for (on, flag, bit) in [(forward_accept == "iptables", "--forward-mark-bit", forward_mark_bit), (notrack == "auto", "--notrack-mark-bit", notrack_mark_bit)] {
                anyhow::ensure!(
                    local_masquerade == "none" || !on || bit != masquerade_mark_bit,
                    "--masquerade-mark-bit {masquerade_mark_bit}: the same bit as {flag}; give each its own"
                );
            }
            anyhow::ensure!(!forward_accept_period.is_zero(), "--forward-accept-period: must be more than 0 (--forward-accept none turns lb's FORWARD rules off)");
            raise_open_files();
            let snat_range = port_range("--snat-ports", &snat_ports)?;
            let sysctl = |name: &str| std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}")).ok();
            let reserved = sysctl("ip_local_reserved_ports").unwrap_or_default();
            if let Some(w) = sysctl("ip_local_port_range").and_then(|r| snat_overlaps_ephemeral(snat_range, &r, &reserved)) {
                tracing::warn!("{w}");
            }
            let cfg = agent::RunConfig {
                source,
                kubeconfig,
                api_keepalive,
                healthz_bind: bind("--healthz-bind", &healthz_bind)?,
                metrics_bind: bind("--metrics-bind", &metrics_bind)?,
                stall_after: stall_after(healthz_stall_seconds, resync_period),
                resync_period,
                node_name: node_name(node_name_flag)?,
                zone,
                cgroup,
                bpffs,
                capacity: loader::Capacity {
                    services: max_services,
                    backends: max_backends,
                    sock_revnat: max_sock_revnat,
                    nat: max_nat,
                },
                node_ips,
                nodeport_addresses: model::NodePortAddresses::parse(&nodeport_addresses).map_err(anyhow::Error::msg)?,
                localhost_nodeports,
                nodeport_interfaces,
                tc_attach: match tc_attach.as_str() {
                    "tcx" => loader::TcAttach::Tcx,
                    "netlink" => loader::TcAttach::Netlink,
                    _ => loader::TcAttach::Auto,
                },
                xdp: nodeport_acceleration == "xdp",
                nodeport_range: port_range("--nodeport-range", &nodeport_range)?,
                snat_ports: snat_range,
                node_flags: if bpf_forward { lb_common::node_flags::BPF_FORWARD } else { 0 }
                    | if external_cluster_ip { lb_common::node_flags::EXTERNAL_CLUSTER_IP } else { 0 }
                    | if per_packet_lb { lb_common::node_flags::POD_PACKET_LB } else { 0 }
                    | if forward_accept == "iptables" { lb_common::node_flags::fwd_mark(forward_mark_bit) } else { 0 }
                    | if notrack == "auto" { lb_common::node_flags::notrack_mark(notrack_mark_bit) } else { 0 }
                    | if local_masquerade == "nftables" { lb_common::node_flags::masq_mark(masquerade_mark_bit) } else { 0 },
                forward_accept_period,
                conntrack,
                maglev: model::maglev::Maglev::new(maglev_table_size, &maglev_seed)
                    .map_err(|e| anyhow::anyhow!("--maglev-table-size: {e}"))?,
                nat_timeouts: nodeport::NatTimeouts {
                    tcp: Duration::from_secs(nat_tcp_timeout),
                    tcp_closed: Duration::from_secs(nat_tcp_close_timeout),
                    dsr_fin: Duration::from_secs(nat_dsr_fin_timeout),
                    udp: Duration::from_secs(nat_udp_timeout),
                    unreplied: Duration::from_secs(nat_unreplied_timeout),
                },
                nat_gc_interval: Duration::from_secs(nat_gc_interval.max(1)),
                model: model::Options {
                    external_ip_socket: external_ip_socket_lb,
                    nodeport_algorithm: nodeport_algorithm.parse().map_err(|e| anyhow::anyhow!("--nodeport-algorithm: {e}"))?,
                    nodeport_mode: nodeport_mode.parse().map_err(|e| anyhow::anyhow!("--nodeport-mode: {e}"))?,
                },
                destroy_stale_sockets,
                kube_proxy_check_period,
                metrics_per_service,
                bpf_log,
            };
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(agent::run(cfg))
        }
        Cmd::List { bpffs, json, stats } => {
            loader::check_root()?;
            loader::check_bpffs(&bpffs)?;
            if !bpffs.join(lb_common::maps::SERVICES4).exists() {
                anyhow::bail!("nothing is pinned under {}: is an agent running with --bpffs {0}?", bpffs.display());
            }
            let maps = Maps::open_pinned(&bpffs)?;
            let (t4, t6) = (maps.v4.read_table(&maps.affinity_match, &maps.src_range)?, maps.v6.read_table(&maps.affinity_match, &maps.src_range)?);
            // Counters of either layout: an older agent's pins may hold the
            // narrower one.
            let svc_stats = stats
                .then(|| {
                    dataplane::maps::read_svc_stats_pin(&dataplane::loader::pin_path(&bpffs, lb_common::maps::SVC_STATS))
                        .map(|v| v.into_iter().collect::<std::collections::BTreeMap<_, _>>())
                })
                .transpose()?;
            let mut v = inspect::view(&t4, &t6, maps.read_stats()?, svc_stats.as_ref());
            // Maglev frontends: their tables (scope "all") as the kernel holds them.
            let tables4 = dataplane::maglev::read_tables(&bpffs, lb_common::maps::MAGLEV4)?;
            let tables6 = dataplane::maglev::read_tables(&bpffs, lb_common::maps::MAGLEV6)?;
            for f in v.frontends.iter_mut().filter(|f| f.flags.contains(&"maglev")) {
                let key = lb_common::MaglevKey {
                    rev_nat_id: f.rev_nat_id,
                    proto: if f.protocol == "TCP" { lb_common::PROTO_TCP } else { lb_common::PROTO_UDP },
                    scope: lb_common::SCOPE_ALL,
                };
                f.maglev = if f.family == "IPv6" {
                    tables6.get(&key).map(|ids| inspect::maglev_view(&t6, ids))
                } else {
                    tables4.get(&key).map(|ids| inspect::maglev_view(&t4, ids))
                };
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{}", inspect::render_text(&v));
            }
            Ok(())
        }
        Cmd::Monitor { bpffs, service, json, agent, seconds } => {
            loader::check_root()?;
            loader::check_bpffs(&bpffs)?;
            if let Some(s) = &service
                && s.split('/').filter(|p| !p.is_empty()).count() != 2
            {
                anyhow::bail!("--service {s}: expected NAMESPACE/NAME");
            }
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(monitor::run(&bpffs, service.as_deref(), json, &agent, seconds.map(Duration::from_secs)))
        }
        Cmd::Nat { bpffs, json } => {
            loader::check_root()?;
            loader::check_bpffs(&bpffs)?;
            if !bpffs.join(lb_common::maps::NAT4).exists() {
                anyhow::bail!("nothing is pinned under {}: is an agent running with --bpffs {0}?", bpffs.display());
            }
            // The tables the programs use: while an upgrade waits for its
            // first sync, the old ones (where they read as this agent's),
            // not the staged ones, empty until then.
            fn table<K: aya::Pod, V: aya::Pod>(bpffs: &std::path::Path, name: &str) -> anyhow::Result<aya::maps::HashMap<aya::maps::MapData, K, V>> {
                let path = loader::live_pin(bpffs, name);
                let data = anyhow::Context::with_context(aya::maps::MapData::from_pin(&path), || format!("open pinned map {}", path.display()))?;
                Ok(aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data))?)
            }
            let now = nodeport::monotonic_ns();
            let mut flows = inspect::nat_flows(&table::<lb_common::Nat4Key, lb_common::Nat4Entry>(&bpffs, lb_common::maps::NAT4)?, now);
            flows.extend(inspect::nat_flows(&table::<lb_common::Nat6Key, lb_common::Nat6Entry>(&bpffs, lb_common::maps::NAT6)?, now));
            if json {
                println!("{}", serde_json::to_string_pretty(&flows)?);
            } else {
                print!("{}", inspect::render_nat(&flows));
                // The kernel's own expiry: whether it would expire these
                // should the agent go, and what it did while none ran.
                // (Now again: reading the tables can take seconds.)
                let pin = loader::nat_timer_pin(&bpffs);
                let expiry = pin.as_ref().and_then(|p| inspect::nat_timer_at(p).ok()).map(|t| inspect::nat_expiry(&t, nodeport::monotonic_ns()));
                let stats = aya::maps::MapData::from_pin(loader::live_pin(&bpffs, lb_common::maps::STATS))
                    .ok()
                    .and_then(|d| aya::maps::PerCpuArray::<_, u64>::try_from(aya::maps::Map::PerCpuArray(d)).ok());
                let count = |i: u32| stats.as_ref().and_then(|m| m.get(&i, 0).ok()).map_or(0, |v| v.iter().sum());
                print!(
                    "{}",
                    inspect::render_nat_expiry(
                        expiry.as_ref(),
                        pin.is_none(),
                        count(lb_common::stats::NAT_WALKS_WITHOUT_AGENT),
                        count(lb_common::stats::NAT_EXPIRED_WITHOUT_AGENT)
                    )
                );
            }
            Ok(())
        }
        Cmd::Teardown { bpffs, wait_seconds } => {
            loader::check_root()?;
            let netfilter = || {
                let mut errors = firewall::remove();
                errors.extend(firewall::remove_table());
                anyhow::ensure!(errors.is_empty(), "remove lb's netfilter rules: {}", errors.join("; "));
                Ok(())
            };
            if !loader::teardown(&bpffs, std::time::Duration::from_secs(wait_seconds), netfilter)? {
                // A second teardown, or a typo: the netfilter rules (one set
                // per network namespace) may be another agent's, running
                // with another --bpffs.
                eprintln!(
                    "nothing is pinned under {}: nothing removed (lb's netfilter rules stay: they belong to whichever agent runs here)",
                    bpffs.display()
                );
                return Ok(());
            }
            Ok(())
        }
        Cmd::CleanupKubeProxy { dry_run } => {
            loader::check_root()?;
            kube_proxy::cleanup(dry_run)
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn snat_ports_in_the_ephemeral_range_are_warned_about() {
        use super::snat_overlaps_ephemeral as w;
        assert_eq!(w((1024, 29999), "32768\t60999\n", "\n"), None);
        let m = w((1024, 29999), "20000 60999", "").unwrap();
        assert!(m.contains("--snat-ports 1024-29999 overlaps") && m.contains("ip_local_port_range 20000 60999) in 10000 port(s)"), "{m}");
        assert!(w((40000, 50000), "1024 65535", "").is_some());
        assert_eq!(w((1024, 29999), "garbage", ""), None);
        // Reserved ports are no ephemeral ports: covered whole, no warning;
        // covered in part, the rest is named.
        assert_eq!(w((1024, 29999), "20000 60999", "20000-29999\n"), None);
        assert_eq!(w((1024, 29999), "20000 60999", "80,8080,19000-25000,25001-30000"), None);
        let m = w((1024, 29999), "20000 60999", "20000-29990,443").unwrap();
        assert!(m.contains("in 9 port(s) not in net.ipv4.ip_local_reserved_ports"), "{m}");
        assert_eq!(w((30000, 30000), "1024 65535", "30000"), None);
        assert!(w((30000, 30001), "1024 65535", "garbage,30000").is_some());
    }

    /// kube-proxy's healthz timeout: twice its syncPeriod.
    #[test]
    fn the_stall_limit_is_twice_the_resync_period_unless_given() {
        use std::time::Duration as D;
        assert_eq!(super::stall_after(None, D::from_secs(30)), D::from_secs(60));
        assert_eq!(super::stall_after(None, D::from_secs(10)), D::from_secs(20));
        assert_eq!(super::stall_after(None, D::ZERO), D::from_secs(60));
        assert_eq!(super::stall_after(Some(5), D::from_secs(30)), D::from_secs(5));
    }

    /// kube-proxy's GetHostname: trimmed, lowercased; blank is an error.
    #[test]
    fn node_names_are_taken_as_kubelet_names_nodes() {
        assert_eq!(super::node_name(Some(" Worker-1\n".into())).unwrap(), "worker-1");
        assert!(super::node_name(Some("  ".into())).is_err());
        assert_eq!(super::node_name(None).unwrap(), super::hostname().trim().to_lowercase());
    }
}
