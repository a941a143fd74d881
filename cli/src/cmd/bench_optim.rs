//! `teraio bench-optim`: throughput of the host optimizer step (`teraio_engine::optim`) over one
//! large float32 tensor (or `--tensors` pieces of it, stepped one after another as a model's
//! parameters are), per thread count.
//!
//! The figure is memory traffic over time: AdamW reads the parameter, the gradient and both
//! states and writes the parameter and both states, 28 bytes a parameter (36 with amsgrad);
//! SGD with momentum 20 (12 without). Compare it with the machine's memory bandwidth (STREAM's
//! triad, or `mbw`): a step that is memory bound runs near it. Buffers are allocated and
//! touched before the clock starts; each thread count runs `--warmup` steps, then `--steps`
//! timed ones, and reports the median and the fastest.

use std::time::Instant;

use serde_json::json;
use teraio_engine::optim::{self, Adam, AdamW, Isa, Sgd};

use crate::units::parse_size;
use crate::{CliError, Result};

/// Which optimizer to time.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Optimizer {
    /// AdamW (decoupled weight decay).
    Adamw,
    /// Adam (L2 weight decay).
    Adam,
    /// SGD with momentum 0.9.
    Sgd,
}

/// The instruction set to run (auto: the fastest this CPU has).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum IsaArg {
    /// The fastest this CPU runs.
    Auto,
    /// AVX-512F.
    Avx512,
    /// AVX2 + FMA.
    Avx2,
    /// The build's baseline target.
    Portable,
}

/// Options of `teraio bench-optim`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  teraio bench-optim                                   # AdamW, 256M parameters, all threads
  teraio bench-optim --params 64M --threads 1,2,4,8,16 --json
  teraio bench-optim --params 1G --tensors 200           # a 1B model's 200 tensors, one by one
  teraio bench-optim --optimizer sgd --amsgrad         # (amsgrad is Adam's; ignored by SGD)")]
pub struct Args {
    /// The optimizer.
    #[arg(long, value_enum, default_value = "adamw")]
    pub optimizer: Optimizer,
    /// Parameters in the tensor (k, M, G suffixes are powers of 1024: 256M = 268,435,456).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub params: u64,
    /// Step the parameters as this many tensors of (nearly) equal size, one after another, as an
    /// optimizer steps a model's parameters: each call's start (its threads' dispatch) counts.
    #[arg(long, default_value_t = 1)]
    pub tensors: usize,
    /// Thread counts to run, comma-separated (default: the machine's available parallelism).
    #[arg(long, value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Timed steps per thread count.
    #[arg(long, default_value_t = 10)]
    pub steps: u32,
    /// Untimed steps before them.
    #[arg(long, default_value_t = 2)]
    pub warmup: u32,
    /// Adam(W) with amsgrad (a third state).
    #[arg(long)]
    pub amsgrad: bool,
    /// The instruction set.
    #[arg(long, value_enum, default_value = "auto")]
    pub isa: IsaArg,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One thread count's result.
#[derive(Debug)]
pub struct Row {
    /// Threads asked.
    pub threads: usize,
    /// Median step, seconds.
    pub median_s: f64,
    /// Fastest step, seconds.
    pub min_s: f64,
}

/// Bytes a step reads and writes per parameter.
pub fn bytes_per_param(opt: Optimizer, amsgrad: bool) -> u64 {
    match (opt, amsgrad) {
        (Optimizer::Sgd, _) => 20,
        (_, false) => 28,
        (_, true) => 36,
    }
}

/// Time `steps` steps (after `warmup`) of `opt` over `n` parameters, cut into `tensors` tensors
/// stepped one after another, for each thread count.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    opt: Optimizer,
    isa: Isa,
    n: usize,
    tensors: usize,
    amsgrad: bool,
    threads: &[usize],
    warmup: u32,
    steps: u32,
) -> Result<Vec<Row>> {
    // Values like a run's (not zeros: no denormal or zero shortcuts), written before the clock.
    let fill = |scale: f32, seed: u32| -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let h = (i ^ seed).wrapping_mul(0x9E37_79B9) >> 9;
                (h as f32 / (1u32 << 23) as f32 - 0.5) * scale
            })
            .collect()
    };
    let mut param = fill(2.0, 1);
    let grad = fill(0.1, 2);
    let mut s1: Vec<f32> = fill(0.01, 3);
    let mut s2: Vec<f32> = fill(1e-4, 4).into_iter().map(f32::abs).collect();
    let mut s3: Vec<f32> = if amsgrad { s2.clone() } else { Vec::new() };
    let piece = n.div_ceil(tensors.max(1)).max(1);
    let mut rows = Vec::new();
    let mut step_no = 0u64;
    for &t in threads {
        let mut times = Vec::with_capacity(steps as usize);
        for i in 0..warmup + steps {
            step_no += 1;
            let start = Instant::now();
            let bufs =
                Bufs { param: &mut param, grad: &grad, s1: &mut s1, s2: &mut s2, s3: &mut s3 };
            step_pieces(opt, isa, amsgrad, t, step_no, piece, bufs)?;
            if i >= warmup {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        rows.push(Row { threads: t, median_s: times[times.len() / 2], min_s: times[0] });
    }
    Ok(rows)
}

/// One step's buffers: the parameter, its gradient and the states (`s3` empty without amsgrad).
struct Bufs<'a> {
    param: &'a mut [f32],
    grad: &'a [f32],
    s1: &'a mut [f32],
    s2: &'a mut [f32],
    s3: &'a mut [f32],
}

/// One step of `opt` over `b`, as tensors of `piece` parameters stepped one after another.
fn step_pieces(
    opt: Optimizer,
    isa: Isa,
    amsgrad: bool,
    threads: usize,
    step_no: u64,
    piece: usize,
    b: Bufs<'_>,
) -> Result<()> {
    let mut max = b.s3.chunks_mut(piece);
    let pieces = b.param.chunks_mut(piece).zip(b.grad.chunks(piece));
    for (((p, g), m1), m2) in pieces.zip(b.s1.chunks_mut(piece)).zip(b.s2.chunks_mut(piece)) {
        let max = if amsgrad { max.next() } else { None };
        match opt {
            Optimizer::Adamw => AdamW { amsgrad, threads, ..AdamW::default() }
                .step_on(isa, step_no, p, g, m1, m2, max)?,
            Optimizer::Adam => Adam { amsgrad, threads, weight_decay: 0.01, ..Adam::default() }
                .step_on(isa, step_no, p, g, m1, m2, max)?,
            Optimizer::Sgd => Sgd { momentum: 0.9, threads, ..Sgd::default() }.step_on(
                isa,
                p,
                g,
                Some(m1),
                false,
            )?,
        }
    }
    Ok(())
}

/// Run the benchmark.
pub fn run(a: Args) -> Result<()> {
    let n = usize::try_from(a.params)
        .map_err(|_| CliError::Usage(format!("--params {} does not fit in memory", a.params)))?;
    if a.steps == 0 {
        return Err(CliError::Usage("--steps must be at least 1".into()));
    }
    let threads =
        if a.threads.is_empty() { vec![optim::default_threads()] } else { a.threads.clone() };
    if let Some(t) = threads.iter().find(|&&t| t == 0) {
        return Err(CliError::Usage(format!("--threads {t}: a thread count is at least 1")));
    }
    let isa = match a.isa {
        IsaArg::Auto => optim::isa(),
        IsaArg::Avx512 => Isa::Avx512,
        IsaArg::Avx2 => Isa::Avx2,
        IsaArg::Portable => Isa::Portable,
    };
    if !isa.supported() {
        return Err(CliError::Usage(format!("--isa {}: this CPU does not run it", isa.name())));
    }
    if a.tensors == 0 || a.tensors > n.max(1) {
        return Err(CliError::Usage(format!(
            "--tensors {}: give between 1 and --params ({n}) tensors",
            a.tensors
        )));
    }
    let per_param = bytes_per_param(a.optimizer, a.amsgrad);
    let rows = measure(a.optimizer, isa, n, a.tensors, a.amsgrad, &threads, a.warmup, a.steps)?;
    let traffic = (n as u64 * per_param) as f64;
    let name = format!("{:?}", a.optimizer).to_lowercase();
    if a.json {
        let out: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "threads": r.threads,
                    "step_s_median": r.median_s,
                    "step_s_min": r.min_s,
                    "params_per_s": n as f64 / r.median_s,
                    "bytes_per_s": traffic / r.median_s,
                })
            })
            .collect();
        let doc = json!({
            "optimizer": name,
            "amsgrad": a.amsgrad,
            "isa": isa.name(),
            "params": n,
            "tensors": a.tensors,
            "bytes_per_param": per_param,
            "steps": a.steps,
            "results": out,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!(
        "{name}{} over {n} parameters{} ({:.2} GB of traffic a step, {per_param} B/param), {} build, \
         median of {} steps:",
        if a.amsgrad && a.optimizer != Optimizer::Sgd { " (amsgrad)" } else { "" },
        if a.tensors > 1 { format!(" in {} tensors", a.tensors) } else { String::new() },
        traffic / 1e9,
        isa.name(),
        a.steps
    );
    println!("  threads   step ms   (min)     Gparam/s   GB/s");
    for r in &rows {
        println!(
            "  {:>7}   {:>7.2}   ({:>6.2})  {:>8.3}   {:>6.1}",
            r.threads,
            r.median_s * 1e3,
            r.min_s * 1e3,
            n as f64 / r.median_s / 1e9,
            traffic / r.median_s / 1e9
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_reports_every_thread_count() {
        for opt in [Optimizer::Adamw, Optimizer::Adam, Optimizer::Sgd] {
            let rows = measure(opt, optim::isa(), 200_003, 1, true, &[1, 3], 1, 2).unwrap();
            assert_eq!(rows.iter().map(|r| r.threads).collect::<Vec<_>>(), [1, 3]);
            assert!(rows.iter().all(|r| r.median_s > 0.0 && r.min_s <= r.median_s));
        }
        assert_eq!(bytes_per_param(Optimizer::Adamw, false), 28);
    }

    #[test]
    fn tensors_step_every_parameter_once() {
        // 1000 parameters as one tensor and as 7 (the last one shorter), two steps each: the
        // same values bitwise (a piece skipped or stepped twice would differ)
        let run = |piece: usize| {
            let mut b: Vec<Vec<f32>> = (0..5)
                .map(|k| {
                    (0..1000).map(|i| ((i * 7 + k * 13) % 101) as f32 / 101.0 + 0.01).collect()
                })
                .collect();
            let [p, g, s1, s2, s3] = &mut b[..] else { unreachable!() };
            for step in 1..=2 {
                for opt in [Optimizer::Adamw, Optimizer::Sgd] {
                    let bufs = Bufs { param: p, grad: g, s1, s2, s3 };
                    step_pieces(opt, optim::isa(), true, 2, step, piece, bufs).unwrap();
                }
            }
            b
        };
        let (one, seven) = (run(1000), run(1000usize.div_ceil(7)));
        assert!(one[0].iter().zip(&seven[0]).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(one[4].iter().zip(&seven[4]).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_ne!(one[0], run(1000)[1], "the step changed the parameters");
    }
}
