//! `teraio trace`: generate synthetic transformer training traces.

use std::path::PathBuf;

use teraio_scheduler::{ModelConfig, Trace, generate};

use crate::output::outln;
use crate::{CliError, Result};

/// Subcommands of `teraio trace`.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Generate a synthetic training trace (one iteration on one GPU).
    Gen(GenArgs),
}

/// Options of `teraio trace gen`.
#[derive(clap::Args, Debug)]
pub struct GenArgs {
    /// Model preset: llama3-8b, granite-8b, llama3-70b, gpt2-small, gpt2-medium, gpt2-large,
    /// gpt2-xl, gpt2-replay (laptop-sized, 10 s iteration). Options below override it.
    #[arg(long, default_value = "gpt2-small")]
    pub model: String,
    /// Transformer layers.
    #[arg(long)]
    pub layers: Option<u32>,
    /// Hidden size.
    #[arg(long)]
    pub hidden: Option<u64>,
    /// Attention heads.
    #[arg(long)]
    pub heads: Option<u32>,
    /// Key/value heads.
    #[arg(long)]
    pub kv_heads: Option<u32>,
    /// FFN intermediate size.
    #[arg(long)]
    pub ffn: Option<u64>,
    /// Vocabulary size.
    #[arg(long)]
    pub vocab: Option<u64>,
    /// Sequence length.
    #[arg(long)]
    pub seq: Option<u64>,
    /// Sequences per micro-batch.
    #[arg(long)]
    pub micro_batch: Option<u64>,
    /// Micro-batches (gradient accumulation steps) per iteration.
    #[arg(long)]
    pub micro_batches: Option<u32>,
    /// fp32 (fp32 tensors, CUDA-core matmuls: PyTorch's default), tf32 (fp32 tensors, TF32
    /// tensor-core matmuls) or bf16 (bf16 weights/activations, fp32 master weights).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Tensor-parallel degree.
    #[arg(long)]
    pub tp: Option<u32>,
    /// Pipeline-parallel degree.
    #[arg(long)]
    pub pp: Option<u32>,
    /// Pipeline stage of this GPU.
    #[arg(long)]
    pub stage: Option<u32>,
    /// GPU of the roofline: h100 (NVL), h100-sxm, h200, a100.
    #[arg(long)]
    pub gpu: Option<String>,
    /// Scale kernel durations so the all-resident iteration takes this many seconds.
    #[arg(long)]
    pub iteration_s: Option<f64>,
    /// Activation checkpointing of every layer: forward keeps only layer inputs, backward
    /// recomputes each layer first (how DeepSpeed/ZeRO-Infinity runs large batches; see
    /// `teraio simulate --checkpointed-trace`).
    #[arg(long, conflicts_with = "checkpoint_layers")]
    pub activation_checkpointing: bool,
    /// Activation checkpointing of the first N layers only (`teraio advise --what
    /// checkpointing` finds the best N).
    #[arg(long, value_name = "N")]
    pub checkpoint_layers: Option<u32>,
    /// Selective recomputation in the other layers: norm and activation-function outputs are
    /// remade in backward instead of kept (cheap kernels, about 30% of a layer's activations).
    #[arg(long)]
    pub selective_recompute: bool,
    /// Step each parameter's optimizer as soon as its gradient is final (during the last
    /// micro-batch's backward), as PyTorch's optimizer-in-backward hooks do. Same training
    /// math, except that it rules out clipping by the global gradient norm.
    #[arg(long, conflicts_with = "optimizer_in_forward")]
    pub optimizer_in_backward: bool,
    /// Step each parameter's optimizer right before its first use in the next iteration's
    /// forward pass, so the step's transfers overlap the forward pass. The same updates as
    /// the step at the end, clipping by the global gradient norm included.
    #[arg(long)]
    pub optimizer_in_forward: bool,
    /// FSDP2 (`fully_shard` on every layer and the root) over N ranks, each with its own
    /// micro-batches: the trace is one rank's. Its parameters, gradients and optimizer states
    /// are 1/N shards (fp32, padded as FSDP2 pads them); each layer's parameters are
    /// all-gathered whole before its forward and again before its backward (while the layer
    /// before computes) and freed after, the root's for the whole micro-batch: tensors
    /// `mbM.NAME.w.unsharded[.fwd|.bwd]` that every kernel in between accesses, so no plan
    /// moves them (FSDP owns them); each layer's unsharded gradients are reduce-scattered into
    /// the shards after its backward. Kernels `*.all_gather*` and `*.reduce_scatter` take the
    /// time on the link (--link-gbps) that the compute around them does not hide; 0 with one
    /// rank. Not with --tp/--pp or the optimizer in forward/backward (docs/FSDP.md).
    #[arg(long, value_name = "N")]
    pub fsdp_ranks: Option<u32>,
    /// GPU-to-GPU bandwidth of the collectives, GB/s per direction as NCCL's bus bandwidth
    /// (FSDP's all-gathers and reduce-scatters, tensor-parallel all-reduces, pipeline sends).
    /// Default: the GPU's, 350 for H100/H200 (NVLink 4), 250 for A100 (assumed, not measured);
    /// give less where the GPUs talk over PCIe (8 H100 NVL cards have NVLink only between
    /// bridged pairs): PCIe Gen5 moves at most about 50 a direction.
    #[arg(long, value_name = "GBPS")]
    pub link_gbps: Option<f64>,
    /// With --fsdp-ranks: the collectives overlap no compute (every microsecond on the link
    /// delays the GPU), as teraio.torch runs FSDP2 on a GPU today (it waits for each one).
    #[arg(long, requires = "fsdp_ranks")]
    pub fsdp_no_overlap: bool,
    /// Leave out which accesses write (`writes`), as traces made before that field did:
    /// every access then counts as a write and no plan can drop a clean copy. For comparisons.
    #[arg(long)]
    pub every_access_writes: bool,
    /// Output file (default: standard output).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

/// Build the model configuration from a preset and overrides: each option given goes through
/// `ModelConfig::set` under its long name, the same path as the keys of a `preset:` spec.
pub fn config(a: &GenArgs) -> Result<ModelConfig> {
    let mut c = ModelConfig::preset(&a.model)?;
    let values: [(&str, Option<String>); 18] = [
        ("layers", a.layers.map(|v| v.to_string())),
        ("hidden", a.hidden.map(|v| v.to_string())),
        ("heads", a.heads.map(|v| v.to_string())),
        ("kv-heads", a.kv_heads.map(|v| v.to_string())),
        ("ffn", a.ffn.map(|v| v.to_string())),
        ("vocab", a.vocab.map(|v| v.to_string())),
        ("seq", a.seq.map(|v| v.to_string())),
        ("micro-batch", a.micro_batch.map(|v| v.to_string())),
        ("micro-batches", a.micro_batches.map(|v| v.to_string())),
        ("dtype", a.dtype.clone()),
        ("tp", a.tp.map(|v| v.to_string())),
        ("pp", a.pp.map(|v| v.to_string())),
        ("stage", a.stage.map(|v| v.to_string())),
        ("gpu", a.gpu.clone()),
        ("checkpoint-layers", a.checkpoint_layers.map(|v| v.to_string())),
        ("iteration-s", a.iteration_s.map(|v| v.to_string())),
        ("fsdp-ranks", a.fsdp_ranks.map(|v| v.to_string())),
        ("link-gbps", a.link_gbps.map(|v| v.to_string())),
    ];
    // Flags last: `activation-checkpointing` covers the layer count set above.
    let flags = [
        ("activation-checkpointing", a.activation_checkpointing),
        ("selective-recompute", a.selective_recompute),
        ("optimizer-in-backward", a.optimizer_in_backward),
        ("optimizer-in-forward", a.optimizer_in_forward),
        ("fsdp-no-overlap", a.fsdp_no_overlap),
    ];
    let set = |c: &mut ModelConfig, key: &str, value: Option<&str>| {
        c.set(key, value).map_err(|e| CliError::Usage(format!("--{key}: {e}")))
    };
    for (key, value) in &values {
        if let Some(v) = value {
            set(&mut c, key, Some(v))?;
        }
    }
    for (key, on) in flags {
        if on {
            set(&mut c, key, None)?;
        }
    }
    Ok(c)
}

/// Load a trace: a JSON file (gzip-compressed or not), or `preset:NAME[,KEY=VALUE...]` to
/// generate a preset on the fly with overrides (`preset:llama3-8b,dtype=tf32,activation-checkpointing`;
/// keys as the long options of `teraio trace gen`, see `ModelConfig::set`).
pub fn load(spec: &str) -> Result<Trace> {
    if let Some(model) = spec.strip_prefix("preset:") {
        return Ok(generate(&ModelConfig::from_spec(model)?)?);
    }
    load_file(std::path::Path::new(spec))
}

/// Load a trace file (JSON, gzip-compressed or not); an error names the file, once.
pub fn load_file(path: &std::path::Path) -> Result<Trace> {
    let text = read_text(path)?;
    Trace::from_json(&text).map_err(|e| crate::error::scheduler_file(path, "trace", e))
}

/// A trace (or plan) file's text: JSON, or JSON compressed with gzip (found by its magic bytes,
/// whatever the file is called), at most [`teraio_scheduler::trace_text_bytes_max`] bytes
/// (decompressed): a larger one is an error naming the file and the limit, found without
/// reading (or decompressing) more than the limit. A UTF-8 byte order mark is skipped.
pub fn read_text(path: &std::path::Path) -> Result<String> {
    use std::io::Read;
    let max = teraio_scheduler::trace_text_bytes_max()?;
    let too_large = |what: &str| {
        CliError::Usage(format!(
            "{}: {what} more than {max} bytes, the limit on a trace's text (set {}=BYTES to \
             raise it)",
            path.display(),
            teraio_scheduler::TRACE_TEXT_BYTES_MAX_ENV
        ))
    };
    let file =
        std::fs::File::open(path).map_err(|source| CliError::File { path: path.into(), source })?;
    let mut bytes = Vec::new();
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|source| CliError::File { path: path.into(), source })?;
    if bytes.len() as u64 > max {
        return Err(too_large("the file holds"));
    }
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut text = Vec::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .take(max.saturating_add(1))
            .read_to_end(&mut text)
            .map_err(|e| {
                CliError::Usage(format!(
                    "{}: gzip-compressed, but not a whole gzip stream of JSON text: {e}",
                    path.display()
                ))
            })?;
        if text.len() as u64 > max {
            return Err(too_large("gzip-compressed, it expands to"));
        }
        bytes = text;
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        CliError::Usage(format!(
            "{}: neither JSON text nor gzip-compressed JSON (invalid UTF-8 at byte {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

/// Write text to a file, or to standard output when `path` is `None`.
pub fn write_out(path: Option<&std::path::Path>, text: &str) -> Result<()> {
    match path {
        Some(p) => {
            std::fs::write(p, text).map_err(|source| CliError::File { path: p.into(), source })
        }
        None => {
            outln!("{text}");
            Ok(())
        }
    }
}

/// Run `teraio trace`.
pub fn run(cmd: Command) -> Result<()> {
    match cmd {
        Command::Gen(a) => {
            let cfg = config(&a)?;
            let mut trace = generate(&cfg)?;
            if a.every_access_writes {
                for t in &mut trace.tensors {
                    t.writes = None;
                }
            }
            write_out(a.output.as_deref(), &trace.to_json())?;
            if a.output.is_some() {
                eprintln!(
                    "{}: {} kernels, {} tensors, {:.3} s ideal iteration",
                    trace.name,
                    trace.kernels.len(),
                    trace.tensors.len(),
                    trace.iteration_time_us() / 1e6
                );
            }
            Ok(())
        }
    }
}
