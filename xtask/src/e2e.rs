//! `cargo xtask e2e-kind`: lb on a real Kubernetes cluster made by kind,
//! without kube-proxy. Needs docker (with an engine), kind and kubectl.
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

const CLUSTER: &str = "lb-e2e";
const IMAGE: &str = "lb-agent:e2e";

fn sh(cmd: &str, args: &[&str]) -> Result<String> {
    eprintln!("e2e: {cmd} {}", args.join(" "));
    let out = Command::new(cmd).args(args).output().with_context(|| format!("spawn {cmd}"))?;
    if !out.status.success() {
        bail!("{cmd} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn kubectl(args: &[&str]) -> Result<String> {
    let mut a = vec!["--context", "kind-lb-e2e"];
    a.extend_from_slice(args);
    sh("kubectl", &a)
}

/// `lbprobe` in the client pod; its JSON summary.
fn probe(args: &[&str]) -> Result<serde_json::Value> {
    let mut a = vec!["exec", "client", "--", "lbprobe"];
    a.extend_from_slice(args);
    Ok(serde_json::from_str(kubectl(&a)?.trim())?)
}

fn until(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if f().unwrap_or(false) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_secs(2));
    }
}

const WORKLOAD: &str = r#"
apiVersion: apps/v1
kind: Deployment
metadata: {name: echo, namespace: default}
spec:
  replicas: 3
  selector: {matchLabels: {app: echo}}
  template:
    metadata: {labels: {app: echo}}
    spec:
      containers:
      - name: echo
        image: lb-agent:e2e
        imagePullPolicy: Never
        command: ["sh", "-c", "exec lbprobe serve --name $(hostname) --port 8080"]
---
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: default}
spec:
  selector: {app: echo}
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: default}
spec:
  selector: {app: nothing-matches}
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: default}
spec:
  containers:
  - name: client
    image: lb-agent:e2e
    imagePullPolicy: Never
    command: ["sleep", "infinity"]
"#;

fn checks(work: &Path) -> Result<()> {
    let wl = work.join("workload.yaml");
    std::fs::write(&wl, WORKLOAD)?;
    kubectl(&["apply", "-f", wl.to_str().unwrap()])?;
    kubectl(&["rollout", "status", "deploy/echo", "--timeout=180s"])?;
    kubectl(&["wait", "--for=condition=Ready", "pod/client", "--timeout=180s"])?;
    let vip = kubectl(&["get", "svc", "echo", "-o", "jsonpath={.spec.clusterIP}"])?;
    let empty = kubectl(&["get", "svc", "empty", "-o", "jsonpath={.spec.clusterIP}"])?;

    // ClusterIP TCP, spread over the three pods.
    until("echo through its ClusterIP", Duration::from_secs(60), || {
        let s = probe(&["tcp", "--addr", &format!("{vip}:80"), "--count", "60"])?;
        Ok(s["ok"] == 60 && s["replies"].as_object().is_some_and(|r| r.len() == 3))
    })?;
    // UDP DNS through the kube-dns ClusterIP.
    let dns = kubectl(&["exec", "client", "--", "getent", "hosts", "echo.default.svc.cluster.local"])?;
    if !dns.contains(vip.trim()) {
        bail!("DNS through kube-dns answered {dns:?}, want {vip}");
    }
    // No endpoints: refused at once.
    let s = probe(&["tcp", "--addr", &format!("{empty}:80"), "--count", "3"])?;
    if s["errors"]["ECONNREFUSED"] != 3 {
        bail!("no-endpoints Service: {s}");
    }
    // Scale down: only the remaining pod answers.
    kubectl(&["scale", "deploy/echo", "--replicas=1"])?;
    until("scale-down to one pod", Duration::from_secs(120), || {
        let s = probe(&["tcp", "--addr", &format!("{vip}:80"), "--count", "20"])?;
        Ok(s["ok"] == 20 && s["replies"].as_object().is_some_and(|r| r.len() == 1))
    })?;
    eprintln!("e2e: all checks passed");
    Ok(())
}

pub fn run(root: &Path, keep: bool) -> Result<()> {
    let work = root.join("target/e2e-kind");
    std::fs::create_dir_all(&work)?;
    let _ = sh("kind", &["delete", "cluster", "--name", CLUSTER]);
    sh("kind", &["create", "cluster", "--name", CLUSTER, "--config", root.join("deploy/kind.yaml").to_str().unwrap()])?;
    let result = (|| -> Result<()> {
        // The e2e stage: the runtime image plus lbprobe (the pods' client/server).
        let dockerfile = root.join("deploy/Dockerfile");
        sh("docker", &["build", "-f", dockerfile.to_str().unwrap(), "--target", "e2e", "-t", IMAGE, root.to_str().unwrap()])?;
        sh("kind", &["load", "docker-image", IMAGE, "--name", CLUSTER])?;
        // The API server override: the control-plane node's address.
        let host = sh("docker", &["inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", &format!("{CLUSTER}-control-plane")])?;
        let overlay = format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- ../../deploy\n\
             configMapGenerator:\n- name: lb-agent-config\n  namespace: kube-system\n  behavior: replace\n  literals:\n  \
             - KUBERNETES_SERVICE_HOST={}\n  - KUBERNETES_SERVICE_PORT=6443\ngeneratorOptions:\n  disableNameSuffixHash: true\n\
             images:\n- name: lb-agent\n  newTag: e2e\n",
            host.trim()
        );
        std::fs::write(work.join("kustomization.yaml"), overlay)?;
        kubectl(&["apply", "-k", work.to_str().unwrap()])?;
        kubectl(&["-n", "kube-system", "rollout", "status", "ds/lb-agent", "--timeout=180s"])?;
        checks(&work)
    })();
    if !keep {
        let _ = sh("kind", &["delete", "cluster", "--name", CLUSTER]);
    }
    result
}
