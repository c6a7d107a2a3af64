//! Upgrades of the pinned maps: which pinned maps this agent cannot use as
//! they are (type, sizes, max_entries, BTF layout, layout version), where
//! their replacements are staged (`next/`), and carrying the datapath's
//! state over to them.
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use lb_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend4, Backend6, Nat4Entry, Nat4Key, Nat6Entry, Nat6Key, NodeConfig,
    NodePortKey, RevNat4, RevNat6, SockRevNat4Key, SockRevNat4Value, SockRevNat6Key, SockRevNat6Value, Svc4Key, Svc6Key, SvcValue,
    maps,
};

use super::loader::{Capacity, OBJ};

/// The staging directory of an upgrade: new maps wait here, pinned, until
/// the agent has filled them and swaps them in.
pub(super) const NEXT: &str = "next";

/// The pin-dir entry that records the layout version of the pins (in
/// `next/` too: the layout of the staged maps).
pub(super) const LAYOUT_MARKER: &str = "layout-";

/// The `next/` entry that says the programs began to move to the staged
/// maps: from then on they are live, and the upgrade can only be finished,
/// not started over.
pub(super) const MOVING: &str = "moving";

/// The `next/` entry that says the second copy (`Pass::Late`) is done: the
/// datapath counters, which it adds up, are not added twice.
pub(super) const LATE_DONE: &str = "late-copy-done";

/// The `next/` entries `INPLACE` + a map's name: a map the pins lacked
/// (one this version adds), which the staging agent pins in place, as its
/// own, rather than stage: it has nothing to be copied from.
pub(super) const INPLACE: &str = "inplace-";

/// Mark `next/` with `name`: a symlink (an agent from before these markers
/// removes every entry of `next/` with unlink, which a directory fails).
pub(super) fn mark_next(bpffs: &Path, name: &str) -> Result<()> {
    match std::os::unix::fs::symlink(name, bpffs.join(NEXT).join(name)) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(e).with_context(|| format!("mark {NEXT}/{name}")),
        _ => Ok(()),
    }
}

/// Whether `next/` carries marker `name` (a symlink to itself: `exists()`,
/// which follows it, says no).
pub(super) fn marked(bpffs: &Path, name: &str) -> bool {
    fs::symlink_metadata(bpffs.join(NEXT).join(name)).is_ok()
}

fn is_marker(name: &str) -> bool {
    name.starts_with(LAYOUT_MARKER) || name.starts_with(INPLACE) || name == LATE_DONE || name == MOVING
}

/// The layout version the maps in `next/` were staged with (none: staged
/// by an agent from before `next/` carried it).
fn staged_version(next: &Path) -> Option<String> {
    layout_marks(next).into_iter().next()
}

/// The layout versions the markers in `dir` name.
fn layout_marks(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().strip_prefix(LAYOUT_MARKER).map(String::from))
        .collect()
}

/// The maps staged in `next/` that this agent knows.
fn staged_names(bpffs: &Path) -> Vec<&'static str> {
    maps::ALL.iter().copied().filter(|m| bpffs.join(NEXT).join(m).exists()).collect()
}

/// Remove `next/` and what it holds: staged maps' pins, then the markers,
/// `MOVING` last (an agent killed in here leaves it while anything is left).
pub(super) fn remove_next(next: &Path) -> Result<()> {
    let mut entries: Vec<(bool, bool, PathBuf)> = fs::read_dir(next)?
        .flatten()
        .map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            (is_marker(&n), n == MOVING, e.path())
        })
        .collect();
    entries.sort();
    for (_, _, p) in entries {
        let dir = fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir());
        if dir { fs::remove_dir(&p) } else { fs::remove_file(&p) }.with_context(|| format!("unpin {}", p.display()))?;
    }
    fs::remove_dir(next).with_context(|| format!("remove {}", next.display()))
}

/// What an earlier agent's unfinished upgrade (`next/` there) means for
/// this one.
pub(super) enum Unfinished {
    /// Staged by this agent's version, as this agent would stage them
    /// (the same maps, each with its type, sizes, max_entries and BTF
    /// layout): this agent takes them as its own staging and finishes the
    /// upgrade from its first sync, moving every program (also those the
    /// earlier agent had moved: they are on these maps already).
    Resume(Vec<&'static str>),
    /// Another version's or another staging (a flag changed too), whose
    /// programs began to move: the staged maps are live; finish that
    /// upgrade as it would have (`finish_moved`), then judge the pins.
    Finish,
    /// Nothing moved: the staged maps were never used; drop them.
    Drop,
}

/// Judge `next/` (see `Unfinished`).
pub(super) fn unfinished(bpffs: &Path, cap: &Capacity) -> Result<Unfinished> {
    let next = bpffs.join(NEXT);
    let staged = staged_names(bpffs);
    if !staged.is_empty() && staged_version(&next).as_deref() == Some(layout_version().as_str()) {
        // Each as this agent would stage it: its type, sizes and BTF
        // layout, and its max_entries.
        let layout = expected_layout(cap);
        let ours_in = |dir: &Path, name: &str| {
            layout.iter().any(|(n, .., max)| {
                *n == name && readable_as_ours(dir, n, cap) && aya::maps::MapInfo::from_pin(dir.join(n)).is_ok_and(|i| i.max_entries() == *max)
            })
        };
        let as_ours = staged.iter().all(|n| ours_in(&next, n));
        // A map the old pins lacked (one this version adds) was pinned in
        // place by the agent that staged the rest, as ours: not staged, and
        // nothing to stage. Only those it marked so: a map that is missing
        // from a staging cut short (killed, or out of memory, between two
        // pins) is not one.
        let inplace = |n: &str| marked(bpffs, &format!("{INPLACE}{n}")) && ours_in(bpffs, n);
        let mut want: Vec<&'static str> = incompatible(bpffs, cap)?.into_iter().filter(|n| staged.contains(n) || !inplace(n)).collect();
        want.sort_unstable();
        let mut have = staged.clone();
        have.sort_unstable();
        if as_ours && want == have {
            return Ok(Unfinished::Resume(staged));
        }
    }
    Ok(if marked(bpffs, MOVING) || staged_in_use(bpffs)? { Unfinished::Finish } else { Unfinished::Drop })
}

/// Whether the maps staged in `next/` are in use: a program behind one of
/// the pinned links reads one of them. For a `next/` staged by an agent
/// from before `MOVING` (which says so for later ones, also where programs
/// attach as netlink filters, which are not links): its upgrade had begun
/// to move its programs (the cgroup links move first, all pinned) when it
/// stopped.
fn staged_in_use(bpffs: &Path) -> Result<bool> {
    use aya::programs::links::{FdLink, PinnedLink};
    let next = bpffs.join(NEXT);
    let staged: std::collections::BTreeSet<u32> =
        maps::ALL.iter().filter_map(|m| aya::maps::MapInfo::from_pin(next.join(m)).ok()).map(|i| i.id()).collect();
    if staged.is_empty() {
        return Ok(false);
    }
    let mut progs = std::collections::BTreeSet::new();
    for e in fs::read_dir(bpffs.join("links")).into_iter().flatten().flatten() {
        // Dropping the handle leaves the link: the pin holds it.
        if let Ok(info) = PinnedLink::from_pin(e.path()).map(FdLink::from).and_then(|l| l.info()) {
            progs.insert(info.program_id());
        }
    }
    for p in aya::programs::loaded_programs().filter_map(|p| p.ok()).filter(|p| progs.contains(&p.id())) {
        let ids = p.map_ids().context("the maps of an attached program")?.unwrap_or_default();
        if ids.iter().any(|id| staged.contains(id)) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Finish the upgrade of an agent killed after its programs began to use
/// the staged maps (`Unfinished::Finish`), as it would have: the second
/// copy (what its old programs added to the old maps since its first
/// copy) unless it was made, then the staged maps in place of the old
/// ones, and the staged layout's version recorded ("unknown" where an
/// agent from before `next/` carried it staged them: the next
/// `incompatible` then replaces every map once more, carrying their state;
/// slower, not wrong). Programs still on the old maps (devices it had not
/// moved yet) keep them until this agent moves them. Safe to repeat (an
/// agent killed in here too). Returns how many entries were copied.
pub(super) fn finish_moved(bpffs: &Path) -> Result<usize> {
    let next = bpffs.join(NEXT);
    let staged: Vec<&'static str> = staged_names(bpffs).into_iter().filter(|m| bpffs.join(m).exists()).collect();
    let copied = if marked(bpffs, LATE_DONE) { 0 } else { carry_state(bpffs, &staged, Pass::Late) };
    mark_next(bpffs, LATE_DONE)?;
    // Every map pin, also one of a map this agent does not know (the
    // killed agent's programs use it).
    let mut moved = 0;
    for e in fs::read_dir(&next)?.flatten() {
        if !is_marker(&e.file_name().to_string_lossy()) {
            fs::rename(e.path(), bpffs.join(e.file_name())).with_context(|| format!("move {} in place", e.path().display()))?;
            moved += 1;
        }
    }
    // The staged layout's version; where `next/` no longer has it, the
    // killed agent had recorded it in the pin dir already (it goes from
    // `next/` only after that: `finish_upgrade`, and here), unless maps
    // came from an agent from before `next/` carried it.
    match staged_version(&next) {
        Some(version) => mark_layout(bpffs, &version)?,
        None if moved > 0 => mark_layout(bpffs, "unknown")?,
        None => {}
    }
    remove_next(&next)?;
    Ok(copied)
}

/// Where the pin of map `name` is now: staged in `next/` during an upgrade
/// that replaces it, else in `bpffs`.
pub fn pin_path(bpffs: &Path, name: &str) -> PathBuf {
    staged_pin(bpffs, name).unwrap_or_else(|| bpffs.join(name))
}

/// The pin of the map `name` the running programs use (until an upgrade
/// finishes: the old one, not the staged one), where the staged one has
/// its layout (its entries read the same); else the staged one. For what
/// an earlier agent left that this one must know before its programs
/// move (its node flags, its flows masqueraded in BPF).
pub fn live_pin(bpffs: &Path, name: &str) -> PathBuf {
    // The programs began to move (an earlier agent killed then, whose
    // upgrade this one resumes): the staged maps are the live ones.
    if marked(bpffs, MOVING) {
        return pin_path(bpffs, name);
    }
    old_pin(bpffs, name).unwrap_or_else(|| pin_path(bpffs, name))
}

/// The pin of the kernel's NAT expiry timer that walks the NAT tables the
/// programs use now: outside an upgrade, or once its programs began to
/// move, this agent's; while an upgrade waits, the earlier agent's, unless
/// this agent stages a timer of its own beside NAT tables it keeps (which
/// it armed at start: it walks the live tables too). `None` where that
/// earlier timer is of another layout (unreadable).
pub fn nat_timer_pin(bpffs: &Path) -> Option<PathBuf> {
    use lb_common::maps::{NAT4, NAT6, NAT_TIMER};
    let Some(staged) = staged_pin(bpffs, NAT_TIMER) else { return Some(bpffs.join(NAT_TIMER)) };
    if marked(bpffs, MOVING) || (staged_pin(bpffs, NAT4).is_none() && staged_pin(bpffs, NAT6).is_none()) {
        return Some(staged);
    }
    old_pin(bpffs, NAT_TIMER)
}

/// The old pin of map `name` while an upgrade stages a replacement of
/// its layout (its entries read the same), which programs not moved yet
/// still use: for the NAT thread, which expires its flows too.
pub fn old_pin(bpffs: &Path, name: &str) -> Option<PathBuf> {
    let staged = staged_pin(bpffs, name)?;
    let old = bpffs.join(name);
    (layouts_agree(&old, &staged, &mut super::btf::BtfCache::default()) == (true, true)).then_some(old)
}

/// Of the upgrade staged in `bpffs/next`: whether its programs began to
/// move, and whether its second copy (which adds the old counters to the
/// staged ones) was made.
pub fn upgrade_marks(bpffs: &Path) -> (bool, bool) {
    (marked(bpffs, MOVING), marked(bpffs, LATE_DONE))
}

/// The pin of map `name` staged by an upgrade this agent has not finished
/// (until then the programs use the one in `bpffs`), if any.
pub fn staged_pin(bpffs: &Path, name: &str) -> Option<PathBuf> {
    Some(bpffs.join(NEXT).join(name)).filter(|p| p.exists())
}

/// The layout version of the maps this agent uses (lb_common::LAYOUT_VERSION;
/// LB_LAYOUT_VERSION overrides it, for the upgrade test only).
pub(super) fn layout_version() -> String {
    std::env::var("LB_LAYOUT_VERSION").unwrap_or_else(|_| lb_common::LAYOUT_VERSION.to_string())
}

/// The layout version the pins in `dir` carry ("1": pinned by an agent from
/// before versions were recorded).
/// Two markers are left by an agent killed inside `mark_layout`: the one
/// it was writing is made only once the pins have that layout, so it is
/// the pins' layout where it is this agent's.
pub(super) fn pinned_layout_version(dir: &Path) -> String {
    let marks = layout_marks(dir);
    let ours = layout_version();
    if marks.contains(&ours) {
        return ours;
    }
    marks.into_iter().next().unwrap_or_else(|| "1".into())
}

/// Record `version` as the layout of the pins in `dir`: the new marker
/// first, then the others go, so that an agent killed in between leaves
/// the new one (with a marker too many, which `pinned_layout_version`
/// reads as another version only if it finds that one first: the next
/// start then replaces the maps once more, a slow start, not a wrong one),
/// never none (read as layout "1": every map replaced).
pub(super) fn mark_layout(dir: &Path, version: &str) -> Result<()> {
    let mark = format!("{LAYOUT_MARKER}{version}");
    fs::create_dir_all(dir.join(&mark)).context("record the layout version")?;
    for e in fs::read_dir(dir)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(LAYOUT_MARKER) && name != mark {
            fs::remove_dir(e.path())?;
        }
    }
    Ok(())
}

/// Every map with the type, key size, value size and max_entries this agent
/// gives it.
pub(super) fn expected_layout(cap: &Capacity) -> [(&'static str, aya::maps::MapType, usize, usize, u32); 35] {
    use aya::maps::MapType as T;
    use lb_common::capacity as c;
    let revnat = cap.services.min(u16::MAX as u32);
    [
        (maps::NAT4, T::Hash, size_of::<Nat4Key>(), size_of::<Nat4Entry>(), cap.nat),
        (maps::NAT6, T::Hash, size_of::<Nat6Key>(), size_of::<Nat6Entry>(), cap.nat),
        (maps::SRC_RANGE, T::LpmTrie, 4 + size_of::<lb_common::SrcRange>(), size_of::<u8>(), c::SRC_RANGE),
        (maps::NODE_CONFIG, T::Array, size_of::<u32>(), size_of::<NodeConfig>(), 1),
        (maps::NODEPORTS, T::Hash, size_of::<NodePortKey>(), size_of::<u8>(), c::NODEPORTS),
        (maps::SERVICES4, T::Hash, size_of::<Svc4Key>(), size_of::<SvcValue>(), cap.services),
        (maps::BACKENDS4, T::Hash, size_of::<u32>(), size_of::<Backend4>(), cap.backends),
        (maps::REVNAT4, T::Hash, size_of::<u16>(), size_of::<RevNat4>(), revnat),
        (maps::SOCK_REVNAT4, T::LruHash, size_of::<SockRevNat4Key>(), size_of::<SockRevNat4Value>(), cap.sock_revnat),
        (maps::SERVICES6, T::Hash, size_of::<Svc6Key>(), size_of::<SvcValue>(), cap.services),
        (maps::BACKENDS6, T::Hash, size_of::<u32>(), size_of::<Backend6>(), cap.backends),
        (maps::REVNAT6, T::Hash, size_of::<u16>(), size_of::<RevNat6>(), revnat),
        (maps::SOCK_REVNAT6, T::LruHash, size_of::<SockRevNat6Key>(), size_of::<SockRevNat6Value>(), cap.sock_revnat),
        (maps::AFFINITY, T::LruHash, size_of::<AffinityKey>(), size_of::<AffinityValue>(), c::AFFINITY),
        (maps::AFFINITY_MATCH, T::Hash, size_of::<AffinityMatchKey>(), size_of::<u8>(), cap.backends),
        (maps::STATS, T::PerCpuArray, size_of::<u32>(), size_of::<u64>(), lb_common::stats::COUNT),
        (maps::SOCK_XLATE, T::SkStorage, size_of::<i32>(), size_of::<lb_common::SockXlate>(), 0),
        (maps::SOCK_CHECK, T::SkStorage, size_of::<i32>(), size_of::<lb_common::SockCheck>(), 0),
        (maps::SOCK_PENDING, T::SkStorage, size_of::<i32>(), size_of::<u64>(), 0),
        (maps::SVC_STATS, T::Hash, size_of::<lb_common::SvcStatsKey>(), size_of::<lb_common::SvcStats>(), revnat + cap.backends),
        (maps::MONITOR, T::Array, size_of::<u32>(), size_of::<u64>(), lb_common::monitor::SLOTS + 1),
        (maps::EVENTS[0], T::RingBuf, 0, 0, lb_common::monitor::RING_BYTES),
        (maps::EVENTS[1], T::RingBuf, 0, 0, lb_common::monitor::RING_BYTES),
        (maps::EVENTS[2], T::RingBuf, 0, 0, lb_common::monitor::RING_BYTES),
        (maps::EVENTS[3], T::RingBuf, 0, 0, lb_common::monitor::RING_BYTES),
        (maps::MAGLEV4, T::HashOfMaps, size_of::<lb_common::MaglevKey>(), size_of::<u32>(), 4 * revnat),
        (maps::MAGLEV6, T::HashOfMaps, size_of::<lb_common::MaglevKey>(), size_of::<u32>(), 4 * revnat),
        (maps::SOCK_UDP, T::Hash, size_of::<u64>(), size_of::<lb_common::SockXlate>(), cap.sock_revnat),
        (maps::XDP_DEVS, T::Hash, size_of::<u32>(), size_of::<u32>(), lb_common::xdp_dev::CAPACITY),
        (maps::FRAG4, T::LruHash, size_of::<lb_common::FragKey>(), size_of::<lb_common::FragPorts>(), c::FRAG),
        (maps::FRAG6, T::LruHash, size_of::<lb_common::Frag6Key>(), size_of::<lb_common::FragPorts>(), c::FRAG),
        (maps::ROUTE_MTU, T::LpmTrie, 4 + size_of::<lb_common::RouteKey>(), size_of::<lb_common::RouteMtu>(), c::ROUTE_MTU),
        (maps::LOCAL4, T::Hash, 4, size_of::<u8>(), c::LOCAL4),
        (maps::NAT_GC, T::Array, size_of::<u32>(), size_of::<lb_common::NatGc>(), 1),
        (maps::NAT_TIMER, T::Array, size_of::<u32>(), size_of::<lb_common::NatTimer>(), 1),
    ]
}

/// The pinned maps in `dir` this agent cannot use as they are: another map
/// type, key or value size, or max_entries (a `--max-*` flag changed),
/// another BTF layout of key or value (a change of meaning at the same
/// size: fields swapped, renamed or retyped), or all of them when the pins
/// carry another layout version. Each is replaced by an upgrade.
pub(super) fn incompatible(dir: &Path, cap: &Capacity) -> Result<Vec<&'static str>> {
    let version_changed = pinned_layout_version(dir) != layout_version();
    let ours = super::btf::object_layouts(OBJ).context("read the BTF of this agent's maps")?;
    let mut out = Vec::new();
    // Those whose entries' layout changed (not their number, nor the
    // layout version alone).
    let mut restructured = Vec::new();
    let mut btf = super::btf::BtfCache::default();
    for (name, ty, k, v, max) in expected_layout(cap) {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let info = aya::maps::MapInfo::from_pin(&path).with_context(|| format!("inspect pinned map {}", path.display()))?;
        let got = info.map_type().ok();
        let shape = got == Some(ty) && info.key_size() as usize == k && info.value_size() as usize == v;
        let same = shape && info.max_entries() == max;
        // A map pinned without BTF (by an agent from before BTF maps) is
        // judged by its sizes and the layout version alone.
        let btf_changed = match (super::btf::pinned_layout(&path, &mut btf), ours.get(name)) {
            (Ok(Some(pinned)), Some(want)) if pinned != *want => {
                tracing::info!(map = name, pinned = ?pinned, wanted = ?want, "pinned map's BTF layout differs");
                true
            }
            (Err(e), _) => {
                tracing::warn!(map = name, error = format!("{e:#}"), "cannot read the pinned map's BTF; it is replaced");
                true
            }
            _ => false,
        };
        if btf_changed || !shape {
            restructured.push(name);
        }
        // Socket storage cannot be copied: a new map loses every live
        // socket's translation (getpeername's and recvmsg's rewriting, the
        // destroyer's match when its endpoint leaves). It goes where its
        // own layout changed, or the ids it holds are numbered afresh
        // (below), not for a new layout version alone (before 12-06 every
        // layout-version upgrade replaced it). A change of meaning at the
        // same layout must change the BTF (a field's name).
        let storage = ty == aya::maps::MapType::SkStorage;
        if (version_changed && !storage) || btf_changed || !same {
            tracing::info!(
                map = name,
                pinned = format!("{got:?} {}/{} x{}", info.key_size(), info.value_size(), info.max_entries()),
                wanted = format!("{ty:?} {k}/{v} x{max}"),
                version_changed,
                btf_changed,
                "pinned map gets a new layout"
            );
            out.push(name);
        }
    }
    // The maps that hold frontend and backend ids, or are keyed by them, go
    // together: until the programs move, the old ones must read only maps
    // of one numbering. (A new backends map beside the live services map
    // had the first sync write the new numbering's ids into the slots the
    // old programs read, and resolve them in the old backends map: a
    // connect went to whatever backend held that id there, another
    // Service's, or was refused.)
    if out.iter().any(|m| SERVICES_GROUP.contains(m)) {
        for m in SERVICES_GROUP {
            if !out.contains(&m) && dir.join(m).exists() {
                tracing::info!(map = m, "pinned map gets a new layout: it goes with the services maps, whose ids it holds");
                out.push(m);
            }
        }
    }
    // The socket storage names frontends by id (`rev_nat_id`): where a
    // rev-NAT map changes its own layout, `carry_ids` cannot carry the ids
    // and frontends are numbered afresh; the storage goes with them (an id
    // that names another frontend would check a socket's packets against
    // that one's loadBalancerSourceRanges). `LB_SOCK_PENDING` holds
    // backend ids too (its connections would be counted to another).
    let renumbered = |ids: [&str; 2]| restructured.iter().any(|m| ids.contains(m));
    let frontends = renumbered([maps::REVNAT4, maps::REVNAT6]);
    let backends = renumbered([maps::BACKENDS4, maps::BACKENDS6]);
    for (m, goes) in [(maps::SOCK_XLATE, frontends), (maps::SOCK_CHECK, frontends), (maps::SOCK_PENDING, frontends || backends)] {
        if goes && !out.contains(&m) && dir.join(m).exists() {
            tracing::info!(map = m, "pinned map gets a new layout: the ids it holds are numbered afresh");
            out.push(m);
        }
    }
    // New services maps may number frontends and backends afresh: the
    // counters keyed by their ids move to a new map too, by what each id
    // stands for (`copy_svc_stats`), even where their own layout is kept.
    let ids = [maps::REVNAT4, maps::REVNAT6, maps::BACKENDS4, maps::BACKENDS6];
    if out.iter().any(|m| ids.contains(m)) && !out.contains(&maps::SVC_STATS) && dir.join(maps::SVC_STATS).exists() {
        tracing::info!(map = maps::SVC_STATS, "pinned map gets a new layout: its ids are renumbered with the services maps");
        out.push(maps::SVC_STATS);
    }
    // A new socket storage map leaves the storage of the old one to go with
    // it, never released by a program: `copy_counters` counts it released,
    // from the old datapath counters, which only the old programs wrote.
    if out.contains(&maps::SOCK_XLATE) && !out.contains(&maps::STATS) && dir.join(maps::STATS).exists() {
        tracing::info!(map = maps::STATS, "pinned map gets a new layout: the socket storage it counts is replaced");
        out.push(maps::STATS);
    }
    Ok(out)
}

/// Whether the pinned map `name` in `dir` has the type, key and value
/// sizes and the BTF layout of this agent's (its max_entries aside): the
/// new programs can read its entries as they are. For the old NAT tables
/// during an upgrade (`LB4_NAT_PREV`).
pub(super) fn readable_as_ours(dir: &Path, name: &str, cap: &Capacity) -> bool {
    let Some((_, ty, k, v, _)) = expected_layout(cap).into_iter().find(|(n, ..)| *n == name) else { return false };
    let Ok(info) = aya::maps::MapInfo::from_pin(dir.join(name)) else { return false };
    if info.map_type().ok() != Some(ty) || info.key_size() as usize != k || info.value_size() as usize != v {
        return false;
    }
    let Ok(ours) = super::btf::object_layouts(OBJ) else { return false };
    match (super::btf::pinned_layout(&dir.join(name), &mut super::btf::BtfCache::default()), ours.get(name)) {
        (Ok(Some(pinned)), Some(want)) => pinned == *want,
        // Pinned without BTF: the sizes and the layout version say; a new
        // version may read the same bytes otherwise.
        (Ok(None), _) => pinned_layout_version(dir) == layout_version(),
        _ => false,
    }
}

/// The maps of the frontends and backends and those that hold their ids:
/// replaced all together or not at all (`incompatible`).
const SERVICES_GROUP: [&str; 10] = [
    maps::SERVICES4,
    maps::SERVICES6,
    maps::BACKENDS4,
    maps::BACKENDS6,
    maps::REVNAT4,
    maps::REVNAT6,
    maps::AFFINITY_MATCH,
    maps::SRC_RANGE,
    maps::MAGLEV4,
    maps::MAGLEV6,
];

/// Whether the staged map `new` has the old one's type, key and value
/// sizes, and whether it has its BTF layout: (same sizes, same BTF).
/// Entries carry over as they are only where both hold.
fn layouts_agree(old: &Path, new: &Path, btf: &mut super::btf::BtfCache) -> (bool, bool) {
    let same_sizes = match (aya::maps::MapInfo::from_pin(old), aya::maps::MapInfo::from_pin(new)) {
        (Ok(a), Ok(b)) => a.key_size() == b.key_size() && a.value_size() == b.value_size() && a.map_type().ok() == b.map_type().ok(),
        _ => false,
    };
    // Same sizes but another BTF layout: the bytes mean something else.
    let same_btf = match (super::btf::pinned_layout(old, btf), super::btf::pinned_layout(new, btf)) {
        (Ok(Some(a)), Ok(Some(b))) => a == b,
        (Ok(None), Ok(_)) | (Ok(_), Ok(None)) => true,
        _ => false,
    };
    (same_sizes, same_btf)
}

/// How the entries of the map pinned at `old` become entries of `new`,
/// where their values' layouts differ by fields added or removed
/// (`btf::Remap`) and their keys and types are the same.
fn remap_of(old: &Path, new: &Path, btf: &mut super::btf::BtfCache) -> Option<super::btf::Remap> {
    let (Ok(Some(a)), Ok(Some(b))) = (super::btf::pinned_layout(old, btf), super::btf::pinned_layout(new, btf)) else { return None };
    let (ia, ib) = (aya::maps::MapInfo::from_pin(old).ok()?, aya::maps::MapInfo::from_pin(new).ok()?);
    if a.key != b.key || ia.key_size() != ib.key_size() || ia.map_type().ok()? != ib.map_type().ok()? {
        return None;
    }
    let r = super::btf::Remap::between(&a.value, &b.value)?;
    (r.old_size == ia.value_size() as usize && r.new_size == ib.value_size() as usize).then_some(r)
}

/// Copy the entries of the map pinned at `old` into `new` through `remap`,
/// never over an entry already there. Returns how many were copied.
fn copy_remapped(old: &Path, new: &Path, remap: &super::btf::Remap) -> Result<usize> {
    use aya::maps::MapData;
    let (from, to) = (MapData::from_pin(old)?, MapData::from_pin(new)?);
    let key_size = aya::maps::MapInfo::from_pin(old)?.key_size() as usize;
    let (keys, values) = super::maps::lookup_all_raw(&from, key_size, remap.old_size).with_context(|| format!("read {}", old.display()))?;
    // Only what the new map lacks is written (the second pass runs while
    // the new programs read it: a whole table of failing writes would
    // hold back the entries it lacks).
    let (present, _) = super::maps::lookup_all_raw(&to, key_size, remap.new_size).with_context(|| format!("read {}", new.display()))?;
    let present: std::collections::HashSet<&[u8]> = present.chunks_exact(key_size).collect();
    let (mut n, mut lost) = (0, Lost::default());
    for (k, v) in keys.chunks_exact(key_size).zip(values.chunks_exact(remap.old_size)).filter(|(k, _)| !present.contains(k)) {
        // BPF_NOEXIST: never overwrite what the new programs wrote.
        match super::maps::update_raw(&to, k, &remap.apply(v), 1) {
            Ok(()) => n += 1,
            Err(e) => lost.note(e),
        }
    }
    lost.warn(new);
    Ok(n)
}

/// Entries a copy could not write, other than those the new programs
/// wrote first (EEXIST: theirs stands): the new hash map full (a `--max-*`
/// lowered below what the old one holds), say. Said per map and pass. (An
/// LRU map, the socket rev-NAT's, takes every write: a smaller one evicts
/// its least recently used entries instead, which no error tells.)
#[derive(Default)]
struct Lost {
    count: usize,
    first: Option<std::io::Error>,
}

impl Lost {
    fn note(&mut self, e: std::io::Error) {
        if e.raw_os_error() == Some(libc::EEXIST) {
            return;
        }
        self.count += 1;
        self.first.get_or_insert(e);
    }

    fn warn(self, new: &Path) {
        if let Some(e) = self.first {
            let map = new.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            tracing::warn!(
                map,
                entries = self.count,
                "upgrade: entries not carried into the new map ({e}; full: a --max-* flag lowered below what the old map holds?): \
                 their flows, affinities or translations start over once the programs move"
            );
        }
    }
}

/// Copy the entries of hash map `old` into `new` (`lru`: LRU hash maps),
/// never over an entry already there. Returns how many were copied.
///
/// Both maps are read in batches (a few thousand entries per system call),
/// and only the entries `new` lacks are written, one by one (BPF_NOEXIST,
/// which batch writes do not take): the second pass runs while the new
/// programs already read the new maps, and a flow the old programs made
/// after the first pass has no entry there until this copies it (read
/// and written entry by entry, a full NAT table took about a second, and
/// such a connection's packets meanwhile met no flow and were reset); now
/// it writes only what the old programs added since the first pass.
fn copy<K: aya::Pod + Default, V: aya::Pod + Default>(old: &Path, new: &Path, lru: bool) -> Result<usize> {
    use aya::maps::{HashMap, Map, MapData};
    let (from, to) = (MapData::from_pin(old)?, MapData::from_pin(new)?);
    let entries = super::maps::lookup_all::<K, V>(&from).with_context(|| format!("read {}", old.display()))?;
    let bytes = |k: &K| -> Vec<u8> {
        // SAFETY: K is Pod: plain bytes, every one initialised.
        unsafe { std::slice::from_raw_parts((k as *const K).cast::<u8>(), size_of::<K>()) }.to_vec()
    };
    let present: std::collections::HashSet<Vec<u8>> =
        super::maps::lookup_all::<K, V>(&to).with_context(|| format!("read {}", new.display()))?.iter().map(|(k, _)| bytes(k)).collect();
    let wrap = |d: MapData| if lru { Map::LruHashMap(d) } else { Map::HashMap(d) };
    let mut to: HashMap<MapData, K, V> = HashMap::try_from(wrap(to))?;
    let (mut n, mut lost) = (0, Lost::default());
    for (k, v) in entries.into_iter().filter(|(k, _)| !present.contains(&bytes(k))) {
        // BPF_NOEXIST: never overwrite what the new programs wrote.
        match to.insert(k, v, 1) {
            Ok(()) => n += 1,
            Err(aya::maps::MapError::SyscallError(e)) => lost.note(e.io_error),
            Err(e) => lost.note(std::io::Error::other(e)),
        }
    }
    lost.warn(new);
    Ok(n)
}

/// Before the first sync reads the staged maps: the frontends' and
/// backends' ids (the rev-NAT and backends maps) copied into the staged
/// ones where their layout is kept and they fit, so that the first sync
/// gives every frontend and backend the id it had. What keeps ids across
/// the move: the sockets' translations, NAT flows, sessionAffinity and the
/// counters name them. Returns how many were copied.
pub(super) fn carry_ids(bpffs: &Path, replaced: &[&'static str]) -> usize {
    let mut btf = super::btf::BtfCache::default();
    let mut total = 0;
    for name in [maps::REVNAT4, maps::REVNAT6, maps::BACKENDS4, maps::BACKENDS6] {
        if !replaced.contains(&name) {
            continue;
        }
        let (old, new) = (bpffs.join(name), bpffs.join(NEXT).join(name));
        if layouts_agree(&old, &new, &mut btf) != (true, true) {
            tracing::warn!(map = name, "upgrade: another layout: frontends and backends are numbered afresh");
            continue;
        }
        let r = match name {
            maps::REVNAT4 => copy::<u16, RevNat4>(&old, &new, false),
            maps::REVNAT6 => copy::<u16, RevNat6>(&old, &new, false),
            maps::BACKENDS4 => copy::<u32, Backend4>(&old, &new, false),
            _ => copy::<u32, Backend6>(&old, &new, false),
        };
        match r {
            Ok(n) => total += n,
            // A smaller map (a lower --max-*): what did not fit is
            // numbered afresh.
            Err(e) => tracing::warn!(map = name, "upgrade: carrying ids over: {e:#}"),
        }
    }
    total
}

/// Copy the entries of the state maps the datapath writes (sessionAffinity,
/// socket tracking, NAT, fragments, counters) from their old pins to the staged new maps, where
/// key and value sizes and their BTF layouts agree (the new map may be
/// larger or smaller: a `--max-*` change); entries already in the new map
/// win. Returns how many were copied.
///
/// Called twice (`Pass`): before the programs move to the new maps, and
/// after, for what the old programs added meanwhile. The first pass says
/// which maps' entries cannot come along. The datapath counters, which add
/// up rather than fill in, are carried in the second pass only, once no
/// program counts into the old map any more.
pub(super) fn carry_state(bpffs: &Path, replaced: &[&'static str], pass: Pass) -> usize {
    let warn = pass == Pass::First;
    let mut total = 0;
    let mut btf = super::btf::BtfCache::default();
    // The datapath counters last: their copy adds up, and `LATE_DONE`,
    // which keeps it from being made twice, is marked right after.
    let ordered = replaced.iter().filter(|n| **n != maps::STATS).chain(replaced.iter().filter(|n| **n == maps::STATS));
    for name in ordered {
        let (old, new) = (bpffs.join(name), bpffs.join(NEXT).join(name));
        let (same_sizes, same_btf) = layouts_agree(&old, &new, &mut btf);
        if *name == maps::STATS {
            // The datapath counters: the old ones, index by index (a new
            // counter starts at zero), so that none goes back.
            if pass == Pass::First {
                continue;
            }
            match copy_counters(&old, &new, replaced.contains(&maps::SOCK_XLATE)) {
                Ok(n) => total += n,
                Err(e) => tracing::warn!(map = name, "upgrade: carrying counters over: {e:#}"),
            }
            continue;
        }
        if *name == maps::SVC_STATS {
            // Per frontend and backend, by what each id stands for; from
            // before `source_range` (40 bytes), with it at zero; so that
            // no counter goes back, nor lands on another Service.
            match copy_svc_stats(bpffs, &old, &new) {
                Ok(n) => total += n,
                Err(e) => tracing::warn!(map = name, "upgrade: carrying counters over: {e:#}"),
            }
            continue;
        }
        if *name == maps::AFFINITY && same_sizes && !same_btf && affinity_before_proto(&old, &new, &mut btf) {
            match copy_affinity_adding_proto(bpffs, &old, &new) {
                Ok(n) => total += n,
                Err(e) => tracing::warn!(map = name, "upgrade: carrying entries over: {e:#}"),
            }
            continue;
        }
        const STATE: [&str; 8] = [maps::AFFINITY, maps::SOCK_REVNAT4, maps::SOCK_REVNAT6, maps::NAT4, maps::NAT6, maps::FRAG4, maps::FRAG6, maps::SOCK_UDP];
        if !same_sizes || !same_btf {
            // A field added or removed: carried by name, where the key
            // is the same and no field changed under its name.
            if STATE.contains(name)
                && let Some(remap) = remap_of(&old, &new, &mut btf)
            {
                if warn {
                    tracing::info!(map = name, from = remap.old_size, to = remap.new_size, "upgrade: its entries have another layout: carried field by field (a new field starts at zero)");
                }
                match copy_remapped(&old, &new, &remap) {
                    Ok(n) => total += n,
                    Err(e) => tracing::warn!(map = name, "upgrade: carrying entries over: {e:#}"),
                }
                continue;
            }
            if warn && STATE.contains(name) && *name != maps::FRAG4 && *name != maps::FRAG6 {
                tracing::warn!(map = name, "upgrade: its entries have another layout and are not carried over");
            }
            continue;
        }
        let r = match *name {
            maps::AFFINITY => copy::<AffinityKey, AffinityValue>(&old, &new, true),
            maps::SOCK_REVNAT4 => copy::<SockRevNat4Key, SockRevNat4Value>(&old, &new, true),
            maps::SOCK_REVNAT6 => copy::<SockRevNat6Key, SockRevNat6Value>(&old, &new, true),
            maps::NAT4 => copy::<Nat4Key, Nat4Entry>(&old, &new, false),
            maps::NAT6 => copy::<Nat6Key, Nat6Entry>(&old, &new, false),
            maps::FRAG4 => copy::<lb_common::FragKey, lb_common::FragPorts>(&old, &new, true),
            maps::FRAG6 => copy::<lb_common::Frag6Key, lb_common::FragPorts>(&old, &new, true),
            // Connected UDP sockets by cookie: how the stale-socket
            // destroyer finds them (sock_diag returns no storage with UDP
            // sockets); their release hook removes them from the new map.
            maps::SOCK_UDP => copy::<u64, lb_common::SockXlate>(&old, &new, false),
            _ => Ok(0),
        };
        match r {
            Ok(n) => total += n,
            Err(e) => tracing::warn!(map = name, "upgrade: carrying entries over: {e:#}"),
        }
    }
    total
}

/// Whether the old `LB_AFFINITY` pin has the key of agents before 12-05's
/// second half, which had no `proto` (a TCP and a UDP frontend on one
/// address and port shared their clients' affinity), and the new one has
/// it.
fn affinity_before_proto(old: &Path, new: &Path, btf: &mut super::btf::BtfCache) -> bool {
    match (super::btf::pinned_layout(old, btf), super::btf::pinned_layout(new, btf)) {
        (Ok(Some(a)), Ok(Some(b))) => a.key.contains("family@") && !a.key.contains("proto@") && b.key.contains("proto@") && a.value == b.value,
        _ => false,
    }
}

/// Carry sessionAffinity entries from a key without `proto` (its byte was
/// padding, zero) to the new key: each entry's protocol is its backend's
/// (backend ids are per protocol), read from the backends maps the old
/// ids belong to. An entry whose backend is gone is left behind: it could
/// not pass the match check anyway.
fn copy_affinity_adding_proto(bpffs: &Path, old: &Path, new: &Path) -> Result<usize> {
    use aya::maps::{HashMap, Map, MapData};
    use lb_common::{FAMILY_V4, FAMILY_V6};
    let protos = |name: &str, family: u8, out: &mut std::collections::HashMap<(u8, u32), u8>| -> Result<()> {
        let m = MapData::from_pin(bpffs.join(name)).with_context(|| format!("open {name}"))?;
        if family == FAMILY_V4 {
            let m: HashMap<MapData, u32, Backend4> = HashMap::try_from(Map::HashMap(m))?;
            out.extend(m.iter().filter_map(|r| r.ok()).map(|(id, b)| ((family, id), b.proto)));
        } else {
            let m: HashMap<MapData, u32, Backend6> = HashMap::try_from(Map::HashMap(m))?;
            out.extend(m.iter().filter_map(|r| r.ok()).map(|(id, b)| ((family, id), b.proto)));
        }
        Ok(())
    };
    let mut proto_of = std::collections::HashMap::new();
    protos(maps::BACKENDS4, FAMILY_V4, &mut proto_of)?;
    protos(maps::BACKENDS6, FAMILY_V6, &mut proto_of)?;
    let from: HashMap<MapData, AffinityKey, AffinityValue> = HashMap::try_from(Map::LruHashMap(MapData::from_pin(old)?))?;
    let mut to: HashMap<MapData, AffinityKey, AffinityValue> = HashMap::try_from(Map::LruHashMap(MapData::from_pin(new)?))?;
    let mut n = 0;
    for (k, v) in from.iter().filter_map(|r| r.ok()) {
        let Some(&proto) = proto_of.get(&(k.family, v.backend_id)) else { continue };
        // BPF_NOEXIST: never overwrite what the new programs wrote.
        if to.insert(AffinityKey { proto, _pad: [0; 4], ..k }, v, 1).is_ok() {
            n += 1;
        }
    }
    Ok(n)
}

/// Which of `carry_state`'s two passes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Pass {
    /// Before the programs move to the new maps.
    First,
    /// After: what the old programs added meanwhile.
    Late,
}

/// Copy the per-frontend and per-backend counters of the old
/// `LB_SVC_STATS` into the staged map; counters the new programs already
/// wrote win. Ids are each agent's own: an upgrade that replaces the
/// services maps hands them out afresh, and even one that keeps them may
/// have freed an id in its first sync. So each old key is followed to what
/// its id stands for in the old maps (a frontend's address and port; a
/// backend's address, port, protocol and flags) and given that one's id in
/// the maps the new agent filled; a counter whose frontend or backend is
/// gone is dropped. Old values of 40 bytes (agents before 12-05) come
/// with `source_range` at zero; any other layout is an error.
fn copy_svc_stats(bpffs: &Path, old: &Path, new: &Path) -> Result<usize> {
    use aya::maps::{HashMap, Map, MapData};
    use lb_common::{SvcStats, SvcStatsKey};
    let ids = stats_ids(bpffs).context("follow the counters' ids to the new maps")?;
    let entries = super::maps::read_svc_stats_pin(old).context("the old counters")?;
    let mut to: HashMap<MapData, SvcStatsKey, SvcStats> = HashMap::try_from(Map::HashMap(MapData::from_pin(new)?)).context("the new counters")?;
    let mut n = 0;
    for (k, v) in entries {
        let Some(k) = ids.get(&k) else { continue };
        // BPF_NOEXIST: never overwrite what the new programs wrote.
        if to.insert(*k, v, 1).is_ok() {
            n += 1;
        }
    }
    Ok(n)
}

/// Each `LB_SVC_STATS` key of the old agent's ids, and the key of the same
/// frontend or backend among the new agent's (see `copy_svc_stats`).
fn stats_ids(bpffs: &Path) -> Result<std::collections::HashMap<lb_common::SvcStatsKey, lb_common::SvcStatsKey>> {
    use lb_common::{FAMILY_V4, FAMILY_V6, STATS_BACKEND, STATS_FRONTEND};
    let mut out = std::collections::HashMap::new();
    // Each map on its own: one that cannot be read (another value layout)
    // costs only its own counters.
    let results = [
        (maps::REVNAT4, follow::<u16, RevNat4>(bpffs, maps::REVNAT4, STATS_FRONTEND, FAMILY_V4, &mut out)),
        (maps::REVNAT6, follow::<u16, RevNat6>(bpffs, maps::REVNAT6, STATS_FRONTEND, FAMILY_V6, &mut out)),
        (maps::BACKENDS4, follow::<u32, Backend4>(bpffs, maps::BACKENDS4, STATS_BACKEND, FAMILY_V4, &mut out)),
        (maps::BACKENDS6, follow::<u32, Backend6>(bpffs, maps::BACKENDS6, STATS_BACKEND, FAMILY_V6, &mut out)),
    ];
    for (map, r) in results {
        if let Err(e) = r {
            tracing::warn!(map, "upgrade: the counters of its ids are not carried over: {e:#}");
        }
    }
    Ok(out)
}

/// Add to `out` the keys of map `name`'s ids: from its old pin's to its
/// current (staged) one's, matched by value.
fn follow<K, V>(
    bpffs: &Path,
    name: &str,
    kind: u8,
    family: u8,
    out: &mut std::collections::HashMap<lb_common::SvcStatsKey, lb_common::SvcStatsKey>,
) -> Result<()>
where
    K: aya::Pod + Into<u32>,
    V: aya::Pod + Eq + std::hash::Hash,
{
    use aya::maps::{HashMap, Map, MapData};
    let read = |p: &Path| -> Result<Vec<(K, V)>> {
        let m: HashMap<MapData, K, V> = HashMap::try_from(Map::HashMap(MapData::from_pin(p)?)).with_context(|| format!("read {}", p.display()))?;
        Ok(m.iter().filter_map(|r| r.ok()).collect())
    };
    let now: std::collections::HashMap<V, u32> = read(&pin_path(bpffs, name))?.into_iter().map(|(k, v)| (v, k.into())).collect();
    let key = |id: u32| lb_common::SvcStatsKey { id, kind, family, _pad: 0 };
    for (k, v) in read(&bpffs.join(name))? {
        if let Some(&id) = now.get(&v) {
            out.insert(key(k.into()), key(id));
        }
    }
    Ok(())
}

/// Add the per-CPU datapath counters of the old `LB_STATS` to the staged
/// map's, each index the old map has (an upgrade that adds counters makes
/// it larger): the staged map holds what the new programs counted since
/// they were attached. When the socket storage map itself is replaced
/// (`xlate_replaced`), the storage the old one held goes with it, and no
/// release will count it: it is counted released here, so that
/// `lb_sockets_tracked` (tracked - released) stays true. Returns how many
/// counters were copied.
fn copy_counters(old: &Path, new: &Path, xlate_replaced: bool) -> Result<usize> {
    use aya::maps::{Map, MapData, PerCpuArray, PerCpuValues};
    use lb_common::stats::{SOCK_TRACKED, SOCK_UNTRACKED};
    let from: PerCpuArray<MapData, u64> = PerCpuArray::try_from(Map::PerCpuArray(MapData::from_pin(old)?)).context("the old counters")?;
    let mut to: PerCpuArray<MapData, u64> = PerCpuArray::try_from(Map::PerCpuArray(MapData::from_pin(new)?)).context("the new counters")?;
    let n = from.len().min(to.len());
    let total = |i: u32| -> Result<u64> { Ok(if i < from.len() { from.get(&i, 0)?.iter().sum() } else { 0 }) };
    let gone = if xlate_replaced { total(SOCK_TRACKED)?.saturating_sub(total(SOCK_UNTRACKED)?) } else { 0 };
    for i in 0..to.len() {
        let add_gone = i == SOCK_UNTRACKED && gone > 0;
        if i >= n && !add_gone {
            continue;
        }
        let mut sum = to.get(&i, 0)?.to_vec();
        if i < n {
            for (s, x) in sum.iter_mut().zip(from.get(&i, 0)?.iter()) {
                *s += x;
            }
        }
        if add_gone {
            sum[0] += gone;
        }
        to.set(i, PerCpuValues::try_from(sum)?, 0)?;
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marks(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    /// `next/`'s markers are symlinks to themselves, seen though `exists()`
    /// says no; marking twice is no error; `remove_next` takes them too.
    #[test]
    fn next_markers_are_seen_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let next = d.path().join(NEXT);
        fs::create_dir(&next).unwrap();
        assert!(!marked(d.path(), MOVING));
        mark_next(d.path(), MOVING).unwrap();
        mark_next(d.path(), MOVING).unwrap();
        mark_next(d.path(), &format!("{LAYOUT_MARKER}7")).unwrap();
        assert!(marked(d.path(), MOVING) && !next.join(MOVING).exists());
        assert!(!marked(d.path(), LATE_DONE));
        assert_eq!(staged_version(&next).as_deref(), Some("7"));
        fs::write(next.join("LB4_NAT"), b"").unwrap();
        remove_next(&next).unwrap();
        assert!(!next.exists());
    }

    /// An agent killed while `remove_next` took the markers (the maps in
    /// place, the pin dir's layout recorded) leaves `moving` alone: the
    /// next one finishes with nothing to move and keeps the recorded
    /// layout (it had written "unknown": every map replaced again).
    #[test]
    fn finishing_an_upgrade_with_only_its_moving_marker_left_keeps_the_layout() {
        let d = tempfile::tempdir().unwrap();
        mark_layout(d.path(), "7").unwrap();
        fs::create_dir(d.path().join(NEXT)).unwrap();
        mark_next(d.path(), MOVING).unwrap();
        assert_eq!(finish_moved(d.path()).unwrap(), 0);
        assert_eq!(pinned_layout_version(d.path()), "7");
        assert!(!d.path().join(NEXT).exists());
    }

    /// The marker of the new layout is written before the old one goes; a
    /// kill in between leaves both, read as this agent's where one is;
    /// none at all reads as "1" (pins from before markers).
    #[test]
    fn the_layout_marker_is_never_missing() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(pinned_layout_version(d.path()), "1");
        mark_layout(d.path(), "older").unwrap();
        assert_eq!(marks(d.path()), ["layout-older"]);
        mark_layout(d.path(), &layout_version()).unwrap();
        assert_eq!(marks(d.path()), [format!("layout-{}", layout_version())]);
        // Killed between the two steps of an upgrade's marking.
        fs::create_dir(d.path().join("layout-older")).unwrap();
        assert_eq!(pinned_layout_version(d.path()), layout_version(), "ours is the pins' layout");
        fs::remove_dir(d.path().join(format!("layout-{}", layout_version()))).unwrap();
        assert_eq!(pinned_layout_version(d.path()), "older");
    }
}
