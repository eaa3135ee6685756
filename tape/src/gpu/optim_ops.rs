//! Device math of the optimizer steps (SGD, AdamW), in place on the parameter.

use super::{moves, GpuArray, Kernel, KernelArgs, Precision};
use crate::precision::Half;
use crate::{Element, Error, Result};

kernels! {
    OPTIM_KERNELS:
    SGD_STEP = "sgd_step": sgd_step_f32, sgd_step_f64;
    ADAMW_STEP = "adamw_step": adamw_step_f32, adamw_step_f64;
    ADAMW_LIST = "adamw_list": adamw_list_f32, adamw_list_f64;
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
/// `coefficients` are the seven scalars of `adamw_element` in optim.cu, in order. With
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

/// Most tensors one `adamw_list` launch takes (`LIST_TENSORS` in common.h: the argument
/// block stays within CUDA's 4 KiB of kernel parameters).
const LIST_TENSORS: usize = 48;

/// The argument block of `adamw_list` (`TensorListArgs` in common.h).
#[repr(C)]
#[derive(Clone, Copy)]
struct TensorListArgs {
    p: [[u64; 5]; LIST_TENSORS],
    start: [i64; LIST_TENSORS + 1],
    per_tensor: [[f64; 3]; LIST_TENSORS],
    shared: [f64; 4],
    count: i64,
    format: i64,
}

// SAFETY: a #[repr(C)] struct of 8-byte integers and floats, laid out as common.h's
// TensorListArgs, which `adamw_list` takes by value.
unsafe impl ferrotron_device::KernelArg for TensorListArgs {}

/// One tensor of a multi-tensor AdamW step: what [`adamw_step`] takes, as handles.
pub(crate) struct AdamWEntry<T> {
    pub param: GpuArray<T>,
    pub grad: GpuArray<T>,
    pub m: GpuArray<T>,
    pub v: GpuArray<T>,
    pub rounded: Option<Half>,
    pub coefficients: [f64; 7],
}

/// [`adamw_step`] of every entry (all on one device, their rounded copies in one format,
/// the same betas and eps), [`LIST_TENSORS`] to a launch: Apex's and PyTorch's
/// multi-tensor `foreach` step, one launch where a launch per tensor costs more than the
/// update itself for small tensors.
pub(crate) fn adamw_list<T: Element>(entries: &[&AdamWEntry<T>]) -> Result<()> {
    entries.chunks(LIST_TENSORS).try_for_each(launch_list)
}

fn launch_list<T: Element>(entries: &[&AdamWEntry<T>]) -> Result<()> {
    let Some(first) = entries.first() else {
        return Ok(());
    };
    let mut args = TensorListArgs {
        p: [[0; 5]; LIST_TENSORS],
        start: [0; LIST_TENSORS + 1],
        per_tensor: [[0.0; 3]; LIST_TENSORS],
        shared: [0.0; 4],
        count: entries.len() as i64,
        format: 0,
    };
    args.shared.copy_from_slice(&first.coefficients[..4]);
    let mut accesses = Vec::with_capacity(5 * entries.len());
    let mut cost = moves(0, 0);
    for (t, entry) in entries.iter().enumerate() {
        let bytes = entry.param.bytes();
        let rounded = match &entry.rounded {
            Some(half) => {
                let slot = half
                    .device_slot()
                    .filter(|_| half.shape() == entry.param.shape());
                let Some((ptr, format)) = slot else {
                    return Err(Error::invalid(
                        "AdamW::step",
                        "the 16-bit copy must be device storage of the parameter's shape",
                    ));
                };
                args.format = format;
                accesses.push(ferrotron_device::Access::write(ptr, 2 * entry.param.len()));
                ptr
            }
            None => 0,
        };
        args.p[t] = [
            entry.param.ptr(),
            entry.grad.ptr(),
            entry.m.ptr(),
            entry.v.ptr(),
            rounded,
        ];
        args.start[t + 1] = args.start[t] + entry.param.len() as i64;
        args.per_tensor[t].copy_from_slice(&entry.coefficients[4..]);
        accesses.extend(
            [entry.param.ptr(), entry.m.ptr(), entry.v.ptr()]
                .map(|ptr| ferrotron_device::Access::write(ptr, bytes)),
        );
        accesses.push(ferrotron_device::Access::read(
            entry.grad.ptr(),
            entry.grad.bytes(),
        ));
        let written = 3 * bytes
            + if rounded != 0 {
                2 * entry.param.len()
            } else {
                0
            };
        cost.read += (3 * bytes + entry.grad.bytes()) as u64;
        cost.written += written as u64;
    }
    let items = args.start[entries.len()] as usize;
    let precision = Precision::of::<T>();
    let backend = first.param.backend();
    let function = backend.function(&ADAMW_LIST, precision)?;
    let stream = first.param.stream();
    // SAFETY: every address is a live array of this backend holding its tensor's
    // elements (the rounded copy 16-bit ones), as the kernel's slots require.
    let launch = || unsafe { stream.launch(&function, items, &[&args], &accesses) };
    let on_device = Error::on_device(ADAMW_LIST.name, first.param.device());
    ferrotron_device::profile::measure(stream, ADAMW_LIST.name, precision.suffix(), cost, launch)
        .map_err(on_device)
}
