//! The demo trains as Megatron trains: embeddings tied to the output layer by default,
//! across pipeline stages as two copies that stay bit-identical and count once in the
//! gradient norm; the first update at the warm-up's initial rate; dropout drawn from
//! streams that resume exactly; each step's log line says, as Megatron's does, the time
//! per step, tokens/s and model TFLOP/s over the steps since the last line.

mod common;

use common::{figure, scratch, words};
use std::path::Path;
use std::process::Command;

/// One block on one rank: the smallest model, for runs that are about conventions.
const SMALL: &str = "--layers 1 --hidden 16 --heads 2 --seq 16 --tp 1 --dp 1";

/// Runs the demo with `args` (writing to `out`); returns success, stdout and stderr.
fn run(args: &[&str], out: &Path) -> (bool, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .expect("the train-gpt binary runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn succeed(args: &[&str], out: &Path) -> String {
    let (ok, stdout, stderr) = run(args, out);
    assert!(ok, "train-gpt {args:?} failed:\n{stdout}{stderr}");
    stdout
}

/// The check line outside checks use: TP 2 × PP 2 × DP 2 with ZeRO and clipping, tied
/// embeddings, against the one-rank tied model: losses and gradient norms (which would
/// be √2-ish off if the copy counted twice) within 1e-5, and the copies bit-identical
/// after every step.
#[test]
fn tied_embeddings_across_stages_train_what_one_rank_trains() {
    let out = scratch("tied");
    let flags = "--pp 2 --tp 2 --dp 2 --layers 4 --microbatches 4 --use-distributed-optimizer \
                 --clip-grad 0.05 --steps 8 --eval-interval 0 --check";
    let stdout = succeed(&words(flags), &out);
    assert!(
        stdout.contains(
            "tied embedding copies: bit-identical on the first and last stage after each of \
             8 steps"
        ),
        "{stdout}"
    );
    let loss = figure(&stdout, "max loss difference: ");
    assert!(loss <= 1e-5, "loss difference {loss}");
    let norm = figure(&stdout, "max relative gradient-norm difference: ");
    assert!(norm <= 1e-5, "gradient-norm difference {norm}");
}

/// bf16 parameters under the distributed optimizer, with fp32 master shards cut
/// differently on the two stages: the copies still take identical updates.
#[test]
fn tied_copies_stay_identical_in_bf16_under_the_distributed_optimizer() {
    let out = scratch("tied-bf16");
    let flags = "--pp 2 --tp 2 --dp 2 --layers 2 --hidden 32 --heads 2 --seq 16 \
                 --microbatches 2 --use-distributed-optimizer --precision bf16 --clip-grad 0.5 \
                 --steps 6 --eval-interval 0 --check";
    let stdout = succeed(&words(flags), &out);
    assert!(
        stdout.contains("bit-identical on the first and last stage after each of 6 steps"),
        "{stdout}"
    );
    // bf16 against the f32 one-rank run: the format's rounding, not a different model.
    let loss = figure(&stdout, "max loss difference: ");
    assert!(loss <= 0.05, "loss difference {loss}");
}

/// The names a safetensors file holds (its JSON header's keys).
fn tensor_names(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let mut names: Vec<String> = header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    names.sort();
    names
}

/// Tied, one tensor serves both ends (no head weight is saved); untied, the head has its
/// own weight and, as Megatron's, no bias. A checkpoint of one kind does not resume as the other.
#[test]
fn tied_and_untied_models_save_what_they_hold_and_do_not_mix() {
    let small = [&words(SMALL)[..], &["--eval-interval", "0"]].concat();
    let out = scratch("tie-out");
    let (tied, untied) = (scratch("tied-ckpt"), scratch("untied-ckpt"));
    let tied_arg = tied.to_string_lossy().into_owned();
    let untied_arg = untied.to_string_lossy().into_owned();
    succeed(
        &[&small[..], &["--steps", "1", "--save", &tied_arg]].concat(),
        &out,
    );
    let untie = "--untie-embeddings-and-output-weights";
    succeed(
        &[&small[..], &["--steps", "1", "--save", &untied_arg, untie]].concat(),
        &out,
    );
    // One step saved: the checkpoint is the save directory's step_0000001.
    let names = |dir: &Path| tensor_names(&dir.join("step_0000001/tp_0_of_1.safetensors"));
    let (tied_names, untied_names) = (names(&tied), names(&untied));
    assert!(tied_names.contains(&"embed.weight".to_string()));
    assert!(
        !tied_names.iter().any(|n| n.starts_with("head.")),
        "{tied_names:?}"
    );
    // Megatron's output layer has no bias.
    assert!(
        !untied_names.contains(&"head.bias".to_string()),
        "{untied_names:?}"
    );
    for name in ["embed.weight", "head.weight"] {
        assert!(untied_names.contains(&name.to_string()), "{untied_names:?}");
    }

    let (ok, _, stderr) = run(
        &[&small[..], &["--steps", "2", "--resume", &tied_arg, untie]].concat(),
        &out,
    );
    assert!(
        !ok && stderr.contains("drop --untie-embeddings-and-output-weights"),
        "{stderr}"
    );
    let (ok, _, stderr) = run(
        &[&small[..], &["--steps", "2", "--resume", &untied_arg]].concat(),
        &out,
    );
    assert!(
        !ok && stderr.contains("pass --untie-embeddings-and-output-weights"),
        "{stderr}"
    );
}

/// The validation loss after the first update: with the warm-up starting at 0 (the
/// default, as Megatron's --lr-warmup-init) the first update leaves the weights as they
/// were, so it equals that of a run whose rate is negligible; starting the warm-up at
/// the peak rate moves them.
#[test]
fn the_first_update_runs_at_the_warmup_initial_rate() {
    let validation = |extra: &[&str]| -> f64 {
        let out = scratch("first-update");
        let args = [
            &words(SMALL)[..],
            &["--steps", "1", "--eval-interval", "1"],
            extra,
        ]
        .concat();
        succeed(&args, &out);
        // `step,loss` after the header: the loss as written, every digit of the f32.
        let csv = std::fs::read_to_string(out.join("validation.csv")).unwrap();
        let row = csv.lines().nth(1).expect("a validation row");
        row.split(',').nth(1).unwrap().parse().unwrap()
    };
    let from_zero = validation(&[]);
    // At 1e-30 every f32 weight rounds back to itself, decay included.
    assert_eq!(from_zero, validation(&["--lr", "1e-30"]));
    assert_ne!(from_zero, validation(&["--lr-warmup-init", "2e-3"]));
}

/// Dropout on, two chunks per stage: each chunk's streams are saved and restored, so
/// four steps in one go equal two, a checkpoint, and two more, bit for bit; and the
/// masks matter (the curve differs from the run without dropout).
#[test]
fn dropout_resumes_bit_identically_with_a_stream_per_chunk() {
    let layout = words(
        "--pp 2 --tp 2 --dp 1 --layers 4 --hidden 16 --heads 2 --seq 16 --schedule interleaved \
         --virtual-stages 2 --microbatches 2 --eval-interval 2",
    );
    let dropout = ["--hidden-dropout", "0.2", "--attention-dropout", "0.2"];
    let losses = |out: &Path| std::fs::read_to_string(out.join("loss.csv")).unwrap();
    let (straight, resumed, plain) = (scratch("do-a"), scratch("do-b"), scratch("do-c"));
    let checkpoint = scratch("do-ckpt");
    let save = checkpoint.to_string_lossy().into_owned();
    succeed(
        &[&layout[..], &dropout, &["--steps", "4"]].concat(),
        &straight,
    );
    succeed(
        &[&layout[..], &dropout, &["--steps", "2", "--save", &save]].concat(),
        &resumed,
    );
    succeed(
        &[&layout[..], &dropout, &["--steps", "4", "--resume", &save]].concat(),
        &resumed,
    );
    assert_eq!(losses(&straight), losses(&resumed));
    succeed(&[&layout[..], &["--steps", "4"]].concat(), &plain);
    assert_ne!(losses(&straight), losses(&plain));
}

/// A tied run saved at TP 2 over two stages and resumed at TP 1: both stages re-cut their
/// copies from shards that were equal, and the copies stay bit-identical.
#[test]
fn tied_copies_stay_identical_after_resuming_at_another_tp() {
    let layout = "--pp 2 --dp 1 --layers 2 --hidden 16 --heads 2 --seq 16 --microbatches 2 \
                  --eval-interval 0";
    let (out, checkpoint) = (scratch("tied-tp-out"), scratch("tied-tp-ckpt"));
    let save = checkpoint.to_string_lossy().into_owned();
    let first = [
        &words(layout)[..],
        &["--tp", "2", "--steps", "3", "--save", &save],
    ]
    .concat();
    succeed(&first, &out);
    let resumed = [
        &words(layout)[..],
        &["--tp", "1", "--steps", "5", "--check"],
    ]
    .concat();
    let stdout = succeed(&[&resumed[..], &["--resume", &save]].concat(), &out);
    assert!(
        stdout.contains("bit-identical on the first and last stage after each of 2 steps"),
        "{stdout}"
    );
}

/// `--batch 2 --seq 16` on one rank: 32 tokens a step; the figure after `label` in each
/// step's line.
#[test]
fn each_step_line_has_megatrons_interval_figures() {
    let out = scratch("conventions-step-line");
    let stdout = succeed(
        &[&words(SMALL)[..], &["--batch", "2", "--steps", "3"]].concat(),
        &out,
    );
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("train step"))
        .collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    let value = |line: &str, label: &str| -> f64 {
        let field = (line.split(" | ")).find(|f| f.starts_with(label));
        let field = field.unwrap_or_else(|| panic!("no {label:?} in {line}"));
        field[label.len()..].trim().parse().unwrap()
    };
    for line in lines {
        let ms = value(line, "elapsed time per step (ms)");
        let tokens = value(line, "tokens/s");
        let tflops = value(line, "TFLOP/s per GPU");
        assert!(ms > 0.0 && tflops >= 0.0, "{line}");
        // Printed to 0.1 ms and whole tokens: the step time the token rate implies rounds
        // to the printed one (half a unit either way, and a little for the rounded rate).
        let implied_ms = 32.0 / (tokens - 0.5).max(1.0) * 1e3;
        assert!(
            (implied_ms - ms).abs() <= 0.05 + implied_ms * 1e-3,
            "{line}: {tokens} tokens/s is a step of {implied_ms:.3} ms"
        );
    }
}
