//! Faults while the replay runs training iterations (`replay::replay` on simulated disks):
//! out of space, EIO on one device, short transfers, corrupt bytes on disk, a device 10x slower,
//! each injected at seeded points of an iteration. Whatever happens, no tensor comes back wrong
//! (the replay verifies every tensor that comes back and fails on a wrong byte) and no tensor
//! whose only copy was in GPU memory is lost; where the iteration can go on it does and the
//! report says what happened; where it cannot (the only copy of a tensor is unreadable) the
//! iteration stops with an error naming the tensor, the kernel and the device, and the next
//! iteration runs.

use std::sync::{Arc, Mutex, MutexGuard};

use teraio_engine::Error;
use teraio_engine::backend::sim::{SimDisk, SimFault, SimOp};
use teraio_engine::executor::{Executor, ExecutorConfig, TierAllocator};
use teraio_engine::pool::BufferPool;
use teraio_engine::replay::{
    BandwidthWatch, IterationSummary, ReplayConfig, ReplayReport, replay, replay_adaptive,
};
use teraio_engine::store::{Location, TensorStore};
use teraio_engine::tier::{HostTier, MemoryTier};
use teraio_scheduler::{Hardware, Plan, Policy, Trace, plan};
use teraio_tests::{sim_store, small_gpt};

/// splitmix64: the seeded choices of these tests.
fn rng(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *seed;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One rig at a time: the slow-device test compares an iteration's measured bandwidth with the
/// first one's, and replays of other tests beside that first iteration (2 cores in CI) make its
/// baseline low enough that the slow iteration no longer looks slow.
static ONE_RIG_AT_A_TIME: Mutex<()> = Mutex::new(());

struct Rig {
    _one_at_a_time: MutexGuard<'static, ()>,
    trace: Trace,
    plan: Plan,
    hw: Hardware,
    disks: Vec<Arc<SimDisk>>,
    store: Arc<TensorStore>,
}

/// A squeezed plan (3/4 of the peak) over 4 simulated disks, with a host tier of `host_bytes`
/// (0: none); each disk as fast as `disk_bytes_per_s` (0: as fast as memory).
fn rig(host_bytes: u64, disk_bytes_per_s: u64) -> Rig {
    let one = ONE_RIG_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let trace = small_gpt(2, Some(150_000.0));
    let peak = trace.resident_memory_per_kernel().into_iter().max().unwrap();
    let mut hw = Hardware::dev();
    hw.gpu_memory_bytes = peak * 3 / 4;
    hw.ssd_count = 4;
    if disk_bytes_per_s > 0 {
        hw.ssd_write_bytes_per_s = disk_bytes_per_s as f64;
        hw.ssd_read_bytes_per_s = disk_bytes_per_s as f64;
        hw.ssd_duplex_bytes_per_s = None;
    }
    let p = plan(&trace, &hw, Policy::Teraio).unwrap();
    assert!(!p.instructions.is_empty(), "memory is squeezed: the plan must move tensors");
    let (disks, store) = sim_store(4, 256 << 20, host_bytes, |d| {
        if disk_bytes_per_s > 0 {
            d.inject(SimFault::Throughput { bytes_per_s: disk_bytes_per_s });
        }
    });
    Rig { _one_at_a_time: one, trace, plan: p, hw, disks, store }
}

fn gpu_for(trace: &Trace) -> Arc<dyn MemoryTier> {
    let backing: u64 =
        trace.tensors.iter().map(|t| BufferPool::capacity_for(t.bytes as usize) as u64).sum();
    HostTier::new("emulated-gpu", backing + (64 << 20)).unwrap()
}

fn run(
    r: &Rig,
    iterations: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> teraio_engine::Result<ReplayReport> {
    let cfg = ReplayConfig {
        gpu_capacity_bytes: r.hw.gpu_memory_bytes,
        iterations,
        ..ReplayConfig::default()
    };
    replay(&r.trace, &r.plan, &r.store, gpu_for(&r.trace), &cfg, &mut |p| {
        progress(p.iteration, p.kernel)
    })
}

/// No iteration stopped, and every tensor that came back was verified.
fn assert_clean(report: &ReplayReport, iterations: usize) {
    assert_eq!(report.iterations.len(), iterations);
    for s in &report.iterations {
        assert!(s.stopped.is_none(), "iteration {} stopped: {:?}", s.iteration, s.stopped);
    }
    assert!(report.verified_tensors > 0);
}

#[test]
fn write_faults_keep_tensors_in_gpu_memory_and_the_run_goes_on() {
    let (mut went_on_after_failures, mut host_saves, mut shorts) = (0, 0, 0);
    for seed in 0..12u64 {
        let mut s = seed;
        let host = if seed % 2 == 1 { 64 << 20 } else { 0 };
        let r = rig(host, 0);
        let d = (rng(&mut s) % 4) as usize;
        let after = rng(&mut s) % 12;
        let fault = match seed % 4 {
            0 => SimFault::Eio { op: SimOp::Write, after_ops: after },
            1 => SimFault::Enospc { after_ops: after },
            2 => SimFault::ShortTransfer { op: SimOp::Write, after_ops: after },
            _ => SimFault::ShortTransfer { op: SimOp::Any, after_ops: after },
        };
        r.disks[d].inject(fault);
        let result = run(&r, 3, &mut |_, _| {});
        let injected = r.disks[d].stats().injected_errors;
        match result {
            Ok(report) => {
                // Failed writes lose nothing: no iteration stops, every tensor that came back
                // verified (a wrong byte fails the replay).
                assert_clean(&report, 3);
                let failed: u64 = report.iterations.iter().map(|s| s.failed_offloads).sum();
                let to_host: u64 = report.iterations.iter().map(|s| s.host_retries).sum();
                if injected > 0 {
                    assert!(
                        failed + to_host > 0,
                        "seed {seed}: {injected} writes failed and the report says nothing"
                    );
                    went_on_after_failures += 1;
                    if host > 0 && to_host > 0 {
                        host_saves += 1;
                    }
                }
                if matches!(fault, SimFault::ShortTransfer { .. }) {
                    assert_eq!(failed + to_host, 0, "seed {seed}: short transfers are resumed");
                    shorts += u64::from(r.disks[d].stats().short_transfers > 0);
                }
            }
            // Memory does not allow keeping every tensor whose write failed: a clear error
            // about the budget, never a lost or wrong tensor.
            Err(Error::NoSpace(msg)) => {
                assert!(injected > 0, "seed {seed}: out of memory without a fault: {msg}");
                assert!(msg.contains("budget"), "seed {seed}: {msg}");
                assert!(msg.contains("writes failed"), "seed {seed}: the message says why: {msg}");
            }
            Err(e) => panic!("seed {seed}: {fault:?} on device {d}: {e}"),
        }
    }
    assert!(went_on_after_failures > 0, "no seed saw a failed write and went on");
    assert!(host_saves > 0, "no failed SSD write went to the host tier");
    assert!(shorts > 0, "no short transfer was injected");
}

#[test]
fn read_faults_stop_the_iteration_naming_tensor_kernel_and_device() {
    let mut stops = 0;
    for seed in 0..10u64 {
        let mut s = seed + 100;
        let r = rig(0, 0);
        let d = (rng(&mut s) % 4) as usize;
        let after = rng(&mut s) % 150;
        r.disks[d].inject(SimFault::Eio { op: SimOp::Read, after_ops: after });
        let device = format!("device {d}");
        match run(&r, 3, &mut |_, _| {}) {
            Ok(report) => {
                assert_eq!(report.iterations.len(), 3, "the replay goes on after a stop");
                for it in &report.iterations {
                    let Some(msg) = &it.stopped else { continue };
                    stops += 1;
                    let lost = it.lost.as_ref().expect("a stopped iteration names the tensor");
                    assert!(!lost.global, "a lost global ends the replay");
                    assert_eq!(lost.device, device, "seed {seed}");
                    assert_eq!(lost.kernel_name, r.trace.kernels[lost.kernel].name);
                    assert!(
                        r.trace.tensors[lost.tensor].accesses.contains(&lost.kernel),
                        "seed {seed}: kernel {} does not use tensor {}",
                        lost.kernel,
                        lost.tensor
                    );
                    for part in [
                        format!("t{} ({})", lost.tensor, lost.name),
                        format!("kernel {} ({})", lost.kernel, lost.kernel_name),
                        device.clone(),
                    ] {
                        assert!(msg.contains(&part), "seed {seed}: `{part}` not in: {msg}");
                    }
                    assert!(it.prefetch_retries >= 2, "tried again before giving up");
                }
            }
            // A global tensor's only copy is unreadable: nothing makes it again.
            Err(Error::TensorLost { device: dev, tensor, .. }) => {
                stops += 1;
                assert_eq!(dev, device, "seed {seed}: {tensor}");
            }
            Err(e) => panic!("seed {seed}: EIO on reads of device {d}: {e}"),
        }
    }
    assert!(stops > 0, "no seed lost a tensor to a read fault");
}

/// The activation to corrupt at kernel `k`: created, its copy on the SSDs only, and read again
/// later in the iteration.
fn victim(r: &Rig, k: usize) -> Option<usize> {
    r.trace.tensors.iter().enumerate().find_map(|(i, t)| {
        let later = t.accesses.iter().any(|&a| a > k);
        let first = t.accesses.first().is_some_and(|&a| a < k);
        let on_ssd = r.store.info(i as u64).is_some_and(|x| x.location == Location::OnSsd);
        (!t.global && later && first && on_ssd).then_some(i)
    })
}

#[test]
fn a_corrupt_copy_stops_its_iteration_and_the_next_one_runs() {
    let mut caught = 0;
    for seed in 0..10u64 {
        let mut s = seed + 1000;
        let r = rig(0, 0);
        let n = r.trace.kernels.len();
        let at = (n / 4 + (rng(&mut s) as usize) % (n / 2)).min(n - 1);
        let mut corrupted = None;
        let report = run(&r, 3, &mut |it, k| {
            if it == 0
                && k >= at
                && corrupted.is_none()
                && let Some(t) = victim(&r, k)
                && let Some(dev) = r.store.corrupt_ssd_copy(&r.disks, t as u64)
            {
                corrupted = Some((t, dev));
            }
        })
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(report.iterations.len(), 3);
        // The next iterations run whole.
        for it in &report.iterations[1..] {
            assert!(it.stopped.is_none(), "seed {seed}: iteration {} stopped", it.iteration);
        }
        let first = &report.iterations[0];
        if let Some(msg) = &first.stopped {
            let (t, dev) = corrupted.expect("only the corrupted tensor can be lost");
            let lost = first.lost.as_ref().unwrap();
            assert_eq!(lost.tensor, t, "seed {seed}: {msg}");
            assert!(lost.device.starts_with(&format!("device {dev} ")), "{}", lost.device);
            assert!(msg.contains("checksum mismatch"), "{msg}");
            assert!(msg.contains(&format!("kernel {}", lost.kernel)), "{msg}");
            caught += 1;
        }
    }
    assert!(caught > 0, "no corrupted copy was read again");
}

#[test]
fn a_lost_global_tensor_ends_the_replay_with_an_error_naming_it() {
    let r = rig(0, 0);
    let offloaded: Vec<usize> =
        r.plan.initially_offloaded.iter().map(|p| p.tensor.index()).collect();
    assert!(!offloaded.is_empty(), "the squeezed plan starts some weights offloaded");
    let mut corrupted = None;
    let err = run(&r, 3, &mut |it, k| {
        if it == 1 && k == 0 && corrupted.is_none() {
            for &t in &offloaded {
                let on_ssd = r.store.info(t as u64).is_some_and(|x| x.location == Location::OnSsd);
                if on_ssd && let Some(dev) = r.store.corrupt_ssd_copy(&r.disks, t as u64) {
                    corrupted = Some((t, dev));
                    break;
                }
            }
        }
    })
    .unwrap_err();
    let (t, dev) = corrupted.expect("a global copy was corrupted");
    match &err {
        Error::TensorLost { tensor, device, kernel, .. } => {
            assert!(tensor.contains(&r.trace.tensors[t].name), "{err}");
            assert!(device.starts_with(&format!("device {dev} ")), "{err}");
            assert!(r.trace.tensors[t].accesses.contains(kernel), "{err}");
        }
        e => panic!("expected TensorLost, got {e}"),
    }
}

#[test]
fn an_out_of_space_array_with_a_host_tier_loses_nothing_and_says_so() {
    // Every SSD write fails from the start: the host tier takes them.
    let r = rig(256 << 20, 0);
    for d in &r.disks {
        d.inject(SimFault::Enospc { after_ops: 0 });
    }
    let report = run(&r, 3, &mut |_, _| {}).unwrap();
    assert_clean(&report, 3);
    let to_host: u64 = report.iterations.iter().map(|s| s.host_retries).sum();
    assert!(to_host > 0);
    assert_eq!(report.store.ssd_write.bytes, 0, "nothing reached the SSDs");
    assert!(report.store.host_read.bytes > 0, "tensors came back from the host tier");
}

#[test]
fn a_slow_device_makes_the_replay_replan_within_two_iterations() {
    const DISK: u64 = 400 << 20;
    let r = rig(0, DISK);
    let slow = SimFault::Throughput { bytes_per_s: DISK / 9 };
    let cfg = ReplayConfig {
        gpu_capacity_bytes: r.hw.gpu_memory_bytes,
        iterations: 4,
        ..ReplayConfig::default()
    };
    let mut watch = BandwidthWatch::new(1.5, 1 << 20);
    let mut replans: Vec<(usize, f64, f64)> = Vec::new();
    let trace = r.trace.clone();
    let hw = r.hw.clone();
    let mut adapt = |s: &IterationSummary| -> teraio_engine::Result<Option<Plan>> {
        let Some((w, rd)) = watch.observe(s) else { return Ok(None) };
        replans.push((s.iteration, w, rd));
        let mut h = hw.clone();
        h.ssd_write_bytes_per_s *= w;
        h.ssd_read_bytes_per_s *= rd;
        Ok(Some(plan(&trace, &h, Policy::Teraio).unwrap()))
    };
    let disk = r.disks[1].clone();
    let report = replay_adaptive(
        &r.trace,
        &r.plan,
        &r.store,
        gpu_for(&r.trace),
        &cfg,
        &mut |p| {
            if p.iteration == 1 && p.kernel == 0 {
                disk.inject(slow);
            }
        },
        &mut adapt,
    )
    .unwrap();
    assert_clean(&report, 4);
    // The slowdown starts with iteration 1; the plan made after it runs iteration 2.
    let after_slow =
        replans.iter().find(|(i, _, _)| *i >= 1).expect("a re-plan after the slowdown");
    assert_eq!(after_slow.0, 1, "re-planned right after the first slow iteration: {replans:?}");
    assert!(
        after_slow.1 < 1.0 / 1.5 || after_slow.2 < 1.0 / 1.5,
        "the new plan assumes a slower array: {replans:?}"
    );
    assert!(report.iterations[2].replanned, "iteration 2 runs the new plan");
    assert!(report.replans >= 1);
}

/// An executor of the rig's plan (it allocates created tensors from host memory standing in
/// for the GPU), its global tensors attached and `start()`ed.
fn started_executor(r: &Rig) -> Executor {
    let mem = HostTier::new("gpu", 1 << 30).unwrap();
    let cfg = ExecutorConfig {
        gpu_budget_bytes: r.hw.gpu_memory_bytes,
        allocate_created: true,
        stream: None,
    };
    let alloc = Box::new(TierAllocator(mem.clone() as Arc<dyn MemoryTier>));
    let mut ex =
        Executor::new(r.store.clone(), alloc, r.trace.clone(), r.plan.clone(), cfg).unwrap();
    for t in r.trace.tensors.iter().filter(|t| t.global) {
        ex.attach(t.id, mem.alloc(t.bytes).unwrap()).unwrap();
    }
    ex.start().unwrap();
    ex
}

#[test]
fn a_trainer_that_starts_over_at_kernel_0_after_a_lost_tensor_goes_on() {
    let mut caught = 0;
    for at in [20usize, 30, 40, 50, 60] {
        let r = rig(0, 0);
        let n = r.trace.kernels.len();
        let mut ex = started_executor(&r);
        let mut corrupted = None;
        let mut lost = None;
        for k in 0..n {
            if k >= at.min(n - 1)
                && corrupted.is_none()
                && let Some(t) = victim(&r, k)
            {
                corrupted = r.store.corrupt_ssd_copy(&r.disks, t as u64).map(|_| t);
            }
            match ex.before_kernel(k) {
                Ok(_) => ex.after_kernel(k).unwrap(),
                Err(e @ Error::TensorLost { .. }) => {
                    // Every later call of the iteration says the same.
                    assert!(matches!(ex.before_kernel(k + 1), Err(Error::TensorLost { .. })));
                    assert!(matches!(ex.end_iteration(), Err(Error::TensorLost { .. })));
                    lost = Some(e);
                    break;
                }
                Err(e) => panic!("at {at}: {e}"),
            }
        }
        let Some(e) = lost else {
            ex.end_iteration().unwrap();
            continue;
        };
        let t = corrupted.expect("only a corrupted copy is lost");
        assert!(e.to_string().contains(&format!("t{t} (")), "{e}");
        caught += 1;
        // The next iteration, started at kernel 0 without abort_iteration(), runs whole.
        for k in 0..n {
            ex.before_kernel(k).unwrap();
            ex.after_kernel(k).unwrap();
        }
        let rep = ex.end_iteration().unwrap();
        assert!(rep.lost.is_none() && rep.iteration == 1);
        ex.finish().unwrap();
    }
    assert!(caught > 0, "no corrupted copy was read again");
}

/// Drive the executor for `iterations` with a scripted trainer; after each iteration, the SSD
/// bytes in use and the ids the store holds.
fn ssd_use_per_iteration(r: &Rig, iterations: usize) -> Vec<(u64, Vec<u64>)> {
    let mut ex = started_executor(r);
    let mut out = Vec::new();
    for _ in 0..iterations {
        for k in 0..r.trace.kernels.len() {
            ex.before_kernel(k).unwrap();
            ex.after_kernel(k).unwrap();
        }
        let rep = ex.end_iteration().unwrap();
        assert!(rep.copies_freed > 0, "activations written in the iteration are freed");
        while ex.in_flight() > 0 {
            ex.poll().unwrap();
        }
        r.store.drain();
        let ids = r.store.tensors().into_iter().map(|t| t.id.get()).collect();
        out.push((r.store.space().total.used_bytes, ids));
    }
    ex.finish().unwrap();
    assert_eq!(r.store.space().total.used_bytes, 0, "finish() frees everything");
    out
}

#[test]
fn ssd_use_returns_to_its_baseline_after_every_iteration() {
    let r = rig(0, 0);
    let per = ssd_use_per_iteration(&r, 3);
    for (used, ids) in &per {
        for id in ids {
            assert!(
                r.trace.tensors[*id as usize].global,
                "the copy of activation {id} outlived its tensor"
            );
        }
        let globals: u64 = r
            .trace
            .tensors
            .iter()
            .filter(|t| t.global)
            .map(|t| t.bytes.div_ceil(1 << 20) * (1 << 20) + 4 * (1 << 20))
            .sum();
        assert!(*used <= globals, "{used} bytes used, globals take at most {globals}");
    }
    assert_eq!(per[1].0, per[0].0, "steady state: the same bytes after every iteration");
    assert_eq!(per[2].0, per[0].0);
}
