//! Compiles lb-ebpf for the BPF target (nightly, build-std) with aya-build;
//! the object is embedded into lb-agent with include_bytes_aligned.
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../lb-ebpf");
    println!("cargo:rerun-if-changed={root}/src");
    println!("cargo:rerun-if-changed=../lb-common/src");
    aya_build::build_ebpf(
        [Package { name: "lb-ebpf", root_dir: root, ..Default::default() }],
        Toolchain::default(),
    )
}
