//! [`MixedPrecision`]: 16-bit parameters trained through f32 master weights (Megatron's
//! `Float16OptimizerWithFloat16Params`, PyTorch's AMP recipe with bf16 weights).

use crate::optim::{Optimizer, OptimizerState};
use crate::{DType, Parameter, Result};

/// The name of the master weight among a parameter's optimizer buffers, so that a
/// checkpoint of the optimizer state keeps the f32 weights.
pub const MASTER_BUFFER: &str = "master_param";

/// Wraps an optimizer so that the model's parameters are stored in bf16 or f16 while the
/// optimizer updates f32 copies of them (the master weights) and writes the rounded
/// result back after each step.
///
/// Gradients stay f32: a parameter's own gradient, or its [main
/// gradient](Parameter::attach_main_grad) (a data-parallel bucket), which the master
/// then shares, so nothing is copied. [`params`](Optimizer::params) are the masters;
/// [`state`](Optimizer::state) carries each master weight as the buffer
/// [`MASTER_BUFFER`], so a checkpoint of it resumes the same run.
///
/// ```
/// use ferrotron_tape::{AdamW, AdamWConfig, DType, MixedPrecision, Optimizer, Parameter, Tape, Tensor};
///
/// let w = Parameter::new("w", Tensor::from_vec(vec![1.0, 2.0], &[2])?);
/// let config = AdamWConfig { lr: 1e-4, weight_decay: 0.0, ..AdamWConfig::default() };
/// let mut adamw = MixedPrecision::new(&[w.clone()], DType::BF16, |masters| {
///     AdamW::new(masters, config)
/// })?;
/// assert_eq!(w.dtype(), DType::BF16);
/// for _ in 0..3 {
///     let tape = Tape::new();
///     tape.watch(&w)?.sum()?.backward()?;
///     adamw.step()?;
///     adamw.zero_grad();
/// }
/// // Three steps of 1e-4 vanish in bf16's spacing just below 1 (2^-8), not in the master.
/// assert_eq!(w.value()?.to_vec()?, [1.0, 2.0]);
/// let master = adamw.params()[0].value()?.to_vec()?;
/// assert!((master[0] - (1.0 - 3e-4)).abs() < 1e-6);
/// # Ok::<(), ferrotron_tape::Error>(())
/// ```
pub struct MixedPrecision<O> {
    model: Vec<Parameter>,
    masters: Vec<Parameter>,
    dtype: DType,
    inner: O,
}

impl<O: Optimizer> MixedPrecision<O> {
    /// Stores `params` as `dtype` (bf16 or f16) and builds the inner optimizer with
    /// `make` over f32 copies of their current values. Build it once the values are
    /// final (after DDP's broadcast and a checkpoint's weights are loaded): later
    /// changes to the parameters do not reach the masters, and the next step overwrites
    /// them.
    pub fn new(
        params: &[Parameter],
        dtype: DType,
        make: impl FnOnce(Vec<Parameter>) -> Result<O>,
    ) -> Result<Self> {
        if !matches!(dtype, DType::BF16 | DType::F16) {
            return Err(crate::Error::invalid(
                "MixedPrecision::new",
                format!("parameters are stored as bf16 or f16 under master weights, not {dtype}"),
            ));
        }
        let masters = params
            .iter()
            .map(|param| {
                let value = param.value()?;
                let master = Parameter::new(param.name(), value.to_dtype(DType::F32)?);
                param.set_value(value.to_dtype(dtype)?)?;
                Ok(master)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MixedPrecision {
            model: params.to_vec(),
            inner: make(masters.clone())?,
            masters,
            dtype,
        })
    }

    /// The model's (16-bit) parameters.
    pub fn model_params(&self) -> &[Parameter] {
        &self.model
    }

    /// The optimizer over the master weights.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// Gives each master its model parameter's gradient: the same main-gradient view, or
    /// the parameter's own gradient tensor (shared, not copied).
    fn share_grads(&self) -> Result<()> {
        for (model, master) in self.model.iter().zip(&self.masters) {
            match model.main_grad() {
                Some(view) => {
                    let shared = master.main_grad().is_some_and(|mine| {
                        mine.storage().same_storage(view.storage())
                            && mine.offset() == view.offset()
                    });
                    if !shared {
                        // A gradient the master still holds would be copied into the
                        // new view over the model's fresh one.
                        master.zero_grad();
                        master.attach_main_grad(view)?;
                    }
                    master.set_main_grad_written(model.has_grad())?;
                }
                None => master.set_grad(model.try_grad()?)?,
            }
        }
        Ok(())
    }

    /// Writes every master, rounded, into its model parameter.
    fn write_back(&self) -> Result<()> {
        crate::optim::round_into(&self.masters, &self.model, self.dtype)
    }
}

impl<O: Optimizer> Optimizer for MixedPrecision<O> {
    fn step(&mut self) -> Result<()> {
        self.share_grads()?;
        // The inner rule writes the rounded model weights, in its update kernel where
        // it can.
        self.inner.step_and_round_into(&self.model, self.dtype)
    }

    fn params(&self) -> &[Parameter] {
        &self.masters
    }

    fn lr(&self) -> f64 {
        self.inner.lr()
    }

    fn state(&self) -> Result<OptimizerState> {
        let mut state = self.inner.state()?;
        for (entry, master) in state.params.iter_mut().zip(&self.masters) {
            entry.buffers.push((
                MASTER_BUFFER.to_string(),
                master.value()?.to_device(crate::Device::Cpu)?,
            ));
        }
        Ok(state)
    }

    /// Restores the inner optimizer's state and, where the state has them, the master
    /// weights (then written, rounded, into the model).
    fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        let mut inner = state.clone();
        let mut masters = Vec::with_capacity(self.masters.len());
        for (entry, master) in inner.params.iter_mut().zip(&self.masters) {
            let position = entry
                .buffers
                .iter()
                .position(|(name, _)| name == MASTER_BUFFER);
            let saved = position.map(|p| entry.buffers.remove(p).1);
            // Checked before anything changes, so a bad state changes nothing.
            if let Some(saved) = saved.as_ref().filter(|s| s.shape() != master.shape()) {
                return Err(crate::Error::shape(
                    "MixedPrecision::load_state",
                    &[saved.shape(), &master.shape()],
                    format!(
                        "the saved master weight of '{}' has another shape",
                        master.name()
                    ),
                ));
            }
            masters.push(saved);
        }
        self.inner.load_state(&inner)?;
        for (master, value) in self.masters.iter().zip(masters) {
            if let Some(value) = value {
                master.set_value(value.to_device(master.device())?)?;
            }
        }
        self.write_back()
    }

    fn zero_grad(&self) {
        for param in self.model.iter().chain(&self.masters) {
            param.zero_grad();
        }
    }
}

impl<O> std::fmt::Debug for MixedPrecision<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MixedPrecision")
            .field("dtype", &self.dtype)
            .field("params", &self.model.len())
            .finish()
    }
}
