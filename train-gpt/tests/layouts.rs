//! Every layout the demo accepts trains, checks, samples, plots, saves and resumes; one it
//! cannot run is refused before the first step, naming the flag to change. The sweep
//! crosses tensor, pipeline (1F1B, GPipe, interleaved with one or two chunks), context and
//! data parallelism with sequence parallelism, the distributed optimizer, clipping, 16-bit
//! formats, dropout, tied and untied embeddings, grouped-query and unfused attention and the
//! emulated device.

mod common;

use common::scratch;
use std::path::Path;
use std::process::{Command, Output};

/// A model small enough that the sweep takes seconds: two blocks, hidden 24 (divisible
/// by 1, 2, 3, 4, 6, 12 heads), a 16-byte context.
const SIZES: &[&str] = &[
    "--layers", "2", "--hidden", "24", "--heads", "4", "--seq", "16", "--batch", "4",
];

/// The accepted layouts. Sizes a layout sets replace [`SIZES`]'.
const ACCEPTED: &[&str] = &[
    "--tp 1 --dp 1",
    "--tp 2 --dp 2",
    "--tp 2 --dp 1 --sequence-parallel --microbatches 2",
    // An uneven vocabulary split (256 over 3), uneven heads per sequence part.
    "--tp 3 --heads 6 --dp 1 --sequence-parallel",
    // More ranks than the 10-byte prompts have positions, under sequence parallelism.
    "--tp 12 --heads 12 --layers 1 --dp 1 --sequence-parallel",
    "--pp 2 --tp 1 --dp 1 --microbatches 2",
    "--pp 2 --tp 1 --dp 2 --schedule gpipe --microbatches 4",
    "--pp 2 --tp 1 --dp 1 --schedule interleaved --virtual-stages 1 --microbatches 2",
    "--pp 2 --tp 2 --dp 1 --layers 4 --schedule interleaved --virtual-stages 2 \
     --microbatches 2 --hidden-dropout 0.1 --attention-dropout 0.1",
    "--pp 4 --tp 1 --dp 1 --layers 4 --microbatches 4",
    "--pp 2 --tp 2 --dp 2 --microbatches 2 --use-distributed-optimizer --clip-grad 0.5",
    "--pp 2 --tp 2 --dp 2 --microbatches 2 --use-distributed-optimizer --precision bf16",
    "--pp 2 --tp 2 --dp 1 --sequence-parallel --untie-embeddings-and-output-weights",
    "--tp 2 --dp 2 --use-distributed-optimizer --precision fp16 --clip-grad 1",
    "--tp 2 --dp 2 --precision bf16 --untie-embeddings-and-output-weights \
     --lr-decay wsd --lr-wsd-decay-steps 100 --lr-warmup-init 1e-4",
    "--tp 1 --dp 3 --microbatches 4 --hidden-dropout 0.2 --lr-decay inverse-square-root",
    "--pp 2 --tp 2 --dp 1 --microbatches 2 --device emulated --precision bf16",
    "--pp 2 --tp 2 --dp 2 --layers 4 --schedule interleaved --virtual-stages 2 \
     --microbatches 2 --use-distributed-optimizer --precision fp16 --hidden-dropout 0.1 \
     --clip-grad 1",
    "--tp 4 --dp 2 --sequence-parallel --use-distributed-optimizer \
     --untie-embeddings-and-output-weights --lr-decay linear",
    "--tp 2 --dp 1 --sequence-parallel --device emulated --precision fp16",
    // Context parallelism: 16 positions in 2 × cp chunks.
    "--cp 2 --tp 2 --dp 2",
    "--cp 2 --pp 2 --tp 1 --dp 1 --microbatches 2 --hidden-dropout 0.1",
    "--cp 2 --tp 2 --dp 1 --sequence-parallel --use-distributed-optimizer --precision bf16",
    "--cp 4 --tp 1 --dp 1 --device emulated",
    // Grouped-query attention (two groups of two heads) split over TP, fused and unfused.
    "--tp 2 --dp 1 --num-query-groups 2 --sequence-parallel --device emulated --precision bf16",
    "--tp 2 --dp 2 --num-query-groups 2 --attention unfused --attention-dropout 0.1",
    "--cp 2 --tp 1 --dp 1 --num-query-groups 1",
    // Experts: sequence parallelism, the distributed optimizer, bf16 on the device.
    "--num-experts 4 --expert-parallel 2 --tp 2 --dp 2 --sequence-parallel \
     --use-distributed-optimizer --precision bf16 --device emulated",
];

/// Layouts refused before training, with a word the message must contain.
const REFUSED: &[(&str, &str)] = &[
    ("--tp 3 --dp 1", "--tp"),
    ("--pp 3 --dp 1", "--layers 2 cannot be split"),
    (
        "--pp 2 --dp 1 --schedule interleaved --microbatches 3",
        "microbatches",
    ),
    ("--pp 2 --dp 1 --virtual-stages 2", "--schedule interleaved"),
    ("--tp 4 --dp 1 --sequence-parallel --seq 2", "--seq"),
    ("--microbatches 3", "--microbatches 3 must divide --batch 4"),
    ("--cp 3 --dp 1", "--seq 16 must be a multiple of 6"),
    (
        "--cp 2 --dp 1 --attention-dropout 0.1",
        "--attention-dropout 0",
    ),
    (
        "--num-query-groups 3",
        "--num-query-groups 3 does not divide --heads 4",
    ),
    (
        "--tp 2 --dp 1 --num-query-groups 1",
        "--num-query-groups 1 cannot be divided",
    ),
    ("--lr-decay wsd", "--lr-wsd-decay-steps"),
    ("--lr-wsd-decay-steps 10", "--lr-decay wsd"),
    ("--lr-decay wsd --lr-wsd-decay-steps 600", "WSD anneal"),
    ("--lr-warmup-init 1", "init_lr"),
    ("--hidden-dropout 1", "--hidden-dropout"),
    ("--weight-decay=-1", "--weight-decay"),
    ("--clip-grad=-1", "--clip-grad must be a finite number ≥ 0"),
    ("--recompute-granularity full", "needs --recompute-method"),
    (
        "--recompute-granularity selective --recompute-method block",
        "drop --recompute-method",
    ),
];

/// The demo with [`SIZES`] (those `layout` does not set), no validation unless asked.
fn train(layout: &[&str], extra: &[&str]) -> Output {
    let sizes = SIZES.chunks(2).filter(|pair| !layout.contains(&pair[0]));
    Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(sizes.flatten())
        .args(["--eval-interval", "2", "--eval-batches", "1"])
        .args(layout)
        .args(extra)
        .output()
        .expect("the train-gpt binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `layout` with `extra`; fails the test with everything it printed unless it
/// succeeds. Returns stdout.
fn succeed(layout: &[&str], extra: &[&str]) -> String {
    let output = train(layout, extra);
    let stdout = text(&output.stdout);
    assert!(
        output.status.success(),
        "train-gpt {layout:?} {extra:?} failed:\n{stdout}{}",
        text(&output.stderr)
    );
    stdout
}

fn csv_rows(path: &Path) -> usize {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().count() - 1
}

/// What every finished run leaves: the curve as CSV and SVG, three samples, the check's
/// line (within f32 rounding of one rank where nothing else differs).
fn assert_complete(what: &str, stdout: &str, out: &Path, steps: usize, flags: &str) {
    assert_eq!(csv_rows(&out.join("loss.csv")), steps, "{what}");
    assert!(csv_rows(&out.join("validation.csv")) >= 1, "{what}");
    assert!(out.join("loss.svg").is_file(), "{what}");
    let samples = stdout.lines().skip_while(|l| *l != "samples:").skip(1);
    assert_eq!(
        samples.take_while(|l| l.starts_with("  ")).count(),
        3,
        "{what}"
    );
    let difference: f32 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("max loss difference: "))
        .unwrap_or_else(|| panic!("{what}: no check line in\n{stdout}"))
        .parse()
        .unwrap();
    let exact = !["bf16", "fp16", "dropout"]
        .iter()
        .any(|f| flags.contains(f));
    // Where the two runs part, if they do: nowhere for an exact layout; with dropout,
    // whose masks differ by layout, at some step.
    let first = stdout
        .lines()
        .find_map(|l| l.strip_prefix("first step differing by more than 1e-4: "))
        .unwrap_or_else(|| panic!("{what}: no first-divergence line in\n{stdout}"));
    if exact {
        assert!(difference < 1e-4, "{what}: loss difference {difference}");
        assert_eq!(first, "none", "{what}");
    }
    if flags.contains("dropout") {
        assert!(
            first.parse::<usize>().is_ok(),
            "{what}: {first}, difference {difference}"
        );
    }
    let tied_across_stages = flags.contains("--pp") && !flags.contains("--untie");
    if tied_across_stages {
        assert!(
            stdout.contains("tied embedding copies: bit-identical"),
            "{what}:\n{stdout}"
        );
    }
}

#[test]
fn every_accepted_layout_trains_checks_samples_plots_saves_and_resumes() {
    for (index, flags) in ACCEPTED.iter().enumerate() {
        let layout: Vec<&str> = flags.split_whitespace().collect();
        let (out, checkpoint) = (
            scratch(&format!("out{index}")),
            scratch(&format!("c{index}")),
        );
        let (out_arg, save_arg) = (out.to_string_lossy(), checkpoint.to_string_lossy());
        let what = format!("{flags} (2 steps, saved)");
        let stdout = succeed(
            &layout,
            &[
                "--steps", "2", "--check", "--out", &out_arg, "--save", &save_arg,
            ],
        );
        assert_complete(&what, &stdout, &out, 2, flags);
        let saved = checkpoint.join("step_0000002/trainer_state.json");
        assert!(saved.is_file(), "{what}");

        let what = format!("{flags} (resumed to 3)");
        let resume = [
            "--steps", "3", "--check", "--out", &out_arg, "--resume", &save_arg,
        ];
        let stdout = succeed(&layout, &resume);
        assert_complete(&what, &stdout, &out, 3, flags);
        let _ = std::fs::remove_dir_all(&out);
        let _ = std::fs::remove_dir_all(&checkpoint);
    }
}

#[test]
fn layouts_that_cannot_run_are_refused_before_the_first_step() {
    for (flags, says) in REFUSED {
        let layout: Vec<&str> = flags.split_whitespace().collect();
        let out = scratch("refused");
        let output = train(&layout, &["--steps", "2", "--out", &out.to_string_lossy()]);
        let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
        assert!(!output.status.success(), "{flags} trained:\n{stdout}");
        assert!(stderr.contains(says), "{flags}: {stderr}");
        assert!(
            !stdout.contains("step ") && !stderr.contains("step "),
            "{flags} started training:\n{stdout}{stderr}"
        );
        assert!(!out.join("loss.csv").exists(), "{flags}");
    }
}
