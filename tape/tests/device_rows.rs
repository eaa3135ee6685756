//! The cooperative row kernels (a warp per row, lanes over its columns, butterfly
//! reductions) equal the CPU at the widths and row counts where such kernels go wrong:
//! width 1, widths around the warp (31, 32, 33) and the block (127, 128, 129), rows longer
//! than a block, and row counts that leave warps of a block without a row. f32 within
//! 1e-6 (the log-softmax gradient, which cancels, 1e-5) and f64 within 1e-12 of the
//! largest magnitude, forward and backward.

#[path = "support/device.rs"]
mod device;

use device::{check, Inputs};
use ferrotron_tape::{CrossEntropyOptions, DType, Reduction};

const F32: f64 = 1e-6;
const F64: f64 = 1e-12;
const WIDTHS: [usize; 9] = [1, 2, 31, 32, 33, 127, 128, 129, 1000];
const ROWS: [usize; 3] = [1, 5, 257];

#[test]
fn softmax_rows_at_every_width() {
    for width in WIDTHS {
        for rows in ROWS {
            let shape: &[usize] = &[rows, width];
            let wide = || Inputs::new(&[shape]).range(-30.0, 30.0);
            let name = |op: &str| format!("{op} [{rows}, {width}]");
            check::<f32>(&name("softmax"), wide(), F32, |x| x[0].softmax());
            // Its gradient g − exp(y)·Σg cancels: the f32 rounding of y and of the row's
            // sum, which the two paths form in different orders, grows by Σg's size.
            check::<f32>(&name("log_softmax"), wide(), 1e-5, |x| x[0].log_softmax());
            check::<f64>(&name("softmax f64"), wide(), F64, |x| x[0].softmax());
        }
    }
}

#[test]
fn causal_softmax_rows_at_every_width() {
    for n in [1, 31, 33, 130] {
        let shape: &[usize] = &[3, n, n];
        check::<f32>("causal_softmax", Inputs::new(&[shape]), F32, |x| {
            x[0].causal_softmax(0.125)
        });
        check::<f64>("causal_softmax f64", Inputs::new(&[shape]), F64, |x| {
            x[0].causal_softmax(0.5)
        });
    }
}

#[test]
fn layer_norm_rows_at_every_width() {
    for width in WIDTHS {
        for rows in ROWS {
            let (x, affine): (&[usize], &[usize]) = (&[rows, width], &[width]);
            check::<f32>("layer_norm", Inputs::new(&[x, affine, affine]), F32, |t| {
                t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5)
            });
            check::<f64>("layer_norm f64", Inputs::new(&[x]), F64, |t| {
                t[0].layer_norm(None, None, 1e-5)
            });
        }
    }
}

#[test]
fn cross_entropy_rows_at_every_width() {
    for classes in [1, 33, 129, 1000] {
        for rows in ROWS {
            // Every third row ignored; the others' labels spread over the classes.
            let labels: Vec<i64> = (0..rows)
                .map(|r| match r % 3 {
                    1 => -100,
                    _ => ((r * 7919) % classes) as i64,
                })
                .collect();
            for smoothing in [0.0, 0.1] {
                let options = CrossEntropyOptions {
                    ignore_index: Some(-100),
                    label_smoothing: smoothing,
                    reduction: Reduction::None,
                };
                let shape: &[usize] = &[rows, classes];
                check::<f32>("cross_entropy", Inputs::new(&[shape]), F32, |x| {
                    x[0].cross_entropy(&labels, &options)
                });
                check::<f64>("cross_entropy f64", Inputs::new(&[shape]), F64, |x| {
                    x[0].cross_entropy(&labels, &options)
                });
            }
        }
    }
}

/// The same kernels on bf16 rows, which they read as stored and whose gradients they
/// read and write in bf16: within one bf16 unit of the largest magnitude (the two paths'
/// f32 sums, ordered differently, may round a value to its neighbour).
#[test]
fn bf16_rows_at_every_width() {
    const BF16: f64 = 1.0 / 128.0;
    // The rows as a bf16 activation (scaling by one is exact), so their gradient is
    // kept in bf16 too.
    let activation = |x: &ferrotron_tape::Tensor| x.to_dtype(DType::BF16)?.scale(1.0);
    for width in [1, 33, 129, 1000] {
        for rows in ROWS {
            let shape: &[usize] = &[rows, width];
            let name = |op: &str| format!("bf16 {op} [{rows}, {width}]");
            let wide = || Inputs::new(&[shape]).range(-30.0, 30.0);
            check::<f32>(&name("softmax"), wide(), BF16, |x| {
                activation(&x[0])?.softmax()
            });
            check::<f32>(&name("layer_norm"), Inputs::new(&[shape]), BF16, |x| {
                activation(&x[0])?.layer_norm(None, None, 1e-5)
            });
            let labels: Vec<i64> = (0..rows)
                .map(|r| match r % 3 {
                    1 => -100,
                    _ => ((r * 7919) % width) as i64,
                })
                .collect();
            let options = CrossEntropyOptions {
                ignore_index: Some(-100),
                label_smoothing: 0.1,
                reduction: Reduction::None,
            };
            check::<f32>(&name("cross_entropy"), wide(), BF16, |x| {
                activation(&x[0])?.cross_entropy(&labels, &options)
            });
        }
    }
}
