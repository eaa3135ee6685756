//! Hugging Face GPT-2 checkpoints: the demo's model is GPT-2's architecture (learned positions, pre-norm blocks with a final layer norm, tanh GELU,
//! biased linears, attention scaled by 1/√d), so a checkpoint exports to a directory that
//! `transformers.GPT2LMHeadModel.from_pretrained` loads, and such a directory starts a run.
//!
//! Names and layouts differ: GPT-2's `Conv1D` stores `[in, out]` (the transpose of a
//! linear's `[out, in]`), and its fused attention projection holds all queries, then all
//! keys, then all values, where ferrotron's holds `[q, k, v]` head by head (so that a
//! tensor-parallel cut hands each rank whole heads). The vocabulary's padding is dropped
//! on export and restored on import.

use crate::checkpoint::{self, TrainerState};
use crate::model::GptConfig;
use anyhow::{bail, ensure, Context, Result};
use ferrotron_tape::Tensor;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// A full tensor: its shape and its values, row-major.
pub type Full = (Vec<usize>, Vec<f32>);

const CONFIG: &str = "config.json";
const WEIGHTS: &str = "model.safetensors";

/// Writes the checkpoint `from` (a `--save` directory or one step of it) as a GPT-2
/// directory `out`.
pub fn export(from: &Path, out: &Path) -> Result<()> {
    let dir = checkpoint_dir(from)?;
    let saved = TrainerState::read(&dir)?;
    let model = saved.model;
    if let Some(groups) = model.query_groups.filter(|&g| g != model.heads) {
        bail!(
            "the checkpoint's attention shares each key and value among {} heads \
             ({groups} query groups); GPT-2 has a key and value per head, so it cannot be \
             exported as GPT-2",
            model.heads / groups
        );
    }
    let full = checkpoint::read_stages(&saved.stage_dirs(&dir), saved.tp)?;
    let mut tensors = BTreeMap::new();
    for (name, (_, tensor)) in &full {
        let values = tensor.to_vec()?;
        tensors.insert(name.clone(), (tensor.shape().to_vec(), values));
    }
    let gpt2 = to_gpt2(&tensors, &model)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    write_weights(&out.join(WEIGHTS), &gpt2)?;
    let config = serde_json::to_string_pretty(&config_json(&model))?;
    std::fs::write(out.join(CONFIG), config)
        .with_context(|| format!("cannot write {}", out.join(CONFIG).display()))?;
    println!(
        "exported {} (step {}) to {}: {} and {}",
        dir.display(),
        saved.losses.len(),
        out.display(),
        CONFIG,
        WEIGHTS
    );
    Ok(())
}

/// The checkpoint `from`'s next-token logits after `ids` (the real vocabulary's), on one
/// rank: what a GPT-2 export of it must reproduce.
pub fn logits(from: &Path, ids: &[usize]) -> Result<Vec<f32>> {
    let dir = checkpoint_dir(from)?;
    let saved = TrainerState::read(&dir)?;
    let full = checkpoint::read_stages(&saved.stage_dirs(&dir), saved.tp)?;
    let model = saved.model;
    ensure!(
        !ids.is_empty() && ids.len() <= model.seq && ids.iter().all(|&i| i < model.valid_vocab),
        "a prompt of 1 to {} tokens below {}",
        model.seq,
        model.valid_vocab
    );
    let results = ferrotron_comm_core::run_local(1, |comm| -> Result<Vec<f32>> {
        let layout = ferrotron_parallel_state::RankLayout::builder(1).build()?;
        let state =
            ferrotron_parallel_state::ParallelState::new(std::sync::Arc::new(comm), layout)?;
        let tp = ferrotron_layers::TensorParallel::from_state(&state);
        let gpt = crate::model::Gpt::chunk(&tp, model, 0, 0..model.layers)?;
        gpt.load(&full, &dir)?;
        let tape = ferrotron_tape::Tape::new();
        let logits = gpt.forward_chunk(
            &tape,
            crate::model::Tokens {
                ids,
                positions: None,
            },
            None,
            ids.len(),
            1,
            None,
        )?;
        let all = logits.to_vec()?;
        let last = (ids.len() - 1) * model.vocab;
        Ok(all[last..last + model.valid_vocab].to_vec())
    })?;
    results
        .into_iter()
        .next()
        .context("the rank returned nothing")
}

/// A `--save` directory's newest checkpoint, or the checkpoint `from` is.
fn checkpoint_dir(from: &Path) -> Result<std::path::PathBuf> {
    checkpoint::newest(from)?
        .or_else(|| {
            from.join("trainer_state.json")
                .is_file()
                .then(|| from.to_path_buf())
        })
        .with_context(|| format!("{} holds no complete checkpoint", from.display()))
}

fn config_json(model: &GptConfig) -> Value {
    json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.valid_vocab,
        "n_positions": model.seq,
        "n_ctx": model.seq,
        "n_embd": model.hidden,
        "n_layer": model.layers,
        "n_head": model.heads,
        "n_inner": 4 * model.hidden,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": true,
        "tie_word_embeddings": model.tied,
        "torch_dtype": "float32",
        "bos_token_id": null,
        "eos_token_id": null,
    })
}

/// The sizes a GPT-2 directory's `config.json` gives, as the demo's flags name them.
pub struct Shape {
    /// Whether the output layer is the token embedding (`tie_word_embeddings`).
    pub tied: bool,
    pub vocab: usize,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub positions: usize,
}

/// A GPT-2 directory's sizes, checked to be a model the demo builds.
pub fn read_shape(dir: &Path) -> Result<Shape> {
    let path = dir.join(CONFIG);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}: pass a GPT-2 directory", path.display()))?;
    let config: Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let number = |key: &str| {
        config[key]
            .as_u64()
            .map(|n| n as usize)
            .with_context(|| format!("{} has no number {key:?}", path.display()))
    };
    let shape = Shape {
        tied: config["tie_word_embeddings"].as_bool().unwrap_or(true),
        vocab: number("vocab_size")?,
        layers: number("n_layer")?,
        hidden: number("n_embd")?,
        heads: number("n_head")?,
        positions: number("n_positions")?,
    };
    ensure!(
        shape.heads > 0 && shape.hidden.is_multiple_of(shape.heads),
        "{}: n_head {} does not divide n_embd {}",
        path.display(),
        shape.heads,
        shape.hidden
    );
    let activation = config["activation_function"].as_str().unwrap_or("gelu_new");
    let inner = config["n_inner"]
        .as_u64()
        .map_or(4 * shape.hidden, |n| n as usize);
    ensure!(
        activation == "gelu_new" && inner == 4 * shape.hidden,
        "{}: the demo's blocks use tanh GELU (gelu_new) and an MLP of 4 × n_embd; this \
         model has {activation} and {inner}",
        path.display()
    );
    Ok(shape)
}

/// Reads a GPT-2 directory: its sizes and its weights under ferrotron's names, with the
/// vocabulary unpadded.
pub fn import(dir: &Path) -> Result<(Shape, BTreeMap<String, Full>)> {
    let shape = read_shape(dir)?;
    let weights = read_weights(&dir.join(WEIGHTS))?;
    let ours = from_gpt2(&weights, &shape)?;
    Ok((shape, ours))
}

fn transpose((shape, values): &Full) -> Full {
    let (rows, cols) = (shape[0], shape[1]);
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    (vec![cols, rows], out)
}

/// Rows `[head][q,k,v][d]` (ferrotron) to `[q,k,v][head][d]` (GPT-2), or back.
fn regroup(values: &[f32], heads: usize, head_dim: usize, width: usize, to_gpt2: bool) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for head in 0..heads {
        for part in 0..3 {
            for d in 0..head_dim {
                let ours = (head * 3 + part) * head_dim + d;
                let theirs = (part * heads + head) * head_dim + d;
                let (from, to) = if to_gpt2 {
                    (ours, theirs)
                } else {
                    (theirs, ours)
                };
                out[to * width..(to + 1) * width]
                    .copy_from_slice(&values[from * width..(from + 1) * width]);
            }
        }
    }
    out
}

/// How each ferrotron tensor of block `i` maps to GPT-2's: (ours, theirs, transposed).
fn block_names(i: usize) -> [(String, String, bool); 12] {
    let (b, h) = (format!("block{i}"), format!("transformer.h.{i}"));
    [
        (format!("{b}.ln1.weight"), format!("{h}.ln_1.weight"), false),
        (format!("{b}.ln1.bias"), format!("{h}.ln_1.bias"), false),
        (
            format!("{b}.attention.qkv.weight"),
            format!("{h}.attn.c_attn.weight"),
            true,
        ),
        (
            format!("{b}.attention.qkv.bias"),
            format!("{h}.attn.c_attn.bias"),
            false,
        ),
        (
            format!("{b}.attention.proj.weight"),
            format!("{h}.attn.c_proj.weight"),
            true,
        ),
        (
            format!("{b}.attention.proj.bias"),
            format!("{h}.attn.c_proj.bias"),
            false,
        ),
        (format!("{b}.ln2.weight"), format!("{h}.ln_2.weight"), false),
        (format!("{b}.ln2.bias"), format!("{h}.ln_2.bias"), false),
        (
            format!("{b}.mlp.fc1.weight"),
            format!("{h}.mlp.c_fc.weight"),
            true,
        ),
        (
            format!("{b}.mlp.fc1.bias"),
            format!("{h}.mlp.c_fc.bias"),
            false,
        ),
        (
            format!("{b}.mlp.fc2.weight"),
            format!("{h}.mlp.c_proj.weight"),
            true,
        ),
        (
            format!("{b}.mlp.fc2.bias"),
            format!("{h}.mlp.c_proj.bias"),
            false,
        ),
    ]
}

/// The tensors outside the blocks, (ours, theirs): the untied output layer's too.
fn top_names(tied: bool) -> Vec<(String, String)> {
    let mut names = vec![
        ("embed.weight".into(), "transformer.wte.weight".into()),
        ("position.weight".into(), "transformer.wpe.weight".into()),
        ("ln_f.weight".into(), "transformer.ln_f.weight".into()),
        ("ln_f.bias".into(), "transformer.ln_f.bias".into()),
    ];
    if !tied {
        names.push(("head.weight".into(), "lm_head.weight".into()));
    }
    names
}

/// Whether `name` holds a row per vocabulary entry (and so its padding).
fn per_token(name: &str) -> bool {
    name == "embed.weight" || name == "head.weight"
}

fn to_gpt2(ours: &BTreeMap<String, Full>, model: &GptConfig) -> Result<BTreeMap<String, Full>> {
    let get = |name: &str| {
        ours.get(name)
            .with_context(|| format!("the checkpoint has no '{name}'"))
    };
    let head_dim = model.hidden / model.heads;
    let mut out = BTreeMap::new();
    for (name, theirs) in top_names(model.tied) {
        let (shape, values) = get(&name)?.clone();
        let full = match per_token(&name) {
            // The padding is no token.
            true => (
                vec![model.valid_vocab, shape[1]],
                values[..model.valid_vocab * shape[1]].to_vec(),
            ),
            false => (shape, values),
        };
        out.insert(theirs, full);
    }
    for i in 0..model.layers {
        for (name, theirs, transposed) in block_names(i) {
            let (shape, mut values) = get(&name)?.clone();
            if name.ends_with("qkv.weight") || name.ends_with("qkv.bias") {
                let width = values.len() / shape[0];
                values = regroup(&values, model.heads, head_dim, width, true);
            }
            let full = (shape, values);
            out.insert(theirs, if transposed { transpose(&full) } else { full });
        }
    }
    Ok(out)
}

/// The shape `config.json`'s sizes give GPT-2's tensor `name`.
fn gpt2_shape(name: &str, shape: &Shape) -> Vec<usize> {
    let h = shape.hidden;
    let ends = |suffix: &str| name.ends_with(suffix);
    match () {
        _ if ends("wte.weight") || ends("lm_head.weight") => vec![shape.vocab, h],
        _ if ends("wpe.weight") => vec![shape.positions, h],
        _ if ends("c_attn.weight") => vec![h, 3 * h],
        _ if ends("c_attn.bias") => vec![3 * h],
        _ if ends("mlp.c_fc.weight") => vec![h, 4 * h],
        _ if ends("mlp.c_fc.bias") => vec![4 * h],
        _ if ends("mlp.c_proj.weight") => vec![4 * h, h],
        _ if ends("attn.c_proj.weight") => vec![h, h],
        _ => vec![h],
    }
}

fn from_gpt2(theirs: &HashMap<String, Full>, shape: &Shape) -> Result<BTreeMap<String, Full>> {
    let get = |name: &str| {
        let full = theirs
            .get(name)
            .or_else(|| theirs.get(name.trim_start_matches("transformer.")))
            .with_context(|| format!("the GPT-2 weights have no '{name}'"))?;
        let expected = gpt2_shape(name, shape);
        ensure!(
            full.0 == expected && full.1.len() == expected.iter().product::<usize>(),
            "the GPT-2 weights' '{name}' is {:?}, but config.json's sizes make it {expected:?}",
            full.0
        );
        Ok(full)
    };
    let head_dim = shape.hidden / shape.heads;
    let mut out = BTreeMap::new();
    for (ours, name) in top_names(shape.tied) {
        out.insert(ours, get(&name)?.clone());
    }
    for i in 0..shape.layers {
        for (ours, name, transposed) in block_names(i) {
            let full = get(&name)?;
            let (dims, mut values) = if transposed {
                transpose(full)
            } else {
                full.clone()
            };
            if ours.ends_with("qkv.weight") || ours.ends_with("qkv.bias") {
                let width = values.len() / dims[0];
                values = regroup(&values, shape.heads, head_dim, width, false);
            }
            out.insert(ours, (dims, values));
        }
    }
    Ok(out)
}

fn write_weights(path: &Path, tensors: &BTreeMap<String, Full>) -> Result<()> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, (shape, values))| {
            let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name.clone(), shape.clone(), data)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, shape, data)| {
            Ok((
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), data)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    // Transformers refuses safetensors files without a framework in their metadata.
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let serialized = safetensors::serialize(views, Some(metadata))?;
    std::fs::write(path, serialized).with_context(|| format!("cannot write {}", path.display()))
}

fn read_weights(path: &Path) -> Result<HashMap<String, Full>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file = SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{} is not a safetensors file", path.display()))?;
    let mut out = HashMap::new();
    for (name, view) in file.tensors() {
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            other => bail!(
                "{}: '{name}' is {other:?}; export it in float32 (torch_dtype float32)",
                path.display()
            ),
        };
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}

/// `full` as tensors, with the embedding padded back to `vocab` rows with zeros (the
/// padding is no token: its rows are never read and take no gradient).
pub fn tensors(full: BTreeMap<String, Full>, vocab: usize) -> Result<BTreeMap<String, Tensor>> {
    full.into_iter()
        .map(|(name, (mut shape, mut values))| {
            if per_token(&name) && shape[0] < vocab {
                values.resize(vocab * shape[1], 0.0);
                shape[0] = vocab;
            }
            Ok((name, Tensor::from_vec(values, &shape)?))
        })
        .collect()
}
