//! What the watchers decode: the model's compact objects, straight from
//! the API server's JSON, with the little metadata a watch needs.
//!
//! Decoding the k8s-openapi types first and converting them would build
//! every object of a list in full at once (managed fields, annotations,
//! endpoint target references: about 70 MB for 10,000 Services with 10
//! endpoints each), only to drop most of it; the allocator keeps much of
//! that for good, interleaved with the objects kept. Decoded this way, a
//! list costs its response body and the compact objects.
use std::borrow::Cow;

use k8s_openapi::api::core::v1::ServiceStatus;
use k8s_openapi::api::discovery::v1::EndpointPort;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::runtime::reflector::Lookup;
use serde::{Deserialize, Deserializer};

use crate::model::objects::{Annotations, Labels, Meta, ServiceSpec};
use crate::model::{Endpoint, EndpointSlice, Service};

/// A model object as the watcher sees it: `meta` holds its name, namespace
/// and resourceVersion (the watcher resumes from the last one), nothing
/// else; `object` is what the store keeps.
#[derive(Clone, Debug)]
pub struct Wire<T> {
    pub meta: ObjectMeta,
    pub object: T,
}

/// The metadata fields read: the model's, and the resourceVersion.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    labels: Option<Labels>,
    #[serde(default)]
    annotations: Option<Annotations>,
}

impl WireMeta {
    /// The watcher's metadata and the model's.
    fn split(self) -> (ObjectMeta, Meta) {
        let meta = ObjectMeta {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            resource_version: self.resource_version,
            ..Default::default()
        };
        let model = Meta {
            name: self.name,
            namespace: self.namespace,
            labels: self.labels.unwrap_or_default(),
            annotations: self.annotations.unwrap_or_default(),
        };
        (meta, model)
    }
}

impl<'de> Deserialize<'de> for Wire<Service> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Raw {
            metadata: WireMeta,
            #[serde(default)]
            spec: Option<ServiceSpec>,
            #[serde(default)]
            status: Option<ServiceStatus>,
        }
        let Raw { metadata, spec, status } = Raw::deserialize(d)?;
        let (meta, metadata) = metadata.split();
        Ok(Wire { meta, object: Service { metadata, spec, status } })
    }
}

impl<'de> Deserialize<'de> for Wire<EndpointSlice> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Raw {
            metadata: WireMeta,
            #[serde(default)]
            address_type: String,
            #[serde(default)]
            endpoints: Option<Vec<Endpoint>>,
            #[serde(default)]
            ports: Option<Vec<EndpointPort>>,
        }
        let Raw { metadata, address_type, endpoints, ports } = Raw::deserialize(d)?;
        let (meta, metadata) = metadata.split();
        Ok(Wire { meta, object: EndpointSlice { metadata, address_type, endpoints: endpoints.unwrap_or_default(), ports } })
    }
}

/// Which API kind a model type is.
pub trait Kind {
    const KIND: &'static str;
    const GROUP: &'static str;
    const PLURAL: &'static str;
}

impl Kind for Service {
    const KIND: &'static str = "Service";
    const GROUP: &'static str = "";
    const PLURAL: &'static str = "services";
}

impl Kind for EndpointSlice {
    const KIND: &'static str = "EndpointSlice";
    const GROUP: &'static str = "discovery.k8s.io";
    const PLURAL: &'static str = "endpointslices";
}

/// What the watcher requests and decodes.
impl<T: Kind> Resource for Wire<T> {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;
    fn kind(_: &()) -> Cow<'_, str> {
        T::KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        T::GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        T::PLURAL.into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

/// What the reflector stores: the model's objects, keyed by namespace and
/// name only (no resourceVersion or uid kept).
macro_rules! lookup {
    ($ty:ty) => {
        impl Lookup for $ty {
            type DynamicType = ();
            fn kind(d: &()) -> Cow<'_, str> {
                <Wire<$ty> as Resource>::kind(d)
            }
            fn group(d: &()) -> Cow<'_, str> {
                <Wire<$ty> as Resource>::group(d)
            }
            fn version(d: &()) -> Cow<'_, str> {
                <Wire<$ty> as Resource>::version(d)
            }
            fn plural(d: &()) -> Cow<'_, str> {
                <Wire<$ty> as Resource>::plural(d)
            }
            fn name(&self) -> Option<Cow<'_, str>> {
                self.metadata.name.as_deref().map(Cow::Borrowed)
            }
            fn namespace(&self) -> Option<Cow<'_, str>> {
                self.metadata.namespace.as_deref().map(Cow::Borrowed)
            }
            fn resource_version(&self) -> Option<Cow<'_, str>> {
                None
            }
            fn uid(&self) -> Option<Cow<'_, str>> {
                None
            }
        }
    };
}
lookup!(Service);
lookup!(EndpointSlice);

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::model::LABEL_SERVICE_PROXY_NAME;
    use crate::model::objects::LAST_CHANGE_TRIGGER_TIME;
    use crate::model::proptests::{service, slice};

    proptest! {
        /// The wire form of a k8s-openapi object's JSON holds the model's
        /// object as `From` converts it, and the watcher's metadata.
        #[test]
        fn wire_equals_from(s in service(), e in slice(6), rv in "[0-9]{1,8}") {
            let mut s = s;
            let mut e = e;
            s.metadata.resource_version = Some(rv.clone());
            e.metadata.resource_version = Some(rv.clone());
            s.metadata.labels = Some([("app".to_string(), "x".to_string()), (LABEL_SERVICE_PROXY_NAME.to_string(), "other".to_string())].into());
            s.metadata.managed_fields = Some(vec![Default::default()]);
            e.metadata.annotations = Some([("a".to_string(), "b".to_string()), (LAST_CHANGE_TRIGGER_TIME.to_string(), "2026-12-01T10:00:00Z".to_string())].into());
            let ws: Wire<Service> = serde_json::from_value(serde_json::to_value(&s).unwrap()).unwrap();
            prop_assert_eq!(&ws.object, &Service::from(&s));
            prop_assert_eq!(ws.meta.resource_version.as_deref(), Some(rv.as_str()));
            prop_assert_eq!(&ws.meta.name, &s.metadata.name);
            prop_assert_eq!(&ws.meta.namespace, &s.metadata.namespace);
            let we: Wire<EndpointSlice> = serde_json::from_value(serde_json::to_value(&e).unwrap()).unwrap();
            prop_assert_eq!(&we.object, &EndpointSlice::from(&e));
            prop_assert_eq!(we.meta.resource_version.as_deref(), Some(rv.as_str()));
        }
    }

    /// JSON nulls where the API server may send them.
    #[test]
    fn nulls_are_empty() {
        let s: Wire<Service> = serde_json::from_str(r#"{"metadata":{"name":"a","namespace":"b","labels":null,"annotations":null},"spec":null}"#).unwrap();
        assert_eq!(s.object.metadata.name.as_deref(), Some("a"));
        let e: Wire<EndpointSlice> =
            serde_json::from_str(r#"{"metadata":{"name":"a","namespace":"b"},"addressType":"IPv4","endpoints":null,"ports":null}"#).unwrap();
        assert!(e.object.endpoints.is_empty());
    }
}
