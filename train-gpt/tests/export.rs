//! GPT-2 checkpoints: `export-hf` writes what transformers loads and computes the same
//! logits from, `--init-from` starts a run from it at another layout with bit-identical
//! weights, and models GPT-2 cannot express are refused.

mod common;

use common::{fresh, succeeded, words};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const MODEL: &[&str] = &[
    "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16",
];

/// "The tensor " in bytes.
const PROMPT: &str = "84,104,101,32,116,101,110,115,111,114,32";

fn demo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(args)
        .output()
        .expect("the demo runs")
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Trains with `flags` (the layout and steps, one string) and `extra`, saving under
/// `dir/save`.
fn train(dir: &Path, flags: &str, extra: &[&str]) -> PathBuf {
    let save = dir.join("save");
    let out = dir.join("out");
    let mut args = MODEL.to_vec();
    args.extend(["--batch", "4", "--save", path(&save), "--out", path(&out)]);
    args.extend(words(flags));
    args.extend(extra);
    succeeded(&demo(&args));
    save
}

fn export(from: &Path, to: &Path) {
    succeeded(&demo(&[
        "export-hf",
        "--from",
        path(from),
        "--out",
        path(to),
    ]));
}

fn logits(from: &Path) -> Vec<f32> {
    let out = succeeded(&demo(&["logits", "--from", path(from), "--ids", PROMPT]));
    let json = out
        .lines()
        .find_map(|l| l.strip_prefix("logits: "))
        .expect("a logits line");
    serde_json::from_str(json).unwrap()
}

const UNTIE: &str = "--untie-embeddings-and-output-weights";

#[test]
fn export_then_import_at_another_layout_keeps_every_weight_bit_for_bit() {
    for (name, tie) in [("tied", ""), ("untied", UNTIE)] {
        let dir = fresh(&format!("export-round-trip-{name}"));
        let first = train(
            &dir.join("a"),
            &format!("--tp 2 --pp 2 --dp 1 --microbatches 2 --steps 4 {tie}"),
            &[],
        );
        let exported = dir.join("hf");
        export(&first, &exported);
        let text = std::fs::read_to_string(exported.join("config.json")).unwrap();
        let config: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(config["model_type"], "gpt2");
        assert_eq!(config["n_layer"], 2);
        assert_eq!(config["vocab_size"], 256);
        assert_eq!(config["tie_word_embeddings"], tie.is_empty());
        // A first step with a learning rate of 0 (warm-up from 0) saves the imported
        // weights.
        let mut extra = words("--lr-warmup-steps 5 --lr-warmup-init 0 --init-from");
        extra.push(path(&exported));
        let layout = format!("--tp 1 --pp 2 --dp 1 --microbatches 2 --steps 1 {tie}");
        let second = train(&dir.join("b"), &layout, &extra);
        let again = dir.join("hf-again");
        export(&second, &again);
        let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
        let same = bytes(&exported) == bytes(&again);
        assert!(same, "{name}: the weights changed on the way");
        assert_eq!(logits(&first), logits(&second), "{name}");
    }
}

/// A Python with torch and transformers: `FERROTRON_PYTHON`, or `python3`.
fn python() -> Option<String> {
    let python = std::env::var("FERROTRON_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python)
        .args(["-c", "import torch, transformers"])
        .output()
        .ok()?;
    probe.status.success().then_some(python)
}

#[test]
fn transformers_computes_the_same_logits_from_the_export() {
    let Some(python) = python() else {
        println!(
            "skipped: no Python with torch and transformers (set FERROTRON_PYTHON to one; \
             pip install torch transformers)"
        );
        return;
    };
    for (name, tie) in [("tied", ""), ("untied", UNTIE)] {
        let dir = fresh(&format!("export-transformers-{name}"));
        let saved = train(&dir, &format!("--tp 2 --dp 1 --steps 5 {tie}"), &[]);
        compare_with_transformers(&python, &dir, &saved);
    }
}

/// Exports `saved` under `dir` and compares transformers' logits with ferrotron's.
fn compare_with_transformers(python: &str, dir: &Path, saved: &Path) {
    let exported = dir.join("hf");
    export(saved, &exported);
    let script = format!(
        "import torch, transformers, json\n\
         m = transformers.GPT2LMHeadModel.from_pretrained({:?}).eval()\n\
         with torch.no_grad():\n    \
             l = m(torch.tensor([[{PROMPT}]])).logits[0, -1]\n\
         print(json.dumps(l.tolist()))\n",
        path(&exported)
    );
    let output = Command::new(python).args(["-c", &script]).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let theirs: Vec<f32> = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let ours = logits(saved);
    assert_eq!(ours.len(), theirs.len());
    let largest = (ours.iter().zip(&theirs))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    println!("largest logit difference, ferrotron against transformers: {largest:e}");
    assert!(largest <= 1e-4, "{largest}");
}

#[test]
fn models_that_do_not_fit_the_run_are_refused() {
    let dir = fresh("export-refused");
    let tied = train(&dir.join("tied"), "--tp 1 --dp 1 --steps 1", &[]);
    let exported = dir.join("hf");
    export(&tied, &exported);
    let mut args = words("--layers 3 --hidden 32 --heads 4 --seq 16 --init-from");
    args.push(path(&exported));
    let mismatched = demo(&args);
    let err = String::from_utf8_lossy(&mismatched.stderr);
    assert!(!mismatched.status.success());
    assert!(
        err.contains("pass --layers 2 --hidden 32 --heads 4 --seq 16"),
        "{err}"
    );
    let mut args = words("--layers 2 --hidden 32 --heads 4 --seq 16 --init-from");
    args.extend([path(&exported), UNTIE]);
    let untied = demo(&args);
    let err = String::from_utf8_lossy(&untied.stderr);
    assert!(!untied.status.success());
    assert!(err.contains("tied embeddings: drop --untie"), "{err}");
}
