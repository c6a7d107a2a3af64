//! lbprobe: the pods of the netns mini-cluster. One binary plays a backend
//! server or a client; it enters its pod's network namespace and its node's
//! cgroup itself, before it opens any socket.
//!
//!   lbprobe --netns NS --cgroup DIR serve --name NAME --port P
//!   lbprobe --netns NS --cgroup DIR tcp --addr IP:PORT --count N
//!   lbprobe --netns NS --cgroup DIR udp --addr IP:PORT --count N [--connected]
//!
//! Clients print one JSON summary on stdout: what a user would see.
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    /// Network namespace to enter (name under /run/netns).
    #[arg(long)]
    netns: Option<String>,
    /// cgroup v2 directory to join.
    #[arg(long)]
    cgroup: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Answer every TCP line and every UDP datagram with NAME.
    Serve {
        #[arg(long)]
        name: String,
        #[arg(long)]
        port: u16,
        /// Answer "NAME PEER-IP": the address the server saw the client at.
        #[arg(long)]
        report_peer: bool,
        /// Benchmark server: for each connection read 1 byte, write 1 byte,
        /// close; one thread, pinned to CPU `tiny`.
        #[arg(long)]
        tiny: Option<usize>,
    },
    /// Benchmark client: connect, 1-byte request, 1-byte response, close,
    /// as fast as possible for SECS seconds, pinned to CPU `cpu`.
    Rate {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        secs: f64,
        #[arg(long, default_value_t = 0)]
        cpu: usize,
    },
    /// TCP: download N bytes of a known pattern and check every byte.
    Bulk {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        bytes: u64,
    },
    /// TCP: open N connections at once, then ask each for a reply.
    Concurrent {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        count: u32,
    },
    /// bind() a TCP and a UDP socket to 0.0.0.0:PORT; print the errno (0: bound).
    Bind {
        #[arg(long)]
        port: u16,
    },
    /// TCP: connect, send a line, read the reply, close; COUNT times.
    Tcp {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long, default_value_t = 0)]
        interval_ms: u64,
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
        /// Stop after this long, whatever the count.
        #[arg(long, default_value_t = 60_000)]
        max_ms: u64,
        /// Keep ONE connection open and send a line every interval (at
        /// least 1 ms) for this long; every line is one attempt.
        #[arg(long)]
        hold_ms: Option<u64>,
        /// Write one JSON line per attempt here: {"t_ms", "reply"|"err"}.
        #[arg(long)]
        trace_file: Option<std::path::PathBuf>,
    },
    /// UDP: one connected socket, a datagram every interval for MAX_MS; on
    /// an error, note it, open a new socket and go on.
    UdpStream {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long, default_value_t = 20)]
        interval_ms: u64,
        #[arg(long)]
        max_ms: u64,
        /// Write one JSON line per attempt here.
        #[arg(long)]
        trace_file: Option<std::path::PathBuf>,
    },
    /// HTTP GET; prints {"status": N, "body": "..."}.
    Http {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        path: String,
    },
    /// UDP: send a datagram, read the reply and its source; COUNT times.
    Udp {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// connect() the socket and use send/recv.
        #[arg(long)]
        connected: bool,
        /// Use one socket for every attempt (default: a new socket each time).
        #[arg(long)]
        one_socket: bool,
        #[arg(long, default_value_t = 0)]
        interval_ms: u64,
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
    },
}

#[derive(Default)]
struct Summary {
    attempts: u32,
    ok: u32,
    replies: BTreeMap<String, u32>,
    errors: BTreeMap<String, u32>,
    /// UDP: the source addresses replies came from. TCP: getpeername.
    peers: BTreeMap<String, u32>,
    max_fail_ms: u64,
    last_reply: String,
    last_error: String,
}

impl Summary {
    fn fail(&mut self, e: &std::io::Error, started: Instant) {
        let name = match e.raw_os_error() {
            Some(n) => format!("{:?}", nix::errno::Errno::from_raw(n)),
            None if e.kind() == std::io::ErrorKind::TimedOut || e.kind() == std::io::ErrorKind::WouldBlock => {
                "ETIMEDOUT".to_string()
            }
            None => format!("{:?}", e.kind()),
        };
        *self.errors.entry(name.clone()).or_default() += 1;
        self.last_error = name;
        self.max_fail_ms = self.max_fail_ms.max(started.elapsed().as_millis() as u64);
    }

    fn print(&self) {
        let v = serde_json::json!({
            "attempts": self.attempts,
            "ok": self.ok,
            "replies": self.replies,
            "errors": self.errors,
            "peers": self.peers,
            "max_fail_ms": self.max_fail_ms,
        });
        println!("{v}");
    }
}

fn epoch_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Per-attempt lines, for tests that need to know when each attempt started.
struct Trace(Option<std::io::BufWriter<std::fs::File>>);

impl Trace {
    fn open(path: Option<&std::path::Path>) -> anyhow::Result<Self> {
        Ok(Trace(path.map(std::fs::File::create).transpose()?.map(std::io::BufWriter::new)))
    }

    /// Record the attempt that started at `t`: a reply if `s.ok` grew past
    /// `ok_before`, else the error.
    fn record(&mut self, t: u64, s: &Summary, ok_before: u32) {
        let Some(w) = self.0.as_mut() else { return };
        let line = if s.ok > ok_before {
            serde_json::json!({"t_ms": t, "reply": s.last_reply})
        } else {
            serde_json::json!({"t_ms": t, "err": s.last_error})
        };
        let _ = writeln!(w, "{line}");
        let _ = w.flush();
    }
}

fn enter(netns: Option<&str>, cgroup: Option<&str>) -> anyhow::Result<()> {
    if let Some(cg) = cgroup {
        std::fs::write(format!("{cg}/cgroup.procs"), std::process::id().to_string())
            .map_err(|e| anyhow::anyhow!("join cgroup {cg}: {e}"))?;
    }
    if let Some(ns) = netns {
        let f = std::fs::File::open(format!("/run/netns/{ns}"))
            .map_err(|e| anyhow::anyhow!("open netns {ns}: {e}"))?;
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| anyhow::anyhow!("setns {ns}: {e}"))?;
    }
    Ok(())
}

/// The byte at offset `i` of a bulk transfer.
fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(2654435761) >> 7) as u8
}

fn peer_ip(a: SocketAddr) -> String {
    match a {
        SocketAddr::V6(v6) => v6.ip().to_ipv4_mapped().map_or(v6.ip().to_string(), |v4| v4.to_string()),
        SocketAddr::V4(v4) => v4.ip().to_string(),
    }
}

fn serve(name: String, port: u16, report_peer: bool) -> anyhow::Result<()> {
    // Dual-stack: [::] also takes IPv4 (net.ipv6.bindv6only is 0).
    let tcp = TcpListener::bind(("::", port))?;
    let udp = UdpSocket::bind(("::", port))?;
    println!("ready");
    std::io::stdout().flush()?;
    let answer = move |name: &str, from: SocketAddr| if report_peer { format!("{name} {}", peer_ip(from)) } else { name.to_string() };
    let uname = name.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        while let Ok((_, from)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(answer(&uname, from).as_bytes(), from);
        }
    });
    for conn in tcp.incoming() {
        let Ok(conn) = conn else { continue };
        let name = name.clone();
        std::thread::spawn(move || {
            let Ok(from) = conn.peer_addr() else { return };
            let mut w = match conn.try_clone() {
                Ok(w) => w,
                Err(_) => return,
            };
            for line in BufReader::new(conn).lines() {
                let Ok(line) = line else { break };
                if let Some(n) = line.strip_prefix("bulk ").and_then(|n| n.trim().parse::<u64>().ok()) {
                    let mut off = 0u64;
                    let mut buf = vec![0u8; 65536];
                    while off < n {
                        let len = (n - off).min(buf.len() as u64) as usize;
                        for (j, b) in buf[..len].iter_mut().enumerate() {
                            *b = pattern(off + j as u64);
                        }
                        if w.write_all(&buf[..len]).is_err() {
                            return;
                        }
                        off += len as u64;
                    }
                    return;
                }
                if w.write_all(format!("{}\n", answer(&name, from)).as_bytes()).is_err() {
                    break;
                }
            }
        });
    }
    Ok(())
}

fn pin(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok() {
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    }
}

/// The benchmark server: 1 byte in, 1 byte out, then wait for the client's
/// close (a RST: no TIME_WAIT anywhere).
fn serve_tiny(port: u16, cpu: usize) -> anyhow::Result<()> {
    pin(cpu);
    let tcp = TcpListener::bind(("::", port))?;
    println!("ready");
    std::io::stdout().flush()?;
    let mut buf = [0u8; 1];
    for conn in tcp.incoming() {
        let Ok(mut c) = conn else { continue };
        let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
        if std::io::Read::read_exact(&mut c, &mut buf).is_ok() && c.write_all(&buf).is_ok() {
            let _ = std::io::Read::read(&mut c, &mut buf);
        }
    }
    Ok(())
}

/// Allow many sockets (the concurrent-flows client).
fn raise_nofile() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls with valid pointers.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

fn tcp_once(addr: SocketAddr, timeout: Duration, s: &mut Summary) {
    let started = Instant::now();
    let r = (|| -> std::io::Result<(String, String)> {
        let mut c = TcpStream::connect_timeout(&addr, timeout)?;
        c.set_read_timeout(Some(timeout))?;
        let peer = c.peer_addr()?.to_string();
        c.write_all(b"hi\n")?;
        let mut line = String::new();
        BufReader::new(&mut c).read_line(&mut line)?;
        if line.is_empty() {
            return Err(std::io::Error::from_raw_os_error(libc::ECONNRESET));
        }
        Ok((line.trim().to_string(), peer))
    })();
    match r {
        Ok((reply, peer)) => {
            s.ok += 1;
            *s.replies.entry(reply.clone()).or_default() += 1;
            *s.peers.entry(peer).or_default() += 1;
            s.last_reply = reply;
        }
        Err(e) => s.fail(&e, started),
    }
}

/// One long-lived connection: a line out, a line back, every `interval`.
/// Stops at the first error (the connection is gone).
fn hold_tcp(addr: SocketAddr, hold: Duration, interval: Duration, timeout: Duration, s: &mut Summary) {
    let started = Instant::now();
    let conn = TcpStream::connect_timeout(&addr, timeout).and_then(|c| {
        c.set_read_timeout(Some(timeout))?;
        Ok(c)
    });
    let mut c = match conn {
        Ok(c) => c,
        Err(e) => {
            s.attempts += 1;
            s.fail(&e, started);
            return;
        }
    };
    if let Ok(p) = c.peer_addr() {
        *s.peers.entry(p.to_string()).or_default() += 1;
    }
    let mut r = BufReader::new(c.try_clone().expect("clone"));
    while started.elapsed() < hold {
        s.attempts += 1;
        let t = Instant::now();
        let mut line = String::new();
        let res = c.write_all(b"hi\n").and_then(|_| r.read_line(&mut line)).and_then(|n| {
            if n == 0 { Err(std::io::Error::from_raw_os_error(libc::ECONNRESET)) } else { Ok(()) }
        });
        match res {
            Ok(()) => {
                s.ok += 1;
                *s.replies.entry(line.trim().to_string()).or_default() += 1;
            }
            Err(e) => {
                s.fail(&e, t);
                return;
            }
        }
        std::thread::sleep(interval);
    }
}

fn udp_once(sock: &UdpSocket, addr: SocketAddr, connected: bool, s: &mut Summary) {
    let started = Instant::now();
    let r = (|| -> std::io::Result<(String, String)> {
        let mut buf = [0u8; 1500];
        if connected {
            sock.connect(addr)?;
            sock.send(b"hi")?;
            let n = sock.recv(&mut buf)?;
            // What the socket believes it is connected to.
            let peer = sock.peer_addr()?.to_string();
            Ok((String::from_utf8_lossy(&buf[..n]).into_owned(), peer))
        } else {
            sock.send_to(b"hi", addr)?;
            let (n, from) = sock.recv_from(&mut buf)?;
            Ok((String::from_utf8_lossy(&buf[..n]).into_owned(), from.to_string()))
        }
    })();
    match r {
        Ok((reply, from)) => {
            s.ok += 1;
            *s.replies.entry(reply).or_default() += 1;
            *s.peers.entry(from).or_default() += 1;
        }
        Err(e) => s.fail(&e, started),
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    enter(cli.netns.as_deref(), cli.cgroup.as_deref())?;
    let mut s = Summary::default();
    match cli.cmd {
        Cmd::Serve { port, tiny: Some(cpu), .. } => return serve_tiny(port, cpu),
        Cmd::Serve { name, port, report_peer, tiny: None } => {
            raise_nofile();
            return serve(name, port, report_peer);
        }
        Cmd::Rate { addr, secs, cpu } => {
            pin(cpu);
            let end = Instant::now() + Duration::from_secs_f64(secs);
            let started = Instant::now();
            let mut buf = [0u8; 1];
            while Instant::now() < end {
                s.attempts += 1;
                let r = (|| -> std::io::Result<()> {
                    let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
                    c.set_read_timeout(Some(Duration::from_secs(1)))?;
                    c.write_all(b"x")?;
                    std::io::Read::read_exact(&mut c, &mut buf)?;
                    // Close with a RST: no TIME_WAIT on either side, so the
                    // same 4-tuple can come back in a later round at once.
                    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
                    nix::sys::socket::setsockopt(&c, nix::sys::socket::sockopt::Linger, &linger).map_err(std::io::Error::from)?;
                    Ok(())
                })();
                match r {
                    Ok(()) => s.ok += 1,
                    Err(e) => s.fail(&e, Instant::now()),
                }
            }
            let el = started.elapsed().as_secs_f64();
            println!("{}", serde_json::json!({"attempts": s.attempts, "ok": s.ok, "errors": s.errors, "secs": el, "rate": s.ok as f64 / el}));
            return Ok(());
        }
        Cmd::Bulk { addr, bytes } => {
            s.attempts = 1;
            let started = Instant::now();
            let r = (|| -> std::io::Result<u64> {
                let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
                c.set_read_timeout(Some(Duration::from_secs(10)))?;
                c.write_all(format!("bulk {bytes}\n").as_bytes())?;
                let mut buf = vec![0u8; 65536];
                let mut off = 0u64;
                loop {
                    let n = std::io::Read::read(&mut c, &mut buf)?;
                    if n == 0 {
                        break;
                    }
                    for (j, b) in buf[..n].iter().enumerate() {
                        if *b != pattern(off + j as u64) {
                            return Err(std::io::Error::other(format!("byte {} differs", off + j as u64)));
                        }
                    }
                    off += n as u64;
                }
                Ok(off)
            })();
            match r {
                Ok(n) if n == bytes => {
                    s.ok = 1;
                    *s.replies.entry(format!("{n} bytes")).or_default() += 1;
                }
                Ok(n) => *s.errors.entry(format!("short: {n} of {bytes} bytes")).or_default() += 1,
                Err(e) => s.fail(&e, started),
            }
        }
        Cmd::Concurrent { addr, count } => {
            raise_nofile();
            let started = Instant::now();
            let mut conns = Vec::new();
            for _ in 0..count {
                s.attempts += 1;
                match TcpStream::connect_timeout(&addr, Duration::from_secs(3)) {
                    Ok(c) => conns.push(c),
                    Err(e) => s.fail(&e, started),
                }
            }
            // All open at once; now one line each.
            for c in &mut conns {
                let r = c.set_read_timeout(Some(Duration::from_secs(3))).and_then(|_| c.write_all(b"hi\n")).and_then(|_| {
                    let mut line = String::new();
                    BufReader::new(&*c).read_line(&mut line)?;
                    Ok(line)
                });
                match r {
                    Ok(line) if !line.is_empty() => {
                        s.ok += 1;
                        *s.replies.entry(line.trim().to_string()).or_default() += 1;
                    }
                    Ok(_) => s.fail(&std::io::Error::from_raw_os_error(libc::ECONNRESET), started),
                    Err(e) => s.fail(&e, started),
                }
            }
        }
        Cmd::Bind { port } => {
            for tcp in [true, false] {
                s.attempts += 1;
                let r = if tcp {
                    TcpListener::bind(("0.0.0.0", port)).map(drop)
                } else {
                    UdpSocket::bind(("0.0.0.0", port)).map(drop)
                };
                match r {
                    Ok(()) => s.ok += 1,
                    Err(e) => s.fail(&e, Instant::now()),
                }
            }
        }
        Cmd::Http { addr, path } => {
            // A bare HTTP/1.1 GET is all the health and metrics checks need.
            let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
            c.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(c, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
            let mut raw = String::new();
            std::io::Read::read_to_string(&mut c, &mut raw)?;
            let status: u16 = raw.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
            let body = raw.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
            println!("{}", serde_json::json!({"status": status, "body": body}));
            return Ok(());
        }
        Cmd::Tcp { addr, hold_ms: Some(hold), interval_ms, timeout_ms, trace_file: _, .. } => {
            hold_tcp(addr, Duration::from_millis(hold), Duration::from_millis(interval_ms.max(1)), Duration::from_millis(timeout_ms), &mut s);
        }
        Cmd::Tcp { addr, count, interval_ms, timeout_ms, max_ms, hold_ms: None, trace_file } => {
            let deadline = Instant::now() + Duration::from_millis(max_ms);
            let mut trace = Trace::open(trace_file.as_deref())?;
            for _ in 0..count {
                if Instant::now() > deadline {
                    break;
                }
                s.attempts += 1;
                let t = epoch_ms();
                let before = s.ok;
                tcp_once(addr, Duration::from_millis(timeout_ms), &mut s);
                trace.record(t, &s, before);
                if interval_ms > 0 {
                    std::thread::sleep(Duration::from_millis(interval_ms));
                }
            }
        }
        Cmd::UdpStream { addr, interval_ms, max_ms, trace_file } => {
            let mut trace = Trace::open(trace_file.as_deref())?;
            let deadline = Instant::now() + Duration::from_millis(max_ms);
            let new_sock = || -> std::io::Result<UdpSocket> {
                let u = UdpSocket::bind(if addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" })?;
                u.set_read_timeout(Some(Duration::from_millis(500)))?;
                u.connect(addr)?;
                Ok(u)
            };
            let mut sock = new_sock()?;
            let mut buf = [0u8; 1500];
            while Instant::now() < deadline {
                s.attempts += 1;
                let t = epoch_ms();
                let before = s.ok;
                match sock.send(b"hi").and_then(|_| sock.recv(&mut buf)) {
                    Ok(n) => {
                        s.ok += 1;
                        let r = String::from_utf8_lossy(&buf[..n]).into_owned();
                        *s.replies.entry(r.clone()).or_default() += 1;
                        s.last_reply = r;
                    }
                    Err(e) => {
                        s.fail(&e, Instant::now());
                        // The socket is gone or stuck: a new one.
                        sock = new_sock()?;
                    }
                }
                trace.record(t, &s, before);
                std::thread::sleep(Duration::from_millis(interval_ms));
            }
        }
        Cmd::Udp { addr, count, connected, one_socket, timeout_ms, interval_ms } => {
            let new_sock = || -> anyhow::Result<UdpSocket> {
                let u = UdpSocket::bind(if addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" })?;
                u.set_read_timeout(Some(Duration::from_millis(timeout_ms)))?;
                Ok(u)
            };
            let mut sock = new_sock()?;
            for i in 0..count {
                if i > 0 && !one_socket {
                    sock = new_sock()?;
                }
                s.attempts += 1;
                udp_once(&sock, addr, connected, &mut s);
                if interval_ms > 0 {
                    std::thread::sleep(Duration::from_millis(interval_ms));
                }
            }
        }
    }
    s.print();
    let _ = std::io::stdout().flush();
    Ok(())
}
