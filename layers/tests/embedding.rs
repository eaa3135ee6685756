//! The vocabulary-parallel embedding on TP ∈ {1, 2, 3, 4} (10 ids: uneven for 3 and 4)
//! equals a plain lookup in the master table, with and without sequence parallelism.

mod common;

use common::{assert_close, join, part, tp_context, AnyResult};
use ferrotron_comm_core::run_local;
use ferrotron_layers::{MasterInit, Module, VocabParallelEmbedding, VocabRange};
use ferrotron_tape::{Generator, Parameter, Tape, Tensor};

const VOCAB: usize = 10;
const HIDDEN: usize = 4;
const IDS: [usize; 10] = [0, 9, 3, 3, 7, 2, 5, 8, 1, 6];
const IDS_SHAPE: [usize; 2] = [5, 2];

#[test]
fn vocab_ranges_cover_the_vocabulary_unevenly() -> AnyResult<()> {
    let ranges: Vec<VocabRange> = (0..3)
        .map(|r| VocabRange::new(VOCAB, r, 3))
        .collect::<std::result::Result<_, _>>()?;
    assert_eq!(
        ranges.iter().map(|r| (r.start, r.end)).collect::<Vec<_>>(),
        [(0, 4), (4, 7), (7, 10)]
    );
    assert!(VocabRange::new(3, 0, 4).is_err());
    Ok(())
}

#[test]
fn embedding_matches_serial_lookup() -> AnyResult<()> {
    let init = MasterInit::new(8, 1.0);
    let r = Tensor::randn(&[5, 2, HIDDEN], 1.0, &mut Generator::new(1));
    let table = Parameter::new("t", init.weight("emb.weight", &[VOCAB, HIDDEN]));
    let tape = Tape::new();
    let want = tape.watch(&table)?.embedding(&IDS, &IDS_SHAPE)?;
    want.mul(&r)?.sum()?.backward()?;
    let want_grad = table.grad().unwrap();

    for tp_size in [1, 2, 3, 4] {
        for sp in [false, true] {
            let what = format!("embedding tp={tp_size} sp={sp}");
            let ranks = run_local(tp_size, |comm| -> AnyResult<(Tensor, Tensor)> {
                let tp = tp_context(comm, sp);
                let (rank, size) = (tp.rank(), tp.size());
                let embedding = VocabParallelEmbedding::new(&tp, "emb", VOCAB, HIDDEN, &init)?;
                let tape = Tape::new();
                let y = embedding.forward(&tape, &IDS, &IDS_SHAPE)?;
                let r_local = if sp {
                    part(&r, 0, rank, size)
                } else {
                    r.clone()
                };
                y.mul(&r_local)?.sum()?.backward()?;
                Ok((y.detach(), embedding.parameters()[0].param.grad().unwrap()))
            })?;
            let outputs: Vec<Tensor> = ranks.iter().map(|o| o.0.clone()).collect();
            let output = if sp {
                join(&outputs, 0)
            } else {
                outputs[0].clone()
            };
            assert_close(&format!("{what}: output"), &output, &want.detach());
            let grads: Vec<Tensor> = ranks.iter().map(|o| o.1.clone()).collect();
            assert_close(&format!("{what}: table grad"), &join(&grads, 0), &want_grad);
        }
    }
    Ok(())
}

/// Megatron's tied output layer: a head sharing the table computes `x · tableᵀ` and
/// adds its gradient to the lookup's, in the one parameter, at every TP size (uneven at
/// 3 and 4) and under sequence parallelism. The reference is a plain lookup and product
/// on the master table.
#[test]
fn a_head_sharing_the_table_adds_both_uses_gradients() -> AnyResult<()> {
    use ferrotron_layers::ColumnParallelLinear;
    let init = MasterInit::new(8, 1.0);
    let r = Tensor::randn(&[5, 2, VOCAB], 1.0, &mut Generator::new(2));
    let table = Parameter::new("t", init.weight("emb.weight", &[VOCAB, HIDDEN]));
    let tape = Tape::new();
    let watched = tape.watch(&table)?;
    let want = watched
        .embedding(&IDS, &IDS_SHAPE)?
        .matmul_transposed(&watched)?;
    want.mul(&r)?.sum()?.backward()?;
    let want_grad = table.grad().unwrap();

    for tp_size in [1, 2, 3, 4] {
        for sp in [false, true] {
            let what = format!("tied head tp={tp_size} sp={sp}");
            let ranks = run_local(tp_size, |comm| -> AnyResult<(Tensor, Tensor)> {
                let tp = tp_context(comm, sp);
                let embedding = VocabParallelEmbedding::new(&tp, "emb", VOCAB, HIDDEN, &init)?;
                let head = ColumnParallelLinear::sharing_weight(&tp, embedding.weight(), true)?;
                // The owner lists the weight; the head lists nothing of its own.
                assert!(head.parameters().is_empty());
                let tape = Tape::new();
                let hidden = embedding.forward(&tape, &IDS, &IDS_SHAPE)?;
                let logits = head.forward(&tape, &hidden)?.output;
                logits.mul(&r)?.sum()?.backward()?;
                Ok((logits.detach(), embedding.weight().param.grad().unwrap()))
            })?;
            assert_close(&format!("{what}: logits"), &ranks[0].0, &want.detach());
            let grads: Vec<Tensor> = ranks.iter().map(|o| o.1.clone()).collect();
            assert_close(&format!("{what}: table grad"), &join(&grads, 0), &want_grad);
        }
    }
    Ok(())
}

/// Only a table split along its rows, in this rank's part, can be shared.
#[test]
fn a_shared_weight_must_be_split_by_rows() -> AnyResult<()> {
    use ferrotron_layers::{ColumnParallelLinear, ShardedParameter, Sharding};
    let errors = run_local(2, |comm| -> AnyResult<Vec<String>> {
        let tp = tp_context(comm, false);
        let weight = |sharding, rows| ShardedParameter {
            param: Parameter::new("w", Tensor::zeros(&[rows, HIDDEN])),
            sharding,
            grad_reduce_group: None,
            shared_copy: false,
            expert: false,
        };
        let split = |dim| Sharding::Split {
            dim,
            full_len: VOCAB,
        };
        let cases = [
            weight(Sharding::Replicated, VOCAB),
            weight(split(1), 5),
            // 10 rows over 2 ranks is 5 each, not 4.
            weight(split(0), 4),
        ];
        let mut errors = Vec::new();
        for case in &cases {
            match ColumnParallelLinear::sharing_weight(&tp, case, false) {
                Ok(_) => panic!("{:?} was accepted", case.sharding),
                Err(error) => errors.push(error.to_string()),
            }
        }
        assert!(ColumnParallelLinear::sharing_weight(&tp, &weight(split(0), 5), false).is_ok());
        Ok(errors)
    })?;
    let errors = &errors[0];
    assert!(errors[0].contains("replicated"), "{}", errors[0]);
    assert!(errors[1].contains("split:1:10"), "{}", errors[1]);
    assert!(errors[2].contains("[5, in_features]"), "{}", errors[2]);
    Ok(())
}
