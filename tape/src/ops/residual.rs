//! A residual branch's end in one pass: its bias, dropout and addition to the residual
//! stream (Megatron's `bias_dropout_add`).

use super::index::{dropout_scale, keep_mask, Dropout};
use crate::gpu::ops::{sum_to_stored, PointwiseInput, PointwiseWrite};
use crate::gpu::shape_ops::bias_dropout_add_stored;
use crate::gpu::{GpuArray, Stored};
use crate::precision::{promoted, written};
use crate::random::Generator;
use crate::tape::record_tensor;
use crate::{DType, Element, Error, Result, Tensor};

const OP: &str = "bias_dropout_add";

impl<T: Element> Tensor<T> {
    /// `residual + dropout(self + bias)`: a residual branch's bias (over the last
    /// dimension, if any), dropout (the probability, and the generator the mask is drawn
    /// from) and addition to the residual stream, Megatron's `bias_dropout_add`.
    ///
    /// It equals `residual.add(&self.add(bias)?.dropout(p, generator)?)`, with the same
    /// mask and each intermediate rounded to its storage format as those ops round it,
    /// which is what it does on the CPU. On a device it is one kernel that stores neither
    /// intermediate; its backward is dropout's (the residual's gradient passes through)
    /// and the bias's sum.
    ///
    /// ```
    /// use ferrotron_tape::Tensor;
    ///
    /// let branch = Tensor::<f64>::from_vec(vec![1.0, 2.0], &[1, 2])?;
    /// let bias = Tensor::from_vec(vec![0.5, -0.5], &[2])?;
    /// let residual = Tensor::from_vec(vec![10.0, 20.0], &[1, 2])?;
    /// let out = branch.bias_dropout_add(Some(&bias), &residual, None)?;
    /// assert_eq!(out.to_vec()?, [11.5, 21.5]);
    /// # Ok::<(), ferrotron_tape::Error>(())
    /// ```
    pub fn bias_dropout_add(
        &self,
        bias: Option<&Tensor<T>>,
        residual: &Tensor<T>,
        dropout: Option<(f64, &mut Generator)>,
    ) -> Result<Tensor<T>> {
        check_shapes(self, bias, residual)?;
        let dropout = match dropout {
            Some((p, generator)) => dropout_scale::<T>(OP, p)?.map(|s| (p, s, generator)),
            None => None,
        };
        let mut tensors = vec![self, residual];
        tensors.extend(bias);
        if super::common_device(OP, &tensors)?.is_none_or(|d| d == crate::Device::Cpu) {
            let branch = match bias {
                Some(bias) => self.add(bias)?,
                None => self.clone(),
            };
            let branch = match dropout {
                Some((p, _, generator)) => branch.dropout(p, generator)?,
                None => branch,
            };
            return residual.add(&branch);
        }
        self.bias_dropout_add_on_device(bias, residual, dropout)
    }

    fn bias_dropout_add_on_device(
        &self,
        bias: Option<&Tensor<T>>,
        residual: &Tensor<T>,
        dropout: Option<(f64, f64, &mut Generator)>,
    ) -> Result<Tensor<T>> {
        let on = self.device();
        // The formats the composition would store its results in.
        let sum = bias.map_or(self.dtype(), |bias| promoted(&[self, bias]));
        let out_format = if residual.dtype() == sum {
            sum
        } else {
            T::DTYPE
        };
        let keep = match dropout {
            Some((p, scale, generator)) => {
                Some((keep_mask(OP, on, self.shape(), p, generator)?, scale))
            }
            None => None,
        };
        let bias_input = match bias {
            Some(bias) => Some((bias.device_input(OP, on)?, format_number(sum))),
            None => None,
        };
        let kernel = BiasDropoutAdd {
            x: self.device_input(OP, on)?,
            bias: bias_input,
            keep: keep.as_ref().map(|(k, s)| (k, *s, format_number(sum))),
            residual: residual.device_input(OP, on)?,
        };
        let out = written(OP, on, self.shape(), out_format, &kernel)?;
        let mut inputs = vec![self, residual];
        inputs.extend(bias);
        let width = bias.map(|b| b.shape().to_vec());
        // The dropout's input: the biased sum, or the branch itself.
        let dropout_input = match bias {
            Some(_) => sum,
            None => self.grad_format(),
        };
        record_tensor(OP, &inputs, out, || {
            Box::new(move |grad: Tensor<T>, needs: &[bool]| {
                // The gradients the composition's tape keeps: the dropped branch's and
                // the biased sum's stored as those results are.
                let dropped_format = match keep {
                    Some(_) => sum,
                    None => dropout_input,
                };
                let kept_as_is = dropped_format == T::DTYPE || grad.dtype() == dropped_format;
                let dropped = match kept_as_is {
                    true => grad.clone(),
                    false => grad.stored_as(OP, dropped_format)?,
                };
                let branch = match &keep {
                    Some((keep, scale)) => {
                        let x = dropped.device_input(OP, on)?;
                        let scale = *scale;
                        let kernel = Dropout { x, keep, scale };
                        written(OP, on, grad.shape(), dropout_input, &kernel)?
                    }
                    None => dropped,
                };
                let d_bias = match &width {
                    Some(shape) if needs[2] => {
                        let branch = branch.device_input(OP, on)?;
                        Some(Tensor::from_gpu(sum_to_stored(on, branch, shape)?))
                    }
                    _ => None,
                };
                let mut grads = vec![needs[0].then_some(branch), needs[1].then_some(grad)];
                if width.is_some() {
                    grads.push(d_bias);
                }
                Ok(grads)
            })
        })
    }
}

fn check_shapes<T: Element>(
    x: &Tensor<T>,
    bias: Option<&Tensor<T>>,
    residual: &Tensor<T>,
) -> Result<()> {
    if residual.shape() != x.shape() {
        return Err(Error::shape(
            OP,
            &[x.shape(), residual.shape()],
            "the branch and the residual have one shape",
        ));
    }
    match bias {
        Some(bias) if bias.ndim() != 1 || x.shape().last() != Some(&bias.numel()) => {
            Err(Error::shape(
                OP,
                &[x.shape(), bias.shape()],
                "the bias is one value per element of the branch's last dimension",
            ))
        }
        _ => Ok(()),
    }
}

/// The kernels' number of a storage format: 0 the element type, 1 bf16, 2 f16.
pub(crate) fn format_number(dtype: DType) -> i64 {
    match dtype {
        DType::BF16 => 1,
        DType::F16 => 2,
        _ => 0,
    }
}

struct BiasDropoutAdd<'a> {
    x: PointwiseInput<'a>,
    bias: Option<(PointwiseInput<'a>, i64)>,
    keep: Option<(&'a GpuArray<u8>, f64, i64)>,
    residual: PointwiseInput<'a>,
}

impl PointwiseWrite for BiasDropoutAdd<'_> {
    fn write<T: Element, O: Stored>(&self, out: &GpuArray<O>) -> Result<()> {
        bias_dropout_add_stored::<T, O>(out, self.x, self.bias, self.keep, self.residual)
    }
}
