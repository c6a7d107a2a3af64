//! kube-proxy's conntrack settings (its `--conntrack-*` flags and their
//! defaults): the size of the node's conntrack table and the timeouts of
//! its TCP and UDP entries. kube-proxy writes them when it starts; a node
//! that swaps kube-proxy for lb keeps them (the kernel's own TCP timeout is
//! 5 days, kube-proxy's 1 day), and lb's masquerade makes conntrack run.
//!
//! Written once conntrack is loaded (the sysctls exist only then), and only
//! where they differ from what is asked for, as kube-proxy writes them.
//! `nf_conntrack_max` and the hash size belong to the whole machine: the
//! kernel lets only the initial network namespace set them.
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The flags, named and defaulted as kube-proxy's.
#[derive(clap::Args, Clone, Debug, PartialEq, Eq)]
pub struct Args {
    /// nf_conntrack_max per CPU of the node: the table holds this many
    /// entries per CPU, at least --conntrack-min (kube-proxy's flag and
    /// default). 0 leaves nf_conntrack_max (and --conntrack-min) alone.
    #[arg(long, default_value_t = 32768)]
    pub conntrack_max_per_core: u64,
    /// The least nf_conntrack_max --conntrack-max-per-core sets.
    #[arg(long, default_value_t = 131072)]
    pub conntrack_min: u64,
    /// Idle timeout of established TCP entries
    /// (nf_conntrack_tcp_timeout_established; 0: left alone).
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    pub conntrack_tcp_timeout_established: Duration,
    /// Timeout of TCP entries in CLOSE_WAIT
    /// (nf_conntrack_tcp_timeout_close_wait; 0: left alone).
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    pub conntrack_tcp_timeout_close_wait: Duration,
    /// Let conntrack accept TCP packets outside its window
    /// (nf_conntrack_tcp_be_liberal=1) instead of calling them INVALID.
    #[arg(long)]
    pub conntrack_tcp_be_liberal: bool,
    /// Timeout of unreplied UDP entries (nf_conntrack_udp_timeout; 0: left
    /// alone).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub conntrack_udp_timeout: Duration,
    /// Timeout of UDP entries that saw replies
    /// (nf_conntrack_udp_timeout_stream; 0: left alone).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub conntrack_udp_timeout_stream: Duration,
}

/// nf_conntrack_max as kube-proxy computes it: `max_per_core` per CPU, at
/// least `min`; None (left alone) when `max_per_core` is 0.
pub fn wanted_max(a: &Args, cpus: u64) -> Option<u64> {
    (a.conntrack_max_per_core > 0).then(|| (a.conntrack_max_per_core * cpus).max(a.conntrack_min))
}

/// The sysctls (under net/netfilter) to hold, with their values and the
/// flag that asks for each, in kube-proxy's order.
pub fn wanted(a: &Args, cpus: u64) -> Vec<(&'static str, u64, &'static str)> {
    let mut out = Vec::new();
    if let Some(max) = wanted_max(a, cpus) {
        out.push(("nf_conntrack_max", max, "--conntrack-max-per-core"));
    }
    for (name, d, flag) in [
        ("nf_conntrack_tcp_timeout_established", a.conntrack_tcp_timeout_established, "--conntrack-tcp-timeout-established"),
        ("nf_conntrack_tcp_timeout_close_wait", a.conntrack_tcp_timeout_close_wait, "--conntrack-tcp-timeout-close-wait"),
    ] {
        if d.as_secs() > 0 {
            out.push((name, d.as_secs(), flag));
        }
    }
    if a.conntrack_tcp_be_liberal {
        out.push(("nf_conntrack_tcp_be_liberal", 1, "--conntrack-tcp-be-liberal"));
    }
    for (name, d, flag) in [
        ("nf_conntrack_udp_timeout", a.conntrack_udp_timeout, "--conntrack-udp-timeout"),
        ("nf_conntrack_udp_timeout_stream", a.conntrack_udp_timeout_stream, "--conntrack-udp-timeout-stream"),
    ] {
        if d.as_secs() > 0 {
            out.push((name, d.as_secs(), flag));
        }
    }
    out
}

/// Where the sysctls and the hash size are.
pub struct Paths {
    /// /proc/sys/net/netfilter
    pub sysctl: PathBuf,
    /// /sys/module/nf_conntrack/parameters/hashsize
    pub hashsize: PathBuf,
}

impl Default for Paths {
    fn default() -> Self {
        Paths { sysctl: "/proc/sys/net/netfilter".into(), hashsize: "/sys/module/nf_conntrack/parameters/hashsize".into() }
    }
}

/// What one application did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// (sysctl, old value, new value) written.
    pub written: Vec<(String, u64, u64)>,
    /// One line each: what could not be set, naming the flag.
    pub problems: Vec<String>,
}

fn read_u64(p: &Path) -> Option<u64> {
    fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// Hold the settings `a` asks for in `paths`; None while conntrack is not
/// loaded (no `nf_conntrack_max`: nothing to set yet). `initial_netns`: the
/// agent runs in the machine's initial network namespace, the only one
/// where nf_conntrack_max and the hash size can be set (elsewhere they are
/// reported, never written).
pub fn apply(a: &Args, cpus: u64, paths: &Paths, initial_netns: bool) -> Option<Applied> {
    if !paths.sysctl.join("nf_conntrack_max").exists() {
        return None;
    }
    let mut out = Applied::default();
    for (name, value, flag) in wanted(a, cpus) {
        let path = paths.sysctl.join(name);
        let Some(now) = read_u64(&path) else {
            out.problems.push(format!("{flag}: cannot read {}", path.display()));
            continue;
        };
        let max = name == "nf_conntrack_max";
        if max && !initial_netns {
            if now != value {
                out.problems.push(format!(
                    "{flag}: nf_conntrack_max is {now}, not {value}: only the machine's initial network namespace can set it (--conntrack-max-per-core 0 leaves it)"
                ));
            }
            continue;
        }
        if now != value {
            match fs::write(&path, value.to_string()) {
                Ok(()) => out.written.push((name.to_string(), now, value)),
                Err(e) => out.problems.push(format!("{flag}: cannot set {name} from {now} to {value} ({}: {e})", path.display())),
            }
        }
        // kube-proxy grows the hash table with the limit: to a quarter of it.
        if max && let Some(hash) = read_u64(&paths.hashsize) && hash < value / 4 {
            match fs::write(&paths.hashsize, (value / 4).to_string()) {
                Ok(()) => out.written.push(("nf_conntrack hashsize".into(), hash, value / 4)),
                Err(e) => out.problems.push(format!("{flag}: cannot set the conntrack hash size to {} ({}: {e})", value / 4, paths.hashsize.display())),
            }
        }
    }
    Some(out)
}

/// Whether this process is in the initial network namespace (that of PID
/// 1 of the machine's PID namespace; in a pod with hostNetwork, the node's).
pub fn in_initial_netns() -> bool {
    match (fs::read_link("/proc/self/ns/net"), fs::read_link("/proc/1/ns/net")) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// The node's CPUs (online), as kube-proxy counts them.
pub fn cpus() -> u64 {
    // SAFETY: sysconf reads a value.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 { n as u64 } else { std::thread::available_parallelism().map_or(1, |n| n.get() as u64) }
}

/// `apply` with the machine's paths, logging what it did: true once done
/// (conntrack loaded), false to look again later.
pub fn ensure(a: &Args) -> bool {
    let Some(done) = apply(a, cpus(), &Paths::default(), in_initial_netns()) else {
        return false;
    };
    for (name, old, new) in &done.written {
        tracing::info!(sysctl = name.as_str(), old, new, "conntrack setting written, as kube-proxy writes it");
    }
    for p in &done.problems {
        tracing::warn!("{p}");
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: Args,
    }

    fn args(flags: &[&str]) -> Args {
        Cli::try_parse_from(std::iter::once("lb").chain(flags.iter().copied())).unwrap().a
    }

    #[test]
    fn defaults_are_kube_proxys() {
        let a = args(&[]);
        assert_eq!(wanted_max(&a, 2), Some(131072), "the floor on a small node");
        assert_eq!(wanted_max(&a, 8), Some(262144), "32768 per core");
        assert_eq!(
            wanted(&a, 2),
            [
                ("nf_conntrack_max", 131072, "--conntrack-max-per-core"),
                ("nf_conntrack_tcp_timeout_established", 86400, "--conntrack-tcp-timeout-established"),
                ("nf_conntrack_tcp_timeout_close_wait", 3600, "--conntrack-tcp-timeout-close-wait"),
            ]
        );
    }

    #[test]
    fn zero_leaves_a_setting_alone_and_go_durations_parse() {
        let a = args(&["--conntrack-max-per-core", "0", "--conntrack-tcp-timeout-established", "0s", "--conntrack-tcp-timeout-close-wait", "0"]);
        assert_eq!(wanted(&a, 64), []);
        // kube-proxy's own spelling of its durations.
        let a = args(&["--conntrack-tcp-timeout-established", "24h0m0s", "--conntrack-udp-timeout", "30s", "--conntrack-udp-timeout-stream", "2m", "--conntrack-tcp-be-liberal"]);
        let w = wanted(&a, 1);
        assert!(w.contains(&("nf_conntrack_tcp_timeout_established", 86400, "--conntrack-tcp-timeout-established")), "{w:?}");
        assert!(w.contains(&("nf_conntrack_tcp_be_liberal", 1, "--conntrack-tcp-be-liberal")), "{w:?}");
        assert!(w.contains(&("nf_conntrack_udp_timeout", 30, "--conntrack-udp-timeout")), "{w:?}");
        assert!(w.contains(&("nf_conntrack_udp_timeout_stream", 120, "--conntrack-udp-timeout-stream")), "{w:?}");
        assert_eq!(args(&["--conntrack-min", "1000", "--conntrack-max-per-core", "10"]).conntrack_min, 1000);
        assert_eq!(wanted_max(&args(&["--conntrack-min", "1000", "--conntrack-max-per-core", "10"]), 4), Some(1000));
        assert!(Cli::try_parse_from(["lb", "--conntrack-tcp-timeout-established", "soon"]).is_err());
    }

    /// A fake /proc/sys/net/netfilter and hashsize file.
    fn fake(values: &[(&str, u64)], hash: u64) -> (tempfile::TempDir, Paths) {
        let d = tempfile::tempdir().unwrap();
        let sysctl = d.path().join("netfilter");
        fs::create_dir(&sysctl).unwrap();
        for (n, v) in values {
            fs::write(sysctl.join(n), format!("{v}\n")).unwrap();
        }
        let hashsize = d.path().join("hashsize");
        fs::write(&hashsize, format!("{hash}\n")).unwrap();
        (d, Paths { sysctl, hashsize })
    }

    const KERNEL: &[(&str, u64)] = &[
        ("nf_conntrack_max", 65536),
        ("nf_conntrack_tcp_timeout_established", 432000),
        ("nf_conntrack_tcp_timeout_close_wait", 60),
        ("nf_conntrack_tcp_be_liberal", 0),
        ("nf_conntrack_udp_timeout", 30),
        ("nf_conntrack_udp_timeout_stream", 120),
    ];

    #[test]
    fn writes_what_differs_and_grows_the_hash_with_the_limit() {
        let (_d, p) = fake(KERNEL, 16384);
        let done = apply(&args(&[]), 2, &p, true).unwrap();
        assert_eq!(
            done.written,
            [
                ("nf_conntrack_max".to_string(), 65536, 131072),
                ("nf_conntrack hashsize".to_string(), 16384, 32768),
                ("nf_conntrack_tcp_timeout_established".to_string(), 432000, 86400),
                ("nf_conntrack_tcp_timeout_close_wait".to_string(), 60, 3600),
            ]
        );
        assert_eq!(done.problems, Vec::<String>::new());
        assert_eq!(read_u64(&p.sysctl.join("nf_conntrack_max")), Some(131072));
        assert_eq!(read_u64(&p.hashsize), Some(32768));
        assert_eq!(read_u64(&p.sysctl.join("nf_conntrack_udp_timeout")), Some(30), "left alone");
        // Again: nothing differs, nothing is written.
        assert_eq!(apply(&args(&[]), 2, &p, true).unwrap(), Applied::default());
        // A larger limit is lowered, as kube-proxy lowers it; a hash
        // already large enough stays.
        fs::write(p.sysctl.join("nf_conntrack_max"), "1048576").unwrap();
        fs::write(&p.hashsize, "262144").unwrap();
        let done = apply(&args(&[]), 2, &p, true).unwrap();
        assert_eq!(done.written, [("nf_conntrack_max".to_string(), 1048576, 131072)]);
    }

    #[test]
    fn outside_the_initial_netns_the_machine_wide_ones_are_only_reported() {
        let (_d, p) = fake(KERNEL, 16384);
        let done = apply(&args(&[]), 2, &p, false).unwrap();
        assert_eq!(read_u64(&p.sysctl.join("nf_conntrack_max")), Some(65536), "not written");
        assert_eq!(read_u64(&p.hashsize), Some(16384), "not written");
        assert_eq!(done.written.len(), 2, "the per-netns timeouts are: {done:?}");
        assert_eq!(done.problems.len(), 1, "{done:?}");
        assert!(done.problems[0].starts_with("--conntrack-max-per-core: nf_conntrack_max is 65536, not 131072"), "{done:?}");
        // Where it already holds the value, nothing to say.
        fs::write(p.sysctl.join("nf_conntrack_max"), "131072").unwrap();
        assert_eq!(apply(&args(&[]), 2, &p, false).unwrap().problems, Vec::<String>::new());
    }

    #[test]
    fn before_conntrack_is_loaded_nothing_is_done_and_a_failed_write_names_its_flag() {
        let (_d, p) = fake(&[], 16384);
        assert_eq!(apply(&args(&[]), 2, &p, true), None);
        let (_d, p) = fake(&KERNEL[..2], 16384);
        // A sysctl the kernel does not have: reported, the rest written.
        let done = apply(&args(&[]), 2, &p, true).unwrap();
        assert!(done.problems.iter().any(|l| l.starts_with("--conntrack-tcp-timeout-close-wait: cannot read")), "{done:?}");
        assert_eq!(read_u64(&p.sysctl.join("nf_conntrack_tcp_timeout_established")), Some(86400));
        // A directory where the file should be: named with its flag.
        let (_d, p) = fake(KERNEL, 1 << 20);
        fs::remove_file(p.sysctl.join("nf_conntrack_tcp_be_liberal")).unwrap();
        fs::create_dir(p.sysctl.join("nf_conntrack_tcp_be_liberal")).unwrap();
        let done = apply(&args(&["--conntrack-tcp-be-liberal"]), 2, &p, true).unwrap();
        assert!(done.problems.iter().any(|l| l.starts_with("--conntrack-tcp-be-liberal: cannot read")), "{done:?}");
    }
}
