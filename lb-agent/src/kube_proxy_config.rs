//! kube-proxy's configuration file (`KubeProxyConfiguration`,
//! `kubeproxy.config.k8s.io/v1alpha1`, the `config.conf` of kubeadm's
//! `kube-proxy` ConfigMap) read by `lb-agent run --kube-proxy-config FILE`,
//! so that a node moving from kube-proxy keeps its settings: each field lb
//! has a flag for becomes that flag, placed before the command line's own
//! flags (a flag given on the command line wins over the file's). Fields
//! lb needs no setting for (its programs replace every proxy mode) are
//! accepted and named in the log when set; a field kube-proxy does not have
//! is an error naming it, as kube-proxy's strict decoding makes it.
use std::ffi::OsString;
use std::path::Path;

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;
use serde::de::IgnoredAny;

/// The flag that names the file.
pub const FLAG: &str = "--kube-proxy-config";

// Some fields are kube-proxy's that lb accepts and never reads.
#[allow(dead_code)]
#[derive(Deserialize, Default, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Config {
    api_version: Option<String>,
    kind: Option<String>,
    client_connection: Option<ClientConnection>,
    hostname_override: Option<String>,
    healthz_bind_address: Option<String>,
    metrics_bind_address: Option<String>,
    mode: Option<String>,
    iptables: Option<Rules>,
    nftables: Option<Rules>,
    ipvs: Option<Ipvs>,
    node_port_addresses: Option<Vec<String>>,
    conntrack: Option<Conntrack>,
    // What lb needs no setting for.
    feature_gates: Option<std::collections::BTreeMap<String, bool>>,
    logging: Option<IgnoredAny>,
    bind_address: Option<IgnoredAny>,
    bind_address_hard_fail: Option<IgnoredAny>,
    enable_profiling: Option<IgnoredAny>,
    show_hidden_metrics_for_version: Option<IgnoredAny>,
    winkernel: Option<IgnoredAny>,
    #[serde(rename = "detectLocalMode")]
    detect_local_mode: Option<String>,
    detect_local: Option<IgnoredAny>,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Option<String>,
    oom_score_adj: Option<IgnoredAny>,
    config_sync_period: Option<IgnoredAny>,
    port_range: Option<IgnoredAny>,
    windows_run_as_service: Option<IgnoredAny>,
}

// Some fields are kube-proxy's that lb accepts and never reads.
#[allow(dead_code)]
#[derive(Deserialize, Default, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ClientConnection {
    kubeconfig: Option<String>,
    accept_content_types: Option<IgnoredAny>,
    content_type: Option<IgnoredAny>,
    qps: Option<IgnoredAny>,
    burst: Option<IgnoredAny>,
}

/// `iptables` and `nftables`.
// Some fields are kube-proxy's that lb accepts and never reads.
#[allow(dead_code)]
#[derive(Deserialize, Default, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Rules {
    masquerade_all: Option<bool>,
    masquerade_bit: Option<IgnoredAny>,
    localhost_node_ports: Option<bool>,
    sync_period: Option<String>,
    min_sync_period: Option<IgnoredAny>,
}

// Some fields are kube-proxy's that lb accepts and never reads.
#[allow(dead_code)]
#[derive(Deserialize, Default, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Ipvs {
    sync_period: Option<String>,
    min_sync_period: Option<IgnoredAny>,
    scheduler: Option<IgnoredAny>,
    #[serde(rename = "excludeCIDRs")]
    exclude_cidrs: Option<IgnoredAny>,
    #[serde(rename = "strictARP")]
    strict_arp: Option<IgnoredAny>,
    tcp_timeout: Option<IgnoredAny>,
    tcp_fin_timeout: Option<IgnoredAny>,
    udp_timeout: Option<IgnoredAny>,
}

// Some fields are kube-proxy's that lb accepts and never reads.
#[allow(dead_code)]
#[derive(Deserialize, Default, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Conntrack {
    max_per_core: Option<u64>,
    min: Option<u64>,
    tcp_established_timeout: Option<String>,
    tcp_close_wait_timeout: Option<String>,
    tcp_be_liberal: Option<bool>,
    udp_timeout: Option<String>,
    udp_stream_timeout: Option<String>,
}

/// What a file asks for: lb's flags (a flag alone where its value is
/// `None`), and what lb leaves as it is, to be logged.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Settings {
    pub flags: Vec<(&'static str, Option<String>)>,
    pub notes: Vec<String>,
}

/// A Go duration ("24h0m0s", "30s", "1m30s") as lb's duration flags take
/// it, or an error naming the field.
fn duration(field: &str, v: &str) -> Result<String> {
    humantime::parse_duration(v).with_context(|| format!("{field}: {v:?} is not a duration lb reads (\"24h0m0s\", \"90s\")"))?;
    Ok(v.to_string())
}

/// The settings of a `KubeProxyConfiguration` document.
pub fn parse(text: &str) -> Result<Settings> {
    let c: Config = serde_saphyr::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
    match (c.api_version.as_deref(), c.kind.as_deref()) {
        (Some("kubeproxy.config.k8s.io/v1alpha1"), Some("KubeProxyConfiguration")) => {}
        (v, k) => bail!(
            "not a KubeProxyConfiguration of kubeproxy.config.k8s.io/v1alpha1 (apiVersion {:?}, kind {:?})",
            v.unwrap_or(""),
            k.unwrap_or("")
        ),
    }
    let mut s = Settings::default();
    let mut flag = |f: &'static str, v: String| s.flags.push((f, Some(v)));
    let set = |v: &Option<String>| v.as_deref().map(str::trim).filter(|v| !v.is_empty()).map(String::from);
    if let Some(k) = c.client_connection.as_ref().and_then(|cc| set(&cc.kubeconfig)) {
        flag("--kubeconfig", k);
    }
    if let Some(h) = set(&c.hostname_override) {
        // kube-proxy's GetHostname: lowercased (lb-agent does it too).
        flag("--node-name", h);
    }
    if let Some(a) = set(&c.healthz_bind_address) {
        flag("--healthz-bind", a);
    }
    if let Some(a) = set(&c.metrics_bind_address) {
        flag("--metrics-bind", a);
    }
    if let Some(a) = c.node_port_addresses.as_ref().filter(|a| !a.is_empty()) {
        flag("--nodeport-addresses", a.join(","));
    }
    // The mode's own section: its sync period is lb's resync period.
    let mode = c.mode.as_deref().unwrap_or("");
    let (section, rules) = match mode {
        "" | "iptables" => ("iptables", c.iptables.as_ref()),
        "nftables" => ("nftables", c.nftables.as_ref()),
        "ipvs" | "kernelspace" => (if mode == "ipvs" { "ipvs" } else { "winkernel" }, None),
        other => bail!("mode: {other:?} is no kube-proxy mode (iptables, ipvs, nftables, kernelspace)"),
    };
    if !mode.is_empty() {
        s.notes.push(format!("mode {mode}: lb's programs replace it"));
    }
    let sync = if mode == "ipvs" { c.ipvs.as_ref().and_then(|i| set(&i.sync_period)) } else { rules.and_then(|r| set(&r.sync_period)) };
    if let Some(p) = sync {
        let v = duration(&format!("{section}.syncPeriod"), &p)?;
        // 0 is kube-proxy's default (30 s), not "never".
        if !humantime::parse_duration(&v)?.is_zero() {
            s.flags.push(("--resync-period", Some(v)));
        }
    }
    if let Some(r) = rules {
        if let Some(l) = r.localhost_node_ports.filter(|_| section == "iptables") {
            s.flags.push(("--localhost-nodeports", Some(l.to_string())));
        }
        if r.masquerade_all == Some(true) {
            s.notes.push(format!(
                "{section}.masqueradeAll is not supported: lb masquerades as kube-proxy does without it (outside traffic; pods keep their addresses towards ClusterIPs)"
            ));
        }
    }
    if let Some(ct) = &c.conntrack {
        if let Some(v) = ct.max_per_core {
            s.flags.push(("--conntrack-max-per-core", Some(v.to_string())));
        }
        if let Some(v) = ct.min {
            s.flags.push(("--conntrack-min", Some(v.to_string())));
        }
        for (field, v, f) in [
            ("conntrack.tcpEstablishedTimeout", &ct.tcp_established_timeout, "--conntrack-tcp-timeout-established"),
            ("conntrack.tcpCloseWaitTimeout", &ct.tcp_close_wait_timeout, "--conntrack-tcp-timeout-close-wait"),
            ("conntrack.udpTimeout", &ct.udp_timeout, "--conntrack-udp-timeout"),
            ("conntrack.udpStreamTimeout", &ct.udp_stream_timeout, "--conntrack-udp-timeout-stream"),
        ] {
            if let Some(v) = set(v) {
                s.flags.push((f, Some(duration(field, &v)?)));
            }
        }
        if ct.tcp_be_liberal == Some(true) {
            s.flags.push(("--conntrack-tcp-be-liberal", None));
        }
    }
    if let Some(cidr) = set(&c.cluster_cidr) {
        s.notes.push(format!("clusterCIDR {cidr} is not used: lb tells pods' traffic by its socket, not its source address"));
    }
    if let Some(m) = set(&c.detect_local_mode) {
        s.notes.push(format!("detectLocalMode {m} is not used (README: what does not work yet)"));
    }
    if let Some(g) = c.feature_gates.as_ref().filter(|g| !g.is_empty()) {
        s.notes.push(format!("featureGates {g:?} are kube-proxy's own"));
    }
    Ok(s)
}

/// The command line with the file's flags put in: `args` as given, and when
/// they run `run` with `--kube-proxy-config FILE`, the flags of FILE right
/// after `run`, but none the command line gives itself (it wins). The
/// notes are logged.
pub fn expand(args: Vec<OsString>) -> Result<Vec<OsString>> {
    if args.get(1).and_then(|a| a.to_str()) != Some("run") {
        return Ok(args);
    }
    let given: Vec<String> = args[2..].iter().map(|a| a.to_string_lossy().into_owned()).collect();
    let mut path = None;
    for (i, a) in given.iter().enumerate() {
        if let Some(p) = a.strip_prefix(&format!("{FLAG}=")) {
            path = Some(p.to_string());
        } else if a == FLAG {
            path = Some(given.get(i + 1).with_context(|| format!("{FLAG} needs a file"))?.clone());
        }
    }
    let Some(path) = path else { return Ok(args) };
    let text = std::fs::read_to_string(Path::new(&path)).with_context(|| format!("{FLAG} {path}"))?;
    let settings = parse(&text).with_context(|| format!("{FLAG} {path}"))?;
    let on_command_line = |f: &str| given.iter().any(|a| a == f || a.starts_with(&format!("{f}=")));
    let mut from_file: Vec<OsString> = Vec::new();
    for (f, v) in &settings.flags {
        if on_command_line(f) {
            tracing::info!(flag = f, file = %path, "the command line's flag wins over kube-proxy's configuration");
            continue;
        }
        from_file.push(match v {
            Some(v) => format!("{f}={v}").into(),
            None => (*f).into(),
        });
    }
    let names: Vec<String> = from_file.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    tracing::info!(file = %path, flags = ?names, "kube-proxy's configuration");
    for n in &settings.notes {
        tracing::info!(file = %path, "kube-proxy's configuration: {n}");
    }
    let mut out = args[..2].to_vec();
    out.extend(from_file);
    out.extend(args[2..].iter().cloned());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kubeadm's kube-proxy ConfigMap (`config.conf`), as `kubeadm init`
    /// writes it, with a few settings changed.
    const KUBEADM: &str = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: 12h0m0s
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: false
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 1s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: 0.0.0.0:10249
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: [192.168.0.0/16, primary]
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

    fn flags(s: &Settings) -> Vec<String> {
        s.flags.iter().map(|(f, v)| v.as_ref().map_or(f.to_string(), |v| format!("{f}={v}"))).collect()
    }

    #[test]
    fn kubeadms_configuration_becomes_lbs_flags() {
        let s = parse(KUBEADM).unwrap();
        assert_eq!(
            flags(&s),
            [
                "--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf",
                "--metrics-bind=0.0.0.0:10249",
                "--nodeport-addresses=192.168.0.0/16,primary",
                "--localhost-nodeports=false",
                "--conntrack-tcp-timeout-established=12h0m0s",
                "--conntrack-udp-timeout=0s",
                "--conntrack-udp-timeout-stream=0s",
            ]
        );
        assert!(s.notes.iter().any(|n| n.contains("clusterCIDR")), "{:?}", s.notes);
        // Another mode's section gives the sync period; masqueradeAll is named.
        let nft = KUBEADM.replace("mode: \"\"", "mode: nftables").replace("  masqueradeAll: false\n  masqueradeBit: null\n  minSyncPeriod: 0s\n  syncPeriod: 0s", "  masqueradeAll: true\n  syncPeriod: 30s");
        let s = parse(&nft).unwrap();
        assert!(flags(&s).contains(&"--resync-period=30s".to_string()) && !flags(&s).iter().any(|f| f.contains("localhost")), "{:?}", flags(&s));
        assert!(s.notes.iter().any(|n| n.contains("nftables.masqueradeAll is not supported")), "{:?}", s.notes);
        assert!(s.notes.iter().any(|n| n.contains("mode nftables")), "{:?}", s.notes);
        let liberal = KUBEADM.replace("tcpBeLiberal: false", "tcpBeLiberal: true").replace("maxPerCore: null", "maxPerCore: 0");
        let f = flags(&parse(&liberal).unwrap());
        assert!(f.contains(&"--conntrack-tcp-be-liberal".to_string()) && f.contains(&"--conntrack-max-per-core=0".to_string()), "{f:?}");
    }

    #[test]
    fn bad_files_are_errors_naming_what_is_wrong() {
        let e = parse(&KUBEADM.replace("oomScoreAdj: null", "oomScoreAdjust: -999")).unwrap_err().to_string();
        assert!(e.contains("oomScoreAdjust"), "{e}");
        let e = parse(&KUBEADM.replace("tcpFinTimeout", "tcpFinTimeOut")).unwrap_err().to_string();
        assert!(e.contains("tcpFinTimeOut"), "{e}");
        let e = parse(&KUBEADM.replace("kind: KubeProxyConfiguration", "kind: KubeletConfiguration")).unwrap_err().to_string();
        assert!(e.contains("KubeletConfiguration"), "{e}");
        let e = parse(&KUBEADM.replace("mode: \"\"", "mode: userspace")).unwrap_err().to_string();
        assert!(e.contains("\"userspace\""), "{e}");
        let e = parse(&KUBEADM.replace("tcpEstablishedTimeout: 12h0m0s", "tcpEstablishedTimeout: soon")).unwrap_err().to_string();
        assert!(e.contains("conntrack.tcpEstablishedTimeout") && e.contains("soon"), "{e}");
    }

    #[test]
    fn the_command_line_wins_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.conf");
        std::fs::write(&path, KUBEADM).unwrap();
        let args = |v: &[&str]| -> Vec<OsString> { v.iter().map(OsString::from).collect() };
        let p = path.to_str().unwrap();
        let out = expand(args(&["lb-agent", "run", "--kube-proxy-config", p, "--metrics-bind", "127.0.0.1:10249", "--nodeport-addresses=10.0.0.0/8"])).unwrap();
        let out: Vec<String> = out.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(&out[..2], ["lb-agent", "run"]);
        assert!(out.contains(&"--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf".to_string()), "{out:?}");
        assert!(!out.iter().any(|a| a.starts_with("--metrics-bind=") || a.contains("192.168.0.0/16")), "the command line's win: {out:?}");
        assert_eq!(out.iter().filter(|a| a.starts_with("--nodeport-addresses")).count(), 1, "{out:?}");
        // Other subcommands, or run without the flag: untouched.
        let plain = args(&["lb-agent", "list", "--kube-proxy-config", p]);
        assert_eq!(expand(plain.clone()).unwrap(), plain);
        let e = expand(args(&["lb-agent", "run", "--kube-proxy-config=/nonexistent"])).unwrap_err();
        assert!(format!("{e:#}").contains("--kube-proxy-config /nonexistent"), "{e:#}");
    }
}
