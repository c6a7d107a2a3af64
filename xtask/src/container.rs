//! The lb-agent image without an image registry.
//!
//! - [`ensure_base_image`]: `localhost/lb-base:bookworm`, a Debian bookworm
//!   minbase made with debootstrap from the machine's apt mirror and imported
//!   into podman (nothing is pulled from a registry).
//! - [`build_image`]: `deploy/Dockerfile` with the binaries built on the host
//!   (`BINS=prebuilt`) on that base (`BASE=localhost/lb-base:bookworm`).
//!
//! What kubelet would run for `deploy/daemonset.yaml`, as `podman` argument
//! lists, is `lbtest::podspec` (the tests crate runs it in the container
//! tests; `cargo xtask pod-commands` prints it).
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
pub use lbtest::podspec::{IMAGE, host_ulimits, image_exists, podman};

/// The registry-free base image (debootstrap minbase, imported, then
/// updated and slimmed by [`BASE_CONTAINERFILE`]).
pub const BASE_IMAGE: &str = "localhost/lb-base:bookworm";
/// The debootstrap root as imported, before [`BASE_CONTAINERFILE`].
const RAW_BASE_IMAGE: &str = "localhost/lb-base-raw:bookworm";
/// Bumped when the base image's recipe changes: an image made by another
/// recipe (label lb.base.recipe) is made again.
const BASE_RECIPE: &str = "2";
/// Turns the imported debootstrap root into the base image, inside the build
/// container (nothing here touches the host): apt sources with -updates and
/// -security, the slim images' dpkg excludes, `apt-get upgrade`, then
/// without docs (but copyrights), man pages, locales and apt lists.
const BASE_CONTAINERFILE: &str = r#"FROM localhost/lb-base-raw:bookworm
ARG MIRROR
ARG SECURITY
ARG SUITE
RUN printf 'deb %s %s main\n' "$MIRROR" "$SUITE" "$MIRROR" "$SUITE-updates" "$SECURITY" "$SUITE-security" \
      > /etc/apt/sources.list \
 && printf 'path-exclude %s\n' '/usr/share/doc/*' '/usr/share/man/*' '/usr/share/info/*' '/usr/share/locale/*' \
      '/usr/share/groff/*' '/usr/share/lintian/*' > /etc/dpkg/dpkg.cfg.d/lb-slim \
 && echo 'path-include /usr/share/doc/*/copyright' >> /etc/dpkg/dpkg.cfg.d/lb-slim \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get -y upgrade \
 && apt-get clean \
 && find /usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete \
 && find /usr/share/doc -mindepth 1 -depth -type d -empty -delete \
 && rm -rf /usr/share/man/* /usr/share/info/* /usr/share/locale/* /usr/share/groff/* /usr/share/lintian/* \
      /var/lib/apt/lists/* /var/log/apt/* /var/log/dpkg.log /var/cache/debconf/*-old
"#;
/// What `cargo xtask image --e2e` tags (runtime + lbprobe).
pub const E2E_IMAGE: &str = "localhost/lb-agent:e2e";
const SUITE: &str = "bookworm";
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
const DEFAULT_SECURITY: &str = "http://deb.debian.org/debian-security";
/// The debootstrap root is cached here (root-owned, outside the shared target dir).
const CACHE: &str = "/var/cache/lb";

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {cmd:?}");
    let st = cmd.status().with_context(|| format!("spawn {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

/// The first `deb` source for `suite` (exactly; not `-security`/`-updates`)
/// in apt's files, given as (file name, text) in the order apt reads them:
/// one-line `.list` entries and deb822 `.sources` paragraphs. Only URIs
/// debootstrap can fetch from (http, https, ftp, file).
pub fn apt_mirror(files: &[(String, String)], suite: &str) -> Option<String> {
    let usable = |uri: &str| ["http://", "https://", "ftp://", "file:/"].iter().any(|p| uri.starts_with(p));
    for (name, text) in files {
        if name.ends_with(".sources") {
            // deb822: paragraphs separated by blank lines; continuation lines
            // start with a space.
            let mut para: Vec<(String, String)> = Vec::new();
            for line in text.lines().map(str::trim_end).chain(std::iter::once("")) {
                if line.starts_with('#') {
                    continue;
                }
                if line.trim().is_empty() {
                    let get = |k: &str| {
                        para.iter().find(|(f, _)| f.eq_ignore_ascii_case(k)).map(|(_, v)| v.as_str()).unwrap_or("")
                    };
                    let enabled = !get("Enabled").trim().eq_ignore_ascii_case("no");
                    if enabled
                        && get("Types").split_whitespace().any(|t| t == "deb")
                        && get("Suites").split_whitespace().any(|s| s == suite)
                        && let Some(uri) = get("URIs").split_whitespace().find(|u| usable(u))
                    {
                        return Some(uri.trim_end_matches('/').to_string());
                    }
                    para.clear();
                } else if line.starts_with([' ', '\t']) {
                    if let Some((_, v)) = para.last_mut() {
                        v.push(' ');
                        v.push_str(line.trim());
                    }
                } else if let Some((k, v)) = line.split_once(':') {
                    para.push((k.trim().to_string(), v.trim().to_string()));
                }
            }
        } else {
            for line in text.lines() {
                let line = line.split('#').next().unwrap_or("");
                let mut words = line.split_whitespace();
                if words.next() != Some("deb") {
                    continue;
                }
                let mut rest: Vec<&str> = words.collect();
                // Options: `[arch=amd64 signed-by=...]`, possibly several words.
                if rest.first().is_some_and(|w| w.starts_with('[')) {
                    let end = rest.iter().position(|w| w.ends_with(']')).unwrap_or(rest.len() - 1);
                    rest.drain(..=end);
                }
                if let [uri, s, ..] = rest[..]
                    && s == suite
                    && usable(uri)
                {
                    return Some(uri.trim_end_matches('/').to_string());
                }
            }
        }
    }
    None
}

/// This machine's apt files, in the order apt reads them.
fn host_apt_files() -> Vec<(String, String)> {
    let mut files = Vec::new();
    if let Ok(t) = std::fs::read_to_string("/etc/apt/sources.list") {
        files.push(("sources.list".to_string(), t));
    }
    let mut names: Vec<PathBuf> = std::fs::read_dir("/etc/apt/sources.list.d")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "list" || e == "sources"))
        .collect();
    names.sort();
    for p in names {
        if let Ok(t) = std::fs::read_to_string(&p) {
            files.push((p.file_name().unwrap().to_string_lossy().into_owned(), t));
        }
    }
    files
}

fn base_recipe_of(image: &str) -> Option<String> {
    let out = podman()
        .args(["image", "inspect", "--format", "{{index .Config.Labels \"lb.base.recipe\"}}", image])
        .output()
        .ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `localhost/lb-base:bookworm`, unless podman has it already (made by this
/// recipe): debootstrap (minbase) from the machine's apt mirror into
/// /var/cache/lb (kept; a run that did not finish is redone), `tar | podman
/// import` as localhost/lb-base-raw:bookworm, then [`BASE_CONTAINERFILE`]
/// (squashed to one layer).
pub fn ensure_base_image() -> Result<()> {
    if image_exists(BASE_IMAGE) && base_recipe_of(BASE_IMAGE).as_deref() == Some(BASE_RECIPE) {
        eprintln!("xtask: {BASE_IMAGE} exists");
        return Ok(());
    }
    let t = Instant::now();
    let files = host_apt_files();
    let mirror = apt_mirror(&files, SUITE).unwrap_or_else(|| DEFAULT_MIRROR.to_string());
    let security = apt_mirror(&files, &format!("{SUITE}-security")).unwrap_or_else(|| DEFAULT_SECURITY.to_string());
    let dir = Path::new(CACHE).join(format!("debootstrap-{SUITE}"));
    // Written after debootstrap succeeded; names the mirror it used.
    let done = Path::new(CACHE).join(format!("debootstrap-{SUITE}.done"));
    if std::fs::read_to_string(&done).ok().as_deref() != Some(mirror.as_str()) {
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("remove {}", dir.display()))?;
        }
        std::fs::create_dir_all(CACHE)?;
        let mut c = Command::new("debootstrap");
        c.arg("--variant=minbase");
        if mirror.starts_with("https://") || security.starts_with("https://") {
            // apt inside the image has to verify the mirror's certificate.
            c.arg("--include=ca-certificates");
        }
        run(c.arg(SUITE).arg(&dir).arg(&mirror))?;
        std::fs::write(&done, &mirror)?;
    }
    // Without apt's package lists and downloaded .debs (the image's RUN steps
    // `apt-get update` anyway), and without the host's resolv.conf and
    // hostname that debootstrap copied (podman provides its own).
    let mut tar = Command::new("tar");
    tar.arg("-C").arg(&dir).args([
        "--exclude=./var/lib/apt/lists/*_*",
        "--exclude=./var/cache/apt/archives/*.deb",
        "--exclude=./var/cache/apt/*.bin",
        "--exclude=./etc/resolv.conf",
        "--exclude=./etc/hostname",
        "-c",
        ".",
    ]);
    eprintln!("xtask: {tar:?} | podman import - {RAW_BASE_IMAGE}");
    let mut tar = tar.stdout(Stdio::piped()).spawn().context("spawn tar")?;
    let stdout = tar.stdout.take().unwrap();
    let import = podman()
        .args(["import", "--change", "CMD [\"/bin/bash\"]", "--change"])
        .arg("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        .args(["-", RAW_BASE_IMAGE])
        .stdin(stdout)
        .status()
        .context("spawn podman import")?;
    let tar_st = tar.wait()?;
    if !tar_st.success() || !import.success() {
        bail!("tar ({tar_st}) | podman import ({import}) failed");
    }
    // Updated and slimmed in a build container (its network is the host's,
    // as for every build here: apt needs the mirror).
    let ctx = Path::new(CACHE).join("base-context");
    std::fs::create_dir_all(&ctx)?;
    let containerfile = ctx.join("Containerfile");
    std::fs::write(&containerfile, BASE_CONTAINERFILE)?;
    let mut c = podman();
    c.args(["build", "--network", "host", "--pull=never", "--squash-all"])
        .arg("--build-arg")
        .arg(format!("MIRROR={mirror}"))
        .arg("--build-arg")
        .arg(format!("SECURITY={security}"))
        .arg("--build-arg")
        .arg(format!("SUITE={SUITE}"))
        .arg("--label")
        .arg(format!("lb.base.recipe={BASE_RECIPE}"));
    for u in host_ulimits() {
        c.args(["--ulimit", &u]);
    }
    run(c.arg("-f").arg(&containerfile).args(["-t", BASE_IMAGE]).arg(&ctx))?;
    eprintln!("xtask: {BASE_IMAGE} made in {:.0?}", t.elapsed());
    Ok(())
}

/// `podman build` of deploy/Dockerfile from binaries already in
/// target/release (lb-agent, lbprobe) on the local base image: no registry.
/// `e2e` builds the e2e stage (runtime + lbprobe) instead of the runtime one.
pub fn build_image(root: &Path, e2e: bool) -> Result<&'static str> {
    for bin in ["lb-agent", "lbprobe"] {
        let p = root.join("target/release").join(bin);
        if !p.is_file() {
            bail!("{} is missing: build the release binaries first", p.display());
        }
    }
    let tag = if e2e { E2E_IMAGE } else { IMAGE };
    let mut c = podman();
    c.args(["build", "--network", "host", "-f", "deploy/Dockerfile"])
        .args(["--build-arg", "BINS=prebuilt", "--build-arg"])
        .arg(format!("BASE={BASE_IMAGE}"))
        .args(["--target", if e2e { "e2e" } else { "runtime" }]);
    // RUN steps run under runc too.
    for u in host_ulimits() {
        c.args(["--ulimit", &u]);
    }
    run(c.args(["-t", tag, "."]).current_dir(root))?;
    Ok(tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// deploy/Dockerfile: the runtime image (the `runtime` target and the
    /// default, last stage) has no test binaries; `e2e` adds lbprobe; the
    /// runtime base and the binaries' stage are build arguments.
    #[test]
    fn the_runtime_stage_has_no_test_binaries() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let text = std::fs::read_to_string(root.join("deploy/Dockerfile")).unwrap();
        // Stages: (FROM line, instructions), comments dropped.
        let mut stages: Vec<(String, String)> = Vec::new();
        for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
            if line.starts_with("FROM ") {
                stages.push((line.to_string(), String::new()));
            } else if let Some((_, body)) = stages.last_mut() {
                body.push_str(line);
                body.push('\n');
            }
        }
        let stage = |name: &str| stages.iter().find(|(from, _)| from.ends_with(&format!(" AS {name}"))).unwrap();
        assert!(text.contains("ARG BASE=debian:bookworm-slim") && text.contains("ARG BINS=build"));
        assert_eq!(stage("runtime").0, "FROM ${BASE} AS runtime");
        assert_eq!(stage("bins").0, "FROM ${BINS} AS bins");
        assert_eq!(stage("prebuilt").0, "FROM scratch AS prebuilt");
        assert!(!stage("runtime").1.contains("lbprobe"));
        // (iptables, nft and ipset: the firewall rules and kube-proxy's clean-up.)
        for tool in ["bpftool", "util-linux", "mount", "iproute2", "coreutils", "iptables", "nftables", "ipset"] {
            assert!(stage("runtime").1.contains(tool), "{tool}");
        }
        assert_eq!(stage("e2e").0, "FROM runtime AS e2e");
        assert!(stage("e2e").1.contains("lbprobe"));
        let (last_from, last_body) = stages.last().unwrap();
        assert_eq!(last_from, "FROM runtime");
        assert!(last_body.trim().is_empty());
    }

    #[test]
    fn the_mirror_is_the_first_plain_suite_source() {
        let f = |n: &str, t: &str| (n.to_string(), t.to_string());
        let deb822 = "Types: deb\n# http://snapshot.debian.org/x\nURIs: http://deb.debian.org/debian/\nSuites: bookworm bookworm-updates\nComponents: main\n\n\
                      Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n";
        assert_eq!(apt_mirror(&[f("debian.sources", deb822)], "bookworm").as_deref(), Some("http://deb.debian.org/debian"));
        // Only the security suite: nothing.
        let sec = "Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n";
        assert_eq!(apt_mirror(&[f("s.sources", sec)], "bookworm"), None);
        // A disabled paragraph and a deb-src one are skipped; continuation lines are read.
        let more = "Enabled: no\nTypes: deb\nURIs: http://off/debian\nSuites: bookworm\n\n\
                    Types: deb-src\nURIs: http://src/debian\nSuites: bookworm\n\n\
                    Types: deb\nURIs: mirror+file:/etc/m\n http://second/debian\nSuites: bookworm\n";
        assert_eq!(apt_mirror(&[f("m.sources", more)], "bookworm").as_deref(), Some("http://second/debian"));
        // One-line format, with options and comments; files in apt's order.
        let list = "# deb http://commented/debian bookworm main\ndeb https://packages.cloud.google.com/apt cloud-sdk-bookworm main\n\
                    deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main # x\n";
        assert_eq!(
            apt_mirror(&[f("sources.list", list), f("debian.sources", deb822)], "bookworm").as_deref(),
            Some("http://mirror.example/debian")
        );
        assert_eq!(apt_mirror(&[], "bookworm"), None);
    }
}
