//! The cross-rank signature check of the MPI and NCCL backends, written once for both.
//!
//! Each rank encodes its call's [`CallSignature`] as a fixed number of `i64` words
//! ([`words`]), the backend all-gathers the words of every rank (`MPI_Allgather` on the
//! host, `ncclAllGather` on the device) and every rank decodes and compares all of them
//! with the rule the local backend uses ([`signatures_agree`]). Every rank sees the same
//! words, so every rank reaches the same verdict: all go on, or all return
//! [`Error::Mismatch`] naming op, group, sequence number and each rank's arguments. The
//! local backend compares the signatures in shared memory instead.
//!
//! The all-gather is the caller's: [`agree`] takes it as a closure, so the check is
//! tested over the local backend without MPI or a GPU. A backend may append words of its
//! own to every rank's signature (the MPI backend sends a small call's data along, so the
//! call finishes from the same exchange); [`agree`] hands every rank's words back.

use crate::calls::signatures_agree;
use crate::dtype::{DType, ReduceOp};
use crate::error::{CallSignature, Error, OpKind, Result};
use ferrotron_device::Device;

/// Words before the per-rank lists: op, dtype, reduce, count, root, memory.
const HEADER: usize = 6;

/// How many words one rank contributes in a group of `size` ranks: the header, then the
/// per-rank counts and receive counts (`-1` when the call has none).
pub(crate) fn words(size: usize) -> usize {
    HEADER + 2 * size
}

/// Checks that every rank of a `size`-rank group issued a call compatible with `sig`.
/// Each rank contributes its encoded signature followed by `extra`, which must have the
/// same length on every rank. `all_gather(mine, all)` is the only communication: it must
/// fill `all` (`size` times `mine.len()` words) with every rank's `mine`, in rank order,
/// and every rank must call it at the same point. Returns `all` when the calls agree
/// (rank `r`'s extra words start at `r * mine.len() + words(size)`), [`Error::Mismatch`]
/// on every rank when they disagree, or the all-gather's own error.
pub(crate) fn agree(
    group: &str,
    seq: u64,
    size: usize,
    sig: &CallSignature,
    extra: &[i64],
    all_gather: impl FnOnce(&[i64], &mut [i64]) -> Result<()>,
) -> Result<Vec<i64>> {
    let mut mine = encode(sig, size);
    mine.extend_from_slice(extra);
    let mut all = vec![0i64; mine.len() * size];
    all_gather(&mine, &mut all)?;
    let calls: Vec<CallSignature> = all
        .chunks(mine.len())
        .enumerate()
        .map(|(rank, words)| decode(rank, words, size))
        .collect();
    if signatures_agree(&calls.iter().collect::<Vec<_>>()) {
        Ok(all)
    } else {
        Err(Error::Mismatch {
            group: group.to_string(),
            seq,
            calls,
        })
    }
}

/// Reads an on/off environment variable: `1`, `true`, `yes`, `on` or `0`, `false`, `no`,
/// `off` (any case); unset or empty means `default`.
#[cfg(any(feature = "mpi", feature = "cuda"))]
pub(crate) fn switch_from_env(var: &str, default: bool) -> Result<bool> {
    parse_switch(var, std::env::var(var).ok().as_deref(), default)
}

fn parse_switch(var: &str, value: Option<&str>, default: bool) -> Result<bool> {
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(default);
    };
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::Config(format!(
            "{var}={value:?}: use 1 to compare every collective's signature across ranks \
             before it runs, or 0 to skip the comparison (default {})",
            if default { "1" } else { "0" }
        ))),
    }
}

/// The fixed-size encoding of `sig` in a group of `size` ranks (see [`words`]).
fn encode(sig: &CallSignature, size: usize) -> Vec<i64> {
    let index = |found: Option<usize>| found.map_or(-1, |i| i as i64);
    let mut words = Vec::with_capacity(words(size));
    words.extend([
        index(OpKind::ALL.iter().position(|&o| o == sig.op)),
        index(
            sig.dtype
                .and_then(|d| DType::ALL.iter().position(|&x| x == d)),
        ),
        index(
            sig.reduce
                .and_then(|r| ReduceOp::ALL.iter().position(|&x| x == r)),
        ),
        sig.count as i64,
        index(sig.root),
        match sig.memory {
            Device::Cpu => -1,
            Device::Emulated => -2,
            Device::Cuda(device) => device as i64,
        },
    ]);
    for counts in [&sig.counts, &sig.recv_counts] {
        match counts {
            // A list of the wrong length is rejected locally before any check runs.
            Some(c) if c.len() == size => words.extend(c.iter().map(|&x| x as i64)),
            _ => words.extend(std::iter::repeat_n(-1, size)),
        }
    }
    words
}

/// The signature rank `rank` encoded as `words`.
fn decode(rank: usize, words: &[i64], size: usize) -> CallSignature {
    let pick = |w: i64| usize::try_from(w).ok();
    let list = |from: usize| {
        let part = &words[from..from + size];
        (part.first() != Some(&-1)).then(|| part.iter().map(|&x| x as usize).collect())
    };
    CallSignature {
        rank,
        op: pick(words[0])
            .and_then(|i| OpKind::ALL.get(i).copied())
            .unwrap_or(OpKind::Barrier),
        dtype: pick(words[1]).and_then(|i| DType::ALL.get(i).copied()),
        reduce: pick(words[2]).and_then(|i| ReduceOp::ALL.get(i).copied()),
        count: pick(words[3]).unwrap_or(0),
        root: pick(words[4]),
        memory: match words[5] {
            -2 => Device::Emulated,
            w => pick(w).map_or(Device::Cpu, Device::Cuda),
        },
        counts: list(HEADER),
        recv_counts: list(HEADER + size),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{run_local, BufMut, BufRef, Communicator};

    fn sig(rank: usize, op: OpKind, dtype: DType, count: usize) -> CallSignature {
        CallSignature {
            rank,
            op,
            dtype: Some(dtype),
            reduce: None,
            count,
            root: None,
            memory: Device::Cpu,
            counts: None,
            recv_counts: None,
        }
    }

    #[test]
    fn every_field_survives_the_encoding() {
        let full = CallSignature {
            reduce: Some(ReduceOp::Max),
            root: Some(2),
            memory: Device::Cuda(3),
            counts: Some(vec![4, 0, 7]),
            recv_counts: Some(vec![0, 1, 2]),
            ..sig(1, OpKind::AllToAllV, DType::BF16, 11)
        };
        let words = encode(&full, 3);
        assert_eq!(words.len(), super::words(3));
        assert_eq!(decode(1, &words, 3), full);
        for memory in [Device::Cpu, Device::Emulated, Device::Cuda(0)] {
            let placed = CallSignature {
                memory,
                ..full.clone()
            };
            assert_eq!(decode(1, &encode(&placed, 3), 3), placed);
        }
        for op in OpKind::ALL {
            for dtype in DType::ALL {
                let plain = sig(0, op, dtype, 5);
                assert_eq!(decode(0, &encode(&plain, 2), 2), plain);
            }
        }
        let bare = CallSignature {
            dtype: None,
            ..sig(0, OpKind::Barrier, DType::U8, 0)
        };
        assert_eq!(decode(0, &encode(&bare, 1), 1), bare);
    }

    /// Two extra words rank `r` sends along with its signature.
    fn extra(rank: usize) -> [i64; 2] {
        [rank as i64 * 10 + 1, -7]
    }

    /// Runs the check on `n` local ranks, rank `r` calling `call(r)` with [`extra`]`(r)`,
    /// over the all-gather of host words the local backend provides; returns every rank's
    /// outcome, having checked that an agreement hands back every rank's words.
    fn check_over_local(n: usize, call: impl Fn(usize) -> CallSignature + Sync) -> Vec<Result<()>> {
        run_local(n, |comm| {
            let words = words(comm.size()) + 2;
            let mut outcomes = Vec::new();
            // Call #1 agrees on every rank, then call #2 is the one under test: the
            // sequence number in the error is the one passed in.
            let barrier = CallSignature {
                dtype: None,
                ..sig(comm.rank(), OpKind::Barrier, DType::U8, 0)
            };
            for (seq, sig) in [(1, barrier), (2, call(comm.rank()))] {
                let mine = extra(comm.rank());
                let outcome = agree(comm.name(), seq, comm.size(), &sig, &mine, |mine, all| {
                    assert_eq!((mine.len(), all.len()), (words, words * comm.size()));
                    comm.all_gather(BufRef::from(mine), BufMut::from(all))
                });
                outcomes.push(outcome.map(|all| {
                    for (r, theirs) in all.chunks(words).enumerate() {
                        assert_eq!(theirs[words - 2..], extra(r), "rank {r}'s extra words");
                        assert_eq!(decode(r, theirs, comm.size()).rank, r);
                    }
                }));
            }
            let first = outcomes.remove(0);
            assert!(first.is_ok(), "{first:?}");
            Ok::<_, Error>(outcomes.remove(0))
        })
        .unwrap()
    }

    /// Every rank got `Mismatch` at call #2 with every rank's own arguments.
    fn assert_mismatch(outcomes: &[Result<()>], expected: impl Fn(usize) -> CallSignature) {
        for (rank, outcome) in outcomes.iter().enumerate() {
            match outcome {
                Err(Error::Mismatch { group, seq, calls }) => {
                    assert_eq!((group.as_str(), *seq), ("world", 2), "rank {rank}");
                    let want: Vec<_> = (0..outcomes.len()).map(&expected).collect();
                    assert_eq!(calls, &want, "rank {rank}");
                }
                other => panic!("rank {rank}: expected Mismatch, got {other:?}"),
            }
        }
    }

    #[test]
    fn matching_calls_pass_on_every_rank() {
        for n in [1, 2, 4] {
            let outcomes = check_over_local(n, |r| CallSignature {
                reduce: Some(ReduceOp::Sum),
                ..sig(r, OpKind::AllReduce, DType::F32, 256)
            });
            assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
            // Per-rank counts that agree: rank r sends r + 1 elements to every peer.
            let outcomes = check_over_local(n, |r| CallSignature {
                counts: Some(vec![r + 1; n]),
                recv_counts: Some((1..=n).collect()),
                ..sig(r, OpKind::AllToAllV, DType::I64, (r + 1) * n)
            });
            assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
        }
    }

    #[test]
    fn each_kind_of_disagreement_is_a_mismatch_on_every_rank() {
        for n in [2, 4] {
            let last = n - 1;
            // The op: the last rank broadcasts while the others all-reduce.
            let op = |r: usize| {
                let mut s = sig(r, OpKind::AllReduce, DType::F32, 8);
                if r == last {
                    s.op = OpKind::Broadcast;
                    s.root = Some(0);
                } else {
                    s.reduce = Some(ReduceOp::Sum);
                }
                s
            };
            assert_mismatch(&check_over_local(n, op), op);
            let dtype = |r: usize| sig(r, OpKind::AllGather, [DType::F32, DType::F64][r % 2], 8);
            assert_mismatch(&check_over_local(n, dtype), dtype);
            let count = |r: usize| sig(r, OpKind::AllGather, DType::I32, 8 + (r == 1) as usize);
            assert_mismatch(&check_over_local(n, count), count);
            let root = |r: usize| CallSignature {
                root: Some((r == last) as usize),
                ..sig(r, OpKind::Broadcast, DType::U8, 3)
            };
            assert_mismatch(&check_over_local(n, root), root);
            let reduce = |r: usize| CallSignature {
                reduce: Some(if r == 0 { ReduceOp::Max } else { ReduceOp::Sum }),
                ..sig(r, OpKind::AllReduce, DType::F32, 8)
            };
            assert_mismatch(&check_over_local(n, reduce), reduce);
            // Host memory on one rank, device memory on the others.
            let memory = |r: usize| CallSignature {
                memory: if r == 0 { Device::Cpu } else { Device::Cuda(r) },
                ..sig(r, OpKind::AllGather, DType::F32, 8)
            };
            assert_mismatch(&check_over_local(n, memory), memory);
            // Emulated device memory on one rank, host memory on the others.
            let emulated = |r: usize| CallSignature {
                memory: if r == last {
                    Device::Emulated
                } else {
                    Device::Cpu
                },
                ..sig(r, OpKind::AllReduce, DType::F32, 8)
            };
            assert_mismatch(&check_over_local(n, emulated), emulated);
            // Per-rank counts that differ between ranks.
            let counts = |r: usize| {
                let mut c = vec![2; n];
                c[last] += (r == 0) as usize;
                CallSignature {
                    counts: Some(c.clone()),
                    ..sig(r, OpKind::AllGatherV, DType::F32, c[r])
                }
            };
            assert_mismatch(&check_over_local(n, counts), counts);
            // Rank 0 sends one more element to the last rank than that rank expects.
            let a2a = |r: usize| {
                let mut sends = vec![1; n];
                sends[last] += (r == 0) as usize;
                CallSignature {
                    counts: Some(sends.clone()),
                    recv_counts: Some(vec![1; n]),
                    ..sig(r, OpKind::AllToAllV, DType::F32, sends.iter().sum())
                }
            };
            assert_mismatch(&check_over_local(n, a2a), a2a);
        }
    }

    #[test]
    fn the_all_gathers_failure_is_returned() {
        let s = sig(0, OpKind::Barrier, DType::U8, 0);
        let failed = agree("g", 0, 1, &s, &[], |_, _| Err(Error::Mpi("gone".into())));
        assert!(matches!(failed, Err(Error::Mpi(m)) if m == "gone"));
    }

    #[test]
    fn switches_parse_on_off_and_default() {
        for (value, default, expect) in [
            (None, true, true),
            (None, false, false),
            (Some(""), true, true),
            (Some(" "), false, false),
            (Some("0"), true, false),
            (Some("off"), true, false),
            (Some("FALSE"), true, false),
            (Some("no"), true, false),
            (Some("1"), false, true),
            (Some(" true "), false, true),
            (Some("Yes"), false, true),
            (Some("on"), false, true),
        ] {
            assert_eq!(
                parse_switch("X", value, default).unwrap(),
                expect,
                "{value:?}"
            );
        }
        match parse_switch("FERROTRON_MPI_CHECK", Some("2"), true) {
            Err(Error::Config(m)) => {
                assert!(m.contains("FERROTRON_MPI_CHECK=\"2\""), "{m}");
                assert!(m.contains("or 0"), "{m}");
            }
            other => panic!("expected Config, got {other:?}"),
        }
    }
}
