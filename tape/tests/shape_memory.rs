//! Shape ops and the memory they take (a counting allocator: this test binary has one
//! test, so nothing else allocates meanwhile; the emulator's memory comes from the same
//! allocator):
//! - `reshape`, and `narrow` over a contiguous range, are views of a tensor's memory in
//!   its own storage format: on the CPU and every device, f32, bf16 and f16, they take no
//!   memory and do not widen 16-bit storage;
//! - on a device, `permute`, any other `narrow` and `concat` of 16-bit tensors move their
//!   bits in that format: they take their 16-bit result only, with no widened copy;
//! - `embedding` of a 16-bit table copies its rows as they are, on the CPU and every
//!   device: it takes its rows in the table's format, never a widened table.
//!
//! Values and gradients equal the copying path's. CUDA memory is not the host allocator's,
//! so on a GPU the byte counts pin nothing and only formats and values are checked.

#[path = "support/counting.rs"]
mod counting;
#[path = "support/device.rs"]
mod device;

use ferrotron_tape::{DType, Device, Generator, Parameter, Tape, Tensor};

/// Makes a tensor from the one under test.
type Make<'a> = &'a dyn Fn() -> ferrotron_tape::Result<Tensor>;

const ROWS: usize = 64;
const COLS: usize = 256;

#[test]
fn shape_ops_take_no_memory_beyond_their_result_in_its_format() -> ferrotron_tape::Result<()> {
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

        // Copies on a device, in the tensor's format.
        if device != Device::Cpu {
            for dtype in [DType::BF16, DType::F16] {
                let x = values.to_device(device)?.to_dtype(dtype)?;
                let size = dtype.size_in_bytes() as isize;
                let copies: [(&str, isize, Make<'_>); 3] = [
                    ("permute", (ROWS * COLS) as isize, &|| x.transpose(0, 1)),
                    ("narrow", (ROWS * 64) as isize, &|| x.narrow(1, 4, 64)),
                    ("concat", (2 * ROWS * COLS) as isize, &|| {
                        Tensor::concat(&[&x, &x], 1)
                    }),
                ];
                for (name, elements, copy) in copies {
                    counting::reset_peak();
                    let before = counting::live();
                    let out = copy()?;
                    let taken = counting::peak() - before;
                    let result = elements * size;
                    assert!(
                        taken <= result + result / 8,
                        "{name} of {dtype} on {device} took {taken} bytes for {result}"
                    );
                    assert_eq!(out.dtype(), dtype);
                }
            }
        }

        // Rows of a 16-bit table, in its format.
        let ids: Vec<usize> = (0..32).map(|i| (i * 7) % ROWS).collect();
        for dtype in [DType::BF16, DType::F16] {
            let table = values.to_device(device)?.to_dtype(dtype)?;
            counting::reset_peak();
            let before = counting::live();
            let rows = table.embedding(&ids, &[4, 8])?;
            let taken = counting::peak() - before;
            let result = (ids.len() * COLS * dtype.size_in_bytes()) as isize;
            assert!(
                taken <= result + result / 8,
                "embedding in {dtype} on {device} took {taken} bytes for {result}"
            );
            assert_eq!((rows.dtype(), rows.shape()), (dtype, &[4, 8, COLS][..]));
            let all = table.to_vec()?;
            let expected: Vec<f32> = (ids.iter())
                .flat_map(|&id| all[id * COLS..(id + 1) * COLS].to_vec())
                .collect();
            assert_eq!(rows.to_vec()?, expected, "embedding in {dtype} on {device}");
        }

        // Gradients land where the pieces came from.
        let p = Parameter::new("p", values.to_device(device)?.to_dtype(DType::BF16)?);
        let tape = Tape::new();
        let piece = tape
            .watch(&p)?
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
