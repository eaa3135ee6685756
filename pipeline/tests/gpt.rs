//! A GPT split over pipeline stages, with tensor and data parallelism, computes the
//! serial model's loss and gradients under every schedule.

use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_ddp::{DdpConfig, DistributedDataParallel};
use ferrotron_layers::{
    vocab_parallel_cross_entropy, BlockConfig, ColumnParallelLinear, LayerNorm, LinearOptions,
    MasterInit, Module, RngTracker, ShardedParameter, TensorParallel, TransformerBlock,
    VocabParallelEmbedding,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_pipeline::{Pipeline, PipelineConfig, Schedule, Stage};
use ferrotron_tape::{CrossEntropyOptions, Tape, Tensor};
use std::collections::BTreeMap;
use std::sync::Arc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const VOCAB: usize = 11;
const HIDDEN: usize = 8;
const HEADS: usize = 2;
const LAYERS: usize = 8;
const SEQ: usize = 4;
/// Sequences per microbatch.
const BATCH: usize = 2;
const MICROBATCHES: usize = 4;

/// The tokens of global sequence `i` and their next-token labels.
fn sequence(i: usize) -> (Vec<usize>, Vec<i64>) {
    let tokens: Vec<usize> = (0..=SEQ).map(|t| (i * 7 + t * 3 + t * t) % VOCAB).collect();
    let labels = tokens[1..].iter().map(|&t| t as i64).collect();
    (tokens[..SEQ].to_vec(), labels)
}

/// Ids and labels laid out `[seq, batch]` for sequences `first..first + count`.
fn batch(first: usize, count: usize) -> (Vec<usize>, Vec<i64>) {
    let seqs: Vec<_> = (first..first + count).map(sequence).collect();
    let mut ids = Vec::new();
    let mut labels = Vec::new();
    for t in 0..SEQ {
        for (tokens, next) in &seqs {
            ids.push(tokens[t]);
            labels.push(next[t]);
        }
    }
    (ids, labels)
}

/// Layers `layers` of the model, with the embedding if it starts the model and the final
/// norm, head and loss if it ends it.
struct GptChunk {
    tp: TensorParallel,
    embed: Option<VocabParallelEmbedding>,
    blocks: Vec<TransformerBlock>,
    head: Option<(LayerNorm, ColumnParallelLinear)>,
    rng: RngTracker,
    /// The first global sequence of this rank's microbatch 0.
    first_sequence: usize,
    ddp: Option<DistributedDataParallel>,
}

impl GptChunk {
    fn new(
        tp: &TensorParallel,
        layers: std::ops::Range<usize>,
    ) -> ferrotron_layers::Result<GptChunk> {
        let init = MasterInit::new(5, 0.3);
        let config = BlockConfig::new(HIDDEN, HEADS);
        let embed = (layers.start == 0)
            .then(|| VocabParallelEmbedding::new(tp, "embed", VOCAB, HIDDEN, &init))
            .transpose()?;
        let head = if layers.end == LAYERS {
            let norm = LayerNorm::new(tp, "ln_f", HIDDEN, config.layer_norm_eps, &init)?;
            let options = LinearOptions::default();
            let head = ColumnParallelLinear::new(tp, "head", HIDDEN, VOCAB, false, options, &init)?;
            Some((norm, head))
        } else {
            None
        };
        let blocks = layers
            .map(|i| TransformerBlock::new(tp, &format!("block{i}"), &config, &init))
            .collect::<ferrotron_layers::Result<_>>()?;
        Ok(GptChunk {
            tp: tp.clone(),
            embed,
            blocks,
            head,
            rng: RngTracker::new(9, tp.rank()),
            first_sequence: 0,
            ddp: None,
        })
    }

    /// The loss of sequences `first..first + count` (the whole model in one chunk), or
    /// this chunk's activation for them.
    fn run(
        &mut self,
        tape: &Tape,
        first: usize,
        count: usize,
        input: Option<&Tensor>,
    ) -> Result<Tensor, BoxError> {
        let (ids, labels) = batch(first, count);
        let mut hidden = match (&self.embed, input) {
            (Some(embed), _) => embed.forward(tape, &ids, &[SEQ, count])?,
            (None, Some(input)) => input.clone(),
            (None, None) => return Err("a middle stage got no input".into()),
        };
        for block in &self.blocks {
            hidden = block.forward(tape, &hidden, &mut self.rng)?;
        }
        let Some((norm, head)) = &self.head else {
            return Ok(hidden);
        };
        let logits = head.forward(tape, &norm.forward(tape, &hidden)?)?.output;
        let options = CrossEntropyOptions::default();
        Ok(vocab_parallel_cross_entropy(
            &logits,
            &labels,
            self.tp.group(),
            VOCAB,
            &options,
        )?)
    }
}

impl Module for GptChunk {
    fn parameters(&self) -> Vec<ShardedParameter> {
        let mut all = Vec::new();
        if let Some(embed) = &self.embed {
            all.extend(embed.parameters());
        }
        for block in &self.blocks {
            all.extend(block.parameters());
        }
        if let Some((norm, head)) = &self.head {
            all.extend(norm.parameters());
            all.extend(head.parameters());
        }
        all
    }
}

impl Stage for GptChunk {
    fn forward(
        &mut self,
        tape: &Tape,
        microbatch: usize,
        input: Option<&Tensor>,
    ) -> Result<Tensor, BoxError> {
        self.run(tape, self.first_sequence + microbatch * BATCH, BATCH, input)
    }

    fn before_backward(&mut self, last: bool) {
        if let Some(ddp) = &self.ddp {
            ddp.set_sync_enabled(last);
        }
    }
}

/// Loss, and every gradient by (tensor-parallel rank, parameter name).
type Outcome = (f32, BTreeMap<(usize, String), Vec<f32>>);

/// The model on `tp` ranks with no pipeline and no data parallelism: the whole global
/// batch in one forward and backward.
fn reference(tp: usize, sequence_parallel: bool) -> Outcome {
    let ranks = run_local(tp, |comm| -> Result<_, BoxError> {
        let tp = TensorParallel::new(Arc::new(comm) as Arc<dyn Communicator>)
            .with_sequence_parallel(sequence_parallel);
        let mut model = GptChunk::new(&tp, 0..LAYERS)?;
        let tape = Tape::new();
        let loss = model.run(&tape, 0, 2 * MICROBATCHES * BATCH, None)?;
        loss.backward()?;
        // Sequence-parallel layer norms and biases hold partial sums until reduced (the
        // pipelined runs' DDP does it).
        ferrotron_layers::all_reduce_sequence_parallel_grads(&model, tp.group())?;
        let loss = loss.item()?;
        Ok((loss, gradients(&model, tp.rank())?))
    })
    .unwrap();
    let loss = ranks[0].0;
    (loss, ranks.into_iter().flat_map(|r| r.1).collect())
}

fn gradients(
    model: &dyn Module,
    tp_rank: usize,
) -> Result<BTreeMap<(usize, String), Vec<f32>>, BoxError> {
    let mut grads = BTreeMap::new();
    for sharded in model.parameters() {
        let grad = sharded.param.grad().ok_or("a parameter got no gradient")?;
        grads.insert((tp_rank, sharded.param.name().to_string()), grad.to_vec()?);
    }
    Ok(grads)
}

/// The same global batch (two data-parallel halves' worth at DP 1) through a pipeline:
/// each data-parallel rank takes `2 / dp` of the sequences of the reference.
fn pipelined(schedule: Schedule, layout: (usize, usize, usize), sp: bool) -> Outcome {
    pipelined_losses(schedule, layout, sp, true, false).0
}

/// [`pipelined`], and the microbatch losses each rank's report holds (with
/// `read_losses` and `overlap_p2p` as given).
fn pipelined_losses(
    schedule: Schedule,
    (pp, tp, dp): (usize, usize, usize),
    sp: bool,
    read_losses: bool,
    overlap_p2p: bool,
) -> (Outcome, Vec<Vec<f32>>) {
    let world = pp * tp * dp;
    let layout = RankLayout::builder(world).tp(tp).pp(pp).build().unwrap();
    let ranks = run_local(world, |comm| -> Result<_, BoxError> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let tp_ctx = TensorParallel::new(state.tp().clone()).with_sequence_parallel(sp);
        let chunks = schedule.chunks();
        let per_chunk = LAYERS / (pp * chunks);
        // Each data-parallel rank runs `2 / dp` reference halves as microbatches.
        let microbatches = MICROBATCHES * 2 / dp;
        let mut stages = Vec::new();
        for chunk in 0..chunks {
            let vstage = chunk * pp + state.pp_rank();
            let mut stage = GptChunk::new(&tp_ctx, vstage * per_chunk..(vstage + 1) * per_chunk)?;
            stage.first_sequence = state.dp_rank() * microbatches * BATCH;
            stage.ddp = Some(DistributedDataParallel::for_model(
                &stage,
                &state,
                DdpConfig::default(),
            )?);
            stages.push(stage);
        }
        // Under sequence parallelism each tensor-parallel rank holds its part of the sequence.
        let seq = if sp { SEQ / tp } else { SEQ };
        let mut config = PipelineConfig::new(schedule, microbatches, &[seq, BATCH, HIDDEN]);
        config.read_losses = read_losses;
        config.overlap_p2p = overlap_p2p;
        let pipeline = Pipeline::new(state.pp().clone(), config)?;
        let mut refs: Vec<&mut dyn Stage> =
            stages.iter_mut().map(|s| s as &mut dyn Stage).collect();
        let report = pipeline.run(&mut refs)?;
        assert!(report.peak_in_flight <= pipeline.planned_peak_in_flight());
        let mut grads = BTreeMap::new();
        for stage in &stages {
            stage.ddp.as_ref().unwrap().finish()?;
            grads.extend(gradients(stage, state.tp_rank())?);
        }
        Ok((report.mean_loss(), state.dp_rank(), grads, report.losses))
    })
    .unwrap();
    let reported = ranks.iter().map(|r| r.3.clone()).collect();
    // The step's loss: the mean over data-parallel ranks of each last stage's mean.
    let losses: Vec<f32> = ranks.iter().filter_map(|r| r.0).collect();
    if !read_losses {
        return ((f32::NAN, BTreeMap::new()), reported);
    }
    assert_eq!(losses.len(), tp * dp);
    let loss = losses.iter().sum::<f32>() / losses.len() as f32;
    let mut grads = BTreeMap::new();
    for (_, dp_rank, rank_grads, _) in ranks {
        for (key, grad) in rank_grads {
            if let Some(seen) = grads.insert(key.clone(), grad.clone()) {
                assert_eq!(
                    seen, grad,
                    "{key:?}: data-parallel replicas disagree (dp rank {dp_rank})"
                );
            }
        }
    }
    ((loss, grads), reported)
}

fn assert_close(what: &str, reference: &Outcome, got: &Outcome) {
    let rel = |a: f32, b: f32, scale: f32| (a - b).abs() / scale.max(1e-3);
    assert!(
        rel(reference.0, got.0, reference.0.abs()) < 1e-5,
        "{what}: loss {} vs {}",
        reference.0,
        got.0
    );
    assert_eq!(
        reference.1.keys().collect::<Vec<_>>(),
        got.1.keys().collect::<Vec<_>>(),
        "{what}: parameters"
    );
    for (key, expected) in &reference.1 {
        let actual = &got.1[key];
        let scale = expected.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (i, (a, b)) in expected.iter().zip(actual).enumerate() {
            assert!(rel(*a, *b, scale) < 1e-5, "{what}: {key:?}[{i}] {a} vs {b}");
        }
    }
}

#[test]
fn every_schedule_and_layout_matches_the_serial_model() {
    let serial = reference(1, false);
    let tensor_parallel = reference(2, false);
    // The tensor-parallel reference is the serial model cut into shards.
    assert!((serial.0 - tensor_parallel.0).abs() < 1e-5);
    for (pp, tp, dp) in [
        (2, 1, 1),
        (2, 2, 1),
        (2, 1, 2),
        (2, 2, 2),
        (4, 1, 1),
        (4, 2, 1),
        (4, 1, 2),
    ] {
        let reference = if tp == 1 { &serial } else { &tensor_parallel };
        for schedule in [
            Schedule::GPipe,
            Schedule::OneFOneB,
            Schedule::Interleaved { virtual_stages: 2 },
        ] {
            let what = format!("{} pp={pp} tp={tp} dp={dp}", schedule.name());
            assert_close(&what, reference, &pipelined(schedule, (pp, tp, dp), false));
        }
    }
}

/// Receives posted one exchange ahead (Megatron's `--overlap-p2p-comm`) carry the same
/// tensors to the same forwards and backwards: the same bits, every schedule.
#[test]
fn receives_posted_ahead_give_the_same_bits() {
    for layout in [(2, 1, 1), (4, 1, 1), (2, 2, 2)] {
        for schedule in [
            Schedule::GPipe,
            Schedule::OneFOneB,
            Schedule::Interleaved { virtual_stages: 2 },
        ] {
            let run = |overlap| pipelined_losses(schedule, layout, false, true, overlap);
            let (batched, ahead) = (run(false), run(true));
            let what = format!("{} {layout:?}", schedule.name());
            assert_eq!(batched.0 .0.to_bits(), ahead.0 .0.to_bits(), "{what}: loss");
            assert_eq!(batched.0 .1, ahead.0 .1, "{what}: gradients");
            assert_eq!(batched.1, ahead.1, "{what}: microbatch losses");
        }
    }
}

/// The last stage's losses come back per microbatch, in microbatch order whatever the
/// schedule (read once, when the step ends), or not at all when not asked for.
#[test]
fn losses_come_back_in_microbatch_order_or_not_at_all() {
    let losses = |schedule, read| pipelined_losses(schedule, (2, 1, 1), false, read, false).1;
    let in_order = losses(Schedule::OneFOneB, true);
    // Rank 1 holds the last stage of 1F1B; with two chunks, rank 1 again (virtual stage 3).
    assert!(in_order[0].is_empty() && in_order[1].len() == 2 * MICROBATCHES);
    assert!(in_order[1].windows(2).any(|w| w[0] != w[1]), "{in_order:?}");
    assert_eq!(losses(Schedule::GPipe, true), in_order);
    let interleaved = losses(Schedule::Interleaved { virtual_stages: 2 }, true);
    for (a, b) in interleaved[1].iter().zip(&in_order[1]) {
        assert!((a - b).abs() < 1e-5, "{interleaved:?} vs {in_order:?}");
    }
    assert!(losses(Schedule::OneFOneB, false).iter().all(Vec::is_empty));
}

/// Under sequence parallelism the stages exchange each rank's part of the sequence.
#[test]
fn sequence_parallel_stages_match_the_sequence_parallel_model() {
    let reference = reference(2, true);
    assert!((reference.0 - self::reference(1, false).0).abs() < 1e-5);
    for schedule in [
        Schedule::OneFOneB,
        Schedule::Interleaved { virtual_stages: 2 },
    ] {
        let what = format!("{} pp=2 tp=2 dp=2, sequence parallel", schedule.name());
        assert_close(&what, &reference, &pipelined(schedule, (2, 2, 2), true));
    }
}

/// A forward-only step (evaluation) gives each microbatch's serial loss on the last
/// stage and records nothing for backward.
#[test]
fn forward_only_steps_give_the_serial_losses() {
    let microbatches = 4;
    let serial: Vec<f32> = run_local(1, |comm| -> Result<_, BoxError> {
        let tp = TensorParallel::new(Arc::new(comm) as Arc<dyn Communicator>);
        let mut model = GptChunk::new(&tp, 0..LAYERS)?;
        (0..microbatches)
            .map(|mb| Ok(model.run(&Tape::new(), mb * BATCH, BATCH, None)?.item()?))
            .collect()
    })
    .unwrap()
    .remove(0);
    for (schedule, pp) in [
        (Schedule::OneFOneB, 4),
        (Schedule::GPipe, 2),
        (Schedule::Interleaved { virtual_stages: 2 }, 2),
    ] {
        let outputs = run_local(pp, |comm| -> Result<_, BoxError> {
            let group: Arc<dyn Communicator> = Arc::new(comm);
            let tp = TensorParallel::new(
                group
                    .clone()
                    .split(Some(group.rank() as u32), 0, "tp")?
                    .ok_or("member")?,
            );
            let chunks = schedule.chunks();
            let per_chunk = LAYERS / (pp * chunks);
            let mut stages = (0..chunks)
                .map(|c| {
                    let vstage = c * pp + group.rank();
                    GptChunk::new(&tp, vstage * per_chunk..(vstage + 1) * per_chunk)
                })
                .collect::<ferrotron_layers::Result<Vec<_>>>()?;
            let mut config = PipelineConfig::new(schedule, microbatches, &[SEQ, BATCH, HIDDEN]);
            config.forward_only = true;
            let pipeline = Pipeline::new(group, config)?;
            let mut refs: Vec<&mut dyn Stage> =
                stages.iter_mut().map(|s| s as &mut dyn Stage).collect();
            let report = pipeline.run(&mut refs)?;
            assert!(report.losses.is_empty());
            for stage in &stages {
                assert!(stage.parameters().iter().all(|p| p.param.grad().is_none()));
            }
            report
                .outputs
                .iter()
                .map(|t| Ok(t.item()?))
                .collect::<Result<Vec<f32>, BoxError>>()
        })
        .unwrap();
        let last = &outputs[pp - 1];
        assert_eq!(last.len(), microbatches, "{}", schedule.name());
        for (a, b) in serial.iter().zip(last) {
            assert!((a - b).abs() < 1e-5, "{}: {a} vs {b}", schedule.name());
        }
        assert!(outputs[..pp - 1].iter().all(Vec::is_empty));
    }
}
