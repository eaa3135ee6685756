//! The pipeline bubble, measured: stages whose forward and backward sleep for fixed times
//! (so the machine's core count does not distort them) run one step on rank threads, and
//! the idle fraction of each rank's step is compared with the theory.
//!
//! ```sh
//! cargo run --release -p ferrotron-pipeline --example bench_pipeline -- \
//!     --pp 4 --microbatches 8 --schedule interleaved --virtual-stages 2 --json
//! ```
//! `--trace FILE` writes the step as Chrome trace JSON (Perfetto, `chrome://tracing`),
//! `--svg FILE` as a picture.

use anyhow::{Context, Result};
use clap::Parser;
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_pipeline::{chrome_trace, Action, Pipeline, PipelineConfig, Schedule, Span, Stage};
use ferrotron_tape::{Tape, Tensor};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Pipeline stages (rank threads).
    #[arg(long, default_value_t = 4)]
    pp: usize,
    /// Microbatches per step.
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    /// gpipe, 1f1b or interleaved.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Model chunks per rank (interleaved only).
    #[arg(long, default_value_t = 2)]
    virtual_stages: usize,
    /// Milliseconds of one stage's forward (its backward takes twice as long); a rank's
    /// chunks share it.
    #[arg(long, default_value_t = 20.0)]
    forward_ms: f64,
    /// Steps to run; the reported figures are the median step's.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Print one JSON line instead of a table.
    #[arg(long)]
    json: bool,
    /// Write the last step's timeline as Chrome trace JSON.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Write the last step's timeline as an SVG picture.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
}

/// A stage that only takes time.
struct Sleeper {
    forward: Duration,
    last: bool,
}

impl Stage for Sleeper {
    fn forward(
        &mut self,
        _: &Tape,
        _: usize,
        _: Option<&Tensor>,
    ) -> std::result::Result<Tensor, Box<dyn std::error::Error + Send + Sync>> {
        std::thread::sleep(self.forward);
        Ok(if self.last {
            Tensor::scalar(0.0)
        } else {
            Tensor::zeros(&[1])
        })
    }

    fn before_backward(&mut self, _: bool) {
        // The backward's work, inside the schedule's backward span.
        std::thread::sleep(2 * self.forward);
    }
}

struct Measured {
    bubble: f64,
    peaks: Vec<usize>,
    timelines: Vec<Vec<Span>>,
}

fn step(args: &Args, schedule: Schedule) -> Result<Measured> {
    let chunks = schedule.chunks();
    let forward = Duration::from_secs_f64(args.forward_ms / 1e3 / chunks as f64);
    let ranks = run_local(args.pp, |comm| -> Result<(usize, Vec<Span>)> {
        let group: Arc<dyn Communicator> = Arc::new(comm);
        let (pp, rank) = (group.size(), group.rank());
        let mut stages: Vec<Sleeper> = (0..chunks)
            .map(|c| Sleeper {
                forward,
                last: c * pp + rank + 1 == pp * chunks,
            })
            .collect();
        let mut config = PipelineConfig::new(schedule, args.microbatches, &[1]);
        group.barrier()?;
        config.trace_epoch = Some(Instant::now());
        let pipeline = Pipeline::new(group, config)?;
        let mut refs: Vec<&mut dyn Stage> =
            stages.iter_mut().map(|s| s as &mut dyn Stage).collect();
        let report = pipeline.run(&mut refs)?;
        Ok((report.peak_in_flight, report.timeline))
    })?;
    let end = |t: &[Span]| t.last().map_or(0.0, |s| s.start_us + s.duration_us);
    let total = ranks.iter().map(|r| end(&r.1)).fold(0.0, f64::max);
    let bubble = ranks
        .iter()
        .map(|(_, timeline)| {
            let busy: f64 = timeline
                .iter()
                .filter(|s| s.is_compute())
                .map(|s| s.duration_us)
                .sum();
            1.0 - busy / total
        })
        .sum::<f64>()
        / ranks.len() as f64;
    Ok(Measured {
        bubble,
        peaks: ranks.iter().map(|r| r.0).collect(),
        timelines: ranks.into_iter().map(|r| r.1).collect(),
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let schedule = Schedule::from_name(&args.schedule, args.virtual_stages)?;
    let mut steps = (0..args.steps.max(1))
        .map(|_| step(&args, schedule))
        .collect::<Result<Vec<_>>>()?;
    let theory = schedule.bubble_fraction(args.pp, args.microbatches);
    let last_timelines = steps
        .last()
        .map(|s| s.timelines.clone())
        .unwrap_or_default();
    steps.sort_by(|a, b| a.bubble.total_cmp(&b.bubble));
    let median = &steps[steps.len() / 2];
    let virtual_stages = schedule.chunks();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "bench": "pipeline", "schedule": schedule.name(), "pp": args.pp,
                "microbatches": args.microbatches, "virtual_stages": virtual_stages,
                "bubble_fraction": median.bubble, "theory": theory,
                "peak_inflight": median.peaks,
            })
        );
    } else {
        println!(
            "{} pp={} microbatches={} virtual_stages={virtual_stages}: bubble {:.3} \
             (theory {theory:.3}, {:+.1}%), peak activations per stage {:?}",
            schedule.name(),
            args.pp,
            args.microbatches,
            median.bubble,
            (median.bubble / theory.max(1e-12) - 1.0) * 100.0,
            median.peaks
        );
    }
    if let Some(path) = &args.trace {
        std::fs::write(path, chrome_trace(&last_timelines))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.svg {
        let title = format!(
            "{} schedule, {} stages, {} microbatches{}",
            schedule.name(),
            args.pp,
            args.microbatches,
            if virtual_stages > 1 {
                format!(", {virtual_stages} chunks per rank")
            } else {
                String::new()
            }
        );
        std::fs::write(path, svg(&title, &last_timelines))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// One row per rank: forwards blue, backwards green (darker for later chunks), labelled
/// with the microbatch; exchanges are left blank, as they are the bubble here.
fn svg(title: &str, timelines: &[Vec<Span>]) -> String {
    let (left, row, width) = (70.0, 34.0, 900.0);
    let end = timelines
        .iter()
        .filter_map(|t| t.last())
        .map(|s| s.start_us + s.duration_us)
        .fold(1.0, f64::max);
    let x = |us: f64| left + us / end * width;
    let height = 40.0 + row * timelines.len() as f64 + 20.0;
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="11">"#,
        left + width + 10.0
    );
    out.push_str(&format!(r#"<rect width="100%" height="100%" fill="white"/><text x="{left}" y="18" font-size="13">{title}</text>"#));
    for (rank, timeline) in timelines.iter().enumerate() {
        let y = 30.0 + row * rank as f64;
        out.push_str(&format!(
            r#"<text x="6" y="{}">rank {rank}</text>"#,
            y + row / 2.0 + 2.0
        ));
        for span in timeline {
            let (color, label) = match span.action {
                Action::Forward { chunk, microbatch } => (
                    ["#4c78a8", "#2a4d74", "#7fa6d1"][chunk % 3],
                    microbatch.to_string(),
                ),
                Action::Backward { chunk, microbatch } => (
                    ["#59a14f", "#2f6b28", "#8cc97f"][chunk % 3],
                    microbatch.to_string(),
                ),
                Action::Exchange(_) => continue,
            };
            let (x0, x1) = (x(span.start_us), x(span.start_us + span.duration_us));
            out.push_str(&format!(
                r#"<rect x="{x0:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{color}" stroke="white" stroke-width="0.5"/>"#,
                (x1 - x0).max(0.5),
                row - 6.0
            ));
            if x1 - x0 > 12.0 {
                out.push_str(&format!(
                    r#"<text x="{:.1}" y="{:.1}" fill="white" text-anchor="middle">{label}</text>"#,
                    (x0 + x1) / 2.0,
                    y + row / 2.0
                ));
            }
        }
    }
    out.push_str(&format!(
        r#"<text x="{left}" y="{:.1}">forward (blue) and backward (green) of each microbatch, darker for a later chunk; white is idle</text></svg>"#,
        height - 6.0
    ));
    out
}
