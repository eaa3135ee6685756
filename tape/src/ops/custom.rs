//! User-defined differentiable ops: implement [`CustomOp`] and call [`Tensor::apply`].

use std::sync::Arc;

use ndarray::ArrayD;

use crate::tape::record;
use crate::{Element, Error, Result, Tensor};

/// A differentiable op defined outside this crate, e.g. a collective whose backward is
/// another collective. The op may hold shared state such as an `Arc<dyn Communicator>`,
/// hence `Send + Sync`.
///
/// Both methods see tensors cut off from the tape, so tensor ops used inside them are not
/// recorded.
pub trait CustomOp<T: Element = f32>: Send + Sync {
    /// Name used in error messages.
    fn name(&self) -> &str;

    /// Computes the output from `inputs`, pushing onto `saved` whatever backward needs.
    fn forward(&self, inputs: &[Tensor<T>], saved: &mut Vec<Tensor<T>>) -> Result<Tensor<T>>;

    /// Given d(loss)/d(output), returns d(loss)/d(input) for each input in order (`None`
    /// for no gradient). Each gradient must have its input's shape. Errors (e.g. from a
    /// communicator) come out of [`Tensor::backward`] unchanged.
    fn backward(
        &self,
        grad_output: &Tensor<T>,
        saved: &[Tensor<T>],
    ) -> Result<Vec<Option<Tensor<T>>>>;
}

impl<T: Element> Tensor<T> {
    /// Applies a user-defined op to `inputs`, recording it on their tape.
    pub fn apply(op: Arc<dyn CustomOp<T>>, inputs: &[&Tensor<T>]) -> Result<Tensor<T>> {
        let detached: Vec<Tensor<T>> = inputs.iter().map(|t| t.detach()).collect();
        let mut saved = Vec::new();
        let output = op.forward(&detached, &mut saved)?;
        let output_array = output.cpu("custom op")?.clone();
        let input_shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape().to_vec()).collect();
        record("custom op", inputs, output_array, || {
            Box::new(move |grad: ArrayD<T>, needs: &[bool]| {
                let grads = op.backward(&Tensor::from_array(grad), &saved)?;
                if grads.len() != input_shapes.len() {
                    return Err(Error::custom(
                        op.name(),
                        format!(
                            "backward returned {} gradients for {} inputs",
                            grads.len(),
                            input_shapes.len()
                        ),
                    ));
                }
                grads
                    .into_iter()
                    .zip(&input_shapes)
                    .zip(needs)
                    .map(|((grad, shape), &need)| match grad {
                        Some(grad) if grad.shape() != shape.as_slice() => Err(Error::custom(
                            op.name(),
                            format!(
                                "backward returned a gradient of shape {:?} for an input of shape {shape:?}",
                                grad.shape()
                            ),
                        )),
                        Some(grad) if need => Ok(Some(grad.cpu("custom op")?.clone().into_owned())),
                        _ => Ok(None),
                    })
                    .collect()
            })
        })
    }
}
