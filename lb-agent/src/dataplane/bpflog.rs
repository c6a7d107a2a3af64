//! `--bpf-log`: the programs' aya-log records, at the level the flag asks
//! for, into the agent's log.

/// `--bpf-log`: the level of the programs' aya-log records (`off`: none;
/// the records are compiled in, and removed at load).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BpfLog {
    #[default]
    Off,
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl BpfLog {
    /// aya-log's level number (Error = 1 .. Trace = 5); 0 turns all off.
    pub(super) fn level(self) -> u8 {
        match self {
            BpfLog::Off => 0,
            BpfLog::Error => aya_log::Level::Error as u8,
            BpfLog::Warn => aya_log::Level::Warn as u8,
            BpfLog::Info => aya_log::Level::Info as u8,
            BpfLog::Debug => aya_log::Level::Debug as u8,
            BpfLog::Trace => aya_log::Level::Trace as u8,
        }
    }
}

/// The programs' log records, into the agent's log (target `lb_bpf`, at
/// info level whatever their own, so that RUST_LOG=info shows what
/// `--bpf-log` asked for).
pub struct BpfLogSink;

impl log::Log for BpfLogSink {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, r: &log::Record<'_>) {
        let msg = r.args().to_string();
        tracing::info!(target: "lb_bpf", level = %r.level(), "{}", hook_words(&msg));
    }
    fn flush(&self) {}
}

/// The programs' decision lines start with `hook << 8 | protocol` as a
/// number and end with ` why=W errno=N` (arguments the verifier walks
/// cheaply): write them as the monitor does, `connect TCP FRONT -> BACKEND
/// (why)`, `... -> ECONNREFUSED (why)` or, for a drop no sender is told
/// of, `... -> dropped (source range)`.
pub(super) fn hook_words(msg: &str) -> String {
    let Some((code, rest)) = msg.split_once(' ') else { return msg.to_string() };
    let Ok(code) = code.parse::<u16>() else { return msg.to_string() };
    let proto = match code as u8 {
        lb_common::PROTO_TCP => "TCP",
        lb_common::PROTO_UDP => "UDP",
        _ => return msg.to_string(),
    };
    let mut rest = rest.to_string();
    if let Some((head, tail)) = rest.rsplit_once(" why=")
        && let Some((why, errno)) = tail.split_once(" errno=")
        && let (Ok(why), Ok(errno)) = (why.parse::<u8>(), errno.parse::<i32>())
    {
        let reason = lb_common::monitor::why_name(why);
        let dropped = why == lb_common::monitor::WHY_SOURCE_RANGE;
        rest = match (errno, head.split_once(" -> ")) {
            (0, _) if !dropped => format!("{head} ({reason})"),
            (0, Some((front, _))) => format!("{front} -> dropped ({reason})"),
            (e, Some((front, _))) => format!("{front} -> {:?} ({reason})", nix::errno::Errno::from_raw(e)),
            _ => format!("{head} ({reason})"),
        };
    }
    format!("{} {proto} {rest}", lb_common::monitor::hook_name((code >> 8) as u8))
}

#[cfg(test)]
mod tests {
    #[test]
    fn decision_lines_name_their_hook_and_protocol() {
        assert_eq!(super::hook_words("262 10.96.0.10:80 -> 10.0.0.1:8080 why=1 errno=0"), "connect TCP 10.96.0.10:80 -> 10.0.0.1:8080 (translated)");
        assert_eq!(super::hook_words("785 [fd00::1]:53 -> [::]:0 why=4 errno=111"), "tc UDP [fd00::1]:53 -> ECONNREFUSED (no endpoints)");
        assert_eq!(super::hook_words("1286 10.100.0.10:80 -> 0.0.0.0:0 why=8 errno=0"), "egress TCP 10.100.0.10:80 -> dropped (source range)");
        assert_eq!(super::hook_words("1297 10.100.0.10:80 -> 0.0.0.0:0 why=8 errno=1"), "egress UDP 10.100.0.10:80 -> EPERM (source range)");
        assert_eq!(super::hook_words("something else"), "something else");
        assert_eq!(super::hook_words("12 not a hook"), "12 not a hook");
    }
}
