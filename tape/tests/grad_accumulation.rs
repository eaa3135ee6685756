//! Backward passes accumulate: two micro-batches equal one pass over the whole batch.

use anyhow::Result;
use ferrotron_tape::{Generator, Parameter, Tape, Tensor};

fn loss_sum(
    tape: &Tape<f64>,
    w: &Parameter<f64>,
    b: &Parameter<f64>,
    x: &Tensor<f64>,
) -> ferrotron_tape::Result<Tensor<f64>> {
    x.matmul(&tape.watch(w)?)?
        .add(&tape.watch(b)?)?
        .tanh()?
        .sum()
}

#[test]
fn two_micro_batches_equal_one_full_batch() -> Result<()> {
    let mut rng = Generator::new(5);
    let w = Parameter::new("w", Tensor::<f64>::randn(&[4, 3], 1.0, &mut rng));
    let b = Parameter::new("b", Tensor::<f64>::randn(&[3], 1.0, &mut rng));
    let x = Tensor::<f64>::randn(&[6, 4], 1.0, &mut rng);
    let tape = Tape::new();

    loss_sum(&tape, &w, &b, &x)?.backward()?;
    let full = (
        w.take_grad().expect("w grad"),
        b.take_grad().expect("b grad"),
    );

    for part in x.split(&[2, 4], 0)? {
        loss_sum(&tape, &w, &b, &part)?.backward()?;
    }
    for (got, want) in [(w.grad(), &full.0), (b.grad(), &full.1)] {
        let got = got.expect("accumulated grad").to_vec()?;
        for (g, f) in got.iter().zip(want.to_vec()?) {
            assert!((g - f).abs() < 1e-12, "{g} vs {f}");
        }
    }
    Ok(())
}

#[test]
fn zero_grad_resets_and_grad_clones_are_not_mutated() -> Result<()> {
    let w = Parameter::new("w", Tensor::<f32>::ones(&[2]));
    let tape = Tape::new();
    tape.watch(&w)?.sum()?.backward()?;
    let first = w.grad().expect("grad");
    tape.watch(&w)?.scale(2.0)?.sum()?.backward()?;
    assert_eq!(w.grad().expect("grad").to_vec()?, vec![3.0, 3.0]);
    assert_eq!(
        first.to_vec()?,
        vec![1.0, 1.0],
        "a grad handed out earlier keeps its values"
    );
    w.zero_grad();
    assert!(w.grad().is_none());
    Ok(())
}
