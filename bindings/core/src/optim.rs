//! The host optimizer steps ([`teraio_engine::optim`]) as both bindings call them: caller
//! memory checked before a slice is made of it ([`check_spans`]), and one hyperparameter set
//! per optimizer whose weight-decay flavour is a flag, as in `torch.optim.Adam`.

use teraio_engine::optim::{Adam, AdamW, Sgd};

use crate::{Error, Result};

/// A float32 buffer of caller memory, as a foreign caller passes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct F32Span {
    /// The argument's name (for messages).
    pub name: &'static str,
    /// Address of the first element.
    pub addr: usize,
    /// Elements (not bytes).
    pub len: usize,
}

impl F32Span {
    /// The bytes `[start, end)` the span covers.
    fn range(&self) -> (usize, usize) {
        (self.addr, self.addr + self.len * 4)
    }
}

/// Check caller buffers before slices are made of them: each non-null unless empty, aligned to
/// 4 bytes, no larger than `isize::MAX` bytes nor wrapping around the address space, and no
/// two overlapping (one is written while another is read: they must be distinct memory). Empty
/// spans are never touched and pass whatever their address.
pub fn check_spans(spans: &[F32Span]) -> Result<()> {
    for s in spans {
        if s.len == 0 {
            continue;
        }
        if s.addr == 0 {
            return Err(Error::InvalidArgument(format!(
                "`{}` is NULL (with {} elements)",
                s.name, s.len
            )));
        }
        let fits = s.len.checked_mul(4).filter(|&b| b <= isize::MAX as usize);
        if fits.and_then(|b| s.addr.checked_add(b)).is_none() {
            return Err(Error::InvalidArgument(format!(
                "`{}`: {} float32 elements at {:#x} are larger than any memory object (at most {} \
                 bytes that do not wrap around the address space)",
                s.name,
                s.len,
                s.addr,
                isize::MAX
            )));
        }
        if !s.addr.is_multiple_of(4) {
            return Err(Error::InvalidArgument(format!(
                "`{}` at {:#x} is not aligned to 4 bytes (float32 buffers must be)",
                s.name, s.addr
            )));
        }
    }
    for (i, a) in spans.iter().enumerate() {
        for b in &spans[i + 1..] {
            if a.len == 0 || b.len == 0 {
                continue;
            }
            let ((a0, a1), (b0, b1)) = (a.range(), b.range());
            if a0 < b1 && b0 < a1 {
                return Err(Error::InvalidArgument(format!(
                    "`{}` ({} elements at {a0:#x}) and `{}` ({} elements at {b0:#x}) overlap: \
                     every buffer of a step must be distinct memory",
                    a.name, a.len, b.name, b.len
                )));
            }
        }
    }
    Ok(())
}

/// An Adam step's hyperparameters as the bindings take them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamArgs {
    /// Step number (1 for the first).
    pub step: u64,
    /// Learning rate.
    pub lr: f64,
    /// `betas[0]`.
    pub beta1: f64,
    /// `betas[1]`.
    pub beta2: f64,
    /// `eps`.
    pub eps: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// AMSGrad.
    pub amsgrad: bool,
    /// Maximize.
    pub maximize: bool,
    /// AdamW (true) or Adam's L2 weight decay (false).
    pub decoupled_weight_decay: bool,
    /// Threads (0: all).
    pub threads: usize,
}

/// One Adam(W) step (see [`AdamW::step`]).
pub fn adam_step(
    a: &AdamArgs,
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    max_exp_avg_sq: Option<&mut [f32]>,
) -> Result<()> {
    let h = AdamW {
        lr: a.lr,
        betas: (a.beta1, a.beta2),
        eps: a.eps,
        weight_decay: a.weight_decay,
        amsgrad: a.amsgrad,
        maximize: a.maximize,
        threads: a.threads,
    };
    if a.decoupled_weight_decay {
        h.step(a.step, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq)?;
    } else {
        Adam::from(h).step(a.step, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq)?;
    }
    Ok(())
}

/// One SGD step (see [`Sgd::step`]).
pub fn sgd_step(
    h: &Sgd,
    param: &mut [f32],
    grad: &[f32],
    momentum_buffer: Option<&mut [f32]>,
    fresh_buffer: bool,
) -> Result<()> {
    Ok(h.step(param, grad, momentum_buffer, fresh_buffer)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;

    fn span(name: &'static str, addr: usize, len: usize) -> F32Span {
        F32Span { name, addr, len }
    }

    #[test]
    fn spans_are_checked_for_null_alignment_size_and_overlap() {
        let ok = [span("param", 0x1000, 4), span("grad", 0x1010, 4), span("m", 0, 0)];
        check_spans(&ok).unwrap();
        for (spans, what) in [
            (vec![span("grad", 0, 3)], "`grad` is NULL"),
            (vec![span("param", 0x1002, 1)], "`param` at 0x1002 is not aligned"),
            (vec![span("param", 0x1000, usize::MAX / 2)], "larger than any memory object"),
            (vec![span("param", usize::MAX - 3, 2)], "larger than any memory object"),
            (
                vec![span("param", 0x1000, 4), span("exp_avg", 0x100c, 4)],
                "`param` (4 elements at 0x1000) and `exp_avg` (4 elements at 0x100c) overlap",
            ),
            (vec![span("a", 0x1000, 1), span("b", 0x2000, 1), span("c", 0x2000, 8)], "`b`"),
        ] {
            let e = check_spans(&spans).unwrap_err();
            assert_eq!(e.status(), Status::InvalidArgument);
            assert!(e.to_string().contains(what), "{e}");
        }
    }

    #[test]
    fn the_flag_picks_the_weight_decay() {
        let a = AdamArgs {
            step: 1,
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.5,
            amsgrad: false,
            maximize: false,
            decoupled_weight_decay: true,
            threads: 1,
        };
        let run = |a: &AdamArgs| {
            let (mut p, mut m, mut v) = (vec![1.0f32], vec![0.0f32], vec![0.0f32]);
            adam_step(a, &mut p, &[0.0], &mut m, &mut v, None).unwrap();
            (p[0], m[0])
        };
        // AdamW: decayed, the zero gradient leaves the averages at zero.
        assert_eq!(run(&a), ((1.0 - 0.1 * 0.5) as f32, 0.0));
        // Adam: the decay went into the gradient.
        let (_, m) = run(&AdamArgs { decoupled_weight_decay: false, ..a });
        assert!((m - 0.05).abs() < 1e-7, "{m}");
        let e = adam_step(&AdamArgs { lr: -1.0, ..a }, &mut [], &[], &mut [], &mut [], None);
        assert!(e.unwrap_err().to_string().contains("lr = -1"));
    }
}
