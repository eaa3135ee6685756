//! Type-erased views of the memory a collective reads and writes, and owned buffers for
//! non-blocking operations.
//!
//! The [`Communicator`](crate::Communicator) trait sees only [`BufRef`], [`BufMut`] and
//! [`Buffer`]: a dtype, an element count and where the memory lives ([`Device`]).
//! Device memory (feature `cuda`) is another `Device` and another constructor
//! ([`BufRef::cuda`], [`BufMut::cuda`]), so it adds no method and changes no signature of
//! the trait.

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use ferrotron_device::{Access, Device, DeviceMemory, Stream};
use std::cell::Cell;
use std::marker::PhantomData;

/// The stream a device view's contents are ordered on; it also names the device and
/// its context.
#[cfg(feature = "cuda")]
pub(crate) type StreamRef<'a> = &'a cudarc::driver::CudaStream;

/// How a view of device memory is ordered: the stream its contents are ordered on, and
/// the stream of the allocation itself (cudarc frees it there), which may differ.
#[cfg(feature = "cuda")]
#[derive(Clone, Copy)]
pub(crate) struct DeviceOrder<'a> {
    stream: StreamRef<'a>,
    owner: StreamRef<'a>,
}

/// A read-only view of `len` elements of one dtype.
#[derive(Clone, Copy)]
pub struct BufRef<'a> {
    ptr: *const u8,
    len: usize,
    dtype: DType,
    emulated: bool,
    /// The device layer's stream the memory belongs to (views of `DeviceMemory`): what
    /// orders host-side collectives over emulated memory for the ordering checker, and
    /// the stream device-resident messages are copied on.
    ordered_on: Option<&'a Stream>,
    #[cfg(feature = "cuda")]
    stream: Option<DeviceOrder<'a>>,
    _borrow: PhantomData<&'a [u8]>,
}

/// A writable view of `len` elements of one dtype.
pub struct BufMut<'a> {
    ptr: *mut u8,
    len: usize,
    dtype: DType,
    emulated: bool,
    /// As in [`BufRef`].
    ordered_on: Option<&'a Stream>,
    #[cfg(feature = "cuda")]
    stream: Option<DeviceOrder<'a>>,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a, T: Element> From<&'a [T]> for BufRef<'a> {
    fn from(slice: &'a [T]) -> Self {
        BufRef {
            ptr: slice.as_ptr().cast(),
            len: slice.len(),
            dtype: T::DTYPE,
            emulated: false,
            ordered_on: None,
            #[cfg(feature = "cuda")]
            stream: None,
            _borrow: PhantomData,
        }
    }
}

impl<'a, T: Element> From<&'a mut [T]> for BufMut<'a> {
    fn from(slice: &'a mut [T]) -> Self {
        BufMut {
            ptr: slice.as_mut_ptr().cast(),
            len: slice.len(),
            dtype: T::DTYPE,
            emulated: false,
            ordered_on: None,
            #[cfg(feature = "cuda")]
            stream: None,
            _borrow: PhantomData,
        }
    }
}

impl<'a, T: Element> From<&'a mut Vec<T>> for BufMut<'a> {
    fn from(v: &'a mut Vec<T>) -> Self {
        BufMut::from(v.as_mut_slice())
    }
}

impl<'a, T: Element> From<&'a Vec<T>> for BufRef<'a> {
    fn from(v: &'a Vec<T>) -> Self {
        BufRef::from(v.as_slice())
    }
}

macro_rules! view_accessors {
    () => {
        /// Element type.
        pub fn dtype(&self) -> DType {
            self.dtype
        }
        /// Number of elements.
        pub fn len(&self) -> usize {
            self.len
        }
        /// Whether the view holds no elements.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }
        /// Size in bytes.
        pub fn byte_len(&self) -> usize {
            self.len * self.dtype.size_in_bytes()
        }
        /// Where the elements live.
        pub fn memory(&self) -> Device {
            #[cfg(feature = "cuda")]
            if let Some(order) = self.stream {
                return Device::Cuda(order.stream.context().ordinal());
            }
            if self.emulated {
                Device::Emulated
            } else {
                Device::Cpu
            }
        }
        /// Declares to the emulated device's ordering checker that a backend is about to
        /// touch this view from the host as `op`: in the order of the stream the memory
        /// belongs to (a local collective runs as work queued there, as NCCL's would), or
        /// as the host's own access when the view names no stream. Nothing for other
        /// memory.
        pub(crate) fn declare(&self, op: &'static str, write: bool) -> Result<()> {
            if !self.emulated {
                return Ok(());
            }
            let (ptr, bytes) = (self.ptr as usize as u64, self.byte_len());
            let access = if write {
                Access::write(ptr, bytes)
            } else {
                Access::read(ptr, bytes)
            };
            match self.ordered_on {
                Some(stream) => stream.declare(op, &[access]),
                None => ferrotron_device::host_access(op, &[access]),
            }
            .map_err(Error::from)
        }

        /// [`declare`](Self::declare) for the local backend's point-to-point transfers,
        /// which touch device memory ordered on a stream only through copies queued there
        /// (a message's copy, a receive's copy) that the checker sees as that stream's
        /// calls: nothing to declare for such a view, and nothing for the host to wait for.
        pub(crate) fn declare_transfer(&self, op: &'static str, write: bool) -> Result<()> {
            match self.ordered_on {
                Some(_) => Ok(()),
                None => self.declare(op, write),
            }
        }

        /// Whether the host may read or write the elements now: host memory always;
        /// emulated memory once the work queued on its stream has run (its worker runs
        /// behind the host, and may still be writing them), which this waits for.
        fn settled(&self) -> bool {
            match (self.emulated, self.ordered_on) {
                (true, Some(stream)) => stream.drain_emulated().is_ok(),
                _ => true,
            }
        }

        /// The stream device memory is ordered on; `None` for host memory.
        #[cfg(feature = "cuda")]
        pub(crate) fn cuda_stream(&self) -> Option<StreamRef<'a>> {
            self.stream.map(|order| order.stream)
        }

        /// The streams that must not run past a collective still using this memory: the
        /// one it is ordered on and the one that frees it. Empty for host memory.
        #[cfg(feature = "cuda")]
        pub(crate) fn cuda_holders(&self) -> Vec<StreamRef<'a>> {
            self.stream
                .map_or_else(Vec::new, |o| vec![o.stream, o.owner])
        }
    };
}

impl<'a> BufRef<'a> {
    view_accessors!();

    /// The device layer's stream the memory belongs to (views of `DeviceMemory`).
    pub(crate) fn ordered_on(&self) -> Option<&'a Stream> {
        self.ordered_on
    }

    /// The elements as a typed host slice, if the view is host (or emulated device)
    /// memory of type `T`; emulated memory once the work queued on its stream has run
    /// (`None` if that stream is broken).
    pub fn as_host_slice<T: Element>(&self) -> Option<&'a [T]> {
        let readable = self.memory().is_host_addressable() && self.dtype == T::DTYPE;
        (readable && self.settled()).then(|| {
            // SAFETY: built from a `&'a [T]` (or `&'a mut [T]`) of this length and type.
            unsafe { std::slice::from_raw_parts(self.ptr.cast::<T>(), self.len) }
        })
    }

    /// A view of `len` elements of `dtype` at `ptr` in host memory.
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len` elements of `dtype`, suitably aligned, for
    /// `'a`.
    #[cfg(feature = "mpi")]
    pub(crate) unsafe fn from_raw_host(ptr: *const u8, len: usize, dtype: DType) -> BufRef<'a> {
        BufRef {
            ptr,
            len,
            dtype,
            emulated: false,
            ordered_on: None,
            #[cfg(feature = "cuda")]
            stream: None,
            _borrow: PhantomData,
        }
    }

    /// A view of `len` elements of `dtype` at `ptr` in an emulated device's memory
    /// ([`Device::Emulated`]).
    ///
    /// # Safety
    /// `ptr` must be host memory valid for reads of `len` elements of `dtype`, suitably
    /// aligned, and not written by anything else, for `'a`.
    pub unsafe fn emulated(ptr: *const u8, len: usize, dtype: DType) -> BufRef<'a> {
        BufRef {
            ptr,
            len,
            dtype,
            emulated: true,
            ordered_on: None,
            #[cfg(feature = "cuda")]
            stream: None,
            _borrow: PhantomData,
        }
    }

    /// Raw host pointer for backends that share memory between rank threads.
    pub(crate) fn host_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// What a point-to-point message carries: a copy of device memory in new memory of
    /// the same device, queued on the view's stream (the host does not wait, and the
    /// bytes never leave the device); a host copy of anything else. The copy is local,
    /// so it runs in the sender's compute order rather than on the group's communication
    /// stream, which then carries only transfers: a receive posted ahead there never
    /// queues behind a send that waits for the sender's compute.
    pub(crate) fn to_message(self) -> Result<Buffer> {
        let Some(on) = self.ordered_on else {
            return self.to_host();
        };
        let bytes = self.byte_len();
        let memory = on.alloc(bytes)?;
        // SAFETY: the new allocation and this view both hold `bytes` bytes.
        unsafe { on.copy(memory.ptr(), self.ptr as usize as u64, bytes)? };
        // Recorded now, not when the message arrives: by then the sender's streams may
        // wait for a collective whose other half the receiver queues after this receive.
        let sent = on.record()?;
        Ok(Buffer::lent(Box::new(DeviceMessage {
            memory,
            sent,
            dtype: self.dtype,
            len: self.len,
        })))
    }

    /// A host copy of the elements, wherever they live (a device-to-host copy for device
    /// memory, ordered on its stream).
    pub fn to_host(self) -> Result<Buffer> {
        #[cfg(feature = "cuda")]
        if let Some(stream) = self.cuda_stream() {
            return cuda_views::to_host(self, stream);
        }
        let mut host = Buffer::zeros(self.dtype, self.len);
        if let (true, Some(stream)) = (self.emulated, self.ordered_on) {
            // A download, as on a GPU: after the stream's work, with the host waiting.
            let dst = host.as_buf_mut();
            // SAFETY: both hold `byte_len` bytes; the view lies inside its allocation.
            unsafe {
                let dst = std::slice::from_raw_parts_mut(dst.ptr, dst.byte_len());
                stream.download(dst, self.ptr as usize as u64)?;
            }
            return Ok(host);
        }
        self.declare("to_host", false)?;
        host.as_buf_mut().copy_from_host_view(self);
        Ok(host)
    }
}

impl<'a> BufMut<'a> {
    view_accessors!();

    /// A shorter-lived writable view of the same memory.
    pub fn reborrow(&mut self) -> BufMut<'_> {
        BufMut {
            _borrow: PhantomData,
            ..*self
        }
    }

    /// A read-only view of the same memory.
    pub fn as_ref(&self) -> BufRef<'_> {
        BufRef {
            ptr: self.ptr,
            len: self.len,
            dtype: self.dtype,
            emulated: self.emulated,
            ordered_on: self.ordered_on,
            #[cfg(feature = "cuda")]
            stream: self.stream,
            _borrow: PhantomData,
        }
    }

    /// The elements as a typed mutable host slice, if the view is host (or emulated
    /// device) memory of type `T`; emulated memory once the work queued on its stream
    /// has run (`None` if that stream is broken).
    pub fn as_host_slice_mut<T: Element>(&mut self) -> Option<&mut [T]> {
        let writable = self.memory().is_host_addressable() && self.dtype == T::DTYPE;
        (writable && self.settled()).then(|| {
            // SAFETY: built from a `&'a mut [T]` of this length and type, and `&mut self`
            // guarantees exclusive access for the returned lifetime.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<T>(), self.len) }
        })
    }

    /// A writable view of `len` elements of `dtype` at `ptr` in an emulated device's
    /// memory ([`Device::Emulated`]).
    ///
    /// # Safety
    /// `ptr` must be host memory valid for reads and writes of `len` elements of `dtype`,
    /// suitably aligned, and not accessed by anything else, for `'a`.
    pub unsafe fn emulated(ptr: *mut u8, len: usize, dtype: DType) -> BufMut<'a> {
        BufMut {
            ptr,
            len,
            dtype,
            emulated: true,
            ordered_on: None,
            #[cfg(feature = "cuda")]
            stream: None,
            _borrow: PhantomData,
        }
    }

    pub(crate) fn host_ptr_mut(&mut self) -> *mut u8 {
        self.ptr
    }

    /// Overwrites the elements, wherever they live, with `host`'s, which must have the
    /// same dtype and length (a host-to-device copy for device memory, ordered on its
    /// stream).
    pub fn copy_from_host(&mut self, host: &Buffer) -> Result<()> {
        if !host.memory().is_host_addressable() {
            return Err(Error::Config(format!(
                "copy_from_host: the source holds {} memory, not host memory; read it \
                 through its owner",
                host.memory()
            )));
        }
        self.check_fits("copy_from_host", host.dtype(), host.len())?;
        #[cfg(feature = "cuda")]
        if let Some(stream) = self.cuda_stream() {
            return cuda_views::from_host(host, self, stream);
        }
        if let (true, Some(stream)) = (self.emulated, self.ordered_on) {
            let src = host.as_buf_ref();
            // SAFETY: both hold `byte_len` bytes; the view lies inside its allocation.
            unsafe {
                let src = std::slice::from_raw_parts(src.ptr, src.byte_len());
                stream.upload(self.ptr as usize as u64, src)?;
            }
            return Ok(());
        }
        self.declare("copy_from_host", true)?;
        self.copy_from_host_view(host.as_buf_ref());
        Ok(())
    }

    /// Refuses a source of another dtype or length.
    fn check_fits(&self, op: &str, dtype: DType, len: usize) -> Result<()> {
        if dtype != self.dtype {
            return Err(Error::WrongDType {
                expected: self.dtype,
                found: dtype,
            });
        }
        if len != self.len {
            return Err(Error::Config(format!(
                "{op}: the source holds {len} elements, the view {}",
                self.len
            )));
        }
        Ok(())
    }

    /// Fills this view with a message made by [`BufRef::to_message`]: device to device
    /// when both are device memory (queued on `comm`, the group's communication stream,
    /// or on this view's stream without one, after the sender's copy, with no host wait),
    /// else through the host. `posted`, recorded on this view's stream when a receive was
    /// posted ahead, is where the view was last written before the copy: the copy waits
    /// for it rather than for everything queued on that stream since.
    pub(crate) fn copy_from_message(
        &mut self,
        message: Buffer,
        comm: Option<&Stream>,
        posted: Option<&ferrotron_device::Event>,
    ) -> Result<()> {
        let device = match message.into_lent() {
            Ok(lent) if (&*lent as &dyn std::any::Any).is::<DeviceMessage>() => {
                let any: Box<dyn std::any::Any> = lent;
                any.downcast::<DeviceMessage>()
                    .expect("the type was just checked")
            }
            Ok(lent) => return self.copy_from_host(&lent.view().to_host()?),
            Err(host) => return self.copy_from_host(&host),
        };
        match self.ordered_on {
            Some(to) => self.copy_from_device_message(*device, to, comm.unwrap_or(to), posted),
            None => self.copy_from_host(&device.view().to_host()?),
        }
    }

    /// The device-to-device half of [`copy_from_message`](Self::copy_from_message),
    /// queued on `on`, ordered between the work `to` (this view's stream) queued before
    /// it (or before `posted`) and after it.
    fn copy_from_device_message(
        &mut self,
        message: DeviceMessage,
        to: &Stream,
        on: &Stream,
        posted: Option<&ferrotron_device::Event>,
    ) -> Result<()> {
        let src = message.view();
        self.check_fits("receive", src.dtype, src.len)?;
        let (dst, bytes) = (self.ptr as usize as u64, self.byte_len());
        // The injected fault applies to the emulated device alone, where the checker
        // reports it; on a GPU the copy would race.
        let skip = SKIP_RECEIVE_WAIT.with(Cell::get) && to.device() == Device::Emulated;
        if !skip {
            on.wait(&message.sent)?;
        }
        let crosses = !on.same_as(to);
        if crosses {
            let recorded;
            let ready = match posted {
                Some(posted) => posted,
                None => {
                    recorded = to.record()?;
                    &recorded
                }
            };
            on.wait(ready)?;
            // Between two ranks: the link's time, on the modelled timeline.
            ferrotron_device::timeline::charge_transfer(bytes as u64);
        }
        // SAFETY: both ranges hold `bytes` bytes (same dtype and length, checked), the
        // message is this call's alone, and `&mut self` makes this view the only access.
        let copied = unsafe { on.copy(dst, src.ptr as usize as u64, bytes) };
        // Freed after the copy in that stream's order, whether or not it was queued, and
        // before anything else can fail (dropped, the message would be freed on the
        // sender's stream, which the copy is not ordered before): the sender's streams
        // never wait for the receiver's.
        // SAFETY: the sender's copy into the message is ordered before `on`'s work (the
        // wait above; the checker reports the fault injected without it), and nothing but
        // this copy, queued on `on`, uses the message after it.
        let freed = unsafe { message.memory.free_on(on) };
        if crosses {
            to.wait(&on.record()?)?;
        }
        freed?;
        Ok(copied?)
    }

    /// Copies `src`'s bytes into this host view (as many as both hold).
    fn copy_from_host_view(&mut self, src: BufRef<'_>) {
        let bytes = self.byte_len().min(src.byte_len());
        // SAFETY: both are host memory valid for `bytes` bytes, and `&mut self` is the
        // only access to ours; distinct borrows do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr, self.ptr, bytes) };
    }
}

#[cfg(feature = "cuda")]
mod cuda_views {
    use super::*;
    use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

    /// A host copy of a device view, taken after the work queued on its stream (a
    /// transfer and a host wait, counted by the device layer).
    pub(super) fn to_host(view: BufRef<'_>, stream: &CudaStream) -> Result<Buffer> {
        let mut host = Buffer::zeros(view.dtype(), view.len());
        let mut out = host.as_buf_mut();
        // SAFETY: `host` was sized for the view's bytes; the copy completes before we
        // return.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(out.host_ptr_mut(), view.byte_len());
            ferrotron_device::cuda::download(stream, dst, view.device_ptr())?;
        }
        Ok(host)
    }

    /// Copies a host buffer of the same dtype and length into a device view and waits
    /// for it.
    pub(super) fn from_host(
        host: &Buffer,
        view: &mut BufMut<'_>,
        stream: &CudaStream,
    ) -> Result<()> {
        debug_assert_eq!((host.dtype(), host.len()), (view.dtype(), view.len()));
        let src = host.as_buf_ref();
        // SAFETY: both sides hold `byte_len` bytes; the copy completes before we return.
        unsafe {
            let bytes = std::slice::from_raw_parts(src.host_ptr(), src.byte_len());
            ferrotron_device::cuda::upload(stream, view.device_ptr(), bytes)?;
        }
        Ok(())
    }

    fn check_device(owner: &CudaStream, stream: &CudaStream) -> Result<()> {
        let (slice_device, stream_device) = (owner.context().ordinal(), stream.context().ordinal());
        if slice_device == stream_device {
            Ok(())
        } else {
            Err(Error::Cuda {
                call: "BufRef::cuda / BufMut::cuda".into(),
                message: format!(
                    "the slice lives on device {slice_device} but the stream belongs to device \
                     {stream_device}; pass a stream of the slice's device"
                ),
            })
        }
    }

    impl<'a> BufRef<'a> {
        /// A view of device memory whose contents are ordered on `stream`: a collective
        /// reads it after the work already queued on `stream`, and has finished with it
        /// when the call returns.
        pub fn cuda<T, S>(slice: &'a S, stream: &'a CudaStream) -> Result<BufRef<'a>>
        where
            T: Element + DeviceRepr,
            S: DevicePtr<T>,
        {
            check_device(slice.stream(), stream)?;
            // Dropping the guard records a use on `stream` for cudarc's event tracking now,
            // before the collective is queued: blocking calls are complete when they return,
            // and `NcclWork::wait_on` orders other streams after non-blocking ones.
            let (ptr, _record) = slice.device_ptr(stream);
            Ok(BufRef {
                ptr: ptr as usize as *const u8,
                len: slice.len(),
                dtype: T::DTYPE,
                emulated: false,
                ordered_on: None,
                stream: Some(super::DeviceOrder {
                    stream,
                    owner: slice.stream(),
                }),
                _borrow: PhantomData,
            })
        }

        /// The device address of a CUDA view.
        pub(crate) fn device_ptr(&self) -> u64 {
            self.ptr as usize as u64
        }
    }

    impl<'a> BufMut<'a> {
        /// A writable view of device memory ordered on `stream`; see [`BufRef::cuda`].
        pub fn cuda<T, S>(slice: &'a mut S, stream: &'a CudaStream) -> Result<BufMut<'a>>
        where
            T: Element + DeviceRepr,
            S: DevicePtrMut<T>,
        {
            check_device(slice.stream(), stream)?;
            let len = slice.len();
            let ptr = {
                let (ptr, _record) = slice.device_ptr_mut(stream);
                ptr
            };
            // Only the device memory is written through the view; the slice itself is
            // only read (for the stream that frees it) from here on.
            let owner = (slice as &'a S).stream();
            Ok(BufMut {
                ptr: ptr as usize as *mut u8,
                len,
                dtype: T::DTYPE,
                emulated: false,
                ordered_on: None,
                stream: Some(super::DeviceOrder { stream, owner }),
                _borrow: PhantomData,
            })
        }

        /// The device address of a CUDA view.
        pub(crate) fn device_ptr(&self) -> u64 {
            self.ptr as usize as u64
        }
    }
}

/// Views of the device layer's allocations ([`DeviceMemory`]), the way tensors hold their
/// memory: CUDA memory ordered on the stream it was allocated on, or the emulated
/// device's. One constructor for both, with the range checked against the allocation.
impl<'a> BufRef<'a> {
    /// A view of `len` elements of `dtype` starting `offset` bytes into `memory`, ordered
    /// on the stream that allocated it: a collective reads it after the work queued there.
    pub fn device(
        memory: &'a DeviceMemory,
        offset: usize,
        len: usize,
        dtype: DType,
    ) -> Result<BufRef<'a>> {
        let view = DeviceView::of(memory, offset, len, dtype, "BufRef::device")?;
        Ok(BufRef {
            ptr: view.ptr as usize as *const u8,
            len,
            dtype,
            emulated: view.emulated,
            ordered_on: view.ordered_on,
            #[cfg(feature = "cuda")]
            stream: view.order,
            _borrow: PhantomData,
        })
    }
}

impl<'a> BufMut<'a> {
    /// A writable view of `len` elements of `dtype` starting `offset` bytes into
    /// `memory`; see [`BufRef::device`].
    pub fn device(
        memory: &'a mut DeviceMemory,
        offset: usize,
        len: usize,
        dtype: DType,
    ) -> Result<BufMut<'a>> {
        // SAFETY: `&mut` makes the view the only access for its lifetime.
        unsafe { BufMut::device_shared(memory, offset, len, dtype) }
    }

    /// [`BufMut::device`] through a shared reference, for owners that hand out disjoint
    /// ranges of one allocation (a tensor library's arrays and flat storage).
    ///
    /// # Safety
    /// Nothing else may read or write the range while the view lives.
    pub unsafe fn device_shared(
        memory: &'a DeviceMemory,
        offset: usize,
        len: usize,
        dtype: DType,
    ) -> Result<BufMut<'a>> {
        let view = DeviceView::of(memory, offset, len, dtype, "BufMut::device")?;
        Ok(BufMut {
            ptr: view.ptr as usize as *mut u8,
            len,
            dtype,
            emulated: view.emulated,
            ordered_on: view.ordered_on,
            #[cfg(feature = "cuda")]
            stream: view.order,
            _borrow: PhantomData,
        })
    }
}

/// What a view of a range of [`DeviceMemory`] holds: its address, whether it is the
/// emulated device's, and (CUDA) the stream that allocated it, which orders it.
struct DeviceView<'a> {
    ptr: u64,
    emulated: bool,
    ordered_on: Option<&'a Stream>,
    #[cfg(feature = "cuda")]
    order: Option<DeviceOrder<'a>>,
    #[cfg(not(feature = "cuda"))]
    order: PhantomData<&'a ()>,
}

impl<'a> DeviceView<'a> {
    /// `len` elements of `dtype` at `offset` bytes into `memory`, checked to lie inside
    /// it and be aligned for `dtype`.
    fn of(
        memory: &'a DeviceMemory,
        offset: usize,
        len: usize,
        dtype: DType,
        op: &'static str,
    ) -> Result<DeviceView<'a>> {
        let size = dtype.size_in_bytes();
        let end = len.checked_mul(size).and_then(|n| n.checked_add(offset));
        if end.is_none_or(|end| end > memory.bytes()) || !offset.is_multiple_of(size) {
            return Err(Error::Config(format!(
                "{op}: {len} elements of {dtype:?} at byte {offset} do not fit the {}-byte \
                 allocation (or are not aligned for {dtype:?}); view a range inside it",
                memory.bytes()
            )));
        }
        #[cfg(feature = "cuda")]
        let order = memory.stream().cuda().map(|stream| {
            let stream: &'a cudarc::driver::CudaStream = stream;
            DeviceOrder {
                stream,
                owner: stream,
            }
        });
        #[cfg(not(feature = "cuda"))]
        let order = PhantomData;
        Ok(DeviceView {
            ptr: memory.ptr() + offset as u64,
            emulated: memory.device() == Device::Emulated,
            ordered_on: Some(memory.stream()),
            order,
        })
    }
}

/// An owned buffer: what non-blocking operations take and hand back. Either a host
/// vector, or memory some other owner lends for the operation's duration
/// ([`Buffer::lent`]: a tensor library's device allocation), so that a non-blocking
/// collective runs in place on it.
#[derive(Debug)]
pub struct Buffer {
    repr: Repr,
}

#[derive(Debug)]
enum Repr {
    Host(HostVec),
    Lent(Box<dyn LentMemory>),
}

/// Memory a [`Buffer`] holds without owning it as a host vector: typically a lease on
/// an allocation that a tensor library shares with other views (a bucket of gradients),
/// which the owner keeps from every other use until the lease is dropped. The views it
/// gives must stay valid, and unaliased by anything else, for as long as the lease lives.
/// Owners recognise their own memory when it comes back (`Box<dyn LentMemory>` upcasts to
/// `Box<dyn Any>`, which downcasts).
pub trait LentMemory: std::any::Any + Send + std::fmt::Debug {
    /// The memory, for a collective to read.
    fn view(&self) -> BufRef<'_>;
    /// The memory, for a collective to write.
    fn view_mut(&mut self) -> BufMut<'_>;
}

#[derive(Clone, Debug, PartialEq)]
enum HostVec {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<half::f16>),
    BF16(Vec<half::bf16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

macro_rules! host_vec_dispatch {
    ($v:expr, $x:ident => $body:expr) => {
        match $v {
            HostVec::F32($x) => $body,
            HostVec::F64($x) => $body,
            HostVec::F16($x) => $body,
            HostVec::BF16($x) => $body,
            HostVec::I32($x) => $body,
            HostVec::I64($x) => $body,
            HostVec::U8($x) => $body,
        }
    };
}

/// Conversion between a typed `Vec` and the owned buffer's storage.
trait HostVecElement: Element {
    fn wrap(v: Vec<Self>) -> HostVec;
    fn unwrap(v: HostVec) -> std::result::Result<Vec<Self>, HostVec>;
}

macro_rules! host_vec_element {
    ($t:ty, $variant:ident) => {
        impl HostVecElement for $t {
            fn wrap(v: Vec<Self>) -> HostVec {
                HostVec::$variant(v)
            }
            fn unwrap(v: HostVec) -> std::result::Result<Vec<Self>, HostVec> {
                match v {
                    HostVec::$variant(v) => Ok(v),
                    other => Err(other),
                }
            }
        }
    };
}
host_vec_element!(f32, F32);
host_vec_element!(f64, F64);
host_vec_element!(half::f16, F16);
host_vec_element!(half::bf16, BF16);
host_vec_element!(i32, I32);
host_vec_element!(i64, I64);
host_vec_element!(u8, U8);

impl Buffer {
    /// Takes ownership of a host vector.
    pub fn from_vec<T: Element>(v: Vec<T>) -> Buffer {
        Buffer {
            repr: Repr::Host(crate::with_dtype!(T::DTYPE, U => {
                // `T` and `U` are the same type; the round trip through `Any` proves it
                // to the compiler without `unsafe`.
                let any: Box<dyn std::any::Any> = Box::new(v);
                match any.downcast::<Vec<U>>() {
                    Ok(v) => <U as HostVecElement>::wrap(*v),
                    Err(_) => unreachable!("DTYPE names the element type itself"),
                }
            })),
        }
    }

    /// Holds `memory` (e.g. a lease on a device allocation) for a non-blocking
    /// operation: the operation reads and writes it in place, and hands it back.
    pub fn lent(memory: Box<dyn LentMemory>) -> Buffer {
        Buffer {
            repr: Repr::Lent(memory),
        }
    }

    /// The lent memory back, or the buffer itself if it is a host vector.
    pub fn into_lent(self) -> std::result::Result<Box<dyn LentMemory>, Buffer> {
        match self.repr {
            Repr::Lent(memory) => Ok(memory),
            Repr::Host(_) => Err(self),
        }
    }

    /// Where the elements live.
    pub fn memory(&self) -> Device {
        self.as_buf_ref().memory()
    }

    /// A zero-filled host buffer.
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        crate::with_dtype!(dtype, U => Buffer::from_vec(vec![U::default(); len]))
    }

    /// Gives the host vector back; a dtype other than `T` is an error naming both, and
    /// so is lent memory (it is not a vector to give).
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>> {
        let found = self.dtype();
        let wrong = || Error::WrongDType {
            expected: T::DTYPE,
            found,
        };
        let Repr::Host(host) = self.repr else {
            return Err(Error::LentBuffer {
                memory: self.memory(),
            });
        };
        crate::with_dtype!(T::DTYPE, U => {
            let v = <U as HostVecElement>::unwrap(host).map_err(|_| wrong())?;
            let any: Box<dyn std::any::Any> = Box::new(v);
            any.downcast::<Vec<T>>().map(|b| *b).map_err(|_| wrong())
        })
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        let host = match &self.repr {
            Repr::Host(host) => host,
            Repr::Lent(memory) => return memory.view().dtype(),
        };
        match host {
            HostVec::F32(_) => DType::F32,
            HostVec::F64(_) => DType::F64,
            HostVec::F16(_) => DType::F16,
            HostVec::BF16(_) => DType::BF16,
            HostVec::I32(_) => DType::I32,
            HostVec::I64(_) => DType::I64,
            HostVec::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Host(host) => host_vec_dispatch!(host, v => v.len()),
            Repr::Lent(memory) => memory.view().len(),
        }
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A read-only view.
    pub fn as_buf_ref(&self) -> BufRef<'_> {
        match &self.repr {
            Repr::Host(host) => host_vec_dispatch!(host, v => BufRef::from(v.as_slice())),
            Repr::Lent(memory) => memory.view(),
        }
    }

    /// A writable view.
    pub fn as_buf_mut(&mut self) -> BufMut<'_> {
        match &mut self.repr {
            Repr::Host(host) => host_vec_dispatch!(host, v => BufMut::from(v.as_mut_slice())),
            Repr::Lent(memory) => memory.view_mut(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_buffer_round_trips_every_dtype() {
        let b = Buffer::from_vec(vec![1.5f32, 2.5]);
        assert_eq!(b.dtype(), DType::F32);
        assert_eq!(b.len(), 2);
        assert_eq!(b.into_vec::<f32>().unwrap(), vec![1.5, 2.5]);
        for dtype in DType::ALL {
            let b = Buffer::zeros(dtype, 3);
            assert_eq!((b.dtype(), b.len()), (dtype, 3));
        }
    }

    #[test]
    fn wrong_dtype_is_an_error_not_a_panic() {
        let err = Buffer::from_vec(vec![1i32]).into_vec::<f64>().unwrap_err();
        assert!(matches!(
            err,
            Error::WrongDType {
                expected: DType::F64,
                found: DType::I32
            }
        ));
    }

    #[test]
    fn views_expose_typed_slices_only_for_their_dtype() {
        let mut v = vec![1u8, 2, 3];
        let mut view = BufMut::from(&mut v);
        assert!(view.as_host_slice_mut::<i32>().is_none());
        view.as_host_slice_mut::<u8>().unwrap()[0] = 9;
        assert_eq!(view.as_ref().as_host_slice::<u8>().unwrap(), &[9, 2, 3]);
        assert_eq!(view.byte_len(), 3);
    }
}

/// Declares a collective's input and output to the emulated device's ordering checker
/// (see `declare`); the MPI backend's (the local one queues its calls on streams).
#[cfg(feature = "mpi")]
pub(crate) fn declare_in_out(
    op: &'static str,
    input: &BufRef<'_>,
    output: &BufMut<'_>,
) -> Result<()> {
    input.declare(op, false)?;
    output.declare(op, true)
}

/// Declares an exchange's sends and receives to the ordering checker; `transfers`:
/// as the local backend's transfers (see `declare_transfer`).
pub(crate) fn declare_exchange(ops: &[crate::P2p<'_>], transfers: bool) -> Result<()> {
    for op in ops {
        let (buf, what, write) = match op {
            crate::P2p::Send { buf, .. } => (*buf, "exchange (send)", false),
            crate::P2p::Recv { buf, .. } => (buf.as_ref(), "exchange (recv)", true),
        };
        if transfers {
            buf.declare_transfer(what, write)?;
        } else {
            buf.declare(what, write)?;
        }
    }
    Ok(())
}

/// A message's data kept on its device: a copy of what was sent, allocated and filled on
/// the sender's stream, freed on the receiver's after its copy (on the sender's if it is
/// never received).
#[derive(Debug)]
struct DeviceMessage {
    memory: DeviceMemory,
    /// Recorded on the sender's stream after its copy into `memory`.
    sent: ferrotron_device::Event,
    dtype: DType,
    len: usize,
}

impl LentMemory for DeviceMessage {
    fn view(&self) -> BufRef<'_> {
        // The whole allocation, made for exactly these elements.
        BufRef::device(&self.memory, 0, self.len, self.dtype)
            .expect("a message's memory holds its elements")
    }

    fn view_mut(&mut self) -> BufMut<'_> {
        BufMut::device(&mut self.memory, 0, self.len, self.dtype)
            .expect("a message's memory holds its elements")
    }
}

thread_local! {
    /// See [`inject_missing_receive_wait`].
    static SKIP_RECEIVE_WAIT: Cell<bool> = const { Cell::new(false) };
}

/// Fault injection for tests of the emulated device's ordering checker: while set, this
/// thread's device-to-device receives on the emulated device leave out their stream's
/// wait for the sender's copy, as a bug would, and the checker reports the receive's copy
/// ([`Error::Unordered`]). Receives on real devices ignore it (they would race). Per
/// thread, like ranks; for tests only.
#[doc(hidden)]
pub fn inject_missing_receive_wait(skip: bool) {
    SKIP_RECEIVE_WAIT.with(|flag| flag.set(skip));
}
