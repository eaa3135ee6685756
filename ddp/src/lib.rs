//! Bucketed, overlapped data-parallel gradient sync (not built yet; see issue 7).
