//! Megatron's memory-mapped indexed dataset: `PREFIX.bin` holds the tokens of every
//! sequence back to back, `PREFIX.idx` where each one starts.
//!
//! The index, all little-endian: the magic `MMIDIDX\0\0`, a `u64` version (1), a `u8`
//! token type code, the `u64` count of sequences N, the `u64` count of document
//! boundaries D, then N `i32` sequence lengths (in tokens), N `i64` byte offsets into
//! the `.bin`, and D `i64` sequence indices at which documents end, starting with 0 (a
//! document is sequences `[d[k], d[k+1])`).

use crate::error::{Error, Result};
use memmap2::Mmap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// Magic, version, token type, and the two counts.
const HEADER: usize = 9 + 8 + 1 + 8 + 8;

/// The type a dataset stores its tokens in, with Megatron's code for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// Code 1.
    U8,
    /// Code 2.
    I8,
    /// Code 3.
    I16,
    /// Code 4.
    I32,
    /// Code 5.
    I64,
    /// Code 8.
    U16,
}

impl DType {
    /// The type Megatron's `preprocess_data.py` picks for a vocabulary: `u16` under
    /// 65,500 entries, `i32` otherwise.
    pub fn for_vocabulary(size: usize) -> DType {
        if size < 65_500 {
            DType::U16
        } else {
            DType::I32
        }
    }

    /// Megatron's code for it.
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::I16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::U16 => 8,
        }
    }

    fn from_code(code: u8) -> Option<DType> {
        Some(match code {
            1 => DType::U8,
            2 => DType::I8,
            3 => DType::I16,
            4 => DType::I32,
            5 => DType::I64,
            8 => DType::U16,
            _ => return None,
        })
    }

    /// Bytes a token takes.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    /// The largest token it holds.
    fn max(self) -> u64 {
        match self {
            DType::U8 => u8::MAX.into(),
            DType::I8 => i8::MAX as u64,
            DType::I16 => i16::MAX as u64,
            DType::U16 => u16::MAX.into(),
            DType::I32 => i32::MAX as u64,
            DType::I64 => u32::MAX.into(),
        }
    }

    /// The token at the start of `bytes`, or `None` for a negative one.
    fn read(self, bytes: &[u8]) -> Option<u32> {
        let value: i64 = match self {
            DType::U8 => bytes[0].into(),
            DType::I8 => (bytes[0] as i8).into(),
            DType::I16 => i16::from_le_bytes([bytes[0], bytes[1]]).into(),
            DType::U16 => u16::from_le_bytes([bytes[0], bytes[1]]).into(),
            DType::I32 => i32::from_le_bytes(bytes[..4].try_into().ok()?).into(),
            DType::I64 => i64::from_le_bytes(bytes[..8].try_into().ok()?),
        };
        u32::try_from(value).ok()
    }
}

/// The `.idx` and `.bin` paths of a dataset prefix.
pub fn paths(prefix: &Path) -> (PathBuf, PathBuf) {
    let with = |extension: &str| {
        let mut path = prefix.as_os_str().to_owned();
        path.push(extension);
        PathBuf::from(path)
    };
    (with(".idx"), with(".bin"))
}

/// An indexed dataset, memory-mapped: opening it reads and checks the index, not the
/// tokens.
pub struct IndexedDataset {
    prefix: PathBuf,
    index: Mmap,
    data: Mmap,
    dtype: DType,
    sequences: usize,
    documents: usize,
}

fn map(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the mapping is read-only and private to this dataset; a file truncated
    // under it by another process is outside what this crate can guard against, as for
    // every reader of memory-mapped files.
    unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))
}

/// The `u64` at `at`; callers stay inside the index, whose size `open` checked.
fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

impl IndexedDataset {
    /// Opens `PREFIX.idx` and `PREFIX.bin` and checks that the index is well formed and
    /// that every sequence lies inside the `.bin`.
    pub fn open(prefix: impl AsRef<Path>) -> Result<IndexedDataset> {
        let prefix = prefix.as_ref().to_path_buf();
        let (idx, bin) = paths(&prefix);
        let index = map(&idx)?;
        let truncated = |what: &str, needed: usize, found: usize| Error::Truncated {
            path: idx.clone(),
            what: what.into(),
            needed: needed as u64,
            found: found as u64,
        };
        if index.len() < HEADER {
            return Err(truncated("the header", HEADER, index.len()));
        }
        if &index[..9] != MAGIC {
            return Err(Error::format(
                &idx,
                "not a Megatron indexed dataset index (bad magic number): write it with \
                 Megatron-LM's preprocess_data.py or `preprocess`",
            ));
        }
        let version = u64_at(&index, 9);
        if version != 1 {
            return Err(Error::format(
                &idx,
                format!("index version {version}; only version 1 exists"),
            ));
        }
        let dtype = DType::from_code(index[17]).ok_or_else(|| {
            Error::format(
                &idx,
                format!(
                    "token type code {} is not an integer type (1 u8, 2 i8, 3 i16, 4 i32, \
                     5 i64, 8 u16)",
                    index[17]
                ),
            )
        })?;
        let (sequences, documents) = (u64_at(&index, 18), u64_at(&index, 26));
        let needed = (HEADER as u64)
            .checked_add(sequences.saturating_mul(12))
            .and_then(|n| n.checked_add(documents.saturating_mul(8)))
            .unwrap_or(u64::MAX);
        if needed > index.len() as u64 {
            return Err(Error::Truncated {
                path: idx,
                what: format!("{sequences} sequences and {documents} document boundaries"),
                needed,
                found: index.len() as u64,
            });
        }
        let dataset = IndexedDataset {
            data: map(&bin)?,
            prefix,
            index,
            dtype,
            sequences: sequences as usize,
            documents: documents as usize,
        };
        dataset.check(&idx, &bin)?;
        Ok(dataset)
    }

    /// Every sequence inside the `.bin`, and document boundaries that cover them in order.
    fn check(&self, idx: &Path, bin: &Path) -> Result<()> {
        for i in 0..self.sequences {
            if self.raw_length(i) < 0 {
                return Err(Error::format(
                    idx,
                    format!(
                        "sequence {i} has a negative length ({})",
                        self.raw_length(i)
                    ),
                ));
            }
            let (start, length) = (self.pointer(i), self.length(i) as u64);
            let end = start.saturating_add(length * self.dtype.size() as u64);
            if end > self.data.len() as u64 {
                return Err(Error::Truncated {
                    path: bin.to_path_buf(),
                    what: format!("sequence {i} (tokens at bytes {start}..{end})"),
                    needed: end,
                    found: self.data.len() as u64,
                });
            }
        }
        let boundaries = self.document_indices();
        let ordered = boundaries.windows(2).all(|w| w[0] <= w[1]);
        if boundaries.first() != Some(&0)
            || boundaries.last() != Some(&(self.sequences as u64))
            || !ordered
        {
            return Err(Error::format(
                idx,
                format!(
                    "document boundaries must rise from 0 to the {} sequences",
                    self.sequences
                ),
            ));
        }
        Ok(())
    }

    /// The prefix it was opened from.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// The type its tokens are stored in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Sequences (documents, unless split into sentences).
    pub fn len(&self) -> usize {
        self.sequences
    }

    /// Whether it holds no sequence.
    pub fn is_empty(&self) -> bool {
        self.sequences == 0
    }

    /// Tokens in sequence `i`, or `None` past the last sequence.
    pub fn sequence_length(&self, i: usize) -> Option<usize> {
        (i < self.sequences).then(|| self.length(i))
    }

    /// Tokens in sequence `i < len()` (checked non-negative by `open`).
    pub(crate) fn length(&self, i: usize) -> usize {
        self.raw_length(i).max(0) as usize
    }

    fn raw_length(&self, i: usize) -> i32 {
        let at = HEADER + 4 * i;
        let mut word = [0u8; 4];
        word.copy_from_slice(&self.index[at..at + 4]);
        i32::from_le_bytes(word)
    }

    fn pointer(&self, i: usize) -> u64 {
        u64_at(&self.index, HEADER + 4 * self.sequences + 8 * i)
    }

    /// The sequence indices at which documents start and end: `[0, …, len()]`.
    pub fn document_indices(&self) -> Vec<u64> {
        let at = HEADER + 12 * self.sequences;
        (0..self.documents)
            .map(|k| u64_at(&self.index, at + 8 * k))
            .collect()
    }

    /// Appends `count` tokens of sequence `i` from token `offset` to `out`.
    pub fn read(&self, i: usize, offset: usize, count: usize, out: &mut Vec<u32>) -> Result<()> {
        let end = offset.checked_add(count);
        if i >= self.sequences || end.is_none_or(|end| end > self.length(i)) {
            return Err(Error::Invalid(format!(
                "{}: tokens {offset}..{} of sequence {i} do not exist",
                self.prefix.display(),
                offset.saturating_add(count)
            )));
        }
        let size = self.dtype.size();
        let start = self.pointer(i) as usize + offset * size;
        for (k, token) in self.data[start..start + count * size]
            .chunks_exact(size)
            .enumerate()
        {
            out.push(self.dtype.read(token).ok_or_else(|| {
                Error::format(
                    paths(&self.prefix).1,
                    format!("token {} of sequence {i} is negative", offset + k),
                )
            })?);
        }
        Ok(())
    }

    /// Sequence `i`'s tokens.
    pub fn sequence(&self, i: usize) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        let length = self.sequence_length(i).unwrap_or(0);
        self.read(i, 0, length, &mut out)?;
        Ok(out)
    }
}

/// Writes an indexed dataset as Megatron's `preprocess_data.py` writes one. The `.bin`
/// and `.idx` are written under temporary names and renamed into place by
/// [`finish`](Self::finish), so a reader never sees half a dataset.
pub struct IndexedWriter {
    prefix: PathBuf,
    bin: BufWriter<File>,
    dtype: DType,
    lengths: Vec<i32>,
    documents: Vec<u64>,
}

fn partial(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}

impl IndexedWriter {
    /// Starts `PREFIX.bin` and `PREFIX.idx` with tokens stored as `dtype`.
    pub fn create(prefix: impl AsRef<Path>, dtype: DType) -> Result<IndexedWriter> {
        let prefix = prefix.as_ref().to_path_buf();
        let bin = partial(&paths(&prefix).1);
        let file = File::create(&bin).map_err(|e| Error::io(&bin, e))?;
        Ok(IndexedWriter {
            prefix,
            bin: BufWriter::new(file),
            dtype,
            lengths: Vec::new(),
            documents: vec![0],
        })
    }

    /// Appends one sequence (a document, or a sentence of one).
    pub fn add_sequence(&mut self, tokens: &[u32]) -> Result<()> {
        let too_large = tokens.iter().find(|&&t| u64::from(t) > self.dtype.max());
        if let Some(token) = too_large {
            return Err(Error::Invalid(format!(
                "token {token} does not fit the dataset's {:?} tokens: create it with a \
                 wider type (DType::for_vocabulary of the vocabulary's size)",
                self.dtype
            )));
        }
        let length = i32::try_from(tokens.len()).map_err(|_| {
            Error::Invalid(format!(
                "a sequence of {} tokens exceeds the format's i32 lengths",
                tokens.len()
            ))
        })?;
        let size = self.dtype.size();
        let mut bytes = Vec::with_capacity(tokens.len() * size);
        for &t in tokens {
            bytes.extend_from_slice(&u64::from(t).to_le_bytes()[..size]);
        }
        let path = partial(&paths(&self.prefix).1);
        self.bin.write_all(&bytes).map_err(|e| Error::io(path, e))?;
        self.lengths.push(length);
        Ok(())
    }

    /// Ends the current document after the sequences added since the last one ended.
    pub fn end_document(&mut self) {
        self.documents.push(self.lengths.len() as u64);
    }

    /// One document of one sequence.
    pub fn add_document(&mut self, tokens: &[u32]) -> Result<()> {
        self.add_sequence(tokens)?;
        self.end_document();
        Ok(())
    }

    /// Writes the index (ending an open document first) and renames both files into
    /// place.
    pub fn finish(mut self) -> Result<()> {
        if self.documents.last() != Some(&(self.lengths.len() as u64)) {
            self.end_document();
        }
        let (idx, bin) = paths(&self.prefix);
        let bin_partial = partial(&bin);
        self.bin.flush().map_err(|e| Error::io(&bin_partial, e))?;
        let mut index = Vec::with_capacity(HEADER + 12 * self.lengths.len());
        index.extend_from_slice(MAGIC);
        index.extend_from_slice(&1u64.to_le_bytes());
        index.push(self.dtype.code());
        index.extend_from_slice(&(self.lengths.len() as u64).to_le_bytes());
        index.extend_from_slice(&(self.documents.len() as u64).to_le_bytes());
        let mut pointer = 0u64;
        let mut pointers = Vec::with_capacity(8 * self.lengths.len());
        for &length in &self.lengths {
            index.extend_from_slice(&length.to_le_bytes());
            pointers.extend_from_slice(&pointer.to_le_bytes());
            pointer += length as u64 * self.dtype.size() as u64;
        }
        index.extend_from_slice(&pointers);
        for &d in &self.documents {
            index.extend_from_slice(&d.to_le_bytes());
        }
        let idx_partial = partial(&idx);
        std::fs::write(&idx_partial, &index).map_err(|e| Error::io(&idx_partial, e))?;
        std::fs::rename(&bin_partial, &bin).map_err(|e| Error::io(&bin, e))?;
        std::fs::rename(&idx_partial, &idx).map_err(|e| Error::io(&idx, e))
    }
}
