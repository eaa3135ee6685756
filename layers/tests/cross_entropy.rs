//! Vocabulary-parallel cross-entropy on TP ∈ {1, 2, 3, 4} (vocabulary 10: uneven for 3
//! and 4), on the CPU and (TP 1 and 3) the emulated device, equals tape's fused serial
//! cross-entropy — loss and logit gradients — with label smoothing, ignore_index and
//! every reduction. A mean over no tokens is 0, and
//! the per-token loss over 2 data-parallel × 2 tensor-parallel ranks equals the serial
//! mean over the global batch's non-ignored tokens, value and parameter gradients.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{assert_close, full_grads, grads_of, join, part, AnyResult};
use ferrotron_comm_core::{run_local, Communicator, CommunicatorExt, ReduceOp};
use ferrotron_layers::{
    vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_per_token, ColumnParallelLinear,
    LinearOptions, MasterInit, TensorParallel,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{CrossEntropyOptions, Device, Generator, Parameter, Reduction, Tape, Tensor};

const ROWS: usize = 6;
const VOCAB: usize = 10;
const LABELS: [i64; ROWS] = [3, -100, 9, 0, 5, 7];

fn serial(
    logits: &Tensor,
    weights: &Tensor,
    options: &CrossEntropyOptions,
) -> AnyResult<(Tensor, Tensor)> {
    let p = Parameter::new("logits", logits.clone());
    let tape = Tape::new();
    let loss = tape.watch(&p)?.cross_entropy(&LABELS, options)?;
    weighted(&loss, weights)?.backward()?;
    Ok((loss.detach(), p.grad().unwrap()))
}

/// A scalar from any reduction's output, so that `None` gets a non-uniform upstream grad.
fn weighted(loss: &Tensor, weights: &Tensor) -> ferrotron_tape::Result<Tensor> {
    if loss.ndim() == 0 {
        loss.scale(1.7)
    } else {
        loss.mul(weights)?.sum()
    }
}

#[test]
fn matches_serial_cross_entropy_for_every_tp_and_option() -> AnyResult<()> {
    let mut rng = Generator::new(17);
    // Large logits check the stable log-sum-exp.
    let logits = Tensor::randn(&[2, ROWS / 2, VOCAB], 30.0, &mut rng);
    let weights = Tensor::randn(&[2, ROWS / 2], 1.0, &mut rng);
    let labels_shaped = LABELS;
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        for label_smoothing in [0.0, 0.1] {
            let options = CrossEntropyOptions {
                ignore_index: Some(-100),
                label_smoothing,
                reduction,
            };
            let (want_loss, want_grad) = serial(&logits, &weights, &options)?;
            // The emulated device runs the device path: its all-reduces on device memory.
            for (tp_size, device) in [
                (1, Device::Cpu),
                (2, Device::Cpu),
                (3, Device::Cpu),
                (4, Device::Cpu),
                (1, Device::Emulated),
                (3, Device::Emulated),
            ] {
                let what = format!("tp={tp_size} {device} {reduction:?} eps={label_smoothing}");
                let ranks = run_local(tp_size, |comm| -> AnyResult<(Tensor, Tensor)> {
                    let tp = common::tp_context(comm, false);
                    let shard = part(&logits, 2, tp.rank(), tp.size()).to_device(device)?;
                    let p = Parameter::new("logits", shard);
                    let tape = Tape::new();
                    let loss = vocab_parallel_cross_entropy(
                        &tape.watch(&p)?,
                        &labels_shaped,
                        tp.group(),
                        VOCAB,
                        &options,
                    )?;
                    assert_eq!(loss.device(), device);
                    weighted(&loss, &weights.to_device(device)?)?.backward()?;
                    Ok((loss.detach(), p.grad().unwrap().to_device(Device::Cpu)?))
                })?;
                for (rank, (loss, _)) in ranks.iter().enumerate() {
                    assert_close(&format!("{what}: loss on rank {rank}"), loss, &want_loss);
                }
                let grads: Vec<Tensor> = ranks.iter().map(|r| r.1.clone()).collect();
                assert_close(
                    &format!("{what}: logits grad"),
                    &join(&grads, 2),
                    &want_grad,
                );
            }
        }
    }
    Ok(())
}

/// Without label smoothing the loss does not involve the sum of the logits, which can
/// overflow f32 where every term of the loss stays finite.
#[test]
fn without_smoothing_an_overflowing_logit_sum_stays_out_of_the_loss() -> AnyResult<()> {
    let logits = Tensor::from_vec(vec![3e38, 3e38, 0.0, 0.0], &[1, 4])?;
    let losses = run_local(2, |comm| -> AnyResult<f32> {
        let tp = common::tp_context(comm, false);
        let shard = part(&logits, 1, tp.rank(), tp.size());
        let options = CrossEntropyOptions::default();
        Ok(vocab_parallel_cross_entropy(&shard, &[0], tp.group(), 4, &options)?.item()?)
    })?;
    for loss in losses {
        assert!(loss.is_finite() && (0.0..1.0).contains(&loss), "{loss}");
    }
    Ok(())
}

#[test]
fn rejects_out_of_range_labels_and_bad_shapes() -> AnyResult<()> {
    let checks = run_local(2, |comm| -> AnyResult<(bool, bool, bool)> {
        let tp = common::tp_context(comm, false);
        let options = CrossEntropyOptions::default();
        let logits = Tensor::zeros(&[2, 5]);
        let label = vocab_parallel_cross_entropy(&logits, &[1, 10], tp.group(), 10, &options);
        let count = vocab_parallel_cross_entropy(&logits, &[1], tp.group(), 10, &options);
        let width = vocab_parallel_cross_entropy(
            &Tensor::zeros(&[2, 4]),
            &[1, 2],
            tp.group(),
            10,
            &options,
        );
        Ok((
            matches!(
                label,
                Err(ferrotron_layers::Error::LabelOutOfRange {
                    label: 10,
                    vocab_size: 10,
                    ..
                })
            ),
            matches!(count, Err(ferrotron_layers::Error::Shape { .. })),
            matches!(width, Err(ferrotron_layers::Error::Shape { .. })),
        ))
    })?;
    assert_eq!(checks, vec![(true, true, true); 2]);
    Ok(())
}

#[test]
fn mean_over_only_ignored_labels_is_zero_with_zero_gradient() -> AnyResult<()> {
    let logits = Tensor::randn(&[3, VOCAB], 1.0, &mut Generator::new(4));
    for tp_size in [1, 2] {
        let ranks = run_local(tp_size, |comm| -> AnyResult<(f32, Vec<f32>)> {
            let tp = common::tp_context(comm, false);
            let p = Parameter::new("logits", part(&logits, 1, tp.rank(), tp.size()));
            let tape = Tape::new();
            let loss = vocab_parallel_cross_entropy(
                &tape.watch(&p)?,
                &[-100; 3],
                tp.group(),
                VOCAB,
                &CrossEntropyOptions::default(),
            )?;
            loss.backward()?;
            Ok((loss.item()?, p.grad().unwrap().to_vec()?))
        })?;
        for (rank, (loss, grad)) in ranks.iter().enumerate() {
            assert_eq!(*loss, 0.0, "tp={tp_size} rank {rank}: loss");
            assert!(
                grad.iter().all(|&g| g == 0.0),
                "tp={tp_size} rank {rank}: {grad:?}"
            );
        }
    }
    Ok(())
}

const DP: usize = 2;
const TOKENS: usize = 5; // per data-parallel rank
const HIDDEN: usize = 4;
const HEAD_VOCAB: usize = 7; // 4 + 3 over TP 2

/// What one world rank reports from a per-token step.
struct PerTokenRank {
    dp_rank: usize,
    tp_rank: usize,
    loss: f32,
    global_tokens: usize,
    global_mean: f32,
    /// This rank's plain [`Reduction::Mean`], for showing what per-token fixes.
    rank_mean: f32,
    /// Parameter gradients after averaging over the data-parallel group, as DDP does.
    grads: Vec<(String, ferrotron_layers::Sharding, Tensor)>,
}

fn head(tp: &TensorParallel) -> ferrotron_layers::Result<ColumnParallelLinear> {
    let init = MasterInit::new(11, 0.5);
    ColumnParallelLinear::new(
        tp,
        "head",
        HIDDEN,
        HEAD_VOCAB,
        false,
        LinearOptions::default(),
        &init,
    )
}

/// Serial reference: one rank, the whole batch, mean over its non-ignored tokens.
fn serial_head(x: &Tensor, labels: &[i64]) -> AnyResult<(f32, BTreeMap<String, Tensor>)> {
    let mut ranks = run_local(1, |comm| -> AnyResult<_> {
        let tp = common::tp_context(comm, false);
        let head = head(&tp)?;
        let logits = head.forward(&Tape::new(), x)?.output;
        let options = CrossEntropyOptions {
            ignore_index: Some(-100),
            ..CrossEntropyOptions::default()
        };
        let loss = vocab_parallel_cross_entropy(&logits, labels, tp.group(), HEAD_VOCAB, &options)?;
        loss.backward()?;
        Ok((loss.item()?, grads_of(&head)))
    })?;
    let (loss, grads) = ranks.remove(0);
    Ok((loss, full_grads(&[grads])))
}

/// DP 2 × TP 2 on 4 rank threads; data-parallel rank r gets tokens `r·TOKENS..`.
fn per_token_head(x: &Tensor, labels: &[i64]) -> AnyResult<Vec<PerTokenRank>> {
    let layout = RankLayout::builder(DP * 2).tp(2).build()?;
    Ok(run_local(DP * 2, |comm| -> AnyResult<PerTokenRank> {
        let state = ParallelState::new(Arc::new(comm) as Arc<dyn Communicator>, layout.clone())?;
        let tp = TensorParallel::from_state(&state);
        let head = head(&tp)?;
        let rows = state.dp_rank() * TOKENS..(state.dp_rank() + 1) * TOKENS;
        let x = x.narrow(0, rows.start, TOKENS)?;
        let labels = &labels[rows];
        let logits = head.forward(&Tape::new(), &x)?.output;
        let options = CrossEntropyOptions {
            ignore_index: Some(-100),
            ..CrossEntropyOptions::default()
        };
        let rank_mean =
            vocab_parallel_cross_entropy(&logits, labels, tp.group(), HEAD_VOCAB, &options)?
                .item()?;
        let token_loss = vocab_parallel_cross_entropy_per_token(
            &logits,
            labels,
            tp.group(),
            HEAD_VOCAB,
            &options,
            state.dp(),
        )?;
        token_loss.loss.backward()?;
        let mut grads = grads_of(&head);
        for (_, _, grad) in &mut grads {
            let mut values = grad.to_vec()?;
            state.dp().all_reduce_slice(&mut values, ReduceOp::Avg)?;
            *grad = Tensor::from_vec(values, grad.shape())?;
        }
        Ok(PerTokenRank {
            dp_rank: state.dp_rank(),
            tp_rank: state.tp_rank(),
            loss: token_loss.loss.item()?,
            global_tokens: token_loss.global_tokens,
            global_mean: token_loss.global_mean.item()?,
            rank_mean,
            grads,
        })
    })?)
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= common::RTOL * b.abs().max(1e-6)
}

#[test]
fn per_token_loss_over_data_parallel_ranks_equals_the_global_token_mean() -> AnyResult<()> {
    let mut rng = Generator::new(8);
    let x = Tensor::randn(&[DP * TOKENS, HIDDEN], 1.0, &mut rng);
    // Rank 0 ignores one token, rank 1 three; then rank 1 ignores all of its tokens.
    let cases: [(&str, [i64; DP * TOKENS]); 2] = [
        (
            "1 and 3 ignored",
            [3, -100, 6, 0, 2, -100, 5, -100, -100, 1],
        ),
        (
            "rank 1 all ignored",
            [3, 4, -100, 0, 2, -100, -100, -100, -100, -100],
        ),
    ];
    for (what, labels) in cases {
        let (want_loss, want_grads) = serial_head(&x, &labels)?;
        let tokens = labels.iter().filter(|&&l| l != -100).count();
        let ranks = per_token_head(&x, &labels)?;
        let average = ranks.iter().map(|r| r.loss).sum::<f32>() / ranks.len() as f32;
        assert!(
            close(average, want_loss),
            "{what}: DP average {average} vs serial {want_loss}"
        );
        let naive = ranks.iter().map(|r| r.rank_mean).sum::<f32>() / ranks.len() as f32;
        assert!(
            (naive - want_loss).abs() > 0.05 * want_loss,
            "{what}: the case must tell per-rank means ({naive}) from the token mean ({want_loss})"
        );
        for rank in &ranks {
            assert_eq!(rank.global_tokens, tokens, "{what}");
            assert!(
                close(rank.global_mean, want_loss),
                "{what}: {} vs {want_loss}",
                rank.global_mean
            );
        }
        for dp_rank in 0..DP {
            let mut parts: Vec<&PerTokenRank> =
                ranks.iter().filter(|r| r.dp_rank == dp_rank).collect();
            parts.sort_by_key(|r| r.tp_rank);
            let grads: Vec<_> = parts.iter().map(|r| r.grads.clone()).collect();
            for (name, grad) in full_grads(&grads) {
                assert_close(
                    &format!("{what}: dp rank {dp_rank} grad of {name}"),
                    &grad,
                    &want_grads[&name],
                );
            }
        }
    }
    Ok(())
}

#[test]
fn per_token_loss_without_any_token_is_zero() -> AnyResult<()> {
    let x = Tensor::randn(&[DP * TOKENS, HIDDEN], 1.0, &mut Generator::new(9));
    for rank in per_token_head(&x, &[-100; DP * TOKENS])? {
        assert_eq!(
            (rank.loss, rank.global_mean, rank.global_tokens),
            (0.0, 0.0, 0)
        );
        for (name, _, grad) in &rank.grads {
            assert!(grad.to_vec()?.iter().all(|&g| g == 0.0), "{name}: {grad:?}");
        }
    }
    Ok(())
}

#[test]
fn per_token_loss_takes_only_the_mean_reduction() -> AnyResult<()> {
    let results = run_local(1, |comm| -> AnyResult<bool> {
        let tp = common::tp_context(comm, false);
        let options = CrossEntropyOptions {
            reduction: Reduction::Sum,
            ..CrossEntropyOptions::default()
        };
        let result = vocab_parallel_cross_entropy_per_token(
            &Tensor::zeros(&[2, VOCAB]),
            &[1, 2],
            tp.group(),
            VOCAB,
            &options,
            tp.group(),
        );
        Ok(matches!(
            result,
            Err(ferrotron_layers::Error::Config { .. })
        ))
    })?;
    assert_eq!(results, vec![true]);
    Ok(())
}
