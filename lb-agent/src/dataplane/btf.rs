//! The BTF layout of map keys and values: what an upgrade compares besides
//! sizes, so that a change of meaning at the same size (fields swapped,
//! renamed, retyped) is caught even when nobody bumped
//! `lb_common::LAYOUT_VERSION`.
//!
//! A layout is written as one string: structs as their members' names,
//! offsets and layouts, integers as size and sign, arrays as element and
//! count; names of types, typedefs and qualifiers are left out, since they
//! change nothing in memory. Ours comes from the BTF of the object this
//! agent carries (the `.maps` section's definitions); a pinned map's from the
//! BTF the kernel keeps for it (`bpf_map_info.btf_id`).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd as _, FromRawFd as _, OwnedFd};
use std::path::Path;

use anyhow::{Context as _, Result, bail};
use btfparse::{Offset, TypeInformation, TypeVariant};

/// Key and value layout of one map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub key: String,
    pub value: String,
}

/// A BTF blob as btfparse reads it.
struct Bytes<'a>(&'a [u8]);

impl btfparse::Readable for Bytes<'_> {
    fn read(&self, offset: u64, buf: &mut [u8]) -> btfparse::Result<()> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        if start == self.0.len() {
            return Err(btfparse::Error::new(btfparse::ErrorKind::EOF, "end of BTF"));
        }
        match start.checked_add(buf.len()).and_then(|end| self.0.get(start..end)) {
            Some(src) => {
                buf.copy_from_slice(src);
                Ok(())
            }
            None => Err(btfparse::Error::new(btfparse::ErrorKind::InvalidOffset, "read past the end of BTF")),
        }
    }
}

fn parse(raw: &[u8]) -> Result<TypeInformation> {
    TypeInformation::new(&Bytes(raw)).map_err(|e| anyhow::anyhow!("parse BTF: {e:?}"))
}

/// The layout of type `id`, as one string.
fn layout(types: &TypeInformation, id: u32) -> String {
    let mut out = String::new();
    write_layout(types, id, &mut out, 0);
    out
}

fn write_layout(types: &TypeInformation, id: u32, out: &mut String, depth: u32) {
    use std::fmt::Write as _;
    if depth > 32 {
        out.push('…');
        return;
    }
    if id == 0 {
        out.push_str("void");
        return;
    }
    let Some(t) = types.from_id(id) else {
        let _ = write!(out, "?{id}");
        return;
    };
    match t {
        TypeVariant::Int(i) => {
            let _ = write!(out, "{}{}", if *i.signed() { 'i' } else { 'u' }, i.size() * 8);
        }
        TypeVariant::Float(f) => {
            let _ = write!(out, "f{}", f.size() * 8);
        }
        TypeVariant::Ptr(_) => out.push_str("ptr"),
        TypeVariant::Typedef(t) => write_layout(types, *t.tid(), out, depth + 1),
        TypeVariant::Const(t) => write_layout(types, *t.tid(), out, depth + 1),
        TypeVariant::Volatile(t) => write_layout(types, *t.tid(), out, depth + 1),
        TypeVariant::Restrict(t) => write_layout(types, *t.tid(), out, depth + 1),
        TypeVariant::TypeTag(t) => write_layout(types, *t.tid(), out, depth + 1),
        TypeVariant::Array(a) => {
            out.push('[');
            write_layout(types, *a.element_tid(), out, depth + 1);
            let _ = write!(out, ";{}]", a.element_count());
        }
        TypeVariant::Struct(s) => members(types, "struct", *s.size(), s.member_list(), out, depth),
        TypeVariant::Union(u) => members(types, "union", *u.size(), u.member_list(), out, depth),
        TypeVariant::Enum(e) => {
            let _ = write!(out, "enum{}{{", e.size());
            for v in e.named_value_list() {
                let _ = write!(out, "{}={:?},", v.name, v.value);
            }
            out.push('}');
        }
        TypeVariant::Enum64(e) => {
            let _ = write!(out, "enum{}{{", e.size());
            for v in e.named_value_list() {
                let _ = write!(out, "{}={:?},", v.name, v.value);
            }
            out.push('}');
        }
        other => {
            let _ = write!(out, "{:?}", std::mem::discriminant(&other));
        }
    }
}

fn members(types: &TypeInformation, kind: &str, size: usize, list: &[btfparse::Member], out: &mut String, depth: u32) {
    use std::fmt::Write as _;
    let _ = write!(out, "{kind}{size}{{");
    for m in list {
        let at = match m.offset() {
            Offset::ByteOffset(b) => format!("{b}"),
            Offset::BitOffsetAndSize(o, s) => format!("{o}b{s}"),
        };
        let _ = write!(out, "{}@{at}:", m.name().unwrap_or_default());
        write_layout(types, m.tid(), out, depth + 1);
        out.push(',');
    }
    out.push('}');
}

/// The key and value layout of every map an object defines in `.maps`.
pub fn object_layouts(elf: &[u8]) -> Result<BTreeMap<String, Layout>> {
    use object::{Object as _, ObjectSection as _};
    let file = object::File::parse(elf).context("parse the BPF object")?;
    let section = file.section_by_name(".BTF").context("the BPF object has no .BTF section")?;
    let raw = section.data().context("read .BTF")?;
    let types = parse(raw)?;
    let pointee = |id: u32| match types.from_id(id) {
        Some(TypeVariant::Ptr(p)) => Some(*p.tid()),
        _ => None,
    };
    let mut out = BTreeMap::new();
    for t in types.get().values() {
        let TypeVariant::DataSec(sec) = t else { continue };
        if sec.name().as_deref() != Some(".maps") {
            continue;
        }
        for v in sec.variable_list() {
            let Some(TypeVariant::Var(var)) = types.from_id(v.var_decl_id) else { continue };
            let Some(name) = var.name().clone() else { continue };
            let Some(TypeVariant::Struct(def)) = types.from_id(*var.tid()) else { continue };
            let field = |want: &str| def.member_list().iter().find(|m| m.name().as_deref() == Some(want)).and_then(|m| pointee(m.tid()));
            if let (Some(k), Some(v)) = (field("key"), field("value")) {
                out.insert(name, Layout { key: layout(&types, k), value: layout(&types, v) });
            }
        }
    }
    if out.is_empty() {
        bail!("the BPF object's BTF defines no maps in .maps");
    }
    Ok(out)
}

// The bpf(2) commands and the parts of their attributes used here.
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_BTF_GET_FD_BY_ID: libc::c_long = 19;

#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

#[repr(C)]
struct GetFdByIdAttr {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

/// `struct bpf_map_info` up to the BTF type ids.
#[repr(C)]
#[derive(Default)]
struct MapInfo {
    map_type: u32,
    id: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    name: [u8; 16],
    ifindex: u32,
    btf_vmlinux_value_type_id: u32,
    netns_dev: u64,
    netns_ino: u64,
    btf_id: u32,
    btf_key_type_id: u32,
    btf_value_type_id: u32,
}

/// `struct bpf_btf_info` up to the blob.
#[repr(C)]
#[derive(Default)]
struct BtfInfo {
    btf: u64,
    btf_size: u32,
    id: u32,
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<libc::c_long> {
    // SAFETY: attr is a valid, initialised bpf_attr prefix of size_of::<T>().
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, std::mem::size_of::<T>()) };
    if r < 0 { Err(std::io::Error::last_os_error()) } else { Ok(r) }
}

fn info_by_fd<T>(fd: std::os::fd::BorrowedFd<'_>, info: &mut T) -> std::io::Result<()> {
    let mut attr = InfoAttr { bpf_fd: fd.as_raw_fd() as u32, info_len: std::mem::size_of::<T>() as u32, info: info as *mut T as u64 };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(drop)
}

/// The BTF objects `pinned_layout` has read, by id: the maps one agent
/// created share one (its object's), which is large, so it is read and
/// parsed once, not once per map (that cost every start about 0.1 s).
#[derive(Default)]
pub struct BtfCache(std::collections::HashMap<u32, TypeInformation>);

/// The key and value layout the kernel records for the map pinned at
/// `path`; `None` when it was created without BTF.
pub fn pinned_layout(path: &Path, cache: &mut BtfCache) -> Result<Option<Layout>> {
    let map = aya::maps::MapData::from_pin(path).with_context(|| format!("open pinned map {}", path.display()))?;
    let mut info = MapInfo::default();
    info_by_fd(map.fd().as_fd(), &mut info).with_context(|| format!("read map info of {}", path.display()))?;
    if info.btf_id == 0 || info.btf_value_type_id == 0 {
        return Ok(None);
    }
    let types = match cache.0.entry(info.btf_id) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let mut attr = GetFdByIdAttr { id: info.btf_id, next_id: 0, open_flags: 0 };
            let fd = bpf(BPF_BTF_GET_FD_BY_ID, &mut attr).with_context(|| format!("open BTF {} of {}", info.btf_id, path.display()))?;
            // SAFETY: BPF_BTF_GET_FD_BY_ID returned a new file descriptor.
            let btf = unsafe { OwnedFd::from_raw_fd(fd as i32) };
            let mut bi = BtfInfo::default();
            info_by_fd(btf.as_fd(), &mut bi).context("read the BTF's size")?;
            let mut raw = vec![0u8; bi.btf_size as usize];
            let mut bi = BtfInfo { btf: raw.as_mut_ptr() as u64, btf_size: raw.len() as u32, id: 0 };
            info_by_fd(btf.as_fd(), &mut bi).context("read the BTF")?;
            e.insert(parse(&raw)?)
        }
    };
    Ok(Some(Layout { key: layout(types, info.btf_key_type_id), value: layout(types, info.btf_value_type_id) }))
}

/// How the entries of a struct of one layout become entries of another:
/// the members both name, with the same layout, copied by name; a member
/// only the new layout has starts at zero, and one only the old has is
/// left behind. What an upgrade uses to carry a map's state where a field
/// was added or removed (a NAT flow's entry that grew a field), instead
/// of leaving it behind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remap {
    pub old_size: usize,
    pub new_size: usize,
    /// (offset in the old, offset in the new, length), in bytes.
    pub moves: Vec<(usize, usize, usize)>,
}

impl Remap {
    /// The remap from layout `old` to `new` (`layout`'s strings); `None`
    /// where there is none to trust: not structs, a bitfield, a member
    /// whose layout changed under its name, or no member in common.
    pub fn between(old: &str, new: &str) -> Option<Remap> {
        let (old_size, old_members) = struct_members(old)?;
        let (new_size, new_members) = struct_members(new)?;
        // Members told apart by name only: none unnamed, none twice.
        for members in [&old_members, &new_members] {
            let names: std::collections::BTreeSet<&str> = members.iter().map(|(n, ..)| n.as_str()).collect();
            if names.len() != members.len() || names.contains("") {
                return None;
            }
        }
        let mut moves = Vec::new();
        for (name, at, layout) in &new_members {
            let Some((_, from, was)) = old_members.iter().find(|(n, ..)| n == name) else { continue };
            if was != layout {
                // Padding a new field took part of: it starts at zero.
                if name.starts_with("_pad") {
                    continue;
                }
                return None;
            }
            let len = size_of_layout(layout)?;
            if from + len > old_size || at + len > new_size {
                return None;
            }
            moves.push((*from, *at, len));
        }
        (!moves.is_empty()).then_some(Remap { old_size, new_size, moves })
    }

    /// An entry of the old layout in the new one.
    pub fn apply(&self, old: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; self.new_size];
        for &(from, to, len) in &self.moves {
            if let Some(src) = old.get(from..from + len) {
                out[to..to + len].copy_from_slice(src);
            }
        }
        out
    }
}

/// A struct member in a layout string: its name, byte offset and layout.
type MemberAt = (String, usize, String);

/// A struct layout's size and its members, split at the top level; `None`
/// for anything else, or a bitfield.
fn struct_members(layout: &str) -> Option<(usize, Vec<MemberAt>)> {
    let rest = layout.strip_prefix("struct")?;
    let brace = rest.find('{')?;
    let size: usize = rest[..brace].parse().ok()?;
    let body = rest[brace + 1..].strip_suffix('}')?;
    let mut members = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in body.char_indices() {
        match c {
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            ',' if depth == 0 => {
                members.push(&body[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if !body[start..].is_empty() {
        members.push(&body[start..]);
    }
    let members = members
        .into_iter()
        .map(|m| {
            let (name, rest) = m.split_once('@')?;
            let (at, layout) = rest.split_once(':')?;
            Some((name.to_string(), at.parse().ok()?, layout.to_string()))
        })
        .collect::<Option<Vec<_>>>()?;
    Some((size, members))
}

/// The size in bytes a layout string stands for.
fn size_of_layout(layout: &str) -> Option<usize> {
    let digits = |s: &str| -> Option<usize> {
        let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        s[..end].parse().ok()
    };
    if layout == "ptr" {
        return Some(8);
    }
    if let Some(inner) = layout.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
        let (elem, count) = inner.rsplit_once(';')?;
        return size_of_layout(elem)?.checked_mul(count.parse().ok()?);
    }
    for kind in ["struct", "union", "enum"] {
        if let Some(rest) = layout.strip_prefix(kind) {
            return digits(rest);
        }
    }
    let bits = match layout.as_bytes().first()? {
        b'u' | b'i' | b'f' => digits(&layout[1..])?,
        _ => return None,
    };
    (bits % 8 == 0 && bits.to_string().len() == layout.len() - 1).then_some(bits / 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A NAT flow's entry that grew a field (`created_ns`, between two
    /// others): every other field is carried by name, the new one is zero.
    #[test]
    fn a_struct_that_grew_a_field_is_remapped_by_name() {
        let old = "struct24{to_saddr@0:[u8;4],to_daddr@4:[u8;4],to_sport@8:u16,to_dport@10:u16,flags@12:u8,state@13:u8,rev_nat_id@14:u16,last_seen_ns@16:u64,}";
        let new = "struct32{to_saddr@0:[u8;4],to_daddr@4:[u8;4],to_sport@8:u16,to_dport@10:u16,flags@12:u8,state@13:u8,rev_nat_id@14:u16,created_ns@16:u64,last_seen_ns@24:u64,}";
        let r = Remap::between(old, new).unwrap();
        assert_eq!((r.old_size, r.new_size), (24, 32));
        let entry: Vec<u8> = (1..=24).collect();
        let got = r.apply(&entry);
        assert_eq!(&got[..16], &entry[..16]);
        assert_eq!(&got[16..24], &[0; 8], "the new field starts at zero");
        assert_eq!(&got[24..], &entry[16..], "last_seen_ns moved");
        // Back again: the field only the old has is left behind.
        let back = Remap::between(new, old).unwrap();
        assert_eq!(back.apply(&got), entry);
        // Nested structs and arrays of structs are sized; enums too.
        assert_eq!(size_of_layout("[struct8{a@0:u32,b@4:u32,};3]"), Some(24));
        assert_eq!(size_of_layout("enum4{A=0,B=1,}"), Some(4));
        assert_eq!(size_of_layout("[[u16;2];4]"), Some(16));
        assert_eq!(size_of_layout("u3"), None);
        let nested = "struct12{a@0:struct8{x@0:u32,y@4:u32,},b@8:u32,}";
        assert_eq!(Remap::between(nested, nested).unwrap().moves, [(0, 0, 8), (8, 8, 4)]);
    }

    #[test]
    fn no_remap_where_a_field_changed_meaning_or_nothing_is_shared() {
        let old = "struct8{a@0:u32,b@4:u32,}";
        // Retyped under its name.
        assert_eq!(Remap::between(old, "struct8{a@0:u32,b@4:i32,}"), None);
        assert_eq!(Remap::between(old, "struct12{a@0:u32,b@4:u64,}"), None);
        // Nothing in common, or not structs.
        assert_eq!(Remap::between(old, "struct8{c@0:u64,}"), None);
        assert_eq!(Remap::between("u32", "u32"), None);
        // A bitfield.
        assert_eq!(Remap::between("struct4{a@0b3:u32,}", "struct4{a@0b3:u32,}"), None);
        // Renamed members are new ones: zero.
        let r = Remap::between(old, "struct8{a@0:u32,c@4:u32,}").unwrap();
        assert_eq!(r.apply(&[1, 2, 3, 4, 5, 6, 7, 8]), [1, 2, 3, 4, 0, 0, 0, 0]);
        // Unnamed or twice-named members cannot be told apart.
        assert_eq!(Remap::between("struct8{@0:u32,a@4:u32,}", old), None);
        assert_eq!(Remap::between("struct8{a@0:u32,a@4:u32,}", old), None);
        // A field that took part of the padding: the rest is padding still.
        let r = Remap::between("struct8{a@0:u32,_pad@4:u32,}", "struct8{a@0:u32,b@4:u16,_pad@6:[u8;2],}").unwrap();
        assert_eq!(r.apply(&[1, 2, 3, 4, 9, 9, 9, 9]), [1, 2, 3, 4, 0, 0, 0, 0]);
    }

    #[test]
    fn our_object_describes_every_pinned_map() {
        let got = object_layouts(super::super::loader::OBJ).unwrap();
        for m in lb_common::maps::ALL {
            assert!(got.contains_key(m), "{m} has no BTF layout: {:?}", got.keys());
        }
        let svc = &got[lb_common::maps::SERVICES4];
        assert!(svc.value.starts_with(&format!("struct{}{{", size_of::<lb_common::SvcValue>())), "{svc:?}");
        assert!(svc.value.contains("count@"), "field names are part of the layout: {svc:?}");
        assert_eq!(got[lb_common::maps::BACKENDS4].key, "u32");
    }
}
