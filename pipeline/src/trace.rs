//! A step's timeline as Chrome trace events (open the file in Perfetto or
//! `chrome://tracing`): one row per rank, one box per forward, backward and exchange.

use std::time::Instant;

/// What a span of the timeline was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    /// A forward of `microbatch` through chunk `chunk`.
    Forward {
        /// The model chunk.
        chunk: usize,
        /// The microbatch.
        microbatch: usize,
    },
    /// A backward.
    Backward {
        /// The model chunk.
        chunk: usize,
        /// The microbatch.
        microbatch: usize,
    },
    /// A batched exchange with the neighbours (waiting for them included).
    Exchange,
}

/// One timed action of a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    /// What ran.
    pub kind: SpanKind,
    /// Start, in microseconds since the step's trace epoch.
    pub start_us: f64,
    /// Duration in microseconds.
    pub duration_us: f64,
}

impl Span {
    pub(crate) fn new(kind: SpanKind, epoch: Instant, started: Instant) -> Span {
        let start_us = started.saturating_duration_since(epoch).as_secs_f64() * 1e6;
        Span {
            kind,
            start_us,
            duration_us: started.elapsed().as_secs_f64() * 1e6,
        }
    }

    /// Whether this span is computation (a forward or backward), not communication.
    pub fn is_compute(&self) -> bool {
        !matches!(self.kind, SpanKind::Exchange)
    }

    fn label(&self) -> String {
        match self.kind {
            SpanKind::Forward { chunk, microbatch } => format!("F{microbatch}.{chunk}"),
            SpanKind::Backward { chunk, microbatch } => format!("B{microbatch}.{chunk}"),
            SpanKind::Exchange => "exchange".into(),
        }
    }
}

/// The fraction of `[first start, last end]` of `timeline` spent outside forwards and
/// backwards: the rank's bubble, exchanges included.
pub fn idle_fraction(timeline: &[Span]) -> f64 {
    let (Some(first), Some(last)) = (timeline.first(), timeline.last()) else {
        return 0.0;
    };
    let total = last.start_us + last.duration_us - first.start_us;
    let busy: f64 = timeline
        .iter()
        .filter(|s| s.is_compute())
        .map(|s| s.duration_us)
        .sum();
    if total > 0.0 {
        (1.0 - busy / total).max(0.0)
    } else {
        0.0
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
            let category = match span.kind {
                SpanKind::Forward { .. } => "forward",
                SpanKind::Backward { .. } => "backward",
                SpanKind::Exchange => "exchange",
            };
            events.push(serde_json::json!({
                "name": span.label(), "cat": category, "ph": "X", "pid": 0, "tid": rank,
                "ts": span.start_us, "dur": span.duration_us,
            }));
        }
    }
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" }).to_string()
}
