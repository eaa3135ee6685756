//! Device memory and the contiguous row-major arrays tensors keep in it.

use std::marker::PhantomData;
use std::sync::Arc;

use ferrotron_device::DeviceMemory;

use super::{backend, moves, Backend, Cost, Kernel, KernelArgs, Precision, Stored};
use crate::{Device, Element, Error, Result};

/// One device allocation and the backend that runs work on it, freed (in its stream's
/// order) when the last array using it goes.
pub(crate) struct DeviceBuffer {
    memory: DeviceMemory,
    backend: Arc<dyn Backend>,
}

/// A contiguous row-major array of `T` on a device. Cloning shares the memory; arrays
/// are never written after the op that produced them returns, so sharing is safe. The
/// exception is flat storage's array and its windows, written in place only under the
/// storage's lock or lease (`crate::flat`).
pub(crate) struct GpuArray<T> {
    buffer: Arc<DeviceBuffer>,
    /// Where the elements start in the allocation: 0 except for windows (of flat storage,
    /// and the views `reshape` and `narrow` make).
    offset_bytes: u64,
    shape: Vec<usize>,
    _element: PhantomData<T>,
}

impl<T> std::fmt::Debug for GpuArray<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuArray")
            .field("device", &self.buffer.backend.device())
            .field("shape", &self.shape)
            .finish()
    }
}

impl<T> Clone for GpuArray<T> {
    fn clone(&self) -> Self {
        GpuArray {
            buffer: self.buffer.clone(),
            offset_bytes: self.offset_bytes,
            shape: self.shape.clone(),
            _element: PhantomData,
        }
    }
}

impl<T: Copy + Default> GpuArray<T> {
    /// Uninitialised memory for `shape`; the caller's kernel writes every element.
    pub(crate) fn uninit(op: &'static str, device: Device, shape: &[usize]) -> Result<Self> {
        let backend = backend(op, device)?;
        let bytes = shape
            .iter()
            .try_fold(std::mem::size_of::<T>(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                crate::Error::shape(op, &[shape], "the tensor's size in bytes overflows usize")
            })?;
        let memory = (backend.stream().alloc(bytes)).map_err(Error::on_device(op, device))?;
        Ok(GpuArray {
            buffer: Arc::new(DeviceBuffer { memory, backend }),
            offset_bytes: 0,
            shape: shape.to_vec(),
            _element: PhantomData,
        })
    }

    /// Copies row-major host data to the device.
    pub(crate) fn from_host(
        op: &'static str,
        device: Device,
        data: &[T],
        shape: &[usize],
    ) -> Result<Self> {
        let out = Self::uninit(op, device, shape)?;
        // SAFETY: `out` holds exactly `data.len()` elements (the caller's shape), and
        // `T` is plain data (floats, integers, bytes).
        unsafe {
            let bytes =
                std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data));
            // Stream-ordered through pinned staging: the host does not wait, and the
            // ops queued after it on the stream read the data.
            out.stream().upload_staged(out.ptr(), bytes)
        }
        .map_err(Error::on_device(op, device))?;
        Ok(out)
    }

    /// The elements in row-major order, after all queued work on them.
    pub(crate) fn to_host(&self) -> Result<Vec<T>> {
        let mut data = vec![T::default(); self.len()];
        // SAFETY: the allocation holds `len` elements, and `data` was sized for them.
        unsafe {
            let bytes = std::slice::from_raw_parts_mut(
                data.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(data.as_slice()),
            );
            self.stream().download(bytes, self.ptr())
        }
        .map_err(Error::on_device("to_host", self.device()))?;
        Ok(data)
    }

    /// The same elements under another shape with the same element count.
    pub(crate) fn reshaped(&self, shape: &[usize]) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), self.len());
        GpuArray {
            buffer: self.buffer.clone(),
            offset_bytes: self.offset_bytes,
            shape: shape.to_vec(),
            _element: PhantomData,
        }
    }

    /// The elements `offset..offset + Π shape` of this array as an array of `shape`,
    /// sharing the memory (flat storage hands its views to kernels this way, and tensors
    /// their contiguous ranges). The caller checks the range.
    pub(crate) fn window(&self, offset: usize, shape: &[usize]) -> Self {
        // Callers check their ranges first (views, flat storage's layout); this keeps every
        // array inside its allocation, which `lend` relies on.
        assert!(
            offset + shape.iter().product::<usize>() <= self.len(),
            "a window of {shape:?} at element {offset} past an array of {} elements",
            self.len()
        );
        GpuArray {
            buffer: self.buffer.clone(),
            offset_bytes: self.offset_bytes + (offset * std::mem::size_of::<T>()) as u64,
            shape: shape.to_vec(),
            _element: PhantomData,
        }
    }

    /// Whether another array shares this memory (then it must not be written in place).
    pub(crate) fn is_shared(&self) -> bool {
        Arc::strong_count(&self.buffer) > 1
    }

    /// A private copy (the caller may then write it in place).
    pub(crate) fn duplicate(&self, op: &'static str) -> Result<Self> {
        let out = Self::uninit(op, self.device(), &self.shape)?;
        let bytes = self.len() * std::mem::size_of::<T>();
        // SAFETY: both hold `len` elements of `T`.
        unsafe { self.stream().copy(out.ptr(), self.ptr(), bytes) }
            .map_err(Error::on_device(op, self.device()))?;
        Ok(out)
    }

    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub(crate) fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Bytes of its elements.
    pub(crate) fn bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }

    pub(crate) fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.buffer.memory.ptr() + self.offset_bytes
    }

    pub(crate) fn device(&self) -> Device {
        self.buffer.backend.device()
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.buffer.backend
    }

    /// The stream the array's work is queued on (its backend's).
    pub(crate) fn stream(&self) -> &ferrotron_device::Stream {
        self.buffer.backend.stream()
    }

    /// This array's memory as a communicator reads it, with no copy: a view of its
    /// allocation, ordered on the stream that made it.
    pub(crate) fn lend(&self) -> ferrotron_comm_core::BufRef<'_>
    where
        T: ferrotron_comm_core::Element,
    {
        let dtype = <T as ferrotron_comm_core::Element>::DTYPE;
        let offset = self.offset_bytes as usize;
        // Invariant, not input: an array is a whole allocation of its elements (`uninit`)
        // or a `window` of one, which asserts it lies inside; offsets are whole elements.
        ferrotron_comm_core::BufRef::device(&self.buffer.memory, offset, self.len(), dtype)
            .expect("an array lies inside its allocation, aligned for its elements")
    }

    /// A writable view of this array's memory, for a collective to fill; see
    /// [`lend`](Self::lend).
    ///
    /// # Safety
    /// Nothing else may access this memory while the view lives (a fresh array, or flat
    /// storage under its lease).
    pub(crate) unsafe fn lend_mut(&self) -> ferrotron_comm_core::BufMut<'_>
    where
        T: ferrotron_comm_core::Element,
    {
        let dtype = <T as ferrotron_comm_core::Element>::DTYPE;
        let offset = self.offset_bytes as usize;
        // SAFETY: the caller guarantees the view is the only access. The range is inside
        // the allocation, as in `lend`.
        unsafe {
            ferrotron_comm_core::BufMut::device_shared(
                &self.buffer.memory,
                offset,
                self.len(),
                dtype,
            )
        }
        .expect("an array lies inside its allocation, aligned for its elements")
    }
}

impl<T: Element> GpuArray<T> {
    /// `shape` filled with `value`.
    pub(crate) fn full(
        op: &'static str,
        device: Device,
        shape: &[usize],
        value: T,
    ) -> Result<Self> {
        let out = Self::uninit(op, device, shape)?;
        out.fill(value)?;
        Ok(out)
    }

    /// Sets every element to `value` in place (fresh arrays and flat storage only).
    pub(crate) fn fill(&self, value: T) -> Result<()> {
        self.fill_rounded(value.into_f64())
    }

    /// Runs `kernel`'s build for `T` over `items` indices, moving `cost` (for profiles).
    pub(crate) fn launch(
        &self,
        kernel: &Kernel,
        items: usize,
        args: &KernelArgs,
        cost: Cost,
    ) -> Result<()> {
        self.launch_build(kernel, Precision::of::<T>(), items, args, cost)
    }
}

impl<E: Stored> GpuArray<E> {
    /// Sets every element to `value` rounded to the elements' format, in place
    /// (fresh arrays and flat storage only).
    pub(crate) fn fill_rounded(&self, value: f64) -> Result<()> {
        let mut args = KernelArgs::default();
        args.p[0] = self.ptr();
        args.i[..2].copy_from_slice(&[self.len() as i64, E::FORMAT]);
        args.f[0] = value;
        let cost = moves(0, self.bytes());
        self.launch_build(&super::FILL, E::build(), self.len(), &args, cost)
    }
}

impl<T: Copy + Default> GpuArray<T> {
    /// Runs `kernel`'s `precision` build over `items` indices, moving `cost` (what a
    /// profile counts: the bytes of the arrays it reads and writes, each once).
    pub(crate) fn launch_build(
        &self,
        kernel: &Kernel,
        precision: Precision,
        items: usize,
        args: &KernelArgs,
        cost: Cost,
    ) -> Result<()> {
        if items == 0 {
            return Ok(());
        }
        let function = self.backend().function(kernel, precision)?;
        let (accesses, count) = self.accesses(kernel, args);
        let stream = self.stream();
        // SAFETY: callers fill `args` with addresses of live arrays of this backend and
        // sizes matching the kernel's documented slots.
        let launch = || unsafe { stream.launch(&function, items, &[args], &accesses[..count]) };
        ferrotron_device::profile::measure(stream, kernel.name, precision.suffix(), cost, launch)
            .map_err(Error::on_device(kernel.name, self.device()))
    }

    /// Runs the cooperative `kernel`'s `precision` build over `grid`, moving `cost` (as
    /// [`launch_build`](Self::launch_build)).
    pub(crate) fn launch_grid(
        &self,
        kernel: &Kernel,
        precision: Precision,
        grid: ferrotron_device::Grid,
        args: &KernelArgs,
        cost: Cost,
    ) -> Result<()> {
        let function = self.backend().function(kernel, precision)?;
        let (accesses, count) = self.accesses(kernel, args);
        let stream = self.stream();
        // SAFETY: as in `launch_build`.
        let launch =
            || unsafe { stream.launch_blocks(&function, grid, &[args], &accesses[..count]) };
        ferrotron_device::profile::measure(stream, kernel.name, precision.suffix(), cost, launch)
            .map_err(Error::on_device(kernel.name, self.device()))
    }

    /// What a launch of `kernel` with `args` on this array reads and writes, for the
    /// emulated device's ordering checker: each address the kernel writes through
    /// written, the others read; this array's own range exactly (it may be the output
    /// or an input), every other address to the end of its allocation (the kernel's
    /// arguments say no more).
    fn accesses(
        &self,
        kernel: &Kernel,
        args: &KernelArgs,
    ) -> ([ferrotron_device::Access; 8], usize) {
        let mut accesses = [ferrotron_device::Access::read(0, 0); 8];
        let mut count = 0;
        let bytes = self.len() * std::mem::size_of::<T>();
        for (slot, &ptr) in args.p.iter().enumerate().filter(|(_, &p)| p != 0) {
            let write = kernel.writes(slot);
            accesses[count] = match (ptr == self.ptr(), write) {
                (true, true) => ferrotron_device::Access::write(ptr, bytes),
                (true, false) => ferrotron_device::Access::read(ptr, bytes),
                (false, write) => ferrotron_device::Access::rest(ptr, write),
            };
            count += 1;
        }
        (accesses, count)
    }
}
