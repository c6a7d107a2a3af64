//! Where Kubernetes objects come from. Sources know nothing about BPF: they
//! hand the agent a full snapshot of objects each time something changes.
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

pub mod dir;

/// A full snapshot of the objects a source knows.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
}

/// `--source` parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceSpec {
    Dir(std::path::PathBuf),
}

impl std::str::FromStr for SourceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            Some(("dir", path)) if !path.is_empty() => Ok(SourceSpec::Dir(path.into())),
            Some(("dir", _)) => Err("dir: needs a path, as in dir:/etc/lb/objects".into()),
            Some((scheme, _)) => Err(format!("unknown source scheme {scheme:?}; supported: dir:PATH")),
            None if s == "kube" => Err("the kube source is not built yet; use dir:PATH".into()),
            None => Err(format!("unknown source {s:?}; supported: dir:PATH")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_specs() {
        assert_eq!("dir:/x".parse::<SourceSpec>(), Ok(SourceSpec::Dir("/x".into())));
        assert!("dir:".parse::<SourceSpec>().unwrap_err().contains("needs a path"));
        assert!("http://x".parse::<SourceSpec>().unwrap_err().contains("unknown source scheme \"http\""));
        assert!("bogus".parse::<SourceSpec>().unwrap_err().contains("unknown source"));
    }
}
