//! How many threads the CPU kernels of one calling thread may use.
//!
//! PyTorch's `set_num_threads` is per process. Here the setting is per calling thread,
//! because ferrotron's local backend runs ranks as threads of one process: each rank owns
//! its share, and ranks × threads per rank ≤ cores keeps them from oversubscribing the
//! machine. Unset, a thread gets the cores available to the process (its affinity mask
//! and cgroup quota), divided by the number of rank threads when it is a local rank.

use std::cell::Cell;
use std::num::NonZeroUsize;
use std::sync::OnceLock;

use crate::{Error, Result};

thread_local! {
    static THREADS: Cell<Option<NonZeroUsize>> = const { Cell::new(None) };
}

/// Sets how many threads the calling thread's CPU kernels (matrix products) use from now
/// on; other threads keep their own setting. Zero is an [`Error::InvalidArgument`].
///
/// ```
/// ferrotron_tape::set_num_threads(1)?;
/// assert_eq!(ferrotron_tape::num_threads(), 1);
/// assert!(ferrotron_tape::set_num_threads(0).is_err());
/// # Ok::<(), ferrotron_tape::Error>(())
/// ```
pub fn set_num_threads(threads: usize) -> Result<()> {
    let threads = NonZeroUsize::new(threads).ok_or_else(|| Error::InvalidArgument {
        op: "set_num_threads",
        reason: "needs at least one thread (1 runs every kernel on the calling thread)".into(),
    })?;
    THREADS.set(Some(threads));
    Ok(())
}

/// The calling thread's thread count: what [`set_num_threads`] set, else the cores
/// available to the process, divided among the rank threads of a local world.
pub fn num_threads() -> usize {
    THREADS
        .get()
        .map_or_else(default_threads, NonZeroUsize::get)
}

fn default_threads() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from));
    (cores / ferrotron_comm_core::local_rank_threads().unwrap_or(1)).max(1)
}

/// Below this many elements per thread an elementwise or row-wise kernel stays on the
/// calling thread: starting a helper costs tens of microseconds, about what 2¹⁶
/// elements of a layer norm or a GELU take.
const MIN_ELEMENTS_PER_THREAD: usize = 1 << 16;

/// How many of the calling thread's threads a kernel over `elements` in `rows` rows uses.
fn threads_for(elements: usize, rows: usize) -> usize {
    (num_threads().min(elements / MIN_ELEMENTS_PER_THREAD))
        .min(rows)
        .max(1)
}

/// Runs `f(first_row, block, extra)` over `data`, rows of `width`, and `extra`, `per_row`
/// values a row, cut into blocks of whole rows, on as many threads as their size
/// warrants. Each row is computed by one call, as on one thread, so the bits do not
/// depend on the thread count.
pub(crate) fn for_row_blocks<T: Send, U: Send>(
    data: &mut [T],
    width: usize,
    extra: &mut [U],
    per_row: usize,
    f: impl Fn(usize, &mut [T], &mut [U]) + Sync,
) {
    let (width, per_row) = (width.max(1), per_row.max(1));
    let rows = data.len() / width;
    let threads = threads_for(data.len(), rows);
    if threads == 1 {
        return f(0, data, extra);
    }
    let block = rows.div_ceil(threads);
    let pieces: Vec<(usize, &mut [T], &mut [U])> = (data.chunks_mut(block * width))
        .zip(
            extra
                .chunks_mut(block * per_row)
                .chain(std::iter::repeat_with(|| &mut [][..])),
        )
        .enumerate()
        .map(|(i, (d, e))| (i * block, d, e))
        .collect();
    run_pieces(pieces, |(first, d, e)| f(first, d, e));
}

/// Runs `work` on every piece, on up to `pieces.len()` threads: the caller and scoped
/// helpers pulling from one queue. A helper that cannot be spawned leaves its share to the
/// others, so this never fails.
pub(crate) fn run_pieces<P: Send>(pieces: Vec<P>, work: impl Fn(P) + Sync) {
    let helpers = pieces.len().saturating_sub(1);
    let queue = parking_lot::Mutex::new(pieces);
    let drain = || loop {
        // The lock is released before the work (a `while let` would hold it throughout).
        let next = queue.lock().pop();
        let Some(piece) = next else { break };
        work(piece);
    };
    std::thread::scope(|scope| {
        for _ in 0..helpers {
            // A failed spawn only means fewer hands.
            let _ = std::thread::Builder::new().spawn_scoped(scope, drain);
        }
        drain();
    });
}
