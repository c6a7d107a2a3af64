//! The `kube` source: kube-rs watchers with reflectors on Services,
//! EndpointSlices and this node's Node object.
//!
//! - Re-lists (410 Gone, watcher restarts) are kube-rs' job: a reflector
//!   store swaps in the full new list only at its end (`InitDone`), so the
//!   snapshot never shows a half-listed world and the maps are never blanked.
//!   Objects that vanished while the watch was down are gone after the swap.
//! - Nothing is published before all three stores have their first full
//!   list, so an agent that restarts never removes inherited state early.
//! - Changes are debounced: a burst of changes is published as one snapshot.
use std::fmt::Debug;
use std::hash::Hash;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Config, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use super::{Publisher, Snapshot, Update};


/// How long to wait after a change for more changes before publishing.
pub const DEBOUNCE: Duration = Duration::from_millis(5);

/// A client from `--kubeconfig`, else `KUBECONFIG` / `~/.kube/config`, else
/// the in-cluster config (`KUBERNETES_SERVICE_HOST`/`_PORT` and the
/// service account).
pub async fn client(kubeconfig: Option<&Path>) -> Result<(Client, String)> {
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
    let url = config.cluster_url.to_string();
    tracing::info!(url, "API server");
    Ok((Client::try_from(config).context("build the Kubernetes client")?, url))
}

/// Run one reflector; report every change on `changed`.
fn spawn_reflector<K>(
    api: Api<K>,
    cfg: watcher::Config,
    writer: reflector::store::Writer<K>,
    changed: mpsc::UnboundedSender<Instant>,
    kind: &'static str,
    server: String,
)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    tokio::spawn(async move {
        let mut events = reflector::reflector(writer, watcher(api, cfg)).default_backoff().boxed();
        let mut failing = false;
        while let Some(ev) = events.next().await {
            match ev {
                // A (re-)list in progress: the store changes only at InitDone.
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                Ok(_) => {
                    if failing {
                        tracing::info!(kind, "watch recovered");
                        failing = false;
                    }
                    if changed.send(Instant::now()).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    failing = true;
                    tracing::error!(
                        kind,
                        "cannot watch {kind}s on the API server {server}: {e}; retrying with backoff \
                         (in a cluster without kube-proxy, KUBERNETES_SERVICE_HOST/PORT must name the real API server)"
                    );
                }
            }
        }
    });
}

fn cloned<K>(store: &Store<K>) -> Vec<Arc<K>>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    store.state()
}

/// Watch the API server and publish snapshots until the watchers end.
pub async fn run(client: Client, server: String, node_name: String, tx: Publisher) -> Result<()> {
    run_with(client, server, node_name, move |u| tx.send(Some(u)).is_ok()).await
}

/// `run`, handing each snapshot to `publish` (false: stop).
pub async fn run_with(
    client: Client,
    server: String,
    node_name: String,
    mut publish: impl FnMut(Arc<Update>) -> bool,
) -> Result<()> {
    let (svc_store, svc_writer) = reflector::store::<Service>();
    let (eps_store, eps_writer) = reflector::store::<EndpointSlice>();
    let (node_store, node_writer) = reflector::store::<Node>();
    let (changed_tx, mut changed) = mpsc::unbounded_channel();
    let all = watcher::Config::default();
    spawn_reflector(Api::<Service>::all(client.clone()), all.clone(), svc_writer, changed_tx.clone(), "Service", server.clone());
    spawn_reflector(Api::<EndpointSlice>::all(client.clone()), all, eps_writer, changed_tx.clone(), "EndpointSlice", server.clone());
    let this_node = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
    spawn_reflector(Api::<Node>::all(client), this_node, node_writer, changed_tx, "Node", server);

    // The first full view of all three before anything is published.
    let first = Instant::now();
    svc_store.wait_until_ready().await.context("Service watcher ended")?;
    eps_store.wait_until_ready().await.context("EndpointSlice watcher ended")?;
    node_store.wait_until_ready().await.context("Node watcher ended")?;
    while changed.try_recv().is_ok() {}
    tracing::info!(
        services = svc_store.state().len(),
        endpointslices = eps_store.state().len(),
        node_found = !node_store.state().is_empty(),
        "kube source: initial list complete"
    );
    let mut since = first;
    loop {
        let snapshot = Snapshot { services: cloned(&svc_store), slices: cloned(&eps_store), nodes: cloned(&node_store) };
        if !publish(Arc::new(Update { snapshot, since })) {
            return Ok(());
        }
        since = changed.recv().await.context("the watchers ended")?;
        tokio::time::sleep(DEBOUNCE).await;
        while changed.try_recv().is_ok() {}
    }
}

#[cfg(test)]
mod tests;
