//! Sharded checkpoints in the safetensors format, and conversion between
//! tensor-parallel sizes.
//!
//! A checkpoint of a model run with tensor-parallel size `n` is a directory with one file
//! per rank, `tp_{rank}_of_{n}.safetensors`. Each file holds that rank's part of every
//! parameter (f32, by parameter name) and, in the safetensors metadata, `tp_rank`,
//! `tp_size` and each parameter's [`Sharding`] in text form (`sharding.<name>` =
//! `replicated` or `split:<dim>:<full_len>`), so a checkpoint can be re-cut without the
//! model's code.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use tape::Tensor;

use crate::error::{Error, Result};
use crate::parallel::{Module, Sharding};

const SHARDING_PREFIX: &str = "sharding.";

/// The file of rank `tp_rank` in a checkpoint of tensor-parallel size `tp_size`.
pub fn shard_path(dir: &Path, tp_rank: usize, tp_size: usize) -> PathBuf {
    dir.join(format!("tp_{tp_rank}_of_{tp_size}.safetensors"))
}

/// One rank's file: its parameter parts with their shardings.
#[derive(Debug, Clone, Default)]
pub struct Shard {
    /// Parameter parts by name, with how the full parameter is divided.
    pub tensors: BTreeMap<String, (Sharding, Tensor)>,
}

/// Writes this rank's parameters of `module` to [`shard_path`]`(dir, tp_rank, tp_size)`,
/// creating `dir` if needed.
pub fn save_shard(module: &dyn Module, dir: &Path, tp_rank: usize, tp_size: usize) -> Result<()> {
    let mut shard = Shard::default();
    for sharded in module.parameters() {
        let name = sharded.param.name().to_string();
        if shard
            .tensors
            .insert(name.clone(), (sharded.sharding, sharded.param.value()))
            .is_some()
        {
            return Err(Error::checkpoint(
                dir,
                format!("two parameters are called '{name}'"),
            ));
        }
    }
    write_shard(&shard, dir, tp_rank, tp_size)
}

/// Loads this rank's parameters of `module` from [`shard_path`]`(dir, tp_rank, tp_size)`;
/// every parameter must be there with this rank's shape and sharding.
pub fn load_shard(module: &dyn Module, dir: &Path, tp_rank: usize, tp_size: usize) -> Result<()> {
    let path = shard_path(dir, tp_rank, tp_size);
    let shard = read_shard(&path)?;
    for sharded in module.parameters() {
        let name = sharded.param.name();
        let Some((sharding, tensor)) = shard.tensors.get(name) else {
            return Err(Error::checkpoint(&path, format!("no parameter '{name}'")));
        };
        if *sharding != sharded.sharding || tensor.shape() != sharded.param.shape().as_slice() {
            return Err(Error::checkpoint(
                &path,
                format!(
                    "parameter '{name}' is {:?} {}, the model's is {:?} {}",
                    tensor.shape(),
                    sharding.encode(),
                    sharded.param.shape(),
                    sharded.sharding.encode()
                ),
            ));
        }
        sharded.param.set_value(tensor.clone())?;
    }
    Ok(())
}

/// Re-cuts the checkpoint of tensor-parallel size `from_size` in `from_dir` into one of
/// size `to_size` in `to_dir` (e.g. 4 → 2 → 1): parts are joined into full tensors and
/// split again by the same rule as the layers use.
pub fn convert_checkpoint(
    from_dir: &Path,
    from_size: usize,
    to_dir: &Path,
    to_size: usize,
) -> Result<()> {
    if to_size == 0 {
        return Err(Error::checkpoint(
            to_dir,
            "the target size must be positive",
        ));
    }
    let full = read_full_checkpoint(from_dir, from_size)?;
    for rank in 0..to_size {
        let mut shard = Shard::default();
        for (name, (sharding, tensor)) in &full {
            let part = sharding.shard(tensor, rank, to_size)?;
            shard.tensors.insert(name.clone(), (*sharding, part));
        }
        write_shard(&shard, to_dir, rank, to_size)?;
    }
    Ok(())
}

/// The full (serial) parameters of a checkpoint of tensor-parallel size `tp_size`.
pub fn read_full_checkpoint(
    dir: &Path,
    tp_size: usize,
) -> Result<BTreeMap<String, (Sharding, Tensor)>> {
    if tp_size == 0 {
        return Err(Error::checkpoint(
            dir,
            "the tensor-parallel size must be positive",
        ));
    }
    let shards = (0..tp_size)
        .map(|rank| read_shard(&shard_path(dir, rank, tp_size)))
        .collect::<Result<Vec<_>>>()?;
    let mut full = BTreeMap::new();
    for (name, (sharding, _)) in &shards[0].tensors {
        let parts = shards
            .iter()
            .enumerate()
            .map(|(rank, shard)| match shard.tensors.get(name) {
                Some((s, tensor)) if s == sharding => Ok(tensor.clone()),
                _ => Err(Error::checkpoint(
                    shard_path(dir, rank, tp_size),
                    format!("parameter '{name}' is missing or sharded differently than on rank 0"),
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        full.insert(name.clone(), (*sharding, sharding.unshard(&parts)?));
    }
    Ok(full)
}

/// Writes one rank's file.
pub fn write_shard(shard: &Shard, dir: &Path, tp_rank: usize, tp_size: usize) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let path = shard_path(dir, tp_rank, tp_size);
    let mut metadata = HashMap::new();
    metadata.insert("tp_rank".to_string(), tp_rank.to_string());
    metadata.insert("tp_size".to_string(), tp_size.to_string());
    let mut bytes = Vec::with_capacity(shard.tensors.len());
    for (name, (sharding, tensor)) in &shard.tensors {
        metadata.insert(format!("{SHARDING_PREFIX}{name}"), sharding.encode());
        let data: Vec<u8> = tensor
            .to_vec()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        bytes.push((name.as_str(), tensor.shape().to_vec(), data));
    }
    let views = bytes
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(Dtype::F32, shape.clone(), data).map(|view| (*name, view))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::checkpoint(&path, e.to_string()))?;
    safetensors::serialize_to_file(views, Some(metadata), &path)
        .map_err(|e| Error::checkpoint(&path, e.to_string()))
}

/// Reads one rank's file.
pub fn read_shard(path: &Path) -> Result<Shard> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let bad = |reason: String| Error::checkpoint(path, reason);
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let tensors = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let mut shard = Shard::default();
    for (name, view) in tensors.iter() {
        if view.dtype() != Dtype::F32 {
            return Err(bad(format!(
                "tensor '{name}' is {:?}, not F32",
                view.dtype()
            )));
        }
        let sharding = metadata
            .get(&format!("{SHARDING_PREFIX}{name}"))
            .and_then(|text| Sharding::decode(text))
            .ok_or_else(|| bad(format!("no valid sharding recorded for '{name}'")))?;
        let values = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let tensor = Tensor::from_vec(values, view.shape())?;
        shard.tensors.insert(name.to_string(), (sharding, tensor));
    }
    Ok(shard)
}
