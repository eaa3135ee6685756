//! From flags to a run: the refusals of combinations that cannot run (each message names
//! the flag to change and the values that would work), and the training configuration
//! the flags describe.

use crate::args::{Args, Attention, Backend, Decay, PipelineSchedule, Precision};
use crate::args::{RecomputeGranularity, RecomputeMethod, WsdStyle};
use crate::model::{self, GptConfig};
use crate::train::{Schedule, TrainConfig};
use crate::{checkpoint, data, hf, stop};
use anyhow::{bail, ensure, Result};
use ferrotron_tape::{LrDecay, WsdAnneal};

/// Whether the attention core runs fused (`--attention`, `auto` resolved for the device).
pub(crate) fn fused_attention(args: &Args) -> bool {
    match args.attention {
        Attention::Auto => match args.device {
            ferrotron_tape::Device::Cuda(_) => tensor_core_attention(args),
            _ => true,
        },
        Attention::Fused => true,
        Attention::Unfused => false,
    }
}

/// Whether the fused kernel runs on the device's tensor cores at these flags: 16-bit
/// activations, heads 64 or 128 wide, compute capability 8.0 or newer (or the emulated
/// device). On CUDA only that fused kernel beats the unfused one's products on cuBLAS.
fn tensor_core_attention(args: &Args) -> bool {
    let head_dim = args.hidden / args.heads.max(1);
    ferrotron_tape::tensor_core_attention_takes(args.device, args.precision.dtype(), head_dim)
}

/// The attention kernel the run uses, for its first lines.
pub(crate) fn describe_attention(args: &Args) -> String {
    let chosen = match args.attention {
        Attention::Auto => "auto: ",
        _ => "",
    };
    let head_dim = args.hidden / args.heads.max(1);
    let kernel = match fused_attention(args) {
        false => "unfused (scores, softmax and products as separate passes)",
        true if tensor_core_attention(args) => "fused, on tensor cores (mma.m16n8k16)",
        true if args.device == ferrotron_tape::Device::Cpu => "fused, on the CPU",
        true if head_dim <= 64 => "fused, on CUDA cores",
        true => "unfused: the fused kernel takes heads this wide on tensor cores only",
    };
    format!("attention: {chosen}{kernel}, heads {head_dim} wide")
}

/// Checks every flag before any rank starts, saying what would be valid.
pub(crate) fn validate(args: &Args, dp: usize, vocabulary: &data::Vocabulary) -> Result<()> {
    validate_model(args, dp, vocabulary)?;
    ensure!(
        !args.profile || args.device != ferrotron_tape::Device::Cpu,
        "--profile counts device kernels, and the CPU runs none: add --device emulated (launches \
         and bytes) or --device cuda:0 (and their time)"
    );
    ensure!(
        !(args.check && args.eod_mask_loss && args.num_experts > 0 && dp > 1),
        "--check cannot reproduce --eod-mask-loss with --num-experts at --dp {dp} on one \
         rank: the experts route each data-parallel rank's rows apart while the loss \
         weighs each microbatch over all ranks' tokens; check at --dp 1 or without one of \
         them"
    );
    ensure!(
        !(args.eod_mask_loss || args.reset_position_ids)
            || vocabulary.token_id(&args.eod_token).is_some(),
        "--eod-mask-loss and --reset-position-ids: the tokenizer has no token {:?} to end \
         documents with; pass the one the data was made with as --eod-token",
        args.eod_token
    );
    validate_recompute(args)?;
    validate_optimizer(args)?;
    validate_pipeline(args)?;
    if let Some(dir) = &args.init_from {
        let shape = hf::read_shape(dir)?;
        let theirs = (
            shape.layers,
            shape.hidden,
            shape.heads,
            shape.positions,
            shape.vocab,
        );
        ensure!(
            theirs
                == (
                    args.layers,
                    args.hidden,
                    args.heads,
                    args.seq,
                    vocabulary.size()
                ),
            "{} is a GPT-2 of {} layers, width {}, {} heads, {} positions and {} tokens: pass \
             --layers {} --hidden {} --heads {} --seq {} (and the tokenizer it was trained with)",
            dir.display(),
            shape.layers,
            shape.hidden,
            shape.heads,
            shape.positions,
            shape.vocab,
            shape.layers,
            shape.hidden,
            shape.heads,
            shape.positions
        );
        ensure!(
            shape.tied != args.untie_embeddings_and_output_weights,
            "{} has {} embeddings: {} --untie-embeddings-and-output-weights",
            dir.display(),
            if shape.tied { "tied" } else { "untied" },
            if shape.tied { "drop" } else { "pass" }
        );
    }
    if let Some(dir) = &args.resume {
        let saved = checkpoint::TrainerState::read(dir)?;
        let model = train_config(args, vocabulary).model;
        saved.check_compatible(&model, args.batch * dp, args.steps)?;
    }
    Ok(())
}

/// `--recompute-method` goes with `full` recomputation, and `full` needs one.
pub(crate) fn validate_recompute(args: &Args) -> Result<()> {
    match (args.recompute_granularity, args.recompute_method) {
        (Some(RecomputeGranularity::Full), None) => bail!(
            "--recompute-granularity full needs --recompute-method: uniform (the blocks in \
             groups of --recompute-num-layers) or block (the first --recompute-num-layers \
             blocks of each model chunk)"
        ),
        (Some(RecomputeGranularity::Selective), Some(_)) => bail!(
            "--recompute-method applies to --recompute-granularity full; selective \
             recomputes every block's attention core: drop --recompute-method"
        ),
        _ => Ok(()),
    }
}

/// Key/value heads: `--num-query-groups`, else one per head.
pub(crate) fn query_groups(args: &Args) -> usize {
    args.num_query_groups.map_or(args.heads, |g| g as usize)
}

/// `--num-query-groups` against the heads and the tensor-parallel split.
pub(crate) fn validate_query_groups(args: &Args) -> Result<()> {
    let Some(groups) = args.num_query_groups.map(|g| g as usize) else {
        return Ok(());
    };
    ensure!(
        args.heads.is_multiple_of(groups),
        "--num-query-groups {groups} does not divide --heads {}; valid groups: {}",
        args.heads,
        list(&divisors(args.heads))
    );
    ensure!(
        groups.is_multiple_of(args.tp),
        "--num-query-groups {groups} cannot be divided among --tp {} ranks (each rank \
         holds whole groups); valid --tp: {}",
        args.tp,
        list(&divisors(groups))
    );
    Ok(())
}

/// The model's and the batch's sizes against the tensor-parallel split.
pub(crate) fn validate_model(args: &Args, dp: usize, vocabulary: &data::Vocabulary) -> Result<()> {
    ensure!(args.tp >= 1, "--tp must be at least 1");
    ensure!(dp >= 1, "--dp must be at least 1");
    validate_context_parallel(args)?;
    validate_experts(args, dp)?;
    ensure!(args.heads >= 1, "--heads must be at least 1");
    ensure!(
        args.hidden.is_multiple_of(args.heads),
        "--hidden {} is not divisible by --heads {}; valid --heads for this width: {}",
        args.hidden,
        args.heads,
        list(&divisors(args.hidden))
    );
    ensure!(
        args.heads.is_multiple_of(args.tp),
        "--heads {} cannot be divided among --tp {} ranks; valid --tp for {} heads: {}",
        args.heads,
        args.tp,
        args.heads,
        list(&divisors(args.heads))
    );
    validate_query_groups(args)?;
    ensure!(
        args.tp <= vocabulary.size(),
        "--tp {} exceeds the {}-byte vocabulary it divides",
        args.tp,
        vocabulary.size()
    );
    ensure!(
        args.layers >= 1 && args.seq >= 1 && args.batch >= 1 && args.steps >= 1,
        "--layers, --seq, --batch and --steps must be at least 1"
    );
    ensure!(
        !args.sequence_parallel || args.seq >= args.tp,
        "--sequence-parallel splits the --seq {} positions among --tp {} ranks; pass \
         --seq >= {}",
        args.seq,
        args.tp,
        args.tp
    );
    for (flag, p) in [
        ("--hidden-dropout", args.hidden_dropout),
        ("--attention-dropout", args.attention_dropout),
    ] {
        ensure!(
            (0.0..1.0).contains(&p),
            "{flag} {p} is not a probability below 1"
        );
    }
    ensure!(args.eval_batches >= 1, "--eval-batches must be at least 1");
    Ok(())
}

/// Context parallelism: two equal chunks of every sequence per rank, and no attention
/// dropout (the ring keeps no probabilities to draw a mask over).
pub(crate) fn validate_context_parallel(args: &Args) -> Result<()> {
    ensure!(args.cp >= 1, "--cp must be at least 1");
    if args.cp == 1 {
        return Ok(());
    }
    ensure!(
        args.seq.is_multiple_of(2 * args.cp),
        "--cp {} gives each rank two equal chunks of every sequence, so --seq {} must be a \
         multiple of {}; pass --seq {}",
        args.cp,
        args.seq,
        2 * args.cp,
        (args.seq / (2 * args.cp)).max(1) * 2 * args.cp
    );
    ensure!(
        args.attention_dropout == 0.0,
        "--attention-dropout {} with --cp {}: the ring attention keeps no probabilities to draw \
         a dropout mask over; pass --attention-dropout 0",
        args.attention_dropout,
        args.cp
    );
    ensure!(
        !args.sequence_parallel || args.seq / args.cp >= args.tp,
        "--sequence-parallel splits each context-parallel rank's {} positions among --tp {} \
         ranks; pass --seq >= {}",
        args.seq / args.cp,
        args.tp,
        args.tp * args.cp
    );
    Ok(())
}

/// The mixture of experts: experts the expert-parallel size divides, expert-parallel
/// ranks within the data-parallel ones, and routing settings in range.
pub(crate) fn validate_experts(args: &Args, dp: usize) -> Result<()> {
    if args.num_experts == 0 {
        ensure!(
            args.expert_parallel == 1,
            "--expert-parallel {} needs experts: pass --num-experts",
            args.expert_parallel
        );
        ensure!(
            args.moe_shared_expert_intermediate_size.is_none(),
            "--moe-shared-expert-intermediate-size needs experts: pass --num-experts"
        );
        return Ok(());
    }
    let (experts, ep) = (args.num_experts, args.expert_parallel);
    ensure!(ep >= 1, "--expert-parallel must be at least 1");
    ensure!(
        experts.is_multiple_of(ep),
        "--num-experts {experts} cannot be divided among --expert-parallel {ep} ranks; valid \
         --expert-parallel: {}",
        list(&divisors(experts))
    );
    ensure!(
        (dp * args.cp).is_multiple_of(ep),
        "--expert-parallel {ep} groups ranks of the --dp {dp} × --cp {} data-parallel ones; \
         pass an --expert-parallel that divides {}",
        args.cp,
        dp * args.cp
    );
    ensure!(
        (1..=experts).contains(&args.moe_top_k),
        "--moe-top-k {} must be between 1 and --num-experts {experts}",
        args.moe_top_k
    );
    ensure!(
        args.moe_capacity_factor
            .is_none_or(|f| f.is_finite() && f > 0.0),
        "--moe-capacity-factor must be positive"
    );
    ensure!(
        args.moe_layer_freq >= 1,
        "--moe-layer-freq must be at least 1"
    );
    ensure!(
        args.moe_ffn_hidden_size != Some(0),
        "--moe-ffn-hidden-size must be at least 1"
    );
    ensure!(
        args.moe_shared_expert_intermediate_size != Some(0),
        "--moe-shared-expert-intermediate-size must be at least 1"
    );
    ensure!(
        args.init_from.is_none() || args.moe_shared_expert_intermediate_size.is_none(),
        "--init-from upcycles the dense MLP into routed experts only: a shared expert would \
         start from nothing and change the model's function; drop \
         --moe-shared-expert-intermediate-size or --init-from"
    );
    Ok(())
}

/// The schedule, AdamW and the loss scaling.
pub(crate) fn validate_optimizer(args: &Args) -> Result<()> {
    ensure!(
        args.lr > 0.0 && args.lr.is_finite(),
        "--lr must be positive"
    );
    ensure!(
        (args.lr_decay == Decay::Wsd) == args.lr_wsd_decay_steps.is_some(),
        "--lr-decay wsd needs --lr-wsd-decay-steps (the anneal's length), and \
         --lr-wsd-decay-steps needs --lr-decay wsd"
    );
    schedule(args).build()?;
    ensure!(
        args.weight_decay >= 0.0 && args.weight_decay.is_finite(),
        "--weight-decay must be a finite number ≥ 0"
    );
    ensure!(
        args.clip_grad >= 0.0 && args.clip_grad.is_finite(),
        "--clip-grad must be a finite number ≥ 0 (0 turns clipping off)"
    );
    ensure!(
        matches!(args.precision, Precision::Fp16)
            || (args.initial_loss_scale.is_none()
                && args.loss_scale_window.is_none()
                && args.inject_grad_overflow.is_none()),
        "--initial-loss-scale, --loss-scale-window and --inject-grad-overflow are about the \
         loss scaling of --precision fp16 (bf16 has f32's range and f32 needs no scaling); \
         drop them or pass --precision fp16"
    );
    if let Some(scaler) = loss_scaler(args) {
        ferrotron_layers::GradScaler::new(scaler)?;
    }
    // A later step than --steps is allowed: a run cut short and resumed keeps its flags.
    ensure!(
        args.inject_grad_overflow != Some(0),
        "--inject-grad-overflow counts steps from 1"
    );
    Ok(())
}

/// The pipeline's split of the layers and the microbatches its schedule can run.
pub(crate) fn validate_pipeline(args: &Args) -> Result<()> {
    ensure!(args.pp >= 1, "--pp must be at least 1");
    ensure!(
        args.virtual_stages == 1 || args.schedule == PipelineSchedule::Interleaved,
        "--virtual-stages {} needs --schedule interleaved",
        args.virtual_stages
    );
    let parts = args.pp * pipeline_schedule(args).chunks();
    ensure!(
        parts >= 1 && args.layers.is_multiple_of(parts),
        "--layers {} cannot be split evenly over --pp {} × --virtual-stages {} = {parts} \
         parts; valid --pp × --virtual-stages: {}",
        args.layers,
        args.pp,
        args.virtual_stages,
        list(&divisors(args.layers))
    );
    ensure!(
        args.microbatches >= 1 && args.batch.is_multiple_of(args.microbatches),
        "--microbatches {} must divide --batch {}; valid: {}",
        args.microbatches,
        args.batch,
        list(&divisors(args.batch))
    );
    pipeline_schedule(args).validate(args.pp, args.microbatches)?;
    ensure!(
        !args.overlap_param_gather || args.use_distributed_optimizer,
        "--overlap-param-gather overlaps the distributed optimizer's parameter all-gather: \
         add --use-distributed-optimizer"
    );
    ensure!(
        !args.overlap_p2p_comm || args.backend == Backend::Local,
        "--overlap-p2p-comm posts pipeline receives ahead, which a failing stage must be \
         able to withdraw: only the local backend's can (MPI's cannot, NCCL cannot post one \
         alone); leave it out with --backend {}",
        match args.backend {
            Backend::Mpi => "mpi",
            _ => "nccl",
        }
    );
    ensure!(
        args.trace.is_none() || args.backend == Backend::Local,
        "--trace collects every stage's timeline in one process: use the local backend"
    );
    Ok(())
}

pub(crate) fn train_config(args: &Args, vocabulary: &data::Vocabulary) -> TrainConfig {
    TrainConfig {
        model: GptConfig {
            vocab: vocabulary.padded(args.tp),
            valid_vocab: vocabulary.size(),
            layers: args.layers,
            hidden: args.hidden,
            heads: args.heads,
            query_groups: args.num_query_groups.map(|g| g as usize),
            attention: match fused_attention(args) {
                true => ferrotron_tape::AttentionKernel::Fused,
                false => ferrotron_tape::AttentionKernel::Unfused,
            },
            seq: args.seq,
            tied: !args.untie_embeddings_and_output_weights,
            attention_dropout: args.attention_dropout,
            hidden_dropout: args.hidden_dropout,
            recompute_attention_core: args.recompute_granularity
                == Some(RecomputeGranularity::Selective),
            moe: moe_config(args),
        },
        tp: args.tp,
        pp: args.pp,
        cp: args.cp,
        ep: args.expert_parallel,
        pipeline: pipeline_schedule(args),
        microbatches: args.microbatches,
        trace: args.trace.is_some(),
        sequence_parallel: args.sequence_parallel,
        device: args.device,
        batch: args.batch,
        steps: args.steps,
        seed: args.seed,
        schedule: schedule(args),
        clip_grad: (args.clip_grad > 0.0).then_some(args.clip_grad),
        distributed_optimizer: args.use_distributed_optimizer,
        overlap_grad_reduce: !args.no_overlap_grad_reduce,
        overlap_param_gather: args.overlap_param_gather,
        overlap_p2p: args.overlap_p2p_comm,
        bucket_elements: args.ddp_bucket_size.map(|n| n as usize),
        precision: args.precision.dtype(),
        weight_decay: args.weight_decay,
        loss_scaler: loss_scaler(args),
        inject_grad_overflow: args.inject_grad_overflow,
        // Set by the local backend's launch, the one that can inject it.
        fail_collective: None,
        eval_interval: args.eval_interval,
        eval_batches: args.eval_batches,
        resume: args.resume.clone(),
        init_from: args.init_from.clone(),
        save: args.save.clone(),
        save_interval: args.save_interval.map(|n| n as usize),
        save_keep: args.save_keep.map(|n| n as usize),
        async_save: args.async_save,
        recompute: recompute(args),
        // Installed where training starts (`training_config`), not while checking flags.
        stop: None,
        sample: true,
        check_tied: args.check,
        profile: args.profile,
        rows_from_ranks: 1,
        eod_mask: eod_id(args.eod_mask_loss, args, vocabulary),
        reset_positions: eod_id(args.reset_position_ids, args, vocabulary),
    }
}

/// The end-of-document token's id when `wanted` (`validate` has checked that the
/// tokenizer has it).
pub(crate) fn eod_id(wanted: bool, args: &Args, vocabulary: &data::Vocabulary) -> Option<u32> {
    wanted
        .then(|| vocabulary.token_id(&args.eod_token))
        .flatten()
}

/// The mixture of experts and how often a block has one, with --num-experts.
pub(crate) fn moe_config(args: &Args) -> Option<(ferrotron_layers::MoeConfig, usize)> {
    (args.num_experts > 0).then(|| {
        let config = ferrotron_layers::MoeConfig {
            softmax: match args.moe_router_pre_softmax {
                true => ferrotron_layers::RouterSoftmax::BeforeTopK,
                false => ferrotron_layers::RouterSoftmax::AfterTopK,
            },
            aux_loss_coeff: args.moe_aux_loss_coeff,
            z_loss_coeff: args.moe_z_loss_coeff,
            capacity_factor: args.moe_capacity_factor,
            shared_expert_ffn: args.moe_shared_expert_intermediate_size,
            ..ferrotron_layers::MoeConfig::new(
                args.num_experts,
                args.moe_top_k,
                args.moe_ffn_hidden_size.unwrap_or(4 * args.hidden),
            )
        };
        (config, args.moe_layer_freq)
    })
}

/// The run's configuration, with SIGTERM and SIGINT now asking it to stop after a step
/// (a signal before this point ends the program as usual).
pub(crate) fn training_config(args: &Args, vocabulary: &data::Vocabulary) -> TrainConfig {
    TrainConfig {
        stop: Some(stop::install()),
        ..train_config(args, vocabulary)
    }
}

/// The blocks `--recompute-granularity full` recomputes.
pub(crate) fn recompute(args: &Args) -> Option<model::Recompute> {
    let layers = args.recompute_num_layers as usize;
    if args.recompute_granularity != Some(RecomputeGranularity::Full) {
        return None;
    }
    Some(match args.recompute_method? {
        RecomputeMethod::Uniform => model::Recompute::Uniform(layers),
        RecomputeMethod::Block => model::Recompute::Block(layers),
    })
}

/// Dynamic loss scaling for fp16 (on by default there, as in PyTorch's AMP recipe and
/// Megatron's --fp16); `None` otherwise, where the flags are refused before training.
pub(crate) fn loss_scaler(args: &Args) -> Option<ferrotron_layers::GradScalerConfig> {
    let defaults = ferrotron_layers::GradScalerConfig::default();
    matches!(args.precision, Precision::Fp16).then(|| ferrotron_layers::GradScalerConfig {
        init_scale: args.initial_loss_scale.unwrap_or(defaults.init_scale),
        growth_interval: args.loss_scale_window.unwrap_or(defaults.growth_interval),
        ..defaults
    })
}

pub(crate) fn pipeline_schedule(args: &Args) -> ferrotron_pipeline::Schedule {
    match args.schedule {
        PipelineSchedule::Gpipe => ferrotron_pipeline::Schedule::GPipe,
        PipelineSchedule::OneFOneB => ferrotron_pipeline::Schedule::OneFOneB,
        PipelineSchedule::Interleaved => ferrotron_pipeline::Schedule::Interleaved {
            virtual_stages: args.virtual_stages,
        },
    }
}

pub(crate) fn schedule(args: &Args) -> Schedule {
    Schedule {
        lr: args.lr,
        min_lr: args.min_lr.unwrap_or(args.lr / 10.0),
        init_lr: args.lr_warmup_init,
        warmup_steps: args.lr_warmup_steps,
        decay_steps: args.lr_decay_steps,
        decay: match args.lr_decay {
            Decay::Constant => LrDecay::Constant,
            Decay::Linear => LrDecay::Linear,
            Decay::Cosine => LrDecay::Cosine,
            Decay::InverseSquareRoot => LrDecay::InverseSquareRoot,
            Decay::Wsd => LrDecay::Wsd {
                // Refused before training when missing; 0 only reaches the check.
                anneal_steps: args.lr_wsd_decay_steps.unwrap_or(0),
                style: match args.lr_wsd_decay_style {
                    WsdStyle::Linear => WsdAnneal::Linear,
                    WsdStyle::Cosine => WsdAnneal::Cosine,
                    WsdStyle::Exponential => WsdAnneal::Exponential,
                    WsdStyle::MinusSqrt => WsdAnneal::MinusSqrt,
                },
            },
        },
    }
}

/// Tensor-parallel sizes that divide both the world and the key/value heads.
#[cfg(feature = "mpi")]
pub(crate) fn valid_tp(world: usize, heads: usize) -> Vec<usize> {
    divisors(world)
        .into_iter()
        .filter(|d| heads.is_multiple_of(*d))
        .collect()
}

pub(crate) fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

pub(crate) fn list(values: &[usize]) -> String {
    values
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
