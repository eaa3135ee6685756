//! Megatron-LM's estimate as restated here, against its known values, and the
//! differences from ferrotron's prediction that the book explains, exactly.

mod common;

use common::serial;
use ferrotron_planner::{megatron, predict, Layout, Model, Recompute};

#[test]
fn gpt3_has_175_billion_parameters_by_megatrons_count() {
    let gpt3 = Model::gpt(96, 12288, 96, 51200, 2048);
    let counted = megatron::estimate(&gpt3, &serial(1)).parameters;
    assert_eq!(counted, 174_580_064_256.0);
}

#[test]
fn ferrotron_counts_the_biases_and_positions_megatrons_formula_leaves_out() {
    for tied in [true, false] {
        let model = Model {
            tied,
            ..Model::gpt(3, 64, 4, 256, 32)
        };
        let (h, f) = (model.hidden, model.ffn);
        let theirs = megatron::estimate(&model, &serial(1)).parameters as usize;
        // Per block: the q, k, v and first MLP biases and the two projections' biases;
        // then the positions (the output layer has no bias, tied or not).
        let missing = model.layers * (3 * h + f + 2 * h) + model.seq * h;
        assert_eq!(model.parameters(), theirs + missing);
    }
}

#[test]
fn both_count_eighteen_bytes_a_parameter_in_16_bit_mixed_precision() {
    let model = Model::gpt(4, 64, 4, 256, 32);
    let layout = Layout {
        element: 2,
        ..serial(2)
    };
    let ours = predict(&model, &layout).unwrap()[0];
    let state = ours.parameters + ours.gradients + ours.master_weights + ours.moments;
    assert_eq!(state, 18 * model.parameters());
    let theirs = megatron::estimate(&model, &layout);
    assert_eq!(theirs.weights_and_optimizer, 18.0 * theirs.parameters);
}

#[test]
fn with_sequence_parallel_and_selective_recomputation_a_layer_keeps_34_sbh_over_tp() {
    // Korthikanti et al. 2022, Table 2: 34·s·b·h/t bytes a layer.
    let layout = Layout {
        tp: 4,
        sequence_parallel: true,
        recompute: Recompute::Selective,
        ..serial(2)
    };
    let activations = |layers| {
        let model = Model::gpt(layers, 64, 4, 256, 32);
        megatron::estimate(&model, &layout).activations
    };
    let sbh = 32.0 * 2.0 * 64.0;
    assert_eq!(activations(2) - activations(1), 34.0 * sbh / 4.0);
}
