//! Every region mapping, on 1–8 ranks, along every dimension, with even, uneven and empty
//! parts: forward values and input gradients equal the one-thread emulation of the whole
//! world (see `support`), in f64.

mod support;

use anyhow::Result;
use ferrotron_mappings::{
    all_gather_from_region, all_gather_variable, copy_to_region, gather_from_region,
    gather_from_sequence_parallel_region, reduce_from_region, reduce_scatter_to_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_region,
    scatter_to_sequence_parallel_region, split_sizes,
};
use ferrotron_tape::Tensor;
use support::{
    assert_close, distributed, part, random, serial, sum_all, with_len, Layout, RankResult,
};

const BASE: [usize; 3] = [2, 3, 2];
const MAX_RANKS: usize = 8;

/// Per-rank lengths along a gathered dimension: even, uneven, and uneven with empty parts.
fn gathered_lengths(n: usize) -> Vec<Vec<usize>> {
    vec![
        vec![2; n],
        (0..n).map(|r| 1 + (r * 5 + 2) % 3).collect(),
        (0..n).map(|r| (r * 3 + 1) % 4).collect(),
    ]
}

/// Ways to cut a whole dimension: the split rule (even, uneven, minimal lengths), and
/// explicit sizes with empty parts.
fn cuts(n: usize) -> Vec<(usize, Option<Vec<usize>>)> {
    let explicit: Vec<usize> = (0..n).map(|r| (r * 3 + 1) % 4).collect();
    vec![
        (2 * n, None),
        (2 * n + 1, None),
        (n, None),
        (explicit.iter().sum(), Some(explicit)),
    ]
}

/// The per-rank sizes a cut stands for.
fn cut_sizes(n: usize, len: usize, sizes: &Option<Vec<usize>>) -> Result<Vec<usize>> {
    Ok(match sizes {
        Some(sizes) => sizes.clone(),
        None => split_sizes(len, n)?,
    })
}

fn per_rank_inputs(shapes: &[Vec<usize>], seed: u64) -> Vec<Tensor<f64>> {
    shapes
        .iter()
        .enumerate()
        .map(|(r, s)| random(s, seed + r as u64))
        .collect()
}

fn compare(what: String, got: Vec<RankResult>, want: Vec<RankResult>) -> Result<()> {
    assert_close(&what, &got, &want)
}

#[test]
fn copy_and_reduce_match_the_world() -> Result<()> {
    for n in 1..=MAX_RANKS {
        for shape in [vec![], vec![3], BASE.to_vec()] {
            let x = random(&shape, 7);
            let replicated = vec![x; n];
            compare(
                format!("copy_to_region n={n} {shape:?}"),
                distributed(&replicated, Layout::PerRank, copy_to_region)?,
                serial(&replicated, Layout::Replicated, Layout::PerRank, |xs| {
                    Ok(xs.to_vec())
                })?,
            )?;
            let inputs = per_rank_inputs(&vec![shape.clone(); n], 11);
            compare(
                format!("reduce_from_region n={n} {shape:?}"),
                distributed(&inputs, Layout::Replicated, reduce_from_region)?,
                serial(&inputs, Layout::PerRank, Layout::Replicated, |xs| {
                    Ok(vec![sum_all(xs)?; xs.len()])
                })?,
            )?;
        }
    }
    Ok(())
}

#[test]
fn scatter_matches_the_world() -> Result<()> {
    for n in 1..=MAX_RANKS {
        for dim in 0..BASE.len() {
            for (len, sizes) in cuts(n) {
                let parts = cut_sizes(n, len, &sizes)?;
                let x = random(&with_len(&BASE, dim, len), 3);
                let replicated = vec![x; n];
                compare(
                    format!("scatter_to_region n={n} dim={dim} len={len} sizes={sizes:?}"),
                    distributed(&replicated, Layout::PerRank, |x, g| {
                        scatter_to_region(x, g, dim, sizes.as_deref())
                    })?,
                    serial(&replicated, Layout::Replicated, Layout::PerRank, |xs| {
                        (0..n).map(|r| part(&xs[0], dim, &parts, r)).collect()
                    })?,
                )?;
                if dim == 0 {
                    compare(
                        format!("scatter_to_sequence_parallel_region n={n} len={len}"),
                        distributed(&replicated, Layout::PerRank, |x, g| {
                            scatter_to_sequence_parallel_region(x, g, sizes.as_deref())
                        })?,
                        serial(&replicated, Layout::Replicated, Layout::PerRank, |xs| {
                            (0..n).map(|r| part(&xs[0], 0, &parts, r)).collect()
                        })?,
                    )?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn reduce_scatter_matches_the_world() -> Result<()> {
    for n in 1..=MAX_RANKS {
        for dim in 0..BASE.len() {
            for (len, sizes) in cuts(n) {
                let parts = cut_sizes(n, len, &sizes)?;
                let inputs = per_rank_inputs(&vec![with_len(&BASE, dim, len); n], 5);
                let world = |xs: &[Tensor<f64>]| -> ferrotron_tape::Result<Vec<Tensor<f64>>> {
                    let total = sum_all(xs)?;
                    (0..n).map(|r| part(&total, dim, &parts, r)).collect()
                };
                compare(
                    format!("reduce_scatter_to_region n={n} dim={dim} len={len} sizes={sizes:?}"),
                    distributed(&inputs, Layout::PerRank, |x, g| {
                        reduce_scatter_to_region(x, g, dim, sizes.as_deref())
                    })?,
                    serial(&inputs, Layout::PerRank, Layout::PerRank, world)?,
                )?;
                if dim == 0 {
                    compare(
                        format!("reduce_scatter_to_sequence_parallel_region n={n} len={len}"),
                        distributed(&inputs, Layout::PerRank, |x, g| {
                            reduce_scatter_to_sequence_parallel_region(x, g, sizes.as_deref())
                        })?,
                        serial(&inputs, Layout::PerRank, Layout::PerRank, world)?,
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// The gathers differ only in backward, i.e. in what the loss after them is: replicated
/// (keep own part) or rank-local (sum the gradients first).
#[test]
fn gathers_match_the_world() -> Result<()> {
    for n in 1..=MAX_RANKS {
        for dim in 0..BASE.len() {
            for lengths in gathered_lengths(n) {
                let shapes: Vec<Vec<usize>> =
                    lengths.iter().map(|&l| with_len(&BASE, dim, l)).collect();
                let inputs = per_rank_inputs(&shapes, 13);
                let gathered = |xs: &[Tensor<f64>]| -> ferrotron_tape::Result<Vec<Tensor<f64>>> {
                    let refs: Vec<&Tensor<f64>> = xs.iter().collect();
                    Ok(vec![Tensor::concat(&refs, dim)?; xs.len()])
                };
                let keep_own = serial(&inputs, Layout::PerRank, Layout::Replicated, gathered)?;
                let summed = serial(&inputs, Layout::PerRank, Layout::PerRank, gathered)?;
                let what = |name: &str, known: bool| {
                    format!("{name} n={n} dim={dim} lengths={lengths:?} sizes known={known}")
                };
                for known in [false, true] {
                    let sizes = known.then_some(lengths.as_slice());
                    compare(
                        what("gather_from_region", known),
                        distributed(&inputs, Layout::Replicated, |x, g| {
                            gather_from_region(x, g, dim, sizes)
                        })?,
                        keep_own.clone(),
                    )?;
                    compare(
                        what("all_gather_from_region", known),
                        distributed(&inputs, Layout::PerRank, |x, g| {
                            all_gather_from_region(x, g, dim, sizes)
                        })?,
                        summed.clone(),
                    )?;
                    for (all_reduce_grads, output, want) in [
                        (false, Layout::Replicated, &keep_own),
                        (true, Layout::PerRank, &summed),
                    ] {
                        compare(
                            what(&format!("all_gather_variable({all_reduce_grads})"), known),
                            distributed(&inputs, output, |x, g| {
                                let (y, got) =
                                    all_gather_variable(x, g, dim, sizes, all_reduce_grads)?;
                                assert_eq!(got, lengths);
                                Ok(y)
                            })?,
                            want.clone(),
                        )?;
                    }
                    if dim == 0 {
                        for (tp_grad, output, want) in [
                            (false, Layout::Replicated, &keep_own),
                            (true, Layout::PerRank, &summed),
                        ] {
                            compare(
                                what(
                                    &format!("gather_from_sequence_parallel_region({tp_grad})"),
                                    known,
                                ),
                                distributed(&inputs, output, |x, g| {
                                    gather_from_sequence_parallel_region(x, g, tp_grad, sizes)
                                })?,
                                want.clone(),
                            )?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// `gather ∘ scatter` is the identity for every length at least the group size, with the
/// sizes exchanged or derived from the split rule.
#[test]
fn gather_undoes_scatter() -> Result<()> {
    for n in 1..=MAX_RANKS {
        for len in n..n + 2 * n {
            for dim in 0..2 {
                let x = random(&with_len(&[3, 2], dim, len), len as u64);
                let inputs = vec![x.clone(); n];
                let results = distributed(&inputs, Layout::Replicated, |x, g| {
                    let mine = scatter_to_region(x, g, dim, None)?;
                    let exchanged = gather_from_region(&mine, g, dim, None)?;
                    let derived = gather_from_region(&mine, g, dim, Some(&split_sizes(len, n)?))?;
                    assert_eq!(exchanged.to_vec()?, derived.to_vec()?);
                    Ok(exchanged)
                })?;
                for r in results {
                    assert_eq!(r.output, x.to_vec()?, "n={n} len={len} dim={dim}");
                    assert_eq!(r.shape, x.shape());
                }
            }
        }
    }
    Ok(())
}

/// The emulation itself is right: its gradients pass finite differences.
#[test]
fn the_world_emulation_passes_gradcheck() -> Result<()> {
    let inputs = per_rank_inputs(&[vec![2, 1, 2], vec![2, 3, 2], vec![2, 2, 2]], 17);
    let weights: Vec<Tensor<f64>> = (0..3).map(|r| random(&[2, 6, 2], 40 + r)).collect();
    ferrotron_tape::gradcheck(
        |xs| {
            let refs: Vec<&Tensor<f64>> = xs.iter().collect();
            let gathered = Tensor::concat(&refs, 1)?;
            let mut loss = gathered.mul(&weights[0])?.sum()?;
            for w in &weights[1..] {
                loss = loss.add(&gathered.mul(w)?.sum()?)?;
            }
            Ok(loss)
        },
        &inputs,
        &ferrotron_tape::GradCheckOptions::default(),
    )?;
    Ok(())
}

/// Random ranks of tensors, group sizes, dims and per-rank lengths (empty ones included).
mod random_shapes {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    fn check(n: usize, shape: &[usize], dim: usize, lengths: &[usize], seed: u64) -> Result<()> {
        let shapes: Vec<Vec<usize>> = lengths.iter().map(|&l| with_len(shape, dim, l)).collect();
        let parts = per_rank_inputs(&shapes, seed);
        compare(
            format!("all_gather_from_region n={n} dim={dim} shapes={shapes:?}"),
            distributed(&parts, Layout::PerRank, |x, g| {
                all_gather_from_region(x, g, dim, None)
            })?,
            serial(&parts, Layout::PerRank, Layout::PerRank, |xs| {
                let refs: Vec<&Tensor<f64>> = xs.iter().collect();
                Ok(vec![Tensor::concat(&refs, dim)?; n])
            })?,
        )?;
        let whole = with_len(shape, dim, lengths.iter().sum());
        let inputs = per_rank_inputs(&vec![whole; n], seed + 100);
        compare(
            format!("reduce_scatter_to_region n={n} dim={dim} sizes={lengths:?}"),
            distributed(&inputs, Layout::PerRank, |x, g| {
                reduce_scatter_to_region(x, g, dim, Some(lengths))
            })?,
            serial(&inputs, Layout::PerRank, Layout::PerRank, |xs| {
                let total = sum_all(xs)?;
                (0..n).map(|r| part(&total, dim, lengths, r)).collect()
            })?,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]
        #[test]
        fn gathers_and_reduce_scatters_match_the_world(
            n in 1usize..=8,
            shape in vec(1usize..4, 1..=3),
            dim_choice in 0usize..3,
            lengths in vec(0usize..4, 8),
            seed in 0u64..1000,
        ) {
            let dim = dim_choice % shape.len();
            check(n, &shape, dim, &lengths[..n], seed)
                .map_err(|e| TestCaseError::fail(format!("{e:#}")))?;
        }
    }
}
