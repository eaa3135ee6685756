//! A step's transfers between stages: each tensor travels as a header (producing virtual
//! stage, microbatch, format, shape) and its data, so that a receiver can tell a
//! misrouted, misshapen or misformatted tensor from a right one. An exchange runs as one
//! batch, or, with [`PipelineConfig::overlap_p2p`](super::PipelineConfig::overlap_p2p),
//! its receives are posted one exchange ahead (Megatron's `--overlap-p2p-comm`).

use super::{out_of_step, Key, Step};
use crate::error::{Error, Result};
use crate::schedule::Transfer;
use ferrotron_comm_core::{Buffer, DType, P2p, P2pWork};
use ferrotron_tape::{Device, Tensor};

/// A tensor to send: its header and its memory.
struct Outgoing {
    peer: usize,
    header: Vec<i64>,
    data: Buffer,
}

/// A tensor to receive into: which forward or backward needs it, and where it lands.
struct Incoming {
    forward: bool,
    key: Key,
    header: Vec<i64>,
    data: Buffer,
}

/// A receive posted ahead of its exchange; abandoned, not awaited, if the step fails
/// before it (its sender may be waiting for this rank).
pub(super) struct Posted {
    forward: bool,
    key: Key,
    header: Option<P2pWork>,
    data: Option<P2pWork>,
}

impl Drop for Posted {
    fn drop(&mut self) {
        for work in [self.header.take(), self.data.take()].into_iter().flatten() {
            work.abandon();
        }
    }
}

impl Step<'_> {
    /// Runs one exchange of the plan: its sends, and its receives (posted now, or
    /// earlier by [`post_receives`](Self::post_receives)).
    pub(super) fn exchange(&mut self, transfers: &[Transfer]) -> Result<()> {
        // A wrong shape of our own is reported after the exchange: the neighbour must
        // get its message (and its own error) rather than wait for one.
        let (outgoing, own_error) = self.outgoing(transfers)?;
        let received = if self.pipeline.config.overlap_p2p {
            self.finish_posted(&outgoing)
        } else {
            self.exchange_now(transfers, &outgoing)
        };
        if let Some(error) = own_error {
            return Err(error);
        }
        for incoming in received? {
            self.accept(incoming)?;
        }
        Ok(())
    }

    /// Posts the receives of `transfers`, the plan's next exchange, so that their
    /// copies run beside the compute queued before that exchange.
    pub(super) fn post_receives(&mut self, transfers: &[Transfer]) -> Result<()> {
        let group = &self.pipeline.group;
        let mut posted = Vec::new();
        for incoming in self.incoming(transfers)? {
            let peer = self.neighbour(!incoming.forward);
            let header = Buffer::from_vec(incoming.header);
            let mut receive = Posted {
                forward: incoming.forward,
                key: incoming.key,
                header: Some(group.irecv(header, peer)?),
                data: None,
            };
            receive.data = Some(group.irecv(incoming.data, peer)?);
            posted.push(receive);
        }
        self.posted.push_back(posted);
        Ok(())
    }

    /// The sends of an exchange, and the first error in what this rank sends (a
    /// placeholder of the expected shape and format travels in its place).
    fn outgoing(&mut self, transfers: &[Transfer]) -> Result<(Vec<Outgoing>, Option<Error>)> {
        let mut own_error = None;
        let mut sends = Vec::new();
        for transfer in transfers {
            let forward = match transfer {
                Transfer::SendForward => true,
                Transfer::SendBackward => false,
                Transfer::RecvForward | Transfer::RecvBackward => continue,
            };
            let pending = if forward {
                self.to_send_forward.take()
            } else {
                self.to_send_backward.take()
            };
            let ((chunk, microbatch), tensor) = pending.ok_or_else(|| {
                Error::Config("internal: the plan sends a tensor it has not made".into())
            })?;
            let vstage = self.pipeline.virtual_stage(chunk);
            if own_error.is_none() {
                own_error = self.check_sent(&tensor, forward, vstage, microbatch);
            }
            let format_code = code(tensor.dtype()).unwrap_or(-1);
            let mut header = vec![vstage as i64, microbatch as i64, format_code];
            header.extend(tensor.shape().iter().map(|&d| d as i64));
            // Sent from the tensor's memory on the stage's device, as stored (a device
            // copy first only if autograd still shares it): NCCL moves it on the GPU, the
            // threads and MPI backends stage device memory through the host themselves.
            // The receiver posts memory of the expected shape and format on its device,
            // so a wrong tensor travels as such a placeholder; the header tells the
            // receiver what was wrong.
            let config = &self.pipeline.config;
            let data = if own_error.is_some() {
                receive_buffer(config.device, config.dtype, &config.shape)?
            } else {
                tensor.to_device(config.device)?.into_buffer()?
            };
            let peer = self.neighbour(forward);
            sends.push(Outgoing { peer, header, data });
        }
        Ok((sends, own_error))
    }

    /// The error in a tensor this rank sends, if its format or shape is not the step's.
    fn check_sent(
        &self,
        tensor: &Tensor,
        forward: bool,
        stage: usize,
        microbatch: usize,
    ) -> Option<Error> {
        let (format, expected) = (self.format(), &self.pipeline.config.shape);
        let what = if forward {
            "activation sent"
        } else {
            "gradient sent"
        };
        if tensor.dtype() != format {
            return Some(Error::Format {
                stage,
                what,
                microbatch,
                got: tensor.dtype().to_string(),
                expected: format,
            });
        }
        (tensor.shape() != expected.as_slice()).then(|| Error::Shape {
            stage,
            what,
            microbatch,
            got: tensor.shape().iter().map(|&d| d as i64).collect(),
            expected: expected.clone(),
        })
    }

    /// The receives of an exchange, each with memory of the expected shape and format.
    fn incoming(&mut self, transfers: &[Transfer]) -> Result<Vec<Incoming>> {
        let config = &self.pipeline.config;
        let mut receives = Vec::new();
        for transfer in transfers {
            let forward = match transfer {
                Transfer::RecvForward => true,
                Transfer::RecvBackward => false,
                Transfer::SendForward | Transfer::SendBackward => continue,
            };
            let awaiting = if forward {
                &mut self.awaiting_input
            } else {
                &mut self.awaiting_gradient
            };
            let key = awaiting.pop_front().ok_or_else(|| {
                Error::Config("internal: the plan receives a tensor nobody needs".into())
            })?;
            receives.push(Incoming {
                forward,
                key,
                header: vec![0; 3 + config.shape.len()],
                data: receive_buffer(config.device, config.dtype, &config.shape)?,
            });
        }
        Ok(receives)
    }

    /// The next rank (`forward`) or the previous one, around the ring of stages.
    fn neighbour(&self, forward: bool) -> usize {
        let (pp, rank) = (self.pipeline.group.size(), self.pipeline.group.rank());
        if forward {
            (rank + 1) % pp
        } else {
            (rank + pp - 1) % pp
        }
    }

    /// Sends and receives one exchange in one batch.
    fn exchange_now(
        &mut self,
        transfers: &[Transfer],
        outgoing: &[Outgoing],
    ) -> Result<Vec<Incoming>> {
        let mut incoming = self.incoming(transfers)?;
        let mut ops = Vec::with_capacity(2 * (outgoing.len() + incoming.len()));
        for send in outgoing {
            ops.push(P2p::Send {
                buf: send.header.as_slice().into(),
                peer: send.peer,
            });
            ops.push(P2p::Send {
                buf: send.data.as_buf_ref(),
                peer: send.peer,
            });
        }
        for receive in incoming.iter_mut() {
            let peer = self.neighbour(!receive.forward);
            ops.push(P2p::Recv {
                buf: receive.header.as_mut_slice().into(),
                peer,
            });
            ops.push(P2p::Recv {
                buf: receive.data.as_buf_mut(),
                peer,
            });
        }
        self.pipeline.group.exchange(&mut ops)?;
        drop(ops);
        Ok(incoming)
    }

    /// Sends an exchange's tensors and finishes the receives posted for it.
    fn finish_posted(&mut self, outgoing: &[Outgoing]) -> Result<Vec<Incoming>> {
        let posted = self.posted.pop_front().ok_or_else(|| {
            Error::Config("internal: an exchange whose receives were not posted".into())
        })?;
        let group = &self.pipeline.group;
        let mut sends = Vec::with_capacity(2 * outgoing.len());
        for send in outgoing {
            sends.push(group.isend(send.header.as_slice().into(), send.peer)?);
            sends.push(group.isend(send.data.as_buf_ref(), send.peer)?);
        }
        // Every receive is waited for before any send fails the call, so that a
        // neighbour's error surfaces here as its own, not as a lost peer.
        let mut first_error = None;
        let mut incoming = Vec::with_capacity(posted.len());
        for receive in posted {
            match receive.finish() {
                Ok(done) => incoming.push(done),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        for send in sends {
            if let Err(e) = send.wait() {
                first_error.get_or_insert(e.into());
            }
        }
        first_error.map_or(Ok(incoming), Err)
    }

    /// Checks a received tensor's header and hands it to the forward or backward that
    /// needs it (the memory the transfer filled, on the stage's device: no copy).
    fn accept(&mut self, incoming: Incoming) -> Result<()> {
        let Incoming {
            forward,
            key,
            header,
            data,
        } = incoming;
        let (chunk, microbatch) = key;
        let stage = self.pipeline.virtual_stage(chunk);
        let producer = if forward { stage - 1 } else { stage + 1 };
        let (what, needed) = if forward {
            ("activation received", "an activation")
        } else {
            ("gradient received", "a gradient")
        };
        if header[..2] != [producer as i64, microbatch as i64] {
            return Err(out_of_step(needed, stage, microbatch));
        }
        let (format, expected) = (self.format(), &self.pipeline.config.shape);
        let got = usize::try_from(header[2])
            .ok()
            .and_then(|c| FORMATS.get(c).copied());
        if got != Some(format) {
            return Err(Error::Format {
                stage,
                what,
                microbatch,
                got: got.map_or_else(|| format!("format code {}", header[2]), |d| d.to_string()),
                expected: format,
            });
        }
        let dims = &header[3..];
        if dims
            .iter()
            .map(|&d| d as usize)
            .ne(expected.iter().copied())
        {
            return Err(Error::Shape {
                stage,
                what,
                microbatch,
                got: dims.to_vec(),
                expected: expected.clone(),
            });
        }
        let tensor = Tensor::from_buffer(data)?;
        if forward {
            self.received.insert(key, tensor);
        } else {
            self.gradients.insert(key, tensor);
        }
        Ok(())
    }
}

impl Posted {
    /// Waits for the header and the data.
    fn finish(mut self) -> Result<Incoming> {
        let take = |work: Option<P2pWork>| -> Result<Buffer> {
            let work =
                work.ok_or_else(|| Error::Config("internal: a receive waited twice".into()))?;
            work.wait()?
                .ok_or_else(|| Error::Config("internal: a receive gave no buffer back".into()))
        };
        let header = take(self.header.take())?.into_vec::<i64>()?;
        let data = take(self.data.take())?;
        Ok(Incoming {
            forward: self.forward,
            key: self.key,
            header,
            data,
        })
    }
}

/// Memory for a received tensor of `shape` in `format` on `device` (zeros until the
/// transfer fills it), lent so the transfer writes into it in place.
fn receive_buffer(device: Device, format: DType, shape: &[usize]) -> Result<Buffer> {
    Ok(Tensor::<f32>::full_as(shape, 0.0, format, device)?.into_buffer()?)
}

/// The formats a header can name, by their code (their position).
const FORMATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// The code of `dtype` in a header, if activations can travel in it.
pub(super) fn code(dtype: DType) -> Option<i64> {
    FORMATS.iter().position(|&f| f == dtype).map(|p| p as i64)
}
