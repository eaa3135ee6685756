//! Row ops (softmax, log_softmax, layer_norm, cross_entropy) on devices equal the CPU,
//! forward and backward (see `support/device.rs`). Runs on the emulator everywhere and on
//! CUDA when a GPU is present.

#[path = "support/device.rs"]
mod device;

use device::{check, Inputs};
use ferrotron_tape::{CrossEntropyOptions, Device, Error, Reduction, Tensor};

const F64: f64 = 1e-12;
const F32: f64 = 1e-5;

#[test]
fn softmax_and_log_softmax() {
    let shapes: [&[usize]; 5] = [&[5], &[3, 7], &[2, 3, 4], &[4, 1], &[3, 0]];
    for shape in shapes {
        check::<f64>("softmax", Inputs::new(&[shape]), F64, |x| x[0].softmax());
        check::<f64>("log_softmax", Inputs::new(&[shape]), F64, |x| {
            x[0].log_softmax()
        });
        // exp(±50) overflows nothing only if the row maximum is subtracted first.
        let large = || Inputs::new(&[shape]).range(-50.0, 50.0);
        check::<f64>("softmax large", large(), F64, |x| x[0].softmax());
        check::<f64>("log_softmax large", large(), F64, |x| x[0].log_softmax());
    }
    let shape: &[usize] = &[6, 9];
    check::<f32>("softmax f32", Inputs::new(&[shape]), F32, |x| {
        x[0].softmax()
    });
    let large = Inputs::new(&[shape]).range(-50.0, 50.0);
    check::<f32>("log_softmax f32", large, F32, |x| x[0].log_softmax());
}

#[test]
fn causal_softmax() {
    let shapes: [&[usize]; 4] = [&[1, 1], &[5, 5], &[2, 3, 7, 7], &[2, 0, 0]];
    for shape in shapes {
        check::<f64>("causal_softmax", Inputs::new(&[shape]), F64, |x| {
            x[0].causal_softmax(0.3)
        });
        let large = Inputs::new(&[shape]).range(-50.0, 50.0);
        check::<f64>("causal_softmax large", large, F64, |x| {
            x[0].causal_softmax(2.0)
        });
    }
    check::<f32>("causal_softmax f32", Inputs::new(&[&[4, 9, 9]]), F32, |x| {
        x[0].causal_softmax(0.125)
    });
}

#[test]
fn layer_norm_with_and_without_affine() {
    for width in [0, 1, 5, 16, 33] {
        let x: &[usize] = &[2, 3, width];
        let affine: &[usize] = &[width];
        check::<f64>("layer_norm", Inputs::new(&[x]), F64, |t| {
            t[0].layer_norm(None, None, 1e-5)
        });
        check::<f64>(
            "layer_norm affine",
            Inputs::new(&[x, affine, affine]),
            F64,
            |t| t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5),
        );
        check::<f64>("layer_norm weight", Inputs::new(&[x, affine]), F64, |t| {
            t[0].layer_norm(Some(&t[1]), None, 1e-5)
        });
        check::<f64>("layer_norm bias", Inputs::new(&[x, affine]), F64, |t| {
            t[0].layer_norm(None, Some(&t[1]), 1e-3)
        });
    }
    // Many rows: the weight and bias gradients are summed in parts (see device_math.rs).
    check::<f64>(
        "layer_norm many rows",
        Inputs::new(&[&[300, 16], &[16], &[16]]),
        F64,
        |t| t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5),
    );
    check::<f64>(
        "layer_norm 1-d",
        Inputs::new(&[&[7], &[7], &[7]]),
        F64,
        |t| t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5),
    );
    let f32_inputs = Inputs::new(&[&[8, 24], &[24], &[24]]);
    check::<f32>("layer_norm f32", f32_inputs, F32, |t| {
        t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5)
    });
}

fn options(reduction: Reduction, smoothing: f64, ignore: Option<i64>) -> CrossEntropyOptions {
    CrossEntropyOptions {
        ignore_index: ignore,
        label_smoothing: smoothing,
        reduction,
    }
}

#[test]
fn cross_entropy_every_option() {
    // Rows 1 and 4 carry the default ignored label.
    let labels = [3, -100, 0, 4, -100, 2];
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        for smoothing in [0.0, 0.1] {
            let opts = options(reduction, smoothing, Some(-100));
            check::<f64>("cross_entropy", Inputs::new(&[&[6, 5]]), F64, |x| {
                x[0].cross_entropy(&labels, &opts)
            });
            check::<f64>("cross_entropy 3-d", Inputs::new(&[&[2, 3, 5]]), F64, |x| {
                x[0].cross_entropy(&labels, &opts)
            });
            // A real class as the ignored label, and no ignored label at all.
            let own = options(reduction, smoothing, Some(2));
            let valid = [3, 1, 0, 4, 2, 2];
            check::<f64>(
                "cross_entropy ignore 2",
                Inputs::new(&[&[6, 5]]),
                F64,
                |x| x[0].cross_entropy(&valid, &own),
            );
            let none = options(reduction, smoothing, None);
            check::<f64>(
                "cross_entropy no ignore",
                Inputs::new(&[&[6, 5]]),
                F64,
                |x| x[0].cross_entropy(&valid, &none),
            );
            check::<f32>("cross_entropy f32", Inputs::new(&[&[6, 5]]), F32, |x| {
                x[0].cross_entropy(&labels, &opts)
            });
        }
    }
    let large = Inputs::new(&[&[6, 5]]).range(-50.0, 50.0);
    let opts = options(Reduction::Mean, 0.1, Some(-100));
    check::<f64>("cross_entropy large", large, F64, |x| {
        x[0].cross_entropy(&labels, &opts)
    });
    check::<f64>("cross_entropy 1-d", Inputs::new(&[&[5]]), F64, |x| {
        x[0].cross_entropy(&[1], &CrossEntropyOptions::default())
    });
}

/// With no classes every label must be ignored: rows exist (losses of 0) but hold nothing.
#[test]
fn cross_entropy_without_classes() {
    let labels = [-100, -100, -100];
    for reduction in [Reduction::Sum, Reduction::None] {
        let opts = options(reduction, 0.1, Some(-100));
        check::<f64>("cross_entropy empty", Inputs::new(&[&[3, 0]]), F64, |x| {
            x[0].cross_entropy(&labels, &opts)
        });
    }
}

/// A mean over no counted rows is 0/0, as on the CPU (and in PyTorch).
#[test]
fn cross_entropy_mean_of_only_ignored_rows_is_nan() {
    let logits = Tensor::<f64>::ones(&[2, 3]);
    let labels = [-100, -100];
    let opts = CrossEntropyOptions::default();
    let cpu = logits.cross_entropy(&labels, &opts).unwrap();
    let device = logits.to_device(Device::Emulated).unwrap();
    let emulated = device.cross_entropy(&labels, &opts).unwrap();
    assert!(cpu.to_vec().unwrap()[0].is_nan());
    assert!(emulated.to_vec().unwrap()[0].is_nan());
}

#[test]
fn bad_labels_are_typed_errors_on_the_device() {
    let logits = Tensor::<f32>::zeros(&[2, 3])
        .to_device(Device::Emulated)
        .unwrap();
    let opts = CrossEntropyOptions::default();
    for labels in [[0, 3], [-1, 0], [0, -7]] {
        let err = logits.cross_entropy(&labels, &opts).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    }
    let err = logits.cross_entropy(&[0], &opts).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    let smoothing = options(Reduction::Mean, 1.5, None);
    let err = logits.cross_entropy(&[0, 1], &smoothing).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
}

#[test]
fn layer_norm_rejects_mixed_devices_and_bad_shapes() {
    let x = Tensor::<f64>::ones(&[2, 4])
        .to_device(Device::Emulated)
        .unwrap();
    let cpu_weight = Tensor::<f64>::ones(&[4]);
    let err = x.layer_norm(Some(&cpu_weight), None, 1e-5).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
    let wrong = Tensor::<f64>::ones(&[3])
        .to_device(Device::Emulated)
        .unwrap();
    let err = x.layer_norm(None, Some(&wrong), 1e-5).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
}
