//! `--plan`'s output: each pipeline stage's predicted peak per rank, or with `--fit` the
//! layouts of a world that fit a budget, the least traffic first.

use ferrotron_planner::{Breakdown, Bytes, Candidate, Layout, Model, Recompute, Search};

/// Each stage's predicted peak per rank, the largest first.
pub fn print_layout(model: &Model, layout: &Layout) -> ferrotron_planner::Result<()> {
    let stages = ferrotron_planner::predict(model, layout)?;
    let largest = stages.iter().map(Breakdown::total).max().unwrap_or(0);
    println!("predicted peak per rank: {largest} bytes");
    for (stage, b) in stages.iter().enumerate() {
        println!("  stage {stage}: {}", categories(b));
    }
    Ok(())
}

fn categories(b: &Breakdown) -> String {
    format!(
        "{} (parameters {}, gradients {}, master weights {}, AdamW moments {}, activations \
         {}, working memory {}, communication {}, data {})",
        b.total(),
        b.parameters,
        b.gradients,
        b.master_weights,
        b.moments,
        b.activations,
        b.working,
        b.communication,
        b.other
    )
}

/// How many fitting layouts `--fit` lists.
const LISTED: usize = 20;

/// The layouts of `search.world` ranks that fit its budget, the least traffic first.
pub fn print_fit(model: &Model, search: &Search) -> ferrotron_planner::Result<()> {
    let found = ferrotron_planner::fit(model, search)?;
    println!(
        "layouts that fit {} per rank on {} ranks: {} of {} (global batch {}, micro-batch \
         {}, sequence parallel with TP > 1)",
        Bytes(search.budget),
        search.world,
        found.fitting.len(),
        found.considered,
        search.global_batch,
        search.micro_batch
    );
    if found.fitting.is_empty() {
        println!(
            "none fits; the smallest peak is {} at {}",
            Bytes(found.smallest.peak),
            describe(&found.smallest.layout)
        );
        return Ok(());
    }
    println!(
        "  {:>3} {:>3} {:>4} {:<15} {:<9} {:<10} {:>12} {:>12} {:>6}",
        "tp", "pp", "dp", "schedule", "dist-opt", "recompute", "peak", "sent/step", "bubble"
    );
    for candidate in found.fitting.iter().take(LISTED) {
        println!("  {}", row(candidate));
    }
    if found.fitting.len() > LISTED {
        println!("  … and {} more", found.fitting.len() - LISTED);
    }
    Ok(())
}

fn schedule_name(layout: &Layout) -> String {
    match layout.schedule {
        ferrotron_pipeline::Schedule::Interleaved { virtual_stages } => {
            format!("interleaved×{virtual_stages}")
        }
        _ if layout.pp == 1 => "-".into(),
        other => other.name().into(),
    }
}

fn recompute_name(recompute: Recompute) -> &'static str {
    match recompute {
        Recompute::None => "none",
        Recompute::Selective => "selective",
        Recompute::Uniform { .. } | Recompute::Block { .. } => "full",
    }
}

fn row(candidate: &Candidate) -> String {
    let layout = &candidate.layout;
    format!(
        "{:>3} {:>3} {:>4} {:<15} {:<9} {:<10} {:>12} {:>12} {:>5.1}%",
        layout.tp,
        layout.pp,
        layout.dp,
        schedule_name(layout),
        if layout.distributed_optimizer {
            "yes"
        } else {
            "no"
        },
        recompute_name(layout.recompute),
        Bytes(candidate.peak).to_string(),
        Bytes(candidate.traffic as usize).to_string(),
        100.0 * candidate.bubble
    )
}

fn describe(layout: &Layout) -> String {
    format!(
        "TP {} × PP {} × DP {} ({} schedule, distributed optimizer {}, {} recomputation)",
        layout.tp,
        layout.pp,
        layout.dp,
        schedule_name(layout),
        if layout.distributed_optimizer {
            "on"
        } else {
            "off"
        },
        recompute_name(layout.recompute)
    )
}
