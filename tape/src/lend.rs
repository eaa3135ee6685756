//! Tensors lend their memory to communicators: a read-only view of an existing tensor,
//! or a writable view of a new tensor's memory that a collective fills. CPU tensors lend
//! host memory, emulated ones their device memory ([`Device::Emulated`]) and CUDA
//! ones their device memory ordered on the device's tape stream, so none goes through a
//! host copy: a collective runs after the kernels that made its input, and the kernels
//! that use its output run after it.
//!
//! A tensor also becomes an owned [`Buffer`] ([`Tensor::into_buffer`]) for a
//! non-blocking collective to run on in place, and the buffer a tensor again once the
//! operation hands it back ([`Tensor::from_buffer`]).
//!
//! [`Device::Emulated`]: ferrotron_comm_core::Device::Emulated

use ferrotron_comm_core::{BufMut, BufRef, Buffer};
use half::{bf16, f16};
use ndarray::{ArcArray, ArrayD, IxDyn};

use crate::gpu::GpuArray;
use crate::precision::{Half, Packed};
use crate::tensor::Storage;
use crate::{DType, Device, Element, Error, Result, Tensor};

const OP: &str = "lend";

impl<T: Element + ferrotron_comm_core::Element> Tensor<T> {
    /// Runs `read` on a view of the elements in row-major order, for a communicator to
    /// read (a send, the input of a gather): the tensor's own memory, or for a CPU tensor
    /// that is not row-major (a transposed view), a row-major host copy.
    ///
    /// ```
    /// use ferrotron_comm_core::{run_local, Communicator, ReduceOp};
    /// use ferrotron_tape::Tensor;
    ///
    /// let sums = run_local(2, |comm| -> Result<Vec<f32>, ferrotron_tape::Error> {
    ///     let x = Tensor::from_vec(vec![1.0, comm.rank() as f32], &[2])?;
    ///     let mut total = vec![0f32; 4];
    ///     x.lend(|view| comm.all_gather(view, (&mut total).into()))?
    ///         .expect("the gather");
    ///     Ok(total)
    /// })
    /// .unwrap();
    /// assert_eq!(sums[1], [1.0, 0.0, 1.0, 1.0]);
    /// ```
    pub fn lend<R>(&self, read: impl FnOnce(BufRef<'_>) -> R) -> Result<R> {
        if let Some(half) = self.half() {
            return Ok(half.lend(read));
        }
        if let Some(array) = self.gpu(OP)? {
            return Ok(read(array.lend()));
        }
        let array = self.cpu(OP)?;
        Ok(match array.as_slice() {
            Some(slice) => read(BufRef::from(slice)),
            None => read(BufRef::from(&array.iter().copied().collect::<Vec<T>>())),
        })
    }

    /// A new tensor of `shape`, stored as `dtype` (`T`'s own, bf16 or f16) on `device`,
    /// whose elements `fill` writes through a view of its memory (zeros before `fill`
    /// runs), e.g. the output of a gather. `fill`'s error is returned instead of a tensor.
    pub fn filled_by<E: From<Error>>(
        device: Device,
        dtype: DType,
        shape: &[usize],
        fill: impl FnOnce(BufMut<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<Tensor<T>, E> {
        crate::precision::check_dtype::<T>("filled_by", dtype)?;
        if dtype != <T as Element>::DTYPE {
            let zeros = Tensor::<T>::full_on(shape, T::zero(), device)?;
            return zeros.stored_as("filled_by", dtype)?.updated_by(fill);
        }
        let fresh = match device {
            Device::Cpu => Fresh::Host(ArrayD::zeros(IxDyn(shape))),
            _ => Fresh::Device(GpuArray::full("filled_by", device, shape, T::zero())?),
        };
        fresh.write(fill)
    }

    /// A copy of this tensor on its device that `update` changes in place through a view
    /// of the copy's memory, e.g. an all-reduce. `update`'s error is returned instead.
    pub fn updated_by<E: From<Error>>(
        &self,
        update: impl FnOnce(BufMut<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<Tensor<T>, E> {
        if let Some(half) = self.half() {
            return Ok(Tensor::from_half(half.updated_by("updated_by", update)?));
        }
        let fresh = match self.gpu("updated_by")? {
            Some(array) => Fresh::Device(array.duplicate("updated_by")?),
            None => Fresh::Host(self.cpu("updated_by")?.as_standard_layout().into_owned()),
        };
        fresh.write(update)
    }
}

/// Memory only the tensor under construction refers to, so lending it writable is sound.
enum Fresh<T: Element> {
    Host(ArrayD<T>),
    Device(GpuArray<T>),
}

impl<T: Element + ferrotron_comm_core::Element> Fresh<T> {
    fn write<E: From<Error>>(
        self,
        write: impl FnOnce(BufMut<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<Tensor<T>, E> {
        fn row_major<T: Element>(array: &mut ArrayD<T>) -> Result<&mut [T]> {
            // Both constructors make row-major arrays; the check keeps that a typed error.
            let shape = array.shape().to_vec();
            array
                .as_slice_mut()
                .ok_or_else(|| Error::shape("lend", &[&shape], "not row-major"))
        }
        match self {
            Fresh::Host(mut array) => {
                write(BufMut::from(row_major(&mut array)?))?;
                Ok(Tensor::from_array(array))
            }
            Fresh::Device(array) => {
                // SAFETY: a fresh allocation (`full` or `duplicate`) that no other array
                // shares, alive until after `write` returns.
                write(unsafe { array.lend_mut() })?;
                Ok(Tensor::from_gpu(array))
            }
        }
    }
}

impl<T: Element + ferrotron_comm_core::Element> Tensor<T> {
    /// This tensor's elements, in their storage format and on their device, as an owned
    /// [`Buffer`] for a non-blocking collective to read and write in place: the tensor's
    /// own memory, or a private row-major copy when another tensor shares it. Once the
    /// operation hands the buffer back, [`from_buffer`](Self::from_buffer) makes it a
    /// tensor again, with no copy.
    ///
    /// ```
    /// use ferrotron_comm_core::{run_local, AsyncOp, Communicator, ReduceOp};
    /// use ferrotron_tape::{DType, Tensor};
    ///
    /// let sums = run_local(2, |comm| -> Result<Vec<f32>, Box<dyn std::error::Error + Send + Sync>> {
    ///     let x = Tensor::from_vec(vec![1.0, comm.rank() as f32], &[2])?.to_dtype(DType::BF16)?;
    ///     let work = comm.start(AsyncOp::AllReduce { buf: x.into_buffer()?, op: ReduceOp::Sum })?;
    ///     let sum = Tensor::<f32>::from_buffer(work.wait()?)?;
    ///     assert_eq!(sum.dtype(), DType::BF16);
    ///     Ok(sum.to_vec()?)
    /// })?;
    /// assert_eq!(sums[0], [2.0, 1.0]);
    /// # Ok::<(), ferrotron_comm_core::Error>(())
    /// ```
    pub fn into_buffer(self) -> Result<Buffer> {
        const OP: &str = "Tensor::into_buffer";
        let shape = self.shape().to_vec();
        Ok(match self.storage {
            Storage::Cpu(array) => LentArray::host(array, shape),
            Storage::Gpu(array) => LentArray::device(OP, array, shape)?,
            Storage::Half(Half::Bf16(packed)) => LentArray::packed(OP, packed, shape)?,
            Storage::Half(Half::F16(packed)) => LentArray::packed(OP, packed, shape)?,
        })
    }

    /// The tensor a [`Buffer`] holds: one [`into_buffer`](Self::into_buffer) made (its
    /// memory, shape, device and format, no copy), or a host vector of `T`, bf16 or f16
    /// (a one-dimensional CPU tensor stored in that format). Memory something else lent
    /// is an error: read it through its owner.
    pub fn from_buffer(buffer: Buffer) -> Result<Tensor<T>> {
        const OP: &str = "Tensor::from_buffer";
        let memory = match buffer.into_lent() {
            Ok(memory) => memory,
            Err(host) => return Self::from_host_buffer(OP, host),
        };
        let any: Box<dyn std::any::Any> = memory;
        let any = match any.downcast::<LentArray<T>>() {
            Ok(lent) => {
                let LentArray { memory, shape } = *lent;
                return match memory {
                    Owned::Host(values) => Tensor::from_vec(values, &shape),
                    Owned::Device(array) => Ok(Tensor::from_gpu(array)),
                };
            }
            Err(any) => any,
        };
        let any = match any.downcast::<LentArray<bf16>>() {
            Ok(lent) => return Ok(Tensor::from_half(Half::Bf16(lent.into_packed(OP)?))),
            Err(any) => any,
        };
        match any.downcast::<LentArray<f16>>() {
            Ok(lent) => Ok(Tensor::from_half(Half::F16(lent.into_packed(OP)?))),
            Err(_) => Err(Error::invalid(
                OP,
                "the buffer holds memory something other than a tensor lent; read it \
                 through its owner",
            )),
        }
    }

    fn from_host_buffer(op: &'static str, host: Buffer) -> Result<Tensor<T>> {
        let dtype = host.dtype();
        let len = host.len();
        let wrong = |e: ferrotron_comm_core::Error| Error::invalid(op, e.to_string());
        let packed = |half: Half| Ok(Tensor::from_half(half));
        match dtype {
            DType::BF16 => packed(Half::Bf16(Packed::Cpu(vector(
                op,
                host.into_vec::<bf16>().map_err(wrong)?,
                &[len],
            )?))),
            DType::F16 => packed(Half::F16(Packed::Cpu(vector(
                op,
                host.into_vec::<f16>().map_err(wrong)?,
                &[len],
            )?))),
            _ => Tensor::from_vec(host.into_vec::<T>().map_err(wrong)?, &[len]),
        }
    }
}

/// `values` as a shared array of `shape`.
fn vector<E>(op: &'static str, values: Vec<E>, shape: &[usize]) -> Result<ArcArray<E, IxDyn>> {
    ArcArray::from_shape_vec(IxDyn(shape), values)
        .map_err(|e| Error::shape(op, &[shape], e.to_string()))
}

/// A tensor's elements lent to a collective: memory nothing else refers to.
#[derive(Debug)]
struct LentArray<E> {
    memory: Owned<E>,
    shape: Vec<usize>,
}

#[derive(Debug)]
enum Owned<E> {
    Host(Vec<E>),
    /// Never cloned while lent, so the collective's view is its only access.
    Device(GpuArray<E>),
}

impl<E: ferrotron_comm_core::Element + Copy + Default> LentArray<E> {
    fn host(array: ArcArray<E, IxDyn>, shape: Vec<usize>) -> Buffer {
        Buffer::lent(Box::new(LentArray {
            memory: Owned::Host(row_major_vec(array)),
            shape,
        }))
    }

    fn device(op: &'static str, array: GpuArray<E>, shape: Vec<usize>) -> Result<Buffer> {
        let array = if array.is_shared() {
            array.duplicate(op)?
        } else {
            array
        };
        Ok(Buffer::lent(Box::new(LentArray {
            memory: Owned::Device(array),
            shape,
        })))
    }

    fn packed(op: &'static str, packed: Packed<E>, shape: Vec<usize>) -> Result<Buffer> {
        match packed {
            Packed::Cpu(array) => Ok(Self::host(array, shape)),
            Packed::Gpu(array) => Self::device(op, array, shape),
        }
    }

    fn into_packed(self, op: &'static str) -> Result<Packed<E>> {
        Ok(match self.memory {
            Owned::Host(values) => Packed::Cpu(vector(op, values, &self.shape)?),
            Owned::Device(array) => Packed::Gpu(array),
        })
    }
}

/// The elements in row-major order, without a copy when `array` is the only user of a
/// row-major allocation.
fn row_major_vec<E: Copy>(array: ArcArray<E, IxDyn>) -> Vec<E> {
    if !array.is_standard_layout() {
        return array.iter().copied().collect();
    }
    let len = array.len();
    let (mut values, offset) = array.into_owned().into_raw_vec_and_offset();
    let start = offset.unwrap_or(0);
    if start > 0 || values.len() > len {
        values.drain(..start);
        values.truncate(len);
    }
    values
}

impl<E: ferrotron_comm_core::Element + Copy + Default> ferrotron_comm_core::LentMemory
    for LentArray<E>
{
    fn view(&self) -> BufRef<'_> {
        match &self.memory {
            Owned::Host(values) => BufRef::from(values.as_slice()),
            Owned::Device(array) => array.lend(),
        }
    }

    fn view_mut(&mut self) -> BufMut<'_> {
        match &mut self.memory {
            Owned::Host(values) => BufMut::from(values.as_mut_slice()),
            // SAFETY: the array is unshared (duplicated otherwise when lent) and never
            // cloned while lent, and `&mut self` makes this view its only access.
            Owned::Device(array) => unsafe { array.lend_mut() },
        }
    }
}
