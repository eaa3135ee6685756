//! Initialisation from a seeded master weight: every rank generates the same full
//! tensor and keeps its part, so a model of any tensor-parallel size starts from the
//! same numbers as the serial one.

use ferrotron_tape::{Generator, Parameter, Tensor};

use crate::error::Result;
use crate::parallel::{ShardedParameter, Sharding, TensorParallel, TP_GROUP};

/// How full (master) parameters are generated.
///
/// Each parameter's generator is seeded from `seed` and the parameter's name, so the
/// values depend neither on the tensor-parallel size nor on the order in which layers
/// are built.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MasterInit {
    /// Base seed shared by every rank.
    pub seed: u64,
    /// Standard deviation of the normal distribution of weight matrices and embeddings.
    pub std: f64,
    /// Standard deviation of the noise added to biases (otherwise zero) and layer-norm
    /// parameters (otherwise one and zero). Megatron uses 0; tests that must see every
    /// parameter's effect use more.
    pub bias_std: f64,
}

impl MasterInit {
    /// Weights from N(0, `std`²) seeded by `seed`; biases zero, layer norms the identity.
    pub fn new(seed: u64, std: f64) -> Self {
        MasterInit {
            seed,
            std,
            bias_std: 0.0,
        }
    }

    /// The same with noisy biases and layer-norm parameters.
    pub fn with_bias_std(mut self, bias_std: f64) -> Self {
        self.bias_std = bias_std;
        self
    }

    /// The generator of the parameter called `name`.
    pub fn generator(&self, name: &str) -> Generator {
        // FNV-1a: a stable hash of the name (std's hasher may change between releases).
        let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, byte| {
            (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
        Generator::new(self.seed ^ hash)
    }

    /// The full weight called `name`: N(0, `std`²).
    pub fn weight(&self, name: &str, shape: &[usize]) -> Tensor {
        Tensor::randn(shape, self.std, &mut self.generator(name))
    }

    /// The full bias called `name`: `offset` plus N(0, `bias_std`²) noise (none when
    /// `bias_std` is 0).
    pub fn bias(&self, name: &str, shape: &[usize], offset: f32) -> Result<Tensor> {
        let constant = Tensor::full(shape, offset);
        if self.bias_std > 0.0 {
            let noise = Tensor::randn(shape, self.bias_std, &mut self.generator(name));
            Ok(constant.add(&noise)?)
        } else {
            Ok(constant)
        }
    }
}

/// Builds a rank's parameter from a full tensor and its sharding.
pub(crate) fn sharded(
    tp: &TensorParallel,
    name: String,
    full: &Tensor,
    sharding: Sharding,
    sequence_parallel_grad: bool,
) -> Result<ShardedParameter> {
    let part = sharding.shard(full, tp.rank(), tp.size())?;
    Ok(ShardedParameter {
        param: Parameter::new(name, part),
        sharding,
        grad_reduce_group: (sequence_parallel_grad && tp.size() > 1).then_some(TP_GROUP),
        shared_copy: false,
        expert: false,
    })
}
