//! Bad user input is a typed error naming the problem, never a panic.

mod common;

use common::{tp_context, AnyResult};
use ferrotron_comm_core::run_local;
use ferrotron_layers::{
    BlockConfig, ColumnParallelLinear, Error, LinearOptions, MasterInit, ParallelSelfAttention,
    RngTracker, RowParallelLinear, TransformerBlock, VocabParallelEmbedding,
};
use ferrotron_tape::{Tape, Tensor};

#[test]
fn out_of_range_id_is_named() -> AnyResult<()> {
    let messages = run_local(2, |comm| -> AnyResult<String> {
        let tp = tp_context(comm, false);
        let embedding = VocabParallelEmbedding::new(&tp, "emb", 10, 4, &MasterInit::new(0, 1.0))?;
        match embedding.forward(&Tape::new(), &[1, 12, 3], &[3]) {
            Err(
                e @ Error::IdOutOfRange {
                    id: 12,
                    vocab_size: 10,
                    ..
                },
            ) => Ok(e.to_string()),
            other => panic!("expected IdOutOfRange, got {other:?}"),
        }
    })?;
    assert!(messages[0].contains("token id 12"), "{}", messages[0]);
    Ok(())
}

#[test]
fn ids_that_do_not_fill_their_shape_are_rejected() -> AnyResult<()> {
    run_local(1, |comm| -> AnyResult<()> {
        let tp = tp_context(comm, false);
        let embedding = VocabParallelEmbedding::new(&tp, "emb", 10, 4, &MasterInit::new(0, 1.0))?;
        assert!(matches!(
            embedding.forward(&Tape::new(), &[1, 2, 3], &[2, 2]),
            Err(Error::Shape { .. })
        ));
        Ok(())
    })?;
    Ok(())
}

#[test]
fn wrong_input_widths_are_rejected() -> AnyResult<()> {
    run_local(2, |comm| -> AnyResult<()> {
        let tp = tp_context(comm, false);
        let init = MasterInit::new(0, 1.0);
        let col =
            ColumnParallelLinear::new(&tp, "c", 4, 6, false, LinearOptions::default(), &init)?;
        let row = RowParallelLinear::new(&tp, "r", 6, 4, true, LinearOptions::default(), &init)?;
        let tape = Tape::new();
        assert!(matches!(
            col.forward(&tape, &Tensor::zeros(&[2, 5])),
            Err(Error::Shape { .. })
        ));
        // The row layer expects this rank's 3 of 6 input features.
        assert!(matches!(
            row.forward(&tape, &Tensor::zeros(&[2, 6])),
            Err(Error::Shape { .. })
        ));
        let attention = ParallelSelfAttention::new(&tp, "a", &BlockConfig::new(4, 2), &init)?;
        let mut rng = RngTracker::new(0, tp.rank());
        assert!(matches!(
            attention.forward(&tape, &Tensor::zeros(&[3, 4]), &mut rng),
            Err(Error::Shape { .. })
        ));
        Ok(())
    })?;
    Ok(())
}

#[test]
fn heads_not_divisible_by_tp_are_rejected() -> AnyResult<()> {
    let results = run_local(4, |comm| -> AnyResult<bool> {
        let tp = tp_context(comm, false);
        let block =
            TransformerBlock::new(&tp, "b", &BlockConfig::new(12, 6), &MasterInit::new(0, 1.0));
        Ok(matches!(
            block,
            Err(Error::NotDivisible {
                what: "attention heads",
                value: 6,
                parts: 4,
                ..
            })
        ))
    })?;
    assert_eq!(results, vec![true; 4]);
    Ok(())
}

#[test]
fn sequence_parallel_row_layer_needs_parallel_input() -> AnyResult<()> {
    run_local(2, |comm| -> AnyResult<()> {
        let tp = tp_context(comm, true);
        let row = RowParallelLinear::new(
            &tp,
            "r",
            6,
            4,
            false,
            LinearOptions::default(),
            &MasterInit::new(0, 1.0),
        );
        assert!(matches!(row, Err(Error::Config { .. })));
        Ok(())
    })?;
    Ok(())
}

#[test]
fn a_vocabulary_smaller_than_the_group_is_rejected() -> AnyResult<()> {
    run_local(4, |comm| -> AnyResult<()> {
        let tp = tp_context(comm, false);
        let embedding = VocabParallelEmbedding::new(&tp, "emb", 3, 4, &MasterInit::new(0, 1.0));
        assert!(matches!(embedding, Err(Error::Mappings(_))));
        Ok(())
    })?;
    Ok(())
}
