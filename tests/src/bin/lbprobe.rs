//! lbprobe: the pods of the netns mini-cluster. One binary plays a backend
//! server or a client; it enters its pod's network namespace and its node's
//! cgroup itself, before it opens any socket.
//!
//!   lbprobe --netns NS --cgroup DIR serve --name NAME --port P [--report-peer [--report-port]] [--ttl T]
//!   lbprobe --netns NS --cgroup DIR tcp --addr IP:PORT --count N [--sport P] [--linger0]
//!   lbprobe --netns NS --cgroup DIR udp --addr IP:PORT --count N [--connected]
//!           [--size N] [--ttl T] [--recverr]
//!   lbprobe --netns NS --cgroup DIR upload --addr IP:PORT --bytes N
//!
//! Clients print one JSON summary on stdout: what a user would see.
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
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
    /// Answer every TCP line and every UDP datagram with NAME. A TCP line
    /// "bulk N" gets N pattern bytes; "upload N" is followed by N pattern
    /// bytes, answered "NAME upload N ok" or "NAME upload bad at OFFSET". A
    /// datagram "big\n" + pattern bytes is answered "NAME bytes=LEN" (or
    /// "NAME bad").
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
        /// TCP only, one thread with epoll: for tens of thousands of
        /// connections at once (a thread each would exhaust the machine).
        #[arg(long)]
        many: bool,
        /// Send with this TTL / hop limit (both families).
        #[arg(long)]
        ttl: Option<u32>,
        /// With --report-peer: "NAME PEER-IP port=PEER-PORT".
        #[arg(long)]
        report_port: bool,
    },
    /// Benchmark client: connect, 1-byte request, 1-byte response, close,
    /// as fast as possible for SECS seconds, pinned to CPU `cpu`.
    Rate(RateArgs),
    /// `rate` against two addresses, alternating every `--batch`
    /// connections, each timed on its own: both see the same machine at
    /// the same moments, so their ratio is free of what drifts between
    /// two runs one after the other. Prints both rates and the ratio.
    RatePair {
        #[arg(long)]
        addr: SocketAddr,
        /// The baseline.
        #[arg(long)]
        baseline: SocketAddr,
        #[arg(long)]
        secs: f64,
        #[arg(long, default_value_t = 0)]
        cpu: usize,
        #[arg(long, default_value_t = 20)]
        batch: u32,
    },
    /// Benchmark client, UDP: send 16-byte datagrams from one connected
    /// socket as fast as possible for SECS seconds (pinned to CPU `cpu`),
    /// then ask the `--tiny` server how many arrived. Prints the datagrams
    /// delivered per second.
    UdpRate(RateArgs),
    /// UDP: send 16-byte datagrams with sendto() from one unconnected
    /// socket (each runs the sendmsg hook) for SECS seconds, answers
    /// unread. Prints how many were sent.
    UdpBlast(RateArgs),
    /// TCP: download N bytes of a known pattern and check every byte.
    Bulk {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        bytes: u64,
        /// Read timeout.
        #[arg(long, default_value_t = 10_000)]
        timeout_ms: u64,
    },
    /// TCP, half closed: ask for a reply WAIT_MS later ("later WAIT_MS"),
    /// shut down the sending side (a FIN), and read the reply until the
    /// server closes.
    HalfClosed {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        wait_ms: u64,
        /// Read timeout.
        #[arg(long, default_value_t = 10_000)]
        timeout_ms: u64,
    },
    /// TCP: upload N bytes of a known pattern; the server checks every byte.
    Upload {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        bytes: u64,
        /// Read and write timeout.
        #[arg(long, default_value_t = 10_000)]
        timeout_ms: u64,
    },
    /// TCP: open N connections at once, then ask each for a reply.
    Concurrent {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        count: u32,
        /// Hold all connections open this long before asking each.
        #[arg(long, default_value_t = 0)]
        hold_ms: u64,
    },
    /// TCP: connect to ADDR (the hooks give the socket its translation
    /// storage), then rewrite that storage through the pinned map PIN as an
    /// agent from before `sock_xlate::COUNTED` left it (the flags byte 0),
    /// send a line, read the reply, close.
    OlderStorage {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        pin: std::path::PathBuf,
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
        /// Bind every connection to this source port (SO_REUSEADDR).
        #[arg(long)]
        sport: Option<u16>,
        /// Bind every connection to this source address (a port the
        /// kernel picks, or --sport).
        #[arg(long)]
        src_addr: Option<std::net::IpAddr>,
        /// Close every connection with a RST (SO_LINGER 0): no TIME_WAIT,
        /// so the same source port can be used again at once.
        #[arg(long)]
        linger0: bool,
        /// Stop once this file exists, whatever the count (not with
        /// --hold-ms).
        #[arg(long)]
        stop_file: Option<std::path::PathBuf>,
    },
    /// Hold TCP connections to ADDR and connected UDP sockets to UDP_ADDR,
    /// each asked once (replies "held:POD"); touch DIR/ready. On DIR/churned:
    /// getpeername of each into peers; touch DIR/checked. On DIR/removed
    /// (holding a pod's name): ask again until every socket to that pod has
    /// failed ("cut:POD", errors) or 10 s passed ("stuck:POD"); the others
    /// once ("alive:POD", or "lost:POD").
    Hold {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        udp_addr: SocketAddr,
        #[arg(long)]
        tcp: u32,
        #[arg(long)]
        udp: u32,
        #[arg(long)]
        dir: std::path::PathBuf,
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
        /// Keep the socket when no reply comes (a fire-and-forget client:
        /// only an error makes it connect again).
        #[arg(long)]
        keep_on_timeout: bool,
        /// After an error keep the socket (the kernel may have disconnected
        /// it) and send with the address (sendto) from then on, as a
        /// client that disconnects and sends on does.
        #[arg(long)]
        sendto_after_error: bool,
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
        /// With --connected: send with sendto() to ADDR all the same (the
        /// kernel runs the sendmsg hooks for it).
        #[arg(long)]
        sendto: bool,
        /// Use one socket for every attempt (default: a new socket each time).
        #[arg(long)]
        one_socket: bool,
        #[arg(long, default_value_t = 0)]
        interval_ms: u64,
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
        /// Datagram size: 0 sends "hi"; N (at least 4) sends "big\n" and
        /// N-4 pattern bytes, which the server checks.
        #[arg(long, default_value_t = 0)]
        size: usize,
        /// With --size: send "echo\n" instead of "big\n": the server answers
        /// with a datagram as large ("... reply=LEN" in the summary).
        #[arg(long)]
        echo: bool,
        /// IP_TTL / IPV6_UNICAST_HOPS of the socket.
        #[arg(long)]
        ttl: Option<u32>,
        /// IP_RECVERR / IPV6_RECVERR: ICMP errors fail send/recv; after a
        /// failure the error queue is read into `offenders`.
        #[arg(long)]
        recverr: bool,
        /// Send from this source port (one flow per port).
        #[arg(long)]
        sport: Option<u16>,
        /// IPv4 options to send with every datagram (IP_OPTIONS), in hex;
        /// spaces are ignored.
        #[arg(long)]
        ip_option: Option<String>,
        /// IPv6: an extension header before every datagram's UDP header:
        /// "hbh" (hop-by-hop options, IPV6_HOPOPTS) or "dst" (destination
        /// options, IPV6_DSTOPTS), 8 bytes holding one PadN option, or
        /// "KIND:HEX" for a header of those bytes (spaces ignored).
        #[arg(long)]
        ip6_ext: Option<String>,
    },
}

/// What the benchmark clients are told: where, for how long, on which CPU.
#[derive(clap::Args)]
struct RateArgs {
    #[arg(long)]
    addr: SocketAddr,
    #[arg(long)]
    secs: f64,
    #[arg(long, default_value_t = 0)]
    cpu: usize,
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
    /// UDP --recverr: the error-queue entries, "icmp type=T code=C from=ADDR".
    offenders: BTreeMap<String, u32>,
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
            "offenders": self.offenders,
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

fn serve(name: String, port: u16, (report_peer, report_port): (bool, bool), ttl: Option<u32>) -> anyhow::Result<()> {
    // Dual-stack: [::] also takes IPv4 (net.ipv6.bindv6only is 0).
    let tcp = TcpListener::bind(("::", port))?;
    let udp = UdpSocket::bind(("::", port))?;
    if let Some(t) = ttl {
        // IP_TTL for the IPv4 side of a dual-stack socket; accepted TCP
        // connections inherit both.
        use nix::sys::socket::{setsockopt, sockopt};
        use std::os::fd::AsFd as _;
        let t = libc::c_int::try_from(t)?;
        for fd in [tcp.as_fd(), udp.as_fd()] {
            setsockopt(&fd, sockopt::Ipv4Ttl, &t)?;
            setsockopt(&fd, sockopt::Ipv6Ttl, &t)?;
        }
    }
    println!("ready");
    std::io::stdout().flush()?;
    let answer = move |name: &str, from: SocketAddr| match (report_peer, report_port) {
        (true, true) => format!("{name} {} port={}", peer_ip(from), from.port()),
        (true, false) => format!("{name} {}", peer_ip(from)),
        _ => name.to_string(),
    };
    let uname = name.clone();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, from)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(&udp_answer(answer(&uname, from), &buf[..n]), from);
        }
    });
    for conn in tcp.incoming() {
        let Ok(conn) = conn else { continue };
        let name = name.clone();
        std::thread::spawn(move || {
            let Ok(from) = conn.peer_addr() else { return };
            serve_conn(conn, &answer(&name, from));
        });
    }
    Ok(())
}

/// The server's answer to a datagram: `me`, and for a "big\n" datagram its
/// length, or "bad" if a pattern byte is wrong. An "echo\n" datagram is
/// answered as large as it came: "ME bytes=LEN echo\n" and pattern bytes.
fn udp_answer(me: String, d: &[u8]) -> Vec<u8> {
    let (rest, echo) = match (d.strip_prefix(b"big\n"), d.strip_prefix(b"echo\n")) {
        (Some(r), _) => (r, false),
        (_, Some(r)) => (r, true),
        _ => return me.into_bytes(),
    };
    if !rest.iter().enumerate().all(|(i, b)| *b == pattern(i as u64)) {
        return format!("{me} bad").into_bytes();
    }
    let line = format!("{me} bytes={}", d.len());
    if !echo {
        return line.into_bytes();
    }
    let mut out = format!("{line} echo\n").into_bytes();
    let pad = d.len().saturating_sub(out.len()) as u64;
    out.extend((0..pad).map(pattern));
    out
}

/// A datagram the client received, as its summary key: an echo answer
/// ("LINE\n" and pattern bytes) becomes "LINE reply=LEN" (or "LINE
/// reply=bad"), anything else its text.
fn udp_reply_key(d: &[u8]) -> String {
    if let Some(pos) = d.iter().position(|b| *b == b'\n') {
        let line = String::from_utf8_lossy(&d[..pos]);
        if line.ends_with(" echo") {
            let ok = d[pos + 1..].iter().enumerate().all(|(i, b)| *b == pattern(i as u64));
            return if ok { format!("{line} reply={}", d.len()) } else { format!("{line} reply=bad") };
        }
    }
    String::from_utf8_lossy(d).into_owned()
}

/// "WORD N" -> N.
fn parse_cmd(line: &str, word: &str) -> Option<u64> {
    line.strip_prefix(word)?.strip_prefix(' ')?.trim().parse().ok()
}

/// One TCP connection of `serve`: answer every line with `me` until the
/// client is gone. One buffered reader carries both the lines and the bytes
/// of an upload, so no byte is lost in its buffer.
fn serve_conn(conn: TcpStream, me: &str) {
    let Ok(mut w) = conn.try_clone() else { return };
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    loop {
        line.clear();
        match r.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let reply = if let Some(n) = parse_cmd(&line, "bulk") {
            let _ = write_pattern(&mut w, n);
            return;
        } else if let Some(ms) = parse_cmd(&line, "later") {
            std::thread::sleep(Duration::from_millis(ms));
            me.to_string()
        } else if let Some(n) = parse_cmd(&line, "upload") {
            match check_pattern(&mut r, n) {
                Ok(None) => format!("{me} upload {n} ok"),
                Ok(Some(off)) => format!("{me} upload bad at {off}"),
                Err(_) => return,
            }
        } else {
            me.to_string()
        };
        if w.write_all(format!("{reply}\n").as_bytes()).is_err() {
            return;
        }
    }
}

/// Write `n` bytes of the pattern.
fn write_pattern(w: &mut impl Write, n: u64) -> std::io::Result<()> {
    let mut off = 0u64;
    let mut buf = vec![0u8; 65536];
    while off < n {
        let len = (n - off).min(buf.len() as u64) as usize;
        for (j, b) in buf[..len].iter_mut().enumerate() {
            *b = pattern(off + j as u64);
        }
        w.write_all(&buf[..len])?;
        off += len as u64;
    }
    Ok(())
}

/// Read exactly `n` bytes and check them against the pattern: the offset of
/// the first wrong byte, if any. Fails if the stream ends early.
fn check_pattern(r: &mut impl std::io::Read, n: u64) -> std::io::Result<Option<u64>> {
    let mut off = 0u64;
    let mut bad = None;
    let mut buf = vec![0u8; 65536];
    while off < n {
        let len = (n - off).min(buf.len() as u64) as usize;
        let got = r.read(&mut buf[..len])?;
        if got == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if bad.is_none() {
            bad = buf[..got].iter().enumerate().find(|(j, b)| **b != pattern(off + *j as u64)).map(|(j, _)| off + j as u64);
        }
        off += got as u64;
    }
    Ok(bad)
}

/// `serve --many`: every TCP connection on one epoll loop; each line gets
/// the answer `serve` gives.
fn serve_many(name: &str, port: u16, report_peer: bool) -> anyhow::Result<()> {
    use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
    use std::collections::HashMap;
    use std::io::Read as _;
    use std::os::fd::AsRawFd as _;
    // SO_REUSEPORT: several of these share the port (one process holds
    // at most RLIMIT_NOFILE connections).
    let sock = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    sock.set_reuse_port(true)?;
    sock.set_only_v6(false)?;
    sock.bind(&SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)).into())?;
    sock.listen(4096)?;
    let tcp: TcpListener = sock.into();
    tcp.set_nonblocking(true)?;
    let ep = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
    let listener = u64::MAX;
    ep.add(&tcp, EpollEvent::new(EpollFlags::EPOLLIN, listener))?;
    println!("ready");
    std::io::stdout().flush()?;
    let mut conns: HashMap<u64, (TcpStream, SocketAddr, Vec<u8>)> = HashMap::new();
    let mut events = vec![EpollEvent::empty(); 1024];
    let mut buf = [0u8; 4096];
    loop {
        let n = ep.wait(&mut events, EpollTimeout::NONE)?;
        for ev in &events[..n] {
            if ev.data() == listener {
                while let Ok((c, from)) = tcp.accept() {
                    c.set_nonblocking(true)?;
                    let id = c.as_raw_fd() as u64;
                    ep.add(&c, EpollEvent::new(EpollFlags::EPOLLIN, id))?;
                    conns.insert(id, (c, from, Vec::new()));
                }
                continue;
            }
            let id = ev.data();
            let Some((c, from, pending)) = conns.get_mut(&id) else { continue };
            let done = loop {
                match c.read(&mut buf) {
                    Ok(0) => break true,
                    Ok(k) => pending.extend_from_slice(&buf[..k]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
                    Err(_) => break true,
                }
            };
            while let Some(i) = pending.iter().position(|b| *b == b'\n') {
                pending.drain(..=i);
                let answer = if report_peer { format!("{name} {}\n", peer_ip(*from)) } else { format!("{name}\n") };
                // A few bytes into an empty socket buffer: never blocks.
                let _ = c.write_all(answer.as_bytes());
            }
            if done && let Some((c, _, _)) = conns.remove(&id) {
                let _ = ep.delete(&c);
            }
        }
    }
}

/// One short connection of the rate benchmarks: connect, a 1-byte
/// request, a 1-byte response, close. `port`: the local port it used.
fn short_conn(addr: &SocketAddr, port: &mut u16) -> std::io::Result<()> {
    let mut c = connect_noting_port(addr, Duration::from_secs(1), port)?;
    c.set_read_timeout(Some(Duration::from_secs(1)))?;
    c.write_all(b"x")?;
    let mut buf = [0u8; 1];
    std::io::Read::read_exact(&mut c, &mut buf)?;
    // Close with a RST: no TIME_WAIT on either side, so the same 4-tuple
    // can come back in a later round at once.
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    nix::sys::socket::setsockopt(&c, nix::sys::socket::sockopt::Linger, &linger).map_err(std::io::Error::from)?;
    Ok(())
}

/// `TcpStream::connect_timeout`, the same syscalls, but the client port is
/// noted as soon as connect() picked it: a connection that never completes
/// names its port too.
fn connect_noting_port(addr: &SocketAddr, timeout: Duration, port: &mut u16) -> std::io::Result<TcpStream> {
    use std::os::fd::AsFd as _;
    let s = socket2::Socket::new(socket2::Domain::for_address(*addr), socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    s.set_nonblocking(true)?;
    match s.connect(&(*addr).into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    *port = s.local_addr()?.as_socket().map_or(0, |a| a.port());
    let mut fds = [nix::poll::PollFd::new(s.as_fd(), nix::poll::PollFlags::POLLOUT)];
    let ms = nix::poll::PollTimeout::try_from(timeout.as_millis() as i32).unwrap_or(nix::poll::PollTimeout::MAX);
    if nix::poll::poll(&mut fds, ms).map_err(std::io::Error::from)? == 0 {
        return Err(std::io::Error::from(std::io::ErrorKind::TimedOut));
    }
    if let Some(e) = s.take_error()? {
        return Err(e);
    }
    s.set_nonblocking(false)?;
    Ok(s.into())
}

fn pin(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok() {
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    }
}

/// The benchmark server: 1 byte in, 1 byte out, then wait for the client's
/// close (a RST: no TIME_WAIT anywhere). On UDP it counts datagrams and
/// answers "stat" with the count since the last "stat".
fn serve_tiny(port: u16, cpu: usize) -> anyhow::Result<()> {
    pin(cpu);
    let tcp = TcpListener::bind(("::", port))?;
    let udp = UdpSocket::bind(("::", port))?;
    std::thread::spawn(move || {
        pin(cpu);
        let mut buf = [0u8; 64];
        let mut count = 0u64;
        while let Ok((n, from)) = udp.recv_from(&mut buf) {
            if &buf[..n] == b"stat" {
                let _ = udp.send_to(count.to_string().as_bytes(), from);
                count = 0;
            } else {
                count += 1;
            }
        }
    });
    println!("ready");
    std::io::stdout().flush()?;
    let mut buf = [0u8; 1];
    for conn in tcp.incoming() {
        let Ok(mut c) = conn else { continue };
        let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
        // One connection at a time: one that never ends (its client's RST
        // lost on the way) holds up the next ones for a second; say so.
        let peer = c.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        match std::io::Read::read_exact(&mut c, &mut buf) {
            Ok(()) if c.write_all(&buf).is_ok() => {
                if let Err(e) = std::io::Read::read(&mut c, &mut buf)
                    && e.kind() == std::io::ErrorKind::WouldBlock
                {
                    eprintln!("lbprobe serve: {peer}: no close from the client within 1 s");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => eprintln!("lbprobe serve: {peer}: no request within 1 s"),
            _ => {}
        }
    }
    Ok(())
}

/// Allow many sockets (the concurrent-flows client and its server): as root,
/// raise the hard limit too.
fn raise_nofile() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls with valid pointers.
    unsafe {
        let want = libc::rlimit { rlim_cur: 1 << 17, rlim_max: 1 << 17 };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
            return;
        }
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// Options of the TCP clients.
struct TcpOpts {
    timeout: Duration,
    /// Bind to this source port first (with SO_REUSEADDR).
    sport: Option<u16>,
    /// Bind to this source address first.
    src: Option<std::net::IpAddr>,
    /// Close with a RST (SO_LINGER 0): no TIME_WAIT.
    linger0: bool,
}

/// Connect within `timeout`, from source port `sport` and address `src`
/// if given.
fn tcp_connect(addr: SocketAddr, timeout: Duration, sport: Option<u16>, src: Option<std::net::IpAddr>) -> std::io::Result<TcpStream> {
    if sport.is_none() && src.is_none() {
        return TcpStream::connect_timeout(&addr, timeout);
    }
    let sock = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    sock.set_reuse_address(true)?;
    let port = sport.unwrap_or(0);
    sock.bind(&src.map_or_else(|| any_addr(addr, port), |ip| SocketAddr::new(ip, port)).into())?;
    sock.connect_timeout(&addr.into(), timeout)?;
    Ok(sock.into())
}

/// The unspecified address of `addr`'s family, with `port`.
fn any_addr(addr: SocketAddr, port: u16) -> SocketAddr {
    if addr.is_ipv4() { ([0, 0, 0, 0], port).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, port).into() }
}

/// SO_LINGER {on, 0}: close() sends a RST.
fn set_linger0(c: &TcpStream) -> std::io::Result<()> {
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    nix::sys::socket::setsockopt(c, nix::sys::socket::sockopt::Linger, &linger).map_err(std::io::Error::from)
}

fn tcp_once(addr: SocketAddr, o: &TcpOpts, s: &mut Summary) {
    let started = Instant::now();
    let timeout = o.timeout;
    let r = (|| -> std::io::Result<(String, String)> {
        let mut c = tcp_connect(addr, timeout, o.sport, o.src)?;
        if o.linger0 {
            set_linger0(&c)?;
        }
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
fn hold_tcp(addr: SocketAddr, hold: Duration, interval: Duration, o: &TcpOpts, s: &mut Summary) {
    let started = Instant::now();
    let conn = tcp_connect(addr, o.timeout, o.sport, o.src).and_then(|c| {
        c.set_read_timeout(Some(o.timeout))?;
        if o.linger0 {
            set_linger0(&c)?;
        }
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

/// TCP `upload`: the pattern out, the server's verdict line back.
fn upload(addr: SocketAddr, bytes: u64, timeout: Duration, s: &mut Summary) {
    s.attempts = 1;
    let started = Instant::now();
    let r = (|| -> std::io::Result<String> {
        let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        c.set_read_timeout(Some(timeout))?;
        c.set_write_timeout(Some(timeout))?;
        c.write_all(format!("upload {bytes}\n").as_bytes())?;
        write_pattern(&mut c, bytes)?;
        let mut line = String::new();
        BufReader::new(&mut c).read_line(&mut line)?;
        if line.is_empty() {
            return Err(std::io::Error::from_raw_os_error(libc::ECONNRESET));
        }
        Ok(line.trim().to_string())
    })();
    match r {
        Ok(line) if line.ends_with(" ok") => {
            s.ok = 1;
            *s.replies.entry(line.clone()).or_default() += 1;
            s.last_reply = line;
        }
        Ok(line) => *s.errors.entry(format!("bad reply: {line}")).or_default() += 1,
        Err(e) => s.fail(&e, started),
    }
}

/// What the `udp` client sends, and how.
struct UdpOpts {
    connected: bool,
    sendto: bool,
    payload: Vec<u8>,
    recverr: bool,
}

/// The datagram of `udp --size N`: "hi" for 0, else "big\n" and N-4
/// pattern bytes.
fn udp_payload(size: usize) -> anyhow::Result<Vec<u8>> {
    match size {
        0 => Ok(b"hi".to_vec()),
        1..4 => anyhow::bail!("--size must be 0 or at least 4"),
        _ => Ok(b"big\n".iter().copied().chain((0..(size - 4) as u64).map(pattern)).collect()),
    }
}

/// A client socket of `udp`, bound to the unspecified address of `addr`'s family.
fn udp_socket(
    addr: SocketAddr,
    timeout: Duration,
    ttl: Option<u32>,
    recverr: bool,
    sport: Option<u16>,
    ip_option: Option<&str>,
    ip6_ext: Option<&str>,
) -> anyhow::Result<UdpSocket> {
    use nix::sys::socket::{setsockopt, sockopt};
    let u = UdpSocket::bind(any_addr(addr, sport.unwrap_or(0)))?;
    if let Some(ext) = ip6_ext {
        let (kind, hex) = ext.split_once(':').unwrap_or((ext, "00000104 00000000"));
        let opt = match kind {
            "hbh" => libc::IPV6_HOPOPTS,
            "dst" => libc::IPV6_DSTOPTS,
            k => anyhow::bail!("--ip6-ext {k}: hbh or dst"),
        };
        // Default: next header (the kernel fills it in), length 0 (8
        // bytes), PadN of 4.
        let hex: String = hex.chars().filter(|c| !c.is_whitespace()).collect();
        let hdr: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16)).collect::<Result<_, _>>()?;
        // SAFETY: a plain setsockopt with a buffer of the given length.
        let rc = unsafe { libc::setsockopt(std::os::fd::AsRawFd::as_raw_fd(&u), libc::IPPROTO_IPV6, opt, hdr.as_ptr().cast(), hdr.len() as libc::socklen_t) };
        if rc != 0 {
            return Err(anyhow::Error::from(std::io::Error::last_os_error()).context("setsockopt --ip6-ext"));
        }
    }
    if let Some(hex) = ip_option {
        let hex: String = hex.chars().filter(|c| !c.is_whitespace()).collect();
        let bytes: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16)).collect::<Result<_, _>>()?;
        // SAFETY: a plain setsockopt with a buffer of the given length.
        let rc = unsafe {
            libc::setsockopt(std::os::fd::AsRawFd::as_raw_fd(&u), libc::IPPROTO_IP, libc::IP_OPTIONS, bytes.as_ptr().cast(), bytes.len() as libc::socklen_t)
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
    }
    u.set_read_timeout(Some(timeout))?;
    if let Some(t) = ttl {
        let t = libc::c_int::try_from(t)?;
        if addr.is_ipv4() {
            setsockopt(&u, sockopt::Ipv4Ttl, &t)?;
        } else {
            setsockopt(&u, sockopt::Ipv6Ttl, &t)?;
        }
    }
    if recverr {
        if addr.is_ipv4() {
            setsockopt(&u, sockopt::Ipv4RecvErr, &true)?;
        } else {
            setsockopt(&u, sockopt::Ipv6RecvErr, &true)?;
        }
    }
    Ok(u)
}

/// Read the socket's error queue (IP_RECVERR) into `s.offenders`.
fn drain_errqueue(sock: &UdpSocket, s: &mut Summary) {
    use nix::sys::socket::{MsgFlags, recvmsg};
    let mut data = [0u8; 64];
    loop {
        let mut iov = [std::io::IoSliceMut::new(&mut data)];
        // Room for a sock_extended_err and its offender (what nix's
        // cmsg_space! allocates, with headers to spare).
        let mut cmsg = vec![0u8; 256];
        let flags = MsgFlags::MSG_ERRQUEUE | MsgFlags::MSG_DONTWAIT;
        // Each successful read dequeues one entry; an empty queue is EAGAIN.
        let Ok(msg) = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), flags) else { return };
        let Ok(cmsgs) = msg.cmsgs() else { return };
        for c in cmsgs {
            if let Some(key) = offender_key(&c) {
                *s.offenders.entry(key).or_default() += 1;
            }
        }
    }
}

/// "icmp type=T code=C from=ADDR" ("icmp6" for ICMPv6) for an error-queue
/// entry; a local error (e.g. EMSGSIZE, info = the path MTU) is
/// "local errno=E info=I".
fn offender_key(c: &nix::sys::socket::ControlMessageOwned) -> Option<String> {
    use nix::sys::socket::ControlMessageOwned::{Ipv4RecvErr, Ipv6RecvErr};
    let (ee, from) = match c {
        Ipv4RecvErr(ee, a) => {
            let ip = a.filter(|a| a.sin_family == libc::AF_INET as libc::sa_family_t).map(|a| IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr))));
            (ee, ip)
        }
        Ipv6RecvErr(ee, a) => {
            let ip = a.filter(|a| a.sin6_family == libc::AF_INET6 as libc::sa_family_t).map(|a| {
                let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
                ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4)
            });
            (ee, ip)
        }
        _ => return None,
    };
    let from = from.map_or("?".to_string(), |ip| ip.to_string());
    Some(match ee.ee_origin {
        libc::SO_EE_ORIGIN_ICMP => format!("icmp type={} code={} from={from}", ee.ee_type, ee.ee_code),
        libc::SO_EE_ORIGIN_ICMP6 => format!("icmp6 type={} code={} from={from}", ee.ee_type, ee.ee_code),
        libc::SO_EE_ORIGIN_LOCAL => {
            format!("local errno={:?} info={}", nix::errno::Errno::from_raw(ee.ee_errno as i32), ee.ee_info)
        }
        o => format!("origin={o} errno={:?} from={from}", nix::errno::Errno::from_raw(ee.ee_errno as i32)),
    })
}

fn udp_once(sock: &UdpSocket, addr: SocketAddr, o: &UdpOpts, s: &mut Summary) {
    let started = Instant::now();
    let r = (|| -> std::io::Result<(String, String)> {
        let mut buf = vec![0u8; 65536];
        if o.connected {
            sock.connect(addr)?;
            if o.sendto {
                sock.send_to(&o.payload, addr)?;
            } else {
                sock.send(&o.payload)?;
            }
            let n = sock.recv(&mut buf)?;
            // What the socket believes it is connected to.
            let peer = sock.peer_addr()?.to_string();
            Ok((udp_reply_key(&buf[..n]), peer))
        } else {
            sock.send_to(&o.payload, addr)?;
            let (n, from) = sock.recv_from(&mut buf)?;
            Ok((udp_reply_key(&buf[..n]), from.to_string()))
        }
    })();
    match r {
        Ok((reply, from)) => {
            s.ok += 1;
            *s.replies.entry(reply).or_default() += 1;
            *s.peers.entry(from).or_default() += 1;
        }
        Err(e) => {
            s.fail(&e, started);
            if o.recverr {
                drain_errqueue(sock, s);
            }
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    enter(cli.netns.as_deref(), cli.cgroup.as_deref())?;
    let mut s = Summary::default();
    match cli.cmd {
        Cmd::Serve { port, tiny: Some(cpu), .. } => return serve_tiny(port, cpu),
        Cmd::Serve { name, port, report_peer, many: true, .. } => {
            raise_nofile();
            return serve_many(&name, port, report_peer);
        }
        Cmd::Serve { name, port, report_peer, tiny: None, ttl, report_port, .. } => {
            raise_nofile();
            return serve(name, port, (report_peer, report_port), ttl);
        }
        Cmd::Rate(RateArgs { addr, secs, cpu }) => {
            pin(cpu);
            let end = Instant::now() + Duration::from_secs_f64(secs);
            let started = Instant::now();
            // The slowest connection (a lost packet shows as a stall).
            let mut slowest = Duration::ZERO;
            let mut slowest_port = 0;
            while Instant::now() < end {
                s.attempts += 1;
                let t = Instant::now();
                let mut port = 0;
                let r = short_conn(&addr, &mut port);
                if t.elapsed() > slowest {
                    slowest = t.elapsed();
                    slowest_port = port;
                }
                match r {
                    Ok(()) => s.ok += 1,
                    Err(e) => s.fail(&e, Instant::now()),
                }
            }
            let el = started.elapsed().as_secs_f64();
            let slowest_ms = slowest.as_secs_f64() * 1e3;
            println!("{}", serde_json::json!({"attempts": s.attempts, "ok": s.ok, "errors": s.errors, "secs": el, "rate": s.ok as f64 / el, "slowest_ms": slowest_ms, "slowest_port": slowest_port}));
            return Ok(());
        }
        Cmd::RatePair { addr, baseline, secs, cpu, batch } => {
            pin(cpu);
            let end = Instant::now() + Duration::from_secs_f64(secs);
            // [baseline, addr]: connections made, time spent, failures.
            let mut ok = [0u64; 2];
            let mut spent = [Duration::ZERO; 2];
            let mut failed = [0u64; 2];
            let mut turn = 0;
            while Instant::now() < end {
                let a = if turn == 0 { baseline } else { addr };
                let t = Instant::now();
                for _ in 0..batch {
                    match short_conn(&a, &mut 0) {
                        Ok(()) => ok[turn] += 1,
                        Err(_) => failed[turn] += 1,
                    }
                }
                spent[turn] += t.elapsed();
                turn ^= 1;
            }
            let rate = |i: usize| ok[i] as f64 / spent[i].as_secs_f64().max(1e-9);
            println!(
                "{}",
                serde_json::json!({"rate": rate(1), "baseline_rate": rate(0), "ratio": rate(1) / rate(0), "ok": ok[1], "baseline_ok": ok[0], "failed": failed[1], "baseline_failed": failed[0]})
            );
            return Ok(());
        }
        Cmd::UdpRate(RateArgs { addr, secs, cpu }) => {
            pin(cpu);
            let sock = UdpSocket::bind(any_addr(addr, 0))?;
            sock.connect(addr)?;
            let started = Instant::now();
            let end = started + Duration::from_secs_f64(secs);
            let mut sent = 0u64;
            let datagram = [b'x'; 16];
            while Instant::now() < end {
                // A burst between clock reads.
                for _ in 0..64 {
                    if sock.send(&datagram).is_ok() {
                        sent += 1;
                    }
                }
            }
            let el = started.elapsed().as_secs_f64();
            // Let the last datagrams arrive, then ask for the count.
            std::thread::sleep(Duration::from_millis(300));
            sock.set_read_timeout(Some(Duration::from_millis(500)))?;
            let mut buf = [0u8; 64];
            let mut received = None;
            for _ in 0..5 {
                sock.send(b"stat")?;
                if let Ok(n) = sock.recv(&mut buf) {
                    received = std::str::from_utf8(&buf[..n]).ok().and_then(|t| t.parse::<u64>().ok());
                    break;
                }
            }
            let Some(received) = received else { anyhow::bail!("no count from the server at {addr}") };
            println!("{}", serde_json::json!({"sent": sent, "received": received, "secs": el, "rate": received as f64 / el}));
            return Ok(());
        }
        Cmd::UdpBlast(RateArgs { addr, secs, cpu }) => {
            pin(cpu);
            let sock = UdpSocket::bind(any_addr(addr, 0))?;
            let end = Instant::now() + Duration::from_secs_f64(secs);
            let mut sent = 0u64;
            while Instant::now() < end {
                for _ in 0..64 {
                    if sock.send_to(&[b'x'; 16], addr).is_ok() {
                        sent += 1;
                    }
                }
            }
            println!("{}", serde_json::json!({"sent": sent}));
            return Ok(());
        }
        Cmd::HalfClosed { addr, wait_ms, timeout_ms } => {
            s.attempts = 1;
            let started = Instant::now();
            let r = (|| -> std::io::Result<String> {
                let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
                c.set_read_timeout(Some(Duration::from_millis(timeout_ms)))?;
                c.write_all(format!("later {wait_ms}\n").as_bytes())?;
                c.shutdown(std::net::Shutdown::Write)?;
                let mut reply = String::new();
                std::io::Read::read_to_string(&mut c, &mut reply)?;
                Ok(reply.trim().to_string())
            })();
            match r {
                Ok(reply) if !reply.is_empty() => {
                    s.ok = 1;
                    *s.replies.entry(reply).or_default() += 1;
                }
                Ok(_) => *s.errors.entry("closed without a reply".to_string()).or_default() += 1,
                Err(e) => s.fail(&e, started),
            }
        }
        Cmd::Bulk { addr, bytes, timeout_ms } => {
            s.attempts = 1;
            let started = Instant::now();
            let r = (|| -> std::io::Result<u64> {
                let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
                c.set_read_timeout(Some(Duration::from_millis(timeout_ms)))?;
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
        Cmd::Upload { addr, bytes, timeout_ms } => upload(addr, bytes, Duration::from_millis(timeout_ms), &mut s),
        Cmd::Concurrent { addr, count, hold_ms } => {
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
            std::thread::sleep(Duration::from_millis(hold_ms));
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
        Cmd::OlderStorage { addr, pin } => {
            use aya::maps::{Map, MapData, SkStorage};
            const SIZE: usize = size_of::<lb_common::SockXlate>();
            s.attempts += 1;
            let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
            let mut storage: SkStorage<MapData, [u8; SIZE]> = SkStorage::try_from(Map::SkStorage(MapData::from_pin(&pin)?))?;
            let mut v = anyhow::Context::context(storage.get(&c, 0), "the socket's translation storage")?;
            v[std::mem::offset_of!(lb_common::SockXlate, _pad)] = 0;
            storage.insert(&c, v, 0)?;
            c.set_read_timeout(Some(Duration::from_secs(2)))?;
            writeln!(c, "hi")?;
            let mut line = String::new();
            BufReader::new(&c).read_line(&mut line)?;
            s.ok += 1;
            *s.replies.entry(line.split_whitespace().next().unwrap_or("").to_string()).or_default() += 1;
            *s.peers.entry(c.peer_addr()?.to_string()).or_default() += 1;
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
        Cmd::Tcp { addr, hold_ms: Some(hold), interval_ms, timeout_ms, linger0, trace_file: _, sport, src_addr, .. } => {
            let o = TcpOpts { timeout: Duration::from_millis(timeout_ms), sport, src: src_addr, linger0 };
            hold_tcp(addr, Duration::from_millis(hold), Duration::from_millis(interval_ms.max(1)), &o, &mut s);
        }
        Cmd::Tcp { addr, count, interval_ms, timeout_ms, max_ms, hold_ms: None, trace_file, sport, src_addr, linger0, stop_file } => {
            let o = TcpOpts { timeout: Duration::from_millis(timeout_ms), sport, src: src_addr, linger0 };
            let deadline = Instant::now() + Duration::from_millis(max_ms);
            let mut trace = Trace::open(trace_file.as_deref())?;
            for _ in 0..count {
                if Instant::now() > deadline || stop_file.as_ref().is_some_and(|f| f.exists()) {
                    break;
                }
                s.attempts += 1;
                let t = epoch_ms();
                let before = s.ok;
                tcp_once(addr, &o, &mut s);
                trace.record(t, &s, before);
                if interval_ms > 0 {
                    std::thread::sleep(Duration::from_millis(interval_ms));
                }
            }
        }
        Cmd::Hold { addr, udp_addr, tcp, udp, dir } => {
            raise_nofile();
            enum Held {
                Tcp(BufReader<TcpStream>),
                Udp(UdpSocket),
            }
            fn ask(h: &mut Held) -> std::io::Result<String> {
                match h {
                    Held::Tcp(r) => {
                        r.get_mut().write_all(b"hi\n")?;
                        let mut line = String::new();
                        if r.read_line(&mut line)? == 0 {
                            return Err(std::io::Error::from_raw_os_error(libc::ECONNRESET));
                        }
                        Ok(line.trim().to_string())
                    }
                    Held::Udp(u) => {
                        let mut buf = [0u8; 1500];
                        u.send(b"hi")?;
                        let n = u.recv(&mut buf)?;
                        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
                    }
                }
            }
            let wait_for = |name: &str| -> anyhow::Result<String> {
                let deadline = Instant::now() + Duration::from_secs(120);
                loop {
                    if let Ok(s) = std::fs::read_to_string(dir.join(name)) {
                        return Ok(s.trim().to_string());
                    }
                    anyhow::ensure!(Instant::now() < deadline, "no {name} cue");
                    std::thread::sleep(Duration::from_millis(20));
                }
            };
            let mut held: Vec<(Held, String)> = Vec::new();
            for i in 0..tcp + udp {
                let h = if i < tcp {
                    let c = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
                    c.set_read_timeout(Some(Duration::from_secs(1)))?;
                    Held::Tcp(BufReader::new(c))
                } else {
                    let u = UdpSocket::bind(if udp_addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" })?;
                    u.set_read_timeout(Some(Duration::from_millis(500)))?;
                    u.connect(udp_addr)?;
                    Held::Udp(u)
                };
                let mut h = h;
                let pod = ask(&mut h)?;
                *s.replies.entry(format!("held:{pod}")).or_default() += 1;
                held.push((h, pod));
            }
            std::fs::write(dir.join("ready"), "")?;
            wait_for("churned")?;
            for (h, _) in &held {
                let peer = match h {
                    Held::Tcp(r) => r.get_ref().peer_addr(),
                    Held::Udp(u) => u.peer_addr(),
                };
                *s.peers.entry(peer.map_or_else(|e| e.to_string(), |p| p.to_string())).or_default() += 1;
            }
            std::fs::write(dir.join("checked"), "")?;
            let removed = wait_for("removed")?;
            let started = Instant::now();
            let mut cut = vec![false; held.len()];
            loop {
                let mut waiting = 0;
                for (i, (h, pod)) in held.iter_mut().enumerate() {
                    if *pod != removed || cut[i] {
                        continue;
                    }
                    s.attempts += 1;
                    if let Err(e) = ask(h) {
                        s.fail(&e, started);
                        cut[i] = true;
                        *s.replies.entry(format!("cut:{pod}")).or_default() += 1;
                    } else {
                        s.ok += 1;
                        waiting += 1;
                    }
                }
                if waiting == 0 || started.elapsed() > Duration::from_secs(10) {
                    if waiting > 0 {
                        *s.replies.entry(format!("stuck:{removed}")).or_default() += waiting;
                    }
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            for (h, pod) in held.iter_mut().filter(|(_, p)| *p != removed) {
                s.attempts += 1;
                match ask(h) {
                    Ok(_) => {
                        s.ok += 1;
                        *s.replies.entry(format!("alive:{pod}")).or_default() += 1;
                    }
                    Err(e) => {
                        s.fail(&e, started);
                        *s.replies.entry(format!("lost:{pod}")).or_default() += 1;
                    }
                }
            }
        }
        Cmd::UdpStream { addr, interval_ms, max_ms, keep_on_timeout, sendto_after_error, trace_file } => {
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
            let mut sendto = false;
            while Instant::now() < deadline {
                s.attempts += 1;
                let t = epoch_ms();
                let before = s.ok;
                let once = if sendto {
                    sock.send_to(b"hi", addr).and_then(|_| sock.recv_from(&mut buf).map(|(n, _)| n))
                } else {
                    sock.send(b"hi").and_then(|_| sock.recv(&mut buf))
                };
                match once {
                    Ok(n) => {
                        s.ok += 1;
                        let r = String::from_utf8_lossy(&buf[..n]).into_owned();
                        *s.replies.entry(r.clone()).or_default() += 1;
                        s.last_reply = r;
                    }
                    Err(e) => {
                        s.fail(&e, Instant::now());
                        // The socket is gone or stuck: a new one.
                        let timeout = matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut);
                        if sendto_after_error && !timeout {
                            sendto = true;
                        } else if !(keep_on_timeout && timeout) {
                            sock = new_sock()?;
                        }
                    }
                }
                trace.record(t, &s, before);
                std::thread::sleep(Duration::from_millis(interval_ms));
            }
        }
        Cmd::Udp { addr, count, connected, sendto, one_socket, timeout_ms, interval_ms, size, echo, ttl, recverr, sport, ip_option, ip6_ext } => {
            let mut payload = udp_payload(size)?;
            if echo && size >= 5 {
                payload = b"echo\n".iter().copied().chain((0..(size - 5) as u64).map(pattern)).collect();
            }
            let o = UdpOpts { connected, sendto, payload, recverr };
            let new_sock = || udp_socket(addr, Duration::from_millis(timeout_ms), ttl, recverr, sport, ip_option.as_deref(), ip6_ext.as_deref());
            let mut sock = new_sock()?;
            for i in 0..count {
                if i > 0 && !one_socket {
                    sock = new_sock()?;
                }
                s.attempts += 1;
                udp_once(&sock, addr, &o, &mut s);
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
