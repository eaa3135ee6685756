//! `reshape`, and `narrow` over a contiguous range, are views of a tensor's memory in
//! its own storage format: on the CPU and every device, f32, bf16 and f16, they take no
//! memory and do not widen 16-bit storage (a counting allocator: this test binary has
//! one test, so nothing else allocates meanwhile; the emulator's memory comes from the
//! same allocator). Their values and gradients equal the copying path's.

#[path = "support/counting.rs"]
mod counting;
#[path = "support/device.rs"]
mod device;

use tape::{DType, Device, Generator, Parameter, Tape, Tensor};

const ROWS: usize = 64;
const COLS: usize = 256;

#[test]
fn reshape_and_contiguous_narrow_share_memory_in_every_format() -> tape::Result<()> {
    let mut rng = Generator::new(11);
    let values = Tensor::randn(&[ROWS, COLS], 1.0, &mut rng);
    let mut devices = vec![Device::Cpu];
    devices.extend(device::devices());
    for device in devices {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = values.to_device(device)?.to_dtype(dtype)?;
            let bytes = (ROWS * COLS * dtype.size_in_bytes()) as isize;
            counting::reset_peak();
            let before = counting::live();
            let rows = x.narrow(0, 8, 16)?;
            let flat = rows.reshape(&[16 * COLS])?;
            let piece = flat.narrow(0, 100, 1000)?.reshape(&[10, 100])?;
            let taken = counting::peak() - before;
            assert!(
                taken < bytes / 64,
                "{dtype} on {device}: views took {taken} bytes of a {bytes}-byte tensor"
            );
            assert_eq!((rows.dtype(), piece.dtype()), (dtype, dtype));

            // The same elements as the CPU's copies of them.
            let all = x.to_vec()?;
            let start = 8 * COLS + 100;
            assert_eq!(piece.to_vec()?, all[start..start + 1000].to_vec());
        }

        // Gradients land where the pieces came from.
        let p = Parameter::new("p", values.to_device(device)?.to_dtype(DType::BF16)?);
        let tape = Tape::new();
        let piece = tape
            .watch(&p)
            .narrow(0, 1, 2)?
            .reshape(&[2 * COLS])?
            .narrow(0, 3, 5)?;
        let weights = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0], &[5])?.to_device(device)?;
        piece.mul(&weights)?.sum()?.backward()?;
        let grad = p.grad().expect("a gradient").to_vec()?;
        let mut expected = vec![0.0; ROWS * COLS];
        for (i, w) in (1..=5).enumerate() {
            expected[COLS + 3 + i] = w as f32;
        }
        assert_eq!(grad, expected, "on {device}");
    }
    Ok(())
}
