//! Bucket layout: reverse registration order, a small first bucket, the byte cap respected,
//! identical on every rank; buffers no larger than the gradients.

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::run_local;
use ferrotron_ddp::{
    DdpConfig, DistributedDataParallel, DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_BYTES,
};
use ferrotron_tape::{Parameter, Tensor};

/// Element counts of the parameters, in registration order.
const NUMELS: [usize; 7] = [300, 10, 200, 200, 50, 400, 20];

/// Per rank: parameter indices of every bucket, buffer bytes, gradient bytes.
type Layout = (Vec<Vec<usize>>, usize, usize);

fn layout(first: usize, cap: usize) -> Result<Vec<Layout>> {
    Ok(run_local(2, |comm| -> Result<Layout> {
        let params: Vec<Parameter> = NUMELS
            .iter()
            .enumerate()
            .map(|(i, &n)| Parameter::new(format!("p{i}"), Tensor::zeros(&[n])))
            .collect();
        let config = DdpConfig {
            first_bucket_bytes: first,
            bucket_cap_bytes: cap,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(params, Arc::new(comm), config)?;
        let mut flat = 0;
        for (i, bucket) in ddp.buckets().iter().enumerate() {
            assert_eq!(bucket.index, i);
            assert_eq!(bucket.flat_offset, flat, "buckets tile the flat buffer");
            let mut offset = 0;
            for p in &bucket.params {
                assert_eq!((p.offset, p.numel), (offset, NUMELS[p.index]));
                offset += p.numel;
            }
            assert_eq!(bucket.numel, offset);
            flat += bucket.numel;
        }
        let indices = ddp
            .buckets()
            .iter()
            .map(|b| b.params.iter().map(|p| p.index).collect())
            .collect();
        Ok((indices, ddp.buffer_bytes(), ddp.gradient_bytes()))
    })?)
}

#[test]
fn buckets_are_reverse_order_small_first_and_capped() -> Result<()> {
    // Bytes: p6 80, p5 1600, p4 200, p3 800, p2 800, p1 40, p0 1200.
    let per_rank = layout(1000, 2000)?;
    assert_eq!(per_rank[0], per_rank[1], "identical on every rank");
    let (buckets, buffer, grads) = &per_rank[0];
    assert_eq!(
        buckets,
        &vec![vec![6], vec![5, 4], vec![3, 2, 1], vec![0]],
        "first bucket ≤ 1000 B, the rest ≤ 2000 B"
    );
    let total: usize = NUMELS.iter().sum::<usize>() * 4;
    assert_eq!(
        (*buffer, *grads),
        (total, total),
        "f32 buckets: exactly 1× the gradients"
    );
    Ok(())
}

#[test]
fn everything_fits_one_bucket_under_the_defaults() -> Result<()> {
    assert_eq!(
        (DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_BYTES),
        (1 << 20, 25 << 20)
    );
    let per_rank = layout(DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_BYTES)?;
    assert_eq!(per_rank[0].0, vec![vec![6, 5, 4, 3, 2, 1, 0]]);
    Ok(())
}

#[test]
fn a_parameter_larger_than_the_cap_gets_its_own_bucket() -> Result<()> {
    let per_rank = layout(100, 900)?;
    assert_eq!(
        per_rank[0].0,
        vec![vec![6], vec![5], vec![4], vec![3], vec![2, 1], vec![0]],
        "p5 (1600 B) and p0 (1200 B) exceed the 900 B cap and stand alone"
    );
    Ok(())
}
