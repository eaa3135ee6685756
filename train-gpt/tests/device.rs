//! The demo on the emulated device (the GPU code path run on the host): it trains what
//! the CPU trains, and a TP 2 × DP 2 step copies nothing between host and device but its
//! batch and its loss, with the replicated or the distributed optimizer.

mod common;

use common::succeeded;
use std::process::Command;

/// Runs the README's device example with `device` and `extra` flags; returns stdout.
fn train(device: &str, extra: &[&str]) -> String {
    // One layer unless `extra` says otherwise (a pipeline needs one per stage).
    let layers: &[&str] = if extra.contains(&"--layers") {
        &[]
    } else {
        &["--layers", "1"]
    };
    let output = Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(["--device", device, "--tp", "2", "--dp", "2"])
        .args(layers)
        .args(extra)
        .args([
            "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "4",
        ])
        .args(["--steps", "3", "--eval-interval", "0"])
        .arg("--out")
        .arg(out_dir(device, extra))
        .output()
        .expect("the train-gpt binary runs");
    succeeded(&output)
}

fn out_dir(device: &str, extra: &[&str]) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("train-gpt-device-{device}{}", extra.join("")))
}

/// The per-step losses of the last [`train`] run with these arguments (`loss.csv`).
fn losses(device: &str, extra: &[&str]) -> Vec<f64> {
    let csv = std::fs::read_to_string(out_dir(device, extra).join("loss.csv"))
        .expect("the run wrote loss.csv");
    csv.lines()
        .skip(1)
        .map(|row| {
            row.split(',')
                .nth(1)
                .and_then(|l| l.parse().ok())
                .expect("a loss")
        })
        .collect()
}

/// The emulated device's reference GEMM adds in another order than the CPU's, so the two
/// curves agree to float32 rounding, not bit for bit (nor always to four printed digits,
/// when a loss falls on a rounding boundary).
fn assert_same_curve(emulated: &[f64], cpu: &[f64]) {
    assert_eq!(emulated.len(), cpu.len());
    for (step, (e, c)) in emulated.iter().zip(cpu).enumerate() {
        assert!(
            (e - c).abs() <= 1e-5 * c.abs(),
            "step {}: {e} against {c}",
            step + 1
        );
    }
}

/// The host waits per step and rank a run prints.
fn host_waits(stdout: &str) -> f64 {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("host waits per step and rank: "))
        .and_then(|n| n.parse().ok())
        .expect("a host-waits line")
}

/// The transfer line's bytes per step and rank: (to the device, to the host).
fn transfers(stdout: &str) -> (u64, u64) {
    let prefix = "device transfers per step and rank: to device ";
    let last = stdout
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_default();
    let figures: Vec<u64> = last
        .strip_prefix(prefix)
        .and_then(|rest| rest.strip_suffix(" bytes"))
        .map(|rest| {
            rest.split(" bytes, to host ")
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(figures.len(), 2, "transfer line {last:?}");
    (figures[0], figures[1])
}

#[test]
fn a_device_run_ends_with_its_transfers_per_step() {
    // Without clipping (the default clips, and reads the norm back).
    let unclipped = ["--clip-grad", "0"];
    let emulated = train("emulated", &unclipped);
    // A step moves its batch to the device (64 tokens per rank: ids, labels and the masks
    // made from them, 27 bytes a token) and its loss back (one f32); gradients
    // stay in the device buckets and the loss arithmetic on the logits' device. The
    // gradients' round trip alone (about 15,000 f32 per rank) would exceed both bounds.
    // The sequence-parallel layer norms' extra sum over TP runs on the device too.
    let sequence_parallel = [&unclipped[..], &["--sequence-parallel"]].concat();
    for run in [&emulated, &train("emulated", &sequence_parallel)] {
        let (to_device, to_host) = transfers(run);
        assert!(to_device <= 64 * 32, "{to_device} bytes to the device");
        assert!(to_host <= 4, "{to_host} bytes to the host");
    }
    // So does the distributed optimizer's step (reduce-scatter, unscale, clip, update,
    // all-gather), which brings back only the overflow check's and the norm's scalars.
    let zero = [
        "--use-distributed-optimizer",
        "--precision",
        "fp16",
        "--clip-grad",
        "1.0",
    ];
    let sharded = train("emulated", &zero);
    let (to_device, to_host) = transfers(&sharded);
    assert!(to_device <= 64 * 32, "{to_device} bytes to the device");
    assert!(to_host <= 4 + 2 * 4, "{to_host} bytes to the host");
    // Every run says how often its ranks waited for the device in a step. Uploads are
    // staged and do not wait, so a plain step waits once (the loss, read when the step
    // ends); the sharded step also reads the overflow check and the norm.
    let plain = host_waits(&emulated);
    assert!(plain <= 1.0, "{plain} host waits in a plain step");
    assert!(host_waits(&sharded) <= 3.0, "{sharded}");
    // The default step clips, as Megatron's does, and reads the norm with the loss.
    let clipped = train("emulated", &[]);
    assert!(host_waits(&clipped) <= 2.0, "{clipped}");
    assert!(transfers(&clipped).1 <= 4 + 8, "{clipped}");
    for run in [&emulated, &sharded] {
        assert!(host_waits(run) >= 1.0, "{run}");
        // Right after the transfer line, where scripts look for it.
        let lines: Vec<&str> = run.lines().collect();
        let at = lines.iter().position(|l| l.starts_with("device transfers"));
        assert!(
            at.is_some_and(|i| lines[i + 1].starts_with("host waits")),
            "{run}"
        );
    }
    // With pipeline stages, activations and their gradients stay on the device: the
    // busiest rank (the last stage) brings back only its scalars (the microbatches'
    // losses, in one read when the step ends, and the norm), where the activations alone
    // were 4,096 bytes a step. That is the asynchronous step's target: two host waits.
    let pipelined = train(
        "emulated",
        &[
            "--layers",
            "2",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--use-distributed-optimizer",
            "--precision",
            "bf16",
            "--clip-grad",
            "1.0",
        ],
    );
    let (to_device, to_host) = transfers(&pipelined);
    assert!(to_device <= 64 * 32, "{to_device} bytes to the device");
    assert!(to_host <= 32, "{to_host} bytes to the host");
    assert!(host_waits(&pipelined) <= 2.0, "{pipelined}");
    // The CPU run trains the same numbers (to float32 rounding) and has no such line.
    let cpu = train("cpu", &[]);
    assert_same_curve(&losses("emulated", &[]), &losses("cpu", &[]));
    assert!(!cpu.contains("device transfers"));
    assert!(!cpu.contains("host waits"));
    train("cpu", &zero);
    assert_same_curve(&losses("emulated", &zero), &losses("cpu", &zero));
}

#[test]
fn a_profile_counts_every_kernel_of_the_steps_after_the_first() {
    let stdout = train("emulated", &["--profile"]);
    assert!(
        stdout.contains("kernels per step (world rank 0, mean of 2 steps after the first)"),
        "{stdout}"
    );
    // Each line: name, launches, total ms, mean µs, read MB, written MB, GB/s, TFLOP/s.
    let line = |name: &str| -> Vec<String> {
        let row = (stdout.lines())
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} line in {stdout}"));
        row.split_whitespace().map(String::from).collect()
    };
    for kernel in [
        "gemm_f32",
        "attention_forward_f32",
        "layer_norm_rows_f32",
        "adamw_list_f32",
    ] {
        let row = line(kernel);
        assert!(row[1].parse::<f64>().unwrap() >= 1.0, "{row:?}");
        // No time on the emulated device, so no rates either.
        assert_eq!(&row[2..4], ["-", "-"], "{row:?}");
        assert!(row[4].parse::<f64>().unwrap() > 0.0, "{row:?}");
    }
    let total = line("total");
    let kernels: Vec<Vec<String>> = (stdout.lines())
        .skip_while(|l| !l.contains("kernels per step"))
        .skip(2)
        .take_while(|l| !l.trim_start().starts_with("total"))
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect();
    let launches: f64 = kernels.iter().map(|k| k[1].parse::<f64>().unwrap()).sum();
    assert!((launches - total[1].parse::<f64>().unwrap()).abs() <= kernels.len() as f64);
    assert!(
        stdout.contains("kernel time: not measured on this device"),
        "{stdout}"
    );
}

/// On the emulated device a run says how much of its communication-stream time its
/// compute streams overlap, in all and for each group's traffic, on a modelled timeline
/// (each call timed by what it moves, not by the host's clock), so the figure is the same
/// on every run and machine. Buckets reduced as soon as backward completes them hide
/// more of the data-parallel traffic than buckets reduced after it, and parameters
/// gathered beside the next forward more again; of the
/// tensor-parallel all-reduces, those of the input gradients run beside the weight
/// gradients' GEMMs (forward's, which the next kernel needs at once, hide nothing).
#[test]
fn the_modelled_timeline_says_how_much_communication_compute_hides() {
    let hidden = |extra: &[&str]| -> String {
        let flags = [
            &["--layers", "2", "--use-distributed-optimizer"],
            &["--ddp-bucket-size", "2000"][..],
            extra,
        ]
        .concat();
        let stdout = train("emulated", &flags);
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix("communication hidden behind compute: "))
            .unwrap_or_else(|| panic!("no overlap figure in\n{stdout}"));
        line.to_string()
    };
    // "P% (by group: tp P%, dp P%)": a group's share.
    let share = |line: &str, group: &str| -> f64 {
        let (_, groups) = line.split_once("(by group: ").expect("shares by group");
        let found = (groups.trim_end_matches(')').split(", "))
            .find_map(|g| g.strip_prefix(group)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {group} share in {line}"));
        found.trim_end_matches('%').parse().expect("a percentage")
    };
    let trace = std::env::temp_dir().join(format!("train-gpt-streams-{}.json", std::process::id()));
    let overlapped = hidden(&["--trace", trace.to_str().unwrap()]);
    assert_eq!(
        hidden(&[]),
        overlapped,
        "the modelled figure is deterministic"
    );
    assert_stream_tracks(&std::fs::read_to_string(&trace).expect("the trace was written"));
    let after_backward = hidden(&["--no-overlap-grad-reduce"]);
    let (dp, dp_after) = (share(&overlapped, "dp"), share(&after_backward, "dp"));
    assert!(
        dp >= 70.0 && dp > dp_after,
        "data-parallel traffic {dp}% hidden with overlap, {dp_after}% without"
    );
    // The parameters' gathers beside the next forward hide more of it again (the last
    // step's gathers have no next forward in the run: three steps, two recorded).
    let beside = share(&hidden(&["--overlap-param-gather"]), "dp");
    assert!(
        beside > dp,
        "{beside}% with the gathers beside the forward, {dp}% without"
    );
    let tp = share(&overlapped, "tp");
    assert!(tp > 0.0 && tp < 50.0, "{overlapped}");
    assert!(!train("cpu", &[]).contains("communication hidden"));
}

/// `--trace`'s device streams: a track (thread) per stream of each rank, compute and
/// each group's communication among them, whose calls follow one another without overlapping.
fn assert_stream_tracks(trace: &str) {
    let trace: serde_json::Value = serde_json::from_str(trace).expect("JSON");
    let events = trace["traceEvents"].as_array().expect("events");
    let names: Vec<&str> = (events.iter())
        .filter(|e| e["name"] == "thread_name" && e["pid"].as_u64() > Some(0))
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    for role in ["compute stream", "communication stream"] {
        assert!(
            names.iter().any(|n| n.starts_with(role)),
            "no {role} in {names:?}"
        );
    }
    // Each group's communication stream is named for it.
    for group in ["(tp)", "(dp)"] {
        assert!(
            names.iter().any(|n| n.ends_with(group)),
            "no {group} track in {names:?}"
        );
    }
    let mut tracks: std::collections::BTreeMap<(u64, u64), Vec<(f64, f64)>> = Default::default();
    for call in events.iter().filter(|e| e["cat"] == "device") {
        let at = |k: &str| call[k].as_f64().expect("a number");
        let key = (call["pid"].as_u64().unwrap(), call["tid"].as_u64().unwrap());
        tracks
            .entry(key)
            .or_default()
            .push((at("ts"), at("ts") + at("dur")));
    }
    assert!(tracks.len() >= 2, "{tracks:?}");
    for (track, mut calls) in tracks {
        calls.sort_by(|a, b| a.0.total_cmp(&b.0));
        for pair in calls.windows(2) {
            assert!(
                pair[0].1 <= pair[1].0 + 1e-6,
                "track {track:?}: {pair:?} overlap"
            );
        }
    }
}

/// A device run opens a group's device communicator when the group first moves device
/// memory (NCCL's on a GPU; on the emulated device a split that stands for it), so of
/// the sixteen groups of a TP 2 × PP 2 × DP 2 layout the first stage opens only those
/// its tensors travel over, and none of one rank; a CPU run opens none.
#[test]
fn a_run_opens_only_the_device_communicators_it_uses() {
    let opened = |device: &str| -> Option<Vec<String>> {
        let stdout = train(
            device,
            &["--pp", "2", "--layers", "2", "--microbatches", "2"],
        );
        let line = (stdout.lines())
            .find_map(|l| l.strip_prefix("device communicators opened by rank 0: "))?;
        let (count, names) = line.split_once(" (").expect("a count and names");
        let mut names: Vec<String> = (names.trim_end_matches(')').split(", "))
            .map(String::from)
            .collect();
        assert_eq!(count.parse::<usize>().ok(), Some(names.len()), "{line}");
        names.sort();
        Some(names)
    };
    assert_eq!(
        opened("emulated").expect("the emulated run says what it opened"),
        ["dp", "embedding", "pp", "tp"]
    );
    assert_eq!(opened("cpu"), None);
}
