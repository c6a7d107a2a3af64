//! The kube source against kube-rs' mocked client service: a fake API
//! server that answers lists and watches from a scripted state.
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};

use super::*;
use crate::model::{self, FrontendKey, Proto};

type Responder = tower_test::mock::SendResponse<Response<Body>>;

#[derive(Default)]
struct Kind {
    items: BTreeMap<String, Value>,
    /// A watch request waiting for events.
    parked: Option<Responder>,
    /// What a lagging watch cache answers lists at resourceVersion=0 with
    /// (`None`: the same as `items`).
    cache: Option<Vec<Value>>,
    /// The watch cache cannot reach a version asked for: lists at one
    /// (`resourceVersion=N`, N > 0) time out, 504.
    stuck: bool,
    /// Status codes to answer the next lists with, and the Retry-After
    /// seconds they ask for.
    fail_lists: Vec<(u16, Option<u64>)>,
    lists: u32,
    /// The query strings of the requests for this kind.
    queries: Vec<String>,
}

#[derive(Default)]
struct State {
    rv: u64,
    kinds: BTreeMap<&'static str, Kind>,
}

/// The fake API server: kinds by collection path.
#[derive(Clone, Default)]
struct Fake(Arc<Mutex<State>>);

const SERVICES: &str = "/api/v1/services";
const SLICES: &str = "/apis/discovery.k8s.io/v1/endpointslices";
const NODES: &str = "/api/v1/nodes";

fn name_of(v: &Value) -> String {
    v["metadata"]["name"].as_str().unwrap().to_string()
}

impl Fake {
    /// Service "a" (10.96.0.1) with one endpoint, 10.0.0.1; no Node.
    fn one_service() -> Self {
        let fake = Fake::default();
        fake.set(SERVICES, vec![svc("a", "10.96.0.1")]);
        fake.set(SLICES, vec![slice("a", "a-1", &["10.0.0.1"])]);
        fake.set(NODES, vec![]);
        fake
    }

    fn set(&self, path: &'static str, items: Vec<Value>) {
        let mut st = self.0.lock().unwrap();
        st.kinds.entry(path).or_default().items = items.into_iter().map(|v| (name_of(&v), v)).collect();
    }

    /// Make lists at resourceVersion=0 answer `items`, as a watch cache
    /// behind etcd would.
    fn lag(&self, path: &'static str, items: Vec<Value>) {
        self.0.lock().unwrap().kinds.entry(path).or_default().cache = Some(items);
    }

    /// Make lists at a version (N > 0) fail as a cache that cannot reach
    /// it does.
    fn stick(&self, path: &'static str) {
        self.0.lock().unwrap().kinds.entry(path).or_default().stuck = true;
    }

    fn fail_next_list(&self, path: &'static str, code: u16) {
        self.0.lock().unwrap().kinds.entry(path).or_default().fail_lists.push((code, None));
    }

    /// Answer the next list of `path` with `code`, asking for a wait of
    /// `secs` (Retry-After).
    fn fail_next_list_asking(&self, path: &'static str, code: u16, secs: u64) {
        self.0.lock().unwrap().kinds.entry(path).or_default().fail_lists.push((code, Some(secs)));
    }

    fn queries(&self, path: &'static str) -> Vec<String> {
        self.0.lock().unwrap().kinds.get(path).map_or(Vec::new(), |k| k.queries.clone())
    }

    fn lists(&self, path: &'static str) -> u32 {
        self.0.lock().unwrap().kinds.get(path).map_or(0, |k| k.lists)
    }

    /// Send one watch event to the parked watch of `path` (waiting for the
    /// watcher to come back if it is between two watches).
    async fn event(&self, path: &'static str, ty: &str, obj: Value) {
        for _ in 0..500 {
            {
                let mut st = self.0.lock().unwrap();
                st.rv += 1;
                let rv = st.rv;
                let kind = st.kinds.entry(path).or_default();
                if let Some(resp) = kind.parked.take() {
                    let mut obj = obj.clone();
                    if ty != "ERROR" {
                        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
                        match ty {
                            "DELETED" => {
                                kind.items.remove(&name_of(&obj));
                            }
                            _ => {
                                kind.items.insert(name_of(&obj), obj.clone());
                            }
                        }
                    }
                    let line = format!("{}\n", json!({"type": ty, "object": obj}));
                    resp.send_response(Response::new(Body::from(line.into_bytes())));
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no watch on {path} to deliver {ty} to");
    }

    /// Send many MODIFIED events in one watch response, as fast as the API
    /// server can.
    async fn burst(&self, path: &'static str, objs: Vec<Value>) {
        for _ in 0..500 {
            {
                let mut st = self.0.lock().unwrap();
                let mut lines = String::new();
                let mut rv = st.rv;
                let kind = st.kinds.entry(path).or_default();
                if let Some(resp) = kind.parked.take() {
                    for mut obj in objs {
                        rv += 1;
                        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
                        kind.items.insert(name_of(&obj), obj.clone());
                        lines += &format!("{}\n", json!({"type": "MODIFIED", "object": obj}));
                    }
                    st.rv = rv;
                    resp.send_response(Response::new(Body::from(lines.into_bytes())));
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no watch on {path}");
    }

    /// Answer requests until the client goes away.
    async fn serve(self, mut handle: tower_test::mock::Handle<Request<Body>, Response<Body>>) {
        while let Some((req, send)) = handle.next_request().await {
            let path = req.uri().path().to_string();
            let query = req.uri().query().unwrap_or("").to_string();
            let key = [SERVICES, SLICES, NODES].into_iter().find(|p| *p == path).unwrap_or_else(|| panic!("unexpected request {path}"));
            let mut st = self.0.lock().unwrap();
            st.rv += 1;
            let rv = st.rv;
            let kind = st.kinds.entry(key).or_default();
            kind.queries.push(query.clone());
            if query.contains("watch=true") {
                // Hold the watch open until the test sends an event.
                kind.parked = Some(send);
                continue;
            }
            kind.lists += 1;
            let at_version = query.split('&').any(|kv| kv.strip_prefix("resourceVersion=").is_some_and(|v| v != "0"));
            if kind.stuck && at_version {
                // As the API server answers it: "Too large resource
                // version", to be asked again in a second.
                kind.fail_lists.insert(0, (504, Some(1)));
            }
            if !kind.fail_lists.is_empty() {
                let (code, retry_after) = kind.fail_lists.remove(0);
                let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": "injected failure", "reason": "InternalError", "code": code});
                let mut r = Response::new(Body::from(serde_json::to_vec(&status).unwrap()));
                *r.status_mut() = StatusCode::from_u16(code).unwrap();
                if let Some(secs) = retry_after {
                    r.headers_mut().insert(http::header::RETRY_AFTER, secs.into());
                }
                send.send_response(r);
                continue;
            }
            let list_kind = match key {
                SERVICES => "ServiceList",
                SLICES => "EndpointSliceList",
                _ => "NodeList",
            };
            let api = if key == SLICES { "discovery.k8s.io/v1" } else { "v1" };
            let items: Vec<Value> = match &kind.cache {
                Some(cached) if query.split('&').any(|kv| kv == "resourceVersion=0") => cached.clone(),
                _ => kind.items.values().cloned().collect(),
            };
            let body = json!({"apiVersion": api, "kind": list_kind, "metadata": {"resourceVersion": rv.to_string()}, "items": items});
            send.send_response(Response::new(Body::from(serde_json::to_vec(&body).unwrap())));
        }
    }
}

fn svc(name: &str, ip: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
        "spec": {"clusterIP": ip, "clusterIPs": [ip], "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}})
}

fn slice(svc: &str, name: &str, ips: &[&str]) -> Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": ips.iter().map(|ip| json!({"addresses": [ip], "conditions": {"ready": true}})).collect::<Vec<_>>()})
}

fn node(name: &str, zone: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}}})
}

struct Harness {
    rx: crate::source::Subscriber,
    status: Arc<crate::source::Status>,
    /// Every snapshot seen, as the set of Service names.
    seen: Vec<BTreeSet<String>>,
}

impl Harness {
    fn start(fake: Fake) -> Self {
        let (mock, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        Self::run(fake, handle, |_| Client::new(mock, "default"))
    }

    /// `start`, the fake behind the layers lb's client puts above
    /// kube-rs' (`observed`).
    fn start_observed(fake: Fake) -> Self {
        let (mock, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        Self::run(fake, handle, |status| Client::new(observed(ObserveLayer { status, host: "mock".into() }).service(mock), "default"))
    }

    fn run(fake: Fake, handle: tower_test::mock::Handle<Request<Body>, Response<Body>>, client: impl FnOnce(Arc<crate::source::Status>) -> Client) -> Self {
        tokio::spawn(fake.clone().serve(handle));
        let (tx, rx) = tokio::sync::watch::channel(None);
        let status = Arc::new(crate::source::Status::default());
        tokio::spawn(run(client(status.clone()), "mock".into(), "node-a".into(), tx, status.clone()));
        Harness { rx, status, seen: Vec::new() }
    }

    /// Wait until the published snapshot satisfies `pred`; return it.
    async fn until(&mut self, what: &str, pred: impl Fn(&Snapshot) -> bool) -> Arc<Update> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(u) = self.rx.borrow_and_update().clone() {
                self.seen.push(u.snapshot.services.iter().map(|s| s.metadata.name.clone().unwrap()).collect());
                if pred(&u.snapshot) {
                    return u;
                }
            }
            if tokio::time::timeout_at(deadline, self.rx.changed()).await.is_err() {
                panic!("timed out waiting for {what}; last: {:?}", self.seen.last());
            }
        }
    }
}

fn names(s: &Snapshot) -> BTreeSet<String> {
    s.services.iter().map(|s| s.metadata.name.clone().unwrap()).collect()
}

fn backends(s: &Snapshot, vip: &str) -> Vec<String> {
    let node = model::node_info(&model::NodeFacts { name: "node-a", ..Default::default() }, &s.nodes);
    let d = model::compute_with(&s.services, &s.slices, &node, &model::Options::default());
    let key = FrontendKey { addr: vip.parse().unwrap(), port: 80, proto: Proto::Tcp };
    d.frontends.get(&key).map(|f| f.backends.iter().map(|b| b.addr.to_string()).collect()).unwrap_or_default()
}

#[tokio::test]
async fn initial_list_then_add_modify_delete() {
    let fake = Fake::default();
    fake.set(SERVICES, vec![svc("a", "10.96.0.1")]);
    fake.set(SLICES, vec![slice("a", "a-1", &["10.0.0.1"])]);
    fake.set(NODES, vec![node("node-a", "zone-1")]);
    let mut h = Harness::start(fake.clone());

    let u = h.until("initial list", |s| !s.services.is_empty()).await;
    assert_eq!(names(&u.snapshot), ["a".to_string()].into());
    assert_eq!(backends(&u.snapshot, "10.96.0.1"), ["10.0.0.1"]);
    let facts = model::NodeFacts { name: "node-a", ..Default::default() };
    assert_eq!(model::node_info(&facts, &u.snapshot.nodes).zone.as_deref(), Some("zone-1"));
    // Every object listed is a change received (kube-proxy's informers
    // add each); the Node is not counted.
    assert_eq!(u.received, crate::source::Received { services: 1, slices: 1 });

    fake.event(SERVICES, "ADDED", svc("b", "10.96.0.2")).await;
    let u = h.until("b added", |s| names(s).contains("b")).await;
    assert_eq!(u.received, crate::source::Received { services: 2, slices: 1 });

    fake.event(SLICES, "MODIFIED", slice("a", "a-1", &["10.0.0.1", "10.0.0.2"])).await;
    let u = h.until("a-1 modified", |s| backends(s, "10.96.0.1").len() == 2).await;
    assert_eq!(backends(&u.snapshot, "10.96.0.1"), ["10.0.0.1", "10.0.0.2"]);

    fake.event(SERVICES, "DELETED", svc("a", "10.96.0.1")).await;
    let u = h.until("a deleted", |s| !names(s).contains("a")).await;
    assert_eq!(names(&u.snapshot), ["b".to_string()].into());
    assert!(backends(&u.snapshot, "10.96.0.1").is_empty());
    assert_eq!(u.received, crate::source::Received { services: 3, slices: 2 });
}

/// After a 410 the watcher re-lists. kube-rs' watcher would ask any API
/// server's cache for any version; lb asks, as client-go's reflector does,
/// for the newest version it saw or newer, unpaged (the cache answers once
/// it has caught up), and where that cache cannot get there, reads
/// consistently: never an older world than the one it saw.
#[tokio::test]
async fn a_410_relist_drops_vanished_objects_without_blanking_and_never_reads_a_lagging_cache() {
    let fake = Fake::default();
    fake.set(SERVICES, vec![svc("keep", "10.96.0.1"), svc("gone", "10.96.0.2")]);
    fake.set(SLICES, vec![]);
    fake.set(NODES, vec![]);
    let mut h = Harness::start_observed(fake.clone());
    h.until("initial list", |s| names(s).len() == 2).await;
    let first = fake.queries(SERVICES);
    // The first list comes from the cache at any version, as kube-proxy's.
    assert!(first.iter().any(|q| !q.contains("watch=true") && q.contains("resourceVersion=0")), "{first:?}");
    let resumed: u64 = first.iter().filter(|q| q.contains("watch=true")).find_map(|q| q.split('&').find_map(|kv| kv.strip_prefix("resourceVersion=")?.parse().ok())).unwrap();

    // While the watch was down, "gone" was deleted and "new" created; the
    // watch then fails with 410 Gone and the watcher re-lists. The API
    // server it reaches next has a cache that answers any version with
    // the world before.
    fake.set(SERVICES, vec![svc("keep", "10.96.0.1"), svc("new", "10.96.0.3")]);
    fake.lag(SERVICES, vec![svc("keep", "10.96.0.1"), svc("gone", "10.96.0.2")]);
    let expired = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "too old resource version", "reason": "Expired", "code": 410});
    fake.event(SERVICES, "ERROR", expired.clone()).await;
    let u = h.until("re-list", |s| names(s).contains("new")).await;
    assert_eq!(names(&u.snapshot), ["keep".to_string(), "new".to_string()].into());
    let lists = |from: usize| -> Vec<String> { fake.queries(SERVICES)[from..].iter().filter(|q| !q.contains("watch=true")).cloned().collect() };
    let relists = lists(first.len());
    let at = format!("resourceVersion={resumed}&resourceVersionMatch=NotOlderThan");
    assert!(!relists.is_empty() && relists.iter().all(|q| q.contains(&at) && !q.contains("limit")), "{relists:?}");

    // A cache that cannot reach that version: a consistent read instead.
    fake.set(SERVICES, vec![svc("keep", "10.96.0.1")]);
    fake.stick(SERVICES);
    let before = fake.queries(SERVICES).len();
    fake.event(SERVICES, "ERROR", expired).await;
    let u = h.until("second re-list", |s| !names(s).contains("new")).await;
    assert_eq!(names(&u.snapshot), ["keep".to_string()].into());
    let relists = lists(before);
    assert!(relists.len() >= 2 && relists[0].contains("resourceVersionMatch=NotOlderThan"), "{relists:?}");
    let last = relists.last().unwrap();
    assert!(!last.contains("resourceVersion") && last.contains("limit=500"), "{relists:?}");
    // No published snapshot ever lost "keep" (the maps are never blanked)
    // or showed "gone" again.
    assert!(h.seen.iter().all(|s| s.contains("keep")), "{:?}", h.seen);
    let back = h.seen.iter().position(|s| s.contains("new")).unwrap();
    assert!(h.seen[back..].iter().all(|s| !s.contains("gone")), "{:?}", h.seen);
}

#[tokio::test]
async fn an_api_error_delays_the_first_snapshot_until_a_retry_succeeds() {
    let fake = Fake::one_service();
    fake.fail_next_list(SLICES, 500);
    let mut h = Harness::start(fake.clone());
    let u = h.until("first snapshot", |_| true).await;
    // The first snapshot is complete: it was published only after the
    // EndpointSlice list succeeded on retry.
    assert!(fake.lists(SLICES) >= 2);
    assert_eq!(backends(&u.snapshot, "10.96.0.1"), ["10.0.0.1"]);
    // The failure showed while it lasted, and cleared with the recovery.
    assert_eq!(h.status.failing_for(), Duration::ZERO);
}

/// client-go's retry where the API server asks for one: a list answered
/// 429 with Retry-After: 2 is sent again after 2 s (the watcher's own
/// backoff would have come back after about 0.8 s), and the wait shows as
/// a failing watch and a counted 429.
#[tokio::test]
async fn a_429_asking_for_a_wait_is_sent_again_after_it() {
    let fake = Fake::one_service();
    fake.fail_next_list_asking(SLICES, 429, 2);
    let started = std::time::Instant::now();
    let mut h = Harness::start_observed(fake.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(h.status.failing_for() > Duration::ZERO, "the wait shows as a failing watch");
    let u = h.until("first snapshot", |_| true).await;
    assert!(started.elapsed() >= Duration::from_secs(2), "sent again only after the wait asked for: {:?}", started.elapsed());
    assert_eq!(fake.lists(SLICES), 2);
    assert_eq!(backends(&u.snapshot, "10.96.0.1"), ["10.0.0.1"]);
    let count = |code: &str| h.status.requests.get_or_create(&[("code", code.into()), ("host", "mock".into()), ("method", "GET".into())]).get();
    assert_eq!(count("429"), 1);
    assert!(count("200") >= 3, "each attempt counted");
}

#[tokio::test]
async fn services_and_slices_are_filtered_at_the_api_server_as_kube_proxy_does() {
    let fake = Fake::one_service();
    let mut h = Harness::start(fake.clone());
    h.until("first snapshot", |_| true).await;
    let selector = "labelSelector=%21service.kubernetes.io%2Fservice-proxy-name%2C%21service.kubernetes.io%2Fheadless";
    for path in [SERVICES, SLICES] {
        let q = fake.queries(path);
        assert!(!q.is_empty() && q.iter().all(|q| q.contains(selector)), "{path}: {q:?}");
        // Lists come from the API server's cache, as kube-proxy's do.
        let lists: Vec<&String> = q.iter().filter(|q| !q.contains("watch=true")).collect();
        assert!(!lists.is_empty() && lists.iter().all(|q| q.contains("resourceVersion=0")), "{path}: {lists:?}");
    }
    // The Node watch asks for this node only, without the label selector.
    assert!(fake.queries(NODES).iter().all(|q| q.contains("fieldSelector=metadata.name%3Dnode-a") && !q.contains("labelSelector")));
}

#[tokio::test]
async fn a_burst_of_a_thousand_changes_is_published_as_a_few_snapshots() {
    let fake = Fake::default();
    fake.set(SERVICES, vec![svc("a", "10.96.0.1")]);
    fake.set(SLICES, vec![slice("a", "a-1", &["10.0.0.0"])]);
    fake.set(NODES, vec![]);
    let (mock, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(fake.clone().serve(handle));
    let published = Arc::new(Mutex::new(Vec::<Arc<Update>>::new()));
    let p = published.clone();
    tokio::spawn(run_with(Client::new(mock, "default"), "mock".into(), "node-a".into(), Default::default(), move |u| {
        p.lock().unwrap().push(u);
        true
    }));
    let wait = |n: usize| {
        let published = published.clone();
        async move {
            for _ in 0..1000 {
                if published.lock().unwrap().len() >= n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("fewer than {n} snapshots");
        }
    };
    wait(1).await;

    let burst: Vec<Value> = (1..=1000).map(|i| slice("a", "a-1", &[&format!("10.0.{}.{}", i / 256, i % 256)])).collect();
    fake.burst(SLICES, burst).await;
    // The last change lands...
    for _ in 0..1000 {
        let done = published.lock().unwrap().last().is_some_and(|u| backends(&u.snapshot, "10.96.0.1") == ["10.0.3.232"]);
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let n = published.lock().unwrap().len();
    let last = published.lock().unwrap().last().cloned().unwrap();
    assert_eq!(backends(&last.snapshot, "10.96.0.1"), ["10.0.3.232"]);
    // ...in a handful of snapshots, not a thousand.
    assert!(n <= 1 + 5, "{n} snapshots for 1000 changes");

    // A single change is published on its own.
    fake.event(SERVICES, "ADDED", svc("b", "10.96.0.2")).await;
    wait(n + 1).await;
    let u = published.lock().unwrap().last().cloned().unwrap();
    assert!(names(&u.snapshot).contains("b"));
}

#[test]
fn a_relist_asks_for_the_newest_version_seen_or_reads_consistently() {
    let q = "labelSelector=x&resourceVersion=0&resourceVersionMatch=NotOlderThan";
    assert_eq!(relist_query(q, Newest { rv: 0, consistent: false }), None, "the first list: any version");
    assert_eq!(relist_query(q, Newest { rv: 42, consistent: false }).as_deref(), Some("labelSelector=x&resourceVersion=42&resourceVersionMatch=NotOlderThan"));
    assert_eq!(relist_query(q, Newest { rv: 42, consistent: true }).as_deref(), Some("labelSelector=x&limit=500"));
    // The next pages of a consistent list: 500 each too.
    assert_eq!(relist_query("labelSelector=x&continue=abc", Newest { rv: 42, consistent: true }).as_deref(), Some("labelSelector=x&continue=abc&limit=500"));
    // The Node list reads consistently already (and pages).
    assert_eq!(relist_query("fieldSelector=metadata.name%3Dn&limit=500", Newest { rv: 42, consistent: false }), None);
}
