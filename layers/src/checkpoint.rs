//! Sharded checkpoints in the safetensors format, and conversion between
//! tensor-parallel sizes.
//!
//! A checkpoint of a model run with tensor-parallel size `n` is a directory with one file
//! per rank, `tp_{rank}_of_{n}.safetensors`. Each file holds that rank's part of every
//! parameter (f32, by parameter name) and, in the safetensors metadata, `tp_rank`,
//! `tp_size` and each parameter's [`Sharding`] in text form (`sharding.<name>` =
//! `replicated` or `split:<dim>:<full_len>`), so a checkpoint can be re-cut without the
//! model's code.
//!
//! An optimizer's state ([`ferrotron_tape::OptimizerState`]) is saved beside the weights in
//! `optim_tp_{rank}_of_{n}.safetensors`: each buffer is a tensor `<parameter>/<buffer>`
//! sharded like its parameter, so it is re-cut to another tensor-parallel size the same
//! way ([`save_optimizer_shard`], [`load_optimizer_state`]).
//!
//! Files are written to a temporary name, flushed to disk and renamed into place, so a
//! reader sees a whole file or the previous one, never a torn write, even after a crash;
//! they are read through a memory map.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use ferrotron_tape::{Optimizer, OptimizerState, ParamState, Parameter, Tensor};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::parallel::{Module, Sharding};

const SHARDING_PREFIX: &str = "sharding.";
/// Metadata key of the optimizer's step count.
const STEPS_KEY: &str = "optimizer_steps";
/// Metadata key prefix of each parameter's own update count.
const PARAM_STEPS_PREFIX: &str = "steps.";

/// The file of rank `tp_rank` in a checkpoint of tensor-parallel size `tp_size`.
pub fn shard_path(dir: &Path, tp_rank: usize, tp_size: usize) -> PathBuf {
    dir.join(format!("tp_{tp_rank}_of_{tp_size}.safetensors"))
}

/// The optimizer-state file of rank `tp_rank` beside [`shard_path`]'s.
pub fn optimizer_shard_path(dir: &Path, tp_rank: usize, tp_size: usize) -> PathBuf {
    dir.join(format!("optim_tp_{tp_rank}_of_{tp_size}.safetensors"))
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
    snapshot_shard(module, dir, tp_rank, tp_size)?.write()
}

/// [`save_shard`]'s file, its tensors copied to host memory now and written when
/// [`PendingFile::write`] is called (on another thread, while training goes on).
pub fn snapshot_shard(
    module: &dyn Module,
    dir: &Path,
    tp_rank: usize,
    tp_size: usize,
) -> Result<PendingFile> {
    let mut shard = Shard::default();
    for sharded in module.parameters() {
        let name = sharded.param.name().to_string();
        if shard
            .tensors
            .insert(name.clone(), (sharded.sharding, sharded.param.value()?))
            .is_some()
        {
            return Err(Error::checkpoint(
                dir,
                format!("two parameters are called '{name}'"),
            ));
        }
    }
    let path = shard_path(dir, tp_rank, tp_size);
    PendingFile::of(&shard, dir, &path, tp_rank, tp_size, HashMap::new())
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
        // Loaded values keep the parameter's storage format (bf16 stays bf16).
        let dtype = sharded.param.dtype();
        sharded.param.set_value(tensor.to_dtype(dtype)?)?;
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
    join_shards(&shards, |rank| shard_path(dir, rank, tp_size))
}

/// Every tensor of `shards` (rank order) joined into its full form.
fn join_shards(
    shards: &[Shard],
    path_of: impl Fn(usize) -> PathBuf,
) -> Result<BTreeMap<String, (Sharding, Tensor)>> {
    let mut full = BTreeMap::new();
    for (name, (sharding, _)) in &shards[0].tensors {
        let parts = shards
            .iter()
            .enumerate()
            .map(|(rank, shard)| match shard.tensors.get(name) {
                Some((s, tensor)) if s == sharding => Ok(tensor.clone()),
                _ => Err(Error::checkpoint(
                    path_of(rank),
                    format!("tensor '{name}' is missing or sharded differently than on rank 0"),
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        full.insert(name.clone(), (*sharding, sharding.unshard(&parts)?));
    }
    Ok(full)
}

/// Writes one rank's file.
pub fn write_shard(shard: &Shard, dir: &Path, tp_rank: usize, tp_size: usize) -> Result<()> {
    let path = shard_path(dir, tp_rank, tp_size);
    PendingFile::of(shard, dir, &path, tp_rank, tp_size, HashMap::new())?.write()
}

/// Reads one rank's file.
pub fn read_shard(path: &Path) -> Result<Shard> {
    Ok(read_file(path)?.0)
}

/// Writes this rank's part of `optimizer`'s state to
/// [`optimizer_shard_path`]`(dir, tp_rank, tp_size)`. The optimizer's parameters must be
/// `module`'s, in [`Module::parameters`] order, which gives each buffer its sharding.
pub fn save_optimizer_shard<O: Optimizer + ?Sized>(
    module: &dyn Module,
    optimizer: &O,
    dir: &Path,
    tp_rank: usize,
    tp_size: usize,
) -> Result<()> {
    let state = optimizer.state()?;
    save_optimizer_state(module, optimizer.params(), &state, dir, tp_rank, tp_size)
}

/// [`save_optimizer_shard`] from a state taken already: for optimizers whose
/// [`Optimizer::state`] is collective (ddp's distributed optimizer gathers its shards
/// over the data-parallel group), every rank takes the state and one of them writes it.
/// `optimizer_params` are the optimizer's parameters, which must be `module`'s in order.
pub fn save_optimizer_state(
    module: &dyn Module,
    optimizer_params: &[Parameter],
    state: &OptimizerState,
    dir: &Path,
    tp_rank: usize,
    tp_size: usize,
) -> Result<()> {
    snapshot_optimizer_state(module, optimizer_params, state, dir, tp_rank, tp_size)?.write()
}

/// [`save_optimizer_state`]'s file, copied to host memory now and written later (see
/// [`snapshot_shard`]).
pub fn snapshot_optimizer_state(
    module: &dyn Module,
    optimizer_params: &[Parameter],
    state: &OptimizerState,
    dir: &Path,
    tp_rank: usize,
    tp_size: usize,
) -> Result<PendingFile> {
    let path = optimizer_shard_path(dir, tp_rank, tp_size);
    let params = module.parameters();
    let same_params = params.len() == optimizer_params.len()
        && state.params.len() == params.len()
        && (params.iter().zip(optimizer_params)).all(|(a, b)| a.param.id() == b.id());
    if !same_params {
        return Err(Error::checkpoint(
            &path,
            "the optimizer's parameters are not the module's, in Module::parameters order",
        ));
    }
    let mut shard = Shard::default();
    let mut metadata = HashMap::from([(STEPS_KEY.to_string(), state.steps.to_string())]);
    for (sharded, entry) in params.iter().zip(&state.params) {
        let name = sharded.param.name();
        metadata.insert(
            format!("{PARAM_STEPS_PREFIX}{name}"),
            entry.steps.to_string(),
        );
        for (buffer, tensor) in &entry.buffers {
            let key = format!("{name}/{buffer}");
            shard
                .tensors
                .insert(key, (sharded.sharding, tensor.clone()));
        }
    }
    PendingFile::of(&shard, dir, &path, tp_rank, tp_size, metadata)
}

/// The optimizer state for this rank's parameters of `module` (tensor-parallel rank
/// `tp_rank` of `tp_size`), from a checkpoint saved at tensor-parallel size `saved_size`:
/// each buffer is joined from the saved parts and cut again like its parameter. Give it
/// to [`Optimizer::load_state`].
pub fn load_optimizer_state(
    module: &dyn Module,
    dir: &Path,
    saved_size: usize,
    tp_rank: usize,
    tp_size: usize,
) -> Result<OptimizerState> {
    load_optimizer_state_inner(module, &[dir], saved_size, (tp_rank, tp_size), true)
}

/// [`load_optimizer_state`] from a checkpoint split over several directories (the
/// pipeline stages of a run saved at another pipeline layout): each parameter's buffers
/// and counts come from whichever directory holds them, and the other stages' are left.
pub fn load_optimizer_state_across(
    module: &dyn Module,
    dirs: &[&Path],
    saved_size: usize,
    tp_rank: usize,
    tp_size: usize,
) -> Result<OptimizerState> {
    load_optimizer_state_inner(module, dirs, saved_size, (tp_rank, tp_size), false)
}

fn load_optimizer_state_inner(
    module: &dyn Module,
    dirs: &[&Path],
    saved_size: usize,
    (tp_rank, tp_size): (usize, usize),
    strict: bool,
) -> Result<OptimizerState> {
    let Some(dir) = dirs.first() else {
        return Err(Error::checkpoint(
            Path::new(""),
            "no checkpoint directory given",
        ));
    };
    if saved_size == 0 {
        return Err(Error::checkpoint(
            dir,
            "the saved tensor-parallel size must be positive",
        ));
    }
    let first = optimizer_shard_path(dir, 0, saved_size);
    let mut metadata = HashMap::new();
    let mut full = BTreeMap::new();
    for dir in dirs {
        let files = (0..saved_size)
            .map(|rank| read_file(&optimizer_shard_path(dir, rank, saved_size)))
            .collect::<Result<Vec<_>>>()?;
        metadata.extend(files[0].1.clone());
        let shards: Vec<Shard> = files.into_iter().map(|(shard, _)| shard).collect();
        full.extend(join_shards(&shards, |rank| {
            optimizer_shard_path(dir, rank, saved_size)
        })?);
    }
    let number = |key: &str| -> Result<u64> {
        metadata
            .get(key)
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| Error::checkpoint(&first, format!("no valid '{key}' in the metadata")))
    };
    let params = module
        .parameters()
        .iter()
        .map(|sharded| {
            let name = sharded.param.name();
            let prefix = format!("{name}/");
            let keys: Vec<String> = full
                .keys()
                .filter(|key| key.starts_with(&prefix))
                .cloned()
                .collect();
            let buffers = keys
                .into_iter()
                .filter_map(|key| full.remove_entry(&key))
                .map(|(key, (sharding, tensor))| {
                    let part = sharding.shard(&tensor, tp_rank, tp_size)?;
                    Ok((key[prefix.len()..].to_string(), part))
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(ParamState {
                steps: number(&format!("{PARAM_STEPS_PREFIX}{name}"))?,
                buffers,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some(stray) = full.keys().next().filter(|_| strict) {
        return Err(Error::checkpoint(
            &first,
            format!(
                "'{stray}' belongs to no parameter of the model; was it saved from another model?"
            ),
        ));
    }
    Ok(OptimizerState {
        steps: number(STEPS_KEY)?,
        params,
    })
}

/// A checkpoint file whose contents are in host memory, ready to write: what a save
/// copies synchronously (device tensors come back to the host once), so the write itself
/// can run beside training.
#[derive(Debug)]
pub struct PendingFile {
    dir: PathBuf,
    path: PathBuf,
    /// Name, shape and little-endian f32 bytes of each tensor.
    tensors: Vec<(String, Vec<usize>, Vec<u8>)>,
    metadata: HashMap<String, String>,
}

impl PendingFile {
    /// `shard` with its shardings, `tp_rank`/`tp_size` and `metadata` for the header,
    /// copied to host memory.
    fn of(
        shard: &Shard,
        dir: &Path,
        path: &Path,
        tp_rank: usize,
        tp_size: usize,
        mut metadata: HashMap<String, String>,
    ) -> Result<PendingFile> {
        metadata.insert("tp_rank".to_string(), tp_rank.to_string());
        metadata.insert("tp_size".to_string(), tp_size.to_string());
        let mut tensors = Vec::with_capacity(shard.tensors.len());
        for (name, (sharding, tensor)) in &shard.tensors {
            metadata.insert(format!("{SHARDING_PREFIX}{name}"), sharding.encode());
            let data: Vec<u8> = tensor
                .to_vec()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            tensors.push((name.clone(), tensor.shape().to_vec(), data));
        }
        Ok(PendingFile {
            dir: dir.to_path_buf(),
            path: path.to_path_buf(),
            tensors,
            metadata,
        })
    }

    /// Where it goes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes it: to a temporary file first, flushed to disk, renamed into place once
    /// complete.
    pub fn write(self) -> Result<()> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Io { path, source }
        };
        let path = &self.path;
        std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        let views = (self.tensors.iter())
            .map(|(name, shape, data)| {
                TensorView::new(Dtype::F32, shape.clone(), data).map(|view| (name.as_str(), view))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Error::checkpoint(path, e.to_string()))?;
        let mut temporary = path.as_os_str().to_owned();
        temporary.push(format!(".tmp-{}", std::process::id()));
        let temporary = PathBuf::from(temporary);
        safetensors::serialize_to_file(views, Some(self.metadata), &temporary)
            .map_err(|e| Error::checkpoint(&temporary, e.to_string()))?;
        // On disk before the name is: a crash after the rename never leaves a torn file.
        (std::fs::File::open(&temporary).and_then(|file| file.sync_all()))
            .map_err(io(&temporary))?;
        std::fs::rename(&temporary, path).map_err(io(path))?;
        // The rename itself is on disk once the directory is.
        (std::fs::File::open(&self.dir).and_then(|dir| dir.sync_all())).map_err(io(&self.dir))
    }
}

/// Reads a file written by [`PendingFile::write`]: its tensors with their shardings, and the
/// header's metadata.
fn read_file(path: &Path) -> Result<(Shard, HashMap<String, String>)> {
    let file = std::fs::File::open(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: the map is only read, and checkpoint files are never modified in place:
    // writers rename a new file over the old one, which leaves this mapping intact.
    let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| Error::Io {
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
    Ok((shard, metadata))
}
