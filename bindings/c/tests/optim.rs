//! `teraio_adamw_step` and `teraio_sgd_step` through their extern functions, as a C program
//! calls them: the same bits as the engine's optimizer (tested against PyTorch in the Python
//! tests), and every bad pointer, length, flag and hyperparameter an error naming it, with
//! nothing written. (`bindings/c/examples/optim.c` runs them from C against the update rule.)

use std::ptr::{null, null_mut};

use ::teraio_engine::optim::{Adam, AdamW, Sgd};
use teraio::*;

mod common;
use common::last_error;

fn params() -> teraio_adamw_params {
    teraio_adamw_params {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        amsgrad: 0,
        maximize: 0,
        decoupled_weight_decay: 1,
        threads: 0,
    }
}

fn sgd_params() -> teraio_sgd_params {
    teraio_sgd_params {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 1e-4,
        nesterov: 1,
        maximize: 0,
        threads: 2,
    }
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 20_001) as f32 / 10_000.0 - 1.0)
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn adamw_through_the_c_abi_is_the_engines_step() {
    for (amsgrad, decoupled, maximize) in [(0, 1, 0), (1, 1, 1), (0, 0, 0), (1, 0, 1)] {
        let n = 200_003;
        let hp = teraio_adamw_params {
            amsgrad,
            decoupled_weight_decay: decoupled,
            maximize,
            ..params()
        };
        let (mut p, mut m, mut v, mut x) = (values(n, 1), vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let (mut rp, mut rm, mut rv, mut rx) = (p.clone(), m.clone(), v.clone(), x.clone());
        let h = AdamW {
            lr: hp.lr,
            betas: (hp.beta1, hp.beta2),
            eps: hp.eps,
            weight_decay: hp.weight_decay,
            amsgrad: amsgrad == 1,
            maximize: maximize == 1,
            threads: 1,
        };
        for step in 1..=3u64 {
            let g = values(n, step as u32 + 10);
            let xp = if amsgrad == 1 { x.as_mut_ptr() } else { null_mut() };
            // SAFETY: every pointer is valid for n floats.
            let s = unsafe {
                teraio_adamw_step(
                    &hp,
                    step,
                    p.as_mut_ptr(),
                    g.as_ptr(),
                    m.as_mut_ptr(),
                    v.as_mut_ptr(),
                    xp,
                    n,
                )
            };
            assert_eq!(s, TERAIO_OK, "{}", last_error());
            let rxo = (amsgrad == 1).then_some(&mut rx[..]);
            if decoupled == 1 {
                h.step(step, &mut rp, &g, &mut rm, &mut rv, rxo).unwrap();
            } else {
                Adam::from(h).step(step, &mut rp, &g, &mut rm, &mut rv, rxo).unwrap();
            }
        }
        assert_eq!(bits(&p), bits(&rp));
        assert_eq!(bits(&m), bits(&rm));
        assert_eq!(bits(&v), bits(&rv));
        assert_eq!(bits(&x), bits(&rx));
    }
}

#[test]
fn sgd_through_the_c_abi_is_the_engines_step() {
    let n = 1023;
    let hp = sgd_params();
    let (mut p, mut b) = (values(n, 3), vec![f32::NAN; n]);
    let (mut rp, mut rb) = (p.clone(), b.clone());
    let h = Sgd {
        lr: hp.lr,
        momentum: hp.momentum,
        dampening: hp.dampening,
        weight_decay: hp.weight_decay,
        nesterov: true,
        maximize: false,
        threads: 1,
    };
    for step in 0..3 {
        let g = values(n, step + 20);
        let fresh = i32::from(step == 0);
        // SAFETY: valid pointers for n floats.
        let s =
            unsafe { teraio_sgd_step(&hp, p.as_mut_ptr(), g.as_ptr(), b.as_mut_ptr(), fresh, n) };
        assert_eq!(s, TERAIO_OK, "{}", last_error());
        h.step(&mut rp, &g, Some(&mut rb), step == 0).unwrap();
    }
    assert_eq!((bits(&p), bits(&b)), (bits(&rp), bits(&rb)));
    // Without momentum the buffer may be NULL; with zero elements every pointer may be.
    let plain = teraio_sgd_params { momentum: 0.0, nesterov: 0, ..hp };
    // SAFETY: valid pointers; NULL buffer allowed without momentum.
    let s =
        unsafe { teraio_sgd_step(&plain, p.as_mut_ptr(), values(n, 9).as_ptr(), null_mut(), 0, n) };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    // SAFETY: zero elements: nothing is touched.
    let s = unsafe { teraio_sgd_step(&hp, null_mut(), null(), null_mut(), 1, 0) };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    // SAFETY: as above.
    let s = unsafe {
        teraio_adamw_step(&params(), 1, null_mut(), null(), null_mut(), null_mut(), null_mut(), 0)
    };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
}

/// Call `teraio_adamw_step` over `n` elements of the given buffers (`None`: NULL).
fn adamw(
    hp: *const teraio_adamw_params,
    step: u64,
    bufs: &mut [Vec<f32>; 5],
    n: usize,
    offsets: [usize; 5],
) -> (i32, String) {
    let [p, g, m, v, x] = bufs;
    // SAFETY: the tests pass pointers inside the vectors (or one byte in: a misaligned pointer
    // is refused before use), lengths within them or refused before use.
    let s = unsafe {
        teraio_adamw_step(
            hp,
            step,
            (p.as_mut_ptr() as *mut u8).add(offsets[0]).cast(),
            (g.as_ptr() as *const u8).add(offsets[1]).cast(),
            (m.as_mut_ptr() as *mut u8).add(offsets[2]).cast(),
            (v.as_mut_ptr() as *mut u8).add(offsets[3]).cast(),
            (x.as_mut_ptr() as *mut u8).add(offsets[4]).cast(),
            n,
        )
    };
    (s, if s == TERAIO_OK { String::new() } else { last_error() })
}

#[test]
fn bad_arguments_are_refused_by_name_and_nothing_is_written() {
    let fresh = || -> [Vec<f32>; 5] {
        [vec![1.0; 16], vec![1.0; 16], vec![0.0; 16], vec![0.0; 16], vec![0.0; 16]]
    };
    let ok = params();
    let cases: Vec<(teraio_adamw_params, u64, usize, [usize; 5], &str)> = vec![
        (teraio_adamw_params { lr: -1.0, ..ok }, 1, 8, [0; 5], "lr = -1 is invalid"),
        (teraio_adamw_params { eps: f64::NAN, ..ok }, 1, 8, [0; 5], "eps = NaN is invalid"),
        (teraio_adamw_params { beta1: 1.0, ..ok }, 1, 8, [0; 5], "beta1 (betas[0]) = 1"),
        (teraio_adamw_params { beta2: 2.0, ..ok }, 1, 8, [0; 5], "beta2 (betas[1]) = 2"),
        (teraio_adamw_params { weight_decay: -1e-3, ..ok }, 1, 8, [0; 5], "weight_decay = -0.001"),
        (teraio_adamw_params { amsgrad: 2, ..ok }, 1, 8, [0; 5], "`amsgrad` = 2: a flag is 0 or 1"),
        (
            teraio_adamw_params { decoupled_weight_decay: -1, ..ok },
            1,
            8,
            [0; 5],
            "`decoupled_weight_decay` = -1",
        ),
        (ok, 0, 8, [0; 5], "step = 0"),
        (ok, 1, 8, [1, 0, 0, 0, 0], "`param` at 0x"),
        (ok, 1, 8, [0, 0, 0, 2, 0], "`exp_avg_sq` at 0x"),
        (ok, 1, usize::MAX / 2, [0; 5], "larger than any memory object"),
        (ok, 1, isize::MAX as usize / 4 + 1, [0; 5], "larger than any memory object"),
    ];
    for (hp, step, n, offsets, what) in cases {
        let mut b = fresh();
        let (s, e) = adamw(&hp, step, &mut b, n, offsets);
        assert_eq!(s, TERAIO_ERR_INVALID_ARGUMENT, "{what}: {e}");
        assert!(e.contains(what), "{what}: {e}");
        assert_eq!(b, fresh(), "{what}: nothing written");
    }
    // NULL params, NULL buffers, one buffer passed twice.
    let mut b = fresh();
    let (s, e) = adamw(null(), 1, &mut b, 8, [0; 5]);
    assert_eq!((s, e.contains("`params` is NULL")), (TERAIO_ERR_INVALID_ARGUMENT, true), "{e}");
    let mut p = vec![1.0f32; 8];
    let mut m = vec![0.0f32; 8];
    // SAFETY: valid or NULL pointers (NULL refused before use).
    let s = unsafe {
        teraio_adamw_step(
            &ok,
            1,
            p.as_mut_ptr(),
            null(),
            m.as_mut_ptr(),
            m.as_mut_ptr(),
            null_mut(),
            8,
        )
    };
    assert_eq!(s, TERAIO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("`grad` is NULL (with 8 elements)"), "{}", last_error());
    let g = [1.0f32; 8];
    // SAFETY: as above.
    let s = unsafe {
        teraio_adamw_step(
            &ok,
            1,
            p.as_mut_ptr(),
            g.as_ptr(),
            m.as_mut_ptr(),
            m.as_mut_ptr(),
            null_mut(),
            8,
        )
    };
    assert_eq!(s, TERAIO_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("`exp_avg` (8 elements at") && last_error().contains("overlap"),
        "{}",
        last_error()
    );
    let ams = teraio_adamw_params { amsgrad: 1, ..ok };
    let mut v = vec![0.0f32; 8];
    // SAFETY: as above.
    let s = unsafe {
        teraio_adamw_step(
            &ams,
            1,
            p.as_mut_ptr(),
            g.as_ptr(),
            m.as_mut_ptr(),
            v.as_mut_ptr(),
            null_mut(),
            8,
        )
    };
    assert_eq!(s, TERAIO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("`max_exp_avg_sq` is NULL"), "{}", last_error());
    assert!(p.iter().all(|&x| x == 1.0) && m.iter().chain(&v).all(|&x| x == 0.0));

    // SGD: momentum needs its buffer; nesterov needs momentum; flags are 0 or 1.
    let hp = sgd_params();
    for (hp, fresh, buf, what) in [
        (hp, 1, false, "`momentum_buffer` is NULL"),
        (teraio_sgd_params { momentum: 0.0, ..hp }, 0, true, "nesterov = true needs momentum > 0"),
        (teraio_sgd_params { lr: f64::INFINITY * 0.0, ..hp }, 0, true, "lr = NaN"),
        (teraio_sgd_params { maximize: 3, ..hp }, 0, true, "`maximize` = 3"),
        (hp, 2, true, "`fresh_buffer` = 2"),
    ] {
        let mut b = vec![0.0f32; 8];
        let bp = if buf { b.as_mut_ptr() } else { null_mut() };
        // SAFETY: valid or NULL pointers.
        let s = unsafe { teraio_sgd_step(&hp, p.as_mut_ptr(), g.as_ptr(), bp, fresh, 8) };
        assert_eq!(s, TERAIO_ERR_INVALID_ARGUMENT, "{what}");
        assert!(last_error().contains(what), "{what}: {}", last_error());
        assert!(b.iter().all(|&x| x == 0.0) && p.iter().all(|&x| x == 1.0));
    }
    // SAFETY: NULL params refused before anything is read.
    let s = unsafe { teraio_sgd_step(null(), p.as_mut_ptr(), g.as_ptr(), null_mut(), 0, 8) };
    assert_eq!(s, TERAIO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("`params` is NULL"));
}
