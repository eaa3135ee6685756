//! Construction-time collectives: every DP rank must hold the same parameter shapes, and
//! starts from DP rank 0's values.

use ferrotron_comm_core::{Communicator, CommunicatorExt};
use ferrotron_tape::{Parameter, Tensor};

use crate::bucket::BucketInfo;
use crate::error::{Error, Result, ShapeMismatch};

/// Compares parameter shapes across `dp`; every rank gets the same verdict.
pub(crate) fn verify_shapes(dp: &dyn Communicator, params: &[Parameter]) -> Result<()> {
    let shapes: Vec<Vec<usize>> = params.iter().map(Parameter::shape).collect();
    let signature = encode(&shapes)?;
    let length = i64::try_from(signature.len()).map_err(|_| too_large())?;
    let lengths = dp.all_gather_vec(&[length])?;
    let counts = lengths
        .iter()
        .map(|&l| usize::try_from(l).map_err(|_| too_large()))
        .collect::<Result<Vec<usize>>>()?;
    let gathered = dp.all_gather_v_vec(&signature, &counts)?;

    let mut per_rank = Vec::with_capacity(counts.len());
    let mut start = 0;
    for count in counts {
        per_rank.push(gathered.get(start..start + count).and_then(decode));
        start += count;
    }
    let reference = per_rank.first().cloned().flatten().unwrap_or_default();
    let mut mismatches = Vec::new();
    for (rank, theirs) in per_rank.iter().enumerate().skip(1) {
        let theirs = theirs.clone().unwrap_or_default();
        if theirs.len() != reference.len() {
            mismatches.push(ShapeMismatch {
                rank,
                index: None,
                name: None,
                expected: vec![reference.len()],
                found: vec![theirs.len()],
            });
        }
        for (index, (expected, found)) in reference.iter().zip(&theirs).enumerate() {
            if expected != found {
                mismatches.push(ShapeMismatch {
                    rank,
                    index: Some(index),
                    name: params.get(index).map(|p| p.name().to_string()),
                    expected: expected.clone(),
                    found: found.clone(),
                });
            }
        }
    }
    if mismatches.is_empty() {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            group: dp.name().to_string(),
            group_size: dp.size(),
            mismatches,
        })
    }
}

/// Copies DP rank 0's parameter values to every rank, one bucket-sized broadcast at a
/// time (bucket layout is identical on every rank once shapes agree).
pub(crate) fn broadcast_from_rank0(
    dp: &dyn Communicator,
    params: &[Parameter],
    buckets: &[BucketInfo],
) -> Result<()> {
    for info in buckets {
        let mut flat = vec![0.0f32; info.numel];
        for slot in &info.params {
            flat[slot.range()].copy_from_slice(&params[slot.index].value()?.to_vec()?);
        }
        dp.broadcast_slice(&mut flat, 0)?;
        if dp.rank() != 0 {
            for slot in &info.params {
                let current = params[slot.index].value()?;
                // The broadcast values keep the parameter's device and storage format.
                let value = Tensor::from_vec(flat[slot.range()].to_vec(), &slot.shape)?
                    .to_device(current.device())?
                    .to_dtype(current.dtype())?;
                params[slot.index].set_value(value)?;
            }
        }
    }
    Ok(())
}

/// `[count, ndim₀, dims₀…, ndim₁, dims₁…, …]`.
fn encode(shapes: &[Vec<usize>]) -> Result<Vec<i64>> {
    let to_i64 = |v: usize| i64::try_from(v).map_err(|_| too_large());
    let mut out = vec![to_i64(shapes.len())?];
    for shape in shapes {
        out.push(to_i64(shape.len())?);
        for &dim in shape {
            out.push(to_i64(dim)?);
        }
    }
    Ok(out)
}

fn decode(signature: &[i64]) -> Option<Vec<Vec<usize>>> {
    let mut values = signature.iter().map(|&v| usize::try_from(v).ok());
    let count = values.next()??;
    let mut shapes = Vec::with_capacity(count);
    for _ in 0..count {
        let ndim = values.next()??;
        let shape = (0..ndim)
            .map(|_| values.next().flatten())
            .collect::<Option<Vec<usize>>>()?;
        shapes.push(shape);
    }
    Some(shapes)
}

fn too_large() -> Error {
    Error::Config("a parameter shape does not fit the 64-bit shape check".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_signatures_round_trip() -> Result<()> {
        let shapes = vec![vec![3, 4], vec![], vec![7]];
        assert_eq!(decode(&encode(&shapes)?), Some(shapes));
        assert_eq!(decode(&[2, 1]), None);
        Ok(())
    }
}
