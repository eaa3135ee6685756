//! Streams and events on the emulated device: recording, waiting on the device, waiting on
//! the host (counted), and what is refused.

use ferrotron_device::{host_waits, Device, Error, Stream};

#[test]
fn events_order_streams_and_host_waits_are_counted() -> ferrotron_device::Result<()> {
    let (first, second) = (
        Stream::new(Device::Emulated)?,
        Stream::new(Device::Emulated)?,
    );
    assert!(!first.same_as(&second));
    assert!(first.same_as(&first.clone()));
    let memory = first.alloc(8)?;
    let event = first.record()?;
    assert_eq!(event.device(), Device::Emulated);
    let before = host_waits(Device::Emulated);
    // Waiting on the device and querying never block the host.
    second.wait(&event)?;
    assert!(event.is_complete()?);
    assert_eq!(host_waits(Device::Emulated), before);
    // Every host wait is counted: a stream's, an event's.
    second.synchronize()?;
    event.synchronize()?;
    assert_eq!(host_waits(Device::Emulated), before + 2);
    drop(memory);
    Ok(())
}

#[test]
fn events_remember_where_their_stream_stood() -> ferrotron_device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let at_start = format!("{:?}", stream.record()?);
    let _memory = stream.alloc(4)?;
    let later = format!("{:?}", stream.record()?);
    assert!(at_start.contains("position: 0"), "{at_start}");
    assert!(later.contains("position: 1"), "{later}");
    Ok(())
}

#[test]
fn host_waits_are_counted_per_thread() -> ferrotron_device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let here = host_waits(Device::Emulated);
    std::thread::scope(|scope| {
        scope
            .spawn(|| stream.synchronize().unwrap())
            .join()
            .unwrap();
    });
    assert_eq!(host_waits(Device::Emulated), here);
    Ok(())
}

#[test]
fn the_host_has_no_streams_and_cuda_needs_its_feature_or_a_gpu() {
    assert!(matches!(
        Stream::new(Device::Cpu),
        Err(Error::Unsupported {
            device: Device::Cpu,
            ..
        })
    ));
    match Stream::new(Device::Cuda(0)) {
        Ok(stream) => println!("a GPU is present: {stream:?}"),
        Err(error) => {
            let message = error.to_string();
            assert!(
                ["cuda` feature", "libcuda", "CUDA device"]
                    .iter()
                    .any(|why| message.contains(why)),
                "{message}"
            );
        }
    }
}
