//! The byte-level training corpus: the project's own documentation by default, or any
//! text file, cut into deterministic (input, target) windows.

use anyhow::{bail, Context, Result};
use std::path::Path;
use tape::Generator;

/// Byte-level vocabulary: every byte value is a token.
pub const VOCAB: usize = 256;

/// The documentation that ships with the repository: always there, about 20 KB of
/// English and Rust, enough for a small model's loss to fall visibly in a minute.
const BUILTIN: &[&str] = &[
    include_str!("../../../README.md"),
    include_str!("../../../ARCHITECTURE.md"),
    include_str!("../../../docs/src/getting-started.md"),
    include_str!("../../../docs/src/comm-core.md"),
    include_str!("../../../docs/src/troubleshooting.md"),
];

pub struct Corpus {
    bytes: Vec<u8>,
    pub source: String,
}

impl Corpus {
    pub fn builtin() -> Corpus {
        Corpus {
            bytes: BUILTIN.concat().into_bytes(),
            source: "built-in documentation corpus".into(),
        }
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
        Ok(Corpus {
            bytes,
            source: path.display().to_string(),
        })
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// The global batch of `step`: `rows` windows of `seq` input tokens and their next-
    /// token targets, identical on every rank (each data-parallel rank then takes its
    /// share of the rows).
    pub fn batch(&self, seed: u64, step: usize, rows: usize, seq: usize) -> (Vec<usize>, Vec<i64>) {
        let mut rng = Generator::new(seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let last_start = self.bytes.len() - seq - 1;
        let mut inputs = Vec::with_capacity(rows * seq);
        let mut targets = Vec::with_capacity(rows * seq);
        for _ in 0..rows {
            let start = (rng.next_u64() % (last_start as u64 + 1)) as usize;
            let window = &self.bytes[start..start + seq + 1];
            inputs.extend(window[..seq].iter().map(|&b| b as usize));
            targets.extend(window[1..].iter().map(|&b| b as i64));
        }
        (inputs, targets)
    }
}
