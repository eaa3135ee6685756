//! Optimizer updates, scaling, norms and 16-bit copies on views of flat storage (what a
//! sharded optimizer runs on its shards, what a 16-bit comm hook sends) give the host
//! loops' numbers, on the CPU, the emulated device and CUDA where present, and refuse
//! views they cannot serve.

#[path = "support/device.rs"]
mod device;

use ferrotron_tape::{
    transfers, AdamWConfig, AdamWUpdate, DType, Device, Error, FlatStorage, FlatView, ParamOptions,
    Parameter, SgdConfig, SgdUpdate, Tensor, Transfers,
};

const LEN: usize = 37;

fn every_device() -> Vec<Device> {
    let mut all = vec![Device::Cpu];
    all.extend(device::devices());
    all
}

fn ramp(scale: f32, shift: f32) -> Vec<f32> {
    (0..LEN).map(|i| (i as f32 * scale + shift).sin()).collect()
}

/// A storage of `values` on `device`, and a view of all of it.
fn view_of(values: &[f32], device: Device) -> FlatView {
    let storage = FlatStorage::zeros(device, values.len()).unwrap();
    let view = FlatView::new(&storage, 0, &[values.len()]).unwrap();
    let tensor = Tensor::from_vec(values.to_vec(), &[values.len()]).unwrap();
    view.copy_from(&tensor.to_device(device).unwrap()).unwrap();
    view
}

fn read(view: &FlatView) -> Vec<f32> {
    view.to_tensor().unwrap().to_vec().unwrap()
}

fn close(a: &[f32], b: &[f32], what: &str) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-6 * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn adamw_and_sgd_on_views_match_the_slice_updates() {
    let adamw = AdamWUpdate::new(
        &AdamWConfig {
            lr: 0.01,
            weight_decay: 0.1,
            ..AdamWConfig::default()
        },
        ParamOptions::default(),
        3,
    );
    let sgd = SgdUpdate::new(
        &SgdConfig {
            momentum: 0.9,
            weight_decay: 0.01,
            ..SgdConfig::new(0.05)
        },
        ParamOptions::default(),
    );
    let (p, g, m, v) = (
        ramp(0.3, 0.1),
        ramp(0.7, 0.2),
        ramp(0.2, 0.3),
        ramp(0.1, 0.0),
    );
    let v: Vec<f32> = v.iter().map(|x| x * x).collect();
    let (mut want_p, mut want_m, mut want_v) = (p.clone(), m.clone(), v.clone());
    adamw
        .apply(&mut want_p, &g, &mut want_m, &mut want_v)
        .unwrap();
    for first in [true, false] {
        let (mut sgd_p, mut sgd_b) = (p.clone(), m.clone());
        sgd.apply(&mut sgd_p, &g, &mut sgd_b, first).unwrap();
        for device in every_device() {
            let (pv, gv, bv) = (
                view_of(&p, device),
                view_of(&g, device),
                view_of(&m, device),
            );
            sgd.apply_views(&pv, &gv, Some(&bv), first).unwrap();
            close(
                &read(&pv),
                &sgd_p,
                &format!("{device} sgd values, first {first}"),
            );
            close(
                &read(&bv),
                &sgd_b,
                &format!("{device} sgd momentum, first {first}"),
            );
        }
    }
    for device in every_device() {
        let (pv, gv) = (view_of(&p, device), view_of(&g, device));
        let (mv, vv) = (view_of(&m, device), view_of(&v, device));
        adamw.apply_views(&pv, &gv, &mv, &vv).unwrap();
        close(&read(&pv), &want_p, &format!("{device} adamw values"));
        close(&read(&mv), &want_m, &format!("{device} adamw m"));
        close(&read(&vv), &want_v, &format!("{device} adamw v"));
        // The CPU runs the slice loop itself: the same bits.
        if device == Device::Cpu {
            assert_eq!(read(&pv), want_p);
        }
    }
}

#[test]
fn scaling_norms_and_finiteness_on_views() {
    let (a, b) = (ramp(0.3, 0.1), ramp(0.9, 0.4));
    let squares: f64 = a
        .iter()
        .chain(&b)
        .map(|&x| f64::from(x) * f64::from(x))
        .sum();
    for device in every_device() {
        let views = [view_of(&a, device), view_of(&b, device)];
        let sum = FlatView::sum_of_squares(&views).unwrap();
        assert!(
            (sum - squares).abs() <= 1e-5 * squares,
            "{device}: {sum} vs {squares}"
        );
        assert!(FlatView::all_finite_scaled(&views, 2.0).unwrap());
        assert!(
            !FlatView::all_finite_scaled(&views, f32::INFINITY).unwrap(),
            "{device}"
        );
        views[1].scale(0.5).unwrap();
        let halved: Vec<f32> = b.iter().map(|x| x * 0.5).collect();
        assert_eq!(read(&views[1]), halved, "{device}");
        views[0].scale(f32::INFINITY).unwrap();
        assert!(
            !FlatView::all_finite_scaled(&views, 1.0).unwrap(),
            "{device}"
        );
        assert_eq!(FlatView::<f32>::sum_of_squares(&[]).unwrap(), 0.0);
    }
}

#[test]
fn sixteen_bit_copies_round_each_element_once_on_the_views_device() {
    let values = ramp(0.7, 0.1);
    for device in every_device() {
        let view = view_of(&values, device);
        for (dtype, round) in [
            (
                DType::BF16,
                (|x| half::bf16::from_f32(x).to_f32()) as fn(f32) -> f32,
            ),
            (DType::F16, |x| half::f16::from_f32(x).to_f32()),
        ] {
            let before = transfers(device);
            let copy = view.to_tensor_as(dtype).unwrap();
            assert_eq!(transfers(device) - before, Transfers::default(), "{device}");
            assert_eq!((copy.dtype(), copy.device()), (dtype, device));
            let expected: Vec<f32> = values.iter().map(|&x| round(x)).collect();
            assert_eq!(copy.to_vec().unwrap(), expected, "{dtype} on {device}");
        }
        assert_eq!(read(&view), values, "the view keeps its f32 values");
        assert!(matches!(
            view.to_tensor_as(DType::F64),
            Err(Error::InvalidArgument { .. })
        ));
    }
}

#[test]
fn a_parameter_range_is_read_into_a_view_on_its_device() {
    // Small integers: exact in bf16 and f16 too.
    let values: Vec<f32> = (0..12).map(|i| i as f32).collect();
    for device in every_device() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let value = Tensor::from_vec(values.clone(), &[3, 4]).unwrap();
            let param = Parameter::new(
                "w",
                value.to_device(device).unwrap().to_dtype(dtype).unwrap(),
            );
            let storage = FlatStorage::zeros(device, 8).unwrap();
            let view = FlatView::new(&storage, 2, &[5]).unwrap();
            let before = transfers(device);
            param.read_flat_into(6, &view).unwrap();
            assert_eq!(
                transfers(device) - before,
                Transfers::default(),
                "{dtype} on {device}"
            );
            assert_eq!(
                read(&view),
                [6.0, 7.0, 8.0, 9.0, 10.0],
                "{dtype} on {device}"
            );
            assert_eq!(read(&FlatView::new(&storage, 0, &[2]).unwrap()), [0.0, 0.0]);
            let past_the_end = param.read_flat_into(8, &view);
            assert!(
                matches!(past_the_end, Err(Error::Shape { .. })),
                "{past_the_end:?}"
            );
        }
    }
}

#[test]
fn views_sharing_a_storage_or_split_across_devices_are_refused() {
    let update = AdamWUpdate::new(&AdamWConfig::default(), ParamOptions::default(), 1);
    let storage = FlatStorage::zeros(Device::Cpu, 8).unwrap();
    let (first, second) = (
        FlatView::new(&storage, 0, &[4]).unwrap(),
        FlatView::new(&storage, 4, &[4]).unwrap(),
    );
    let (m, v) = (
        view_of(&[0.0; 4], Device::Cpu),
        view_of(&[0.0; 4], Device::Cpu),
    );
    let shared = update.apply_views(&first, &second, &m, &v);
    assert!(
        matches!(&shared, Err(Error::InvalidArgument { .. })),
        "{shared:?}"
    );
    let elsewhere = view_of(&[0.0; 4], Device::Emulated);
    let split = update.apply_views(&first, &elsewhere, &m, &v);
    assert!(
        matches!(split, Err(Error::DeviceMismatch { .. })),
        "{split:?}"
    );
    let short = view_of(&[0.0; 3], Device::Cpu);
    assert!(update.apply_views(&first, &short, &m, &v).is_err());
    // A storage lent to a collective is not updated behind its back.
    let lease = m.storage().lease().unwrap();
    let leased = update.apply_views(&first, &view_of(&[0.0; 4], Device::Cpu), &m, &v);
    assert!(matches!(leased, Err(Error::Leased { .. })), "{leased:?}");
    drop(lease);
}
