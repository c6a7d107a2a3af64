//! What an operator sees when the agent cannot start: one clear line on
//! stderr naming the problem, and a non-zero exit.
use std::process::Command;

use lbtest::bin;

fn agent(args: &[&str]) -> (i32, String) {
    let out = Command::new(bin("lb-agent")).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn assert_one_line_error(args: &[&str], want: &str) {
    let (code, err) = agent(args);
    assert_ne!(code, 0, "{args:?} must fail: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line for {args:?}, got: {err}");
    assert!(lines[0].starts_with("lb-agent: ") && lines[0].contains(want), "{args:?}: want {want:?} in {err:?}");
}

fn tmpdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("lbt-{}-cli-{tag}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn unknown_source_scheme() {
    assert_one_line_error(&["run", "--source", "http://x"], "unknown source scheme \"http\"");
}

#[test]
fn a_maglev_table_size_that_is_no_prime() {
    assert_one_line_error(&["run", "--maglev-table-size", "16384"], "--maglev-table-size: 16384 is not a prime");
    let (code, err) = agent(&["run", "--nodeport-algorithm", "ring-hash"]);
    assert_ne!(code, 0);
    assert!(err.contains("--nodeport-algorithm") && err.contains("ring-hash"), "{err}");
}

#[test]
fn mark_bits_that_collide() {
    assert_one_line_error(&["run", "--masquerade-mark-bit", "12"], "--masquerade-mark-bit 12: the same bit as --forward-mark-bit");
    assert_one_line_error(&["run", "--masquerade-mark-bit", "13"], "--masquerade-mark-bit 13: the same bit as --notrack-mark-bit");
    assert_one_line_error(&["run", "--notrack-mark-bit", "12"], "--notrack-mark-bit 12: the same bit as --forward-mark-bit");
    let (code, err) = agent(&["run", "--local-masquerade", "iptables"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--local-masquerade") && err.contains("nftables") && err.contains("none"), "{err}");
}

#[test]
fn conntrack_values_that_are_no_durations() {
    let (code, err) = agent(&["run", "--conntrack-tcp-timeout-close-wait", "an hour"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--conntrack-tcp-timeout-close-wait") && err.contains("an hour"), "{err}");
    let (code, err) = agent(&["run", "--conntrack-max-per-core=-1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--conntrack-max-per-core"), "{err}");
}

#[test]
fn nodeport_addresses_that_are_no_cidrs() {
    assert_one_line_error(&["run", "--nodeport-addresses", "10.0.0.1"], "--nodeport-addresses: \"10.0.0.1\" has no prefix length");
    assert_one_line_error(&["run", "--nodeport-addresses", "10.0.0.0/8,primary"], "--nodeport-addresses: \"primary\" cannot be combined");
    assert_one_line_error(&["run", "--nodeport-addresses", "10.0.0.0/40"], "--nodeport-addresses: \"10.0.0.0/40\" is not a CIDR");
}

#[test]
fn missing_source_directory() {
    assert_one_line_error(&["run", "--source", "dir:/nonexistent/lb-objects"], "/nonexistent/lb-objects");
}

#[test]
fn no_bpffs() {
    let d = tmpdir("nobpffs");
    let pins = d.join("pins");
    assert_one_line_error(
        &["run", "--source", &format!("dir:{}", d.display()), "--bpffs", pins.to_str().unwrap()],
        "no bpffs",
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn no_cgroup_v2() {
    let d = tmpdir("nocgroup");
    assert_one_line_error(
        &["run", "--source", &format!("dir:{}", d.display()), "--cgroup", d.to_str().unwrap(), "--bpffs", "/sys/fs/bpf/lbt-cli-never-created"],
        "no cgroup v2",
    );
    assert!(!std::path::Path::new("/sys/fs/bpf/lbt-cli-never-created").exists());
    std::fs::remove_dir_all(&d).unwrap();
}

/// `lb-agent run` under setpriv (util-linux) with `privs`: one line that
/// starts with `want`, and a non-zero exit.
fn assert_setpriv_error(privs: &[&str], want: &str) {
    let out = Command::new("setpriv").args(privs).arg(bin("lb-agent")).args(["run", "--source", "dir:/tmp"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with(want), "{err}");
}

#[test]
fn not_root() {
    // Run as nobody.
    assert_setpriv_error(&["--reuid=65534", "--regid=65534", "--clear-groups"], "lb-agent: not root");
}

#[test]
fn list_without_pins_says_so() {
    let (code, err) = agent(&["list", "--bpffs", "/sys/fs/bpf/lbt-cli-nothing-here"]);
    assert_ne!(code, 0);
    assert!(err.contains("nothing is pinned under /sys/fs/bpf/lbt-cli-nothing-here"), "{err}");
}

#[test]
fn cgroup_v1_only() {
    let d = tmpdir("cgv1");
    // A cgroup v1 hierarchy (this machine mounts v1 controllers beside v2).
    let v1 = std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && f[2] == "cgroup").then(|| f[1].to_string())
        });
    // No v1 mount here: make one, named, without controllers, for the test.
    let own = v1.is_none().then(|| {
        let m = std::env::temp_dir().join(format!("lbt-{}-cgv1mnt", std::process::id()));
        std::fs::create_dir_all(&m).unwrap();
        let ok = Command::new("mount").args(["-t", "cgroup", "-o", "none,name=lbtest", "lbtest"]).arg(&m).status().unwrap().success();
        assert!(ok, "cannot mount a cgroup v1 hierarchy");
        m
    });
    let v1 = v1.unwrap_or_else(|| own.as_ref().unwrap().to_string_lossy().into_owned());
    let (code, err) = agent(&["run", "--source", &format!("dir:{}", d.display()), "--cgroup", &v1, "--bpffs", "/sys/fs/bpf/lbt-cli-never-created"]);
    if let Some(m) = &own {
        let _ = Command::new("umount").arg(m).status();
        let _ = std::fs::remove_dir(m);
    }
    std::fs::remove_dir_all(&d).unwrap();
    assert_ne!(code, 0);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("lb-agent: no cgroup v2") && err.contains("cgroup v1 hierarchy"), "{err}");
}

#[test]
fn a_tmpfs_cgroup_path_gets_the_hybrid_host_hint() {
    // What a container sees when its cgroup volume is the top of a hybrid
    // host's /sys/fs/cgroup: a tmpfs, at any mount point.
    let d = tmpdir("cgtmpfs");
    let (code, err) = agent(&["run", "--source", &format!("dir:{}", d.display()), "--cgroup", "/dev/shm", "--bpffs", "/sys/fs/bpf/lbt-cli-never-created"]);
    std::fs::remove_dir_all(&d).unwrap();
    assert_ne!(code, 0);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("lb-agent: no cgroup v2: /dev/shm is a tmpfs") && err.contains("/sys/fs/cgroup/unified"), "{err}");
}

#[test]
fn a_missing_capability_is_named() {
    // Root, but without CAP_NET_ADMIN in the bounding set.
    assert_setpriv_error(
        &["--bounding-set", "-net_admin", "--inh-caps", "-net_admin", "--"],
        "lb-agent: missing capability CAP_NET_ADMIN",
    );
}
