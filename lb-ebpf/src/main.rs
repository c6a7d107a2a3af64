//! The lb BPF programs. Built only for the BPF target (by lb-agent/build.rs);
//! on the host this crate is an empty binary so that `cargo build --workspace`
//! and `cargo clippy --workspace` stay clean.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]
// atomic_xadd: the BPF target has no atomic types with fetch_add, yet the
// instruction set has an atomic add (what C's __sync_fetch_and_add emits).
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics), allow(internal_features))]

#[cfg(target_arch = "bpf")]
mod lb;
#[cfg(target_arch = "bpf")]
mod nodeport;
#[cfg(target_arch = "bpf")]
mod sock;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[cfg(not(target_arch = "bpf"))]
fn main() {}
