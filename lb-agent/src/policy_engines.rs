//! NetworkPolicy that a CNI enforces in netfilter: Calico's iptables or
//! nftables dataplane, kube-router, Weave Net's policy controller. Their
//! rules see forwarded packets in the FORWARD hook. `--bpf-forward` sends
//! lb's outside flows (NodePort, LoadBalancer IPs, externalIPs) past that
//! hook, both ways, so such policy no longer applies to them: a silent
//! loss of policy, which the operator must hear about. With the flag on,
//! the agent looks for these engines at start and then every
//! `--kube-proxy-check-period`, warns naming each and the chains or
//! tables it found, and exports `lb_bpf_forward_policy_bypassed{engine}`
//! (1 while found). Policy enforced at the pod's device by a TC program
//! (Cilium) or in the pod still applies, and is not looked for.
//!
//! Found by name: each engine's own chain in the filter table that its
//! FORWARD rules go through, or its nftables table. A chain of another
//! name that drops (Docker's isolation, a hardened node's REJECT) is no
//! NetworkPolicy, and would make the warning fire on most nodes.

/// The engines looked for, as the metric names them.
pub const ENGINES: [&str; 3] = ["calico", "kube-router", "weave-net"];

/// Filter-table chains (name or prefix with `*`) that only these engines
/// create, in iptables mode.
const CHAINS: &[(&str, &str)] = &[
    ("calico", "cali-FORWARD"),
    ("calico", "cali-to-wl-dispatch"),
    ("kube-router", "KUBE-ROUTER-FORWARD"),
    ("kube-router", "KUBE-NWPLCY-*"),
    ("weave-net", "WEAVE-NPC"),
];

/// nftables tables (family, name) only these engines create.
const TABLES: &[(&str, &str)] = &[("calico", "calico")];

/// What was found of one engine: "filter cali-FORWARD", "table ip calico".
pub type Found = Vec<(&'static str, Vec<String>)>;

fn matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == pattern,
    }
}

fn add(found: &mut Found, engine: &'static str, what: String) {
    match found.iter_mut().find(|(e, _)| *e == engine) {
        Some((_, list)) if list.contains(&what) => {}
        Some((_, list)) => list.push(what),
        None => found.push((engine, vec![what])),
    }
}

/// The engines' chains declared in the filter table of `iptables-save`
/// output (one family, either backend). A prefix pattern is named once,
/// with how many chains matched it.
pub fn chains_in_save(save: &str, found: &mut Found) {
    let mut table = "";
    let mut counts: Vec<(&'static str, &'static str, usize)> = Vec::new();
    for line in save.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.trim();
            continue;
        }
        let Some(decl) = line.strip_prefix(':') else { continue };
        if table != "filter" {
            continue;
        }
        let name = decl.split_whitespace().next().unwrap_or_default();
        for (engine, pattern) in CHAINS {
            if !matches(pattern, name) {
                continue;
            }
            if pattern.ends_with('*') {
                match counts.iter_mut().find(|(_, p, _)| p == pattern) {
                    Some((_, _, n)) => *n += 1,
                    None => counts.push((engine, pattern, 1)),
                }
            } else {
                add(found, engine, format!("filter {name}"));
            }
        }
    }
    for (engine, pattern, n) in counts {
        add(found, engine, format!("filter {n} {pattern} chains"));
    }
}

/// The engines' tables in `nft list tables` output.
pub fn tables_in_nft(list: &str, found: &mut Found) {
    for line in list.lines() {
        let mut w = line.split_whitespace();
        if let (Some("table"), Some(family), Some(name)) = (w.next(), w.next(), w.next()) {
            for (engine, table) in TABLES {
                if name == *table {
                    add(found, engine, format!("table {family} {name}"));
                }
            }
        }
    }
}

/// Look on this node (its network namespace), in every iptables backend
/// and family and in nftables.
pub fn detect() -> Found {
    let mut found = Found::new();
    for tool in ["iptables-legacy-save", "ip6tables-legacy-save", "iptables-nft-save", "ip6tables-nft-save"] {
        if let Some(save) = crate::kube_proxy::output(tool, &[]) {
            chains_in_save(&save, &mut found);
        }
    }
    if let Some(list) = crate::kube_proxy::output("nft", &["list", "tables"]) {
        tables_in_nft(&list, &mut found);
    }
    for (_, what) in &mut found {
        what.sort();
    }
    found.sort();
    found
}

/// Look, set the metric, and say what changed since `last`: a warning for
/// the engines whose policy `--bpf-forward` bypasses, a note when they are
/// gone.
pub fn check(metric: &prometheus_client::metrics::family::Family<[(&'static str, &'static str); 1], prometheus_client::metrics::gauge::Gauge>, last: &mut Option<Found>) {
    let now = detect();
    for engine in ENGINES {
        metric.get_or_create(&[("engine", engine)]).set(now.iter().any(|(e, _)| *e == engine) as i64);
    }
    // Said again only when the engines change, not their chains (kube-router
    // has a chain per NetworkPolicy).
    let engines = |f: &Found| f.iter().map(|(e, _)| *e).collect::<Vec<_>>();
    if last.as_ref().map(engines) == Some(engines(&now)) {
        return;
    }
    if now.is_empty() {
        if last.as_ref().is_some_and(|l| !l.is_empty()) {
            tracing::info!("no NetworkPolicy engine enforcing in netfilter is left on this node: --bpf-forward bypasses none");
        }
    } else {
        let what: Vec<String> = now.iter().map(|(e, w)| format!("{e} ({})", w.join(", "))).collect();
        tracing::warn!(
            "--bpf-forward: NetworkPolicy enforced in netfilter on this node: {}. lb's outside flows (NodePort, LoadBalancer IPs, \
             externalIPs) are forwarded in BPF, past the FORWARD hook where these rules run, so that policy does not apply to them. \
             Run without --bpf-forward on such nodes, or enforce policy at the pod's device (README: Forwarding in BPF)",
            what.join("; ")
        );
    }
    *last = Some(now);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_engines_chains_are_found_in_the_filter_table_only() {
        let save = "\
*nat
:cali-FORWARD - [0:0]
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:cali-FORWARD - [0:0]
:cali-to-wl-dispatch - [0:0]
:KUBE-ROUTER-FORWARD - [0:0]
:KUBE-NWPLCY-AAAA - [0:0]
:KUBE-NWPLCY-BBBB - [0:0]
:DOCKER-ISOLATION-STAGE-1 - [0:0]
:KUBE-FORWARD - [0:0]
-A FORWARD -j cali-FORWARD
COMMIT
";
        let mut found = Found::new();
        chains_in_save(save, &mut found);
        assert_eq!(
            found,
            vec![
                ("calico", vec!["filter cali-FORWARD".to_string(), "filter cali-to-wl-dispatch".to_string()]),
                ("kube-router", vec!["filter KUBE-ROUTER-FORWARD".to_string(), "filter 2 KUBE-NWPLCY-* chains".to_string()]),
            ]
        );
        // The other family says the same: nothing is named twice.
        chains_in_save(save, &mut found);
        assert_eq!(found[0].1.len(), 2);
    }

    #[test]
    fn a_node_with_docker_kube_proxy_and_a_hardened_forward_chain_has_no_policy_engine() {
        let save = "\
*filter
:FORWARD DROP [0:0]
:DOCKER-USER - [0:0]
:DOCKER-ISOLATION-STAGE-1 - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-FIREWALL - [0:0]
:LB-FORWARD - [0:0]
:ufw-before-forward - [0:0]
-A FORWARD -j REJECT --reject-with icmp-host-prohibited
COMMIT
";
        let mut found = Found::new();
        chains_in_save(save, &mut found);
        tables_in_nft("table inet lb\ntable ip kube-proxy\ntable ip filter\n", &mut found);
        assert_eq!(found, Found::new());
    }

    #[test]
    fn calicos_nftables_dataplane_is_found_by_its_tables() {
        let mut found = Found::new();
        tables_in_nft("table inet lb\ntable ip calico\ntable ip6 calico\n", &mut found);
        assert_eq!(found, vec![("calico", vec!["table ip calico".to_string(), "table ip6 calico".to_string()])]);
        chains_in_save("*filter\n:WEAVE-NPC - [0:0]\nCOMMIT\n", &mut found);
        assert_eq!(found[1], ("weave-net", vec!["filter WEAVE-NPC".to_string()]));
    }
}
