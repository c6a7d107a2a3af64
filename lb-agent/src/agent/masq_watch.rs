//! Whether flows masqueraded in BPF (`nat_flags::LOCAL`) may still live
//! on a node whose agent does not make them (no `--bpf-forward`). The pod
//! programs translate their replies, so they stay until none is left, and
//! only then may `node_flags::NO_BPF_MASQUERADED` tell them to skip that
//! lookup. Until this agent's flags are written, the programs may still
//! make such flows under the earlier agent's flags: only a count from a
//! NAT pass that started after that write says none lives.

/// What the watch asks of the agent after a look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Look {
    /// Nothing yet.
    Wait,
    /// This agent's flags are written: start a NAT pass now (one that
    /// counts every flow made before).
    Pass,
    /// None is left: take the pod programs off where only they needed
    /// them, and set `NO_BPF_MASQUERADED`.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MasqWatch {
    /// None lives, and none can be made.
    Done,
    /// Some may live; `after`: the passes started when this agent's flags
    /// were written (None: not yet written).
    Pending { after: Option<u64> },
}

impl MasqWatch {
    /// At start: `forward` (this agent makes such flows itself: nothing to
    /// watch), `flows` (counted in the tables now), `earlier_masq` (the
    /// flags the earlier agent left have `BPF_FORWARD` with the
    /// masquerade on: such flows may be made until this agent's flags are
    /// written).
    pub fn start(forward: bool, flows: usize, earlier_masq: bool) -> Self {
        if forward || (flows == 0 && !earlier_masq) { MasqWatch::Done } else { MasqWatch::Pending { after: None } }
    }

    pub fn pending(&self) -> bool {
        matches!(self, MasqWatch::Pending { .. })
    }

    /// One look: `written` (this agent's flags are in the node config),
    /// `started` (NAT passes started so far), `last` (the last finished
    /// pass and its count of such flows).
    pub fn look(&mut self, written: bool, started: u64, last: (u64, usize)) -> Look {
        match *self {
            MasqWatch::Done => Look::Wait,
            MasqWatch::Pending { after: None } if written => {
                *self = MasqWatch::Pending { after: Some(started) };
                Look::Pass
            }
            MasqWatch::Pending { after: None } => Look::Wait,
            MasqWatch::Pending { after: Some(after) } => {
                let (pass, flows) = last;
                if pass > after && flows == 0 {
                    *self = MasqWatch::Done;
                    Look::Done
                } else {
                    Look::Wait
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_to_watch_where_no_such_flow_lives_or_can_be_made() {
        assert_eq!(MasqWatch::start(true, 5, true), MasqWatch::Done, "--bpf-forward makes them itself");
        assert_eq!(MasqWatch::start(false, 0, false), MasqWatch::Done);
        assert_eq!(MasqWatch::start(false, 1, false), MasqWatch::Pending { after: None });
        assert_eq!(MasqWatch::start(false, 0, true), MasqWatch::Pending { after: None }, "the earlier flags may still make some");
        let mut done = MasqWatch::Done;
        assert!(!done.pending());
        assert_eq!(done.look(true, 9, (9, 0)), Look::Wait);
    }

    #[test]
    fn only_a_pass_started_after_the_flags_were_written_counts() {
        let mut w = MasqWatch::start(false, 0, true);
        // Passes that count none, before this agent's flags are written:
        // the earlier flags may make a flow the next moment.
        assert_eq!(w.look(false, 3, (3, 0)), Look::Wait);
        assert_eq!(w.look(false, 4, (4, 0)), Look::Wait);
        // Written: a pass now.
        assert_eq!(w.look(true, 4, (4, 0)), Look::Pass);
        assert_eq!(w, MasqWatch::Pending { after: Some(4) });
        // Pass 4 started before the write (it may have missed a flow made
        // just before it), and pass 5 is under way: still nothing.
        assert_eq!(w.look(true, 5, (4, 0)), Look::Wait);
        // Pass 5 found a flow; so did 6.
        assert_eq!(w.look(true, 6, (5, 1)), Look::Wait);
        assert_eq!(w.look(true, 6, (6, 1)), Look::Wait);
        assert!(w.pending());
        // Pass 7 found none: done, once.
        assert_eq!(w.look(true, 7, (7, 0)), Look::Done);
        assert!(!w.pending());
        assert_eq!(w.look(true, 8, (8, 0)), Look::Wait);
    }

    #[test]
    fn flows_at_start_are_waited_for_too() {
        let mut w = MasqWatch::start(false, 2, false);
        assert_eq!(w.look(true, 0, (0, 2)), Look::Pass);
        // The count read at start is pass 0: it never decides.
        assert_eq!(w.look(true, 0, (0, 0)), Look::Wait);
        assert_eq!(w.look(true, 1, (1, 0)), Look::Done);
    }
}
