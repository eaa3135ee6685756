//! The model, data and number formatting the DDP benchmarks share.
#![allow(dead_code)] // each benchmark uses its own subset

use ferrotron_tape::{Generator, Parameter, Tape, Tensor};

/// Width of every linear layer.
pub const WIDTH: usize = 1024;
/// Number of linear layers.
pub const LAYERS: usize = 8;
/// Rows of input per rank.
pub const BATCH: usize = 32;
/// DDP's bucket cap: the model's 32 MiB of gradients in eight buckets.
pub const BUCKET_CAP_BYTES: usize = 4 << 20;

/// `LAYERS` × (Linear(WIDTH, WIDTH) + relu), weights and biases in registration order.
pub fn model(seed: u64) -> Vec<Parameter> {
    let mut rng = Generator::new(seed);
    let std = (1.0 / WIDTH as f64).sqrt();
    (0..LAYERS)
        .flat_map(|i| {
            [
                Parameter::new(
                    format!("l{i}.w"),
                    Tensor::randn(&[WIDTH, WIDTH], std, &mut rng),
                ),
                Parameter::new(format!("l{i}.b"), Tensor::zeros(&[WIDTH])),
            ]
        })
        .collect()
}

/// The mean of the model's output.
pub fn loss(tape: &Tape, params: &[Parameter], x: &Tensor) -> ferrotron_tape::Result<Tensor> {
    let mut h = x.clone();
    for layer in params.chunks(2) {
        h = h
            .matmul(&tape.watch(&layer[0])?)?
            .add(&tape.watch(&layer[1])?)?
            .relu()?;
    }
    h.mean()
}

/// The median of `values` (NaN for none).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// A finite JSON number (JSON has no NaN or infinity).
pub fn json_number(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.4}")
    } else {
        "null".into()
    }
}
