//! Prints a Megatron rank layout: every group and each rank's coordinates.
//!
//! ```text
//! cargo run -p ferrotron-parallel-state --example layout -- --world 16 --tp 2 --pp 4
//! cargo run -p ferrotron-parallel-state --example layout -- --world 16 --tp 2 --pp 4 --json
//! ```
//!
//! `--json` prints one object mapping each group family (`tp, pp, dp, cp, dp-cp, tp-pp,
//! tp-dp, tp-cp, embedding, position-embedding`, plus the expert families when `--ep` or
//! `--expert-tp` is given) to its rank lists in Megatron's order. Invalid
//! configurations exit non-zero with the error on stderr.
//!
//! The bytes each rank sends per step for a model on such a layout, and its memory, are
//! the planner's (`ferrotron_planner::traffic`, `ferrotron_planner::predict`, and `train-gpt --plan --fit`).

use anyhow::{bail, Result};
use clap::Parser;
use ferrotron_parallel_state::{GroupKind, Order, RankLayout};

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
    print_layout(&layout, kinds, expert)
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
