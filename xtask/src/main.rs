//! cargo xtask: setup, demo, test, image, e2e-container.
//!
//! Every command runs `setup` first; setup is idempotent and installs only
//! what is missing.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};
use lbtest::podspec;

mod container;
mod e2e;

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install the toolchain pieces and system packages (idempotent).
    Setup,
    /// Build, then run the netns mini-cluster demo.
    Demo,
    /// End-to-end on kind (needs docker with a running engine, and kind):
    /// create a cluster without kube-proxy, install lb, check Services, delete it.
    E2eKind {
        /// Keep the cluster after the run (for debugging).
        #[arg(long)]
        keep: bool,
    },
    /// Benchmarks against kube-proxy's rule shapes, in one run (release build).
    Bench {
        /// Extra arguments for lb-bench (e.g. --rounds 3).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// The lb-agent image without a registry: release binaries built here,
    /// a debootstrap base image, `podman build` (BINS=prebuilt).
    Image {
        /// Build the e2e stage (runtime + lbprobe) as localhost/lb-agent:e2e.
        #[arg(long)]
        e2e: bool,
    },
    /// Print (not run) the `podman run` commands kubelet's view of
    /// deploy/daemonset.yaml becomes on one node: init containers, then the
    /// agent. ConfigMaps come from deploy/kustomization.yaml's literals.
    PodCommands {
        /// spec.nodeName (downward API) and the hostname.
        #[arg(long, default_value = "node-a")]
        node: String,
        /// The netns (under /run/netns) that stands in for hostNetwork.
        #[arg(long, default_value = "lb-node-a")]
        netns: String,
        /// hostPath substitution FROM=TO (repeatable), e.g. /sys/fs/bpf=/sys/fs/bpf/t1.
        #[arg(long = "host-path", value_name = "FROM=TO")]
        host_paths: Vec<String>,
        /// The image the manifest's lb-agent:<version> becomes.
        #[arg(long, default_value = container::IMAGE)]
        image: String,
        /// A directory with the service account's token, ca.crt and
        /// namespace, mounted read-only where kubelet mounts the token.
        #[arg(long, value_name = "DIR")]
        service_account: Option<String>,
    },
    /// Build the image (as `image`), then run the DaemonSet's pod in the
    /// netns mini-cluster: `cargo test -p tests --test container`.
    E2eContainer {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Build (the image included), then run every test (unit,
    /// netns-cluster and container), plus clippy.
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
}

const APT_PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "bpftool",
    "iptables",
    "nftables",
    "iproute2",
    // lb-agent cleanup-kube-proxy: IPVS mode's ipsets (and its test).
    "ipset",
    "util-linux",
    // The XDP tests: checksum offload off on the test fabric.
    "ethtool",
    // cargo xtask image: the image without a registry.
    "podman",
    "runc",
    "debootstrap",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn status(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {cmd:?}");
    let st = cmd.status().with_context(|| format!("spawn {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

fn has(cmd: &str) -> bool {
    Command::new("sh").args(["-c", &format!("command -v {cmd}")]).output().is_ok_and(|o| o.status.success())
}

fn cargo_bin(name: &str) -> Option<PathBuf> {
    if has(name) {
        return Some(PathBuf::from(name));
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))?;
    let p = home.join("bin").join(name);
    p.is_file().then_some(p)
}

/// toolchain.env: the one place toolchains and tools are pinned.
struct Pins {
    bpf_nightly: &'static str,
    llvm: &'static str,
    bpf_linker: &'static str,
}

impl Pins {
    fn load() -> Result<Self> {
        Self::parse(include_str!("../../toolchain.env"))
    }

    fn parse(text: &'static str) -> Result<Self> {
        let get = |key: &str| {
            text.lines()
                .filter_map(|l| l.trim().split_once('='))
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v)
                .with_context(|| format!("toolchain.env has no {key}="))
        };
        Ok(Self { bpf_nightly: get("BPF_NIGHTLY")?, llvm: get("LLVM_MAJOR")?, bpf_linker: get("BPF_LINKER_VERSION")? })
    }
}

fn setup() -> Result<()> {
    // SAFETY: trivial syscall.
    if unsafe { libc::geteuid() } != 0 {
        bail!("xtask setup needs root (apt-get, bpffs, netns)");
    }
    let missing_pkg = !Path::new(&format!("/usr/lib/llvm-{}/bin/llvm-config", Pins::load()?.llvm)).exists()
        || !Path::new("/usr/include/zstd.h").exists()
        || ["bpftool", "ip", "iptables", "nft", "ipset", "nsenter", "ethtool", "podman", "runc", "debootstrap"].iter().any(|c| !has(c));
    if missing_pkg {
        status(Command::new("apt-get").arg("update"))?;
        status(Command::new("apt-get").args(["install", "-y", "--no-install-recommends"]).args(APT_PACKAGES).env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    let pins = Pins::load()?;
    let toolchains = Command::new("rustup").args(["toolchain", "list"]).output().context("rustup")?;
    if !String::from_utf8_lossy(&toolchains.stdout).lines().any(|l| l.starts_with(pins.bpf_nightly)) {
        status(Command::new("rustup").args(["toolchain", "install", pins.bpf_nightly, "--profile", "minimal"]))?;
    }
    let comps = Command::new("rustup").args(["component", "list", "--installed", "--toolchain", pins.bpf_nightly]).output()?;
    if !String::from_utf8_lossy(&comps.stdout).lines().any(|l| l.starts_with("rust-src")) {
        status(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", pins.bpf_nightly]))?;
    }
    let linker_ok = cargo_bin("bpf-linker").is_some_and(|p| {
        Command::new(p).arg("--version").output().is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout).split_whitespace().any(|w| w == pins.bpf_linker)
        })
    });
    if !linker_ok {
        let llvm = format!("/usr/lib/llvm-{}/bin", pins.llvm);
        let path = format!("{llvm}:{}", std::env::var("PATH").unwrap_or_default());
        status(
            Command::new("cargo")
                .args(["install", "bpf-linker", "--locked", "--force", "--version", pins.bpf_linker])
                .args(["--no-default-features", "--features", &format!("llvm-{}", pins.llvm)])
                .env("PATH", path),
        )?;
    }
    let mounted = Command::new("mountpoint").args(["-q", "/sys/fs/bpf"]).status()?.success();
    if !mounted {
        status(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]))?;
    }
    Ok(())
}

/// cargo, with ~/.cargo/bin on PATH (bpf-linker lives there).
fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    if let Some(bin) = cargo_bin("bpf-linker").and_then(|p| p.parent().map(Path::to_path_buf))
        && !bin.as_os_str().is_empty()
    {
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
        c.env("PATH", path);
    }
    c.current_dir(root());
    c
}

fn docker_engine_up() -> bool {
    Command::new("docker").arg("info").output().is_ok_and(|o| o.status.success())
}

/// What e2e-kind lacks on this machine, in one line, or None.
fn e2e_preflight(has: &dyn Fn(&str) -> bool, engine_up: &dyn Fn() -> bool) -> Option<String> {
    let mut missing = Vec::new();
    for tool in ["docker", "kind", "kubectl"] {
        if !has(tool) {
            missing.push(format!("{tool} not found"));
        }
    }
    if has("docker") && !engine_up() {
        missing.push("no Docker engine running (`docker info` fails)".to_string());
    }
    (!missing.is_empty()).then(|| missing.join("; "))
}

fn build_bins(release: bool) -> Result<()> {
    let mut c = cargo();
    c.args(["build", "-p", "lb-agent", "-p", "tests", "--bins"]);
    if release {
        c.arg("--release");
    }
    status(&mut c)
}

/// The north-south suites, run again with each other TC attach mode and
/// with XDP acceleration.
const NETLINK_SUITES: [&str; 9] = [
    "nodeport",
    "north_south",
    "north_south_icmp",
    "north_south_abuse",
    "north_south_forward",
    "north_south_maglev",
    "north_south_dsr",
    "north_south_xdp",
    "north_south_l3",
];

/// `cargo xtask image`, after setup: the release binaries, the base image,
/// then the lb-agent image (`e2e`: the e2e stage). Returns its tag.
fn image(e2e: bool) -> Result<&'static str> {
    let t0 = Instant::now();
    // The same build as bench: lb-agent and lbprobe (the e2e stage's).
    build_bins(true)?;
    eprintln!("xtask: release binaries in {:.0?}", t0.elapsed());
    let t = Instant::now();
    container::ensure_base_image()?;
    eprintln!("xtask: base image in {:.0?}", t.elapsed());
    let t = Instant::now();
    let tag = container::build_image(&root(), e2e)?;
    eprintln!("xtask: {tag} built in {:.0?} ({:.0?} in all)", t.elapsed(), t0.elapsed());
    Ok(tag)
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Setup => setup(),
        Cmd::Demo => {
            setup()?;
            build_bins(false)?;
            status(&mut Command::new(root().join("target/debug/lb-demo")))
        }
        Cmd::E2eKind { keep } => {
            // Checked first, before anything is installed or built.
            if let Some(missing) = e2e_preflight(&|c: &str| has(c), &|| docker_engine_up()) {
                eprintln!("xtask e2e-kind: cannot run here: {missing}");
                std::process::exit(1);
            }
            setup()?;
            e2e::run(&root(), keep)
        }
        Cmd::Bench { args } => {
            setup()?;
            build_bins(true)?;
            status(Command::new(root().join("target/release/lb-bench")).args(&args).current_dir(root()))
        }
        Cmd::Image { e2e } => {
            setup()?;
            image(e2e).map(drop)
        }
        Cmd::E2eContainer { args } => {
            setup()?;
            image(false)?;
            // The harness's own binaries (lb-agent for teardown and
            // `list`, lbprobe, lb-apiserver), as for every kernel test.
            build_bins(false)?;
            status(cargo().args(["test", "-p", "tests", "--test", "container"]).args(&args))
        }
        Cmd::PodCommands { node, netns, host_paths, image, service_account } => {
            let ds = podspec::daemonset_from_yaml(&std::fs::read_to_string(root().join("deploy/daemonset.yaml"))?)?;
            let mut ctx = podspec::PodContext::new(&node, &format!("lb-agent-{node}"), &netns);
            ctx.config_maps =
                podspec::kustomize_config_maps(&std::fs::read_to_string(root().join("deploy/kustomization.yaml"))?)?;
            for hp in &host_paths {
                let (from, to) = hp.split_once('=').with_context(|| format!("--host-path {hp}: not FROM=TO"))?;
                ctx.host_paths.insert(from.into(), to.into());
            }
            ctx.run_images_as(&ds, &image);
            ctx.service_account = service_account;
            let pod = podspec::pod_runs(&ds, &ctx)?;
            for dir in &pod.mkdirs {
                println!("mkdir -p {}", podspec::shell_quote(dir));
            }
            for run in &pod.runs {
                let args: Vec<String> = run.args.iter().map(|a| podspec::shell_quote(a)).collect();
                println!("podman {}", args.join(" "));
            }
            Ok(())
        }
        Cmd::Test { args } => {
            setup()?;
            // tests/tests/container.rs runs this image.
            image(false)?;
            build_bins(false)?;
            status(cargo().args(["test", "--workspace"]).args(&args))?;
            if args.is_empty() {
                // The north-south suites again with the TC programs attached
                // the way kernels before 6.6 need (clsact + netlink filters).
                let mut c = cargo();
                c.args(["test", "-p", "tests"]);
                for suite in NETLINK_SUITES {
                    c.args(["--test", suite]);
                }
                status(c.env("LB_TC_ATTACH", "netlink"))?;
                // ... and with XDP acceleration in front of them, on a
                // fabric that carries complete checksums as a wire does,
                // with forwarding in BPF (as XDP is meant to run: what it
                // passes up is forwarded by TC).
                let mut c = cargo();
                c.args(["test", "-p", "tests"]);
                for suite in NETLINK_SUITES {
                    c.args(["--test", suite]);
                }
                status(c.env("LB_NODEPORT_ACCELERATION", "xdp").env("LB_BPF_FORWARD", "1"))?;
            }
            status(cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_name_a_dated_nightly_and_agree_with_the_apt_packages() {
        let pins = Pins::load().unwrap();
        // A floating `nightly` changes LLVM under bpf-linker: only a dated one.
        let date = pins.bpf_nightly.strip_prefix("nightly-").expect("BPF_NIGHTLY is nightly-YYYY-MM-DD");
        assert_eq!(date.len(), 10, "{date}");
        assert!(APT_PACKAGES.contains(&format!("llvm-{}-dev", pins.llvm).as_str()));
        assert!(Pins::parse("BPF_NIGHTLY=x\n").is_err());
        let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
        assert!(dockerfile.contains("toolchain.env"), "the Dockerfile must read the pins");
        assert!(!dockerfile.contains("install nightly"), "the Dockerfile must not install a floating nightly");
    }

    #[test]
    fn e2e_preflight_names_what_is_missing_in_one_line() {
        let none = e2e_preflight(&|_| false, &|| false).unwrap();
        assert_eq!(none, "docker not found; kind not found; kubectl not found");
        let no_engine = e2e_preflight(&|t| t != "kind", &|| false).unwrap();
        assert_eq!(no_engine, "kind not found; no Docker engine running (`docker info` fails)");
        assert_eq!(e2e_preflight(&|_| true, &|| true), None);
    }
}
