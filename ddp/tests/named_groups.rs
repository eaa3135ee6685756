//! Seed 003's extra reductions: after the DP average, marked parameters are summed over
//! named groups — checked against hand-computed values.

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::run_local;
use ferrotron_ddp::{
    CompressedAllReduce, DdpConfig, DistributedDataParallel, Error, NamedGroupReduction,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{Parameter, Tape, Tensor};

/// TP = 2 × DP = 2 on 4 ranks: TP groups {0,1} {2,3}, DP groups {0,2} {1,3}.
/// Parameters (registration order) `a` (marked "tp"), `b` (unmarked), `c` (marked "tp"),
/// in one bucket, with an unmarked one between the marked ones. World rank r's gradient
/// is `r + 1` for `a`, `10(r + 1)` for `b` and `100(r + 1)` for `c`.
#[test]
fn tp_marked_gradients_are_dp_averaged_then_tp_summed() -> Result<()> {
    let layout = RankLayout::builder(4).tp(2).build()?;
    let grads = run_local(4, |comm| -> Result<Vec<Vec<f32>>> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let params = vec![
            Parameter::new("a", Tensor::ones(&[2])),
            Parameter::new("b", Tensor::ones(&[3])),
            Parameter::new("c", Tensor::ones(&[1])),
        ];
        let mut marks = NamedGroupReduction::new();
        marks.mark(&state, &params[0], &["tp"])?;
        marks.mark(&state, &params[2], &["tp"])?;
        assert_eq!(marks.groups_of(&params[0]), vec!["tp"]);
        assert!(marks.groups_of(&params[1]).is_empty());
        // Reductions run in the registry's order, whatever order the marks came in, so
        // every rank issues them alike.
        let mut order = NamedGroupReduction::new();
        order.mark(&state, &params[1], &["tp-cp", "tp"])?;
        assert_eq!(order.groups_of(&params[1]), vec!["tp", "tp-cp"]);
        // Debug output lists each group with its number of marked parameters.
        assert_eq!(format!("{order:?}"), r#"{"tp": 1, "tp-cp": 1}"#);
        let config = DdpConfig {
            extra_reductions: marks,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(params.clone(), state.dp().clone(), config)?;
        assert_eq!(ddp.buckets().len(), 1);
        let r = state.rank() as f64 + 1.0;
        let tape = Tape::new();
        let loss = tape
            .watch(&params[0])?
            .scale(r)?
            .sum()?
            .add(&tape.watch(&params[1])?.scale(10.0 * r)?.sum()?)?
            .add(&tape.watch(&params[2])?.scale(100.0 * r)?.sum()?)?;
        ddp.backward(&loss)?;
        Ok(params
            .iter()
            .map(|p| p.grad().map(|g| g.to_vec()).transpose())
            .collect::<ferrotron_tape::Result<Option<Vec<_>>>>()?
            .unwrap_or_default())
    })?;
    // DP averages: ranks 0 and 2 → (1 + 3)/2 = 2; ranks 1 and 3 → (2 + 4)/2 = 3.
    // TP sums of the averages: 2 + 3 = 5 on every rank.
    for (rank, g) in grads.iter().enumerate() {
        let dp_average = if rank % 2 == 0 { 2.0 } else { 3.0 };
        assert_eq!(g[0], vec![5.0; 2], "rank {rank} a");
        assert_eq!(g[1], vec![10.0 * dp_average; 3], "rank {rank} b");
        assert_eq!(g[2], vec![500.0], "rank {rank} c");
    }
    Ok(())
}

/// Tied embeddings (Megatron `_allreduce_word_embedding_grads`): PP = 2 × DP = 2 on 4
/// ranks; the first and last stages each hold the word embedding, marked "embedding".
/// Embedding groups {0,2} {1,3}; DP groups {0,1} {2,3}.
#[test]
fn tied_embedding_gradients_are_summed_over_the_embedding_group() -> Result<()> {
    let layout = RankLayout::builder(4).pp(2).build()?;
    let grads = run_local(4, |comm| -> Result<Vec<f32>> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let embedding = Parameter::new("word_embeddings", Tensor::ones(&[2, 2]));
        let mut marks = NamedGroupReduction::new();
        marks.mark(&state, &embedding, &["embedding"])?;
        let config = DdpConfig {
            extra_reductions: marks,
            ..DdpConfig::default()
        };
        let ddp =
            DistributedDataParallel::new(vec![embedding.clone()], state.dp().clone(), config)?;
        let tape = Tape::new();
        let r = state.rank() as f64 + 1.0;
        ddp.backward(&tape.watch(&embedding)?.scale(r)?.sum()?)?;
        Ok(embedding
            .grad()
            .map(|g| g.to_vec())
            .transpose()?
            .unwrap_or_default())
    })?;
    // DP averages: stage 0 (ranks 0, 1) → 1.5; stage 1 (ranks 2, 3) → 3.5. Sum: 5.
    assert_eq!(grads, vec![vec![5.0; 4]; 4]);
    Ok(())
}

/// Each stage's copy of a tied embedding is reduced in a bucket of its own, plain and
/// sharded: at offset 0 of a buffer of the same size on both stages, whatever else each
/// stage holds, so every collective adds its elements in the same order on both and the
/// copies stay bit-identical (a ring's order depends on the position).
#[test]
fn a_tied_embedding_is_reduced_alone_at_the_same_place_on_both_stages() -> Result<()> {
    let layout = RankLayout::builder(4).pp(2).build()?;
    for sharded in [false, true] {
        let buckets = run_local(4, |comm| -> Result<Vec<(usize, usize, usize)>> {
            let state = ParallelState::new(Arc::new(comm), layout.clone())?;
            let embedding = Parameter::new("embed.weight", Tensor::ones(&[8, 4]));
            let other = |name: &str, n: usize| Parameter::new(name, Tensor::ones(&[n]));
            // Stage 0 looks the table up first; stage 1 ends with it, after other weights.
            let params = match state.pp_rank() {
                0 => vec![embedding.clone(), other("pos", 3), other("ln", 5)],
                _ => vec![other("ln_f", 7), embedding.clone()],
            };
            let mut marks = NamedGroupReduction::new();
            marks.mark(&state, &embedding, &["embedding"])?;
            let config = DdpConfig {
                extra_reductions: marks,
                use_distributed_optimizer: sharded,
                ..DdpConfig::default()
            };
            let ddp = DistributedDataParallel::new(params, state.dp().clone(), config)?;
            let bucket = (ddp.buckets().iter())
                .find(|b| b.params.iter().any(|p| p.name == "embed.weight"))
                .expect("a bucket holds the embedding");
            assert_eq!(bucket.params.len(), 1, "alone in its bucket");
            Ok(vec![(
                bucket.params[0].offset,
                bucket.numel,
                bucket.padded_numel,
            )])
        })?;
        let first = &buckets[0];
        assert!(
            buckets.iter().all(|b| b == first),
            "sharded {sharded}: {buckets:?}"
        );
        assert_eq!(first[0].0, 0);
    }
    Ok(())
}

#[test]
fn marking_rejects_the_dp_group_and_unknown_names() -> Result<()> {
    let layout = RankLayout::builder(2).tp(2).build()?;
    run_local(2, |comm| -> Result<()> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let p = Parameter::new("p", Tensor::ones(&[1]));
        let mut marks = NamedGroupReduction::new();
        let err = marks.mark(&state, &p, &["dp"]).unwrap_err();
        assert!(matches!(err, Error::InvalidMark { .. }), "{err}");
        let err = marks.mark(&state, &p, &["no-such-group"]).unwrap_err();
        assert!(matches!(err, Error::ParallelState(_)), "{err}");
        assert!(err.to_string().contains("no-such-group"), "{err}");

        // A mark for a parameter DDP was not given.
        marks.mark(&state, &p, &["tp"])?;
        let other = Parameter::new("other", Tensor::ones(&[1]));
        let config = DdpConfig {
            extra_reductions: marks,
            ..DdpConfig::default()
        };
        let err =
            DistributedDataParallel::new(vec![other], state.dp().clone(), config).unwrap_err();
        assert!(
            matches!(err, Error::InvalidMark { ref name, .. } if name == "p"),
            "{err}"
        );
        Ok(())
    })?;
    Ok(())
}

/// The extra reductions run on the f32 gradients, not in a 16-bit bucket: TP ranks
/// contribute 1 and 2⁻⁸ (both exact in bf16), whose sum 1 + 2⁻⁸ bf16 cannot hold.
#[test]
fn extra_reductions_sum_in_f32_under_a_bf16_comm_hook() -> Result<()> {
    let layout = RankLayout::builder(2).tp(2).build()?;
    let grads = run_local(2, |comm| -> Result<Vec<f32>> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let p = Parameter::new("ln.weight", Tensor::ones(&[3]));
        let mut marks = NamedGroupReduction::new();
        marks.mark(&state, &p, &["tp"])?;
        let config = DdpConfig {
            comm_hook: Arc::new(CompressedAllReduce::bf16()),
            extra_reductions: marks,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(vec![p.clone()], state.dp().clone(), config)?;
        let scale = if state.tp_rank() == 0 {
            1.0
        } else {
            2f64.powi(-8)
        };
        let tape = Tape::new();
        ddp.backward(&tape.watch(&p)?.scale(scale)?.sum()?)?;
        Ok(p.grad()
            .map(|g| g.to_vec())
            .transpose()?
            .unwrap_or_default())
    })?;
    assert_eq!(grads, vec![vec![1.0 + 2f32.powi(-8); 3]; 2]);
    Ok(())
}

/// TP = 2, DP = 1, `find_unused_parameters`: `used_by_one` gets a gradient (3) on TP rank
/// 0 only, `unused` on neither. Both still take part in the one coalesced reduction: the
/// first ends with the sum on both ranks, the second with no gradient.
#[test]
fn marked_parameters_without_gradients_take_part_as_zeros() -> Result<()> {
    let layout = RankLayout::builder(2).tp(2).build()?;
    let grads = run_local(2, |comm| -> Result<Vec<Option<Vec<f32>>>> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let params = vec![
            Parameter::new("used", Tensor::ones(&[2])),
            Parameter::new("used_by_one", Tensor::ones(&[2])),
            Parameter::new("unused", Tensor::ones(&[1])),
        ];
        let mut marks = NamedGroupReduction::new();
        for p in &params {
            marks.mark(&state, p, &["tp"])?;
        }
        let config = DdpConfig {
            find_unused_parameters: true,
            extra_reductions: marks,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(params.clone(), state.dp().clone(), config)?;
        let tape = Tape::new();
        let mut loss = tape.watch(&params[0])?.sum()?;
        if state.tp_rank() == 0 {
            loss = loss.add(&tape.watch(&params[1])?.scale(3.0)?.sum()?)?;
        }
        ddp.backward(&loss)?;
        Ok(params
            .iter()
            .map(|p| p.grad().map(|g| g.to_vec()).transpose())
            .collect::<ferrotron_tape::Result<_>>()?)
    })?;
    for g in &grads {
        assert_eq!(g[0], Some(vec![2.0; 2]));
        assert_eq!(g[1], Some(vec![3.0; 2]));
        assert_eq!(g[2], None);
    }
    Ok(())
}
