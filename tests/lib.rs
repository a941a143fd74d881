//! Cross-crate integration tests live in `tests/tests/`; what several of them share is here.

use std::sync::Arc;

use teraio_engine::array::{ArrayConfig, DeviceArray, Target};
use teraio_engine::backend::sim::SimDisk;
use teraio_engine::store::{StoreConfig, TensorStore};
use teraio_engine::tier::{HostTier, MemoryTier};
use teraio_scheduler::{ModelConfig, Trace, generate};

/// A small generated GPT iteration (the `gpt2-replay` preset cut down: hidden 256, 4 heads,
/// sequence 128, micro-batch 2) with `layers` layers, scaled to `iteration_us` when given.
pub fn small_gpt(layers: u32, iteration_us: Option<f64>) -> Trace {
    let mut c = ModelConfig::preset("gpt2-replay").expect("a preset");
    c.layers = layers;
    c.hidden = 256;
    c.heads = 4;
    c.kv_heads = 4;
    c.ffn = 1024;
    c.vocab = 8192;
    c.seq_len = 128;
    c.micro_batch = 2;
    c.target_iteration_us = iteration_us;
    generate(&c).expect("the generator takes the preset")
}

/// A retaining tensor store over `disks` simulated disks of `disk_bytes` each (4 KiB blocks),
/// with a host tier of `host_bytes` (0: none). `prepare` runs on the disks before the array
/// opens (a fault to inject, a throughput to set).
pub fn sim_store(
    disks: usize,
    disk_bytes: u64,
    host_bytes: u64,
    prepare: impl Fn(&SimDisk),
) -> (Vec<Arc<SimDisk>>, Arc<TensorStore>) {
    let disks: Vec<Arc<SimDisk>> =
        (0..disks as u64).map(|i| SimDisk::new(disk_bytes, 4096, i)).collect();
    disks.iter().for_each(|d| prepare(d));
    let array =
        DeviceArray::open(ArrayConfig::new(disks.iter().map(|d| Target::Sim(d.clone())).collect()))
            .expect("an array over simulated disks");
    let mut scfg = StoreConfig::new(array);
    scfg.retain_on_prefetch = true;
    if host_bytes > 0 {
        let tier = HostTier::new("host", host_bytes).expect("a host tier");
        scfg.host_tier = Some(tier as Arc<dyn MemoryTier>);
    }
    (disks, Arc::new(TensorStore::open(scfg).expect("a store over simulated disks")))
}
