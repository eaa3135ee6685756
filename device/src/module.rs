//! Kernels and their launch. A kernel is a loop over independent indices taking its
//! arguments by value; on CUDA it comes from a module NVRTC compiled (once per process and
//! architecture, loaded once per device), on the emulated device it is the same source
//! built for the host, which runs the loop to completion when launched.

use std::borrow::Cow;
use std::collections::HashMap;
#[cfg(feature = "cuda")]
use std::sync::Arc;

use parking_lot::Mutex;

use crate::blocks::{BlockKernel, Grid};
use crate::checker::Access;
use crate::emulated::{ArgCopy, Work, ARG_WORDS, MAX_ARG_WORDS};
use crate::error::{Error, Result};
use crate::stream::Stream;
use crate::Device;

/// A kernel built for the host: it reads its one argument (a `#[repr(C)]` struct) through
/// the pointer and runs every index in turn.
pub type HostKernel = unsafe extern "C" fn(*const std::ffi::c_void);

/// Plain data a kernel takes as one parameter, by value.
///
/// # Safety
/// `Self` must be laid out as the kernel's parameter: a scalar, or a `#[repr(C)]` struct of
/// scalars whose fields the kernel declares in the same order.
pub unsafe trait KernelArg: Copy + Send + Sync + 'static {}

// SAFETY: scalars are passed as themselves.
unsafe impl KernelArg for u64 {}
// SAFETY: as above.
unsafe impl KernelArg for i64 {}
// SAFETY: as above.
unsafe impl KernelArg for u32 {}
// SAFETY: as above.
unsafe impl KernelArg for i32 {}
// SAFETY: as above.
unsafe impl KernelArg for f32 {}
// SAFETY: as above.
unsafe impl KernelArg for f64 {}

/// One argument of a launch, whatever its type: any [`KernelArg`] (implement that one;
/// this trait is sealed).
pub trait Arg: sealed::Sealed + Send + Sync {
    /// Copies the value into `words` for a host kernel queued to run later (words, so
    /// that the copy is aligned as any kernel argument needs); `false` if it does not
    /// fit.
    #[doc(hidden)]
    fn host_copy(&self, words: &mut [u64]) -> bool;
    /// Pushes the value onto a CUDA launch.
    #[cfg(feature = "cuda")]
    #[doc(hidden)]
    fn push<'a>(&'a self, launch: &mut cudarc::driver::LaunchArgs<'a>);
}

mod sealed {
    /// Only [`KernelArg`](super::KernelArg)s are [`Arg`](super::Arg)s.
    pub trait Sealed {}

    impl<A: super::KernelArg> Sealed for A {}
}

/// `A` as cudarc passes kernel parameters (a pointer to the value).
#[cfg(feature = "cuda")]
#[repr(transparent)]
struct Param<A>(A);

// SAFETY: `KernelArg` promises the layout the kernel reads.
#[cfg(feature = "cuda")]
unsafe impl<A: KernelArg> cudarc::driver::DeviceRepr for Param<A> {}

impl<A: KernelArg> Arg for A {
    fn host_copy(&self, words: &mut [u64]) -> bool {
        const { assert!(std::mem::align_of::<A>() <= std::mem::align_of::<u64>()) };
        let bytes = std::mem::size_of::<A>();
        if bytes > std::mem::size_of_val(words) {
            return false;
        }
        // SAFETY: `words` holds at least `bytes` bytes; `A` is plain data (`KernelArg`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self as *const A).cast::<u8>(),
                words.as_mut_ptr().cast::<u8>(),
                bytes,
            )
        };
        true
    }

    #[cfg(feature = "cuda")]
    fn push<'a>(&'a self, launch: &mut cudarc::driver::LaunchArgs<'a>) {
        use cudarc::driver::PushKernelArg;
        // SAFETY: `Param<A>` is `#[repr(transparent)]` over `A`.
        let param = unsafe { &*(self as *const A).cast::<Param<A>>() };
        launch.arg(param);
    }
}

/// A kernel ready to launch on a stream of its device.
#[derive(Clone)]
pub struct Function {
    name: Cow<'static, str>,
    kind: FunctionKind,
}

#[derive(Clone)]
enum FunctionKind {
    Host(HostKernel),
    HostBlocks(BlockKernel),
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaFunction),
}

impl std::fmt::Debug for Function {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Function")
            .field("name", &self.name)
            .finish()
    }
}

impl Function {
    /// A kernel's host build, for streams of the emulated device.
    pub fn host(name: &'static str, kernel: HostKernel) -> Function {
        Function {
            name: Cow::Borrowed(name),
            kind: FunctionKind::Host(kernel),
        }
    }

    /// A cooperative kernel's host build, for streams of the emulated device (launched
    /// with [`Stream::launch_blocks`]).
    pub fn host_blocks(name: &'static str, kernel: BlockKernel) -> Function {
        Function {
            name: Cow::Borrowed(name),
            kind: FunctionKind::HostBlocks(kernel),
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// [`Stream::launch`] on a stream a caller holds only as cudarc's: enough blocks of
    /// 256 threads to cover `items` (at most 65,535, which stride).
    ///
    /// # Safety
    /// As [`Stream::launch`], and the function must come from a [`Module`] loaded on the
    /// stream's device.
    #[cfg(feature = "cuda")]
    pub unsafe fn launch_on(
        &self,
        stream: &cudarc::driver::CudaStream,
        items: usize,
        args: &[&dyn Arg],
    ) -> Result<()> {
        const THREADS: u32 = 256;
        if items == 0 {
            return Ok(());
        }
        let blocks = items.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
        let grid = Grid {
            blocks,
            threads: THREADS,
        };
        // SAFETY: as the caller's.
        unsafe { self.launch_grid_on(stream, grid, args) }
    }

    /// Launches the CUDA function over `grid` on `stream`.
    ///
    /// # Safety
    /// As [`launch_on`](Self::launch_on).
    #[cfg(feature = "cuda")]
    unsafe fn launch_grid_on(
        &self,
        stream: &cudarc::driver::CudaStream,
        grid: Grid,
        args: &[&dyn Arg],
    ) -> Result<()> {
        let FunctionKind::Cuda(function) = &self.kind else {
            return Err(Error::Invalid {
                op: "Function::launch_on",
                reason: format!(
                    "{} is a host build; launch it on the emulated device",
                    self.name
                ),
            });
        };
        crate::cuda::bind(stream)?;
        let config = cudarc::driver::LaunchConfig {
            grid_dim: (grid.blocks, 1, 1),
            block_dim: (grid.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(function);
        for arg in args {
            arg.push(&mut launch);
        }
        // SAFETY: the caller guarantees the arguments and their addresses.
        unsafe { launch.launch(config) }
            .map(drop)
            .map_err(|e| Error::Driver {
                call: format!("cuLaunchKernel ({})", self.name),
                message: crate::cuda::describe(&e),
            })
    }
}

/// Kernels compiled for one CUDA device, with their functions looked up once.
pub struct Module {
    device: Device,
    #[cfg(feature = "cuda")]
    module: Arc<cudarc::driver::CudaModule>,
    functions: Mutex<HashMap<String, Function>>,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl Module {
    /// The module `name` for CUDA device `ordinal`: `source` compiled by NVRTC for the
    /// virtual architecture `arch` (NVRTC's default when `None`), once per process and
    /// architecture, and loaded once per device, name and architecture.
    #[cfg(feature = "cuda")]
    pub fn cuda(
        ordinal: usize,
        name: &'static str,
        source: impl FnOnce() -> String,
        arch: Option<&'static str>,
    ) -> Result<Arc<Module>> {
        use std::sync::OnceLock;
        type Key = (usize, &'static str, Option<&'static str>);
        static MODULES: OnceLock<Mutex<HashMap<Key, Arc<Module>>>> = OnceLock::new();
        let mut modules = MODULES.get_or_init(Default::default).lock();
        if let Some(module) = modules.get(&(ordinal, name, arch)) {
            return Ok(module.clone());
        }
        let ptx = crate::cuda::compile(name, source, arch)?;
        let module = crate::cuda::context(ordinal)?
            .load_module(ptx)
            .map_err(|e| Error::Driver {
                call: format!("cuModuleLoadData ({name})"),
                message: crate::cuda::describe(&e),
            })?;
        let module = Arc::new(Module {
            device: Device::Cuda(ordinal),
            module,
            functions: Mutex::new(HashMap::new()),
        });
        modules.insert((ordinal, name, arch), module.clone());
        Ok(module)
    }

    /// The device the module was loaded on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The kernel called `name` in the module.
    pub fn function(&self, name: &str) -> Result<Function> {
        #[cfg(feature = "cuda")]
        {
            let mut functions = self.functions.lock();
            if let Some(function) = functions.get(name) {
                return Ok(function.clone());
            }
            let function = Function {
                name: Cow::Owned(name.to_string()),
                kind: FunctionKind::Cuda(self.module.load_function(name).map_err(|e| {
                    Error::Driver {
                        call: "cuModuleGetFunction".into(),
                        message: format!("{name}: {}", crate::cuda::describe(&e)),
                    }
                })?),
            };
            functions.insert(name.to_string(), function.clone());
            Ok(function)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (name, &self.functions);
            Err(Error::Unsupported {
                op: "Module::function",
                device: self.device,
            })
        }
    }
}

impl Stream {
    /// Queues `function` over `items` independent indices with `args`: on CUDA enough
    /// blocks of 256 threads to cover them (at most 65,535, which stride), on the emulated
    /// device the host build, run by the stream's worker on a copy of the argument (host
    /// builds take exactly one argument). Nothing is queued for 0 items.
    ///
    /// `accesses` are the memory the kernel reads and writes, which the emulated device's
    /// ordering checker checks against other streams' and the host's accesses
    /// ([`Error::Unordered`]; CUDA ignores them). Leaving memory out only hides it from
    /// the checker.
    ///
    /// # Safety
    /// The arguments must be the kernel's, in order, and every address in them device
    /// memory of this stream's device valid for what the kernel accesses until it has run.
    pub unsafe fn launch(
        &self,
        function: &Function,
        items: usize,
        args: &[&dyn Arg],
        accesses: &[Access],
    ) -> Result<()> {
        if items == 0 {
            return Ok(());
        }
        match &function.kind {
            FunctionKind::Host(kernel) => {
                let arg = self.host_argument(function, args)?;
                // The caller guarantees the argument and the addresses in it until the
                // kernel has run.
                let work = Work::Kernel {
                    kernel: *kernel,
                    arg,
                };
                self.queue_emulated(static_name(function), accesses, work)
            }
            FunctionKind::HostBlocks(_) => Err(Error::Invalid {
                op: "Stream::launch",
                reason: format!(
                    "{} is a cooperative kernel: launch it with Stream::launch_blocks",
                    function.name
                ),
            }),
            #[cfg(feature = "cuda")]
            FunctionKind::Cuda(_) => {
                let stream = self.cuda().ok_or_else(|| self.wrong_device(function))?;
                // SAFETY: as the caller's.
                unsafe { function.launch_on(stream, items, args) }
            }
        }
    }

    /// Queues the cooperative kernel `function` over `grid` with `args`: on CUDA as that
    /// grid of blocks, on the emulated device its host build run thread by thread, block
    /// by block, with a GPU's barriers, warp operations and shared memory, and checked
    /// (see [`blocks`](crate::blocks): a fault breaks the stream with its description).
    /// `accesses` are as for [`launch`](Self::launch). A grid the device would refuse
    /// (no blocks, blocks of more than 1024 threads or not of whole warps) is an error.
    ///
    /// # Safety
    /// As [`launch`](Self::launch).
    pub unsafe fn launch_blocks(
        &self,
        function: &Function,
        grid: Grid,
        args: &[&dyn Arg],
        accesses: &[Access],
    ) -> Result<()> {
        if let Some(reason) = grid.check() {
            return Err(Error::Invalid {
                op: "Stream::launch_blocks",
                reason: format!("{}: {reason}", function.name),
            });
        }
        match &function.kind {
            FunctionKind::HostBlocks(kernel) => {
                let arg = self.host_argument(function, args)?;
                let name = static_name(function);
                let work = Work::Blocks {
                    kernel: *kernel,
                    arg,
                    grid,
                    name,
                };
                self.queue_emulated(name, accesses, work)
            }
            FunctionKind::Host(_) => Err(Error::Invalid {
                op: "Stream::launch_blocks",
                reason: format!(
                    "{} is a kernel over independent indices: launch it with Stream::launch",
                    function.name
                ),
            }),
            #[cfg(feature = "cuda")]
            FunctionKind::Cuda(_) => {
                let stream = self.cuda().ok_or_else(|| self.wrong_device(function))?;
                // SAFETY: as the caller's.
                unsafe { function.launch_grid_on(stream, grid, args) }
            }
        }
    }

    /// A host build's one argument copied into the words the queue keeps, on an
    /// emulated stream.
    fn host_argument(&self, function: &Function, args: &[&dyn Arg]) -> Result<ArgCopy> {
        if self.device() != Device::Emulated {
            return Err(self.wrong_device(function));
        }
        let [arg] = args else {
            return Err(Error::Invalid {
                op: "Stream::launch",
                reason: format!(
                    "the host build of {} takes one argument (a struct), not {}",
                    function.name,
                    args.len()
                ),
            });
        };
        let mut words = [0u64; ARG_WORDS];
        if arg.host_copy(&mut words) {
            return Ok(ArgCopy::Inline(words));
        }
        // A GPU keeps a launch's parameters in its driver's command buffer.
        let mut words =
            crate::counters::bookkeeping(|| vec![0u64; MAX_ARG_WORDS].into_boxed_slice());
        if arg.host_copy(&mut words) {
            return Ok(ArgCopy::Boxed(words));
        }
        Err(Error::Invalid {
            op: "Stream::launch",
            reason: format!(
                "the argument of {} is larger than a kernel's {} bytes of parameters; pass \
                 a smaller struct",
                function.name,
                MAX_ARG_WORDS * 8
            ),
        })
    }

    fn wrong_device(&self, function: &Function) -> Error {
        Error::Invalid {
            op: "Stream::launch",
            reason: format!(
                "{} was built for another device than this stream's ({})",
                function.name,
                self.device()
            ),
        }
    }
}

/// A host build's name as the ordering checker and fault reports keep it.
fn static_name(function: &Function) -> &'static str {
    match &function.name {
        Cow::Borrowed(name) => name,
        Cow::Owned(_) => "kernel",
    }
}
