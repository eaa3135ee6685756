//! User-defined differentiable ops: gradients flow through them, they may hold shared
//! (Send + Sync) state, and their errors come out of backward.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use ferrotron_tape::{
    gradcheck, CustomOp, Error, Generator, GradCheckOptions, Parameter, Tape, Tensor,
};

/// Stand-in for a communicator: a group of `size` ranks whose all-reduce sums equal values.
trait FakeGroup: Send + Sync {
    fn all_reduce(&self, t: &Tensor<f64>) -> ferrotron_tape::Result<Tensor<f64>>;
}

struct EqualRanks(usize);

impl FakeGroup for EqualRanks {
    fn all_reduce(&self, t: &Tensor<f64>) -> ferrotron_tape::Result<Tensor<f64>> {
        t.scale(self.0 as f64)
    }
}

/// Megatron's `copy_to_tensor_model_parallel_region`: identity forward, all-reduce backward.
struct CopyToRegion {
    group: Arc<dyn FakeGroup>,
}

impl CustomOp<f64> for CopyToRegion {
    fn name(&self) -> &str {
        "copy_to_region"
    }
    fn forward(
        &self,
        inputs: &[Tensor<f64>],
        _saved: &mut Vec<Tensor<f64>>,
    ) -> ferrotron_tape::Result<Tensor<f64>> {
        Ok(inputs[0].clone())
    }
    fn backward(
        &self,
        grad: &Tensor<f64>,
        _saved: &[Tensor<f64>],
    ) -> ferrotron_tape::Result<Vec<Option<Tensor<f64>>>> {
        Ok(vec![Some(self.group.all_reduce(grad)?)])
    }
}

#[test]
fn collective_style_op_backward_runs_another_collective() -> Result<()> {
    let op: Arc<dyn CustomOp<f64>> = Arc::new(CopyToRegion {
        group: Arc::new(EqualRanks(4)),
    });
    let w = Parameter::new("w", Tensor::<f64>::from_vec(vec![1.0, 2.0], &[2])?);
    let tape = Tape::new();
    let y = Tensor::apply(op.clone(), &[&tape.watch(&w)?])?;
    assert_eq!(y.to_vec()?, vec![1.0, 2.0]);
    y.sum()?.backward()?;
    assert_eq!(w.grad().expect("grad").to_vec()?, vec![4.0, 4.0]);
    // The op is Send + Sync, so it can be shared with other rank threads.
    std::thread::spawn(move || assert_eq!(op.name(), "copy_to_region"))
        .join()
        .map_err(|_| anyhow::anyhow!("thread panicked"))?;
    Ok(())
}

/// `x · y` with a saved-tensor backward; `wrong` makes the backward deliberately incorrect.
struct Product {
    wrong: bool,
}

impl CustomOp<f64> for Product {
    fn name(&self) -> &str {
        "product"
    }
    fn forward(
        &self,
        inputs: &[Tensor<f64>],
        saved: &mut Vec<Tensor<f64>>,
    ) -> ferrotron_tape::Result<Tensor<f64>> {
        saved.extend(inputs.iter().cloned());
        inputs[0].mul(&inputs[1])
    }
    fn backward(
        &self,
        grad: &Tensor<f64>,
        saved: &[Tensor<f64>],
    ) -> ferrotron_tape::Result<Vec<Option<Tensor<f64>>>> {
        let grad_x = grad.mul(&saved[1])?;
        let grad_y = if self.wrong {
            grad.mul(&saved[1])?
        } else {
            grad.mul(&saved[0])?
        };
        Ok(vec![Some(grad_x), Some(grad_y)])
    }
}

#[test]
fn gradcheck_accepts_a_correct_op_and_rejects_a_wrong_one() -> Result<()> {
    let mut rng = Generator::new(3);
    let inputs = [
        Tensor::randn(&[3], 1.0, &mut rng),
        Tensor::randn(&[3], 1.0, &mut rng),
    ];
    let options = GradCheckOptions::default();
    let good: Arc<dyn CustomOp<f64>> = Arc::new(Product { wrong: false });
    gradcheck(
        |x| Tensor::apply(good.clone(), &[&x[0], &x[1]]),
        &inputs,
        &options,
    )?;
    let bad: Arc<dyn CustomOp<f64>> = Arc::new(Product { wrong: true });
    let error = gradcheck(
        |x| Tensor::apply(bad.clone(), &[&x[0], &x[1]]),
        &inputs,
        &options,
    )
    .expect_err("wrong gradient");
    assert!(
        matches!(error, Error::GradCheck { input: 1, .. }),
        "{error}"
    );
    Ok(())
}

struct Failing;

impl CustomOp<f32> for Failing {
    fn name(&self) -> &str {
        "failing_all_reduce"
    }
    fn forward(
        &self,
        inputs: &[Tensor],
        _saved: &mut Vec<Tensor>,
    ) -> ferrotron_tape::Result<Tensor> {
        Ok(inputs[0].clone())
    }
    fn backward(
        &self,
        _grad: &Tensor,
        _saved: &[Tensor],
    ) -> ferrotron_tape::Result<Vec<Option<Tensor>>> {
        let cause = std::io::Error::new(std::io::ErrorKind::TimedOut, "rank 1 timed out");
        Err(Error::custom(self.name(), cause))
    }
}

struct WrongShape;

impl CustomOp<f32> for WrongShape {
    fn name(&self) -> &str {
        "wrong_shape"
    }
    fn forward(
        &self,
        inputs: &[Tensor],
        _saved: &mut Vec<Tensor>,
    ) -> ferrotron_tape::Result<Tensor> {
        Ok(inputs[0].clone())
    }
    fn backward(
        &self,
        _grad: &Tensor,
        _saved: &[Tensor],
    ) -> ferrotron_tape::Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(Tensor::zeros(&[5]))])
    }
}

#[test]
fn backward_errors_propagate_as_typed_errors() -> Result<()> {
    let w = Parameter::new("w", Tensor::ones(&[2]));
    let tape = Tape::new();
    let error = Tensor::apply(Arc::new(Failing), &[&tape.watch(&w)?])?
        .sum()?
        .backward()
        .expect_err("backward must fail");
    match &error {
        Error::Custom { op, source } => {
            assert_eq!(op, "failing_all_reduce");
            assert!(source.to_string().contains("timed out"));
        }
        other => panic!("unexpected error {other}"),
    }
    assert!(w.grad().is_none());

    let error = Tensor::apply(Arc::new(WrongShape), &[&tape.watch(&w)?])?
        .sum()?
        .backward()
        .expect_err("shape check");
    assert!(error.to_string().contains("wrong_shape"), "{error}");
    Ok(())
}

/// Identity op that records when it is dropped, to observe the tape freeing saved state.
struct DropProbe {
    dropped: Arc<AtomicBool>,
    must_be_dropped_first: Option<Arc<AtomicBool>>,
}

impl Drop for DropProbe {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

impl CustomOp<f32> for DropProbe {
    fn name(&self) -> &str {
        "drop_probe"
    }
    fn forward(
        &self,
        inputs: &[Tensor],
        _saved: &mut Vec<Tensor>,
    ) -> ferrotron_tape::Result<Tensor> {
        Ok(inputs[0].clone())
    }
    fn backward(
        &self,
        grad: &Tensor,
        _saved: &[Tensor],
    ) -> ferrotron_tape::Result<Vec<Option<Tensor>>> {
        if let Some(flag) = &self.must_be_dropped_first {
            if !flag.load(Ordering::SeqCst) {
                return Err(Error::custom("drop_probe", "later node still alive"));
            }
        }
        Ok(vec![Some(grad.clone())])
    }
}

#[test]
fn backward_releases_each_node_once_it_has_run() -> Result<()> {
    let late_dropped = Arc::new(AtomicBool::new(false));
    let early = Arc::new(DropProbe {
        dropped: Arc::new(AtomicBool::new(false)),
        must_be_dropped_first: Some(late_dropped.clone()),
    });
    let late = Arc::new(DropProbe {
        dropped: late_dropped.clone(),
        must_be_dropped_first: None,
    });
    let w = Parameter::new("w", Tensor::ones(&[2]));
    let tape = Tape::new();
    let h = Tensor::apply(early, &[&tape.watch(&w)?])?;
    let h = Tensor::apply(late, &[&h.exp()?])?;
    let loss = h.sum()?;
    assert!(!late_dropped.load(Ordering::SeqCst));
    loss.backward()?;
    assert!(tape.is_empty());
    Ok(())
}
