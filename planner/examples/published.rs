//! Published configurations planned for ferrotron's model and set beside Megatron-LM's
//! estimate of the same configuration, and the layouts of GPT-3 175B on 1,024 GPUs that
//! fit 80 GiB. The book's tables come from this output.
//!
//! ```text
//! cargo run --release -p ferrotron-planner --example published
//! ```

use anyhow::Result;
use ferrotron_pipeline::Schedule;
use ferrotron_planner::{
    fit, megatron, predict, Breakdown, Bytes, Layout, Model, Recompute, Search, Target,
};

/// Megatron pads the vocabulary to a multiple of 128 × TP.
fn padded(vocab: usize, tp: usize) -> usize {
    vocab.next_multiple_of(128 * tp)
}

/// With hidden dropout (Megatron's default, and its formula counts the masks) but no
/// attention dropout (its formula keeps no attention scores).
fn gpt3_175b(tp: usize) -> Model {
    Model {
        hidden_dropout: true,
        ..Model::gpt(96, 12288, 96, padded(51200, tp), 2048)
    }
}

/// Llama-2-70B's sizes (80 layers, width 8192, 64 heads, MLP 28672, 32,000 tokens,
/// 4,096 positions, untied output layer) in ferrotron's GPT architecture: all heads keep
/// their own keys and values, and the MLP has two matrices, not SwiGLU's three.
fn llama2_70b_shape(tp: usize) -> Model {
    Model {
        ffn: 28672,
        tied: false,
        hidden_dropout: true,
        ..Model::gpt(80, 8192, 64, padded(32000, tp), 4096)
    }
}

fn layout(tp: usize, pp: usize, dp: usize, microbatches: usize) -> Layout {
    Layout {
        tp,
        pp,
        dp,
        schedule: Schedule::OneFOneB,
        microbatches,
        batch: microbatches,
        element: 2,
        distributed_optimizer: false,
        sequence_parallel: false,
        recompute: Recompute::None,
        target: Target::Device,
        corpus_bytes: 0,
    }
}

fn gib(bytes: f64) -> String {
    format!("{:.2}", bytes / (1u64 << 30) as f64)
}

/// One row of the book's table: stage 0's rank (the most loaded by both counts), ours
/// against Megatron's.
fn compare(name: &str, model: &Model, layout: &Layout) -> Result<()> {
    let stages = predict(model, layout)?;
    let ours: &Breakdown = &stages[0];
    let theirs = megatron::estimate(model, layout);
    let state = ours.parameters + ours.gradients + ours.master_weights + ours.moments;
    let transient = ours.working + ours.communication + ours.other;
    println!(
        "| {name} | {:.3} / {:.3} | {} / {} | {} / {} | {} | {} / {} |",
        (ours.parameters / layout.element) as f64 / 1e9,
        theirs.parameters / 1e9,
        gib(state as f64),
        gib(theirs.weights_and_optimizer),
        gib(ours.activations as f64),
        gib(theirs.activations),
        gib(transient as f64),
        gib(ours.total() as f64),
        gib(theirs.total()),
    );
    Ok(())
}

fn main() -> Result<()> {
    // GPT-3 175B as Narayanan et al. (2021) trained it: TP 8 × PP 16 on 1,024 GPUs,
    // 1,536 sequences a step (DP 8: 192 microbatches of one sequence), 16-bit.
    println!(
        "| configuration | parameters on the rank, billions (ferrotron / Megatron) | \
         weights and optimizer, GiB | activations, GiB | working, communication, data, GiB \
         | total, GiB |"
    );
    println!("|---|---|---|---|---|---|");
    let base = layout(8, 16, 8, 192);
    let gpt3 = gpt3_175b(8);
    compare("GPT-3 175B, TP 8 × PP 16 × DP 8, 1F1B", &gpt3, &base)?;
    let full = Layout {
        recompute: Recompute::Uniform { layers: 1 },
        ..base
    };
    compare("same, full recomputation", &gpt3, &full)?;
    let today = Layout {
        distributed_optimizer: true,
        sequence_parallel: true,
        recompute: Recompute::Selective,
        ..base
    };
    compare(
        "same, distributed optimizer, SP, selective recomputation",
        &gpt3,
        &today,
    )?;
    let interleaved = Layout {
        schedule: Schedule::Interleaved { virtual_stages: 3 },
        ..today
    };
    compare("same, interleaved × 3", &gpt3, &interleaved)?;
    // Llama-2-70B's shape on 1,024 GPUs at TP 8 × PP 4 × DP 32: 1,024 sequences of 4,096
    // tokens a step (4M tokens, as it was trained): 32 microbatches.
    let llama = llama2_70b_shape(8);
    let llama_layout = Layout {
        distributed_optimizer: true,
        sequence_parallel: true,
        recompute: Recompute::Selective,
        ..layout(8, 4, 32, 32)
    };
    compare(
        "Llama-2-70B shape, TP 8 × PP 4 × DP 32, distributed optimizer, SP, selective",
        &llama,
        &llama_layout,
    )?;
    let search = Search {
        world: 1024,
        budget: "80GiB".parse::<Bytes>()?.0,
        global_batch: 1536,
        micro_batch: 1,
        max_tp: 8,
        element: 2,
        target: Target::Device,
        corpus_bytes: 0,
    };
    let found = fit(&gpt3, &search)?;
    println!(
        "\nGPT-3 175B on 1,024 ranks within 80 GiB: {} layouts of {} considered fit\n",
        found.fitting.len(),
        found.considered
    );
    println!("| TP | PP | DP | schedule | distributed optimizer | recomputation | peak | sent per step | bubble |");
    println!("|---:|---:|---:|---|---|---|---:|---:|---:|");
    let published = found
        .fitting
        .iter()
        .position(|c| c.layout.tp == 8 && c.layout.pp == 16 && c.layout.schedule.chunks() == 1);
    let rows = found.fitting.iter().enumerate();
    for (i, c) in rows.filter(|&(i, _)| i < 8 || Some(i) == published) {
        if Some(i) == published && i >= 8 {
            println!("| … | | | | | | | | |");
        }
        let l = &c.layout;
        println!(
            "| {} | {} | {} | {:?} | {} | {:?} | {} | {} | {:.1}% |",
            l.tp,
            l.pp,
            l.dp,
            l.schedule,
            if l.distributed_optimizer { "yes" } else { "no" },
            l.recompute,
            Bytes(c.peak),
            Bytes(c.traffic as usize),
            100.0 * c.bubble
        );
    }
    Ok(())
}
