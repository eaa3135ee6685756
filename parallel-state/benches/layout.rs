//! Layout costs: enumerating every group of a 65,536-rank layout (target < 1 s) and one
//! rank's view of a 1,048,576-rank layout (coordinates and memberships in nanoseconds,
//! member lists in time proportional to their length).
//!
//! `CARGO_TARGET_DIR=/work/target-ps cargo bench -p ferrotron-parallel-state --bench layout`

use criterion::{criterion_group, criterion_main, Criterion};
use ferrotron_parallel_state::{GroupKind, RankLayout};
use std::hint::black_box;

fn enumerate_all_groups(c: &mut Criterion) {
    let layout = RankLayout::builder(1 << 16)
        .tp(8)
        .cp(2)
        .pp(8)
        .ep(4)
        .build()
        .expect("valid layout");
    c.bench_function("all 16 families, 65536 ranks", |b| {
        b.iter(|| {
            for kind in GroupKind::ALL {
                black_box(layout.groups(black_box(kind)));
            }
        })
    });
}

fn one_rank_of_a_million(c: &mut Criterion) {
    let layout = RankLayout::builder(1 << 20)
        .tp(8)
        .cp(2)
        .pp(16)
        .build()
        .expect("valid layout");
    c.bench_function(
        "one rank's coordinates and memberships, 1048576 ranks",
        |b| {
            b.iter(|| {
                let rank = black_box(987_654);
                black_box(layout.coordinates(rank).expect("in range"));
                for kind in GroupKind::ALL {
                    black_box(layout.membership(kind, rank).expect("in range"));
                }
            })
        },
    );
    // Member lists cost their length: this rank's 16 groups hold ~190,000 ranks.
    c.bench_function("one rank's coordinates and groups, 1048576 ranks", |b| {
        b.iter(|| {
            let rank = black_box(987_654);
            black_box(layout.coordinates(rank).expect("in range"));
            for kind in GroupKind::ALL {
                black_box(layout.group_of(kind, rank).expect("in range"));
            }
        })
    });
}

criterion_group!(benches, enumerate_all_groups, one_rank_of_a_million);
criterion_main!(benches);
