//! What an operator monitors: /healthz, /livez and /metrics of an agent in
//! its node, and a clear error when the API server cannot be reached.
use std::time::Duration;

use anyhow::Result;
use lbtest::Cluster;
use lbtest::objects::{service, slice};

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

    let s = c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "7"])?;
    assert_eq!(s.ok, 7);
    let s = c.probe(&client, &["tcp", "--addr", "10.96.0.11:80", "--count", "2"])?;
    assert_eq!(s.errors.get("ECONNREFUSED"), Some(&2));

    let (code, m) = c.http(1, "127.0.0.1:10249", "/metrics")?;
    assert_eq!(code, 200);
    assert_eq!(metric(&m, "lb_datapath_events_total{result=\"translated\"}"), Some(7.0), "{m}");
    assert_eq!(metric(&m, "lb_datapath_events_total{result=\"refused_no_endpoints\"}"), Some(2.0), "{m}");
    assert_eq!(metric(&m, "lb_services"), Some(2.0), "{m}");
    assert_eq!(metric(&m, "lb_backends"), Some(1.0), "{m}");
    assert!(metric(&m, "lb_sync_duration_seconds_count").unwrap() >= 1.0, "{m}");
    assert!(metric(&m, "lb_event_to_programmed_seconds_count").unwrap() >= 1.0, "{m}");
    assert_eq!(metric(&m, "lb_map_entries{map=\"LB4_BACKENDS\"}"), Some(1.0), "{m}");
    assert_eq!(metric(&m, "lb_sync_errors_total"), Some(0.0), "{m}");
    Ok(())
}

#[test]
fn an_unreachable_api_server_is_a_clear_error_and_healthz_stays_503() -> Result<()> {
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
        let (code, _) = c.http(1, "127.0.0.1:10256", "/healthz")?;
        assert_eq!(code, 503, "no sync yet");
        Ok(())
    })();
    let _ = agent.kill();
    let _ = agent.wait();
    res
}
