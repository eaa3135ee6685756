//! User-defined differentiable ops: implement [`CustomOp`] and call [`Tensor::apply`].

use std::sync::Arc;

use crate::tape::record_tensor;
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
        let inputs_meta: Vec<(Vec<usize>, crate::Device)> = inputs
            .iter()
            .map(|t| (t.shape().to_vec(), t.device()))
            .collect();
        record_tensor("custom op", inputs, output.detach(), || {
            Box::new(move |grad: Tensor<T>, needs: &[bool]| {
                let grads = op.backward(&grad, &saved)?;
                if grads.len() != inputs_meta.len() {
                    return Err(Error::custom(
                        op.name(),
                        format!(
                            "backward returned {} gradients for {} inputs",
                            grads.len(),
                            inputs_meta.len()
                        ),
                    ));
                }
                grads
                    .into_iter()
                    .zip(&inputs_meta)
                    .zip(needs)
                    .map(|((grad, (shape, device)), &need)| match grad {
                        Some(grad) if grad.shape() != shape.as_slice() => Err(Error::custom(
                            op.name(),
                            format!(
                                "backward returned a gradient of shape {:?} for an input of shape {shape:?}",
                                grad.shape()
                            ),
                        )),
                        Some(grad) if grad.device() != *device => Err(Error::custom(
                            op.name(),
                            format!(
                                "backward returned a gradient on {} for an input on {device}",
                                grad.device()
                            ),
                        )),
                        Some(grad) if need => Ok(Some(grad.detach())),
                        _ => Ok(None),
                    })
                    .collect()
            })
        })
    }
}
