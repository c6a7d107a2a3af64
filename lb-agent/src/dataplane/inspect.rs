//! `lb-agent list`: what the pinned maps hold, like `ipvsadm -Ln`.
use std::fmt::Write as _;
use std::net::Ipv4Addr;

use lb_common::{PROTO_TCP, PROTO_UDP, SCOPE_ALL, SCOPE_LOCAL, Svc4Key, backend_flags, svc_flags};
use serde::Serialize;

use super::writer::Table;

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct BackendView {
    pub id: u32,
    pub address: String,
    pub port: u16,
    pub local: bool,
    pub terminating: bool,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct FrontendView {
    pub address: String,
    pub port: u16,
    pub protocol: &'static str,
    pub rev_nat_id: u16,
    pub local_only: bool,
    pub affinity_timeout: Option<u32>,
    pub backends: Vec<BackendView>,
    /// Only for internalTrafficPolicy Local: the node-local backends used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_backends: Option<Vec<BackendView>>,
}

#[derive(Debug, Serialize)]
pub struct ListView {
    pub frontends: Vec<FrontendView>,
    /// Addresses known as ClusterIPs: other ports on them are refused.
    pub vips: Vec<String>,
    pub stats: std::collections::BTreeMap<&'static str, u64>,
}

fn proto_name(p: u8) -> &'static str {
    match p {
        PROTO_TCP => "TCP",
        PROTO_UDP => "UDP",
        _ => "?",
    }
}

fn backends(t: &Table, k: &Svc4Key, scope: u8, count: u16) -> Vec<BackendView> {
    (1..=count)
        .filter_map(|slot| {
            let s = t.services.get(&Svc4Key::new(k.addr, k.port, k.proto, scope, slot))?;
            let b = t.backends.get(&s.backend_id)?;
            Some(BackendView {
                id: s.backend_id,
                address: Ipv4Addr::from(b.addr).to_string(),
                port: b.port,
                local: b.flags & backend_flags::LOCAL != 0,
                terminating: b.flags & backend_flags::TERMINATING != 0,
            })
        })
        .collect()
}

pub fn view(t: &Table, stats: Vec<(&'static str, u64)>) -> ListView {
    let mut frontends = Vec::new();
    let mut vips = Vec::new();
    for (k, v) in &t.services {
        if k.slot != 0 || k.scope != SCOPE_ALL {
            continue;
        }
        if v.flags & svc_flags::VIP_MARKER != 0 {
            vips.push(Ipv4Addr::from(k.addr).to_string());
            continue;
        }
        let local_only = v.flags & svc_flags::LOCAL_ONLY != 0;
        let local_backends = local_only.then(|| {
            let n = t
                .services
                .get(&Svc4Key::new(k.addr, k.port, k.proto, SCOPE_LOCAL, 0))
                .map_or(0, |l| l.count);
            backends(t, k, SCOPE_LOCAL, n)
        });
        frontends.push(FrontendView {
            address: Ipv4Addr::from(k.addr).to_string(),
            port: k.port,
            protocol: proto_name(k.proto),
            rev_nat_id: v.rev_nat_id,
            local_only,
            affinity_timeout: (v.flags & svc_flags::AFFINITY != 0).then_some(v.affinity_timeout),
            backends: backends(t, k, SCOPE_ALL, v.count),
            local_backends,
        });
    }
    ListView { frontends, vips, stats: stats.into_iter().collect() }
}

pub fn render_text(v: &ListView) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "Prot Frontend                 Backends  Flags");
    for f in &v.frontends {
        let mut flags = Vec::new();
        if f.local_only {
            flags.push("local-only".to_string());
        }
        if let Some(t) = f.affinity_timeout {
            flags.push(format!("affinity={t}s"));
        }
        let shown = f.local_backends.as_ref().unwrap_or(&f.backends);
        let front = format!("{}:{}", f.address, f.port);
        let _ = writeln!(s, "{:<4} {:<24} {:<9} {}", f.protocol, front, shown.len(), flags.join(","));
        if shown.is_empty() {
            let _ = writeln!(s, "  (no endpoints: connect is refused)");
        }
        for b in shown {
            let mut bf = Vec::new();
            if b.local {
                bf.push("local");
            }
            if b.terminating {
                bf.push("terminating");
            }
            let addr = format!("{}:{}", b.address, b.port);
            let _ = writeln!(s, "  -> {:<24} id={:<6} {}", addr, b.id, bf.join(","));
        }
    }
    let stats: Vec<String> = v.stats.iter().map(|(k, n)| format!("{k}={n}")).collect();
    let _ = writeln!(s, "stats: {}", stats.join(" "));
    s
}
