//! Launching a kernel's host build on the emulated device.

use std::ffi::c_void;

use ferrotron_device::{Access, Device, Function, KernelArg, Stream};

/// The argument block of `add_one`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AddOne {
    data: u64,
    len: u64,
}

// SAFETY: a #[repr(C)] struct of scalars, read by `add_one` as such.
unsafe impl KernelArg for AddOne {}

/// `data[i] += 1` for every index: a kernel's host build.
unsafe extern "C" fn add_one(args: *const c_void) {
    // SAFETY: the launch passes a pointer to an `AddOne` whose `data` holds `len` f32s.
    unsafe {
        let args = &*args.cast::<AddOne>();
        let data = std::slice::from_raw_parts_mut(args.data as *mut f32, args.len as usize);
        for x in data {
            *x += 1.0;
        }
    }
}

#[test]
fn a_host_build_runs_over_its_indices() -> ferrotron_device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let memory = stream.alloc(4 * 3)?;
    let values = [1.0f32, 2.0, 3.0];
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
    let function = Function::host("add_one", add_one);
    let args = AddOne {
        data: memory.ptr(),
        len: 3,
    };
    let mut back = [0u8; 12];
    // SAFETY: the allocation holds three f32s, as `args` says.
    unsafe {
        stream.upload(memory.ptr(), &bytes(&values))?;
        stream.launch(&function, 3, &[&args], &[Access::write(memory.ptr(), 12)])?;
        stream.download(&mut back, memory.ptr())?;
    }
    assert_eq!(back.to_vec(), bytes(&[2.0, 3.0, 4.0]));
    assert_eq!(function.name(), "add_one");
    Ok(())
}

#[test]
fn a_launch_of_the_wrong_shape_is_refused() -> ferrotron_device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let function = Function::host("add_one", add_one);
    let (a, b) = (1u64, 2u64);
    // SAFETY: refused before the kernel runs.
    let error = unsafe { stream.launch(&function, 1, &[&a, &b], &[]) }.unwrap_err();
    assert!(error.to_string().contains("takes one argument"), "{error}");
    // No indices, no launch: nothing is read.
    // SAFETY: the kernel does not run.
    unsafe { stream.launch(&function, 0, &[], &[]) }?;
    Ok(())
}
