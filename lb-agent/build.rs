//! Compiles lb-ebpf for the BPF target (nightly, build-std) with aya-build;
//! the object is embedded into lb-agent with include_bytes_aligned. The
//! nightly is the one pinned in toolchain.env (never a floating `nightly`).
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../lb-ebpf");
    println!("cargo:rerun-if-changed={root}/src");
    println!("cargo:rerun-if-changed=../lb-common/src");
    println!("cargo:rerun-if-changed=../toolchain.env");
    let pins = include_str!("../toolchain.env");
    let nightly = pins
        .lines()
        .find_map(|l| l.trim().strip_prefix("BPF_NIGHTLY="))
        .ok_or_else(|| anyhow::anyhow!("toolchain.env has no BPF_NIGHTLY="))?;
    aya_build::build_ebpf(
        [Package { name: "lb-ebpf", root_dir: root, ..Default::default() }],
        Toolchain::Custom(nightly),
    )
}
