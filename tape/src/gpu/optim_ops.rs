//! Device math of the optimizer steps (SGD, AdamW), in place on the parameter.

use super::{moves, GpuArray, Kernel, KernelArgs};
use crate::precision::Half;
use crate::{Element, Error, Result};

kernels! {
    OPTIM_KERNELS:
    SGD_STEP = "sgd_step": sgd_step_f32, sgd_step_f64;
    ADAMW_STEP = "adamw_step": adamw_step_f32, adamw_step_f64;
}

/// The scalars of one SGD step as `sgd_step` in optim.cu takes them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SgdScalars {
    pub lr: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
}

/// One SGD step of `param` (written in place); `buffer` is the momentum buffer (with
/// momentum), which the `first` step sets from the direction.
pub(crate) fn sgd_step<T: Element>(
    param: &GpuArray<T>,
    grad: &GpuArray<T>,
    buffer: Option<&GpuArray<T>>,
    first: bool,
    step: SgdScalars,
) -> Result<()> {
    let has_momentum = step.momentum != 0.0;
    let mut args = KernelArgs::default();
    args.p[..3].copy_from_slice(&[param.ptr(), grad.ptr(), buffer.map_or(0, |b| b.ptr())]);
    args.i[0] = param.len() as i64;
    args.i[1] = i64::from(has_momentum)
        | i64::from(has_momentum && first) << 1
        | i64::from(step.nesterov) << 2;
    args.f[..4].copy_from_slice(&[
        step.lr,
        step.weight_decay,
        step.momentum,
        1.0 - step.dampening,
    ]);
    // The parameter and gradient are read, the parameter and buffer written; the buffer
    // is read too unless this step starts it.
    let buffer_bytes = buffer.map_or(0, GpuArray::bytes) * usize::from(has_momentum);
    let read = param.bytes() + grad.bytes() + if first { 0 } else { buffer_bytes };
    let cost = moves(read, param.bytes() + buffer_bytes);
    param.launch(&SGD_STEP, param.len(), &args, cost)
}

/// One AdamW step of `param` with moments `m` and `v` (all written in place);
/// `coefficients` are the seven scalars of `adamw_step` in optim.cu, in order. With
/// `rounded`, the new values are also written there rounded to 16 bits, in the same pass.
pub(crate) fn adamw_step<T: Element>(
    param: &GpuArray<T>,
    grad: &GpuArray<T>,
    m: &GpuArray<T>,
    v: &GpuArray<T>,
    coefficients: [f64; 7],
    rounded: Option<&Half>,
) -> Result<()> {
    let mut args = KernelArgs::default();
    args.p[..4].copy_from_slice(&[param.ptr(), grad.ptr(), m.ptr(), v.ptr()]);
    args.i[0] = param.len() as i64;
    args.f[..7].copy_from_slice(&coefficients);
    let state = param.bytes() + m.bytes() + v.bytes();
    let mut written = state;
    if let Some(rounded) = rounded {
        let slot = rounded
            .device_slot()
            .filter(|_| rounded.shape() == param.shape());
        let Some((ptr, kind)) = slot else {
            return Err(Error::invalid(
                "AdamW::step",
                "the 16-bit copy must be device storage of the parameter's shape",
            ));
        };
        args.p[4] = ptr;
        args.i[1] = kind;
        written += 2 * param.len();
    }
    let cost = moves(state + grad.bytes(), written);
    param.launch(&ADAMW_STEP, param.len(), &args, cost)
}
