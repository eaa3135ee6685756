//! Gradient-norm clipping on TP ∈ {2, 4}, with and without sequence parallelism, equals
//! clipping the serial model: the same norm, and the same clipped gradients. A NaN on one
//! rank is seen by all, and nothing is scaled.

mod common;

use common::{assert_close, full_grads, grads_of, part, tp_context, AnyResult};
use ferrotron_comm_core::run_local;
use ferrotron_layers::{
    all_reduce_sequence_parallel_grads, clip_grad_norm, BlockConfig, GradNorm, MasterInit, Module,
    RngTracker, Sharding, TransformerBlock,
};
use ferrotron_tape::{Generator, Parameter, Tape, Tensor};

const SEQ: usize = 6;
const BATCH: usize = 2;
const HIDDEN: usize = 24;

type RankGrads = Vec<(String, Sharding, Tensor)>;

/// One block's forward and backward on `tp` ranks, then clipping to `max_norm` (a
/// fraction of the serial norm, so it clips); each rank's norm and clipped gradients.
fn clipped(
    tp: usize,
    sequence_parallel: bool,
    max_norm: f64,
) -> AnyResult<Vec<(GradNorm, RankGrads)>> {
    let mut rng = Generator::new(3);
    let input = Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng);
    let weights = Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng);
    Ok(run_local(tp, |comm| -> AnyResult<(GradNorm, RankGrads)> {
        let tp = tp_context(comm, sequence_parallel);
        let config = BlockConfig {
            ffn_hidden: 50,
            ..BlockConfig::new(HIDDEN, 4)
        };
        let init = MasterInit::new(7, 0.2).with_bias_std(0.1);
        let block = TransformerBlock::new(&tp, "block", &config, &init)?;
        let (x, w) = if sequence_parallel {
            (
                part(&input, 0, tp.rank(), tp.size()),
                part(&weights, 0, tp.rank(), tp.size()),
            )
        } else {
            (input.clone(), weights.clone())
        };
        let tape = Tape::new();
        let x = tape.watch(&Parameter::new("x", x))?;
        let out = block.forward(&tape, &x, &mut RngTracker::new(1, tp.rank()))?;
        out.mul(&w)?.sum()?.backward()?;
        all_reduce_sequence_parallel_grads(&block, tp.group())?;
        let norm = clip_grad_norm(&block.parameters(), &tp, &[], max_norm)?;
        Ok((norm, grads_of(&block)))
    })?)
}

#[test]
fn clipping_a_tensor_parallel_block_equals_clipping_the_serial_one() -> AnyResult<()> {
    // The unclipped serial norm, then a limit at a third of it.
    let unclipped = clipped(1, false, 1e9)?;
    let (norm, grads) = &unclipped[0];
    assert!(!norm.clipped && norm.norm > 0.0);
    let by_hand: f64 = grads
        .iter()
        .flat_map(|(_, _, g)| g.to_vec().unwrap())
        .map(|v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt();
    assert!(
        (norm.norm - by_hand).abs() <= 1e-5 * by_hand,
        "{} vs {by_hand}",
        norm.norm
    );
    let max_norm = norm.norm / 3.0;
    let serial = clipped(1, false, max_norm)?;
    let serial_grads = full_grads(&[serial[0].1.clone()]);
    let clipped_norm: f64 = serial_grads
        .values()
        .flat_map(|g| g.to_vec().unwrap())
        .map(|v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt();
    assert!(
        (clipped_norm - max_norm).abs() <= 1e-4 * max_norm,
        "{clipped_norm} vs {max_norm}"
    );
    for tp in [2, 4] {
        for sequence_parallel in [false, true] {
            let what = format!("tp={tp} sp={sequence_parallel}");
            let ranks = clipped(tp, sequence_parallel, max_norm)?;
            for (rank, (norm, _)) in ranks.iter().enumerate() {
                assert!(norm.clipped, "{what}: rank {rank} did not clip");
                let relative = (norm.norm - serial[0].0.norm).abs() / serial[0].0.norm;
                assert!(
                    relative <= 1e-5,
                    "{what}: rank {rank} norm {} vs {}",
                    norm.norm,
                    serial[0].0.norm
                );
            }
            let grads: Vec<RankGrads> = ranks.into_iter().map(|(_, g)| g).collect();
            for (name, grad) in full_grads(&grads) {
                assert_close(
                    &format!("{what}: clipped grad of {name}"),
                    &grad,
                    &serial_grads[&name],
                );
            }
        }
    }
    Ok(())
}

#[test]
fn a_nan_gradient_on_one_rank_is_reported_by_every_rank_and_nothing_is_scaled() -> AnyResult<()> {
    let outcomes = run_local(2, |comm| -> AnyResult<(GradNorm, Vec<f32>)> {
        let tp = tp_context(comm, false);
        let a = Parameter::new("a", Tensor::from_vec(vec![3.0, 4.0], &[2])?);
        a.set_grad(Some(Tensor::from_vec(vec![30.0, 40.0], &[2])?))?;
        if tp.rank() == 1 {
            a.set_grad(Some(Tensor::from_vec(vec![f32::NAN, 1.0], &[2])?))?;
        }
        let params = [half_of_four(&a)];
        let norm = clip_grad_norm(&params, &tp, &[], 1.0)?;
        Ok((norm, a.grad().expect("grad").to_vec()?))
    })?;
    for (rank, (norm, grad)) in outcomes.iter().enumerate() {
        assert!(!norm.is_finite() && !norm.clipped, "rank {rank}: {norm:?}");
        if rank == 0 {
            assert_eq!(grad, &[30.0, 40.0], "rank 0's gradient must stay as it was");
        }
    }
    Ok(())
}

#[test]
fn a_limit_that_is_not_positive_and_finite_is_refused() -> AnyResult<()> {
    run_local(1, |comm| -> AnyResult<()> {
        let tp = tp_context(comm, false);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let err = clip_grad_norm(&[], &tp, &[], bad).unwrap_err();
            assert!(err.to_string().contains("max_norm"), "{err}");
        }
        Ok(())
    })?;
    Ok(())
}

#[test]
fn a_norm_at_the_limit_is_scaled_by_megatrons_epsilon_and_one_just_under_it_is_not() -> AnyResult<()>
{
    // Gradient [3, 4]: norm 5. Megatron's coefficient is max_norm / (norm + 1e-6).
    let outcomes = run_local(1, |comm| -> AnyResult<Vec<(GradNorm, Vec<f32>)>> {
        let tp = tp_context(comm, false);
        let mut outcomes = Vec::new();
        for max_norm in [5.0, 5.0 + 1e-6] {
            let a = Parameter::new("a", Tensor::zeros(&[2]));
            a.set_grad(Some(Tensor::from_vec(vec![3.0, 4.0], &[2])?))?;
            let params = [ferrotron_layers::ShardedParameter {
                param: a.clone(),
                sharding: Sharding::Replicated,
                grad_reduce_group: None,
                shared_copy: false,
                expert: false,
            }];
            let norm = clip_grad_norm(&params, &tp, &[], max_norm)?;
            outcomes.push((norm, a.grad().expect("grad").to_vec()?));
        }
        Ok(outcomes)
    })?
    .remove(0);
    let (at_limit, scaled) = &outcomes[0];
    assert!(at_limit.is_finite() && at_limit.clipped, "{at_limit:?}");
    assert_eq!(at_limit.scale, 5.0 / (5.0 + 1e-6));
    let coefficient = at_limit.scale as f32;
    assert_eq!(scaled, &[3.0 * coefficient, 4.0 * coefficient]);
    // A coefficient of exactly 1 leaves the gradients alone.
    let (above_limit, kept) = &outcomes[1];
    assert!(
        above_limit.is_finite() && !above_limit.clipped && above_limit.scale == 1.0,
        "{above_limit:?}"
    );
    assert_eq!(kept, &[3.0, 4.0]);
    Ok(())
}

#[test]
fn clipping_without_any_gradient_is_an_error_on_every_rank_not_a_zero_norm() -> AnyResult<()> {
    // Rank 1 holds no gradient while rank 0 does: a norm. Then neither does: an error on
    // both (under a sharded DDP the gradients are not in the parameters at all).
    let outcomes = run_local(2, |comm| -> AnyResult<(f64, String)> {
        let tp = tp_context(comm, false);
        let a = Parameter::new("a", Tensor::zeros(&[2]));
        if tp.rank() == 0 {
            a.set_grad(Some(Tensor::from_vec(vec![3.0, 4.0], &[2])?))?;
        }
        let params = [half_of_four(&a)];
        let partly = clip_grad_norm(&params, &tp, &[], 100.0)?;
        a.zero_grad();
        let err = clip_grad_norm(&params, &tp, &[], 100.0).unwrap_err();
        Ok((partly.norm, err.to_string()))
    })?;
    for (rank, (norm, err)) in outcomes.iter().enumerate() {
        assert_eq!(*norm, 5.0, "rank {rank}");
        assert!(
            err.contains("no rank holds a gradient"),
            "rank {rank}: {err}"
        );
    }
    Ok(())
}

/// `param` as each of two tensor ranks' half of a 4-vector.
fn half_of_four(param: &Parameter) -> ferrotron_layers::ShardedParameter {
    ferrotron_layers::ShardedParameter {
        param: param.clone(),
        sharding: Sharding::Split {
            dim: 0,
            full_len: 4,
        },
        grad_reduce_group: None,
        shared_copy: false,
        expert: false,
    }
}

/// A weight held by two pipeline stages (a tied embedding): the last stage's copy is a
/// `shared_copy`, so the norm counts the weight once, and clipping scales both copies
/// alike. Unmarked, the norm would count it twice (√2 times larger).
#[test]
fn a_shared_copy_is_scaled_but_counted_once() -> AnyResult<()> {
    use ferrotron_comm_core::Communicator;
    use std::sync::Arc;
    for marked in [true, false] {
        let norms = run_local(2, |comm| -> AnyResult<(f64, Vec<f32>)> {
            let pipeline: Arc<dyn Communicator> = Arc::new(comm);
            let stage = pipeline.rank();
            // Each stage is its own tensor-parallel group of one.
            let alone = pipeline.split(Some(stage as u32), 0, "tp")?.unwrap();
            let tp = ferrotron_layers::TensorParallel::new(alone);
            let copy = Parameter::new("embed.weight", Tensor::zeros(&[2]));
            copy.set_grad(Some(Tensor::from_vec(vec![3.0, 4.0], &[2])?))?;
            let sharded = ferrotron_layers::ShardedParameter {
                param: copy.clone(),
                sharding: Sharding::Split {
                    dim: 0,
                    full_len: 2,
                },
                grad_reduce_group: Some(ferrotron_layers::EMBEDDING_GROUP),
                shared_copy: marked && stage == 1,
                expert: false,
            };
            let norm = clip_grad_norm(&[sharded], &tp, &[&pipeline], 1.0)?;
            Ok((norm.norm, copy.grad().unwrap().to_vec()?))
        })?;
        let expected = if marked { 5.0 } else { 50f64.sqrt() };
        for (stage, (norm, grad)) in norms.iter().enumerate() {
            assert!(
                (norm - expected).abs() < 1e-12,
                "stage {stage}: norm {norm}"
            );
            let scale = 1.0 / (expected + 1e-6);
            let want = [(3.0 * scale) as f32, (4.0 * scale) as f32];
            assert_eq!(grad, &want, "stage {stage} (marked: {marked})");
        }
    }
    Ok(())
}

/// On a device the squares of every gradient add up there: clipping reads one number
/// back (one host wait), however many gradients there are, and the norm is theirs.
#[test]
fn on_a_device_the_norm_is_read_once() -> AnyResult<()> {
    use ferrotron_tape::{host_waits, Device};
    let device = Device::Emulated;
    let results = run_local(1, |comm| -> AnyResult<(u64, f64)> {
        let tp = tp_context(comm, false);
        let params: Vec<ferrotron_layers::ShardedParameter> = (0..6)
            .map(|i| -> AnyResult<_> {
                let param = Parameter::new(format!("p{i}"), Tensor::zeros(&[2]).to_device(device)?);
                let grad = Tensor::from_vec(vec![1.0, 2.0], &[2])?.to_device(device)?;
                param.set_grad(Some(grad))?;
                Ok(ferrotron_layers::ShardedParameter {
                    param,
                    sharding: Sharding::Replicated,
                    grad_reduce_group: None,
                    shared_copy: false,
                    expert: false,
                })
            })
            .collect::<AnyResult<_>>()?;
        let before = host_waits(device);
        let norm = clip_grad_norm(&params, &tp, &[], 100.0)?;
        Ok((host_waits(device) - before, norm.norm))
    })?;
    let (waits, norm) = results[0];
    assert_eq!(waits, 1);
    assert!((norm - 30f64.sqrt()).abs() < 1e-6, "norm {norm}");
    Ok(())
}
