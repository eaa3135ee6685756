//! A step's timeline as Chrome trace events (open the file in Perfetto or
//! `chrome://tracing`): one row per rank, one box per forward, backward and exchange.

use crate::schedule::Action;
use std::time::Instant;

/// One timed action of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// What ran.
    pub action: Action,
    /// Start, in microseconds since the step's trace epoch.
    pub start_us: f64,
    /// Duration in microseconds.
    pub duration_us: f64,
}

impl Span {
    pub(crate) fn new(action: Action, epoch: Instant, started: Instant) -> Span {
        let start_us = started.saturating_duration_since(epoch).as_secs_f64() * 1e6;
        Span {
            action,
            start_us,
            duration_us: started.elapsed().as_secs_f64() * 1e6,
        }
    }

    /// Whether this span is computation (a forward or backward), not communication.
    pub fn is_compute(&self) -> bool {
        !matches!(self.action, Action::Exchange(_))
    }

    fn label(&self) -> String {
        match self.action {
            Action::Forward { chunk, microbatch } => format!("F{microbatch}.{chunk}"),
            Action::Backward { chunk, microbatch } => format!("B{microbatch}.{chunk}"),
            Action::Exchange(_) => "exchange".into(),
        }
    }
}

/// Chrome trace event JSON of every rank's timeline (`timelines[r]` is pipeline rank
/// `r`'s): forwards, backwards and exchanges as complete events, one thread per rank.
pub fn chrome_trace(timelines: &[Vec<Span>]) -> String {
    let mut events = Vec::new();
    for (rank, timeline) in timelines.iter().enumerate() {
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
            "args": { "name": format!("pipeline rank {rank}") },
        }));
        for span in timeline {
            let category = match span.action {
                Action::Forward { .. } => "forward",
                Action::Backward { .. } => "backward",
                Action::Exchange(_) => "exchange",
            };
            events.push(serde_json::json!({
                "name": span.label(), "cat": category, "ph": "X", "pid": 0, "tid": rank,
                "ts": span.start_us, "dur": span.duration_us,
            }));
        }
    }
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" }).to_string()
}
