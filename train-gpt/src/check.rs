//! `--check`: the same run on one rank (TP = PP = CP = DP = 1, the same global batches),
//! and how far this run's losses and gradient norms are from it.

use crate::args::Args;
use crate::config::train_config;
use crate::data::Corpus;
use crate::report::Progress;
use crate::train::{train_rank, RankResult, TrainConfig};
use anyhow::Result;
use ferrotron_comm_core::run_local;
use std::sync::Arc;

/// Trains the same steps on one rank and prints how far this run's losses (and, when
/// clipping, gradient norms) are from its. The loss line comes first; the others say
/// how the differences grow.
pub(crate) fn compare_with_one_rank(
    args: &Args,
    corpus: &Corpus,
    dp: usize,
    result: &RankResult,
) -> Result<()> {
    let serial = check_run(args, corpus, dp)?;
    if args.hidden_dropout > 0.0 || args.attention_dropout > 0.0 {
        println!(
            "note: with dropout each layout draws other masks (per tensor-parallel rank and \
             pipeline stage, as Megatron), so the losses differ by more than rounding"
        );
    }
    let differences: Vec<f32> = (result.losses.iter().zip(&serial.losses))
        .map(|(a, b)| (a - b).abs())
        .collect();
    let largest_by = |steps: usize| {
        differences
            .iter()
            .take(steps)
            .fold(0.0f32, |m, &d| m.max(d))
    };
    // Display never uses an exponent, so this is a plain decimal number.
    println!("max loss difference: {}", largest_by(differences.len()));
    // Rounding differences grow as training amplifies them; show how fast.
    let growth: Vec<String> = [1, 10, 100]
        .into_iter()
        .filter(|&steps| steps < differences.len())
        .map(|steps| format!("{:.1e} by step {steps}", largest_by(steps)))
        .collect();
    if !growth.is_empty() {
        println!("largest difference {}", growth.join(", "));
    }
    // Where the runs part, so that a divergence is located, not only measured.
    match differences.iter().position(|&d| d > 1e-4) {
        Some(i) => println!("first step differing by more than 1e-4: {}", i + 1),
        None => println!("first step differing by more than 1e-4: none"),
    }
    let norms: Vec<f64> = (result.grad_norms.iter())
        .filter_map(|(step, norm)| {
            let (_, serial) = serial.grad_norms.iter().find(|(s, _)| s == step)?;
            Some((norm - serial).abs() / serial.abs().max(f64::MIN_POSITIVE))
        })
        .collect();
    if !norms.is_empty() {
        let largest = norms.iter().fold(0.0f64, |m, &d| m.max(d));
        println!("max relative gradient-norm difference: {largest}");
    }
    Ok(())
}

/// The same training on one rank: TP = 1, DP = 1, the whole global batch.
pub(crate) fn check_run(args: &Args, corpus: &Corpus, dp: usize) -> Result<RankResult> {
    println!("check: the same steps with TP 1 × DP 1 on one rank");
    let mut reference = train_config(args, &corpus.vocabulary);
    // One rank pads the vocabulary for TP 1; the padding is no token either way.
    reference.model.vocab = corpus.vocabulary.padded(1);
    reference.model.recompute_attention_core = false;
    let config = TrainConfig {
        tp: 1,
        pp: 1,
        cp: 1,
        ep: 1,
        pipeline: ferrotron_pipeline::Schedule::OneFOneB,
        // Experts route each data-parallel rank's microbatches by themselves (capacity
        // and load-balancing loss count its tokens): one rank runs them as microbatches
        // of their own, the same rows.
        //
        // Masked positions make microbatches' token counts differ, and the loss weighs
        // each microbatch alike (its mean over the data-parallel ranks' tokens): the
        // reference then runs microbatch m as all ranks' m-th rows together.
        microbatches: match (args.num_experts, args.eod_mask_loss) {
            (0, false) => 1,
            (0, true) => args.microbatches,
            _ => dp * args.microbatches,
        },
        rows_from_ranks: match (args.num_experts, args.eod_mask_loss) {
            (0, true) => dp,
            _ => 1,
        },
        trace: false,
        sequence_parallel: false,
        batch: args.batch * dp,
        // From the start, whatever the run under check resumed from: its losses include
        // the saved steps'.
        resume: None,
        init_from: args.init_from.clone(),
        save: None,
        save_interval: None,
        save_keep: None,
        async_save: false,
        // The reference keeps every activation: --check then also checks recomputation.
        recompute: None,
        stop: None,
        sample: false,
        eval_interval: 0,
        distributed_optimizer: false,
        check_tied: false,
        profile: false,
        ..reference
    };
    let progress = Progress::of_run("check", args, &config.model, dp, 1);
    let mut results = run_local(1, |comm| {
        train_rank(Arc::new(comm), &config, corpus, Some(&progress))
    })?;
    Ok(results.swap_remove(0))
}
