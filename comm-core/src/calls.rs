//! What every backend does with a call before moving data: validate it locally (buffer
//! lengths, counts, roots, dtypes) and, once the peers' signatures are known, check that
//! all ranks agree.

use crate::buffer::{BufMut, BufRef};
use crate::dtype::{reduce_raw, DType, Element, ReduceOp};
use crate::error::{CallSignature, Error, OpKind, Result};
use ferrotron_device::Device;

/// One rank's view of its group, for validating calls.
pub(crate) struct CallCheck<'a> {
    pub(crate) group: &'a str,
    pub(crate) rank: usize,
    pub(crate) size: usize,
}

impl CallCheck<'_> {
    pub(crate) fn signature(
        &self,
        op: OpKind,
        dtype: Option<DType>,
        count: usize,
    ) -> CallSignature {
        CallSignature {
            rank: self.rank,
            op,
            dtype,
            reduce: None,
            count,
            root: None,
            memory: Device::Cpu,
            counts: None,
            recv_counts: None,
        }
    }

    /// The signature of a call that moves `count` elements of `dtype` in `memory`.
    fn data_signature(
        &self,
        op: OpKind,
        dtype: DType,
        memory: Device,
        count: usize,
    ) -> CallSignature {
        CallSignature {
            memory,
            ..self.signature(op, Some(dtype), count)
        }
    }

    fn invalid_buffer(&self, op: OpKind, detail: String) -> Error {
        Error::InvalidBuffer {
            op,
            group: self.group.to_string(),
            detail,
        }
    }

    fn invalid_argument(&self, op: OpKind, detail: String) -> Error {
        Error::InvalidArgument {
            op,
            group: self.group.to_string(),
            detail,
        }
    }

    fn reduce_op(&self, op: OpKind, reduce: ReduceOp, dtype: DType) -> Result<()> {
        if reduce.supports(dtype) {
            Ok(())
        } else {
            Err(Error::Unsupported {
                op,
                reduce,
                dtype,
                hint: "averaging integers has no agreed rounding; use Sum and divide",
            })
        }
    }

    /// Input and output of one call must have one dtype and live in one kind of memory.
    fn same_kind(&self, op: OpKind, input: &BufRef<'_>, output: &BufMut<'_>) -> Result<()> {
        let (input, output) = (
            (input.dtype(), input.memory()),
            (output.dtype(), output.memory()),
        );
        if input.1 != output.1 {
            return Err(self.invalid_buffer(
                op,
                format!(
                    "input is in {} memory but output in {}; pass both on the same device",
                    input.1, output.1
                ),
            ));
        }
        if input.0 == output.0 {
            Ok(())
        } else {
            Err(self.invalid_buffer(
                op,
                format!(
                    "input is {} but output is {}; both must have one dtype",
                    input.0, output.0
                ),
            ))
        }
    }

    fn counts(&self, op: OpKind, counts: &[usize]) -> Result<()> {
        if counts.len() == self.size {
            Ok(())
        } else {
            Err(self.invalid_argument(
                op,
                format!(
                    "{} per-rank counts given for a group of {} ranks; pass one count per rank",
                    counts.len(),
                    self.size
                ),
            ))
        }
    }

    fn member(&self, op: OpKind, role: &str, rank: usize) -> Result<()> {
        if rank < self.size {
            Ok(())
        } else {
            Err(self.invalid_argument(
                op,
                format!("{role} {rank} is not a rank of a group of {}", self.size),
            ))
        }
    }

    /// Checks that `peer` names another rank of the group (a rendezvous with oneself
    /// could never complete).
    pub(crate) fn peer(&self, op: OpKind, role: &str, peer: usize) -> Result<()> {
        self.member(op, role, peer)?;
        if peer == self.rank {
            Err(self.invalid_argument(
                op,
                format!("{role} {peer} is this rank; send and recv pair two different ranks"),
            ))
        } else {
            Ok(())
        }
    }

    pub(crate) fn all_reduce(&self, buf: &BufMut<'_>, reduce: ReduceOp) -> Result<CallSignature> {
        let op = OpKind::AllReduce;
        self.reduce_op(op, reduce, buf.dtype())?;
        let mut sig = self.data_signature(op, buf.dtype(), buf.memory(), buf.len());
        sig.reduce = Some(reduce);
        Ok(sig)
    }

    pub(crate) fn broadcast(&self, buf: &BufMut<'_>, root: usize) -> Result<CallSignature> {
        let op = OpKind::Broadcast;
        self.member(op, "root", root)?;
        let mut sig = self.data_signature(op, buf.dtype(), buf.memory(), buf.len());
        sig.root = Some(root);
        Ok(sig)
    }

    /// Validates an all-gather; `counts` is `None` for the equal-count variant. Returns
    /// the signature and the per-rank counts.
    pub(crate) fn all_gather(
        &self,
        input: &BufRef<'_>,
        output: &BufMut<'_>,
        counts: Option<&[usize]>,
    ) -> Result<(CallSignature, Vec<usize>)> {
        let n = self.size;
        let Some(counts) = counts else {
            let op = OpKind::AllGather;
            self.same_kind(op, input, output)?;
            if output.len() != input.len() * n {
                return Err(self.invalid_buffer(
                    op,
                    format!(
                        "output has {} elements; it must hold size × input = {n} × {} = {}",
                        output.len(),
                        input.len(),
                        input.len() * n
                    ),
                ));
            }
            let sig = self.data_signature(op, input.dtype(), input.memory(), input.len());
            return Ok((sig, vec![input.len(); n]));
        };
        let op = OpKind::AllGatherV;
        self.counts(op, counts)?;
        self.same_kind(op, input, output)?;
        let total: usize = counts.iter().sum();
        if input.len() != counts[self.rank] || output.len() != total {
            return Err(self.invalid_buffer(
                op,
                format!(
                    "input has {} elements and output {}; with counts {counts:?} rank {} must \
                     pass {} and the output must hold {total}",
                    input.len(),
                    output.len(),
                    self.rank,
                    counts[self.rank]
                ),
            ));
        }
        let mut sig = self.data_signature(op, input.dtype(), input.memory(), input.len());
        sig.counts = Some(counts.to_vec());
        Ok((sig, counts.to_vec()))
    }

    /// Validates a reduce-scatter; `counts` is `None` for the equal-count variant. Returns
    /// the signature and the per-rank counts.
    pub(crate) fn reduce_scatter(
        &self,
        input: &BufRef<'_>,
        output: &BufMut<'_>,
        counts: Option<&[usize]>,
        reduce: ReduceOp,
    ) -> Result<(CallSignature, Vec<usize>)> {
        let n = self.size;
        let op = if counts.is_some() {
            OpKind::ReduceScatterV
        } else {
            OpKind::ReduceScatter
        };
        self.same_kind(op, input, output)?;
        self.reduce_op(op, reduce, input.dtype())?;
        let counts = match counts {
            Some(counts) => {
                self.counts(op, counts)?;
                counts.to_vec()
            }
            None => {
                if input.len() != output.len() * n {
                    return Err(self.invalid_buffer(
                        op,
                        format!(
                            "input has {} elements; it must hold size × output = {n} × {} = {}",
                            input.len(),
                            output.len(),
                            output.len() * n
                        ),
                    ));
                }
                vec![output.len(); n]
            }
        };
        let total: usize = counts.iter().sum();
        if input.len() != total || output.len() != counts[self.rank] {
            return Err(self.invalid_buffer(
                op,
                format!(
                    "input has {} elements and output {}; with counts {counts:?} the input \
                     must hold {total} and rank {}'s output {}",
                    input.len(),
                    output.len(),
                    self.rank,
                    counts[self.rank]
                ),
            ));
        }
        let mut sig = self.data_signature(op, input.dtype(), input.memory(), input.len());
        sig.reduce = Some(reduce);
        if op == OpKind::ReduceScatterV {
            sig.counts = Some(counts.clone());
        }
        Ok((sig, counts))
    }

    pub(crate) fn all_to_all_v(
        &self,
        input: &BufRef<'_>,
        send_counts: &[usize],
        output: &BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<CallSignature> {
        let op = OpKind::AllToAllV;
        self.counts(op, send_counts)?;
        self.counts(op, recv_counts)?;
        self.same_kind(op, input, output)?;
        let (send_total, recv_total) = (
            send_counts.iter().sum::<usize>(),
            recv_counts.iter().sum::<usize>(),
        );
        if input.len() != send_total || output.len() != recv_total {
            return Err(self.invalid_buffer(
                op,
                format!(
                    "input has {} elements and output {}; the send counts sum to {send_total} \
                     and the receive counts to {recv_total}",
                    input.len(),
                    output.len()
                ),
            ));
        }
        let mut sig = self.data_signature(op, input.dtype(), input.memory(), input.len());
        sig.counts = Some(send_counts.to_vec());
        sig.recv_counts = Some(recv_counts.to_vec());
        Ok(sig)
    }
}

/// Start offset of every rank's block, for per-rank counts.
pub(crate) fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |acc, &c| {
            let start = *acc;
            *acc += c;
            Some(start)
        })
        .collect()
}

/// Whether every rank asked for a compatible call; also what makes direct reads of
/// peers' memory safe, since it proves every buffer has the length we assume.
pub(crate) fn signatures_agree(sigs: &[&CallSignature]) -> bool {
    let first = sigs[0];
    let same = |f: &dyn Fn(&CallSignature) -> bool| sigs.iter().all(|s| f(s));
    if !same(&|s| {
        s.op == first.op
            && s.dtype == first.dtype
            && s.reduce == first.reduce
            && s.root == first.root
            // Host, emulated or device memory (any device) on every rank.
            && std::mem::discriminant(&s.memory) == std::mem::discriminant(&first.memory)
    }) {
        return false;
    }
    match first.op {
        OpKind::AllReduce | OpKind::Broadcast | OpKind::AllGather | OpKind::ReduceScatter => {
            same(&|s| s.count == first.count)
        }
        OpKind::AllGatherV => {
            same(&|s| s.counts == first.counts)
                && first.counts.as_ref().is_some_and(|c| {
                    c.len() == sigs.len() && sigs.iter().all(|s| c[s.rank] == s.count)
                })
        }
        OpKind::ReduceScatterV => {
            same(&|s| s.counts == first.counts)
                && first
                    .counts
                    .as_ref()
                    .is_some_and(|c| sigs.iter().all(|s| c.iter().sum::<usize>() == s.count))
        }
        OpKind::AllToAllV => sigs.iter().all(|s| {
            let sends = s.counts.as_deref().unwrap_or_default();
            sends.len() == sigs.len()
                && sigs.iter().all(|peer| {
                    let recvs = peer.recv_counts.as_deref().unwrap_or_default();
                    recvs.len() == sigs.len() && recvs[s.rank] == sends[peer.rank]
                })
        }),
        OpKind::Barrier | OpKind::Split | OpKind::Send | OpKind::Recv | OpKind::Exchange => true,
    }
}

/// Reduces typed slices into `out` (a safe wrapper used by tests, benchmarks and
/// sequential references): `out[i] = op(sources[0][i], sources[1][i], ...)`, combined in
/// source order exactly as the backends combine ranks.
pub fn reduce_slices<T: Element>(op: ReduceOp, sources: &[&[T]], out: &mut [T]) -> Result<()> {
    let invalid = |detail: String| Error::InvalidBuffer {
        op: OpKind::AllReduce,
        group: "reduce_slices".into(),
        detail,
    };
    if sources.is_empty() {
        return Err(invalid("no sources given; pass at least one slice".into()));
    }
    if let Some(bad) = sources.iter().find(|s| s.len() != out.len()) {
        return Err(invalid(format!(
            "a source has {} elements but the output {}; all must have the same length",
            bad.len(),
            out.len()
        )));
    }
    if !op.supports(T::DTYPE) {
        return Err(Error::Unsupported {
            op: OpKind::AllReduce,
            reduce: op,
            dtype: T::DTYPE,
            hint: "averaging integers has no agreed rounding; use Sum and divide",
        });
    }
    let ptrs: Vec<*const T> = sources.iter().map(|s| s.as_ptr()).collect();
    // SAFETY: lengths checked above; `out` is a distinct &mut so it overlaps no source.
    unsafe { reduce_raw(op, &ptrs, &[out.as_mut_ptr()], out.len()) };
    Ok(())
}

#[cfg(test)]
#[path = "calls_tests.rs"]
mod tests;
