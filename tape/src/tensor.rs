//! The [`Tensor`] type: an immutable, cheaply cloned n-d array on a [`Device`], optionally
//! linked to a node of a [`Tape`](crate::Tape) so that operations on it are recorded.

use std::fmt;

use ndarray::{ArcArray, ArrayD, IxDyn};

use crate::gpu::ops::{BinaryKernel, BinaryKind};
use crate::gpu::GpuArray;
use crate::precision::{self, Half};
use crate::random::Generator;
use crate::tape::GradLink;
use crate::{DType, Device, Element, Error, Result};

/// Where the elements live. Crate-private: ops dispatch on it, users see only [`Device`]
/// and [`DType`].
#[derive(Clone)]
pub(crate) enum Storage<T> {
    Cpu(ArcArray<T, IxDyn>),
    Gpu(GpuArray<T>),
    /// bf16 or f16 (see `crate::precision`).
    Half(Half),
}

/// An n-dimensional, row-major tensor of `T` (`f32` by default, `f64` for grad checks).
///
/// Cloning is cheap (the storage is shared behind an `Arc`); tensors are immutable, so
/// every operation returns a new tensor. A tensor obtained from
/// [`Tape::watch`](crate::Tape::watch), or computed from one while the tape records, carries
/// a link to its tape node and [`requires_grad`](Tensor::requires_grad).
#[derive(Clone)]
pub struct Tensor<T: Element = f32> {
    pub(crate) storage: Storage<T>,
    pub(crate) link: Option<GradLink<T>>,
}

impl<T: Element> Tensor<T> {
    /// Wraps an ndarray array (any layout) as a CPU tensor that does not require grad.
    pub fn from_array(array: ArrayD<T>) -> Self {
        Self::from_shared(array.into_shared())
    }

    pub(crate) fn from_shared(array: ArcArray<T, IxDyn>) -> Self {
        Tensor {
            storage: Storage::Cpu(array),
            link: None,
        }
    }

    /// A CPU tensor from row-major `data`; fails if `data.len()` is not the product of `shape`.
    pub fn from_vec(data: Vec<T>, shape: &[usize]) -> Result<Self> {
        let expected: usize = shape.iter().product();
        if data.len() != expected {
            return Err(Error::shape(
                "from_vec",
                &[&[data.len()], shape],
                format!("{} elements cannot fill shape {shape:?}", data.len()),
            ));
        }
        ArrayD::from_shape_vec(IxDyn(shape), data)
            .map(Self::from_array)
            .map_err(|e| Error::shape("from_vec", &[shape], e.to_string()))
    }

    /// A 0-dimensional tensor holding `value`.
    pub fn scalar(value: T) -> Self {
        Self::from_array(ArrayD::from_elem(IxDyn(&[]), value))
    }

    /// A tensor of `shape` filled with `value`.
    pub fn full(shape: &[usize], value: T) -> Self {
        Self::from_array(ArrayD::from_elem(IxDyn(shape), value))
    }

    /// A tensor of `shape` filled with `value`, made on `device` (no host copy).
    pub fn full_on(shape: &[usize], value: T, device: Device) -> Result<Self> {
        match device {
            Device::Cpu => Ok(Self::full(shape, value)),
            _ => Ok(Self::from_gpu(GpuArray::full(
                "full_on", device, shape, value,
            )?)),
        }
    }

    /// A tensor of `shape` filled with `value` rounded to `dtype` (`T`'s own, bf16 or
    /// f16) as [`to_dtype`](Self::to_dtype) rounds, made in that format on `device`: no
    /// tensor in `T` first.
    ///
    /// ```
    /// use ferrotron_tape::{DType, Device, Tensor};
    ///
    /// let x = Tensor::<f32>::full_as(&[2, 3], 0.1, DType::BF16, Device::Cpu)?;
    /// assert_eq!((x.dtype(), x.nbytes()), (DType::BF16, 12));
    /// assert_eq!(x.to_vec()?[0], half::bf16::from_f32(0.1).to_f32());
    /// # Ok::<(), ferrotron_tape::Error>(())
    /// ```
    pub fn full_as(shape: &[usize], value: T, dtype: DType, device: Device) -> Result<Self> {
        const OP: &str = "full_as";
        precision::check_dtype::<T>(OP, dtype)?;
        if dtype == T::DTYPE {
            return Self::full_on(shape, value, device);
        }
        let half = Half::full(OP, dtype, shape, value.into_f64(), device)?;
        Ok(Self::from_half(half))
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Self::full(shape, T::zero())
    }

    /// A tensor of ones.
    pub fn ones(shape: &[usize]) -> Self {
        Self::full(shape, T::one())
    }

    /// Normal samples with mean 0 and standard deviation `std`.
    pub fn randn(shape: &[usize], std: f64, generator: &mut Generator) -> Self {
        Self::from_array(ArrayD::from_shape_simple_fn(IxDyn(shape), || {
            T::from_f64(generator.normal() * std)
        }))
    }

    /// Uniform samples in `[low, high)`.
    pub fn uniform(shape: &[usize], low: f64, high: f64, generator: &mut Generator) -> Self {
        Self::from_array(ArrayD::from_shape_simple_fn(IxDyn(shape), || {
            T::from_f64(low + (high - low) * generator.uniform())
        }))
    }

    /// The CPU array behind this tensor (shared, or widened from 16 bits); an op without
    /// a device implementation gets a typed error for a device tensor.
    pub(crate) fn cpu(&self, op: &'static str) -> Result<ArcArray<T, IxDyn>> {
        match &self.storage {
            Storage::Cpu(array) => Ok(array.clone()),
            Storage::Half(half) => half.widen_cpu(op),
            Storage::Gpu(array) => Err(Error::UnsupportedDevice {
                op,
                device: array.device(),
            }),
        }
    }

    /// Mutable CPU array; copies the elements first if another tensor shares them.
    pub(crate) fn cpu_mut(&mut self, op: &'static str) -> Result<&mut ArcArray<T, IxDyn>> {
        match &mut self.storage {
            Storage::Cpu(array) => Ok(array),
            Storage::Gpu(array) => Err(Error::UnsupportedDevice {
                op,
                device: array.device(),
            }),
            Storage::Half(half) => Err(not_in_place(op, half.dtype())),
        }
    }

    /// The CPU array by value (no copy when this tensor is its only user).
    pub(crate) fn into_cpu_array(self, op: &'static str) -> Result<ArrayD<T>> {
        match self.storage {
            Storage::Cpu(array) => Ok(array.into_owned()),
            Storage::Half(half) => Ok(half.widen_cpu(op)?.into_owned()),
            Storage::Gpu(array) => Err(Error::UnsupportedDevice {
                op,
                device: array.device(),
            }),
        }
    }

    /// The same values stored in `T` (the tensor itself when they are).
    fn widened(&self, op: &'static str) -> Result<Tensor<T>> {
        let Storage::Half(half) = &self.storage else {
            return Ok(self.clone());
        };
        let storage = match half.widen_gpu(op)? {
            Some(array) => Storage::Gpu(array),
            None => Storage::Cpu(half.widen_cpu(op)?),
        };
        Ok(Tensor {
            storage,
            link: self.link.clone(),
        })
    }

    /// A tensor (not requiring grad) around 16-bit storage.
    pub(crate) fn from_half(half: Half) -> Self {
        Tensor {
            storage: Storage::Half(half),
            link: None,
        }
    }

    /// The 16-bit storage, if the elements are stored so.
    pub(crate) fn half(&self) -> Option<&Half> {
        match &self.storage {
            Storage::Half(half) => Some(half),
            Storage::Cpu(_) | Storage::Gpu(_) => None,
        }
    }

    /// The storage format of the elements: `T`'s own (`F32`, `F64`), or `BF16` / `F16`
    /// after [`to_dtype`](Self::to_dtype).
    pub fn dtype(&self) -> DType {
        match &self.storage {
            Storage::Half(half) => half.dtype(),
            Storage::Cpu(_) | Storage::Gpu(_) => T::DTYPE,
        }
    }

    /// Bytes the elements occupy in their storage format.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype().size_in_bytes()
    }

    /// The same values stored as `dtype` (`T`'s own, bf16 or f16), rounded to nearest
    /// even. Recorded on the tape: the gradient passes through unchanged. Later ops on
    /// the result compute in `T` and round their results to `dtype` again.
    ///
    /// ```
    /// use ferrotron_tape::{DType, Tensor};
    ///
    /// let x = Tensor::from_vec(vec![1.0f32, 1.0 + 1.0 / 256.0, 3.0e5], &[3])?;
    /// let y = x.to_dtype(DType::BF16)?;
    /// assert_eq!((y.dtype(), y.nbytes()), (DType::BF16, 6));
    /// // bf16 keeps 8 significant bits: 1 + 2^-8 rounds to even, 3e5 to 299008.
    /// assert_eq!(y.to_vec()?, [1.0, 1.0, 299_008.0]);
    /// // Ops compute in f32 and round their result to the inputs' format once.
    /// let z = y.add(&y)?;
    /// assert_eq!((z.dtype(), z.to_vec()?), (DType::BF16, vec![2.0, 2.0, 598_016.0]));
    /// # Ok::<(), ferrotron_tape::Error>(())
    /// ```
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor<T>> {
        const OP: &str = "to_dtype";
        precision::check_dtype::<T>(OP, dtype)?;
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let output = self.detach().stored_as(OP, dtype)?;
        crate::tape::record_as(crate::tape::Recorded::Cast, OP, &[self], output, || {
            Box::new(|grad: Tensor<T>, _: &[bool]| Ok(vec![Some(grad)]))
        })
    }

    /// The same values stored as `dtype` (checked by the caller), not recorded.
    pub(crate) fn stored_as(&self, op: &'static str, dtype: DType) -> Result<Tensor<T>> {
        let full = self.widened(op)?;
        if dtype == T::DTYPE {
            return Ok(full);
        }
        let half = match &full.storage {
            Storage::Cpu(array) => Half::narrow_cpu(op, dtype, array)?,
            Storage::Gpu(array) => Half::narrow_gpu(op, dtype, array)?,
            Storage::Half(_) => unreachable!("widened above"),
        };
        Ok(Tensor {
            storage: Storage::Half(half),
            link: full.link,
        })
    }

    /// Adds `other` (same shape and device) into this untracked tensor, the sum stored
    /// as `format` (`T`'s own or 16-bit, rounded once): in place on the CPU
    /// (copy-on-write), a new array on a device, where 16-bit operands are read as
    /// stored.
    pub(crate) fn accumulate_as(
        &mut self,
        op: &'static str,
        other: &Tensor<T>,
        format: DType,
    ) -> Result<()> {
        if self.device() != other.device() {
            return Err(Error::DeviceMismatch {
                op,
                first: self.device(),
                second: other.device(),
            });
        }
        if let (Some(a), Some(b)) = (self.pointwise_input(), other.pointwise_input()) {
            let sum = BinaryKernel {
                op,
                kind: BinaryKind::Add,
                a,
                b,
            };
            let shape = self.shape().to_vec();
            *self = crate::precision::written(op, self.device(), &shape, format, &sum)?;
            return Ok(());
        }
        if self.half().is_some() {
            *self = self.widened(op)?;
        }
        let theirs = other.cpu(op)?;
        *self.cpu_mut(op)? += &theirs;
        if format != T::DTYPE {
            *self = self.stored_as(op, format)?;
        }
        Ok(())
    }

    /// The device array, made private to this tensor first (copy-on-write) so that an
    /// optimizer may update it in place without changing tensors handed out earlier.
    pub(crate) fn gpu_unique(&mut self, op: &'static str) -> Result<&GpuArray<T>> {
        match &mut self.storage {
            Storage::Gpu(array) => {
                if array.is_shared() {
                    *array = array.duplicate(op)?;
                }
                Ok(array)
            }
            Storage::Cpu(_) => Err(Error::UnsupportedDevice {
                op,
                device: Device::Cpu,
            }),
            Storage::Half(half) => Err(not_in_place(op, half.dtype())),
        }
    }

    /// The device array behind this tensor (shared, or widened from 16 bits), if it
    /// lives on a device.
    pub(crate) fn gpu(&self, op: &'static str) -> Result<Option<GpuArray<T>>> {
        match &self.storage {
            Storage::Gpu(array) => Ok(Some(array.clone())),
            Storage::Half(half) => half.widen_gpu(op),
            Storage::Cpu(_) => Ok(None),
        }
    }

    /// Elements `offset..offset + Π shape` of a device tensor in row-major order, as an
    /// array of `shape`: a window of its memory (no copy), or for 16-bit storage that
    /// range alone widened; `None` for a CPU tensor. The caller checks the range.
    pub(crate) fn gpu_range(
        &self,
        op: &'static str,
        offset: usize,
        shape: &[usize],
    ) -> Result<Option<GpuArray<T>>> {
        match &self.storage {
            Storage::Gpu(array) => Ok(Some(array.window(offset, shape))),
            Storage::Half(half) => match half.range(offset, shape) {
                Some(range) => range.widen_gpu(op),
                None => Ok(None),
            },
            Storage::Cpu(_) => Ok(None),
        }
    }

    /// The device memory a pointwise kernel reads this tensor from, 16-bit storage as
    /// stored; `None` on the CPU.
    pub(crate) fn pointwise_input(&self) -> Option<crate::gpu::ops::PointwiseInput<'_>> {
        match &self.storage {
            Storage::Cpu(_) => None,
            Storage::Gpu(array) => Some(array.into()),
            Storage::Half(half) => half.pointwise_input(),
        }
    }

    /// Elements `offset..offset + Π shape` in row-major order as a tensor of `shape`
    /// (not recorded) sharing this tensor's memory, in its storage format: no copy, no
    /// widening. `None` for a CPU array in another memory order. The caller checks the
    /// range.
    pub(crate) fn memory_range(&self, offset: usize, shape: &[usize]) -> Option<Tensor<T>> {
        let storage = match &self.storage {
            Storage::Cpu(array) => {
                Storage::Cpu(crate::precision::memory_range(array, offset, shape)?)
            }
            Storage::Gpu(array) => Storage::Gpu(array.window(offset, shape)),
            Storage::Half(half) => Storage::Half(half.range(offset, shape)?),
        };
        Some(Tensor {
            storage,
            link: None,
        })
    }

    /// A tensor (not requiring grad) around a device array.
    pub(crate) fn from_gpu(array: GpuArray<T>) -> Self {
        Tensor {
            storage: Storage::Gpu(array),
            link: None,
        }
    }

    /// The tensor's dimensions.
    pub fn shape(&self) -> &[usize] {
        match &self.storage {
            Storage::Cpu(array) => array.shape(),
            Storage::Gpu(array) => array.shape(),
            Storage::Half(half) => half.shape(),
        }
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape().len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape().iter().product()
    }

    /// The device holding the elements.
    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Gpu(array) => array.device(),
            Storage::Half(half) => half.device(),
        }
    }

    /// The same values on `device` (the tensor itself when already there). The copy is
    /// not recorded on the tape: move inputs and parameters before the forward pass.
    pub fn to_device(&self, device: Device) -> Result<Self> {
        const OP: &str = "to_device";
        if device == self.device() {
            return Ok(self.clone());
        }
        if let Storage::Half(half) = &self.storage {
            return Ok(Tensor {
                storage: Storage::Half(half.to_device(OP, device)?),
                link: None,
            });
        }
        let host = self.to_vec()?;
        Ok(match device {
            Device::Cpu => Self::from_vec(host, self.shape())?,
            _ => Self::from_gpu(GpuArray::from_host(OP, device, &host, self.shape())?),
        })
    }

    /// Whether operations on this tensor are recorded for backward.
    pub fn requires_grad(&self) -> bool {
        self.link.is_some()
    }

    /// The format backward keeps this tensor's gradient in: the tensor's own 16-bit
    /// format for an activation stored so (PyTorch's and Megatron's bf16 gradients, half
    /// the bytes of f32), `T`'s for parameters (whose gradients feed f32 main gradients)
    /// and for everything else. Each contribution is rounded to it, and contributions
    /// are added two at a time in the order backward produces them, each sum rounded
    /// to it again (as PyTorch's autograd adds a bf16 gradient in bf16), on every
    /// device alike.
    pub fn grad_format(&self) -> DType {
        self.link.as_ref().map_or(T::DTYPE, |link| link.grad_format)
    }

    /// The same data, cut off from the tape: operations on the result are not recorded.
    pub fn detach(&self) -> Self {
        Tensor {
            storage: self.storage.clone(),
            link: None,
        }
    }

    /// The elements in row-major order.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        match &self.storage {
            Storage::Gpu(array) => return array.to_host(),
            Storage::Half(half) => return half.to_vec(),
            Storage::Cpu(_) => {}
        }
        let array = self.cpu("to_vec")?;
        // Element-wise iteration over a dynamic-rank array costs index arithmetic per
        // element; contiguous data (the common case) is one memcpy.
        Ok(match array.as_slice() {
            Some(contiguous) => contiguous.to_vec(),
            None => array.iter().copied().collect(),
        })
    }

    /// An owned ndarray copy of the elements.
    pub fn to_array(&self) -> Result<ArrayD<T>> {
        if self.device() != Device::Cpu {
            return ArrayD::from_shape_vec(IxDyn(self.shape()), self.to_vec()?)
                .map_err(|e| Error::shape("to_array", &[self.shape()], e.to_string()));
        }
        Ok(self.cpu("to_array")?.to_owned())
    }

    /// The single element of a one-element tensor.
    pub fn item(&self) -> Result<T> {
        let host = self.to_device(Device::Cpu)?;
        let array = host.cpu("item")?;
        match array.iter().next() {
            Some(&value) if array.len() == 1 => Ok(value),
            _ => Err(Error::shape(
                "item",
                &[self.shape()],
                "item() needs exactly one element",
            )),
        }
    }

    /// The elements converted to another element type (not recorded on the tape).
    pub fn cast<U: Element>(&self) -> Result<Tensor<U>> {
        let device = self.device();
        let values = self
            .to_vec()?
            .into_iter()
            .map(|v| U::from_f64(v.into_f64()));
        Tensor::from_vec(values.collect(), self.shape())?.to_device(device)
    }
}

impl<T: Element> fmt::Debug for Tensor<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = f.debug_struct("Tensor");
        out.field("shape", &self.shape())
            .field("device", &self.device())
            .field("requires_grad", &self.requires_grad());
        match &self.storage {
            Storage::Cpu(array) if array.len() <= 16 => {
                out.field("data", &array.iter().collect::<Vec<_>>())
            }
            Storage::Cpu(_) | Storage::Gpu(_) | Storage::Half(_) => out.field("data", &"…"),
        };
        if let Storage::Half(half) = &self.storage {
            out.field("dtype", &half.dtype());
        }
        out.finish()
    }
}

/// The error for an in-place update of 16-bit storage.
fn not_in_place(op: &'static str, dtype: DType) -> Error {
    Error::invalid(
        op,
        format!(
            "the tensor is stored in {dtype}, which is not updated in place; keep an f32 \
             master copy (tape::MixedPrecision) and write the parameter from it"
        ),
    )
}
