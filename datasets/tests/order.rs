//! Megatron's sample order, bit for bit: NumPy's `RandomState` shuffles, the GPT
//! dataset's samples and their order, splits and blends, against figures that NumPy 2.4.6
//! and Megatron-LM's own `helpers.cpp` (`build_sample_idx`, `build_blending_indices`,
//! compiled from commit d98e8a64ddf3) produced for the same inputs.

mod common;

use common::numbered;
use ferrotron_datasets::{
    blending_indices, component_samples, parse_blend, parse_split, split_ranges, Blend, GptConfig,
    GptDataset, IndexedDataset, RandomState,
};
use std::sync::Arc;

#[test]
fn the_mersenne_twister_is_the_reference_one() {
    // The C++ standard's check: the 10,000th output of mt19937 seeded 5489.
    let mut random = RandomState::new(5489);
    let last = (0..10_000).map(|_| random.next_u32()).last().unwrap();
    assert_eq!(last, 4_123_659_995);
}

#[test]
fn shuffles_are_numpys() {
    // numpy.random.RandomState(seed).shuffle(numpy.arange(n))
    let cases: [(u32, Vec<usize>); 3] = [
        (1234, vec![7, 2, 9, 1, 0, 8, 4, 5, 6, 3]),
        (0, vec![6, 2, 1, 3, 0, 5, 4]),
        (u32::MAX, vec![11, 8, 5, 9, 1, 10, 6, 0, 4, 7, 2, 3]),
    ];
    for (seed, expected) in cases {
        let mut items: Vec<usize> = (0..expected.len()).collect();
        RandomState::new(seed).shuffle(&mut items);
        assert_eq!(items, expected, "seed {seed}");
    }
}

const SIZES: [usize; 13] = [5, 17, 3, 9, 12, 1, 30, 8, 4, 11, 6, 2, 20];

/// The first and last token of every sample, in the order served.
fn ends(dataset: &GptDataset) -> (Vec<u32>, Vec<u32>) {
    (0..dataset.len())
        .map(|i| {
            let sample = dataset.sample(i).unwrap();
            (sample[0], *sample.last().unwrap())
        })
        .unzip()
}

#[test]
fn one_epoch_gives_megatrons_samples_in_its_order() {
    let data = Arc::new(IndexedDataset::open(numbered("one-epoch", &SIZES)).unwrap());
    let config = GptConfig { seq: 8, seed: 1234 };
    let dataset = GptDataset::new(data, 0..13, Some(10), config).unwrap();
    let (first, last) = ends(&dataset);
    assert_eq!(
        first,
        [
            5000, 6023, 9001, 12013, 1001, 12005, 2, 8000, 9009, 10000, 1009, 6015, 7001, 4004,
            6007
        ]
    );
    assert_eq!(
        last,
        [6007, 3001, 9009, 9001, 1009, 12013, 12005, 4004, 7001, 2, 8000, 6023, 1001, 5000, 6015]
    );
}

#[test]
fn several_epochs_and_a_final_epoch_shuffled_apart_are_megatrons() {
    let data = Arc::new(IndexedDataset::open(numbered("epochs", &SIZES)).unwrap());
    // Sequences 2..11, 40 samples of 7: four epochs, the last shuffled on its own.
    let dataset = GptDataset::new(
        data.clone(),
        2..11,
        Some(40),
        GptConfig { seq: 7, seed: 1234 },
    )
    .unwrap();
    let (first, _) = ends(&dataset);
    assert_eq!(first.len(), 47);
    assert_eq!(
        first[..24],
        [
            9001, 4003, 4010, 4000, 6028, 3007, 8003, 8000, 6014, 3003, 4007, 9008, 4009, 10000,
            6021, 10001, 2000, 6023, 6011, 6004, 6018, 6002, 9004, 6025
        ]
    );
    assert_eq!(first[40..], [3001, 6028, 6007, 6000, 6014, 9005, 3008]);
    // Two epochs of which the second is needed only in part.
    let dataset = GptDataset::new(data, 0..13, Some(24), GptConfig { seq: 8, seed: 99 }).unwrap();
    let (first, last) = ends(&dataset);
    assert_eq!(
        first,
        [
            12009, 12001, 9005, 0, 3002, 6013, 7001, 6029, 1001, 6005, 2002, 6021, 8001, 4006,
            12017, 6022, 4003, 6014, 4011, 10000, 0, 1009, 12017, 1009, 9001, 12001, 6006, 9009,
            1001, 12009, 3007
        ]
    );
    assert_eq!(last[..6], [12017, 12009, 3002, 7001, 1001, 6021]);
}

#[test]
fn samples_cross_document_boundaries() {
    let data = Arc::new(IndexedDataset::open(numbered("cross", &[50, 40, 30])).unwrap());
    let dataset = GptDataset::new(data, 0..3, None, GptConfig { seq: 16, seed: 0 }).unwrap();
    let (first, _) = ends(&dataset);
    assert_eq!(first, [26, 1002, 2016, 1034, 1018, 2000, 10]);
    // Served sample 3 starts six tokens before the end of document 1 and goes on with
    // the first eleven of the document after it in the shuffled order.
    let sample = dataset.sample(3).unwrap();
    assert_eq!(sample[..6], [1034, 1035, 1036, 1037, 1038, 1039]);
    let next = sample[6];
    assert_eq!(next % 1000, 0);
    let expected: Vec<u32> = (next..next + 11).collect();
    assert_eq!(sample[6..], expected[..]);
}

#[test]
fn a_split_too_small_for_one_sample_is_a_typed_error() {
    let data = Arc::new(IndexedDataset::open(numbered("small", &[3, 2])).unwrap());
    let err = GptDataset::new(data, 0..2, Some(1), GptConfig { seq: 8, seed: 1 })
        .err()
        .unwrap();
    assert!(err.to_string().contains("--seq"), "{err}");
}

#[test]
fn splits_round_as_megatron_rounds() {
    let split = parse_split("969,30,1").unwrap();
    assert_eq!(split_ranges(split, 1000), [0..969, 969..999, 999..1000]);
    assert_eq!(
        split_ranges(split, 12345),
        [0..11962, 11962..12333, 12333..12345]
    );
    // Halves round to even: 2.5 → 2.
    assert_eq!(
        split_ranges(parse_split("1,1").unwrap(), 5),
        [0..2, 2..5, 5..5]
    );
    assert_eq!(
        split_ranges(parse_split("98, 2").unwrap(), 100),
        [0..98, 98..100, 100..100]
    );
    for bad in ["", "1,2,3,4", "-1,2", "a,b", "0,0,0"] {
        assert!(parse_split(bad).is_err(), "{bad}");
    }
}

#[test]
fn blends_interleave_as_megatron_interleaves() {
    let words: Vec<String> = ["0.3", "a", "0.7", "b"].map(String::from).to_vec();
    let blend = parse_blend(&words).unwrap();
    assert_eq!(
        blend
            .iter()
            .map(|b| b.1.to_str().unwrap())
            .collect::<Vec<_>>(),
        ["a", "b"]
    );
    let weights: Vec<f64> = blend.iter().map(|b| b.0).collect();
    let (datasets, within): (Vec<usize>, Vec<usize>) =
        blending_indices(&weights, 10).into_iter().unzip();
    assert_eq!(datasets, [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]);
    assert_eq!(within, [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]);
    // Each component is asked for its share and half a percent more.
    assert_eq!(component_samples(&weights, 1000), [(300, 302), (700, 704)]);
    let single = parse_blend(&["only".to_string()]).unwrap();
    assert_eq!(single[0].0, 1.0);
    assert!(parse_blend(&["0.5".to_string(), "a".into(), "-1".into(), "b".into()]).is_err());
}

#[test]
fn a_blend_serves_each_component_in_its_own_order() {
    let a = Arc::new(IndexedDataset::open(numbered("blend-a", &SIZES)).unwrap());
    let b = Arc::new(IndexedDataset::open(numbered("blend-b", &[50, 40, 30])).unwrap());
    let config = GptConfig { seq: 8, seed: 1234 };
    let weights = [0.25, 0.75];
    let parts = component_samples(&weights, 12);
    let components = vec![
        GptDataset::new(a.clone(), 0..13, Some(parts[0].1), config).unwrap(),
        GptDataset::new(b.clone(), 0..3, Some(parts[1].1), config).unwrap(),
    ];
    let alone = [
        GptDataset::new(a, 0..13, Some(parts[0].1), config).unwrap(),
        GptDataset::new(b, 0..3, Some(parts[1].1), config).unwrap(),
    ];
    let blend = Blend::new(components, &weights, 12).unwrap();
    for (i, (k, j)) in blending_indices(&weights, 12).into_iter().enumerate() {
        assert_eq!(blend.sample(i).unwrap(), (k, alone[k].sample(j).unwrap()));
    }
}
