//! Column- and row-parallel linear layers on TP ∈ {1, 2, 3, 4} (3 and 4 split 10 output
//! features unevenly) equal a plain `x·Wᵀ + b` on the master weights: outputs, input
//! gradients and weight/bias gradients, with every option and sequence parallelism.

mod common;

use common::{assert_close, join, part, tp_context, AnyResult};
use ferrotron_comm_core::run_local;
use ferrotron_layers::{
    all_reduce_sequence_parallel_grads, ColumnParallelLinear, LinearOptions, MasterInit, Module,
    RowParallelLinear,
};
use ferrotron_tape::{Generator, Parameter, Tape, Tensor};

const SEQ: usize = 5;
const BATCH: usize = 2;
const IN: usize = 6;
const OUT: usize = 10;

fn init() -> MasterInit {
    MasterInit::new(11, 0.3).with_bias_std(0.2)
}

/// Plain serial reference: output and gradients of `Σ (x·Wᵀ + b) ⊙ r`.
struct Serial {
    output: Tensor,
    x_grad: Tensor,
    w_grad: Tensor,
    b_grad: Tensor,
}

fn serial(name: &str, x: &Tensor, r: &Tensor) -> AnyResult<Serial> {
    let init = init();
    let w = Parameter::new("w", init.weight(&format!("{name}.weight"), &[OUT, IN]));
    let b = Parameter::new("b", init.bias(&format!("{name}.bias"), &[OUT], 0.0)?);
    let xp = Parameter::new("x", x.clone());
    let tape = Tape::new();
    let y = tape
        .watch(&xp)?
        .matmul(&tape.watch(&w)?.transpose(0, 1)?)?
        .add(&tape.watch(&b)?)?;
    y.mul(r)?.sum()?.backward()?;
    Ok(Serial {
        output: y.detach(),
        x_grad: xp.grad().unwrap(),
        w_grad: w.grad().unwrap(),
        b_grad: b.grad().unwrap(),
    })
}

fn data() -> (Tensor, Tensor) {
    let mut rng = Generator::new(3);
    (
        Tensor::randn(&[SEQ, BATCH, IN], 1.0, &mut rng),
        Tensor::randn(&[SEQ, BATCH, OUT], 1.0, &mut rng),
    )
}

struct RankOut {
    output: Tensor,
    x_grad: Tensor,
    w_grad: Tensor,
    b_grad: Tensor,
}

#[test]
fn column_parallel_matches_serial() -> AnyResult<()> {
    let (x, r) = data();
    let want = serial("col", &x, &r)?;
    for tp_size in [1, 2, 3, 4] {
        for (gather_output, sp) in [(false, false), (true, false), (false, true), (true, true)] {
            let what = format!("column tp={tp_size} gather={gather_output} sp={sp}");
            let ranks = run_local(tp_size, |comm| -> AnyResult<RankOut> {
                let tp = tp_context(comm, sp);
                let (rank, size) = (tp.rank(), tp.size());
                let layer = ColumnParallelLinear::new(
                    &tp,
                    "col",
                    IN,
                    OUT,
                    gather_output,
                    LinearOptions::default(),
                    &init(),
                )?;
                let x_local = if sp {
                    part(&x, 0, rank, size)
                } else {
                    x.clone()
                };
                let xp = Parameter::new("x", x_local);
                let tape = Tape::new();
                let y = layer.forward(&tape, &tape.watch(&xp)?)?.output;
                let r_local = if gather_output {
                    r.clone()
                } else {
                    part(&r, 2, rank, size)
                };
                y.mul(&r_local)?.sum()?.backward()?;
                let params = layer.parameters();
                Ok(RankOut {
                    output: y.detach(),
                    x_grad: xp.grad().unwrap(),
                    w_grad: params[0].param.grad().unwrap(),
                    b_grad: params[1].param.grad().unwrap(),
                })
            })?;
            let outputs: Vec<Tensor> = ranks.iter().map(|o| o.output.clone()).collect();
            let output = if gather_output {
                outputs[0].clone()
            } else {
                join(&outputs, 2)
            };
            assert_close(&format!("{what}: output"), &output, &want.output);
            let x_grads: Vec<Tensor> = ranks.iter().map(|o| o.x_grad.clone()).collect();
            let x_grad = if sp {
                join(&x_grads, 0)
            } else {
                x_grads[0].clone()
            };
            assert_close(&format!("{what}: x grad"), &x_grad, &want.x_grad);
            let w: Vec<Tensor> = ranks.iter().map(|o| o.w_grad.clone()).collect();
            assert_close(&format!("{what}: w grad"), &join(&w, 0), &want.w_grad);
            let b: Vec<Tensor> = ranks.iter().map(|o| o.b_grad.clone()).collect();
            assert_close(&format!("{what}: b grad"), &join(&b, 0), &want.b_grad);
        }
    }
    Ok(())
}

#[test]
fn column_parallel_skip_bias_add_returns_the_bias_part() -> AnyResult<()> {
    let (x, _) = data();
    let options = LinearOptions {
        bias: true,
        skip_bias_add: true,
    };
    let ranks = run_local(2, |comm| -> AnyResult<(Tensor, Tensor)> {
        let tp = tp_context(comm, false);
        let layer = ColumnParallelLinear::new(&tp, "col", IN, OUT, false, options, &init())?;
        let out = layer.forward(&Tape::new(), &x)?;
        let bias = out.bias.expect("skipped bias is returned");
        Ok((out.output.add(&bias)?, bias))
    })?;
    let want = serial("col", &x, &Tensor::zeros(&[SEQ, BATCH, OUT]))?;
    let outputs: Vec<Tensor> = ranks.iter().map(|o| o.0.clone()).collect();
    assert_close("output + returned bias", &join(&outputs, 2), &want.output);
    assert_eq!(ranks[0].1.shape(), &[5]);
    Ok(())
}

#[test]
fn row_parallel_matches_serial() -> AnyResult<()> {
    // Row-parallel: IN is the divided dimension, so use OUT inputs and IN outputs swapped:
    // reuse the same shapes by treating `x` as [.., OUT] input of a OUT → IN layer.
    let mut rng = Generator::new(4);
    let x = Tensor::randn(&[SEQ, BATCH, OUT], 1.0, &mut rng);
    let r = Tensor::randn(&[SEQ, BATCH, IN], 1.0, &mut rng);
    let init = init();
    let w = Parameter::new("w", init.weight("row.weight", &[IN, OUT]));
    let b = Parameter::new("b", init.bias("row.bias", &[IN], 0.0)?);
    let xp = Parameter::new("x", x.clone());
    let tape = Tape::new();
    let y = tape
        .watch(&xp)?
        .matmul(&tape.watch(&w)?.transpose(0, 1)?)?
        .add(&tape.watch(&b)?)?;
    y.mul(&r)?.sum()?.backward()?;
    let (want_y, want_x, want_w, want_b) = (
        y.detach(),
        xp.grad().unwrap(),
        w.grad().unwrap(),
        b.grad().unwrap(),
    );

    for tp_size in [1, 2, 3, 4] {
        for (input_is_parallel, sp) in [(true, false), (false, false), (true, true)] {
            let what = format!("row tp={tp_size} parallel_input={input_is_parallel} sp={sp}");
            let ranks = run_local(tp_size, |comm| -> AnyResult<RankOut> {
                let tp = tp_context(comm, sp);
                let (rank, size) = (tp.rank(), tp.size());
                let layer = RowParallelLinear::new(
                    &tp,
                    "row",
                    OUT,
                    IN,
                    input_is_parallel,
                    LinearOptions::default(),
                    &init,
                )?;
                let x_local = if input_is_parallel {
                    part(&x, 2, rank, size)
                } else {
                    x.clone()
                };
                let xp = Parameter::new("x", x_local);
                let tape = Tape::new();
                let y = layer.forward(&tape, &tape.watch(&xp)?)?.output;
                let r_local = if sp {
                    part(&r, 0, rank, size)
                } else {
                    r.clone()
                };
                y.mul(&r_local)?.sum()?.backward()?;
                all_reduce_sequence_parallel_grads(&layer, tp.group())?;
                let params = layer.parameters();
                Ok(RankOut {
                    output: y.detach(),
                    x_grad: xp.grad().unwrap(),
                    w_grad: params[0].param.grad().unwrap(),
                    b_grad: params[1].param.grad().unwrap(),
                })
            })?;
            let outputs: Vec<Tensor> = ranks.iter().map(|o| o.output.clone()).collect();
            let output = if sp {
                join(&outputs, 0)
            } else {
                outputs[0].clone()
            };
            assert_close(&format!("{what}: output"), &output, &want_y);
            let x_grads: Vec<Tensor> = ranks.iter().map(|o| o.x_grad.clone()).collect();
            let x_grad = if input_is_parallel {
                join(&x_grads, 2)
            } else {
                x_grads[0].clone()
            };
            assert_close(&format!("{what}: x grad"), &x_grad, &want_x);
            let w: Vec<Tensor> = ranks.iter().map(|o| o.w_grad.clone()).collect();
            assert_close(&format!("{what}: w grad"), &join(&w, 1), &want_w);
            for (rank, o) in ranks.iter().enumerate() {
                assert_close(
                    &format!("{what}: b grad on rank {rank}"),
                    &o.b_grad,
                    &want_b,
                );
            }
        }
    }
    Ok(())
}

#[test]
fn layers_without_bias_have_only_a_weight() -> AnyResult<()> {
    let options = LinearOptions {
        bias: false,
        skip_bias_add: false,
    };
    let counts = run_local(2, |comm| -> AnyResult<(usize, usize)> {
        let tp = tp_context(comm, false);
        let col = ColumnParallelLinear::new(&tp, "c", IN, OUT, true, options, &init())?;
        let row = RowParallelLinear::new(&tp, "r", OUT, IN, true, options, &init())?;
        Ok((col.parameters().len(), row.parameters().len()))
    })?;
    assert_eq!(counts, vec![(1, 1); 2]);
    Ok(())
}
