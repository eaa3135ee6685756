//! 16-bit tensors: bf16 and f16 as a storage format.
//!
//! A `Tensor<T>` stores its elements as `T` or, after
//! [`to_dtype`](crate::Tensor::to_dtype), as bf16 or f16 (half the memory). The element
//! type stays the compute type: an op widens 16-bit inputs to `T`, computes there (so
//! sums, softmax, norm statistics and GEMM accumulation are f32), and rounds its result
//! once to the inputs' format (see [`promoted`]). A 16-bit activation's gradient is
//! kept in its format, a parameter's in `T` (see [`Tensor::grad_format`]). Keeping the
//! format out of the type lets one tape hold a bf16 model and its f32 loss, as PyTorch
//! autocast and Megatron's `--bf16` do.

use ferrotron_comm_core::DType;
use half::{bf16, f16};
use ndarray::{ArcArray, ArrayBase, Data, IxDyn};

use crate::gpu::ops::{PointwiseInput, PointwiseWrite};
use crate::gpu::{GpuArray, HalfFormat, KernelArgs, CONVERT_HALF};
use crate::{Device, Element, Error, Result, Tensor};

/// A 16-bit float format tensors can be stored in: its element conversions (from
/// [`HalfFormat`], which device code uses without the tensor storage) and where a
/// tensor's storage holds it.
pub(crate) trait HalfFloat: HalfFormat {
    /// The storage, if it is in this format.
    fn packed(half: &Half) -> Option<&Packed<Self>>;
    fn into_half(packed: Packed<Self>) -> Half;
}

impl HalfFloat for bf16 {
    fn packed(half: &Half) -> Option<&Packed<Self>> {
        match half {
            Half::Bf16(packed) => Some(packed),
            Half::F16(_) => None,
        }
    }
    fn into_half(packed: Packed<Self>) -> Half {
        Half::Bf16(packed)
    }
}

impl HalfFloat for f16 {
    fn packed(half: &Half) -> Option<&Packed<Self>> {
        match half {
            Half::F16(packed) => Some(packed),
            Half::Bf16(_) => None,
        }
    }
    fn into_half(packed: Packed<Self>) -> Half {
        Half::F16(packed)
    }
}

/// `array` rounded to `H` on its device, in one kernel.
pub(crate) fn narrowed<H: HalfFloat, T: Element>(
    op: &'static str,
    array: &GpuArray<T>,
) -> Result<GpuArray<H>> {
    let out = GpuArray::<H>::uninit(op, array.device(), array.shape())?;
    let mut args = KernelArgs::default();
    args.p[0] = out.ptr();
    args.p[1] = array.ptr();
    args.i[0] = array.len() as i64;
    args.i[1] = H::KIND;
    let cost = crate::gpu::moves(array.bytes(), out.bytes());
    array.launch(&CONVERT_HALF, array.len(), &args, cost)?;
    Ok(out)
}

/// The CPU array's values rounded to `dtype` (bf16 or f16) in place, kept in `T`: what
/// storing them in `dtype` and widening them again gives.
pub(crate) fn round_in_place<T: Element>(
    array: &mut ndarray::ArrayD<T>,
    dtype: DType,
) -> Result<()> {
    fn rounded<H: HalfFormat, T: Element>(v: T) -> T {
        T::from_f64(f64::from(H::narrow(as_f32(v)).widen()))
    }
    match dtype {
        DType::BF16 => array.mapv_inplace(rounded::<bf16, T>),
        DType::F16 => array.mapv_inplace(rounded::<f16, T>),
        other => return Err(not_16_bit("backward", other)),
    }
    Ok(())
}

/// The value as f32, the source every 16-bit rounding starts from (f64 rounds twice,
/// on the CPU as on a device).
fn as_f32<T: Element>(value: T) -> f32 {
    value.into_f64() as f32
}

/// The elements of a 16-bit tensor, on the CPU or a device.
#[derive(Clone)]
pub(crate) enum Packed<H> {
    Cpu(ArcArray<H, IxDyn>),
    Gpu(GpuArray<H>),
}

impl<H: HalfFloat> Packed<H> {
    fn narrow_cpu<T: Element, S: Data<Elem = T>>(array: &ArrayBase<S, IxDyn>) -> Self {
        Packed::Cpu(array.mapv(|v| H::narrow(as_f32(v))).into_shared())
    }

    fn narrow_gpu<T: Element>(op: &'static str, array: &GpuArray<T>) -> Result<Self> {
        narrowed(op, array).map(Packed::Gpu)
    }

    fn widen_cpu<T: Element>(&self, op: &'static str) -> Result<ArcArray<T, IxDyn>> {
        match self {
            Packed::Cpu(array) => Ok(array
                .mapv(|h| T::from_f64(f64::from(h.widen())))
                .into_shared()),
            Packed::Gpu(array) => Err(Error::UnsupportedDevice {
                op,
                device: array.device(),
            }),
        }
    }

    fn widen_gpu<T: Element>(&self, op: &'static str) -> Result<Option<GpuArray<T>>> {
        let Packed::Gpu(array) = self else {
            return Ok(None);
        };
        let out = GpuArray::<T>::uninit(op, array.device(), array.shape())?;
        let mut args = KernelArgs::default();
        args.p[0] = out.ptr();
        args.p[1] = array.ptr();
        args.i[0] = array.len() as i64;
        args.i[1] = H::KIND + 2;
        let cost = crate::gpu::moves(array.bytes(), out.bytes());
        out.launch(&CONVERT_HALF, array.len(), &args, cost)?;
        Ok(Some(out))
    }

    fn shape(&self) -> &[usize] {
        match self {
            Packed::Cpu(array) => array.shape(),
            Packed::Gpu(array) => array.shape(),
        }
    }

    fn device(&self) -> Device {
        match self {
            Packed::Cpu(_) => Device::Cpu,
            Packed::Gpu(array) => array.device(),
        }
    }

    fn range(&self, offset: usize, shape: &[usize]) -> Option<Self> {
        Some(match self {
            Packed::Cpu(array) => Packed::Cpu(memory_range(array, offset, shape)?),
            Packed::Gpu(array) => Packed::Gpu(array.window(offset, shape)),
        })
    }

    /// `shape` filled with `value` rounded to `H` (through f32, as every rounding here),
    /// on `device`.
    fn full(op: &'static str, shape: &[usize], value: f64, device: Device) -> Result<Self> {
        Ok(match device {
            Device::Cpu => Packed::Cpu(ArcArray::from_elem(IxDyn(shape), H::narrow(value as f32))),
            _ => {
                let out = GpuArray::<H>::uninit(op, device, shape)?;
                out.fill_rounded(value)?;
                Packed::Gpu(out)
            }
        })
    }

    /// Rows `ids` of a CPU `[vocab, hidden]` array, as they are, laid out as `shape`;
    /// `None` for device storage.
    fn cpu_rows(&self, ids: &[usize], shape: &[usize]) -> Option<Self> {
        let Packed::Cpu(array) = self else {
            return None;
        };
        let mut rows = Vec::with_capacity(shape.iter().product());
        for &id in ids {
            rows.extend(array.index_axis(ndarray::Axis(0), id).iter().copied());
        }
        ArcArray::from_shape_vec(IxDyn(shape), rows)
            .ok()
            .map(Packed::Cpu)
    }

    /// The 16-bit elements in row-major order (a download from a device).
    fn to_host(&self) -> Result<Vec<H>> {
        match self {
            Packed::Cpu(array) => Ok(array.iter().copied().collect()),
            Packed::Gpu(array) => array.to_host(),
        }
    }

    /// The same 16-bit elements on `device` (no widening on the way).
    fn to_device(&self, op: &'static str, device: Device) -> Result<Self> {
        let host = self.to_host()?;
        let shape = self.shape().to_vec();
        Ok(match device {
            Device::Cpu => Packed::Cpu(
                ArcArray::from_shape_vec(IxDyn(&shape), host)
                    .map_err(|e| Error::shape(op, &[&shape], e.to_string()))?,
            ),
            _ => Packed::Gpu(GpuArray::from_host(op, device, &host, &shape)?),
        })
    }

    /// Runs `read` on a view of the 16-bit elements, for a communicator.
    fn lend<R>(&self, read: impl FnOnce(ferrotron_comm_core::BufRef<'_>) -> R) -> R {
        match self {
            Packed::Gpu(array) => read(array.lend()),
            Packed::Cpu(array) => match array.as_slice() {
                Some(slice) => read(ferrotron_comm_core::BufRef::from(slice)),
                None => read(ferrotron_comm_core::BufRef::from(
                    &array.iter().copied().collect::<Vec<H>>(),
                )),
            },
        }
    }
}

impl<H: HalfFloat> Packed<H> {
    /// A private copy (CPU: row-major), which may then be lent writable.
    fn duplicate(&self, op: &'static str) -> Result<Self> {
        Ok(match self {
            Packed::Cpu(array) => {
                Packed::Cpu(array.as_standard_layout().into_owned().into_shared())
            }
            Packed::Gpu(array) => Packed::Gpu(array.duplicate(op)?),
        })
    }

    /// Lets `write` change this storage through a writable view of its memory.
    ///
    /// # Safety
    /// Nothing else may refer to this storage: it comes from [`duplicate`](Self::duplicate)
    /// or a fresh allocation.
    unsafe fn write<E: From<Error>>(
        self,
        write: impl FnOnce(ferrotron_comm_core::BufMut<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<Self, E> {
        match self {
            Packed::Cpu(array) => {
                let mut owned = array.into_owned();
                let shape = owned.shape().to_vec();
                let slice = owned
                    .as_slice_mut()
                    .ok_or_else(|| Error::shape("lend", &[&shape], "not row-major"))?;
                write(ferrotron_comm_core::BufMut::from(slice))?;
                Ok(Packed::Cpu(owned.into_shared()))
            }
            Packed::Gpu(array) => {
                // SAFETY: the caller guarantees that no other array shares this memory.
                write(unsafe { array.lend_mut() })?;
                Ok(Packed::Gpu(array))
            }
        }
    }
}

/// A tensor's 16-bit storage.
#[derive(Clone)]
pub(crate) enum Half {
    Bf16(Packed<bf16>),
    F16(Packed<f16>),
}

/// Runs `$body` with `$packed` bound to the storage of either format.
macro_rules! each_format {
    ($half:expr, $packed:ident => $body:expr) => {
        match $half {
            Half::Bf16($packed) => $body,
            Half::F16($packed) => $body,
        }
    };
}

impl Half {
    /// `array` rounded to `dtype` (bf16 or f16), on the CPU.
    pub(crate) fn narrow_cpu<T: Element, S: Data<Elem = T>>(
        op: &'static str,
        dtype: DType,
        array: &ArrayBase<S, IxDyn>,
    ) -> Result<Self> {
        Ok(match dtype {
            DType::F16 => Half::F16(Packed::narrow_cpu(array)),
            DType::BF16 => Half::Bf16(Packed::narrow_cpu(array)),
            other => return Err(not_16_bit(op, other)),
        })
    }

    /// `shape` filled with `value` rounded to `dtype` (bf16 or f16), on `device`.
    pub(crate) fn full(
        op: &'static str,
        dtype: DType,
        shape: &[usize],
        value: f64,
        device: Device,
    ) -> Result<Self> {
        Ok(match dtype {
            DType::F16 => Half::F16(Packed::full(op, shape, value, device)?),
            DType::BF16 => Half::Bf16(Packed::full(op, shape, value, device)?),
            other => return Err(not_16_bit(op, other)),
        })
    }

    /// Device storage of `shape` in `dtype` (bf16 or f16) for a kernel to fill before
    /// anything reads it (work on a device runs in queue order).
    pub(crate) fn uninit_gpu(
        op: &'static str,
        dtype: DType,
        shape: &[usize],
        device: Device,
    ) -> Result<Self> {
        Ok(match dtype {
            DType::F16 => Half::F16(Packed::Gpu(GpuArray::uninit(op, device, shape)?)),
            DType::BF16 => Half::Bf16(Packed::Gpu(GpuArray::uninit(op, device, shape)?)),
            other => return Err(not_16_bit(op, other)),
        })
    }

    /// The device address and format (0 bf16, 1 f16, as the kernels number them) of
    /// device storage; `None` on the CPU.
    pub(crate) fn device_slot(&self) -> Option<(u64, i64)> {
        match self {
            Half::Bf16(Packed::Gpu(array)) => Some((array.ptr(), 0)),
            Half::F16(Packed::Gpu(array)) => Some((array.ptr(), 1)),
            _ => None,
        }
    }

    /// `array` rounded to `dtype` (bf16 or f16), on its device.
    pub(crate) fn narrow_gpu<T: Element>(
        op: &'static str,
        dtype: DType,
        array: &GpuArray<T>,
    ) -> Result<Self> {
        Ok(match dtype {
            DType::F16 => Half::F16(Packed::narrow_gpu(op, array)?),
            DType::BF16 => Half::Bf16(Packed::narrow_gpu(op, array)?),
            other => return Err(not_16_bit(op, other)),
        })
    }

    pub(crate) fn dtype(&self) -> DType {
        match self {
            Half::Bf16(_) => DType::BF16,
            Half::F16(_) => DType::F16,
        }
    }

    /// The elements widened to `T`, on the CPU (an error for device storage).
    pub(crate) fn widen_cpu<T: Element>(&self, op: &'static str) -> Result<ArcArray<T, IxDyn>> {
        each_format!(self, packed => packed.widen_cpu(op))
    }

    /// The elements widened to `T` on their device; `None` for CPU storage.
    pub(crate) fn widen_gpu<T: Element>(&self, op: &'static str) -> Result<Option<GpuArray<T>>> {
        each_format!(self, packed => packed.widen_gpu(op))
    }

    pub(crate) fn shape(&self) -> &[usize] {
        each_format!(self, packed => packed.shape())
    }

    /// Elements `offset..offset + Π shape` in row-major order as storage of `shape`,
    /// sharing the memory (see [`memory_range`]). The caller checks the range.
    pub(crate) fn range(&self, offset: usize, shape: &[usize]) -> Option<Half> {
        Some(match self {
            Half::Bf16(packed) => Half::Bf16(packed.range(offset, shape)?),
            Half::F16(packed) => Half::F16(packed.range(offset, shape)?),
        })
    }

    pub(crate) fn device(&self) -> Device {
        each_format!(self, packed => packed.device())
    }

    /// Rows `ids` of CPU storage `[vocab, hidden]`, copied as they are, as storage of
    /// `shape` (`ids.len() · hidden` elements); `None` for device storage.
    pub(crate) fn cpu_rows(&self, ids: &[usize], shape: &[usize]) -> Option<Half> {
        Some(match self {
            Half::Bf16(packed) => Half::Bf16(packed.cpu_rows(ids, shape)?),
            Half::F16(packed) => Half::F16(packed.cpu_rows(ids, shape)?),
        })
    }

    /// Device storage as a pointwise kernel reads it; `None` on the CPU.
    pub(crate) fn pointwise_input(&self) -> Option<PointwiseInput<'_>> {
        match self {
            Half::Bf16(Packed::Gpu(array)) => Some(array.into()),
            Half::F16(Packed::Gpu(array)) => Some(array.into()),
            Half::Bf16(Packed::Cpu(_)) | Half::F16(Packed::Cpu(_)) => None,
        }
    }

    /// The elements widened to `T`, in row-major order on the host (a device downloads
    /// 16-bit elements).
    pub(crate) fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        each_format!(self, packed => Ok(packed
            .to_host()?
            .into_iter()
            .map(|h| T::from_f64(f64::from(h.widen())))
            .collect()))
    }

    pub(crate) fn to_device(&self, op: &'static str, device: Device) -> Result<Self> {
        Ok(match self {
            Half::Bf16(packed) => Half::Bf16(packed.to_device(op, device)?),
            Half::F16(packed) => Half::F16(packed.to_device(op, device)?),
        })
    }

    pub(crate) fn lend<R>(&self, read: impl FnOnce(ferrotron_comm_core::BufRef<'_>) -> R) -> R {
        each_format!(self, packed => packed.lend(read))
    }

    /// A private copy that `write` changes through a writable view of its memory.
    pub(crate) fn updated_by<E: From<Error>>(
        &self,
        op: &'static str,
        write: impl FnOnce(ferrotron_comm_core::BufMut<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<Half, E> {
        // SAFETY: `duplicate` makes memory no other array shares.
        Ok(match self {
            Half::Bf16(packed) => Half::Bf16(unsafe { packed.duplicate(op)?.write(write)? }),
            Half::F16(packed) => Half::F16(unsafe { packed.duplicate(op)?.write(write)? }),
        })
    }
}

/// Elements `offset..offset + Π shape` of a row-major CPU array as an array of `shape`
/// sharing its memory (arrays are copied on write, so sharing is safe); `None` for an
/// array in another memory order. The caller checks the range.
pub(crate) fn memory_range<E: Clone>(
    array: &ArcArray<E, IxDyn>,
    offset: usize,
    shape: &[usize],
) -> Option<ArcArray<E, IxDyn>> {
    if !array.is_standard_layout() {
        return None;
    }
    let mut flat = array
        .clone()
        .into_shape_with_order(IxDyn(&[array.len()]))
        .ok()?;
    let len = shape.iter().product::<usize>();
    flat.slice_axis_inplace(ndarray::Axis(0), ndarray::Slice::from(offset..offset + len));
    flat.into_shape_with_order(IxDyn(shape)).ok()
}

/// A new device tensor of `shape` stored as `dtype`, computed in `T` by `kernel`, which
/// rounds once as it writes a 16-bit format (no f32 result to narrow).
pub(crate) fn written<T: Element>(
    op: &'static str,
    device: Device,
    shape: &[usize],
    dtype: DType,
    kernel: &impl PointwiseWrite,
) -> Result<Tensor<T>> {
    fn fresh<T: Element, H: HalfFloat>(
        op: &'static str,
        device: Device,
        shape: &[usize],
        kernel: &impl PointwiseWrite,
    ) -> Result<Tensor<T>> {
        let out = GpuArray::<H>::uninit(op, device, shape)?;
        kernel.write::<T, H>(&out)?;
        Ok(Tensor::from_half(H::into_half(Packed::Gpu(out))))
    }
    Ok(match dtype {
        DType::BF16 => fresh::<T, bf16>(op, device, shape, kernel)?,
        DType::F16 => fresh::<T, f16>(op, device, shape, kernel)?,
        _ => {
            let out = GpuArray::<T>::uninit(op, device, shape)?;
            kernel.write::<T, T>(&out)?;
            Tensor::from_gpu(out)
        }
    })
}

/// Whether tensors of element type `T` can be stored as `dtype`.
pub(crate) fn check_dtype<T: Element>(op: &'static str, dtype: DType) -> Result<()> {
    if dtype == T::DTYPE || matches!(dtype, DType::BF16 | DType::F16) {
        Ok(())
    } else {
        Err(Error::invalid(
            op,
            format!(
                "a tensor of {} can be stored as {}, bf16 or f16, not {dtype}",
                T::DTYPE,
                T::DTYPE
            ),
        ))
    }
}

/// The format an op's result is stored in: the one format all its inputs share, where
/// 0-d inputs (scalars) count only if every input is one, as PyTorch promotes; mixed
/// formats compute and stay in `T`.
pub(crate) fn promoted<T: Element>(inputs: &[&Tensor<T>]) -> DType {
    let shaped = inputs.iter().any(|t| t.ndim() > 0);
    let mut formats = inputs
        .iter()
        .filter(|t| !shaped || t.ndim() > 0)
        .map(|t| t.dtype());
    match formats.next() {
        Some(first) if formats.all(|d| d == first) => first,
        _ => T::DTYPE,
    }
}

fn not_16_bit(op: &'static str, dtype: DType) -> Error {
    Error::invalid(op, format!("16-bit storage is bf16 or f16, not {dtype}"))
}

/// What a backward that reads an op's output but must not read it rounded (tanh's
/// `1 − y²`) keeps: the output itself (for an input stored in its element type, the
/// output tensor's own storage), or for a 16-bit input that input, half the bytes, from
/// which backward recomputes the same output.
pub(crate) enum Kept<T: Element, A> {
    Output(A),
    Input(Tensor<T>),
}

impl<T: Element, A> Kept<T, A> {
    pub(crate) fn new(input: &Tensor<T>, output: A) -> Self {
        match input.half() {
            Some(_) => Kept::Input(input.detach()),
            None => Kept::Output(output),
        }
    }
}
