//! Where the host waits for a device, by kind of work, counted on the emulated device (the
//! GPU code path, counted the same way): uploads, ops, backward and optimizer steps queue
//! without waiting; reading values back waits once per read.

use ferrotron_tape::{
    host_waits, AdamW, AdamWConfig, Device, Generator, Optimizer, Parameter, Tape, Tensor,
};

const DEVICE: Device = Device::Emulated;

#[test]
fn only_reading_values_back_waits() -> ferrotron_tape::Result<()> {
    let mut generator = Generator::new(5);
    let start = host_waits(DEVICE);
    // Uploads are staged: the host does not wait for them.
    let x = Tensor::<f32>::uniform(&[8, 16], -1.0, 1.0, &mut generator).to_device(DEVICE)?;
    let w = Parameter::new(
        "w",
        Tensor::<f32>::uniform(&[16, 4], -1.0, 1.0, &mut generator).to_device(DEVICE)?,
    );
    let mut optimizer = AdamW::new(vec![w.clone()], AdamWConfig::default())?;
    assert_eq!(host_waits(DEVICE) - start, 0, "uploads");
    for _ in 0..3 {
        // Forward, backward and the update: all queued.
        let tape = Tape::new();
        let y = x.matmul(&tape.watch(&w)?)?;
        y.mul(&y)?.sum()?.backward()?;
        optimizer.step()?;
        optimizer.zero_grad();
    }
    assert_eq!(
        host_waits(DEVICE) - start,
        0,
        "forward, backward and AdamW steps"
    );
    // Each read is one wait.
    let value = w.value()?;
    value.to_vec()?;
    value.sum()?.item()?;
    assert_eq!(host_waits(DEVICE) - start, 2, "two reads");
    Ok(())
}
