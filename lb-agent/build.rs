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
    )?;
    strip_debug(pins);
    Ok(())
}

/// Drop the object's DWARF (.debug_* and their relocations: about 60% of
/// it), which the loader parses along with everything else and the kernel
/// never sees; .BTF and .BTF.ext (types, line info for verifier logs) stay.
/// Without the pinned LLVM's llvm-objcopy the object stays as it is.
fn strip_debug(pins: &str) {
    let Some(major) = pins.lines().find_map(|l| l.trim().strip_prefix("LLVM_MAJOR=")) else { return };
    let objcopy = format!("/usr/lib/llvm-{major}/bin/llvm-objcopy");
    let obj = std::path::Path::new(&std::env::var("OUT_DIR").unwrap_or_default()).join("lb");
    match std::process::Command::new(&objcopy).arg("--strip-debug").arg(&obj).status() {
        Ok(s) if s.success() => {}
        Ok(s) => println!("cargo:warning={objcopy} --strip-debug failed ({s}); the BPF object keeps its DWARF"),
        Err(e) => println!("cargo:warning={objcopy}: {e}; the BPF object keeps its DWARF"),
    }
}
