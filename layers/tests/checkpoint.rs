//! Sharded safetensors checkpoints: save/load round trips, conversion TP=4 → 2 → 1
//! (with uneven splits) that reproduces the serial model's parameters exactly, and
//! optimizer state that resumes bit-identically at the same or another TP size.

mod common;

use std::path::PathBuf;

use common::{tp_context, AnyResult};
use ferrotron_comm_core::run_local;
use ferrotron_layers::checkpoint::{
    convert_checkpoint, load_optimizer_state, load_shard, optimizer_shard_path,
    read_full_checkpoint, save_optimizer_shard, save_shard,
};
use ferrotron_layers::{BlockConfig, MasterInit, Module, TransformerBlock};
use ferrotron_tape::{AdamW, AdamWConfig, Optimizer};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("layers-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn config() -> BlockConfig {
    BlockConfig {
        ffn_hidden: 18,
        ..BlockConfig::new(8, 4)
    }
}

/// Every parameter of a block on `tp` ranks, joined to full tensors, by name.
fn full_values(tp_size: usize, init: &MasterInit) -> AnyResult<Vec<(String, Vec<f32>)>> {
    let ranks = run_local(tp_size, |comm| -> AnyResult<_> {
        let tp = tp_context(comm, false);
        let block = TransformerBlock::new(&tp, "b", &config(), init)?;
        Ok(common::values_of(&block)?)
    })?;
    let mut out = Vec::new();
    for (index, (name, sharding, _)) in ranks[0].iter().enumerate() {
        let parts: Vec<_> = ranks.iter().map(|r| r[index].2.clone()).collect();
        out.push((name.clone(), sharding.unshard(&parts)?.to_vec()?));
    }
    Ok(out)
}

#[test]
fn save_then_load_restores_every_shard() -> AnyResult<()> {
    let dir = scratch("roundtrip");
    let saved = MasterInit::new(1, 0.5).with_bias_std(0.1);
    run_local(2, |comm| -> AnyResult<()> {
        let tp = tp_context(comm, false);
        let block = TransformerBlock::new(&tp, "b", &config(), &saved)?;
        save_shard(&block, &dir, tp.rank(), tp.size())?;
        let other = TransformerBlock::new(&tp, "b", &config(), &MasterInit::new(2, 0.5))?;
        load_shard(&other, &dir, tp.rank(), tp.size())?;
        for (a, b) in block.parameters().iter().zip(other.parameters()) {
            assert_eq!(
                a.param.value()?.to_vec()?,
                b.param.value()?.to_vec()?,
                "{}",
                a.param.name()
            );
        }
        Ok(())
    })?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn converting_4_to_2_to_1_gives_the_serial_model() -> AnyResult<()> {
    let (dir4, dir2, dir1) = (scratch("tp4"), scratch("tp2"), scratch("tp1"));
    let init = MasterInit::new(9, 0.5).with_bias_std(0.1);
    run_local(4, |comm| -> AnyResult<()> {
        let tp = tp_context(comm, false);
        let block = TransformerBlock::new(&tp, "b", &config(), &init)?;
        save_shard(&block, &dir4, tp.rank(), tp.size()).map_err(anyhow::Error::from)
    })?;
    convert_checkpoint(&dir4, 4, &dir2, 2)?;
    convert_checkpoint(&dir2, 2, &dir1, 1)?;
    // Load the converted TP=2 checkpoint into a TP=2 model built from other weights.
    let loaded2 = run_local(2, |comm| -> AnyResult<_> {
        let tp = tp_context(comm, false);
        let block = TransformerBlock::new(&tp, "b", &config(), &MasterInit::new(0, 1.0))?;
        load_shard(&block, &dir2, tp.rank(), tp.size())?;
        Ok(common::values_of(&block)?)
    })?;
    let serial = full_values(1, &init)?;
    let tp2_serial = full_values(2, &init)?;
    assert_eq!(serial, tp2_serial);
    for (index, (name, values)) in serial.iter().enumerate() {
        let (_, sharding, _) = &loaded2[0][index];
        let parts: Vec<_> = loaded2.iter().map(|r| r[index].2.clone()).collect();
        assert_eq!(
            &sharding.unshard(&parts)?.to_vec()?,
            values,
            "{name} after 4 → 2"
        );
    }
    let full1 = read_full_checkpoint(&dir1, 1)?;
    for (name, values) in &serial {
        assert_eq!(&full1[name].1.to_vec()?, values, "{name} after 4 → 2 → 1");
    }
    for dir in [dir4, dir2, dir1] {
        std::fs::remove_dir_all(dir)?;
    }
    Ok(())
}

#[test]
fn loading_into_a_mismatched_model_is_an_error() -> AnyResult<()> {
    let dir = scratch("mismatch");
    let init = MasterInit::new(1, 0.5);
    run_local(2, |comm| -> AnyResult<()> {
        let tp = tp_context(comm, false);
        let block = TransformerBlock::new(&tp, "b", &config(), &init)?;
        save_shard(&block, &dir, tp.rank(), tp.size())?;
        let wider = TransformerBlock::new(&tp, "b", &BlockConfig::new(8, 4), &init)?;
        assert!(matches!(
            load_shard(&wider, &dir, tp.rank(), tp.size()),
            Err(ferrotron_layers::Error::Checkpoint { .. })
        ));
        assert!(matches!(
            load_shard(&block, &dir, tp.rank(), 4),
            Err(ferrotron_layers::Error::Io { .. })
        ));
        Ok(())
    })?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// One AdamW step on `block` with a gradient computed elementwise from each value, so
/// every tensor-parallel size updates each element of the full model identically.
fn adamw_step(block: &TransformerBlock, optimizer: &mut AdamW) -> AnyResult<()> {
    for sharded in block.parameters() {
        let value = sharded.param.value()?;
        let grad = value.mul(&value)?.sub(&value.scale(0.1)?)?;
        sharded.param.set_grad(Some(grad))?;
    }
    Ok(optimizer.step()?)
}

fn adamw(block: &TransformerBlock) -> ferrotron_tape::Result<AdamW> {
    let params = block.parameters().into_iter().map(|p| p.param).collect();
    AdamW::new(params, AdamWConfig::default())
}

#[test]
fn optimizer_state_resumes_exactly_at_the_same_and_another_tp_size() -> AnyResult<()> {
    let dir = scratch("optimizer");
    let init = MasterInit::new(3, 0.5).with_bias_std(0.1);
    // Two steps at TP 2, save, then the third step: the reference.
    let continued = run_local(2, |comm| -> AnyResult<_> {
        let tp = tp_context(comm, false);
        let block = TransformerBlock::new(&tp, "b", &config(), &init)?;
        let mut optimizer = adamw(&block)?;
        adamw_step(&block, &mut optimizer)?;
        adamw_step(&block, &mut optimizer)?;
        save_shard(&block, &dir, tp.rank(), tp.size())?;
        save_optimizer_shard(&block, &optimizer, &dir, tp.rank(), tp.size())?;
        adamw_step(&block, &mut optimizer)?;
        Ok(common::values_of(&block)?)
    })?;
    // Resume into models built from other weights, at TP 2 and at TP 1.
    let resume = |tp_size: usize| {
        run_local(tp_size, |comm| -> AnyResult<_> {
            let tp = tp_context(comm, false);
            let block = TransformerBlock::new(&tp, "b", &config(), &MasterInit::new(8, 1.0))?;
            let full = read_full_checkpoint(&dir, 2)?;
            for sharded in block.parameters() {
                let (sharding, tensor) = &full[sharded.param.name()];
                sharded
                    .param
                    .set_value(sharding.shard(tensor, tp.rank(), tp.size())?)?;
            }
            let mut optimizer = adamw(&block)?;
            let state = load_optimizer_state(&block, &dir, 2, tp.rank(), tp.size())?;
            assert_eq!(state.steps, 2);
            optimizer.load_state(&state)?;
            adamw_step(&block, &mut optimizer)?;
            Ok(common::values_of(&block)?)
        })
    };
    assert_eq!(
        format!("{:?}", resume(2)?),
        format!("{continued:?}"),
        "TP 2 → TP 2 resume must be bit-identical"
    );
    let serial = resume(1)?;
    for (index, (name, sharding, value)) in serial[0].iter().enumerate() {
        let parts: Vec<_> = continued.iter().map(|r| r[index].2.clone()).collect();
        assert_eq!(
            value.to_vec()?,
            sharding.unshard(&parts)?.to_vec()?,
            "{name} at TP 1"
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn optimizer_state_of_another_model_is_an_error() -> AnyResult<()> {
    let dir = scratch("optimizer-mismatch");
    let init = MasterInit::new(1, 0.5);
    run_local(1, |comm| -> AnyResult<()> {
        let tp = tp_context(comm, false);
        let block = TransformerBlock::new(&tp, "b", &config(), &init)?;
        let mut optimizer = adamw(&block)?;
        adamw_step(&block, &mut optimizer)?;
        save_optimizer_shard(&block, &optimizer, &dir, 0, 1)?;
        let other = TransformerBlock::new(&tp, "other", &config(), &init)?;
        assert!(matches!(
            load_optimizer_state(&other, &dir, 1, 0, 1),
            Err(ferrotron_layers::Error::Checkpoint { .. })
        ));
        // An optimizer over other parameters cannot be saved as this module's.
        assert!(matches!(
            save_optimizer_shard(&other, &optimizer, &dir, 0, 1),
            Err(ferrotron_layers::Error::Checkpoint { .. })
        ));
        // A torn file (as a crash in the middle of a write would leave without the
        // rename) is reported, not misread.
        let path = optimizer_shard_path(&dir, 0, 1);
        let bytes = std::fs::read(&path)?;
        std::fs::write(&path, &bytes[..bytes.len() / 2])?;
        assert!(matches!(
            load_optimizer_state(&block, &dir, 1, 0, 1),
            Err(ferrotron_layers::Error::Checkpoint { .. })
        ));
        Ok(())
    })?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
