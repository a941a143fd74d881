//! The host optimizer steps (`teraio_adamw_step`, `teraio_sgd_step`): PyTorch's AdamW / Adam /
//! SGD update over caller float32 memory, SIMD and multi-threaded (docs/C_ABI.md, "Host
//! optimizer").

use teraio_bindings_core::optim::{AdamArgs, F32Span, adam_step, check_spans, sgd_step};
use teraio_bindings_core::{Error, Status};
use teraio_engine::optim::Sgd;

use crate::ffi::guard;
use crate::teraio_status;

/// Hyperparameters of [`teraio_adamw_step`], as `torch.optim.AdamW` names them (its defaults:
/// lr 1e-3, beta1 0.9, beta2 0.999, eps 1e-8, weight_decay 0.01).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct teraio_adamw_params {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Coefficient of the running average of the gradient (`betas[0]`, in [0, 1)).
    pub beta1: f64,
    /// Coefficient of the running average of its square (`betas[1]`, in [0, 1)).
    pub beta2: f64,
    /// Added to the denominator (>= 0).
    pub eps: f64,
    /// Weight decay (>= 0).
    pub weight_decay: f64,
    /// 1: AMSGrad (`max_exp_avg_sq` required); 0: not.
    pub amsgrad: i32,
    /// 1: maximize the objective; 0: minimize.
    pub maximize: i32,
    /// 1: AdamW's decoupled weight decay; 0: Adam's L2 weight decay (`torch.optim.Adam`).
    pub decoupled_weight_decay: i32,
    /// Threads at most (0: every core; a buffer under 64 Ki elements a thread uses fewer).
    pub threads: u32,
}

/// Hyperparameters of [`teraio_sgd_step`], as `torch.optim.SGD` names them.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct teraio_sgd_params {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Momentum factor (>= 0; 0: no momentum buffer).
    pub momentum: f64,
    /// Dampening of the gradient in the momentum buffer.
    pub dampening: f64,
    /// L2 weight decay (>= 0).
    pub weight_decay: f64,
    /// 1: Nesterov momentum (needs momentum > 0, dampening 0); 0: not.
    pub nesterov: i32,
    /// 1: maximize the objective; 0: minimize.
    pub maximize: i32,
    /// Threads at most (0: every core).
    pub threads: u32,
}

/// A 0/1 flag of a parameter struct.
fn flag(what: &str, v: i32) -> teraio_bindings_core::Result<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(Error::InvalidArgument(format!("`{what}` = {v}: a flag is 0 or 1"))),
    }
}

/// Read a parameter struct (any alignment).
///
/// # Safety
/// `p` is NULL or valid for a read of `T`.
unsafe fn read_params<T: Copy>(p: *const T) -> teraio_bindings_core::Result<T> {
    if p.is_null() {
        return Err(Error::InvalidArgument("`params` is NULL".into()));
    }
    // SAFETY: non-null; the caller guarantees it is valid for a read of T; read_unaligned
    // needs no alignment, and the structs' fields are valid for every bit pattern.
    Ok(unsafe { p.read_unaligned() })
}

/// A slice of a span [`check_spans`] accepted.
///
/// # Safety
/// The span passed `check_spans` with the call's other spans; the caller guarantees its
/// memory is valid for reads and writes for the call and used by no one else meanwhile.
unsafe fn slice_mut<'a>(s: F32Span) -> &'a mut [f32] {
    if s.len == 0 {
        return &mut [];
    }
    // SAFETY: non-null, aligned, at most isize::MAX bytes, disjoint from the other spans
    // (check_spans); valid and exclusive for the call (the caller's contract).
    unsafe { std::slice::from_raw_parts_mut(s.addr as *mut f32, s.len) }
}

/// As [`slice_mut`], read only.
///
/// # Safety
/// As [`slice_mut`], for reads.
unsafe fn slice<'a>(s: F32Span) -> &'a [f32] {
    if s.len == 0 {
        return &[];
    }
    // SAFETY: as in slice_mut; only read.
    unsafe { std::slice::from_raw_parts(s.addr as *const f32, s.len) }
}

fn span(name: &'static str, p: *const f32, len: usize) -> F32Span {
    F32Span { name, addr: p as usize, len }
}

/// One AdamW (or Adam) step in place over `len` float32 elements: exactly
/// `torch.optim.AdamW`'s single-tensor CPU update (bitwise for the states; the parameter can
/// differ where PyTorch's float32 `sqrt` is not correctly rounded, docs/C_ABI.md). `step` is
/// the step number counting this one (1 first). `param`, `exp_avg`, `exp_avg_sq` (zeros before
/// the first step) and, with `amsgrad`, `max_exp_avg_sq` are written; `grad` is read; without
/// amsgrad `max_exp_avg_sq` may be NULL (and is ignored). Errors (`TERAIO_ERR_INVALID_ARGUMENT`,
/// nothing written): `params` NULL, a hyperparameter out of range or a flag not 0/1 (the
/// message names it and its value), `step` 0, a NULL or misaligned (not 4-byte) pointer with
/// `len` > 0, `len` above `PTRDIFF_MAX / 4`, two buffers that overlap.
///
/// # Safety
/// `params` is valid for a read; each pointer is valid for `len` floats (reads, and writes
/// for those written) for the call, and no other thread uses that memory meanwhile.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_adamw_step(
    params: *const teraio_adamw_params,
    step: u64,
    param: *mut f32,
    grad: *const f32,
    exp_avg: *mut f32,
    exp_avg_sq: *mut f32,
    max_exp_avg_sq: *mut f32,
    len: usize,
) -> teraio_status {
    guard("teraio_adamw_step", || {
        // SAFETY: forwarded contract.
        let h = unsafe { read_params(params) }?;
        let args = AdamArgs {
            step,
            lr: h.lr,
            beta1: h.beta1,
            beta2: h.beta2,
            eps: h.eps,
            weight_decay: h.weight_decay,
            amsgrad: flag("amsgrad", h.amsgrad)?,
            maximize: flag("maximize", h.maximize)?,
            decoupled_weight_decay: flag("decoupled_weight_decay", h.decoupled_weight_decay)?,
            threads: h.threads as usize,
        };
        let (p, g) = (span("param", param, len), span("grad", grad, len));
        let (m, v) = (span("exp_avg", exp_avg, len), span("exp_avg_sq", exp_avg_sq, len));
        let x = args.amsgrad.then(|| span("max_exp_avg_sq", max_exp_avg_sq, len));
        let mut spans = vec![p, g, m, v];
        spans.extend(x);
        check_spans(&spans)?;
        // SAFETY: the spans passed check_spans together; the caller guarantees the memory.
        let (p, g, m, v) = unsafe { (slice_mut(p), slice(g), slice_mut(m), slice_mut(v)) };
        // SAFETY: as above.
        let x = x.map(|x| unsafe { slice_mut(x) });
        adam_step(&args, p, g, m, v, x)?;
        Ok(Status::Ok)
    })
}

/// One SGD step in place over `len` float32 elements: exactly `torch.optim.SGD`'s
/// single-tensor CPU update (bitwise). With momentum, `momentum_buffer` is required and
/// written; `fresh_buffer` = 1 on its first step (PyTorch's `momentum_buffer` is None: it is
/// set to the gradient, its contents unread), 0 after. Without momentum `momentum_buffer` may be
/// NULL (and is ignored). Errors as [`teraio_adamw_step`].
///
/// # Safety
/// As [`teraio_adamw_step`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_sgd_step(
    params: *const teraio_sgd_params,
    param: *mut f32,
    grad: *const f32,
    momentum_buffer: *mut f32,
    fresh_buffer: i32,
    len: usize,
) -> teraio_status {
    guard("teraio_sgd_step", || {
        // SAFETY: forwarded contract.
        let h = unsafe { read_params(params) }?;
        let sgd = Sgd {
            lr: h.lr,
            momentum: h.momentum,
            dampening: h.dampening,
            weight_decay: h.weight_decay,
            nesterov: flag("nesterov", h.nesterov)?,
            maximize: flag("maximize", h.maximize)?,
            threads: h.threads as usize,
        };
        let fresh = flag("fresh_buffer", fresh_buffer)?;
        let (p, g) = (span("param", param, len), span("grad", grad, len));
        let b = (sgd.momentum != 0.0).then(|| span("momentum_buffer", momentum_buffer, len));
        let mut spans = vec![p, g];
        spans.extend(b);
        check_spans(&spans)?;
        // SAFETY: the spans passed check_spans together; the caller guarantees the memory.
        let (p, g) = unsafe { (slice_mut(p), slice(g)) };
        // SAFETY: as above.
        let b = b.map(|b| unsafe { slice_mut(b) });
        sgd_step(&sgd, p, g, b, fresh)?;
        Ok(Status::Ok)
    })
}
