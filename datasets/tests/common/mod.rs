#![allow(dead_code)]

use ferrotron_datasets::{DType, IndexedWriter};
use std::path::PathBuf;

/// A fresh directory for `name`, unique to this test process.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("datasets-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A dataset of one-sequence documents of `sizes` tokens, token `j` of document `d`
/// being `1000 · d + j`, so that a sample says where each of its tokens came from.
pub fn numbered(name: &str, sizes: &[usize]) -> PathBuf {
    let prefix = scratch(name).join("numbered");
    let mut writer = IndexedWriter::create(&prefix, DType::U16).unwrap();
    for (d, &size) in sizes.iter().enumerate() {
        let tokens: Vec<u32> = (0..size as u32).map(|j| 1000 * d as u32 + j).collect();
        writer.add_document(&tokens).unwrap();
    }
    writer.finish().unwrap();
    prefix
}
