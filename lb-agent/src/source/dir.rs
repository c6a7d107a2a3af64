//! The `dir:` source: a directory of `.yaml`, `.yml` and `.json` files as
//! `kubectl get -o yaml` prints them. One or many documents per file, or a
//! `List`. Kinds `Service` and `Node` (v1) and `EndpointSlice`
//! (discovery.k8s.io/v1); other kinds are ignored.
//!
//! A file that does not parse is reported by name and keeps its last good
//! content, so one bad edit never takes other objects (or its own) away.
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;

use crate::model::{EndpointSlice, Service};
use serde::Deserialize;

use super::Snapshot;

#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("{file}: {msg}")]
    Syntax { file: String, msg: String },
    #[error("{file}: document {doc}: {msg}")]
    Object { file: String, doc: usize, msg: String },
}

/// The objects of one file.
#[derive(Clone, Debug, Default)]
pub struct FileObjects {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
}

fn is_source_file(p: &Path) -> bool {
    let hidden = p.file_name().and_then(|n| n.to_str()).is_none_or(|n| n.starts_with('.'));
    !hidden && matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml" | "json"))
}

/// What a document is, from its kind and apiVersion.
enum Kind {
    List,
    Service,
    EndpointSlice,
    Node,
    Other,
}

fn classify(kind: &str, api: &str) -> Result<Kind, String> {
    let want = |k: Kind, v: &str| if api == v { Ok(k) } else { Err(format!("{kind} with apiVersion {api:?}, want {v}")) };
    match kind {
        "" => Err("no kind".into()),
        "List" | "ServiceList" | "EndpointSliceList" | "NodeList" => Ok(Kind::List),
        "Service" => want(Kind::Service, "v1"),
        "EndpointSlice" => want(Kind::EndpointSlice, "discovery.k8s.io/v1"),
        "Node" => want(Kind::Node, "v1"),
        _ => Ok(Kind::Other),
    }
}

/// Deserialize one object of kind `kind` from `d` and add it. A Service or
/// an EndpointSlice needs a name.
fn push<'de, D>(out: &mut FileObjects, kind: &Kind, d: D) -> Result<(), String>
where
    D: serde::Deserializer<'de>,
    D::Error: std::fmt::Display,
{
    let named = |what: &str, name: &Option<String>| match name.as_deref() {
        None | Some("") => Err(format!("{what} without metadata.name")),
        Some(_) => Ok(()),
    };
    match kind {
        Kind::Service => {
            let s = Service::deserialize(d).map_err(|e| format!("Service: {e}"))?;
            named("Service", &s.metadata.name)?;
            out.services.push(s);
        }
        Kind::EndpointSlice => {
            let s = EndpointSlice::deserialize(d).map_err(|e| format!("EndpointSlice: {e}"))?;
            named("EndpointSlice", &s.metadata.name)?;
            out.slices.push(s);
        }
        Kind::Node => out.nodes.push(Node::deserialize(d).map_err(|e| format!("Node: {e}"))?),
        Kind::List | Kind::Other => {}
    }
    Ok(())
}

/// One YAML document, as a value.
fn add_object(out: &mut FileObjects, mut v: serde_json::Value, file: &str, doc: usize) -> Result<(), ParseError> {
    let err = |msg: String| ParseError::Object { file: file.to_string(), doc, msg };
    if v.is_null() {
        return Ok(());
    }
    let kind = v.get("kind").and_then(|k| k.as_str()).unwrap_or("").to_string();
    let api = v.get("apiVersion").and_then(|k| k.as_str()).unwrap_or("").to_string();
    match classify(&kind, &api).map_err(err)? {
        Kind::List => {
            let items = match v.get_mut("items").map(serde_json::Value::take) {
                Some(serde_json::Value::Array(a)) => a,
                Some(serde_json::Value::Null) | None => Vec::new(),
                Some(_) => return Err(err(format!("{kind}: items is not a list"))),
            };
            for item in items {
                add_object(out, item, file, doc)?;
            }
            Ok(())
        }
        Kind::Other => {
            tracing::debug!(file, doc, kind, "ignoring object of another kind");
            Ok(())
        }
        k => push(out, &k, v).map_err(err),
    }
}

/// The kind and apiVersion of a JSON object (and the items of a list),
/// read without building the object.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(default, borrow)]
    kind: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, rename = "apiVersion", borrow)]
    api_version: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    items: Option<Vec<&'a serde_json::value::RawValue>>,
}

/// One JSON object, deserialized straight from its text.
fn add_json(out: &mut FileObjects, text: &str, file: &str) -> Result<(), ParseError> {
    let err = |msg: String| ParseError::Object { file: file.to_string(), doc: 1, msg };
    if text.trim() == "null" {
        return Ok(());
    }
    let head: Head = serde_json::from_str(text).map_err(|e| err(format!("not an object: {e}")))?;
    let kind = head.kind.as_deref().unwrap_or("");
    match classify(kind, head.api_version.as_deref().unwrap_or("")).map_err(err)? {
        Kind::List => {
            for item in head.items.iter().flatten() {
                add_json(out, item.get(), file)?;
            }
            Ok(())
        }
        Kind::Other => {
            tracing::debug!(file, kind, "ignoring object of another kind");
            Ok(())
        }
        k => push(out, &k, &mut serde_json::Deserializer::from_str(text)).map_err(err),
    }
}

/// Parse one file's text. `name` is used in errors. The whole file fails if
/// any document in it is malformed. JSON is read straight into the model's
/// types; YAML goes through a value per document (several times slower).
pub fn parse(name: &str, text: &str) -> Result<FileObjects, ParseError> {
    let mut out = FileObjects::default();
    if name.ends_with(".json") {
        serde_json::from_str::<serde::de::IgnoredAny>(text)
            .map_err(|e| ParseError::Syntax { file: name.into(), msg: e.to_string() })?;
        add_json(&mut out, text, name)?;
        return Ok(out);
    }
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple_with_options(text, yaml_options(text.len()))
        .map_err(|e| ParseError::Syntax { file: name.into(), msg: e.to_string() })?;
    for (i, v) in docs.into_iter().enumerate() {
        add_object(&mut out, v, name, i + 1)?;
    }
    Ok(out)
}

/// serde-saphyr's budgets suit small configuration files (1,024 documents,
/// 250,000 nodes, 1,000,000 events): a file of 10,000 Services, or one
/// `kubectl get -o yaml` List of them, is far bigger. These grow with the
/// input instead (a document takes at least 4 bytes, a node or two events at
/// least one), so only what the text itself holds is allowed; the alias and
/// anchor limits, which stop expansion bombs, keep their defaults.
pub fn yaml_options(len: usize) -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_documents = budget.max_documents.max(len / 4 + 1);
    budget.max_nodes = budget.max_nodes.max(len + 1);
    budget.max_events = budget.max_events.max(2 * len + 2);
    budget.max_total_scalar_bytes = budget.max_total_scalar_bytes.max(len);
    let mut o = serde_saphyr::Options::default();
    o.budget = Some(budget);
    o
}

/// What identifies a version of a file without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Signature {
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

fn signature(md: &std::fs::Metadata) -> Signature {
    Signature {
        ino: md.ino(),
        size: md.size(),
        mtime_ns: md.mtime() as i128 * 1_000_000_000 + md.mtime_nsec() as i128,
    }
}

struct Entry {
    sig: Signature,
    /// A hash of the text the objects came from: a re-read of the same text
    /// changes nothing.
    text_hash: u64,
    services: Vec<Arc<Service>>,
    slices: Vec<Arc<EndpointSlice>>,
    nodes: Vec<Arc<Node>>,
}

fn hash_text(t: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    t.hash(&mut h);
    h.finish()
}

/// What reading a file gave.
enum Read {
    /// It could not be read (it may be half-written): try again later.
    Failed,
    /// The text it already had.
    Same,
    /// New text (its hash), parsed.
    Parsed(u64, Result<FileObjects, ParseError>),
}

/// The state of the directory: the last good objects of every file.
pub struct DirState {
    dir: PathBuf,
    files: BTreeMap<PathBuf, Entry>,
    /// Files whose last read failed, with the signature that failed, so the
    /// same error is logged once rather than on every rescan.
    failed: BTreeMap<PathBuf, Signature>,
    /// `received`.
    received: super::Received,
}

impl DirState {
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        let md = std::fs::metadata(dir)
            .map_err(|e| anyhow::anyhow!("source directory {}: {e}", dir.display()))?;
        if !md.is_dir() {
            anyhow::bail!("source directory {}: not a directory", dir.display());
        }
        Ok(Self { dir: dir.to_path_buf(), files: BTreeMap::new(), failed: BTreeMap::new(), received: Default::default() })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The changes received so far (`super::Received`): each Service and
    /// EndpointSlice of a file read anew counts (also one the edit left
    /// alone: the file is the unit here), those fewer than the file held
    /// before, and those of a removed file.
    pub fn received(&self) -> super::Received {
        self.received
    }

    /// Re-read what changed. `touched` are paths a watcher reported; they are
    /// re-read even when their signature looks unchanged. Returns whether
    /// the set of objects may have changed.
    pub fn rescan(&mut self, touched: &BTreeSet<PathBuf>) -> anyhow::Result<bool> {
        let mut seen = BTreeSet::new();
        let mut changed = false;
        let rd = std::fs::read_dir(&self.dir)
            .map_err(|e| anyhow::anyhow!("source directory {}: {e}", self.dir.display()))?;
        let mut todo = Vec::new();
        for ent in rd {
            let Ok(ent) = ent else { continue };
            let path = ent.path();
            if !is_source_file(&path) {
                continue;
            }
            let Ok(md) = std::fs::metadata(&path) else { continue };
            if !md.is_file() {
                continue;
            }
            seen.insert(path.clone());
            let sig = signature(&md);
            let known = self.files.get(&path).is_some_and(|e| e.sig == sig)
                || self.failed.get(&path) == Some(&sig);
            if known && !touched.contains(&path) {
                continue;
            }
            todo.push((path, sig));
        }
        for (path, sig, read) in self.read_all(todo) {
            let (text_hash, parsed) = match read {
                Read::Failed => continue,
                Read::Same => {
                    if let Some(e) = self.files.get_mut(&path) {
                        e.sig = sig;
                    }
                    continue;
                }
                Read::Parsed(h, p) => (h, p),
            };
            match parsed {
                Ok(o) => {
                    self.failed.remove(&path);
                    let entry = Entry {
                        sig,
                        text_hash,
                        services: o.services.into_iter().map(Arc::new).collect(),
                        slices: o.slices.into_iter().map(Arc::new).collect(),
                        nodes: o.nodes.into_iter().map(Arc::new).collect(),
                    };
                    let fewer = self.files.get(&path).map_or((0, 0), |old| {
                        (old.services.len().saturating_sub(entry.services.len()), old.slices.len().saturating_sub(entry.slices.len()))
                    });
                    self.received.services += (entry.services.len() + fewer.0) as u64;
                    self.received.slices += (entry.slices.len() + fewer.1) as u64;
                    self.files.insert(path, entry);
                    changed = true;
                }
                Err(e) => {
                    if self.failed.insert(path.clone(), sig) != Some(sig) {
                        let kept = if self.files.contains_key(&path) {
                            "keeping its last good content"
                        } else {
                            "no objects from it are used"
                        };
                        tracing::error!("bad source file {e}; {kept}");
                    }
                }
            }
        }
        let gone: Vec<PathBuf> = self.files.keys().filter(|p| !seen.contains(*p)).cloned().collect();
        for p in gone {
            if let Some(old) = self.files.remove(&p) {
                self.received.services += old.services.len() as u64;
                self.received.slices += old.slices.len() as u64;
            }
            changed = true;
        }
        self.failed.retain(|p, _| seen.contains(p));
        Ok(changed)
    }

    /// Read and parse `files`, on as many threads as there are cores (a
    /// cold start reads them all).
    fn read_all(&self, files: Vec<(PathBuf, Signature)>) -> Vec<(PathBuf, Signature, Read)> {
        let read = |path: &Path| -> Read {
            let name = path.display().to_string();
            let text = match std::fs::read_to_string(path) {
                Ok(t) => t,
                Err(e) => {
                    tracing::debug!("{name}: {e}");
                    return Read::Failed;
                }
            };
            let text_hash = hash_text(&text);
            if self.files.get(path).is_some_and(|e| e.text_hash == text_hash) {
                return Read::Same;
            }
            // Kept as exact copies: what the parser built has room to
            // spare (vectors grown by doubling); copying a whole file's
            // objects at once, then freeing the parser's, leaves the
            // long-lived ones together rather than among holes.
            let exact = |o: FileObjects| FileObjects {
                services: o.services.to_vec(),
                slices: o.slices.to_vec(),
                nodes: o.nodes,
            };
            Read::Parsed(text_hash, parse(&name, &text).map(exact))
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(files.len());
        if threads <= 1 {
            return files.into_iter().map(|(p, sig)| { let r = read(&p); (p, sig, r) }).collect();
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let mut results: Vec<_> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        let mut mine = Vec::new();
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some((p, _)) = files.get(i) else { break };
                            mine.push((i, read(p)));
                        }
                        mine
                    })
                })
                .collect();
            workers.into_iter().flat_map(|w| w.join().expect("a parser thread panicked")).collect()
        });
        results.sort_by_key(|(i, _)| *i);
        files.into_iter().zip(results).map(|((p, sig), (_, r))| (p, sig, r)).collect()
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut snap = Snapshot::default();
        for e in self.files.values() {
            snap.services.extend(e.services.iter().cloned());
            snap.slices.extend(e.slices.iter().cloned());
            snap.nodes.extend(e.nodes.iter().cloned());
        }
        snap
    }
}

/// Watch `dir`; every batch of changed paths is sent on the returned channel.
/// Keep the watcher alive for as long as events are wanted.
fn watch(
    dir: &Path,
) -> anyhow::Result<(notify::RecommendedWatcher, tokio::sync::mpsc::UnboundedReceiver<Vec<PathBuf>>)> {
    use notify::Watcher as _;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut w = notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
        // Reads (ours included: a rescan opens the files) change nothing.
        Ok(ev) if matches!(ev.kind, notify::EventKind::Access(_)) => {}
        Ok(ev) => {
            let _ = tx.send(ev.paths);
        }
        Err(e) => {
            tracing::warn!("directory watch error: {e}");
            let _ = tx.send(Vec::new());
        }
    })?;
    w.watch(dir, notify::RecursiveMode::NonRecursive)
        .map_err(|e| anyhow::anyhow!("cannot watch source directory {}: {e}", dir.display()))?;
    Ok((w, rx))
}

/// Run the source: publish the directory's objects now, and again after
/// every change (inotify, plus a stat-only rescan every 500 ms in case an
/// event is lost).
pub async fn run(mut state: DirState, tx: super::Publisher) -> anyhow::Result<()> {
    let (_watcher, mut events) = watch(state.dir())?;
    state.rescan(&BTreeSet::new())?;
    let publish = |state: &DirState, since: std::time::Instant| {
        let update = super::Update { snapshot: state.snapshot(), since, queued: std::time::SystemTime::now(), received: state.received() };
        let _ = tx.send(Some(std::sync::Arc::new(update)));
    };
    publish(&state, std::time::Instant::now());
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
    loop {
        let mut touched = BTreeSet::new();
        tokio::select! {
            Some(paths) = events.recv() => {
                // At once, with whatever else is already queued: a burst
                // that arrives while the agent programs becomes one update
                // (the channel keeps only the newest snapshot).
                touched.extend(paths);
                while let Ok(p) = events.try_recv() {
                    touched.extend(p);
                }
            }
            _ = tick.tick() => {}
        }
        let since = std::time::Instant::now();
        match state.rescan(&touched) {
            Ok(true) => {
                tracing::debug!(rescan_us = since.elapsed().as_micros() as u64, "dir source: changed");
                publish(&state, since);
            }
            Ok(false) => {}
            Err(e) => tracing::error!("{e:#}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SVC: &str = "apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
";
    const SLICE: &str = "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: default
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.1.2]
  conditions: {ready: true}
";

    #[test]
    fn more_documents_than_serde_saphyrs_default_budget() {
        let doc = "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: default}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n";
        let mut text = String::new();
        for i in 0..3000 {
            text += &doc.replace("name: s", &format!("name: s{i}")).replace("10.96.0.1", &format!("10.96.{}.{}", i / 250, i % 250 + 1));
            text += "---\n";
        }
        let got = parse("many.yaml", &text).unwrap();
        assert_eq!(got.services.len(), 3000);
    }

    #[test]
    fn multi_document_yaml() {
        let text = format!("{SVC}---\n{SLICE}---\n");
        let o = parse("a.yaml", &text).unwrap();
        assert_eq!(o.services.len(), 1);
        assert_eq!(o.slices.len(), 1);
        assert_eq!(o.slices[0].endpoints[0].addresses.as_slice(), ["10.244.1.2".parse::<std::net::IpAddr>().unwrap()]);
    }

    #[test]
    fn list_kind_and_json() {
        let text = r#"{"apiVersion":"v1","kind":"List","items":[
            {"apiVersion":"v1","kind":"Service","metadata":{"name":"a"},"spec":{"clusterIP":"10.96.0.1"}},
            {"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"ignored"}}
        ]}"#;
        let o = parse("l.json", text).unwrap();
        assert_eq!(o.services.len(), 1);
        let o = parse("l.yaml", text).unwrap();
        assert_eq!(o.services.len(), 1);
    }

    #[test]
    fn malformed_input_names_the_file() {
        let e = parse("bad.yaml", "kind: Service\n  : [").unwrap_err().to_string();
        assert!(e.starts_with("bad.yaml:"), "{e}");
        let e = parse("v.yaml", "apiVersion: v2\nkind: Service\nmetadata: {name: x}\n").unwrap_err().to_string();
        assert!(e.contains("v.yaml: document 1") && e.contains("want v1"), "{e}");
        let e = parse("t.yaml", &format!("{SVC}---\napiVersion: v1\nkind: Service\nmetadata: {{name: y}}\nspec: {{ports: 3}}\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.yaml: document 2") && e.contains("Service"), "{e}");
        let e = parse("n.yaml", "apiVersion: v1\nkind: Service\nspec: {}\n").unwrap_err().to_string();
        assert!(e.contains("without metadata.name"), "{e}");
        let e = parse("k.yaml", "foo: bar\n").unwrap_err().to_string();
        assert!(e.contains("no kind"), "{e}");
        // The same from JSON, which is read straight into the model's types.
        let e = parse("n.json", r#"{"apiVersion": "v1", "kind": "Service", "spec": {}}"#).unwrap_err().to_string();
        assert!(e.starts_with("n.json:") && e.contains("without metadata.name"), "{e}");
        let e = parse("t.json", r#"{"apiVersion": "v1", "kind": "List", "items": [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "y"}, "spec": {"ports": 3}}]}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("Service: invalid type"), "{e}");
        let e = parse("v.json", r#"{"apiVersion": "v2", "kind": "EndpointSlice"}"#).unwrap_err().to_string();
        assert!(e.contains("want discovery.k8s.io/v1"), "{e}");
        let e = parse("s.json", r#"{"kind": "Service""#).unwrap_err().to_string();
        assert!(e.starts_with("s.json:"), "{e}");
    }

    #[test]
    fn empty_documents_are_fine() {
        let o = parse("e.yaml", "---\n---\n").unwrap();
        assert!(o.services.is_empty());
        assert!(parse("e.yaml", "").unwrap().services.is_empty());
    }

    #[test]
    fn dir_keeps_last_good_content_and_drops_deleted_files() {
        let d = std::env::temp_dir().join(format!("lb-dir-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let none = BTreeSet::new();
        std::fs::write(d.join("svc.yaml"), SVC).unwrap();
        std::fs::write(d.join("slice.yml"), SLICE).unwrap();
        std::fs::write(d.join("notes.txt"), "not an object").unwrap();
        let mut st = DirState::new(&d).unwrap();
        assert!(st.rescan(&none).unwrap());
        assert_eq!(st.snapshot().services.len(), 1);
        assert_eq!(st.snapshot().slices.len(), 1);
        assert!(!st.rescan(&none).unwrap(), "nothing changed");
        let received = |services, slices| super::super::Received { services, slices };
        assert_eq!(st.received(), received(1, 1), "each object read is a change received");

        // A broken edit keeps the last good content.
        std::fs::write(d.join("svc.yaml"), "kind: [").unwrap();
        let touched: BTreeSet<_> = [d.join("svc.yaml")].into();
        st.rescan(&touched).unwrap();
        assert_eq!(st.snapshot().services.len(), 1);
        assert_eq!(st.received(), received(1, 1), "nothing received");

        // Deleting a file removes its objects.
        std::fs::remove_file(d.join("slice.yml")).unwrap();
        assert!(st.rescan(&none).unwrap());
        assert!(st.snapshot().slices.is_empty());
        assert_eq!(st.received(), received(1, 2), "the slice's removal");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn missing_dir_is_an_error_naming_it() {
        let e = DirState::new(Path::new("/nonexistent/lb")).err().unwrap().to_string();
        assert!(e.contains("/nonexistent/lb"), "{e}");
    }
}
