//! Where Kubernetes objects come from. Sources know nothing about BPF: each
//! runs as a task and publishes a full snapshot of the objects whenever they
//! change. The channel keeps only the newest snapshot, so a burst of changes
//! that arrives while the agent programs the maps becomes one sync.
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Node;

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
}

/// The newest update; `None` until the source has its first full view.
pub type Publisher = tokio::sync::watch::Sender<Option<Arc<Update>>>;
pub type Subscriber = tokio::sync::watch::Receiver<Option<Arc<Update>>>;

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
    fn source_specs() {
        assert_eq!("dir:/x".parse::<SourceSpec>(), Ok(SourceSpec::Dir("/x".into())));
        assert_eq!("kube".parse::<SourceSpec>(), Ok(SourceSpec::Kube));
        assert!("dir:".parse::<SourceSpec>().unwrap_err().contains("needs a path"));
        assert!("http://x".parse::<SourceSpec>().unwrap_err().contains("unknown source scheme \"http\""));
        assert!("bogus".parse::<SourceSpec>().unwrap_err().contains("unknown source"));
    }
}
