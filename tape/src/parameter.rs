//! Trainable leaves: a value, a gradient slot that backward accumulates into, and
//! grad-ready hooks.

use std::fmt;
use std::sync::Arc;
use std::thread::ThreadId;

use parking_lot::{Condvar, Mutex};

use crate::gpu::GpuArray;
use crate::{DType, Element, Error, FlatView, Result, Tensor};

/// A grad-ready hook: called with the parameter as soon as its gradient for the current
/// backward pass is complete. An error stops backward and is returned from it.
pub type GradHook<T> = Box<dyn FnMut(&Parameter<T>) -> Result<()> + Send>;

/// Identity of a parameter, stable while the parameter is alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(usize);

struct ParamShared<T: Element> {
    name: String,
    /// Whether it stands in for an activation (see [`Parameter::activation`]).
    activation: bool,
    value: Mutex<Tensor<T>>,
    /// Work that sets the value before it is next read ([`Parameter::set_pending`]).
    pending: Mutex<Option<PendingValue>>,
    grad: Mutex<GradSlot<T>>,
    hooks: Mutex<Vec<GradHook<T>>>,
}

/// Work that sets some parameters' values later, run by the first read of any of them
/// ([`Parameter::set_pending`]): a bucket of parameters all-gathered after the optimizer's
/// step lands just before the next forward reads it, so the gather runs beside the
/// step's end and the forward's start (Megatron's `--overlap-param-gather`). Clones share
/// the work, which runs once.
#[derive(Clone)]
pub struct PendingValue(Arc<Shared>);

struct Shared {
    state: Mutex<Landing>,
    /// Notified when a landing that was running ends.
    ended: Condvar,
}

enum Landing {
    Waiting(Box<dyn FnOnce() -> Result<()> + Send>),
    /// Running on this thread (whose own `set_value` calls must not wait for it; another
    /// thread's reads wait until it ends).
    Running(ThreadId),
    Landed,
    /// It failed; the values stayed as they were.
    Failed(String),
}

impl PendingValue {
    /// Work that `land` does: it sets the values (with [`Parameter::set_value`]) of the
    /// parameters it is given to.
    pub fn new(land: impl FnOnce() -> Result<()> + Send + 'static) -> Self {
        PendingValue(Arc::new(Shared {
            state: Mutex::new(Landing::Waiting(Box::new(land))),
            ended: Condvar::new(),
        }))
    }

    /// Runs the work unless it ran already (waiting for it if another thread is running
    /// it); its error, now or on every later call.
    pub fn land(&self) -> Result<()> {
        let me = std::thread::current().id();
        let mut state = self.0.state.lock();
        while matches!(&*state, Landing::Running(id) if *id != me) {
            self.0.ended.wait(&mut state);
        }
        let work = match std::mem::replace(&mut *state, Landing::Running(me)) {
            Landing::Waiting(work) => work,
            // Landed, failed, or running further up this thread's stack.
            other => {
                let result = match &other {
                    Landing::Failed(message) => Err(Error::custom(
                        "a parameter's pending value",
                        message.clone(),
                    )),
                    _ => Ok(()),
                };
                *state = other;
                return result;
            }
        };
        drop(state);
        // Should `work` panic, the guard marks the landing failed as the panic unwinds,
        // so that readers on other threads stop waiting for it.
        let mut guard = Running {
            shared: &self.0,
            ended: None,
        };
        let outcome = work();
        guard.ended = Some(match &outcome {
            Ok(()) => Landing::Landed,
            Err(error) => Landing::Failed(error.to_string()),
        });
        drop(guard);
        outcome
    }
}

/// A landing under way: when dropped, it records how the landing ended (failed, if it
/// never said: its work panicked) and wakes the threads waiting for it.
struct Running<'a> {
    shared: &'a Shared,
    ended: Option<Landing>,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let ended = self
            .ended
            .take()
            .unwrap_or_else(|| Landing::Failed("the work that lands it panicked".to_string()));
        *self.shared.state.lock() = ended;
        self.shared.ended.notify_all();
    }
}

/// Where backward accumulates a parameter's gradient.
enum GradSlot<T: Element> {
    /// A tensor of its own (`None` until backward reaches the parameter).
    Own(Option<Tensor<T>>),
    /// A view into flat storage (a gradient bucket), accumulated in place; `written`
    /// says whether it holds this pass's gradient (zeroing is forgetting, not a fill).
    Main { view: FlatView<T>, written: bool },
}

impl<T: Element> GradSlot<T> {
    fn has_grad(&self) -> bool {
        match self {
            GradSlot::Own(grad) => grad.is_some(),
            GradSlot::Main { written, .. } => *written,
        }
    }

    /// A snapshot: the tensor itself, or a copy of the view (an error while a collective
    /// holds the view's storage, or when the copy fails).
    fn snapshot(&self) -> Result<Option<Tensor<T>>> {
        match self {
            GradSlot::Own(grad) => Ok(grad.clone()),
            GradSlot::Main { view, written } => written.then(|| view.to_tensor()).transpose(),
        }
    }

    fn clear(&mut self) {
        match self {
            GradSlot::Own(grad) => *grad = None,
            GradSlot::Main { written, .. } => *written = false,
        }
    }
}

/// A trainable tensor with a gradient slot. Clones share the same parameter.
///
/// Use it in a forward pass through [`Tape::watch`](crate::Tape::watch); backward then
/// accumulates into [`grad`](Parameter::grad) until [`zero_grad`](Parameter::zero_grad).
#[derive(Clone)]
pub struct Parameter<T: Element = f32> {
    shared: Arc<ParamShared<T>>,
}

impl<T: Element> Parameter<T> {
    /// A parameter holding `value` (detached from any tape), with no gradient yet.
    pub fn new(name: impl Into<String>, value: Tensor<T>) -> Self {
        Self::leaf(name.into(), value, false)
    }

    /// A leaf standing in for an activation: a pipeline stage's received input, or a
    /// recomputed block's. Its gradient is kept in the format its value is stored in,
    /// as the activation's own would be (see [`Tensor::grad_format`]), so a stage or a
    /// replay hands back the same bits the whole model computes.
    pub fn activation(name: impl Into<String>, value: Tensor<T>) -> Self {
        Self::leaf(name.into(), value, true)
    }

    fn leaf(name: String, value: Tensor<T>, activation: bool) -> Self {
        Parameter {
            shared: Arc::new(ParamShared {
                name,
                activation,
                value: Mutex::new(value.detach()),
                pending: Mutex::new(None),
                grad: Mutex::new(GradSlot::Own(None)),
                hooks: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The format backward keeps its gradient in: `T`'s, or for an
    /// [`activation`](Self::activation) its value's.
    pub(crate) fn grad_format(&self) -> DType {
        match self.shared.activation {
            true => self.shared.value.lock().dtype(),
            false => T::DTYPE,
        }
    }

    /// The name given at construction.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Identity shared by all clones of this parameter.
    pub fn id(&self) -> ParamId {
        ParamId(Arc::as_ptr(&self.shared) as *const () as usize)
    }

    /// The current value (a cheap clone, not recorded on any tape), once a pending value
    /// has landed ([`set_pending`](Self::set_pending)): if that failed, its error, now
    /// and at every later read, never the value it was to replace.
    pub fn value(&self) -> Result<Tensor<T>> {
        self.settle()?;
        Ok(self.shared.value.lock().clone())
    }

    /// The format the value is stored in (a pending value lands in the same).
    pub fn dtype(&self) -> DType {
        self.shared.value.lock().dtype()
    }

    /// The device the value lives on (a pending value lands on the same).
    pub fn device(&self) -> crate::Device {
        self.shared.value.lock().device()
    }

    /// Makes `pending` set this parameter's value before anything reads or writes it:
    /// every reader runs it first (the tape's `watch` included).
    pub fn set_pending(&self, pending: &PendingValue) {
        *self.shared.pending.lock() = Some(pending.clone());
    }

    /// Lands a pending value now, if there is one; the error it met, if it failed (then
    /// on every call, so that a fallible caller reports it).
    pub fn settle(&self) -> Result<()> {
        let pending = self.shared.pending.lock().clone();
        match pending {
            Some(pending) => {
                let landed = pending.land();
                if landed.is_ok() {
                    self.shared.pending.lock().take();
                }
                landed
            }
            None => Ok(()),
        }
    }

    /// Shape of the value.
    pub fn shape(&self) -> Vec<usize> {
        self.shared.value.lock().shape().to_vec()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shared.value.lock().numel()
    }

    /// Replaces the value; the shape must stay the same. A pending value lands first
    /// (unless this call is its landing), so it cannot overwrite this one later.
    pub fn set_value(&self, value: Tensor<T>) -> Result<()> {
        self.settle()?;
        let mut current = self.shared.value.lock();
        if current.shape() != value.shape() {
            return Err(Error::shape(
                "Parameter::set_value",
                &[current.shape(), value.shape()],
                "a parameter keeps its shape",
            ));
        }
        *current = value.detach();
        Ok(())
    }

    /// Copies elements `offset..offset + out.len()` of the value (flattened, row-major)
    /// into `out`: no allocation for a host value; from a device value only those
    /// elements are downloaded.
    pub fn read_flat(&self, offset: usize, out: &mut [T]) -> Result<()> {
        self.settle()?;
        read_flat(&self.shared.value.lock(), offset, out)
    }

    /// Copies elements `offset..offset + out.numel()` of the value (flattened, row-major,
    /// widened from 16 bits) into `out`, on the same device: no host transfer for a
    /// device value.
    pub fn read_flat_into(&self, offset: usize, out: &FlatView<T>) -> Result<()> {
        const OP: &str = "Parameter::read_flat_into";
        // A handle on the value, so that no lock of this parameter is held while the
        // view's storage is locked (backward takes them the other way round).
        let value = self.value()?;
        if out.device() == crate::Device::Cpu {
            return crate::flat::with_regions(OP, &[out], |regions| match regions {
                crate::flat::Regions::Host(mut slices) => read_flat(&value, offset, slices[0]),
                crate::flat::Regions::Device(_) => unreachable!("a CPU view"),
            });
        }
        flat_range(OP, value.numel(), offset, out.numel())?;
        // A window of the value's memory (16 bits: that range widened), then one copy.
        let piece =
            value
                .gpu_range(OP, offset, out.shape())?
                .ok_or(crate::Error::DeviceMismatch {
                    op: OP,
                    first: out.device(),
                    second: value.device(),
                })?;
        out.copy_from(&Tensor::from_gpu(piece))
    }

    /// Overwrites elements `offset..offset + values.len()` of the value (flattened,
    /// row-major) in place: no allocation for a host value that nothing else holds (one
    /// that a tensor still shares is copied first, so that tensor keeps its values); a
    /// device value, or a 16-bit one, is replaced by an updated copy in its format (one
    /// upload, and a download of the old value only when part of it stays).
    pub fn write_flat(&self, offset: usize, values: &[T]) -> Result<()> {
        const OP: &str = "Parameter::write_flat";
        self.settle()?;
        let mut value = self.shared.value.lock();
        let range = flat_range(OP, value.numel(), offset, values.len())?;
        if let Ok(array) = value.cpu_mut(OP) {
            match array.as_slice_mut() {
                Some(all) => all[range].copy_from_slice(values),
                None => array
                    .iter_mut()
                    .skip(offset)
                    .zip(values)
                    .for_each(|(a, v)| *a = *v),
            }
            return Ok(());
        }
        let host = if range.len() == value.numel() {
            values.to_vec()
        } else {
            let mut host = value.to_vec()?;
            host[range].copy_from_slice(values);
            host
        };
        let (shape, device, dtype) = (value.shape().to_vec(), value.device(), value.dtype());
        // Rounded before it moves, so a 16-bit value uploads 2 bytes an element.
        *value = Tensor::from_vec(host, &shape)?
            .stored_as(OP, dtype)?
            .to_device(device)?;
        Ok(())
    }

    /// The accumulated gradient, or `None` if no backward reached this parameter since the
    /// last [`zero_grad`](Parameter::zero_grad). With a [main
    /// gradient](Self::attach_main_grad) it is a copy of the view (on its device), and
    /// also `None` while a collective holds the view's storage (a data-parallel bucket
    /// being reduced, until DDP's `finish`) or if the copy fails: see
    /// [`try_grad`](Self::try_grad).
    pub fn grad(&self) -> Option<Tensor<T>> {
        self.try_grad().ok().flatten()
    }

    /// [`grad`](Self::grad), with the reason when a main gradient cannot be read
    /// ([`Error::Leased`] while a collective holds it, or a failed device copy) instead
    /// of `None`. Library code that must not mistake a failure for "no gradient" uses it.
    pub fn try_grad(&self) -> Result<Option<Tensor<T>>> {
        self.shared.grad.lock().snapshot()
    }

    /// Whether backward has produced a gradient since the last zeroing (no copy).
    pub fn has_grad(&self) -> bool {
        self.shared.grad.lock().has_grad()
    }

    /// Removes and returns the gradient; `None`, and nothing removed, while a collective
    /// holds the main gradient's storage (see [`try_grad`](Self::try_grad)).
    pub fn take_grad(&self) -> Option<Tensor<T>> {
        let mut slot = self.shared.grad.lock();
        let grad = slot.snapshot().ok()?;
        slot.clear();
        grad
    }

    /// Makes `view` this parameter's gradient storage (Megatron's `main_grad`, PyTorch's
    /// `gradient_as_bucket_view`): backward then accumulates into it in place, and
    /// [`grad`](Self::grad) reads it. The view must have the value's shape and device; a
    /// gradient the parameter holds is copied in.
    pub fn attach_main_grad(&self, view: FlatView<T>) -> Result<()> {
        const OP: &str = "Parameter::attach_main_grad";
        let (shape, device) = {
            let value = self.shared.value.lock();
            (value.shape().to_vec(), value.device())
        };
        if view.shape() != shape.as_slice() {
            return Err(Error::shape(
                OP,
                &[&shape, view.shape()],
                "a main gradient has its parameter's shape",
            ));
        }
        if view.device() != device {
            return Err(Error::DeviceMismatch {
                op: OP,
                first: device,
                second: view.device(),
            });
        }
        let mut slot = self.shared.grad.lock();
        let current = slot.snapshot()?;
        if let Some(grad) = &current {
            view.write(OP, grad, false)?;
        }
        *slot = GradSlot::Main {
            view,
            written: current.is_some(),
        };
        Ok(())
    }

    /// The attached main-gradient view, if any.
    pub fn main_grad(&self) -> Option<FlatView<T>> {
        match &*self.shared.grad.lock() {
            GradSlot::Main { view, .. } => Some(view.clone()),
            GradSlot::Own(_) => None,
        }
    }

    /// Marks the main gradient as holding (`true`) or not holding this pass's gradient,
    /// for code that fills the view itself (a collective that reduced it in place, or
    /// zeros for an unused parameter). Without a main gradient it is an error.
    pub fn set_main_grad_written(&self, written: bool) -> Result<()> {
        match &mut *self.shared.grad.lock() {
            GradSlot::Main { written: w, .. } => {
                *w = written;
                Ok(())
            }
            GradSlot::Own(_) => Err(Error::invalid(
                "Parameter::set_main_grad_written",
                format!("{} has no main gradient attached", self.shared.name),
            )),
        }
    }

    /// Replaces the gradient (e.g. with an all-reduced one); its shape and device must
    /// match the value's ([`Error::Shape`], [`Error::DeviceMismatch`]), since optimizers
    /// and backward's accumulation run on the value's device.
    pub fn set_grad(&self, grad: Option<Tensor<T>>) -> Result<()> {
        const OP: &str = "Parameter::set_grad";
        if let Some(grad) = &grad {
            let value = self.shared.value.lock();
            if grad.shape() != value.shape() {
                return Err(Error::shape(
                    OP,
                    &[value.shape(), grad.shape()],
                    "gradient shape must equal the parameter's",
                ));
            }
            if grad.device() != value.device() {
                return Err(Error::DeviceMismatch {
                    op: OP,
                    first: value.device(),
                    second: grad.device(),
                });
            }
        }
        match &mut *self.shared.grad.lock() {
            GradSlot::Own(slot) => *slot = grad.map(|g| g.detach()),
            GradSlot::Main { view, written } => {
                if let Some(grad) = &grad {
                    view.write(OP, grad, false)?;
                }
                *written = grad.is_some();
            }
        }
        Ok(())
    }

    /// Drops the gradient (PyTorch's `set_to_none` behaviour; a main gradient keeps its
    /// memory, and the next backward overwrites it instead of adding).
    pub fn zero_grad(&self) {
        self.shared.grad.lock().clear();
    }

    /// Registers a hook that fires each time backward completes this parameter's gradient.
    /// Hooks run in registration order on the thread running backward; a hook must not
    /// register further hooks on the same parameter.
    pub fn register_grad_hook(
        &self,
        hook: impl FnMut(&Parameter<T>) -> Result<()> + Send + 'static,
    ) {
        self.shared.hooks.lock().push(Box::new(hook));
    }

    /// Removes all grad-ready hooks.
    pub fn clear_grad_hooks(&self) {
        self.shared.hooks.lock().clear();
    }

    /// Adds a finished gradient contribution to the slot, then runs the hooks.
    pub(crate) fn accumulate_and_notify(&self, contribution: Tensor<T>) -> Result<()> {
        {
            let mut slot = self.shared.grad.lock();
            match &mut *slot {
                GradSlot::Own(own @ None) => *own = Some(contribution),
                // Copy-on-write: a clone handed out by grad() keeps its old values.
                GradSlot::Own(Some(existing)) => {
                    existing.accumulate_as("backward", &contribution, self.grad_format())?
                }
                GradSlot::Main { view, written } => {
                    view.write("backward", &contribution, *written)
                        .map_err(|e| match e {
                            Error::Leased { op, .. } => Error::Leased {
                                op,
                                parameter: Some(self.shared.name.clone()),
                            },
                            other => other,
                        })?;
                    *written = true;
                }
            }
        }
        let mut hooks = self.shared.hooks.lock();
        for hook in hooks.iter_mut() {
            hook(self)?;
        }
        Ok(())
    }

    /// Runs `update` on the value and gradient in place (used by optimizers), as
    /// contiguous slices in the same element order. Parameters without a gradient are
    /// skipped and `Ok(false)` is returned.
    pub(crate) fn update_in_place(
        &self,
        op: &'static str,
        update: impl FnOnce(&mut [T], &[T]) -> Result<()>,
    ) -> Result<bool> {
        self.settle()?;
        let grad_slot = self.shared.grad.lock();
        if !grad_slot.has_grad() {
            return Ok(false);
        }
        let mut value = self.shared.value.lock();
        let value = value.cpu_mut(op)?;
        if !value.is_standard_layout() {
            *value = value.as_standard_layout().into_owned().into_shared();
        }
        let values = value
            .as_slice_mut()
            .ok_or_else(|| Error::invalid(op, "a parameter is not contiguous after a copy"))?;
        match &*grad_slot {
            GradSlot::Own(Some(grad)) => match grad.cpu(op)?.as_standard_layout().as_slice() {
                Some(grads) => update(values, grads)?,
                None => {
                    return Err(Error::invalid(
                        op,
                        "a gradient is not contiguous after a copy",
                    ))
                }
            },
            GradSlot::Main { view, .. } => view.with_host(op, |grads| update(values, grads))?,
            GradSlot::Own(None) => unreachable!("has_grad checked above"),
        }
        Ok(true)
    }
}

impl<T: Element> Parameter<T> {
    /// Whether the value lives on a device (optimizers then use their device kernels).
    pub(crate) fn on_device(&self) -> bool {
        self.shared.value.lock().device() != crate::Device::Cpu
    }

    /// The device counterpart of [`update_in_place`](Self::update_in_place): `update`
    /// writes the (private) device value in place given the gradient.
    pub(crate) fn update_on_device(
        &self,
        op: &'static str,
        update: impl FnOnce(&GpuArray<T>, &GpuArray<T>) -> Result<()>,
    ) -> Result<bool> {
        self.settle()?;
        let grad_slot = self.shared.grad.lock();
        let mut value = self.shared.value.lock();
        let device = value.device();
        match &*grad_slot {
            GradSlot::Own(None) | GradSlot::Main { written: false, .. } => return Ok(false),
            GradSlot::Own(Some(grad)) => {
                update(value.gpu_unique(op)?, &grad.device_array(op, device)?)?
            }
            GradSlot::Main { view, .. } => {
                let value = value.gpu_unique(op)?;
                view.with_device(op, |grad| update(value, grad))?
            }
        }
        Ok(true)
    }
}

impl<T: Element> fmt::Debug for Parameter<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Parameter")
            .field("name", &self.name())
            .field("shape", &self.shape())
            .field("has_grad", &self.has_grad())
            .finish()
    }
}

/// Elements `offset..offset + out.len()` of `value` (flattened, row-major) into `out`:
/// no allocation for a host value; from a device value only those elements are
/// downloaded.
fn read_flat<T: Element>(value: &Tensor<T>, offset: usize, out: &mut [T]) -> Result<()> {
    const OP: &str = "Parameter::read_flat";
    let numel = value.numel();
    let range = flat_range(OP, numel, offset, out.len())?;
    match value.cpu(OP) {
        Ok(array) => match array.as_slice() {
            Some(all) => out.copy_from_slice(&all[range]),
            None => out
                .iter_mut()
                .zip(array.iter().skip(offset))
                .for_each(|(o, v)| *o = *v),
        },
        Err(_) => {
            let piece = value.reshape(&[numel])?.narrow(0, offset, out.len())?;
            out.copy_from_slice(&piece.to_vec()?);
        }
    }
    Ok(())
}

/// `offset..offset + len` if it lies within `numel` elements.
fn flat_range(
    op: &'static str,
    numel: usize,
    offset: usize,
    len: usize,
) -> Result<std::ops::Range<usize>> {
    match offset.checked_add(len) {
        Some(end) if end <= numel => Ok(offset..end),
        _ => Err(Error::shape(
            op,
            &[&[numel], &[offset, len]],
            "elements offset..offset + len must lie within the parameter",
        )),
    }
}
