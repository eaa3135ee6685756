//! The [`Tensor`] type: an immutable, cheaply cloned n-d array on a [`Device`], optionally
//! linked to a node of a [`Tape`](crate::Tape) so that operations on it are recorded.

use std::fmt;

use ndarray::{ArcArray, ArrayD, IxDyn};

use crate::gpu::GpuArray;
use crate::random::Generator;
use crate::tape::GradLink;
use crate::{Device, Element, Error, Result};

/// Where the elements live. Private: ops dispatch on it, users see only [`Device`].
#[derive(Clone)]
enum Storage<T> {
    Cpu(ArcArray<T, IxDyn>),
    Gpu(GpuArray<T>),
}

/// An n-dimensional, row-major tensor of `T` (`f32` by default, `f64` for grad checks).
///
/// Cloning is cheap (the storage is shared behind an `Arc`); tensors are immutable, so
/// every operation returns a new tensor. A tensor obtained from
/// [`Tape::watch`](crate::Tape::watch), or computed from one while the tape records, carries
/// a link to its tape node and [`requires_grad`](Tensor::requires_grad).
#[derive(Clone)]
pub struct Tensor<T: Element = f32> {
    storage: Storage<T>,
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

    /// The CPU array behind this tensor; an op without a device implementation gets a
    /// typed error for a device tensor.
    pub(crate) fn cpu(&self, op: &'static str) -> Result<&ArcArray<T, IxDyn>> {
        match &self.storage {
            Storage::Cpu(array) => Ok(array),
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
        }
    }

    /// The CPU array by value (no copy when this tensor is its only user).
    pub(crate) fn into_cpu_array(self, op: &'static str) -> Result<ArrayD<T>> {
        match self.storage {
            Storage::Cpu(array) => Ok(array.into_owned()),
            Storage::Gpu(array) => Err(Error::UnsupportedDevice {
                op,
                device: array.device(),
            }),
        }
    }

    /// Adds `other` (same shape and device) into this untracked tensor: in place on the
    /// CPU (copy-on-write), a new array on a device.
    pub(crate) fn accumulate(&mut self, op: &'static str, other: &Tensor<T>) -> Result<()> {
        if self.device() != other.device() {
            return Err(Error::DeviceMismatch {
                op,
                first: self.device(),
                second: other.device(),
            });
        }
        match (&mut self.storage, &other.storage) {
            (Storage::Cpu(mine), Storage::Cpu(theirs)) => *mine += theirs,
            (Storage::Gpu(mine), Storage::Gpu(theirs)) => {
                let shape = mine.shape().to_vec();
                *mine = crate::gpu::ops::binary(
                    op,
                    crate::gpu::ops::BinaryKind::Add,
                    mine,
                    theirs,
                    &shape,
                )?;
            }
            _ => unreachable!("devices compared equal above"),
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
        }
    }

    /// The device array behind this tensor, if it lives on a device.
    pub(crate) fn gpu(&self) -> Option<&GpuArray<T>> {
        match &self.storage {
            Storage::Gpu(array) => Some(array),
            Storage::Cpu(_) => None,
        }
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
        }
    }

    /// The same values on `device` (the tensor itself when already there). The copy is
    /// not recorded on the tape: move inputs and parameters before the forward pass.
    pub fn to_device(&self, device: Device) -> Result<Self> {
        const OP: &str = "to_device";
        if device == self.device() {
            return Ok(self.clone());
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

    /// The same data, cut off from the tape: operations on the result are not recorded.
    pub fn detach(&self) -> Self {
        Tensor {
            storage: self.storage.clone(),
            link: None,
        }
    }

    /// The elements in row-major order.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        if let Some(array) = self.gpu() {
            return array.to_host();
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
        if self.gpu().is_some() {
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
        let host = self.to_device(Device::Cpu)?;
        let array = host.cpu("cast")?;
        Tensor::from_array(array.mapv(|v| U::from_f64(v.into_f64()))).to_device(device)
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
            Storage::Cpu(_) | Storage::Gpu(_) => out.field("data", &"…"),
        };
        out.finish()
    }
}
