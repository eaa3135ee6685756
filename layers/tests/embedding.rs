//! The vocabulary-parallel embedding on TP ∈ {1, 2, 3, 4} (10 ids: uneven for 3 and 4)
//! equals a plain lookup in the master table, with and without sequence parallelism.

mod common;

use comm_core::run_local;
use common::{assert_close, join, part, tp_context, AnyResult};
use layers::{MasterInit, Module, VocabParallelEmbedding, VocabRange};
use tape::{Generator, Parameter, Tape, Tensor};

const VOCAB: usize = 10;
const HIDDEN: usize = 4;
const IDS: [usize; 10] = [0, 9, 3, 3, 7, 2, 5, 8, 1, 6];
const IDS_SHAPE: [usize; 2] = [5, 2];

#[test]
fn vocab_ranges_cover_the_vocabulary_unevenly() -> AnyResult<()> {
    let ranges: Vec<VocabRange> = (0..3)
        .map(|r| VocabRange::new(VOCAB, r, 3))
        .collect::<Result<_, _>>()?;
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
    let want = tape.watch(&table).embedding(&IDS, &IDS_SHAPE)?;
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
