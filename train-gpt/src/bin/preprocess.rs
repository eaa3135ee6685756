//! Tokenizes a corpus into a Megatron-LM indexed dataset (`PREFIX_text_document.idx` and
//! `.bin`), as Megatron-LM's `tools/preprocess_data.py` does, so that the files train
//! here and in Megatron alike.
//!
//! ```text
//! cargo run --release -p ferrotron-train-gpt --bin preprocess -- --input corpus.jsonl \
//!     --tokenizer tokenizer.json --output-prefix data/corpus --append-eod
//! cargo run --release -p ferrotron-train-gpt -- --data-path data/corpus_text_document \
//!     --tokenizer tokenizer.json
//! ```
//!
//! JSON lines (`.jsonl` or `.json`) give one document per line, its text under each of
//! `--json-keys` (one dataset per key); any other file is plain text with documents
//! separated by blank lines.

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use ferrotron_datasets::{DType, IndexedWriter};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(about = "Tokenize text into a Megatron-LM indexed dataset (.idx/.bin)")]
struct Args {
    /// JSON lines, one document per line, or plain text with blank lines between
    /// documents.
    #[arg(long)]
    input: PathBuf,
    /// A Hugging Face tokenizer.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Written: PREFIX_KEY_document.idx and .bin for each JSON key (KEY is `text` for
    /// plain text).
    #[arg(long)]
    output_prefix: PathBuf,
    /// The JSON keys whose text to tokenize.
    #[arg(long, num_args = 1.., default_value = "text")]
    json_keys: Vec<String>,
    /// End every non-empty document with the end-of-document token.
    #[arg(long)]
    append_eod: bool,
    /// The end-of-document token's text.
    #[arg(long, default_value = "<|endoftext|>")]
    eod_token: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let tokenizer = tokenizers::Tokenizer::from_file(&args.tokenizer).map_err(|e| {
        anyhow::anyhow!(
            "cannot load the tokenizer {}: {e}",
            args.tokenizer.display()
        )
    })?;
    let eod = match args.append_eod {
        false => None,
        true => Some(tokenizer.token_to_id(&args.eod_token).with_context(|| {
            format!(
                "the tokenizer has no token {:?} to end documents with; pass --eod-token",
                args.eod_token
            )
        })?),
    };
    let json = matches!(
        args.input.extension().and_then(|e| e.to_str()),
        Some("jsonl" | "json")
    );
    let keys = if json {
        args.json_keys.clone()
    } else {
        vec!["text".into()]
    };
    let dtype = DType::for_vocabulary(tokenizer.get_vocab_size(true));
    let mut writers = keys
        .iter()
        .map(|key| {
            let prefix = output(&args.output_prefix, key);
            Ok((
                IndexedWriter::create(&prefix, dtype)?,
                prefix,
                0usize,
                0usize,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    for document in documents(&args.input, json, &keys)? {
        for ((writer, _, docs, tokens), text) in writers.iter_mut().zip(document?) {
            let mut ids = tokenizer
                .encode(text.as_str(), false)
                .map_err(|e| anyhow::anyhow!("cannot tokenize a document: {e}"))?
                .get_ids()
                .to_vec();
            if let (Some(eod), false) = (eod, ids.is_empty()) {
                ids.push(eod);
            }
            // Megatron's writer skips empty documents.
            if !ids.is_empty() {
                writer.add_document(&ids)?;
                (*docs, *tokens) = (*docs + 1, *tokens + ids.len());
            }
        }
    }
    for (writer, prefix, docs, tokens) in writers {
        writer.finish()?;
        println!(
            "{}.idx and .bin: {docs} documents, {tokens} tokens ({dtype:?})",
            prefix.display()
        );
    }
    Ok(())
}

fn output(prefix: &Path, key: &str) -> PathBuf {
    let mut name = prefix.as_os_str().to_owned();
    name.push(format!("_{key}_document"));
    PathBuf::from(name)
}

/// Each document's text under each key, in order.
fn documents(
    path: &Path,
    json: bool,
    keys: &[String],
) -> Result<Box<dyn Iterator<Item = Result<Vec<String>>>>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let lines = BufReader::new(file).lines();
    if json {
        let (path, keys) = (path.to_path_buf(), keys.to_vec());
        return Ok(Box::new(lines.enumerate().filter_map(move |(n, line)| {
            let line = match line {
                Ok(line) if line.trim().is_empty() => return None,
                Ok(line) => line,
                Err(e) => return Some(Err(e.into())),
            };
            Some(fields(&line, &keys).with_context(|| format!("{} line {}", path.display(), n + 1)))
        })));
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
    let documents: Vec<Result<Vec<String>>> = text
        .split("\n\n")
        .filter(|d| !d.trim().is_empty())
        .map(|d| Ok(vec![d.to_string()]))
        .collect();
    ensure!(!documents.is_empty(), "{} holds no text", path.display());
    Ok(Box::new(documents.into_iter()))
}

fn fields(line: &str, keys: &[String]) -> Result<Vec<String>> {
    let value: serde_json::Value = serde_json::from_str(line).context("not a JSON object")?;
    keys.iter()
        .map(|key| match &value[key.as_str()] {
            serde_json::Value::String(text) => Ok(text.clone()),
            _ => bail!("no string under the key {key:?} (pass --json-keys)"),
        })
        .collect()
}
