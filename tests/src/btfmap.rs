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

/// A struct member for `replace_with_layout`: its name and type, one of
/// `u8`, `u16`, `u32`, `u64` or `[u8;N]`.
pub type Member<'a> = (&'a str, &'a str);

fn member_size(ty: &str) -> Result<u32> {
    Ok(match ty {
        "u8" => 1,
        "u16" => 2,
        "u32" => 4,
        "u64" => 8,
        _ => ty
            .strip_prefix("[u8;")
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|n| n.trim().parse().ok())
            .with_context(|| format!("member type {ty:?}"))?,
    })
}

/// BTF with two structs whose members are laid out one after the other,
/// the key's and the value's, and their type ids. Types 1-4 are u8, u16,
/// u32 and u64 (u32 is a socket storage map's key), then one `[u8; N]`
/// per array member, then the two structs.
fn btf_blob(key: &[Member], value: &[Member]) -> Result<(Vec<u8>, u32, u32)> {
    let mut strings: Vec<u8> = b"\0u8\0u16\0u32\0u64\0".to_vec();
    let mut name = |n: &str| -> u32 {
        let at = strings.len() as u32;
        strings.extend(n.as_bytes());
        strings.push(0);
        at
    };
    let ints = [("u8", 1u32, 1u32), ("u16", 4, 2), ("u32", 8, 4), ("u64", 12, 8)];
    let mut types: Vec<u32> = Vec::new();
    for (_, at, size) in ints {
        types.extend([at, 1 << 24, size, size * 8]);
    }
    let mut next = 5u32;
    let mut member_types = Vec::new();
    for (_, ty) in key.iter().chain(value) {
        let id = match ints.iter().position(|(n, ..)| n == ty) {
            Some(i) => i as u32 + 1,
            None => {
                types.extend([0, 3 << 24, 0, 1, 3, member_size(ty)?]);
                next += 1;
                next - 1
            }
        };
        member_types.push(id);
    }
    let names: Vec<u32> = key.iter().chain(value).map(|(n, _)| name(n)).collect();
    let struct_names = [name("old_k"), name("old_v")];
    let mut i = 0;
    for (sname, members) in struct_names.iter().zip([key, value]) {
        let mut body = Vec::new();
        let mut at = 0;
        for (_, ty) in members {
            // Member offsets are in bits.
            body.extend([names[i], member_types[i], at * 8]);
            at += member_size(ty)?;
            i += 1;
        }
        types.extend([*sname, (4 << 24) | members.len() as u32, at]);
        types.extend(body);
    }
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
    Ok((out, next, next + 1))
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
    let (k, v) = (format!("[u8;{}]", info.key_size()), format!("[u8;{}]", info.value_size()));
    replace_with_layout(path, &[("x", &k)], &[("x", &v)])
}

/// Replace the map pinned at `path` by an empty one of the same type,
/// sizes, max_entries and flags, whose BTF names the key's and the value's
/// members as given (one after the other, no padding between them): the
/// layout an older agent's struct had.
pub fn replace_with_layout(path: &Path, key: &[Member], value: &[Member]) -> Result<()> {
    replace(path, key, value, false)
}

/// `replace_with_layout` where the members need not add up to the map's
/// sizes: the key and value are as long as their members (an older
/// agent's struct with a field fewer).
pub fn replace_with_layout_sized(path: &Path, key: &[Member], value: &[Member]) -> Result<()> {
    replace(path, key, value, true)
}

fn replace(path: &Path, key: &[Member], value: &[Member], any_size: bool) -> Result<()> {
    let info = aya::maps::MapInfo::from_pin(path).with_context(|| format!("inspect {}", path.display()))?;
    let sum = |m: &[Member]| m.iter().map(|(_, t)| member_size(t)).sum::<Result<u32>>();
    let (key_size, value_size) = (sum(key)?, sum(value)?);
    anyhow::ensure!(any_size || (key_size, value_size) == (info.key_size(), info.value_size()), "the members do not add up to the map's sizes");
    let (blob, key_struct, value_struct) = btf_blob(key, value)?;
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
    let key_type = if map_type == SK_STORAGE { 3 } else { key_struct };
    let mut create = MapCreate {
        map_type,
        key_size,
        value_size,
        max_entries: info.max_entries(),
        map_flags: info.map_flags(),
        inner_map_fd: 0,
        numa_node: 0,
        map_name: *b"bogus_btf\0\0\0\0\0\0\0",
        map_ifindex: 0,
        btf_fd: btf.as_raw_fd() as u32,
        btf_key_type_id: key_type,
        btf_value_type_id: value_struct,
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
