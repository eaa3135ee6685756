//! Invalid configurations are typed errors that say what is wrong and what is valid.

use ferrotron_parallel_state::{Error, Order, RankLayout, Stage};

fn message(result: Result<RankLayout, Error>) -> (Error, String) {
    let error = result.expect_err("configuration should be rejected");
    let text = error.to_string();
    (error, text)
}

#[test]
fn zero_sizes() {
    let (error, text) = message(RankLayout::builder(8).tp(0).build());
    assert!(matches!(error, Error::ZeroSize { what: "tp" }));
    assert!(text.contains("at least 1"), "{text}");
    let (error, _) = message(RankLayout::builder(0).build());
    assert!(matches!(error, Error::ZeroSize { what: "world size" }));
    let (error, _) = message(RankLayout::builder(8).ep(0).build());
    assert!(matches!(error, Error::ZeroSize { what: "ep" }));
}

#[test]
fn world_not_divisible_by_model_size() {
    let (error, text) = message(RankLayout::builder(12).tp(2).pp(4).build());
    assert!(matches!(
        error,
        Error::NotDivisible {
            world: 12,
            product: 8,
            ..
        }
    ));
    assert!(text.contains("tp·pp·cp (2·4·1) = 8"), "{text}");
    assert!(text.contains("1, 2, 3, 4, 6, 12"), "{text}");

    let (error, text) = message(RankLayout::builder(12).tp(2).ep(4).build());
    assert!(matches!(error, Error::NotDivisible { product: 8, .. }));
    assert!(text.contains("expert tp·ep·pp"), "{text}");
}

#[test]
fn bad_order_strings() {
    let error = "tp-xp-dp".parse::<Order>().unwrap_err();
    assert!(matches!(&error, Error::UnknownOrderToken { token, .. } if token == "xp"));
    assert!(error.to_string().contains("tp, cp, ep, dp and pp"));

    let error = "tp-dp-TP".parse::<Order>().unwrap_err();
    assert!(matches!(&error, Error::RepeatedOrderToken { token, .. } if token == "TP"));

    assert!(matches!(
        "".parse::<Order>(),
        Err(Error::UnknownOrderToken { .. })
    ));
    assert!(matches!(
        "tp--pp".parse::<Order>(),
        Err(Error::UnknownOrderToken { .. })
    ));
    // Tokens are case-insensitive, as in Megatron.
    assert_eq!("TP-Pp-dp".parse::<Order>().unwrap().to_string(), "tp-pp-dp");
}

#[test]
fn axis_missing_from_order() -> anyhow::Result<()> {
    let (error, text) = message(
        RankLayout::builder(8)
            .tp(2)
            .cp(2)
            .order("tp-dp-pp".parse()?)
            .build(),
    );
    assert!(matches!(
        error,
        Error::MissingOrderAxis {
            axis: "cp",
            size: 2,
            ..
        }
    ));
    assert!(text.contains("add \"cp\""), "{text}");

    // dp > 1 is an axis too.
    let (error, _) = message(RankLayout::builder(8).tp(2).order("tp-pp".parse()?).build());
    assert!(matches!(
        error,
        Error::MissingOrderAxis {
            axis: "dp",
            size: 4,
            ..
        }
    ));

    let (error, _) = message(
        RankLayout::builder(8)
            .ep(2)
            .order("tp-dp-pp".parse()?)
            .build(),
    );
    assert!(matches!(error, Error::MissingOrderAxis { axis: "ep", .. }));

    // Axes of size 1 may be left out.
    let layout = RankLayout::builder(8).tp(8).order("tp".parse()?).build()?;
    assert_eq!(layout.order().to_string(), "tp");
    Ok(())
}

#[test]
fn expert_layout_megatron_rejects() -> anyhow::Result<()> {
    // pp not last and cp > 1: expert dp (dp·cp = 4) differs from dp (2).
    let (error, text) = message(
        RankLayout::builder(8)
            .cp(2)
            .pp(2)
            .order("tp-pp-cp-dp".parse()?)
            .build(),
    );
    assert!(matches!(error, Error::ExpertMismatch { .. }));
    assert!(text.contains("put pp last"), "{text}");

    // Same data-parallel sizes but the pipeline stride differs (2 dense, 1 expert).
    let (error, text) = message(
        RankLayout::builder(8)
            .tp(2)
            .pp(2)
            .ep(2)
            .expert_tp(1)
            .order("tp-pp-ep-dp".parse()?)
            .build(),
    );
    assert!(matches!(error, Error::ExpertMismatch { .. }));
    assert!(text.contains("pipeline groups differ"), "{text}");
    Ok(())
}

#[test]
fn stages_and_ranks_out_of_range() -> anyhow::Result<()> {
    let (error, text) = message(
        RankLayout::builder(8)
            .pp(4)
            .embedding_stages([Stage::First, Stage::At(4)])
            .build(),
    );
    assert!(matches!(
        error,
        Error::StageOutOfRange {
            group: "embedding",
            stage: 4,
            pp: 4
        }
    ));
    assert!(text.contains("0..=3"), "{text}");

    let layout = RankLayout::builder(8).tp(2).rank_offset(4).build()?;
    for rank in [0, 3, 12] {
        let error = layout.coordinates(rank).unwrap_err();
        assert!(matches!(
            error,
            Error::RankOutOfRange {
                first: 4,
                last: 11,
                ..
            }
        ));
    }
    assert!(layout.coordinates(11).is_ok());
    let error = layout
        .rank_of(ferrotron_parallel_state::Coordinates {
            tp: 2,
            ..Default::default()
        })
        .unwrap_err();
    assert!(matches!(
        error,
        Error::CoordinateOutOfRange {
            axis: "tp",
            value: 2,
            size: 2
        }
    ));
    Ok(())
}
