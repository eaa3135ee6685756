//! The device layer on a real CUDA device: streams ordered by events, stream-ordered memory,
//! copies both ways, a kernel compiled by NVRTC and launched, and the counters. Runs where
//! `cuda:0` exists and the crate has its `cuda` feature; elsewhere it prints `skipped: …`.

use ferrotron_device::{host_waits, transfers, Device, Stream};

/// `cuda:0`'s stream, or why there is none.
fn gpu_stream() -> Result<Stream, String> {
    if !cfg!(feature = "cuda") {
        return Err("built without the `cuda` feature".into());
    }
    Stream::new(Device::Cuda(0)).map_err(|e| e.to_string())
}

/// `cuda:0`'s stream; without one, prints why and returns from the test.
macro_rules! gpu_or_skip {
    () => {
        match gpu_stream() {
            Ok(stream) => stream,
            Err(reason) => {
                println!("skipped: {reason}");
                return Ok(());
            }
        }
    };
}

fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

#[test]
fn streams_events_memory_and_copies_on_cuda() -> ferrotron_device::Result<()> {
    let first = gpu_or_skip!();
    let second = Stream::new(Device::Cuda(0))?;
    assert!(!first.same_as(&second));
    let n = 1 << 20;
    let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let source = first.alloc(4 * n)?;
    let target = second.alloc(4 * n)?;
    let (waits, moved) = (host_waits(Device::Cuda(0)), transfers(Device::Cuda(0)));
    let mut back = vec![0u8; 4 * n];
    // SAFETY: both allocations hold n f32s; the second stream waits for the first's upload
    // before copying, and the download is ordered after the copy on the second stream.
    unsafe {
        first.upload(source.ptr(), &bytes(&values))?;
        let uploaded = first.record()?;
        second.wait(&uploaded)?;
        second.copy(target.ptr(), source.ptr(), 4 * n)?;
        second.download(&mut back, target.ptr())?;
    }
    assert_eq!(back, bytes(&values));
    let after = transfers(Device::Cuda(0));
    assert_eq!(after.to_device_bytes - moved.to_device_bytes, 4 * n as u64);
    assert_eq!(after.to_host_bytes - moved.to_host_bytes, 4 * n as u64);
    let done = second.record()?;
    done.synchronize()?;
    assert!(done.is_complete()?);
    assert!(host_waits(Device::Cuda(0)) > waits);
    Ok(())
}

#[test]
fn a_kernel_compiled_by_nvrtc_runs_on_its_stream() -> ferrotron_device::Result<()> {
    let stream = gpu_or_skip!();
    #[cfg(feature = "cuda")]
    {
        let source = || {
            "extern \"C\" __global__ void scale_add(float* data, unsigned long long n, float a) {\n\
                 for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;\n\
                      i < n; i += (unsigned long long)gridDim.x * blockDim.x) {\n\
                     data[i] = a * data[i] + 1.0f;\n\
                 }\n\
             }\n"
            .to_string()
        };
        let module = ferrotron_device::Module::cuda(0, "device-test-scale-add", source, None)?;
        assert_eq!(module.device(), Device::Cuda(0));
        let function = module.function("scale_add")?;
        // More items than 65,535 blocks of 256 cover, so the kernel's stride loop is used.
        let n: usize = 65_535 * 256 + 1000;
        let memory = stream.alloc(4 * n)?;
        let values: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
        let mut back = vec![0u8; 4 * n];
        // SAFETY: the allocation holds n f32s, as the arguments say.
        unsafe {
            stream.upload(memory.ptr(), &bytes(&values))?;
            stream.launch(&function, n, &[&memory.ptr(), &(n as u64), &2.0f32], &[])?;
            stream.download(&mut back, memory.ptr())?;
        }
        let expected: Vec<f32> = values.iter().map(|x| 2.0 * x + 1.0).collect();
        assert_eq!(back, bytes(&expected));
        assert!(module.function("no_such_kernel").is_err());
    }
    #[cfg(not(feature = "cuda"))]
    let _ = stream;
    Ok(())
}

#[test]
fn pinned_copies_are_queued_and_waited_for_when_read() -> ferrotron_device::Result<()> {
    let stream = gpu_or_skip!();
    let n = 1 << 24;
    let memory = stream.alloc(n)?;
    let mut outgoing = ferrotron_device::PinnedMemory::new(Device::Cuda(0), n)?;
    for (i, byte) in outgoing.as_mut_slice()?.iter_mut().enumerate() {
        *byte = (i % 251) as u8;
    }
    let mut incoming = ferrotron_device::PinnedMemory::new(Device::Cuda(0), n)?;
    let waits = host_waits(Device::Cuda(0));
    // SAFETY: the allocation holds n bytes.
    unsafe {
        stream.upload_pinned(memory.ptr(), &outgoing, n)?;
        stream.download_pinned(&mut incoming, memory.ptr(), n)?;
    }
    // Queued: the host has not waited (16 MiB each way takes far longer than queueing).
    assert_eq!(host_waits(Device::Cuda(0)), waits);
    let back = incoming.as_slice()?.to_vec();
    assert!(back.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
    // Reading the outgoing bytes again waits for nothing new: the upload has run.
    assert_eq!(outgoing.as_slice()?[250], 250);
    Ok(())
}

#[test]
fn staged_uploads_queue_without_host_waits() -> ferrotron_device::Result<()> {
    let stream = gpu_or_skip!();
    let memory = stream.alloc(1 << 20)?;
    let waits = host_waits(Device::Cuda(0));
    for round in 0..8u8 {
        // SAFETY: the allocation holds 1 MiB.
        unsafe { stream.upload_staged(memory.ptr(), &vec![round; 1 << 20])? };
    }
    assert_eq!(host_waits(Device::Cuda(0)), waits);
    let mut back = vec![0u8; 1 << 20];
    // SAFETY: as above.
    unsafe { stream.download(&mut back, memory.ptr())? };
    assert!(back.iter().all(|&b| b == 7));
    Ok(())
}

/// Memory cannot be freed in the order of another device's stream: the call is an error
/// and the memory is leaked, not freed (work queued on that stream may still use it,
/// and no stream of the memory's own device is ordered after that work). Emulated memory
/// and `cuda:0`'s stream are two devices.
#[test]
fn a_free_on_another_devices_stream_is_refused_and_leaks() -> ferrotron_device::Result<()> {
    let gpu = gpu_or_skip!();
    let emulated = Stream::new(Device::Emulated)?;
    let memory = emulated.alloc(64)?;
    let held = ferrotron_device::device_memory(Device::Emulated).live;
    // SAFETY: nothing uses the memory; the call is refused before any free is queued.
    let refused = unsafe { memory.free_on(&gpu) };
    let message = refused.expect_err("another device's stream").to_string();
    assert!(message.contains("leaked"), "{message}");
    // No longer held by this thread's count, never handed back to the allocator.
    assert_eq!(
        ferrotron_device::device_memory(Device::Emulated).live,
        held - 64
    );
    emulated.synchronize()
}
