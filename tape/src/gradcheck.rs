//! Finite-difference gradient checking, used by every op's tests and by downstream crates.

use crate::random::Generator;
use crate::{Element, Error, Parameter, Result, Tape, Tensor};

/// Tolerances of [`gradcheck`]. An analytic gradient `a` passes against the numeric `n`
/// when `|a − n| ≤ atol + rtol·|n|`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradCheckOptions {
    /// Central-difference step.
    pub eps: f64,
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
    /// Seed of the random projection that turns the output into a scalar.
    pub seed: u64,
}

impl Default for GradCheckOptions {
    /// Tolerances meant for `f64` (as `torch.autograd.gradcheck`).
    fn default() -> Self {
        GradCheckOptions {
            eps: 1e-6,
            atol: 1e-5,
            rtol: 1e-3,
            seed: 0,
        }
    }
}

/// Checks the gradients of `f` at `inputs` against central differences.
///
/// `f` is called once with tensors recorded on a fresh tape (the analytic pass: backward of
/// `Σ f(x) ⊙ w` for a fixed random `w`) and then, untracked, twice per input element. Use
/// `f64` tensors: `f32` rounding swamps the differences. Returns
/// [`Error::GradCheck`] at the first disagreeing element.
pub fn gradcheck<T, F>(f: F, inputs: &[Tensor<T>], options: &GradCheckOptions) -> Result<()>
where
    T: Element,
    F: Fn(&[Tensor<T>]) -> Result<Tensor<T>>,
{
    let params: Vec<Parameter<T>> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| Parameter::new(format!("input{i}"), t.clone()))
        .collect();
    let tape = Tape::new();
    let watched: Vec<Tensor<T>> = params
        .iter()
        .map(|p| tape.watch(p))
        .collect::<std::result::Result<_, _>>()?;
    let output = f(&watched)?;
    let projection = Tensor::<T>::randn(output.shape(), 1.0, &mut Generator::new(options.seed));
    let weights = projection.to_vec()?;
    let objective = output.mul(&projection)?.sum()?;
    if objective.requires_grad() {
        objective.backward()?;
    }

    let project = |values: &[Tensor<T>]| -> Result<f64> {
        let out = tape.no_grad(|| f(values))?;
        if out.numel() != weights.len() {
            return Err(Error::shape(
                "gradcheck",
                &[out.shape(), projection.shape()],
                "f returned differently shaped outputs for perturbed inputs",
            ));
        }
        Ok(out
            .to_vec()?
            .iter()
            .zip(&weights)
            .map(|(&o, &w)| o.into_f64() * w.into_f64())
            .sum())
    };

    for (input_index, (input, param)) in inputs.iter().zip(&params).enumerate() {
        let analytic = match param.grad() {
            Some(grad) => grad.to_vec()?,
            None => vec![T::zero(); input.numel()],
        };
        let base = input.to_vec()?;
        for (element, &analytic) in analytic.iter().enumerate() {
            let perturbed_value = |delta: f64| -> Result<f64> {
                let mut data = base.clone();
                data[element] = T::from_f64(data[element].into_f64() + delta);
                let mut values: Vec<Tensor<T>> = inputs.iter().map(Tensor::detach).collect();
                values[input_index] = Tensor::from_vec(data, input.shape())?;
                project(&values)
            };
            let numeric = (perturbed_value(options.eps)? - perturbed_value(-options.eps)?)
                / (2.0 * options.eps);
            let analytic = analytic.into_f64();
            if (analytic - numeric).abs() > options.atol + options.rtol * numeric.abs() {
                return Err(Error::GradCheck {
                    input: input_index,
                    index: element,
                    analytic,
                    numeric,
                });
            }
        }
    }
    Ok(())
}
