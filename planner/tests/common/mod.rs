use ferrotron_pipeline::Schedule;
use ferrotron_planner::{Layout, Recompute, Target};

/// One rank of everything, f32, on the device, one microbatch of `batch` sequences.
pub fn serial(batch: usize) -> Layout {
    Layout {
        tp: 1,
        pp: 1,
        dp: 1,
        schedule: Schedule::OneFOneB,
        microbatches: 1,
        batch,
        element: 4,
        distributed_optimizer: false,
        sequence_parallel: false,
        recompute: Recompute::None,
        target: Target::Device,
        corpus_bytes: 0,
    }
}
