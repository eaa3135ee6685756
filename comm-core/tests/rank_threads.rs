//! Rank threads know how many rank threads their local world runs.

use ferrotron_comm_core::{local_rank_threads, run_local, Communicator};

#[test]
fn rank_threads_see_their_world_size_and_other_threads_none() -> ferrotron_comm_core::Result<()> {
    assert_eq!(local_rank_threads(), None);
    let seen = run_local(3, |comm| {
        let helper = std::thread::spawn(local_rank_threads).join().ok().flatten();
        Ok::<_, ferrotron_comm_core::Error>((comm.rank(), local_rank_threads(), helper))
    })?;
    for (rank, (seen_rank, on_rank, on_helper)) in seen.into_iter().enumerate() {
        assert_eq!(seen_rank, rank);
        assert_eq!(on_rank, Some(3), "rank {rank}");
        assert_eq!(on_helper, None, "a thread a rank spawns is not a rank");
    }
    assert_eq!(local_rank_threads(), None);
    Ok(())
}
