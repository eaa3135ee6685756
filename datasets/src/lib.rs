//! Data from the ecosystem: Megatron-LM's memory-mapped indexed datasets (`.idx`/`.bin`,
//! as its `preprocess_data.py` writes them), read and written, and Megatron's GPT dataset
//! on top: splits, samples of `seq + 1` tokens across document boundaries, NumPy's
//! shuffles reproduced bit for bit, and weighted blends. The same prefix, seed and
//! sizes give the samples Megatron-LM would train on, in its order.
//!
//! # Writing and reading a dataset
//! ```
//! use ferrotron_datasets::{DType, IndexedDataset, IndexedWriter};
//!
//! let dir = std::env::temp_dir().join(format!("datasets-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let prefix = dir.join("corpus_text_document");
//! let mut writer = IndexedWriter::create(&prefix, DType::for_vocabulary(50257))?;
//! writer.add_document(&[464, 2068, 7586, 21831, 50256])?;
//! writer.add_document(&[40, 588, 340, 50256])?;
//! writer.finish()?;
//!
//! let dataset = IndexedDataset::open(&prefix)?;
//! assert_eq!(dataset.len(), 2);
//! assert_eq!(dataset.sequence(1)?, [40, 588, 340, 50256]);
//! assert_eq!(dataset.document_indices(), [0, 1, 2]);
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), ferrotron_datasets::Error>(())
//! ```
//!
//! # Samples in Megatron's order
//! ```
//! use ferrotron_datasets::{split_ranges, parse_split, GptConfig, GptDataset, IndexedDataset, IndexedWriter, DType};
//! use std::sync::Arc;
//!
//! # let dir = std::env::temp_dir().join(format!("datasets-doc2-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir).unwrap();
//! # let prefix = dir.join("numbers");
//! # let mut writer = IndexedWriter::create(&prefix, DType::U16)?;
//! # for d in 0..20u32 { writer.add_document(&(0..7).map(|t| 100 * d + t).collect::<Vec<_>>())?; }
//! # writer.finish()?;
//! let dataset = Arc::new(IndexedDataset::open(&prefix)?);
//! let [train, _valid, _test] = split_ranges(parse_split("969,30,1")?, dataset.len());
//! let samples = GptDataset::new(dataset, train, Some(100), GptConfig { seq: 8, seed: 1234 })?;
//! assert!(samples.len() >= 100);
//! assert_eq!(samples.sample(0)?.len(), 9); // 8 inputs and the last target
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), ferrotron_datasets::Error>(())
//! ```
//!
//! # Cargo features
//! None: the crate builds and runs as it is.
#![warn(missing_docs)]

// The README's example runs as a doctest, so the package's front page cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod blend;
mod error;
mod gpt;
mod indexed;
mod random;
mod split;

pub use blend::{blending_indices, component_samples, parse_blend, Blend};
pub use error::{Error, Result};
pub use gpt::{GptConfig, GptDataset};
pub use indexed::{paths, DType, IndexedDataset, IndexedWriter};
pub use random::RandomState;
pub use split::{parse_split, split_ranges};
