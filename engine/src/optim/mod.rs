//! Host-side optimizer steps over float32 buffers in host memory: [`AdamW`], [`Adam`] and
//! [`Sgd`] (with momentum), with PyTorch's semantics.
//!
//! Each step is one call over one tensor's buffers: the parameter, its gradient and the
//! optimizer's state, all of the parameter's length. Hyperparameters come with every call (a
//! param group's, read at each step, so schedulers work); the caller keeps the state and the
//! step count. The update is elementwise, SIMD (AVX-512 or AVX2 + FMA chosen at run time, a
//! portable build elsewhere: [`Isa`]) and split across threads for large tensors
//! ([`AdamW::threads`]; a tensor below [`MIN_ELEMENTS_PER_THREAD`] elements a thread stays on
//! the caller's thread).
//!
//! # Exactly PyTorch's step
//!
//! The arithmetic is that of `torch.optim.AdamW` / `Adam` / `SGD` with `foreach=False` on the
//! CPU (`_single_tensor_adam`, `_single_tensor_sgd`), operation by operation: the scalars
//! (bias corrections, step size, `1 - lr * weight_decay`) are computed in double precision as
//! Python does and rounded once to float32; the elementwise operations are those of ATen's
//! vectorized CPU kernels, including where they fuse a multiply and an add (the kernels module
//! lists them). Every result is therefore bitwise PyTorch's except where a square root enters:
//! ATen's float32 `sqrt` is not correctly rounded (within 1 ulp; MKL's vector math in the
//! official wheels), teraio's is. That touches Adam's denominator only: `exp_avg`, `exp_avg_sq`,
//! `max_exp_avg_sq`, the step and every SGD result stay bitwise equal; a parameter can differ
//! by an ulp of its update (measured against PyTorch 2.15: bindings/python/tests/torch/
//! test_host_optim.py prints the bound). The three instruction-set builds and any thread count
//! agree bitwise with one another.
//!
//! ```
//! use teraio_engine::optim::AdamW;
//!
//! let opt = AdamW { lr: 1e-3, weight_decay: 0.01, ..AdamW::default() };
//! let (mut param, grad) = (vec![1.0f32; 1000], vec![0.5f32; 1000]);
//! let (mut exp_avg, mut exp_avg_sq) = (vec![0.0f32; 1000], vec![0.0f32; 1000]);
//! for step in 1..=3 {
//!     opt.step(step, &mut param, &grad, &mut exp_avg, &mut exp_avg_sq, None)?;
//! }
//! assert!(param[0] < 1.0);
//! # Ok::<(), teraio_engine::Error>(())
//! ```

mod kernels;
mod workers;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

pub use kernels::Isa;
use kernels::{AdamBufs, AdamScalars, SgdBufs, SgdScalars, Split};

use crate::{Error, Result};

/// Below this many elements per thread a step does not start another thread (64 Ki elements:
/// AdamW moves 1.75 MiB of memory for them, ~100 µs on one core, against ~10-20 µs to start a
/// thread).
pub const MIN_ELEMENTS_PER_THREAD: usize = 1 << 16;

/// Blocks start at multiples of this many elements (64 bytes: no two threads write
/// one cache line of an aligned buffer).
const CHUNK_ALIGN_ELEMENTS: usize = 16;

/// The threads a step uses when asked for 0: the machine's available parallelism.
pub fn default_threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The instruction set the steps run with on this CPU.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(Isa::detect)
}

/// Threads for `n` elements when `threads` were asked (0: [`default_threads`]).
fn threads_for(n: usize, threads: usize) -> usize {
    let asked = if threads == 0 { default_threads() } else { threads };
    asked.min(n.div_ceil(MIN_ELEMENTS_PER_THREAD)).max(1)
}

/// Blocks are at most this many elements (1 MiB of each float32 buffer): small enough that a
/// thread held up by another process's threads (an OpenMP pool spinning after its own work, the
/// trainer's threads) leaves its share to the others, large enough that taking one costs
/// nothing against its ~100 µs of memory traffic.
const MAX_BLOCK_ELEMENTS: usize = 1 << 18;

/// Elements of each block when `n` elements go to `threads` threads: about four blocks a
/// thread, at least [`MIN_ELEMENTS_PER_THREAD`], at most [`MAX_BLOCK_ELEMENTS`], a multiple of
/// [`CHUNK_ALIGN_ELEMENTS`].
fn block_len(n: usize, threads: usize) -> usize {
    let even = n.div_ceil(threads.max(1) * 4);
    even.clamp(MIN_ELEMENTS_PER_THREAD, MAX_BLOCK_ELEMENTS).next_multiple_of(CHUNK_ALIGN_ELEMENTS)
}

/// Run `f` over `bufs` cut into blocks ([`block_len`]) that `threads` threads take one at a
/// time as they finish the last (the optimizer's worker threads, started once: `workers`, and
/// the caller's): a thread that gets less of the CPU does fewer blocks instead of holding the
/// step up with a fixed share. Blocks start at multiples of [`CHUNK_ALIGN_ELEMENTS`].
fn parallel<B: Split + Send>(bufs: B, threads: usize, f: impl Fn(B) + Sync) {
    let n = bufs.len();
    if threads <= 1 {
        return f(bufs);
    }
    let block = block_len(n, threads);
    let mut blocks = Vec::with_capacity(n.div_ceil(block));
    let mut rest = bufs;
    while rest.len() > block {
        let (head, tail) = rest.split_at(block);
        blocks.push(Mutex::new(Some(head)));
        rest = tail;
    }
    blocks.push(Mutex::new(Some(rest)));
    let next = AtomicUsize::new(0);
    let take = || {
        while let Some(slot) = blocks.get(next.fetch_add(1, Ordering::Relaxed)) {
            // Each index is handed out once, so the slot is never contended; a poisoned lock
            // (a panic in `f` on another block) still holds its block.
            let b = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(b) = b {
                f(b);
            }
        }
    };
    let helpers = threads.min(blocks.len()) - 1;
    let jobs: Vec<Box<dyn FnOnce() + Send + '_>> =
        (0..helpers).map(|_| Box::new(&take) as Box<dyn FnOnce() + Send + '_>).collect();
    workers::scope(jobs, take);
}

/// `value` of `key` is `>= 0` (NaN is not).
fn non_negative(who: &str, key: &str, value: f64) -> Result<()> {
    if value >= 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("{who}: {key} = {value} is invalid: it must be >= 0")))
    }
}

/// `value` of `key` is in `[0, 1)`.
fn beta(who: &str, key: &str, value: f64) -> Result<()> {
    if (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{who}: {key} = {value} is invalid: it must be >= 0 and < 1"
        )))
    }
}

/// Buffer `what` has `param`'s `n` elements.
fn same_len(who: &str, what: &str, len: usize, n: usize) -> Result<()> {
    if len == n {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{who}: {what} has {len} elements, param has {n} (every buffer has param's length)"
        )))
    }
}

/// Adam with decoupled weight decay, as `torch.optim.AdamW`: the parameter is scaled by
/// `1 - lr * weight_decay` before the Adam update. `Default` is PyTorch's defaults (lr 1e-3,
/// betas (0.9, 0.999), eps 1e-8, weight decay 0.01) on all threads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Coefficients of the running averages of the gradient and its square (each in [0, 1)).
    pub betas: (f64, f64),
    /// Added to the denominator (>= 0).
    pub eps: f64,
    /// Decoupled weight decay (>= 0).
    pub weight_decay: f64,
    /// Normalize by the maximum of the second moments so far (AMSGrad).
    pub amsgrad: bool,
    /// Maximize the objective (step along the gradient).
    pub maximize: bool,
    /// Threads for one step; 0: [`default_threads`]. Never more than one per
    /// [`MIN_ELEMENTS_PER_THREAD`] elements.
    pub threads: usize,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
            amsgrad: false,
            maximize: false,
            threads: 0,
        }
    }
}

/// Adam with L2 weight decay, as `torch.optim.Adam`: `weight_decay * param` is added to the
/// gradient. `Default` is PyTorch's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, no weight
/// decay) on all threads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Coefficients of the running averages of the gradient and its square (each in [0, 1)).
    pub betas: (f64, f64),
    /// Added to the denominator (>= 0).
    pub eps: f64,
    /// L2 weight decay (>= 0).
    pub weight_decay: f64,
    /// Normalize by the maximum of the second moments so far (AMSGrad).
    pub amsgrad: bool,
    /// Maximize the objective (step along the gradient).
    pub maximize: bool,
    /// Threads for one step; 0: [`default_threads`].
    pub threads: usize,
}

impl Default for Adam {
    fn default() -> Self {
        Adam { weight_decay: 0.0, ..Adam::from(AdamW::default()) }
    }
}

impl From<AdamW> for Adam {
    /// The same hyperparameters, the weight decay as L2.
    fn from(a: AdamW) -> Adam {
        let AdamW { lr, betas, eps, weight_decay, amsgrad, maximize, threads } = a;
        Adam { lr, betas, eps, weight_decay, amsgrad, maximize, threads }
    }
}

impl From<Adam> for AdamW {
    /// The same hyperparameters, the weight decay decoupled.
    fn from(a: Adam) -> AdamW {
        let Adam { lr, betas, eps, weight_decay, amsgrad, maximize, threads } = a;
        AdamW { lr, betas, eps, weight_decay, amsgrad, maximize, threads }
    }
}

impl AdamW {
    /// Check the hyperparameters as PyTorch's constructor does (NaN is refused too).
    pub fn validate(&self) -> Result<()> {
        check_adam("AdamW", &Adam::from(*self))
    }

    /// Update `param` and the state in place: step number `step` (1 for the first step: the
    /// count after this update, PyTorch's `state['step']`). `grad` and the states have
    /// `param`'s length; `max_exp_avg_sq` is required with `amsgrad` (and left alone without
    /// it). States start at zero. On error nothing was written.
    pub fn step(
        &self,
        step: u64,
        param: &mut [f32],
        grad: &[f32],
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
        max_exp_avg_sq: Option<&mut [f32]>,
    ) -> Result<()> {
        self.step_on(isa(), step, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq)
    }

    /// [`step`](Self::step) with the loop compiled for `isa` (tests, benchmarks); an
    /// instruction set this CPU lacks is `Unsupported`.
    #[allow(clippy::too_many_arguments)] // step's arguments and the instruction set
    pub fn step_on(
        &self,
        isa: Isa,
        step: u64,
        param: &mut [f32],
        grad: &[f32],
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
        max_exp_avg_sq: Option<&mut [f32]>,
    ) -> Result<()> {
        let bufs = AdamBufsIn { param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq };
        adam_step("AdamW", &Adam::from(*self), true, isa, step, bufs)
    }
}

impl Adam {
    /// Check the hyperparameters as PyTorch's constructor does (NaN is refused too).
    pub fn validate(&self) -> Result<()> {
        check_adam("Adam", self)
    }

    /// As [`AdamW::step`], with the weight decay as L2.
    pub fn step(
        &self,
        step: u64,
        param: &mut [f32],
        grad: &[f32],
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
        max_exp_avg_sq: Option<&mut [f32]>,
    ) -> Result<()> {
        self.step_on(isa(), step, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq)
    }

    /// As [`AdamW::step_on`].
    #[allow(clippy::too_many_arguments)] // step's arguments and the instruction set
    pub fn step_on(
        &self,
        isa: Isa,
        step: u64,
        param: &mut [f32],
        grad: &[f32],
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
        max_exp_avg_sq: Option<&mut [f32]>,
    ) -> Result<()> {
        let bufs = AdamBufsIn { param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq };
        adam_step("Adam", self, false, isa, step, bufs)
    }
}

/// The buffers as the caller passed them.
struct AdamBufsIn<'a> {
    param: &'a mut [f32],
    grad: &'a [f32],
    exp_avg: &'a mut [f32],
    exp_avg_sq: &'a mut [f32],
    max_exp_avg_sq: Option<&'a mut [f32]>,
}

fn check_adam(who: &str, h: &Adam) -> Result<()> {
    non_negative(who, "lr", h.lr)?;
    non_negative(who, "eps", h.eps)?;
    beta(who, "beta1 (betas[0])", h.betas.0)?;
    beta(who, "beta2 (betas[1])", h.betas.1)?;
    non_negative(who, "weight_decay", h.weight_decay)
}

/// The step's float32 scalars, computed as `_single_tensor_adam` computes them in Python.
fn adam_scalars(h: &Adam, step: u64) -> AdamScalars {
    let (beta1, beta2) = h.betas;
    // `step` is a Python float in PyTorch (`state['step'].item()`); `**` is C's pow, also for
    // the 0.5 (black_box keeps LLVM from turning that pow into a sqrt).
    let t = step as f64;
    let bias_correction1 = 1.0 - beta1.powf(t);
    let bias_correction2 = 1.0 - beta2.powf(t);
    let step_size = h.lr / bias_correction1;
    let bias_correction2_sqrt = bias_correction2.powf(std::hint::black_box(0.5));
    let weight = (1.0 - beta1) as f32;
    // ATen's lerp: small weights start from the old value, others from the end point.
    let lerp_from_avg = weight.abs() < 0.5;
    AdamScalars {
        decay: (1.0 - h.lr * h.weight_decay) as f32,
        weight_decay: h.weight_decay as f32,
        lerp_coeff: if lerp_from_avg { weight } else { weight - 1.0 },
        lerp_from_avg,
        beta2: beta2 as f32,
        one_minus_beta2: (1.0 - beta2) as f32,
        bias_correction2_sqrt: bias_correction2_sqrt as f32,
        inv_bias_correction2_sqrt: 1.0 / bias_correction2_sqrt as f32,
        eps: h.eps as f32,
        neg_step_size: (-step_size) as f32,
    }
}

fn adam_step(
    who: &str,
    h: &Adam,
    decoupled: bool,
    isa: Isa,
    step: u64,
    b: AdamBufsIn<'_>,
) -> Result<()> {
    check_adam(who, h)?;
    if step == 0 {
        return Err(Error::InvalidArgument(format!(
            "{who}: step = 0 is invalid: steps count from 1 (the count after this update, \
             PyTorch's state['step'])"
        )));
    }
    let n = b.param.len();
    same_len(who, "grad", b.grad.len(), n)?;
    same_len(who, "exp_avg", b.exp_avg.len(), n)?;
    same_len(who, "exp_avg_sq", b.exp_avg_sq.len(), n)?;
    let max_exp_avg_sq: &mut [f32] = match b.max_exp_avg_sq {
        Some(m) if h.amsgrad => {
            same_len(who, "max_exp_avg_sq", m.len(), n)?;
            m
        }
        None if h.amsgrad => {
            return Err(Error::InvalidArgument(format!(
                "{who}: amsgrad needs max_exp_avg_sq (a state of param's length, zeros at first)"
            )));
        }
        _ => &mut [],
    };
    if !isa.supported() {
        return Err(Error::Unsupported(format!(
            "{who}: this CPU does not run the {} build of the optimizer",
            isa.name()
        )));
    }
    let s = adam_scalars(h, step);
    let wd = match (h.weight_decay != 0.0, decoupled) {
        (false, _) => kernels::WD_NONE,
        (true, true) => kernels::WD_DECOUPLED,
        (true, false) => kernels::WD_L2,
    };
    let bufs = AdamBufs {
        param: b.param,
        grad: b.grad,
        exp_avg: b.exp_avg,
        exp_avg_sq: b.exp_avg_sq,
        max_exp_avg_sq,
    };
    parallel(bufs, threads_for(n, h.threads), |chunk| {
        kernels::adam(isa, wd, h.maximize, h.amsgrad, &s, chunk)
    });
    Ok(())
}

/// Stochastic gradient descent with momentum, as `torch.optim.SGD`. `Default` is PyTorch's
/// (lr 1e-3, no momentum, no dampening, no weight decay) on all threads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Momentum factor (>= 0; 0: no momentum buffer).
    pub momentum: f64,
    /// Dampening of the gradient in the momentum buffer.
    pub dampening: f64,
    /// L2 weight decay (>= 0).
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and no dampening).
    pub nesterov: bool,
    /// Maximize the objective.
    pub maximize: bool,
    /// Threads for one step; 0: [`default_threads`].
    pub threads: usize,
}

impl Default for Sgd {
    fn default() -> Self {
        Sgd {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
            threads: 0,
        }
    }
}

impl Sgd {
    /// Check the hyperparameters as PyTorch's constructor does (NaN is refused too).
    pub fn validate(&self) -> Result<()> {
        non_negative("SGD", "lr", self.lr)?;
        non_negative("SGD", "momentum", self.momentum)?;
        non_negative("SGD", "weight_decay", self.weight_decay)?;
        if self.dampening.is_nan() {
            return Err(Error::InvalidArgument("SGD: dampening = NaN is invalid".into()));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::InvalidArgument(format!(
                "SGD: nesterov = true needs momentum > 0 and dampening = 0 (momentum = {}, \
                 dampening = {})",
                self.momentum, self.dampening
            )));
        }
        Ok(())
    }

    /// Update `param` in place. With `momentum != 0`, `momentum_buffer` (param's length) is
    /// required: `fresh_buffer` says it holds no history yet (PyTorch's
    /// `state['momentum_buffer']` is None, the first step): it is set to the gradient instead
    /// of updated. Without momentum the buffer, if given, is left alone. On error nothing was
    /// written.
    pub fn step(
        &self,
        param: &mut [f32],
        grad: &[f32],
        momentum_buffer: Option<&mut [f32]>,
        fresh_buffer: bool,
    ) -> Result<()> {
        self.step_on(isa(), param, grad, momentum_buffer, fresh_buffer)
    }

    /// [`step`](Self::step) with the loop compiled for `isa`.
    pub fn step_on(
        &self,
        isa: Isa,
        param: &mut [f32],
        grad: &[f32],
        momentum_buffer: Option<&mut [f32]>,
        fresh_buffer: bool,
    ) -> Result<()> {
        self.validate()?;
        let n = param.len();
        same_len("SGD", "grad", grad.len(), n)?;
        let (mom, buf): (u8, &mut [f32]) = match momentum_buffer {
            _ if self.momentum == 0.0 => (kernels::MOM_NONE, &mut []),
            Some(b) => {
                same_len("SGD", "momentum_buffer", b.len(), n)?;
                (if fresh_buffer { kernels::MOM_FRESH } else { kernels::MOM_RUNNING }, b)
            }
            None => {
                return Err(Error::InvalidArgument(format!(
                    "SGD: momentum = {} needs momentum_buffer (param's length; fresh_buffer on \
                     the first step)",
                    self.momentum
                )));
            }
        };
        if !isa.supported() {
            return Err(Error::Unsupported(format!(
                "SGD: this CPU does not run the {} build of the optimizer",
                isa.name()
            )));
        }
        let s = SgdScalars {
            weight_decay: self.weight_decay as f32,
            momentum: self.momentum as f32,
            one_minus_dampening: (1.0 - self.dampening) as f32,
            neg_lr: (-self.lr) as f32,
        };
        let wd = self.weight_decay != 0.0;
        let bufs = SgdBufs { param, grad, momentum_buffer: buf };
        parallel(bufs, threads_for(n, self.threads), |chunk| {
            kernels::sgd(isa, wd, self.maximize, mom, self.nesterov, &s, chunk)
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests;
