//! Bad shapes and arguments give typed errors that name the op and the shapes.

use anyhow::Result;
use ferrotron_tape::{CrossEntropyOptions, Device, Error, Generator, Parameter, Tape, Tensor};

fn assert_shape_error(result: ferrotron_tape::Result<Tensor>, op: &str, mention: &str) {
    match result {
        Err(error @ Error::Shape { .. }) => {
            let text = error.to_string();
            assert!(text.starts_with(op), "{text}");
            assert!(text.contains(mention), "{text} should mention {mention}");
        }
        other => panic!("expected a shape error from {op}, got {other:?}"),
    }
}

#[test]
fn shape_errors_name_op_and_shapes() -> Result<()> {
    let a = Tensor::<f32>::zeros(&[2, 3]);
    let b = Tensor::<f32>::zeros(&[4, 5]);
    assert_shape_error(a.matmul(&b), "matmul", "[[2, 3], [4, 5]]");
    assert_shape_error(a.matmul(&Tensor::zeros(&[3])), "matmul", "2-D or 3-D");
    assert_shape_error(
        Tensor::zeros(&[2, 3, 4]).matmul(&Tensor::zeros(&[3, 4, 5])),
        "matmul",
        "batch",
    );
    assert_shape_error(a.add(&b), "add", "[[2, 3], [4, 5]]");
    assert_shape_error(a.mul(&Tensor::zeros(&[2])), "mul", "broadcast");
    assert_shape_error(a.reshape(&[4, 2]), "reshape", "[[2, 3], [4, 2]]");
    assert_shape_error(a.narrow(1, 2, 2), "narrow", "exceeds");
    assert_shape_error(a.sum_dim(2, false), "sum_dim", "out of range");
    assert_shape_error(a.transpose(0, 5), "transpose", "out of range");
    assert_shape_error(a.permute(&[0, 0]), "permute", "permutation");
    assert_shape_error(Tensor::concat(&[&a, &b], 0), "concat", "must match");
    assert_shape_error(
        a.layer_norm(Some(&Tensor::ones(&[2])), None, 1e-5),
        "layer_norm",
        "[3]",
    );
    assert_shape_error(
        a.cross_entropy(&[0], &CrossEntropyOptions::default()),
        "cross_entropy",
        "2 labels",
    );
    assert_shape_error(
        Tensor::zeros(&[2, 3, 4]).embedding(&[0], &[1]),
        "embedding",
        "2-D",
    );
    assert_shape_error(a.embedding(&[0, 1], &[3]), "embedding", "ids_shape");
    assert_shape_error(
        Tensor::from_vec(vec![1.0; 5], &[2, 3]),
        "from_vec",
        "5 elements",
    );
    assert!(matches!(
        a.split(&[1, 1], 1),
        Err(Error::Shape { op: "split", .. })
    ));
    assert!(matches!(
        a.chunk(2, 1),
        Err(Error::Shape { op: "chunk", .. })
    ));
    assert!(matches!(a.item(), Err(Error::Shape { op: "item", .. })));
    Ok(())
}

#[test]
fn invalid_arguments() -> Result<()> {
    let a = Tensor::<f32>::zeros(&[2, 3]);
    let invalid =
        |r: ferrotron_tape::Result<Tensor>| matches!(r, Err(Error::InvalidArgument { .. }));
    assert!(invalid(a.dropout(1.5, &mut Generator::new(0))));
    assert!(invalid(a.embedding(&[7], &[1])));
    assert!(invalid(
        a.cross_entropy(&[0, 3], &CrossEntropyOptions::default())
    ));
    assert!(invalid(Tensor::concat(&[], 0)));
    Ok(())
}

#[test]
fn unsupported_device_and_bad_backward_calls() -> Result<()> {
    let a = Tensor::<f32>::zeros(&[2]);
    // Without the `cuda` feature CUDA is not built in; with it, a machine without a
    // driver or GPU gets an error naming what is missing (and a GPU machine a tensor).
    match (a.to_device(Device::Cuda(0)), cfg!(feature = "cuda")) {
        (
            Err(Error::UnsupportedDevice {
                device: Device::Cuda(0),
                ..
            }),
            false,
        ) => {}
        (Err(err @ Error::Device { .. }), true) => {
            let text = err.to_string();
            assert!(text.contains("lib") || text.contains("device"), "{text}");
        }
        (Ok(on_gpu), true) => assert_eq!(on_gpu.device(), Device::Cuda(0)),
        (other, built) => panic!("unexpected with cuda built = {built}: {other:?}"),
    }
    assert_eq!(a.device(), Device::Cpu);
    assert!(matches!(
        a.backward(),
        Err(Error::Shape { op: "backward", .. })
    ));
    assert!(matches!(a.sum()?.backward(), Err(Error::NotRecorded)));
    let w = Parameter::new("w", Tensor::<f32>::zeros(&[2]));
    assert!(matches!(
        w.set_grad(Some(Tensor::zeros(&[3]))),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        w.set_value(Tensor::zeros(&[3])),
        Err(Error::Shape { .. })
    ));
    let tape = Tape::new();
    let y = tape.watch(&w)?.exp()?;
    assert!(
        matches!(y.backward(), Err(Error::Shape { .. })),
        "non-scalar needs a seed"
    );
    assert!(matches!(
        y.backward_with_grad(&Tensor::zeros(&[5])),
        Err(Error::Shape { .. })
    ));
    Ok(())
}

#[test]
fn set_grad_rejects_a_gradient_on_another_device() -> Result<()> {
    let on_device = Parameter::new("w", Tensor::<f32>::zeros(&[2]).to_device(Device::Emulated)?);
    let on_host = Parameter::new("b", Tensor::<f32>::zeros(&[2]));
    let host_grad = Tensor::<f32>::ones(&[2]);
    let device_grad = host_grad.to_device(Device::Emulated)?;
    for (param, grad, first, second) in [
        (&on_device, &host_grad, Device::Emulated, Device::Cpu),
        (&on_host, &device_grad, Device::Cpu, Device::Emulated),
    ] {
        match param.set_grad(Some(grad.clone())) {
            Err(Error::DeviceMismatch {
                op: "Parameter::set_grad",
                first: f,
                second: s,
            }) => assert_eq!((f, s), (first, second)),
            other => panic!("{}: expected DeviceMismatch, got {other:?}", param.name()),
        }
        assert!(param.grad().is_none(), "a refused gradient is not stored");
    }
    on_device.set_grad(Some(device_grad.clone()))?;
    assert_eq!(on_device.grad().map(|g| g.device()), Some(Device::Emulated));
    Ok(())
}

/// Optimizer settings `torch.optim` refuses (and non-finite ones) are typed errors at
/// construction that name the setting, not steps whose CPU and device numbers differ.
#[test]
fn invalid_optimizer_settings_are_refused_at_construction() {
    use ferrotron_tape::{AdamW, AdamWConfig, Sgd, SgdConfig};
    let params = || vec![Parameter::new("w", Tensor::<f32>::zeros(&[2]))];
    let adamw = AdamWConfig::default();
    let bad_adamw = [
        (
            AdamWConfig {
                betas: (1.0, 0.999),
                ..adamw
            },
            "first beta",
        ),
        (
            AdamWConfig {
                betas: (-0.1, 0.999),
                ..adamw
            },
            "first beta",
        ),
        (
            AdamWConfig {
                betas: (0.9, 1.5),
                ..adamw
            },
            "second beta",
        ),
        (
            AdamWConfig {
                betas: (0.9, f64::NAN),
                ..adamw
            },
            "second beta",
        ),
        (AdamWConfig { lr: -1e-3, ..adamw }, "learning rate"),
        (
            AdamWConfig {
                lr: f64::INFINITY,
                ..adamw
            },
            "learning rate",
        ),
        (AdamWConfig { eps: 0.0, ..adamw }, "epsilon"),
        (
            AdamWConfig {
                eps: -1e-8,
                ..adamw
            },
            "epsilon",
        ),
        (
            AdamWConfig {
                weight_decay: -0.1,
                ..adamw
            },
            "weight decay",
        ),
    ];
    for (config, named) in bad_adamw {
        let error = AdamW::new(params(), config).map(drop).unwrap_err();
        assert!(matches!(error, Error::InvalidArgument { .. }), "{error:?}");
        assert!(error.to_string().contains(named), "{config:?}: {error}");
    }
    let sgd = SgdConfig::new(0.1);
    let bad_sgd = [
        (SgdConfig { lr: -0.1, ..sgd }, "learning rate"),
        (
            SgdConfig {
                momentum: -0.9,
                ..sgd
            },
            "momentum",
        ),
        (
            SgdConfig {
                weight_decay: f64::NAN,
                ..sgd
            },
            "weight decay",
        ),
        (
            SgdConfig {
                nesterov: true,
                ..sgd
            },
            "Nesterov",
        ),
        (
            SgdConfig {
                nesterov: true,
                momentum: 0.9,
                dampening: 0.1,
                ..sgd
            },
            "Nesterov",
        ),
    ];
    for (config, named) in bad_sgd {
        let error = Sgd::new(params(), config).map(drop).unwrap_err();
        assert!(error.to_string().contains(named), "{config:?}: {error}");
    }
    assert!(AdamW::new(
        params(),
        AdamWConfig {
            betas: (0.0, 0.0),
            ..adamw
        }
    )
    .is_ok());
    assert!(Sgd::new(
        params(),
        SgdConfig {
            nesterov: true,
            momentum: 0.9,
            ..sgd
        }
    )
    .is_ok());
}
