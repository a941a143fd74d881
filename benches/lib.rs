//! Shared pieces of teraio's benchmarks: the allocator workload (used by the criterion bench
//! `benches/allocator.rs` and the `array_pairs` example for callgrind) and thread CPU time.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Pre-drawn sizes and picks, cycled through (a power of two, so the cycle is a mask).
pub const TABLE: usize = 1 << 16;

/// Seeded random sizes (log-uniform 1 MiB ..= 1 GiB) and victim picks.
pub struct Workload {
    sizes: Vec<u64>,
    picks: Vec<u32>,
    next: usize,
}

impl Workload {
    /// The workload of `seed`.
    pub fn new(seed: u64) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        let (lo, hi) = ((MIB as f64).ln(), (GIB as f64).ln());
        let sizes = (0..TABLE).map(|_| rng.gen_range(lo..=hi).exp() as u64).collect();
        let picks = (0..TABLE).map(|_| rng.r#gen::<u32>()).collect();
        Self { sizes, picks, next: 0 }
    }

    /// The next (size, victim index below `live`).
    #[inline]
    pub fn next(&mut self, live: usize) -> (u64, usize) {
        let i = self.next;
        self.next = (i + 1) & (TABLE - 1);
        (self.sizes[i], self.picks[i] as usize % live)
    }
}

/// CPU time of the calling thread in ns (scheduler accounting, tick-granular while running).
pub fn thread_cpu_ns() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").expect("Linux schedstat");
    stat.split_whitespace().next().and_then(|t| t.parse().ok()).expect("schedstat run time")
}
