//! What a run prints besides its progress: the first line (the model, layout and data),
//! and at the end the busiest rank's figures (transfers, host waits, memory, the
//! communication the compute hid), the check against one rank, samples and the curves.

use crate::args::{Args, Backend, Precision};
use crate::check::compare_with_one_rank;
use crate::config::pipeline_schedule;
use crate::data::Corpus;
use crate::train::{self, Hidden, RankResult};
use crate::{checkpoint, memory, report, stop};
use anyhow::Result;

/// The groups whose communication the overlap figure names, in the order it names them.
pub(crate) fn overlap_groups() -> impl Iterator<Item = &'static str> {
    ferrotron_parallel_state::GroupKind::ALL
        .into_iter()
        .map(|kind| kind.name())
        .chain(["world"])
}

/// A rank's transfers and host waits per step, its peak memory, its modelled step time,
/// and the share of its communication left exposed, in all and of each of
/// [`overlap_groups`] (-1: none), as numbers to take the largest of.
pub(crate) fn step_costs(result: &RankResult) -> Vec<f64> {
    let t = result.transfers_per_step;
    let hidden = result.communication_hidden.as_ref();
    let exposed = |share: Option<f64>| share.map_or(-1.0, |hidden| 1.0 - hidden);
    let by_group = overlap_groups().map(|name| {
        let groups = hidden.map(|h| h.by_group.as_slice()).unwrap_or_default();
        exposed(
            groups
                .iter()
                .find(|(g, _)| g == name)
                .map(|(_, share)| *share),
        )
    });
    [
        t.to_device_bytes as f64,
        t.to_device_copies as f64,
        t.to_host_bytes as f64,
        t.to_host_copies as f64,
        result.host_waits_per_step,
        result.peak_bytes as f64,
        result.modelled_step.unwrap_or(-1.0),
        exposed(hidden.map(|h| h.all)),
    ]
    .into_iter()
    .chain(by_group)
    .collect()
}

/// The model state and the peak's phases of the rank with the largest peak, given that
/// peak (the ranks that reach it report theirs, the others zeros, and the largest of
/// each figure is kept).
pub(crate) fn busiest_model_state(result: &RankResult, peak: usize) -> Vec<f64> {
    let s = result.model_state;
    let state = [s.values, s.grads, s.masters, s.moments];
    let mine = state.iter().chain(&result.peak_phases).map(|&b| b as f64);
    match result.peak_bytes == peak {
        true => mine.collect(),
        false => vec![0.0; state.len() + result.peak_phases.len()],
    }
}

/// This rank's peak and model state in its pipeline stage's slots (the others zero), as
/// numbers to take the largest of over the ranks: `pp` peaks, then `pp` model states.
pub(crate) fn stage_memory(result: &RankResult, pp: usize) -> Vec<f64> {
    let mut slots = vec![0.0; 2 * pp];
    let stage = result.coordinates.0;
    slots[stage] = result.peak_bytes as f64;
    slots[pp + stage] = result.model_state.total() as f64;
    slots
}

pub(crate) fn set_stage_memory(result: &mut RankResult, slots: &[f64]) {
    let pp = slots.len() / 2;
    result.stage_peaks = (0..pp)
        .map(|s| [slots[s] as usize, slots[pp + s] as usize])
        .collect();
}

pub(crate) fn set_model_state(result: &mut RankResult, figures: &[f64]) {
    let [values, grads, masters, moments] = [0, 1, 2, 3].map(|i| figures[i] as usize);
    result.model_state.values = values;
    result.model_state.grads = grads;
    result.model_state.masters = masters;
    result.model_state.moments = moments;
    for (phase, &bytes) in result.peak_phases.iter_mut().zip(&figures[4..]) {
        *phase = bytes as usize;
    }
}

/// The largest of each figure over the ranks: the report shows the busiest rank's (the
/// last pipeline stage reads the loss, the first uploads the batch).
pub(crate) fn busiest_rank(costs: impl Iterator<Item = Vec<f64>>) -> Vec<f64> {
    costs
        .reduce(|most, c| most.into_iter().zip(c).map(|(m, c)| m.max(c)).collect())
        .unwrap_or_default()
}

pub(crate) fn set_step_costs(result: &mut RankResult, costs: Vec<f64>) {
    let [to_device, to_device_copies, to_host, to_host_copies, waits, peak, step, exposed] =
        std::array::from_fn(|i| costs.get(i).copied().unwrap_or(-1.0));
    // The rank that hides the least speaks for the run, for each group too.
    let hidden = |exposed: f64| (exposed >= 0.0).then_some(1.0 - exposed);
    result.modelled_step = (step >= 0.0).then_some(step);
    let by_group = (overlap_groups().zip(costs.iter().skip(8)))
        .filter_map(|(name, &exposed)| Some((name.to_string(), hidden(exposed)?)))
        .collect();
    result.communication_hidden = hidden(exposed).map(|all| Hidden { all, by_group });
    result.peak_bytes = peak as usize;
    result.transfers_per_step = ferrotron_tape::Transfers {
        to_device_bytes: to_device as u64,
        to_device_copies: to_device_copies as u64,
        to_host_bytes: to_host as u64,
        to_host_copies: to_host_copies as u64,
    };
    result.host_waits_per_step = waits;
}

pub(crate) fn announce(args: &Args, corpus: &Corpus, dp: usize) {
    println!(
        "GPT: {} layers, hidden {}, {} heads, context {} | {} | {} steps of {} sequences | \
         data: {}",
        args.layers,
        args.hidden,
        args.heads,
        args.seq,
        describe_layout(args, dp),
        args.steps,
        args.batch * dp,
        corpus.describe()
    );
    println!("{}", crate::config::describe_attention(args));
    if args.num_experts > 0 {
        println!(
            "mixture of experts: {} experts, top-{}, in {}, divided among {} expert-parallel \
             ranks, {}",
            args.num_experts,
            args.moe_top_k,
            match args.moe_layer_freq {
                1 => "every block".to_string(),
                n => format!("blocks 0, {n}, {}, …", 2 * n),
            },
            args.expert_parallel,
            match args.moe_capacity_factor {
                Some(f) => format!("capacity factor {f}"),
                None => "dropless".to_string(),
            } + &match args.moe_shared_expert_intermediate_size {
                Some(width) => format!(", a shared expert of width {width}"),
                None => String::new(),
            }
        );
    }
    if let Some(dir) = &args.resume {
        println!("resuming the run saved in {}", dir.display());
        let old = checkpoint::TrainerState::read(dir).is_ok_and(|s| s.format < 2);
        if old {
            println!(
                "note: this checkpoint predates Megatron's schedule position and weight-decay \
                 groups: the steps from here take the rate one position earlier and leave \
                 biases and norms undecayed, unlike the run that saved it"
            );
        }
    }
}

/// The first line's middle: the ranks, how they split the work, the backend, device and
/// format ("TP 2 × PP 1 × DP 2 = 4 ranks on the local backend, cpu").
fn describe_layout(args: &Args, dp: usize) -> String {
    let cp = match args.cp {
        1 => String::new(),
        cp => format!(" × CP {cp}"),
    };
    let schedule = if args.pp > 1 || args.microbatches > 1 {
        let chunks = match args.virtual_stages {
            1 => String::new(),
            v => format!(", {v} chunks per stage"),
        };
        let name = pipeline_schedule(args).name();
        format!(
            ", {name} schedule, {} microbatches{chunks}",
            args.microbatches
        )
    } else {
        String::new()
    };
    let sp = match args.sequence_parallel {
        true => " with sequence parallelism",
        false => "",
    };
    let zero = match args.use_distributed_optimizer {
        true => ", AdamW sharded over DP",
        false => "",
    };
    let backend = match args.backend {
        Backend::Local => "local",
        Backend::Mpi => "mpi",
        Backend::Nccl => "nccl",
    };
    let precision = match args.precision {
        Precision::Fp32 => "",
        Precision::Bf16 => ", bf16",
        Precision::Fp16 => ", fp16",
    };
    format!(
        "TP {} × PP {}{cp} × DP {dp} = {} ranks{schedule}{sp}{zero} on the {backend} backend, \
         {}{precision}",
        args.tp,
        args.pp,
        args.tp * args.pp * args.cp * dp,
        args.device
    )
}

/// On world rank 0 after training: the loss curve, the samples and, with --check, the
/// comparison against one rank. The comparison's line is the program's last.
pub(crate) fn finish(args: &Args, corpus: &Corpus, dp: usize, result: RankResult) -> Result<()> {
    // Training is over: a signal from here on (during --check, say) ends the program.
    stop::uninstall();
    write_curves(args, corpus, dp, &result)?;
    if let Some(dir) = result.saved.last() {
        let saves = result.saved.len();
        let wait = result.save_wait.as_secs_f64() * 1e3 / saves as f64;
        println!("checkpoint: {}", dir.display());
        println!("saves: {saves}, training waited {wait:.1} ms per save");
    }
    if let Some(step) = result.stopped {
        match result.saved.last() {
            Some(dir) => println!(
                "stopped by a signal after step {step}; --resume {} continues it",
                dir.display()
            ),
            None => println!("stopped by a signal after step {step}; nothing saved (no --save)"),
        }
        return Ok(());
    }
    println!("samples:");
    for sample in &result.samples {
        println!("  {sample:?}");
    }
    if let Some(profile) = &result.profile {
        print!("{}", report::profile_table(profile));
    }
    print_device_costs(args, &result);
    print_memory(args, &result);
    if let Some(tied) = result.tied_copies {
        println!("{}", describe_tied_copies(&tied));
    }
    if args.check {
        compare_with_one_rank(args, corpus, dp, &result)?;
    }
    Ok(())
}

/// The first and last losses, and the curves as CSV and SVG in `--out`.
fn write_curves(args: &Args, corpus: &Corpus, dp: usize, result: &RankResult) -> Result<()> {
    let losses = &result.losses;
    println!(
        "loss: {:.4} at step 1 → {:.4} at step {}",
        losses[0],
        losses[losses.len() - 1],
        losses.len()
    );
    if let Some((step, loss)) = result.validation.last() {
        println!("validation loss: {loss:.4} at step {step}");
    }
    std::fs::create_dir_all(&args.out)?;
    let (csv, svg) = (args.out.join("loss.csv"), args.out.join("loss.svg"));
    let training: Vec<(usize, f32)> = (1..).zip(losses.iter().copied()).collect();
    report::write_csv(&csv, &training)?;
    let validation_csv = args.out.join("validation.csv");
    report::write_csv(&validation_csv, &result.validation)?;
    let title = format!("train-gpt: TP {} × DP {dp}, {}", args.tp, corpus.source);
    report::write_svg(&svg, &training, &result.validation, &title)?;
    println!(
        "loss curve: {}, {} and {}",
        csv.display(),
        validation_csv.display(),
        svg.display()
    );
    Ok(())
}

/// On a device: the busiest rank's transfers and host waits per step, and on the
/// emulated device what its modelled timeline says.
fn print_device_costs(args: &Args, result: &RankResult) {
    if args.device != ferrotron_tape::Device::Cpu {
        let moved = result.transfers_per_step;
        println!(
            "device transfers per step and rank: to device {} bytes, to host {} bytes",
            moved.to_device_bytes, moved.to_host_bytes
        );
        // A mean over the steps, to one decimal (whole numbers print without one).
        let waits = (result.host_waits_per_step * 10.0).round() / 10.0;
        println!("host waits per step and rank: {waits}");
    }
    if let Some(hidden) = &result.communication_hidden {
        // The emulated device's modelled timeline (see `ferrotron_device::timeline`).
        let groups: Vec<String> = (hidden.by_group.iter())
            .map(|(group, share)| format!("{group} {:.1}%", 100.0 * share))
            .collect();
        println!(
            "communication hidden behind compute: {:.1}% (by group: {})",
            100.0 * hidden.all,
            groups.join(", ")
        );
    }
    if let Some(groups) = &result.device_groups {
        // Opened when first used: NCCL communicators on a GPU, their stand-ins elsewhere.
        println!(
            "device communicators opened by rank 0: {} ({})",
            groups.len(),
            groups.join(", ")
        );
    }
    if let Some(step) = result.modelled_step {
        // The same timeline: each call timed at an H200's rates, the slowest rank's step.
        println!("modelled step time: {:.1} µs", step * 1e6);
    }
}

/// The busiest rank's measured peak memory, what it held, and each stage's.
fn print_memory(args: &Args, result: &RankResult) {
    let on_gpu = matches!(args.device, ferrotron_tape::Device::Cuda(_));
    println!(
        "measured peak per rank: {} bytes{}",
        result.peak_bytes,
        if on_gpu { " of device memory" } else { "" }
    );
    let s = &result.model_state;
    println!(
        "  of which model state {} (parameters {}, gradients {}, master weights {}, AdamW \
         moments {}), activations and the rest {}",
        s.total(),
        s.values,
        s.grads,
        s.masters,
        s.moments,
        result.peak_bytes.saturating_sub(s.total())
    );
    // By phase only where the allocator sees it (host memory, the emulated device's).
    if !on_gpu {
        let phases: Vec<String> = (memory::PHASES.iter().zip(&result.peak_phases))
            .map(|(phase, bytes)| format!("{} {bytes}", phase.name()))
            .collect();
        println!("  held by what allocated it: {}", phases.join(", "));
    }
    if result.stage_peaks.len() > 1 {
        let stages: Vec<String> = (result.stage_peaks.iter().enumerate())
            .map(|(i, [peak, state])| format!("stage {i} {peak} bytes (model state {state})"))
            .collect();
        println!("measured peak per pipeline stage: {}", stages.join(", "));
    }
}

/// What `--check` found of the two stages' copies of the tied embedding.
pub(crate) fn describe_tied_copies(tied: &train::TiedCopies) -> String {
    match tied.first_difference {
        None => format!(
            "tied embedding copies: bit-identical on the first and last stage after each of \
             {} steps",
            tied.steps
        ),
        Some((step, elements)) => format!(
            "tied embedding copies: the first and last stage's differ in {elements} \
             elements after step {step}"
        ),
    }
}
