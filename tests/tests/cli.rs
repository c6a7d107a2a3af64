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

#[test]
fn not_root() {
    // Run as nobody through setpriv (util-linux).
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(bin("lb-agent"))
        .args(["run", "--source", "dir:/tmp"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("lb-agent: not root"), "{err}");
}

#[test]
fn list_without_pins_says_so() {
    let (code, err) = agent(&["list", "--bpffs", "/sys/fs/bpf/lbt-cli-nothing-here"]);
    assert_ne!(code, 0);
    assert!(err.contains("nothing is pinned under /sys/fs/bpf/lbt-cli-nothing-here"), "{err}");
}
