//! Every mapping on emulated device tensors, forward and backward, equals the same
//! mapping on CPU tensors, and moves no tensor bytes between host and device: the
//! collectives read and write the tensors' own device memory.

mod support;

use anyhow::Result;
use ferrotron_mappings::{
    all_gather_from_region, all_to_all, copy_to_region, gather_from_region, reduce_from_region,
    reduce_scatter_to_region, scatter_to_region,
};
use ferrotron_tape::{Device, Tensor, Transfers};
use support::{assert_close, distributed_on, random, Group, Layout};

type Mapping = fn(&Tensor<f64>, &Group) -> ferrotron_mappings::Result<Tensor<f64>>;

#[test]
fn every_mapping_on_the_emulated_device_equals_the_cpu_with_no_host_copies() -> Result<()> {
    const RANKS: usize = 3;
    // Along dimension 1 of [2, 7, 3] (parts 3, 2, 2): packing into per-rank blocks is
    // needed, the path the device must do without the host.
    let cases: [(&str, Layout, Layout, Vec<usize>, Mapping); 7] = [
        (
            "copy_to",
            Layout::Replicated,
            Layout::PerRank,
            vec![2, 7, 3],
            |x, g| copy_to_region(x, g),
        ),
        (
            "reduce_from",
            Layout::PerRank,
            Layout::Replicated,
            vec![2, 7, 3],
            |x, g| reduce_from_region(x, g),
        ),
        (
            "scatter",
            Layout::Replicated,
            Layout::PerRank,
            vec![2, 7, 3],
            |x, g| scatter_to_region(x, g, 1, None),
        ),
        (
            "gather",
            Layout::PerRank,
            Layout::Replicated,
            vec![2, 2, 3],
            |x, g| gather_from_region(x, g, 1, None),
        ),
        (
            "reduce_scatter",
            Layout::PerRank,
            Layout::PerRank,
            vec![2, 7, 3],
            |x, g| reduce_scatter_to_region(x, g, 1, None),
        ),
        (
            "all_gather",
            Layout::PerRank,
            Layout::Replicated,
            vec![2, 2, 3],
            |x, g| all_gather_from_region(x, g, 1, None),
        ),
        (
            "all_to_all",
            Layout::PerRank,
            Layout::PerRank,
            vec![2, 6, 3],
            |x, g| all_to_all(x, g, 1, 2, None),
        ),
    ];
    for (name, input, output, shape, mapping) in cases {
        let inputs: Vec<Tensor<f64>> = (0..RANKS)
            .map(|r| match input {
                Layout::Replicated => random(&shape, 40),
                Layout::PerRank => random(&shape, 41 + r as u64),
            })
            .collect();
        let cpu = distributed_on(Device::Cpu, &inputs, output, mapping)?;
        let emulated = distributed_on(Device::Emulated, &inputs, output, mapping)?;
        let (cpu, _): (Vec<_>, Vec<_>) = cpu.into_iter().unzip();
        let (emulated, moved): (Vec<_>, Vec<_>) = emulated.into_iter().unzip();
        assert_close(name, &emulated, &cpu)?;
        for (rank, moved) in moved.into_iter().enumerate() {
            assert_eq!(moved, Transfers::default(), "{name}, rank {rank}");
        }
    }
    Ok(())
}
