//! Byte counts as people write them, and layouts that cannot be planned: typed errors
//! that say why.

mod common;

use common::serial;
use ferrotron_planner::{predict, Bytes, Error, Layout, Model, Recompute};

#[test]
fn byte_counts_parse_with_binary_and_decimal_units() {
    let parse = |text: &str| text.parse::<Bytes>().map(|b| b.0);
    assert_eq!(parse("80GiB").unwrap(), 80 << 30);
    assert_eq!(parse("80 gib").unwrap(), 80 << 30);
    assert_eq!(parse("1.5TB").unwrap(), 1_500_000_000_000);
    assert_eq!(parse("512MiB").unwrap(), 512 << 20);
    assert_eq!(parse("4KB").unwrap(), 4000);
    assert_eq!(parse("1000000").unwrap(), 1_000_000);
    assert_eq!(parse("7B").unwrap(), 7);
    for bad in ["80XB", "", "GiB", "-1GiB", "1e400"] {
        let err = parse(bad).unwrap_err();
        assert!(err.to_string().contains("80GiB"), "{bad}: {err}");
    }
    assert_eq!(Bytes(80 << 30).to_string(), "80.00 GiB");
    assert_eq!(Bytes(1536).to_string(), "1.50 KiB");
    assert_eq!(Bytes(12).to_string(), "12 B");
}

#[test]
fn layouts_that_do_not_split_the_model_are_typed_errors() {
    let model = Model::gpt(4, 64, 4, 256, 32);
    let cases = [
        (Layout { tp: 3, ..serial(2) }, "divide by tp 3"),
        (Layout { pp: 3, ..serial(2) }, "4 layers do not split"),
        (
            Layout {
                microbatches: 3,
                ..serial(2)
            },
            "3 equal microbatches",
        ),
        (
            Layout {
                element: 3,
                ..serial(2)
            },
            "3-byte",
        ),
        (Layout { dp: 0, ..serial(2) }, "at least 1"),
        (
            Layout {
                recompute: Recompute::Block { layers: 0 },
                ..serial(2)
            },
            "at least 1 layer",
        ),
    ];
    for (layout, says) in cases {
        match predict(&model, &layout) {
            Err(Error::Invalid(message)) => assert!(message.contains(says), "{message}"),
            other => panic!("{layout:?}: {other:?}"),
        }
    }
    let odd = Model {
        hidden: 66,
        ..model
    };
    assert!(matches!(predict(&odd, &serial(2)), Err(Error::Invalid(_))));
}
