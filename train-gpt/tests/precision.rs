//! `--precision`: bf16 and fp16 training at TP 2 × DP 2 follows the f32 loss curve, the
//! memory line says what each rank holds, a bf16 run resumes from its checkpoint, the
//! distributed optimizer trains bf16 parameters as replicated master weights do,
//! pipeline stages pass 16-bit activations on unchanged, and fp16's loss scaling skips
//! an overflowing step and resumes with its scale.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A small GPT trained `steps` steps at TP 2 × DP 2 in `precision`, writing to `out`;
/// returns stdout.
fn train(precision: &str, steps: usize, out: &Path, extra: &[&str]) -> String {
    let steps = steps.to_string();
    let args = [
        &[
            "--precision",
            precision,
            "--tp",
            "2",
            "--dp",
            "2",
            "--layers",
            "2",
        ][..],
        &["--steps", &steps],
        extra,
    ]
    .concat();
    run(&args, out)
}

/// A small GPT (hidden 32, 2 heads, context 32, batch 4, seed 1, no validation) trained
/// with `args`, writing to `out`; returns stdout.
fn run(args: &[&str], out: &Path) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(["--hidden", "32", "--heads", "2", "--seq", "32"])
        .args(["--batch", "4", "--seed", "1", "--eval-interval", "0"])
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .expect("the train-gpt binary runs");
    assert!(
        output.status.success(),
        "{args:?}: {}",
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
    // Untied: with the head tied to the table, when a run leaves the loss plateau (near
    // 3.3 here) moves by tens of steps with rounding, so at a given step any two formats
    // can be 10% apart either way, depending on the corpus; untied they stay within 3%.
    let untied = ["--untie-embeddings-and-output-weights"];
    let steps = 200;
    let f32_out = out_dir("fp32");
    let stdout = train("fp32", steps, &f32_out, &untied);
    assert_eq!(bytes_per_parameter(&stdout), 16.0);
    let exact = losses(&f32_out);
    assert_eq!(exact.len(), steps);
    for precision in ["bf16", "fp16"] {
        let out = out_dir(precision);
        let stdout = train(precision, steps, &out, &untied);
        // 2 (the parameter) + 4 (its f32 gradient) + 4 (the master) + 8 (AdamW).
        assert_eq!(bytes_per_parameter(&stdout), 18.0, "{stdout}");
        let curve = losses(&out);
        assert_eq!(curve.len(), steps);
        assert!(
            curve.iter().all(|l| l.is_finite()),
            "{precision}: {curve:?}"
        );
        // The mean of the last 50 steps: a single step's loss is one small batch's.
        let tail = |curve: &[f32]| curve[steps - 50..].iter().sum::<f32>() / 50.0;
        let (last, expected) = (tail(&curve), tail(&exact));
        assert!(
            (last - expected).abs() <= 0.03 * expected,
            "{precision}: loss over the last 50 steps {last}, f32 {expected}"
        );
        assert!(last < 0.7 * curve[0], "{precision}: the loss falls");
    }
}

#[test]
fn a_bf16_run_resumes_from_its_checkpoint() {
    // Eight steps straight, against four, a checkpoint (f32 master weights in the
    // optimizer state) and four more.
    assert_eq!(
        resumed_losses("bf16", 4, 8, &[]),
        losses_after("bf16", "straight", 8, &[])
    );
}

/// The losses of a run of `precision` saved after `saved` steps and resumed up to
/// `steps`, with `extra` flags.
fn resumed_losses(precision: &str, saved: usize, steps: usize, extra: &[&str]) -> Vec<f32> {
    let dir = out_dir(&format!("{precision}-checkpoint"));
    let _ = std::fs::remove_dir_all(&dir);
    let dir = dir.to_string_lossy().into_owned();
    losses_after(
        precision,
        "first-half",
        saved,
        &[extra, &["--save", &dir]].concat(),
    );
    losses_after(
        precision,
        "second-half",
        steps,
        &[extra, &["--resume", &dir]].concat(),
    )
}

/// The losses of a run of `precision` (its stdout kept as `stdout.txt` in its out dir).
fn losses_after(precision: &str, name: &str, steps: usize, extra: &[&str]) -> Vec<f32> {
    let out = out_dir(&format!("{precision}-{name}"));
    let stdout = train(precision, steps, &out, extra);
    std::fs::write(out.join("stdout.txt"), stdout).expect("a writable out dir");
    losses(&out)
}

#[test]
fn fp16_survives_a_forced_overflow_by_skipping_the_step_and_halving_the_scale() {
    let steps = 30;
    let (plain, forced) = (out_dir("fp16-plain"), out_dir("fp16-overflow"));
    train("fp16", steps, &plain, &[]);
    let stdout = train("fp16", steps, &forced, &["--inject-grad-overflow", "5"]);
    let skipped: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("gradients overflowed"))
        .collect();
    assert_eq!(
        skipped,
        [
            "step 5: gradients overflowed at loss scale 65536; step skipped on every rank, \
          loss scale now 32768"
        ],
        "{stdout}"
    );
    // The same run up to the skipped step, which leaves the parameters as they were: the
    // next loss is step 5's again (on the next step's data), and training goes on.
    let (plain, forced) = (losses(&plain), losses(&forced));
    assert_eq!(forced[..5], plain[..5]);
    assert_ne!(forced[5], plain[5]);
    assert!(forced.iter().all(|l| l.is_finite()), "{forced:?}");
    let (last, expected) = (forced[steps - 1], plain[steps - 1]);
    assert!(
        (last - expected).abs() <= 0.03 * expected,
        "{last} against {expected}"
    );
}

#[test]
fn an_fp16_run_resumes_with_its_loss_scale() {
    // The scale doubles every 2 finite steps: 2^20 at step 8, when the injected overflow
    // of step 9 halves it. Resumed after step 7, the run must start from the saved scale
    // (2^19, one finite step towards the next doubling) to print the same.
    let flags = ["--loss-scale-window", "2", "--inject-grad-overflow", "9"];
    let straight = losses_after("fp16", "straight", 10, &flags);
    assert_eq!(resumed_losses("fp16", 7, 10, &flags), straight);
    let resumed = out_dir("fp16-second-half").join("stdout.txt");
    let stdout = std::fs::read_to_string(resumed).expect("the resumed run's stdout");
    assert!(
        stdout.contains("step 9: gradients overflowed at loss scale 1048576;"),
        "{stdout}"
    );
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
fn pipeline_stages_pass_16_bit_activations_as_they_are() {
    // Interleaved PP 2 × TP 2 with sequence parallelism against one stage: activations
    // cross stages in their 16-bit format as stored, so the losses agree bit for bit.
    for precision in ["bf16", "fp16"] {
        let common = [
            "--precision",
            precision,
            "--tp",
            "2",
            "--sequence-parallel",
            "--layers",
            "4",
            "--microbatches",
            "2",
            "--steps",
            "4",
        ];
        let (one, two) = (out_dir("one-stage"), out_dir("two-stages"));
        run(&common, &one);
        let interleaved = [
            "--pp",
            "2",
            "--schedule",
            "interleaved",
            "--virtual-stages",
            "2",
        ];
        run(&[&common[..], &interleaved].concat(), &two);
        assert_eq!(losses(&two), losses(&one), "{precision}");
    }
}

#[test]
fn loss_scaling_flags_need_fp16_and_a_usable_scale() {
    let stderr = refused(
        "scale-bf16",
        &["--precision", "bf16", "--initial-loss-scale", "1024"],
    );
    assert!(stderr.contains("pass --precision fp16"), "{stderr}");
    let stderr = refused(
        "scale-zero",
        &["--precision", "fp16", "--initial-loss-scale", "0"],
    );
    assert!(stderr.contains("init_scale must be a positive"), "{stderr}");
    let stderr = refused(
        "inject-zero",
        &["--precision", "fp16", "--inject-grad-overflow", "0"],
    );
    assert!(stderr.contains("counts steps from 1"), "{stderr}");
}
