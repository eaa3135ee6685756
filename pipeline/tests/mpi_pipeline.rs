//! Pipelines over the MPI backend: the world is the pipeline group (2 or 4 stages under
//! `mpirun -n 2` / `-n 4`). Every schedule gives the serial model's gradients, which
//! every rank computes locally, a misshapen activation is a typed error on both sides,
//! and receives posted ahead are refused.
//!
//! ```text
//! cargo test -p ferrotron-pipeline --features mpi --test mpi_pipeline --no-run
//! mpirun -n 4 target/debug/deps/mpi_pipeline-<hash>
//! ```
//! Rank 0 prints `N passed, M failed`; the exit status is non-zero on any failure.

use anyhow::ensure;
use ferrotron_comm_core::mpi::MpiWorld;
use ferrotron_comm_core::Communicator;
use ferrotron_pipeline::{Error, Pipeline, PipelineConfig, Schedule, Stage};
use ferrotron_tape::{Parameter, Tape, Tensor};
use std::sync::Arc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const MICROBATCHES_PER_STAGE: usize = 2;

fn weight(layer: usize) -> Tensor {
    let values = (0..16)
        .map(|i| ((layer * 16 + i) % 7) as f32 / 7.0 - 0.4)
        .collect();
    Tensor::from_vec(values, &[4, 4]).unwrap()
}

fn input(microbatch: usize) -> Tensor {
    let values = (0..12)
        .map(|i| ((microbatch * 12 + i) % 5) as f32 / 5.0 - 0.3)
        .collect();
    Tensor::from_vec(values, &[3, 4]).unwrap()
}

/// Layer `layer` of `layers`: y = tanh(x · W); the last one's loss is mean(y²).
struct Layer {
    layer: usize,
    layers: usize,
    weight: Parameter,
    transpose_output: bool,
}

impl Stage for Layer {
    fn forward(&mut self, tape: &Tape, mb: usize, x: Option<&Tensor>) -> Result<Tensor, BoxError> {
        let x = x.cloned().unwrap_or_else(|| input(mb));
        let y = x.matmul(&tape.watch(&self.weight)?)?.tanh()?;
        if self.layer + 1 == self.layers {
            return Ok(y.mul(&y)?.mean()?);
        }
        Ok(if self.transpose_output {
            y.transpose(0, 1)?
        } else {
            y
        })
    }
}

/// Each layer's gradient of the mean loss over the microbatches, on one rank.
fn serial_gradients(layers: usize, microbatches: usize) -> anyhow::Result<Vec<Vec<f32>>> {
    let params: Vec<Parameter> = (0..layers)
        .map(|l| Parameter::new("w", weight(l)))
        .collect();
    for mb in 0..microbatches {
        let tape = Tape::new();
        let mut x = input(mb);
        for p in &params {
            x = x.matmul(&tape.watch(p)?)?.tanh()?;
        }
        x.mul(&x)?
            .mean()?
            .scale(1.0 / microbatches as f64)?
            .backward()?;
    }
    params
        .iter()
        .map(|p| Ok(p.grad().unwrap().to_vec()?))
        .collect()
}

fn schedules_match_the_serial_model(world: &Arc<dyn Communicator>) -> anyhow::Result<()> {
    let pp = world.size();
    let microbatches = MICROBATCHES_PER_STAGE * pp;
    for schedule in [
        Schedule::GPipe,
        Schedule::OneFOneB,
        Schedule::Interleaved { virtual_stages: 2 },
    ] {
        if pp == 1 && schedule.chunks() > 1 {
            continue;
        }
        let layers = pp * schedule.chunks();
        let expected = serial_gradients(layers, microbatches)?;
        let mut stages: Vec<Layer> = (0..schedule.chunks())
            .map(|c| {
                let layer = c * pp + world.rank();
                Layer {
                    layer,
                    layers,
                    weight: Parameter::new("w", weight(layer)),
                    transpose_output: false,
                }
            })
            .collect();
        let config = PipelineConfig::new(schedule, microbatches, &[3, 4]);
        let pipeline = Pipeline::new(world.clone(), config)?;
        let mut refs: Vec<&mut dyn Stage> =
            stages.iter_mut().map(|s| s as &mut dyn Stage).collect();
        let report = pipeline.run(&mut refs)?;
        ensure!(report.peak_in_flight <= pipeline.planned_peak_in_flight());
        for stage in &stages {
            let got = stage.weight.grad().unwrap().to_vec()?;
            for (a, b) in got.iter().zip(&expected[stage.layer]) {
                ensure!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                    "{}: layer {} {a} vs {b}",
                    schedule.name(),
                    stage.layer
                );
            }
        }
    }
    Ok(())
}

fn a_transposed_activation_fails_both_sides(world: &Arc<dyn Communicator>) -> anyhow::Result<()> {
    let pp = world.size();
    if pp < 2 {
        return Ok(());
    }
    let pipeline = Pipeline::new(
        world.clone(),
        PipelineConfig::new(Schedule::OneFOneB, pp, &[3, 4]),
    )?;
    let mut stage = Layer {
        layer: world.rank(),
        layers: pp,
        weight: Parameter::new("w", weight(world.rank())),
        transpose_output: world.rank() == 0,
    };
    let outcome = pipeline.run(&mut [&mut stage]);
    match (world.rank(), outcome) {
        (
            0,
            Err(Error::Shape {
                what: "activation sent",
                ..
            }),
        ) => {}
        (
            1,
            Err(Error::Shape {
                what: "activation received",
                ..
            }),
        ) => {}
        // The later stages wait on the failed ones: under MPI nothing would release
        // them, so this case stops at the first two stages' errors.
        (rank, other) if rank < 2 => anyhow::bail!("rank {rank}: {:?}", other.map(drop)),
        _ => unreachable!("later stages are not run in this case"),
    }
    Ok(())
}

/// Receives posted ahead are refused over MPI, whose posted receives a failing stage
/// could not withdraw (it would wait for a peer that may never send).
fn receives_posted_ahead_are_refused(world: &Arc<dyn Communicator>) -> anyhow::Result<()> {
    let mut config = PipelineConfig::new(Schedule::OneFOneB, 2 * world.size(), &[3, 4]);
    config.overlap_p2p = true;
    match Pipeline::new(world.clone(), config) {
        Err(Error::Config(message)) => {
            ensure!(message.contains("mpi backend"), "{message}");
            Ok(())
        }
        other => anyhow::bail!("expected a configuration error, got {:?}", other.err()),
    }
}

fn main() -> anyhow::Result<()> {
    let mpi = MpiWorld::init()?;
    let world: Arc<dyn Communicator> = Arc::new(mpi.world()?);
    let mut results = vec![
        (
            "schedules match the serial model",
            schedules_match_the_serial_model(&world),
        ),
        (
            "receives posted ahead are refused",
            receives_posted_ahead_are_refused(&world),
        ),
    ];
    // Only two stages take part, so that none waits on a failed one.
    let pair = world
        .split(Some(u32::from(world.rank() < 2)), 0, "pair")?
        .expect("member");
    if world.rank() < 2 && world.size() >= 2 {
        results.push((
            "a transposed activation fails both sides",
            a_transposed_activation_fails_both_sides(&pair),
        ));
    }
    world.barrier()?;
    let failed = results.iter().filter(|r| r.1.is_err()).count();
    for (name, outcome) in &results {
        if let Err(e) = outcome {
            eprintln!("rank {}: {name} FAILED: {e:#}", world.rank());
        }
    }
    if world.rank() == 0 {
        println!("mpi_pipeline on {} ranks", world.size());
        println!("{} passed, {} failed", results.len() - failed, failed);
    }
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
