//! The training data: by default the bytes of the project's own documentation (or any
//! text file), cut into deterministic (input, target) windows; or Megatron-LM's indexed
//! datasets (`--data-path`), sampled as Megatron's GPT dataset samples them.

use anyhow::{bail, ensure, Context, Result};
use ferrotron_datasets::{Blend, GptConfig, GptDataset, IndexedDataset};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

mod sampler;
pub use sampler::{mask_after_eod, reset_positions, DistributedSampler};

/// Byte-level vocabulary: every byte value is a token.
pub const VOCAB: usize = 256;

/// Megatron pads the vocabulary to a multiple of this times the tensor-parallel size
/// (`--make-vocab-size-divisible-by`).
const VOCAB_MULTIPLE: usize = 128;

/// The built-in corpus: a snapshot of the project's documentation (2026-11-26), about
/// 80 KB of English and Rust, enough for a small model's loss to fall visibly in a
/// minute. A copy inside the package, not the live files: the crate builds from its own
/// directory (as `cargo package` and `cargo install` need), and editing the docs does not
/// move the book's demo figures.
const BUILTIN: &[&str] = &[
    include_str!("../../corpus/README.md"),
    include_str!("../../corpus/ARCHITECTURE.md"),
    include_str!("../../corpus/getting-started.md"),
    include_str!("../../corpus/comm-core.md"),
    include_str!("../../corpus/troubleshooting.md"),
];

/// How token ids map to text: bytes, or a Hugging Face tokenizer.
pub struct Vocabulary {
    tokenizer: Option<tokenizers::Tokenizer>,
    size: usize,
}

impl Vocabulary {
    /// Every byte a token.
    pub fn bytes() -> Vocabulary {
        Vocabulary {
            tokenizer: None,
            size: VOCAB,
        }
    }

    /// The tokenizer in `path` (a `tokenizer.json`).
    pub fn from_file(path: &Path) -> Result<Vocabulary> {
        let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| {
            anyhow::anyhow!(
                "cannot load the tokenizer {}: {e}; pass a Hugging Face tokenizer.json",
                path.display()
            )
        })?;
        let size = tokenizer.get_vocab_size(true);
        Ok(Vocabulary {
            tokenizer: Some(tokenizer),
            size,
        })
    }

    /// The id of the token whose text is `text` (a tokenizer's special or ordinary token;
    /// none with bytes).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.tokenizer.as_ref()?.token_to_id(text)
    }

    /// Tokens that exist.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The size the model's embedding and output layer take: bytes as they are, a
    /// tokenizer's vocabulary padded to a multiple of 128 × `tp` as Megatron pads it (the
    /// padding's logits are left out of the loss).
    pub fn padded(&self, tp: usize) -> usize {
        match self.tokenizer {
            None => self.size,
            Some(_) => self.size.next_multiple_of(VOCAB_MULTIPLE * tp),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.tokenizer {
            None => Ok(text.bytes().map(u32::from).collect()),
            Some(t) => Ok(t
                .encode(text, false)
                .map_err(|e| anyhow::anyhow!("cannot tokenize {text:?}: {e}"))?
                .get_ids()
                .to_vec()),
        }
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.tokenizer {
            None => {
                let bytes: Vec<u8> = ids.iter().map(|&i| i.min(255) as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Some(t) => t
                .decode(ids, false)
                .unwrap_or_else(|e| format!("<cannot decode: {e}>")),
        }
    }
}

/// Which part of the data a batch comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    Validation,
}

pub struct Corpus {
    kind: Kind,
    pub source: String,
    pub vocabulary: Vocabulary,
}

enum Kind {
    /// Bytes; the held-out split starts at `validation_start`, the last tenth.
    Bytes {
        bytes: Vec<u8>,
        validation_start: usize,
    },
    Tokens(Tokens),
}

/// Fraction of the corpus (its end) held out for the validation loss.
const VALIDATION_FRACTION: f64 = 0.1;

impl Corpus {
    pub fn builtin() -> Corpus {
        Corpus::new(
            BUILTIN.concat().into_bytes(),
            "built-in documentation corpus".into(),
        )
    }

    /// Reads `path`; it must hold more than one training window of text.
    pub fn from_file(path: &Path, window: usize) -> Result<Corpus> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read the corpus file {}", path.display()))?;
        if bytes.is_empty() {
            bail!(
                "the corpus file {} is empty; pass a text file",
                path.display()
            );
        }
        if bytes.len() <= window {
            bail!(
                "the corpus file {} has {} bytes, but one training window needs {}; pass a \
                 longer file or a smaller --seq",
                path.display(),
                bytes.len(),
                window + 1
            );
        }
        Ok(Corpus::new(bytes, path.display().to_string()))
    }

    fn new(bytes: Vec<u8>, source: String) -> Corpus {
        let held_out = (bytes.len() as f64 * VALIDATION_FRACTION) as usize;
        Corpus {
            kind: Kind::Bytes {
                validation_start: bytes.len() - held_out,
                bytes,
            },
            source,
            vocabulary: Vocabulary::bytes(),
        }
    }

    /// Megatron's indexed datasets `blend` (weights and prefixes), cut by `split`, in
    /// `vocabulary`'s tokens. Opening checks every file; the samples are drawn when the
    /// run's batch is known ([`prepare`](Self::prepare)).
    pub fn megatron(
        blend: Vec<(f64, PathBuf)>,
        split: [f64; 3],
        seed: u64,
        vocabulary: Vocabulary,
    ) -> Result<Corpus> {
        let seed = u32::try_from(seed).map_err(|_| {
            anyhow::anyhow!(
                "--seed {seed}: Megatron's datasets draw their order from NumPy's \
                 RandomState, which takes seeds below 2^32"
            )
        })?;
        let mut datasets = Vec::new();
        for (weight, prefix) in blend {
            let dataset = IndexedDataset::open(&prefix)?;
            datasets.push((weight, Arc::new(dataset)));
        }
        let source = datasets
            .iter()
            .map(|(w, d)| match datasets.len() {
                1 => d.prefix().display().to_string(),
                _ => format!("{w:.3} × {}", d.prefix().display()),
            })
            .collect::<Vec<_>>()
            .join(" + ");
        Ok(Corpus {
            kind: Kind::Tokens(Tokens {
                datasets,
                split,
                seed,
                built: Mutex::new(None),
            }),
            source: format!("Megatron dataset {source}"),
            vocabulary,
        })
    }

    /// Where the data comes from and how much there is.
    pub fn describe(&self) -> String {
        match &self.kind {
            Kind::Bytes { bytes, .. } => format!("{} ({} bytes)", self.source, bytes.len()),
            Kind::Tokens(tokens) => {
                let sequences: usize = tokens.datasets.iter().map(|(_, d)| d.len()).sum();
                format!(
                    "{} ({sequences} sequences, a vocabulary of {} tokens)",
                    self.source,
                    self.vocabulary.size()
                )
            }
        }
    }

    /// Bytes of the byte corpus (the sampler holds an index per window of it); 0 for
    /// Megatron's datasets.
    pub fn len(&self) -> usize {
        match &self.kind {
            Kind::Bytes { bytes, .. } => bytes.len(),
            Kind::Tokens(_) => 0,
        }
    }

    /// Draws the samples a run of `steps` steps of `global_batch` sequences of `seq`
    /// tokens reads, and `validation` held-out ones; once per process for the same
    /// sizes. The byte corpus needs nothing.
    pub fn prepare(
        &self,
        seq: usize,
        global_batch: usize,
        steps: usize,
        validation: usize,
    ) -> Result<()> {
        match &self.kind {
            Kind::Bytes { .. } => Ok(()),
            Kind::Tokens(tokens) => tokens.prepare(Sizes {
                seq,
                train: steps * global_batch,
                validation,
            }),
        }
    }

    /// Checks that both splits hold at least one window of `seq` tokens and its targets.
    pub fn check_window(&self, seq: usize) -> Result<()> {
        let Kind::Bytes {
            bytes,
            validation_start,
        } = &self.kind
        else {
            return Ok(());
        };
        let (train, validation) = (*validation_start, bytes.len() - validation_start);
        if train.min(validation) <= seq {
            bail!(
                "the {} has {} bytes: {train} for training and {validation} held out for \
                 validation, and each split needs more than one window of --seq {seq}; pass \
                 a smaller --seq or a longer --data file",
                self.source,
                bytes.len()
            );
        }
        Ok(())
    }

    /// Samples the training sampler draws from.
    pub fn training_windows(&self, seq: usize) -> usize {
        match &self.kind {
            Kind::Bytes {
                validation_start, ..
            } => validation_start - seq,
            Kind::Tokens(tokens) => tokens.built().map_or(0, |b| b.train.len()),
        }
    }

    /// Whether the sampler shuffles: the byte corpus yes, Megatron's datasets no (they
    /// come shuffled, and Megatron's sampler reads them in order).
    pub fn shuffled(&self) -> bool {
        matches!(self.kind, Kind::Bytes { .. })
    }

    /// `count` held-out samples, the same in every run: windows spread evenly over the
    /// byte corpus's held-out split, or the validation split's first samples.
    pub fn validation_starts(&self, seq: usize, count: usize) -> Vec<usize> {
        match &self.kind {
            Kind::Bytes {
                bytes,
                validation_start,
            } => {
                let windows = bytes.len() - validation_start - seq;
                (0..count)
                    .map(|k| validation_start + k * windows / count)
                    .collect()
            }
            Kind::Tokens(_) => (0..count).collect(),
        }
    }

    /// The samples `ids` of `split`: `seq` input tokens each, row after row, and their
    /// next-token targets.
    pub fn rows(&self, split: Split, ids: &[usize], seq: usize) -> Result<(Vec<usize>, Vec<i64>)> {
        let mut inputs = Vec::with_capacity(ids.len() * seq);
        let mut targets = Vec::with_capacity(ids.len() * seq);
        let mut push = |window: &[u32]| {
            inputs.extend(window[..seq].iter().map(|&t| t as usize));
            targets.extend(window[1..].iter().map(|&t| i64::from(t)));
        };
        match &self.kind {
            Kind::Bytes { bytes, .. } => {
                for &start in ids {
                    let window: Vec<u32> = bytes[start..start + seq + 1]
                        .iter()
                        .map(|&b| b.into())
                        .collect();
                    push(&window);
                }
            }
            Kind::Tokens(tokens) => {
                let built = tokens
                    .built()
                    .context("the datasets' samples are not drawn yet")?;
                for &id in ids {
                    let window = built.sample(split, id)?;
                    if let Some(&bad) = window
                        .iter()
                        .find(|&&t| t as usize >= self.vocabulary.size())
                    {
                        bail!(
                            "{}: token {bad} is outside the tokenizer's {} entries; pass the \
                             tokenizer the data was made with",
                            self.source,
                            self.vocabulary.size()
                        );
                    }
                    push(&window);
                }
            }
        }
        Ok((inputs, targets))
    }
}

/// The samples a run needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sizes {
    seq: usize,
    train: usize,
    validation: usize,
}

/// Megatron's datasets and the samples drawn from them for one run's sizes.
struct Tokens {
    datasets: Vec<(f64, Arc<IndexedDataset>)>,
    split: [f64; 3],
    seed: u32,
    built: Mutex<Option<(Sizes, Arc<Drawn>)>>,
}

/// One split's samples: one dataset's, or a blend's.
enum Samples {
    One(GptDataset),
    Blend(Blend),
}

impl Samples {
    fn len(&self) -> usize {
        match self {
            Samples::One(d) => d.len(),
            Samples::Blend(b) => b.len(),
        }
    }

    fn sample(&self, i: usize) -> ferrotron_datasets::Result<Vec<u32>> {
        match self {
            Samples::One(d) => d.sample(i),
            Samples::Blend(b) => Ok(b.sample(i)?.1),
        }
    }
}

struct Drawn {
    train: Samples,
    validation: Option<Samples>,
}

impl Drawn {
    fn sample(&self, split: Split, i: usize) -> Result<Vec<u32>> {
        let samples = match split {
            Split::Train => &self.train,
            Split::Validation => self
                .validation
                .as_ref()
                .context("no validation samples were drawn")?,
        };
        Ok(samples.sample(i)?)
    }
}

impl Tokens {
    fn built(&self) -> Option<Arc<Drawn>> {
        let built = self.built.lock().ok()?;
        built.as_ref().map(|(_, drawn)| drawn.clone())
    }

    fn prepare(&self, sizes: Sizes) -> Result<()> {
        let mut built = self
            .built
            .lock()
            .map_err(|_| anyhow::anyhow!("another rank failed drawing the samples"))?;
        if built.as_ref().is_some_and(|(s, _)| *s == sizes) {
            return Ok(());
        }
        let train = self.draw(0, sizes.train, sizes.seq)?;
        let validation = match sizes.validation {
            0 => None,
            n => Some(self.draw(1, n, sizes.seq)?),
        };
        *built = Some((sizes, Arc::new(Drawn { train, validation })));
        Ok(())
    }

    /// `samples` samples of split `split` (0 training, 1 validation), blended by weight.
    fn draw(&self, split: usize, samples: usize, seq: usize) -> Result<Samples> {
        let config = GptConfig {
            seq,
            seed: self.seed,
        };
        let name = ["training", "validation"][split];
        let dataset = |data: &Arc<IndexedDataset>, count: usize| -> Result<GptDataset> {
            let range = ferrotron_datasets::split_ranges(self.split, data.len())[split].clone();
            ensure!(
                !range.is_empty(),
                "{}: --split gives the {name} split none of its {} sequences; raise its \
                 weight (e.g. --split 969,30,1)",
                data.prefix().display(),
                data.len()
            );
            Ok(GptDataset::new(data.clone(), range, Some(count), config)?)
        };
        if let [(_, data)] = &self.datasets[..] {
            return Ok(Samples::One(dataset(data, samples)?));
        }
        let weights: Vec<f64> = self.datasets.iter().map(|(w, _)| *w).collect();
        let counts = ferrotron_datasets::component_samples(&weights, samples);
        let parts = (self.datasets.iter().zip(&counts))
            .map(|((_, data), &(_, asked))| dataset(data, asked))
            .collect::<Result<Vec<_>>>()?;
        let size = counts.iter().map(|c| c.0).sum();
        Ok(Samples::Blend(Blend::new(parts, &weights, size)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_data_is_read_in_the_gpt_datasets_order_by_every_layout() {
        let dir = std::env::temp_dir().join(format!("train-gpt-order-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let prefix = dir.join("numbers");
        let mut writer =
            ferrotron_datasets::IndexedWriter::create(&prefix, ferrotron_datasets::DType::U16)
                .unwrap();
        for d in 0..40u32 {
            let tokens: Vec<u32> = (0..(5 + d % 9)).map(|j| (d * 13 + j) % 256).collect();
            writer.add_document(&tokens).unwrap();
        }
        writer.finish().unwrap();
        let (seq, steps, global) = (8, 5, 6);
        let split = ferrotron_datasets::parse_split("90,10").unwrap();
        let corpus = Corpus::megatron(
            vec![(1.0, prefix.clone())],
            split,
            1234,
            Vocabulary::bytes(),
        )
        .unwrap();
        corpus.prepare(seq, global, steps, 0).unwrap();
        // Megatron's samples 0, 1, 2, … of the training split, in order.
        let data = Arc::new(IndexedDataset::open(&prefix).unwrap());
        let train = ferrotron_datasets::split_ranges(split, data.len())[0].clone();
        let config = GptConfig { seq, seed: 1234 };
        let reference = GptDataset::new(data, train, Some(steps * global), config).unwrap();
        for dp in [1, 2, 3] {
            let mut ranks: Vec<DistributedSampler> = (0..dp)
                .map(|r| {
                    DistributedSampler::new(corpus.training_windows(seq), 7, global / dp, r, dp)
                        .in_order()
                })
                .collect();
            for step in 0..steps {
                let ids: Vec<usize> = ranks.iter_mut().flat_map(|r| r.starts(step)).collect();
                let (inputs, targets) = corpus.rows(Split::Train, &ids, seq).unwrap();
                for (row, i) in (step * global..(step + 1) * global).enumerate() {
                    let sample = reference.sample(i).unwrap();
                    let got: Vec<usize> = inputs[row * seq..(row + 1) * seq].to_vec();
                    let expected: Vec<usize> = sample[..seq].iter().map(|&t| t as usize).collect();
                    assert_eq!(got, expected, "dp {dp} step {step} row {row}");
                    assert_eq!(targets[row * seq + seq - 1], i64::from(sample[seq]));
                }
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
