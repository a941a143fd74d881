//! The replay (the executor driven by `teraio run`'s emulated trainer) runs a small generated training iteration on a simulated array, with
//! emulated GPU memory smaller than the iteration needs, and agrees with the simulator.

use std::sync::Arc;

use teraio_engine::array::{ArrayConfig, DeviceArray, Target};
use teraio_engine::backend::sim::SimDisk;
use teraio_engine::pool::BufferPool;
use teraio_engine::replay::{ReplayConfig, replay};
use teraio_engine::store::{StoreConfig, TensorStore};
use teraio_engine::tier::HostTier;
use teraio_scheduler::{Hardware, ModelConfig, Policy, SimOptions, generate, plan, simulate};
use teraio_tests::small_gpt;

#[test]
fn replay_executes_the_plan_and_verifies_every_tensor_that_comes_back() {
    let trace = small_gpt(2, Some(400_000.0));
    let peak = trace.resident_memory_per_kernel().into_iter().max().unwrap();
    let mut hw = Hardware::dev();
    hw.gpu_memory_bytes = peak * 3 / 4;
    let p = plan(&trace, &hw, Policy::Teraio).unwrap();
    assert!(!p.instructions.is_empty(), "memory is squeezed: the plan must move tensors");
    let sim = simulate(&trace, &p, &hw, &SimOptions::default()).unwrap();

    let disks: Vec<Arc<SimDisk>> = (0..4).map(|i| SimDisk::new(256 << 20, 4096, i)).collect();
    let array =
        DeviceArray::open(ArrayConfig::new(disks.iter().map(|d| Target::Sim(d.clone())).collect()))
            .unwrap();
    let mut scfg = StoreConfig::new(array);
    scfg.retain_on_prefetch = true;
    let store = Arc::new(TensorStore::open(scfg).unwrap());
    let backing: u64 =
        trace.tensors.iter().map(|t| BufferPool::capacity_for(t.bytes as usize) as u64).sum();
    let gpu = HostTier::new("emulated-gpu", backing + (64 << 20)).unwrap();
    let cfg = ReplayConfig { gpu_capacity_bytes: hw.gpu_memory_bytes, ..ReplayConfig::default() };
    let mut calls = 0usize;
    let report = replay(&trace, &p, &store, gpu, &cfg, &mut |_| calls += 1).unwrap();

    assert_eq!(calls, 2 * trace.kernels.len(), "progress before every kernel of both iterations");
    assert!(report.peak_gpu_bytes <= hw.gpu_memory_bytes, "never above the emulated capacity");
    assert!(report.prefetches > 0 && report.offloads > 0);
    let planned_drops = p.instructions.iter().filter(|i| i.is_clean_drop()).count() as u64;
    assert!(planned_drops > 0, "the generator marks writes, so unchanged weights can be dropped");
    assert_eq!(
        report.clean_drops, planned_drops,
        "in steady state every planned drop writes nothing"
    );
    assert!(report.verified_tensors >= report.prefetches - report.kept_copies);
    assert!(report.verified_bytes > 0);
    assert!(report.iteration_time_s >= report.kernel_time_s * 0.99);
    assert!(report.store.ssd_write.bytes + report.store.host_write.bytes > 0);
    // The store is left empty.
    assert!(store.tensors().is_empty(), "{} tensors left", store.tensors().len());
    assert!(sim.iteration_time_us > 0.0);
}

#[test]
fn replay_refuses_a_plan_for_another_trace() {
    let trace = small_gpt(2, Some(400_000.0));
    let mut c = ModelConfig::preset("gpt2-replay").unwrap();
    c.layers = 1;
    let other = generate(&c).unwrap();
    let p = plan(&other, &Hardware::dev(), Policy::Ideal).unwrap();
    let disks: Vec<Arc<SimDisk>> = (0..1).map(|i| SimDisk::new(64 << 20, 4096, i)).collect();
    let array =
        DeviceArray::open(ArrayConfig::new(disks.iter().map(|d| Target::Sim(d.clone())).collect()))
            .unwrap();
    let store = Arc::new(TensorStore::open(StoreConfig::new(array)).unwrap());
    let gpu = HostTier::new("emulated-gpu", 1 << 30).unwrap();
    let err = replay(&trace, &p, &store, gpu, &ReplayConfig::default(), &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("does not fit the trace"), "{err}");
}
