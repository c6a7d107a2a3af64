//! `cargo xtask demo`: a netns mini-cluster with one Service of three pods
//! and a client pod; 300 connections through the ClusterIP, how they spread,
//! a Service without endpoints refused at once, and `lb-agent list`.
use std::time::Instant;

use anyhow::Result;
use lbtest::Cluster;
use lbtest::objects::{service, slice};

fn main() -> Result<()> {
    println!("== building a mini-cluster: 1 node, 3 backend pods, 1 client pod (network namespaces)");
    let mut c = Cluster::new(1)?;
    let mut eps = Vec::new();
    for name in ["web-0", "web-1", "web-2"] {
        let p = c.add_pod(1, name)?;
        c.serve(&p, 8080)?;
        println!("   pod {name:<6} {} serving on :8080", p.ip);
        eps.push(p);
    }
    let client = c.add_pod(1, "client")?;
    println!("   pod client {}", client.ip);

    c.write_object("web.yaml", &service("web", "10.96.0.10", &[("http", 80, 8080, "TCP")]))?;
    let e: Vec<(&str, &str, bool)> = eps.iter().map(|p| (p.ip.as_str(), "node-1", true)).collect();
    c.write_object("web-slice.yaml", &slice("web", "web-abc", &[("http", 8080, "TCP")], &e))?;
    c.write_object("empty.yaml", &service("empty", "10.96.0.11", &[("http", 80, 8080, "TCP")]))?;
    println!("== Services: web 10.96.0.10:80 -> 3 pods :8080;  empty 10.96.0.11:80 -> no endpoints");

    c.start_agent(1)?;
    println!("== lb-agent runs on node-1 (cgroup {}, pins {})", c.nodes[0].cgroup.display(), c.nodes[0].bpffs.display());
    let want: Vec<String> = eps.iter().map(|p| format!("{}:8080", p.ip)).collect();
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    c.wait_programmed("10.96.0.10", 80, "TCP", Some(&want))?;

    println!("\n== 300 TCP connections from the client pod to 10.96.0.10:80");
    let s = c.probe(&client, &["tcp", "--addr", "10.96.0.10:80", "--count", "300"])?;
    for (pod, n) in &s.replies {
        let bar = "#".repeat((*n as usize).div_ceil(4));
        println!("   {pod:<6} {n:>4}  {:>5.1}%  {bar}", *n as f64 * 100.0 / s.attempts as f64);
    }
    println!("   ok {} of {}, failed {}", s.ok, s.attempts, s.failed());

    println!("\n== a connection to 10.96.0.11:80 (a Service with no endpoints)");
    let t = Instant::now();
    let r = c.probe(&client, &["tcp", "--addr", "10.96.0.11:80", "--count", "1"])?;
    let err = r.errors.keys().next().cloned().unwrap_or_else(|| "no error?".into());
    println!("   connect() failed with {err} (connection refused) after {} ms, client run {:?}", r.max_fail_ms, t.elapsed());

    println!("\n== lb-agent list --bpffs {}", c.nodes[0].bpffs.display());
    print!("{}", lbtest::run(lbtest::bin("lb-agent").to_str().unwrap(), &["list", "--bpffs", c.nodes[0].bpffs.to_str().unwrap()])?);

    println!("\n== cleaning up (agent, pins, namespaces, cgroup)");
    drop(c);
    println!("   done");
    if s.ok != 300 || err != "ECONNREFUSED" {
        anyhow::bail!("the demo did not behave as expected");
    }
    Ok(())
}
