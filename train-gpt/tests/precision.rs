//! `--precision`: bf16 and fp16 training at TP 2 × DP 2 follows the f32 loss curve, the
//! memory line says what each rank holds, a bf16 run resumes from its checkpoint, and
//! the distributed optimizer trains bf16 parameters as replicated master weights do.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A small GPT trained `steps` steps at TP 2 × DP 2 in `precision`, writing to `out`;
/// returns stdout.
fn train(precision: &str, steps: usize, out: &Path, extra: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(["--precision", precision, "--tp", "2", "--dp", "2"])
        .args([
            "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "32",
        ])
        .args(["--batch", "4", "--seed", "1", "--eval-interval", "0"])
        .args(["--steps", &steps.to_string()])
        .args(extra)
        .arg("--out")
        .arg(out)
        .output()
        .expect("the train-gpt binary runs");
    assert!(
        output.status.success(),
        "{precision}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn out_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("train-gpt-precision-{name}"))
}

/// The losses of `loss.csv` (header, then `step,loss`).
fn losses(out: &Path) -> Vec<f32> {
    let text = std::fs::read_to_string(out.join("loss.csv")).expect("loss.csv");
    text.lines()
        .skip(1)
        .map(|line| line.split(',').nth(1).unwrap().parse().unwrap())
        .collect()
}

/// The total of the `model state per rank` line.
fn bytes_per_parameter(stdout: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("model state per rank: "))
        .expect("a model state line");
    line["model state per rank: ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn sixteen_bit_training_follows_the_f32_curve() {
    let steps = 200;
    let f32_out = out_dir("fp32");
    let stdout = train("fp32", steps, &f32_out, &[]);
    assert_eq!(bytes_per_parameter(&stdout), 16.0);
    let exact = losses(&f32_out);
    assert_eq!(exact.len(), steps);
    for precision in ["bf16", "fp16"] {
        let out = out_dir(precision);
        let stdout = train(precision, steps, &out, &[]);
        // 2 (the parameter) + 4 (its f32 gradient) + 4 (the master) + 8 (AdamW).
        assert_eq!(bytes_per_parameter(&stdout), 18.0, "{stdout}");
        let curve = losses(&out);
        assert_eq!(curve.len(), steps);
        assert!(
            curve.iter().all(|l| l.is_finite()),
            "{precision}: {curve:?}"
        );
        let (last, expected) = (curve[steps - 1], exact[steps - 1]);
        assert!(
            (last - expected).abs() <= 0.03 * expected,
            "{precision}: final loss {last}, f32 {expected}"
        );
        assert!(last < 0.7 * curve[0], "{precision}: the loss falls");
    }
}

#[test]
fn a_bf16_run_resumes_from_its_checkpoint() {
    // Eight steps straight, against four, a checkpoint (f32 master weights in the
    // optimizer state) and four more.
    let straight = losses_after("straight", 8, &[]);
    let saved = out_dir("saved-checkpoint");
    let _ = std::fs::remove_dir_all(&saved);
    let save = saved.to_string_lossy().into_owned();
    losses_after("first-half", 4, &["--save", &save]);
    let resumed = losses_after("second-half", 8, &["--resume", &save]);
    assert_eq!(resumed, straight);
}

fn losses_after(name: &str, steps: usize, extra: &[&str]) -> Vec<f32> {
    let out = out_dir(name);
    train("bf16", steps, &out, extra);
    losses(&out)
}

/// Runs train-gpt with `args`, which it must refuse; returns its stderr.
fn refused(name: &str, args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(args)
        .arg("--out")
        .arg(out_dir(name))
        .output()
        .expect("the train-gpt binary runs");
    assert!(!output.status.success(), "{args:?} ran");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn bf16_under_the_distributed_optimizer_trains_as_with_replicated_master_weights() {
    let steps = 20;
    let (plain, zero) = (out_dir("bf16-plain"), out_dir("bf16-zero"));
    train("bf16", steps, &plain, &[]);
    let stdout = train("bf16", steps, &zero, &["--use-distributed-optimizer"]);
    // Megatron's bound for bf16 parameters with f32 main gradients under the distributed
    // optimizer: 6 + 12/d bytes, and half a byte for the shards' padding (d = 2).
    let bytes = bytes_per_parameter(&stdout);
    assert!(bytes <= 6.0 + 12.0 / 2.0 + 0.5, "{stdout}");
    // The reduce-scatter sums in the same order as the all-reduce, and the shard's
    // update is the replicated one's, element by element: the same losses, bit for bit.
    assert_eq!(losses(&zero), losses(&plain));
}

#[test]
fn pipeline_stages_refuse_16_bit_activations_with_the_reason() {
    let stderr = refused(
        "pipeline",
        &[
            "--precision",
            "fp16",
            "--pp",
            "2",
            "--tp",
            "1",
            "--steps",
            "1",
        ],
    );
    assert!(stderr.contains("--pp 2 sends activations"), "{stderr}");
}
