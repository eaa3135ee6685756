//! Gradients as views into flat storage (what DDP's buckets are): backward accumulates
//! into the view in place and zeroing forgets instead of filling; `grad()` is a snapshot;
//! optimizers step from the view; a lease for a collective keeps every other access out,
//! even when it is leaked. On the CPU, the emulated device and `cuda:0` where present
//! (otherwise `skipped: …` is printed), with no host transfer on a device.

use ferrotron_tape::{
    transfers, Device, Error, FlatStorage, FlatView, Optimizer, Parameter, Sgd, SgdConfig, Tape,
    Tensor,
};

fn devices() -> Vec<Device> {
    let mut devices = vec![Device::Cpu, Device::Emulated];
    match Tensor::<f32>::zeros(&[1]).to_device(Device::Cuda(0)) {
        Ok(_) => devices.push(Device::Cuda(0)),
        Err(reason) => println!("skipped on cuda:0: {reason}"),
    }
    devices
}

fn param_on(device: Device, name: &str, values: Vec<f32>, shape: &[usize]) -> Parameter {
    Parameter::new(
        name,
        Tensor::from_vec(values, shape)
            .unwrap()
            .to_device(device)
            .unwrap(),
    )
}

#[test]
fn backward_accumulates_into_the_view_in_place() -> anyhow::Result<()> {
    for device in devices() {
        let storage = FlatStorage::<f32>::zeros(device, 7)?;
        let w = param_on(device, "w", vec![1.0, 2.0, 3.0, 4.0], &[2, 2]);
        let b = param_on(device, "b", vec![0.5, 0.5], &[2]);
        w.attach_main_grad(FlatView::new(&storage, 0, &[2, 2])?)?;
        b.attach_main_grad(FlatView::new(&storage, 5, &[2])?)?;
        assert!(w.main_grad().unwrap().storage().same_storage(&storage));
        let x = Tensor::from_vec(vec![1.0, -1.0], &[1, 2])?.to_device(device)?;

        let before = transfers(device);
        let tape = Tape::new();
        let loss = |scale: f64| -> ferrotron_tape::Result<Tensor> {
            x.matmul(&tape.watch(&w)?)?
                .add(&tape.watch(&b)?)?
                .scale(scale)?
                .sum()
        };
        loss(1.0)?.backward()?;
        loss(2.0)?.backward()?;
        assert_eq!(transfers(device) - before, Default::default(), "{device}");

        // d/dw = 3 · xᵀ·1, d/db = 3; the element between the views stays untouched.
        let whole = FlatView::new(&storage, 0, &[7])?.to_tensor()?;
        assert_eq!(
            whole.to_vec()?,
            [3.0, 3.0, -3.0, -3.0, 0.0, 3.0, 3.0],
            "{device}"
        );
        let snapshot = w.grad().expect("a gradient");
        assert_eq!(snapshot.device(), device);

        // Zeroing forgets: the next backward overwrites instead of adding, and the
        // snapshot taken before keeps its values.
        w.zero_grad();
        b.zero_grad();
        assert!(!w.has_grad() && w.grad().is_none());
        loss(1.0)?.backward()?;
        assert_eq!(w.grad().unwrap().to_vec()?, [1.0, 1.0, -1.0, -1.0]);
        assert_eq!(snapshot.to_vec()?, [3.0, 3.0, -3.0, -3.0]);

        // An optimizer steps from the view.
        let mut sgd = Sgd::new(vec![w.clone(), b.clone()], SgdConfig::new(0.5))?;
        sgd.step()?;
        assert_eq!(w.value()?.to_vec()?, [0.5, 1.5, 3.5, 4.5], "{device}");
        assert_eq!(b.value()?.to_vec()?, [0.0, 0.0], "{device}");

        // set_grad writes the view; take_grad forgets it.
        b.set_grad(Some(
            Tensor::from_vec(vec![7.0, 8.0], &[2])?.to_device(device)?,
        ))?;
        assert_eq!(
            FlatView::new(&storage, 5, &[2])?.to_tensor()?.to_vec()?,
            [7.0, 8.0]
        );
        assert_eq!(b.take_grad().unwrap().to_vec()?, [7.0, 8.0]);
        assert!(!b.has_grad());
    }
    Ok(())
}

#[test]
fn attaching_copies_the_gradient_in_and_checks_shape_and_device() -> anyhow::Result<()> {
    let storage = FlatStorage::<f32>::zeros(Device::Emulated, 4)?;
    let p = param_on(Device::Emulated, "p", vec![1.0, 2.0], &[2]);
    let tape = Tape::new();
    tape.watch(&p)?.scale(5.0)?.sum()?.backward()?;
    p.attach_main_grad(FlatView::new(&storage, 2, &[2])?)?;
    assert_eq!(
        FlatView::new(&storage, 0, &[4])?.to_tensor()?.to_vec()?,
        [0.0, 0.0, 5.0, 5.0]
    );
    assert!(p.has_grad());

    let wrong_shape = p
        .attach_main_grad(FlatView::new(&storage, 0, &[3])?)
        .unwrap_err();
    assert!(matches!(wrong_shape, Error::Shape { .. }), "{wrong_shape}");
    let host = FlatStorage::<f32>::zeros(Device::Cpu, 2)?;
    let wrong_device = p
        .attach_main_grad(FlatView::new(&host, 0, &[2])?)
        .unwrap_err();
    assert!(
        matches!(wrong_device, Error::DeviceMismatch { .. }),
        "{wrong_device}"
    );
    assert!(FlatView::new(&storage, 3, &[2]).is_err(), "past the end");
    assert!(
        FlatView::new(&storage, usize::MAX, &[2]).is_err(),
        "overflowing range"
    );
    let unattached = Parameter::new("q", Tensor::<f32>::zeros(&[1]));
    assert!(unattached.set_main_grad_written(true).is_err());
    Ok(())
}

#[test]
fn a_lease_keeps_every_other_access_out_until_dropped_even_when_leaked() -> anyhow::Result<()> {
    for device in devices() {
        let storage = FlatStorage::<f32>::zeros(device, 2)?;
        let p = param_on(device, "p", vec![1.0, 2.0], &[2]);
        p.attach_main_grad(FlatView::new(&storage, 0, &[2])?)?;
        let tape = Tape::new();

        let mut lease = storage.lease()?;
        assert!(storage.is_leased());
        assert_eq!(lease.memory(), device);
        assert_eq!(lease.len(), 2);
        assert!(lease.as_buf_mut().len() == 2);
        assert!(matches!(storage.lease(), Err(Error::Leased { .. })));
        let refused = tape.watch(&p)?.sum()?.backward().unwrap_err();
        assert!(
            matches!(&refused, Error::Leased { parameter: Some(name), .. } if name == "p"),
            "{refused}"
        );
        assert!(refused.to_string().contains("finish"), "{refused}");
        assert!(p.grad().is_none(), "no snapshot of values in flight");
        assert!(
            lease.into_vec::<f32>().is_err(),
            "lent memory is not a vector"
        );
        assert!(!storage.is_leased(), "dropping the buffer ends the lease");

        tape.watch(&p)?.sum()?.backward()?;
        assert_eq!(p.grad().unwrap().to_vec()?, [1.0, 1.0]);

        // A leaked lease leaves the storage refused, never aliased.
        std::mem::forget(storage.lease()?);
        assert!(matches!(
            FlatView::new(&storage, 0, &[2])?.to_tensor(),
            Err(Error::Leased { .. })
        ));
        let fresh = FlatStorage::<f32>::zeros(device, 2)?;
        assert_eq!(
            FlatView::new(&fresh, 0, &[2])?.to_tensor()?.to_vec()?,
            [0.0, 0.0]
        );
    }
    Ok(())
}

#[test]
fn storage_and_views_describe_themselves_and_fill() -> anyhow::Result<()> {
    for device in devices() {
        let storage = FlatStorage::<f32>::zeros(device, 6)?;
        assert!(!storage.is_empty());
        assert!(FlatStorage::<f32>::zeros(device, 0)?.is_empty());
        assert_eq!((storage.len(), storage.device()), (6, device));
        let other = FlatStorage::<f32>::zeros(device, 6)?;
        assert!(storage.same_storage(&storage.clone()) && !storage.same_storage(&other));

        let view = FlatView::new(&storage, 2, &[2, 2])?;
        assert_eq!(
            (view.offset(), view.numel(), view.shape()),
            (2, 4, &[2, 2][..])
        );
        view.fill(1.5)?;
        assert_eq!(
            FlatView::new(&storage, 0, &[6])?.to_tensor()?.to_vec()?,
            [0.0, 0.0, 1.5, 1.5, 1.5, 1.5]
        );
        let shown = format!("{view:?}");
        assert!(
            shown.contains("offset: 2") && shown.contains("len: 6"),
            "{shown}"
        );
        let lease = storage.lease()?;
        let shown = format!("{lease:?}");
        assert!(
            shown.contains("FlatStorage") && shown.contains("leased: true"),
            "{shown}"
        );
        assert!(matches!(view.fill(0.0), Err(Error::Leased { .. })));
    }
    Ok(())
}

/// Contributions that are transposed views (the backward of a transpose) land in the
/// view in row-major order, the first overwriting and the next adding.
#[test]
fn transposed_contributions_accumulate_in_row_major_order() -> anyhow::Result<()> {
    let storage = FlatStorage::<f32>::zeros(Device::Cpu, 6)?;
    let w = Parameter::new("w", Tensor::<f32>::zeros(&[2, 3]));
    w.attach_main_grad(FlatView::new(&storage, 0, &[2, 3])?)?;
    let c1 = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2])?;
    let c2 = Tensor::from_vec(vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0], &[3, 2])?;
    let tape = Tape::new();
    // Two backward passes: the first contribution overwrites, the second adds.
    for c in [&c1, &c2] {
        tape.watch(&w)?.transpose(0, 1)?.mul(c)?.sum()?.backward()?;
    }
    // d/dw = (c1 + c2)ᵀ
    assert_eq!(
        w.grad().unwrap().to_vec()?,
        [11.0, 33.0, 55.0, 22.0, 44.0, 66.0]
    );
    Ok(())
}
