//! The `kube` source: kube-rs watchers and reflector stores on Services,
//! EndpointSlices and this node's Node object.
//!
//! - Objects are decoded straight into the model's compact form
//!   (`model::objects`, see `wire`), never built as the API sends them:
//!   a fifth of the memory at 10,000 Services.
//! - Re-lists (410 Gone, watcher restarts): the full new list replaces the
//!   old only at its end (`InitDone`), so the snapshot never shows a
//!   half-listed world and the maps are never blanked. Objects that
//!   vanished while the watch was down are gone after the swap. A re-list
//!   never asks for a world older than the one already seen
//!   (`relist_query`).
//! - Nothing is published before all three stores have their first full
//!   list, so an agent that restarts never removes inherited state early.
//! - A lone change is published at once; a burst, as one snapshot per 5 ms.
use std::fmt::Debug;
use std::hash::Hash;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use futures::{StreamExt as _, TryStreamExt as _};

use k8s_openapi::api::core::v1::Node;
use kube::runtime::reflector::{self, Lookup, Store, reflector};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Config, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use super::{Newest, Publisher, Snapshot, Status, Update};
use crate::model::{EndpointSlice, Service};

mod retry;
mod wire;
use wire::Wire;


/// kube-proxy's label selector for Services and EndpointSlices: Services
/// another proxy serves, and headless ones, are filtered at the API server
/// and never cached.
pub const LABEL_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// The shortest time between two snapshots: a burst of changes goes out as
/// one snapshot per this much time, a lone change at once.
pub const DEBOUNCE: Duration = Duration::from_millis(5);

/// A client from `--kubeconfig`, else `KUBECONFIG` / `~/.kube/config`, else
/// the in-cluster config (`KUBERNETES_SERVICE_HOST`/`_PORT` and the
/// service account).
pub async fn client(kubeconfig: Option<&Path>, keepalive: Duration, status: Arc<Status>) -> Result<(Client, String)> {
    let config = match kubeconfig {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p).with_context(|| format!("--kubeconfig {}", p.display()))?;
            Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("--kubeconfig {}", p.display()))?
        }
        None => Config::infer().await.context(
            "no Kubernetes configuration: pass --kubeconfig, set KUBECONFIG, or run in a pod \
             (in-cluster config needs KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT)",
        )?,
    };
    let mut config = config;
    // No silent retries below the watcher: kube-rs' client would retry a
    // 429, 503 or 504 up to 15 times (minutes) with nothing logged or
    // counted. The watcher's own backoff retries, and each failure is
    // reported (`cannot watch`, `lb_source_watch_failing_seconds`,
    // `rest_client_requests_total{code}`), as client-go's informers do;
    // where the server asks for a wait (Retry-After), client-go's request
    // retry waits that long, reported the same way (`observed`).
    config.default_retry = false;
    let url = config.cluster_url.to_string();
    tracing::info!(url, "API server");
    // client-go's `host` label: the server's host:port.
    let host = config.cluster_url.authority().map(|a| a.to_string()).unwrap_or_default();
    Ok((build_client(config, keepalive, ObserveLayer { status, host: host.into() })?, url))
}

/// kube-rs' client stack (`ClientBuilder::try_from(Config)`: TLS, the
/// timeouts, the base URI, auth and extra headers) on a connector with TCP
/// keepalive, which kube-rs' own does not set: a watch on a server that
/// died without a word (power lost, a half-open connection) would
/// otherwise wait for its 290 s timeout. The socket's TCP_USER_TIMEOUT
/// ends it as the probes fail, also with a request unanswered.
fn build_client(config: Config, keepalive: Duration, observe: ObserveLayer) -> Result<Client> {
    use kube::client::ConfigExt as _;
    anyhow::ensure!(
        config.proxy_url.is_none(),
        "the kubeconfig sets proxy-url, which lb's client does not support: reach the API server directly"
    );
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    if !keepalive.is_zero() {
        let interval = (keepalive / 5).max(Duration::from_secs(1));
        http.set_keepalive(Some(keepalive));
        http.set_keepalive_interval(Some(interval));
        http.set_keepalive_retries(Some(3));
        http.set_tcp_user_timeout(Some(keepalive + interval * 3));
    }
    let https = config.rustls_https_connector_with_connector(http).context("TLS for the API server")?;
    let mut timeouts = hyper_timeout::TimeoutConnector::new(https);
    timeouts.set_connect_timeout(config.connect_timeout);
    timeouts.set_read_timeout(config.read_timeout);
    timeouts.set_write_timeout(config.write_timeout);
    timeouts.set_reset_reader_on_write(config.reset_reader_on_write);
    let http_client: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build(timeouts);
    let service = observed(observe)
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer().context("API server credentials")?)
        .layer(config.extra_headers_layer().context("the kubeconfig's extra headers")?)
        .map_err(tower::BoxError::from)
        .service(http_client);
    Ok(Client::new(service, config.default_namespace))
}

/// What lb's client puts above kube-rs' layers: client-go's retries where
/// the API server asks for them (`retry`), each attempt observed.
fn observed(observe: ObserveLayer) -> tower::ServiceBuilder<tower::layer::util::Stack<ObserveLayer, tower::layer::util::Stack<tower::retry::RetryLayer<retry::RetryAfter>, tower::layer::util::Identity>>> {
    tower::ServiceBuilder::new().layer(tower::retry::RetryLayer::new(retry::RetryAfter::new(observe.status.clone()))).layer(observe)
}

/// The query a list goes out with, where it is not the one kube-rs'
/// watcher made (None). The watcher asks the API server's cache for any
/// version (`resourceVersion=0`) at every list; kube-proxy's informers
/// (client-go's reflector) do that only at the first. A re-list asks for
/// the newest version seen or newer (`resourceVersionMatch=NotOlderThan`,
/// unpaged: the cache answers it once it has caught up with that version,
/// and never with an older world: a lagging API server's cache would bring
/// deleted Services back and take new endpoints away, which lb acts on by
/// destroying sockets and resetting flows); where the cache could not
/// answer at that version (410, or 504 for a version it has not reached),
/// a consistent read (no version, pages of 500), client-go's fallback.
fn relist_query(query: &str, newest: Newest) -> Option<String> {
    let params: Vec<&str> = query.split('&').filter(|kv| !kv.is_empty()).collect();
    // The next pages of a paged list (kube-rs asks for them without the
    // limit when the watcher's own page size is unset): pages of 500 too.
    let limited = params.iter().any(|kv| kv.starts_with("limit="));
    if params.iter().any(|kv| kv.starts_with("continue=")) && !limited {
        return Some(format!("{query}&limit=500"));
    }
    if newest.rv == 0 || !params.contains(&"resourceVersion=0") {
        return None;
    }
    let kept = params.iter().filter(|kv| **kv != "resourceVersion=0" && !kv.starts_with("resourceVersionMatch="));
    let mut out: Vec<String> = kept.map(|kv| kv.to_string()).collect();
    if newest.consistent {
        // Paged, as client-go's pager pages it: without
        // ConsistentListFromCache, etcd answers it.
        if !limited {
            out.push("limit=500".into());
        }
    } else {
        out.push(format!("resourceVersion={}", newest.rv));
        out.push("resourceVersionMatch=NotOlderThan".into());
    }
    Some(out.join("&"))
}

/// The watched kind a request path is for.
fn kind_of(path: &str) -> Option<&'static str> {
    let last = path.rsplit('/').next()?;
    match last {
        "services" => Some("Service"),
        "endpointslices" => Some("EndpointSlice"),
        "nodes" => Some("Node"),
        _ => None,
    }
}

/// Tells the status when a watch request of a kind is answered 2xx
/// (`Status::watch_answered`: working once it has not failed for a
/// moment): kube-rs' watcher says nothing when a watch resumes quietly,
/// so without this a recovered watch would count as failing until its
/// kind next changed. Not a list's 2xx: its body may still fail (cut off,
/// or undecodable), and a list's success shows as its objects
/// (`spawn_watch`). Counts every request and its time for client-go's
/// `rest_client_*` metrics.
#[derive(Clone)]
struct ObserveLayer {
    status: Arc<Status>,
    host: Arc<str>,
}

impl<S> tower::Layer<S> for ObserveLayer {
    type Service = Observe<S>;
    fn layer(&self, inner: S) -> Observe<S> {
        Observe { inner, status: self.status.clone(), host: self.host.clone() }
    }
}

#[derive(Clone)]
struct Observe<S> {
    inner: S,
    status: Arc<Status>,
    host: Arc<str>,
}

impl<S, B> tower::Service<http::Request<kube::client::Body>> for Observe<S>
where
    S: tower::Service<http::Request<kube::client::Body>, Response = http::Response<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<kube::client::Body>) -> Self::Future {
        let query = req.uri().query().unwrap_or_default().to_string();
        let params = || query.split('&');
        let is_watch = params().any(|kv| kv == "watch=true" || kv == "watch=1");
        let kind = kind_of(req.uri().path());
        let method = req.method().clone();
        let (status, host) = (self.status.clone(), self.host.clone());
        // A list: nothing older than what was seen (`relist_query`).
        let mut floored = None;
        if let Some(kind) = kind
            && !is_watch
            && method == http::Method::GET
        {
            let newest = status.newest(kind);
            if let Some(q) = relist_query(&query, newest)
                && let Ok(uri) = format!("{}?{q}", req.uri().path()).parse()
            {
                *req.uri_mut() = uri;
                floored = (!newest.consistent).then_some((kind, newest.rv));
            }
        }
        // A watch resumes from a version seen (a list's, a bookmark's).
        if let Some(kind) = kind.filter(|_| is_watch)
            && let Some(rv) = params().find_map(|kv| kv.strip_prefix("resourceVersion="))
        {
            status.saw(kind, rv);
        }
        let started = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            let code = r.as_ref().map_or_else(|_| "<error>".to_string(), |resp| resp.status().as_u16().to_string());
            status.request(&host, method.as_str(), &code, started.elapsed());
            if let (Some(kind), Ok(resp)) = (kind, &r) {
                let st = resp.status();
                if st.is_success() && is_watch {
                    status.watch_answered(kind);
                } else if st.is_success() {
                    status.relist_consistent(kind, false);
                } else if let Some((kind, rv)) = floored
                    && (st == http::StatusCode::GONE || st == http::StatusCode::GATEWAY_TIMEOUT)
                {
                    tracing::warn!(
                        kind,
                        code = st.as_u16(),
                        "the API server could not list {kind}s from its cache at resourceVersion {rv} or newer, the newest \
                         lb has seen ({st}: that server's cache is behind); the next list is a consistent read"
                    );
                    status.relist_consistent(kind, true);
                }
            }
            r
        })
    }
}

/// A watcher event with its object converted to the form the store keeps.
fn convert_event<K, C>(ev: watcher::Event<K>, convert: fn(K) -> C) -> watcher::Event<C> {
    use watcher::Event;
    match ev {
        Event::Apply(o) => Event::Apply(convert(o)),
        Event::Delete(o) => Event::Delete(convert(o)),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(convert(o)),
        Event::InitDone => Event::InitDone,
    }
}

/// This node's object, without what the agent never reads and a node has
/// much of: field managers and the list of its container images.
fn strip_node(mut node: Node) -> Node {
    node.metadata.managed_fields = None;
    if let Some(status) = node.status.as_mut() {
        status.images = None;
    }
    node
}

/// What every watch shares: where to report changes and failures.
struct WatchCtx {
    changed: mpsc::UnboundedSender<Instant>,
    kind: &'static str,
    server: String,
    status: Arc<Status>,
}

/// Watch one kind through a kube-rs reflector; return its store. The store
/// keeps the objects as `convert` makes them from what the watcher
/// decodes. A (re-)list replaces the store's objects only when complete
/// (`InitDone`): the store never shows a half-listed world. Every change is
/// reported on `changed`, and every object's resourceVersion goes to
/// `Status::saw`, so that a re-list asks for nothing older (`relist_query`).
fn spawn_watch<K, C>(api: Api<K>, cfg: watcher::Config, convert: fn(K) -> C, ctx: WatchCtx) -> Store<C>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
    C: Lookup<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    let WatchCtx { changed, kind, server, status } = ctx;
    let writer = reflector::store::Writer::<C>::default();
    let store = writer.as_reader();
    let seen = status.clone();
    tokio::spawn(async move {
        let converted = watcher(api, cfg).default_backoff().map_ok(move |ev| {
            if let watcher::Event::Apply(o) | watcher::Event::Delete(o) | watcher::Event::InitApply(o) = &ev {
                seen.received_one(kind);
                if let Some(rv) = o.meta().resource_version.as_deref() {
                    seen.saw(kind, rv);
                }
            }
            convert_event(ev, convert)
        });
        let mut events = reflector(writer, converted).boxed();
        let mut failing = false;
        while let Some(ev) = events.next().await {
            let ev = match ev {
                Ok(ev) => ev,
                // A resourceVersion too old to resume from: the watcher
                // relists, as it should; nothing is failing.
                Err(watcher::Error::WatchError(st)) if st.code == 410 => {
                    tracing::info!(kind, "{kind} watch expired (410 Gone); relisting");
                    continue;
                }
                Err(e) => {
                    failing = true;
                    let for_s = status.failed(kind).as_secs();
                    tracing::error!(
                        kind,
                        failing_for_s = for_s,
                        "cannot watch {kind}s on the API server {server}: {e}; retrying with backoff; the maps keep \
                         what they hold meanwhile (in a cluster without kube-proxy, KUBERNETES_SERVICE_HOST/PORT \
                         must name the real API server)"
                    );
                    continue;
                }
            };
            // (Init comes before the list is asked for: no sign of health.)
            if failing && !matches!(ev, watcher::Event::Init) {
                tracing::info!(kind, "watch recovered");
                status.recovered(kind);
                failing = false;
            }
            // A (re-)list in progress changes nothing until it is done.
            let publish = !matches!(ev, watcher::Event::Init | watcher::Event::InitApply(_));
            if publish && changed.send(Instant::now()).is_err() {
                return;
            }
        }
    });
    store
}

/// Watch the API server and publish snapshots until the watchers end.
pub async fn run(client: Client, server: String, node_name: String, tx: Publisher, status: Arc<Status>) -> Result<()> {
    run_with(client, server, node_name, status, move |u| tx.send(Some(u)).is_ok()).await
}

/// `run`, handing each snapshot to `publish` (false: stop).
pub async fn run_with(
    client: Client,
    server: String,
    node_name: String,
    status: Arc<Status>,
    mut publish: impl FnMut(Arc<Update>) -> bool,
) -> Result<()> {
    let (changed_tx, mut changed) = mpsc::unbounded_channel();
    // Lists from the API server's watch cache, as kube-proxy's informers
    // do: when every node lists at once (a rollout, an API server
    // restart), etcd does not take them all. The first at any version
    // (resourceVersion=0), re-lists at the newest seen or newer
    // (`relist_query`). The cache answers whole (it ignores a page size),
    // and kube-rs sends resourceVersion=0 only without one.
    let mut proxied = watcher::Config::default().labels(LABEL_SELECTOR).any_semantic();
    proxied.page_size = None;
    let ctx = |kind| WatchCtx { changed: changed_tx.clone(), kind, server: server.clone(), status: status.clone() };
    let svcs = spawn_watch(Api::<Wire<Service>>::all(client.clone()), proxied.clone(), |w| w.object, ctx("Service"));
    let slices = spawn_watch(Api::<Wire<EndpointSlice>>::all(client.clone()), proxied, |w| w.object, ctx("EndpointSlice"));
    let this_node = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
    let nodes = spawn_watch(Api::<Node>::all(client), this_node, strip_node, ctx("Node"));
    drop(changed_tx);

    // The first full view of all three before anything is published.
    let ended = || anyhow::anyhow!("the watchers ended");
    tokio::try_join!(svcs.wait_until_ready(), slices.wait_until_ready(), nodes.wait_until_ready()).map_err(|_| ended())?;
    while changed.try_recv().is_ok() {}
    tracing::info!(
        services = svcs.len(),
        endpointslices = slices.len(),
        node_found = !nodes.is_empty(),
        "kube source: initial list complete"
    );
    // Pending from now, not from the list's start: a first list that took
    // longer than the stall limit (an API server slow at boot) would
    // otherwise turn /healthz 503 the moment it is published.
    let mut since = Instant::now();
    loop {
        // Counted before the stores are read: a change counted is in this
        // snapshot, or (counted as its store took it) in the next one,
        // which it makes.
        let received = status.received();
        let snapshot = Snapshot { services: svcs.state(), slices: slices.state(), nodes: nodes.state() };
        if !publish(Arc::new(Update { snapshot, since, queued: std::time::SystemTime::now(), received })) {
            return Ok(());
        }
        let published = Instant::now();
        since = changed.recv().await.context("the watchers ended")?;
        // A change after a quiet spell goes out at once; in a burst, at
        // most one snapshot goes out per DEBOUNCE.
        let quiet = published.elapsed();
        if quiet < DEBOUNCE {
            tokio::time::sleep(DEBOUNCE - quiet).await;
        }
        while changed.try_recv().is_ok() {}
    }
}

#[cfg(test)]
mod tests;
