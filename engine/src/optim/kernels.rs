//! The elementwise loops of the host optimizers, written once as plain Rust and compiled three
//! times: for AVX-512, for AVX2 + FMA (both x86-64, chosen at run time) and for the build's
//! baseline target (the portable fallback; what every other architecture runs).
//!
//! Each loop repeats, per element and in the same order, the arithmetic of PyTorch's
//! single-tensor CPU step (`torch/optim/adam.py` `_single_tensor_adam`, `torch/optim/sgd.py`
//! `_single_tensor_sgd`) as ATen's vectorized kernels compute it on a CPU with FMA:
//!
//! - `add(other, alpha)` is `fma(other, alpha, self)` (ATen's `vec::fmadd`);
//! - `lerp(end, w)` is `fma(w, end - self, self)` for `|w| < 0.5`, else
//!   `fma(w - 1, end - self, end)` (ATen's `lerp_vec`);
//! - `addcmul(t1, t2, value)` is `fma(value * t1, t2, self)` (the compiler contracts ATen's
//!   `self + value * t1 * t2`);
//! - `addcdiv(t1, t2, value)` is `self + (value * t1) / t2`; `mul`, `div`, `sqrt` as written.
//!
//! The division by the bias correction is computed without a divide ([`div_by`]: the same
//! correctly rounded quotient from three multiply-adds; a vector divide is the slowest
//! instruction of the loop).
//!
//! Rust never contracts `a * b + c` on its own, so every fused operation is an explicit
//! [`f32::mul_add`]: each operation is correctly rounded, the result does not depend on the
//! instruction set, the vector width or where a thread's chunk starts, and the three builds
//! agree bitwise (the tests check it). On a CPU without FMA the portable build calls the C
//! library's `fmaf` (correct, slower); x86-64 CPUs since 2013 take the AVX2 path.
//!
//! The one operation that does not match PyTorch bit for bit is the square root: ATen's CPU
//! `sqrt` on float32 goes through a vector math library (MKL VML in the official wheels) that
//! is within 1 ulp but not correctly rounded; here it is IEEE `sqrt` (correctly rounded). See
//! the module documentation for what that does to the parameters.

/// Which compiled copy of the loops runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// The build's baseline target: LLVM vectorizes the loops for what it may assume (SSE2 on
    /// x86-64, NEON on aarch64).
    Portable,
    /// x86-64 with AVX2 and FMA (256-bit vectors).
    Avx2,
    /// x86-64 with AVX-512F (512-bit vectors).
    Avx512,
}

impl Isa {
    /// The fastest copy this CPU runs (detected once; later calls are a load).
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
            {
                return Isa::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Whether this CPU runs the copy.
    pub fn supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Isa::Avx2.supported() && std::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
        }
    }

    /// `portable`, `avx2` or `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// No weight decay.
pub(crate) const WD_NONE: u8 = 0;
/// Decoupled weight decay (AdamW): the parameter is scaled before the update.
pub(crate) const WD_DECOUPLED: u8 = 1;
/// L2 weight decay (Adam, SGD): `weight_decay * param` is added to the gradient.
pub(crate) const WD_L2: u8 = 2;

/// The scalars of one Adam step, in float32 as PyTorch hands them to its kernels (each computed
/// in double precision from the hyperparameters, then rounded once).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamScalars {
    /// `1 - lr * weight_decay` (decoupled weight decay).
    pub decay: f32,
    /// `weight_decay` (L2).
    pub weight_decay: f32,
    /// The lerp's coefficient: `1 - beta1`, or `(1 - beta1) - 1` when that weight is not small.
    pub lerp_coeff: f32,
    /// Whether the lerp starts from the old average (`|1 - beta1| < 0.5`) or from the gradient.
    pub lerp_from_avg: bool,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^step)` (Python's `** 0.5`).
    pub bias_correction2_sqrt: f32,
    /// `1 / bias_correction2_sqrt`, rounded to nearest (for [`div_by`]).
    pub inv_bias_correction2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
    /// `-lr / (1 - beta1^step)`.
    pub neg_step_size: f32,
}

/// The buffers of one Adam step (all of `param`'s length; `max_exp_avg_sq` empty without
/// amsgrad).
pub(crate) struct AdamBufs<'a> {
    pub param: &'a mut [f32],
    pub grad: &'a [f32],
    pub exp_avg: &'a mut [f32],
    pub exp_avg_sq: &'a mut [f32],
    pub max_exp_avg_sq: &'a mut [f32],
}

/// The scalars of one SGD step, in float32.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SgdScalars {
    /// `weight_decay`.
    pub weight_decay: f32,
    /// `momentum`.
    pub momentum: f32,
    /// `1 - dampening`.
    pub one_minus_dampening: f32,
    /// `-lr`.
    pub neg_lr: f32,
}

/// The buffers of one SGD step (`momentum_buffer` empty without momentum).
pub(crate) struct SgdBufs<'a> {
    pub param: &'a mut [f32],
    pub grad: &'a [f32],
    pub momentum_buffer: &'a mut [f32],
}

/// No momentum buffer.
pub(crate) const MOM_NONE: u8 = 0;
/// The buffer holds no history yet: it becomes the gradient.
pub(crate) const MOM_FRESH: u8 = 1;
/// The buffer is updated: `momentum * buf + (1 - dampening) * grad`.
pub(crate) const MOM_RUNNING: u8 = 2;

/// Buffers that can be cut in two at an element index (for threads).
pub(crate) trait Split: Sized {
    /// Elements.
    fn len(&self) -> usize;
    /// The first `mid` elements and the rest.
    fn split_at(self, mid: usize) -> (Self, Self);
}

/// `s` cut at `mid`, or two empty slices when `s` is empty (an unused state buffer).
fn cut(s: &mut [f32], mid: usize) -> (&mut [f32], &mut [f32]) {
    if s.is_empty() { (&mut [], &mut []) } else { s.split_at_mut(mid) }
}

impl Split for AdamBufs<'_> {
    fn len(&self) -> usize {
        self.param.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.param.split_at_mut(mid);
        let (g0, g1) = self.grad.split_at(mid);
        let (m0, m1) = self.exp_avg.split_at_mut(mid);
        let (v0, v1) = self.exp_avg_sq.split_at_mut(mid);
        let (x0, x1) = cut(self.max_exp_avg_sq, mid);
        (
            AdamBufs { param: p0, grad: g0, exp_avg: m0, exp_avg_sq: v0, max_exp_avg_sq: x0 },
            AdamBufs { param: p1, grad: g1, exp_avg: m1, exp_avg_sq: v1, max_exp_avg_sq: x1 },
        )
    }
}

impl Split for SgdBufs<'_> {
    fn len(&self) -> usize {
        self.param.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.param.split_at_mut(mid);
        let (g0, g1) = self.grad.split_at(mid);
        let (b0, b1) = cut(self.momentum_buffer, mid);
        (
            SgdBufs { param: p0, grad: g0, momentum_buffer: b0 },
            SgdBufs { param: p1, grad: g1, momentum_buffer: b1 },
        )
    }
}

/// torch.maximum: the larger, NaN when either is NaN.
#[inline(always)]
fn maximum(a: f32, b: f32) -> f32 {
    if a > b || a.is_nan() { a } else { b }
}

/// `x / c` correctly rounded, for a normal `c` in (0, 1] and `y = RN(1 / c)`, without a
/// division: `q = RN(x * y)` is within an ulp of the quotient, the remainder `x - q * c` is
/// exact in one fused multiply-add, and `RN(q + remainder * y)` is the correctly rounded
/// quotient (Markstein's theorem; Muller et al., *Handbook of Floating-Point Arithmetic*,
/// 2nd ed., section 4.7). It needs no underflow, which holds here: `x` is a square root of a
/// float32, so zero or at least 2^-74.5, and dividing by `c <= 1` makes it no smaller. Zeros,
/// infinity and NaN pass through as the division passes them. A vector divide takes 8-16 cycles of a
/// core's one divider; this is three pipelined multiply-adds (the tests check it against `/`).
#[inline(always)]
pub(crate) fn div_by(x: f32, c: f32, y: f32) -> f32 {
    let q = x * y;
    let r = (-q).mul_add(c, x);
    let refined = r.mul_add(y, q);
    // Zero (its sign), infinity and NaN: `q` is already the quotient.
    if q.is_finite() && q != 0.0 { refined } else { q }
}

/// One Adam step over `b`. The slices are re-cut to `param`'s length so LLVM drops the bounds
/// checks and vectorizes (mutable slices never alias, so no run-time overlap checks either).
#[inline(always)]
fn adam_loop<const WD: u8, const MAXIMIZE: bool, const AMSGRAD: bool>(
    s: &AdamScalars,
    b: AdamBufs<'_>,
) {
    let n = b.param.len();
    let p = b.param;
    let g = &b.grad[..n];
    let m = &mut b.exp_avg[..n];
    let v = &mut b.exp_avg_sq[..n];
    let vmax = if AMSGRAD { &mut b.max_exp_avg_sq[..n] } else { &mut [][..] };
    for i in 0..n {
        // grad = -grad if maximize
        let mut grad = if MAXIMIZE { -g[i] } else { g[i] };
        let mut param = p[i];
        if WD == WD_DECOUPLED {
            // param.mul_(1 - lr * weight_decay)
            param *= s.decay;
        } else if WD == WD_L2 {
            // grad = grad.add(param, alpha=weight_decay)
            grad = param.mul_add(s.weight_decay, grad);
        }
        // exp_avg.lerp_(grad, 1 - beta1)
        let avg = m[i];
        let base = if s.lerp_from_avg { avg } else { grad };
        let avg = s.lerp_coeff.mul_add(grad - avg, base);
        m[i] = avg;
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        let sq = (s.one_minus_beta2 * grad).mul_add(grad, v[i] * s.beta2);
        v[i] = sq;
        let sq = if AMSGRAD {
            // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            let mx = maximum(vmax[i], sq);
            vmax[i] = mx;
            mx
        } else {
            sq
        };
        // denom = (sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = div_by(sq.sqrt(), s.bias_correction2_sqrt, s.inv_bias_correction2_sqrt) + s.eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        p[i] = param + (s.neg_step_size * avg) / denom;
    }
}

/// One SGD step over `b`.
#[inline(always)]
fn sgd_loop<const WD: bool, const MAXIMIZE: bool, const MOM: u8, const NESTEROV: bool>(
    s: &SgdScalars,
    b: SgdBufs<'_>,
) {
    let n = b.param.len();
    let p = b.param;
    let g = &b.grad[..n];
    let buf = if MOM == MOM_NONE { &mut [][..] } else { &mut b.momentum_buffer[..n] };
    for i in 0..n {
        let mut grad = if MAXIMIZE { -g[i] } else { g[i] };
        if WD {
            // grad = grad.add(param, alpha=weight_decay)
            grad = p[i].mul_add(s.weight_decay, grad);
        }
        if MOM != MOM_NONE {
            let m = if MOM == MOM_FRESH {
                // buf = grad.clone()
                grad
            } else {
                // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                grad.mul_add(s.one_minus_dampening, buf[i] * s.momentum)
            };
            buf[i] = m;
            // grad = grad.add(buf, alpha=momentum) if nesterov else buf
            grad = if NESTEROV { m.mul_add(s.momentum, grad) } else { m };
        }
        // param.add_(grad, alpha=-lr)
        p[i] = grad.mul_add(s.neg_lr, p[i]);
    }
}

/// The loops' variants, one function per (flags, instruction set): `$name::<flags>` calls the
/// loop compiled for `$isa`.
macro_rules! compiled_for {
    ($adam:ident, $sgd:ident, $($feature:literal)?) => {
        $(#[target_feature(enable = $feature)])?
        fn $adam<const WD: u8, const MAXIMIZE: bool, const AMSGRAD: bool>(
            s: &AdamScalars,
            b: AdamBufs<'_>,
        ) {
            adam_loop::<WD, MAXIMIZE, AMSGRAD>(s, b)
        }

        $(#[target_feature(enable = $feature)])?
        fn $sgd<const WD: bool, const MAXIMIZE: bool, const MOM: u8, const NESTEROV: bool>(
            s: &SgdScalars,
            b: SgdBufs<'_>,
        ) {
            sgd_loop::<WD, MAXIMIZE, MOM, NESTEROV>(s, b)
        }
    };
}

compiled_for!(adam_portable, sgd_portable,);
#[cfg(target_arch = "x86_64")]
compiled_for!(adam_avx2, sgd_avx2, "avx2,fma");
#[cfg(target_arch = "x86_64")]
compiled_for!(adam_avx512, sgd_avx512, "avx512f,avx2,fma");

/// Run the Adam loop compiled for `isa` (which the caller checked this CPU supports).
fn adam_on<const WD: u8, const MAXIMIZE: bool, const AMSGRAD: bool>(
    isa: Isa,
    s: &AdamScalars,
    b: AdamBufs<'_>,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is `Isa::detect()` or was checked with `Isa::supported`: this CPU has
        // AVX-512F, AVX2 and FMA.
        Isa::Avx512 => unsafe { adam_avx512::<WD, MAXIMIZE, AMSGRAD>(s, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above: this CPU has AVX2 and FMA.
        Isa::Avx2 => unsafe { adam_avx2::<WD, MAXIMIZE, AMSGRAD>(s, b) },
        _ => adam_portable::<WD, MAXIMIZE, AMSGRAD>(s, b),
    }
}

/// One Adam step over `b` with the loop compiled for `isa` (supported by this CPU).
pub(crate) fn adam(
    isa: Isa,
    wd: u8,
    maximize: bool,
    amsgrad: bool,
    s: &AdamScalars,
    b: AdamBufs<'_>,
) {
    debug_assert!(isa.supported());
    match (wd, maximize, amsgrad) {
        (WD_NONE, false, false) => adam_on::<WD_NONE, false, false>(isa, s, b),
        (WD_NONE, false, true) => adam_on::<WD_NONE, false, true>(isa, s, b),
        (WD_NONE, true, false) => adam_on::<WD_NONE, true, false>(isa, s, b),
        (WD_NONE, true, true) => adam_on::<WD_NONE, true, true>(isa, s, b),
        (WD_DECOUPLED, false, false) => adam_on::<WD_DECOUPLED, false, false>(isa, s, b),
        (WD_DECOUPLED, false, true) => adam_on::<WD_DECOUPLED, false, true>(isa, s, b),
        (WD_DECOUPLED, true, false) => adam_on::<WD_DECOUPLED, true, false>(isa, s, b),
        (WD_DECOUPLED, true, true) => adam_on::<WD_DECOUPLED, true, true>(isa, s, b),
        (_, false, false) => adam_on::<WD_L2, false, false>(isa, s, b),
        (_, false, true) => adam_on::<WD_L2, false, true>(isa, s, b),
        (_, true, false) => adam_on::<WD_L2, true, false>(isa, s, b),
        (_, true, true) => adam_on::<WD_L2, true, true>(isa, s, b),
    }
}

/// Run the SGD loop compiled for `isa` (which the caller checked this CPU supports).
fn sgd_on<const WD: bool, const MAXIMIZE: bool, const MOM: u8, const NESTEROV: bool>(
    isa: Isa,
    s: &SgdScalars,
    b: SgdBufs<'_>,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is `Isa::detect()` or was checked with `Isa::supported`: this CPU has
        // AVX-512F, AVX2 and FMA.
        Isa::Avx512 => unsafe { sgd_avx512::<WD, MAXIMIZE, MOM, NESTEROV>(s, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above: this CPU has AVX2 and FMA.
        Isa::Avx2 => unsafe { sgd_avx2::<WD, MAXIMIZE, MOM, NESTEROV>(s, b) },
        _ => sgd_portable::<WD, MAXIMIZE, MOM, NESTEROV>(s, b),
    }
}

/// `sgd_on` with the momentum variant fixed by `mom` and `nesterov`.
fn sgd_mom<const WD: bool, const MAXIMIZE: bool>(
    isa: Isa,
    mom: u8,
    nesterov: bool,
    s: &SgdScalars,
    b: SgdBufs<'_>,
) {
    match (mom, nesterov) {
        (MOM_FRESH, false) => sgd_on::<WD, MAXIMIZE, MOM_FRESH, false>(isa, s, b),
        (MOM_FRESH, true) => sgd_on::<WD, MAXIMIZE, MOM_FRESH, true>(isa, s, b),
        (MOM_RUNNING, false) => sgd_on::<WD, MAXIMIZE, MOM_RUNNING, false>(isa, s, b),
        (MOM_RUNNING, true) => sgd_on::<WD, MAXIMIZE, MOM_RUNNING, true>(isa, s, b),
        _ => sgd_on::<WD, MAXIMIZE, MOM_NONE, false>(isa, s, b),
    }
}

/// One SGD step over `b` with the loop compiled for `isa` (supported by this CPU). `mom` is
/// `MOM_NONE`, `MOM_FRESH` or `MOM_RUNNING`; `nesterov` only matters with momentum.
pub(crate) fn sgd(
    isa: Isa,
    weight_decay: bool,
    maximize: bool,
    mom: u8,
    nesterov: bool,
    s: &SgdScalars,
    b: SgdBufs<'_>,
) {
    debug_assert!(isa.supported());
    match (weight_decay, maximize) {
        (false, false) => sgd_mom::<false, false>(isa, mom, nesterov, s, b),
        (false, true) => sgd_mom::<false, true>(isa, mom, nesterov, s, b),
        (true, false) => sgd_mom::<true, false>(isa, mom, nesterov, s, b),
        (true, true) => sgd_mom::<true, true>(isa, mom, nesterov, s, b),
    }
}
