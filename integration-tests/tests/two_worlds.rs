//! DESIGN.md invariant 5 (no global mutable state): two independent `run_local` worlds,
//! each 4 ranks training a small `layers` MLP under TP = 2 × DP = 2 with `ddp`, running
//! concurrently on two threads of one process give bit-for-bit the results of running
//! them one after the other (and each still equals its serial model), on the CPU and on
//! the emulated device.

mod support;

use std::sync::Barrier;

use support::{assert_matches_serial, train_parallel, train_serial, Arch, Opt, RankResult, Setup};

/// Every rank's losses and parameters, as bits.
type Fingerprint = Vec<(Vec<u32>, Vec<Vec<u32>>)>;

fn fingerprint(ranks: &[RankResult]) -> Fingerprint {
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    ranks
        .iter()
        .map(|r| {
            (
                bits(r.losses.clone()),
                r.params
                    .iter()
                    .map(|(_, _, t)| bits(t.to_vec().unwrap()))
                    .collect(),
            )
        })
        .collect()
}

/// World `seed` on `device`: its own master weights, data and optimizer.
fn world(seed: u64, opt: Opt, device: ferrotron_tape::Device) -> Setup {
    Setup {
        init_seed: seed,
        data_seed: 1000 * seed,
        device,
        ..Setup::new(Arch::Mlp, 2, 2, opt, 5)
    }
}

#[test]
fn two_concurrent_worlds_equal_sequential_runs() -> anyhow::Result<()> {
    concurrent_worlds_equal_sequential_runs(ferrotron_tape::Device::Cpu, 3)
}

/// A device's backend (and its compiled kernels) is cached once per process: the one
/// stated exception to having no global state. Two worlds sharing it still do not meet.
#[test]
fn two_concurrent_worlds_on_one_device_equal_sequential_runs() -> anyhow::Result<()> {
    concurrent_worlds_equal_sequential_runs(ferrotron_tape::Device::Emulated, 1)
}

fn concurrent_worlds_equal_sequential_runs(
    device: ferrotron_tape::Device,
    rounds: usize,
) -> anyhow::Result<()> {
    let (a, b) = (world(1, Opt::Sgd, device), world(2, Opt::AdamW, device));
    let sequential_a = train_parallel(&a)?;
    let sequential_b = train_parallel(&b)?;
    let (want_a, want_b) = (fingerprint(&sequential_a), fingerprint(&sequential_b));
    assert_ne!(
        want_a, want_b,
        "the two worlds must differ to detect cross-talk"
    );

    for round in 0..rounds {
        let start = Barrier::new(2);
        let run = |setup: &Setup| {
            start.wait();
            train_parallel(setup)
        };
        let (got_a, got_b) = std::thread::scope(|scope| {
            let first = scope.spawn(|| run(&a));
            let second = scope.spawn(|| run(&b));
            (first.join().unwrap(), second.join().unwrap())
        });
        let (got_a, got_b) = (got_a?, got_b?);
        assert!(
            fingerprint(&got_a) == want_a,
            "world A differs in round {round}"
        );
        assert!(
            fingerprint(&got_b) == want_b,
            "world B differs in round {round}"
        );
    }

    assert_matches_serial("world A", &a, &sequential_a, &train_serial(&a)?);
    assert_matches_serial("world B", &b, &sequential_b, &train_serial(&b)?);
    Ok(())
}
