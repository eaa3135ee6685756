//! The two parameters the optimizer tests train: a matrix and a vector.

use ferrotron_tape::{Device, Parameter, Tensor};

/// `w` (2 × 3) and `b` (2) on `device`.
pub fn parameters(device: Device) -> Result<Vec<Parameter>, Box<dyn std::error::Error>> {
    let w = Tensor::from_vec(vec![0.5, -1.0, 2.0, 0.25, -0.75, 1.5], &[2, 3])?;
    let b = Tensor::from_vec(vec![0.1, -0.2], &[2])?;
    Ok(vec![
        Parameter::new("w", w.to_device(device)?),
        Parameter::new("b", b.to_device(device)?),
    ])
}
