//! Model-based tests (proptest-state-machine) of the extent and array allocators.
//!
//! The reference model is deliberately naive: one `bool` per allocation unit, and the documented
//! placement policy implemented with linear scans over the free runs. The reference computes the
//! expected outcome of every transition (extents, or which error); the system under test must
//! produce exactly that, and after every step its bitmap, free extents and stats must match the
//! model and `check_invariants` must pass.

use std::cmp::Reverse;

use proptest::prelude::*;
use proptest::test_runner::Config;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use teraio_allocator::{ArrayAllocator, Error, ExtentAllocator, Stats};
use teraio_layout::{ArrayGeometry, Extent, StripeMap, lane_bytes, lane_count};

const BLOCK: u32 = 4096;

/// A free or allocated range in units: (start, length).
type Run = (u64, u64);

/// One device as the model sees it: a bool per unit, true = allocated.
#[derive(Clone, Debug)]
struct DevModel {
    base_bytes: u64,
    unit_bytes: u64,
    allocated: Vec<bool>,
}

impl DevModel {
    fn units(&self) -> u64 {
        self.allocated.len() as u64
    }

    fn free_units(&self) -> u64 {
        self.allocated.iter().filter(|a| !**a).count() as u64
    }

    fn free_runs(&self) -> Vec<Run> {
        let mut runs = Vec::new();
        let mut i = 0;
        while i < self.allocated.len() {
            if self.allocated[i] {
                i += 1;
                continue;
            }
            let start = i;
            while i < self.allocated.len() && !self.allocated[i] {
                i += 1;
            }
            runs.push((start as u64, (i - start) as u64));
        }
        runs
    }

    fn all(&self, (start, len): Run, value: bool) -> bool {
        self.allocated[start as usize..(start + len) as usize].iter().all(|&a| a == value)
    }

    fn set(&mut self, (start, len): Run, value: bool) {
        self.allocated[start as usize..(start + len) as usize].fill(value);
    }

    /// The documented policy, by linear scans: best fit (smallest, then lowest offset) if one
    /// run holds `need`; else whole runs largest first (then lowest offset) until one does.
    fn alloc(&mut self, need: u64) -> Option<Vec<Run>> {
        if need > self.free_units() {
            return None;
        }
        // The fewest extents that can hold `need`: the k largest runs.
        let mut lens: Vec<u64> = self.free_runs().iter().map(|r| r.1).collect();
        lens.sort_unstable_by_key(|&l| Reverse(l));
        let mut covered = 0;
        let mut fewest = 0;
        for l in lens {
            if covered >= need {
                break;
            }
            covered += l;
            fewest += 1;
        }
        let mut out = Vec::new();
        let mut rest = need;
        loop {
            let runs = self.free_runs();
            if let Some(&(start, _)) =
                runs.iter().filter(|r| r.1 >= rest).min_by_key(|r| (r.1, r.0))
            {
                self.set((start, rest), true);
                out.push((start, rest));
                break;
            }
            let &(start, len) = runs.iter().min_by_key(|r| (Reverse(r.1), r.0)).unwrap();
            self.set((start, len), true);
            out.push((start, len));
            rest -= len;
        }
        assert_eq!(out.len(), fewest, "the policy must use the fewest extents");
        out.sort_unstable();
        Some(out)
    }

    fn extent(&self, (start, len): Run) -> Extent {
        Extent { offset: self.base_bytes + start * self.unit_bytes, len: len * self.unit_bytes }
    }

    fn bitmap_bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.allocated.len().div_ceil(8)];
        for (i, _) in self.allocated.iter().enumerate().filter(|(_, a)| **a) {
            out[i / 8] |= 1 << (i % 8);
        }
        out
    }

    /// Byte extent -> unit run, or None when it is not whole units inside the device.
    fn run_of(&self, e: Extent) -> Option<Run> {
        let rel = e.offset.checked_sub(self.base_bytes)?;
        if !rel.is_multiple_of(self.unit_bytes)
            || !e.len.is_multiple_of(self.unit_bytes)
            || e.len == 0
        {
            return None;
        }
        let (start, len) = (rel / self.unit_bytes, e.len / self.unit_bytes);
        (start < self.units() && len <= self.units() - start).then_some((start, len))
    }

    /// The SUT must agree with the model on everything observable.
    fn assert_matches(&self, sut: &ExtentAllocator) {
        sut.check_invariants().unwrap();
        assert_eq!(sut.bitmap_bytes(), self.bitmap_bytes(), "bitmap");
        let runs: Vec<Extent> = self.free_runs().into_iter().map(|r| self.extent(r)).collect();
        assert_eq!(sut.free_extents().collect::<Vec<_>>(), runs, "free extents");
        let s: Stats = sut.stats();
        let free = self.free_units() * self.unit_bytes;
        let cap = self.units() * self.unit_bytes;
        assert_eq!((s.capacity_bytes, s.free_bytes, s.used_bytes), (cap, free, cap - free));
        assert_eq!(s.used_bytes + s.free_bytes, s.capacity_bytes);
        assert_eq!(s.free_extents, runs.len() as u64);
        assert_eq!(s.largest_free_bytes, runs.iter().map(|e| e.len).max().unwrap_or(0));
        assert!((0.0..1.0).contains(&s.fragmentation));
        assert!(runs.iter().all(|e| (e.offset - self.base_bytes).is_multiple_of(self.unit_bytes)));
    }
}

/// What a transition must produce.
#[derive(Clone, Debug, PartialEq)]
enum Outcome {
    Done,
    Extents(Vec<Extent>),
    Tensor(Vec<(u32, Vec<Extent>)>),
    NoSpace,
    NotAllocated,
    AlreadyAllocated,
    InvalidArgument,
}

fn outcome_of_error(e: &Error) -> Outcome {
    match e {
        Error::NoSpace { .. } => Outcome::NoSpace,
        Error::NotAllocated { .. } => Outcome::NotAllocated,
        Error::AlreadyAllocated { .. } => Outcome::AlreadyAllocated,
        Error::InvalidArgument(_) => Outcome::InvalidArgument,
        other => panic!("unexpected error {other:?}"),
    }
}

fn outcome<T>(r: Result<T, Error>, ok: impl FnOnce(T) -> Outcome) -> Outcome {
    match r {
        Ok(v) => ok(v),
        Err(e) => outcome_of_error(&e),
    }
}

/// Remove `cut` from every run in `runs` (splitting runs it falls inside).
fn subtract(runs: &mut Vec<Run>, (cs, cl): Run) {
    let ce = cs + cl;
    let mut out = Vec::with_capacity(runs.len() + 1);
    for &(s, l) in runs.iter() {
        let e = s + l;
        if e <= cs || s >= ce {
            out.push((s, l));
            continue;
        }
        if s < cs {
            out.push((s, cs - s));
        }
        if e > ce {
            out.push((ce, e - ce));
        }
    }
    *runs = out;
}

// ---------------------------------------------------------------------------------------------
// One device.

#[derive(Clone, Debug)]
struct DevState {
    dev: DevModel,
    /// Allocated runs the test knows about (from alloc and mark), for meaningful frees.
    live: Vec<Run>,
    /// Runs freed earlier: candidates for double frees.
    freed: Vec<Run>,
    expect: Outcome,
}

/// Frees name concrete extents, chosen when the transition is generated (from the live or
/// freed lists, or arbitrary), so the expected outcome follows from the model alone, also while
/// shrinking removes earlier steps.
#[derive(Clone, Debug)]
enum DevOp {
    Alloc { bytes: u64 },
    Free(Extent),
    Mark { start: u64, len: u64 },
    Rebuild,
}

struct DevMachine;

impl DevState {
    fn free(&mut self, e: Extent) {
        let Some(run) = self.dev.run_of(e) else {
            self.expect = Outcome::InvalidArgument;
            return;
        };
        if !self.dev.all(run, true) {
            self.expect = Outcome::NotAllocated;
            return;
        }
        self.dev.set(run, false);
        subtract(&mut self.live, run);
        self.freed.push(run);
        self.expect = Outcome::Done;
    }

    fn run_extent(&self, run: Run) -> Extent {
        self.dev.extent(run)
    }
}

impl ReferenceStateMachine for DevMachine {
    type State = DevState;
    type Transition = DevOp;

    fn init_state() -> BoxedStrategy<DevState> {
        (1u64..=96, prop_oneof![Just(4096u64), Just(1 << 16)], 0u64..4)
            .prop_map(|(units, unit_bytes, base)| DevState {
                dev: DevModel {
                    base_bytes: base * 4096,
                    unit_bytes,
                    allocated: vec![false; units as usize],
                },
                live: Vec::new(),
                freed: Vec::new(),
                expect: Outcome::Done,
            })
            .boxed()
    }

    fn transitions(state: &DevState) -> BoxedStrategy<DevOp> {
        let units = state.dev.units();
        let unit = state.dev.unit_bytes;
        let cap = units * unit;
        let dev = state.dev.clone();
        let range = (0..units).prop_flat_map(move |s| (Just(s), 1..=units - s));
        let free_run = move |run: Run| DevOp::Free(dev.extent(run));
        let mut ops: Vec<(u32, BoxedStrategy<DevOp>)> = vec![
            (4, (1..=4 * unit).prop_map(|bytes| DevOp::Alloc { bytes }).boxed()),
            (3, (1..=cap + 2 * unit).prop_map(|bytes| DevOp::Alloc { bytes }).boxed()),
            (1, range.clone().prop_map(free_run.clone()).boxed()),
            (
                1,
                (0..cap + 2 * unit, 0..cap / 2 + unit)
                    .prop_map(|(offset, len)| DevOp::Free(Extent { offset, len }))
                    .boxed(),
            ),
            (2, range.prop_map(|(start, len)| DevOp::Mark { start, len }).boxed()),
            (1, Just(DevOp::Rebuild).boxed()),
        ];
        if !state.live.is_empty() {
            let live = prop::sample::select(state.live.clone());
            ops.push((4, live.clone().prop_map(free_run.clone()).boxed()));
            let part = (live, any::<u64>(), 1..8u64).prop_map(move |((s, l), skip, take)| {
                let skip = skip % l;
                free_run((s + skip, take.min(l - skip)))
            });
            ops.push((1, part.boxed()));
        }
        if !state.freed.is_empty() {
            let dev = state.dev.clone();
            let again = prop::sample::select(state.freed.clone());
            ops.push((2, again.prop_map(move |run| DevOp::Free(dev.extent(run))).boxed()));
        }
        prop::strategy::Union::new_weighted(ops).boxed()
    }

    fn preconditions(state: &DevState, op: &DevOp) -> bool {
        match op {
            DevOp::Mark { start, len } => start + len <= state.dev.units(),
            _ => true,
        }
    }

    fn apply(mut state: DevState, op: &DevOp) -> DevState {
        match *op {
            DevOp::Alloc { bytes } => {
                let need = bytes.div_ceil(state.dev.unit_bytes);
                state.expect = match state.dev.alloc(need) {
                    Some(runs) => {
                        state.live.extend(&runs);
                        Outcome::Extents(runs.into_iter().map(|r| state.run_extent(r)).collect())
                    }
                    None => Outcome::NoSpace,
                };
            }
            DevOp::Free(e) => state.free(e),
            DevOp::Mark { start, len } => {
                if state.dev.all((start, len), false) {
                    state.dev.set((start, len), true);
                    state.live.push((start, len));
                    state.expect = Outcome::Done;
                } else {
                    state.expect = Outcome::AlreadyAllocated;
                }
            }
            DevOp::Rebuild => state.expect = Outcome::Done,
        }
        state
    }
}

impl StateMachineTest for DevMachine {
    type SystemUnderTest = ExtentAllocator;
    type Reference = DevMachine;

    fn init_test(state: &DevState) -> ExtentAllocator {
        let d = &state.dev;
        ExtentAllocator::new(7, d.base_bytes, d.units() * d.unit_bytes, d.unit_bytes).unwrap()
    }

    fn apply(mut sut: ExtentAllocator, state: &DevState, op: DevOp) -> ExtentAllocator {
        let got = match op {
            DevOp::Alloc { bytes } => outcome(sut.alloc(bytes), Outcome::Extents),
            DevOp::Free(e) => outcome(sut.free(e), |()| Outcome::Done),
            DevOp::Mark { start, len } => {
                outcome(sut.mark_allocated(state.run_extent((start, len))), |()| Outcome::Done)
            }
            DevOp::Rebuild => {
                let d = &state.dev;
                let cap = d.units() * d.unit_bytes;
                sut = ExtentAllocator::from_bitmap(
                    7,
                    d.base_bytes,
                    cap,
                    d.unit_bytes,
                    &sut.bitmap_bytes(),
                )
                .unwrap();
                Outcome::Done
            }
        };
        assert_eq!(got, state.expect, "{op:?}");
        if let Outcome::Extents(extents) = &got {
            // Independent of the model: sorted, aligned, disjoint.
            assert!(extents.windows(2).all(|w| w[0].end() <= w[1].offset));
        }
        sut
    }

    fn check_invariants(sut: &ExtentAllocator, state: &DevState) {
        state.dev.assert_matches(sut);
    }
}

prop_state_machine! {
    #![proptest_config(Config { cases: 256, ..Config::default() })]
    #[test]
    fn extent_allocator_matches_the_model(sequential 1..60 => DevMachine);
}

// ---------------------------------------------------------------------------------------------
// The array.

/// A tensor as the model placed it: (device, runs) per lane, in lane order.
type TensorModel = Vec<(u32, Vec<Run>)>;

#[derive(Clone, Debug)]
struct ArrayState {
    devs: Vec<DevModel>,
    stripe_unit_bytes: u64,
    /// Tensors allocated (or marked) and not freed since, with their sizes.
    live: Vec<(u64, TensorModel)>,
    /// Tensors freed earlier: candidates for double frees and for marking again.
    freed: Vec<(u64, TensorModel)>,
    expect: Outcome,
}

#[derive(Clone, Debug)]
enum ArrayOp {
    Alloc { size_bytes: u64 },
    Free { size_bytes: u64, tensor: TensorModel },
    Mark { size_bytes: u64, tensor: TensorModel },
    Rebuild,
}

impl ArrayState {
    fn extents(&self, tensor: &TensorModel) -> Vec<(u32, Vec<Extent>)> {
        tensor
            .iter()
            .map(|(d, runs)| (*d, runs.iter().map(|&r| self.devs[*d as usize].extent(r)).collect()))
            .collect()
    }

    /// The documented array policy over the model devices.
    fn alloc(&mut self, size_bytes: u64) -> Option<TensorModel> {
        let n = self.devs.len() as u32;
        let lanes = lane_count(size_bytes, self.stripe_unit_bytes, n);
        let needs = lane_bytes(size_bytes, self.stripe_unit_bytes, BLOCK, lanes);
        let mut order: Vec<usize> = (0..self.devs.len()).collect();
        order.sort_by_key(|&d| (Reverse(self.devs[d].free_units() * self.devs[d].unit_bytes), d));
        order.truncate(lanes as usize);
        let fits = order
            .iter()
            .zip(&needs)
            .all(|(&d, &need)| need.div_ceil(self.devs[d].unit_bytes) <= self.devs[d].free_units());
        if !fits {
            return None;
        }
        let mut tensor = Vec::new();
        for (&d, &need) in order.iter().zip(&needs) {
            let unit = self.devs[d].unit_bytes;
            let runs = self.devs[d].alloc(need.div_ceil(unit)).expect("checked to fit");
            tensor.push((d as u32, runs));
        }
        Some(tensor)
    }

    fn all(&self, tensor: &TensorModel, value: bool) -> bool {
        tensor.iter().all(|(d, runs)| runs.iter().all(|&r| self.devs[*d as usize].all(r, value)))
    }

    fn set(&mut self, tensor: &TensorModel, value: bool) {
        for (d, runs) in tensor {
            for &r in runs {
                self.devs[*d as usize].set(r, value);
            }
        }
    }
}

struct ArrayMachine;

impl ReferenceStateMachine for ArrayMachine {
    type State = ArrayState;
    type Transition = ArrayOp;

    fn init_state() -> BoxedStrategy<ArrayState> {
        (
            // Up to 6 devices: maps of more than `INLINE_LANES` (4) lanes keep theirs on the heap.
            prop::collection::vec((1u64..=48, prop_oneof![Just(4096u64), Just(8192)]), 1..=6),
            prop_oneof![Just(4096u64), Just(16384), Just(65536)],
        )
            .prop_map(|(devs, stripe_unit_bytes)| ArrayState {
                devs: devs
                    .into_iter()
                    .map(|(units, unit_bytes)| DevModel {
                        base_bytes: 0,
                        unit_bytes,
                        allocated: vec![false; units as usize],
                    })
                    .collect(),
                stripe_unit_bytes,
                live: Vec::new(),
                freed: Vec::new(),
                expect: Outcome::Done,
            })
            .boxed()
    }

    fn transitions(state: &ArrayState) -> BoxedStrategy<ArrayOp> {
        let cap: u64 = state.devs.iter().map(|d| d.units() * d.unit_bytes).sum();
        let mut ops: Vec<(u32, BoxedStrategy<ArrayOp>)> = vec![
            (
                3,
                (1..=state.stripe_unit_bytes * 6)
                    .prop_map(|size_bytes| ArrayOp::Alloc { size_bytes })
                    .boxed(),
            ),
            (2, (1..=cap + 8192).prop_map(|size_bytes| ArrayOp::Alloc { size_bytes }).boxed()),
            (1, Just(ArrayOp::Rebuild).boxed()),
        ];
        if !state.live.is_empty() {
            let live = prop::sample::select(state.live.clone());
            ops.push((
                4,
                live.prop_map(|(size_bytes, tensor)| ArrayOp::Free { size_bytes, tensor }).boxed(),
            ));
        }
        if !state.freed.is_empty() {
            let freed = prop::sample::select(state.freed.clone());
            ops.push((
                1,
                freed
                    .clone()
                    .prop_map(|(size_bytes, tensor)| ArrayOp::Free { size_bytes, tensor })
                    .boxed(),
            ));
            ops.push((
                1,
                freed.prop_map(|(size_bytes, tensor)| ArrayOp::Mark { size_bytes, tensor }).boxed(),
            ));
        }
        prop::strategy::Union::new_weighted(ops).boxed()
    }

    fn apply(mut state: ArrayState, op: &ArrayOp) -> ArrayState {
        match op {
            ArrayOp::Alloc { size_bytes } => {
                state.expect = match state.alloc(*size_bytes) {
                    Some(tensor) => {
                        let out = Outcome::Tensor(state.extents(&tensor));
                        state.live.push((*size_bytes, tensor));
                        out
                    }
                    None => Outcome::NoSpace,
                };
            }
            ArrayOp::Free { size_bytes, tensor } => {
                if state.all(tensor, true) {
                    state.set(tensor, false);
                    state.live.retain(|(_, t)| t != tensor);
                    state.freed.push((*size_bytes, tensor.clone()));
                    state.expect = Outcome::Done;
                } else {
                    state.expect = Outcome::NotAllocated;
                }
            }
            ArrayOp::Mark { size_bytes, tensor } => {
                if state.all(tensor, false) {
                    state.set(tensor, true);
                    state.live.push((*size_bytes, tensor.clone()));
                    state.expect = Outcome::Done;
                } else {
                    state.expect = Outcome::AlreadyAllocated;
                }
            }
            ArrayOp::Rebuild => state.expect = Outcome::Done,
        }
        state
    }
}

fn build_array(state: &ArrayState, bitmaps: Option<Vec<Vec<u8>>>) -> ArrayAllocator {
    let geometry =
        ArrayGeometry::new(state.devs.len() as u32, BLOCK, state.stripe_unit_bytes).unwrap();
    let devices = state
        .devs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let cap = d.units() * d.unit_bytes;
            match &bitmaps {
                None => ExtentAllocator::new(i as u32, d.base_bytes, cap, d.unit_bytes),
                Some(b) => {
                    ExtentAllocator::from_bitmap(i as u32, d.base_bytes, cap, d.unit_bytes, &b[i])
                }
            }
            .unwrap()
        })
        .collect();
    ArrayAllocator::new(geometry, devices).unwrap()
}

fn stripe_map(state: &ArrayState, size_bytes: u64, tensor: &TensorModel) -> StripeMap {
    let lanes = state
        .extents(tensor)
        .into_iter()
        .map(|(device, extents)| teraio_layout::Lane { device, extents: extents.into() })
        .collect();
    StripeMap::new(size_bytes, state.stripe_unit_bytes, BLOCK, lanes).unwrap()
}

impl StateMachineTest for ArrayMachine {
    type SystemUnderTest = ArrayAllocator;
    type Reference = ArrayMachine;

    fn init_test(state: &ArrayState) -> ArrayAllocator {
        build_array(state, None)
    }

    fn apply(mut sut: ArrayAllocator, state: &ArrayState, op: ArrayOp) -> ArrayAllocator {
        let got = match &op {
            ArrayOp::Alloc { size_bytes } => outcome(sut.alloc_tensor(*size_bytes), |map| {
                assert_eq!(map.size_bytes(), *size_bytes);
                Outcome::Tensor(
                    map.lanes().iter().map(|l| (l.device, l.extents.to_vec())).collect(),
                )
            }),
            ArrayOp::Free { size_bytes, tensor } => {
                let map = stripe_map(state, *size_bytes, tensor);
                outcome(sut.free_tensor(&map), |()| Outcome::Done)
            }
            ArrayOp::Mark { size_bytes, tensor } => {
                let map = stripe_map(state, *size_bytes, tensor);
                outcome(sut.mark_tensor(&map), |()| Outcome::Done)
            }
            ArrayOp::Rebuild => {
                let bitmaps = sut.devices().iter().map(ExtentAllocator::bitmap_bytes).collect();
                sut = build_array(state, Some(bitmaps));
                Outcome::Done
            }
        };
        assert_eq!(got, state.expect, "{op:?}");
        sut
    }

    fn check_invariants(sut: &ArrayAllocator, state: &ArrayState) {
        sut.check_invariants().unwrap();
        for (i, d) in state.devs.iter().enumerate() {
            d.assert_matches(sut.device(i as u32));
        }
        let s = sut.stats();
        let total = |f: fn(&Stats) -> u64| s.devices.iter().map(f).sum::<u64>();
        assert_eq!(s.total.used_bytes + s.total.free_bytes, s.total.capacity_bytes);
        assert_eq!(s.total.used_bytes, total(|d| d.used_bytes));
        assert_eq!(s.total.free_extents, total(|d| d.free_extents));
    }
}

prop_state_machine! {
    #![proptest_config(Config { cases: 256, ..Config::default() })]
    #[test]
    fn array_allocator_matches_the_model(sequential 1..50 => ArrayMachine);
}
