//! Other BPF programs on the hooks lb's socket programs use, for the cgroup
//! lb attaches to (its own and its ancestors': the programs that run for
//! its sockets). After a move from Cilium's kube-proxy replacement or
//! Calico's eBPF mode, their connect and sendmsg programs can be left on
//! the root cgroup: every program of a hook runs, in order, each on the
//! address the one before left, so a stale one translates a Service
//! address from its own, older maps before lb sees it (or refuses it), and
//! nothing in lb's own state says so. On a device, a TCX program ahead of
//! lb's that ends the chain (another proxy's NodePort program, Cilium's
//! `cil_from_netdev`) keeps outside traffic from lb's. kube-proxy's rules
//! get the same look (`kube_proxy`).
use std::collections::HashMap;
use std::os::fd::AsRawFd as _;
use std::path::Path;

use anyhow::{Context as _, Result};
use aya_obj::generated::bpf_attach_type as T;

/// The hooks lb's socket programs use, by name.
pub const HOOKS: [(T, &str); 8] = [
    (T::BPF_CGROUP_INET4_CONNECT, "connect4"),
    (T::BPF_CGROUP_INET6_CONNECT, "connect6"),
    (T::BPF_CGROUP_UDP4_SENDMSG, "sendmsg4"),
    (T::BPF_CGROUP_UDP6_SENDMSG, "sendmsg6"),
    (T::BPF_CGROUP_UDP4_RECVMSG, "recvmsg4"),
    (T::BPF_CGROUP_UDP6_RECVMSG, "recvmsg6"),
    (T::BPF_CGROUP_INET4_GETPEERNAME, "getpeername4"),
    (T::BPF_CGROUP_INET6_GETPEERNAME, "getpeername6"),
];

/// A program of another owner on one of `HOOKS`, or ahead of lb's on a
/// device's TCX hook (`device`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Foreign {
    pub hook: &'static str,
    pub id: u32,
    pub name: String,
    pub device: Option<String>,
}

/// The TCX hooks, by name.
const TCX_HOOKS: [(aya::programs::tc::TcAttachType, &str); 2] =
    [(aya::programs::tc::TcAttachType::Ingress, "tcx_ingress"), (aya::programs::tc::TcAttachType::Egress, "tcx_egress")];

/// The programs of other owners that run ahead of lb's on the TCX hooks of
/// this network namespace's devices (devices lb is not on are not looked
/// at; clsact filters, `--tc-attach netlink`, neither).
pub fn tcx_programs() -> Vec<Foreign> {
    let mut out = Vec::new();
    for link in crate::netdev::links().unwrap_or_default() {
        for (ty, hook) in TCX_HOOKS {
            let Ok((_, progs)) = aya::programs::tc::SchedClassifier::query_tcx(&link.name, ty) else { continue };
            let names: Vec<(u32, String)> = progs.iter().map(|p| (p.id(), p.name_as_str().unwrap_or("").to_string())).collect();
            let Some(first_ours) = names.iter().position(|(_, n)| ours(n)) else { continue };
            out.extend(names[..first_ours].iter().map(|(id, name)| Foreign { hook, id: *id, name: name.clone(), device: Some(link.name.clone()) }));
        }
    }
    out
}

/// bpf(2)'s BPF_PROG_QUERY attributes.
#[repr(C)]
#[derive(Default)]
struct QueryAttr {
    target_fd: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

const BPF_PROG_QUERY: libc::c_long = 16;
/// The programs that run for the cgroup: its ancestors' too.
const BPF_F_QUERY_EFFECTIVE: u32 = 1;

/// The ids of the programs that run on `hook` for the cgroup `fd`.
fn query(fd: i32, hook: T) -> std::io::Result<Vec<u32>> {
    let mut ids = vec![0u32; 64];
    let mut attr = QueryAttr {
        target_fd: fd as u32,
        attach_type: hook as u32,
        query_flags: BPF_F_QUERY_EFFECTIVE,
        prog_ids: ids.as_mut_ptr() as u64,
        prog_cnt: ids.len() as u32,
        ..Default::default()
    };
    // SAFETY: `attr` and the id buffer it points at live until the call
    // returns; the kernel writes at most `prog_cnt` ids.
    let r = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_QUERY, &mut attr as *mut QueryAttr, size_of::<QueryAttr>()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    ids.truncate((attr.prog_cnt as usize).min(64));
    Ok(ids)
}

/// Whether a program name is one of lb's (any version's: they all start
/// so; the kernel keeps 15 characters of a name).
fn ours(name: &str) -> bool {
    name.starts_with("lb_")
}

/// The programs of other owners that run on lb's socket hooks for
/// `cgroup`, in each hook's order.
pub fn cgroup_programs(cgroup: &Path) -> Result<Vec<Foreign>> {
    let dir = std::fs::File::open(cgroup).with_context(|| format!("open {}", cgroup.display()))?;
    let mut names: Option<HashMap<u32, String>> = None;
    let mut out = Vec::new();
    for (hook, name) in HOOKS {
        let ids = query(dir.as_raw_fd(), hook).with_context(|| format!("query the {name} programs of {}", cgroup.display()))?;
        if ids.is_empty() {
            continue;
        }
        let names = names.get_or_insert_with(|| {
            aya::programs::loaded_programs().filter_map(|p| p.ok()).map(|p| (p.id(), p.name_as_str().unwrap_or("").to_string())).collect()
        });
        for id in ids {
            let prog = names.get(&id).cloned().unwrap_or_default();
            if !ours(&prog) {
                out.push(Foreign { hook: name, id, name: prog, device: None });
            }
        }
    }
    Ok(out)
}

/// Look, say what is found (once per change), and set `lb_foreign_programs{hook}`.
pub fn check(
    cgroup: &Path,
    metric: &prometheus_client::metrics::family::Family<[(&'static str, &'static str); 1], prometheus_client::metrics::gauge::Gauge>,
    last: &mut Option<Vec<Foreign>>,
) {
    let mut now = match cgroup_programs(cgroup) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!("cannot list the other BPF programs on lb's socket hooks: {e:#}");
            return;
        }
    };
    now.extend(tcx_programs());
    for hook in HOOKS.iter().map(|h| h.1).chain(TCX_HOOKS.iter().map(|h| h.1)) {
        metric.get_or_create(&[("hook", hook)]).set(now.iter().filter(|f| f.hook == hook).count() as i64);
    }
    if last.as_ref() == Some(&now) {
        return;
    }
    if now.is_empty() {
        if last.as_ref().is_some_and(|l| !l.is_empty()) {
            tracing::info!("no other BPF program is left on lb's socket hooks");
        }
    } else {
        let name = |f: &Foreign| if f.name.is_empty() { "?".to_string() } else { f.name.clone() };
        let socket: Vec<String> = now.iter().filter(|f| f.device.is_none()).map(|f| format!("{} on {} (id {})", name(f), f.hook, f.id)).collect();
        let tc: Vec<String> = now
            .iter()
            .filter_map(|f| Some(format!("{} on {} of {} (id {})", name(f), f.hook, f.device.as_deref()?, f.id)))
            .collect();
        if !socket.is_empty() {
            tracing::warn!(
                cgroup = %cgroup.display(),
                "other BPF programs run on the socket hooks lb uses, for the sockets lb balances: {}. Each program of a hook runs on \
                 the address the one before left: another proxy's (Cilium's socket LB, cil_sock*; Calico's eBPF mode) translates or \
                 refuses Service addresses from its own, maybe stale, maps. Turn that proxy's socket LB off (Cilium: \
                 kubeProxyReplacement=false, socketLB.enabled=false) or detach it (`bpftool cgroup detach CGROUP HOOK id ID`)",
                socket.join(", ")
            );
        }
        if !tc.is_empty() {
            tracing::warn!(
                "other BPF programs run ahead of lb's on the TC hooks of its devices: {}. One that ends the chain (another \
                 proxy's NodePort program) keeps outside traffic from lb's; remove it with its owner's tools (`bpftool net \
                 show` lists them; `bpftool link detach id ID` for a link)",
                tc.join(", ")
            );
        }
    }
    *last = Some(now);
}

#[cfg(test)]
mod tests {
    #[test]
    fn lbs_programs_are_told_by_their_name() {
        for name in ["lb_connect4", "lb_getpeername6", "lb_sendmsg4"] {
            assert!(super::ours(name), "{name}");
        }
        for name in ["cil_sock4_connect", "calico_connect", "", "lbconnect"] {
            assert!(!super::ours(name), "{name}");
        }
    }
}
