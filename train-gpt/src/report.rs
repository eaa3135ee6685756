//! What the run shows a person: a progress bar on a terminal (plain lines otherwise), and
//! at the end the loss curve as CSV and SVG.

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

/// Shared by the rank threads; only world rank 0 reports to it.
pub struct Progress {
    bar: Option<ProgressBar>,
    label: &'static str,
    steps: usize,
    /// When the last step reported ended and which it was (a resumed run starts past
    /// 0; `None` until the first step), for figures over the steps since.
    last: Mutex<Option<(Instant, usize)>>,
    started: Instant,
    tokens_per_step: usize,
    flops_per_step_per_rank: f64,
}

impl Progress {
    /// The progress report of a run of `ranks` ranks training `model` on `dp`
    /// data-parallel ranks' batches.
    pub fn of_run(
        label: &'static str,
        args: &crate::args::Args,
        model: &crate::model::GptConfig,
        dp: usize,
        ranks: usize,
    ) -> Progress {
        let tokens = args.batch * dp * args.seq;
        let flops_per_rank = model.flops_per_token() * tokens as f64 / ranks as f64;
        Progress::new(label, args.steps, tokens, flops_per_rank)
    }

    /// `tokens_per_step`: tokens of the global batch; `flops_per_step_per_rank`: the
    /// model's flops of a step divided by the ranks (see `GptConfig::flops_per_token`).
    pub fn new(
        label: &'static str,
        steps: usize,
        tokens_per_step: usize,
        flops_per_step_per_rank: f64,
    ) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(steps as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "{prefix} {bar:30.cyan/blue} step {pos}/{len} {msg} [{elapsed_precise}]",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_prefix(label);
            bar
        });
        Progress {
            bar,
            label,
            steps,
            last: Mutex::new(None),
            started: Instant::now(),
            tokens_per_step,
            flops_per_step_per_rank,
        }
    }

    /// Reports step `step`'s loss, with the time per step, tokens/s and model TFLOP/s
    /// per rank over the steps since the last report (the first since training
    /// started, which includes its warm-up), as Megatron's log does per interval.
    pub fn step(&self, step: usize, loss: f32) {
        let now = Instant::now();
        // A poisoned lock only means another rank thread panicked; its value still holds.
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let (since, from) = last
            .replace((now, step))
            .unwrap_or((self.started, step - 1));
        drop(last);
        let steps = step.saturating_sub(from).max(1) as f64;
        let seconds = now.duration_since(since).as_secs_f64().max(1e-9);
        let figures = format!(
            "loss {loss:.4} | elapsed time per step (ms) {:.1} | tokens/s {:.0} | TFLOP/s per GPU {:.3}",
            seconds * 1e3 / steps,
            self.tokens_per_step as f64 * steps / seconds,
            self.flops_per_step_per_rank * steps / seconds / 1e12,
        );
        match &self.bar {
            Some(bar) => {
                bar.set_position(step as u64);
                bar.set_message(figures);
            }
            None => println!("{} step {step:>4}/{} {figures}", self.label, self.steps),
        }
    }

    /// A line of its own, above the bar when there is one.
    pub fn note(&self, text: &str) {
        match &self.bar {
            Some(bar) => bar.println(text),
            None => println!("{text}"),
        }
    }

    /// Clears the bar, so the lines printed next (the summary, and `--check`'s last
    /// line) start on a line of their own.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// The kernels of several steps together, with how many steps and their wall time.
#[derive(Debug, Clone, Default)]
pub struct StepsProfile {
    pub kernels: ferrotron_tape::profile::Profile,
    pub steps: usize,
    pub wall: std::time::Duration,
}

impl StepsProfile {
    /// Adds one step's kernels and wall time.
    pub fn add(&mut self, kernels: &ferrotron_tape::profile::Profile, wall: std::time::Duration) {
        self.kernels.add(kernels);
        self.steps += 1;
        self.wall += wall;
    }
}

/// The per-kernel table of `--profile`: each kernel's launches, time (CUDA), bytes and
/// achieved bandwidth and TFLOP/s per step, the most expensive first, a total line, and
/// the kernels' time against the steps' wall time.
pub fn profile_table(profile: &StepsProfile) -> String {
    let steps = profile.steps.max(1) as f64;
    let mut text = format!(
        "kernels per step (world rank 0, mean of {} steps after the first):\n",
        profile.steps
    );
    text.push_str(&format!(
        "  {:<36} {:>8} {:>10} {:>9} {:>10} {:>10} {:>8} {:>8}\n",
        "kernel", "launches", "total ms", "mean us", "read MB", "written MB", "GB/s", "TFLOP/s"
    ));
    let total = profile.kernels.total();
    for kernel in profile.kernels.kernels.iter().chain([&total]) {
        let ms = kernel.time.map(|t| t.as_secs_f64() * 1e3 / steps);
        let launches = kernel.launches as f64 / steps;
        let per_second = |amount: f64| match kernel.time {
            Some(t) if !t.is_zero() => format!("{:.1}", amount / t.as_secs_f64()),
            _ => "-".into(),
        };
        text.push_str(&format!(
            "  {:<36} {:>8} {:>10} {:>9} {:>10.3} {:>10.3} {:>8} {:>8}\n",
            kernel.name,
            format!("{launches:.0}"),
            ms.map_or("-".into(), |ms| format!("{ms:.3}")),
            ms.map_or("-".into(), |ms| format!(
                "{:.1}",
                ms * 1e3 / launches.max(1.0)
            )),
            kernel.read as f64 / steps / 1e6,
            kernel.written as f64 / steps / 1e6,
            per_second(kernel.bytes() as f64 / 1e9),
            match kernel.flops {
                0 => "-".into(),
                flops => per_second(flops as f64 / 1e12),
            },
        ));
    }
    let wall = profile.wall.as_secs_f64() * 1e3 / steps;
    text.push_str(&match total.time {
        Some(time) => format!(
            "kernel time {:.3} ms per step of {wall:.3} ms wall\n",
            time.as_secs_f64() * 1e3 / steps
        ),
        None => format!("kernel time: not measured on this device; {wall:.3} ms wall per step\n"),
    });
    text
}

/// `step,loss` rows.
pub fn write_csv(path: &Path, losses: &[(usize, f32)]) -> Result<()> {
    let mut text = String::from("step,loss\n");
    for (step, loss) in losses {
        text.push_str(&format!("{step},{loss}\n"));
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// A self-contained SVG line chart of the training loss against step, with the
/// validation loss as a second line and a legend.
pub fn write_svg(
    path: &Path,
    training: &[(usize, f32)],
    validation: &[(usize, f32)],
    title: &str,
) -> Result<()> {
    let (width, height, margin) = (640.0, 360.0, 50.0);
    let all = training.iter().chain(validation);
    let max = all.clone().map(|p| p.1).fold(f32::MIN, f32::max);
    let min = all.map(|p| p.1).fold(f32::MAX, f32::min);
    let span = (max - min).max(1e-6);
    let last = training.last().map_or(1, |p| p.0);
    let steps = last.max(2) - 1;
    let x = |step: usize| margin + (width - 2.0 * margin) * (step - 1) as f32 / steps as f32;
    let y = |l: f32| height - margin - (height - 2.0 * margin) * (l - min) / span;
    let points = |series: &[(usize, f32)]| {
        series
            .iter()
            .map(|&(step, l)| format!("{:.1},{:.1}", x(step), y(l)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{cx}" y="24" text-anchor="middle" font-size="14">{title}</text>
<line x1="{margin}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>
<line x1="{margin}" y1="{margin}" x2="{margin}" y2="{bottom}" stroke="black"/>
<text x="{margin}" y="{label_y}" text-anchor="middle">1</text>
<text x="{right}" y="{label_y}" text-anchor="middle">{last}</text>
<text x="{cx}" y="{label_y}" text-anchor="middle">step</text>
<text x="{value_x}" y="{top_y}" text-anchor="end">{max:.3}</text>
<text x="{value_x}" y="{bottom}" text-anchor="end">{min:.3}</text>
<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{training}"/>
<polyline fill="none" stroke="#ff7f0e" stroke-width="2" points="{validation}"/>
<line x1="{legend_x}" y1="40" x2="{legend_line}" y2="40" stroke="#1f77b4" stroke-width="2"/>
<text x="{legend_text}" y="44">training</text>
<line x1="{legend_x}" y1="58" x2="{legend_line}" y2="58" stroke="#ff7f0e" stroke-width="2"/>
<text x="{legend_text}" y="62">validation (held out)</text>
</svg>
"##,
        cx = width / 2.0,
        bottom = height - margin,
        right = width - margin,
        label_y = height - margin + 18.0,
        value_x = margin - 6.0,
        top_y = margin + 4.0,
        legend_x = width - margin - 170.0,
        legend_line = width - margin - 150.0,
        legend_text = width - margin - 144.0,
        training = points(training),
        validation = points(validation),
        title = escape_xml(title),
    );
    std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))
}

/// The title may hold a file name; `&`, `<` and `>` would break the SVG.
fn escape_xml(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
