//! Tensors lend their memory to communicators: a read-only view of an existing tensor,
//! or a writable view of a new tensor's memory that a collective fills. CPU tensors lend
//! host memory, emulated ones their device memory ([`Device::Emulated`]) and CUDA
//! ones their device memory ordered on the device's tape stream, so none goes through a
//! host copy: a collective runs after the kernels that made its input, and the kernels
//! that use its output run after it.
//!
//! [`Device::Emulated`]: comm_core::Device::Emulated

use comm_core::{BufMut, BufRef};
use ndarray::{ArrayD, IxDyn};

use crate::gpu::GpuArray;
use crate::{DType, Device, Element, Error, Result, Tensor};

const OP: &str = "lend";

impl<T: Element + comm_core::Element> Tensor<T> {
    /// Runs `read` on a view of the elements in row-major order, for a communicator to
    /// read (a send, the input of a gather): the tensor's own memory, or for a CPU tensor
    /// that is not row-major (a transposed view), a row-major host copy.
    ///
    /// ```
    /// use comm_core::{run_local, Communicator, ReduceOp};
    /// use tape::Tensor;
    ///
    /// let sums = run_local(2, |comm| -> Result<Vec<f32>, tape::Error> {
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

impl<T: Element + comm_core::Element> Fresh<T> {
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
