//! A product of two bf16 or f16 device matrices reads them as stored (cuBLAS's GemmEx
//! with f32 accumulation, the emulator's reference of it), forward and backward, also
//! with the second one transposed (`matmul_transposed`, a linear layer's `x·Wᵀ`): the
//! forward takes only its 16-bit result, the backward only the incoming gradient rounded
//! to 16 bits and the two f32 gradients, with no widened f32 copy of either operand (a
//! counting allocator: this test binary has one test, so nothing else allocates
//! meanwhile; the emulator's memory comes from the same allocator).

#[path = "support/counting.rs"]
mod counting;

use ferrotron_tape::{DType, Device, Generator, Parameter, Tape, Tensor};

const N: usize = 128;

#[test]
fn sixteen_bit_device_products_allocate_only_their_result() -> ferrotron_tape::Result<()> {
    let mut rng = Generator::new(3);
    let cases = [DType::BF16, DType::F16]
        .into_iter()
        .flat_map(|d| [(d, false), (d, true)]);
    for (dtype, transposed) in cases {
        let a = Tensor::randn(&[2, N, N], 0.1, &mut rng);
        let b = Tensor::randn(&[N, N], 0.1, &mut rng);
        let product = |a: &Tensor, b: &Tensor| match transposed {
            true => a.matmul_transposed(b),
            false => a.matmul(b),
        };
        let expected = product(&a.to_dtype(dtype)?, &b.to_dtype(dtype)?)?.to_vec()?;
        let on_device = |t: &Tensor| t.to_device(Device::Emulated)?.to_dtype(dtype);
        let (a, b) = (
            Parameter::new("a", on_device(&a)?),
            Parameter::new("b", on_device(&b)?),
        );
        let tape = Tape::new();
        let grad = Tensor::randn(&[2, N, N], 1.0, &mut rng).to_device(Device::Emulated)?;
        counting::reset_peak();
        let before = counting::live();
        let product = product(&tape.watch(&a)?, &tape.watch(&b)?)?;
        let taken = counting::peak() - before;
        let result = (2 * N * N * 2) as isize;
        assert_eq!(product.dtype(), dtype);
        // A widened operand alone would take twice the result's bytes.
        assert!(
            taken <= result + result / 8,
            "{dtype} (transposed: {transposed}): the product took {taken} bytes for a {result}-byte result"
        );

        counting::reset_peak();
        let before = counting::live();
        product.backward_with_grad(&grad)?;
        let taken = counting::peak() - before;
        // The 16-bit gradient (the result's size) and f32 gradients of A and B; widened
        // operands would add as much again as those two.
        let needed = result + (2 * N * N * 4 + N * N * 4) as isize;
        assert!(
            taken <= needed + needed / 8,
            "{dtype} (transposed: {transposed}): backward took {taken} bytes where {needed} are needed"
        );
        assert_eq!(a.grad().map(|g| g.dtype()), Some(DType::F32));
        let got = product.to_vec()?;
        let scale = expected.iter().fold(1f32, |m, v| m.max(v.abs()));
        let ulp = if dtype == DType::BF16 {
            2f32.powi(-7)
        } else {
            2f32.powi(-10)
        };
        for (x, y) in got.iter().zip(&expected) {
            assert!((x - y).abs() <= ulp * scale, "{dtype}: {x} vs {y}");
        }
    }
    Ok(())
}
