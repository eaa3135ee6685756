//! Optimizers with PyTorch semantics: [`Sgd`] (momentum, weight decay) and [`AdamW`],
//! with optional [`LrSchedule`]s and their state for checkpoints ([`OptimizerState`]).

use ndarray::{ArrayD, IxDyn};

use crate::flat::{with_regions, Regions};
use crate::gpu::optim_ops::{adamw_list, adamw_step, sgd_step, AdamWEntry, SgdScalars};
use crate::gpu::GpuArray;
use crate::precision::Half;
use crate::schedule::LrSchedule;
use crate::{DType, Device, Element, Error, FlatView, Parameter, Result, Tensor};

/// Something that updates parameters from their gradients.
pub trait Optimizer<T: Element = f32> {
    /// Applies one update to every parameter that has a gradient.
    fn step(&mut self) -> Result<()>;

    /// The parameters being optimised.
    fn params(&self) -> &[Parameter<T>];

    /// The learning rate the next [`step`](Self::step) uses.
    fn lr(&self) -> f64;

    /// A copy of everything besides the parameters that the next steps depend on: the
    /// step count and each parameter's buffers. Restoring it with
    /// [`load_state`](Self::load_state) into an optimizer over the same parameters makes
    /// the following steps bit-identical to this optimizer's.
    fn state(&self) -> Result<OptimizerState<T>>;

    /// Restores a [`state`](Self::state); each buffer moves to its parameter's device.
    /// A state for other parameters (count, shapes or buffer names) is an error and
    /// changes nothing.
    fn load_state(&mut self, state: &OptimizerState<T>) -> Result<()>;

    /// Clears every parameter's gradient.
    fn zero_grad(&self) {
        for param in self.params() {
            param.zero_grad();
        }
    }

    /// [`step`](Self::step), then each parameter's new value rounded to `dtype` into the
    /// matching one of `copies` (one per parameter, in order): the write-back of
    /// [`MixedPrecision`](crate::MixedPrecision)'s master weights into its 16-bit model.
    /// An optimizer whose update kernel can also write the rounded value ([`AdamW`] on a
    /// device) does both in one pass over the parameter.
    fn step_and_round_into(&mut self, copies: &[Parameter<T>], dtype: DType) -> Result<()> {
        check_copies(self.params(), copies)?;
        self.step()?;
        round_into(self.params(), copies, dtype)
    }
}

/// An error unless `copies` has one parameter of the same shape per one of `params`.
fn check_copies<T: Element>(params: &[Parameter<T>], copies: &[Parameter<T>]) -> Result<()> {
    let matching = params.len() == copies.len()
        && params
            .iter()
            .zip(copies)
            .all(|(p, c)| p.shape() == c.shape());
    if matching {
        return Ok(());
    }
    Err(Error::invalid(
        "Optimizer::step_and_round_into",
        format!(
            "{} copies for {} parameters: pass one copy of each parameter's shape, in order",
            copies.len(),
            params.len()
        ),
    ))
}

/// Writes each of `params`' values, rounded to `dtype`, into the matching one of `copies`.
pub(crate) fn round_into<T: Element>(
    params: &[Parameter<T>],
    copies: &[Parameter<T>],
    dtype: DType,
) -> Result<()> {
    for (param, copy) in params.iter().zip(copies) {
        copy.set_value(param.value()?.to_dtype(dtype)?)?;
    }
    Ok(())
}

/// A boxed optimizer is one, so that a rule chosen at run time can still be wrapped (in
/// [`MixedPrecision`](crate::MixedPrecision), say).
impl<T: Element, O: Optimizer<T> + ?Sized> Optimizer<T> for Box<O> {
    fn step(&mut self) -> Result<()> {
        (**self).step()
    }

    fn params(&self) -> &[Parameter<T>] {
        (**self).params()
    }

    fn lr(&self) -> f64 {
        (**self).lr()
    }

    fn state(&self) -> Result<OptimizerState<T>> {
        (**self).state()
    }

    fn load_state(&mut self, state: &OptimizerState<T>) -> Result<()> {
        (**self).load_state(state)
    }

    fn zero_grad(&self) {
        (**self).zero_grad()
    }

    fn step_and_round_into(&mut self, copies: &[Parameter<T>], dtype: DType) -> Result<()> {
        (**self).step_and_round_into(copies, dtype)
    }
}

/// Settings of [`Sgd`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables momentum).
    pub momentum: f64,
    /// L2 penalty added to the gradient (coupled, as `torch.optim.SGD`).
    pub weight_decay: f64,
    /// Dampening of the momentum update.
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl SgdConfig {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        SgdConfig {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            dampening: 0.0,
            nesterov: false,
        }
    }

    /// Checks the settings as `torch.optim.SGD` does, and that each is finite: a
    /// learning rate, momentum and weight decay of at least 0, and Nesterov momentum
    /// only with momentum and no dampening.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "SgdConfig";
        let SgdConfig {
            lr,
            momentum,
            weight_decay,
            dampening,
            nesterov,
        } = *self;
        at_least_zero(OP, "learning rate", lr)?;
        at_least_zero(OP, "momentum", momentum)?;
        at_least_zero(OP, "weight decay", weight_decay)?;
        finite(OP, "dampening", dampening)?;
        if nesterov && (momentum <= 0.0 || dampening != 0.0) {
            return Err(Error::invalid(
                OP,
                format!(
                    "Nesterov momentum needs a momentum above 0 and no dampening (momentum \
                     {momentum}, dampening {dampening})"
                ),
            ));
        }
        Ok(())
    }
}

/// `value`, named `what`, unless it is infinite or NaN.
fn finite(op: &'static str, what: &str, value: f64) -> Result<f64> {
    match value.is_finite() {
        true => Ok(value),
        false => Err(Error::invalid(
            op,
            format!("the {what} is {value}: give a finite number"),
        )),
    }
}

/// `value`, named `what`, unless it is negative or not finite.
fn at_least_zero(op: &'static str, what: &str, value: f64) -> Result<f64> {
    match finite(op, what, value)? >= 0.0 {
        true => Ok(value),
        false => Err(Error::invalid(
            op,
            format!("the {what} is {value}: give 0 or more"),
        )),
    }
}

/// Stochastic gradient descent, as `torch.optim.SGD`.
#[derive(Debug)]
pub struct Sgd<T: Element = f32> {
    params: Vec<Parameter<T>>,
    options: Vec<ParamOptions>,
    config: SgdConfig,
    clock: Clock,
    momentum_buffers: Vec<Option<ArrayD<T>>>,
    /// Momentum buffers of parameters that live on a device.
    device_buffers: Vec<Option<GpuArray<T>>>,
}

/// Name of SGD's buffer in an [`OptimizerState`], as in `torch.optim.SGD`'s state.
const MOMENTUM_BUFFER: &str = "momentum_buffer";

impl<T: Element> Sgd<T> {
    /// An optimizer over `params`; settings `torch.optim.SGD` refuses are an error
    /// ([`SgdConfig::validate`]).
    pub fn new(params: Vec<Parameter<T>>, config: SgdConfig) -> Result<Self> {
        config.validate()?;
        let momentum_buffers = vec![None; params.len()];
        let device_buffers = vec![None; params.len()];
        Ok(Sgd {
            options: vec![ParamOptions::default(); params.len()],
            params,
            config,
            clock: Clock::default(),
            momentum_buffers,
            device_buffers,
        })
    }

    /// Takes each step's learning rate from `schedule` instead of `config.lr`.
    pub fn with_schedule(mut self, schedule: LrSchedule) -> Self {
        self.clock.schedule = Some(schedule);
        self
    }

    /// Scales the learning rate and weight decay of each parameter by `options(param)`
    /// (PyTorch's parameter groups), e.g. [`ParamOptions::megatron_groups`].
    pub fn with_param_options(mut self, options: impl Fn(&Parameter<T>) -> ParamOptions) -> Self {
        self.options = self.params.iter().map(options).collect();
        self
    }
}

impl<T: Element> Optimizer<T> for Sgd<T> {
    fn step(&mut self) -> Result<()> {
        self.config.lr = self.clock.advance(self.config.lr);
        let c = self.config;
        for (i, param) in self.params.iter().enumerate() {
            let update = SgdUpdate::new(&c, self.options[i]);
            if param.on_device() {
                let buffer = &mut self.device_buffers[i];
                param.update_on_device("Sgd::step", |value, grad| {
                    // The first step with momentum makes the buffer, from the direction.
                    let first = update.momentum != 0.0 && buffer.is_none();
                    if first {
                        *buffer = Some(GpuArray::uninit(
                            "Sgd::step",
                            value.device(),
                            value.shape(),
                        )?);
                    }
                    sgd_step(value, grad, buffer.as_ref(), first, update.scalars())
                })?;
                continue;
            }
            let buffer = &mut self.momentum_buffers[i];
            let shape = param.shape();
            param.update_in_place("Sgd::step", |values, grads| {
                let first = update.momentum != 0.0 && buffer.is_none();
                let buffer = match buffer {
                    Some(buffer) => host_slice(buffer)?,
                    None if update.momentum != 0.0 => {
                        host_slice(buffer.insert(ArrayD::zeros(IxDyn(&shape))))?
                    }
                    None => &mut [],
                };
                update.apply(values, grads, buffer, first)
            })?;
        }
        Ok(())
    }

    fn params(&self) -> &[Parameter<T>] {
        &self.params
    }

    fn lr(&self) -> f64 {
        self.clock.next_lr(self.config.lr)
    }

    fn state(&self) -> Result<OptimizerState<T>> {
        let params = (self.momentum_buffers.iter().zip(&self.device_buffers))
            .map(|(host, device)| {
                let buffer = match (host, device) {
                    (Some(array), _) => Some(Tensor::from_array(array.clone())),
                    (None, Some(array)) => Some(Tensor::from_gpu(array.duplicate("Sgd::state")?)),
                    (None, None) => None,
                };
                Ok(ParamState {
                    steps: 0,
                    buffers: buffer
                        .map(|b| (MOMENTUM_BUFFER.to_string(), b))
                        .into_iter()
                        .collect(),
                })
            })
            .collect::<Result<_>>()?;
        Ok(OptimizerState {
            steps: self.clock.steps,
            params,
        })
    }

    fn load_state(&mut self, state: &OptimizerState<T>) -> Result<()> {
        let slots = state.restore(&self.params, &[MOMENTUM_BUFFER], "Sgd::load_state")?;
        for (i, slot) in slots.into_iter().enumerate() {
            let (host, device) = match slot {
                Some((_, mut buffers)) => buffers.remove(0),
                None => (None, None),
            };
            self.momentum_buffers[i] = host;
            self.device_buffers[i] = device;
        }
        self.clock.steps = state.steps;
        Ok(())
    }
}

/// Settings of [`AdamW`] (defaults as `torch.optim.AdamW`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay rates of the first and second moment estimates (default 0.9, 0.999).
    pub betas: (f64, f64),
    /// Added to the denominator for stability (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay (default 1e-2).
    pub weight_decay: f64,
}

impl AdamWConfig {
    /// Checks the settings as `torch.optim.AdamW` does, and that each is finite: a
    /// learning rate and weight decay of at least 0, betas in [0, 1), and an epsilon
    /// above 0 (PyTorch takes 0, which divides by zero where a gradient has always been
    /// 0).
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "AdamWConfig";
        at_least_zero(OP, "learning rate", self.lr)?;
        at_least_zero(OP, "weight decay", self.weight_decay)?;
        let (beta1, beta2) = self.betas;
        for (what, beta) in [("first beta", beta1), ("second beta", beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(Error::invalid(
                    OP,
                    format!("the {what} is {beta}: give a value in [0, 1) (0.9, 0.999 by default)"),
                ));
            }
        }
        if finite(OP, "epsilon", self.eps)? <= 0.0 {
            return Err(Error::invalid(
                OP,
                format!(
                    "epsilon is {}: give a value above 0 (1e-8 by default)",
                    self.eps
                ),
            ));
        }
        Ok(())
    }
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

/// First and second moment estimates of one parameter, and its step count.
type AdamState<T> = (ArrayD<T>, ArrayD<T>, u32);

/// [`AdamState`] of a parameter on a device.
type DeviceAdamState<T> = (GpuArray<T>, GpuArray<T>, u32);

/// Adam with decoupled weight decay and bias correction, as `torch.optim.AdamW`.
#[derive(Debug)]
pub struct AdamW<T: Element = f32> {
    params: Vec<Parameter<T>>,
    options: Vec<ParamOptions>,
    config: AdamWConfig,
    clock: Clock,
    moments: Vec<Option<AdamState<T>>>,
    device_moments: Vec<Option<DeviceAdamState<T>>>,
}

/// Names of AdamW's buffers in an [`OptimizerState`], as in `torch.optim.AdamW`'s state.
const ADAM_BUFFERS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

impl<T: Element> AdamW<T> {
    /// An optimizer over `params`; settings `torch.optim.AdamW` refuses are an error
    /// ([`AdamWConfig::validate`]).
    pub fn new(params: Vec<Parameter<T>>, config: AdamWConfig) -> Result<Self> {
        config.validate()?;
        let moments = (0..params.len()).map(|_| None).collect();
        let device_moments = (0..params.len()).map(|_| None).collect();
        Ok(AdamW {
            options: vec![ParamOptions::default(); params.len()],
            params,
            config,
            clock: Clock::default(),
            moments,
            device_moments,
        })
    }

    /// Takes each step's learning rate from `schedule` instead of `config.lr`.
    pub fn with_schedule(mut self, schedule: LrSchedule) -> Self {
        self.clock.schedule = Some(schedule);
        self
    }

    /// Scales the learning rate and weight decay of each parameter by `options(param)`
    /// (PyTorch's parameter groups), e.g. [`ParamOptions::megatron_groups`].
    pub fn with_param_options(mut self, options: impl Fn(&Parameter<T>) -> ParamOptions) -> Self {
        self.options = self.params.iter().map(options).collect();
        self
    }
}

impl<T: Element> AdamW<T> {
    /// One step over every parameter; with `round`, each new value is also written,
    /// rounded, into its copy: on a device by the update kernel itself, which takes the
    /// device's parameters in as few launches as its argument block allows.
    fn update(&mut self, round: Option<(&[Parameter<T>], DType)>) -> Result<()> {
        self.config.lr = self.clock.advance(self.config.lr);
        let c = self.config;
        let mut on_devices: Vec<(usize, AdamWEntry<T>)> = Vec::new();
        let mut gathered = std::collections::HashSet::new();
        let copies = round.map(|(copies, _)| copies);
        for (i, param) in self.params.iter().enumerate() {
            // A parameter listed twice is updated twice, in order: the gathered
            // updates run before its second one reads the value.
            if !gathered.insert(param.id()) {
                launch_by_device(std::mem::take(&mut on_devices), copies)?;
                gathered = std::collections::HashSet::from([param.id()]);
            }
            let options = self.options[i];
            let update = move |step| AdamWUpdate::new(&c, options, step);
            let copy = round.map(|(copies, dtype)| (&copies[i], dtype));
            let entry = if param.on_device() {
                let rounded = copy.map(|(_, dtype)| dtype);
                device_entry(param, &mut self.device_moments[i], rounded, update)?
            } else {
                step_on_host(param, &mut self.moments[i], update)?;
                None
            };
            match (entry, copy) {
                (Some(entry), _) => on_devices.push((i, entry)),
                // Updated on the host, or not at all (no gradient): rounded as it is.
                (None, Some((copy, dtype))) => {
                    let (param, copy) = (std::slice::from_ref(param), std::slice::from_ref(copy));
                    round_into(param, copy, dtype)?
                }
                (None, None) => {}
            }
        }
        launch_by_device(on_devices, copies)
    }
}

const ADAMW_OP: &str = "AdamW::step";

/// One AdamW update of a host parameter (if it has a gradient), in place.
fn step_on_host<T: Element>(
    param: &Parameter<T>,
    moments: &mut Option<AdamState<T>>,
    update: impl Fn(u32) -> AdamWUpdate,
) -> Result<()> {
    let shape = param.shape();
    param.update_in_place(ADAMW_OP, |values, grads| {
        let (m, v, step) = moments.get_or_insert_with(|| {
            let zeros = || ArrayD::zeros(IxDyn(&shape));
            (zeros(), zeros(), 0)
        });
        *step += 1;
        update(*step).apply(values, grads, host_slice(m)?, host_slice(v)?)
    })?;
    Ok(())
}

/// A device parameter's update for the multi-tensor launch (handles to its arrays,
/// updated in place by it, and a fresh 16-bit copy to write if `rounded`); `None`
/// without a gradient.
fn device_entry<T: Element>(
    param: &Parameter<T>,
    state: &mut Option<DeviceAdamState<T>>,
    rounded: Option<DType>,
    update: impl Fn(u32) -> AdamWUpdate,
) -> Result<Option<AdamWEntry<T>>> {
    let device = param.device();
    let rounded = rounded
        .map(|dtype| Half::uninit_gpu(ADAMW_OP, dtype, &param.shape(), device))
        .transpose()?;
    let mut entry = None;
    param.update_on_device(ADAMW_OP, |value, grad| {
        let (m, v, step) = match state {
            Some(state) => state,
            None => {
                let zeros = || GpuArray::full(ADAMW_OP, device, value.shape(), T::zero());
                state.insert((zeros()?, zeros()?, 0))
            }
        };
        *step += 1;
        entry = Some(AdamWEntry {
            param: value.clone(),
            grad: grad.clone(),
            m: m.clone(),
            v: v.clone(),
            rounded,
            coefficients: update(*step).coefficients(),
        });
        Ok(())
    })?;
    Ok(entry)
}

/// The multi-tensor launches of each device's updates, then each rounded copy (written
/// by them) as its model parameter's value.
fn launch_by_device<T: Element>(
    updates: Vec<(usize, AdamWEntry<T>)>,
    copies: Option<&[Parameter<T>]>,
) -> Result<()> {
    let mut devices: Vec<(Device, Vec<&AdamWEntry<T>>)> = Vec::new();
    for (_, entry) in &updates {
        let device = entry.param.device();
        match devices.iter_mut().find(|(d, _)| *d == device) {
            Some((_, entries)) => entries.push(entry),
            None => devices.push((device, vec![entry])),
        }
    }
    for (_, entries) in &devices {
        adamw_list(entries)?;
    }
    for (i, entry) in updates {
        if let (Some(copies), Some(half)) = (copies, entry.rounded) {
            copies[i].set_value(Tensor::from_half(half))?;
        }
    }
    Ok(())
}

impl<T: Element> Optimizer<T> for AdamW<T> {
    fn step(&mut self) -> Result<()> {
        self.update(None)
    }

    fn step_and_round_into(&mut self, copies: &[Parameter<T>], dtype: DType) -> Result<()> {
        check_copies(&self.params, copies)?;
        self.update(Some((copies, dtype)))
    }

    fn params(&self) -> &[Parameter<T>] {
        &self.params
    }

    fn lr(&self) -> f64 {
        self.clock.next_lr(self.config.lr)
    }

    fn state(&self) -> Result<OptimizerState<T>> {
        let params = (self.moments.iter().zip(&self.device_moments))
            .map(|(host, device)| {
                let (m, v, steps) = match (host, device) {
                    (Some((m, v, steps)), _) => (
                        Tensor::from_array(m.clone()),
                        Tensor::from_array(v.clone()),
                        *steps,
                    ),
                    (None, Some((m, v, steps))) => (
                        Tensor::from_gpu(m.duplicate("AdamW::state")?),
                        Tensor::from_gpu(v.duplicate("AdamW::state")?),
                        *steps,
                    ),
                    (None, None) => return Ok(ParamState::default()),
                };
                Ok(ParamState {
                    steps: u64::from(steps),
                    buffers: vec![(ADAM_BUFFERS[0].into(), m), (ADAM_BUFFERS[1].into(), v)],
                })
            })
            .collect::<Result<_>>()?;
        Ok(OptimizerState {
            steps: self.clock.steps,
            params,
        })
    }

    fn load_state(&mut self, state: &OptimizerState<T>) -> Result<()> {
        let slots = state.restore(&self.params, &ADAM_BUFFERS, "AdamW::load_state")?;
        for (i, slot) in slots.into_iter().enumerate() {
            self.moments[i] = None;
            self.device_moments[i] = None;
            let Some((steps, mut buffers)) = slot else {
                continue;
            };
            let steps = u32::try_from(steps).map_err(|_| {
                Error::invalid("AdamW::load_state", format!("{steps} steps exceed u32"))
            })?;
            match (buffers.remove(0), buffers.remove(0)) {
                ((Some(m), _), (Some(v), _)) => self.moments[i] = Some((m, v, steps)),
                ((_, Some(m)), (_, Some(v))) => self.device_moments[i] = Some((m, v, steps)),
                _ => unreachable!("restore places every buffer of a parameter on one device"),
            }
        }
        self.clock.steps = state.steps;
        Ok(())
    }
}

/// Per-parameter multipliers of an optimizer's learning rate and weight decay: PyTorch's
/// parameter groups, Megatron's `lr_mult` and `wd_mult`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamOptions {
    /// Multiplies the learning rate (default 1).
    pub lr_mult: f64,
    /// Multiplies the weight decay (default 1; 0 turns decay off).
    pub wd_mult: f64,
}

impl Default for ParamOptions {
    fn default() -> Self {
        ParamOptions {
            lr_mult: 1.0,
            wd_mult: 1.0,
        }
    }
}

impl ParamOptions {
    /// Megatron-Core's default groups: no weight decay for a parameter whose name ends
    /// in `.bias` or that has one dimension (biases and normalisation weights); full
    /// decay for the rest, scalars included, as Megatron's `_get_param_groups` decides.
    /// Pass it to `with_param_options`; without it every parameter is decayed, as in
    /// `torch.optim.AdamW`.
    pub fn megatron_groups<T: Element>(param: &Parameter<T>) -> ParamOptions {
        let no_decay = param.name().ends_with(".bias") || param.shape().len() == 1;
        ParamOptions {
            wd_mult: if no_decay { 0.0 } else { 1.0 },
            ..ParamOptions::default()
        }
    }
}

/// One SGD update of one parameter's elements, exactly as [`Sgd::step`] applies it; public
/// so that a sharded optimizer can apply it to its slice of a parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdUpdate {
    /// Learning rate (the parameter's multiplier applied).
    pub lr: f64,
    /// Coupled weight decay (the parameter's multiplier applied).
    pub weight_decay: f64,
    /// Momentum factor (0: no momentum buffer).
    pub momentum: f64,
    /// Dampening of the momentum update.
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl SgdUpdate {
    /// The update's scalars as the device kernel takes them.
    fn scalars(&self) -> SgdScalars {
        SgdScalars {
            lr: self.lr,
            weight_decay: self.weight_decay,
            momentum: self.momentum,
            dampening: self.dampening,
            nesterov: self.nesterov,
        }
    }

    /// The update `config` (with this step's learning rate) makes to a parameter with
    /// `options`.
    pub fn new(config: &SgdConfig, options: ParamOptions) -> Self {
        SgdUpdate {
            lr: config.lr * options.lr_mult,
            weight_decay: config.weight_decay * options.wd_mult,
            momentum: config.momentum,
            dampening: config.dampening,
            nesterov: config.nesterov,
        }
    }

    /// Updates `values` in place from `grads`. With momentum, `buffer` is the momentum
    /// buffer of the same length, which the parameter's `first` update sets to the
    /// direction undampened; without, it is ignored.
    pub fn apply<T: Element>(
        &self,
        values: &mut [T],
        grads: &[T],
        buffer: &mut [T],
        first: bool,
    ) -> Result<()> {
        let has_momentum = self.momentum != 0.0;
        check_lengths(
            "SgdUpdate::apply",
            values.len(),
            grads.len(),
            has_momentum.then_some(buffer.len()),
        )?;
        let (lr, wd) = (T::from_f64(self.lr), T::from_f64(self.weight_decay));
        let (mu, damp) = (
            T::from_f64(self.momentum),
            T::from_f64(1.0 - self.dampening),
        );
        if !has_momentum {
            for (p, &g) in values.iter_mut().zip(grads) {
                *p = *p - lr * (g + wd * *p);
            }
            return Ok(());
        }
        for ((p, &g), b) in values.iter_mut().zip(grads).zip(buffer.iter_mut()) {
            let direction = g + wd * *p;
            *b = if first {
                direction
            } else {
                mu * *b + damp * direction
            };
            let step = if self.nesterov {
                direction + mu * *b
            } else {
                *b
            };
            *p -= lr * step;
        }
        Ok(())
    }

    /// [`apply`](Self::apply) on views of flat storage (each in its own storage, all on
    /// one device): on a device, in place there. `buffer` is needed with momentum.
    pub fn apply_views<T: Element>(
        &self,
        values: &FlatView<T>,
        grads: &FlatView<T>,
        buffer: Option<&FlatView<T>>,
        first: bool,
    ) -> Result<()> {
        const OP: &str = "SgdUpdate::apply_views";
        let has_momentum = self.momentum != 0.0;
        let buffer = buffer.filter(|_| has_momentum);
        check_lengths(
            OP,
            values.numel(),
            grads.numel(),
            has_momentum.then(|| buffer.map_or(0, |b| b.numel())),
        )?;
        let views: Vec<&FlatView<T>> = [values, grads].into_iter().chain(buffer).collect();
        with_regions(OP, &views, |regions| match regions {
            Regions::Host(mut slices) => match slices.as_mut_slice() {
                [values, grads, buffer] => self.apply(values, grads, buffer, first),
                [values, grads] => self.apply(values, grads, &mut [], first),
                _ => unreachable!("two or three views"),
            },
            Regions::Device(arrays) => {
                sgd_step(&arrays[0], &arrays[1], arrays.get(2), first, self.scalars())
            }
        })
    }
}

/// One AdamW update of one parameter's elements at a given step count, exactly as
/// [`AdamW::step`] applies it; public so that a sharded optimizer can apply it to its
/// slice of a parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWUpdate {
    /// `1 - β1`: the first moment's step towards the gradient.
    beta1_complement: f64,
    /// `β2` and `1 - β2`: the second moment's decay and the squared gradient's weight.
    beta2: f64,
    beta2_complement: f64,
    eps: f64,
    /// `1 - lr·weight_decay`: the decoupled decay factor.
    decay: f64,
    /// `lr / (1 - β1^t)`.
    step_size: f64,
    /// `√(1 - β2^t)`.
    bias2_sqrt: f64,
}

impl AdamWUpdate {
    /// The update `config` (with this step's learning rate) makes to a parameter with
    /// `options` at its `step`-th update (1 for the first).
    pub fn new(config: &AdamWConfig, options: ParamOptions, step: u32) -> Self {
        let lr = config.lr * options.lr_mult;
        let (beta1, beta2) = config.betas;
        // Step sizes follow torch: lr/(1-β1^t) on m, √(1-β2^t) folded into the denominator.
        // Every scalar is formed in f64 and rounded once to the compute type, as PyTorch
        // forms them from Python floats: 1 - f32(0.999) would be 1.3e-5 too small.
        let step = step as i32;
        AdamWUpdate {
            beta1_complement: 1.0 - beta1,
            beta2,
            beta2_complement: 1.0 - beta2,
            eps: config.eps,
            decay: 1.0 - lr * config.weight_decay * options.wd_mult,
            step_size: lr / (1.0 - beta1.powi(step)),
            bias2_sqrt: (1.0 - beta2.powi(step)).sqrt(),
        }
    }

    /// The seven scalars of the device kernel (`adamw_element` in optim.cu), in its
    /// order: those of every parameter first, then this parameter's.
    fn coefficients(&self) -> [f64; 7] {
        [
            self.beta1_complement,
            self.beta2,
            self.beta2_complement,
            self.eps,
            self.decay,
            self.step_size,
            self.bias2_sqrt,
        ]
    }

    /// Updates `values` and the moments `m` and `v` (all of the same length) in place
    /// from `grads`.
    pub fn apply<T: Element>(
        &self,
        values: &mut [T],
        grads: &[T],
        m: &mut [T],
        v: &mut [T],
    ) -> Result<()> {
        check_lengths(
            "AdamWUpdate::apply",
            values.len(),
            grads.len(),
            Some(m.len()),
        )?;
        check_lengths(
            "AdamWUpdate::apply",
            values.len(),
            grads.len(),
            Some(v.len()),
        )?;
        let w1 = T::from_f64(self.beta1_complement);
        let (b2, w2) = (T::from_f64(self.beta2), T::from_f64(self.beta2_complement));
        let (decay, step_size) = (T::from_f64(self.decay), T::from_f64(self.step_size));
        let (eps, bias2_sqrt) = (T::from_f64(self.eps), T::from_f64(self.bias2_sqrt));
        for (((p, &g), m), v) in values
            .iter_mut()
            .zip(grads)
            .zip(m.iter_mut())
            .zip(v.iter_mut())
        {
            *m = lerp(*m, g, w1);
            *v = b2 * *v + w2 * g * g;
            *p = *p * decay - step_size * *m / ((*v).sqrt() / bias2_sqrt + eps);
        }
        Ok(())
    }

    /// [`apply`](Self::apply) on views of flat storage (each in its own storage, all on
    /// one device): on a device, in place there.
    pub fn apply_views<T: Element>(
        &self,
        values: &FlatView<T>,
        grads: &FlatView<T>,
        m: &FlatView<T>,
        v: &FlatView<T>,
    ) -> Result<()> {
        const OP: &str = "AdamWUpdate::apply_views";
        check_lengths(OP, values.numel(), grads.numel(), Some(m.numel()))?;
        check_lengths(OP, values.numel(), grads.numel(), Some(v.numel()))?;
        with_regions(OP, &[values, grads, m, v], |regions| match regions {
            Regions::Host(mut slices) => match slices.as_mut_slice() {
                [values, grads, m, v] => self.apply(values, grads, m, v),
                _ => unreachable!("four views"),
            },
            Regions::Device(arrays) => adamw_step(
                &arrays[0],
                &arrays[1],
                &arrays[2],
                &arrays[3],
                self.coefficients(),
                None,
            ),
        })
    }
}

/// `start + weight·(end − start)` as `torch.lerp` computes it: from the nearer end, so
/// that a weight of 1 gives `end` exactly (PyTorch's AdamW moves the first moment so).
fn lerp<T: Element>(start: T, end: T, weight: T) -> T {
    // The weight is 1 - β1, in (0, 1] for every valid β1: the same test as optim.cu's.
    if weight < T::from_f64(0.5) {
        start + weight * (end - start)
    } else {
        end - (end - start) * (T::one() - weight)
    }
}

fn check_lengths(
    op: &'static str,
    values: usize,
    grads: usize,
    buffer: Option<usize>,
) -> Result<()> {
    if grads != values || buffer.is_some_and(|len| len != values) {
        return Err(Error::invalid(
            op,
            format!(
                "{values} values, {grads} gradients and {} buffer elements: give slices of one length",
                buffer.map_or("no".to_string(), |len| len.to_string())
            ),
        ));
    }
    Ok(())
}

/// A host array's elements as one slice (arrays the optimizers create are contiguous).
fn host_slice<T: Element>(array: &mut ArrayD<T>) -> Result<&mut [T]> {
    array
        .as_slice_mut()
        .ok_or_else(|| Error::invalid("optimizer", "an optimizer buffer is not contiguous"))
}

/// Counts optimizer steps and, with a schedule, sets each step's learning rate.
#[derive(Debug, Clone, Copy, Default)]
struct Clock {
    steps: u64,
    schedule: Option<LrSchedule>,
}

impl Clock {
    /// The learning rate of the next step (`lr` without a schedule): the schedule at
    /// the number of steps taken.
    fn next_lr(&self, lr: f64) -> f64 {
        self.schedule.map_or(lr, |s| s.lr(self.steps))
    }

    /// Counts a step and returns its learning rate.
    fn advance(&mut self, lr: f64) -> f64 {
        let lr = self.next_lr(lr);
        self.steps += 1;
        lr
    }
}

/// What an optimizer keeps besides the parameters, from [`Optimizer::state`].
#[derive(Debug, Clone)]
pub struct OptimizerState<T: Element = f32> {
    /// Steps taken: the position on the learning-rate schedule.
    pub steps: u64,
    /// One entry per parameter, in [`Optimizer::params`] order.
    pub params: Vec<ParamState<T>>,
}

/// One parameter's optimizer buffers.
#[derive(Debug, Clone)]
pub struct ParamState<T: Element = f32> {
    /// Updates applied to this parameter (AdamW's bias correction counts them; a
    /// parameter without a gradient is not updated). 0 for SGD.
    pub steps: u64,
    /// Named buffers of the parameter's shape (`exp_avg` and `exp_avg_sq` for AdamW,
    /// `momentum_buffer` for SGD with momentum), as in PyTorch's optimizer state; empty
    /// before the parameter's first update.
    pub buffers: Vec<(String, Tensor<T>)>,
}

impl<T: Element> Default for ParamState<T> {
    fn default() -> Self {
        ParamState {
            steps: 0,
            buffers: Vec::new(),
        }
    }
}

/// A restored buffer, on the host or on its parameter's device.
type Placed<T> = (Option<ArrayD<T>>, Option<GpuArray<T>>);

/// A parameter's restored update count and buffers; `None` before its first update.
type Restored<T> = Option<(u64, Vec<Placed<T>>)>;

impl<T: Element> OptimizerState<T> {
    /// Checks the state against `params` and an optimizer's buffer names, and places each
    /// parameter's buffers (in `names` order) where the parameter lives. `None` for a
    /// parameter with no buffers yet.
    fn restore(
        &self,
        params: &[Parameter<T>],
        names: &[&str],
        op: &'static str,
    ) -> Result<Vec<Restored<T>>> {
        if self.params.len() != params.len() {
            return Err(Error::invalid(
                op,
                format!(
                    "the state holds {} parameters, the optimizer {}; restore it into an \
                     optimizer over the same parameters",
                    self.params.len(),
                    params.len()
                ),
            ));
        }
        params
            .iter()
            .zip(&self.params)
            .map(|(param, entry)| {
                if entry.buffers.is_empty() {
                    return Ok(None);
                }
                let found: Vec<&str> = entry.buffers.iter().map(|(n, _)| n.as_str()).collect();
                if found != names {
                    return Err(Error::invalid(
                        op,
                        format!(
                            "'{}' has buffers {found:?}; this optimizer keeps {names:?}",
                            param.name()
                        ),
                    ));
                }
                let device = param.device();
                let placed = entry
                    .buffers
                    .iter()
                    .map(|(_, buffer)| {
                        if buffer.shape() != param.shape() {
                            return Err(Error::shape(
                                op,
                                &[&param.shape(), buffer.shape()],
                                format!("a buffer of '{}' has another shape", param.name()),
                            ));
                        }
                        Ok(match device {
                            Device::Cpu => (Some(buffer.to_array()?), None),
                            _ => {
                                let on_device = buffer.to_device(device)?;
                                let array = on_device
                                    .gpu(op)?
                                    .ok_or(Error::UnsupportedDevice { op, device })?;
                                // A private copy: the optimizer updates it in place.
                                (None, Some(array.duplicate(op)?))
                            }
                        })
                    })
                    .collect::<Result<_>>()?;
                Ok(Some((entry.steps, placed)))
            })
            .collect()
    }
}
