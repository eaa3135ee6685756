//! Indexing ops: embedding lookup, masked fill, dropout.

use ndarray::{ArrayD, Axis, IxDyn, Zip};

use crate::random::Generator;
use crate::tape::record;
use crate::{Element, Error, Result, Tensor};

impl<T: Element> Tensor<T> {
    /// Rows of this `[vocab, hidden]` table picked by `ids` (laid out with `ids_shape`);
    /// the result has shape `ids_shape + [hidden]`. Backward scatter-adds into the table.
    pub fn embedding(&self, ids: &[usize], ids_shape: &[usize]) -> Result<Tensor<T>> {
        const OP: &str = "embedding";
        let table = self.cpu(OP)?;
        if table.ndim() != 2 {
            return Err(Error::shape(
                OP,
                &[table.shape()],
                "the table must be 2-D [vocab, hidden]",
            ));
        }
        if ids.len() != ids_shape.iter().product::<usize>() {
            return Err(Error::shape(
                OP,
                &[&[ids.len()], ids_shape],
                "ids do not fill ids_shape",
            ));
        }
        let vocab = table.shape()[0];
        if let Some(&bad) = ids.iter().find(|&&id| id >= vocab) {
            return Err(Error::invalid(
                OP,
                format!("id {bad} out of range for vocabulary {vocab}"),
            ));
        }
        let rows = table.select(Axis(0), ids);
        let mut out_shape = ids_shape.to_vec();
        out_shape.push(table.shape()[1]);
        let out = super::reshape_owned(OP, rows, &out_shape)?;
        record(OP, &[self], out.into_shared(), || {
            let ids = ids.to_vec();
            let table_shape = table.raw_dim();
            Box::new(move |grad: ArrayD<T>, _: &[bool]| {
                let hidden = table_shape[1];
                let grad = super::reshape_owned(OP, grad, &[ids.len(), hidden])?;
                let mut table_grad = ArrayD::zeros(table_shape);
                for (&id, row) in ids.iter().zip(grad.outer_iter()) {
                    let mut target = table_grad.index_axis_mut(Axis(0), id);
                    target += &row;
                }
                Ok(vec![Some(table_grad)])
            })
        })
    }

    /// Replaces elements where `mask` is true by `value` (e.g. −∞ above the diagonal for a
    /// causal mask). `mask` must broadcast to this tensor's shape.
    pub fn masked_fill(&self, mask: &ArrayD<bool>, value: T) -> Result<Tensor<T>> {
        const OP: &str = "masked_fill";
        let input = self.cpu(OP)?;
        let mask = mask
            .broadcast(input.raw_dim())
            .ok_or_else(|| {
                Error::shape(
                    OP,
                    &[input.shape(), mask.shape()],
                    "mask does not broadcast to the input",
                )
            })?
            .to_owned();
        let out = Zip::from(input)
            .and(&mask)
            .map_collect(|&x, &masked| if masked { value } else { x });
        record(OP, &[self], out.into_shared(), || {
            Box::new(move |mut grad: ArrayD<T>, _: &[bool]| {
                Zip::from(&mut grad).and(&mask).for_each(|g, &masked| {
                    if masked {
                        *g = T::zero();
                    }
                });
                Ok(vec![Some(grad)])
            })
        })
    }

    /// Zeroes each element with probability `p` and scales the rest by `1/(1−p)`, drawing
    /// the mask from `generator`. Call it only in training; `p = 0` returns the input.
    pub fn dropout(&self, p: f64, generator: &mut Generator) -> Result<Tensor<T>> {
        const OP: &str = "dropout";
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid(
                OP,
                format!("probability {p} is not in [0, 1]"),
            ));
        }
        if p == 0.0 {
            return Ok(self.clone());
        }
        let input = self.cpu(OP)?;
        let keep_scale = if p < 1.0 {
            T::from_f64(1.0 / (1.0 - p))
        } else {
            T::zero()
        };
        let mask = ArrayD::from_shape_simple_fn(IxDyn(input.shape()), || {
            if generator.uniform() < p {
                T::zero()
            } else {
                keep_scale
            }
        });
        let out = Zip::from(input).and(&mask).map_collect(|&x, &m| x * m);
        record(OP, &[self], out.into_shared(), || {
            Box::new(move |grad: ArrayD<T>, _: &[bool]| Ok(vec![Some(grad * &mask)]))
        })
    }
}

/// A `[n, n]` mask that is true above the diagonal: future positions for causal attention.
pub fn causal_mask(n: usize) -> ArrayD<bool> {
    ArrayD::from_shape_fn(IxDyn(&[n, n]), |index| index[1] > index[0])
}
