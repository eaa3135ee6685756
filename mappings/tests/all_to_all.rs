//! `all_to_all` on 1–8 ranks for every (scatter_dim, gather_dim) pair, with explicit splits
//! (empty parts included) and the split rule: outputs and gradients equal the one-thread
//! emulation, where rank `r` receives part `r` of every rank's tensor.

mod support;

use anyhow::Result;
use ferrotron_mappings::{all_to_all, split_sizes};
use ferrotron_tape::Tensor;
use support::{assert_close, distributed, part, random, serial, with_len, Layout};

const BASE: [usize; 3] = [2, 3, 2];

/// One all-to-all setup: whether splits are passed (or left to the split rule), and each
/// rank's splits along `scatter_dim` and its shape.
struct Case {
    given: bool,
    splits: Vec<Vec<usize>>,
    shapes: Vec<Vec<usize>>,
}

fn cases(n: usize, scatter_dim: usize, gather_dim: usize) -> Result<Vec<Case>> {
    let mut cases = Vec::new();
    if scatter_dim == gather_dim {
        // Splits (and so lengths) may differ by rank.
        let explicit: Vec<Vec<usize>> = (0..n)
            .map(|r| (0..n).map(|q| (r * 3 + q * 5 + 1) % 3).collect())
            .collect();
        let ruled: Vec<Vec<usize>> = (0..n)
            .map(|r| split_sizes(n + r % 2, n))
            .collect::<std::result::Result<_, _>>()?;
        for (given, splits) in [(true, explicit), (false, ruled)] {
            let shapes = splits
                .iter()
                .map(|s| with_len(&BASE, scatter_dim, s.iter().sum()))
                .collect();
            cases.push(Case {
                given,
                splits,
                shapes,
            });
        }
    } else {
        // One split for all ranks; lengths along gather_dim may differ by rank.
        let explicit: Vec<usize> = (0..n).map(|q| (q * 2 + 1) % 3).collect();
        for (given, splits) in [(true, explicit), (false, split_sizes(2 * n + 1, n)?)] {
            let shapes = (0..n)
                .map(|r| {
                    let shape = with_len(&BASE, scatter_dim, splits.iter().sum());
                    with_len(&shape, gather_dim, 1 + r % 3)
                })
                .collect();
            cases.push(Case {
                given,
                splits: vec![splits; n],
                shapes,
            });
        }
    }
    Ok(cases)
}

#[test]
fn all_to_all_matches_the_world() -> Result<()> {
    for n in 1..=8 {
        for scatter_dim in 0..BASE.len() {
            for gather_dim in 0..BASE.len() {
                for Case {
                    given,
                    splits,
                    shapes,
                } in cases(n, scatter_dim, gather_dim)?
                {
                    let inputs: Vec<Tensor<f64>> = shapes
                        .iter()
                        .enumerate()
                        .map(|(r, s)| random(s, 50 + r as u64))
                        .collect();
                    let got = distributed(&inputs, Layout::PerRank, |x, g| {
                        let mine = given.then(|| splits[g.rank()].as_slice());
                        all_to_all(x, g, scatter_dim, gather_dim, mine)
                    })?;
                    let want = serial(&inputs, Layout::PerRank, Layout::PerRank, |xs| {
                        (0..n)
                            .map(|r| {
                                let parts = (0..n)
                                    .map(|s| part(&xs[s], scatter_dim, &splits[s], r))
                                    .collect::<ferrotron_tape::Result<Vec<_>>>()?;
                                let refs: Vec<&Tensor<f64>> = parts.iter().collect();
                                Tensor::concat(&refs, gather_dim)
                            })
                            .collect()
                    })?;
                    assert_close(
                        &format!("all_to_all n={n} {scatter_dim}->{gather_dim} splits={splits:?} given={given}"),
                        &got,
                        &want,
                    )?;
                }
            }
        }
    }
    Ok(())
}
