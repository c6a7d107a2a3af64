//! Every manifest in deploy/ parses into k8s-openapi types, and says what
//! the install needs: least privilege, hostNetwork, pins that survive.
use std::collections::BTreeSet;
use std::path::PathBuf;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};

fn deploy(file: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(file);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn docs(file: &str) -> Vec<serde_json::Value> {
    serde_saphyr::from_multiple::<serde_json::Value>(&deploy(file)).unwrap().into_iter().filter(|v| !v.is_null()).collect()
}

/// `v` as a `T`, every key of it known to `T`: k8s-openapi skips keys it
/// does not know, so a misspelled one (`priorityClasName`) would pass
/// unseen; each key must come back when the value is written again.
fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(v: &serde_json::Value) -> T {
    let t: T = serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{e}: {v:?}"));
    let back = serde_json::to_value(&t).unwrap();
    let lost = lost_keys(v, &back, "");
    assert!(lost.is_empty(), "keys the API does not know: {lost:?}");
    t
}

/// The keys of `orig` (paths) that `back` has not.
fn lost_keys(orig: &serde_json::Value, back: &serde_json::Value, at: &str) -> Vec<String> {
    use serde_json::Value;
    match (orig, back) {
        (Value::Object(o), Value::Object(b)) => o
            .iter()
            .flat_map(|(k, v)| match b.get(k) {
                Some(w) => lost_keys(v, w, &format!("{at}.{k}")),
                None => vec![format!("{at}.{k}")],
            })
            .collect(),
        (Value::Array(o), Value::Array(b)) => o.iter().zip(b).enumerate().flat_map(|(i, (v, w))| lost_keys(v, w, &format!("{at}[{i}]"))).collect(),
        _ => Vec::new(),
    }
}

#[test]
fn a_misspelled_key_is_caught() {
    let v = serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x", "namspace": "y"}});
    let back = serde_json::to_value(serde_json::from_value::<ServiceAccount>(v.clone()).unwrap()).unwrap();
    assert_eq!(lost_keys(&v, &back, ""), [".metadata.namspace"]);
}

/// What keeps the agent on every node through a rollout, as kube-proxy's
/// DaemonSet: every taint tolerated, the node-critical priority, one node
/// at a time, and time to exit on SIGTERM.
#[test]
fn the_daemon_set_runs_everywhere_one_node_at_a_time() {
    let ds: DaemonSet = typed(&docs("daemonset.yaml")[0]);
    let spec = ds.spec.unwrap();
    let strategy = spec.update_strategy.unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.unwrap();
    assert_eq!(rolling.max_unavailable, Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1)));
    assert_eq!(rolling.max_surge, None, "a second agent on a node would fight the first over the pins");
    let pod = spec.template.spec.unwrap();
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    let tolerations = pod.tolerations.unwrap();
    assert!(tolerations.iter().any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none() && t.effect.is_none()), "{tolerations:?}");
    assert!(pod.termination_grace_period_seconds.is_some_and(|s| s >= 10), "{:?}", pod.termination_grace_period_seconds);
    for c in pod.init_containers.iter().flatten().chain(&pod.containers) {
        assert_eq!(c.security_context.as_ref().and_then(|s| s.privileged), Some(true), "{}: bidirectional mount propagation", c.name);
    }
}

#[test]
fn every_manifest_parses_into_its_type() {
    let mut kinds = BTreeSet::new();
    for file in ["rbac.yaml", "daemonset.yaml"] {
        for d in docs(file) {
            let kind = d["kind"].as_str().unwrap().to_string();
            match kind.as_str() {
                "ServiceAccount" => drop(typed::<ServiceAccount>(&d)),
                "ClusterRole" => drop(typed::<ClusterRole>(&d)),
                "ClusterRoleBinding" => drop(typed::<ClusterRoleBinding>(&d)),
                "DaemonSet" => drop(typed::<DaemonSet>(&d)),
                other => panic!("{file}: unexpected kind {other}"),
            }
            kinds.insert(kind);
        }
    }
    assert_eq!(kinds, ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "ServiceAccount"].map(String::from).into());
    let k = &docs("kustomization.yaml")[0];
    let resources: Vec<&str> = k["resources"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
    assert_eq!(resources, ["rbac.yaml", "daemonset.yaml"]);
    let lits: Vec<&str> = k["configMapGenerator"][0]["literals"].as_array().unwrap().iter().map(|l| l.as_str().unwrap()).collect();
    assert!(lits.iter().any(|l| l.starts_with("KUBERNETES_SERVICE_HOST=")), "{lits:?}");
    assert!(lits.iter().any(|l| l.starts_with("KUBERNETES_SERVICE_PORT=")), "{lits:?}");
    let kind = &docs("kind.yaml")[0];
    assert_eq!(kind["networking"]["kubeProxyMode"].as_str(), Some("none"));
}

#[test]
fn the_cluster_role_grants_get_list_watch_on_three_resources_and_nothing_else() {
    let d = docs("rbac.yaml");
    let role: ClusterRole = typed(d.iter().find(|d| d["kind"] == "ClusterRole").unwrap());
    let mut granted = BTreeSet::new();
    for r in role.rules.unwrap() {
        assert!(r.non_resource_urls.is_none() && r.resource_names.is_none(), "{r:?}");
        for g in r.api_groups.unwrap_or_default() {
            for res in r.resources.clone().unwrap_or_default() {
                for v in &r.verbs {
                    granted.insert((g.clone(), res.clone(), v.clone()));
                }
            }
        }
    }
    let mut want = BTreeSet::new();
    for (g, res) in [("", "services"), ("", "nodes"), ("discovery.k8s.io", "endpointslices")] {
        for v in ["get", "list", "watch"] {
            want.insert((g.to_string(), res.to_string(), v.to_string()));
        }
    }
    assert_eq!(granted, want);
    let sa: ServiceAccount = typed(d.iter().find(|d| d["kind"] == "ServiceAccount").unwrap());
    let binding: ClusterRoleBinding = typed(d.iter().find(|d| d["kind"] == "ClusterRoleBinding").unwrap());
    assert_eq!(binding.role_ref.name, role.metadata.name.unwrap());
    let subject = &binding.subjects.unwrap()[0];
    assert_eq!((subject.kind.as_str(), subject.name.as_str()), ("ServiceAccount", sa.metadata.name.as_deref().unwrap()));
    assert_eq!(subject.namespace, sa.metadata.namespace);
}

#[test]
fn the_daemon_set_runs_on_every_node_with_pinned_state_and_health() {
    let ds: DaemonSet = typed(&docs("daemonset.yaml")[0]);
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.host_network, Some(true));
    // Without the host's PID namespace no pod netns is visible.
    assert_eq!(pod.host_pid, Some(true));
    assert_eq!(pod.service_account_name.as_deref(), Some("lb-agent"));
    // bpffs is checked by type: the hostPath is always a mount point.
    let init = pod.init_containers.as_ref().unwrap()[0].command.clone().unwrap().join(" ");
    assert!(init.contains("stat -f -c %T /sys/fs/bpf") && init.contains("bpf_fs"), "{init}");
    assert!(pod.tolerations.unwrap().iter().any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()));
    let c = &pod.containers[0];
    let args = c.args.clone().unwrap();
    assert!(args.contains(&"--source=kube".to_string()), "{args:?}");
    // Ready once the agent has synced (/readyz; /healthz is kube-proxy's,
    // 200 from the start); restarted on /livez alone (/healthz fails while
    // the node drains; /readyz while the API server is down at boot, and
    // restarts then only delay the first sync), after a startup probe that
    // gives the first sync time; timeouts a sync's pause on the agent's
    // one thread does not reach.
    let port = k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(10256);
    for (p, path) in [(&c.readiness_probe, "/readyz"), (&c.startup_probe, "/livez"), (&c.liveness_probe, "/livez")] {
        let p = p.as_ref().unwrap();
        let get = p.http_get.as_ref().unwrap();
        assert_eq!((get.path.as_deref(), &get.port), (Some(path), &port));
        assert!(p.timeout_seconds.unwrap_or(1) >= 5, "{p:?}");
    }
    // Not on virtual-kubelet nodes, nor on nodes labelled to keep
    // kube-proxy (where an agent that cannot run would hold every rollout).
    let terms = pod.affinity.as_ref().unwrap().node_affinity.as_ref().unwrap().required_during_scheduling_ignored_during_execution.as_ref().unwrap();
    let exprs = terms.node_selector_terms[0].match_expressions.clone().unwrap();
    assert!(exprs.iter().any(|e| e.key == "type" && e.operator == "NotIn" && e.values.as_deref() == Some(&["virtual-kubelet".to_string()][..])), "{exprs:?}");
    assert!(exprs.iter().any(|e| e.key == "lb.dev/skip" && e.operator == "DoesNotExist"), "{exprs:?}");
    let startup = c.startup_probe.as_ref().unwrap();
    assert!(startup.period_seconds.unwrap_or(10) * startup.failure_threshold.unwrap_or(3) >= 300, "{startup:?}");
    assert_eq!(pod.node_selector.as_ref().and_then(|s| s.get("kubernetes.io/os")).map(String::as_str), Some("linux"));
    let mounts = c.volume_mounts.clone().unwrap();
    let vols = pod.volumes.clone().unwrap();
    // The mount a path lies under, and the host path behind it.
    let host_path_of = |path: &str| -> Option<String> {
        let m = mounts.iter().filter(|m| path.starts_with(&m.mount_path)).max_by_key(|m| m.mount_path.len())?;
        vols.iter().find(|v| v.name == m.name)?.host_path.as_ref().map(|h| h.path.clone())
    };
    let flag = |name: &str| args.iter().find_map(|a| a.strip_prefix(&format!("--{name}="))).map(str::to_string);
    // The pins live on the host's bpffs (they outlive the pod), in a mount
    // that propagates the pins both ways.
    let pins = flag("bpffs").expect("--bpffs");
    assert_eq!(host_path_of(&pins).as_deref(), Some("/sys/fs/bpf"), "{pins}");
    let bpffs = mounts.iter().filter(|m| pins.starts_with(&m.mount_path)).max_by_key(|m| m.mount_path.len()).unwrap();
    assert_eq!(bpffs.mount_propagation.as_deref(), Some("Bidirectional"));
    // The programs attach to the host's cgroup v2 root, not the pod's.
    let cgroup = flag("cgroup").expect("--cgroup");
    assert_eq!(host_path_of(&cgroup).as_deref(), Some("/sys/fs/cgroup"), "{cgroup}");
    // The health check kube-proxy's users probe: the readiness probe's port.
    let healthz = flag("healthz-bind").expect("--healthz-bind");
    assert!(healthz.ends_with(":10256"), "{healthz}");
    let env = c.env.clone().unwrap();
    let node = env.iter().find(|e| e.name == "NODE_NAME").unwrap();
    assert_eq!(node.value_from.as_ref().unwrap().field_ref.as_ref().unwrap().field_path, "spec.nodeName");
    let from = c.env_from.clone().unwrap();
    assert_eq!(from[0].config_map_ref.as_ref().unwrap().name, "lb-agent-config");
    assert_eq!(c.security_context.as_ref().unwrap().privileged, Some(true));
    // No memory limit: the node's translated sockets are charged to the
    // agent's cgroup (README: "The agent's memory limit").
    let res = c.resources.as_ref().unwrap();
    assert!(res.requests.as_ref().unwrap().contains_key("memory"));
    assert!(res.limits.as_ref().is_none_or(|l| !l.contains_key("memory")), "{res:?}");
    let paths: BTreeSet<String> = vols.iter().filter_map(|v| v.host_path.as_ref().map(|h| h.path.clone())).collect();
    assert_eq!(paths, ["/run/xtables.lock".to_string(), "/sys/fs/bpf".to_string(), "/sys/fs/cgroup".to_string()].into());
    // iptables' lock is the host's, shared with kubelet and the CNI.
    assert_eq!(host_path_of("/run/xtables.lock").as_deref(), Some("/run/xtables.lock"));
}

/// lb-agent's version, from its Cargo.toml (what `lb-agent --version`
/// prints).
fn agent_version() -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../lb-agent/Cargo.toml");
    let text = std::fs::read_to_string(&p).unwrap();
    let line = text.lines().find(|l| l.starts_with("version")).unwrap();
    line.split('"').nth(1).unwrap().to_string()
}

/// Every container of both DaemonSets runs the release the manifests come
/// with, never `:latest`: with `imagePullPolicy: IfNotPresent` a node
/// holding an older `latest` would keep running it, and with `Always`
/// nodes would run whatever was pushed last, the agent of one node newer
/// than its neighbours' without a rollout. A new version in
/// lb-agent/Cargo.toml fails this until the manifests name it.
#[test]
fn the_manifests_run_the_release_they_come_with() {
    let want = format!("lb-agent:{}", agent_version());
    for file in ["daemonset.yaml", "uninstall/daemonset.yaml"] {
        let ds: DaemonSet = typed(&docs(file)[0]);
        let pod = ds.spec.unwrap().template.spec.unwrap();
        let all: Vec<_> = pod.init_containers.unwrap_or_default().into_iter().chain(pod.containers).collect();
        assert!(all.len() >= 2, "{file}");
        for c in all {
            assert_eq!(c.image.as_deref(), Some(want.as_str()), "{file}: {}", c.name);
            assert_eq!(c.image_pull_policy.as_deref(), Some("IfNotPresent"), "{file}: {}", c.name);
        }
    }
    for file in ["kustomization.yaml", "uninstall/kustomization.yaml"] {
        let k = &docs(file)[0];
        assert_eq!(k["images"], serde_json::json!([{"name": "lb-agent", "newTag": agent_version()}]), "{file}");
    }
    assert!(deploy("Dockerfile").contains(&format!("-t {want} .")), "the Dockerfile's example tag");
}

#[test]
fn the_uninstall_daemon_set_tears_down_in_the_nodes_network_namespace() {
    let ds: DaemonSet = typed(&docs("uninstall/daemonset.yaml")[0]);
    // Applied with -k: the agent's image, as the agent's kustomization sets it.
    let k = &docs("uninstall/kustomization.yaml")[0];
    assert_eq!(k["resources"], serde_json::json!(["daemonset.yaml"]));
    assert_eq!(k["images"], docs("kustomization.yaml")[0]["images"], "the same image as the agent's");
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.host_network, Some(true), "TC filters and the reserved ports are per network namespace");
    assert_eq!(pod.node_selector.as_ref().and_then(|s| s.get("kubernetes.io/os")).map(String::as_str), Some("linux"), "where the agent ran");
    let init = &pod.init_containers.unwrap()[0];
    let args = init.args.clone().unwrap();
    assert_eq!(args[0], "teardown");
    // The same pin directory as the agent's, on the host's bpffs.
    let agent: DaemonSet = typed(&docs("daemonset.yaml")[0]);
    let run = agent.spec.unwrap().template.spec.unwrap().containers[0].args.clone().unwrap();
    let pins = |a: &[String]| a.iter().find_map(|x| x.strip_prefix("--bpffs=")).map(str::to_string);
    assert_eq!(pins(&args), pins(&run), "{args:?} {run:?}");
    let dir = pins(&args).unwrap();
    let mount = init.volume_mounts.as_ref().unwrap().iter().find(|m| dir.starts_with(&m.mount_path)).expect("a mount holding --bpffs");
    let vol = pod.volumes.as_ref().unwrap().iter().find(|v| v.name == mount.name).unwrap();
    assert_eq!(vol.host_path.as_ref().map(|h| h.path.as_str()), Some("/sys/fs/bpf"));
}
