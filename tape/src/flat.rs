//! Flat storage: one contiguous allocation on one device whose ranges several
//! parameters' gradients live in (a data-parallel bucket, Megatron's `main_grad`
//! buffer), so that a collective reduces them in place, with no copy in or out; also the
//! shards a sharded optimizer keeps (moments, master weights) and updates where they
//! live.
//!
//! Tensors are immutable; flat storage is the one thing written in place: by backward
//! accumulating into a view attached with
//! [`Parameter::attach_main_grad`](crate::Parameter::attach_main_grad), by optimizers
//! reading or updating views ([`AdamWUpdate::apply_views`](crate::AdamWUpdate::apply_views)),
//! and by a collective holding a [`lease`](FlatStorage::lease) on the whole storage. Every access holds the storage's lock, and every access but the lease's
//! is refused while a lease is out, so a collective in flight never races with backward.

use std::sync::Arc;

use ndarray::{ArrayView, IxDyn};
use parking_lot::Mutex;

use crate::gpu::{ops, GpuArray};
use crate::precision::Half;
use crate::{DType, Device, Element, Error, Result, Tensor};

/// One contiguous allocation of `len` elements on one device, zeros when made. Clones
/// share it.
///
/// ```
/// use ferrotron_tape::{Device, FlatStorage, FlatView, Tensor};
///
/// let storage = FlatStorage::<f32>::zeros(Device::Cpu, 6)?;
/// let view = FlatView::new(&storage, 2, &[2, 2])?;
/// assert_eq!(view.to_tensor()?.to_vec()?, vec![0.0; 4]);
/// assert!(FlatView::new(&storage, 4, &[2, 2]).is_err(), "past the end");
/// # Ok::<(), ferrotron_tape::Error>(())
/// ```
pub struct FlatStorage<T: Element = f32> {
    shared: Arc<Shared<T>>,
}

impl<T: Element> Clone for FlatStorage<T> {
    fn clone(&self) -> Self {
        FlatStorage {
            shared: self.shared.clone(),
        }
    }
}

struct Shared<T: Element> {
    memory: Memory<T>,
    len: usize,
    device: Device,
    /// Whether a lease is out; every access holds this lock.
    leased: Mutex<bool>,
}

enum Memory<T> {
    /// A leaked `Box<[T]>` of `len` elements, freed in `Drop`: accessed only through raw
    /// pointers, under the lock, so views never alias a live reference.
    Host(*mut T),
    Device(GpuArray<T>),
}

// SAFETY: the host pointer is owned by `Shared` and only dereferenced under its lock (or
// by the single lease while `leased` keeps everyone else out); device arrays are
// `Send + Sync`.
unsafe impl<T: Element> Send for Shared<T> {}
// SAFETY: as for `Send`.
unsafe impl<T: Element> Sync for Shared<T> {}

impl<T: Element> Drop for Shared<T> {
    fn drop(&mut self) {
        if let Memory::Host(ptr) = self.memory {
            // SAFETY: made by `Box::into_raw` of a boxed slice of `len` elements in `zeros`;
            // no lease or view outlives the `Arc` that owns this.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, self.len)) });
        }
    }
}

impl<T: Element> FlatStorage<T> {
    /// `len` zeros on `device`.
    pub fn zeros(device: Device, len: usize) -> Result<Self> {
        let memory = match device {
            Device::Cpu => {
                Memory::Host(Box::into_raw(vec![T::zero(); len].into_boxed_slice()).cast())
            }
            _ => Memory::Device(GpuArray::full(
                "FlatStorage::zeros",
                device,
                &[len],
                T::zero(),
            )?),
        };
        Ok(FlatStorage {
            shared: Arc::new(Shared {
                memory,
                len,
                device,
                leased: Mutex::new(false),
            }),
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shared.len
    }

    /// Whether the storage holds no elements.
    pub fn is_empty(&self) -> bool {
        self.shared.len == 0
    }

    /// The device holding the elements.
    pub fn device(&self) -> Device {
        self.shared.device
    }

    /// Whether a [`lease`](Self::lease) is out.
    pub fn is_leased(&self) -> bool {
        *self.shared.leased.lock()
    }

    /// Whether two handles share one allocation.
    pub fn same_storage(&self, other: &FlatStorage<T>) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// The whole storage as an owned [`ferrotron_comm_core::Buffer`] for a non-blocking collective
    /// to run on in place (host, emulated or CUDA memory, the last ordered on the
    /// device's tape stream). Until the buffer is dropped (after the operation hands it
    /// back, or with a failed one), every other access to the storage and its views is
    /// refused with [`Error::Leased`]; a second lease too.
    pub fn lease(&self) -> Result<ferrotron_comm_core::Buffer>
    where
        T: ferrotron_comm_core::Element,
    {
        let mut leased = self.shared.leased.lock();
        if *leased {
            return Err(Error::Leased {
                op: "FlatStorage::lease",
                parameter: None,
            });
        }
        *leased = true;
        Ok(ferrotron_comm_core::Buffer::lent(Box::new(Lease {
            storage: self.clone(),
        })))
    }

    /// Takes back the buffer a collective on this storage handed back: this storage's own
    /// [`lease`](Self::lease) is dropped, which ends it (the result is already in place);
    /// any other buffer (a 16-bit copy, a tensor's memory, a host vector) has its elements
    /// copied in, widened, and must hold exactly [`len`](Self::len) of them.
    pub fn receive(&self, result: ferrotron_comm_core::Buffer) -> Result<()>
    where
        T: ferrotron_comm_core::Element,
    {
        let result = match result.into_lent() {
            Ok(memory) => {
                let any: &dyn std::any::Any = &*memory;
                let own = any.downcast_ref::<Lease<T>>();
                if own.is_some_and(|lease| lease.storage.same_storage(self)) {
                    return Ok(());
                }
                ferrotron_comm_core::Buffer::lent(memory)
            }
            Err(host) => host,
        };
        let values = Tensor::<T>::from_buffer(result)?.to_device(self.device())?;
        FlatView::new(self, 0, &[self.len()])?.copy_from(&values)
    }

    /// Runs `access` on elements `offset..offset + len` under the lock: a host slice,
    /// or a device window of that range.
    fn access<R>(
        &self,
        op: &'static str,
        offset: usize,
        shape: &[usize],
        access: impl FnOnce(Region<'_, T>) -> Result<R>,
    ) -> Result<R> {
        let leased = self.shared.leased.lock();
        if *leased {
            return Err(Error::Leased {
                op,
                parameter: None,
            });
        }
        // SAFETY: the lock is held while `access` runs.
        let out = access(unsafe { self.region(offset, shape) });
        drop(leased);
        out
    }

    /// Elements `offset..offset + Π shape` as a host slice or a device window.
    ///
    /// # Safety
    /// The range lies within the storage (views are checked when made), and the caller
    /// holds the lock, and no lease is out, while the region is used: that keeps every
    /// other access out.
    unsafe fn region(&self, offset: usize, shape: &[usize]) -> Region<'_, T> {
        match &self.shared.memory {
            Memory::Host(ptr) => {
                let len: usize = shape.iter().product();
                // SAFETY: as the caller promises.
                Region::Host(unsafe { std::slice::from_raw_parts_mut(ptr.add(offset), len) })
            }
            Memory::Device(array) => Region::Device(array.window(offset, shape)),
        }
    }
}

/// Views of distinct storages on one device, as one access sees them together.
pub(crate) enum Regions<'a, T> {
    Host(Vec<&'a mut [T]>),
    Device(Vec<GpuArray<T>>),
}

/// Runs `access` on `views` together, under all their storages' locks (taken in one
/// order, so that two such accesses never wait for each other). Views must lie in
/// distinct storages (one storage's lock cannot be taken twice) on one device.
pub(crate) fn with_regions<T: Element, R>(
    op: &'static str,
    views: &[&FlatView<T>],
    access: impl FnOnce(Regions<'_, T>) -> Result<R>,
) -> Result<R> {
    let device = views.first().map_or(Device::Cpu, |view| view.device());
    for (index, view) in views.iter().enumerate() {
        if view.device() != device {
            return Err(Error::DeviceMismatch {
                op,
                first: device,
                second: view.device(),
            });
        }
        if views[..index]
            .iter()
            .any(|other| other.storage.same_storage(&view.storage))
        {
            return Err(Error::invalid(
                op,
                "two views lie in one storage: give each its own FlatStorage",
            ));
        }
    }
    let mut order: Vec<&FlatView<T>> = views.to_vec();
    order.sort_by_key(|view| Arc::as_ptr(&view.storage.shared));
    let guards: Vec<_> = order
        .iter()
        .map(|view| view.storage.shared.leased.lock())
        .collect();
    if guards.iter().any(|leased| **leased) {
        return Err(Error::Leased {
            op,
            parameter: None,
        });
    }
    let (mut host, mut windows) = (Vec::new(), Vec::new());
    for view in views {
        // SAFETY: every storage's lock is held until `access` returns, none is leased,
        // and the storages are distinct, so no two regions alias.
        match unsafe { view.storage.region(view.offset, &view.shape) } {
            Region::Host(slice) => host.push(slice),
            Region::Device(window) => windows.push(window),
        }
    }
    // One device (checked above) gives one kind of region.
    let out = match windows.is_empty() {
        true => access(Regions::Host(host)),
        false => access(Regions::Device(windows)),
    };
    drop(guards);
    out
}

impl<T: Element> std::fmt::Debug for FlatStorage<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlatStorage")
            .field("device", &self.device())
            .field("len", &self.len())
            .field("leased", &self.is_leased())
            .finish()
    }
}

/// A range of a [`FlatStorage`] as one access sees it.
enum Region<'a, T> {
    Host(&'a mut [T]),
    Device(GpuArray<T>),
}

/// The storage lent to a collective; dropping it ends the lease.
struct Lease<T: Element> {
    storage: FlatStorage<T>,
}

impl<T: Element> Drop for Lease<T> {
    fn drop(&mut self) {
        *self.storage.shared.leased.lock() = false;
    }
}

impl<T: Element> std::fmt::Debug for Lease<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("storage", &self.storage)
            .finish()
    }
}

impl<T: Element + ferrotron_comm_core::Element> ferrotron_comm_core::LentMemory for Lease<T> {
    fn view(&self) -> ferrotron_comm_core::BufRef<'_> {
        let shared = &self.storage.shared;
        match &shared.memory {
            // SAFETY: the whole allocation; while this lease lives every other access is
            // refused, so nothing writes it.
            Memory::Host(ptr) => ferrotron_comm_core::BufRef::from(unsafe {
                std::slice::from_raw_parts(ptr.cast_const(), shared.len)
            }),
            Memory::Device(array) => array.lend(),
        }
    }

    fn view_mut(&mut self) -> ferrotron_comm_core::BufMut<'_> {
        let shared = &self.storage.shared;
        match &shared.memory {
            // SAFETY: as in `view`; `&mut self` makes this the lease's only view.
            Memory::Host(ptr) => ferrotron_comm_core::BufMut::from(unsafe {
                std::slice::from_raw_parts_mut(*ptr, shared.len)
            }),
            // SAFETY: the storage's array is never handed out whole, and its windows are
            // used only under the lock, which the lease keeps everyone else from using.
            Memory::Device(array) => unsafe { array.lend_mut() },
        }
    }
}

/// A tensor-shaped range of a [`FlatStorage`]: where one parameter's gradient lives
/// inside a bucket. Clones share the storage.
#[derive(Clone)]
pub struct FlatView<T: Element = f32> {
    storage: FlatStorage<T>,
    offset: usize,
    shape: Vec<usize>,
}

impl<T: Element> FlatView<T> {
    /// Elements `offset..offset + Π shape` of `storage`, as a tensor of `shape`; a range
    /// past the end is an error.
    pub fn new(storage: &FlatStorage<T>, offset: usize, shape: &[usize]) -> Result<Self> {
        let end = (shape.iter())
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|numel| offset.checked_add(numel));
        if end.is_none_or(|end| end > storage.len()) {
            return Err(Error::shape(
                "FlatView::new",
                &[&[storage.len()], &[offset], shape],
                "the view must lie within its storage",
            ));
        }
        Ok(FlatView {
            storage: storage.clone(),
            offset,
            shape: shape.to_vec(),
        })
    }

    /// The storage this view lies in.
    pub fn storage(&self) -> &FlatStorage<T> {
        &self.storage
    }

    /// First element of the view in its storage.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The view's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The device holding the elements.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// A copy of the elements as a tensor on the storage's device (no host transfer for a
    /// device storage).
    pub fn to_tensor(&self) -> Result<Tensor<T>> {
        const OP: &str = "FlatView::to_tensor";
        self.storage
            .access(OP, self.offset, &self.shape, |region| match region {
                Region::Host(slice) => Tensor::from_vec(slice.to_vec(), &self.shape),
                Region::Device(window) => Ok(Tensor::from_gpu(window.duplicate(OP)?)),
            })
    }

    /// A copy of the elements stored as `dtype` (`T`'s own, bf16 or f16) on the storage's
    /// device, rounded once: what a 16-bit collective sends.
    pub fn to_tensor_as(&self, dtype: DType) -> Result<Tensor<T>> {
        const OP: &str = "FlatView::to_tensor_as";
        crate::precision::check_dtype::<T>(OP, dtype)?;
        if dtype == T::DTYPE {
            return self.to_tensor();
        }
        self.storage.access(OP, self.offset, &self.shape, |region| {
            Ok(Tensor::from_half(match region {
                Region::Host(slice) => {
                    let array = ArrayView::from_shape(IxDyn(&self.shape), &*slice)
                        .map_err(|e| Error::shape(OP, &[&self.shape], e.to_string()))?;
                    Half::narrow_cpu(OP, dtype, &array)?
                }
                Region::Device(window) => Half::narrow_gpu(OP, dtype, &window)?,
            }))
        })
    }

    /// Sets every element to `value`.
    pub fn fill(&self, value: T) -> Result<()> {
        const OP: &str = "FlatView::fill";
        self.storage
            .access(OP, self.offset, &self.shape, |region| match region {
                Region::Host(slice) => {
                    slice.fill(value);
                    Ok(())
                }
                Region::Device(window) => window.fill(value),
            })
    }

    /// Overwrites the elements with `tensor`'s (same shape and device; a 16-bit tensor
    /// is widened): no host transfer for a device storage.
    pub fn copy_from(&self, tensor: &Tensor<T>) -> Result<()> {
        self.write("FlatView::copy_from", tensor, false)
    }

    /// Multiplies every element by `factor`, in place.
    pub fn scale(&self, factor: T) -> Result<()> {
        with_regions("FlatView::scale", &[self], |regions| match regions {
            Regions::Host(mut slices) => {
                slices[0].iter_mut().for_each(|x| *x *= factor);
                Ok(())
            }
            Regions::Device(windows) => {
                let window = &windows[0];
                let factor = GpuArray::full("FlatView::scale", window.device(), &[1], factor)?;
                ops::binary_into(
                    "FlatView::scale",
                    ops::BinaryKind::Mul,
                    window,
                    window,
                    &factor,
                )
            }
        })
    }

    /// The sum of the squared elements of all `views` (a gradient norm's share), on one
    /// device: accumulated in f64 view by view on the CPU; in `T` on a device, where only
    /// the total leaves it.
    pub fn sum_of_squares(views: &[FlatView<T>]) -> Result<f64> {
        const OP: &str = "FlatView::sum_of_squares";
        let mut total: Option<Tensor<T>> = None;
        let mut host = 0.0;
        for view in views {
            if view.device() == Device::Cpu {
                host += view.with_host(OP, |slice| {
                    Ok(slice
                        .iter()
                        .map(|&x| x.into_f64() * x.into_f64())
                        .sum::<f64>())
                })?;
                continue;
            }
            // Read in place under the lock; the kernels queue in the storage's stream order.
            let squares = view.with_device(OP, |window| {
                let values = Tensor::from_gpu(window.clone());
                values.mul(&values)?.sum()
            })?;
            total = Some(match total {
                Some(total) => total.add(&squares)?,
                None => squares,
            });
        }
        let device = total.map(|t| t.item()).transpose()?;
        Ok(host + device.map_or(0.0, T::into_f64))
    }

    /// Whether every element of every one of `views` times `factor` is finite. On a
    /// device only one scalar leaves it: the sum of the products times zero, which is NaN
    /// exactly when one of them is not finite.
    pub fn all_finite_scaled(views: &[FlatView<T>], factor: T) -> Result<bool> {
        const OP: &str = "FlatView::all_finite_scaled";
        let mut total: Option<Tensor<T>> = None;
        for view in views {
            if view.device() == Device::Cpu {
                if !view.with_host(OP, |slice| {
                    Ok(slice.iter().all(|&x| (x * factor).is_finite()))
                })? {
                    return Ok(false);
                }
                continue;
            }
            let flags = view.with_device(OP, |window| {
                Tensor::from_gpu(window.clone())
                    .scale(factor.into_f64())?
                    .scale(0.0)?
                    .sum()
            })?;
            total = Some(match total {
                Some(total) => total.add(&flags)?,
                None => flags,
            });
        }
        Ok(total
            .map(|t| t.item())
            .transpose()?
            .is_none_or(|t| t.is_finite()))
    }

    /// Writes `tensor` (same shape and device) into the view, or adds it to what is there.
    pub(crate) fn write(&self, op: &'static str, tensor: &Tensor<T>, add: bool) -> Result<()> {
        if tensor.shape() != self.shape.as_slice() {
            return Err(Error::shape(
                op,
                &[&self.shape, tensor.shape()],
                "a gradient must have its view's shape",
            ));
        }
        if tensor.device() != self.device() {
            return Err(Error::DeviceMismatch {
                op,
                first: self.device(),
                second: tensor.device(),
            });
        }
        self.storage
            .access(op, self.offset, &self.shape, |region| match region {
                Region::Host(slice) => {
                    // Row-major slices (the usual gradient) in one pass the compiler
                    // vectorises; other layouts element by element.
                    let source = tensor.cpu(op)?;
                    match (source.as_slice(), add) {
                        (Some(values), false) => slice.copy_from_slice(values),
                        (Some(values), true) => {
                            slice.iter_mut().zip(values).for_each(|(s, &v)| *s += v)
                        }
                        (None, false) => slice
                            .iter_mut()
                            .zip(source.iter())
                            .for_each(|(s, &v)| *s = v),
                        (None, true) => slice
                            .iter_mut()
                            .zip(source.iter())
                            .for_each(|(s, &v)| *s += v),
                    }
                    Ok(())
                }
                Region::Device(window) => {
                    let source = tensor.device_array(op, self.device())?;
                    if add {
                        ops::binary_into(op, ops::BinaryKind::Add, &window, &window, &source)
                    } else {
                        let bytes = window.len() * std::mem::size_of::<T>();
                        // SAFETY: both hold `len` elements of `T` on this device.
                        unsafe { window.stream().copy(window.ptr(), source.ptr(), bytes) }
                            .map_err(crate::Error::on_device(op, window.device()))
                    }
                }
            })
    }

    /// Runs `read` on the elements as a host slice (host storage).
    pub(crate) fn with_host<R>(
        &self,
        op: &'static str,
        read: impl FnOnce(&[T]) -> Result<R>,
    ) -> Result<R> {
        self.storage
            .access(op, self.offset, &self.shape, |region| match region {
                Region::Host(slice) => read(slice),
                Region::Device(window) => Err(Error::UnsupportedDevice {
                    op,
                    device: window.device(),
                }),
            })
    }

    /// Runs `read` on the elements as a device array (device storage).
    pub(crate) fn with_device<R>(
        &self,
        op: &'static str,
        read: impl FnOnce(&GpuArray<T>) -> Result<R>,
    ) -> Result<R> {
        self.storage
            .access(op, self.offset, &self.shape, |region| match region {
                Region::Device(window) => read(&window),
                Region::Host(_) => Err(Error::UnsupportedDevice {
                    op,
                    device: Device::Cpu,
                }),
            })
    }
}

impl<T: Element> std::fmt::Debug for FlatView<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlatView")
            .field("storage", &self.storage)
            .field("offset", &self.offset)
            .field("shape", &self.shape)
            .finish()
    }
}
