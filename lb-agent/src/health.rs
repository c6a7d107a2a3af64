//! Health and metrics, where kube-proxy users expect them:
//! `/healthz` and `/livez` on `--healthz-bind` (default `0.0.0.0:10256`),
//! `/metrics` on `--metrics-bind` (default `127.0.0.1:10249`), with
//! kube-proxy's semantics: `/healthz` fails while the Node is being deleted
//! or cluster-autoscaler has tainted it for deletion (KEP-3836), `/livez`
//! does not; an API outage fails neither (the pinned
//! dataplane keeps serving) but shows in `lb_source_watch_failing_seconds`.
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{any, get};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// A metric labelled by one name: value pair.
type Label1 = [(&'static str, &'static str); 1];

/// Which health endpoint asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// kube-proxy's `/healthz`: keeping up, and the Node eligible.
    Healthz,
    /// kube-proxy's `/livez`: keeping up.
    Livez,
    /// lb's `/readyz`: keeping up, and the maps programmed by this agent
    /// at least once (the DaemonSet's readiness and startup probes).
    Readyz,
}

/// When the source last published a change (the `since` of its newest
/// update), read at each answer: a loop that stopped taking updates is
/// seen stalling without its help.
type Latest = Box<dyn Fn() -> Option<Instant> + Send + Sync>;

/// Whether the agent has programmed the maps and keeps up with changes.
pub struct Health {
    state: Mutex<HealthState>,
    /// A change not programmed after this long makes /healthz fail.
    stall_after: Duration,
    latest: std::sync::OnceLock<Latest>,
    /// kube-proxy's `kubeproxy_proxy_healthz_total{code}` and
    /// `kubeproxy_proxy_livez_total{code}`: the answers given.
    pub healthz_total: Family<Label1, Counter>,
    pub livez_total: Family<Label1, Counter>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health").field("state", &self.state).field("stall_after", &self.stall_after).finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct HealthState {
    /// When the maps last matched the source (wall clock, for the body);
    /// at start the start, as kube-proxy's sync loop marks itself updated
    /// before its first sync ("in case Sync() never succeeds").
    last_updated: SystemTime,
    /// This agent programmed the maps at least once.
    synced_once: bool,
    /// The oldest change the sync loop took and has not programmed yet.
    pending_since: Option<Instant>,
    /// The `since` of the newest update the maps hold.
    programmed_since: Option<Instant>,
    /// The Node is being deleted (a deletionTimestamp, or
    /// cluster-autoscaler's ToBeDeletedByClusterAutoscaler taint;
    /// `model::node_eligible`): load balancers should stop sending here
    /// (KEP-3836).
    node_deleting: bool,
    /// The node's IP families ("IPv4", "IPv6"): the body's `status`.
    families: Vec<&'static str>,
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_nanos(t).to_string()
}

impl Health {
    pub fn new(stall_after: Duration) -> Self {
        Self {
            state: Mutex::new(HealthState {
                last_updated: SystemTime::now(),
                synced_once: false,
                pending_since: None,
                programmed_since: None,
                node_deleting: false,
                families: Vec::new(),
            }),
            stall_after,
            latest: std::sync::OnceLock::new(),
            healthz_total: Family::default(),
            livez_total: Family::default(),
        }
    }

    /// Where the source's newest change is read (`Latest`).
    pub fn watch_source(&self, latest: impl Fn() -> Option<Instant> + Send + Sync + 'static) {
        let _ = self.latest.set(Box::new(latest));
    }

    /// A change arrived from the source.
    pub fn changed(&self, at: Instant) {
        let mut s = self.state.lock().unwrap();
        if s.pending_since.is_none() {
            s.pending_since = Some(at);
        }
    }

    /// The maps now hold everything the source said up to the update of
    /// `since` (and the node's `families`).
    pub fn synced(&self, since: Instant, families: &[&'static str]) {
        let mut s = self.state.lock().unwrap();
        s.last_updated = SystemTime::now();
        s.synced_once = true;
        s.pending_since = None;
        s.programmed_since = Some(since);
        s.families = families.to_vec();
    }

    /// Whether this node's Node object is being deleted.
    pub fn node_deleting(&self, deleting: bool) {
        self.state.lock().unwrap().node_deleting = deleting;
    }

    /// The answer to `probe`: healthy unless a change has waited longer
    /// than `stall_after` (kube-proxy's `healthTimeout`), so also while the
    /// agent starts, as kube-proxy's; `/healthz` also needs the Node
    /// eligible, `/readyz` a first sync. The body is kube-proxy's (1.33+):
    /// `lastUpdated` (now, when healthy, as kube-proxy keeps it for
    /// compatibility), `currentTime`, `nodeEligible` (`/healthz` only),
    /// `healthy`, and `status` by IP family.
    pub fn report(&self, probe: Probe) -> (bool, serde_json::Value) {
        let s = self.state.lock().unwrap();
        // Published by the source and not yet in the maps: pending too,
        // whether or not the sync loop took it.
        let published = self.latest.get().and_then(|f| f()).filter(|t| s.programmed_since.is_none_or(|p| *t > p));
        let oldest = match (s.pending_since, published) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let healthy = oldest.is_none_or(|t| t.elapsed() <= self.stall_after);
        let eligible = !s.node_deleting;
        let ok = match probe {
            Probe::Healthz => healthy && eligible,
            Probe::Livez => healthy,
            Probe::Readyz => healthy && s.synced_once,
        };
        let now = SystemTime::now();
        let status: serde_json::Map<String, serde_json::Value> = s
            .families
            .iter()
            .map(|f| (f.to_string(), serde_json::json!({"lastUpdated": rfc3339(s.last_updated), "healthy": healthy})))
            .collect();
        let mut body = serde_json::json!({
            "lastUpdated": rfc3339(if healthy { now } else { s.last_updated }),
            "currentTime": rfc3339(now),
            "healthy": healthy,
        });
        if !status.is_empty() {
            body["status"] = serde_json::Value::Object(status);
        }
        match probe {
            Probe::Healthz => body["nodeEligible"] = eligible.into(),
            Probe::Readyz => body["synced"] = s.synced_once.into(),
            Probe::Livez => {}
        }
        (ok, body)
    }
}

/// The datapath counters, read from the per-CPU stats map at each scrape.
pub trait StatsSource: Send + Sync + std::fmt::Debug + 'static {
    fn read(&self) -> Vec<(&'static str, u64)>;
    /// Each frontend's and backend's counters (`--metrics-per-service`).
    fn per_service(&self) -> Vec<ServiceCounters> {
        Vec::new()
    }
    /// The kernel's NAT expiry timer (`None`: unreadable).
    fn nat_expiry(&self) -> Option<crate::dataplane::inspect::NatExpiry> {
        None
    }
}

/// The sockets holding a translation storage now: created less released
/// (`stats::SOCK_TRACKED`, `SOCK_UNTRACKED`). Sockets an agent from before
/// the count translated are released uncounted: never below zero.
pub fn tracked_sockets(stats: &[(&'static str, u64)]) -> Option<u64> {
    let get = |n: &str| stats.iter().find(|(name, _)| *name == n).map(|(_, v)| *v);
    Some(get("sock_tracked")?.saturating_sub(get("sock_untracked")?))
}

/// The counters of one frontend (`addr` = its address:port) or backend.
#[derive(Debug, Clone)]
pub struct ServiceCounters {
    pub frontend: bool,
    pub addr: String,
    /// A backend's protocol (a pod's port 53 is a TCP and a UDP backend).
    pub protocol: Option<&'static str>,
    pub counters: lb_common::SvcStats,
}

#[derive(Debug)]
struct DatapathCollector(Arc<dyn StatsSource>);

impl Collector for DatapathCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        {
            let stats = self.0.read();
            let mut m = encoder.encode_descriptor(
                "lb_datapath_events",
                "Socket-LB decisions by the BPF programs (translated, refused_no_endpoints, refused_no_port, unreachable_no_local, reversed, retried, affinity_hit)",
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (name, v) in &stats {
                let labels = [("result", *name)];
                ConstCounter::new(*v).encode(m.encode_family(&labels)?)?;
            }
            if let Some(n) = tracked_sockets(&stats) {
                let m = encoder.encode_descriptor(
                    "lb_sockets_tracked",
                    "Connected sockets holding their translation in socket storage (LB_SOCK_XLATE): about 384 bytes each, charged to the memory cgroup of the agent that created lb's maps",
                    None,
                    prometheus_client::metrics::MetricType::Gauge,
                )?;
                prometheus_client::metrics::gauge::ConstGauge::new(n as i64).encode(m)?;
            }
        }
        if let Some(e) = self.0.nat_expiry() {
            use prometheus_client::metrics::{MetricType::Gauge, gauge::ConstGauge};
            let m = encoder.encode_descriptor(
                "lb_nat_kernel_expiry_armed",
                "Whether the kernel's NAT expiry timer runs (it looked within 3 s): should the agent go, it expires the NAT tables of outside flows; 0: they would fill, then refuse new outside flows",
                None,
                Gauge,
            )?;
            ConstGauge::new(i64::from(e.armed)).encode(m)?;
            if let Some(ago) = e.walked_s {
                let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()) - ago;
                let m = encoder.encode_descriptor(
                    "lb_nat_kernel_expiry_last_walk_timestamp_seconds",
                    "When the kernel's NAT expiry last walked a NAT table (one a look at most, while no agent runs; nat_walks_without_agent counts table walks)",
                    None,
                    Gauge,
                )?;
                ConstGauge::new(at).encode(m)?;
                let m = encoder.encode_descriptor("lb_nat_kernel_expiry_last_walk_duration_seconds", "How long that walk of one table took (in softirq)", None, Gauge)?;
                ConstGauge::new(e.walk_took_s).encode(m)?;
            }
        }
        let per = self.0.per_service();
        if per.is_empty() {
            return Ok(());
        }
        type Pick = fn(&lb_common::SvcStats) -> u64;
        let families: [(&str, &str, bool, &str, Pick); 7] = [
            (
                "lb_frontend_connections",
                "Connections translated for a frontend (connect; new TC flows; behind loadBalancerSourceRanges, once a packet passes them)",
                true,
                "",
                |c| c.conns,
            ),
            ("lb_frontend_refused", "Connections to a frontend refused", true, "no_endpoints", |c| c.refused),
            ("lb_frontend_refused", "", true, "no_local_endpoint", |c| c.unreachable),
            ("lb_frontend_packets", "Packets of a frontend's translated TC flows, both directions", true, "", |c| c.packets),
            ("lb_frontend_bytes", "Bytes of a frontend's translated TC flows, both directions", true, "", |c| c.bytes),
            (
                "lb_frontend_source_range_dropped_packets",
                "Packets to a frontend dropped by its loadBalancerSourceRanges (TC; the socket path's connections and datagrams)",
                true,
                "",
                |c| c.source_range,
            ),
            ("lb_backend_connections", "Connections translated to a backend", false, "", |c| c.conns),
        ];
        let mut i = 0;
        while i < families.len() {
            let (name, help, frontend, _, _) = families[i];
            let mut m = encoder.encode_descriptor(name, help, None, prometheus_client::metrics::MetricType::Counter)?;
            // The families sharing this name (refusals by reason).
            while i < families.len() && families[i].0 == name {
                let (_, _, _, reason, pick) = families[i];
                for s in per.iter().filter(|s| s.frontend == frontend) {
                    let key = if frontend { "frontend" } else { "backend" };
                    let mut labels = vec![(key, s.addr.as_str())];
                    if let Some(p) = s.protocol {
                        labels.push(("protocol", p));
                    }
                    if !reason.is_empty() {
                        labels.push(("reason", reason));
                    }
                    ConstCounter::new(pick(&s.counters)).encode(m.encode_family(&labels)?)?;
                }
                i += 1;
            }
        }
        Ok(())
    }
}

/// The source's newest update, read at each scrape: when it was published
/// and the changes received up to it (`source::Update`).
pub type Published = Box<dyn Fn() -> Option<(SystemTime, crate::source::Received)> + Send + Sync>;

struct PublishedView(Published);

impl std::fmt::Debug for PublishedView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PublishedView")
    }
}

/// What the sync loop tells the queue gauges (`Metrics::watch_queue`).
#[derive(Debug, Default)]
pub struct QueueState {
    /// The changes received up to the update the last sync took.
    pub taken: crate::source::Received,
    /// When the loop queued a sync of its own (a node address changed).
    pub queued: Option<SystemTime>,
    /// The node's IP families, once a sync knows them.
    pub families: Vec<&'static str>,
}

/// The agent's metrics.
#[derive(Debug)]
pub struct Metrics {
    pub sync_duration: Histogram,
    pub event_to_programmed: Histogram,
    pub sync_errors: Counter,
    pub services: Gauge,
    pub backends: Gauge,
    pub map_entries: Family<[(&'static str, &'static str); 1], Gauge>,
    pub map_capacity: Family<[(&'static str, &'static str); 1], Gauge>,
    pub not_programmed: Gauge,
    pub sockets_destroyed: Counter,
    /// Stale sockets the kernel refused to destroy, by errno.
    pub sockets_destroy_failed: Family<[(&'static str, String); 1], Counter>,
    /// kube-proxy's metrics, under its names, labels and meanings (those
    /// with `ip_family` once per family this node reports: see
    /// `Reconciler::ip_families`).
    pub kp_sync_duration: Family<Label1, Histogram, fn() -> Histogram>,
    pub kp_sync_full_duration: Family<Label1, Histogram, fn() -> Histogram>,
    pub kp_sync_partial_duration: Family<Label1, Histogram, fn() -> Histogram>,
    pub kp_network_programming: Family<Label1, Histogram, fn() -> Histogram>,
    pub kp_last_sync: Family<Label1, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub kp_last_queued: Family<Label1, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub kp_endpoint_changes: Counter,
    pub kp_service_changes: Counter,
    pub kp_endpoint_changes_pending: Gauge,
    pub kp_service_changes_pending: Gauge,
    /// The source's side of the queue gauges, read at each scrape (so a
    /// sync loop that hangs does not stop them: kube-proxy sets them from
    /// its informers' handlers).
    published: std::sync::OnceLock<PublishedView>,
    /// The sync loop's side.
    pub queue: Mutex<QueueState>,
    /// (ip_family, traffic_policy).
    pub kp_no_local_endpoints: Family<[(&'static str, &'static str); 2], Gauge>,
    /// How long the source's watches have been failing (0: they work).
    pub source_failing: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Map entries that were found changed or missing by the periodic
    /// resync, and written back.
    pub drift_repaired: Counter,
    /// Processes of the attached cgroup the agent cannot see (no hostPID).
    pub cgroup_invisible: Gauge,
    /// kube-proxy's rules found on the node, per mode (1: there).
    pub kube_proxy_rules: Family<[(&'static str, &'static str); 1], Gauge>,
    /// Other owners' BPF programs on lb's socket hooks, by hook.
    pub foreign_programs: Family<[(&'static str, &'static str); 1], Gauge>,
    /// `--bpf-forward` only: NetworkPolicy engines enforcing in netfilter
    /// (crate::policy_engines), whose policy the flag bypasses.
    pub bpf_forward_policy_bypassed: Family<[(&'static str, &'static str); 1], Gauge>,
    /// lb's netfilter rules written (put in place, or back), by kind
    /// (`forward`: LB-FORWARD and its jump; `notrack`, `masquerade`: table
    /// inet lb's rules).
    pub netfilter_written: Family<[(&'static str, &'static str); 1], Counter>,
    /// Chains that may drop what lb hands to the stack without lb's accept
    /// in place (native nftables chains, rules lb could not write).
    pub netfilter_problems: Gauge,
    /// healthCheckNodePort listeners that could not be opened.
    pub health_check_failed: Gauge,
    /// Each frontend's Service, for `lb-agent monitor` (GET /frontends).
    pub frontend_names: Mutex<std::collections::BTreeMap<crate::model::FrontendKey, crate::monitor::FrontendName>>,
    registry: Mutex<Registry>,
}

impl Metrics {
    pub fn new(datapath: Arc<dyn StatsSource>) -> Arc<Self> {
        let m = Metrics {
            sync_duration: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            event_to_programmed: Histogram::new(exponential_buckets(0.0005, 2.0, 18)),
            sync_errors: Counter::default(),
            services: Gauge::default(),
            backends: Gauge::default(),
            map_entries: Family::default(),
            map_capacity: Family::default(),
            not_programmed: Gauge::default(),
            sockets_destroyed: Counter::default(),
            sockets_destroy_failed: Family::default(),
            kp_sync_duration: Family::new_with_constructor(sync_buckets),
            kp_sync_full_duration: Family::new_with_constructor(sync_buckets),
            kp_sync_partial_duration: Family::new_with_constructor(sync_buckets),
            kp_network_programming: Family::new_with_constructor(programming_buckets),
            kp_last_sync: Family::default(),
            kp_last_queued: Family::default(),
            kp_endpoint_changes: Counter::default(),
            kp_service_changes: Counter::default(),
            kp_endpoint_changes_pending: Gauge::default(),
            kp_service_changes_pending: Gauge::default(),
            published: std::sync::OnceLock::new(),
            queue: Mutex::new(QueueState::default()),
            kp_no_local_endpoints: Family::default(),
            source_failing: Gauge::default(),
            drift_repaired: Counter::default(),
            cgroup_invisible: Gauge::default(),
            kube_proxy_rules: Family::default(),
            foreign_programs: Family::default(),
            bpf_forward_policy_bypassed: Family::default(),
            netfilter_written: Family::default(),
            netfilter_problems: Gauge::default(),
            health_check_failed: Gauge::default(),
            frontend_names: Mutex::new(Default::default()),
            registry: Mutex::new(Registry::default()),
        };
        {
            let mut r = m.registry.lock().unwrap();
            r.register("lb_sync_duration_seconds", "Time to compute and program one sync", m.sync_duration.clone());
            r.register(
                "lb_event_to_programmed_seconds",
                "Time from a watch or file event to the maps holding it",
                m.event_to_programmed.clone(),
            );
            r.register("lb_sync_errors", "Syncs that failed to program the maps", m.sync_errors.clone());
            r.register("lb_services", "Programmed frontends (ClusterIP:port/proto)", m.services.clone());
            r.register("lb_backends", "Programmed backends", m.backends.clone());
            r.register("lb_map_entries", "Entries in each map the agent owns", m.map_entries.clone());
            r.register("lb_map_capacity", "max_entries of each map", m.map_capacity.clone());
            r.register(
                "lb_services_not_programmed",
                "Services left out because they could not be written (a full map)",
                m.not_programmed.clone(),
            );
            r.register(
                "lb_sockets_destroyed",
                "Connected sockets destroyed because their backend left the Service",
                m.sockets_destroyed.clone(),
            );
            r.register(
                "lb_sockets_destroy_failed",
                "Stale sockets the kernel refused to destroy, by errno (EOPNOTSUPP: a kernel built without CONFIG_INET_DIAG_DESTROY, where clients of a removed endpoint wait for their timeouts)",
                m.sockets_destroy_failed.clone(),
            );
            r.register(
                "kubeproxy_sync_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds (kube-proxy's name: one sync of the maps)",
                m.kp_sync_duration.clone(),
            );
            r.register(
                "kubeproxy_sync_full_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds for full resyncs (every frontend recomputed and written)",
                m.kp_sync_full_duration.clone(),
            );
            r.register(
                "kubeproxy_sync_partial_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds for partial resyncs (only what changed)",
                m.kp_sync_partial_duration.clone(),
            );
            r.register(
                "kubeproxy_network_programming_duration_seconds",
                "In Cluster Network Programming Latency in seconds: from an EndpointSlice's last-change-trigger-time to the maps holding it",
                m.kp_network_programming.clone(),
            );
            r.register(
                "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                "The last time proxy rules were successfully synced (Unix seconds)",
                m.kp_last_sync.clone(),
            );
            r.register(
                "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
                "The last time a sync of proxy rules was queued (a change arrived; Unix seconds)",
                m.kp_last_queued.clone(),
            );
            r.register(
                "kubeproxy_sync_proxy_rules_endpoint_changes",
                "Cumulative proxy rules Endpoint changes (EndpointSlices added, changed or removed)",
                m.kp_endpoint_changes.clone(),
            );
            r.register("kubeproxy_sync_proxy_rules_service_changes", "Cumulative proxy rules Service changes", m.kp_service_changes.clone());
            r.register(
                "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
                "Pending proxy rules Endpoint changes (received, not taken by a sync yet)",
                m.kp_endpoint_changes_pending.clone(),
            );
            r.register(
                "kubeproxy_sync_proxy_rules_service_changes_pending",
                "Pending proxy rules Service changes (received, not taken by a sync yet)",
                m.kp_service_changes_pending.clone(),
            );
            r.register(
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                "Number of services with a Local traffic policy and no endpoints on this node (Service ports with endpoints elsewhere only)",
                m.kp_no_local_endpoints.clone(),
            );
            r.register(
                "lb_source_watch_failing_seconds",
                "How long the source's watches have been failing (0: working); the dataplane keeps serving meanwhile",
                m.source_failing.clone(),
            );
            r.register(
                "lb_drift_repaired",
                "Map entries the periodic resync found changed or missing (by hand, e.g. bpftool) and wrote back",
                m.drift_repaired.clone(),
            );
            r.register(
                "lb_cgroup_processes_invisible",
                "Processes of the attached cgroup the agent cannot see in /proc (a PID namespace of its own: stale sockets cannot be destroyed)",
                m.cgroup_invisible.clone(),
            );
            r.register(
                "lb_kube_proxy_rules",
                "kube-proxy's rules found on the node, by mode (iptables-legacy, iptables-nft, nftables, ipvs): 1 while there (kube-proxy running, or its rules left behind)",
                m.kube_proxy_rules.clone(),
            );
            r.register(
                "lb_foreign_programs",
                "BPF programs of other owners on the cgroup hooks lb's socket programs use (connect4/6, sendmsg4/6, recvmsg4/6, getpeername4/6), for lb's cgroup and its ancestors, by hook: another proxy's (Cilium's socket LB, Calico's eBPF mode) acts on Service addresses before lb",
                m.foreign_programs.clone(),
            );
            r.register(
                "lb_bpf_forward_policy_bypassed",
                "With --bpf-forward: NetworkPolicy engines found enforcing in netfilter (calico, kube-router, weave-net), 1 while found: lb's outside flows, forwarded in BPF, bypass their policy",
                m.bpf_forward_policy_bypassed.clone(),
            );
            r.register(
                "lb_netfilter_rules_written",
                "lb's netfilter rules written by the agent, by kind (forward: LB-FORWARD and the jump to it; notrack and masquerade: table inet lb's rules): once at first, then once per removal repaired (a firewall reload)",
                m.netfilter_written.clone(),
            );
            r.register(
                "lb_netfilter_problems",
                "Places where what lb hands to the stack may be dropped and lb's accept is not in place: native nftables forward chains that may drop without `meta mark & MARK == MARK accept` first, and rules lb could not write (the agent's log names each)",
                m.netfilter_problems.clone(),
            );
            r.register(
                "lb_health_check_listeners_failed",
                "healthCheckNodePort listeners (a port, on every address or on one --nodeport-addresses address) that could not be opened, mostly because another process holds the port: the load balancer sees that node as down (the agent's log names each; tried again at each sync)",
                m.health_check_failed.clone(),
            );
            r.register_collector(Box::new(DatapathCollector(datapath)));
            r.register_collector(Box::new(ProcessCollector));
        }
        Arc::new(m)
    }

    /// Serve the source's requests to the API server too (client-go's
    /// `rest_client_*` metrics; none with the `dir:` source).
    pub fn register_source(&self, s: &crate::source::Status) {
        let mut r = self.registry.lock().unwrap();
        r.register("rest_client_requests", "Number of HTTP requests, partitioned by status code, method, and host.", s.requests.clone());
        r.register(
            "rest_client_request_duration_seconds",
            "Request latency in seconds. Broken down by verb, and host.",
            s.request_duration.clone(),
        );
    }

    /// Serve kube-proxy's counters of `/healthz` and `/livez` answers too.
    pub fn register_health(&self, h: &Health) {
        let mut r = self.registry.lock().unwrap();
        r.register("kubeproxy_proxy_healthz", "Cumulative proxy healthz HTTP status", h.healthz_total.clone());
        r.register("kubeproxy_proxy_livez", "Cumulative proxy livez HTTP status", h.livez_total.clone());
    }

    /// Read the source's newest update at each scrape for kube-proxy's
    /// queue gauges: `..._last_queued_timestamp_seconds` (when it was
    /// published, or the loop's own queued sync if later), the
    /// `..._changes_total` counters (changes received) and the
    /// `..._changes_pending` gauges (received, not taken by a sync).
    pub fn watch_queue(&self, published: Published) {
        let _ = self.published.set(PublishedView(published));
    }

    fn refresh_queue(&self) {
        let Some((published, received)) = self.published.get().and_then(|p| (p.0)()) else { return };
        let q = self.queue.lock().unwrap();
        let queued = q.queued.map_or(published, |t| t.max(published));
        let at = queued.duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        // The node's families now only (a family it no longer has would
        // keep a queued time past its last sync: a false alert).
        self.kp_last_queued.clear();
        for family in &q.families {
            self.kp_last_queued.get_or_create(&[("ip_family", *family)]).set(at);
        }
        let pending = received.since(q.taken);
        self.kp_service_changes_pending.set(pending.services as i64);
        self.kp_endpoint_changes_pending.set(pending.slices as i64);
        // Counters: raised to the source's count (it only grows).
        for (counter, n) in [(&self.kp_service_changes, received.services), (&self.kp_endpoint_changes, received.slices)] {
            let had = counter.get();
            if n > had {
                counter.inc_by(n - had);
            }
        }
    }

    pub fn encode(&self) -> String {
        self.refresh_queue();
        let mut out = String::new();
        let r = self.registry.lock().unwrap();
        prometheus_client::encoding::text::encode(&mut out, &r).expect("encoding to a String cannot fail");
        out
    }
}

/// kube-proxy's sync latency buckets: 1 ms, doubling, 15 of them.
fn sync_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// kube-proxy's network programming latency buckets: 0, 0.25 s, 0.5 s,
/// each second to 59 s, every 5 s to 115 s, every 30 s to 5 minutes.
fn programming_buckets() -> Histogram {
    let b = [0.0, 0.25, 0.5]
        .into_iter()
        .chain((1..=59).map(f64::from))
        .chain((0..12).map(|i| 60.0 + 5.0 * f64::from(i)))
        .chain((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    Histogram::new(b)
}

/// The standard process metrics (`process_*`, as every Prometheus client
/// and kube-proxy export them), read at each scrape.
#[derive(Debug)]
struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use prometheus_client::metrics::MetricType;
        let p = metrics_process::collector::collect();
        let gauges = [
            ("process_open_fds", "Number of open file descriptors.", p.open_fds),
            ("process_max_fds", "Maximum number of open file descriptors.", p.max_fds),
            ("process_virtual_memory_bytes", "Virtual memory size in bytes.", p.virtual_memory_bytes),
            ("process_virtual_memory_max_bytes", "Maximum amount of virtual memory available in bytes.", p.virtual_memory_max_bytes),
            ("process_resident_memory_bytes", "Resident memory size in bytes.", p.resident_memory_bytes),
            ("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", p.start_time_seconds),
            ("process_threads", "Number of OS threads in the process.", p.threads),
        ];
        for (name, help, v) in gauges {
            if let Some(v) = v {
                let g: Gauge<f64, std::sync::atomic::AtomicU64> = Gauge::default();
                g.set(v as f64);
                g.encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?)?;
            }
        }
        if let Some(cpu) = p.cpu_seconds_total {
            let m = encoder.encode_descriptor("process_cpu_seconds", "Total user and system CPU time spent in seconds.", None, MetricType::Counter)?;
            ConstCounter::new(cpu).encode(m)?;
        }
        Ok(())
    }
}

fn health_response(h: &Health, probe: Probe) -> impl IntoResponse + use<> {
    let (ok, body) = h.report(probe);
    let code = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let counter = match probe {
        Probe::Healthz => Some(&h.healthz_total),
        Probe::Livez => Some(&h.livez_total),
        Probe::Readyz => None,
    };
    if let Some(c) = counter {
        c.get_or_create(&[("code", if ok { "200" } else { "503" })]).inc();
    }
    (code, [(header::CONTENT_TYPE, "application/json"), (header::X_CONTENT_TYPE_OPTIONS, "nosniff")], body.to_string())
}

async fn healthz(State(h): State<Arc<Health>>) -> impl IntoResponse {
    health_response(&h, Probe::Healthz)
}

async fn livez(State(h): State<Arc<Health>>) -> impl IntoResponse {
    health_response(&h, Probe::Livez)
}

async fn readyz(State(h): State<Arc<Health>>) -> impl IntoResponse {
    health_response(&h, Probe::Readyz)
}

/// Each frontend and its Service, for `lb-agent monitor`.
async fn frontends(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    let names: Vec<crate::monitor::FrontendName> = m.frontend_names.lock().unwrap().values().cloned().collect();
    axum::Json(names)
}

async fn metrics(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], m.encode())
}

/// What `/proxyMode` answers on the metrics port, where kube-proxy's
/// names its mode.
pub const PROXY_MODE: &str = "lb";

/// A listener on every address of both families (`[::]` with IPV6_V6ONLY
/// off, whatever net.ipv6.bindv6only says); IPv4 alone where the node has
/// no IPv6.
pub fn dual_stack_listener(port: u16) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::from_std(dual_stack_socket(port)?)
}

/// `dual_stack_listener`'s socket, not yet given to a runtime.
pub fn dual_stack_socket(port: u16) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let (sock, addr) = match Socket::new(Domain::IPV6, Type::STREAM, None) {
        Ok(s) => {
            s.set_only_v6(false)?;
            (s, SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)))
        }
        Err(_) => (Socket::new(Domain::IPV4, Type::STREAM, None)?, SocketAddr::from(([0, 0, 0, 0], port))),
    };
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(1024)?;
    Ok(sock.into())
}

/// Listen on `addr` (given by `flag`); `0.0.0.0` means every address of
/// both families, as Go's listener takes it for kube-proxy's
/// `--healthz-bind-address` (an IPv6-only node's kubelet and load
/// balancers probe its IPv6 address). A port in use says who holds it,
/// and, on kube-proxy's own ports, that kube-proxy may still run here.
async fn listen(flag: &str, addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    let bound = if addr.ip() == std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED) {
        dual_stack_listener(addr.port())
    } else {
        tokio::net::TcpListener::bind(addr).await
    };
    match bound {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            let holder = crate::kube_proxy::port_holder(addr.port()).map(|h| format!(", held by {h}")).unwrap_or_default();
            let hint = if [10256, 10249].contains(&addr.port()) {
                "; kube-proxy listens there too (healthz 10256, metrics 10249): if it still runs on this node, delete its \
                 DaemonSet first (README: Installing on a cluster), or move lb's with the flag"
            } else {
                ""
            };
            anyhow::bail!("{flag} {addr}: {e}{holder}{hint}")
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("{flag} {addr}"))),
    }
}

/// Bind both listeners now (so that a bad address fails at start), and
/// serve them in the background. Returns the bound addresses.
pub async fn serve(
    healthz_bind: Option<SocketAddr>,
    metrics_bind: Option<SocketAddr>,
    health: Arc<Health>,
    m: Arc<Metrics>,
) -> anyhow::Result<(Option<SocketAddr>, Option<SocketAddr>)> {
    let mut bound = (None, None);
    if let Some(addr) = healthz_bind {
        let l = listen("--healthz-bind", addr).await?;
        bound.0 = Some(l.local_addr()?);
        // Any method, as kube-proxy's handlers answer any (HAProxy's
        // `option httpchk` sends OPTIONS).
        let app = Router::new().route("/healthz", any(healthz)).route("/livez", any(livez)).route("/readyz", any(readyz)).with_state(health);
        tokio::spawn(async move { axum::serve(l, app).await });
    }
    if let Some(addr) = metrics_bind {
        let l = listen("--metrics-bind", addr).await?;
        bound.1 = Some(l.local_addr()?);
        // kube-proxy's metrics server answers /healthz with "ok" too.
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/frontends", get(frontends))
            .route("/healthz", any(|| async { "ok" }))
            // kube-proxy's mode (iptables, ipvs, nftables); Kubernetes'
            // e2e "should check kube-proxy urls" wants a 200 here, and
            // tools that skip by mode see none they know.
            .route("/proxyMode", any(|| async { ([(header::CONTENT_TYPE, "text/plain; charset=utf-8"), (header::X_CONTENT_TYPE_OPTIONS, "nosniff")], PROXY_MODE) }))
            .with_state(m);
        tokio::spawn(async move { axum::serve(l, app).await });
    }
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[derive(Debug)]
    struct FakeStats;
    impl StatsSource for FakeStats {
        fn read(&self) -> Vec<(&'static str, u64)> {
            vec![("translated", 42), ("refused_no_endpoints", 3)]
        }
    }

    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        request(addr, "GET", path).await
    }

    async fn request(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").as_bytes()).await.unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.unwrap();
        let code = buf.split_whitespace().nth(1).unwrap().parse().unwrap();
        let body = buf.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (code, body)
    }

    /// The whole answer: status code, the headers (lowercased) and the body.
    async fn get_full(addr: SocketAddr, path: &str) -> (u16, String, serde_json::Value) {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes()).await.unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.unwrap();
        let code = buf.split_whitespace().nth(1).unwrap().parse().unwrap();
        let (head, body) = buf.split_once("\r\n\r\n").unwrap();
        (code, head.to_ascii_lowercase(), serde_json::from_str(body).unwrap())
    }

    #[tokio::test]
    async fn healthz_answers_as_kube_proxys_from_the_start_and_503_when_stalled() {
        let health = Arc::new(Health::new(Duration::from_millis(200)));
        let m = Metrics::new(Arc::new(FakeStats));
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let (h, metrics_at) = serve(Some(lo), Some(lo), health.clone(), m).await.unwrap();
        let h = h.unwrap();
        // Any method, as kube-proxy's (HAProxy checks with OPTIONS); the
        // metrics server's /healthz is kube-proxy's plain "ok".
        for (method, path) in [("OPTIONS", "/healthz"), ("POST", "/livez"), ("HEAD", "/healthz")] {
            assert_eq!(request(h, method, path).await.0, 200, "{method} {path}");
        }
        assert_eq!(get(metrics_at.unwrap(), "/healthz").await, (200, "ok".to_string()));
        assert_eq!(get(metrics_at.unwrap(), "/proxyMode").await, (200, "lb".to_string()));
        let published = Arc::new(Mutex::new(None::<Instant>));
        let p = published.clone();
        health.watch_source(move || *p.lock().unwrap());

        // Starting: healthy, as kube-proxy is before its first sync (the
        // pinned maps serve meanwhile); /readyz waits for the first sync.
        let (code, head, v) = get_full(h, "/healthz").await;
        assert_eq!(code, 200, "{v}");
        assert!(head.contains("x-content-type-options: nosniff") && head.contains("content-type: application/json"), "{head}");
        assert_eq!((v["healthy"].as_bool(), v["nodeEligible"].as_bool()), (Some(true), Some(true)), "{v}");
        assert!(v["currentTime"].as_str().unwrap().ends_with('Z') && v.get("status").is_none(), "{v}");
        let (code, _, v) = get_full(h, "/livez").await;
        assert!(code == 200 && v.get("nodeEligible").is_none(), "/livez has no nodeEligible, as kube-proxy's: {v}");
        let (code, _, v) = get_full(h, "/readyz").await;
        assert_eq!((code, v["synced"].as_bool()), (503, Some(false)), "{v}");

        // The source's first view, taken by the sync loop: pending.
        let first = Instant::now();
        *published.lock().unwrap() = Some(first);
        health.changed(first);
        assert_eq!(get_full(h, "/healthz").await.0, 200, "pending, not stalled yet");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (code, _, v) = get_full(h, "/healthz").await;
        assert_eq!((code, v["healthy"].as_bool()), (503, Some(false)), "the first sync is late: {v}");
        assert_eq!(get_full(h, "/livez").await.0, 503);
        health.synced(first, &["IPv4", "IPv6"]);
        let (code, _, v) = get_full(h, "/healthz").await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["status"]["IPv6"]["healthy"], true, "{v}");
        assert!(v["status"]["IPv4"]["lastUpdated"].as_str().unwrap().ends_with('Z'), "{v}");
        assert_eq!(get_full(h, "/readyz").await.0, 200);

        // A change the source published and the sync loop never took (a
        // loop stuck elsewhere): stalled all the same.
        let second = Instant::now();
        *published.lock().unwrap() = Some(second);
        assert_eq!(get_full(h, "/livez").await.0, 200);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(get_full(h, "/livez").await.0, 503, "a loop that took nothing");
        assert_eq!(get_full(h, "/readyz").await.0, 503);
        let (_, _, v) = get_full(h, "/healthz").await;
        assert_ne!(v["lastUpdated"], v["currentTime"], "unhealthy: the last sync's time: {v}");
        health.synced(second, &["IPv4"]);
        let (code, _, v) = get_full(h, "/healthz").await;
        assert_eq!(code, 200);
        assert!(v["status"].get("IPv6").is_none(), "{v}");

        // The Node is being deleted: /healthz fails (KEP-3836), /livez not.
        health.node_deleting(true);
        let (code, _, v) = get_full(h, "/healthz").await;
        assert_eq!((code, v["nodeEligible"].as_bool(), v["healthy"].as_bool()), (503, Some(false), Some(true)), "{v}");
        assert_eq!(get_full(h, "/livez").await.0, 200);
        assert_eq!(get_full(h, "/readyz").await.0, 200);
        health.node_deleting(false);
        assert_eq!(get_full(h, "/healthz").await.0, 200);
    }

    /// kube-proxy's queue gauges come from the source's side, read at each
    /// scrape: while the sync loop hangs (it takes no update), the queued
    /// time moves on and the pending changes grow, so that an alert on
    /// `last_queued - last_timestamp` or on pending fires, as for a hung
    /// kube-proxy. (Before 12-07 both were written after a sync, by the
    /// loop itself: a hung loop froze them.)
    #[test]
    fn the_queue_gauges_follow_the_source_while_the_sync_loop_hangs() {
        use crate::source::Received;
        let m = Metrics::new(Arc::new(FakeStats));
        let published = Arc::new(Mutex::new(None::<(SystemTime, Received)>));
        let p = published.clone();
        m.watch_queue(Box::new(move || *p.lock().unwrap()));
        let read = |name: &str| {
            let body = m.encode();
            body.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok()).unwrap_or_else(|| panic!("{name}:\n{body}"))
        };
        let queued = "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv4\"}";
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        // The first update, taken by a sync that knows the node's family.
        *published.lock().unwrap() = Some((t0, Received { services: 3, slices: 5 }));
        {
            let mut q = m.queue.lock().unwrap();
            q.taken = Received { services: 3, slices: 5 };
            q.families = vec!["IPv4"];
        }
        assert_eq!(read(queued), 1_000_000.0);
        assert_eq!(read("kubeproxy_sync_proxy_rules_service_changes_pending"), 0.0);
        assert_eq!(read("kubeproxy_sync_proxy_rules_endpoint_changes_pending"), 0.0);
        assert_eq!(read("kubeproxy_sync_proxy_rules_service_changes_total"), 3.0);
        assert_eq!(read("kubeproxy_sync_proxy_rules_endpoint_changes_total"), 5.0);
        // The loop hangs; the source publishes on.
        *published.lock().unwrap() = Some((t0 + Duration::from_secs(30), Received { services: 4, slices: 7 }));
        assert_eq!(read(queued), 1_000_030.0);
        assert_eq!(read("kubeproxy_sync_proxy_rules_service_changes_pending"), 1.0);
        assert_eq!(read("kubeproxy_sync_proxy_rules_endpoint_changes_pending"), 2.0);
        assert_eq!(read("kubeproxy_sync_proxy_rules_service_changes_total"), 4.0);
        assert_eq!(read("kubeproxy_sync_proxy_rules_endpoint_changes_total"), 7.0);
        // Read twice, counted once.
        assert_eq!(read("kubeproxy_sync_proxy_rules_endpoint_changes_total"), 7.0);
        // A sync the loop queued itself (a node address changed), later.
        m.queue.lock().unwrap().queued = Some(t0 + Duration::from_secs(40));
        assert_eq!(read(queued), 1_000_040.0);
        // The loop takes the newest update: nothing pending.
        m.queue.lock().unwrap().taken = Received { services: 4, slices: 7 };
        assert_eq!(read("kubeproxy_sync_proxy_rules_endpoint_changes_pending"), 0.0);
        // The node is IPv6 now: no IPv4 series left behind.
        m.queue.lock().unwrap().families = vec!["IPv6"];
        let body = m.encode();
        assert!(!body.contains("last_queued_timestamp_seconds{ip_family=\"IPv4\"}"), "{body}");
        assert_eq!(read("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv6\"}"), 1_000_040.0);
    }

    /// kube-proxy's metrics as a kube-proxy 1.3x exports them: names,
    /// types (counters end in _total), labels and buckets; its healthz
    /// and livez counters; the standard process metrics.
    #[tokio::test]
    async fn kube_proxys_metric_names_labels_and_buckets() {
        let health = Arc::new(Health::new(Duration::from_secs(60)));
        let m = Metrics::new(Arc::new(FakeStats));
        m.register_health(&health);
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let (h, addr) = serve(Some(lo), Some(lo), health.clone(), m.clone()).await.unwrap();
        let (h, addr) = (h.unwrap(), addr.unwrap());
        health.node_deleting(true);
        assert_eq!(get(h, "/healthz").await.0, 503);
        health.node_deleting(false);
        assert_eq!(get(h, "/healthz").await.0, 200);
        assert_eq!(get(h, "/healthz").await.0, 200);
        assert_eq!(get(h, "/livez").await.0, 200);
        assert_eq!(get(h, "/readyz").await.0, 503, "not counted among kube-proxy's answers");
        let v4 = [("ip_family", "IPv4")];
        m.kp_sync_duration.get_or_create(&v4).observe(0.003);
        m.kp_sync_full_duration.get_or_create(&v4).observe(0.003);
        m.kp_network_programming.get_or_create(&[("ip_family", "IPv6")]).observe(0.3);
        m.kp_last_queued.get_or_create(&v4).set(1.5e9);
        m.kp_no_local_endpoints.get_or_create(&[("ip_family", "IPv4"), ("traffic_policy", "internal")]).set(2);
        m.kp_endpoint_changes_pending.set(3);
        // Some CPU time for process_cpu_seconds_total to show (its clock
        // ticks are 10 ms).
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(60) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let (code, body) = get(addr, "/metrics").await;
        assert_eq!(code, 200);
        for line in [
            "kubeproxy_proxy_healthz_total{code=\"503\"} 1",
            "kubeproxy_proxy_healthz_total{code=\"200\"} 2",
            "kubeproxy_proxy_livez_total{code=\"200\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\",ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\",ip_family=\"IPv6\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.5\",ip_family=\"IPv6\"} 1",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"300.0\",ip_family=\"IPv6\"} 1",
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv4\"} 1500000000.0",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 2",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending 3",
            "kubeproxy_sync_proxy_rules_service_changes_pending 0",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 0",
        ] {
            assert!(body.lines().any(|l| l == line), "{line} missing:\n{body}");
        }
        // kube-proxy's network programming buckets: 0, 0.25, 0.5, 1..59,
        // 60..115 by 5, 120..300 by 30 (and +Inf).
        let buckets = body.lines().filter(|l| l.starts_with("kubeproxy_network_programming_duration_seconds_bucket{")).count();
        assert_eq!(buckets, 1 + 2 + 59 + 12 + 7 + 1, "{body}");
        let value = |name: &str| body.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok());
        assert!(value("process_resident_memory_bytes").is_some_and(|v| v > 1e6), "{body}");
        assert!(value("process_cpu_seconds_total").is_some_and(|v| v > 0.0), "{body}");
        assert!(value("process_open_fds").is_some_and(|v| v >= 3.0), "{body}");
        let start = value("process_start_time_seconds").unwrap();
        let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs_f64();
        assert!(start <= now && start > now - 3600.0, "{start} vs {now}");
    }

    #[tokio::test]
    async fn metrics_are_prometheus_text() {
        let health = Arc::new(Health::new(Duration::from_secs(60)));
        let m = Metrics::new(Arc::new(FakeStats));
        m.services.set(7);
        m.sync_errors.inc();
        m.sync_duration.observe(0.002);
        m.map_entries.get_or_create(&[("map", "LB4_SERVICES")]).set(12);
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let (_, addr) = serve(None, Some(lo), health, m).await.unwrap();
        let (code, body) = get(addr.unwrap(), "/metrics").await;
        assert_eq!(code, 200);
        for line in [
            "lb_services 7",
            "lb_sync_errors_total 1",
            "lb_sync_duration_seconds_count 1",
            "lb_map_entries{map=\"LB4_SERVICES\"} 12",
            "lb_datapath_events_total{result=\"translated\"} 42",
            "lb_datapath_events_total{result=\"refused_no_endpoints\"} 3",
        ] {
            assert!(body.lines().any(|l| l == line), "{line} missing:\n{body}");
        }
    }
}
