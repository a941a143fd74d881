//! A fixed number of array alloc + free pairs, for instruction counts that noise cannot touch.
//!
//! The workload of `cargo bench -p teraio-benches --bench allocator` (array part): a 16 TiB
//! array of 4 devices x 4 TiB in 1 MiB units, 1 MiB stripe unit, tensor sizes log-uniform in
//! 1 MiB ..= 1 GiB from the same seeded generator, filled to 50%; then `PAIRS` times: free a
//! random live tensor, allocate a new one. The pairs run in `run_pairs`, so callgrind can count
//! them alone:
//!
//! ```text
//! cargo build --release -p teraio-benches --example array_pairs
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*run_pairs*' \
//!     target/release/examples/array_pairs 150000 [WARMUP_PAIRS]
//! ```
//!
//! `WARMUP_PAIRS` pairs (default 0) run first, uncounted: a criterion run does millions of
//! pairs, after which free space is more fragmented than after the fill (about 22,500 free
//! extents instead of 15,000).
//!
//! Instructions per pair = the total callgrind reports / `PAIRS`. Run alone, it also prints
//! the pairs per second of `run_pairs` by the thread's CPU time and by the wall clock (one
//! sample: quick A/B checks; the criterion bench gives the figures).

use std::hint::black_box;

use teraio_allocator::{ArrayAllocator, ExtentAllocator};
use teraio_benches::{Workload, thread_cpu_ns};
use teraio_layout::{ArrayGeometry, StripeMap};

const MIB: u64 = 1 << 20;
const TIB: u64 = 1 << 40;

/// The pairs callgrind counts.
#[inline(never)]
fn run_pairs(a: &mut ArrayAllocator, w: &mut Workload, live: &mut Vec<StripeMap>, pairs: u64) {
    pairs_loop(a, w, live, pairs);
}

#[inline(always)]
fn pairs_loop(a: &mut ArrayAllocator, w: &mut Workload, live: &mut Vec<StripeMap>, pairs: u64) {
    for _ in 0..pairs {
        let (size, victim) = w.next(live.len());
        let old = live.swap_remove(victim);
        a.free_tensor(&old).expect("free a live tensor");
        drop(old);
        live.push(a.alloc_tensor(black_box(size)).expect("space at ~50% fill"));
    }
}

fn main() {
    let arg = |i: usize, default: u64| {
        std::env::args().nth(i).map_or(default, |s| s.parse().expect("PAIRS [WARMUP_PAIRS]"))
    };
    let (pairs, warmup) = (arg(1, 100_000), arg(2, 0));
    let geometry = ArrayGeometry::new(4, 4096, MIB).expect("valid geometry");
    let devices =
        (0..4).map(|d| ExtentAllocator::new(d, MIB, 4 * TIB, MIB).expect("valid device")).collect();
    let mut a = ArrayAllocator::new(geometry, devices).expect("valid array");
    let mut w = Workload::new(1);
    let mut live = Vec::new();
    let capacity = a.stats().total.capacity_bytes;
    while a.stats().total.used_bytes < capacity / 2 {
        let (size, _) = w.next(1);
        live.push(a.alloc_tensor(size).expect("filling to 50%"));
    }
    // Inlined here (not a function of its own, which the linker could fold into `run_pairs`).
    pairs_loop(&mut a, &mut w, &mut live, warmup);
    let (cpu, wall) = (thread_cpu_ns(), std::time::Instant::now());
    run_pairs(&mut a, &mut w, &mut live, pairs);
    let (cpu_s, wall_s) = ((thread_cpu_ns() - cpu) as f64 * 1e-9, wall.elapsed().as_secs_f64());
    let s = a.stats().total;
    println!(
        "{pairs} pairs: {:.0} pairs/s CPU time, {:.0} pairs/s wall clock; {} tensors live, \
         fill {:.1}%, {} free extents",
        pairs as f64 / cpu_s,
        pairs as f64 / wall_s,
        live.len(),
        100.0 * s.used_bytes as f64 / s.capacity_bytes as f64,
        s.free_extents
    );
    a.check_invariants().expect("invariants hold");
}
