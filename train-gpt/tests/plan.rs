//! `--plan` predicts the peak memory per rank that a training run with the same flags then
//! measures, within 10% (5% on the emulated device), over a grid that spans tensor, sequence, pipeline and data
//! parallelism, the three schedules, the distributed optimizer, the three precisions,
//! recomputation, dropout and untied embeddings, on the CPU and on the emulated device.

mod common;

use common::{bytes_after, demo_stdout, memory_run};

/// Layouts and options, each with `--plan` and then trained.
const GRID: [&str; 24] = [
    "--tp 1 --dp 1",
    "--tp 2 --dp 1",
    "--tp 2 --dp 2",
    "--tp 1 --dp 2 --use-distributed-optimizer",
    "--tp 2 --dp 2 --use-distributed-optimizer --precision bf16",
    "--tp 1 --dp 1 --precision bf16",
    "--tp 1 --dp 1 --precision fp16",
    "--tp 2 --dp 1 --sequence-parallel",
    "--tp 2 --dp 1 --sequence-parallel --precision bf16",
    "--tp 1 --dp 1 --recompute-granularity full --recompute-method uniform",
    "--tp 1 --dp 1 --recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    "--tp 1 --dp 1 --recompute-granularity full --recompute-method block --recompute-num-layers 2",
    "--tp 1 --dp 1 --recompute-granularity selective",
    "--tp 2 --dp 1 --sequence-parallel --recompute-granularity selective",
    "--tp 1 --dp 1 --pp 2 --microbatches 8 --schedule gpipe",
    "--tp 1 --dp 1 --pp 2 --microbatches 8 --schedule 1f1b",
    "--tp 1 --dp 1 --pp 4 --microbatches 8 --schedule 1f1b",
    "--tp 1 --dp 1 --pp 2 --microbatches 4 --schedule interleaved --virtual-stages 2",
    "--tp 2 --dp 1 --pp 2 --microbatches 4",
    "--tp 1 --dp 2 --pp 2 --microbatches 4 --use-distributed-optimizer --precision bf16",
    "--tp 1 --dp 1 --hidden-dropout 0.1 --attention-dropout 0.1",
    "--tp 1 --dp 1 --untie-embeddings-and-output-weights",
    "--tp 1 --dp 1 --microbatches 4",
    "--tp 2 --dp 2 --pp 2 --microbatches 4 --sequence-parallel --recompute-granularity full \
     --recompute-method uniform",
];

/// Predicted and measured peaks of each layout on `device`, and those further apart than
/// allowed.
fn compare(device: &str, layouts: &[&str]) {
    let mut report = Vec::new();
    let mut misses = 0;
    // On the emulated device what follows the streams' timing is the device layer's
    // bookkeeping (queues of work, the checker's records, the pinned staging pool), which
    // no rank's count includes, as a GPU's driver holds it: the device's rows measure
    // within 0.6% of one another run after run (2026-11-29) and get 5%.
    let allowed = if device == "emulated" { 0.05 } else { 0.10 };
    for layout in layouts {
        let flags = format!("{layout} --device {device}");
        let predicted = bytes_after(
            &memory_run(&format!("{flags} --plan")),
            "predicted peak per rank: ",
        );
        let measured = bytes_after(&memory_run(&flags), "measured peak per rank: ");
        let ratio = predicted as f64 / measured as f64;
        let miss = (ratio - 1.0).abs() > allowed;
        misses += usize::from(miss);
        report.push(format!(
            "{} {predicted:>10} predicted {measured:>10} measured ({ratio:.3}) {flags}",
            if miss { "MISS" } else { "    " }
        ));
    }
    println!("{}", report.join("\n"));
    assert_eq!(
        misses,
        0,
        "{misses} predictions off by more than allowed:\n{}",
        report.join("\n")
    );
}

#[test]
fn the_plan_predicts_the_measured_peak_on_the_cpu() {
    compare("cpu", &GRID);
}

#[test]
fn the_plan_predicts_the_measured_peak_on_the_emulated_device() {
    // Every fourth layout (among them the distributed optimizer in bf16, sequence
    // parallelism, selective recomputation, a 4-stage pipeline and dropout): the emulated
    // device's reference products are slow. All 24 are within 5% (the book's table).
    let layouts: Vec<&str> = GRID.iter().step_by(4).copied().collect();
    compare("emulated", &layouts);
}

/// A model `--fit` places on four ranks, trained in bf16 for two steps.
const FIT: &str = "--layers 4 --hidden 64 --heads 4 --seq 64 --steps 2 --eval-interval 0 \
                   --precision bf16";

/// The training flags of one row of `--fit`'s table (`tp pp dp schedule dist-opt
/// recompute peak sent bubble`), and the peak it prints.
fn row_flags(row: &str) -> (String, String) {
    let c: Vec<&str> = row.split_whitespace().collect();
    let (tp, pp, dp): (usize, usize, usize) = (
        c[0].parse().unwrap(),
        c[1].parse().unwrap(),
        c[2].parse().unwrap(),
    );
    let batch = 16 / dp;
    let mut flags = format!(
        "--tp {tp} --pp {pp} --dp {dp} --batch {batch} --microbatches {}",
        batch / 2
    );
    match c[3] {
        "-" | "1f1b" => {}
        interleaved => {
            let v = interleaved.trim_start_matches("interleaved×");
            flags += &format!(" --schedule interleaved --virtual-stages {v}");
        }
    }
    if c[4] == "yes" {
        flags += " --use-distributed-optimizer";
    }
    if tp > 1 {
        flags += " --sequence-parallel";
    }
    flags += match c[5] {
        "none" => "",
        "selective" => " --recompute-granularity selective",
        _ => " --recompute-granularity full --recompute-method uniform",
    };
    (flags, format!("{} {}", c[6], c[7]))
}

#[test]
fn fit_lists_layouts_that_plan_and_train_within_the_budget() {
    let budget = 3 << 20;
    let listed = demo_stdout(&format!(
        "{FIT} --plan --fit 3MiB --world 4 --global-batch-size 16 --micro-batch-size 2"
    ));
    println!("{listed}");
    let rows: Vec<&str> = listed
        .lines()
        .skip(2)
        .filter(|l| !l.contains("more"))
        .collect();
    let all = demo_stdout(&format!(
        "{FIT} --plan --fit 1GiB --world 4 --global-batch-size 16 --micro-batch-size 2"
    ));
    assert!(
        !rows.is_empty() && rows.len() < all.lines().count() - 2,
        "{listed}{all}"
    );
    for row in [rows[0], rows[rows.len() - 1]] {
        let (flags, peak) = row_flags(row);
        let predicted = bytes_after(
            &demo_stdout(&format!("{FIT} {flags} --plan")),
            "predicted peak per rank: ",
        );
        assert_eq!(planner_bytes(predicted), peak, "{flags}");
        assert!(predicted <= budget);
        let measured = bytes_after(
            &demo_stdout(&format!("{FIT} {flags}")),
            "measured peak per rank: ",
        );
        // The plan's tolerance.
        assert!(
            measured as f64 <= 1.10 * budget as f64,
            "{flags}: {measured}"
        );
    }
}

/// A byte count as `--fit` prints it.
fn planner_bytes(bytes: usize) -> String {
    format!("{:.2} MiB", bytes as f64 / (1 << 20) as f64)
}

/// The number after `label ` in `line`.
fn figure(line: &str, label: &str) -> usize {
    let at = line
        .find(&format!("{label} "))
        .unwrap_or_else(|| panic!("{label}: {line}"));
    let digits: String = line[at + label.len() + 1..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap()
}

#[test]
fn the_measured_peak_splits_by_phase_and_the_passes_hold_what_the_plan_says() {
    let layouts = [
        "--tp 1 --dp 1",
        "--tp 1 --dp 1 --recompute-granularity full --recompute-method uniform",
        "--tp 1 --dp 1 --recompute-granularity selective",
        "--tp 2 --dp 2",
        "--tp 2 --dp 1 --sequence-parallel --precision bf16",
        "--tp 1 --dp 1 --pp 2 --microbatches 8",
        "--tp 1 --dp 1 --hidden-dropout 0.1 --attention-dropout 0.1",
    ];
    let mut report = Vec::new();
    for layout in layouts {
        let run = memory_run(layout);
        let peak = bytes_after(&run, "measured peak per rank: ");
        let phases = run
            .lines()
            .find_map(|l| l.strip_prefix("  held by what allocated it: "))
            .unwrap_or_else(|| panic!("no phases: {run}"));
        let names = [
            "building the model",
            "reading data",
            "forward and backward passes",
            "the optimizer step",
            "saving",
            "other",
        ];
        let held: usize = names.iter().map(|n| figure(phases, n)).sum();
        // Exact for one rank; another rank's free of a message at the instant of the
        // peak could move the figures by that message.
        let off = held.abs_diff(peak) as f64 / peak as f64;
        assert!(
            off <= 0.01,
            "{layout}: the phases add up to {held}, not {peak}\n{run}"
        );
        // The plan's busiest stage: its activations, working memory and messages are what
        // the passes hold at the peak.
        let plan = memory_run(&format!("{layout} --plan"));
        let predicted = bytes_after(&plan, "predicted peak per rank: ");
        let stage = plan
            .lines()
            .find(|l| l.contains(&format!(": {predicted} (")))
            .unwrap();
        // (A pipelined stage's messages, the plan's communication here, are made during
        // the passes too; none of these layouts has the distributed optimizer's buffers.)
        let expected = figure(stage, "activations")
            + figure(stage, "working memory")
            + figure(stage, "communication");
        let passes = figure(phases, "forward and backward passes");
        let ratio = expected as f64 / passes as f64;
        report.push(format!("{ratio:.3} {expected:>10} {passes:>10} {layout}"));
        assert!((ratio - 1.0).abs() <= 0.10, "{}", report.join("\n"));
    }
    println!("{}", report.join("\n"));
}

#[test]
fn what_the_plan_does_not_model_is_refused() {
    for (flags, needle) in [
        ("--cp 2 --seq 16 --plan", "context parallelism"),
        ("--num-experts 4 --plan", "mixture of experts"),
    ] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_train-gpt"))
            .args(common::words(flags))
            .output()
            .expect("the train-gpt binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{flags} planned");
        assert!(stderr.contains(needle), "{flags}: {stderr}");
    }
}

/// Fused attention keeps nothing of size sequence²: a 2-layer model's measured peak grows
/// less than 2.5× from sequence 2048 to 4096 (the unfused kernel's grows about 4×), and
/// the plan predicts both within 10%.
#[test]
fn with_fused_attention_the_peak_grows_linearly_in_the_sequence_as_planned() {
    let flags = |seq: usize| {
        format!(
            "--layers 2 --hidden 64 --heads 4 --seq {seq} --batch 1 --steps 1 --eval-interval 0"
        )
    };
    let peak = |seq: usize| {
        let measured = bytes_after(&demo_stdout(&flags(seq)), "measured peak per rank: ");
        let plan = demo_stdout(&format!("{} --plan", flags(seq)));
        let predicted = bytes_after(&plan, "predicted peak per rank: ");
        let ratio = predicted as f64 / measured as f64;
        assert!(
            (ratio - 1.0).abs() <= 0.10,
            "seq {seq}: {predicted} predicted, {measured} measured"
        );
        measured
    };
    let (short, long) = (peak(2048), peak(4096));
    let growth = long as f64 / short as f64;
    assert!(
        growth < 2.5,
        "the peak grows {growth}x from {short} to {long} bytes"
    );
}
