//! Tensors lend their memory to communicators: CPU tensors as host memory, emulated ones
//! as emulated device memory, CUDA ones (where a GPU is present) as device memory on
//! their stream, with no host↔device copy; new tensors are written in place
//! by a collective; tensors become owned buffers for non-blocking collectives and come
//! back from them; and the transfer counters count exactly the copies asked for.

use ferrotron_comm_core::{run_local, AsyncOp, Buffer, Communicator, Error as CommError, ReduceOp};
use ferrotron_tape::{transfers, DType, Device, FlatStorage, FlatView, Tensor, Transfers};

/// Devices whose memory the host can read directly.
fn devices() -> [Device; 2] {
    [Device::Cpu, Device::Emulated]
}

/// Every device here: the host-addressable ones, and `cuda:0` when it can be opened
/// (otherwise the reason is printed as `skipped: …`).
fn every_device() -> Vec<Device> {
    let mut all = devices().to_vec();
    match Tensor::<f32>::zeros(&[1]).to_device(Device::Cuda(0)) {
        Ok(_) => all.push(Device::Cuda(0)),
        Err(reason) => println!("skipped on cuda:0: {reason}"),
    }
    all
}

#[test]
fn a_lent_view_holds_the_elements_in_row_major_order() -> anyhow::Result<()> {
    let x = Tensor::<f32>::from_vec((0..6).map(|i| i as f32).collect(), &[2, 3])?;
    for device in devices() {
        let on = x.to_device(device)?;
        let before = transfers(device);
        let (memory, values) = on.lend(|view| {
            (
                view.memory(),
                view.as_host_slice::<f32>().map(<[f32]>::to_vec),
            )
        })?;
        assert_eq!(
            transfers(device),
            before,
            "{device}: lending copies nothing"
        );
        let expected = if device == Device::Cpu {
            Device::Cpu
        } else {
            Device::Emulated
        };
        assert_eq!(memory, expected);
        assert_eq!(values.unwrap(), x.to_vec()?);
    }
    // A transposed CPU view lends its elements in the transposed order.
    let t = x.transpose(0, 1)?;
    let lent = t.lend(|view| view.as_host_slice::<f32>().map(<[f32]>::to_vec))?;
    assert_eq!(lent.unwrap(), vec![0., 3., 1., 4., 2., 5.]);
    Ok(())
}

#[test]
fn collectives_write_new_tensors_in_place_on_every_device() -> anyhow::Result<()> {
    for device in every_device() {
        let results = run_local(2, move |comm| -> anyhow::Result<_> {
            let r = comm.rank() as f32;
            let x = Tensor::<f32>::from_vec(vec![r, r + 1.0, r + 2.0], &[3])?.to_device(device)?;
            let before = transfers(device);
            let gathered =
                Tensor::<f32>::filled_by(device, ferrotron_tape::DType::F32, &[2, 3], |out| {
                    x.lend(|input| comm.all_gather(input, out))?
                        .map_err(anyhow::Error::from)
                })?;
            let summed = x.updated_by(|buf| {
                comm.all_reduce(buf, ReduceOp::Sum)
                    .map_err(anyhow::Error::from)
            })?;
            let moved = transfers(device) - before;
            assert_eq!((gathered.device(), summed.device()), (device, device));
            Ok((moved, gathered.to_vec()?, summed.to_vec()?, x.to_vec()?))
        })?;
        for (rank, (moved, gathered, summed, x)) in results.into_iter().enumerate() {
            assert_eq!(moved, Transfers::default(), "{device}: no host round trip");
            assert_eq!(gathered, [0., 1., 2., 1., 2., 3.]);
            assert_eq!(summed, [1., 3., 5.]);
            // The updated tensor is a copy: the original keeps its values.
            assert_eq!(x[0], rank as f32, "{device}");
        }
    }
    Ok(())
}

#[test]
fn tensors_travel_through_non_blocking_collectives_as_owned_buffers() -> anyhow::Result<()> {
    for device in every_device() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let results = run_local(2, move |comm| -> anyhow::Result<_> {
                let r = comm.rank() as f32;
                let x = Tensor::<f32>::from_vec(vec![r, 0.5, -r, 1.0], &[2, 2])?
                    .to_device(device)?
                    .to_dtype(dtype)?;
                let before = transfers(device);
                // `x` stays alive: the buffer is a private copy of shared memory.
                let buf = x.clone().into_buffer()?;
                let work = comm.start(AsyncOp::AllReduce {
                    buf,
                    op: ReduceOp::Sum,
                })?;
                let sum = Tensor::<f32>::from_buffer(work.wait()?)?;
                let moved = transfers(device) - before;
                let kept = (sum.shape().to_vec(), sum.device(), sum.dtype());
                Ok((moved, kept, sum.to_vec()?, x.to_vec()?))
            })?;
            for (rank, (moved, kept, sum, x)) in results.into_iter().enumerate() {
                let label = format!("{dtype} on {device}");
                assert_eq!(moved, Transfers::default(), "{label}: no host round trip");
                assert_eq!(kept, (vec![2, 2], device, dtype), "{label}");
                assert_eq!(sum, [1.0, 1.0, -1.0, 2.0], "{label}");
                let r = rank as f32;
                assert_eq!(x, [r, 0.5, -r, 1.0], "{label}: the lent tensor's copy");
            }
        }
    }
    Ok(())
}

#[test]
fn host_buffers_become_cpu_tensors_and_foreign_memory_is_refused() -> anyhow::Result<()> {
    let f32s = Tensor::<f32>::from_buffer(Buffer::from_vec(vec![1.0f32, 2.0]))?;
    assert_eq!((f32s.shape(), f32s.to_vec()?), (&[2][..], vec![1.0, 2.0]));
    let halves = vec![half::bf16::from_f32(0.5), half::bf16::from_f32(-3.0)];
    let bf16s = Tensor::<f32>::from_buffer(Buffer::from_vec(halves))?;
    assert_eq!(
        (bf16s.dtype(), bf16s.to_vec()?),
        (DType::BF16, vec![0.5, -3.0])
    );
    let wrong = Tensor::<f32>::from_buffer(Buffer::from_vec(vec![1i32]));
    assert!(wrong.is_err(), "i32 elements are no tensor's");
    // Flat storage lends its memory too, but only it may read that lease.
    let storage = FlatStorage::<f32>::zeros(Device::Cpu, 3)?;
    let error = Tensor::<f32>::from_buffer(storage.lease()?).unwrap_err();
    assert!(
        error.to_string().contains("read it through its owner"),
        "{error}"
    );
    Ok(())
}

#[test]
fn flat_storage_takes_back_its_lease_and_copies_in_other_results() -> anyhow::Result<()> {
    let storage = FlatStorage::<f32>::zeros(Device::Cpu, 3)?;
    let whole = FlatView::new(&storage, 0, &[3])?;
    whole.fill(1.0)?;
    // Its own lease: the result is in place, and the lease ends.
    storage.receive(storage.lease()?)?;
    assert!(!storage.is_leased());
    assert_eq!(whole.to_tensor()?.to_vec()?, [1.0; 3]);
    // A tensor's memory in another format, and a host vector: copied in, widened.
    let halves = Tensor::<f32>::from_vec(vec![0.5, 2.0, -4.0], &[3])?.to_dtype(DType::BF16)?;
    storage.receive(halves.into_buffer()?)?;
    assert_eq!(whole.to_tensor()?.to_vec()?, [0.5, 2.0, -4.0]);
    storage.receive(Buffer::from_vec(vec![7.0f32, 8.0, 9.0]))?;
    assert_eq!(whole.to_tensor()?.to_vec()?, [7.0, 8.0, 9.0]);
    // Another storage's lease, or the wrong length, is refused and changes nothing.
    let other = FlatStorage::<f32>::zeros(Device::Cpu, 3)?;
    assert!(storage.receive(other.lease()?).is_err());
    assert!(!other.is_leased(), "the refused lease is dropped");
    assert!(storage.receive(Buffer::from_vec(vec![1.0f32; 2])).is_err());
    assert_eq!(whole.to_tensor()?.to_vec()?, [7.0, 8.0, 9.0]);
    Ok(())
}

#[test]
fn a_failed_write_returns_its_error_and_no_tensor() {
    for device in every_device() {
        let outcome = Tensor::<f32>::filled_by(
            device,
            ferrotron_tape::DType::F32,
            &[2],
            |_| -> anyhow::Result<()> { Err(anyhow::anyhow!("the collective failed")) },
        );
        assert_eq!(outcome.unwrap_err().to_string(), "the collective failed");
        // A communicator's typed error comes back as itself.
        let x = Tensor::<f64>::zeros(&[1]).to_device(device).unwrap();
        let outcome = x.updated_by(|_| -> Result<(), Lent> {
            Err(Lent::Comm(CommError::Config("no".into())))
        });
        assert!(matches!(outcome, Err(Lent::Comm(CommError::Config(_)))));
    }
}

/// An error type of the kind a crate above tape defines: communicator or tape errors.
#[derive(Debug)]
enum Lent {
    Comm(CommError),
    Tape,
}

impl From<ferrotron_tape::Error> for Lent {
    fn from(_: ferrotron_tape::Error) -> Self {
        Lent::Tape
    }
}

#[test]
fn transfers_count_each_copy_and_its_bytes() -> anyhow::Result<()> {
    let before = transfers(Device::Emulated);
    let x = Tensor::<f64>::ones(&[3, 2]).to_device(Device::Emulated)?;
    let y = x.add(&x)?;
    let _ = y.to_vec()?;
    let _ = y.sum()?.item()?;
    let moved = transfers(Device::Emulated) - before;
    assert_eq!(
        moved,
        Transfers {
            to_device_bytes: 48,
            to_device_copies: 1,
            to_host_bytes: 48 + 8,
            to_host_copies: 2,
        }
    );
    // Another thread's copies are its own.
    std::thread::spawn(|| {
        Tensor::<f32>::ones(&[8])
            .to_device(Device::Emulated)
            .map(drop)
    })
    .join()
    .unwrap()?;
    assert_eq!(transfers(Device::Emulated) - before, moved);
    assert_eq!(transfers(Device::Cpu), Transfers::default());
    Ok(())
}
