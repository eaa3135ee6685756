//! The bytes a rank sends per step, against the ring-collective volumes worked by hand.

mod common;

use common::serial;
use ferrotron_pipeline::Schedule;
use ferrotron_planner::{traffic, Layout, Model, Recompute};

fn model() -> Model {
    Model::gpt(4, 64, 4, 256, 32)
}

#[test]
fn data_parallel_all_reduces_every_f32_gradient() {
    let layout = Layout { dp: 4, ..serial(2) };
    let sent = traffic(&model(), &layout).unwrap();
    let parameters = model().parameters() as f64;
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].data, 2.0 * 3.0 / 4.0 * parameters * 4.0);
    assert_eq!(sent[0].tensor + sent[0].pipeline + sent[0].embedding, 0.0);
}

#[test]
fn the_distributed_optimizer_reduce_scatters_gradients_and_gathers_parameters() {
    let layout = Layout {
        dp: 4,
        element: 2,
        distributed_optimizer: true,
        ..serial(2)
    };
    let sent = traffic(&model(), &layout).unwrap();
    let padded = model().parameters().next_multiple_of(64 * 4) as f64;
    assert_eq!(sent[0].data, 3.0 / 4.0 * padded * (4.0 + 2.0));
}

#[test]
fn tensor_parallel_collectives_per_block_embedding_head_and_loss() {
    let (batch, m) = (4, 2);
    let layout = Layout {
        tp: 2,
        microbatches: m,
        ..serial(batch)
    };
    let model = model();
    let tokens = (batch / m * model.seq) as f64;
    let sbh = tokens * model.hidden as f64;
    // All-reduces over 2 ranks send N each: 4 a block, the embedding's, the head's;
    // cross-entropy's three f32 rows.
    let expected = m as f64 * ((4.0 * 4.0 + 2.0) * sbh * 4.0 + 3.0 * tokens * 4.0);
    assert_eq!(traffic(&model, &layout).unwrap()[0].tensor, expected);
    // Sequence parallelism trades each all-reduce for a reduce-scatter and an all-gather.
    let sp = Layout {
        sequence_parallel: true,
        ..layout
    };
    assert_eq!(traffic(&model, &sp).unwrap()[0].tensor, expected);
    // A full recomputation replays each block's forward: two more a block.
    let full = Layout {
        recompute: Recompute::Uniform { layers: 1 },
        ..layout
    };
    let replayed = m as f64 * 4.0 * 2.0 * sbh * 4.0;
    assert_eq!(
        traffic(&model, &full).unwrap()[0].tensor,
        expected + replayed
    );
    let selective = Layout {
        recompute: Recompute::Selective,
        ..layout
    };
    assert_eq!(traffic(&model, &selective).unwrap()[0].tensor, expected);
}

#[test]
fn pipeline_stages_send_activations_forward_and_gradients_back() {
    let model = Model::gpt(6, 64, 4, 256, 32);
    let layout = Layout {
        pp: 3,
        microbatches: 3,
        batch: 3,
        ..serial(3)
    };
    let sbh = (model.seq * model.hidden) as f64 * 4.0;
    let sent = traffic(&model, &layout).unwrap();
    let pipeline: Vec<f64> = sent.iter().map(|t| t.pipeline).collect();
    assert_eq!(pipeline, [3.0 * sbh, 6.0 * sbh, 3.0 * sbh]);
    // The tied embedding's f32 gradient between the first and the last stage.
    let embedding: Vec<f64> = sent.iter().map(|t| t.embedding).collect();
    let shard = (model.vocab * model.hidden) as f64 * 4.0;
    assert_eq!(embedding, [shard, 0.0, shard]);
    // Two chunks a rank: every chunk boundary but the model's two ends.
    let model = Model::gpt(6, 64, 4, 256, 32);
    let interleaved = Layout {
        schedule: Schedule::Interleaved { virtual_stages: 2 },
        ..layout
    };
    let sent = traffic(&model, &interleaved).unwrap();
    let pipeline: Vec<f64> = sent.iter().map(|t| t.pipeline).collect();
    assert_eq!(pipeline, [9.0 * sbh, 12.0 * sbh, 9.0 * sbh]);
    let untied = Model {
        tied: false,
        ..model
    };
    assert!(traffic(&untied, &layout)
        .unwrap()
        .iter()
        .all(|t| t.embedding == 0.0));
}
