//! What an operator monitors: /healthz, /livez and /metrics of an agent in
//! its node, and a clear error when the API server cannot be reached.
use std::time::Duration;

use anyhow::Result;
use lbtest::Cluster;
use lbtest::objects::{service, service_ips, service_typed, slice};

fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

#[test]
fn healthz_and_metrics_in_a_node() -> Result<()> {
    let mut c = Cluster::new(1)?;
    let pod = c.add_pod(1, "pod-a")?;
    c.serve(&pod, 8080)?;
    let client = c.add_pod(1, "client")?;
    c.write_object("svc.yaml", &service("web", "10.96.0.10", &[("http", 80, 8080, "TCP")]))?;
    c.write_object("slice.yaml", &slice("web", "web-1", &[("http", 8080, "TCP")], &[(&pod.ip, "node-1", true)]))?;
    c.write_object("empty.yaml", &service("empty", "10.96.0.11", &[("http", 80, 8080, "TCP")]))?;
    c.start_agent(1)?;
    c.wait_programmed("10.96.0.10", 80, "TCP", Some(&[&format!("{}:8080", pod.ip)]))?;

    let (code, body) = c.http(1, "127.0.0.1:10256", "/healthz")?;
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body)?;
    assert!(v["lastUpdated"].as_str().unwrap().ends_with('Z'), "{v}");
    assert_eq!(c.http(1, "127.0.0.1:10256", "/livez")?.0, 200);
    // 0.0.0.0 (the default) is every address of both families, as for
    // kube-proxy: an IPv6-only node is probed on its IPv6 address.
    assert_eq!(c.http(1, "[::1]:10256", "/healthz")?.0, 200);

    let s = c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "7"])?;
    assert_eq!(s.ok, 7);
    let s = c.probe(&client, &["tcp", "--addr", "10.96.0.11:80", "--count", "2"])?;
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&2));

    let (code, m) = c.http(1, "127.0.0.1:10249", "/metrics")?;
    assert_eq!(code, 200);
    // Kubernetes' e2e "should check kube-proxy urls" asks for a 200 here.
    assert_eq!(c.http(1, "127.0.0.1:10249", "/proxyMode")?, (200, "lb".to_string()));
    assert_eq!(metric(&m, "lb_datapath_events_total{result=\"translated\"}"), Some(7.0), "{m}");
    assert_eq!(metric(&m, "lb_datapath_events_total{result=\"refused_no_endpoints\"}"), Some(2.0), "{m}");
    assert_eq!(metric(&m, "lb_services"), Some(2.0), "{m}");
    assert_eq!(metric(&m, "lb_backends"), Some(1.0), "{m}");
    assert!(metric(&m, "lb_sync_duration_seconds_count").unwrap() >= 1.0, "{m}");
    assert!(metric(&m, "lb_event_to_programmed_seconds_count").unwrap() >= 1.0, "{m}");
    assert_eq!(metric(&m, "lb_map_entries{map=\"LB4_BACKENDS\"}"), Some(1.0), "{m}");
    assert_eq!(metric(&m, "lb_sync_errors_total"), Some(0.0), "{m}");
    assert!(!m.contains("lb_frontend_") && !m.contains("lb_backend_"), "per-service series only with --metrics-per-service: {m}");
    Ok(())
}

#[test]
fn an_unreachable_api_server_is_a_clear_error_and_the_agent_is_not_ready() -> Result<()> {
    let c = Cluster::new(1)?;
    let n = &c.nodes[0];
    // An API server on a closed loopback port of the node's own netns.
    let kubeconfig = c.objects.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: \"https://127.0.0.1:1\", insecure-skip-tls-verify: true}\n\
         users:\n- name: u\n  user: {token: t}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n",
    )?;
    let log = c.agent_log(1);
    let mut agent = std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", n.netns))
        .arg(lbtest::bin("lb-agent"))
        .args(["run", "--source", "kube", "--node-name", "node-1"])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--cgroup")
        .arg(&n.cgroup)
        .arg("--bpffs")
        .arg(&n.bpffs)
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let res = (|| -> Result<()> {
        c.wait_for("the watch error in the log", Duration::from_secs(10), || {
            Ok(std::fs::read_to_string(&log)?.contains("cannot watch Services on the API server https://127.0.0.1:1/"))
        })?;
        let text = std::fs::read_to_string(&log)?;
        assert!(text.contains("KUBERNETES_SERVICE_HOST"), "the error says what to check: {text}");
        assert!(!text.contains("initial sync complete"), "{text}");
        // kube-proxy's /healthz and /livez: healthy while starting (what
        // the pins hold serves meanwhile; no change has waited); lb's
        // /readyz, the DaemonSet's readiness probe: not before a sync.
        // (The source runs on its own thread: its error can come before
        // the programs are loaded and health is served.)
        c.wait_for("health served", Duration::from_secs(10), || Ok(c.http(1, "127.0.0.1:10256", "/healthz").is_ok()))?;
        assert_eq!(c.http(1, "127.0.0.1:10256", "/healthz")?.0, 200);
        assert_eq!(c.http(1, "127.0.0.1:10256", "/livez")?.0, 200);
        let (code, body) = c.http(1, "127.0.0.1:10256", "/readyz")?;
        assert_eq!(code, 503, "no sync yet: {body}");
        Ok(())
    })();
    let _ = agent.kill();
    let _ = agent.wait();
    res
}

fn slice_with_trigger(ip: &str, trigger: &str) -> String {
    slice("web", "web-1", &[("http", 8080, "TCP")], &[(ip, "node-1", true)])
        .replacen("metadata:\n", &format!("metadata:\n  annotations:\n    endpoints.kubernetes.io/last-change-trigger-time: \"{trigger}\"\n"), 1)
}

#[test]
fn kube_proxys_operational_contract() -> Result<()> {
    let mut c = Cluster::new(1)?;
    let (a, b) = (c.add_pod(1, "pod-a")?, c.add_pod(1, "pod-b")?);
    c.serve(&a, 8080)?;
    c.serve(&b, 8080)?;
    let client = c.add_pod(1, "client")?;
    c.write_object("node.yaml", &lbtest::objects::node("node-1", "z1"))?;
    c.write_object("svc.yaml", &service("web", "10.96.0.10", &[("http", 80, 8080, "TCP")]))?;
    c.write_object("slice.yaml", &slice("web", "web-1", &[("http", 8080, "TCP")], &[(&a.ip, "node-1", true)]))?;
    // (The stall limit as by default: twice the resync period would be 2 s.)
    c.start_agent_with(1, &["--resync-period", "1s", "--healthz-stall-seconds", "60"])?;
    c.wait_programmed("10.96.0.10", 80, "TCP", Some(&[&format!("{}:8080", a.ip)]))?;

    // Metrics on loopback only, as kube-proxy's.
    assert!(c.http(1, &format!("{}:10249", c.nodes[0].ip), "/metrics").is_err(), "not on the node's address");
    // kube-proxy's names and labels (ip_family: this node's primary
    // address is IPv4): the first sync is a full one.
    let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
    assert!(metric(&m, "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}").unwrap() >= 1.0, "{m}");
    assert!(metric(&m, "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}").unwrap() >= 1.0, "{m}");
    let last = metric(&m, "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}").unwrap();
    let queued = metric(&m, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv4\"}").unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs_f64();
    assert!((now - last).abs() < 60.0, "{last} vs {now}");
    assert!(queued <= last && last - queued < 5.0, "queued {queued}, synced {last}");
    // Nothing changes: every resync (1 s here) checks the maps and counts
    // as a full sync, so the timestamp moves on, as kube-proxy's periodic
    // syncs move it (an alert on its age must not fire on a quiet node).
    let full = |m: &str| metric(m, "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}").unwrap();
    let full_before = full(&m);
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let quiet = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
    let later = metric(&quiet, "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}").unwrap();
    assert!(later - last >= 1.0, "the timestamp moved on: {last} -> {later}");
    assert!(full(&quiet) >= full_before + 1.0, "{quiet}");
    assert_eq!(metric(&quiet, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv4\"}"), Some(queued), "nothing queued");
    let m = quiet;
    let endpoint_changes = metric(&m, "kubeproxy_sync_proxy_rules_endpoint_changes_total").unwrap();
    let service_changes = metric(&m, "kubeproxy_sync_proxy_rules_service_changes_total").unwrap();
    assert_eq!(metric(&m, "kubeproxy_sync_proxy_rules_endpoint_changes_pending"), Some(0.0), "{m}");
    assert_eq!(metric(&m, "kubeproxy_sync_proxy_rules_service_changes_pending"), Some(0.0), "{m}");
    for policy in ["internal", "external"] {
        let name = format!("kubeproxy_sync_proxy_rules_no_local_endpoints_total{{ip_family=\"IPv4\",traffic_policy=\"{policy}\"}}");
        assert_eq!(metric(&m, &name), Some(0.0), "{m}");
    }
    assert_eq!(metric(&m, "lb_source_watch_failing_seconds"), Some(0.0), "{m}");
    assert!(metric(&m, "process_resident_memory_bytes").is_some_and(|v| v > 1e6), "{m}");

    // An endpoint change that happened 2 s ago (its trigger time): counted,
    // and its programming latency measured from then.
    let two_ago = humantime::format_rfc3339_seconds(std::time::SystemTime::now() - Duration::from_secs(2)).to_string();
    c.write_object("slice.yaml", &slice_with_trigger(&b.ip, &two_ago))?;
    c.wait_programmed("10.96.0.10", 80, "TCP", Some(&[&format!("{}:8080", b.ip)]))?;
    // The sync's histograms are observed just after it wrote the maps.
    c.wait_for("the sync's latency observed", Duration::from_secs(2), || {
        let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
        Ok(metric(&m, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}").is_some_and(|n| n >= 1.0)
            && metric(&m, "kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"}").is_some_and(|n| n >= 1.0))
    })?;
    let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
    assert!(metric(&m, "kubeproxy_sync_proxy_rules_endpoint_changes_total").unwrap() > endpoint_changes, "{m}");
    assert_eq!(metric(&m, "kubeproxy_sync_proxy_rules_service_changes_total").unwrap(), service_changes, "{m}");
    assert!(metric(&m, "kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"}").unwrap() >= 1.0, "{m}");
    assert!(metric(&m, "kubeproxy_network_programming_duration_seconds_sum{ip_family=\"IPv4\"}").unwrap() >= 1.5, "{m}");
    assert!(metric(&m, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}").unwrap() >= 1.0, "{m}");

    // Services with a Local policy whose endpoints are all on another
    // node, each Service port once (the NodePort is on every node address):
    // kube-proxy's no_local_endpoints gauge, by policy.
    let no_local = |c: &Cluster, policy: &str| -> Result<Option<f64>> {
        let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
        Ok(metric(&m, &format!("kubeproxy_sync_proxy_rules_no_local_endpoints_total{{ip_family=\"IPv4\",traffic_policy=\"{policy}\"}}")))
    };
    c.write_object("itp.yaml", &service_ips("itp", &["10.96.0.20"], &[("http", 80, 8080, "TCP"), ("dns", 53, 53, "UDP")], "  internalTrafficPolicy: Local\n"))?;
    c.write_object("itp-slice.yaml", &slice("itp", "itp-1", &[("http", 8080, "TCP"), ("dns", 53, "UDP")], &[("10.244.2.5", "node-2", true)]))?;
    c.write_object("etp.yaml", &service_typed("etp", &["10.96.0.21"], "NodePort", &[("http", 80, 8080, "TCP", 30080)], "  externalTrafficPolicy: Local\n", &[]))?;
    c.write_object("etp-slice.yaml", &slice("etp", "etp-1", &[("http", 8080, "TCP")], &[("10.244.2.6", "node-2", true)]))?;
    c.wait_for("two internal, one external", Duration::from_secs(5), || Ok(no_local(&c, "internal")? == Some(2.0) && no_local(&c, "external")? == Some(1.0)))?;
    // An endpoint here for each: none left. No endpoints at all: not counted.
    c.write_object("itp-slice.yaml", &slice("itp", "itp-1", &[("http", 8080, "TCP"), ("dns", 53, "UDP")], &[(&a.ip, "node-1", true)]))?;
    c.write_object("etp-slice.yaml", &slice("etp", "etp-1", &[("http", 8080, "TCP")], &[]))?;
    c.wait_for("none", Duration::from_secs(5), || Ok(no_local(&c, "internal")? == Some(0.0) && no_local(&c, "external")? == Some(0.0)))?;
    let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
    assert!(metric(&m, "kubeproxy_proxy_healthz_total{code=\"200\"}").is_none(), "no /healthz asked yet: {m}");

    // The Node is being deleted: /healthz says 503 (KEP-3836), /livez 200.
    c.write_object("node.yaml", &lbtest::objects::node("node-1", "z1").replacen("metadata:\n", "metadata:\n  deletionTimestamp: \"2026-12-01T10:00:00Z\"\n", 1))?;
    c.wait_for("/healthz 503", Duration::from_secs(5), || Ok(c.http(1, "127.0.0.1:10256", "/healthz")?.0 == 503))?;
    let (_, body) = c.http(1, "127.0.0.1:10256", "/healthz")?;
    assert_eq!(serde_json::from_str::<serde_json::Value>(&body)?["nodeEligible"], false, "{body}");
    assert_eq!(c.http(1, "127.0.0.1:10256", "/livez")?.0, 200);
    // Its finalizers done, the Node object is gone: the node stays
    // ineligible, as kube-proxy syncs the deleted object's last state.
    c.remove_object("node.yaml")?;
    std::thread::sleep(Duration::from_millis(1500));
    let (code, body) = c.http(1, "127.0.0.1:10256", "/healthz")?;
    assert_eq!((code, serde_json::from_str::<serde_json::Value>(&body)?["nodeEligible"].clone()), (503, false.into()), "{body}");
    c.write_object("node.yaml", &lbtest::objects::node("node-1", "z1"))?;
    c.wait_for("/healthz 200", Duration::from_secs(5), || Ok(c.http(1, "127.0.0.1:10256", "/healthz")?.0 == 200))?;
    // cluster-autoscaler's taint on a node it is about to delete: 503 too.
    let tainted = format!(
        "{}spec:\n  taints:\n  - key: ToBeDeletedByClusterAutoscaler\n    value: \"1764928800\"\n    effect: NoSchedule\n",
        lbtest::objects::node("node-1", "z1")
    );
    c.write_object("node.yaml", &tainted)?;
    c.wait_for("/healthz 503 (tainted)", Duration::from_secs(5), || Ok(c.http(1, "127.0.0.1:10256", "/healthz")?.0 == 503))?;
    assert_eq!(c.http(1, "127.0.0.1:10256", "/livez")?.0, 200);
    c.write_object("node.yaml", &lbtest::objects::node("node-1", "z1"))?;
    c.wait_for("/healthz 200 (untainted)", Duration::from_secs(5), || Ok(c.http(1, "127.0.0.1:10256", "/healthz")?.0 == 200))?;
    // Every answer counted by its code, as kube-proxy's healthz server does.
    let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
    assert!(metric(&m, "kubeproxy_proxy_healthz_total{code=\"503\"}").is_some_and(|n| n >= 4.0), "{m}");
    assert!(metric(&m, "kubeproxy_proxy_healthz_total{code=\"200\"}").is_some_and(|n| n >= 1.0), "{m}");
    assert_eq!(metric(&m, "kubeproxy_proxy_livez_total{code=\"200\"}"), Some(2.0), "{m}");

    // Drift: the frontend's entry deleted by hand comes back within the
    // resync period, counted and logged.
    let pin = c.nodes[0].bpffs.join(lb_common::maps::SERVICES4);
    let mut svc: aya::maps::HashMap<_, [u8; 12], [u8; 16]> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(aya::maps::MapData::from_pin(&pin)?))?;
    let mut key = [0u8; 12];
    key[..4].copy_from_slice(&[10, 96, 0, 10]);
    key[4..6].copy_from_slice(&80u16.to_ne_bytes());
    key[6] = 6;
    svc.remove(&key)?;
    assert_eq!(c.programmed(1, "10.96.0.10", 80, "TCP")?, None, "deleted by hand");
    c.wait_programmed("10.96.0.10", 80, "TCP", Some(&[&format!("{}:8080", b.ip)]))?;
    let s = c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "3"])?;
    assert_eq!(s.ok, 3, "{s:?}");
    let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
    assert!(metric(&m, "lb_drift_repaired_total").unwrap() >= 1.0, "{m}");
    assert!(std::fs::read_to_string(c.agent_log(1))?.contains("writing them back"));
    Ok(())
}

/// kube-proxy's conntrack settings, which a node that swaps kube-proxy for
/// lb must keep (the kernel's own TCP timeout is 5 days, kube-proxy's 1
/// day): written in the node's network namespace once conntrack is loaded
/// (lb's masquerade loads it), only where they differ, and the machine-wide
/// nf_conntrack_max is never written from a namespace that cannot (it is
/// named in a warning instead).
#[test]
fn kube_proxys_conntrack_settings() -> Result<()> {
    let mut c = Cluster::new(1)?;
    let netns = c.nodes[0].netns.clone();
    let sysctl = |c: &Cluster, name: &str| -> Result<u64> { Ok(c.in_netns(&netns, &["cat", &format!("/proc/sys/net/netfilter/{name}")])?.trim().parse()?) };
    let machine_max = std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_max").ok();
    c.start_agent(1)?;
    c.wait_for("kube-proxy's TCP timeouts", Duration::from_secs(5), || {
        Ok(sysctl(&c, "nf_conntrack_tcp_timeout_established").ok() == Some(86400) && sysctl(&c, "nf_conntrack_tcp_timeout_close_wait")? == 3600)
    })?;
    assert_eq!(sysctl(&c, "nf_conntrack_tcp_be_liberal")?, 0);
    assert_eq!(sysctl(&c, "nf_conntrack_udp_timeout")?, 30, "the kernel's: kube-proxy leaves it by default");
    let cpus = std::thread::available_parallelism()?.get() as u64;
    let want = (32768 * cpus).max(131072);
    let now = sysctl(&c, "nf_conntrack_max")?;
    let log = std::fs::read_to_string(c.agent_log(1))?;
    assert!(log.contains("nf_conntrack_tcp_timeout_established") && log.contains("432000"), "the agent says what it changed: {log}");
    if now != want {
        assert!(log.contains(&format!("--conntrack-max-per-core: nf_conntrack_max is {now}, not {want}: only the machine's initial network namespace can set it")), "{log}");
    }
    assert_eq!(std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_max").ok(), machine_max, "the machine's limit is untouched");
    // Other values by flag, kube-proxy's spelling of durations included.
    c.kill_agent(1);
    c.start_agent_with(
        1,
        &["--conntrack-tcp-timeout-established", "2h0m0s", "--conntrack-tcp-be-liberal", "--conntrack-udp-timeout", "45s", "--conntrack-udp-timeout-stream", "3m", "--conntrack-max-per-core", "0"],
    )?;
    c.wait_for("the flags' values", Duration::from_secs(5), || Ok(sysctl(&c, "nf_conntrack_tcp_timeout_established")? == 7200))?;
    assert_eq!(
        ["nf_conntrack_tcp_timeout_close_wait", "nf_conntrack_tcp_be_liberal", "nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream"].map(|n| sysctl(&c, n).unwrap()),
        [3600, 1, 45, 180]
    );
    let log = std::fs::read_to_string(c.agent_log(1))?;
    assert_eq!(log.matches("only the machine's initial network namespace").count(), if now != want { 1 } else { 0 }, "--conntrack-max-per-core 0 leaves the limit alone: {log}");
    Ok(())
}

/// kube-proxy's configuration file (`--kube-proxy-config`, the
/// `config.conf` of kubeadm's kube-proxy ConfigMap): its settings take
/// effect as lb's flags of the same meaning would, a flag on the command
/// line wins, and what lb does not use is named in the log.
#[test]
fn kube_proxys_configuration_file_sets_what_its_flags_would() -> Result<()> {
    let mut c = Cluster::new(1)?;
    let a = c.add_pod(1, "pod-a")?;
    c.serve(&a, 8080)?;
    let netns = c.nodes[0].netns.clone();
    let sysctl = |c: &Cluster, name: &str| -> Result<u64> { Ok(c.in_netns(&netns, &["cat", &format!("/proc/sys/net/netfilter/{name}")])?.trim().parse()?) };
    c.write_object("svc.yaml", &service_typed("np", &["10.96.0.10"], "NodePort", &[("http", 80, 8080, "TCP", 30080)], "", &[]))?;
    c.write_object("slice.yaml", &slice("np", "np-1", &[("http", 8080, "TCP")], &[(&a.ip, "node-1", true)]))?;
    // Beside the objects, not among them.
    let conf = c.objects.parent().unwrap().join("kube-proxy.conf");
    std::fs::write(
        &conf,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: iptables\nclusterCIDR: 10.244.0.0/16\n\
         healthzBindAddress: 0.0.0.0:10266\nmetricsBindAddress: 127.0.0.1:10259\n\
         iptables:\n  localhostNodePorts: false\n  masqueradeAll: false\n  syncPeriod: 30s\n\
         conntrack:\n  maxPerCore: 0\n  tcpEstablishedTimeout: 12h0m0s\n  tcpCloseWaitTimeout: 30m0s\n",
    )?;
    c.start_agent_with(1, &["--kube-proxy-config", conf.to_str().unwrap(), "--metrics-bind", "127.0.0.1:10249"])?;
    c.wait_programmed("10.96.0.10", 80, "TCP", Some(&[&format!("{}:8080", a.ip)]))?;
    assert_eq!(c.http(1, "127.0.0.1:10266", "/healthz")?.0, 200, "the file's healthzBindAddress");
    assert!(c.http(1, "127.0.0.1:10256", "/healthz").is_err(), "not the default's");
    assert_eq!(c.http(1, "127.0.0.1:10249", "/metrics")?.0, 200, "the command line's --metrics-bind wins");
    assert!(c.http(1, "127.0.0.1:10259", "/metrics").is_err());
    assert!(c.programmed(1, &c.nodes[0].ip.clone(), 30080, "TCP")?.is_some());
    assert_eq!(c.programmed(1, "127.0.0.1", 30080, "TCP")?, None, "iptables.localhostNodePorts false");
    c.wait_for("the file's conntrack timeouts", Duration::from_secs(5), || {
        Ok(sysctl(&c, "nf_conntrack_tcp_timeout_established").ok() == Some(43200) && sysctl(&c, "nf_conntrack_tcp_timeout_close_wait")? == 1800)
    })?;
    let log = std::fs::read_to_string(c.agent_log(1))?;
    assert!(log.contains("clusterCIDR 10.244.0.0/16 is not used") && log.contains("mode iptables"), "{log}");
    assert!(!log.contains("only the machine's initial network namespace"), "maxPerCore 0 leaves the limit alone: {log}");
    // A field kube-proxy does not have: the agent does not start, and says which.
    c.kill_agent(1);
    std::fs::write(&conf, "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nconntrack:\n  tcpEstablishedTimout: 1h\n")?;
    let err = c.start_agent_with(1, &["--kube-proxy-config", conf.to_str().unwrap()]).expect_err("a misspelt field");
    let log = std::fs::read_to_string(c.agent_log(1))?;
    assert!(log.contains("--kube-proxy-config") && log.contains("tcpEstablishedTimout"), "{err:#}: {log}");
    Ok(())
}

#[test]
fn teardown_gives_back_the_reserved_nodeport_range() -> Result<()> {
    let mut c = Cluster::new(1)?;
    let netns = c.nodes[0].netns.clone();
    let reserved = |c: &Cluster| -> Result<String> { Ok(c.in_netns(&netns, &["cat", "/proc/sys/net/ipv4/ip_local_reserved_ports"])?.trim().to_string()) };
    c.in_netns(&netns, &["sysctl", "-qw", "net.ipv4.ip_local_reserved_ports=2000-2001"])?;
    c.start_agent(1)?;
    assert_eq!(reserved(&c)?, "2000-2001,30000-32767");
    c.kill_agent(1);
    let bpffs = c.nodes[0].bpffs.clone();
    lbtest::teardown_in(&netns, &bpffs)?;
    assert_eq!(reserved(&c)?, "2000-2001", "what was there before stays; lb's range goes");
    assert!(!bpffs.exists(), "no pins left");
    // The operator's ranges touch and lie inside lb's: the kernel merges
    // them into one; teardown takes out lb's ports only.
    c.in_netns(&netns, &["sysctl", "-qw", "net.ipv4.ip_local_reserved_ports=29000-29999,31000-31010"])?;
    c.start_agent(1)?;
    assert_eq!(reserved(&c)?, "29000-32767");
    c.kill_agent(1);
    lbtest::teardown_in(&netns, &bpffs)?;
    assert_eq!(reserved(&c)?, "29000-29999,31000-31010", "the operator's ports stay");
    Ok(())
}

#[test]
fn an_agent_that_cannot_see_the_pods_processes_says_so() -> Result<()> {
    let mut c = Cluster::new(1)?;
    let pod = c.add_pod(1, "pod-a")?;
    c.serve(&pod, 8080)?;
    c.write_object("svc.yaml", &service("web", "10.96.0.10", &[("http", 80, 8080, "TCP")]))?;
    c.write_object("slice.yaml", &slice("web", "web-1", &[("http", 8080, "TCP")], &[(&pod.ip, "node-1", true)]))?;
    let n = &c.nodes[0];
    // A PID namespace of its own, as a container without hostPID.
    let log = c.agent_log(1);
    let mut agent = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--kill-child", "--", "nsenter"])
        .arg(format!("--net=/run/netns/{}", n.netns))
        .arg("--")
        .arg(lbtest::bin("lb-agent"))
        .args(["run", "--node-name", "node-1"])
        .arg("--source")
        .arg(format!("dir:{}", c.objects.display()))
        .arg("--cgroup")
        .arg(&n.cgroup)
        .arg("--bpffs")
        .arg(&n.bpffs)
        .stderr(std::fs::File::create(&log)?)
        .stdout(std::process::Stdio::null())
        .spawn()?;
    let res = (|| -> Result<()> {
        c.wait_for("the error", Duration::from_secs(20), || Ok(std::fs::read_to_string(&log)?.contains("cannot see the processes of the cgroup")))?;
        let text = std::fs::read_to_string(&log)?;
        assert!(text.contains("hostPID"), "the error says what to do: {text}");
        let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
        assert!(metric(&m, "lb_cgroup_processes_invisible").unwrap() >= 1.0, "{m}");
        Ok(())
    })();
    let _ = agent.kill();
    let _ = agent.wait();
    res
}

/// `lb-agent list --stats` and `--metrics-per-service`: each frontend's and
/// backend's connections and refusals (socket and TC paths), and the TC
/// path's packets and bytes, like `ipvsadm -L --stats`.
#[test]
fn per_frontend_and_backend_counters_like_ipvsadm_stats() -> Result<()> {
    use lbtest::world::*;
    let mut w = world_with(&web("NodePort", "", &[]), &["--metrics-per-service"])?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    assert_eq!(tcp(&w.c, &client, "10.96.0.10:80", 10)?.ok, 10);
    assert_eq!(tcp(&w.c, &w.outside, &hostport(NODE1, 30080), 4)?.ok, 4);

    let l = w.c.list_with(1, &["--stats"])?;
    let front = |addr: &str, port: u64| -> serde_json::Value {
        l["frontends"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["address"] == addr && f["port"] == port && f["protocol"] == "TCP")
            .unwrap_or_else(|| panic!("no frontend {addr}:{port} in {l}"))
            .clone()
    };
    let cip = front("10.96.0.10", 80);
    assert_eq!(cip["stats"]["conns"], 10, "{cip}");
    let per_backend: Vec<u64> = cip["backends"].as_array().unwrap().iter().map(|b| b["stats"]["conns"].as_u64().unwrap()).collect();
    // A backend counts the connections of every frontend it serves: the
    // ClusterIP's 10 and the NodePort's 4.
    assert_eq!(per_backend.iter().sum::<u64>(), 14, "{cip}");
    assert!(per_backend.iter().all(|n| *n > 0), "{cip}");
    let np = front(NODE1, 30080);
    assert_eq!(np["stats"]["conns"], 4, "{np}");
    let (packets, bytes) = (np["stats"]["packets"].as_u64().unwrap(), np["stats"]["bytes"].as_u64().unwrap());
    // Each connection: SYN, SYN-ACK, ACK, a request, a reply, FINs, ACKs.
    assert!(packets >= 4 * 6, "{np}");
    assert!(bytes >= packets * 54, "{np}");
    assert_eq!(cip["stats"]["packets"], 0, "socket-LB connections have no per-packet path: {cip}");

    // Backends by address, port and protocol: each pod's 8080 serves the
    // Service's TCP and UDP ports, one series each (before 12-05 both were
    // labelled only "ip:8080": repeated series, which Prometheus refuses).
    assert_eq!(w.c.probe(&client, &["udp", "--addr", "10.96.0.10:80", "--count", "4", "--connected"])?.ok, 4);
    let (_, m) = w.c.http(1, "127.0.0.1:10249", "/metrics")?;
    let series: Vec<&str> = m.lines().filter(|l| l.starts_with("lb_backend_connections_total{")).filter_map(|l| l.rsplit_once(' ').map(|x| x.0)).collect();
    let distinct: std::collections::BTreeSet<&str> = series.iter().copied().collect();
    assert_eq!(distinct.len(), series.len(), "one series per backend: {m}");
    let sum = |proto: &str| -> f64 {
        [&w.p1, &w.p2].iter().map(|p| metric(&m, &format!("lb_backend_connections_total{{backend=\"{}:8080\",protocol=\"{proto}\"}}", p.ip)).unwrap_or(0.0)).sum()
    };
    assert_eq!((sum("TCP"), sum("UDP")), (14.0, 4.0), "{m}");

    // No endpoints: refusals are counted by reason.
    set_endpoints(&w, &[])?;
    wait_backends(&w.c, 1, "10.96.0.10", 80, 0)?;
    let s = tcp(&w.c, &client, "10.96.0.10:80", 3)?;
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&3), "{s:?}");
    let l = w.c.list_with(1, &["--stats"])?;
    let cip = l["frontends"].as_array().unwrap().iter().find(|f| f["address"] == "10.96.0.10" && f["port"] == 80 && f["protocol"] == "TCP").unwrap().clone();
    // 10 TCP and 4 UDP connects: the TCP and UDP port of one address and
    // port number share the frontend's counters (one rev-NAT id).
    assert_eq!((cip["stats"]["conns"].as_u64(), cip["stats"]["refused"].as_u64()), (Some(14), Some(3)), "{cip}");
    let text = lbtest::run(lbtest::bin("lb-agent").to_str().unwrap(), &["list", "--stats", "--bpffs", w.c.nodes[0].bpffs.to_str().unwrap()])?;
    assert!(text.contains("conns=14 refused=3 unreachable=0"), "{text}");

    let (_, m) = w.c.http(1, "127.0.0.1:10249", "/metrics")?;
    assert_eq!(metric(&m, "lb_frontend_connections_total{frontend=\"10.96.0.10:80\"}"), Some(14.0), "{m}");
    assert_eq!(metric(&m, "lb_frontend_refused_total{frontend=\"10.96.0.10:80\",reason=\"no_endpoints\"}"), Some(3.0), "{m}");
    assert_eq!(metric(&m, &format!("lb_frontend_connections_total{{frontend=\"{NODE1}:30080\"}}")), Some(4.0), "{m}");
    assert!(metric(&m, &format!("lb_frontend_packets_total{{frontend=\"{NODE1}:30080\"}}")).unwrap() >= 24.0, "{m}");
    Ok(())
}

/// A frontend or backend id handed out again starts its counters from
/// zero, whatever a freed id still holds (counts that reached it after its
/// deletion: a NAT flow's last packets, a connection counted once a packet
/// passed its source ranges; or what an earlier agent left): here every
/// free id holds such counters, written through the pinned map. The
/// counters of ids still free are deleted: by every full sync, and by the
/// periodic resync between them.
#[test]
fn an_id_handed_out_again_starts_its_counters_from_zero() -> Result<()> {
    use aya::maps::{HashMap, Map, MapData};
    use lb_common::{FAMILY_V4, STATS_BACKEND, STATS_FRONTEND, SvcStats, SvcStatsKey};
    use lbtest::objects::{Endpoint as E, slice_of};
    use lbtest::world::*;
    let mut w = world(&web("NodePort", "", &[]))?;
    let client = w.c.add_pod(1, "client")?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    // The ids in use (IPv4), by kind.
    let in_use = |w: &World| -> Result<[(u8, std::collections::BTreeSet<u32>); 2]> {
        let l = w.c.list(1)?;
        let fronts = || l["frontends"].as_array().into_iter().flatten().filter(|f| f["family"] == "IPv4");
        let ids = |v: &serde_json::Value| v.as_u64().map(|id| id as u32);
        let used_fronts = fronts().filter_map(|f| ids(&f["rev_nat_id"])).collect();
        let used_backends = fronts().flat_map(|f| f["backends"].as_array().into_iter().flatten().filter_map(|b| ids(&b["id"]))).collect();
        Ok([(STATS_FRONTEND, used_fronts), (STATS_BACKEND, used_backends)])
    };
    let pinned = |w: &World| -> Result<HashMap<MapData, SvcStatsKey, SvcStats>> {
        Ok(HashMap::try_from(Map::HashMap(MapData::from_pin(w.c.nodes[0].bpffs.join(lb_common::maps::SVC_STATS))?))?)
    };
    // Every free id (of the first 300) gets stale counters.
    let stale = |w: &World| -> Result<usize> {
        let mut stats = pinned(w)?;
        let old = SvcStats { conns: 1000, refused: 100, unreachable: 10, packets: 5000, bytes: 500_000, source_range: 1 };
        let mut n = 0;
        for (kind, used) in in_use(w)? {
            for id in (1..=300).filter(|id| !used.contains(id)) {
                stats.insert(SvcStatsKey { id, kind, family: FAMILY_V4, _pad: 0 }, old, 0)?;
                n += 1;
            }
        }
        Ok(n)
    };
    // How many counters of ids not in use the map holds.
    let stale_left = |w: &World| -> Result<usize> {
        let used = in_use(w)?;
        let keys: Vec<SvcStatsKey> = pinned(w)?.keys().collect::<Result<_, _>>()?;
        Ok(keys.iter().filter(|k| k.family == FAMILY_V4 && !used.iter().any(|(kind, ids)| *kind == k.kind && ids.contains(&k.id))).count())
    };
    // A new Service, with a backend of its own (pod-1 on another port).
    let add = |w: &World, name: &str, vip: &str, port: u16| -> Result<()> {
        w.c.serve(&w.p1, port)?;
        w.c.write_object(&format!("{name}.yaml"), &service_ips(name, &[vip], &[("http", 80, port, "TCP")], ""))?;
        w.c.write_object(&format!("{name}-slice.yaml"), &slice_of(name, &format!("{name}-1"), "IPv4", &[("http", port, "TCP")], &[E::ready(&w.p1.ip, "node-1")]))?;
        Ok(())
    };
    let fresh = |w: &World, vip: &str| -> Result<()> {
        wait_backends(&w.c, 1, vip, 80, 1)?;
        let l = w.c.list_with(1, &["--stats"])?;
        let f = l["frontends"].as_array().into_iter().flatten().find(|f| f["address"] == vip).unwrap().clone();
        let (id, backend) = (f["rev_nat_id"].as_u64().unwrap(), f["backends"][0]["id"].as_u64().unwrap());
        assert!(id <= 300 && backend <= 300, "ids the stale counters cover: {f}");
        let zero = serde_json::json!({"conns": 0, "refused": 0, "unreachable": 0, "source_range": 0, "packets": 0, "bytes": 0});
        assert_eq!((&f["stats"], &f["backends"][0]["stats"]), (&zero, &zero), "{f}");
        assert_eq!(tcp(&w.c, &client, &format!("{vip}:80"), 3)?.ok, 3);
        let (stats, backends) = w.c.frontend_stats(1, vip, 80, "TCP")?;
        assert_eq!((stats["conns"].as_u64(), backends), (Some(3), 3), "{stats}");
        Ok(())
    };
    // Handed out by a sync of the change.
    assert!(stale(&w)? > 500);
    add(&w, "extra", "10.96.0.20", 8081)?;
    fresh(&w, "10.96.0.20")?;
    // And by a full sync: the first after a restart, with a Service added
    // while the agent was down.
    w.c.kill_agent(1);
    assert!(stale(&w)? > 500);
    add(&w, "third", "10.96.0.30", 8082)?;
    w.c.start_agent_with(1, &[])?;
    fresh(&w, "10.96.0.30")?;
    // That full sync also deleted the counters of every id still free
    // (the periodic resync, 30 s by default, has not run yet).
    assert_eq!(stale_left(&w)?, 0);
    // Between full syncs the periodic resync deletes them, and only them.
    w.c.kill_agent(1);
    w.c.start_agent_with(1, &["--resync-period", "1s"])?;
    wait_backends(&w.c, 1, "10.96.0.30", 80, 1)?;
    assert!(stale(&w)? > 500);
    w.c.wait_for("the periodic resync to delete the stale counters", std::time::Duration::from_secs(10), || Ok(stale_left(&w)? == 0))?;
    let (stats, backends) = w.c.frontend_stats(1, "10.96.0.30", 80, "TCP")?;
    assert_eq!((stats["conns"].as_u64(), backends), (Some(3), 3), "the counters of ids in use stay: {stats}");
    Ok(())
}

/// Another proxy's socket program left on the cgroup lb attaches to (as
/// Cilium's socket LB stays after a move from Cilium) runs on every
/// connect before lb's, and its TC program ahead of lb's on a device:
/// named in warnings and in `lb_foreign_programs{hook}`. node-2, with
/// none, says nothing.
#[test]
fn another_proxys_socket_program_on_lbs_cgroup_is_named_in_a_warning_and_a_metric() -> Result<()> {
    let mut c = Cluster::new(2)?;
    let _prog = lbtest::bpfprog::attach_connect4(&c.nodes[0].cgroup, "cil_sock4_conn")?;
    // And a TC program on node-1's eth0, which lb's comes after.
    lbtest::bpfprog::attach_tcx_ingress(&c.nodes[0].netns, "eth0", "cil_from_netdev")?;
    // The TC programs on eth0 from the start (not only once a Service
    // takes outside traffic).
    for node in [1, 2] {
        c.start_agent_with(node, &["--kube-proxy-check-period", "1s", "--nodeport-interface", "eth0"])?;
    }
    let log1 = c.agent_log(1);
    c.wait_for("node-1's warning", Duration::from_secs(10), || {
        Ok(std::fs::read_to_string(&log1)?.contains("other BPF programs run on the socket hooks lb uses"))
    })?;
    c.wait_for("node-1's TC warning", Duration::from_secs(10), || {
        Ok(std::fs::read_to_string(&log1)?.contains("other BPF programs run ahead of lb's on the TC hooks of its devices"))
    })?;
    let text = std::fs::read_to_string(&log1)?;
    assert!(text.contains("cil_sock4_conn on connect4 (id "), "{text}");
    assert!(text.contains("cil_from_netdev on tcx_ingress of eth0 (id "), "{text}");
    assert_eq!(
        metric(&c.http(1, "127.0.0.1:10249", "/metrics")?.1, "lb_foreign_programs{hook=\"tcx_ingress\"}"),
        Some(1.0)
    );
    let gauge = |node: usize, hook: &str| -> Result<Option<f64>> {
        Ok(metric(&c.http(node, "127.0.0.1:10249", "/metrics")?.1, &format!("lb_foreign_programs{{hook=\"{hook}\"}}")))
    };
    assert_eq!((gauge(1, "connect4")?, gauge(1, "sendmsg4")?, gauge(1, "connect6")?), (Some(1.0), Some(0.0), Some(0.0)));
    c.wait_for("node-2's metric", Duration::from_secs(10), || Ok(gauge(2, "connect4")?.is_some()))?;
    assert_eq!(gauge(2, "connect4")?, Some(0.0));
    let text2 = std::fs::read_to_string(c.agent_log(2))?;
    assert!(!text2.contains("other BPF programs"), "{text2}");
    Ok(())
}

/// A program another owner puts behind lb's on a NodePort device (a host
/// firewall's, an observability tool's) sees the packets lb passes on, as
/// it would without lb: here one that drops every packet, appended to
/// node-1's eth0 TCX ingress after lb's. A connection to a port of node-1
/// itself and one to a NodePort are both dropped by it (time out), where
/// before 12-05's second half lb's programs ended the chain with
/// TC_ACT_OK: the first was refused by node-1 and the second served, the
/// firewall never asked.
#[test]
fn a_program_behind_lbs_on_a_device_sees_the_packets_lb_passes_on() -> Result<()> {
    use lbtest::world::*;
    let w = world(&web("NodePort", "", &[]))?;
    wait_backends(&w.c, 1, NODE1, 30080, 2)?;
    let np = hostport(NODE1, 30080);
    let closed = hostport(NODE1, 9);
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &np, "--count", "3"])?;
    assert_eq!(s.ok, 3, "served before: {s:?}");
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &closed, "--count", "1", "--timeout-ms", "700"])?;
    assert!(s.errors.contains_key("ECONNREFUSED"), "node-1 refuses a closed port: {s:?}");
    lbtest::bpfprog::attach_tcx_ingress_returning(&w.c.nodes[0].netns, "eth0", "fw_drop_all", 2)?;
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &closed, "--count", "1", "--timeout-ms", "700"])?;
    assert_eq!(s.errors.keys().collect::<Vec<_>>(), ["ETIMEDOUT"], "dropped by the program behind lb's: {s:?}");
    let s = w.c.probe(&w.outside, &["tcp", "--addr", &np, "--count", "3", "--timeout-ms", "700"])?;
    assert_eq!((s.ok, s.errors.keys().map(String::as_str).collect::<Vec<_>>()), (0, vec!["ETIMEDOUT"]), "the NodePort's packets too: {s:?}");
    Ok(())
}

/// kube-proxy's rules on a node (kube-proxy still running, or its rules
/// left behind when its DaemonSet was deleted) are named in a warning and
/// in `lb_kube_proxy_rules{mode}`, in each mode kube-proxy has: iptables
/// through either backend, nftables, IPVS. kubelet's own KUBE-* chains are
/// not kube-proxy's. Rules removed later are seen gone at the next check.
#[test]
fn kube_proxys_rules_on_a_node_are_named_in_a_warning_and_a_metric() -> Result<()> {
    let mut c = Cluster::new(2)?;
    let pod = c.add_pod(2, "pod-a")?;
    c.write_object("svc.yaml", &service("web", "10.96.0.10", &[("http", 80, 8080, "TCP")]))?;
    c.write_object("slice.yaml", &slice("web", "web-1", &[("http", 8080, "TCP")], &[(&pod.ip, "node-2", true)]))?;
    let (n1, n2) = (c.nodes[0].netns.clone(), c.nodes[1].netns.clone());
    let run = |c: &Cluster, ns: &str, cmds: &[&[&str]]| -> Result<()> {
        for cmd in cmds {
            c.in_netns(ns, cmd)?;
        }
        Ok(())
    };
    // node-1: kube-proxy's iptables mode (IPv4 in iptables-legacy, IPv6 in
    // iptables-nft), its nftables mode, and IPVS mode's device (a veth
    // here: this kernel has no dummy driver; it is found by name).
    run(
        &c,
        &n1,
        &[
            &["iptables-legacy", "-t", "nat", "-N", "KUBE-SERVICES"],
            &["iptables-legacy", "-t", "nat", "-N", "KUBE-NODEPORTS"],
            &["iptables-legacy", "-t", "nat", "-N", "KUBE-SVC-AAAAAAAAAAAAAAAA"],
            &["iptables-legacy", "-t", "nat", "-N", "KUBE-SEP-BBBBBBBBBBBBBBBB"],
            &["iptables-legacy", "-t", "nat", "-A", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"],
            &["iptables-legacy", "-t", "nat", "-A", "KUBE-SERVICES", "-d", "10.96.0.10/32", "-j", "KUBE-SVC-AAAAAAAAAAAAAAAA"],
            &["iptables-legacy", "-t", "nat", "-A", "KUBE-SVC-AAAAAAAAAAAAAAAA", "-j", "KUBE-SEP-BBBBBBBBBBBBBBBB"],
            // Its masquerade chains, and IPVS mode's filter chain and
            // ipsets (one a rule refers to: destroyed once the rule is
            // gone), both families.
            &["iptables-legacy", "-t", "nat", "-N", "KUBE-POSTROUTING"],
            &["iptables-legacy", "-t", "nat", "-N", "KUBE-MARK-MASQ"],
            &["iptables-legacy", "-t", "nat", "-A", "POSTROUTING", "-m", "comment", "--comment", "kubernetes postrouting rules", "-j", "KUBE-POSTROUTING"],
            &["iptables-legacy", "-t", "nat", "-A", "KUBE-POSTROUTING", "-m", "mark", "--mark", "0x4000/0x4000", "-j", "MASQUERADE"],
            &["iptables-legacy", "-t", "filter", "-N", "KUBE-IPVS-FILTER"],
            &["iptables-legacy", "-t", "filter", "-A", "INPUT", "-m", "comment", "--comment", "kubernetes ipvs access filter", "-j", "KUBE-IPVS-FILTER"],
            &["ipset", "create", "KUBE-CLUSTER-IP", "hash:ip,port"],
            &["ipset", "create", "KUBE-6-CLUSTER-IP", "hash:ip,port", "family", "inet6"],
            &["iptables-legacy", "-t", "nat", "-A", "KUBE-SERVICES", "-m", "set", "--match-set", "KUBE-CLUSTER-IP", "dst,dst", "-j", "ACCEPT"],
            // Another tool's set named KUBE-* (kube-router's network policy): stays.
            &["ipset", "create", "KUBE-SRC-NOTKUBEPROXY", "hash:ip"],
            // kubelet's chain and an operator's own rule, which stay.
            &["iptables-legacy", "-t", "filter", "-N", "KUBE-FIREWALL"],
            &["iptables-legacy", "-t", "filter", "-A", "INPUT", "-j", "KUBE-FIREWALL"],
            &["iptables-legacy", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", "8081", "-j", "REDIRECT", "--to-ports", "81"],
            &["ip6tables-nft", "-t", "filter", "-N", "KUBE-FORWARD"],
            &["ip6tables-nft", "-t", "filter", "-A", "FORWARD", "-j", "KUBE-FORWARD"],
            &["nft", "add", "table", "ip", "kube-proxy"],
            &["ip", "link", "add", "kube-ipvs0", "type", "veth", "peer", "name", "kube-ipvs0p"],
        ],
    )?;
    // node-2: only kubelet's chains (and those older kubelets made).
    run(
        &c,
        &n2,
        &[
            &["iptables-legacy", "-t", "filter", "-N", "KUBE-FIREWALL"],
            &["iptables-legacy", "-t", "mangle", "-N", "KUBE-KUBELET-CANARY"],
            &["iptables-nft", "-t", "nat", "-N", "KUBE-MARK-MASQ"],
            &["iptables-nft", "-t", "nat", "-N", "KUBE-POSTROUTING"],
        ],
    )?;
    for node in [1, 2] {
        c.start_agent_with(node, &["--kube-proxy-check-period", "1s"])?;
    }
    let log1 = c.agent_log(1);
    c.wait_for("node-1's warning", Duration::from_secs(20), || Ok(std::fs::read_to_string(&log1)?.contains("kube-proxy's rules are on this node")))?;
    let text = std::fs::read_to_string(&log1)?;
    for want in [
        "iptables-legacy (filter KUBE-IPVS-FILTER, nat KUBE-NODEPORTS, nat KUBE-SERVICES; 2 per-Service chains)",
        "iptables-nft (filter KUBE-FORWARD)",
        "nftables (table ip kube-proxy)",
        "ipvs (device kube-ipvs0)",
        "kube-proxy --cleanup",
    ] {
        assert!(text.contains(want), "node-1's warning names {want}: {text}");
    }
    let gauge = |node: usize, mode: &str| -> Result<Option<f64>> {
        Ok(metric(&c.http(node, "127.0.0.1:10249", "/metrics")?.1, &format!("lb_kube_proxy_rules{{mode=\"{mode}\"}}")))
    };
    for mode in ["iptables-legacy", "iptables-nft", "nftables", "ipvs"] {
        assert_eq!(gauge(1, mode)?, Some(1.0), "node-1 {mode}");
    }
    // node-2 has been looked at as often, and holds nothing of kube-proxy's.
    c.wait_for("node-2's metric", Duration::from_secs(10), || Ok(gauge(2, "iptables-legacy")?.is_some()))?;
    for mode in ["iptables-legacy", "iptables-nft", "nftables", "ipvs"] {
        assert_eq!(gauge(2, mode)?, Some(0.0), "node-2 {mode}");
    }
    let text2 = std::fs::read_to_string(c.agent_log(2))?;
    assert!(!text2.contains("kube-proxy's rules"), "kubelet's chains are not kube-proxy's: {text2}");
    // The operator cleans node-1 up with lb-agent cleanup-kube-proxy
    // (kube-proxy --cleanup's job): a dry run first changes nothing.
    let agent = lbtest::bin("lb-agent");
    let agent = agent.to_str().unwrap();
    // The agent's own rules (LB-FORWARD, table inet lb) may come at any
    // time: conntrack runs here (kube-proxy's nat rules).
    let saves = || -> Result<String> {
        let all = c.in_netns(&n1, &["iptables-legacy-save"])? + &c.in_netns(&n1, &["ip6tables-nft-save"])? + &c.in_netns(&n1, &["nft", "list", "tables"])?;
        Ok(all.lines().filter(|l| !l.contains("LB-FORWARD") && l.trim() != "table inet lb").map(|l| format!("{l}\n")).collect())
    };
    let before = saves()?;
    let dry = c.in_netns(&n1, &[agent, "cleanup-kube-proxy", "--dry-run"])?;
    assert!(dry.contains("-X KUBE-SERVICES") && dry.contains("nft delete table ip kube-proxy") && dry.contains("ip link del kube-ipvs0"), "{dry}");
    assert!(dry.contains("ipset destroy KUBE-6-CLUSTER-IP") && !dry.contains("KUBE-SRC-NOTKUBEPROXY"), "{dry}");
    let sets = || c.in_netns(&n1, &["ipset", "list", "-n"]);
    assert_eq!(sets()?.lines().count(), 3, "a dry run destroys no ipset");
    assert_eq!(saves()?.lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>(), before.lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>(), "a dry run changes nothing");
    c.in_netns(&n1, &[agent, "cleanup-kube-proxy"])?;
    let after = saves()?;
    for gone in ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-SVC-", "KUBE-SEP-", "KUBE-FORWARD", "kube-proxy", "KUBE-POSTROUTING", "KUBE-MARK-MASQ", "KUBE-IPVS-FILTER"] {
        assert!(!after.contains(gone), "{gone} removed: {after}");
    }
    assert_eq!(sets()?.trim(), "KUBE-SRC-NOTKUBEPROXY", "kube-proxy's ipsets destroyed, another tool's kept");
    for kept in ["-A INPUT -j KUBE-FIREWALL", ":KUBE-FIREWALL", "--dport 8081 -j REDIRECT --to-ports 81"] {
        assert!(after.contains(kept), "{kept} kept: {after}");
    }
    assert_eq!(c.in_netns(&n1, &[agent, "cleanup-kube-proxy"])?.trim(), "no kube-proxy rules on this node");
    c.wait_for("node-1's rules seen gone", Duration::from_secs(10), || Ok(std::fs::read_to_string(&log1)?.contains("kube-proxy's rules are gone")))?;
    for mode in ["iptables-legacy", "iptables-nft", "nftables", "ipvs"] {
        assert_eq!(gauge(1, mode)?, Some(0.0), "node-1 {mode} after the clean-up");
    }
    Ok(())
}

/// `--bpf-forward` sends lb's outside flows past netfilter's FORWARD hook,
/// and so past NetworkPolicy that a CNI enforces there: a node where
/// Calico's, kube-router's or Weave Net's rules are found gets a warning
/// naming them and `lb_bpf_forward_policy_bypassed{engine}`, looked at
/// again every period; a node without the flag loses nothing and is told
/// nothing.
#[test]
fn bpf_forward_names_the_network_policy_it_would_bypass() -> Result<()> {
    let mut c = Cluster::new(2)?;
    let pod = c.add_pod(2, "pod-a")?;
    c.write_object("svc.yaml", &service("web", "10.96.0.10", &[("http", 80, 8080, "TCP")]))?;
    c.write_object("slice.yaml", &slice("web", "web-1", &[("http", 8080, "TCP")], &[(&pod.ip, "node-2", true)]))?;
    let (n1, n2) = (c.nodes[0].netns.clone(), c.nodes[1].netns.clone());
    // Calico's iptables chains on both nodes, its nftables table on node-1;
    // Docker's chain, which is no NetworkPolicy, too.
    for ns in [&n1, &n2] {
        for cmd in [
            &["iptables-legacy", "-t", "filter", "-N", "cali-FORWARD"][..],
            &["iptables-legacy", "-t", "filter", "-A", "FORWARD", "-j", "cali-FORWARD"],
            &["iptables-legacy", "-t", "filter", "-N", "DOCKER-ISOLATION-STAGE-1"],
        ] {
            c.in_netns(ns, cmd)?;
        }
    }
    c.in_netns(&n1, &["nft", "add", "table", "ip6", "calico"])?;
    c.start_agent_with(1, &["--bpf-forward", "--kube-proxy-check-period", "1s"])?;
    c.start_agent_with(2, &["--kube-proxy-check-period", "1s"])?;
    let log1 = c.agent_log(1);
    let warned = |log: &std::path::Path| -> Result<Vec<String>> {
        Ok(std::fs::read_to_string(log)?.lines().filter(|l| l.contains("NetworkPolicy enforced in netfilter")).map(String::from).collect())
    };
    c.wait_for("node-1's warning", Duration::from_secs(10), || Ok(!warned(&log1)?.is_empty()))?;
    let w = warned(&log1)?;
    assert!(w.len() == 1 && w[0].contains("calico (filter cali-FORWARD, table ip6 calico)") && !w[0].contains("DOCKER"), "{w:?}");
    let gauge = |node: usize, engine: &str| -> Result<Option<f64>> {
        Ok(metric(&c.http(node, "127.0.0.1:10249", "/metrics")?.1, &format!("lb_bpf_forward_policy_bypassed{{engine=\"{engine}\"}}")))
    };
    assert_eq!((gauge(1, "calico")?, gauge(1, "kube-router")?, gauge(1, "weave-net")?), (Some(1.0), Some(0.0), Some(0.0)));
    // kube-router comes later: seen at the next look.
    c.in_netns(&n1, &["iptables-legacy", "-t", "filter", "-N", "KUBE-ROUTER-FORWARD"])?;
    c.wait_for("kube-router seen", Duration::from_secs(10), || Ok(gauge(1, "kube-router")? == Some(1.0)))?;
    let w = warned(&log1)?;
    assert!(w.len() == 2 && w[1].contains("kube-router (filter KUBE-ROUTER-FORWARD)"), "{w:?}");
    // All gone: said once, and the metric drops.
    for cmd in [
        &["iptables-legacy", "-t", "filter", "-D", "FORWARD", "-j", "cali-FORWARD"][..],
        &["iptables-legacy", "-t", "filter", "-X", "cali-FORWARD"],
        &["iptables-legacy", "-t", "filter", "-X", "KUBE-ROUTER-FORWARD"],
        &["nft", "delete", "table", "ip6", "calico"],
    ] {
        c.in_netns(&n1, cmd)?;
    }
    c.wait_for("the engines seen gone", Duration::from_secs(10), || Ok(std::fs::read_to_string(&log1)?.contains("bypasses none")))?;
    assert_eq!((gauge(1, "calico")?, gauge(1, "kube-router")?), (Some(0.0), Some(0.0)));
    // node-2 forwards through the stack: its Calico rules see lb's flows,
    // and it says nothing of them.
    assert!(warned(&c.agent_log(2))?.is_empty());
    assert_eq!(gauge(2, "calico")?, None);
    Ok(())
}

/// kube-proxy still running on the node holds 10256 (and 10249): the
/// agent stops at start with an error naming the flag, the address, the
/// process that holds it and what to do.
#[test]
fn a_port_held_by_another_process_is_an_error_naming_it() -> Result<()> {
    let mut c = Cluster::new(1)?;
    c.write_object("svc.yaml", &service("web", "10.96.0.10", &[("http", 80, 8080, "TCP")]))?;
    let host = c.host(1);
    let pid = c.serve(&host, 10256)?;
    let err = c.start_agent(1).expect_err("the agent cannot serve /healthz on a port in use");
    let text = format!("{err:#}");
    for want in ["--healthz-bind 0.0.0.0:10256", "in use", &format!("held by lbprobe (pid {pid})"), "kube-proxy listens there too", "delete its DaemonSet"] {
        assert!(text.contains(want), "the error says {want:?}: {text}");
    }
    Ok(())
}

/// The agent's sync loop hangs (its thread stopped, as on a stuck
/// syscall) while an endpoint changes: `/healthz` answers 503 once the
/// change waited longer than the stall limit, `/livez` too, and the queue
/// metrics show it, as kube-proxy's do for its hung loop (the queued time
/// past the last sync, the change pending). Once the loop goes on, all is
/// well again. Before 12-07 the health and metrics servers and the source
/// ran on the loop's thread: a hung loop left them unanswered, and the
/// loop wrote the queue metrics itself. The healthCheckNodePort servers
/// answer 503 as kube-proxy's do for an unhealthy proxy (before 12-08 they
/// too ran on the loop's thread: a load balancer's probe timed out).
#[test]
fn a_hung_sync_loop_shows_in_healthz_and_the_queue_metrics() -> Result<()> {
    let mut c = Cluster::new(1)?;
    let (a, b) = (c.add_pod(1, "pod-a")?, c.add_pod(1, "pod-b")?);
    c.write_object("node.yaml", &lbtest::objects::node("node-1", "z1"))?;
    let local = "  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n";
    c.write_object("svc.yaml", &service_typed("web", &["10.96.0.10"], "LoadBalancer", &[("http", 80, 8080, "TCP", 30080)], local, &[]))?;
    c.write_object("slice.yaml", &slice("web", "web-1", &[("http", 8080, "TCP")], &[(&a.ip, "node-1", true)]))?;
    c.start_agent_with(1, &["--healthz-stall-seconds", "2"])?;
    c.wait_programmed("10.96.0.10", 80, "TCP", Some(&[&format!("{}:8080", a.ip)]))?;
    let last = "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}";
    let queued = "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv4\"}";
    let pending = "kubeproxy_sync_proxy_rules_endpoint_changes_pending";
    let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
    assert_eq!(metric(&m, pending), Some(0.0), "{m}");
    let hc = || -> Result<(u16, serde_json::Value)> {
        let (code, body) = c.http(1, "127.0.0.1:32000", "/")?;
        Ok((code, serde_json::from_str(&body)?))
    };
    c.wait_for("the health check served", Duration::from_secs(10), || Ok(hc().is_ok_and(|(code, _)| code == 200)))?;
    // The agent's main thread runs its sync loop.
    let stopped = lbtest::ThreadStopped::new(c.agent_pid(1).expect("the agent runs"))?;
    c.write_object("slice.yaml", &slice("web", "web-1", &[("http", 8080, "TCP")], &[(&b.ip, "node-1", true)]))?;
    c.wait_for("/healthz 503", Duration::from_secs(10), || Ok(c.http(1, "127.0.0.1:10256", "/healthz")?.0 == 503))?;
    assert_eq!(c.http(1, "127.0.0.1:10256", "/livez")?.0, 503);
    let (code, v) = hc()?;
    assert_eq!((code, &v["serviceProxyHealthy"], &v["localEndpoints"]), (503, &serde_json::json!(false), &serde_json::json!(1)), "{v}");
    let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
    assert!(metric(&m, pending).is_some_and(|n| n >= 1.0), "the change is pending: {m}");
    let (q, l) = (metric(&m, queued).unwrap(), metric(&m, last).unwrap());
    assert!(q > l, "queued {q} after the last sync {l}");
    drop(stopped);
    c.wait_programmed("10.96.0.10", 80, "TCP", Some(&[&format!("{}:8080", b.ip)]))?;
    c.wait_for("/healthz 200", Duration::from_secs(10), || Ok(c.http(1, "127.0.0.1:10256", "/healthz")?.0 == 200))?;
    assert_eq!(hc()?.0, 200);
    let m = c.http(1, "127.0.0.1:10249", "/metrics")?.1;
    assert_eq!(metric(&m, pending), Some(0.0), "{m}");
    assert!(metric(&m, last).unwrap() >= metric(&m, queued).unwrap(), "{m}");
    Ok(())
}
