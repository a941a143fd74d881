//! Allocator micro-benchmarks: alloc + free pairs at 50% fill on a 16 TiB array.
//!
//! Workload: 4 devices x 4 TiB, 1 MiB allocation units (4 Mi units per device), 1 MiB stripe
//! unit. Tensor sizes are log-uniform in 1 MiB ..= 1 GiB (mean ~148 MiB), drawn from a seeded
//! generator ahead of time. The array is filled to 50% first; then every iteration frees a
//! random live tensor and allocates a new one of a fresh size, which keeps the fill near 50%.
//! Throughput is reported in pairs (elements) per second.
//!
//! Each workload is measured twice: `*_wall` is criterion's wall clock; `*_cpu` counts only the
//! CPU time of the benchmark thread (from `/proc/thread-self/schedstat`), so time spent waiting
//! for a core while other jobs run on the machine is left out. The `_cpu` figure is "pairs per
//! second on one core".
//!
//! Run: `cargo bench -p teraio-benches --bench allocator`
#![expect(missing_docs, reason = "criterion_group! generates an undocumented pub fn")]

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use teraio_allocator::{ArrayAllocator, ExtentAllocator};
use teraio_benches::{Workload, thread_cpu_ns};
use teraio_layout::{ArrayGeometry, Extent, StripeMap};

const MIB: u64 = 1 << 20;
const TIB: u64 = 1 << 40;
const DEVICES: u32 = 4;
const DEVICE_BYTES: u64 = 4 * TIB;
/// Bench `step` (one pair) by wall clock and by thread CPU time.
fn bench_both(c: &mut Criterion, name: &str, mut step: impl FnMut()) {
    let mut g = c.benchmark_group("allocator");
    g.throughput(Throughput::Elements(1));
    g.bench_function(format!("{name}_wall"), |b| b.iter(&mut step));
    g.bench_function(format!("{name}_cpu"), |b| {
        b.iter_custom(|iters| {
            let start = thread_cpu_ns();
            for _ in 0..iters {
                step();
            }
            Duration::from_nanos(thread_cpu_ns() - start)
        })
    });
    g.finish();
}

fn array() -> ArrayAllocator {
    let geometry = ArrayGeometry::new(DEVICES, 4096, MIB).expect("valid geometry");
    let devices = (0..DEVICES)
        .map(|d| ExtentAllocator::new(d, MIB, DEVICE_BYTES, MIB).expect("valid device"))
        .collect();
    ArrayAllocator::new(geometry, devices).expect("valid array")
}

/// Array level: `alloc_tensor` + `free_tensor` (what the tensor store calls).
fn array_pairs(c: &mut Criterion) {
    let start = std::time::Instant::now();
    let mut a = array();
    let built = start.elapsed();
    let mut w = Workload::new(1);
    let mut live: Vec<StripeMap> = Vec::new();
    let capacity = a.stats().total.capacity_bytes;
    while a.stats().total.used_bytes < capacity / 2 {
        let (size, _) = w.next(1);
        live.push(a.alloc_tensor(size).expect("filling to 50%"));
    }
    eprintln!("array: built 16 TiB in {built:?}; {} tensors live at 50% fill", live.len());
    bench_both(c, "array_pair_16TiB_50pct", || {
        let (size, victim) = w.next(live.len());
        let old = live.swap_remove(victim);
        a.free_tensor(&old).expect("free a live tensor");
        live.push(a.alloc_tensor(black_box(size)).expect("space at ~50% fill"));
    });
    let s = a.stats().total;
    eprintln!(
        "array after: fill {:.1}%, {} free extents, fragmentation {:.3}",
        100.0 * s.used_bytes as f64 / s.capacity_bytes as f64,
        s.free_extents,
        s.fragmentation
    );
    a.check_invariants().expect("invariants hold after the run");
}

/// Device level: `ExtentAllocator::alloc` + `free` on one 4 TiB device, same size mix.
fn device_pairs(c: &mut Criterion) {
    let mut d = ExtentAllocator::new(0, MIB, DEVICE_BYTES, MIB).expect("valid device");
    let mut w = Workload::new(2);
    let mut live: Vec<Vec<Extent>> = Vec::new();
    while d.used_bytes() < d.capacity_bytes() / 2 {
        let (size, _) = w.next(1);
        live.push(d.alloc(size).expect("filling to 50%"));
    }
    bench_both(c, "device_pair_4TiB_50pct", || {
        let (size, victim) = w.next(live.len());
        for e in live.swap_remove(victim) {
            d.free(e).expect("free a live extent");
        }
        live.push(d.alloc(black_box(size)).expect("space at ~50% fill"));
    });
    let s = d.stats();
    eprintln!(
        "device after: {} allocations live, {} free extents, fragmentation {:.3}",
        live.len(),
        s.free_extents,
        s.fragmentation
    );
    d.check_invariants().expect("invariants hold after the run");
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(6)).sample_size(20);
    targets = array_pairs, device_pairs
}
criterion_main!(benches);
