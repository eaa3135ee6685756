//! Reading and writing a parameter's elements by flat (row-major) position, as ddp's
//! distributed optimizer does with the pieces it owns: on the CPU and the emulated
//! device, in row-major order even for a transposed value, moving only the elements
//! asked for, without disturbing tensors that still hold the old value, and refusing
//! ranges outside the parameter.

use ferrotron_tape::{transfers, Device, Parameter, Tensor};

fn counting(shape: &[usize]) -> Tensor {
    let numel = shape.iter().product();
    Tensor::from_vec((0..numel).map(|i| i as f32).collect(), shape).expect("shape fits")
}

#[test]
fn pieces_read_and_write_in_row_major_order_on_every_device() -> anyhow::Result<()> {
    for device in [Device::Cpu, Device::Emulated] {
        let p = Parameter::new("p", counting(&[2, 3]).to_device(device)?);
        let mut piece = [0.0; 3];
        p.read_flat(2, &mut piece)?;
        assert_eq!(piece, [2.0, 3.0, 4.0], "{device}");
        let held = p.value()?;
        p.write_flat(1, &[10.0, 11.0])?;
        assert_eq!(
            p.value()?.to_vec()?,
            [0.0, 10.0, 11.0, 3.0, 4.0, 5.0],
            "{device}"
        );
        assert_eq!(p.device(), device);
        assert_eq!(
            held.to_vec()?,
            counting(&[6]).to_vec()?,
            "{device}: a held value keeps its elements"
        );
    }
    // A transposed value is read and written in its own row-major order.
    let p = Parameter::new("t", counting(&[2, 3]).transpose(0, 1)?);
    let mut all = [0.0; 6];
    p.read_flat(0, &mut all)?;
    assert_eq!(all, [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    p.write_flat(4, &[7.0, 8.0])?;
    assert_eq!(p.value()?.to_vec()?, [0.0, 3.0, 1.0, 4.0, 7.0, 8.0]);
    Ok(())
}

/// On a device a piece is read by downloading that piece only, and a whole value is
/// written by one upload, without downloading the old one.
#[test]
fn device_values_move_only_the_elements_asked_for() -> anyhow::Result<()> {
    let p = Parameter::new("p", counting(&[2, 3]).to_device(Device::Emulated)?);
    let before = transfers(Device::Emulated);
    p.read_flat(2, &mut [0.0; 3])?;
    p.write_flat(0, &[1.0; 6])?;
    let moved = transfers(Device::Emulated) - before;
    assert_eq!((moved.to_host_bytes, moved.to_host_copies), (12, 1));
    assert_eq!((moved.to_device_bytes, moved.to_device_copies), (24, 1));
    Ok(())
}

#[test]
fn a_range_outside_the_parameter_is_refused_and_changes_nothing() -> anyhow::Result<()> {
    let p = Parameter::new("p", counting(&[4]));
    let err = p.write_flat(3, &[1.0, 2.0]).unwrap_err();
    assert!(err.to_string().contains("within the parameter"), "{err}");
    assert!(p.read_flat(usize::MAX, &mut [0.0]).is_err());
    assert_eq!(p.value()?.to_vec()?, [0.0, 1.0, 2.0, 3.0]);
    Ok(())
}
