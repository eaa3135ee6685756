//! Optimizers with PyTorch semantics: [`Sgd`] (momentum, weight decay) and [`AdamW`].

use ndarray::{ArrayD, Zip};

use crate::gpu::optim_ops::{adamw_step, sgd_step, SgdStep};
use crate::gpu::GpuArray;
use crate::{Element, Parameter, Result};

/// Something that updates parameters from their gradients.
pub trait Optimizer<T: Element = f32> {
    /// Applies one update to every parameter that has a gradient.
    fn step(&mut self) -> Result<()>;

    /// The parameters being optimised.
    fn params(&self) -> &[Parameter<T>];

    /// Clears every parameter's gradient.
    fn zero_grad(&self) {
        for param in self.params() {
            param.zero_grad();
        }
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
}

/// Stochastic gradient descent, as `torch.optim.SGD`.
#[derive(Debug)]
pub struct Sgd<T: Element = f32> {
    params: Vec<Parameter<T>>,
    config: SgdConfig,
    momentum_buffers: Vec<Option<ArrayD<T>>>,
    /// Momentum buffers of parameters that live on a device.
    device_buffers: Vec<Option<GpuArray<T>>>,
}

impl<T: Element> Sgd<T> {
    /// An optimizer over `params`.
    pub fn new(params: Vec<Parameter<T>>, config: SgdConfig) -> Self {
        let momentum_buffers = vec![None; params.len()];
        let device_buffers = vec![None; params.len()];
        Sgd {
            params,
            config,
            momentum_buffers,
            device_buffers,
        }
    }

    /// Changes the learning rate (for schedules).
    pub fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

impl<T: Element> Optimizer<T> for Sgd<T> {
    fn step(&mut self) -> Result<()> {
        let c = self.config;
        let (lr, wd) = (T::from_f64(c.lr), T::from_f64(c.weight_decay));
        let (mu, damp) = (T::from_f64(c.momentum), T::from_f64(1.0 - c.dampening));
        for (i, param) in self.params.iter().enumerate() {
            if param.on_device() {
                let step = SgdStep {
                    lr: c.lr,
                    weight_decay: c.weight_decay,
                    momentum: c.momentum,
                    dampening: c.dampening,
                    nesterov: c.nesterov,
                };
                let buffer = &mut self.device_buffers[i];
                param.update_on_device("Sgd::step", |value, grad| {
                    sgd_step(value, grad, buffer, &step)
                })?;
                continue;
            }
            let buffer = &mut self.momentum_buffers[i];
            param.update_in_place("Sgd::step", |value, grad| {
                if c.momentum == 0.0 {
                    Zip::from(value)
                        .and(grad)
                        .for_each(|p, &g| *p = *p - lr * (g + wd * *p));
                    return;
                }
                let mut direction = grad.to_owned();
                if c.weight_decay != 0.0 {
                    Zip::from(&mut direction)
                        .and(&*value)
                        .for_each(|d, &p| *d += wd * p);
                }
                let buf = match buffer {
                    // The first step initialises the buffer with the gradient, undampened.
                    None => buffer.insert(direction.clone()),
                    Some(buf) => {
                        Zip::from(&mut *buf)
                            .and(&direction)
                            .for_each(|b, &d| *b = mu * *b + damp * d);
                        buf
                    }
                };
                if c.nesterov {
                    Zip::from(&mut direction)
                        .and(&*buf)
                        .for_each(|d, &b| *d += mu * b);
                } else {
                    direction.assign(buf);
                }
                Zip::from(value)
                    .and(&direction)
                    .for_each(|p, &d| *p -= lr * d);
            })?;
        }
        Ok(())
    }

    fn params(&self) -> &[Parameter<T>] {
        &self.params
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
    config: AdamWConfig,
    moments: Vec<Option<AdamState<T>>>,
    device_moments: Vec<Option<DeviceAdamState<T>>>,
}

impl<T: Element> AdamW<T> {
    /// An optimizer over `params`.
    pub fn new(params: Vec<Parameter<T>>, config: AdamWConfig) -> Self {
        let moments = (0..params.len()).map(|_| None).collect();
        let device_moments = (0..params.len()).map(|_| None).collect();
        AdamW {
            params,
            config,
            moments,
            device_moments,
        }
    }

    /// Changes the learning rate (for schedules).
    pub fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

impl<T: Element> Optimizer<T> for AdamW<T> {
    fn step(&mut self) -> Result<()> {
        let c = self.config;
        let (beta1, beta2) = c.betas;
        for (i, param) in self.params.iter().enumerate() {
            if param.on_device() {
                let state = &mut self.device_moments[i];
                param.update_on_device("AdamW::step", |value, grad| {
                    let (m, v, step) = match state {
                        Some(state) => state,
                        None => {
                            let zeros = || {
                                GpuArray::full(
                                    "AdamW::step",
                                    value.device(),
                                    value.shape(),
                                    T::zero(),
                                )
                            };
                            state.insert((zeros()?, zeros()?, 0))
                        }
                    };
                    *step += 1;
                    let bias1 = 1.0 - beta1.powi(*step as i32);
                    let bias2_sqrt = (1.0 - beta2.powi(*step as i32)).sqrt();
                    let coefficients = [
                        beta1,
                        beta2,
                        1.0 - c.lr * c.weight_decay,
                        c.lr / bias1,
                        c.eps,
                        bias2_sqrt,
                    ];
                    adamw_step(value, grad, m, v, coefficients)
                })?;
                continue;
            }
            let moments = &mut self.moments[i];
            param.update_in_place("AdamW::step", |value, grad| {
                let (m, v, step) = moments.get_or_insert_with(|| {
                    (
                        ArrayD::zeros(grad.raw_dim()),
                        ArrayD::zeros(grad.raw_dim()),
                        0,
                    )
                });
                *step += 1;
                // Step sizes follow torch: lr/(1-β1^t) on m, √(1-β2^t) folded into the denominator.
                let bias1 = 1.0 - beta1.powi(*step as i32);
                let bias2_sqrt = (1.0 - beta2.powi(*step as i32)).sqrt();
                let decay = T::from_f64(1.0 - c.lr * c.weight_decay);
                let step_size = T::from_f64(c.lr / bias1);
                let (b1, b2) = (T::from_f64(beta1), T::from_f64(beta2));
                let (eps, bias2_sqrt) = (T::from_f64(c.eps), T::from_f64(bias2_sqrt));
                Zip::from(value)
                    .and(grad)
                    .and(m)
                    .and(v)
                    .for_each(|p, &g, m, v| {
                        *m = b1 * *m + (T::one() - b1) * g;
                        *v = b2 * *v + (T::one() - b2) * g * g;
                        *p = *p * decay - step_size * *m / ((*v).sqrt() / bias2_sqrt + eps);
                    });
            })?;
        }
        Ok(())
    }

    fn params(&self) -> &[Parameter<T>] {
        &self.params
    }
}
