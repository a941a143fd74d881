//! The optimizer steps: every instruction-set build and thread count agree bitwise; lengths that
//! do not fill a vector; errors that name the argument; the math against hand-computed steps.
//! (Against PyTorch itself: bindings/python/tests/torch/test_host_optim.py.)

use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

const ODD_LENGTHS: [usize; 7] = [0, 1, 7, 15, 17, 1023, 100_003];

/// Every build this CPU runs.
fn isas() -> Vec<Isa> {
    [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.supported()).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Values like a training run's: mostly normal, some tiny, some zero, now and then a
/// negative zero.
fn values(rng: &mut SmallRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| match rng.gen_range(0..100) {
            0 => 0.0,
            1 => -0.0,
            2 => rng.gen_range(-1e-30f32..1e-30),
            _ => rng.gen_range(-1.0f32..1.0) * scale,
        })
        .collect()
}

/// Adam's state after a few steps: averages from gradients, squares non-negative.
#[derive(Clone, Debug, PartialEq)]
struct AdamState {
    param: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    max_exp_avg_sq: Vec<f32>,
}

impl AdamState {
    fn new(rng: &mut SmallRng, n: usize) -> AdamState {
        AdamState {
            param: values(rng, n, 2.0),
            exp_avg: values(rng, n, 0.1),
            exp_avg_sq: values(rng, n, 0.01).into_iter().map(f32::abs).collect(),
            max_exp_avg_sq: values(rng, n, 0.02).into_iter().map(f32::abs).collect(),
        }
    }
    fn bits(&self) -> [Vec<u32>; 4] {
        [bits(&self.param), bits(&self.exp_avg), bits(&self.exp_avg_sq), bits(&self.max_exp_avg_sq)]
    }
}

/// `steps` Adam(W) steps from `start` with fresh gradients from `seed`, on `isa`.
fn run_adam(
    h: &Adam,
    decoupled: bool,
    isa: Isa,
    start: &AdamState,
    seed: u64,
    steps: u64,
) -> AdamState {
    let mut s = start.clone();
    let mut rng = SmallRng::seed_from_u64(seed);
    for step in 1..=steps {
        let grad = values(&mut rng, s.param.len(), 1.0);
        let max = h.amsgrad.then_some(&mut s.max_exp_avg_sq[..]);
        let r = if decoupled {
            AdamW::from(*h).step_on(
                isa,
                step,
                &mut s.param,
                &grad,
                &mut s.exp_avg,
                &mut s.exp_avg_sq,
                max,
            )
        } else {
            h.step_on(isa, step, &mut s.param, &grad, &mut s.exp_avg, &mut s.exp_avg_sq, max)
        };
        r.unwrap();
    }
    s
}

fn arbitrary_adam() -> impl Strategy<Value = (Adam, bool)> {
    (
        prop_oneof![Just(0.0), 1e-5f64..1e-1],
        prop_oneof![Just(0.9), Just(0.0), 0.0f64..0.999, 0.4f64..0.6],
        prop_oneof![Just(0.999), Just(0.0), 0.0f64..0.9999],
        prop_oneof![Just(1e-8), Just(0.0), 1e-12f64..1e-3],
        prop_oneof![Just(0.0), Just(0.01), 0.0f64..1.0],
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        1usize..4,
    )
        .prop_map(|(lr, b1, b2, eps, weight_decay, amsgrad, maximize, decoupled, threads)| {
            let h = Adam { lr, betas: (b1, b2), eps, weight_decay, amsgrad, maximize, threads };
            (h, decoupled)
        })
}

fn arbitrary_sgd() -> impl Strategy<Value = Sgd> {
    (
        prop_oneof![Just(0.0), 1e-5f64..1.0],
        prop_oneof![Just(0.0), Just(0.9), 0.0f64..1.5],
        prop_oneof![Just(0.0), 0.0f64..1.0],
        prop_oneof![Just(0.0), 0.0f64..0.5],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(lr, momentum, dampening, weight_decay, nesterov, maximize)| {
            let nesterov = nesterov && momentum > 0.0;
            let dampening = if nesterov { 0.0 } else { dampening };
            Sgd { lr, momentum, dampening, weight_decay, nesterov, maximize, threads: 1 }
        })
}

/// `steps` SGD steps from `param` (and a fresh momentum buffer) on `isa`.
fn run_sgd(h: &Sgd, isa: Isa, param: &[f32], seed: u64, steps: usize) -> (Vec<f32>, Vec<f32>) {
    let mut p = param.to_vec();
    let mut buf = vec![0.0; p.len()];
    let mut rng = SmallRng::seed_from_u64(seed);
    for step in 0..steps {
        let grad = values(&mut rng, p.len(), 1.0);
        h.step_on(isa, &mut p, &grad, Some(&mut buf), step == 0).unwrap();
    }
    (p, buf)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_build_of_adam_agrees_bitwise(
        (h, decoupled) in arbitrary_adam(),
        n in 0usize..300,
        seed in any::<u64>(),
    ) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let start = AdamState::new(&mut rng, n);
        let want = run_adam(&h, decoupled, Isa::Portable, &start, seed, 3).bits();
        for isa in isas() {
            let got = run_adam(&h, decoupled, isa, &start, seed, 3).bits();
            prop_assert_eq!(&got, &want, "{:?} vs portable", isa);
        }
    }

    #[test]
    fn every_build_of_sgd_agrees_bitwise(h in arbitrary_sgd(), n in 0usize..300, seed in any::<u64>()) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let param = values(&mut rng, n, 2.0);
        let (p0, b0) = run_sgd(&h, Isa::Portable, &param, seed, 3);
        for isa in isas() {
            let (p, b) = run_sgd(&h, isa, &param, seed, 3);
            prop_assert_eq!(bits(&p), bits(&p0), "{:?} vs portable", isa);
            prop_assert_eq!(bits(&b), bits(&b0), "{:?} vs portable", isa);
        }
    }
}

/// Every flag combination, every odd length: all builds equal the portable one bitwise.
#[test]
fn odd_lengths_and_every_variant_agree_across_builds() {
    for &n in &ODD_LENGTHS {
        let mut rng = SmallRng::seed_from_u64(n as u64);
        let start = AdamState::new(&mut rng, n);
        for variant in 0..16u32 {
            let h = Adam {
                lr: 1e-3,
                betas: (if variant & 8 != 0 { 0.3 } else { 0.9 }, 0.999),
                eps: 1e-8,
                weight_decay: 0.05,
                amsgrad: variant & 1 != 0,
                maximize: variant & 2 != 0,
                threads: 1,
            };
            let decoupled = variant & 4 != 0;
            let want = run_adam(&h, decoupled, Isa::Portable, &start, 7, 2);
            for isa in isas() {
                let got = run_adam(&h, decoupled, isa, &start, 7, 2);
                assert_eq!(got.bits(), want.bits(), "n {n}, variant {variant}, {isa:?}");
            }
        }
        let param = start.param.clone();
        for variant in 0..8u32 {
            let h = Sgd {
                lr: 0.01,
                momentum: if variant & 1 != 0 { 0.9 } else { 0.0 },
                dampening: 0.0,
                weight_decay: if variant & 2 != 0 { 1e-4 } else { 0.0 },
                nesterov: variant & 5 == 5,
                maximize: variant & 4 != 0,
                threads: 1,
            };
            let want = run_sgd(&h, Isa::Portable, &param, 3, 3);
            for isa in isas() {
                let got = run_sgd(&h, isa, &param, 3, 3);
                assert_eq!(bits(&got.0), bits(&want.0), "sgd n {n}, variant {variant}, {isa:?}");
                assert_eq!(bits(&got.1), bits(&want.1), "sgd n {n}, variant {variant}, {isa:?}");
            }
        }
    }
}

/// The thread count cuts the buffers elsewhere; the result is the same bits.
#[test]
fn threads_change_nothing() {
    let n = 5 * MIN_ELEMENTS_PER_THREAD + 13;
    let mut rng = SmallRng::seed_from_u64(11);
    let start = AdamState::new(&mut rng, n);
    let h = Adam { amsgrad: true, weight_decay: 0.01, threads: 1, ..Adam::default() };
    let want = run_adam(&h, true, isa(), &start, 5, 2);
    for threads in [2, 3, 4, 7, 64] {
        let got = run_adam(&Adam { threads, ..h }, true, isa(), &start, 5, 2);
        assert_eq!(got.bits(), want.bits(), "{threads} threads");
    }
    let h = Sgd { momentum: 0.9, nesterov: true, weight_decay: 1e-3, threads: 1, ..Sgd::default() };
    let want = run_sgd(&h, isa(), &start.param, 5, 3);
    for threads in [2, 5, 0] {
        let got = run_sgd(&Sgd { threads, ..h }, isa(), &start.param, 5, 3);
        assert_eq!((bits(&got.0), bits(&got.1)), (bits(&want.0), bits(&want.1)), "{threads}");
    }
    assert_eq!(threads_for(10, 8), 1);
    assert_eq!(threads_for(2 * MIN_ELEMENTS_PER_THREAD + 1, 8), 3);
    assert_eq!(threads_for(usize::MAX / 2, 5), 5);
    assert!(threads_for(usize::MAX / 2, 0) >= 1);
}

/// Blocks go to whichever thread is free: a thread held up on its first block leaves every
/// other block to the rest (a fixed share a thread would hold the step until it is done), and
/// every element is stepped once.
#[test]
fn a_held_up_thread_leaves_the_other_blocks_to_the_rest() {
    use std::sync::Mutex;
    use std::time::{Duration, Instant};
    assert!(default_threads() >= 2, "this test needs two hardware threads");
    let n = 16 * MAX_BLOCK_ELEMENTS + 5;
    let block = block_len(n, 2);
    assert_eq!(block, MAX_BLOCK_ELEMENTS);
    let blocks = n.div_ceil(block);
    let (mut param, grad) = (vec![0.0f32; n], vec![0.0f32; n]);
    let base = param.as_ptr() as usize;
    let ran = Mutex::new(Vec::new()); // (block, thread)
    let bufs = SgdBufs { param: &mut param, grad: &grad, momentum_buffer: &mut [] };
    parallel(bufs, 2, |b: SgdBufs<'_>| {
        let i = (b.param.as_ptr() as usize - base) / 4 / block;
        if i == 0 {
            // Held until the other blocks are done (or 20 s).
            let deadline = Instant::now() + Duration::from_secs(20);
            while ran.lock().unwrap().len() < blocks - 1 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        b.param.iter_mut().for_each(|x| *x += 1.0);
        ran.lock().unwrap().push((i, std::thread::current().id()));
    });
    assert!(param.iter().all(|&x| x == 1.0), "every element stepped once");
    let ran = ran.into_inner().unwrap();
    let mut seen: Vec<usize> = ran.iter().map(|r| r.0).collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..blocks).collect::<Vec<_>>());
    let held = ran.iter().find(|r| r.0 == 0).unwrap().1;
    let by_held: Vec<usize> = ran.iter().filter(|r| r.1 == held).map(|r| r.0).collect();
    assert_eq!(by_held, [0], "the held-up thread ran only its first block");
    assert_eq!(block_len(10 * MIN_ELEMENTS_PER_THREAD, 8), MIN_ELEMENTS_PER_THREAD);
    assert_eq!(block_len(40 * MIN_ELEMENTS_PER_THREAD + 1, 2) % CHUNK_ALIGN_ELEMENTS, 0);
}

/// The math, against steps worked out in f64 (loosely: the rounding is PyTorch's, tested in
/// Python): Adam's first step moves each parameter by about `lr` against its gradient's sign.
#[test]
fn steps_do_what_the_papers_say() {
    let lr = 0.01;
    let h = AdamW { lr, weight_decay: 0.1, ..AdamW::default() };
    let mut p = vec![1.0f32, -2.0, 0.5];
    let g = [0.3f32, -0.7, 0.0];
    let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
    h.step(1, &mut p, &g, &mut m, &mut v, None).unwrap();
    let decay = 1.0 - lr * 0.1;
    let want = [1.0 * decay - lr, -2.0 * decay + lr, 0.5 * decay];
    for i in 0..3 {
        assert!((p[i] as f64 - want[i]).abs() < 1e-6, "{i}: {} vs {}", p[i], want[i]);
    }
    assert!((m[0] - 0.03).abs() < 1e-7 && (v[1] - 0.001 * 0.49).abs() < 1e-9, "{m:?} {v:?}");
    // Adam's L2 decay goes into the gradient (and the averages).
    let mut p = vec![1.0f32];
    let (mut m, mut v) = (vec![0.0; 1], vec![0.0; 1]);
    Adam { lr, weight_decay: 0.5, ..Adam::default() }
        .step(1, &mut p, &[0.0], &mut m, &mut v, None)
        .unwrap();
    assert!((m[0] - 0.05).abs() < 1e-7 && (p[0] - 0.99).abs() < 1e-6, "{m:?} {p:?}");
    // SGD with momentum: the buffer is the gradient, then momentum * buf + (1 - dampening) * g.
    let h = Sgd { lr: 0.1, momentum: 0.9, dampening: 0.5, ..Sgd::default() };
    let (mut p, mut b) = (vec![1.0f32], vec![f32::NAN]);
    h.step(&mut p, &[2.0], Some(&mut b), true).unwrap();
    assert_eq!((p[0], b[0]), (1.0 - 0.2, 2.0));
    h.step(&mut p, &[2.0], Some(&mut b), false).unwrap();
    assert!((b[0] - 2.8).abs() < 1e-6 && (p[0] - (0.8 - 0.28)).abs() < 1e-6, "{p:?} {b:?}");
    // maximize climbs.
    let mut p = vec![1.0f32];
    Sgd { lr: 0.5, maximize: true, ..Sgd::default() }.step(&mut p, &[1.0], None, false).unwrap();
    assert_eq!(p[0], 1.5);
}

/// AMSGrad keeps the largest second moment, and propagates NaN as torch.maximum does.
#[test]
fn amsgrad_keeps_the_maximum_and_nan() {
    let h = AdamW { amsgrad: true, ..AdamW::default() };
    let mut p = vec![0.0f32; 3];
    let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
    let mut mx = vec![5.0f32, 0.0, f32::NAN];
    h.step(3, &mut p, &[1.0, 1.0, 1.0], &mut m, &mut v, Some(&mut mx)).unwrap();
    assert_eq!(mx[0], 5.0);
    assert_eq!(mx[1], v[1]);
    assert!(mx[2].is_nan() && p[2].is_nan());
}

fn invalid(r: Result<()>) -> String {
    match r {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// A wrong length names the buffer, its length and param's; a bad hyperparameter its key and
/// value; nothing is written.
#[test]
fn errors_name_the_argument_and_write_nothing() {
    let h = AdamW::default();
    let mut p = vec![1.0f32; 8];
    let (mut m, mut v, mut x) = (vec![0.0f32; 8], vec![0.0f32; 8], vec![0.0f32; 8]);
    let g = vec![1.0f32; 8];
    let e = invalid(h.step(1, &mut p, &g[..7], &mut m, &mut v, None));
    assert!(e.contains("grad has 7 elements, param has 8"), "{e}");
    let e = invalid(h.step(1, &mut p, &g, &mut m[..3], &mut v, None));
    assert!(e.contains("exp_avg has 3 elements"), "{e}");
    let e = invalid(h.step(1, &mut p, &g, &mut m, &mut v[..7], None));
    assert!(e.contains("exp_avg_sq has 7 elements"), "{e}");
    let ams = AdamW { amsgrad: true, ..h };
    let e = invalid(ams.step(1, &mut p, &g, &mut m, &mut v, Some(&mut x[..2])));
    assert!(e.contains("max_exp_avg_sq has 2 elements"), "{e}");
    let e = invalid(ams.step(1, &mut p, &g, &mut m, &mut v, None));
    assert!(e.contains("amsgrad needs max_exp_avg_sq"), "{e}");
    let e = invalid(h.step(0, &mut p, &g, &mut m, &mut v, None));
    assert!(e.contains("step = 0"), "{e}");
    for (bad, key, value) in [
        (AdamW { lr: -1.0, ..h }, "lr", "-1"),
        (AdamW { lr: f64::NAN, ..h }, "lr", "NaN"),
        (AdamW { eps: -1e-8, ..h }, "eps", "-0.00000001"),
        (AdamW { betas: (1.0, 0.999), ..h }, "beta1 (betas[0])", "1"),
        (AdamW { betas: (0.9, -0.1), ..h }, "beta2 (betas[1])", "-0.1"),
        (AdamW { weight_decay: -0.5, ..h }, "weight_decay", "-0.5"),
    ] {
        let e = invalid(bad.step(1, &mut p, &g, &mut m, &mut v, None));
        assert!(e.starts_with("AdamW: ") && e.contains(&format!("{key} = {value} ")), "{e}");
        assert!(bad.validate().is_err());
        let e = invalid(Adam::from(bad).step(1, &mut p, &g, &mut m, &mut v, None));
        assert!(e.starts_with("Adam: "), "{e}");
    }
    assert!(p.iter().all(|&x| x == 1.0) && m.iter().chain(&v).all(|&x| x == 0.0));

    let s = Sgd { momentum: 0.9, ..Sgd::default() };
    let e = invalid(s.step(&mut p, &g, None, true));
    assert!(e.contains("momentum = 0.9 needs momentum_buffer"), "{e}");
    let e = invalid(s.step(&mut p, &g, Some(&mut m[..5]), true));
    assert!(e.contains("momentum_buffer has 5 elements, param has 8"), "{e}");
    let e = invalid(s.step(&mut p, &g[..1], Some(&mut m), true));
    assert!(e.contains("grad has 1 elements"), "{e}");
    for (bad, what) in [
        (Sgd { lr: -0.1, ..s }, "lr = -0.1 "),
        (Sgd { momentum: -0.1, ..s }, "momentum = -0.1 "),
        (Sgd { weight_decay: f64::NAN, ..s }, "weight_decay = NaN "),
        (Sgd { nesterov: true, dampening: 0.1, ..s }, "nesterov = true needs"),
        (Sgd { nesterov: true, momentum: 0.0, ..s }, "nesterov = true needs"),
    ] {
        let e = invalid(bad.step(&mut p, &g, Some(&mut m), false));
        assert!(e.starts_with("SGD: ") && e.contains(what), "{e}");
    }
    assert!(p.iter().all(|&x| x == 1.0) && m.iter().all(|&x| x == 0.0));
    // Without momentum a buffer is left alone.
    Sgd::default().step(&mut p, &g, Some(&mut m), false).unwrap();
    assert!(m.iter().all(|&x| x == 0.0) && p[0] < 1.0);
}

#[test]
fn an_instruction_set_this_cpu_lacks_is_unsupported() {
    for i in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
        let mut p = [0.0f32; 4];
        let r = Sgd::default().step_on(i, &mut p, &[1.0; 4], None, false);
        assert_eq!(r.is_ok(), i.supported(), "{i:?}: {r:?}");
        if let Err(e) = r {
            assert!(matches!(e, Error::Unsupported(_)), "{e}");
        }
    }
    assert!(isa().supported());
    assert!(Isa::Portable.supported());
}

/// Quotients for the tests of `div_by`: `x` a float32 square root (as Adam's `sqrt(v)` is) or an
/// edge value, `c` a normal float32 in (0, 1].
fn check_div_by(x: f32, c: f32) {
    let y = 1.0 / c;
    let got = kernels::div_by(x, c, y);
    let want = x / c;
    assert!(
        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
        "div_by({x:e} = {:#010x}, {c:e} = {:#010x}) = {got:e}, x / c = {want:e}",
        x.to_bits(),
        c.to_bits()
    );
}

#[test]
fn the_division_without_a_divide_is_the_division() {
    let mut rng = SmallRng::seed_from_u64(7);
    // Adam's own divisors: sqrt(1 - beta2^t) for common betas and steps, and random ones.
    let mut divisors = vec![1.0f32, 0.5, f32::MIN_POSITIVE, 1.0 - f32::EPSILON / 2.0];
    for beta2 in [0.95f64, 0.98, 0.99, 0.999, 0.9999, 0.5] {
        for t in [1u32, 2, 3, 10, 100, 1000, 10_000] {
            divisors.push((1.0 - beta2.powi(t as i32)).sqrt() as f32);
        }
    }
    divisors.extend((0..200).map(|_| f32::from_bits(rng.gen_range(0x3000_0000u32..=0x3f80_0000))));
    let specials = [0.0f32, -0.0, f32::INFINITY, f32::NAN, f32::MAX.sqrt(), f32::MAX];
    for &c in &divisors {
        assert!(c.is_normal() && c > 0.0 && c <= 1.0, "{c:e}");
        for x in specials {
            check_div_by(x, c);
        }
        // Square roots of every binade's floats, from the smallest subnormal up.
        for _ in 0..20_000 {
            let v = f32::from_bits(rng.gen_range(1u32..0x7f80_0000));
            check_div_by(v.sqrt(), c);
        }
        // Quotients next to a tie: x = (k + 1/2) ulp * c, rounded, for random significands.
        for _ in 0..2_000 {
            let q = f32::from_bits(rng.gen_range(0x2000_0000u32..0x5f00_0000));
            let x = ((q as f64 + q as f64 * f64::from(f32::EPSILON) / 4.0) * c as f64) as f32;
            check_div_by(x, c);
        }
    }
}

/// Every float32 square root over a few divisors, in release builds only (~2^31 quotients a
/// divisor): `cargo test --release -p teraio-engine exhaustive_division -- --ignored`.
#[test]
#[ignore = "minutes; run in release with --ignored"]
fn exhaustive_division_by_adams_divisors() {
    for c in [0.031_622_775f32, 0.044_710_03, 0.999_999_9, 0.7] {
        for bits in 0..0x7f80_0000u32 {
            check_div_by(f32::from_bits(bits).sqrt(), c);
        }
    }
}
