//! Where Kubernetes objects come from. Sources know nothing about BPF: each
//! runs as a task and publishes a full snapshot of the objects whenever they
//! change. The channel keeps only the newest snapshot, so a burst of changes
//! that arrives while the agent programs the maps becomes one sync.
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

use crate::model::{EndpointSlice, Service};

pub mod dir;
pub mod kube;

/// A full snapshot of the objects a source knows. Objects are shared, not
/// copied: an unchanged object is the same allocation from one snapshot to
/// the next.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    pub nodes: Vec<Arc<Node>>,
}

/// What a source publishes: a snapshot, and when the first change that it
/// contains was seen (for the event-to-programmed latency).
#[derive(Debug)]
pub struct Update {
    pub snapshot: Snapshot,
    pub since: Instant,
    /// When it was published (wall clock): kube-proxy's "queued" time of
    /// a sync, which its informers' handlers set as changes arrive.
    pub queued: std::time::SystemTime,
    /// The changes the source had received when it published this.
    pub received: Received,
}

/// Object changes a source has received since it started, by kind: each
/// object added, changed or removed (and each object of a re-list), as
/// kube-proxy's change trackers count their informers' events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Received {
    pub services: u64,
    pub slices: u64,
}

impl Received {
    /// Those of `self` not in `taken` (an earlier count).
    pub fn since(self, taken: Received) -> Received {
        Received { services: self.services.saturating_sub(taken.services), slices: self.slices.saturating_sub(taken.slices) }
    }
}

/// The newest update; `None` until the source has its first full view.
pub type Publisher = tokio::sync::watch::Sender<Option<Arc<Update>>>;
pub type Subscriber = tokio::sync::watch::Receiver<Option<Arc<Update>>>;

/// A metric's labels: (name, value) pairs.
type Labels<const N: usize> = [(&'static str, String); N];

/// How a source is doing, shared with the agent's metrics: since when each
/// of its watches has been failing, and its requests to the API server.
#[derive(Debug)]
pub struct Status {
    failing: std::sync::Mutex<std::collections::BTreeMap<&'static str, Spell>>,
    /// Per watched kind, what its next re-list may ask for (`Newest`).
    newest: std::sync::Mutex<std::collections::BTreeMap<&'static str, Newest>>,
    /// client-go's `rest_client_requests_total{code,host,method}`: every
    /// request by its answer's status code ("<error>": no answer).
    pub requests: Family<Labels<3>, Counter>,
    /// client-go's `rest_client_request_duration_seconds{host,verb}`: until
    /// the answer's headers (a watch's too), in client-go's buckets.
    pub request_duration: Family<Labels<2>, Histogram, fn() -> Histogram>,
    /// Watch events received: Services, EndpointSlices (`Received`).
    received: [std::sync::atomic::AtomicU64; 2],
}

impl Default for Status {
    fn default() -> Self {
        fn buckets() -> Histogram {
            Histogram::new([0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0])
        }
        Status {
            failing: Default::default(),
            newest: Default::default(),
            requests: Family::default(),
            request_duration: Family::new_with_constructor(buckets),
            received: Default::default(),
        }
    }
}

impl Status {
    /// A watch event of `kind` arrived (an object added, changed, removed,
    /// or listed again); Services and EndpointSlices are counted.
    pub fn received_one(&self, kind: &str) {
        let i = match kind {
            "Service" => 0,
            "EndpointSlice" => 1,
            _ => return,
        };
        self.received[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The changes received so far.
    pub fn received(&self) -> Received {
        let n = |i: usize| self.received[i].load(std::sync::atomic::Ordering::Relaxed);
        Received { services: n(0), slices: n(1) }
    }

    /// A request to the API server at `host` answered `code` after `took`.
    pub fn request(&self, host: &str, method: &str, code: &str, took: std::time::Duration) {
        self.requests.get_or_create(&[("code", code.to_string()), ("host", host.to_string()), ("method", method.to_string())]).inc();
        self.request_duration.get_or_create(&[("host", host.to_string()), ("verb", method.to_string())]).observe(took.as_secs_f64());
    }

    /// Watch `what` failed (the first failure of a spell counts; a watch
    /// answered 2xx less than `WATCH_OK_GRACE` before does not end it).
    /// Returns how long the spell has lasted.
    pub fn failed(&self, what: &'static str) -> std::time::Duration {
        let mut f = self.failing.lock().unwrap();
        let spell = f.entry(what).or_insert(Spell { since: Instant::now(), watch_ok: None });
        if spell.over() {
            spell.since = Instant::now();
        }
        spell.watch_ok = None;
        spell.since.elapsed()
    }

    /// A watch request of `what` was answered 2xx: working, unless it
    /// fails within `WATCH_OK_GRACE`.
    pub fn watch_answered(&self, what: &'static str) {
        if let Some(spell) = self.failing.lock().unwrap().get_mut(what) {
            spell.watch_ok = Some(Instant::now());
        }
    }

    /// Watch `what` works again (its objects arrived).
    pub fn recovered(&self, what: &'static str) {
        self.failing.lock().unwrap().remove(what);
    }

    /// An object of `kind` at resourceVersion `rv` was seen (listed or
    /// watched), or a watch of it resumed from `rv`. The API server's
    /// versions are etcd's revisions (decimal uint64s, which it parses
    /// itself); one that is not is ignored.
    pub fn saw(&self, kind: &'static str, rv: &str) {
        if let Ok(rv) = rv.parse::<u64>() {
            let mut n = self.newest.lock().unwrap();
            let e = n.entry(kind).or_default();
            e.rv = e.rv.max(rv);
        }
    }

    /// What the next list of `kind` may ask for.
    pub fn newest(&self, kind: &'static str) -> Newest {
        self.newest.lock().unwrap().get(kind).copied().unwrap_or_default()
    }

    /// The API server could not list `kind` at its newest version from its
    /// cache (`consistent`), or a list of it succeeded (`!consistent`).
    pub fn relist_consistent(&self, kind: &'static str, consistent: bool) {
        self.newest.lock().unwrap().entry(kind).or_default().consistent = consistent;
    }

    /// How long the longest-failing watch has been failing (zero: none is).
    pub fn failing_for(&self) -> std::time::Duration {
        let mut f = self.failing.lock().unwrap();
        f.retain(|_, s| !s.over());
        f.values().map(|s| s.since.elapsed()).max().unwrap_or_default()
    }
}

/// What a re-list of one kind may ask for: nothing older than what was
/// seen (client-go's reflector re-lists at its last version, from the API
/// server's cache), or, where the cache could not answer at that version,
/// a consistent read (client-go's fallback).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Newest {
    /// The newest resourceVersion seen (0: none yet: the first list).
    pub rv: u64,
    /// The cache could not list at `rv`: the next list reads consistently.
    pub consistent: bool,
}

/// A spell of failures of one watch.
#[derive(Debug, Clone, Copy)]
struct Spell {
    since: Instant,
    /// A watch request of it answered 2xx since its last failure (no
    /// objects need come: a watch resumes quietly).
    watch_ok: Option<Instant>,
}

/// How long a watch answered 2xx must go without failing to count as
/// working: a 200's body may still fail (an undecodable first line, a
/// stream cut at once), and that is the same spell.
const WATCH_OK_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

impl Spell {
    /// Over: a watch answered and has not failed since, for the grace.
    fn over(&self) -> bool {
        self.watch_ok.is_some_and(|t| t.elapsed() >= WATCH_OK_GRACE)
    }
}

/// `--source` parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceSpec {
    /// Watch the API server (kubeconfig from the usual places).
    Kube,
    /// A directory of YAML/JSON files.
    Dir(std::path::PathBuf),
}

impl std::str::FromStr for SourceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            Some(("dir", path)) if !path.is_empty() => Ok(SourceSpec::Dir(path.into())),
            Some(("dir", _)) => Err("dir: needs a path, as in dir:/etc/lb/objects".into()),
            Some((scheme, _)) => Err(format!("unknown source scheme {scheme:?}; supported: kube, dir:PATH")),
            None if s == "kube" => Ok(SourceSpec::Kube),
            None => Err(format!("unknown source {s:?}; supported: kube, dir:PATH")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_reports_the_longest_failing_watch() {
        let st = Status::default();
        assert_eq!(st.failing_for(), std::time::Duration::ZERO);
        st.failed("Service");
        std::thread::sleep(std::time::Duration::from_millis(20));
        st.failed("Service");
        st.failed("Node");
        assert!(st.failing_for() >= std::time::Duration::from_millis(20), "the first failure of the spell counts");
        st.recovered("Service");
        assert!(st.failing_for() < std::time::Duration::from_millis(20));
        st.recovered("Node");
        assert_eq!(st.failing_for(), std::time::Duration::ZERO);
    }

    #[test]
    fn source_specs() {
        assert_eq!("dir:/x".parse::<SourceSpec>(), Ok(SourceSpec::Dir("/x".into())));
        assert_eq!("kube".parse::<SourceSpec>(), Ok(SourceSpec::Kube));
        assert!("dir:".parse::<SourceSpec>().unwrap_err().contains("needs a path"));
        assert!("http://x".parse::<SourceSpec>().unwrap_err().contains("unknown source scheme \"http\""));
        assert!("bogus".parse::<SourceSpec>().unwrap_err().contains("unknown source"));
    }

    /// A watch answered 2xx that fails at once continues its spell; one
    /// that keeps working for the grace ends it; objects end it at once.
    #[test]
    fn a_failing_spell_lasts_until_a_watch_keeps_working() {
        let st = Status::default();
        st.failed("Service");
        std::thread::sleep(std::time::Duration::from_millis(300));
        st.watch_answered("Service");
        assert!(st.failed("Service") >= std::time::Duration::from_millis(300), "the same spell");
        st.watch_answered("Service");
        assert!(st.failing_for() >= std::time::Duration::from_millis(300), "not over before the grace");
        std::thread::sleep(WATCH_OK_GRACE + std::time::Duration::from_millis(100));
        assert_eq!(st.failing_for(), std::time::Duration::ZERO, "over: the watch kept working");
        assert!(st.failed("Service") < std::time::Duration::from_millis(100), "a new spell");
        st.recovered("Service");
        assert_eq!(st.failing_for(), std::time::Duration::ZERO);
    }
}
