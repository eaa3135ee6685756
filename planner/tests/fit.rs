//! The layouts that fit a budget: all of them and only them, the least traffic first,
//! each with the peak `predict` gives it.

use ferrotron_planner::{fit, predict, Error, Model, Search, Target};

fn model() -> Model {
    Model::gpt(8, 128, 8, 512, 64)
}

fn search(budget: usize) -> Search {
    Search {
        world: 8,
        budget,
        global_batch: 16,
        micro_batch: 1,
        max_tp: 8,
        element: 2,
        target: Target::Device,
        corpus_bytes: 0,
    }
}

#[test]
fn the_listed_layouts_fit_and_come_least_traffic_first() {
    let everything = fit(&model(), &search(usize::MAX)).unwrap();
    // Every TP × PP × DP of 8 ranks and schedule once: TP 1 takes PP 1, 2 (1F1B and
    // interleaved × 2 and × 4), 4 (1F1B, × 2) and 8; TP 2 PP 1, 2 (three) and 4 (two);
    // TP 4 PP 1 and 2 (three); TP 8 PP 1.
    assert_eq!(everything.fitting.len(), 7 + 6 + 4 + 1);
    let budget = everything.fitting.iter().map(|c| c.peak).sum::<usize>() / 18;
    let found = fit(&model(), &search(budget)).unwrap();
    assert!(!found.fitting.is_empty() && found.fitting.len() < 18);
    assert_eq!(found.considered, everything.considered);
    assert_eq!(everything.considered, 18);
    for c in &found.fitting {
        assert!(c.peak <= budget);
        let stages = predict(&model(), &c.layout).unwrap();
        assert_eq!(c.stages, stages);
        assert_eq!(c.peak, stages.iter().map(|s| s.total()).max().unwrap());
        let l = &c.layout;
        assert_eq!(l.tp * l.pp * l.dp, 8);
        assert_eq!(l.dp * l.batch, 16);
        assert_eq!(l.sequence_parallel, l.tp > 1);
    }
    assert!(found
        .fitting
        .windows(2)
        .all(|w| w[0].traffic <= w[1].traffic));
}

#[test]
fn a_budget_of_the_smallest_peak_fits_it_and_one_byte_less_fits_nothing() {
    let smallest = fit(&model(), &search(1)).unwrap().smallest;
    assert!(fit(&model(), &search(smallest.peak - 1))
        .unwrap()
        .fitting
        .is_empty());
    let found = fit(&model(), &search(smallest.peak)).unwrap();
    assert_eq!(found.fitting.len(), 1);
    assert_eq!(found.fitting[0].peak, smallest.peak);
}

#[test]
fn a_world_no_layout_divides_is_a_typed_error() {
    let prime = Search {
        world: 7,
        ..search(usize::MAX)
    };
    match fit(&model(), &prime) {
        Err(Error::Invalid(message)) => assert!(message.contains("no layout of 7 ranks")),
        other => panic!("{other:?}"),
    }
    assert!(matches!(fit(&model(), &search(0)), Err(Error::Invalid(_))));
    let no_tp = Search {
        max_tp: 0,
        ..search(usize::MAX)
    };
    assert!(matches!(fit(&model(), &no_tp), Err(Error::Invalid(_))));
}
