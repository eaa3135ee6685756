//! The tape: a define-by-run record of operations, owned by one model/thread, and the
//! reverse pass over it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ndarray::{ArcArray, ArrayD, IxDyn};
use parking_lot::Mutex;

use ferrotron_comm_core::DType;

use crate::parameter::ParamId;
use crate::{Element, Error, Parameter, Result, Tensor};

/// Gradients of one recorded op with respect to each of its inputs (`None`: not needed or zero).
pub(crate) type InputGrads<T> = Vec<Option<ArrayD<T>>>;

/// A CPU op's backward: gets the output gradient and which inputs need a gradient.
pub(crate) type BackwardFn<T> = Box<dyn FnOnce(ArrayD<T>, &[bool]) -> Result<InputGrads<T>> + Send>;

/// Any op's backward, on tensors of the op's device (detached from the tape).
pub(crate) type TensorBackwardFn<T> =
    Box<dyn FnOnce(Tensor<T>, &[bool]) -> Result<Vec<Option<Tensor<T>>>> + Send>;

enum NodeKind<T: Element> {
    Leaf(Parameter<T>),
    Op(OpBackward<T>),
}

enum OpBackward<T: Element> {
    /// A CPU op: its gradients stay plain arrays, with no tensor wrapping per node.
    Cpu(BackwardFn<T>),
    /// An op on any device.
    Any(TensorBackwardFn<T>),
}

/// A gradient in flight during backward: an array from CPU ops, a tensor from others.
enum Grad<T: Element> {
    Cpu(ArrayD<T>),
    Tensor(Tensor<T>),
}

impl<T: Element> Grad<T> {
    fn into_tensor(self) -> Tensor<T> {
        match self {
            Grad::Cpu(array) => Tensor::from_array(array),
            Grad::Tensor(tensor) => tensor,
        }
    }

    /// The gradient as a tensor stored in `format` (a leaf's gradient format: a
    /// parameter's is `T`'s, whatever format its contributions came in).
    fn into_stored(self, format: DType) -> Result<Tensor<T>> {
        let tensor = self.into_tensor();
        match tensor.dtype() == format {
            true => Ok(tensor),
            false => tensor.stored_as("backward", format),
        }
    }

    fn into_array(self, op: &'static str) -> Result<ArrayD<T>> {
        match self {
            Grad::Cpu(array) => Ok(array),
            Grad::Tensor(tensor) => tensor.into_cpu_array(op),
        }
    }

    /// Adds `other` in place (CPU arrays) or into a new tensor (devices, mixed), the sum
    /// rounded once to `format` (see [`conform`](Self::conform)).
    fn accumulate(self, other: Grad<T>, format: DType) -> Result<Grad<T>> {
        match (self, other) {
            (Grad::Cpu(mut mine), Grad::Cpu(theirs)) => {
                mine += &theirs;
                Grad::Cpu(mine).conform(format)
            }
            (mine, theirs) => {
                let mut sum = mine.into_tensor();
                sum.accumulate_as("backward", &theirs.into_tensor(), format)?;
                Ok(Grad::Tensor(sum))
            }
        }
    }

    /// The gradient in the format its tensor keeps gradients in: a 16-bit activation's
    /// gradient is rounded to that format, as PyTorch's and Megatron's are, so it moves
    /// half the bytes; a CPU array keeps its element type with the rounded values.
    fn conform(self, format: DType) -> Result<Grad<T>> {
        if format == T::DTYPE {
            return Ok(self);
        }
        match self {
            Grad::Cpu(mut array) => {
                crate::precision::round_in_place(&mut array, format)?;
                Ok(Grad::Cpu(array))
            }
            Grad::Tensor(tensor) if tensor.dtype() == format => Ok(Grad::Tensor(tensor)),
            Grad::Tensor(tensor) => Ok(Grad::Tensor(tensor.stored_as("backward", format)?)),
        }
    }
}

struct Node<T: Element> {
    /// Taken (left `None`) when backward visits the node, releasing what it saved.
    kind: Option<NodeKind<T>>,
    /// Tape positions of the inputs that are recorded, by argument position.
    inputs: Vec<Option<usize>>,
    /// The format its gradient is kept in (see [`Tensor::grad_format`]).
    grad_format: DType,
}

struct TapeState<T: Element> {
    nodes: Vec<Node<T>>,
    /// Bumped whenever the nodes are consumed, so tensors from older passes are recognised.
    generation: u64,
    leaves: HashMap<ParamId, usize>,
    /// Parameters [`Tape::watch`] replaces with others (see [`Tape::substitute`]).
    substitutes: HashMap<ParamId, Parameter<T>>,
}

struct TapeShared<T: Element> {
    state: Mutex<TapeState<T>>,
    recording: AtomicBool,
}

/// A tensor's position on a tape.
#[derive(Clone)]
pub(crate) struct GradLink<T: Element> {
    tape: Tape<T>,
    node: usize,
    generation: u64,
    pub(crate) grad_format: DType,
}

/// A define-by-run record of the operations of one model (or thread).
///
/// There is no global tape: each `Tape` is a value, and clones share it. Operations on
/// tensors obtained from [`watch`](Tape::watch) are recorded on that tape; `backward`
/// consumes the record, so each forward pass starts afresh and parameters must be watched
/// again in it.
#[derive(Clone)]
pub struct Tape<T: Element = f32> {
    shared: Arc<TapeShared<T>>,
}

impl<T: Element> Default for Tape<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Element> std::fmt::Debug for Tape<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tape")
            .field("recorded_nodes", &self.len())
            .field("recording", &self.is_recording())
            .finish()
    }
}

/// Restores the tape's previous recording flag when dropped (also on panic).
struct RecordingGuard<'a, T: Element> {
    tape: &'a Tape<T>,
    previous: bool,
}

impl<T: Element> Drop for RecordingGuard<'_, T> {
    fn drop(&mut self) {
        self.tape
            .shared
            .recording
            .store(self.previous, Ordering::Relaxed);
    }
}

impl<T: Element> Tape<T> {
    /// An empty tape that records.
    pub fn new() -> Self {
        Tape {
            shared: Arc::new(TapeShared {
                state: Mutex::new(TapeState {
                    nodes: Vec::new(),
                    generation: 0,
                    leaves: HashMap::new(),
                    substitutes: HashMap::new(),
                }),
                recording: AtomicBool::new(true),
            }),
        }
    }

    /// Whether operations are being recorded (false inside [`no_grad`](Tape::no_grad)).
    pub fn is_recording(&self) -> bool {
        self.shared.recording.load(Ordering::Relaxed)
    }

    /// Runs `body` without recording on this tape: results do not require grad.
    pub fn no_grad<R>(&self, body: impl FnOnce() -> R) -> R {
        let _guard = RecordingGuard {
            tape: self,
            previous: self.shared.recording.swap(false, Ordering::Relaxed),
        };
        body()
    }

    /// Number of nodes currently recorded.
    pub fn len(&self) -> usize {
        self.shared.state.lock().nodes.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops everything recorded (e.g. after a forward pass that needs no backward).
    pub fn clear(&self) {
        let mut state = self.shared.state.lock();
        state.nodes.clear();
        state.leaves.clear();
        state.generation += 1;
    }

    /// The parameter's value as a tensor recorded on this tape, so that backward reaches the
    /// parameter's gradient. Watching the same parameter twice in one pass gives one leaf.
    /// A pending value ([`Parameter::set_pending`]) lands first; if its landing failed,
    /// that error (a forward pass never runs on the value it was to replace).
    pub fn watch(&self, param: &Parameter<T>) -> Result<Tensor<T>> {
        let substitute = self
            .shared
            .state
            .lock()
            .substitutes
            .get(&param.id())
            .cloned();
        let param = substitute.as_ref().unwrap_or(param);
        let mut value = param.value()?;
        if !self.is_recording() {
            return Ok(value);
        }
        let grad_format = param.grad_format();
        let mut state = self.shared.state.lock();
        let node = match state.leaves.get(&param.id()) {
            Some(&node) => node,
            None => {
                let node = state.nodes.len();
                state.nodes.push(Node {
                    kind: Some(NodeKind::Leaf(param.clone())),
                    inputs: Vec::new(),
                    grad_format,
                });
                state.leaves.insert(param.id(), node);
                node
            }
        };
        value.link = Some(GradLink {
            tape: self.clone(),
            node,
            generation: state.generation,
            grad_format,
        });
        Ok(value)
    }

    /// Makes [`watch`](Self::watch) of `param` on this tape watch `stand_in` instead, so
    /// code that reads its parameters by watching them runs on other values and its
    /// backward fills `stand_in`'s gradient, not `param`'s (activation recomputation
    /// replays a module's forward this way).
    pub fn substitute(&self, param: &Parameter<T>, stand_in: &Parameter<T>) {
        let mut state = self.shared.state.lock();
        state.substitutes.insert(param.id(), stand_in.clone());
    }

    /// Backward from a one-element `loss`, as [`Tensor::backward`].
    pub fn backward(&self, loss: &Tensor<T>) -> Result<()> {
        match &loss.link {
            Some(link) if Arc::ptr_eq(&link.tape.shared, &self.shared) => loss.backward(),
            Some(_) => Err(Error::TapeMismatch { op: "backward" }),
            None => Err(Error::NotRecorded),
        }
    }

    /// Records an op whose inputs may be on this tape; returns the output tensor linked to it.
    fn push_op(
        &self,
        op: &'static str,
        inputs: &[&Tensor<T>],
        output: Tensor<T>,
        backward: OpBackward<T>,
        moves: bool,
    ) -> Result<Tensor<T>> {
        let grad_format = match moves {
            false => output.dtype(),
            true => moved_grad_format(inputs),
        };
        let mut state = self.shared.state.lock();
        let mut input_nodes = Vec::with_capacity(inputs.len());
        for input in inputs {
            input_nodes.push(match &input.link {
                Some(link) if link.generation != state.generation => {
                    return Err(Error::StaleGraph { op })
                }
                Some(link) => Some(link.node),
                None => None,
            });
        }
        let node = state.nodes.len();
        state.nodes.push(Node {
            kind: Some(NodeKind::Op(backward)),
            inputs: input_nodes,
            grad_format,
        });
        let mut tensor = output;
        tensor.link = Some(GradLink {
            tape: self.clone(),
            node,
            generation: state.generation,
            grad_format,
        });
        Ok(tensor)
    }
}

/// The gradient format of a view or cast: its recorded inputs' where they share one, so a
/// view or cast of parameters is still parameters (its gradient stays in `T`) and a cast
/// of a 16-bit activation to f32 hands back a 16-bit gradient, rounded where the op
/// that makes it writes it; `T`'s where they differ.
fn moved_grad_format<T: Element>(inputs: &[&Tensor<T>]) -> DType {
    let mut formats = inputs
        .iter()
        .filter(|t| t.requires_grad())
        .map(|t| t.grad_format());
    match formats.next() {
        Some(first) if formats.all(|f| f == first) => first,
        _ => T::DTYPE,
    }
}

/// Builds an op's output tensor, recording it (with the backward made by `make_backward`)
/// when an input is on a recording tape. `make_backward` is not called otherwise, so
/// untracked computation saves nothing.
pub(crate) fn record<T: Element>(
    op: &'static str,
    inputs: &[&Tensor<T>],
    output: ArcArray<T, IxDyn>,
    make_backward: impl FnOnce() -> BackwardFn<T>,
) -> Result<Tensor<T>> {
    record_stored(op, inputs, Tensor::from_shared(output), make_backward)
}

/// [`record`] for a CPU op whose output may already be stored in a 16-bit format (rows
/// of a 16-bit table, copied as they are).
pub(crate) fn record_stored<T: Element>(
    op: &'static str,
    inputs: &[&Tensor<T>],
    output: Tensor<T>,
    make_backward: impl FnOnce() -> BackwardFn<T>,
) -> Result<Tensor<T>> {
    record_link(Recorded::Computed, op, inputs, output, || {
        OpBackward::Cpu(make_backward())
    })
}

/// [`record`] for ops on any device: the backward takes and returns tensors.
pub(crate) fn record_tensor<T: Element>(
    op: &'static str,
    inputs: &[&Tensor<T>],
    output: Tensor<T>,
    make_backward: impl FnOnce() -> TensorBackwardFn<T>,
) -> Result<Tensor<T>> {
    record_as(Recorded::Computed, op, inputs, output, make_backward)
}

/// What an op does to the format of its result and its gradient.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// Computes: the result is rounded to its inputs' shared 16-bit format and keeps its
    /// gradient in its own format.
    Computed,
    /// A loss: the result stays in `T` whatever its inputs' formats (PyTorch's autocast
    /// keeps a loss's sums in f32 too), and so does its gradient.
    Loss,
    /// A cast: the result keeps the format it is given; its gradient is kept as its
    /// inputs keep theirs (see [`moved_grad_format`]).
    Cast,
    /// Moves elements (reshape, transpose, narrow, concatenation): rounded like a
    /// computed result, its gradient kept as its inputs keep theirs, so a weight read
    /// through a transpose gets the gradient a product reading it transposed in place
    /// gives it.
    View,
}

/// [`record_tensor`] for an op of any [`Recorded`] kind.
pub(crate) fn record_as<T: Element>(
    kind: Recorded,
    op: &'static str,
    inputs: &[&Tensor<T>],
    output: Tensor<T>,
    make_backward: impl FnOnce() -> TensorBackwardFn<T>,
) -> Result<Tensor<T>> {
    record_link(
        kind,
        op,
        inputs,
        output,
        || OpBackward::Any(make_backward()),
    )
}

/// [`record`] for a CPU op of any [`Recorded`] kind.
pub(crate) fn record_cpu_as<T: Element>(
    kind: Recorded,
    op: &'static str,
    inputs: &[&Tensor<T>],
    output: ArcArray<T, IxDyn>,
    make_backward: impl FnOnce() -> BackwardFn<T>,
) -> Result<Tensor<T>> {
    let output = Tensor::from_shared(output);
    record_link(
        kind,
        op,
        inputs,
        output,
        || OpBackward::Cpu(make_backward()),
    )
}

/// [`record`] for an op whose backward reads its own output: `make_backward` gets the
/// output as the tape stores it (rounded once to the inputs' 16-bit format where they
/// share one), the same bytes the next op usually keeps, so nothing is held twice. This
/// is what PyTorch's softmax backward and Megatron's fused softmax read.
pub(crate) fn record_reading_output<T: Element>(
    op: &'static str,
    inputs: &[&Tensor<T>],
    output: ArcArray<T, IxDyn>,
    make_backward: impl FnOnce(Tensor<T>) -> BackwardFn<T>,
) -> Result<Tensor<T>> {
    let output = stored(op, inputs, Tensor::from_shared(output))?;
    let kept = output.detach();
    record_link(Recorded::Computed, op, inputs, output, || {
        OpBackward::Cpu(make_backward(kept))
    })
}

/// [`record_reading_output`] for ops on any device.
pub(crate) fn record_tensor_reading_output<T: Element>(
    op: &'static str,
    inputs: &[&Tensor<T>],
    output: Tensor<T>,
    make_backward: impl FnOnce(Tensor<T>) -> TensorBackwardFn<T>,
) -> Result<Tensor<T>> {
    let output = stored(op, inputs, output)?;
    let kept = output.detach();
    record_link(Recorded::Computed, op, inputs, output, || {
        OpBackward::Any(make_backward(kept))
    })
}

/// `output` in the format its inputs promote to.
fn stored<T: Element>(
    op: &'static str,
    inputs: &[&Tensor<T>],
    output: Tensor<T>,
) -> Result<Tensor<T>> {
    let format = crate::precision::promoted(inputs);
    if format != output.dtype() && output.dtype() == T::DTYPE {
        output.stored_as(op, format)
    } else {
        Ok(output)
    }
}

/// Records `output` (rounded where `kind` rounds) when an input is on a recording tape.
fn record_link<T: Element>(
    kind: Recorded,
    op: &'static str,
    inputs: &[&Tensor<T>],
    output: Tensor<T>,
    make_backward: impl FnOnce() -> OpBackward<T>,
) -> Result<Tensor<T>> {
    let output = match kind {
        Recorded::Computed | Recorded::View => stored(op, inputs, output)?,
        Recorded::Loss | Recorded::Cast => output,
    };
    let mut tape: Option<&Tape<T>> = None;
    for input in inputs {
        if let Some(link) = &input.link {
            match tape {
                Some(seen) if !Arc::ptr_eq(&seen.shared, &link.tape.shared) => {
                    return Err(Error::TapeMismatch { op })
                }
                _ => tape = Some(&link.tape),
            }
        }
    }
    match tape {
        Some(tape) if tape.is_recording() => {
            let moves = matches!(kind, Recorded::Cast | Recorded::View);
            tape.push_op(op, inputs, output, make_backward(), moves)
        }
        _ => Ok(output),
    }
}

impl<T: Element> Tensor<T> {
    /// Reverse pass from this one-element tensor (usually a loss): accumulates d(self)/d(p)
    /// into the gradient of every parameter `p` that reached it, firing each parameter's
    /// grad-ready hooks as soon as its gradient is complete. Consumes the tape's record.
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            return Err(Error::shape(
                "backward",
                &[self.shape()],
                "an implicit output gradient needs a one-element tensor; use backward_with_grad",
            ));
        }
        let seed = Tensor::full_on(self.shape(), T::one(), self.device())?;
        self.backward_from(seed)
    }

    /// Reverse pass seeded with `grad` (same shape as `self`) as d(loss)/d(self).
    pub fn backward_with_grad(&self, grad: &Tensor<T>) -> Result<()> {
        check_seed(self.shape(), self.device(), grad)?;
        self.backward_from(grad.detach())
    }

    /// What a later [`GradHandle::backward_with_grad`] needs of this tensor, without its
    /// values: a pipeline stage that has sent an activation on keeps only this (and what
    /// the recorded ops saved), as Megatron's `deallocate_output_tensor` does. `None`
    /// when the tensor is not recorded on a tape.
    pub fn grad_handle(&self) -> Option<GradHandle<T>> {
        Some(GradHandle {
            link: self.link.clone()?,
            shape: self.shape().to_vec(),
            device: self.device(),
        })
    }

    fn backward_from(&self, seed: Tensor<T>) -> Result<()> {
        let link = self.link.as_ref().ok_or(Error::NotRecorded)?;
        backward_from_link(link, seed)
    }
}

/// A recorded tensor's place on its tape, shape and device, without its values (see
/// [`Tensor::grad_handle`]).
#[derive(Clone)]
pub struct GradHandle<T: Element = f32> {
    link: GradLink<T>,
    shape: Vec<usize>,
    device: crate::Device,
}

impl<T: Element> GradHandle<T> {
    /// The tensor's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The tensor's device.
    pub fn device(&self) -> crate::Device {
        self.device
    }

    /// Reverse pass seeded with `grad` as d(loss)/d(tensor), as
    /// [`Tensor::backward_with_grad`] on the tensor would run it.
    pub fn backward_with_grad(&self, grad: &Tensor<T>) -> Result<()> {
        check_seed(&self.shape, self.device, grad)?;
        backward_from_link(&self.link, grad.detach())
    }
}

fn check_seed<T: Element>(shape: &[usize], device: crate::Device, grad: &Tensor<T>) -> Result<()> {
    if grad.shape() != shape {
        return Err(Error::shape(
            "backward_with_grad",
            &[shape, grad.shape()],
            "the seed gradient must have the tensor's shape",
        ));
    }
    if grad.device() != device {
        return Err(Error::DeviceMismatch {
            op: "backward_with_grad",
            first: device,
            second: grad.device(),
        });
    }
    Ok(())
}

fn backward_from_link<T: Element>(link: &GradLink<T>, seed: Tensor<T>) -> Result<()> {
    let mut nodes = {
        let mut state = link.tape.shared.state.lock();
        if state.generation != link.generation {
            return Err(Error::StaleGraph { op: "backward" });
        }
        state.leaves.clear();
        state.generation += 1;
        // Take the record out so ops (e.g. in hooks) can record a new pass meanwhile.
        std::mem::take(&mut state.nodes)
    };
    let root = link.node;
    nodes.truncate(root + 1);
    run_backward(nodes, root, seed)
}

fn run_backward<T: Element>(mut nodes: Vec<Node<T>>, root: usize, seed: Tensor<T>) -> Result<()> {
    // Count, for each node reachable from the root, how many edges will deliver a gradient to
    // it; a leaf is complete (and its hooks may fire) when that count reaches zero.
    let mut needed = vec![false; nodes.len()];
    let mut pending = vec![0u32; nodes.len()];
    needed[root] = true;
    for index in (0..=root).rev() {
        if needed[index] {
            for &input in nodes[index].inputs.iter().flatten() {
                needed[input] = true;
                pending[input] += 1;
            }
        }
    }

    let mut grads: Vec<Option<Grad<T>>> = Vec::with_capacity(nodes.len());
    grads.resize_with(nodes.len(), || None);
    grads[root] = Some(Grad::Tensor(seed).conform(nodes[root].grad_format)?);

    // Tape order is a topological order, so walking it backwards visits every node after
    // all of its consumers.
    for index in (0..=root).rev() {
        if !needed[index] {
            continue;
        }
        let inputs = std::mem::take(&mut nodes[index].inputs);
        let backward = match nodes[index].kind.take() {
            None => continue,
            Some(NodeKind::Leaf(param)) => {
                // Only the root can be a leaf that nobody finished yet; others were
                // finished when their last contribution arrived.
                if let Some(grad) = grads[index].take() {
                    param.accumulate_and_notify(grad.into_stored(param.grad_format())?)?;
                }
                continue;
            }
            Some(NodeKind::Op(backward)) => backward,
        };
        let input_grads: Vec<Option<Grad<T>>> = match grads[index].take() {
            Some(grad) => {
                let needs: Vec<bool> = inputs.iter().map(Option::is_some).collect();
                match backward {
                    OpBackward::Cpu(backward) => backward(grad.into_array("backward")?, &needs)?
                        .into_iter()
                        .map(|g| g.map(Grad::Cpu))
                        .collect(),
                    OpBackward::Any(backward) => backward(grad.into_tensor(), &needs)?
                        .into_iter()
                        .map(|g| g.map(Grad::Tensor))
                        .collect(),
                }
            }
            None => Vec::new(),
        };
        // Dropping `backward` above released the tensors it saved.
        let mut input_grads = input_grads.into_iter();
        for input in inputs {
            let grad = input_grads.next().flatten();
            let Some(input) = input else { continue };
            if let Some(grad) = grad {
                let format = nodes[input].grad_format;
                grads[input] = Some(match grads[input].take() {
                    Some(existing) => existing.accumulate(grad.conform(format)?, format)?,
                    None => grad.conform(format)?,
                });
            }
            pending[input] -= 1;
            if pending[input] == 0 {
                if let Some(NodeKind::Leaf(param)) = &nodes[input].kind {
                    if let Some(grad) = grads[input].take() {
                        param.accumulate_and_notify(grad.into_stored(param.grad_format())?)?;
                    }
                }
            }
        }
    }
    Ok(())
}
