//! A step's timeline as Chrome trace events (open the file in Perfetto or
//! `chrome://tracing`): one row per rank, one box per forward, backward and exchange, and
//! with device streams, one row per stream of each rank with its calls.

use crate::schedule::Action;
use ferrotron_tape::timeline::Timeline;
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
    chrome_trace_with_streams(timelines, &[])
}

/// [`chrome_trace`] and, for each rank that has one (`streams[r]`), its device streams'
/// calls on the emulated device's modelled timeline (`ferrotron_tape::timeline`): one
/// process per rank, one thread per stream, in microseconds from the rank's first call.
/// Calls on one stream never overlap; calls on two streams side by side are overlap.
pub fn chrome_trace_with_streams(timelines: &[Vec<Span>], streams: &[Timeline]) -> String {
    let mut events = pipeline_events(timelines);
    for (rank, line) in streams.iter().enumerate() {
        events.extend(stream_events(rank, line));
    }
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" }).to_string()
}

/// A rank's streams as one process (`pid` 1 + rank), a thread per stream.
fn stream_events(rank: usize, line: &Timeline) -> Vec<serde_json::Value> {
    let pid = 1 + rank;
    let mut events = vec![serde_json::json!({
        "name": "process_name", "ph": "M", "pid": pid,
        "args": { "name": format!("pipeline rank {rank}: device streams (modelled)") },
    })];
    let origin = line
        .intervals
        .iter()
        .map(|i| i.start)
        .fold(f64::INFINITY, f64::min);
    let mut streams: Vec<u64> = Vec::new();
    for call in &line.intervals {
        let tid = match streams.iter().position(|&s| s == call.stream) {
            Some(tid) => tid,
            None => {
                streams.push(call.stream);
                let (role, label) = (call.role.name(), &call.label);
                let name = match &**label == role {
                    true => format!("{role} stream {}", call.stream),
                    false => format!("{role} stream {} ({label})", call.stream),
                };
                events.push(serde_json::json!({
                    "name": "thread_name", "ph": "M", "pid": pid, "tid": streams.len() - 1,
                    "args": { "name": name },
                }));
                streams.len() - 1
            }
        };
        events.push(serde_json::json!({
            "name": call.name, "cat": "device", "ph": "X", "pid": pid, "tid": tid,
            "ts": (call.start - origin) * 1e6, "dur": (call.end - call.start) * 1e6,
        }));
    }
    events
}

fn pipeline_events(timelines: &[Vec<Span>]) -> Vec<serde_json::Value> {
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
    events
}
