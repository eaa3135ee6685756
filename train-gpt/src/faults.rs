//! Fault injection for the tests of crash safety: `FERROTRON_CRASH_AT=<point>@<step>`
//! ends the process abruptly (exit status 86, nothing flushed or cleaned up) when the save
//! of that step reaches that point, as a node failing there would (without `@<step>`, the
//! first save that reaches it). Points: `before the shards`, `after the shards`,
//! `before the trainer state`, `before the rename`, `before the marker`.
//!
//! `FERROTRON_KILL_AT=<world rank>@<step>` makes that rank's process kill itself with
//! SIGKILL after that step, as a node that disappears would (with ranks as processes,
//! under MPI; with ranks as threads the whole process goes).
//!
//! `FERROTRON_FAIL_COLLECTIVE=<world rank>@<step>[:<group>[:<call>]]` makes one call of
//! that rank in that step fail as a broken link fails it (see [`FailCollective`]).

/// The status a crash at an injected point exits with.
pub const CRASH_STATUS: i32 = 86;

/// Crashes here, in the save of `step`, if `FERROTRON_CRASH_AT` names this point.
pub fn point(point: &str, step: usize) {
    let Ok(at) = std::env::var("FERROTRON_CRASH_AT") else {
        return;
    };
    let (name, at_step) = match at.split_once('@') {
        Some((name, step)) => (name, step.parse().ok()),
        None => (at.as_str(), None),
    };
    if name == point && at_step.is_none_or(|s: usize| s == step) {
        eprintln!("crash injected {point} of the save of step {step} (FERROTRON_CRASH_AT)");
        std::process::exit(CRASH_STATUS);
    }
}

/// Kills this process with SIGKILL after `step` if `FERROTRON_KILL_AT` names this world
/// rank and step.
pub fn kill_point(rank: usize, step: usize) {
    let Ok(at) = std::env::var("FERROTRON_KILL_AT") else {
        return;
    };
    let parsed = at
        .split_once('@')
        .and_then(|(r, s)| Some((r.parse().ok()?, s.parse().ok()?)));
    if parsed == Some((rank, step)) {
        eprintln!("rank {rank} kills itself after step {step} (FERROTRON_KILL_AT)");
        // SAFETY: signals this process; SIGKILL cannot be caught, the process ends here.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

/// `FERROTRON_FAIL_COLLECTIVE=<world rank>@<step>[:<group>[:<call>]]`: that rank's first
/// call of that step (counted from 1, as `loss.csv` counts them) in that group (`tp`,
/// `dp`, `dp-cp`, `pp`, `cp`, `ep`, `embedding`, ...; any when omitted) that is that
/// call (`all_reduce`, `all_gather`, `reduce_scatter`, `send`, ...; any when omitted)
/// fails as a broken link fails it ([`ferrotron_comm_core::FaultInjector`]), on the
/// local backend: for the tests that show a failed collective ends the run with its
/// error and leaves no checkpoint of its step.
#[derive(Clone, Debug)]
pub struct FailCollective {
    rank: usize,
    step: usize,
    group: Option<String>,
    call: Option<ferrotron_comm_core::OpKind>,
    injector: ferrotron_comm_core::FaultInjector,
}

/// The variable [`FailCollective`] is read from.
pub const FAIL_COLLECTIVE: &str = "FERROTRON_FAIL_COLLECTIVE";

/// The groups a run's calls go to, by name (`ferrotron_parallel_state`'s, and the world).
const GROUPS: [&str; 15] = [
    "world",
    "tp",
    "pp",
    "dp",
    "cp",
    "dp-cp",
    "tp-cp",
    "tp-pp",
    "embedding",
    "position-embedding",
    "ep",
    "expert-tp",
    "expert-tp-ep",
    "expert-tp-ep-pp",
    "expert-dp",
];

impl FailCollective {
    /// The failure the environment asks for in a world of `world` ranks, if any.
    pub fn from_env(world: usize) -> anyhow::Result<Option<FailCollective>> {
        match std::env::var(FAIL_COLLECTIVE) {
            Ok(text) => Self::parse(&text, world).map(Some),
            Err(_) => Ok(None),
        }
    }

    fn parse(text: &str, world: usize) -> anyhow::Result<FailCollective> {
        let usage = || {
            anyhow::anyhow!(
                "{FAIL_COLLECTIVE}={text:?}: give <world rank>@<step>[:<group>[:<call>]], e.g. \
                 1@3:dp:all_gather (a rank below {world}, a step from 1, a group of {GROUPS:?}, \
                 a call such as all_reduce, all_gather, reduce_scatter, send or recv)"
            )
        };
        let mut parts = text.trim().split(':');
        let (rank, step) = parts
            .next()
            .and_then(|at| at.split_once('@'))
            .ok_or_else(usage)?;
        let (rank, step): (usize, usize) = (
            rank.parse().map_err(|_| usage())?,
            step.parse().map_err(|_| usage())?,
        );
        let group = parts.next().map(str::to_string);
        let call = parts.next();
        let known = group.as_deref().is_none_or(|g| GROUPS.contains(&g));
        let call = match call {
            None => None,
            Some(name) => Some(
                (ferrotron_comm_core::OpKind::ALL.into_iter())
                    .find(|op| op.name() == name)
                    .ok_or_else(usage)?,
            ),
        };
        if rank >= world || step == 0 || !known || parts.next().is_some() {
            return Err(usage());
        }
        Ok(FailCollective {
            rank,
            step,
            group,
            call,
            injector: ferrotron_comm_core::FaultInjector::new(),
        })
    }

    /// The injector the local backend's world takes.
    pub fn injector(&self) -> &ferrotron_comm_core::FaultInjector {
        &self.injector
    }

    /// Arms the failure when world rank `rank` starts step `step` (counted from 1), if
    /// they are the ones it names.
    pub fn arm_at(&self, rank: usize, step: usize) {
        if (rank, step) == (self.rank, self.step) {
            eprintln!(
                "rank {rank} fails its next {} in group {} of step {step} ({FAIL_COLLECTIVE})",
                self.call.map_or("call", |c| c.name()),
                self.group.as_deref().unwrap_or("any"),
            );
            (self.injector).arm(rank, self.group.as_deref(), self.call);
        }
    }
}
