//! What changed from one snapshot to the next, for kube-proxy's change
//! counters and its network programming latency. Snapshots share unchanged
//! objects, so a changed object is one whose allocation differs.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use crate::model::{EndpointSlice, Service};
use crate::source::Snapshot;

type Key = (Option<String>, Option<String>);

/// The objects of the last snapshot, by namespace and name.
#[derive(Default)]
pub struct Changes {
    services: HashMap<Key, usize>,
    slices: HashMap<Key, usize>,
    first: bool,
}

/// What one snapshot changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changed {
    /// Services added, changed or removed.
    pub services: u64,
    /// EndpointSlices added, changed or removed.
    pub slices: u64,
    /// The last-change-trigger-time of every added or changed
    /// EndpointSlice that has one (none for the first snapshot: those
    /// changes happened before the agent started).
    pub triggers: Vec<SystemTime>,
}

fn key(m: &crate::model::objects::Meta) -> Key {
    (m.namespace.clone(), m.name.clone())
}

/// Count the objects of `now` that are not in `before` by identity, and
/// those of `before` that are gone; return the new index.
fn diff<T>(before: &HashMap<Key, usize>, now: &[Arc<T>], meta: fn(&T) -> &crate::model::objects::Meta, mut changed: impl FnMut(&T)) -> (HashMap<Key, usize>, u64) {
    let mut index = HashMap::with_capacity(now.len());
    let mut n = 0;
    for o in now {
        let k = key(meta(o));
        let id = Arc::as_ptr(o) as usize;
        if before.get(&k) != Some(&id) {
            n += 1;
            changed(o);
        }
        index.insert(k, id);
    }
    n += before.keys().filter(|k| !index.contains_key(*k)).count() as u64;
    (index, n)
}

impl Changes {
    pub fn new() -> Self {
        Changes { first: true, ..Default::default() }
    }

    pub fn observe(&mut self, snap: &Snapshot) -> Changed {
        let mut out = Changed::default();
        let first = std::mem::replace(&mut self.first, false);
        let (services, n) = diff(&self.services, &snap.services, |s: &Service| &s.metadata, |_| {});
        out.services = n;
        let triggers = &mut out.triggers;
        let (slices, n) = diff(&self.slices, &snap.slices, |s: &EndpointSlice| &s.metadata, |s| {
            if let Some(t) = s.metadata.annotations.last_change_trigger_time.as_deref().filter(|_| !first)
                && let Ok(t) = humantime::parse_rfc3339_weak(t)
            {
                triggers.push(t);
            }
        });
        out.slices = n;
        self.services = services;
        self.slices = slices;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(name: &str, trigger: Option<&str>) -> Arc<EndpointSlice> {
        let mut s = EndpointSlice::default();
        s.metadata.name = Some(name.into());
        s.metadata.namespace = Some("ns".into());
        s.metadata.annotations.last_change_trigger_time = trigger.map(Into::into);
        Arc::new(s)
    }

    fn svc(name: &str) -> Arc<Service> {
        let mut s = Service::default();
        s.metadata.name = Some(name.into());
        Arc::new(s)
    }

    #[test]
    fn counts_added_changed_and_removed_objects_and_collects_trigger_times() {
        let mut c = Changes::new();
        let (a, b) = (svc("a"), svc("b"));
        let s1 = slice("a-1", Some("2026-12-01T10:00:00Z"));
        let first = c.observe(&Snapshot { services: vec![a.clone(), b.clone()], slices: vec![s1.clone()], nodes: vec![] });
        assert_eq!((first.services, first.slices), (2, 1));
        assert!(first.triggers.is_empty(), "the initial list's changes predate the agent");
        // Nothing changed: the same allocations.
        let same = c.observe(&Snapshot { services: vec![a.clone(), b.clone()], slices: vec![s1.clone()], nodes: vec![] });
        assert_eq!(same, Changed::default());
        // b removed, a replaced, the slice changed with a new trigger time.
        let s2 = slice("a-1", Some("2026-12-01T10:00:01Z"));
        let ch = c.observe(&Snapshot { services: vec![svc("a")], slices: vec![s2, slice("a-2", None)], nodes: vec![] });
        assert_eq!((ch.services, ch.slices), (2, 2));
        assert_eq!(ch.triggers, [humantime::parse_rfc3339("2026-12-01T10:00:01Z").unwrap()]);
    }
}
