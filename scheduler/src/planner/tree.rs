//! Segment tree over the kernels of an iteration, holding per-kernel "excess" values
//! `e_k` (bytes above a capacity, negative when below) weighted by kernel duration.
//!
//! Supports range add, global/range max, and the planner's benefit query
//! `sum over k in [l, r) of dur_k * clamp(e_k, 0, s)`: the area above the capacity line that
//! removing `s` bytes over `[l, r)` takes away. The query descends only into nodes whose
//! values straddle 0 or `s`, so it is cheap where the curve is far from the line.
//!
//! Range adds are lazy and never pushed down: a node's figures include its own pending add
//! but not its ancestors', which queries carry down as an offset. Queries only read.

#[derive(Clone, Copy, Default)]
struct Node {
    min: i64,
    max: i64,
    lazy: i64,
    sum_dur: f64,
    sum_e_dur: f64,
}

/// See the module documentation.
#[derive(Clone)]
pub(crate) struct ExcessTree {
    n: usize,
    nodes: Vec<Node>,
}

impl ExcessTree {
    /// Build from per-kernel excess values and durations (same length, > 0).
    pub(crate) fn new(excess: &[i64], dur: &[f64]) -> Self {
        let n = excess.len().max(1);
        let mut t = ExcessTree { n, nodes: vec![Node::default(); 4 * n] };
        t.build(1, 0, n, excess, dur);
        t
    }

    fn build(&mut self, node: usize, lo: usize, hi: usize, e: &[i64], d: &[f64]) {
        if hi - lo == 1 {
            let (ev, dv) =
                (e.get(lo).copied().unwrap_or(i64::MIN / 4), d.get(lo).copied().unwrap_or(0.0));
            self.nodes[node] =
                Node { min: ev, max: ev, lazy: 0, sum_dur: dv, sum_e_dur: ev as f64 * dv };
            return;
        }
        let mid = (lo + hi) / 2;
        self.build(2 * node, lo, mid, e, d);
        self.build(2 * node + 1, mid, hi, e, d);
        self.pull(node);
    }

    fn pull(&mut self, node: usize) {
        let (a, b) = (self.nodes[2 * node], self.nodes[2 * node + 1]);
        let n = &mut self.nodes[node];
        n.min = a.min.min(b.min) + n.lazy;
        n.max = a.max.max(b.max) + n.lazy;
        n.sum_dur = a.sum_dur + b.sum_dur;
        n.sum_e_dur = a.sum_e_dur + b.sum_e_dur + n.lazy as f64 * n.sum_dur;
    }

    fn apply(&mut self, node: usize, delta: i64) {
        let n = &mut self.nodes[node];
        n.min += delta;
        n.max += delta;
        n.lazy += delta;
        n.sum_e_dur += delta as f64 * n.sum_dur;
    }

    /// Add `delta` to every kernel in `[l, r)`.
    pub(crate) fn add(&mut self, l: usize, r: usize, delta: i64) {
        if l < r {
            self.add_rec(1, 0, self.n, l, r.min(self.n), delta);
        }
    }

    fn add_rec(&mut self, node: usize, lo: usize, hi: usize, l: usize, r: usize, delta: i64) {
        if r <= lo || hi <= l {
            return;
        }
        if l <= lo && hi <= r {
            self.apply(node, delta);
            return;
        }
        let mid = (lo + hi) / 2;
        self.add_rec(2 * node, lo, mid, l, r, delta);
        self.add_rec(2 * node + 1, mid, hi, l, r, delta);
        self.pull(node);
    }

    /// Largest value over all kernels.
    pub(crate) fn max(&self) -> i64 {
        self.nodes[1].max
    }

    /// Largest value over `[l, r)` (`i64::MIN` for an empty range).
    pub(crate) fn range_max(&self, l: usize, r: usize) -> i64 {
        if l >= r {
            return i64::MIN;
        }
        self.max_rec(1, 0, self.n, l, r.min(self.n), 0)
    }

    /// `acc`: the pending adds of the node's ancestors.
    fn max_rec(&self, node: usize, lo: usize, hi: usize, l: usize, r: usize, acc: i64) -> i64 {
        if r <= lo || hi <= l {
            return i64::MIN;
        }
        let nd = &self.nodes[node];
        if l <= lo && hi <= r {
            return nd.max + acc;
        }
        let (mid, acc) = ((lo + hi) / 2, acc + nd.lazy);
        self.max_rec(2 * node, lo, mid, l, r, acc).max(self.max_rec(
            2 * node + 1,
            mid,
            hi,
            l,
            r,
            acc,
        ))
    }

    /// `sum over k in [l, r) of dur_k * clamp(e_k, 0, s)`.
    pub(crate) fn clamp_sum(&self, l: usize, r: usize, s: i64) -> f64 {
        if l >= r {
            return 0.0;
        }
        self.clamp_rec(1, 0, self.n, l, r.min(self.n), s, 0)
    }

    #[expect(clippy::too_many_arguments, reason = "a recursion over the tree's bounds")]
    fn clamp_rec(
        &self,
        node: usize,
        lo: usize,
        hi: usize,
        l: usize,
        r: usize,
        s: i64,
        acc: i64,
    ) -> f64 {
        if r <= lo || hi <= l {
            return 0.0;
        }
        let nd = &self.nodes[node];
        let (min, max) = (nd.min + acc, nd.max + acc);
        if max <= 0 {
            return 0.0;
        }
        if l <= lo && hi <= r {
            if min >= s {
                return s as f64 * nd.sum_dur;
            }
            if min >= 0 && max <= s {
                return nd.sum_e_dur + acc as f64 * nd.sum_dur;
            }
        }
        let (mid, acc) = ((lo + hi) / 2, acc + nd.lazy);
        self.clamp_rec(2 * node, lo, mid, l, r, s, acc)
            + self.clamp_rec(2 * node + 1, mid, hi, l, r, s, acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn matches_naive(
            init in proptest::collection::vec(-50i64..50, 1..40),
            ops in proptest::collection::vec((0usize..40, 0usize..40, -30i64..30), 0..20),
            q in (0usize..40, 0usize..40, 0i64..40),
        ) {
            let n = init.len();
            let dur: Vec<f64> = (0..n).map(|i| 1.0 + i as f64 * 0.5).collect();
            let mut naive = init.clone();
            let mut t = ExcessTree::new(&init, &dur);
            for (a, b, d) in ops {
                let (x, y) = (a % n, b % n);
                let (l, r) = (x.min(y), x.max(y) + 1);
                t.add(l, r, d);
                for v in &mut naive[l..r] { *v += d; }
            }
            let (x, y) = (q.0 % n, q.1 % n);
            let (l, r) = (x.min(y), x.max(y) + 1);
            let want: f64 = (l..r).map(|k| dur[k] * naive[k].clamp(0, q.2) as f64).sum();
            prop_assert!((t.clamp_sum(l, r, q.2) - want).abs() < 1e-6);
            prop_assert_eq!(t.max(), *naive.iter().max().unwrap());
            prop_assert_eq!(t.range_max(l, r), *naive[l..r].iter().max().unwrap());
        }
    }
}
