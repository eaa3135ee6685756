//! Tensors lend their memory to communicators: a read-only view of an existing tensor,
//! or a writable view of a new tensor's memory that a collective fills. CPU tensors lend
//! host memory and emulated ones their device memory ([`MemoryKind::Emulated`]), so
//! neither goes through a host copy. CUDA tensors still lend a host copy: comm-core and
//! tape do not share a CUDA stream yet.
//!
//! [`MemoryKind::Emulated`]: comm_core::MemoryKind::Emulated

use comm_core::{BufMut, BufRef};
use ndarray::{ArrayD, IxDyn};

use crate::gpu::GpuArray;
use crate::{Device, Element, Error, Result, Tensor};

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
        if let Some(array) = self.gpu() {
            if array.device() == Device::Emulated {
                // SAFETY: emulated allocations are host memory of `len` elements of `T`,
                // aligned for it; arrays are never written once made, and the view lives
                // only during `read`, which borrows `self` (so the memory stays alive).
                let view = unsafe {
                    BufRef::emulated(
                        array.ptr() as usize as *const u8,
                        array.len(),
                        <T as comm_core::Element>::DTYPE,
                    )
                };
                return Ok(read(view));
            }
            return Ok(read(BufRef::from(&array.to_host()?)));
        }
        let array = self.cpu("lend")?;
        Ok(match array.as_slice() {
            Some(slice) => read(BufRef::from(slice)),
            None => read(BufRef::from(&array.iter().copied().collect::<Vec<T>>())),
        })
    }

    /// A new tensor of `shape` on `device` whose elements `fill` writes through a view of
    /// its memory (zeros before `fill` runs), e.g. the output of a gather. `fill`'s error
    /// is returned instead of a tensor.
    pub fn filled_by<E: From<Error>>(
        device: Device,
        shape: &[usize],
        fill: impl FnOnce(BufMut<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<Tensor<T>, E> {
        let fresh = match device {
            Device::Cpu => Fresh::Host(ArrayD::zeros(IxDyn(shape))),
            Device::Emulated => {
                Fresh::Emulated(GpuArray::full("filled_by", device, shape, T::zero())?)
            }
            Device::Cuda(_) => Fresh::Staged(device, ArrayD::zeros(IxDyn(shape))),
        };
        fresh.write(fill)
    }

    /// A copy of this tensor on its device that `update` changes in place through a view
    /// of the copy's memory, e.g. an all-reduce. `update`'s error is returned instead.
    pub fn updated_by<E: From<Error>>(
        &self,
        update: impl FnOnce(BufMut<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<Tensor<T>, E> {
        let fresh = match (self.device(), self.gpu()) {
            (Device::Emulated, Some(array)) => Fresh::Emulated(array.duplicate("updated_by")?),
            (Device::Cpu, _) => {
                Fresh::Host(self.cpu("updated_by")?.as_standard_layout().into_owned())
            }
            (device, _) => Fresh::Staged(device, self.to_array()?),
        };
        fresh.write(update)
    }
}

/// Memory only the tensor under construction refers to, so lending it writable is sound.
enum Fresh<T: Element> {
    Host(ArrayD<T>),
    Emulated(GpuArray<T>),
    /// Host memory uploaded to `Device` once written.
    Staged(Device, ArrayD<T>),
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
            Fresh::Emulated(array) => {
                // SAFETY: a fresh emulated allocation (host memory of `len` elements of
                // `T`) that no other array shares, alive until after `write` returns.
                let view = unsafe {
                    BufMut::emulated(
                        array.ptr() as usize as *mut u8,
                        array.len(),
                        <T as comm_core::Element>::DTYPE,
                    )
                };
                write(view)?;
                Ok(Tensor::from_gpu(array))
            }
            Fresh::Staged(device, mut array) => {
                write(BufMut::from(row_major(&mut array)?))?;
                Ok(Tensor::from_array(array).to_device(device)?)
            }
        }
    }
}
