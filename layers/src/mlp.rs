//! The tensor-parallel MLP: a block's, and each expert's of a mixture of experts.

use ferrotron_tape::{Gelu, Tape, Tensor};

use crate::config::BlockConfig;
use crate::error::Result;
use crate::init::MasterInit;
use crate::linear::{ColumnParallelLinear, LinearOptions, LinearOutput, RowParallelLinear};
use crate::parallel::{Module, ShardedParameter, TensorParallel};

/// `row(gelu(column(x)))`: `hidden → ffn_hidden → hidden` with the inner activations
/// divided among the tensor-parallel ranks, one reduction per forward pass.
#[derive(Clone)]
pub struct ParallelMlp {
    fc1: ColumnParallelLinear,
    fc2: RowParallelLinear,
    gelu: Gelu,
}

impl ParallelMlp {
    /// An MLP called `name` (`name.fc1`, `name.fc2`).
    pub fn new(
        tp: &TensorParallel,
        name: &str,
        config: &BlockConfig,
        init: &MasterInit,
    ) -> Result<Self> {
        Ok(ParallelMlp {
            fc1: ColumnParallelLinear::new(
                tp,
                &format!("{name}.fc1"),
                config.hidden,
                config.ffn_hidden,
                false,
                // The bias goes into the activation's kernel.
                LinearOptions {
                    skip_bias_add: true,
                    ..LinearOptions::default()
                },
                init,
            )?,
            fc2: RowParallelLinear::new(
                tp,
                &format!("{name}.fc2"),
                config.ffn_hidden,
                config.hidden,
                true,
                // A block adds the bias with the residual (`bias_dropout_add`).
                LinearOptions {
                    skip_bias_add: true,
                    ..LinearOptions::default()
                },
                init,
            )?,
            gelu: config.gelu,
        })
    }

    /// Applies the MLP to `x: [..., hidden]` (sequence part first under sequence
    /// parallelism).
    pub fn forward(&self, tape: &Tape, x: &Tensor) -> Result<Tensor> {
        self.forward_parts(tape, x)?.with_bias()
    }

    /// [`forward`](Self::forward) with the last layer's bias returned, not added, for
    /// the caller to add with the residual.
    pub(crate) fn forward_parts(&self, tape: &Tape, x: &Tensor) -> Result<LinearOutput> {
        let inner = self.fc1.forward(tape, x)?;
        let inner = match inner.bias {
            Some(bias) => inner.output.bias_gelu(&bias, self.gelu)?,
            None => inner.output.gelu(self.gelu)?,
        };
        self.fc2.forward(tape, &inner)
    }
}

impl Module for ParallelMlp {
    fn parameters(&self) -> Vec<ShardedParameter> {
        let mut params = self.fc1.parameters();
        params.extend(self.fc2.parameters());
        params
    }
}
