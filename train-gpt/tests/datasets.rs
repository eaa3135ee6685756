//! Data from Megatron-LM: `preprocess` tokenizes text into an indexed dataset, the demo
//! trains on it (alone and blended) with the tokenizer's vocabulary padded as Megatron
//! pads it and the padding left out of the loss, `--eod-mask-loss` leaves the positions
//! after each document's end out of the loss and `--reset-position-ids` counts positions
//! from each document's start, at any layout, and damaged files or a mismatched tokenizer
//! are refused naming the file.

mod common;

use common::{fresh, succeeded, words};
use ferrotron_datasets::IndexedDataset;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const WORDS: &str = "the model splits its layers over stages and its heads over ranks while \
     every rank keeps a shard of the optimizer state and sends gradients to its group";

/// A word-level tokenizer.json: `[UNK]`, `<|endoftext|>`, then every word of [`WORDS`].
fn tokenizer(dir: &Path) -> (PathBuf, usize) {
    let mut words: Vec<&str> = WORDS.split_whitespace().collect();
    words.sort_unstable();
    words.dedup();
    let mut vocab = vec![
        "\"[UNK]\": 0".to_string(),
        "\"<|endoftext|>\": 1".to_string(),
    ];
    vocab.extend(
        words
            .iter()
            .enumerate()
            .map(|(i, w)| format!("\"{w}\": {}", i + 2)),
    );
    let special = |id: usize, content: &str| {
        format!(
            r#"{{"id": {id}, "content": "{content}", "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true}}"#
        )
    };
    let json = format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{}, {}], "normalizer": null,
            "pre_tokenizer": {{"type": "Whitespace"}}, "post_processor": null,
            "decoder": null,
            "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "[UNK]"}}}}"#,
        special(0, "[UNK]"),
        special(1, "<|endoftext|>"),
        vocab.join(", ")
    );
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json).unwrap();
    (path, words.len() + 2)
}

/// `count` JSON-lines documents of words drawn in a fixed pattern.
fn corpus(dir: &Path, count: usize, salt: usize) -> PathBuf {
    let words: Vec<&str> = WORDS.split_whitespace().collect();
    let lines: Vec<String> = (0..count)
        .map(|d| {
            let length = 20 + (d * 7 + salt) % 30;
            let text: Vec<&str> = (0..length)
                .map(|i| words[(d * 3 + i * (salt + 5)) % words.len()])
                .collect();
            format!("{{\"text\": \"{}\", \"id\": {d}}}", text.join(" "))
        })
        .collect();
    let path = dir.join(format!("corpus{salt}.jsonl"));
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

fn run(binary: &str, args: &[&str]) -> Output {
    Command::new(binary)
        .args(args)
        .output()
        .expect("the binary runs")
}

/// Tokenizes `count` documents into `dir/NAME_text_document`.
fn preprocess(dir: &Path, tokenizer: &Path, name: &str, count: usize, salt: usize) -> PathBuf {
    let input = corpus(dir, count, salt);
    let prefix = dir.join(name);
    let out = succeeded(&run(
        env!("CARGO_BIN_EXE_preprocess"),
        &[
            "--input",
            input.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--output-prefix",
            prefix.to_str().unwrap(),
            "--append-eod",
        ],
    ));
    assert!(out.contains(&format!("{count} documents")), "{out}");
    dir.join(format!("{name}_text_document"))
}

const MODEL: &str =
    "--layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --steps 6 --eval-interval 3";

fn train(dir: &Path, extra: &[&str]) -> Output {
    let out = dir.join("out");
    let mut args: Vec<&str> = words(MODEL);
    args.extend(extra);
    args.extend(["--out", out.to_str().unwrap()]);
    run(env!("CARGO_BIN_EXE_train-gpt"), &args)
}

fn number_after(text: &str, prefix: &str) -> f64 {
    let at = text
        .find(prefix)
        .unwrap_or_else(|| panic!("no {prefix:?} in {text}"))
        + prefix.len();
    let digits: String = text[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == 'e' || *c == '-')
        .collect();
    digits.parse().unwrap()
}

#[test]
fn preprocess_writes_what_the_tokenizer_gives_with_end_of_document_tokens() {
    let dir = fresh("datasets-preprocess");
    let (tokenizer, _) = tokenizer(&dir);
    let prefix = preprocess(&dir, &tokenizer, "docs", 12, 1);
    let dataset = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(dataset.len(), 12);
    assert_eq!(dataset.document_indices(), (0..=12).collect::<Vec<u64>>());
    let first = dataset.sequence(0).unwrap();
    // 21 words and the end-of-document token, none of them unknown.
    assert_eq!(first.len(), 22);
    assert_eq!(*first.last().unwrap(), 1);
    assert!(first[..21].iter().all(|&t| t >= 2));
}

#[test]
fn the_demo_trains_on_a_dataset_and_its_blend_exactly_at_any_layout() {
    let dir = fresh("datasets-train");
    let (tokenizer, size) = tokenizer(&dir);
    let a = preprocess(&dir, &tokenizer, "a", 60, 1);
    let b = preprocess(&dir, &tokenizer, "b", 40, 2);
    let tok = tokenizer.to_str().unwrap();
    let out = succeeded(&train(
        &dir,
        &[
            "--data-path",
            a.to_str().unwrap(),
            "--tokenizer",
            tok,
            "--tp",
            "2",
            "--dp",
            "2",
            "--check",
        ],
    ));
    assert!(
        out.contains(&format!("a vocabulary of {size} tokens")),
        "{out}"
    );
    // The vocabulary is padded to 256 at TP 2 and to 128 at TP 1, and the padding takes
    // no probability: the first loss of a model near zero is ln of the real tokens.
    let first = number_after(&out, "loss: ");
    assert!(
        (first - (size as f64).ln()).abs() < 0.05,
        "{first} vs ln {size}"
    );
    assert!(number_after(&out, "max loss difference: ") <= 1e-4, "{out}");
    let blend = succeeded(&train(
        &dir,
        &[
            "--data-path",
            "0.3",
            a.to_str().unwrap(),
            "0.7",
            b.to_str().unwrap(),
            "--tokenizer",
            tok,
            "--tp",
            "1",
            "--dp",
            "2",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--check",
        ],
    ));
    assert!(
        blend.contains("0.300 ×") && blend.contains("0.700 ×"),
        "{blend}"
    );
    assert!(
        number_after(&blend, "max loss difference: ") <= 1e-4,
        "{blend}"
    );
}

#[test]
fn damaged_data_and_a_mismatched_tokenizer_are_refused_naming_the_file() {
    let dir = fresh("datasets-refused");
    let (tokenizer, _) = tokenizer(&dir);
    let prefix = preprocess(&dir, &tokenizer, "docs", 30, 3);
    let tok = tokenizer.to_str().unwrap();
    let bin = ferrotron_datasets::paths(&prefix).1;
    let bytes = std::fs::read(&bin).unwrap();
    std::fs::write(&bin, &bytes[..bytes.len() - 10]).unwrap();
    let truncated = train(
        &dir,
        &["--data-path", prefix.to_str().unwrap(), "--tokenizer", tok],
    );
    let err = String::from_utf8_lossy(&truncated.stderr);
    assert!(!truncated.status.success());
    assert!(
        err.contains(bin.to_str().unwrap()) && err.contains("truncated"),
        "{err}"
    );
    std::fs::write(&bin, &bytes).unwrap();
    // A tokenizer of fewer tokens than the data uses.
    let small = dir.join("small.json");
    let text = std::fs::read_to_string(&tokenizer).unwrap();
    let cut = text.find(", \"the\"").map_or(text.clone(), |at| {
        let end = text[at + 1..].find(',').map_or(text.len(), |e| at + 1 + e);
        format!("{}{}", &text[..at], &text[end..])
    });
    std::fs::write(&small, cut).unwrap();
    let mismatched = train(
        &dir,
        &[
            "--data-path",
            prefix.to_str().unwrap(),
            "--tokenizer",
            small.to_str().unwrap(),
        ],
    );
    let err = String::from_utf8_lossy(&mismatched.stderr);
    assert!(!mismatched.status.success());
    assert!(err.contains("outside the tokenizer"), "{err}");
    let unpaired = train(&dir, &["--data-path", prefix.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&unpaired.stderr).contains("--tokenizer"));
}

#[test]
fn eod_mask_loss_leaves_document_boundaries_out_at_any_layout() {
    let dir = fresh("datasets-eod-mask");
    let (tokenizer, _) = tokenizer(&dir);
    let prefix = preprocess(&dir, &tokenizer, "docs", 40, 4);
    let data = ["--data-path", prefix.to_str().unwrap(), "--tokenizer"];
    let tok = tokenizer.to_str().unwrap();
    let layout = ["--tp", "2", "--dp", "2"];
    let mut flags: Vec<&str> = data.iter().copied().chain([tok]).chain(layout).collect();
    let plain = succeeded(&train(&dir, &flags));
    flags.extend(["--eod-mask-loss", "--check"]);
    let masked = succeeded(&train(&dir, &flags));
    assert!(
        number_after(&masked, "max loss difference: ") <= 1e-4,
        "{masked}"
    );
    // Documents of 22 tokens in windows of 16: most windows cross an end, whose next
    // position no longer counts. Near initialisation every position's loss is close to
    // ln V, so the mean moves little (3e-4 here), but far more than rounding would.
    let (a, b) = (
        number_after(&plain, "loss: "),
        number_after(&masked, "loss: "),
    );
    assert!((a - b).abs() > 1e-4, "masking changed nothing: {a} vs {b}");
    // A token the tokenizer does not have, and no tokenizer at all.
    flags.extend(["--eod-token", "</s>"]);
    let unknown = train(&dir, &flags);
    let err = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        !unknown.status.success() && err.contains("\"</s>\""),
        "{err}"
    );
    // Experts route each rank's rows apart, the masked loss weighs all ranks' together:
    // one rank cannot check both at DP 2.
    flags.truncate(flags.len() - 2);
    flags.extend(["--num-experts", "4", "--expert-parallel", "2"]);
    let experts = train(&dir, &flags);
    let err = String::from_utf8_lossy(&experts.stderr);
    assert!(
        !experts.status.success() && err.contains("--check cannot"),
        "{err}"
    );
    let bytes = train(&dir, &["--eod-mask-loss"]);
    assert!(!bytes.status.success());
    assert!(String::from_utf8_lossy(&bytes.stderr).contains("--tokenizer"));
}

#[test]
fn reset_position_ids_count_from_each_document_start_at_any_layout() {
    let dir = fresh("datasets-reset-positions");
    let (tokenizer, _) = tokenizer(&dir);
    let prefix = preprocess(&dir, &tokenizer, "docs", 40, 5);
    let data = [
        "--data-path",
        prefix.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
    ];
    let first_loss = |extra: &[&str]| -> f64 {
        let flags: Vec<&str> = data.iter().chain(extra).copied().collect();
        let out = succeeded(&train(&dir, &flags));
        if extra.contains(&"--check") {
            assert!(number_after(&out, "max loss difference: ") <= 1e-4, "{out}");
        }
        number_after(&out, "loss: ")
    };
    let plain = first_loss(&["--tp", "2", "--dp", "1"]);
    // Sequence and context parallelism cut the positions as they cut the ids.
    let reset = first_loss(&[
        "--tp",
        "2",
        "--dp",
        "1",
        "--sequence-parallel",
        "--cp",
        "2",
        "--reset-position-ids",
        "--check",
    ]);
    assert!(
        (plain - reset).abs() > 1e-4,
        "resetting changed nothing: {plain}"
    );
    first_loss(&[
        "--tp",
        "1",
        "--dp",
        "1",
        "--pp",
        "2",
        "--microbatches",
        "2",
        "--reset-position-ids",
        "--eod-mask-loss",
        "--device",
        "emulated",
        "--check",
    ]);
}
