//! Elementwise arithmetic with broadcasting, and pointwise functions.

use ndarray::{ArcArray, ArrayD, IxDyn, Zip};

use super::{broadcast_shape, pointwise, pointwise_inputs, sum_to_shape};
use crate::gpu::ops::{
    self as device, AddedBias, BinaryKernel, BinaryKind, PointwiseInput, PointwiseWrite, UnaryKind,
};
use crate::gpu::{GpuArray, Stored};
use crate::precision::{promoted, written, Kept};
use crate::tape::{
    record, record_reading_output, record_tensor, record_tensor_reading_output, BackwardFn,
    TensorBackwardFn,
};
use crate::{DType, Element, Error, Result, Tensor};

/// Which GELU formula to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Gelu {
    /// `x · Φ(x)` with the exact normal CDF.
    #[default]
    Erf,
    /// The tanh approximation `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    Tanh,
}

#[derive(Clone, Copy)]
enum Binary {
    Add,
    Sub,
    Mul,
    Div,
}

impl Binary {
    fn device_kind(self) -> BinaryKind {
        match self {
            Binary::Add => BinaryKind::Add,
            Binary::Sub => BinaryKind::Sub,
            Binary::Mul => BinaryKind::Mul,
            Binary::Div => BinaryKind::Div,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
            Binary::Div => "div",
        }
    }
}

/// `f` applied to `a` and `b` broadcast to `shape`.
fn zip_broadcast<T: Element>(
    op: &'static str,
    a: &ArcArray<T, IxDyn>,
    b: &ArcArray<T, IxDyn>,
    shape: &[usize],
    f: impl Fn(T, T) -> T,
) -> Result<ArrayD<T>> {
    if a.shape() == b.shape() {
        return Ok(Zip::from(a).and(b).map_collect(|&x, &y| f(x, y)));
    }
    let mismatch = || Error::shape(op, &[a.shape(), b.shape()], "cannot broadcast");
    let av = a.broadcast(IxDyn(shape)).ok_or_else(mismatch)?;
    let bv = b.broadcast(IxDyn(shape)).ok_or_else(mismatch)?;
    Ok(Zip::from(&av).and(&bv).map_collect(|&x, &y| f(x, y)))
}

impl<T: Element> Tensor<T> {
    fn binary(&self, other: &Tensor<T>, kind: Binary) -> Result<Tensor<T>> {
        let op = kind.name();
        if let Some([a, b]) = pointwise_inputs(op, [self, other])? {
            let shape = broadcast_shape(op, a.shape, b.shape)?;
            let kernel = BinaryKernel {
                op,
                kind: kind.device_kind(),
                a,
                b,
            };
            let format = promoted(&[self, other]);
            let out = written(op, self.device(), &shape, format, &kernel)?;
            let formats = [self.grad_format(), other.grad_format()];
            return record_tensor(op, &[self, other], out, || {
                // The inputs as stored, which backward reads so.
                let (a, b) = (self.detach(), other.detach());
                Box::new(move |grad: Tensor<T>, needs: &[bool]| {
                    let on = a.device();
                    let operands = [a.device_input(op, on)?, b.device_input(op, on)?];
                    binary_backward_on_device(op, kind, &grad, needs, operands, formats)
                })
            });
        }
        let a = self.cpu(op)?;
        let b = other.cpu(op)?;
        let shape = broadcast_shape(op, a.shape(), b.shape())?;
        let out = match kind {
            Binary::Add => zip_broadcast(op, &a, &b, &shape, |x, y| x + y)?,
            Binary::Sub => zip_broadcast(op, &a, &b, &shape, |x, y| x - y)?,
            Binary::Mul => zip_broadcast(op, &a, &b, &shape, |x, y| x * y)?,
            Binary::Div => zip_broadcast(op, &a, &b, &shape, |x, y| x / y)?,
        };
        record(op, &[self, other], out.into_shared(), || {
            let (a, b) = (self.detach(), other.detach());
            let backward: BackwardFn<T> = Box::new(move |grad, needs| {
                binary_backward(kind, grad, needs, &a.cpu(op)?, &b.cpu(op)?)
            });
            backward
        })
    }

    /// `self + other`, with NumPy broadcasting (e.g. a bias over leading dimensions).
    pub fn add(&self, other: &Tensor<T>) -> Result<Tensor<T>> {
        self.binary(other, Binary::Add)
    }

    /// `self - other`, with broadcasting.
    pub fn sub(&self, other: &Tensor<T>) -> Result<Tensor<T>> {
        self.binary(other, Binary::Sub)
    }

    /// `self * other` elementwise, with broadcasting.
    pub fn mul(&self, other: &Tensor<T>) -> Result<Tensor<T>> {
        self.binary(other, Binary::Mul)
    }

    /// `self / other` elementwise, with broadcasting.
    pub fn div(&self, other: &Tensor<T>) -> Result<Tensor<T>> {
        self.binary(other, Binary::Div)
    }

    /// `self * factor`.
    pub fn scale(&self, factor: f64) -> Result<Tensor<T>> {
        self.scaled("scale", factor)
    }

    /// `-self`.
    pub fn neg(&self) -> Result<Tensor<T>> {
        self.scaled("neg", -1.0)
    }

    /// `f(self)` on a device, recorded with its backward; `None` for CPU tensors.
    fn unary_on_device(
        &self,
        op: &'static str,
        kind: UnaryKind,
        factor: f64,
    ) -> Result<Option<Tensor<T>>> {
        let Some([x]) = pointwise_inputs(op, [self])? else {
            return Ok(None);
        };
        let on = self.device();
        let kernel = UnaryKernel {
            kind,
            x,
            bias: None,
            factor,
        };
        let y = written(op, on, self.shape(), self.dtype(), &kernel)?;
        let format = self.grad_format();
        // Only what the derivative reads is kept: the output as stored for exp, the
        // output for tanh (or a 16-bit input, since 1 − y² of a rounded y near ±1 cancels),
        // nothing for a scale, the input for the others. The kernel reads it as stored.
        let backward = move |kept: Option<Kept<T, Tensor<T>>>| -> TensorBackwardFn<T> {
            Box::new(move |grad: Tensor<T>, _: &[bool]| {
                let grad = grad.device_input(op, on)?;
                let recomputed;
                let kept = match &kept {
                    None => grad,
                    Some(Kept::Output(y)) => y.device_input(op, on)?,
                    Some(Kept::Input(x)) if matches!(kind, UnaryKind::Tanh) => {
                        let x = x.device_input(op, on)?;
                        let kernel = UnaryKernel {
                            kind,
                            x,
                            bias: None,
                            factor,
                        };
                        recomputed = written::<T>(op, on, x.shape, T::DTYPE, &kernel)?;
                        recomputed.device_input(op, on)?
                    }
                    Some(Kept::Input(x)) => x.device_input(op, on)?,
                };
                let kernel = device::UnaryBackward {
                    kind,
                    grad,
                    kept,
                    bias: None,
                    factor,
                };
                Ok(vec![Some(written(op, on, grad.shape, format, &kernel)?)])
            })
        };
        match kind {
            UnaryKind::Exp => record_tensor_reading_output(op, &[self], y, |out| {
                backward(Some(Kept::Output(out)))
            }),
            UnaryKind::Tanh => record_tensor(op, &[self], y.clone(), || {
                backward(Some(Kept::new(self, y)))
            }),
            UnaryKind::Scale => record_tensor(op, &[self], y, || backward(None)),
            _ => record_tensor(op, &[self], y, || {
                backward(Some(Kept::Input(self.detach())))
            }),
        }
        .map(Some)
    }

    fn scaled(&self, op: &'static str, factor: f64) -> Result<Tensor<T>> {
        if let Some(out) = self.unary_on_device(op, UnaryKind::Scale, factor)? {
            return Ok(out);
        }
        let factor = T::from_f64(factor);
        let out = self.cpu(op)?.mapv(|x| x * factor);
        record(op, &[self], out.into_shared(), || {
            Box::new(move |grad: ArrayD<T>, _: &[bool]| Ok(vec![Some(grad * factor)]))
        })
    }

    /// Elementwise `e^x`.
    pub fn exp(&self) -> Result<Tensor<T>> {
        if let Some(out) = self.unary_on_device("exp", UnaryKind::Exp, 1.0)? {
            return Ok(out);
        }
        let out = self.cpu("exp")?.mapv(T::exp).into_shared();
        record_reading_output("exp", &[self], out, |kept| {
            Box::new(move |grad: ArrayD<T>, _: &[bool]| Ok(vec![Some(grad * &kept.cpu("exp")?)]))
        })
    }

    /// Elementwise natural logarithm.
    pub fn log(&self) -> Result<Tensor<T>> {
        if let Some(out) = self.unary_on_device("log", UnaryKind::Log, 1.0)? {
            return Ok(out);
        }
        let input = self.cpu("log")?;
        let out = input.mapv(T::ln);
        record("log", &[self], out.into_shared(), || {
            let input = self.detach();
            Box::new(move |grad: ArrayD<T>, _: &[bool]| Ok(vec![Some(grad / &input.cpu("log")?)]))
        })
    }

    /// Elementwise hyperbolic tangent.
    pub fn tanh(&self) -> Result<Tensor<T>> {
        if let Some(out) = self.unary_on_device("tanh", UnaryKind::Tanh, 1.0)? {
            return Ok(out);
        }
        let tanh = |x: &ArcArray<T, IxDyn>| pointwise::map(x, T::tanh_vectorizable).into_shared();
        let out = tanh(&self.cpu("tanh")?);
        record("tanh", &[self], out.clone(), || {
            let kept = Kept::new(self, out);
            Box::new(move |mut grad: ArrayD<T>, _: &[bool]| {
                let out = match &kept {
                    Kept::Output(y) => y.clone(),
                    Kept::Input(x) => tanh(&x.cpu("tanh")?),
                };
                pointwise::update_with(&mut grad, &out, |g, y| g * (T::one() - y * y));
                Ok(vec![Some(grad)])
            })
        })
    }

    /// Elementwise `max(x, 0)`.
    pub fn relu(&self) -> Result<Tensor<T>> {
        if let Some(out) = self.unary_on_device("relu", UnaryKind::Relu, 1.0)? {
            return Ok(out);
        }
        let input = self.cpu("relu")?;
        let out = input.mapv(|x| if x > T::zero() { x } else { T::zero() });
        record("relu", &[self], out.into_shared(), || {
            let input = self.detach();
            Box::new(move |mut grad: ArrayD<T>, _: &[bool]| {
                let input = input.cpu("relu")?;
                Zip::from(&mut grad).and(&input).for_each(|g, &x| {
                    if x <= T::zero() {
                        *g = T::zero();
                    }
                });
                Ok(vec![Some(grad)])
            })
        })
    }

    /// Elementwise GELU, exact or tanh-approximated.
    pub fn gelu(&self, approximation: Gelu) -> Result<Tensor<T>> {
        let kind = match approximation {
            Gelu::Erf => UnaryKind::GeluErf,
            Gelu::Tanh => UnaryKind::GeluTanh,
        };
        if let Some(out) = self.unary_on_device("gelu", kind, 1.0)? {
            return Ok(out);
        }
        let input = self.cpu("gelu")?;
        // One loop per approximation, so each inner loop is branch-free and vectorises.
        let out = match approximation {
            Gelu::Erf => pointwise::map(&input, gelu_erf),
            Gelu::Tanh => pointwise::map(&input, gelu_tanh),
        };
        record("gelu", &[self], out.into_shared(), || {
            let input = self.detach();
            Box::new(move |mut grad: ArrayD<T>, _: &[bool]| {
                let input = input.cpu("gelu")?;
                match approximation {
                    Gelu::Erf => {
                        pointwise::update_with(&mut grad, &input, |g, x| g * gelu_erf_derivative(x))
                    }
                    Gelu::Tanh => pointwise::update_with(&mut grad, &input, |g, x| {
                        g * gelu_tanh_derivative(x)
                    }),
                }
                Ok(vec![Some(grad)])
            })
        })
    }
}

impl<T: Element> Tensor<T> {
    /// `gelu(self + bias)`, `bias` over the last dimension: a linear layer's bias and its
    /// activation (Megatron's `bias_gelu` fusion). It equals
    /// `self.add(bias)?.gelu(approximation)`, the sum rounded to its storage format in
    /// between; on a device it is one kernel each way, the sum never stored (its
    /// backward adds the kept input and bias again).
    ///
    /// ```
    /// use ferrotron_tape::{Gelu, Tensor};
    ///
    /// let x = Tensor::<f64>::from_vec(vec![-1.0, 0.0, 1.0, 2.0], &[2, 2])?;
    /// let bias = Tensor::from_vec(vec![1.0, -1.0], &[2])?;
    /// let fused = x.bias_gelu(&bias, Gelu::Erf)?.to_vec()?;
    /// assert_eq!(fused, x.add(&bias)?.gelu(Gelu::Erf)?.to_vec()?);
    /// # Ok::<(), ferrotron_tape::Error>(())
    /// ```
    pub fn bias_gelu(&self, bias: &Tensor<T>, approximation: Gelu) -> Result<Tensor<T>> {
        const OP: &str = "bias_gelu";
        if bias.ndim() != 1 || self.shape().last() != Some(&bias.numel()) {
            return Err(Error::shape(
                OP,
                &[self.shape(), bias.shape()],
                "the bias is one value per element of the input's last dimension",
            ));
        }
        let kind = match approximation {
            Gelu::Erf => UnaryKind::GeluErf,
            Gelu::Tanh => UnaryKind::GeluTanh,
        };
        let Some([x, b]) = pointwise_inputs(OP, [self, bias])? else {
            return self.add(bias)?.gelu(approximation);
        };
        let (on, sum) = (self.device(), promoted(&[self, bias]));
        let sum_format = super::residual::format_number(sum);
        let bias_added = Some(AddedBias {
            bias: b,
            sum_format,
        });
        let kernel = UnaryKernel {
            kind,
            x,
            bias: bias_added,
            factor: 1.0,
        };
        let y = written(OP, on, self.shape(), sum, &kernel)?;
        record_tensor(OP, &[self, bias], y, || {
            let (x, bias) = (self.detach(), bias.detach());
            Box::new(move |grad: Tensor<T>, needs: &[bool]| {
                let grad = grad.device_input(OP, on)?;
                let added = AddedBias {
                    bias: bias.device_input(OP, on)?,
                    sum_format,
                };
                let kernel = device::UnaryBackward {
                    kind,
                    grad,
                    kept: x.device_input(OP, on)?,
                    bias: Some(added),
                    factor: 1.0,
                };
                // The gradient of the sum, stored as the sum is (the composition's
                // rounding), is the input's; the bias's sums it.
                let d_sum: Tensor<T> = written(OP, on, grad.shape, sum, &kernel)?;
                let db = needs[1]
                    .then(|| {
                        let d_sum = d_sum.device_input(OP, on)?;
                        device::sum_to_stored(on, d_sum, bias.shape()).map(Tensor::from_gpu)
                    })
                    .transpose()?;
                Ok(vec![needs[0].then_some(d_sum), db])
            })
        })
    }
}

/// Gradients of `a (kind) b` on a device from `grad`, every tensor read as stored: each
/// written in its operand's gradient `formats` (the incoming gradient itself for a sum's
/// operand of its shape), a broadcast operand's summed down to it in `T`.
fn binary_backward_on_device<T: Element>(
    op: &'static str,
    kind: Binary,
    grad: &Tensor<T>,
    needs: &[bool],
    [a, b]: [PointwiseInput<'_>; 2],
    formats: [DType; 2],
) -> Result<Vec<Option<Tensor<T>>>> {
    let on = grad.device();
    let g = grad.device_input(op, on)?;
    let times = |other| BinaryKernel {
        op,
        kind: BinaryKind::Mul,
        a: g,
        b: other,
    };
    let over = |other| BinaryKernel {
        op,
        kind: BinaryKind::Div,
        a: g,
        b: other,
    };
    let negated = UnaryKernel {
        kind: UnaryKind::Scale,
        x: g,
        bias: None,
        factor: -1.0,
    };
    let mut grads = Vec::with_capacity(2);
    for (i, operand) in [a, b].into_iter().enumerate() {
        if !needs[i] {
            grads.push(None);
            continue;
        }
        let (shape, format) = (operand.shape, formats[i]);
        let whole = (shape, format);
        let summed = |g: PointwiseInput<'_>| -> Result<Tensor<T>> {
            Ok(Tensor::from_gpu(device::sum_to_stored(on, g, shape)?))
        };
        grads.push(Some(match (kind, i) {
            (Binary::Add, _) | (Binary::Sub, 0) if shape == g.shape => grad.clone(),
            (Binary::Add, _) | (Binary::Sub, 0) => summed(g)?,
            (Binary::Sub, _) => as_operand((op, on), &negated, g.shape, whole)?,
            (Binary::Mul, 0) => as_operand((op, on), &times(b), g.shape, whole)?,
            (Binary::Mul, _) => as_operand((op, on), &times(a), g.shape, whole)?,
            (Binary::Div, 0) => as_operand((op, on), &over(b), g.shape, whole)?,
            (Binary::Div, _) => {
                // d(a/b)/db = -(a/b)/b · g, in `T` until the last product.
                let quotient = device::binary::<T>(op, BinaryKind::Div, on, g.shape, (a, b))?;
                let over_b = (&quotient).into();
                let over_b = device::binary::<T>(op, BinaryKind::Div, on, g.shape, (over_b, b))?;
                let negated = device::unary::<T>(UnaryKind::Scale, &over_b, -1.0)?;
                let product = BinaryKernel {
                    op,
                    kind: BinaryKind::Mul,
                    a: g,
                    b: (&negated).into(),
                };
                as_operand((op, on), &product, g.shape, whole)?
            }
        }));
    }
    Ok(grads)
}

/// `kernel`'s gradient of `full` shape on `on` as an operand's of `(shape, format)`:
/// written in its format where the operand has that shape, else summed down to it in `T`.
fn as_operand<T: Element>(
    (op, on): (&'static str, crate::Device),
    kernel: &impl PointwiseWrite,
    full: &[usize],
    (shape, format): (&[usize], DType),
) -> Result<Tensor<T>> {
    if shape == full {
        return written(op, on, shape, format, kernel);
    }
    let whole: Tensor<T> = written(op, on, full, T::DTYPE, kernel)?;
    let whole = whole.device_input(op, on)?;
    Ok(Tensor::from_gpu(device::sum_to_stored(on, whole, shape)?))
}

fn binary_backward<T: Element>(
    kind: Binary,
    grad: ArrayD<T>,
    needs: &[bool],
    a: &ArcArray<T, IxDyn>,
    b: &ArcArray<T, IxDyn>,
) -> Result<Vec<Option<ArrayD<T>>>> {
    let op = kind.name();
    let (need_a, need_b) = (needs[0], needs[1]);
    let shape = grad.shape().to_vec();
    let mismatch = || Error::shape(op, &[a.shape(), b.shape()], "cannot broadcast");
    let a_full = a.broadcast(IxDyn(&shape)).ok_or_else(mismatch)?;
    let b_full = b.broadcast(IxDyn(&shape)).ok_or_else(mismatch)?;
    let (grad_a, grad_b) = match kind {
        Binary::Add | Binary::Sub => {
            let grad_b = need_b.then(|| match kind {
                Binary::Sub => grad.mapv(|g| -g),
                _ => grad.clone(),
            });
            (need_a.then_some(grad), grad_b)
        }
        Binary::Mul => (
            need_a.then(|| Zip::from(&grad).and(&b_full).map_collect(|&g, &y| g * y)),
            need_b.then(|| Zip::from(&grad).and(&a_full).map_collect(|&g, &x| g * x)),
        ),
        Binary::Div => (
            need_a.then(|| Zip::from(&grad).and(&b_full).map_collect(|&g, &y| g / y)),
            need_b.then(|| {
                Zip::from(&grad)
                    .and(&a_full)
                    .and(&b_full)
                    .map_collect(|&g, &x, &y| -g * x / (y * y))
            }),
        ),
    };
    Ok(vec![
        grad_a.map(|g| sum_to_shape(g, a.shape())),
        grad_b.map(|g| sum_to_shape(g, b.shape())),
    ])
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_TANH_COEFF: f64 = 0.044_715;

fn gelu_erf<T: Element>(x: T) -> T {
    let half = T::from_f64(0.5);
    half * x * (T::one() + (x * T::from_f64(std::f64::consts::FRAC_1_SQRT_2)).erf())
}

fn gelu_erf_derivative<T: Element>(x: T) -> T {
    let half = T::from_f64(0.5);
    let cdf = half * (T::one() + (x * T::from_f64(std::f64::consts::FRAC_1_SQRT_2)).erf());
    let pdf = (-half * x * x).exp() * T::from_f64(0.398_942_280_401_432_7);
    cdf + x * pdf
}

#[inline(always)]
fn gelu_tanh<T: Element>(x: T) -> T {
    let inner = T::from_f64(SQRT_2_OVER_PI) * (x + T::from_f64(GELU_TANH_COEFF) * x * x * x);
    T::from_f64(0.5) * x * (T::one() + inner.tanh_vectorizable())
}

#[inline(always)]
fn gelu_tanh_derivative<T: Element>(x: T) -> T {
    let half = T::from_f64(0.5);
    let c = T::from_f64(SQRT_2_OVER_PI);
    let k = T::from_f64(GELU_TANH_COEFF);
    let t = (c * (x + k * x * x * x)).tanh_vectorizable();
    let dinner = c * (T::one() + T::from_f64(3.0) * k * x * x);
    half * (T::one() + t) + half * x * (T::one() - t * t) * dinner
}

/// `kind(x)` as a pointwise kernel writing any storage format.
struct UnaryKernel<'a> {
    kind: UnaryKind,
    x: PointwiseInput<'a>,
    bias: Option<AddedBias<'a>>,
    factor: f64,
}

impl PointwiseWrite for UnaryKernel<'_> {
    fn write<T: Element, O: Stored>(&self, out: &GpuArray<O>) -> Result<()> {
        device::unary_stored::<T, O>(self.kind, out, self.x, self.bias.as_ref(), self.factor)
    }
}
