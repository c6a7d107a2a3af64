//! lb-agent's `--source kube` end to end, against `lb-apiserver`: a
//! wire-level list/watch API server (real HTTP, chunked watch streams,
//! resourceVersions, 410 Expired, TLS with a bearer token) fed from the
//! cluster's object directory. The API server runs inside node-1's netns
//! on 127.0.0.1, where that node's agent reaches it.
//!
//! The first test checks the stand-in itself with kube-rs' own client, so
//! that the others test the agent, not the fake.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use lbtest::objects::{SvcPort, node, service, slice};
use lbtest::{ApiServer, Cluster, Pod, Summary, with_netns};

const VIP: &str = "10.96.0.10";
const SP: &[SvcPort] = &[("http", 80, 8080, "TCP")];
const EP: &[(&str, u16, &str)] = &[("http", 8080, "TCP")];

fn be(p: &Pod) -> String {
    format!("{}:8080", p.ip)
}

fn slice_for(svc: &str, name: &str, pods: &[&Pod]) -> String {
    let eps: Vec<(&str, &str, bool)> = pods.iter().map(|p| (p.ip.as_str(), "node-1", true)).collect();
    slice(svc, name, EP, &eps)
}

fn names(s: &Summary) -> BTreeSet<&str> {
    s.replies.keys().map(String::as_str).collect()
}

/// Percent-decoding of a logged request line.
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The logged requests, decoded, from index `from` on.
fn requests_since(api: &ApiServer, from: usize) -> Result<Vec<String>> {
    Ok(api.requests()?.into_iter().skip(from).map(|r| decode(&r)).collect())
}

fn is_watch(r: &str) -> bool {
    r.contains("watch=true") || r.contains("watch=1")
}

/// Requests on the collection `path` (list or watch), not a deeper path.
fn on(r: &str, path: &str) -> bool {
    r.strip_prefix("GET ").and_then(|r| r.strip_prefix(path)).is_some_and(|rest| rest.is_empty() || rest.starts_with('?'))
}

const SERVICES: &str = "/api/v1/services";
const SLICES: &str = "/apis/discovery.k8s.io/v1/endpointslices";
const NODES: &str = "/api/v1/nodes";

/// One node; backend pods serving on 8080 and a client pod; Service `web`
/// on VIP with the first two pods; Node objects; the API server in
/// node-1's netns.
fn world(pods: &[&str], tls: bool) -> Result<(Cluster, ApiServer, Vec<Pod>, Pod)> {
    let (c, v, client) = Cluster::one_node(pods)?;
    // Two Node objects: the agent must watch only its own.
    c.write_object("nodes.yaml", &format!("{}---\n{}", node("node-1", "zone-a"), node("node-2", "zone-b")))?;
    c.write_object("svc.yaml", &service("web", VIP, SP))?;
    c.write_object("slice.yaml", &slice_for("web", "web-1", &[&v[0], &v[1]]))?;
    let api = c.start_apiserver(1, tls)?;
    Ok((c, api, v, client))
}

fn tcp(c: &Cluster, pod: &Pod, n: u32) -> Result<Summary> {
    c.probe(pod, &["tcp", "--addr", &format!("{VIP}:80"), "--count", &n.to_string()])
}

/// Wait up to `secs` for VIP:80 to be programmed with exactly `want`.
fn wait_backends(c: &Cluster, want: &[&Pod], secs: u64) -> Result<()> {
    let mut want: Vec<String> = want.iter().map(|p| be(p)).collect();
    want.sort();
    c.wait_for(&format!("{VIP}:80 = {want:?}"), Duration::from_secs(secs), || {
        Ok(c.programmed(1, VIP, 80, "TCP")?.map(|mut v| {
            v.sort();
            v
        }) == Some(want.clone()))
    })
}

fn log(c: &Cluster) -> String {
    std::fs::read_to_string(c.agent_log(1)).unwrap_or_default()
}

/// Poll VIP:80's programmed backends until `stop`; count the polls and
/// the times it was missing or empty.
fn watch_programmed(c: &Cluster, stop: &AtomicBool, polls: &AtomicU32, blank: &AtomicU32) {
    while !stop.load(Ordering::SeqCst) {
        match c.programmed(1, VIP, 80, "TCP") {
            Ok(Some(v)) if !v.is_empty() => {}
            _ => {
                blank.fetch_add(1, Ordering::SeqCst);
            }
        }
        polls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ------------------------------------------------------------ the stand-in

/// A scratch directory, removed on drop (and by the next cluster if this
/// process dies: the name carries its PID).
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Result<Self> {
        let d = std::env::temp_dir().join(format!("lbt-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("objects"))?;
        Ok(Scratch(d))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn kube_client(kubeconfig: &Path, with_token: bool) -> Result<kube::Client> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    if !with_token {
        cfg.auth_info.token = None;
    }
    Ok(kube::Client::try_from(cfg)?)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

fn api_code(r: Result<impl std::fmt::Debug, kube::Error>) -> Option<u16> {
    match r {
        Err(kube::Error::Api(s)) => Some(s.code),
        _ => None,
    }
}

fn labelled_service(name: &str, ns: &str, labels: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{{labels}}}\nspec:\n  clusterIP: {ip}\n  ports:\n  - {{name: http, port: 80, protocol: TCP}}\n"
    )
}

/// Write `file` in `dir` atomically.
fn put(dir: &Path, file: &str, text: &str) -> Result<()> {
    let tmp = dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, dir.join(file))?;
    Ok(())
}

/// The next watch event that is not a BOOKMARK.
async fn next_change<S>(w: &mut S) -> Result<WatchEvent<Service>>
where
    S: futures::Stream<Item = Result<WatchEvent<Service>, kube::Error>> + Unpin,
{
    loop {
        match w.next().await.context("watch ended")?? {
            WatchEvent::Bookmark(_) => continue,
            e => return Ok(e),
        }
    }
}

#[test]
fn the_stand_in_pages_selects_watches_and_expires_like_an_api_server() -> Result<()> {
    let scratch = Scratch::new("apiproto")?;
    let objs = scratch.0.join("objects");
    let mut all = String::new();
    for i in 0..5 {
        let labels = if i < 3 { "app: web" } else { "app: db, tier: canary" };
        all += &labelled_service(&format!("s{i}"), "default", labels, &format!("10.96.1.{i}"));
        all += "---\n";
    }
    all += &labelled_service("x", "other", "app: web", "10.96.1.99");
    put(&objs, "svcs.yaml", &all)?;
    put(&objs, "nodes.yaml", &format!("{}---\n{}---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ignored\n", node("node-1", "a"), node("node-2", "b")))?;
    let api = ApiServer::start(None, &objs, None, &scratch.0.join("kubeconfig"), &scratch.0.join("log"))?;

    runtime()?.block_on(async {
        let c = kube_client(&api.kubeconfig, true).await?;
        let svcs: Api<Service> = Api::all(c.clone());

        // Pages of 2 through one consistent snapshot: a Service added
        // between two pages is not in this list.
        let p1 = svcs.list(&ListParams::default().limit(2)).await?;
        let tok = p1.metadata.continue_.clone().context("a continue token")?;
        assert_eq!(p1.items.len(), 2);
        assert_eq!(p1.metadata.remaining_item_count, Some(4));
        put(&objs, "late.yaml", &labelled_service("late", "default", "app: web", "10.96.1.50"))?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut seen: Vec<String> = p1.items.iter().map(|s| s.metadata.name.clone().unwrap()).collect();
        let mut cont = Some(tok);
        while let Some(t) = cont {
            let p = svcs.list(&ListParams::default().limit(2).continue_token(&t)).await?;
            assert_eq!(p.metadata.resource_version, p1.metadata.resource_version, "one snapshot");
            seen.extend(p.items.iter().map(|s| s.metadata.name.clone().unwrap()));
            cont = p.metadata.continue_.filter(|t| !t.is_empty());
        }
        assert_eq!(seen, ["s0", "s1", "s2", "s3", "s4", "x"]);
        let fresh = svcs.list(&ListParams::default()).await?;
        assert_eq!(fresh.items.len(), 7, "the new list has the late Service");
        let rv = fresh.metadata.resource_version.clone().unwrap();
        assert!(rv.parse::<u64>()? > p1.metadata.resource_version.clone().unwrap().parse::<u64>()?);
        for s in &fresh.items {
            assert!(s.metadata.uid.is_some() && s.metadata.resource_version.is_some(), "{:?}", s.metadata);
        }

        // Selectors, namespaces, get.
        let sel = |l: &str| ListParams::default().labels(l);
        let n = |l: &kube::core::ObjectList<Service>| l.items.iter().map(|s| s.metadata.name.clone().unwrap()).collect::<Vec<_>>();
        assert_eq!(n(&svcs.list(&sel("app=web")).await?), ["late", "s0", "s1", "s2", "x"]);
        assert_eq!(n(&svcs.list(&sel("app,tier!=canary,!nope")).await?), ["late", "s0", "s1", "s2", "x"]);
        assert_eq!(n(&svcs.list(&sel("tier in (canary)")).await?), ["s3", "s4"]);
        assert_eq!(n(&Api::<Service>::namespaced(c.clone(), "other").list(&ListParams::default()).await?), ["x"]);
        assert_eq!(n(&svcs.list(&ListParams::default().fields("metadata.namespace!=default")).await?), ["x"]);
        assert_eq!(api_code(svcs.list(&sel("a b c")).await), Some(400));
        let nodes: Api<Node> = Api::all(c.clone());
        let only = nodes.list(&ListParams::default().fields("metadata.name=node-2")).await?;
        assert_eq!(only.items.len(), 1);
        assert_eq!(only.items[0].metadata.name.as_deref(), Some("node-2"));
        assert_eq!(nodes.get("node-1").await?.metadata.name.as_deref(), Some("node-1"));
        assert_eq!(api_code(nodes.get("nope").await), Some(404));

        // A watch from the list's resourceVersion: a change, as MODIFIED
        // with a newer resourceVersion; a label change out of a selection
        // as DELETED.
        let mut w = svcs.watch(&WatchParams::default().timeout(10), &rv).await?.boxed();
        let mut web = svcs.watch(&WatchParams::default().labels("app=web").timeout(10), &rv).await?.boxed();
        put(&objs, "late.yaml", &labelled_service("late", "default", "app: gone", "10.96.1.50"))?;
        match next_change(&mut w).await? {
            WatchEvent::Modified(s) => {
                assert_eq!(s.metadata.name.as_deref(), Some("late"));
                assert!(s.metadata.resource_version.unwrap().parse::<u64>()? > rv.parse::<u64>()?);
            }
            e => panic!("want MODIFIED, got {e:?}"),
        }
        match next_change(&mut web).await? {
            WatchEvent::Deleted(s) => assert_eq!(s.metadata.name.as_deref(), Some("late")),
            e => panic!("want DELETED, got {e:?}"),
        }
        // Bookmarks when asked for.
        let mut bm = svcs.watch(&WatchParams::default().timeout(10), &rv).await?.boxed();
        let mut got_bookmark = false;
        for _ in 0..5 {
            if let WatchEvent::Bookmark(b) = bm.next().await.context("watch ended")?? {
                assert!(b.metadata.resource_version.parse::<u64>()? > rv.parse::<u64>()?);
                got_bookmark = true;
                break;
            }
        }
        assert!(got_bookmark);

        // After a compaction, a watch from an old resourceVersion gets a
        // single ERROR event with a 410 Expired Status (HTTP 200).
        api.control("/lbtest/compact")?;
        let mut old = svcs.watch(&WatchParams::default(), &rv).await?.boxed();
        match old.next().await.context("watch ended")?? {
            WatchEvent::Error(s) => assert_eq!((s.code, s.reason.as_str()), (410, "Expired")),
            e => panic!("want a 410 ERROR event, got {e:?}"),
        }
        assert!(old.next().await.is_none(), "the stream ends after the error");
        // Continue tokens do not outlive a compaction either.
        let p = svcs.list(&ListParams::default().limit(2)).await?;
        api.control("/lbtest/compact")?;
        let t = p.metadata.continue_.unwrap();
        assert_eq!(api_code(svcs.list(&ListParams::default().limit(2).continue_token(&t)).await), Some(410));
        // An unparseable resourceVersion is a 400, on lists and watches.
        let bad = ListParams { resource_version: Some("abc".into()), ..Default::default() };
        assert_eq!(api_code(svcs.list(&bad).await), Some(400));
        assert_eq!(api_code(svcs.watch(&WatchParams::default(), "abc").await.map(|_| ())), Some(400));

        // Injected faults: a code with a Status body, then invalid JSON.
        api.control("/lbtest/fail?code=500&count=2")?;
        assert_eq!(api_code(svcs.list(&ListParams::default()).await), Some(500));
        assert_eq!(api_code(nodes.list(&ListParams::default()).await), Some(500));
        assert!(svcs.list(&ListParams::default()).await.is_ok(), "two failures only");
        // kube-rs' client retries a 503 by itself, as against a real server.
        let n = api.requests()?.len();
        api.control("/lbtest/fail?code=503&count=2")?;
        assert!(nodes.list(&ListParams::default()).await.is_ok());
        assert_eq!(api.requests()?.len() - n, 4, "the fail control and three tries");
        api.control("/lbtest/garbage?count=1")?;
        let e = svcs.list(&ListParams::default()).await.expect_err("invalid JSON");
        assert!(!matches!(e, kube::Error::Api(_)), "a decode error, not a Status: {e:?}");
        assert!(svcs.list(&ListParams::default()).await.is_ok());

        // kube-rs' own watcher pages through with limit and gets them all.
        let cfg = kube::runtime::watcher::Config::default().page_size(2);
        let mut ev = kube::runtime::watcher(svcs.clone(), cfg).boxed();
        let mut listed = 0;
        loop {
            match ev.next().await.context("watcher ended")?? {
                kube::runtime::watcher::Event::InitApply(_) => listed += 1,
                kube::runtime::watcher::Event::InitDone => break,
                _ => {}
            }
        }
        assert_eq!(listed, 7);
        anyhow::Ok(())
    })?;

    let reqs = requests_since(&api, 0)?;
    assert!(reqs.iter().any(|r| r.contains("labelSelector=app,tier!=canary,!nope")), "{reqs:#?}");
    assert!(reqs.iter().any(|r| r.contains("fieldSelector=metadata.name=node-2")), "{reqs:#?}");
    assert!(reqs.iter().filter(|r| on(r, SERVICES) && r.contains("limit=2") && r.contains("continue=")).count() >= 3, "{reqs:#?}");
    Ok(())
}

// ------------------------------------------------------------ lb-agent

#[test]
fn the_kube_source_programs_services_from_the_api_server_and_follows_changes() -> Result<()> {
    let (mut c, api, p, client) = world(&["pod-a", "pod-b", "pod-c"], false)?;
    c.start_agent_kube(1, &api.kubeconfig, &[])?;
    assert!(log(&c).contains("kube source: initial list complete"), "{}", log(&c));
    wait_backends(&c, &[&p[0], &p[1]], 10)?;
    let s = tcp(&c, &client, 40)?;
    assert_eq!(s.ok, 40, "{s:?}");
    assert_eq!(names(&s), ["pod-a", "pod-b"].into(), "{s:?}");

    // What the agent asked: Services and EndpointSlices listed from the API
    // server's cache (resourceVersion=0, as kube-proxy's informers), its
    // own Node with a paged quorum read, watches from the list's
    // resourceVersion with bookmarks.
    let reqs = requests_since(&api, 0)?;
    for path in [SERVICES, SLICES] {
        assert!(reqs.iter().any(|r| on(r, path) && !is_watch(r) && r.contains("resourceVersion=0")), "a cached list of {path}: {reqs:#?}");
    }
    assert!(reqs.iter().any(|r| on(r, NODES) && !is_watch(r) && r.contains("limit=500")), "a paged list of {NODES}: {reqs:#?}");
    for path in [SERVICES, SLICES, NODES] {
        assert!(
            reqs.iter().any(|r| on(r, path) && is_watch(r) && r.contains("resourceVersion=") && r.contains("allowWatchBookmarks=true")),
            "a watch of {path}: {reqs:#?}"
        );
    }
    for r in reqs.iter().filter(|r| on(r, NODES)) {
        assert!(r.contains("fieldSelector=metadata.name=node-1"), "every Node request selects this node: {r}");
    }

    // An endpoint change arrives through the watch.
    c.write_object("slice.yaml", &slice_for("web", "web-1", &[&p[0], &p[2]]))?;
    wait_backends(&c, &[&p[0], &p[2]], 10)?;
    let s = tcp(&c, &client, 40)?;
    assert_eq!(s.ok, 40, "{s:?}");
    assert_eq!(names(&s), ["pod-a", "pod-c"].into(), "{s:?}");

    // Dropped watch connections resume from their resourceVersion: no
    // new list; the next change still arrives.
    c.wait_for("three open watches", Duration::from_secs(10), || Ok(api.state()?["openWatches"] == 3))?;
    let before = api.requests()?.len();
    api.control("/lbtest/close")?;
    c.wait_for("three watches resumed", Duration::from_secs(10), || {
        Ok(requests_since(&api, before)?.iter().filter(|r| is_watch(r)).count() >= 3)
    })?;
    let reqs = requests_since(&api, before)?;
    assert!(reqs.iter().all(|r| is_watch(r) || r.starts_with("POST ")), "resumed, not relisted: {reqs:#?}");

    // Labelled for another proxy, the Service leaves the agent's label
    // selection: the API server sends a DELETED, and it is unprogrammed;
    // unlabelled, it comes back.
    c.write_object("svc.yaml", &service("web", VIP, SP).replace("  namespace: default\n", "  namespace: default\n  labels:\n    service.kubernetes.io/service-proxy-name: other\n"))?;
    c.wait_programmed(VIP, 80, "TCP", None)?;
    c.write_object("svc.yaml", &service("web", VIP, SP))?;
    wait_backends(&c, &[&p[0], &p[2]], 10)?;

    // A second Service appears, and the first goes away.
    c.write_object("svc2.yaml", &service("api", "10.96.0.11", SP))?;
    c.write_object("slice2.yaml", &slice_for("api", "api-1", &[&p[1]]))?;
    c.wait_programmed("10.96.0.11", 80, "TCP", Some(&[&be(&p[1])]))?;
    c.remove_object("svc.yaml")?;
    c.wait_programmed(VIP, 80, "TCP", None)?;
    let s = c.probe(&client, &["tcp", "--addr", "10.96.0.11:80", "--count", "5"])?;
    assert_eq!(names(&s), ["pod-b"].into(), "{s:?}");
    Ok(())
}

#[test]
fn after_a_compaction_the_agent_relists_without_ever_blanking_the_maps() -> Result<()> {
    let (mut c, api, p, _client) = world(&["pod-a", "pod-b", "pod-c"], false)?;
    c.write_object("svc2.yaml", &service("gone", "10.96.0.11", SP))?;
    c.write_object("slice2.yaml", &slice_for("gone", "gone-1", &[&p[0]]))?;
    c.start_agent_kube(1, &api.kubeconfig, &[])?;
    wait_backends(&c, &[&p[0], &p[1]], 10)?;
    c.wait_programmed("10.96.0.11", 80, "TCP", Some(&[&be(&p[0])]))?;
    // The agent is watching, from a known resourceVersion.
    c.wait_for("three open watches", Duration::from_secs(10), || Ok(api.state()?["openWatches"] == 3))?;
    let before = api.requests()?.len();

    let (stop, polls, blank) = (AtomicBool::new(false), AtomicU32::new(0), AtomicU32::new(0));
    std::thread::scope(|s| -> Result<()> {
        s.spawn(|| watch_programmed(&c, &stop, &polls, &blank));
        std::thread::sleep(Duration::from_millis(300));
        // Forget the history: the open watches end, and each resumes from
        // a resourceVersion that is now too old. Right away, while the
        // watchers back off before relisting, one Service goes away and
        // the other's endpoints change: the relist must bring both.
        api.control("/lbtest/compact")?;
        c.remove_object("svc2.yaml")?;
        c.remove_object("slice2.yaml")?;
        c.write_object("slice.yaml", &slice_for("web", "web-1", &[&p[1], &p[2]]))?;
        let r = wait_backends(&c, &[&p[1], &p[2]], 30)
            .and_then(|_| c.wait_for("gone unprogrammed", Duration::from_secs(30), || Ok(c.programmed(1, "10.96.0.11", 80, "TCP")?.is_none())));
        // Keep polling a little after the swap.
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::SeqCst);
        r
    })?;
    let (polls, blank) = (polls.load(Ordering::SeqCst), blank.load(Ordering::SeqCst));
    assert!(polls > 5, "the maps were polled throughout: {polls}");
    assert_eq!(blank, 0, "{VIP}:80 was missing or empty in {blank} of {polls} polls during the relist");

    // Each kind: a watch resumed from an old resourceVersion (answered 410),
    // then a new list. A kind whose objects did not change (Nodes here) may
    // relist only after its watcher's backoff: wait for it.
    let relisted = |path: &str| -> Result<bool> {
        let reqs = requests_since(&api, before)?;
        let watch = reqs.iter().position(|r| on(r, path) && is_watch(r));
        let list = reqs.iter().rposition(|r| on(r, path) && !is_watch(r));
        Ok(matches!((watch, list), (Some(w), Some(l)) if w < l))
    };
    for path in [SERVICES, SLICES, NODES] {
        if c.wait_for(&format!("{path}: a re-watch, then a relist"), Duration::from_secs(10), || relisted(path)).is_err() {
            panic!("{path}: a re-watch, then a relist: {:#?}", requests_since(&api, before)?);
        }
    }
    // A 410 is a routine relist, said at info level, not a failure.
    let text = log(&c);
    assert!(text.contains("watch expired (410 Gone); relisting"), "the 410 is reported: {text}");
    assert!(!text.contains("cannot watch"), "not as an error: {text}");
    Ok(())
}

#[test]
fn api_errors_and_garbage_leave_traffic_alone_and_a_later_change_still_arrives() -> Result<()> {
    let (mut c, api, p, client) = world(&["pod-a", "pod-b", "pod-c"], false)?;
    c.start_agent_kube(1, &api.kubeconfig, &[])?;
    wait_backends(&c, &[&p[0], &p[1]], 10)?;
    c.wait_for("three open watches", Duration::from_secs(10), || Ok(api.state()?["openWatches"] == 3))?;

    // 500s, then invalid JSON, for the agent's next list/watch requests;
    // the compaction makes all three watchers ask again at once.
    api.control("/lbtest/fail?code=500&count=6")?;
    api.control("/lbtest/garbage?count=3")?;
    api.control("/lbtest/compact")?;
    let started = Instant::now();
    let (mut attempts, mut ok) = (0, 0);
    loop {
        let s = c.probe(&client, &["tcp", "--addr", &format!("{VIP}:80"), "--count", "10", "--interval-ms", "10"])?;
        attempts += s.attempts;
        ok += s.ok;
        assert_eq!(names(&s).difference(&["pod-a", "pod-b"].into()).count(), 0, "{s:?}");
        let st = api.state()?;
        if st["failRemaining"] == 0 && st["garbageRemaining"] == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "the agent did not consume the injected faults: {st}");
    }
    assert_eq!(ok, attempts, "the ClusterIP kept working through the faults");
    assert!(attempts >= 20, "{attempts}");
    assert!(log(&c).contains("cannot watch"), "the faults are reported: {}", log(&c));
    // client-go's request metrics count them, by code, host and method.
    let (_, m) = c.http(1, "127.0.0.1:10249", "/metrics")?;
    let requests = |code: &str| {
        let name = format!("rest_client_requests_total{{code=\"{code}\",host=\"{}\",method=\"GET\"}} ", api.addr);
        m.lines().find_map(|l| l.strip_prefix(name.as_str())?.trim().parse::<f64>().ok())
    };
    assert_eq!(requests("500"), Some(6.0), "the six injected 500s: {m}");
    assert!(requests("200").is_some_and(|n| n >= 6.0), "the lists and watches: {m}");
    let timed = format!("rest_client_request_duration_seconds_count{{host=\"{}\",verb=\"GET\"}} ", api.addr);
    let timed = m.lines().find_map(|l| l.strip_prefix(timed.as_str())?.trim().parse::<f64>().ok());
    assert!(timed.is_some_and(|n| n >= 12.0), "every request timed: {m}");

    // 503s (an API server behind a load balancer with no server up) are
    // failures the agent reports and counts, each one, as client-go does:
    // kube-rs' client would retry them silently, for minutes.
    api.control("/lbtest/fail?code=503&count=3")?;
    api.control("/lbtest/compact")?;
    c.wait_for("the 503s consumed", Duration::from_secs(30), || Ok(api.state()?["failRemaining"] == 0))?;
    c.wait_for("the 503s counted", Duration::from_secs(10), || {
        let (_, m) = c.http(1, "127.0.0.1:10249", "/metrics")?;
        let name = format!("rest_client_requests_total{{code=\"503\",host=\"{}\",method=\"GET\"}} ", api.addr);
        Ok(m.lines().find_map(|l| l.strip_prefix(name.as_str())?.trim().parse::<f64>().ok()) == Some(3.0))
    })?;
    assert!(log(&c).contains("503"), "the 503s are reported: {}", log(&c));

    // A change after the fault gets through once the watchers recover.
    c.write_object("slice.yaml", &slice_for("web", "web-1", &[&p[0], &p[2]]))?;
    wait_backends(&c, &[&p[0], &p[2]], 60)?;
    let s = tcp(&c, &client, 40)?;
    assert_eq!(s.ok, 40, "{s:?}");
    assert_eq!(names(&s), ["pod-a", "pod-c"].into(), "{s:?}");
    Ok(())
}

#[test]
fn in_cluster_config_over_tls_with_a_service_account_token() -> Result<()> {
    let (mut c, api, p, client) = world(&["pod-a", "pod-b", "pod-c"], true)?;
    let sa = api.tls_dir.clone().unwrap();
    for f in ["ca.crt", "token", "namespace"] {
        assert!(sa.join(f).is_file(), "{f}");
    }
    // The server wants the token: without it, 401; with it, the list.
    let netns = api.netns.clone();
    let kc = api.kubeconfig.clone();
    let (without, with) = with_netns(netns.as_deref(), || {
        runtime()?.block_on(async {
            let lp = ListParams::default();
            let anon = Api::<Service>::all(kube_client(&kc, false).await?).list(&lp).await;
            let auth = Api::<Service>::all(kube_client(&kc, true).await?).list(&lp).await;
            anyhow::Ok((api_code(anon), auth.map(|l| l.items.len()).map_err(|e| e.to_string())))
        })
    })?;
    assert_eq!(without, Some(401));
    assert_eq!(with, Ok(1));

    // The agent with nothing but a pod's in-cluster configuration.
    let real = Path::new("/var/run/secrets/kubernetes.io/serviceaccount");
    let had = real.exists();
    c.start_agent_in_cluster(1, &api, &[])?;
    let text = log(&c);
    assert!(text.contains(&format!("https://{}", api.addr)), "in-cluster URL from KUBERNETES_SERVICE_HOST/PORT: {text}");
    wait_backends(&c, &[&p[0], &p[1]], 10)?;
    let s = tcp(&c, &client, 20)?;
    assert_eq!(names(&s), ["pod-a", "pod-b"].into(), "{s:?}");
    c.write_object("slice.yaml", &slice_for("web", "web-1", &[&p[2]]))?;
    wait_backends(&c, &[&p[2]], 10)?;
    assert_eq!(real.exists(), had, "the machine's own /var/run/secrets is untouched");

    // And again with --kubeconfig: the same TLS server, CA data and token
    // from the kubeconfig.
    c.kill_agent(1);
    c.start_agent_kube(1, &api.kubeconfig, &[])?;
    c.write_object("slice.yaml", &slice_for("web", "web-1", &[&p[0], &p[1], &p[2]]))?;
    wait_backends(&c, &[&p[0], &p[1], &p[2]], 10)?;
    let s = tcp(&c, &client, 60)?;
    assert_eq!(s.ok, 60, "{s:?}");
    assert_eq!(names(&s).len(), 3, "{s:?}");
    Ok(())
}


/// `lb_source_watch_failing_seconds` of node 1's agent.
fn failing_seconds(c: &Cluster) -> Result<f64> {
    let (_, m) = c.http(1, "127.0.0.1:10249", "/metrics")?;
    let v = m.lines().find_map(|l| l.strip_prefix("lb_source_watch_failing_seconds ")).context("no lb_source_watch_failing_seconds")?;
    Ok(v.trim().parse()?)
}

/// Lists answered 200 with a body that cannot be decoded fail for as long
/// as they do: `lb_source_watch_failing_seconds` counts from the first
/// failure (a 200's headers, or the watcher's retry starting, do not
/// restart it), and goes back to 0 once the lists decode again.
#[test]
fn lists_that_keep_failing_after_their_headers_are_reported_failing_throughout() -> Result<()> {
    let (mut c, api, p, client) = world(&["pod-a", "pod-b"], false)?;
    c.start_agent_kube(1, &api.kubeconfig, &[])?;
    wait_backends(&c, &[&p[0], &p[1]], 10)?;
    c.wait_for("three open watches", Duration::from_secs(10), || Ok(api.state()?["openWatches"] == 3))?;
    api.control("/lbtest/garbage?count=1000000")?;
    api.control("/lbtest/compact")?;
    c.wait_for("a failure reported", Duration::from_secs(10), || Ok(failing_seconds(&c)? > 0.0))?;
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(6));
    let f = failing_seconds(&c)?;
    assert!(f >= started.elapsed().as_secs_f64() - 0.5, "failing for {f} s, since at least {:?} ago", started.elapsed());
    // The ClusterIP works throughout, from what the maps hold.
    assert_eq!(tcp(&c, &client, 10)?.ok, 10);
    api.control("/lbtest/garbage?count=0")?;
    c.wait_for("lb_source_watch_failing_seconds back to 0", Duration::from_secs(40), || Ok(failing_seconds(&c)? == 0.0))
}

/// Failing watches show while the sync loop hangs: the source, its client
/// and the gauge run on the agent's side thread, beside `/metrics`, not on
/// the loop's (since 12-07; a sync that blocked froze the gauge at what it
/// read last).
#[test]
fn failing_watches_show_while_the_sync_loop_hangs() -> Result<()> {
    let (mut c, api, p, _client) = world(&["pod-a", "pod-b"], false)?;
    c.start_agent_kube(1, &api.kubeconfig, &[])?;
    wait_backends(&c, &[&p[0], &p[1]], 10)?;
    c.wait_for("three open watches", Duration::from_secs(10), || Ok(api.state()?["openWatches"] == 3))?;
    let stopped = lbtest::ThreadStopped::new(c.agent_pid(1).context("the agent runs")?)?;
    api.control("/lbtest/fail?code=500&count=1000000")?;
    api.control("/lbtest/close")?;
    c.wait_for("the failure reported while the loop hangs", Duration::from_secs(15), || Ok(failing_seconds(&c)? > 1.0))?;
    assert!(log(&c).contains("cannot watch"), "{}", log(&c));
    drop(stopped);
    api.control("/lbtest/fail?code=500&count=0")?;
    c.wait_for("lb_source_watch_failing_seconds back to 0", Duration::from_secs(40), || Ok(failing_seconds(&c)? == 0.0))
}

/// A watch whose re-watch fails once and then succeeds is healthy again,
/// even when nothing changes afterwards.
#[test]
fn a_watch_that_resumes_after_an_error_is_not_reported_failing() -> Result<()> {
    let (mut c, api, p, _client) = world(&["pod-a", "pod-b"], false)?;
    c.start_agent_kube(1, &api.kubeconfig, &[])?;
    wait_backends(&c, &[&p[0], &p[1]], 10)?;
    c.wait_for("three open watches", Duration::from_secs(10), || Ok(api.state()?["openWatches"] == 3))?;
    // The connections drop, and each watch's first try to resume fails.
    api.control("/lbtest/fail?code=500&count=3")?;
    api.control("/lbtest/close")?;
    c.wait_for("the failures consumed", Duration::from_secs(10), || Ok(api.state()?["failRemaining"] == 0))?;
    c.wait_for("three open watches again", Duration::from_secs(20), || Ok(api.state()?["openWatches"] == 3))?;
    c.wait_for("lb_source_watch_failing_seconds back to 0", Duration::from_secs(10), || Ok(failing_seconds(&c)? == 0.0))
}

/// An API server that dies without a word (power lost; here every packet
/// to and from it dropped) is noticed by TCP keepalive within seconds
/// (`--api-keepalive`, 2 s here: 5 s to the verdict), not at the watch's
/// 290 s timeout: the watches fail, are reported failing, and start
/// again; traffic goes on from the maps meanwhile, and once the server is
/// back a change made while it was gone arrives.
#[test]
fn a_server_that_dies_without_a_word_is_noticed_by_tcp_keepalive() -> Result<()> {
    let (mut c, api, p, client) = world(&["pod-a", "pod-b"], false)?;
    c.start_agent_kube(1, &api.kubeconfig, &["--api-keepalive", "2s"])?;
    wait_backends(&c, &[&p[0], &p[1]], 10)?;
    c.wait_for("three open watches", Duration::from_secs(10), || Ok(api.state()?["openWatches"] == 3))?;
    let port = api.addr.rsplit(':').next().context("the API server's port")?.to_string();
    let netns = c.nodes[0].netns.clone();
    let rule = |op: &str, dir: &str| -> Result<String> { c.in_netns(&netns, &["iptables", "-w", op, "INPUT", "-i", "lo", "-p", "tcp", dir, &port, "-j", "DROP"]) };
    rule("-I", "--dport")?;
    rule("-I", "--sport")?;
    let dropped = Instant::now();
    c.wait_for("the dead server noticed", Duration::from_secs(15), || Ok(failing_seconds(&c)? > 0.0))?;
    eprintln!("noticed after {:.1?}", dropped.elapsed());
    assert!(log(&c).contains("cannot watch"), "{}", log(&c));
    assert_eq!(tcp(&c, &client, 10)?.ok, 10, "the maps serve meanwhile");
    // Gone while the server could not be reached; seen once it can.
    c.write_object("slice.yaml", &slice_for("web", "web-1", &[&p[0]]))?;
    std::thread::sleep(Duration::from_secs(1));
    rule("-D", "--dport")?;
    rule("-D", "--sport")?;
    wait_backends(&c, &[&p[0]], 60)?;
    c.wait_for("lb_source_watch_failing_seconds back to 0", Duration::from_secs(40), || Ok(failing_seconds(&c)? == 0.0))
}
