//! The DaemonSet's pod as `podman run` commands, the way kubelet would run
//! it on one node (pure; unit-tested below), and the podman basics that go
//! with them. `cargo xtask pod-commands` prints these commands;
//! tests/tests/container.rs runs them in the netns mini-cluster.
use std::collections::BTreeMap;
use std::process::Command;

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, PodSpec, Volume};

/// What `cargo xtask image` tags (the runtime stage), and what the
/// container tests run.
pub const IMAGE: &str = "localhost/lb-agent:dev";

/// Where kubelet mounts a pod's service account token, CA and namespace.
pub const SERVICE_ACCOUNT_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// podman with the only runtime that works on hybrid-cgroup hosts (crun refuses).
pub fn podman() -> Command {
    let mut c = Command::new("podman");
    c.args(["--runtime", "runc"]);
    c
}

/// Whether podman has `image` locally.
pub fn image_exists(image: &str) -> bool {
    podman().args(["image", "exists", image]).status().is_ok_and(|s| s.success())
}

/// `--ulimit` values for every container (and RUN step): what runc can set
/// from podman's own limits. runc cannot raise a limit above its parent's
/// hard limit without CAP_SYS_RESOURCE (which root here does not have), and
/// podman's defaults (nofile 1048576, the parent's nproc) are above them:
/// podman lowers its own nproc to 32768, nofile stays this process's hard
/// limit.
pub fn host_ulimits() -> Vec<String> {
    [("nofile", libc::RLIMIT_NOFILE, 1_048_576), ("nproc", libc::RLIMIT_NPROC, 32_768)]
        .into_iter()
        .map(|(name, res, cap)| {
            let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: getrlimit writes into the struct we own.
            let hard = if unsafe { libc::getrlimit(res, &mut lim) } == 0 { lim.rlim_max.min(cap) } else { cap };
            format!("{name}={hard}:{hard}")
        })
        .collect()
}

/// What a node gives the pod, for [`pod_runs`].
#[derive(Debug, Clone)]
pub struct PodContext {
    /// `spec.nodeName` (downward API) and the hostname of a hostNetwork pod.
    pub node_name: String,
    /// The pod's name (`metadata.name`); the podman containers are
    /// `<pod_name>-<container>`.
    pub pod_name: String,
    /// Stands in for the node's network namespace: hostNetwork becomes
    /// `--network ns:/run/netns/<netns>`, never the real host network.
    pub netns: String,
    /// ConfigMaps by name (their `data`), for envFrom/configMapKeyRef.
    pub config_maps: BTreeMap<String, BTreeMap<String, String>>,
    /// hostPath substitutions: a hostPath equal to a key, or under it, is
    /// taken from the value instead (e.g. /sys/fs/bpf -> /sys/fs/bpf/<test>).
    pub host_paths: BTreeMap<String, String>,
    /// Image substitutions (e.g. lb-agent:latest -> localhost/lb-agent:dev).
    pub images: BTreeMap<String, String>,
    /// `--ulimit` values (default: [`host_ulimits`]).
    pub ulimits: Vec<String>,
    /// A directory with the service account's `token`, `ca.crt` and
    /// `namespace`: mounted read-only at [`SERVICE_ACCOUNT_PATH`] in every
    /// container, as kubelet mounts the projected token volume, unless the
    /// pod spec says `automountServiceAccountToken: false` or the container
    /// mounts something there itself. None: no token (the default).
    pub service_account: Option<String>,
}

impl PodContext {
    pub fn new(node_name: &str, pod_name: &str, netns: &str) -> Self {
        Self {
            node_name: node_name.into(),
            pod_name: pod_name.into(),
            netns: netns.into(),
            config_maps: BTreeMap::new(),
            host_paths: BTreeMap::new(),
            images: BTreeMap::new(),
            ulimits: host_ulimits(),
            service_account: None,
        }
    }

    /// Every image `ds`'s containers name becomes `to` (the manifests
    /// name `lb-agent:<version>`; the tests run a local build).
    pub fn run_images_as(&mut self, ds: &DaemonSet, to: &str) {
        let spec = ds.spec.as_ref().and_then(|s| s.template.spec.as_ref());
        for c in spec.into_iter().flat_map(|s| s.init_containers.iter().flatten().chain(&s.containers)) {
            if let Some(image) = &c.image {
                self.images.insert(image.clone(), to.into());
            }
        }
    }
}

/// One container of the pod, as a `podman` command line.
#[derive(Debug, Clone, PartialEq)]
pub struct PodmanRun {
    /// The container's name in the pod spec.
    pub container: String,
    /// The podman container's name (`<pod_name>-<container>`).
    pub name: String,
    /// Init containers run in order, each to completion (`--rm`, in the
    /// foreground), before the main containers (`--detach`).
    pub init: bool,
    /// Arguments for the `podman` binary (starting with `--runtime runc run`).
    pub args: Vec<String>,
}

/// What kubelet would do for the pod: hostPath directories to create first
/// (type DirectoryOrCreate, after substitution), then the containers.
#[derive(Debug, Clone, PartialEq)]
pub struct PodRuns {
    pub mkdirs: Vec<String>,
    pub runs: Vec<PodmanRun>,
}

/// A DaemonSet manifest (one YAML document).
pub fn daemonset_from_yaml(text: &str) -> Result<DaemonSet> {
    serde_saphyr::from_str(text).context("parse DaemonSet")
}

/// Kubelet's `$(VAR)` expansion in command, args and env values: a defined
/// variable is replaced, an undefined reference is left as written, `$$`
/// is a literal `$`.
pub fn expand(s: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
        {
            let name = &inner[..end];
            match vars.get(name) {
                Some(v) => out.push_str(v),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Valid environment variable names (kubelet skips envFrom keys that are not).
fn env_name_ok(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

fn volume_kind(v: &Volume) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|j| j.as_object().and_then(|o| o.keys().find(|k| *k != "name").cloned()))
        .unwrap_or_else(|| "unknown".into())
}

/// The hostPath after the caller's substitutions (longest matching prefix,
/// on whole path components).
fn substitute(path: &str, subs: &BTreeMap<String, String>) -> String {
    let p = path.trim_end_matches('/');
    subs.iter()
        .filter_map(|(from, to)| {
            let from = from.trim_end_matches('/');
            let tail = p.strip_prefix(from)?;
            (tail.is_empty() || tail.starts_with('/')).then(|| (from.len(), format!("{}{tail}", to.trim_end_matches('/'))))
        })
        .max_by_key(|(n, _)| *n)
        .map(|(_, s)| s)
        .unwrap_or_else(|| if p.is_empty() { "/".into() } else { p.to_string() })
}

/// The environment kubelet gives a container: envFrom first (each source in
/// order, with its prefix), then env (a later name wins; `$(VAR)` in values
/// refers to what is defined before it). In first-definition order.
fn container_env(c: &Container, ds: &DaemonSet, spec: &PodSpec, ctx: &PodContext) -> Result<Vec<(String, String)>> {
    let mut order: Vec<String> = Vec::new();
    let mut vars: BTreeMap<String, String> = BTreeMap::new();
    let mut set = |k: String, v: String, vars: &mut BTreeMap<String, String>| {
        if vars.insert(k.clone(), v).is_none() {
            order.push(k);
        }
    };
    let config_map = |name: &str, optional: Option<bool>| -> Result<Option<&BTreeMap<String, String>>> {
        match ctx.config_maps.get(name) {
            Some(m) => Ok(Some(m)),
            None if optional == Some(true) => Ok(None),
            None => bail!("container {}: ConfigMap {name} not given (and not optional)", c.name),
        }
    };
    for from in c.env_from.iter().flatten() {
        if from.secret_ref.is_some() {
            bail!("container {}: envFrom secretRef is not supported", c.name);
        }
        let Some(cm) = &from.config_map_ref else { continue };
        let prefix = from.prefix.as_deref().unwrap_or("");
        for (k, v) in config_map(&cm.name, cm.optional)?.into_iter().flatten() {
            let k = format!("{prefix}{k}");
            if env_name_ok(&k) {
                set(k, v.clone(), &mut vars);
            }
        }
    }
    for e in c.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (_, Some(from)) => {
                if let Some(f) = &from.field_ref {
                    let namespace = ds.metadata.namespace.clone().unwrap_or_else(|| "default".into());
                    match f.field_path.as_str() {
                        "spec.nodeName" => ctx.node_name.clone(),
                        "metadata.name" => ctx.pod_name.clone(),
                        "metadata.namespace" => namespace,
                        "spec.serviceAccountName" => spec.service_account_name.clone().unwrap_or_else(|| "default".into()),
                        other => bail!("container {}: env {}: fieldRef {other} is not supported", c.name, e.name),
                    }
                } else if let Some(k) = &from.config_map_key_ref {
                    match config_map(&k.name, k.optional)?.and_then(|m| m.get(&k.key)) {
                        Some(v) => v.clone(),
                        None if k.optional == Some(true) => continue,
                        None => bail!("container {}: env {}: ConfigMap {} has no key {}", c.name, e.name, k.name, k.key),
                    }
                } else {
                    bail!("container {}: env {}: only fieldRef and configMapKeyRef are supported", c.name, e.name);
                }
            }
            (Some(v), None) => expand(v, &vars),
            (None, None) => String::new(),
        };
        set(e.name.clone(), value, &mut vars);
    }
    Ok(order
        .into_iter()
        .map(|k| {
            let v = vars[&k].clone();
            (k, v)
        })
        .collect())
}

fn container_run(c: &Container, init: bool, ds: &DaemonSet, spec: &PodSpec, ctx: &PodContext, mkdirs: &mut Vec<String>) -> Result<PodmanRun> {
    let name = format!("{}-{}", ctx.pod_name, c.name);
    let mut a: Vec<String> = vec!["--runtime".into(), "runc".into(), "run".into()];
    let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
    push(&[if init { "--rm" } else { "--detach" }]);
    push(&["--name", &name]);
    push(&["--label", &format!("io.kubernetes.pod.name={}", ctx.pod_name)]);
    push(&["--label", &format!("io.kubernetes.container.name={}", c.name)]);
    for u in &ctx.ulimits {
        push(&["--ulimit", u]);
    }
    // The node's network is the caller's netns: never this machine's.
    if spec.host_network == Some(true) {
        push(&["--network", &format!("ns:/run/netns/{}", ctx.netns)]);
        push(&["--hostname", &ctx.node_name]);
    } else {
        // The pod network is not modelled: no network but loopback.
        push(&["--network", "none"]);
    }
    if spec.host_pid == Some(true) {
        push(&["--pid", "host"]);
    }
    if spec.host_ipc == Some(true) {
        push(&["--ipc", "host"]);
    }
    let sc = c.security_context.as_ref();
    let privileged = sc.and_then(|s| s.privileged) == Some(true);
    if privileged {
        push(&["--privileged"]);
    }
    if let Some(caps) = sc.and_then(|s| s.capabilities.as_ref()) {
        for cap in caps.add.iter().flatten() {
            push(&["--cap-add", cap]);
        }
        for cap in caps.drop.iter().flatten() {
            push(&["--cap-drop", cap]);
        }
    }
    if let Some(uid) = sc.and_then(|s| s.run_as_user) {
        let user = match sc.and_then(|s| s.run_as_group) {
            Some(gid) => format!("{uid}:{gid}"),
            None => uid.to_string(),
        };
        push(&["--user", &user]);
    }
    if sc.and_then(|s| s.read_only_root_filesystem) == Some(true) {
        push(&["--read-only"]);
    }
    if !init && let Some(grace) = spec.termination_grace_period_seconds {
        push(&["--stop-timeout", &grace.to_string()]);
    }
    let env = container_env(c, ds, spec, ctx)?;
    for (k, v) in &env {
        push(&["--env", &format!("{k}={v}")]);
    }
    for m in c.volume_mounts.iter().flatten() {
        let vol = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == m.name)
            .with_context(|| format!("container {}: volumeMount {} names no volume", c.name, m.name))?;
        let Some(hp) = &vol.host_path else {
            bail!("container {}: volume {} is {}: only hostPath volumes are supported", c.name, vol.name, volume_kind(vol));
        };
        let host = substitute(&hp.path, &ctx.host_paths);
        if hp.type_.as_deref() == Some("DirectoryOrCreate") && !mkdirs.contains(&host) {
            mkdirs.push(host.clone());
        }
        let host = match m.sub_path.as_deref() {
            Some(sub) if !sub.is_empty() => format!("{}/{}", host.trim_end_matches('/'), sub),
            _ => host,
        };
        let propagation = match m.mount_propagation.as_deref() {
            None | Some("None") => "rprivate",
            Some("HostToContainer") => "rslave",
            Some("Bidirectional") if privileged => "rshared",
            Some("Bidirectional") => bail!("container {}: Bidirectional mount propagation needs a privileged container", c.name),
            Some(other) => bail!("container {}: mountPropagation {other} is not known", c.name),
        };
        let ro = if m.read_only == Some(true) { "ro," } else { "" };
        push(&["--volume", &format!("{host}:{}:{ro}{propagation}", m.mount_path)]);
    }
    // The projected service account token, as kubelet mounts it: read-only,
    // in every container, unless the pod opts out or the container mounts
    // something at that path itself.
    let own_mount = c.volume_mounts.iter().flatten().any(|m| m.mount_path.trim_end_matches('/') == SERVICE_ACCOUNT_PATH);
    if let Some(sa) = &ctx.service_account
        && spec.automount_service_account_token != Some(false)
        && !own_mount
    {
        push(&["--volume", &format!("{}:{SERVICE_ACCOUNT_PATH}:ro,rprivate", sa.trim_end_matches('/'))]);
    }
    if let Some(dir) = &c.working_dir {
        push(&["--workdir", dir]);
    }
    let image = c.image.as_deref().with_context(|| format!("container {} has no image", c.name))?;
    let image = ctx.images.get(image).map(String::as_str).unwrap_or(image);
    // Kubelet's default pull policy: Always for :latest (or no tag), else IfNotPresent.
    let pull = match c.image_pull_policy.as_deref() {
        Some("Always") => "always",
        Some("Never") => "never",
        Some("IfNotPresent") => "missing",
        _ if image.ends_with(":latest") || !image.rsplit('/').next().unwrap_or(image).contains(':') => "always",
        _ => "missing",
    };
    push(&["--pull", pull]);
    // command replaces the image's ENTRYPOINT (and drops its CMD); args
    // replace CMD. `$(VAR)` refers to the container's environment.
    let vars: BTreeMap<String, String> = env.into_iter().collect();
    let command: Vec<String> = c.command.iter().flatten().map(|s| expand(s, &vars)).collect();
    let args: Vec<String> = c.args.iter().flatten().map(|s| expand(s, &vars)).collect();
    if let Some((entry, rest)) = command.split_first() {
        push(&["--entrypoint", entry]);
        push(&[image]);
        a.extend(rest.iter().cloned());
    } else {
        push(&[image]);
    }
    a.extend(args);
    Ok(PodmanRun { container: c.name.clone(), name, init, args: a })
}

/// The DaemonSet's pod as `podman` commands, the way kubelet would run it on
/// node `ctx.node_name`: init containers in order, then the containers.
/// Not modelled: probes, resources, ports (hostNetwork publishes nothing),
/// Service environment variables; the service account token only as a
/// directory the caller gives (`PodContext::service_account`).
pub fn pod_runs(ds: &DaemonSet, ctx: &PodContext) -> Result<PodRuns> {
    let spec = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("DaemonSet has no pod template spec")?;
    let mut mkdirs = Vec::new();
    let mut runs = Vec::new();
    for c in spec.init_containers.iter().flatten() {
        runs.push(container_run(c, true, ds, spec, ctx, &mut mkdirs)?);
    }
    for c in &spec.containers {
        runs.push(container_run(c, false, ds, spec, ctx, &mut mkdirs)?);
    }
    Ok(PodRuns { mkdirs, runs })
}

/// The ConfigMaps a kustomization's configMapGenerator makes from
/// `literals` (KEY=VALUE), by name.
pub fn kustomize_config_maps(text: &str) -> Result<BTreeMap<String, BTreeMap<String, String>>> {
    let k: serde_json::Value = serde_saphyr::from_str(text).context("parse kustomization")?;
    let mut maps = BTreeMap::new();
    for g in k.get("configMapGenerator").and_then(|g| g.as_array()).into_iter().flatten() {
        let name = g.get("name").and_then(|n| n.as_str()).context("configMapGenerator without a name")?;
        let data: &mut BTreeMap<String, String> = maps.entry(name.to_string()).or_default();
        for lit in g.get("literals").and_then(|l| l.as_array()).into_iter().flatten() {
            let (key, value) = lit.as_str().and_then(|l| l.split_once('=')).context("literal is not KEY=VALUE")?;
            data.insert(key.to_string(), value.to_string());
        }
    }
    Ok(maps)
}

/// `arg` for sh: as is when it is plain, else in single quotes.
pub fn shell_quote(arg: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c);
    if !arg.is_empty() && arg.chars().all(plain) {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// The shape of deploy/daemonset.yaml, pinned here so that the field
    /// tests do not move with the manifest (the_deploy_manifest_translates
    /// reads the real one).
    const DAEMONSET: &str = r#"
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: lb-agent, namespace: kube-system}
spec:
  selector: {matchLabels: {app.kubernetes.io/name: lb-agent}}
  template:
    metadata: {labels: {app.kubernetes.io/name: lb-agent}}
    spec:
      serviceAccountName: lb-agent
      hostNetwork: true
      hostPID: true
      terminationGracePeriodSeconds: 30
      initContainers:
      - name: mount-bpffs
        image: lb-agent:latest
        imagePullPolicy: IfNotPresent
        command: ["sh", "-c", "mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf"]
        securityContext: {privileged: true}
        volumeMounts:
        - {name: bpffs, mountPath: /sys/fs/bpf, mountPropagation: Bidirectional}
      containers:
      - name: lb-agent
        image: lb-agent:latest
        imagePullPolicy: IfNotPresent
        args: [run, --source=kube, --bpffs=/sys/fs/bpf/lb, --cgroup=/run/lb/cgroupv2]
        env:
        - name: NODE_NAME
          valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
        - {name: RUST_LOG, value: info}
        envFrom:
        - configMapRef: {name: lb-agent-config}
        securityContext: {privileged: true}
        ports:
        - {name: healthz, containerPort: 10256}
        readinessProbe:
          httpGet: {path: /readyz, port: 10256}
        volumeMounts:
        - {name: bpffs, mountPath: /sys/fs/bpf, mountPropagation: Bidirectional}
        - {name: cgroup, mountPath: /run/lb/cgroupv2, mountPropagation: HostToContainer}
      volumes:
      - name: bpffs
        hostPath: {path: /sys/fs/bpf, type: DirectoryOrCreate}
      - name: cgroup
        hostPath: {path: /sys/fs/cgroup, type: Directory}
"#;

    fn daemonset() -> DaemonSet {
        daemonset_from_yaml(DAEMONSET).unwrap()
    }

    fn root() -> &'static Path {
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
    }

    /// deploy/daemonset.yaml itself: whatever it says, its pod becomes one
    /// run per container, on the given netns, with the node's name, the
    /// substituted hostPaths and the spec's hostPID.
    #[test]
    fn the_deploy_manifest_translates() {
        let ds = daemonset_from_yaml(&std::fs::read_to_string(root().join("deploy/daemonset.yaml")).unwrap()).unwrap();
        let mut c = ctx();
        c.run_images_as(&ds, IMAGE);
        c.config_maps = kustomize_config_maps(&std::fs::read_to_string(root().join("deploy/kustomization.yaml")).unwrap()).unwrap();
        let pod = pod_runs(&ds, &c).unwrap();
        let spec = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        let names: Vec<&str> = spec.init_containers.iter().flatten().chain(&spec.containers).map(|c| c.name.as_str()).collect();
        assert_eq!(pod.runs.iter().map(|r| r.container.as_str()).collect::<Vec<_>>(), names);
        let host_pid = spec.host_pid == Some(true);
        for r in &pod.runs {
            let a = &r.args;
            assert_eq!(values(a, "--network"), ["ns:/run/netns/lbt-node-a"], "{a:?}");
            assert_eq!(!values(a, "--pid").is_empty(), host_pid);
            assert!(a.contains(&IMAGE.to_string()));
            for v in values(a, "--volume") {
                assert!(!v.starts_with("/sys/fs/bpf:") && !v.starts_with("/sys/fs/cgroup:"), "not substituted: {v}");
            }
        }
        let agent = &pod.runs.iter().find(|r| r.container == "lb-agent").unwrap().args;
        assert!(values(agent, "--env").contains(&"NODE_NAME=node-a"));
        assert!(values(agent, "--env").contains(&"KUBERNETES_SERVICE_PORT=6443"));
        assert_eq!(after_image(agent, IMAGE)[0], "run");
    }

    fn ctx() -> PodContext {
        let mut ctx = PodContext::new("node-a", "lb-agent-t1", "lbt-node-a");
        ctx.config_maps.insert(
            "lb-agent-config".into(),
            [("KUBERNETES_SERVICE_HOST", "10.0.0.1"), ("KUBERNETES_SERVICE_PORT", "6443")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        ctx.host_paths.insert("/sys/fs/bpf".into(), "/sys/fs/bpf/t1".into());
        ctx.host_paths.insert("/sys/fs/cgroup".into(), "/sys/fs/cgroup/unified/t1".into());
        ctx.images.insert("lb-agent:latest".into(), IMAGE.into());
        ctx
    }

    /// The values of every `flag VALUE` pair.
    fn values<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
        args.windows(2).filter(|w| w[0] == flag).map(|w| w[1].as_str()).collect()
    }

    /// What follows the image: the container's command line after the entrypoint.
    fn after_image<'a>(args: &'a [String], image: &str) -> &'a [String] {
        let i = args.iter().position(|a| a == image).expect("image in args");
        &args[i + 1..]
    }

    #[test]
    fn the_daemonset_becomes_one_init_run_and_one_main_run() {
        let pod = pod_runs(&daemonset(), &ctx()).unwrap();
        assert_eq!(pod.runs.len(), 2);
        assert_eq!((pod.runs[0].container.as_str(), pod.runs[0].init), ("mount-bpffs", true));
        assert_eq!((pod.runs[1].container.as_str(), pod.runs[1].init), ("lb-agent", false));
        // Both hostPaths are DirectoryOrCreate / Directory: only bpffs is created.
        assert_eq!(pod.mkdirs, ["/sys/fs/bpf/t1"]);
        for r in &pod.runs {
            let a = &r.args;
            assert_eq!(a[..3], ["--runtime", "runc", "run"]);
            assert_eq!(values(a, "--ulimit"), host_ulimits());
            // hostNetwork: the given netns, never `--network host`.
            assert_eq!(values(a, "--network"), ["ns:/run/netns/lbt-node-a"]);
            assert_eq!(values(a, "--hostname"), ["node-a"]);
            assert!(a.contains(&"--privileged".to_string()));
            assert_eq!(values(a, "--pid"), ["host"]);
            assert_eq!(values(a, "--pull"), ["missing"]);
            assert_eq!(values(a, "--name"), [format!("lb-agent-t1-{}", r.container)]);
            assert_eq!(r.name, format!("lb-agent-t1-{}", r.container));
        }
    }

    #[test]
    fn the_init_container_runs_its_command_in_the_foreground() {
        let pod = pod_runs(&daemonset(), &ctx()).unwrap();
        let a = &pod.runs[0].args;
        assert!(a.contains(&"--rm".to_string()) && !a.contains(&"--detach".to_string()));
        assert_eq!(values(a, "--entrypoint"), ["sh"]);
        assert_eq!(after_image(a, IMAGE), ["-c", "mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf"]);
        assert_eq!(values(a, "--volume"), ["/sys/fs/bpf/t1:/sys/fs/bpf:rshared"]);
        assert!(values(a, "--env").is_empty());
        assert!(values(a, "--stop-timeout").is_empty());
    }

    #[test]
    fn the_agent_gets_args_env_and_both_mounts() {
        let pod = pod_runs(&daemonset(), &ctx()).unwrap();
        let a = &pod.runs[1].args;
        assert!(a.contains(&"--detach".to_string()) && !a.contains(&"--rm".to_string()));
        // args only: the image's ENTRYPOINT (lb-agent) stays.
        assert!(values(a, "--entrypoint").is_empty());
        assert_eq!(
            after_image(a, IMAGE),
            [
                "run",
                "--source=kube",
                "--bpffs=/sys/fs/bpf/lb",
                "--cgroup=/run/lb/cgroupv2",
            ]
        );
        // envFrom first, then env; the downward API names the node.
        assert_eq!(
            values(a, "--env"),
            ["KUBERNETES_SERVICE_HOST=10.0.0.1", "KUBERNETES_SERVICE_PORT=6443", "NODE_NAME=node-a", "RUST_LOG=info"]
        );
        assert_eq!(
            values(a, "--volume"),
            ["/sys/fs/bpf/t1:/sys/fs/bpf:rshared", "/sys/fs/cgroup/unified/t1:/run/lb/cgroupv2:rslave"]
        );
        assert_eq!(values(a, "--stop-timeout"), ["30"]);
        // Volumes come before the image; the image is the substituted one.
        let img = a.iter().position(|x| x == IMAGE).unwrap();
        assert!(a.iter().rposition(|x| x == "--volume").unwrap() < img);
    }

    #[test]
    fn the_service_account_directory_is_mounted_read_only_where_kubelet_puts_the_token() {
        let mut c = ctx();
        c.service_account = Some("/tmp/t1/serviceaccount/".into());
        let pod = pod_runs(&daemonset(), &c).unwrap();
        let sa = format!("/tmp/t1/serviceaccount:{SERVICE_ACCOUNT_PATH}:ro,rprivate");
        // In every container (kubelet mounts it in init containers too), after the spec's own mounts.
        assert_eq!(values(&pod.runs[0].args, "--volume"), ["/sys/fs/bpf/t1:/sys/fs/bpf:rshared", sa.as_str()]);
        assert_eq!(
            values(&pod.runs[1].args, "--volume"),
            ["/sys/fs/bpf/t1:/sys/fs/bpf:rshared", "/sys/fs/cgroup/unified/t1:/run/lb/cgroupv2:rslave", sa.as_str()]
        );
        // Not when the pod opts out.
        let off = DAEMONSET.replace("      hostNetwork: true\n", "      hostNetwork: true\n      automountServiceAccountToken: false\n");
        let pod = pod_runs(&daemonset_from_yaml(&off).unwrap(), &c).unwrap();
        assert!(pod.runs.iter().all(|r| !values(&r.args, "--volume").iter().any(|v| v.contains(SERVICE_ACCOUNT_PATH))));
        // Not over a container's own mount at that path.
        let own = DAEMONSET.replace(
            "        - {name: cgroup, mountPath: /run/lb/cgroupv2, mountPropagation: HostToContainer}\n",
            "        - {name: cgroup, mountPath: /run/lb/cgroupv2, mountPropagation: HostToContainer}\n        - {name: cgroup, mountPath: /var/run/secrets/kubernetes.io/serviceaccount}\n",
        );
        let pod = pod_runs(&daemonset_from_yaml(&own).unwrap(), &c).unwrap();
        let vols = values(&pod.runs[1].args, "--volume");
        assert_eq!(vols.iter().filter(|v| v.contains(SERVICE_ACCOUNT_PATH)).count(), 1, "{vols:?}");
        assert!(!vols.contains(&sa.as_str()), "{vols:?}");
        // None given: no token, as before.
        let pod = pod_runs(&daemonset(), &ctx()).unwrap();
        assert!(pod.runs.iter().all(|r| !r.args.iter().any(|a| a.contains(SERVICE_ACCOUNT_PATH))));
    }

    #[test]
    fn without_substitutions_the_spec_paths_and_image_are_used() {
        let mut c = ctx();
        c.host_paths.clear();
        c.images.clear();
        let pod = pod_runs(&daemonset(), &c).unwrap();
        let a = &pod.runs[1].args;
        assert_eq!(values(a, "--volume"), ["/sys/fs/bpf:/sys/fs/bpf:rshared", "/sys/fs/cgroup:/run/lb/cgroupv2:rslave"]);
        assert!(a.contains(&"lb-agent:latest".to_string()));
        assert_eq!(pod.mkdirs, ["/sys/fs/bpf"]);
    }

    #[test]
    fn a_missing_config_map_is_an_error_as_in_kubelet() {
        let mut c = ctx();
        c.config_maps.clear();
        let e = pod_runs(&daemonset(), &c).unwrap_err().to_string();
        assert!(e.contains("ConfigMap lb-agent-config"), "{e}");
    }

    const POD: &str = r#"
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: x, namespace: ns1}
spec:
  selector: {matchLabels: {a: b}}
  template:
    spec:
      hostPID: true
      hostIPC: true
      serviceAccountName: sa
      containers:
      - name: c
        image: reg/img:1.0
        command: ["/bin/x", "--node=$(NODE)"]
        args: ["$(A)-$(UNSET)", "$$(A)", "cost $5"]
        workingDir: /w
        envFrom:
        - prefix: P_
          configMapRef: {name: cm}
        - configMapRef: {name: nope, optional: true}
        env:
        - {name: NODE, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
        - {name: POD, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
        - {name: NS, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
        - {name: SA, valueFrom: {fieldRef: {fieldPath: spec.serviceAccountName}}}
        - {name: K, valueFrom: {configMapKeyRef: {name: cm, key: k}}}
        - {name: A, value: "a$(NODE)"}
        - {name: P_k, value: overridden}
        - {name: EMPTY}
        securityContext:
          capabilities: {add: [BPF, NET_ADMIN], drop: [ALL]}
          runAsUser: 1000
          runAsGroup: 2000
          readOnlyRootFilesystem: true
        volumeMounts:
        - {name: h, mountPath: /h, readOnly: true, subPath: sub}
        - {name: h, mountPath: /h2}
      volumes:
      - name: h
        hostPath: {path: /var/lib/x/, type: Directory}
"#;

    #[test]
    fn each_field_becomes_its_podman_flag() {
        let ds = daemonset_from_yaml(POD).unwrap();
        let mut c = PodContext::new("n1", "x-n1", "nsx");
        c.config_maps.insert("cm".into(), [("k".to_string(), "v".to_string()), ("bad key".to_string(), "z".to_string())].into());
        c.host_paths.insert("/var/lib".into(), "/tmp/t/lib".into());
        let pod = pod_runs(&ds, &c).unwrap();
        assert!(pod.mkdirs.is_empty());
        let a = &pod.runs[0].args;
        // No hostNetwork: no network but loopback (the pod network is not modelled).
        assert_eq!(values(a, "--network"), ["none"]);
        assert!(values(a, "--hostname").is_empty());
        assert_eq!(values(a, "--pid"), ["host"]);
        assert_eq!(values(a, "--ipc"), ["host"]);
        assert!(!a.contains(&"--privileged".to_string()));
        assert_eq!(values(a, "--cap-add"), ["BPF", "NET_ADMIN"]);
        assert_eq!(values(a, "--cap-drop"), ["ALL"]);
        assert_eq!(values(a, "--user"), ["1000:2000"]);
        assert!(a.contains(&"--read-only".to_string()));
        assert_eq!(values(a, "--workdir"), ["/w"]);
        assert_eq!(values(a, "--pull"), ["missing"]);
        assert_eq!(
            values(a, "--env"),
            ["P_k=overridden", "NODE=n1", "POD=x-n1", "NS=ns1", "SA=sa", "K=v", "A=an1", "EMPTY="]
        );
        assert_eq!(values(a, "--volume"), ["/tmp/t/lib/x/sub:/h:ro,rprivate", "/tmp/t/lib/x:/h2:rprivate"]);
        assert_eq!(values(a, "--entrypoint"), ["/bin/x"]);
        assert_eq!(after_image(a, "reg/img:1.0"), ["--node=n1", "an1-$(UNSET)", "$(A)", "cost $5"]);
    }

    #[test]
    fn kubelet_rules_are_kept() {
        let c = {
            let mut c = PodContext::new("n1", "x-n1", "nsx");
            c.config_maps.insert("cm".into(), [("k".to_string(), "v".to_string())].into());
            c
        };
        // Bidirectional propagation only for privileged containers.
        let bidi = POD.replace("mountPath: /h2}", "mountPath: /h2, mountPropagation: Bidirectional}");
        let e = pod_runs(&daemonset_from_yaml(&bidi).unwrap(), &c).unwrap_err().to_string();
        assert!(e.contains("privileged"), "{e}");
        let ok = bidi.replace("readOnlyRootFilesystem: true", "privileged: true");
        let a = &pod_runs(&daemonset_from_yaml(&ok).unwrap(), &c).unwrap().runs[0].args;
        assert_eq!(values(a, "--volume")[1], "/var/lib/x:/h2:rshared");
        // Unsupported sources are errors, not silently dropped.
        let secret = POD.replace("- configMapRef: {name: nope, optional: true}", "- secretRef: {name: s}");
        assert!(pod_runs(&daemonset_from_yaml(&secret).unwrap(), &c).is_err());
        let empty = POD.replace("hostPath: {path: /var/lib/x/, type: Directory}", "emptyDir: {}");
        let e = pod_runs(&daemonset_from_yaml(&empty).unwrap(), &c).unwrap_err().to_string();
        assert!(e.contains("emptyDir"), "{e}");
        let field = POD.replace("fieldPath: metadata.name", "fieldPath: status.podIP");
        assert!(pod_runs(&daemonset_from_yaml(&field).unwrap(), &c).is_err());
        // :latest (or no tag) without a policy is pulled always, as kubelet does.
        let latest = POD.replace("image: reg/img:1.0", "image: reg:5000/img");
        let a = &pod_runs(&daemonset_from_yaml(&latest).unwrap(), &c).unwrap().runs[0].args;
        assert_eq!(values(a, "--pull"), ["always"]);
    }

    #[test]
    fn kustomize_literals_become_config_maps_and_args_are_quoted() {
        let maps = kustomize_config_maps(&std::fs::read_to_string(root().join("deploy/kustomization.yaml")).unwrap()).unwrap();
        let cm = &maps["lb-agent-config"];
        assert_eq!(cm["KUBERNETES_SERVICE_PORT"], "6443");
        assert!(cm.contains_key("KUBERNETES_SERVICE_HOST"));
        assert!(kustomize_config_maps("configMapGenerator:\n- name: a\n  literals: [novalue]\n").is_err());
        assert_eq!(shell_quote("--volume=/a:/b:rshared"), "--volume=/a:/b:rshared");
        assert_eq!(shell_quote("mountpoint -q /x || mount"), "'mountpoint -q /x || mount'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn expansion_is_kubelets() {
        let vars: BTreeMap<String, String> = [("A".to_string(), "1".to_string())].into();
        assert_eq!(expand("$(A)", &vars), "1");
        assert_eq!(expand("x$(A)y$(B)z", &vars), "x1y$(B)z");
        assert_eq!(expand("$$(A) $$ $", &vars), "$(A) $ $");
        assert_eq!(expand("$(A", &vars), "$(A");
        assert_eq!(expand("exec lbprobe serve --name $(hostname)", &vars), "exec lbprobe serve --name $(hostname)");
    }

    #[test]
    fn host_path_substitution_takes_the_longest_whole_component_prefix() {
        let subs: BTreeMap<String, String> =
            [("/sys/fs/bpf", "/sys/fs/bpf/t"), ("/sys/fs", "/x"), ("/a/", "/b/")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        assert_eq!(substitute("/sys/fs/bpf", &subs), "/sys/fs/bpf/t");
        assert_eq!(substitute("/sys/fs/bpf/lb", &subs), "/sys/fs/bpf/t/lb");
        assert_eq!(substitute("/sys/fs/cgroup", &subs), "/x/cgroup");
        assert_eq!(substitute("/sys/fs/bpfx", &subs), "/x/bpfx");
        assert_eq!(substitute("/a", &subs), "/b");
        assert_eq!(substitute("/ab", &subs), "/ab");
        assert_eq!(substitute("/", &subs), "/");
    }
}
