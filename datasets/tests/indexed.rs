//! The `.idx`/`.bin` format: what is written reads back, files written by Megatron-LM's
//! own writer and by a small independent writer of the published layout read here, and
//! damaged files are typed errors that name the file. (Megatron-LM's reader, run on a
//! file `preprocess` wrote, reads every sequence back; the book has the record.)

mod common;

use common::scratch;
use ferrotron_datasets::{paths, DType, Error, IndexedDataset, IndexedWriter};
use std::path::Path;

#[test]
fn written_datasets_read_back_in_every_token_type() {
    for (dtype, largest) in [
        (DType::U8, 255),
        (DType::I8, 127),
        (DType::I16, 32767),
        (DType::U16, 65535),
        (DType::I32, 1 << 30),
        (DType::I64, u32::MAX),
    ] {
        let prefix = scratch(&format!("{dtype:?}")).join("data");
        let documents: Vec<Vec<Vec<u32>>> = vec![
            vec![vec![1, 2, 3], vec![largest]],
            vec![vec![]],
            vec![vec![0, largest, 7, 7, 7]],
        ];
        let mut writer = IndexedWriter::create(&prefix, dtype).unwrap();
        for document in &documents {
            for sentence in document {
                writer.add_sequence(sentence).unwrap();
            }
            writer.end_document();
        }
        writer.finish().unwrap();
        let dataset = IndexedDataset::open(&prefix).unwrap();
        assert_eq!(dataset.dtype(), dtype);
        assert_eq!(dataset.len(), 4);
        assert_eq!(dataset.document_indices(), [0, 2, 3, 4]);
        let sequences: Vec<Vec<u32>> = (0..4).map(|i| dataset.sequence(i).unwrap()).collect();
        assert_eq!(sequences, documents.concat());
        let mut part = Vec::new();
        dataset.read(3, 1, 2, &mut part).unwrap();
        assert_eq!(part, [largest, 7]);
        assert!(matches!(
            dataset.read(3, 4, 2, &mut part),
            Err(Error::Invalid(_))
        ));
        let overflowing = dataset.read(3, 1, usize::MAX, &mut part);
        assert!(matches!(overflowing, Err(Error::Invalid(_))));
        assert_eq!(dataset.sequence_length(3), Some(5));
        assert_eq!(dataset.sequence_length(4), None);
        assert!(matches!(dataset.sequence(4), Err(Error::Invalid(_))));
    }
}

#[test]
fn a_token_too_large_for_the_type_is_refused() {
    let prefix = scratch("narrow").join("data");
    let mut writer = IndexedWriter::create(&prefix, DType::U16).unwrap();
    let err = writer.add_document(&[1, 70_000]).unwrap_err();
    assert!(err.to_string().contains("70000"), "{err}");
    assert_eq!(DType::for_vocabulary(50_257), DType::U16);
    assert_eq!(DType::for_vocabulary(128_256), DType::I32);
}

/// The published layout written out by hand: magic, version 1, type code, counts, i32
/// lengths, i64 byte offsets, i64 document boundaries; the tokens back to back.
fn write_by_hand(prefix: &Path, code: u8, size: usize, sequences: &[&[i64]], boundaries: &[i64]) {
    let (idx, bin) = paths(prefix);
    let mut index = b"MMIDIDX\x00\x00".to_vec();
    index.extend(1u64.to_le_bytes());
    index.push(code);
    index.extend((sequences.len() as u64).to_le_bytes());
    index.extend((boundaries.len() as u64).to_le_bytes());
    for s in sequences {
        index.extend((s.len() as i32).to_le_bytes());
    }
    let mut offset = 0i64;
    for s in sequences {
        index.extend(offset.to_le_bytes());
        offset += (s.len() * size) as i64;
    }
    for b in boundaries {
        index.extend(b.to_le_bytes());
    }
    let data: Vec<u8> = sequences
        .iter()
        .flat_map(|s| s.iter().flat_map(|t| t.to_le_bytes()[..size].to_vec()))
        .collect();
    std::fs::write(idx, index).unwrap();
    std::fs::write(bin, data).unwrap();
}

#[test]
fn a_file_in_the_published_layout_reads() {
    let prefix = scratch("by-hand").join("data");
    // i32 tokens (code 4), three documents of one, two and one sentences.
    write_by_hand(
        &prefix,
        4,
        4,
        &[&[50256], &[1, 2], &[3], &[9, 8, 7]],
        &[0, 1, 3, 4],
    );
    let dataset = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(dataset.dtype(), DType::I32);
    assert_eq!(dataset.document_indices(), [0, 1, 3, 4]);
    assert_eq!(dataset.sequence(0).unwrap(), [50256]);
    assert_eq!(dataset.sequence(3).unwrap(), [9, 8, 7]);
}

#[test]
fn damaged_files_are_typed_errors_naming_the_file() {
    let dir = scratch("damaged");
    let good = dir.join("good");
    write_by_hand(&good, 8, 2, &[&[1, 2, 3], &[4, 5]], &[0, 2]);
    let (idx, bin) = paths(&good);
    let copy = |name: &str, idx_bytes: Vec<u8>, bin_bytes: Vec<u8>| {
        let prefix = dir.join(name);
        let (i, b) = paths(&prefix);
        std::fs::write(i, idx_bytes).unwrap();
        std::fs::write(b, bin_bytes).unwrap();
        prefix
    };
    let (index, data) = (std::fs::read(&idx).unwrap(), std::fs::read(&bin).unwrap());

    let short_bin = copy("short-bin", index.clone(), data[..data.len() - 1].to_vec());
    match IndexedDataset::open(&short_bin) {
        Err(Error::Truncated {
            path,
            needed: 10,
            found: 9,
            ..
        }) => {
            assert_eq!(path, paths(&short_bin).1)
        }
        other => panic!("{:?}", other.err()),
    }
    let mut magic = index.clone();
    magic[0] = b'X';
    let bad_magic = copy("bad-magic", magic, data.clone());
    let err = IndexedDataset::open(&bad_magic).err().unwrap();
    assert!(matches!(&err, Error::Format { path, .. } if *path == paths(&bad_magic).0));
    assert!(err.to_string().contains("magic"), "{err}");

    let mut version = index.clone();
    version[9] = 2;
    let err = IndexedDataset::open(copy("version", version, data.clone()))
        .err()
        .unwrap();
    assert!(err.to_string().contains("version 2"), "{err}");

    let mut float = index.clone();
    float[17] = 7;
    let err = IndexedDataset::open(copy("float", float, data.clone()))
        .err()
        .unwrap();
    assert!(err.to_string().contains("not an integer type"), "{err}");

    let mut negative = index.clone();
    negative[34..38].copy_from_slice(&(-3i32).to_le_bytes());
    let err = IndexedDataset::open(copy("negative", negative, data.clone()))
        .err()
        .unwrap();
    assert!(err.to_string().contains("negative length"), "{err}");

    let short_idx = copy("short-idx", index[..index.len() - 3].to_vec(), data.clone());
    assert!(matches!(
        IndexedDataset::open(short_idx),
        Err(Error::Truncated { .. })
    ));
    let missing = IndexedDataset::open(dir.join("nothing")).err().unwrap();
    assert!(matches!(missing, Error::Io { .. }));
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

/// Files written by Megatron-LM's `IndexedDatasetBuilder` (commit 00caa53, NumPy 2.4.6):
/// documents `[1, 2, 3]`, `[65535, 7] [8]` (two sentences) and `[0, 9, 9, 9, 9]`, in
/// `uint16`; and the same in `int32` with 100000 for the 0.
const MEGATRON_U16: (&str, &str) = (
    "4d4d494449445800000100000000000000080400000000000000040000000000000003000000020000000100\
     000005000000000000000000000006000000000000000a000000000000000c00000000000000000000000000\
     0000010000000000000003000000000000000400000000000000",
    "010002000300ffff0700080000000900090009000900",
);
const MEGATRON_I32: (&str, &str) = (
    "4d4d494449445800000100000000000000040400000000000000040000000000000003000000020000000100\
     00000500000000000000000000000c0000000000000014000000000000001800000000000000000000000000\
     0000010000000000000003000000000000000400000000000000",
    "010000000200000003000000ffff00000700000008000000a086010009000000090000000900000009000000",
);

#[test]
fn files_megatrons_writer_wrote_read_here() {
    for (name, (idx, bin), dtype, first) in [
        ("u16", MEGATRON_U16, DType::U16, 0),
        ("i32", MEGATRON_I32, DType::I32, 100_000),
    ] {
        let prefix = scratch(&format!("megatron-{name}")).join("data");
        let (i, b) = paths(&prefix);
        std::fs::write(i, unhex(idx)).unwrap();
        std::fs::write(b, unhex(bin)).unwrap();
        let dataset = IndexedDataset::open(&prefix).unwrap();
        assert_eq!(dataset.dtype(), dtype);
        assert_eq!(dataset.document_indices(), [0, 1, 3, 4]);
        let sequences: Vec<Vec<u32>> = (0..4).map(|s| dataset.sequence(s).unwrap()).collect();
        assert_eq!(
            sequences,
            [
                vec![1, 2, 3],
                vec![65535, 7],
                vec![8],
                vec![first, 9, 9, 9, 9]
            ]
        );
        // And what this crate writes for the same documents is the same bytes.
        let ours = scratch(&format!("ours-{name}")).join("data");
        let mut writer = IndexedWriter::create(&ours, dtype).unwrap();
        writer.add_document(&[1, 2, 3]).unwrap();
        writer.add_sequence(&[65535, 7]).unwrap();
        writer.add_sequence(&[8]).unwrap();
        writer.end_document();
        writer.add_document(&[first, 9, 9, 9, 9]).unwrap();
        writer.finish().unwrap();
        let (oi, ob) = paths(&ours);
        assert_eq!(std::fs::read(oi).unwrap(), unhex(idx), "{name} index");
        assert_eq!(std::fs::read(ob).unwrap(), unhex(bin), "{name} data");
    }
}
