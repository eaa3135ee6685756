//! Prints a Megatron rank layout: every group, each rank's coordinates and, given
//! transformer dimensions, the bytes each rank sends per training step in each group.
//!
//! ```text
//! cargo run -p parallel-state --example layout -- --world 16 --tp 2 --pp 4
//! cargo run -p parallel-state --example layout -- --world 16 --tp 2 --pp 4 --json
//! cargo run -p parallel-state --example layout -- --world 16 --tp 2 --pp 4 \
//!     --hidden 4096 --seq 2048 --micro-batch 1 --micro-batches 8 --layers 32 --vocab 50304
//! ```
//!
//! `--json` prints one object mapping each group family (`tp, pp, dp, cp, dp-cp, tp-pp,
//! tp-dp, tp-cp, embedding, position-embedding`, plus the expert families when `--ep` or
//! `--expert-tp` is given) to its rank lists in Megatron's order. Invalid
//! configurations exit non-zero with the error on stderr.
//!
//! # Traffic model (bytes a rank sends per step; ring collectives)
//! A ring all-reduce of N elements over g ranks sends 2·(g−1)/g·N elements per rank.
//! With m micro-batches of b sequences of s tokens, hidden size h, L layers, vocabulary
//! V, t = tp, c = cp, p = pp, and d' = dp·cp:
//! * TP: 4 all-reduces of b·(s/c)·h activations per layer per micro-batch (2 forward,
//!   2 backward) over the rank's L/p layers:
//!   m · (L/p) · 4 · 2(t−1)/t · b·(s/c)·h elements of `--act-bytes`.
//! * DP: one all-reduce, over dp-cp, of the gradients of this rank's parameter shard,
//!   P = (L/p)·12h²/t (+ V·h/t on a stage holding the word embedding or the output
//!   layer): 2(d'−1)/d' · P elements of `--grad-bytes`.
//! * PP: b·(s/c)·h per micro-batch boundary: the activation sent forward by every stage
//!   but the last and the gradient sent backward by every stage but the first:
//!   m · b·(s/c)·h · (#directions) elements of `--act-bytes`.
//! * Embedding (p > 1): all-reduce of the tied word-embedding gradient V·h/t between
//!   the first and last stage: 2(e−1)/e · V·h/t elements of `--grad-bytes`, e = 2.

use anyhow::{bail, Context, Result};
use clap::Parser;
use parallel_state::{GroupKind, Order, RankLayout};

#[derive(Parser, Debug)]
#[command(about = "Megatron-Core rank layout and per-rank communication volume")]
struct Args {
    /// Number of ranks (or give --dp and it is tp·pp·cp·dp).
    #[arg(long)]
    world: Option<usize>,
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Pipeline-parallel size.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Context-parallel size.
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// Data-parallel size; checked against world / (tp·pp·cp) when --world is given.
    #[arg(long)]
    dp: Option<usize>,
    /// Expert-parallel size (adds the expert families to the output).
    #[arg(long)]
    ep: Option<usize>,
    /// Tensor-parallel size of expert layers (default: --tp).
    #[arg(long)]
    expert_tp: Option<usize>,
    /// Axis order, fastest-varying first.
    #[arg(long, default_value = "tp-cp-ep-dp-pp")]
    order: String,
    /// First rank of the layout.
    #[arg(long, default_value_t = 0)]
    rank_offset: usize,
    /// Print the groups as one JSON object and nothing else.
    #[arg(long)]
    json: bool,
    /// Hidden size h (enables the traffic table).
    #[arg(long)]
    hidden: Option<usize>,
    /// Sequence length s.
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// Micro-batch size b.
    #[arg(long, default_value_t = 1)]
    micro_batch: usize,
    /// Micro-batches per step m.
    #[arg(long, default_value_t = 1)]
    micro_batches: usize,
    /// Transformer layers L.
    #[arg(long, default_value_t = 24)]
    layers: usize,
    /// Vocabulary size V.
    #[arg(long, default_value_t = 50304)]
    vocab: usize,
    /// Bytes per activation element.
    #[arg(long, default_value_t = 2)]
    act_bytes: usize,
    /// Bytes per gradient element.
    #[arg(long, default_value_t = 4)]
    grad_bytes: usize,
}

fn main() {
    if let Err(error) = run(Args::parse()) {
        eprintln!("error: {error:#}");
        std::process::exit(2);
    }
}

fn run(args: Args) -> Result<()> {
    let layout = build_layout(&args)?;
    let expert = args.ep.is_some() || args.expert_tp.is_some();
    let kinds: &[GroupKind] = if expert {
        &GroupKind::ALL
    } else {
        &GroupKind::CORE
    };
    if args.json {
        let object: serde_json::Map<String, serde_json::Value> = kinds
            .iter()
            .map(|&kind| (kind.name().to_string(), layout.groups(kind).into()))
            .collect();
        println!("{}", serde_json::Value::Object(object));
        return Ok(());
    }
    print_layout(&layout, kinds, expert)?;
    if let Some(hidden) = args.hidden {
        print_traffic(&layout, &args, hidden)?;
    }
    Ok(())
}

fn build_layout(args: &Args) -> Result<RankLayout> {
    let model = args.tp * args.pp * args.cp;
    let world = match (args.world, args.dp) {
        (Some(world), _) => world,
        (None, Some(dp)) => model * dp,
        (None, None) => bail!("give --world, or --dp to make the world tp·pp·cp·dp"),
    };
    let order: Order = args.order.parse()?;
    let mut builder = RankLayout::builder(world)
        .tp(args.tp)
        .pp(args.pp)
        .cp(args.cp)
        .ep(args.ep.unwrap_or(1))
        .order(order)
        .rank_offset(args.rank_offset);
    if let Some(expert_tp) = args.expert_tp {
        builder = builder.expert_tp(expert_tp);
    }
    let layout = builder.build()?;
    if let Some(dp) = args.dp {
        if dp != layout.dp() {
            bail!(
                "--dp {dp} does not match world {world} / (tp·pp·cp = {model}) = {}",
                layout.dp()
            );
        }
    }
    Ok(layout)
}

fn print_layout(layout: &RankLayout, kinds: &[GroupKind], expert: bool) -> Result<()> {
    println!(
        "world {} (ranks {}..={}), order {}: tp {} · cp {} · dp {} · pp {}",
        layout.world_size(),
        layout.rank_offset(),
        layout.rank_offset() + layout.world_size() - 1,
        layout.order(),
        layout.tp(),
        layout.cp(),
        layout.dp(),
        layout.pp()
    );
    if expert {
        println!(
            "experts: expert tp {} · ep {} · expert dp {} · pp {}",
            layout.expert_tp(),
            layout.ep(),
            layout.expert_dp(),
            layout.pp()
        );
    }
    println!("\ngroups");
    for &kind in kinds {
        let groups: Vec<String> = layout
            .groups(kind)
            .iter()
            .map(|g| format!("{g:?}"))
            .collect();
        println!("  {:<20} {}", kind.name(), groups.join(" "));
    }
    println!("\nrank coordinates");
    println!(
        "  {:>6} {:>4} {:>4} {:>4} {:>4}  stage",
        "rank", "tp", "cp", "dp", "pp"
    );
    for rank in layout.rank_offset()..layout.rank_offset() + layout.world_size() {
        let c = layout.coordinates(rank)?;
        let stage = match (layout.is_first_stage(rank)?, layout.is_last_stage(rank)?) {
            (true, true) => "first+last",
            (true, false) => "first",
            (false, true) => "last",
            (false, false) => "",
        };
        println!(
            "  {rank:>6} {:>4} {:>4} {:>4} {:>4}  {stage}",
            c.tp, c.cp, c.dp, c.pp
        );
    }
    Ok(())
}

/// Elements a rank sends in a ring all-reduce of `elements` over `group` ranks.
fn ring_all_reduce(elements: f64, group: usize) -> f64 {
    2.0 * (group as f64 - 1.0) / group as f64 * elements
}

fn print_traffic(layout: &RankLayout, args: &Args, hidden: usize) -> Result<()> {
    let (t, p, c) = (layout.tp(), layout.pp(), layout.cp());
    let dp_cp = layout.dp() * c;
    if args.layers % p != 0 {
        bail!("{} layers do not split evenly over pp = {p}", args.layers);
    }
    let h = hidden as f64;
    let tokens = (args.micro_batch * args.seq) as f64 / c as f64;
    let activation = tokens * h;
    let layers_per_stage = (args.layers / p) as f64;
    let m = args.micro_batches as f64;
    let (act, grad) = (args.act_bytes as f64, args.grad_bytes as f64);
    let embedding_shard = args.vocab as f64 * h / t as f64;
    println!(
        "\nbytes sent per rank per step (h {hidden}, s {}, b {}, m {}, L {}, V {}; \
         activations {} B, gradients {} B; ring collectives)",
        args.seq, args.micro_batch, args.micro_batches, args.layers, args.vocab, act, grad
    );
    println!("  TP  = m·(L/p)·4·2(t−1)/t·b·(s/c)·h · act_bytes");
    println!("  DP  = 2(d'−1)/d'·P · grad_bytes, P = (L/p)·12h²/t (+ V·h/t on embedding stages), d' = dp·cp");
    println!(
        "  PP  = m·b·(s/c)·h · (forward unless last stage + backward unless first) · act_bytes"
    );
    println!("  EMB = 2(e−1)/e·V·h/t · grad_bytes over the embedding group (p > 1)");
    println!(
        "  {:>6} {:>14} {:>14} {:>14} {:>14} {:>14}",
        "rank", "TP", "DP", "PP", "EMB", "total"
    );
    for rank in layout.rank_offset()..layout.rank_offset() + layout.world_size() {
        let first = layout.is_first_stage(rank)?;
        let last = layout.is_last_stage(rank)?;
        let tp_bytes = m * layers_per_stage * 4.0 * ring_all_reduce(activation, t) * act;
        let embedding_group = layout
            .group_of(GroupKind::Embedding, rank)
            .context("embedding group")?;
        let holds_embedding = embedding_group.is_some();
        let params = layers_per_stage * 12.0 * h * h / t as f64
            + if holds_embedding {
                embedding_shard
            } else {
                0.0
            };
        let dp_bytes = ring_all_reduce(params, dp_cp) * grad;
        let directions = f64::from(u8::from(!last) + u8::from(!first));
        let pp_bytes = m * activation * directions * act;
        let emb_bytes = match embedding_group {
            Some(group) if p > 1 => ring_all_reduce(embedding_shard, group.len()) * grad,
            _ => 0.0,
        };
        let total = tp_bytes + dp_bytes + pp_bytes + emb_bytes;
        println!(
            "  {rank:>6} {:>14} {:>14} {:>14} {:>14} {:>14}",
            human(tp_bytes),
            human(dp_bytes),
            human(pp_bytes),
            human(emb_bytes),
            human(total)
        );
    }
    Ok(())
}

fn human(bytes: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}
