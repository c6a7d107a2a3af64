//! lb-apiserver: a wire-level stand-in for the Kubernetes API server's
//! list/watch protocol, for tests. It speaks real HTTP/1.1 (optionally over
//! TLS with a bearer token), so kube-rs' watcher, and kubectl-like clients,
//! talk to it exactly as they talk to a cluster.
//!
//! ```text
//! lb-apiserver --objects DIR [--listen 127.0.0.1:0] [--tls-dir DIR] [--kubeconfig-out FILE]
//! ```
//!
//! Prints one line `ready ADDR` (the bound address) on stdout once it
//! listens and has written its files.
//!
//! # Objects
//!
//! `--objects DIR` has the layout lb-agent's `dir:` source reads: `.yaml`,
//! `.yml` and `.json` files (hidden files skipped), one or many documents
//! each, or a `List`; kinds Service (v1), EndpointSlice
//! (discovery.k8s.io/v1) and Node (v1), others ignored. The directory is
//! polled every 50 ms; differences become ADDED / MODIFIED / DELETED
//! events with one global, increasing resourceVersion. Every object is
//! stamped with `metadata.resourceVersion`, a `metadata.uid` (stable until
//! it is deleted), `creationTimestamp` and, when namespaced, a namespace
//! (`default` when the file has none). A file that does not parse keeps
//! its last good content. The last 1000 events (`--history`) are kept for
//! watch resumption.
//!
//! # API
//!
//! - discovery: `GET /version`, `/api`, `/api/v1`, `/apis`,
//!   `/apis/discovery.k8s.io`, `/apis/discovery.k8s.io/v1`, `/healthz`;
//! - get: `GET /api/v1/nodes/NAME`, `/api/v1/namespaces/NS/services/NAME`,
//!   `/apis/discovery.k8s.io/v1/namespaces/NS/endpointslices/NAME`;
//! - list: `GET /api/v1/services`, `/apis/discovery.k8s.io/v1/endpointslices`,
//!   `/api/v1/nodes`, and the namespaced forms `.../namespaces/NS/services`
//!   etc.: a ServiceList / EndpointSliceList / NodeList with
//!   `metadata.resourceVersion`. `limit` + `continue` page through one
//!   consistent snapshot (a continue token outlives neither 64 newer paged
//!   lists nor a compaction: then 410 Expired, as the real server answers).
//!   `labelSelector` (`key`, `!key`, `key=value`, `key==value`,
//!   `key!=value`, `key in (a,b)`, `key notin (a,b)`, comma-separated) and
//!   `fieldSelector` (`metadata.name` and `metadata.namespace` with `=`,
//!   `==`, `!=`). The list's `resourceVersion` parameter must be a number
//!   (else 400); it is otherwise ignored: lists are always served from the
//!   newest state (what `resourceVersion=0` or none asks for).
//! - watch: `GET ...?watch=true` (or `1`): HTTP 200, `Transfer-Encoding:
//!   chunked`, one JSON watch event per line. From `resourceVersion=N`: the
//!   events after N; from none or `0` (or with `sendInitialEvents=true`):
//!   ADDED for every current object first (and, with sendInitialEvents, a
//!   BOOKMARK annotated `k8s.io/initial-events-end`). Selectors apply as on
//!   the real server: an object that stops matching is DELETED, one that
//!   starts matching ADDED. `allowWatchBookmarks=true`: a BOOKMARK every
//!   second. When N is older than the oldest kept event, a single ERROR
//!   event with a Status 410 Expired (HTTP 200), like the real server; an
//!   unparseable resourceVersion is a 400. A watch ends after
//!   min(`timeoutSeconds`, `--max-watch-seconds` = 30) seconds, and at once
//!   when the history is compacted.
//!
//! # Test controls (same listener, same auth)
//!
//! - `POST /lbtest/compact`: forget the whole history and end every open
//!   watch: every resumed watch then gets 410 and the client relists;
//! - `POST /lbtest/close`: end every open watch (as a dropped connection
//!   or a load balancer's idle timeout would); the history stays, so the
//!   clients resume where they were;
//! - `POST /lbtest/fail?code=500&count=N`: the next N list/watch requests
//!   answer that HTTP code with a Status body;
//! - `POST /lbtest/garbage?count=N`: the next N list/watch responses are
//!   HTTP 200 with invalid JSON (a list body, or a watch stream's line);
//! - `GET /lbtest/requests`: a JSON array of every request seen, as
//!   `"METHOD /path?query"` (the query as sent, percent-encoded), except
//!   the reads of /lbtest/requests and /lbtest/state themselves;
//! - `GET /lbtest/state`: `{resourceVersion, compacted, history,
//!   openWatches, failRemaining, garbageRemaining, objects}`.
//!
//! # TLS and the files it writes
//!
//! With `--tls-dir DIR`: HTTPS with a self-signed certificate for
//! 127.0.0.1, ::1 and localhost (rcgen), and every request needs
//! `Authorization: Bearer TOKEN` (else 401). DIR gets the files of an
//! in-cluster service account: `ca.crt` (the certificate), `token` and
//! `namespace` (kube-system), so kube-rs' in-cluster config
//! (`KUBERNETES_SERVICE_HOST`/`_PORT` plus those files mounted at
//! /var/run/secrets/kubernetes.io/serviceaccount) works. Without it: plain
//! HTTP, no auth.
//!
//! A kubeconfig for the server (with TLS: `certificate-authority-data` and
//! the token) goes to `--kubeconfig-out FILE`; by default to
//! `TLS_DIR/kubeconfig` with TLS, else to `kubeconfig` next to the objects
//! directory (in its parent directory).
use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::io::Write as _;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result, bail};
use base64::Engine as _;
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt as _, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

#[derive(Parser)]
#[command(name = "lb-apiserver", about = "A wire-level Kubernetes list/watch API stand-in for tests")]
struct Cli {
    /// Directory of YAML/JSON object files (the layout of lb-agent's dir: source).
    #[arg(long)]
    objects: PathBuf,
    /// Address to listen on (port 0: any free port; see the `ready` line).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Serve HTTPS with a bearer token; write ca.crt, token, namespace and
    /// kubeconfig here.
    #[arg(long)]
    tls_dir: Option<PathBuf>,
    /// Where to write the kubeconfig. Default: TLS_DIR/kubeconfig, else
    /// `kubeconfig` in the objects directory's parent.
    #[arg(long)]
    kubeconfig_out: Option<PathBuf>,
    /// Watches end after min(timeoutSeconds, this many seconds).
    #[arg(long, default_value_t = 30)]
    max_watch_seconds: u64,
    /// Watch events kept for resumption.
    #[arg(long, default_value_t = 1000)]
    history: usize,
    /// Period of the directory poll, in milliseconds.
    #[arg(long, default_value_t = 50)]
    poll_ms: u64,
}

// ---------------------------------------------------------------- kinds

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Kind {
    Service,
    EndpointSlice,
    Node,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Service, Kind::EndpointSlice, Kind::Node];

    fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
        }
    }
    fn group(self) -> &'static str {
        match self {
            Kind::EndpointSlice => "discovery.k8s.io",
            _ => "",
        }
    }
    fn api_version(self) -> &'static str {
        match self {
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            _ => "v1",
        }
    }
    fn plural(self) -> &'static str {
        match self {
            Kind::Service => "services",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "nodes",
        }
    }
    fn namespaced(self) -> bool {
        self != Kind::Node
    }
    fn from_doc(kind: &str, api: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == kind && k.api_version() == api)
    }
    fn from_path(group: &str, plural: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.group() == group && k.plural() == plural)
    }
    fn resource(self) -> Value {
        let short: &[&str] = match self {
            Kind::Service => &["svc"],
            Kind::EndpointSlice => &[],
            Kind::Node => &["no"],
        };
        json!({
            "name": self.plural(),
            "singularName": self.name().to_lowercase(),
            "namespaced": self.namespaced(),
            "kind": self.name(),
            "verbs": ["get", "list", "watch"],
            "shortNames": short,
        })
    }
}

/// (kind, namespace ("" when cluster-scoped), name)
type Key = (Kind, String, String);

// ---------------------------------------------------------------- state

struct Stored {
    /// As read from the file (normalized), to detect changes.
    src: Value,
    /// As served: stamped with resourceVersion, uid, ...
    obj: Arc<Value>,
    uid: String,
    created: String,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum EvType {
    Added,
    Modified,
    Deleted,
}

impl EvType {
    fn as_str(self) -> &'static str {
        match self {
            EvType::Added => "ADDED",
            EvType::Modified => "MODIFIED",
            EvType::Deleted => "DELETED",
        }
    }
}

struct Event {
    rv: u64,
    kind: Kind,
    ty: EvType,
    /// The new object (for DELETED: the last state, with the deletion's rv).
    obj: Arc<Value>,
    /// MODIFIED: the previous state (for selector transitions).
    old: Option<Arc<Value>>,
}

/// A list snapshot that continue tokens page through.
struct ListSnapshot {
    kind: Kind,
    rv: u64,
    items: Vec<Arc<Value>>,
}

const SNAPSHOTS: usize = 64;
const REQUESTS: usize = 100_000;

struct State {
    rv: u64,
    objects: BTreeMap<Key, Stored>,
    history: VecDeque<Event>,
    history_cap: usize,
    /// Every event after this resourceVersion is in `history`.
    compacted: u64,
    /// Bumped by a compaction or /lbtest/close: open watches end.
    epoch: u64,
    uids: u64,
    snapshots: VecDeque<(u64, Arc<ListSnapshot>)>,
    next_snapshot: u64,
    fail: Option<(u16, u32)>,
    garbage: u32,
    requests: VecDeque<String>,
    open_watches: usize,
}

impl State {
    fn new(history_cap: usize) -> Self {
        State {
            rv: 0,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            history_cap: history_cap.max(1),
            compacted: 0,
            epoch: 0,
            uids: 0,
            snapshots: VecDeque::new(),
            next_snapshot: 1,
            fail: None,
            garbage: 0,
            requests: VecDeque::new(),
            open_watches: 0,
        }
    }

    fn push_event(&mut self, ev: Event) {
        self.history.push_back(ev);
        while self.history.len() > self.history_cap {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.rv;
            }
        }
    }

    fn stamp(&self, key: &Key, src: &Value, uid: &str, created: &str) -> Value {
        let mut o = src.clone();
        let Some(m) = o.as_object_mut() else { return o };
        m.insert("apiVersion".into(), json!(key.0.api_version()));
        m.insert("kind".into(), json!(key.0.name()));
        let meta = m.entry("metadata").or_insert_with(|| json!({}));
        if let Some(meta) = meta.as_object_mut() {
            meta.insert("resourceVersion".into(), json!(self.rv.to_string()));
            meta.insert("uid".into(), json!(uid));
            meta.entry("creationTimestamp").or_insert_with(|| json!(created));
            if key.0.namespaced() {
                meta.insert("namespace".into(), json!(key.1));
            }
        }
        o
    }

    /// Make the objects `desired`; record the differences as events.
    /// Returns whether anything changed.
    fn apply(&mut self, desired: BTreeMap<Key, Value>) -> bool {
        let mut changed = false;
        let gone: Vec<Key> = self.objects.keys().filter(|k| !desired.contains_key(*k)).cloned().collect();
        for (key, src) in desired {
            match self.objects.get(&key) {
                Some(s) if s.src == src => continue,
                Some(s) => {
                    self.rv += 1;
                    let (uid, created, old) = (s.uid.clone(), s.created.clone(), s.obj.clone());
                    let obj = Arc::new(self.stamp(&key, &src, &uid, &created));
                    self.objects.insert(key.clone(), Stored { src, obj: obj.clone(), uid, created });
                    self.push_event(Event { rv: self.rv, kind: key.0, ty: EvType::Modified, obj, old: Some(old) });
                }
                None => {
                    self.rv += 1;
                    self.uids += 1;
                    let uid = format!("1b000000-0000-4000-8000-{:012x}", self.uids);
                    let created = now_rfc3339();
                    let obj = Arc::new(self.stamp(&key, &src, &uid, &created));
                    self.objects.insert(key.clone(), Stored { src, obj: obj.clone(), uid, created });
                    self.push_event(Event { rv: self.rv, kind: key.0, ty: EvType::Added, obj, old: None });
                }
            }
            changed = true;
        }
        for key in gone {
            let Some(s) = self.objects.remove(&key) else { continue };
            self.rv += 1;
            let mut last = (*s.obj).clone();
            last["metadata"]["resourceVersion"] = json!(self.rv.to_string());
            self.push_event(Event { rv: self.rv, kind: key.0, ty: EvType::Deleted, obj: Arc::new(last), old: None });
            changed = true;
        }
        changed
    }

    /// Forget the whole history: every resourceVersion a client knows is
    /// now too old; open watches end; continue tokens expire.
    fn compact(&mut self) {
        self.rv += 1;
        self.compacted = self.rv;
        self.history.clear();
        self.snapshots.clear();
        self.epoch += 1;
    }

    fn record(&mut self, line: String) {
        if self.requests.len() >= REQUESTS {
            self.requests.pop_front();
        }
        self.requests.push_back(line);
    }
}

fn now_rfc3339() -> String {
    let secs = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (secs / 86400, secs % 86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

// ---------------------------------------------------------------- files

/// The objects of one file, by key.
type FileObjects = Vec<(Key, Value)>;

fn is_source_file(p: &Path) -> bool {
    let hidden = p.file_name().and_then(|n| n.to_str()).is_none_or(|n| n.starts_with('.'));
    !hidden && matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml" | "json"))
}

fn parse_file(path: &Path) -> Result<FileObjects, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let mut docs = Vec::new();
    if path.extension().and_then(|e| e.to_str()) == Some("json") {
        docs.push(serde_json::from_str::<Value>(&text).map_err(|e| e.to_string())?);
    } else {
        docs = lbtest::yaml_docs(&text).map_err(|e| e.to_string())?;
    }
    let mut out = Vec::new();
    for (i, d) in docs.into_iter().enumerate() {
        add_doc(&mut out, d).map_err(|e| format!("document {}: {e}", i + 1))?;
    }
    Ok(out)
}

fn add_doc(out: &mut FileObjects, mut v: Value) -> Result<(), String> {
    if v.is_null() {
        return Ok(());
    }
    if !v.is_object() {
        return Err("not an object".into());
    }
    let kind = v["kind"].as_str().unwrap_or("").to_string();
    let api = v["apiVersion"].as_str().unwrap_or("").to_string();
    if kind == "List" || kind.ends_with("List") {
        if let Value::Array(items) = v["items"].take() {
            for item in items {
                add_doc(out, item)?;
            }
        }
        return Ok(());
    }
    let Some(k) = Kind::from_doc(&kind, &api) else { return Ok(()) };
    let name = v["metadata"]["name"].as_str().unwrap_or("").to_string();
    if name.is_empty() {
        return Err(format!("{kind} without metadata.name"));
    }
    let ns = if k.namespaced() {
        let ns = v["metadata"]["namespace"].as_str().filter(|s| !s.is_empty()).unwrap_or("default").to_string();
        v["metadata"]["namespace"] = json!(ns);
        ns
    } else {
        if let Some(m) = v["metadata"].as_object_mut() {
            m.remove("namespace");
        }
        String::new()
    };
    // What the server stamps is not the file's to say.
    if let Some(m) = v["metadata"].as_object_mut() {
        m.remove("resourceVersion");
        m.remove("uid");
    }
    out.push(((k, ns, name), v));
    Ok(())
}

/// The directory's files, parsed, kept while unchanged.
struct Dir {
    path: PathBuf,
    /// file -> ((mtime ns, size, inode), its objects)
    files: BTreeMap<PathBuf, ((i64, u64, u64), FileObjects)>,
    /// Files whose current content did not parse (reported once).
    bad: BTreeMap<PathBuf, (i64, u64, u64)>,
}

impl Dir {
    fn new(path: PathBuf) -> Self {
        Dir { path, files: BTreeMap::new(), bad: BTreeMap::new() }
    }

    /// Re-read what changed; the desired objects.
    fn scan(&mut self) -> BTreeMap<Key, Value> {
        let mut seen = Vec::new();
        match std::fs::read_dir(&self.path) {
            Ok(rd) => {
                for e in rd.flatten() {
                    let p = e.path();
                    if !is_source_file(&p) {
                        continue;
                    }
                    let Ok(md) = std::fs::metadata(&p) else { continue };
                    if !md.is_file() {
                        continue;
                    }
                    let stamp = (md.mtime() * 1_000_000_000 + md.mtime_nsec(), md.size(), md.ino());
                    seen.push(p.clone());
                    if self.files.get(&p).is_some_and(|(s, _)| *s == stamp) || self.bad.get(&p) == Some(&stamp) {
                        continue;
                    }
                    match parse_file(&p) {
                        Ok(objs) => {
                            self.bad.remove(&p);
                            self.files.insert(p, (stamp, objs));
                        }
                        Err(e) => {
                            eprintln!("lb-apiserver: {}: {e} (keeping its last good content)", p.display());
                            self.bad.insert(p, stamp);
                        }
                    }
                }
            }
            Err(e) => eprintln!("lb-apiserver: read {}: {e}", self.path.display()),
        }
        self.files.retain(|p, _| seen.contains(p));
        self.bad.retain(|p, _| seen.contains(p));
        let mut desired = BTreeMap::new();
        for (p, (_, objs)) in &self.files {
            for (k, v) in objs {
                if desired.insert(k.clone(), v.clone()).is_some() {
                    eprintln!("lb-apiserver: {}: {} {}/{} defined again; the last file wins", p.display(), k.0.name(), k.1, k.2);
                }
            }
        }
        desired
    }
}

// ---------------------------------------------------------------- selectors

#[derive(Debug, Clone)]
enum LabelReq {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

fn valid_key(k: &str) -> bool {
    !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
}

fn valid_value(v: &str) -> bool {
    v.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// Split at commas outside parentheses.
fn split_terms(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn parse_labels(s: &str) -> Result<Vec<LabelReq>, String> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for term in split_terms(s) {
        let t = term.trim();
        let bad = || format!("invalid label selector term {t:?}");
        let req = if let Some(k) = t.strip_prefix('!') {
            LabelReq::NotExists(k.trim().to_string())
        } else if let Some((k, v)) = t.split_once("!=") {
            LabelReq::Ne(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = t.split_once("==") {
            LabelReq::Eq(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = t.split_once('=') {
            LabelReq::Eq(k.trim().into(), v.trim().into())
        } else if let Some((lhs, rest)) = t.split_once('(') {
            let vals = rest.strip_suffix(')').ok_or_else(bad)?;
            let vals: Vec<String> = vals.split(',').map(|v| v.trim().to_string()).collect();
            let f: Vec<&str> = lhs.split_whitespace().collect();
            match f.as_slice() {
                [k, "in"] => LabelReq::In(k.to_string(), vals),
                [k, "notin"] => LabelReq::NotIn(k.to_string(), vals),
                _ => return Err(bad()),
            }
        } else {
            LabelReq::Exists(t.to_string())
        };
        let (key, vals): (&str, Vec<&str>) = match &req {
            LabelReq::Exists(k) | LabelReq::NotExists(k) => (k, vec![]),
            LabelReq::Eq(k, v) | LabelReq::Ne(k, v) => (k, vec![v.as_str()]),
            LabelReq::In(k, v) | LabelReq::NotIn(k, v) => (k, v.iter().map(String::as_str).collect()),
        };
        if !valid_key(key) || !vals.iter().all(|v| valid_value(v)) {
            return Err(bad());
        }
        out.push(req);
    }
    Ok(out)
}

#[derive(Debug, Clone)]
enum FieldReq {
    Eq(&'static str, String),
    Ne(&'static str, String),
}

fn parse_fields(s: &str) -> Result<Vec<FieldReq>, String> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for term in s.split(',') {
        let t = term.trim();
        let (field, val, eq) = if let Some((f, v)) = t.split_once("!=") {
            (f, v, false)
        } else if let Some((f, v)) = t.split_once("==") {
            (f, v, true)
        } else if let Some((f, v)) = t.split_once('=') {
            (f, v, true)
        } else {
            return Err(format!("invalid field selector term {t:?}: want FIELD=VALUE or FIELD!=VALUE"));
        };
        let field = match field.trim() {
            "metadata.name" => "metadata.name",
            "metadata.namespace" => "metadata.namespace",
            f => return Err(format!("field label not supported: {f}")),
        };
        let val = val.trim().to_string();
        out.push(if eq { FieldReq::Eq(field, val) } else { FieldReq::Ne(field, val) });
    }
    Ok(out)
}

#[derive(Clone, Debug)]
struct Filter {
    /// From the path (`.../namespaces/NS/...`).
    namespace: Option<String>,
    labels: Vec<LabelReq>,
    fields: Vec<FieldReq>,
}

impl Filter {
    fn matches(&self, o: &Value) -> bool {
        let meta = &o["metadata"];
        let ns = meta["namespace"].as_str().unwrap_or("");
        if self.namespace.as_deref().is_some_and(|want| want != ns) {
            return false;
        }
        let field = |f: &str| match f {
            "metadata.name" => meta["name"].as_str().unwrap_or(""),
            _ => ns,
        };
        for f in &self.fields {
            let ok = match f {
                FieldReq::Eq(f, v) => field(f) == v,
                FieldReq::Ne(f, v) => field(f) != v,
            };
            if !ok {
                return false;
            }
        }
        let label = |k: &str| meta["labels"][k].as_str();
        self.labels.iter().all(|r| match r {
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::NotExists(k) => label(k).is_none(),
            LabelReq::Eq(k, v) => label(k) == Some(v.as_str()),
            LabelReq::Ne(k, v) => label(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelReq::NotIn(k, vs) => label(k).is_none_or(|l| !vs.iter().any(|v| v == l)),
        })
    }
}

// ---------------------------------------------------------------- HTTP

type Body = BoxBody<Bytes, Infallible>;

struct Server {
    state: Mutex<State>,
    /// Signalled on every change (new events, compaction).
    tick: tokio::sync::watch::Sender<()>,
    token: Option<String>,
    max_watch: Duration,
    addr: SocketAddr,
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_str(content_type).unwrap());
    r
}

fn json_response(status: StatusCode, v: &impl Serialize) -> Response<Body> {
    full(status, "application/json", serde_json::to_vec(v).unwrap_or_default())
}

fn reason_of(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        409 => "Conflict",
        410 => "Expired",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "Unknown",
    }
}

fn status_value(code: u16, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason_of(code),
        "code": code,
    })
}

fn status(code: u16, message: &str) -> Response<Body> {
    json_response(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), &status_value(code, message))
}

/// A chunked watch response fed by `rx`.
fn stream_response(rx: mpsc::Receiver<Bytes>) -> Response<Body> {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    let mut r = Response::new(StreamBody::new(stream).boxed());
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// A complete watch response of these lines.
fn lines_response(lines: Vec<Bytes>) -> Response<Body> {
    let (tx, rx) = mpsc::channel(lines.len().max(1));
    for l in lines {
        let _ = tx.try_send(l);
    }
    stream_response(rx)
}

fn pct_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

struct Query(Vec<(String, String)>);

impl Query {
    fn parse(q: &str) -> Self {
        Query(
            q.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (pct_decode(k), pct_decode(v))
                })
                .collect(),
        )
    }
    fn get(&self, k: &str) -> Option<&str> {
        self.0.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
    }
    fn flag(&self, k: &str) -> bool {
        matches!(self.get(k), Some("true" | "1"))
    }
}

/// A resource path: kind, namespace from the path, object name.
struct ResPath {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
}

fn parse_res_path(path: &str) -> Option<ResPath> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", "discovery.k8s.io", "v1", rest @ ..] => ("discovery.k8s.io", rest),
        _ => return None,
    };
    let (namespace, plural, name) = match rest {
        [plural] => (None, *plural, None),
        [plural, name] => (None, *plural, Some(*name)),
        ["namespaces", ns, plural] => (Some(*ns), *plural, None),
        ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name)),
        _ => return None,
    };
    let kind = Kind::from_path(group, plural)?;
    // Cluster-scoped kinds have no namespaced form; a namespaced object
    // is only addressed within its namespace.
    if (!kind.namespaced() && namespace.is_some()) || (kind.namespaced() && namespace.is_none() && name.is_some()) {
        return None;
    }
    if name.is_some_and(str::is_empty) {
        return None;
    }
    Some(ResPath { kind, namespace: namespace.map(String::from), name: name.map(String::from) })
}

fn discovery(srv: &Server, path: &str) -> Option<Value> {
    let group = |k: Kind| {
        let gv = json!({"groupVersion": k.api_version(), "version": "v1"});
        json!({"name": k.group(), "versions": [gv.clone()], "preferredVersion": gv})
    };
    let resources = |gv: &str| -> Value {
        Kind::ALL.into_iter().filter(|k| k.api_version() == gv).map(Kind::resource).collect()
    };
    Some(match path.trim_end_matches('/') {
        "/version" => json!({
            "major": "1", "minor": "33", "gitVersion": "v1.33.0-lb-apiserver", "gitCommit": "lb-apiserver",
            "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24.0",
            "compiler": "gc", "platform": "linux/amd64",
        }),
        "/api" => json!({
            "kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": srv.addr.to_string()}],
        }),
        "/api/v1" => json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1", "resources": resources("v1")}),
        "/apis" => json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group(Kind::EndpointSlice)]}),
        "/apis/discovery.k8s.io" => {
            let mut g = group(Kind::EndpointSlice);
            g["kind"] = json!("APIGroup");
            g["apiVersion"] = json!("v1");
            g
        }
        "/apis/discovery.k8s.io/v1" => json!({
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "discovery.k8s.io/v1",
            "resources": resources("discovery.k8s.io/v1"),
        }),
        _ => return None,
    })
}

async fn handle(srv: Arc<Server>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let raw_query = req.uri().query().unwrap_or("").to_string();
    let quiet = method == Method::GET && (path == "/lbtest/requests" || path == "/lbtest/state");
    if !quiet {
        let line = if raw_query.is_empty() { format!("{method} {path}") } else { format!("{method} {path}?{raw_query}") };
        srv.state.lock().unwrap().record(line);
    }
    if let Some(token) = &srv.token {
        let ok = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| t.trim() == token);
        if !ok {
            return Ok(status(401, "Unauthorized"));
        }
    }
    let q = Query::parse(&raw_query);
    if let Some(ctl) = path.strip_prefix("/lbtest/") {
        return Ok(control(&srv, &method, ctl, &q));
    }
    if matches!(path.as_str(), "/healthz" | "/livez" | "/readyz") {
        return Ok(full(StatusCode::OK, "text/plain", "ok"));
    }
    if let Some(doc) = discovery(&srv, &path) {
        if method != Method::GET {
            return Ok(status(405, &format!("the server does not allow this method on {path}")));
        }
        return Ok(json_response(StatusCode::OK, &doc));
    }
    let Some(rp) = parse_res_path(&path) else {
        return Ok(status(404, &format!("the server could not find the requested resource ({path})")));
    };
    if method != Method::GET {
        return Ok(status(405, &format!("{method} is not supported here: this stand-in serves get, list and watch")));
    }
    if let Some(name) = &rp.name {
        let st = srv.state.lock().unwrap();
        let key = (rp.kind, rp.namespace.clone().unwrap_or_default(), name.clone());
        return Ok(match st.objects.get(&key) {
            Some(s) => json_response(StatusCode::OK, &*s.obj),
            None => status(404, &format!("{} \"{name}\" not found", rp.kind.plural())),
        });
    }
    Ok(list_or_watch(&srv, rp, &q))
}

fn control(srv: &Arc<Server>, method: &Method, ctl: &str, q: &Query) -> Response<Body> {
    let count = || q.get("count").map_or(Ok(1), str::parse::<u32>);
    let ok = || json_response(StatusCode::OK, &json!({"ok": true}));
    match (method.as_str(), ctl) {
        ("POST", "compact") => {
            srv.state.lock().unwrap().compact();
            srv.tick.send_replace(());
            ok()
        }
        ("POST", "close") => {
            srv.state.lock().unwrap().epoch += 1;
            srv.tick.send_replace(());
            ok()
        }
        ("POST", "fail") => {
            let code = q.get("code").map_or(Ok(500), str::parse::<u16>);
            match (code, count()) {
                (Ok(code), Ok(n)) if (400..=599).contains(&code) => {
                    srv.state.lock().unwrap().fail = (n > 0).then_some((code, n));
                    ok()
                }
                _ => status(400, "want code=400..599 and count=N"),
            }
        }
        ("POST", "garbage") => match count() {
            Ok(n) => {
                srv.state.lock().unwrap().garbage = n;
                ok()
            }
            Err(_) => status(400, "want count=N"),
        },
        ("GET", "requests") => {
            let st = srv.state.lock().unwrap();
            json_response(StatusCode::OK, &st.requests)
        }
        ("GET", "state") => {
            let st = srv.state.lock().unwrap();
            json_response(
                StatusCode::OK,
                &json!({
                    "resourceVersion": st.rv,
                    "compacted": st.compacted,
                    "history": st.history.len(),
                    "openWatches": st.open_watches,
                    "failRemaining": st.fail.map_or(0, |f| f.1),
                    "garbageRemaining": st.garbage,
                    "objects": st.objects.len(),
                }),
            )
        }
        _ => status(404, &format!("no test control {method} /lbtest/{ctl}")),
    }
}

fn list_kind(kind: Kind) -> String {
    format!("{}List", kind.name())
}

#[derive(Serialize)]
struct ListBody<'a> {
    kind: String,
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    metadata: Value,
    items: &'a [Arc<Value>],
}

/// One watch event line.
fn event_line(ty: &str, obj: &Value) -> Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"{\"type\":\"");
    out.extend_from_slice(ty.as_bytes());
    out.extend_from_slice(b"\",\"object\":");
    let _ = serde_json::to_writer(&mut out, obj);
    out.extend_from_slice(b"}\n");
    out.into()
}

fn bookmark_line(kind: Kind, rv: u64, initial_end: bool) -> Bytes {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line("BOOKMARK", &json!({"kind": kind.name(), "apiVersion": kind.api_version(), "metadata": meta}))
}

fn expired_line(rv: u64, compacted: u64) -> Bytes {
    event_line("ERROR", &status_value(410, &format!("too old resource version: {rv} ({compacted})")))
}

fn list_or_watch(srv: &Arc<Server>, rp: ResPath, q: &Query) -> Response<Body> {
    let watch = q.flag("watch");
    {
        let mut st = srv.state.lock().unwrap();
        if let Some((code, n)) = st.fail {
            st.fail = (n > 1).then_some((code, n - 1));
            return status(code, &format!("injected by lb-apiserver /lbtest/fail ({code})"));
        }
        if st.garbage > 0 {
            st.garbage -= 1;
            return if watch {
                lines_response(vec![Bytes::from_static(b"{\"type\":\"ADDED\",\"object\":{this is not json\n")])
            } else {
                full(StatusCode::OK, "application/json", "{\"kind\": this is not json")
            };
        }
    }
    let rv = match q.get("resourceVersion").filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => match s.parse::<u64>() {
            Ok(v) => Some(v),
            Err(_) => return status(400, &format!("invalid resourceVersion {s:?}: want a decimal number")),
        },
    };
    let filter = match (parse_labels(q.get("labelSelector").unwrap_or("")), parse_fields(q.get("fieldSelector").unwrap_or(""))) {
        (Ok(labels), Ok(fields)) => Filter { namespace: rp.namespace.clone(), labels, fields },
        (Err(e), _) | (_, Err(e)) => return status(400, &e),
    };
    if watch {
        start_watch(srv, rp.kind, filter, rv, q)
    } else {
        list(srv, rp.kind, &filter, q)
    }
}

fn list(srv: &Server, kind: Kind, filter: &Filter, q: &Query) -> Response<Body> {
    let limit = match q.get("limit").filter(|s| !s.is_empty()).map(str::parse::<usize>) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => return status(400, "invalid limit"),
    };
    let mut st = srv.state.lock().unwrap();
    let (snap, offset, id) = match q.get("continue").filter(|s| !s.is_empty()) {
        Some(tok) => {
            let parsed = tok.split_once('/').and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<usize>().ok()?)));
            let Some((id, offset)) = parsed else { return status(400, &format!("invalid continue token {tok:?}")) };
            match st.snapshots.iter().find(|(i, _)| *i == id) {
                Some((_, s)) if s.kind == kind => (s.clone(), offset, Some(id)),
                Some(_) => return status(400, "the continue token belongs to another resource"),
                None => {
                    return status(
                        410,
                        "The provided continue parameter is too old to display a consistent list result. \
                         You can start a new list without the continue parameter.",
                    );
                }
            }
        }
        None => {
            let items: Vec<Arc<Value>> = st
                .objects
                .range((kind, String::new(), String::new())..)
                .take_while(|(k, _)| k.0 == kind)
                .filter(|(_, s)| filter.matches(&s.obj))
                .map(|(_, s)| s.obj.clone())
                .collect();
            (Arc::new(ListSnapshot { kind, rv: st.rv, items }), 0, None)
        }
    };
    let len = snap.items.len();
    let offset = offset.min(len);
    let end = if limit > 0 { (offset + limit).min(len) } else { len };
    let mut meta = json!({"resourceVersion": snap.rv.to_string()});
    if end < len {
        let id = id.unwrap_or_else(|| {
            let id = st.next_snapshot;
            st.next_snapshot += 1;
            st.snapshots.push_back((id, snap.clone()));
            while st.snapshots.len() > SNAPSHOTS {
                st.snapshots.pop_front();
            }
            id
        });
        meta["continue"] = json!(format!("{id}/{end}"));
        meta["remainingItemCount"] = json!(len - end);
    }
    drop(st);
    json_response(
        StatusCode::OK,
        &ListBody { kind: list_kind(kind), api_version: kind.api_version(), metadata: meta, items: &snap.items[offset..end] },
    )
}

/// The line an event makes for a watcher with `filter`, if any.
fn filtered(ev: &Event, filter: &Filter) -> Option<Bytes> {
    let now = filter.matches(&ev.obj);
    match ev.ty {
        EvType::Added | EvType::Deleted => now.then(|| event_line(ev.ty.as_str(), &ev.obj)),
        EvType::Modified => {
            let before = ev.old.as_deref().is_some_and(|o| filter.matches(o));
            match (before, now) {
                (true, true) => Some(event_line("MODIFIED", &ev.obj)),
                (false, true) => Some(event_line("ADDED", &ev.obj)),
                (true, false) => {
                    // It left the selection: DELETED, its last matching
                    // state at this event's resourceVersion.
                    let mut o = ev.old.as_deref().cloned().unwrap_or(Value::Null);
                    o["metadata"]["resourceVersion"] = json!(ev.rv.to_string());
                    Some(event_line("DELETED", &o))
                }
                (false, false) => None,
            }
        }
    }
}

struct WatchGuard(Arc<Server>);

impl Drop for WatchGuard {
    fn drop(&mut self) {
        if let Ok(mut st) = self.0.state.lock() {
            st.open_watches = st.open_watches.saturating_sub(1);
        }
    }
}

fn start_watch(srv: &Arc<Server>, kind: Kind, filter: Filter, rv: Option<u64>, q: &Query) -> Response<Body> {
    let timeout = q.get("timeoutSeconds").and_then(|s| s.parse::<u64>().ok()).filter(|s| *s > 0);
    let timeout = timeout.map_or(srv.max_watch, |s| Duration::from_secs(s).min(srv.max_watch));
    let bookmarks = q.flag("allowWatchBookmarks");
    let send_initial = q.flag("sendInitialEvents");
    // Subscribe before reading the state: no change can slip between.
    let tick = srv.tick.subscribe();
    let mut st = srv.state.lock().unwrap();
    let mut initial = Vec::new();
    let from = match rv {
        Some(r) if r > 0 && !send_initial => {
            if r < st.compacted {
                let line = expired_line(r, st.compacted);
                return lines_response(vec![line]);
            }
            r
        }
        // None, 0, or sendInitialEvents: the current state as ADDED first.
        _ => {
            for (_, s) in st.objects.range((kind, String::new(), String::new())..).take_while(|(k, _)| k.0 == kind) {
                if filter.matches(&s.obj) {
                    initial.push(event_line("ADDED", &s.obj));
                }
            }
            if send_initial {
                initial.push(bookmark_line(kind, st.rv, true));
            }
            st.rv
        }
    };
    st.open_watches += 1;
    let epoch = st.epoch;
    drop(st);
    let (tx, rx) = mpsc::channel(64);
    let guard = WatchGuard(srv.clone());
    tokio::spawn(watch_task(guard, tick, kind, filter, from, epoch, bookmarks, timeout, tx, initial));
    stream_response(rx)
}

#[allow(clippy::too_many_arguments)]
async fn watch_task(
    guard: WatchGuard,
    mut tick: tokio::sync::watch::Receiver<()>,
    kind: Kind,
    filter: Filter,
    mut sent: u64,
    epoch: u64,
    bookmarks: bool,
    timeout: Duration,
    tx: mpsc::Sender<Bytes>,
    initial: Vec<Bytes>,
) {
    let srv = guard.0.clone();
    let deadline = tokio::time::Instant::now() + timeout;
    for l in initial {
        if tx.send(l).await.is_err() {
            return;
        }
    }
    let mut bm = tokio::time::interval_at(tokio::time::Instant::now() + Duration::from_secs(1), Duration::from_secs(1));
    loop {
        let (lines, end) = {
            let st = srv.state.lock().unwrap();
            if st.epoch != epoch {
                (Vec::new(), true)
            } else if sent < st.compacted {
                // Fell behind the kept history.
                (vec![expired_line(sent, st.compacted)], true)
            } else {
                let start = st.history.partition_point(|e| e.rv <= sent);
                let lines: Vec<Bytes> =
                    st.history.range(start..).filter(|e| e.kind == kind).filter_map(|e| filtered(e, &filter)).collect();
                sent = sent.max(st.rv);
                (lines, false)
            }
        };
        for l in lines {
            if tx.send(l).await.is_err() {
                return;
            }
        }
        if end {
            return;
        }
        tokio::select! {
            r = tick.changed() => if r.is_err() { return },
            _ = tokio::time::sleep_until(deadline) => return,
            _ = bm.tick(), if bookmarks => {
                if tx.send(bookmark_line(kind, sent, false)).await.is_err() {
                    return;
                }
            }
            _ = tx.closed() => return,
        }
    }
}

// ---------------------------------------------------------------- TLS and files

fn random_token() -> Result<String> {
    let mut b = [0u8; 24];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

struct Tls {
    acceptor: tokio_rustls::TlsAcceptor,
    ca_pem: String,
    token: String,
}

fn make_tls(dir: &Path) -> Result<Tls> {
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string(), "::1".to_string(), "localhost".to_string()])
        .context("generate the certificate")?;
    let ca_pem = ck.cert.pem();
    let token = random_token()?;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    std::fs::write(dir.join("ca.crt"), &ca_pem)?;
    std::fs::write(dir.join("token"), &token)?;
    std::fs::write(dir.join("namespace"), "kube-system")?;
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.signing_key.serialize_der().into());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![ck.cert.der().clone()], key)
        .context("TLS server config")?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Tls { acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(cfg)), ca_pem, token })
}

fn kubeconfig(addr: SocketAddr, tls: Option<&Tls>) -> String {
    let (server, cluster_extra, user) = match tls {
        Some(t) => (
            format!("https://{addr}"),
            format!("\n    certificate-authority-data: {}", base64::engine::general_purpose::STANDARD.encode(&t.ca_pem)),
            format!("\n    token: {}", t.token),
        ),
        None => (format!("http://{addr}"), String::new(), " {}".to_string()),
    };
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: lb-apiserver\n  cluster:\n    server: {server}{cluster_extra}\n\
         users:\n- name: lb-test\n  user:{user}\ncontexts:\n- name: lb-apiserver\n  context:\n    cluster: lb-apiserver\n    \
         user: lb-test\n    namespace: default\ncurrent-context: lb-apiserver\n"
    )
}

fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp-lb-apiserver");
    std::fs::write(&tmp, text).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))?;
    Ok(())
}

// ---------------------------------------------------------------- main

fn main() -> Result<()> {
    let cli = Cli::parse();
    if !cli.objects.is_dir() {
        bail!("--objects {}: not a directory", cli.objects.display());
    }
    let mut dir = Dir::new(cli.objects.clone());
    let mut state = State::new(cli.history);
    state.apply(dir.scan());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cli.listen).await.with_context(|| format!("listen on {}", cli.listen))?;
        let addr = listener.local_addr()?;
        let tls = cli.tls_dir.as_deref().map(make_tls).transpose()?;
        let kc_path = match (&cli.kubeconfig_out, &cli.tls_dir) {
            (Some(p), _) => p.clone(),
            (None, Some(d)) => d.join("kubeconfig"),
            (None, None) => {
                let abs = std::fs::canonicalize(&cli.objects)?;
                abs.parent().unwrap_or(Path::new("/")).join("kubeconfig")
            }
        };
        write_atomic(&kc_path, &kubeconfig(addr, tls.as_ref()))?;
        let srv = Arc::new(Server {
            state: Mutex::new(state),
            tick: tokio::sync::watch::channel(()).0,
            token: tls.as_ref().map(|t| t.token.clone()),
            max_watch: Duration::from_secs(cli.max_watch_seconds.max(1)),
            addr,
        });
        // The directory poll: a plain thread (file I/O blocks).
        let poll_srv = srv.clone();
        let period = Duration::from_millis(cli.poll_ms.max(1));
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(period);
                let desired = dir.scan();
                let changed = poll_srv.state.lock().unwrap().apply(desired);
                if changed {
                    poll_srv.tick.send_replace(());
                }
            }
        });
        let acceptor = tls.map(|t| t.acceptor);
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "ready {addr}")?;
            out.flush()?;
        }
        loop {
            let (tcp, _) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("lb-apiserver: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let srv = srv.clone();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| handle(srv.clone(), req));
                let mut http = http1::Builder::new();
                http.timer(TokioTimer::new()).keep_alive(true);
                let r = match acceptor {
                    Some(a) => match a.accept(tcp).await {
                        Ok(s) => http.serve_connection(TokioIo::new(s), svc).await,
                        Err(e) => {
                            eprintln!("lb-apiserver: TLS handshake: {e}");
                            return;
                        }
                    },
                    None => http.serve_connection(TokioIo::new(tcp), svc).await,
                };
                if let Err(e) = r
                    && !e.is_incomplete_message()
                {
                    eprintln!("lb-apiserver: connection: {e}");
                }
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(ns: &str, name: &str, labels: Value) -> Value {
        json!({"metadata": {"name": name, "namespace": ns, "labels": labels}})
    }

    #[test]
    fn label_selectors() {
        let o = obj("default", "a", json!({"app": "web", "tier": "fe"}));
        let m = |s: &str| Filter { namespace: None, labels: parse_labels(s).unwrap(), fields: vec![] }.matches(&o);
        assert!(m(""));
        assert!(m("app"));
        assert!(!m("!app"));
        assert!(m("!nope"));
        assert!(m("app=web,tier==fe"));
        assert!(!m("app=web,tier!=fe"));
        assert!(m("nope!=x"));
        assert!(m("app in (db, web)"));
        assert!(!m("app notin (db,web)"));
        assert!(m("nope notin (x)"));
        assert!(parse_labels("a b").is_err());
        assert!(parse_labels("=x").is_err());
    }

    #[test]
    fn field_selectors_and_namespaces() {
        let o = obj("kube-system", "a", json!({}));
        let f = |s: &str, ns: Option<&str>| {
            Filter { namespace: ns.map(String::from), labels: vec![], fields: parse_fields(s).unwrap() }.matches(&o)
        };
        assert!(f("metadata.name=a", None));
        assert!(!f("metadata.name=b", None));
        assert!(f("metadata.namespace==kube-system,metadata.name!=b", None));
        assert!(!f("", Some("default")));
        assert!(parse_fields("spec.x=1").is_err());
    }

    #[test]
    fn percent_decoding_and_queries() {
        let q = Query::parse("&watch=true&fieldSelector=metadata.name%3Dnode-1&labelSelector=a+in+%28x%2Cy%29");
        assert!(q.flag("watch"));
        assert_eq!(q.get("fieldSelector"), Some("metadata.name=node-1"));
        assert_eq!(q.get("labelSelector"), Some("a in (x,y)"));
        assert_eq!(pct_decode("100%"), "100%");
    }

    #[test]
    fn paths() {
        let p = parse_res_path("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices").unwrap();
        assert_eq!((p.kind, p.namespace.as_deref(), p.name.as_deref()), (Kind::EndpointSlice, Some("ns"), None));
        assert!(parse_res_path("/api/v1/namespaces/ns/nodes").is_none());
        assert!(parse_res_path("/api/v1/services/x").is_none());
        assert_eq!(parse_res_path("/api/v1/nodes/n1").unwrap().name.as_deref(), Some("n1"));
    }

    #[test]
    fn events_and_history() {
        let key = |n: &str| (Kind::Service, "default".to_string(), n.to_string());
        let mut st = State::new(2);
        st.apply([(key("a"), obj("default", "a", json!({})))].into());
        assert_eq!(st.rv, 1);
        // Unchanged content: no event.
        assert!(!st.apply([(key("a"), obj("default", "a", json!({})))].into()));
        st.apply([(key("a"), obj("default", "a", json!({"x": "1"})))].into());
        st.apply(BTreeMap::new());
        let types: Vec<EvType> = st.history.iter().map(|e| e.ty).collect();
        assert_eq!(types, [EvType::Modified, EvType::Deleted]);
        assert_eq!(st.compacted, 1, "the oldest event fell out of the history");
        assert_eq!(st.history[1].obj["metadata"]["resourceVersion"], "3");
        st.compact();
        assert_eq!((st.rv, st.compacted), (4, 4));
    }

    #[test]
    fn a_label_change_out_of_a_selection_is_a_delete() {
        let f = Filter { namespace: None, labels: parse_labels("app=web").unwrap(), fields: vec![] };
        let old = Arc::new(obj("default", "a", json!({"app": "web"})));
        let ev = Event { rv: 7, kind: Kind::Service, ty: EvType::Modified, obj: Arc::new(obj("default", "a", json!({}))), old: Some(old) };
        let line = filtered(&ev, &f).unwrap();
        let v: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(v["type"], "DELETED");
        assert_eq!(v["object"]["metadata"]["resourceVersion"], "7");
    }

    #[test]
    fn dates() {
        let d = now_rfc3339();
        assert_eq!(d.len(), 20, "{d}");
        assert!(d.starts_with("20"), "{d}");
    }
}
