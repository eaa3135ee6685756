//! Vocabulary-parallel cross-entropy on TP ∈ {1, 2, 3, 4} (vocabulary 10: uneven for 3
//! and 4) equals tape's fused serial cross-entropy — loss and logit gradients — with
//! label smoothing, ignore_index and every reduction.

mod common;

use comm_core::run_local;
use common::{assert_close, join, part, AnyResult};
use layers::vocab_parallel_cross_entropy;
use tape::{CrossEntropyOptions, Generator, Parameter, Reduction, Tape, Tensor};

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
    let loss = tape.watch(&p).cross_entropy(&LABELS, options)?;
    weighted(&loss, weights)?.backward()?;
    Ok((loss.detach(), p.grad().unwrap()))
}

/// A scalar from any reduction's output, so that `None` gets a non-uniform upstream grad.
fn weighted(loss: &Tensor, weights: &Tensor) -> tape::Result<Tensor> {
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
            for tp_size in [1, 2, 3, 4] {
                let what = format!("tp={tp_size} {reduction:?} eps={label_smoothing}");
                let ranks = run_local(tp_size, |comm| -> AnyResult<(Tensor, Tensor)> {
                    let tp = common::tp_context(comm, false);
                    let p = Parameter::new("logits", part(&logits, 2, tp.rank(), tp.size()));
                    let tape = Tape::new();
                    let loss = vocab_parallel_cross_entropy(
                        &tape.watch(&p),
                        &labels_shaped,
                        tp.group(),
                        VOCAB,
                        &options,
                    )?;
                    weighted(&loss, &weights)?.backward()?;
                    Ok((loss.detach(), p.grad().unwrap()))
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
                Err(layers::Error::LabelOutOfRange {
                    label: 10,
                    vocab_size: 10,
                    ..
                })
            ),
            matches!(count, Err(layers::Error::Shape { .. })),
            matches!(width, Err(layers::Error::Shape { .. })),
        ))
    })?;
    assert_eq!(checks, vec![(true, true, true); 2]);
    Ok(())
}
