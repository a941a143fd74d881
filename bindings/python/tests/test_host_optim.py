"""The host optimizer from Python without PyTorch: `teraio.adamw_step` / `sgd_step` against the
update rule written out in numpy (bitwise: numpy's sqrt is correctly rounded, as teraio's is;
a fused multiply-add is emulated in float64, exact for these products), and every bad buffer or
hyperparameter a clear exception that names it. (Against PyTorch itself:
tests/torch/test_torch_host_optim.py.)"""

import numpy as np
import pytest

import teraio

f32 = np.float32
SIZES = [0, 1, 7, 15, 17, 1023, 100_003]


def fma(a, b, c):
    """float32 fma(a, b, c): the product of two float32 is exact in float64; the sum is rounded
    to float64 then float32 (a double rounding that these fixed seeds never hit)."""
    return (np.float64(1) * a * b + c).astype(f32)


def ref_adam(p, g, m, v, vmax, step, lr, b1, b2, eps, wd, amsgrad, maximize, decoupled):
    """`torch.optim.Adam(W)`'s single-tensor CPU step, operation by operation (ATen fuses `add`
    with alpha, `lerp` and `addcmul` into one rounding)."""
    g = -g if maximize else g
    if wd != 0:
        if decoupled:
            p = (p * f32(1 - lr * wd)).astype(f32)
        else:
            g = fma(p, f32(wd), g)
    w = f32(1 - b1)
    if abs(w) < 0.5:
        m = fma(np.full_like(m, w), (g - m).astype(f32), m)
    else:
        m = fma(np.full_like(m, w - f32(1)), (g - m).astype(f32), g)
    v = fma((f32(1 - b2) * g).astype(f32), g, (v * f32(b2)).astype(f32))
    if amsgrad:
        vmax = np.maximum(vmax, v)
    bc1 = 1 - b1 ** float(step)
    bc2 = 1 - b2 ** float(step)
    denom = ((np.sqrt(vmax if amsgrad else v) / f32(bc2 ** 0.5)).astype(f32) + f32(eps)).astype(f32)
    p = (p + ((f32(-lr / bc1) * m).astype(f32) / denom).astype(f32)).astype(f32)
    return p, m, v, vmax


def data(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n).astype(f32), (rng.standard_normal(n) * 0.1).astype(f32))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_matches_the_rule_bitwise(n, amsgrad, maximize, decoupled):
    p, _ = data(n, n)
    m, v, vmax = np.zeros(n, f32), np.zeros(n, f32), np.zeros(n, f32)
    rp, rm, rv, rx = p.copy(), m.copy(), v.copy(), vmax.copy()
    hp = dict(lr=3e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.1)
    for step in range(1, 4):
        _, g = data(n, 100 * n + step)
        teraio.adamw_step(p, g, m, v, step=step, lr=hp["lr"], beta1=hp["b1"], beta2=hp["b2"],
                          eps=hp["eps"], weight_decay=hp["wd"], amsgrad=amsgrad,
                          max_exp_avg_sq=vmax if amsgrad else None, maximize=maximize,
                          decoupled_weight_decay=decoupled, threads=2)
        rp, rm, rv, rx = ref_adam(rp, g, rm, rv, rx, step, amsgrad=amsgrad, maximize=maximize,
                                  decoupled=decoupled, **hp)
        for got, want in ((p, rp), (m, rm), (v, rv), (vmax, rx)):
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_large_beta1_takes_lerps_other_form():
    n = 1001
    p, g = data(n, 3)
    m, v = (g * 0.5).astype(f32), np.abs(g).astype(f32)
    rp, rm, _, _ = ref_adam(p.copy(), g, m.copy(), v.copy(), None, 5, 0.01, 0.3, 0.9, 1e-6, 0.0,
                            False, False, True)
    teraio.adamw_step(p, g, m, v, step=5, lr=0.01, beta1=0.3, beta2=0.9, eps=1e-6, weight_decay=0.0)
    np.testing.assert_array_equal(m.view(np.uint32), rm.view(np.uint32))
    np.testing.assert_array_equal(p.view(np.uint32), rp.view(np.uint32))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_the_rule_bitwise(n, nesterov):
    p, _ = data(n, n)
    buf = np.full(n, np.nan, f32)  # a fresh buffer's contents are never read
    rp, rb = p.copy(), None
    lr, mom, wd = 0.05, 0.9, 1e-3
    for step in range(3):
        _, g = data(n, 7 * n + step)
        teraio.sgd_step(p, g, buf, lr=lr, momentum=mom, weight_decay=wd, nesterov=nesterov,
                        fresh_buffer=step == 0)
        gg = fma(rp, f32(wd), g)
        rb = gg.copy() if rb is None else fma(gg, f32(1), (rb * f32(mom)).astype(f32))
        d = fma(rb, f32(mom), gg) if nesterov else rb
        rp = fma(d, f32(-lr), rp)
        np.testing.assert_array_equal(p.view(np.uint32), rp.view(np.uint32))
        np.testing.assert_array_equal(buf.view(np.uint32), rb.view(np.uint32))


def test_threads_change_nothing():
    n = 300_001
    out = []
    for threads in (1, 2, 3, None):
        p, g = data(n, 1)
        m, v = np.zeros(n, f32), np.zeros(n, f32)
        teraio.adamw_step(p, g, m, v, step=1, lr=1e-3, weight_decay=0.01, threads=threads)
        out.append(p)
    for p in out[1:]:
        np.testing.assert_array_equal(p.view(np.uint32), out[0].view(np.uint32))
    info = teraio.optimizer_info()
    assert info["isa"] in ("avx512", "avx2", "portable") and info["threads"] >= 1


def bufs(n=8):
    return [np.zeros(n, f32) for _ in range(4)]


def adamw(p, g, m, v, **kw):
    hp = dict(step=1, lr=1e-3, weight_decay=0.01)
    hp.update(kw)
    teraio.adamw_step(p, g, m, v, **hp)


@pytest.mark.parametrize("bad, what", [
    (lambda b: (b[0], b[1][:7], b[2], b[3]), "grad has 7 elements, param has 8"),
    (lambda b: (b[0], b[1], b[2][:3], b[3]), "exp_avg has 3 elements"),
    (lambda b: (b[0], b[1], b[2], np.zeros(9, f32)), "exp_avg_sq has 9 elements"),
    (lambda b: (b[0], b[1].astype(np.float64), b[2], b[3]), "grad: an array of typestr '<f8'"),
    (lambda b: (b[0].astype(np.float16), b[1], b[2], b[3]), "param: an array of typestr '<f2'"),
    (lambda b: (np.zeros((8, 2), f32)[:, 0], b[1], b[2], b[3]), "param: a non-contiguous array"),
    (lambda b: (b[0], b[1], np.frombuffer(bytes(32), f32), b[3]), "exp_avg: the array is read-only"),
    (lambda b: (b[0], b[0], b[2], b[3]), "`param` (8 elements at"),
    (lambda b: (lambda base: (b[0], b[1], base[:8], base[4:]))(np.zeros(12, f32)),
     "`exp_avg` (8 elements at"),
    (lambda b: (b[0], b[1], b[2], np.frombuffer(bytearray(36), f32, offset=2, count=8)), "not aligned"),
    (lambda b: (b[0], b[1], b[2], "abc"), "exp_avg_sq"),
    (lambda b: (b[0], b[1], b[2], bytearray(32)), "a buffer of format 'B'"),
    (lambda b: (b[0], b[1], b[2], memoryview(bytes(32)).cast("f")), "exp_avg_sq: a read-only buffer"),
    (lambda b: (memoryview(bytearray(32)).cast("i"), b[1], b[2], b[3]), "param: a buffer of format 'i'"),
])
def test_bad_buffers_name_the_argument_and_write_nothing(bad, what):
    b = bufs()
    b[0][:] = 1.0
    p, g, m, v = bad(b)
    with pytest.raises(teraio.InvalidArgumentError) as e:
        adamw(p, g, m, v)
    assert what in str(e.value), str(e.value)
    assert (b[0] == 1.0).all() and not b[2].any() and not b[3].any()


@pytest.mark.parametrize("kw, what", [
    (dict(lr=-1.0), "lr = -1 is invalid"),
    (dict(lr=float("nan")), "lr = NaN is invalid"),
    (dict(beta1=1.0), "beta1 (betas[0]) = 1 is invalid"),
    (dict(beta2=-0.5), "beta2 (betas[1]) = -0.5 is invalid"),
    (dict(eps=-1e-8), "eps = "),
    (dict(weight_decay=-0.1), "weight_decay = -0.1 is invalid"),
    (dict(step=0), "step = 0"),
    (dict(step=1.5), "step = 1.5"),
    (dict(threads=0), "threads = 0"),
    (dict(amsgrad=True), "amsgrad needs max_exp_avg_sq"),
    (dict(amsgrad=True, max_exp_avg_sq=np.zeros(2, f32)), "max_exp_avg_sq has 2 elements"),
])
def test_bad_hyperparameters_name_the_key_and_value(kw, what):
    p, g, m, v = bufs()
    with pytest.raises(teraio.InvalidArgumentError) as e:
        adamw(p, g, m, v, **kw)
    assert what in str(e.value), str(e.value)
    assert not p.any() and not m.any()


def test_sgd_errors_name_the_argument():
    p, g, b, _ = bufs()
    for kw, what in [
        (dict(momentum=0.9), "momentum = 0.9 needs momentum_buffer"),
        (dict(momentum=0.9, momentum_buffer=np.zeros(3, f32)), "momentum_buffer has 3 elements"),
        (dict(momentum=0.9, momentum_buffer=np.zeros(8, np.float64)),
         "momentum_buffer: an array of typestr '<f8'"),
        (dict(momentum=0.9, momentum_buffer=bytes(32)), "momentum_buffer: a buffer of format 'B'"),
        (dict(nesterov=True), "nesterov = true needs momentum > 0"),
        (dict(lr=-0.1), "lr = -0.1 is invalid"),
        (dict(momentum_buffer=p), "overlap"),
    ]:
        kw = dict(kw)
        buf = kw.pop("momentum_buffer", None)
        with pytest.raises(teraio.InvalidArgumentError) as e:
            teraio.sgd_step(p, g, buf, lr=kw.pop("lr", 0.1), **kw)
        assert what in str(e.value), (kw, str(e.value))
    teraio.sgd_step(p, np.ones(8, f32), lr=0.5)
    assert (p == -0.5).all()
    teraio.sgd_step(p, memoryview(np.ones(8, f32)), lr=0.5)  # any float32 buffer
    assert (p == -1.0).all()
