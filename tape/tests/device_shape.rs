//! Shape and index ops on devices equal the CPU, forward and backward (see
//! `support/device.rs`). Runs on the emulator everywhere and on CUDA when a GPU is present.

#[path = "support/device.rs"]
mod device;

use device::{check, Inputs};
use ferrotron_tape::ndarray::{ArrayD, IxDyn};
use ferrotron_tape::{causal_mask, Device, Error, Generator, Tensor};

const F64: f64 = 1e-12;
const F32: f64 = 1e-6;

#[test]
fn transpose_and_permute() {
    let x: &[usize] = &[2, 3, 4];
    for (dim0, dim1) in [(0, 1), (0, 2), (1, 2), (2, 2)] {
        check::<f64>("transpose", Inputs::new(&[x]), F64, |x| {
            x[0].transpose(dim0, dim1)
        });
    }
    check::<f64>("transpose 2-d", Inputs::new(&[&[5, 3]]), F64, |x| {
        x[0].transpose(0, 1)
    });
    for order in [[1, 2, 0], [2, 0, 1], [2, 1, 0], [0, 1, 2]] {
        check::<f64>("permute 3-d", Inputs::new(&[x]), F64, |x| {
            x[0].permute(&order)
        });
    }
    for order in [[3, 1, 0, 2], [0, 2, 3, 1], [3, 2, 1, 0]] {
        check::<f64>("permute 4-d", Inputs::new(&[&[2, 3, 1, 4]]), F64, |x| {
            x[0].permute(&order)
        });
    }
    // A device copy feeds later ops like the CPU's strided view does.
    check::<f64>("transpose then reshape", Inputs::new(&[x]), F64, |x| {
        x[0].transpose(1, 2)?.reshape(&[2, 12])?.exp()
    });
    check::<f64>("permute 0-d", Inputs::new(&[&[]]), F64, |x| {
        x[0].permute(&[])
    });
    check::<f64>("permute empty", Inputs::new(&[&[2, 0, 3]]), F64, |x| {
        x[0].permute(&[2, 0, 1])
    });
    check::<f32>("permute f32", Inputs::new(&[&[2, 3, 1, 4]]), F32, |x| {
        x[0].permute(&[3, 1, 0, 2])
    });
}

#[test]
fn narrow_split_chunk() {
    let x: &[usize] = &[4, 5, 6];
    for dim in 0..3 {
        let size = x[dim];
        for (start, len) in [(0, 2), (1, size - 2), (size - 1, 1), (0, size), (2, 0)] {
            check::<f64>("narrow", Inputs::new(&[x]), F64, |x| {
                x[0].narrow(dim, start, len)
            });
        }
    }
    check::<f64>("narrow 1-d", Inputs::new(&[&[7]]), F64, |x| {
        x[0].narrow(0, 3, 4)
    });
    // Pieces used unevenly (and one left out), so each one's gradient shows.
    check::<f64>("split", Inputs::new(&[x]), F64, |x| {
        let parts = x[0].split(&[2, 0, 2, 1], 1)?;
        parts[0].sum()?.add(&parts[2].exp()?.sum()?)
    });
    check::<f64>("chunk", Inputs::new(&[x]), F64, |x| {
        let parts = x[0].chunk(3, 2)?;
        Tensor::concat(&[&parts[2], &parts[0].scale(3.0)?], 2)
    });
    check::<f32>("narrow f32", Inputs::new(&[x]), F32, |x| {
        x[0].narrow(1, 1, 3)
    });
}

#[test]
fn concat_along_each_dim() {
    for dim in 0..3 {
        let shape = |size: usize| {
            let mut s = vec![2, 3, 4];
            s[dim] = size;
            s
        };
        let (a, b, c) = (shape(1), shape(3), shape(2));
        check::<f64>("concat", Inputs::new(&[&a, &b, &c]), F64, |x| {
            Tensor::concat(&[&x[0], &x[1], &x[2]], dim)
        });
        // A tensor used twice gets both pieces of the gradient.
        check::<f64>("concat repeated", Inputs::new(&[&a, &b]), F64, |x| {
            Tensor::concat(&[&x[0], &x[1], &x[0]], dim)
        });
    }
    check::<f64>(
        "concat with empty",
        Inputs::new(&[&[2, 0], &[2, 3]]),
        F64,
        |x| Tensor::concat(&[&x[0], &x[1]], 1),
    );
    check::<f64>("concat one", Inputs::new(&[&[3, 2]]), F64, |x| {
        Tensor::concat(&[&x[0]], 0)
    });
    check::<f32>("concat f32", Inputs::new(&[&[2, 3], &[2, 5]]), F32, |x| {
        Tensor::concat(&[&x[0], &x[1]], 1)
    });
}

#[test]
fn embedding_accumulates_repeated_ids() {
    let ids = [2, 0, 2, 4, 2, 1];
    check::<f64>("embedding", Inputs::new(&[&[5, 3]]), F64, |x| {
        x[0].embedding(&ids, &[2, 3])
    });
    check::<f64>("embedding flat", Inputs::new(&[&[5, 3]]), F64, |x| {
        x[0].embedding(&ids, &[6])
    });
    check::<f64>("embedding no ids", Inputs::new(&[&[5, 3]]), F64, |x| {
        x[0].embedding(&[], &[0])
    });
    check::<f32>("embedding f32", Inputs::new(&[&[5, 4]]), F32, |x| {
        x[0].embedding(&ids, &[3, 2])
    });
}

#[test]
fn masked_fill_broadcasts_the_mask() {
    let causal = causal_mask(4);
    check::<f64>("masked_fill causal", Inputs::new(&[&[2, 4, 4]]), F64, |x| {
        x[0].masked_fill(&causal, -1e9)
    });
    let columns = ArrayD::from_shape_vec(IxDyn(&[1, 3]), vec![true, false, true]).unwrap();
    check::<f64>(
        "masked_fill columns",
        Inputs::new(&[&[2, 4, 3]]),
        F64,
        |x| x[0].masked_fill(&columns, 0.5),
    );
    let per_batch = ArrayD::from_shape_fn(IxDyn(&[2, 1, 3]), |i| (i[0] + i[2]) % 2 == 0);
    check::<f64>(
        "masked_fill per batch",
        Inputs::new(&[&[2, 4, 3]]),
        F64,
        |x| x[0].masked_fill(&per_batch, 0.5),
    );
    let full = ArrayD::from_shape_fn(IxDyn(&[3, 5]), |i| (i[0] + 2 * i[1]) % 3 == 0);
    check::<f32>("masked_fill f32", Inputs::new(&[&[3, 5]]), F32, |x| {
        x[0].masked_fill(&full, -2.0)
    });
}

#[test]
fn masked_fill_with_infinity_matches_the_cpu() {
    let x = Tensor::<f32>::uniform(&[3, 3], -1.0, 1.0, &mut Generator::new(3));
    let masked = |t: &Tensor<f32>| {
        t.masked_fill(&causal_mask(3), f32::NEG_INFINITY)
            .and_then(|y| y.to_vec())
    };
    let cpu = masked(&x).unwrap();
    let emulated = masked(&x.to_device(Device::Emulated).unwrap()).unwrap();
    assert_eq!(cpu, emulated);
    assert_eq!(emulated[1], f32::NEG_INFINITY);
}

#[test]
fn dropout_draws_the_cpu_mask() {
    for p in [0.3, 0.0, 1.0] {
        check::<f64>("dropout", Inputs::new(&[&[4, 5, 6]]), F64, |x| {
            x[0].dropout(p, &mut Generator::new(11))
        });
    }
    check::<f32>("dropout f32", Inputs::new(&[&[7, 9]]), F32, |x| {
        x[0].dropout(0.3, &mut Generator::new(11))
    });
    // Same seed, same elements kept, bit for bit; and the generator advances alike.
    let x = Tensor::<f32>::ones(&[50, 40]);
    let run = |t: &Tensor<f32>| {
        let mut generator = Generator::new(5);
        let out = t.dropout(0.3, &mut generator).and_then(|y| y.to_vec());
        (out.unwrap(), generator.next_u64())
    };
    let (cpu, cpu_next) = run(&x);
    let (emulated, emulated_next) = run(&x.to_device(Device::Emulated).unwrap());
    assert_eq!(cpu, emulated);
    assert_eq!(cpu_next, emulated_next);
    let dropped = cpu.iter().filter(|&&v| v == 0.0).count();
    assert!((400..800).contains(&dropped), "{dropped} of 2000 dropped");
}

#[test]
fn device_errors_are_typed() {
    let table = Tensor::<f32>::zeros(&[4, 2])
        .to_device(Device::Emulated)
        .unwrap();
    let err = table.embedding(&[1, 4], &[2]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(err.to_string().contains("id 4"), "{err}");
    let err = table.embedding(&[0], &[2]).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");

    // More dimensions than the kernels' shape slots hold; a narrow that is a view of
    // the memory needs no kernel.
    let deep = Tensor::<f32>::zeros(&[2, 1, 1, 1, 1, 1, 1, 1, 1])
        .to_device(Device::Emulated)
        .unwrap();
    let err = deep.transpose(0, 8).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    assert!(err.to_string().contains("at most 8"), "{err}");
    assert!(matches!(deep.narrow(3, 0, 1), Err(Error::Shape { .. })));
    assert_eq!(deep.narrow(0, 1, 1).unwrap().shape(), &[1; 9]);
    assert!(matches!(
        Tensor::concat(&[&deep, &deep], 0),
        Err(Error::Shape { .. })
    ));

    let err = Tensor::concat(&[&table, &Tensor::zeros(&[4, 2])], 0).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
    let err = table.masked_fill(&causal_mask(3), 0.0).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
}
