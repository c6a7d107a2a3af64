//! A pinned map of the same type and sizes as one of lb's but with another
//! BTF layout: what an older (or newer) agent whose struct changed meaning
//! at the same size leaves behind. Made with raw bpf(2) calls, since neither
//! bpftool nor aya creates a map with hand-written BTF.
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::path::Path;

use anyhow::{Context as _, Result};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_BTF_LOAD: libc::c_long = 18;
const SK_STORAGE: u32 = 24;

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<OwnedFd> {
    // SAFETY: attr is a valid bpf_attr prefix of size_of::<T>().
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, std::mem::size_of::<T>()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: these commands return a new file descriptor (BPF_OBJ_PIN
    // returns 0, which the caller never wraps: see pin()).
    Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
}

/// BTF with two structs, `bogus_k { x: [u8; key] }` (type 5) and
/// `bogus_v { x: [u8; value] }` (type 6).
fn bogus_btf(key: u32, value: u32) -> Vec<u8> {
    let strings = b"\0u8\0x\0bogus_k\0bogus_v\0u32\0";
    let (u8_name, x, k_name, v_name, u32_name) = (1u32, 4u32, 6u32, 14u32, 22u32);
    let int = |name: u32, size: u32, bits: u32| [name, 1 << 24, size, bits];
    let array = |len: u32| [0, 3 << 24, 0, 1, 2, len];
    let one_member = |name: u32, size: u32, ty: u32| [name, (4 << 24) | 1, size, x, ty, 0];
    let mut types: Vec<u32> = Vec::new();
    types.extend(int(u8_name, 1, 8)); // 1: u8
    types.extend(int(u32_name, 4, 32)); // 2: u32
    types.extend(array(key)); // 3: [u8; key]
    types.extend(array(value)); // 4: [u8; value]
    types.extend(one_member(k_name, key, 3)); // 5
    types.extend(one_member(v_name, value, 4)); // 6
    let type_len = (types.len() * 4) as u32;
    let mut out = Vec::new();
    out.extend(0xeb9fu16.to_ne_bytes());
    out.extend([1u8, 0]);
    for w in [24, 0, type_len, type_len, strings.len() as u32] {
        out.extend(u32::to_ne_bytes(w));
    }
    for w in types {
        out.extend(w.to_ne_bytes());
    }
    out.extend(strings);
    out
}

#[repr(C)]
struct BtfLoad {
    btf: u64,
    log_buf: u64,
    btf_size: u32,
    log_size: u32,
    log_level: u32,
}

#[repr(C)]
struct MapCreate {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
    map_ifindex: u32,
    btf_fd: u32,
    btf_key_type_id: u32,
    btf_value_type_id: u32,
}

#[repr(C)]
struct ObjPin {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// Replace the map pinned at `path` by an empty one of the same type, key
/// and value size, max_entries and flags, whose BTF says its key and value
/// are byte arrays in structs of other names (a socket storage map's key
/// stays the u32 the kernel requires).
pub fn replace_with_bogus_btf(path: &Path) -> Result<()> {
    let info = aya::maps::MapInfo::from_pin(path).with_context(|| format!("inspect {}", path.display()))?;
    let (key, value) = (info.key_size(), info.value_size());
    let blob = bogus_btf(key, value);
    let mut log = vec![0u8; 4096];
    let mut load = BtfLoad {
        btf: blob.as_ptr() as u64,
        log_buf: log.as_mut_ptr() as u64,
        btf_size: blob.len() as u32,
        log_size: log.len() as u32,
        log_level: 1,
    };
    let btf = bpf(BPF_BTF_LOAD, &mut load).with_context(|| {
        format!("BPF_BTF_LOAD: {}", String::from_utf8_lossy(&log).trim_end_matches('\0'))
    })?;
    let map_type = raw_map_type(&info)?;
    let key_type = if map_type == SK_STORAGE { 2 } else { 5 };
    let mut create = MapCreate {
        map_type,
        key_size: key,
        value_size: value,
        max_entries: info.max_entries(),
        map_flags: info.map_flags(),
        inner_map_fd: 0,
        numa_node: 0,
        map_name: *b"bogus_btf\0\0\0\0\0\0\0",
        map_ifindex: 0,
        btf_fd: btf.as_raw_fd() as u32,
        btf_key_type_id: key_type,
        btf_value_type_id: 6,
    };
    let map = bpf(BPF_MAP_CREATE, &mut create).context("BPF_MAP_CREATE with the bogus BTF")?;
    std::fs::remove_file(path).with_context(|| format!("unpin {}", path.display()))?;
    let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    let mut pin = ObjPin { pathname: cpath.as_ptr() as u64, bpf_fd: map.as_raw_fd() as u32, file_flags: 0 };
    // SAFETY: valid attr; BPF_OBJ_PIN returns 0, not a descriptor.
    let r = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_PIN, &mut pin as *mut ObjPin, std::mem::size_of::<ObjPin>()) };
    if r != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("pin {}", path.display()));
    }
    Ok(())
}

fn raw_map_type(info: &aya::maps::MapInfo) -> Result<u32> {
    use aya::maps::MapType as T;
    Ok(match info.map_type()? {
        T::Hash => 1,
        T::Array => 2,
        T::PerCpuArray => 6,
        T::LruHash => 9,
        T::LpmTrie => 11,
        T::SkStorage => SK_STORAGE,
        other => anyhow::bail!("no bogus-BTF twin for a {other:?} map"),
    })
}
