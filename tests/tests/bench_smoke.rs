//! A small smoke run of every bench case, so that the bench code cannot rot.
//! Not a benchmark: no number is checked, only that every case ran.
use lbtest::bin;

#[test]
fn every_bench_case_runs() {
    let out_json = std::env::temp_dir().join(format!("lbt-{}-bench.json", std::process::id()));
    let out = std::process::Command::new(bin("lb-bench"))
        .args(["--rounds", "1", "--secs", "0.2", "--services", "30", "--changes", "5", "--bulk-bytes", "1000000", "--out"])
        .arg(&out_json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out_json).unwrap()).unwrap();
    std::fs::remove_file(&out_json).unwrap();
    let dp = v["datapath"].as_object().unwrap();
    // 11 cases with the client and server on different nodes (2 of them
    // with --per-packet-lb), 2 on one node.
    assert_eq!(dp.len(), 13, "{stdout}");
    // lb against direct from the same client, alternating: across nodes and
    // on one node.
    let paired = v["paired"].as_object().unwrap();
    assert_eq!(paired.len(), 2, "{stdout}");
    assert!(paired.values().all(|s| s["ratios"][0].as_f64().is_some_and(|r| r > 0.0)), "{stdout}");
    // Each socket program's cost per run, at both scales.
    for scale in ["small", "large"] {
        assert!(v["program_ns"][scale]["lb_connect4"].as_f64().is_some_and(|ns| ns > 0.0), "{scale}: {stdout}");
    }
    for (case, s) in dp {
        assert!(s["values"][0].as_f64().unwrap() > 0.0, "{case}: {stdout}");
    }
    // Direct, lb TC, lb TC with BPF forwarding, with DSR, with Maglev,
    // iptables behind 10 and behind 30 Services; direct, lb TC and lb BPF
    // forwarding on IPv6.
    let np = v["nodeport"].as_object().unwrap();
    assert_eq!(np.len(), 10, "{stdout}");
    for (case, s) in np {
        assert!(s["values"][0].as_f64().unwrap() > 0.0, "NodePort {case}: {stdout}");
    }
    let tput = v["nodeport_throughput"].as_object().unwrap();
    assert_eq!(tput.len(), 10, "{stdout}");
    let udp = v["nodeport_udp"].as_object().unwrap();
    assert_eq!(udp.len(), 10, "{stdout}");
    assert!(v["nodeport_program_ns"][0]["lb_nodeport_ingress"].as_f64().is_some_and(|ns| ns > 0.0), "{stdout}");
    // On the wired fabric: direct, lb TC, TC with BPF forwarding, XDP,
    // iptables behind 10; the XDP node's program ran and took packets away
    // from its TC program.
    for m in ["conn", "udp", "throughput"] {
        let w = v["nodeport_wired"][m].as_object().unwrap();
        assert_eq!(w.len(), 5, "{m}: {stdout}");
        assert!(w.values().all(|s| s["values"][0].as_f64().is_some_and(|x| x > 0.0)), "{m}: {stdout}");
    }
    // At the backends' node: direct and lb (node 2), direct and iptables
    // (node 19).
    for m in ["conn", "udp", "throughput"] {
        let l = v["nodeport_local"][m].as_object().unwrap();
        assert_eq!(l.len(), 4, "{m}: {stdout}");
        assert!(l.values().all(|s| s["values"][0].as_f64().is_some_and(|x| x > 0.0)), "{m}: {stdout}");
    }
    // Paired from the outside client: four lb modes against direct and
    // against iptables, iptables against direct, and at the backends' node
    // lb (TC; with BPF forwarding, masquerading in BPF; with BPF
    // forwarding, the client's address kept) against direct and
    // iptables, and iptables against direct.
    let np_paired = v["nodeport_paired"].as_object().unwrap();
    assert_eq!(np_paired.len(), 16, "{stdout}");
    assert!(np_paired.keys().any(|k| k.contains("masquerading in BPF")), "{stdout}");
    assert!(np_paired.values().all(|s| s["ratios"][0].as_f64().is_some_and(|r| r > 0.0)), "{stdout}");
    // With BPF forwarding at the backends' node, the pod program runs on
    // the server's device (its cost is reported).
    let runs = v["pod_program_ns"]["lb_pod_ingress runs"].as_f64().unwrap_or(0.0);
    assert!(v["pod_program_ns"]["lb_pod_ingress"].as_f64().is_some_and(|ns| ns > 0.0) && runs > 0.0, "{stdout}");
    // With --per-packet-lb both pod programs run on the client's device.
    for prog in ["lb_pod_ingress", "lb_pod_egress"] {
        assert!(v["per_packet_program_ns"][format!("{prog} runs")].as_f64().is_some_and(|n| n > 0.0), "{prog}: {stdout}");
    }
    let (fwd, xdp) = (&v["nodeport_wired_program_ns"][0], &v["nodeport_wired_program_ns"][1]);
    assert!(xdp["lb_nodeport_xdp runs"].as_f64().is_some_and(|n| n > 0.0), "{stdout}");
    assert!(xdp["lb_nodeport_ingress runs"].as_f64() < fwd["lb_nodeport_ingress runs"].as_f64(), "{stdout}");
    for (case, s) in udp {
        assert!(s["values"][0].as_f64().unwrap() > 0.0, "NodePort UDP {case}: {stdout}");
    }
    assert!(v["control_plane"].as_object().unwrap().keys().any(|k| k.contains("(YAML)")), "{stdout}");
    assert!(v["map_write_ratio_to_raw"].as_f64().is_some_and(|r| r > 0.0), "{stdout}");
    assert_eq!(v["change_latency_ms"]["samples"].as_array().unwrap().len(), 5);
    assert!(stdout.contains("| lb, 30 services |"), "{stdout}");
}
