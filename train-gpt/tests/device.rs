//! The demo on the emulated device (the GPU code path run on the host): it trains what
//! the CPU trains, and reports what a step copies between host and device.

use std::process::Command;

/// Runs the README's device example with `device`; returns stdout.
fn train(device: &str) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args([
            "--device", device, "--tp", "2", "--dp", "2", "--layers", "1",
        ])
        .args([
            "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "4",
        ])
        .args(["--steps", "3", "--eval-interval", "0"])
        .arg("--out")
        .arg(std::env::temp_dir().join(format!("train-gpt-device-{device}")))
        .output()
        .expect("the train-gpt binary runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{device}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn loss_line(stdout: &str) -> &str {
    stdout
        .lines()
        .find(|l| l.starts_with("loss: "))
        .expect("a loss line")
}

#[test]
fn a_device_run_ends_with_its_transfers_per_step() {
    let emulated = train("emulated");
    let last = emulated.lines().last().unwrap_or_default();
    let figures: Vec<u64> = last
        .strip_prefix("device transfers per step and rank: to device ")
        .and_then(|rest| rest.strip_suffix(" bytes"))
        .map(|rest| {
            rest.split(" bytes, to host ")
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(figures.len(), 2, "last line {last:?}");
    // The whole model on a rank is about 26,000 parameters; a step that copied every
    // activation through the host, as tensor-parallel collectives once did, moves far
    // more than the gradients' round trip.
    assert!(figures.iter().all(|&bytes| bytes < 200_000), "{last}");
    // The CPU run trains the same numbers (to the printed digits) and has no such line.
    let cpu = train("cpu");
    assert_eq!(loss_line(&emulated), loss_line(&cpu));
    assert!(!cpu.contains("device transfers"));
}
