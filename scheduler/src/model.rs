//! Synthetic traces of decoder-only transformer training, per GPU.
//!
//! One iteration = `micro_batches` forward+backward passes (gradient accumulation, GPipe
//! order on a pipeline stage) followed by one AdamW step per parameter tensor. Kernel
//! durations come from a roofline of a named GPU: `max(flops / (peak * efficiency), bytes /
//! (hbm * 0.58)) + 4 us launch`, where `bytes` is the size of every tensor the kernel touches.
//! The efficiencies were measured on an H200 with PyTorch 2.11 (`benches/gpu/`,
//! docs/BENCHMARKS.md): matmuls reach 0.75 of the CUDA-core peak in fp32, 0.61 of the TF32
//! peak and 0.68 of the bf16 peak; causal attention (SDPA) 0.67 forward / 0.53 backward of
//! the fp32 CUDA-core peak in fp32 *and* tf32 (PyTorch has no TF32 attention kernel), 0.59 /
//! 0.46 of the bf16 peak in bf16; memory-bound kernels 0.58 of HBM bandwidth. Other GPUs are
//! assumed to reach the same fractions.
//!
//! Precision: `fp32` keeps weights, gradients and both AdamW moments in fp32 (16 B/param) and
//! runs matmuls on CUDA cores (PyTorch's default: TF32 off); `tf32` stores the same fp32
//! tensors but runs matmuls on TF32 tensor cores (`torch.backends.cuda.matmul.allow_tf32 =
//! True`, Hugging Face `--tf32`); `bf16` keeps bf16 weights and gradients plus fp32 master
//! weights and moments (16 B/param) and runs on tensor cores.
//!
//! # FSDP2
//! With [`ModelConfig::fsdp_ranks`] = N the trace is one rank's of FSDP2 data parallelism
//! (`fully_shard` on every transformer layer and on the root), each rank on its own
//! micro-batches (the same compute as without FSDP):
//! - its **shards**: every weight, gradient and AdamW moment `ceil(elements / N)` elements, in
//!   fp32 (FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` keeps the
//!   sharded parameter in fp32 and gathers it in bf16, so a bf16 trace has no master copy).
//!   The weights are read by the all-gathers and written by the optimizer; the gradient shard
//!   is made by the first micro-batch's reduce-scatter and accumulated by the others';
//! - FSDP's **gathered parameters** (`mbM.NAME.w.unsharded`, `.fwd`, `.bwd`): the root's
//!   (embedding, final norm, head) all-gathered at the start of each micro-batch and kept
//!   until its backward is done (FSDP2 does not reshard the root after forward); each layer's
//!   all-gathered before its forward and again before its backward, while the layer before
//!   (in that pass's order) computes, and freed after its last kernel of the pass. Every kernel
//!   of their lifetime accesses them, so no plan offloads them (FSDP owns them: teraio.torch
//!   leaves them alone), and an activation whose operator reads one has no producer (FSDP may
//!   have freed it where a recomputation would run);
//! - each micro-batch's **unsharded gradients** (`mbM.NAME.grad.unsharded`), written by the
//!   layer's backward and reduce-scattered into the shards right after it;
//! - the **collectives**, kernels `mbM.root.all_gather`, `mbM.LL.all_gather.fwd|.bwd`,
//!   `mbM.LL.reduce_scatter`, `mbM.root.reduce_scatter` ([`is_fsdp_collective`]). A ring moves
//!   `(N - 1) / N` of the whole tensors (parameters in their dtype, gradients in fp32) at the
//!   link's rate ([`ModelConfig::link_bytes_per_s`]); the compute kernels running meanwhile
//!   hide that time (a layer's forward hides the next layer's all-gather; a layer's backward
//!   the next backward all-gather and the reduce-scatter of the layer after it), and the
//!   kernel's duration is what is left (0 with one rank). The root's all-gather and
//!   reduce-scatter have nothing to hide behind. [`ModelConfig::fsdp_no_overlap`]: nothing
//!   hides them.
//!
//! With one rank the trace is the unsharded one (same kernels and times, same tensor sizes in
//! fp32) plus the gathered copies, the unsharded gradients and collectives of no time.
//! [`ModelConfig::fsdp_cpu_offload`] makes FSDP2's `CPUOffloadPolicy` instead: no shard or
//! state in the trace, their copies in the collectives' time, the optimizer on the CPU.

use serde::{Deserialize, Serialize};

use crate::trace::{Kernel, Tensor, TensorId, TensorKind, Trace};
use crate::{Error, Result};

mod fsdp;

/// Element type of weights and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// 4 bytes, CUDA-core FLOP/s.
    Fp32,
    /// 4 bytes (fp32 storage), TF32 tensor-core FLOP/s for matmuls.
    Tf32,
    /// 2 bytes, tensor-core FLOP/s, fp32 master weights.
    Bf16,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Fp32 | Dtype::Tf32 => 4,
            Dtype::Bf16 => 2,
        }
    }

    /// Parse `fp32`, `tf32` or `bf16`.
    pub fn parse(s: &str) -> Result<Dtype> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" => Ok(Dtype::Fp32),
            "tf32" => Ok(Dtype::Tf32),
            "bf16" => Ok(Dtype::Bf16),
            _ => Err(Error::InvalidArgument(format!(
                "unknown dtype {s:?} (known: fp32, tf32, bf16)"
            ))),
        }
    }
}

/// A GPU of the roofline model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Gpu {
    /// H100 NVL, 94 GB (the paper's GPU).
    H100Nvl,
    /// H100 SXM, 80 GB.
    H100Sxm,
    /// H200 SXM, 141 GB.
    H200,
    /// A100 SXM, 80 GB.
    A100,
}

impl Gpu {
    /// Parse `h100` (= H100 NVL), `h100-nvl`, `h100-sxm`, `h200`, `a100`.
    pub fn parse(s: &str) -> Result<Gpu> {
        match s.to_ascii_lowercase().as_str() {
            "h100" | "h100-nvl" => Ok(Gpu::H100Nvl),
            "h100-sxm" => Ok(Gpu::H100Sxm),
            "h200" => Ok(Gpu::H200),
            "a100" => Ok(Gpu::A100),
            _ => Err(Error::InvalidArgument(format!(
                "unknown GPU {s:?} (known: h100, h100-nvl, h100-sxm, h200, a100)"
            ))),
        }
    }

    /// Dense peak FLOP/s for `dtype` (fp32: CUDA cores; tf32 and bf16: tensor cores; NVIDIA
    /// datasheets, the sparsity figures halved).
    pub fn peak_flops(self, dtype: Dtype) -> f64 {
        match (self, dtype) {
            (Gpu::H100Nvl, Dtype::Fp32) => 60e12,
            (Gpu::H100Nvl, Dtype::Tf32) => 418e12,
            (Gpu::H100Nvl, Dtype::Bf16) => 835e12,
            (Gpu::H100Sxm | Gpu::H200, Dtype::Fp32) => 67e12,
            (Gpu::H100Sxm | Gpu::H200, Dtype::Tf32) => 495e12,
            (Gpu::H100Sxm | Gpu::H200, Dtype::Bf16) => 989e12,
            (Gpu::A100, Dtype::Fp32) => 19.5e12,
            (Gpu::A100, Dtype::Tf32) => 156e12,
            (Gpu::A100, Dtype::Bf16) => 312e12,
        }
    }

    /// HBM bandwidth, bytes/s.
    pub fn hbm_bytes_per_s(self) -> f64 {
        match self {
            Gpu::H100Nvl => 3.9e12,
            Gpu::H100Sxm => 3.35e12,
            Gpu::H200 => 4.8e12,
            Gpu::A100 => 2.0e12,
        }
    }

    /// GPU-to-GPU bandwidth a collective reaches, bytes/s per direction (NCCL's bus
    /// bandwidth), used for tensor/pipeline-parallel and FSDP communication: 350 GB/s on the
    /// Hopper GPUs, about 78% of NVLink 4's 450 GB/s per direction (an assumed NCCL efficiency,
    /// not measured here; an H100 NVL has NVLink only to its bridge partner, so 8 of them talk
    /// over PCIe: set [`ModelConfig::link_bytes_per_s`]), 250 GB/s on the A100 (NVLink 3, 300).
    pub fn link_bytes_per_s(self) -> f64 {
        match self {
            Gpu::A100 => 250e9,
            _ => 350e9,
        }
    }

    /// Memory capacity, bytes.
    pub fn memory_bytes(self) -> u64 {
        match self {
            Gpu::H100Nvl => 94_000_000_000,
            Gpu::H100Sxm | Gpu::A100 => 80_000_000_000,
            Gpu::H200 => 141_000_000_000,
        }
    }
}

/// Shape and training setup of a decoder-only transformer, as seen by one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Name written into the trace.
    pub name: String,
    /// Transformer layers (whole model; a pipeline stage gets `layers / pipeline_parallel`).
    pub layers: u32,
    /// Hidden size.
    pub hidden: u64,
    /// Attention heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention; = heads for multi-head attention).
    pub kv_heads: u32,
    /// FFN intermediate size.
    pub ffn: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Sequence length.
    pub seq_len: u64,
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Micro-batches per iteration (gradient accumulation steps); global batch per GPU is
    /// `micro_batch * micro_batches`.
    pub micro_batches: u32,
    /// Element type.
    pub dtype: Dtype,
    /// SwiGLU MLP (gate and up projections) instead of a GELU MLP.
    pub gated_mlp: bool,
    /// LM head shares the embedding matrix.
    pub tied_embeddings: bool,
    /// Tensor-parallel degree (heads, FFN and vocabulary split; two all-reduces per layer).
    pub tensor_parallel: u32,
    /// Pipeline-parallel degree.
    pub pipeline_parallel: u32,
    /// Which pipeline stage this GPU's trace is for (0-based).
    pub pipeline_stage: u32,
    /// GPU of the roofline.
    pub gpu: Gpu,
    /// If set, scale kernel durations so the all-resident iteration takes this long.
    #[serde(default)]
    pub target_iteration_us: Option<f64>,
    /// Activation checkpointing (Hugging Face `gradient_checkpointing`,
    /// `deepspeed.checkpointing`) of the first this-many transformer layers of this GPU's
    /// stage (0: none; `layers` or more: all): the forward pass keeps only such a layer's
    /// input; backward first recomputes the layer's forward from it (kernels named
    /// `mbM.LL.rc.*`), then uses the recomputed activations. About a third more compute per
    /// checkpointed layer, far less activation memory. The first layers are chosen because
    /// their activations are held longest (from early forward to late backward).
    #[serde(default)]
    pub checkpointed_layers: u32,
    /// Selective recomputation in the layers not checkpointed: the outputs of the two norms
    /// and of the activation function (cheap, memory-bound kernels with large outputs) are
    /// not kept for backward but remade from their inputs right before backward reads them
    /// (kernels `mbM.LL.rc.norm1.fwd` etc.), as in Megatron's selective recomputation.
    #[serde(default)]
    pub selective_recompute: bool,
    /// The optimizer step of each parameter runs as soon as its gradient is final (right
    /// after the last micro-batch's backward kernel that writes it) instead of after the
    /// whole backward pass, as PyTorch's optimizer-in-backward hooks
    /// (`register_post_accumulate_grad_hook`) do: the step's transfers overlap the rest of
    /// the backward pass.
    #[serde(default)]
    pub optimizer_in_backward: bool,
    /// The optimizer step of each parameter runs right before the parameter's first use in
    /// the next iteration's forward pass instead of after the backward pass: the step's
    /// transfers overlap the next forward pass. The same updates in the same order as the
    /// step at the end, clipping by the global gradient norm included (the norm is complete
    /// when backward ends); gradients then live across the iteration boundary. A forward
    /// pre-hook per module can do it in PyTorch; the last iteration's step is flushed after
    /// the loop.
    #[serde(default)]
    pub optimizer_in_forward: bool,
    /// FSDP2 data parallelism (`fully_shard` on every transformer layer and on the root) over
    /// this many ranks, each with its own micro-batches: the trace is one rank's (see "FSDP2"
    /// in the module documentation). `None`: no FSDP (every parameter whole on this GPU).
    #[serde(default)]
    pub fsdp_ranks: Option<u32>,
    /// Bandwidth of the GPU-to-GPU link collectives run over, bytes/s per direction, as NCCL's
    /// bus bandwidth (tensor-parallel all-reduces, pipeline sends, FSDP's all-gathers and
    /// reduce-scatters). `None`: [`Gpu::link_bytes_per_s`].
    #[serde(default)]
    pub link_bytes_per_s: Option<f64>,
    /// With [`ModelConfig::fsdp_ranks`]: FSDP's all-gathers and reduce-scatters overlap no
    /// compute, every microsecond on the link delays the GPU (how teraio.torch runs FSDP2 on a
    /// GPU today: it waits for each collective FSDP issues; docs/TORCH.md, "FSDP2").
    #[serde(default)]
    pub fsdp_no_overlap: bool,
    /// With [`ModelConfig::fsdp_ranks`]: FSDP2's `CPUOffloadPolicy` (see "FSDP2" in the module
    /// documentation). `None`: the shards live in GPU memory (for teraio to move).
    #[serde(default)]
    pub fsdp_cpu_offload: Option<FsdpCpuOffload>,
}

/// FSDP2's `CPUOffloadPolicy` in a generated trace ([`ModelConfig::fsdp_cpu_offload`]): the
/// rank's parameter shards, gradient shards and optimizer states live in host memory, so the
/// GPU's trace has none of them. Each all-gather first copies its shards up (fp32, at
/// `h2d_bytes_per_s`) and each reduce-scatter then copies its gradient shards down (at
/// `d2h_bytes_per_s`), in the collective's own stream: the copies add to its time on the link,
/// which the compute around it hides as far as it can. The optimizer step runs on the CPU after
/// backward, the GPU waiting (`optimizer.step()` on the CPU tensors): one kernel per parameter,
/// `NAME.cpu_adamw`, of the shard's parameters over `cpu_adam_params_per_s`, accessing nothing.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FsdpCpuOffload {
    /// Host-to-GPU copy rate of the shards, bytes/s (pinned memory).
    pub h2d_bytes_per_s: f64,
    /// GPU-to-host copy rate of the gradient shards, bytes/s.
    pub d2h_bytes_per_s: f64,
    /// AdamW parameters the CPU steps a second.
    pub cpu_adam_params_per_s: f64,
}

/// The most FSDP ranks [`ModelConfig::validate`] takes (a bound on the input; FSDP2 runs larger
/// jobs as HSDP, sharded within a node and replicated across, which is not modelled).
pub const FSDP_RANKS_MAX: u32 = 1024;

impl ModelConfig {
    fn llama_like(name: &str, layers: u32, hidden: u64, heads: u32, kv: u32, ffn: u64) -> Self {
        ModelConfig {
            name: name.into(),
            layers,
            hidden,
            heads,
            kv_heads: kv,
            ffn,
            vocab: 128_256,
            seq_len: 4096,
            micro_batch: 4,
            micro_batches: 4,
            dtype: Dtype::Fp32,
            gated_mlp: true,
            tied_embeddings: false,
            tensor_parallel: 1,
            pipeline_parallel: 1,
            pipeline_stage: 0,
            gpu: Gpu::H100Nvl,
            target_iteration_us: None,
            checkpointed_layers: 0,
            selective_recompute: false,
            optimizer_in_backward: false,
            optimizer_in_forward: false,
            fsdp_ranks: None,
            link_bytes_per_s: None,
            fsdp_no_overlap: false,
            fsdp_cpu_offload: None,
        }
    }

    fn gpt2(name: &str, layers: u32, hidden: u64, heads: u32) -> Self {
        ModelConfig {
            name: name.into(),
            layers,
            hidden,
            heads,
            kv_heads: heads,
            ffn: 4 * hidden,
            vocab: 50_257,
            seq_len: 1024,
            micro_batch: 8,
            micro_batches: 1,
            dtype: Dtype::Fp32,
            gated_mlp: false,
            tied_embeddings: true,
            tensor_parallel: 1,
            pipeline_parallel: 1,
            pipeline_stage: 0,
            gpu: Gpu::H100Nvl,
            target_iteration_us: None,
            checkpointed_layers: 0,
            selective_recompute: false,
            optimizer_in_backward: false,
            optimizer_in_forward: false,
            fsdp_ranks: None,
            link_bytes_per_s: None,
            fsdp_no_overlap: false,
            fsdp_cpu_offload: None,
        }
    }

    /// Names of the presets [`ModelConfig::preset`] knows.
    pub const PRESETS: [&'static str; 8] = [
        "llama3-8b",
        "granite-8b",
        "llama3-70b",
        "gpt2-small",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "gpt2-replay",
    ];

    /// The paper's evaluation cases (fp32, AdamW, H100 NVL) and GPT-2 sizes:
    /// - `llama3-8b`: 32 layers, global batch 16 (4 x 4) of 4096 tokens.
    /// - `granite-8b`: Granite-8B-code shape (36 layers, vocab 49152), batch 16 x 4096.
    /// - `llama3-70b`: 80 layers, tensor-parallel 2 (one of the paper's two GPUs), global
    ///   batch 16 (8 x 2) of 4096 tokens.
    /// - `gpt2-small|medium|large|xl`: 1024 tokens x 8.
    /// - `gpt2-replay`: a 6-layer GPT-2-small-like model, 4 x 256 tokens, about 1.8 GB of
    ///   tensors, durations scaled to a 10 s iteration: sized for a real-time replay on a
    ///   laptop-class machine against [`crate::Hardware::dev`].
    pub fn preset(name: &str) -> Result<ModelConfig> {
        let c = match name {
            "llama3-8b" => Self::llama_like(name, 32, 4096, 32, 8, 14_336),
            "granite-8b" => {
                let mut c = Self::llama_like(name, 36, 4096, 32, 8, 14_336);
                c.vocab = 49_152;
                c
            }
            "llama3-70b" => {
                let mut c = Self::llama_like(name, 80, 8192, 64, 8, 28_672);
                c.tensor_parallel = 2;
                c.micro_batch = 2;
                c.micro_batches = 8;
                c
            }
            "gpt2-small" => Self::gpt2(name, 12, 768, 12),
            "gpt2-medium" => Self::gpt2(name, 24, 1024, 16),
            "gpt2-large" => Self::gpt2(name, 36, 1280, 20),
            "gpt2-xl" => Self::gpt2(name, 48, 1600, 25),
            "gpt2-replay" => {
                let mut c = Self::gpt2(name, 6, 768, 12);
                c.seq_len = 256;
                c.micro_batch = 4;
                c.target_iteration_us = Some(10e6);
                c
            }
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown model preset {name:?} (known: {})",
                    Self::PRESETS.join(", ")
                )));
            }
        };
        Ok(c)
    }

    /// Set one field by its command-line name (`teraio trace gen --help`): `layers`,
    /// `hidden`, `heads`, `kv-heads`, `ffn`, `vocab`, `seq`, `micro-batch`, `micro-batches`,
    /// `dtype`, `tp`, `pp`, `stage`, `gpu`, `iteration-s`, `checkpoint-layers`, `fsdp-ranks`,
    /// `link-gbps` (GB/s, 10^9 bytes a second), and the flags `activation-checkpointing` (every
    /// layer), `selective-recompute`, `optimizer-in-backward`, `optimizer-in-forward` and
    /// `fsdp-no-overlap` (take no value).
    pub fn set(&mut self, key: &str, value: Option<&str>) -> Result<()> {
        let bad = |m: String| Error::InvalidArgument(m);
        let flag = matches!(
            key,
            "activation-checkpointing"
                | "selective-recompute"
                | "optimizer-in-backward"
                | "optimizer-in-forward"
                | "fsdp-no-overlap"
        );
        if flag {
            if value.is_some() {
                let hint = if key == "activation-checkpointing" {
                    " (use checkpoint-layers=N)"
                } else {
                    ""
                };
                return Err(bad(format!("{key} takes no value{hint}")));
            }
            match key {
                "activation-checkpointing" => self.checkpointed_layers = self.layers,
                "selective-recompute" => self.selective_recompute = true,
                "optimizer-in-backward" => self.optimizer_in_backward = true,
                "optimizer-in-forward" => self.optimizer_in_forward = true,
                _ => self.fsdp_no_overlap = true,
            }
            return Ok(());
        }
        let v = value.ok_or_else(|| bad(format!("{key} needs a value ({key}=...)")))?;
        fn num<T: std::str::FromStr>(key: &str, v: &str) -> Result<T> {
            v.parse().map_err(|_| Error::InvalidArgument(format!("{key}={v}: not a number")))
        }
        match key {
            "layers" => self.layers = num(key, v)?,
            "hidden" => self.hidden = num(key, v)?,
            "heads" => self.heads = num(key, v)?,
            "kv-heads" => self.kv_heads = num(key, v)?,
            "ffn" => self.ffn = num(key, v)?,
            "vocab" => self.vocab = num(key, v)?,
            "seq" => self.seq_len = num(key, v)?,
            "micro-batch" => self.micro_batch = num(key, v)?,
            "micro-batches" => self.micro_batches = num(key, v)?,
            "dtype" => self.dtype = Dtype::parse(v)?,
            "tp" => self.tensor_parallel = num(key, v)?,
            "pp" => self.pipeline_parallel = num(key, v)?,
            "stage" => self.pipeline_stage = num(key, v)?,
            "gpu" => self.gpu = Gpu::parse(v)?,
            "iteration-s" => self.target_iteration_us = Some(num::<f64>(key, v)? * 1e6),
            "checkpoint-layers" => self.checkpointed_layers = num(key, v)?,
            "fsdp-ranks" => self.fsdp_ranks = Some(num(key, v)?),
            "link-gbps" => self.link_bytes_per_s = Some(num::<f64>(key, v)? * 1e9),
            _ => {
                return Err(bad(format!(
                    "unknown model option {key:?} (known: layers, hidden, heads, kv-heads, ffn, \
                     vocab, seq, micro-batch, micro-batches, dtype, tp, pp, stage, gpu, \
                     iteration-s, checkpoint-layers, fsdp-ranks, link-gbps, \
                     activation-checkpointing, selective-recompute, optimizer-in-backward, \
                     optimizer-in-forward, fsdp-no-overlap)"
                )));
            }
        }
        Ok(())
    }

    /// Parse a model specification `NAME[,KEY=VALUE|,FLAG]...`: a preset and
    /// [`ModelConfig::set`] overrides, e.g. `llama3-8b,dtype=tf32,activation-checkpointing`.
    pub fn from_spec(spec: &str) -> Result<ModelConfig> {
        let mut parts = spec.split(',');
        let mut cfg = ModelConfig::preset(parts.next().unwrap_or("").trim())?;
        for part in parts {
            let part = part.trim();
            match part.split_once('=') {
                Some((k, v)) => cfg.set(k.trim(), Some(v.trim()))?,
                None => cfg.set(part, None)?,
            }
        }
        Ok(cfg)
    }

    /// Check the shape is consistent.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.layers == 0 || self.hidden == 0 || self.heads == 0 || self.kv_heads == 0 {
            return bad("layers, hidden, heads and kv_heads must be > 0".into());
        }
        if self.ffn == 0 || self.vocab == 0 || self.seq_len == 0 || self.micro_batch == 0 {
            return bad("ffn, vocab, seq_len and micro_batch must be > 0".into());
        }
        if self.micro_batches == 0 {
            return bad("micro_batches must be > 0".into());
        }
        if self.optimizer_in_backward && self.optimizer_in_forward {
            return bad(
                "optimizer-in-backward and optimizer-in-forward are exclusive: the step runs \
                 either during backward or before the next forward"
                    .into(),
            );
        }
        if let Some(l) = self.link_bytes_per_s
            && !(l.is_finite() && l > 0.0)
        {
            return bad(format!("link-gbps {}: must be a number of GB/s > 0", l / 1e9));
        }
        if let Some(c) = &self.fsdp_cpu_offload {
            if self.fsdp_ranks.is_none() {
                return bad("fsdp_cpu_offload without fsdp-ranks: no shards to offload".into());
            }
            for (name, v) in [
                ("h2d_bytes_per_s", c.h2d_bytes_per_s),
                ("d2h_bytes_per_s", c.d2h_bytes_per_s),
                ("cpu_adam_params_per_s", c.cpu_adam_params_per_s),
            ] {
                if !(v.is_finite() && v > 0.0) {
                    return bad(format!("fsdp_cpu_offload.{name} {v}: must be > 0"));
                }
            }
        }
        match self.fsdp_ranks {
            None if self.fsdp_no_overlap => {
                return bad("fsdp-no-overlap without fsdp-ranks: no FSDP collectives to \
                            overlap (give fsdp-ranks=N)"
                    .into());
            }
            None => {}
            Some(0) => {
                return bad("fsdp-ranks 0: at least 1 rank (leave fsdp-ranks out for a trace \
                            without FSDP)"
                    .into());
            }
            Some(n) if n > FSDP_RANKS_MAX => {
                return bad(format!(
                    "fsdp-ranks {n}: at most {FSDP_RANKS_MAX} (larger jobs shard within a node \
                     and replicate across nodes, HSDP, which is not modelled)"
                ));
            }
            Some(n) if u64::from(n) > self.hidden => {
                return bad(format!(
                    "fsdp-ranks {n}: more ranks than a norm weight has elements (hidden {}), \
                     some ranks would hold empty shards",
                    self.hidden
                ));
            }
            Some(n) if self.tensor_parallel != 1 || self.pipeline_parallel != 1 => {
                return bad(format!(
                    "fsdp-ranks {n} with tp {} and pp {}: FSDP combined with tensor or pipeline \
                     parallelism is not modelled (tp and pp must be 1)",
                    self.tensor_parallel, self.pipeline_parallel
                ));
            }
            Some(n) if self.optimizer_in_backward || self.optimizer_in_forward => {
                let which = if self.optimizer_in_backward { "backward" } else { "forward" };
                return bad(format!(
                    "fsdp-ranks {n} with optimizer-in-{which}: not modelled (the FSDP trace \
                     steps the shards after the backward pass)"
                ));
            }
            Some(_) => {}
        }
        if !self.hidden.is_multiple_of(u64::from(self.heads)) {
            return bad(format!("hidden {} not divisible by heads {}", self.hidden, self.heads));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "heads {} not divisible by kv_heads {}",
                self.heads, self.kv_heads
            ));
        }
        if self.tensor_parallel == 0 || !self.heads.is_multiple_of(self.tensor_parallel) {
            return bad(format!(
                "tensor_parallel {} must be > 0 and divide heads {}",
                self.tensor_parallel, self.heads
            ));
        }
        if self.pipeline_parallel == 0 || !self.layers.is_multiple_of(self.pipeline_parallel) {
            return bad(format!(
                "pipeline_parallel {} must be > 0 and divide layers {}",
                self.pipeline_parallel, self.layers
            ));
        }
        if self.pipeline_stage >= self.pipeline_parallel {
            return bad(format!(
                "pipeline_stage {} out of range for pipeline_parallel {}",
                self.pipeline_stage, self.pipeline_parallel
            ));
        }
        if let Some(t) = self.target_iteration_us
            && !(t.is_finite() && t > 0.0)
        {
            return bad(format!("target_iteration_us must be > 0, got {t}"));
        }
        // Bounds that keep every size in the generator's u64 arithmetic (tokens x width x 4 <
        // 2^58) and the trace in memory.
        const MAX_WIDTH: u64 = 1 << 24;
        const MAX_TOKENS: u64 = 1 << 32;
        const MAX_KERNELS: u64 = 5_000_000;
        for (name, v) in [("hidden", self.hidden), ("ffn", self.ffn), ("vocab", self.vocab)] {
            if v > MAX_WIDTH {
                return bad(format!(
                    "{name} {v} is larger than the generator supports ({MAX_WIDTH})"
                ));
            }
        }
        let tokens = self.seq_len.checked_mul(self.micro_batch).filter(|&t| t <= MAX_TOKENS);
        if tokens.is_none() {
            return bad(format!(
                "seq_len x micro_batch ({} x {}) is more than {MAX_TOKENS} tokens",
                self.seq_len, self.micro_batch
            ));
        }
        let kernels =
            u64::from(self.layers / self.pipeline_parallel) * u64::from(self.micro_batches) * 45;
        if kernels > MAX_KERNELS {
            return bad(format!(
                "{} layers x {} micro-batches would make about {kernels} kernels; the limit is \
                 {MAX_KERNELS}",
                self.layers / self.pipeline_parallel,
                self.micro_batches
            ));
        }
        Ok(())
    }

    /// Parameters of this GPU's tensor/pipeline shard of the model (with FSDP, before FSDP
    /// shards them: each rank holds about `1 / fsdp_ranks` of these, and gathers them whole
    /// unit by unit).
    pub fn parameters_per_gpu(&self) -> u64 {
        self.layer_weights().iter().map(|w| w.1).sum::<u64>()
            * u64::from(self.layers / self.pipeline_parallel)
            + self.embedding_params()
    }

    /// The GPU-to-GPU link's bandwidth, bytes/s per direction: [`ModelConfig::link_bytes_per_s`]
    /// or, unset, the GPU's ([`Gpu::link_bytes_per_s`]).
    pub fn link_bytes_per_s(&self) -> f64 {
        self.link_bytes_per_s.unwrap_or_else(|| self.gpu.link_bytes_per_s())
    }

    /// Tokens one GPU (one rank) trains on per iteration: `seq_len x micro_batch x
    /// micro_batches`.
    pub fn tokens_per_iteration(&self) -> u64 {
        self.seq_len.saturating_mul(self.micro_batch).saturating_mul(u64::from(self.micro_batches))
    }

    fn tp(&self) -> u64 {
        u64::from(self.tensor_parallel)
    }

    fn head_dim(&self) -> u64 {
        self.hidden / u64::from(self.heads)
    }

    fn qkv_width(&self) -> u64 {
        let kv = u64::from(self.kv_heads).div_ceil(self.tp());
        (u64::from(self.heads) / self.tp() + 2 * kv) * self.head_dim()
    }

    fn up_width(&self) -> u64 {
        self.ffn / self.tp() * if self.gated_mlp { 2 } else { 1 }
    }

    /// (name, elements) of one layer's parameter tensors on this GPU.
    fn layer_weights(&self) -> Vec<(&'static str, u64)> {
        let h = self.hidden;
        vec![
            ("norm1", h),
            ("wqkv", h * self.qkv_width()),
            ("wo", u64::from(self.heads) / self.tp() * self.head_dim() * h),
            ("norm2", h),
            ("wup", h * self.up_width()),
            ("wdown", self.ffn / self.tp() * h),
        ]
    }

    fn embedding_params(&self) -> u64 {
        let v = self.vocab.div_ceil(self.tp()) * self.hidden;
        let first = self.pipeline_stage == 0;
        let last = self.pipeline_stage + 1 == self.pipeline_parallel;
        let mut p = 0;
        if first {
            p += v;
        }
        if last {
            p += self.hidden; // final norm
            if !self.tied_embeddings || !first {
                p += v;
            }
        }
        p
    }
}

/// Parameter tensors (and their gradient and optimizer-state companions).
struct Param {
    /// The weight (under FSDP: this rank's shard).
    weight: TensorId,
    /// Its gradient (under FSDP: this rank's shard, made by the reduce-scatters).
    grad: TensorId,
    states: Vec<TensorId>,
    /// Elements of the whole parameter.
    elements: u64,
    /// Elements the optimizer steps on this GPU (under FSDP: the shard's).
    step_elements: u64,
}

struct Builder {
    trace: Trace,
    cfg: ModelConfig,
    params: Vec<Param>,
    /// Per parameter index: kernels that used it during backward (for gradient accesses).
    flops_div: f64,
    /// Attention FLOP/s achieved, forward and backward.
    attn_fwd: f64,
    attn_bwd: f64,
    hbm: f64,
    /// FSDP2's shards, gathered parameters and collectives ([`ModelConfig::fsdp_ranks`]).
    fsdp: Option<fsdp::Fsdp>,
}

const LAUNCH_US: f64 = 4.0;
/// Fraction of HBM bandwidth memory-bound kernels reach (RMSNorm 0.52-0.66, SiLU-gate
/// 0.52-0.54 of an H200's 4.8 TB/s, measured).
const MEMORY_EFFICIENCY: f64 = 0.58;

/// Fraction of the peak a large matmul reaches (H200, measured at Llama3-8B shapes).
fn matmul_efficiency(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::Fp32 => 0.75,
        Dtype::Tf32 => 0.61,
        Dtype::Bf16 => 0.68,
    }
}

/// Attention FLOP/s, forward and backward: fp32 and tf32 run on CUDA cores (no TF32
/// attention kernel in PyTorch), bf16 on tensor cores (H200, measured).
fn attention_flops(gpu: Gpu, dtype: Dtype) -> (f64, f64) {
    match dtype {
        Dtype::Fp32 | Dtype::Tf32 => {
            let peak = gpu.peak_flops(Dtype::Fp32);
            (peak * 0.67, peak * 0.53)
        }
        Dtype::Bf16 => {
            let peak = gpu.peak_flops(Dtype::Bf16);
            (peak * 0.59, peak * 0.46)
        }
    }
}

impl Builder {
    fn tensor(&mut self, name: String, bytes: u64, kind: TensorKind, global: bool) -> TensorId {
        let id = TensorId(self.trace.tensors.len() as u32);
        self.trace.tensors.push(Tensor {
            id,
            name,
            bytes: bytes.max(1),
            kind,
            global,
            created_by: None,
            accesses: Vec::new(),
            dies_after: None,
            writes: Some(Vec::new()),
            producer: None,
        });
        id
    }

    fn act(&mut self, name: String, bytes: u64) -> TensorId {
        self.tensor(name, bytes, TensorKind::Activation, false)
    }

    /// Add a kernel touching `uses` (existing tensors or ones created here) that writes only
    /// the tensors it creates. Duration from the roofline unless `fixed_us` is given
    /// (communication).
    fn kernel(
        &mut self,
        name: String,
        layer: Option<u32>,
        flops: f64,
        uses: &[TensorId],
        fixed_us: Option<f64>,
    ) -> usize {
        self.kernel_writing(name, layer, flops, uses, &[], fixed_us)
    }

    /// [`Builder::kernel`] that also modifies the existing tensors `modifies` (each in `uses`
    /// too): gradients accumulated by a backward kernel, parameters and optimizer states
    /// updated by the optimizer step. A non-global tensor is written by the kernel that
    /// creates it (its first access); every other access reads.
    fn kernel_writing(
        &mut self,
        name: String,
        layer: Option<u32>,
        flops: f64,
        uses: &[TensorId],
        modifies: &[TensorId],
        fixed_us: Option<f64>,
    ) -> usize {
        let k = self.trace.kernels.len();
        let mut bytes = 0.0;
        for &t in uses {
            let tensor = &mut self.trace.tensors[t.index()];
            if tensor.accesses.last() != Some(&k) {
                let creates = !tensor.global && tensor.accesses.is_empty();
                tensor.accesses.push(k);
                bytes += tensor.bytes as f64;
                if creates || modifies.contains(&t) {
                    tensor.writes.get_or_insert_with(Vec::new).push(k);
                }
            }
        }
        debug_assert!(modifies.iter().all(|t| uses.contains(t)), "{name}: modifies not in uses");
        let duration_us = fixed_us.unwrap_or_else(|| {
            let compute = flops / self.flops_div;
            let memory = bytes / self.hbm;
            compute.max(memory) * 1e6
        }) + LAUNCH_US;
        self.trace.kernels.push(Kernel { name, duration_us, layer });
        k
    }

    /// RMSNorm of `x` with weight `w` into `out` (forward, and its recomputations).
    fn norm_kernel(
        &mut self,
        name: String,
        layer: Option<u32>,
        x: TensorId,
        w: TensorId,
        out: TensorId,
    ) {
        let t = (self.cfg.seq_len * self.cfg.micro_batch) as f64;
        self.kernel(name, layer, 5.0 * t * self.cfg.hidden as f64, &[x, w, out], None);
    }

    /// The MLP's activation function (SwiGLU or GELU) of `u` into `a`.
    fn act_kernel(&mut self, name: String, layer: Option<u32>, u: TensorId, a: TensorId) {
        let t = (self.cfg.seq_len * self.cfg.micro_batch) as f64;
        let width = self.cfg.ffn / self.cfg.tp();
        self.kernel(name, layer, 8.0 * t * width as f64, &[u, a], None);
    }

    fn comm_us(&self, bytes: u64) -> f64 {
        // Ring all-reduce over `tp` GPUs moves 2 (tp-1)/tp of the data each way.
        let tp = self.cfg.tp() as f64;
        2.0 * (tp - 1.0) / tp * bytes as f64 / self.cfg.link_bytes_per_s() * 1e6
    }

    fn finish(mut self) -> Trace {
        let n = self.trace.kernels.len();
        for t in &mut self.trace.tensors {
            if !t.global {
                t.created_by = t.accesses.first().copied();
                t.dies_after = t.accesses.last().copied();
            }
        }
        debug_assert!(self.trace.tensors.iter().all(|t| !t.accesses.is_empty()));
        let _ = n;
        self.params.clear();
        self.trace
    }
}

/// Generate one iteration's trace for `cfg`.
pub fn generate(cfg: &ModelConfig) -> Result<Trace> {
    cfg.validate()?;
    let e = cfg.dtype.bytes();
    let (attn_fwd, attn_bwd) = attention_flops(cfg.gpu, cfg.dtype);
    let mut b = Builder {
        trace: Trace::new(&cfg.name),
        cfg: cfg.clone(),
        params: Vec::new(),
        flops_div: cfg.gpu.peak_flops(cfg.dtype) * matmul_efficiency(cfg.dtype),
        attn_fwd,
        attn_bwd,
        hbm: cfg.gpu.hbm_bytes_per_s() * MEMORY_EFFICIENCY,
        fsdp: fsdp::Fsdp::new(cfg),
    };
    let tokens = cfg.seq_len * cfg.micro_batch;
    let h = cfg.hidden;
    let tp = cfg.tp();
    let heads_p = u64::from(cfg.heads) / tp;
    let layers_here = cfg.layers / cfg.pipeline_parallel;
    let first_layer = cfg.pipeline_stage * layers_here;
    let first_stage = cfg.pipeline_stage == 0;
    let last_stage = cfg.pipeline_stage + 1 == cfg.pipeline_parallel;
    let vocab_p = cfg.vocab.div_ceil(tp);

    // Parameters, gradients (created at first backward use, die after the optimizer step)
    // and AdamW states (global). Under FSDP, the rank's shards: fp32 (FSDP2's
    // MixedPrecisionPolicy keeps the sharded parameter in fp32 and gathers it in bf16, so no
    // master copy), the gradient shard fp32 (reduce_dtype).
    // (FSDP2 pads the last shard: every rank holds `ceil(elements / ranks)`.)
    let fsdp_on = cfg.fsdp_ranks.is_some();
    let ranks = cfg.fsdp_ranks.map_or(1, u64::from);
    let shard = |elements: u64| elements.div_ceil(ranks);
    let shard_e = if fsdp_on { 4 } else { e };
    let new_param = |b: &mut Builder, name: String, elements: u64| -> usize {
        let here = shard(elements);
        let weight = b.tensor(format!("{name}.w"), here * shard_e, TensorKind::Weight, true);
        let grad = b.tensor(format!("{name}.grad"), here * shard_e, TensorKind::Gradient, false);
        let mut states = vec![
            b.tensor(format!("{name}.adam_m"), here * 4, TensorKind::OptimizerState, true),
            b.tensor(format!("{name}.adam_v"), here * 4, TensorKind::OptimizerState, true),
        ];
        if cfg.dtype == Dtype::Bf16 && !fsdp_on {
            states.push(b.tensor(
                format!("{name}.master"),
                elements * 4,
                TensorKind::OptimizerState,
                true,
            ));
        }
        b.params.push(Param { weight, grad, states, elements, step_elements: here });
        b.params.len() - 1
    };
    let emb = first_stage.then(|| new_param(&mut b, "embed".into(), vocab_p * h));
    let mut layer_params = Vec::new();
    for l in 0..layers_here {
        let layer = first_layer + l;
        let ids: Vec<usize> = cfg
            .layer_weights()
            .iter()
            .map(|(n, el)| new_param(&mut b, format!("L{layer}.{n}"), *el))
            .collect();
        layer_params.push(ids);
    }
    let (norm_f, head) = if last_stage {
        let nf = new_param(&mut b, "final_norm".into(), h);
        let head = if cfg.tied_embeddings && first_stage {
            emb.unwrap_or(nf)
        } else {
            new_param(&mut b, "lm_head".into(), vocab_p * h)
        };
        (Some(nf), Some(head))
    } else {
        (None, None)
    };
    // (Under FSDP: what compute kernels read and backward kernels write, see `fsdp`.)
    let w = |b: &Builder, p: usize| b.weight(p);
    let g = |b: &Builder, p: usize| b.grad(p);
    // FSDP's root unit: the parameters outside the layers.
    let mut root: Vec<usize> = Vec::new();
    for p in [emb, norm_f, head].into_iter().flatten() {
        if !root.contains(&p) {
            root.push(p);
        }
    }
    if let Some(f) = b.fsdp.as_mut() {
        f.sized(b.params.len());
    }
    let gather = |b: &mut Builder, mb: u32, l: usize, phase: &str| {
        let layer = first_layer + l as u32;
        let kernel = format!("mb{mb}.L{layer}.all_gather.{phase}");
        b.fsdp_all_gather(mb, kernel, Some(layer), &layer_params[l], &format!(".{phase}"))
    };

    let act_bytes = |width: u64| tokens * width * e;
    for mb in 0..cfg.micro_batches {
        // ---------------- forward ----------------
        // FSDP: the root's parameters stay gathered the whole micro-batch (FSDP2 does not
        // reshard the root after forward); each layer's are gathered while the layer before
        // computes (prefetch) and freed after its forward.
        let root_gathered =
            b.fsdp_all_gather(mb, format!("mb{mb}.root.all_gather"), None, &root, "");
        b.fsdp_use(&root_gathered);
        let mut next = if layer_params.is_empty() { None } else { gather(&mut b, mb, 0, "fwd") };
        let since = b.trace.kernels.len();
        let mut x = b.act(format!("mb{mb}.x{first_layer}"), act_bytes(h));
        if let Some(p) = emb {
            let we = w(&b, p);
            b.kernel(format!("mb{mb}.embed.fwd"), None, 0.0, &[we, x], None);
        } else {
            b.kernel(format!("mb{mb}.recv_act"), None, 0.0, &[x], Some(b.comm_us(act_bytes(h))));
        }
        b.fsdp_hide_gather(&next, since);
        let mut saved = Vec::new();
        for (l, ps) in layer_params.iter().enumerate() {
            let layer = first_layer + l as u32;
            let gathered = next.take();
            if l + 1 < layer_params.len() {
                next = gather(&mut b, mb, l + 1, "fwd");
            }
            b.fsdp_use(&gathered);
            let since = b.trace.kernels.len();
            let xn = b.act(format!("mb{mb}.x{}", layer + 1), act_bytes(h));
            saved.push(forward_layer(&mut b, &format!("mb{mb}.L{layer}."), layer, ps, x, xn));
            b.fsdp_release(&gathered);
            b.fsdp_hide_gather(&next, since);
            x = xn;
        }
        // ---------------- head / loss ----------------
        // FSDP: the last layer's parameters are gathered again for its backward while the
        // head runs; the root's gradients of this micro-batch are made unsharded.
        let mut next = match layer_params.len() {
            0 => None,
            n => gather(&mut b, mb, n - 1, "bwd"),
        };
        b.fsdp_unsharded_grads(mb, &root);
        let since = b.trace.kernels.len();
        let mut dx;
        if let (Some(nfp), Some(hp)) = (norm_f, head) {
            let t = tokens as f64;
            let nf = b.act(format!("mb{mb}.nf"), act_bytes(h));
            let wnf = w(&b, nfp);
            b.norm_kernel(format!("mb{mb}.final_norm.fwd"), None, x, wnf, nf);
            let logits = b.act(format!("mb{mb}.logits"), tokens * vocab_p * 4);
            let wh = w(&b, hp);
            let f = 2.0 * t * (vocab_p * h) as f64;
            b.kernel(format!("mb{mb}.lm_head.fwd"), None, f, &[nf, wh, logits], None);
            let dlogits = b.act(format!("mb{mb}.dlogits"), tokens * vocab_p * 4);
            b.kernel(
                format!("mb{mb}.loss"),
                None,
                10.0 * t * vocab_p as f64,
                &[logits, dlogits],
                None,
            );
            let dnf = b.act(format!("mb{mb}.dnf"), act_bytes(h));
            let gh = g(&b, hp);
            b.kernel_writing(
                format!("mb{mb}.lm_head.bwd"),
                None,
                2.0 * f,
                &[dlogits, nf, wh, gh, dnf],
                &[gh],
                None,
            );
            dx = b.act(format!("mb{mb}.dx_top"), act_bytes(h));
            let gnf = g(&b, nfp);
            b.kernel_writing(
                format!("mb{mb}.final_norm.bwd"),
                None,
                10.0 * t * h as f64,
                &[dnf, x, wnf, gnf, dx],
                &[gnf],
                None,
            );
        } else {
            dx = b.act(format!("mb{mb}.dx_top"), act_bytes(h));
            b.kernel(
                format!("mb{mb}.recv_grad"),
                None,
                0.0,
                &[x, dx],
                Some(b.comm_us(act_bytes(h))),
            );
        }
        b.fsdp_hide_gather(&next, since);
        // ---------------- backward ----------------
        // FSDP: each layer's backward (and recomputation) reads its parameters gathered again
        // and writes unsharded gradients, reduce-scattered into the rank's gradient shards
        // right after it, while the next layer's backward computes.
        let mut scattered = None;
        for (l, ps) in layer_params.iter().enumerate().rev() {
            let layer = first_layer + l as u32;
            let gathered = next.take();
            if l > 0 {
                next = gather(&mut b, mb, l - 1, "bwd");
            }
            b.fsdp_use(&gathered);
            b.fsdp_unsharded_grads(mb, ps);
            let since = b.trace.kernels.len();
            let recomputed;
            let checkpointed = (l as u32) < cfg.checkpointed_layers;
            let selective = cfg.selective_recompute && !checkpointed;
            let s = if checkpointed {
                // Recompute this layer's forward from its checkpointed input; the output is
                // not needed again (the gradient flowing in is `dx`).
                let pre = format!("mb{mb}.L{layer}.rc.");
                let out = b.act(format!("{pre}x_out"), act_bytes(h));
                recomputed = forward_layer(&mut b, &pre, layer, ps, saved[l].x, out);
                &recomputed
            } else {
                &saved[l]
            };
            let lo = Some(layer);
            let nm = |s: &str| format!("mb{mb}.L{layer}.{s}");
            let t = tokens as f64;
            // Selective recomputation: the norms' and the activation function's outputs are
            // remade from their inputs (kept anyway) right before backward reads them.
            let (mut sa, mut sn2, mut sn1) = (s.a, s.n2, s.n1);
            if selective {
                sa = b.act(nm("rc.a"), act_bytes(cfg.ffn / tp));
                b.act_kernel(nm("rc.act.fwd"), lo, s.u, sa);
            }
            let da = b.act(nm("da"), act_bytes(cfg.ffn / tp));
            let (wd, gd) = (w(&b, ps[5]), g(&b, ps[5]));
            let f = 4.0 * t * (cfg.ffn / tp * h) as f64;
            b.kernel_writing(nm("down.bwd"), lo, f, &[dx, sa, wd, gd, da], &[gd], None);
            let du = b.act(nm("du"), act_bytes(cfg.up_width()));
            b.kernel(nm("act.bwd"), lo, 16.0 * t * (cfg.ffn / tp) as f64, &[da, s.u, du], None);
            let dn2 = b.act(nm("dn2"), act_bytes(h));
            let (wup, gup) = (w(&b, ps[4]), g(&b, ps[4]));
            let f = 4.0 * t * (h * cfg.up_width()) as f64;
            if selective {
                sn2 = b.act(nm("rc.n2"), act_bytes(h));
                let wn2 = w(&b, ps[3]);
                b.norm_kernel(nm("rc.norm2.fwd"), lo, s.x2, wn2, sn2);
            }
            b.kernel_writing(nm("up.bwd"), lo, f, &[du, sn2, wup, gup, dn2], &[gup], None);
            if tp > 1 {
                b.kernel(nm("up.bwd.allreduce"), lo, 0.0, &[dn2], Some(b.comm_us(act_bytes(h))));
            }
            let dx2 = b.act(nm("dx2"), act_bytes(h));
            let (wn2, gn2) = (w(&b, ps[3]), g(&b, ps[3]));
            b.kernel_writing(
                nm("norm2.bwd"),
                lo,
                10.0 * t * h as f64,
                &[dn2, s.x2, wn2, gn2, dx, dx2],
                &[gn2],
                None,
            );
            let dctx = b.act(nm("dctx"), act_bytes(heads_p * cfg.head_dim()));
            let (wo, go) = (w(&b, ps[2]), g(&b, ps[2]));
            let f = 4.0 * t * (heads_p * cfg.head_dim() * h) as f64;
            b.kernel_writing(nm("o.bwd"), lo, f, &[dx2, s.ctx, wo, go, dctx], &[go], None);
            let dqkv = b.act(nm("dqkv"), act_bytes(cfg.qkv_width()));
            let ws = b.tensor(nm("attn_bwd_ws"), 64 << 20, TensorKind::Workspace, false);
            let attn_f = 5.0 * t * cfg.seq_len as f64 * (heads_p * cfg.head_dim()) as f64;
            let attn_f = attn_f * b.flops_div / b.attn_bwd; // at attention's rate
            b.kernel(nm("attn.bwd"), lo, attn_f, &[dctx, s.qkv, s.ctx, s.lse, dqkv, ws], None);
            let dn1 = b.act(nm("dn1"), act_bytes(h));
            let (wqkv, gqkv) = (w(&b, ps[1]), g(&b, ps[1]));
            let f = 4.0 * t * (h * cfg.qkv_width()) as f64;
            if selective {
                sn1 = b.act(nm("rc.n1"), act_bytes(h));
                let wn1 = w(&b, ps[0]);
                b.norm_kernel(nm("rc.norm1.fwd"), lo, s.x, wn1, sn1);
            }
            b.kernel_writing(nm("qkv.bwd"), lo, f, &[dqkv, sn1, wqkv, gqkv, dn1], &[gqkv], None);
            if tp > 1 {
                b.kernel(nm("qkv.bwd.allreduce"), lo, 0.0, &[dn1], Some(b.comm_us(act_bytes(h))));
            }
            let dxl = b.act(format!("mb{mb}.dx{layer}"), act_bytes(h));
            let (wn1, gn1) = (w(&b, ps[0]), g(&b, ps[0]));
            b.kernel_writing(
                nm("norm1.bwd"),
                lo,
                10.0 * t * h as f64,
                &[dn1, s.x, wn1, gn1, dx2, dxl],
                &[gn1],
                None,
            );
            dx = dxl;
            b.fsdp_release(&gathered);
            b.fsdp_hide_gather(&next, since);
            b.fsdp_hide_scatter(&scattered, since);
            let kernel = format!("mb{mb}.L{layer}.reduce_scatter");
            scattered = b.fsdp_reduce_scatter(kernel, Some(layer), ps);
        }
        let since = b.trace.kernels.len();
        if let Some(p) = emb {
            let ge = g(&b, p);
            b.kernel_writing(format!("mb{mb}.embed.bwd"), None, 0.0, &[dx, ge], &[ge], None);
        } else {
            b.kernel(format!("mb{mb}.send_grad"), None, 0.0, &[dx], Some(b.comm_us(act_bytes(h))));
        }
        b.fsdp_hide_scatter(&scattered, since);
        // FSDP: the root's gradients are reduce-scattered last, with nothing left to hide it.
        b.fsdp_release(&root_gathered);
        b.fsdp_reduce_scatter(format!("mb{mb}.root.reduce_scatter"), None, &root);
    }
    // ---------------- optimizer ----------------
    let cpu_offload = b.fsdp.as_ref().and_then(fsdp::Fsdp::cpu_offload);
    for pi in 0..b.params.len() {
        let p = &b.params[pi];
        if let Some(c) = cpu_offload {
            // FSDP2's CPU offload: the step on the CPU, the GPU waiting; the states in host
            // memory (not in the trace).
            let cpu_us = p.step_elements as f64 / c.cpu_adam_params_per_s * 1e6;
            let name = b.trace.tensors[p.weight.index()].name.trim_end_matches(".w").to_string();
            let k = b.kernel(format!("{name}.cpu_adamw"), layer_of(&name), 0.0, &[], Some(0.0));
            b.trace.kernels[k].duration_us = cpu_us;
            continue;
        }
        let mut uses = vec![p.weight, p.grad];
        uses.extend(p.states.iter().copied());
        // AdamW reads the gradient and updates the parameter and every state in place.
        let mut modifies = vec![p.weight];
        modifies.extend(p.states.iter().copied());
        let flops = 12.0 * p.step_elements as f64;
        let name = b.trace.tensors[p.weight.index()].name.trim_end_matches(".w").to_string();
        let layer = layer_of(&name);
        b.kernel_writing(format!("{name}.adamw"), layer, flops, &uses, &modifies, None);
    }
    let (in_backward, in_forward) = (cfg.optimizer_in_backward, cfg.optimizer_in_forward);
    let mut fsdp = b.fsdp.take();
    if let Some(f) = fsdp.as_mut() {
        f.drop_unaccessed(&mut b.trace);
    }
    let mut trace = b.finish();
    if let Some(f) = &fsdp {
        f.set_durations(&mut trace);
    }
    if in_backward {
        step_in_backward(&mut trace);
    }
    if in_forward {
        step_in_forward(&mut trace);
    }
    if let Some(target) = cfg.target_iteration_us {
        trace.scale_to_iteration_time(target)?;
    }
    mark_producers(&mut trace);
    if let Some(f) = &fsdp {
        f.keep_gathered(&mut trace);
    }
    trace.validate()?;
    Ok(trace)
}

/// Say how to recompute every activation that a forward op (`*.fwd`, recomputations
/// included) creates alone, modifying nothing else: the op again, on the other tensors it
/// reads, in the op's own time ([`crate::trace::Producer`] without a duration). Attention (which creates its output, the softmax
/// statistics and a workspace at once), communication and backward ops are left out.
fn mark_producers(trace: &mut Trace) {
    let n = trace.kernels.len();
    let mut created: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut modified = vec![false; n];
    let mut reads: Vec<Vec<TensorId>> = vec![Vec::new(); n];
    for (i, t) in trace.tensors.iter().enumerate() {
        for &k in &t.accesses {
            if t.created_by == Some(k) && !t.global {
                created[k].push(i);
            } else {
                reads[k].push(t.id);
                modified[k] |= t.writes_at(k);
            }
        }
    }
    for k in 0..n {
        let [i] = created[k][..] else { continue };
        let t = &trace.tensors[i];
        let forward = trace.kernels[k].name.ends_with(".fwd");
        if !forward || modified[k] || t.kind != TensorKind::Activation || reads[k].is_empty() {
            continue;
        }
        trace.tensors[i].producer = Some(crate::trace::Producer {
            inputs: std::mem::take(&mut reads[k]),
            duration_us: None,
        });
    }
}

/// Activations of one layer's forward pass that its backward reads.
struct Saved {
    x: TensorId,
    n1: TensorId,
    qkv: TensorId,
    ctx: TensorId,
    lse: TensorId,
    x2: TensorId,
    n2: TensorId,
    u: TensorId,
    a: TensorId,
}

/// One transformer layer's forward kernels, from input `x` to output `xn` (both existing
/// tensors), named `{pre}norm1.fwd` etc.: the forward pass and, with activation
/// checkpointing, its recomputation in backward.
fn forward_layer(
    b: &mut Builder,
    pre: &str,
    layer: u32,
    ps: &[usize],
    x: TensorId,
    xn: TensorId,
) -> Saved {
    let cfg = b.cfg.clone();
    let e = cfg.dtype.bytes();
    let tokens = cfg.seq_len * cfg.micro_batch;
    let act_bytes = |width: u64| tokens * width * e;
    let (h, tp) = (cfg.hidden, cfg.tp());
    let heads_p = u64::from(cfg.heads) / tp;
    let lo = Some(layer);
    let nm = |s: &str| format!("{pre}{s}");
    let w = |b: &Builder, i: usize| b.weight(ps[i]);
    let t = tokens as f64;
    let n1 = b.act(nm("n1"), act_bytes(h));
    let wn1 = w(b, 0);
    b.norm_kernel(nm("norm1.fwd"), lo, x, wn1, n1);
    let qkv = b.act(nm("qkv"), act_bytes(cfg.qkv_width()));
    let wqkv = w(b, 1);
    let f = 2.0 * t * (h * cfg.qkv_width()) as f64;
    b.kernel(nm("qkv.fwd"), lo, f, &[n1, wqkv, qkv], None);
    let ctx = b.act(nm("ctx"), act_bytes(heads_p * cfg.head_dim()));
    let lse = b.act(nm("lse"), tokens * heads_p * 4);
    let ws = b.tensor(nm("attn_ws"), 32 << 20, TensorKind::Workspace, false);
    let attn_f = 2.0 * t * cfg.seq_len as f64 * (heads_p * cfg.head_dim()) as f64;
    let attn_f = attn_f * b.flops_div / b.attn_fwd; // at attention's rate
    b.kernel(nm("attn.fwd"), lo, attn_f, &[qkv, ctx, lse, ws], None);
    let o = b.act(nm("o"), act_bytes(h));
    let wo = w(b, 2);
    let f = 2.0 * t * (heads_p * cfg.head_dim() * h) as f64;
    b.kernel(nm("o.fwd"), lo, f, &[ctx, wo, o], None);
    if tp > 1 {
        let us = b.comm_us(act_bytes(h));
        b.kernel(nm("o.allreduce"), lo, 0.0, &[o], Some(us));
    }
    let x2 = b.act(nm("x2"), act_bytes(h));
    b.kernel(nm("add1.fwd"), lo, t * h as f64, &[x, o, x2], None);
    let n2 = b.act(nm("n2"), act_bytes(h));
    let wn2 = w(b, 3);
    b.norm_kernel(nm("norm2.fwd"), lo, x2, wn2, n2);
    let u = b.act(nm("u"), act_bytes(cfg.up_width()));
    let wup = w(b, 4);
    let f = 2.0 * t * (h * cfg.up_width()) as f64;
    b.kernel(nm("up.fwd"), lo, f, &[n2, wup, u], None);
    let a = b.act(nm("a"), act_bytes(cfg.ffn / tp));
    b.act_kernel(nm("act.fwd"), lo, u, a);
    let d = b.act(nm("d"), act_bytes(h));
    let wd = w(b, 5);
    let f = 2.0 * t * (cfg.ffn / tp * h) as f64;
    b.kernel(nm("down.fwd"), lo, f, &[a, wd, d], None);
    if tp > 1 {
        let us = b.comm_us(act_bytes(h));
        b.kernel(nm("down.allreduce"), lo, 0.0, &[d], Some(us));
    }
    b.kernel(nm("add2.fwd"), lo, t * h as f64, &[x2, d, xn], None);
    Saved { x, n1, qkv, ctx, lse, x2, n2, u, a }
}

/// Move every AdamW kernel to right after the last kernel that writes its gradient (the
/// last micro-batch's backward use of the parameter), keeping the order of everything else;
/// accesses, writes and lifetimes follow the kernels.
fn step_in_backward(trace: &mut Trace) {
    let n = trace.kernels.len();
    // Sort key per kernel: (position it follows, 1 for a moved step, original index).
    let mut key: Vec<(usize, u8, usize)> = (0..n).map(|k| (k, 0, k)).collect();
    for t in &trace.tensors {
        if t.kind != TensorKind::Gradient {
            continue;
        }
        let Some(step) = t.accesses.iter().copied().find(|&k| is_optimizer_step(&trace.kernels[k]))
        else {
            continue;
        };
        let written = t.writes.as_deref().unwrap_or(&t.accesses);
        if let Some(&last) = written.iter().filter(|&&k| k < step).max() {
            key[step] = (last, 1, step);
        }
    }
    reorder(trace, &key);
}

/// Move each AdamW kernel right before the first kernel of the iteration that uses its
/// weight (the first micro-batch's forward), as [`ModelConfig::optimizer_in_forward`]
/// describes. The gradients then live from the backward pass to the next iteration's step:
/// they become global tensors.
fn step_in_forward(trace: &mut Trace) {
    let n = trace.kernels.len();
    // Sort key per kernel: (position it precedes, 0 for a moved step, original index).
    let mut key: Vec<(usize, u8, usize)> = (0..n).map(|k| (k, 1, k)).collect();
    let is_step = |k: usize| is_optimizer_step(&trace.kernels[k]);
    for t in &trace.tensors {
        if t.kind != TensorKind::Weight {
            continue;
        }
        let Some(step) = t.accesses.iter().copied().find(|&k| is_step(k)) else { continue };
        if let Some(&first) = t.accesses.iter().find(|&&k| !is_step(k)) {
            key[step] = (first, 0, step);
        }
    }
    reorder(trace, &key);
    let kernels = &trace.kernels;
    for t in &mut trace.tensors {
        let stepped_first = t.accesses.first().is_some_and(|&k| is_optimizer_step(&kernels[k]));
        if t.kind == TensorKind::Gradient && stepped_first {
            t.global = true;
            t.created_by = None;
            t.dies_after = None;
        }
    }
}

/// Whether `k` is an optimizer step of a generated trace (the AdamW kernels, `NAME.adamw`).
pub fn is_optimizer_step(k: &Kernel) -> bool {
    k.name.ends_with(".adamw")
}

/// Whether `k` is one of FSDP's collectives in a generated trace ([`ModelConfig::fsdp_ranks`]:
/// `NAME.all_gather[.fwd|.bwd]`, `NAME.reduce_scatter`). Its duration is the time of its link
/// transfer that the compute around it does not hide.
pub fn is_fsdp_collective(k: &Kernel) -> bool {
    let n = &k.name;
    n.ends_with(".reduce_scatter")
        || n.ends_with(".all_gather")
        || n.ends_with(".all_gather.fwd")
        || n.ends_with(".all_gather.bwd")
}

/// Whether a generated trace runs some optimizer step before its last backward kernel
/// ([`ModelConfig::optimizer_in_backward`], [`ModelConfig::optimizer_in_forward`]).
pub fn optimizer_steps_moved(trace: &Trace) -> bool {
    let last_bwd = trace.kernels.iter().rposition(|k| k.name.contains(".bwd"));
    let first_step = trace.kernels.iter().position(is_optimizer_step);
    matches!((first_step, last_bwd), (Some(s), Some(b)) if s < b)
}

/// Whether a generated trace recomputes activations in backward (kernels `mbM.LL.rc.*`:
/// [`ModelConfig::checkpointed_layers`], [`ModelConfig::selective_recompute`]).
pub fn recomputes_activations(trace: &Trace) -> bool {
    trace.kernels.iter().any(|k| k.name.contains(".rc."))
}

/// Reorder the kernels by `key` (sorted ascending) and renumber every access.
fn reorder(trace: &mut Trace, key: &[(usize, u8, usize)]) {
    let n = trace.kernels.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&k| key[k]);
    let mut new_index = vec![0; n];
    for (i, &k) in order.iter().enumerate() {
        new_index[k] = i;
    }
    let old = std::mem::take(&mut trace.kernels);
    trace.kernels = order.iter().map(|&k| old[k].clone()).collect();
    for t in &mut trace.tensors {
        for a in &mut t.accesses {
            *a = new_index[*a];
        }
        t.accesses.sort_unstable();
        if let Some(w) = &mut t.writes {
            for a in w.iter_mut() {
                *a = new_index[*a];
            }
            w.sort_unstable();
        }
        if !t.global {
            t.created_by = t.accesses.first().copied();
            t.dies_after = t.accesses.last().copied();
        }
    }
}

fn layer_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('L')?;
    rest.split('.').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_is_consistent() {
        let cfg = ModelConfig::preset("gpt2-small").unwrap();
        let t = generate(&cfg).unwrap();
        // GPT-2 small has 124M parameters (tied embeddings, no biases here: ~123.5M).
        let params = cfg.parameters_per_gpu();
        assert!((120_000_000..130_000_000).contains(&params), "{params}");
        let weights: u64 =
            t.tensors.iter().filter(|x| x.kind == TensorKind::Weight).map(|x| x.bytes).sum();
        assert_eq!(weights, params * 4);
        assert!(t.iteration_time_us() > 0.0);
    }

    #[test]
    fn paper_presets_have_expected_scale() {
        let cfg = ModelConfig::preset("llama3-8b").unwrap();
        let p = cfg.parameters_per_gpu();
        assert!((7_900_000_000..8_200_000_000).contains(&p), "{p}");
        let cfg = ModelConfig::preset("llama3-70b").unwrap();
        let p = cfg.parameters_per_gpu();
        // Half of 70.6B with tensor parallel 2 (norm weights replicated).
        assert!((34_500_000_000..35_800_000_000).contains(&p), "{p}");
    }

    #[test]
    fn replay_preset_is_laptop_sized() {
        let t = generate(&ModelConfig::preset("gpt2-replay").unwrap()).unwrap();
        let peak = t.resident_memory_per_kernel().into_iter().max().unwrap();
        assert!(peak > 300_000_000 && peak < 2_500_000_000, "{peak}");
        assert!((t.iteration_time_us() - 10e6).abs() < 1.0);
    }

    #[test]
    fn pipeline_and_tensor_split() {
        let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
        cfg.pipeline_parallel = 2;
        cfg.pipeline_stage = 1;
        cfg.tensor_parallel = 2;
        let t = generate(&cfg).unwrap();
        assert!(t.kernels.iter().any(|k| k.name.contains("recv_act")));
        assert!(t.kernels.iter().any(|k| k.name.contains("allreduce")));
        assert!(!t.kernels.iter().any(|k| k.name.contains("embed.fwd")));
        cfg.pipeline_stage = 2;
        assert!(generate(&cfg).is_err());
    }

    /// Which accesses write, per kind: weights and optimizer states only in their AdamW
    /// kernel, gradients in every backward kernel (created, then accumulated), never in the
    /// AdamW kernel that reads them; activations and workspaces only where created.
    #[test]
    fn writes_are_marked_truthfully() {
        for dtype in [Dtype::Fp32, Dtype::Bf16] {
            let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
            cfg.micro_batches = 3;
            cfg.dtype = dtype;
            let t = generate(&cfg).unwrap();
            let is = |k: usize, s: &str| t.kernels[k].name.ends_with(s);
            for x in &t.tensors {
                let w = x.writes.as_ref().expect("generated traces say which accesses write");
                match x.kind {
                    TensorKind::Weight | TensorKind::OptimizerState => {
                        assert_eq!(w.len(), 1, "{}", x.name);
                        assert!(is(w[0], ".adamw"), "{}", x.name);
                        assert_eq!(Some(&w[0]), x.accesses.last());
                    }
                    TensorKind::Gradient => {
                        let (last, bwd) = x.accesses.split_last().unwrap();
                        assert!(is(*last, ".adamw") && !x.writes_at(*last), "{}", x.name);
                        assert_eq!(w, bwd, "{}", x.name);
                        assert!(bwd.iter().all(|&k| t.kernels[k].name.contains(".bwd")));
                        // Tied embeddings: lm_head.bwd and embed.bwd, per micro-batch.
                        assert!(w.len() >= 3, "{}: one per micro-batch", x.name);
                    }
                    TensorKind::Activation | TensorKind::Workspace => {
                        assert_eq!(w, &vec![x.created_by.unwrap()], "{}", x.name);
                    }
                }
            }
        }
    }

    /// Activations made by a forward op alone can be recomputed from the op's other tensors:
    /// the norms' outputs from the layer input and the norm weight, the MLP activation from
    /// the up projection; attention's outputs (made together) and backward tensors cannot.
    #[test]
    fn forward_activations_say_how_to_recompute_them() {
        let t = generate(&ModelConfig::preset("gpt2-small").unwrap()).unwrap();
        let by = |n: &str| t.tensors.iter().find(|x| x.name == n).unwrap();
        let names = |ids: &[TensorId]| -> Vec<String> {
            ids.iter().map(|&i| t.tensor(i).name.clone()).collect()
        };
        let n1 = by("mb0.L3.n1").recomputable().unwrap();
        assert_eq!(names(&n1.inputs), vec!["L3.norm1.w", "mb0.x3"]);
        let n1_t = by("mb0.L3.n1");
        let c = n1_t.created_by.unwrap();
        assert_eq!(t.recompute_us(n1_t.id), Some(t.kernels[c].duration_us));
        assert_eq!(names(&by("mb0.L3.a").recomputable().unwrap().inputs), vec!["mb0.L3.u"]);
        assert!(by("mb0.L3.ctx").producer.is_none() && by("mb0.L3.lse").producer.is_none());
        assert!(by("mb0.L3.da").producer.is_none(), "backward tensors are not recomputed");
        assert!(t.tensors.iter().filter(|x| x.producer.is_some()).count() > 12 * 6);
        assert!(t.tensors.iter().all(|x| x.producer.is_none() || x.kind == TensorKind::Activation));
    }

    #[test]
    fn bf16_adds_master_weights() {
        let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
        cfg.dtype = Dtype::Bf16;
        let t = generate(&cfg).unwrap();
        assert!(t.tensors.iter().any(|x| x.name.ends_with(".master")));
        let fp32 = generate(&ModelConfig::preset("gpt2-small").unwrap()).unwrap();
        assert!(t.iteration_time_us() < fp32.iteration_time_us());
    }

    #[test]
    fn tf32_keeps_fp32_tensors_and_runs_faster() {
        let fp32 = generate(&ModelConfig::preset("llama3-8b").unwrap()).unwrap();
        let mut cfg = ModelConfig::preset("llama3-8b").unwrap();
        cfg.dtype = Dtype::parse("TF32").unwrap();
        let t = generate(&cfg).unwrap();
        let bytes = |t: &Trace| t.tensors.iter().map(|x| x.bytes).collect::<Vec<_>>();
        assert_eq!(bytes(&t), bytes(&fp32));
        assert!(!t.tensors.iter().any(|x| x.name.ends_with(".master")));
        // Matmuls run several times faster; attention stays on CUDA cores and memory-bound
        // kernels do not speed up (an H200 layer measured 3.5x, docs/BENCHMARKS.md).
        let speedup = fp32.iteration_time_us() / t.iteration_time_us();
        assert!((3.0..4.5).contains(&speedup), "{speedup}");
        assert!(Dtype::parse("fp16").unwrap_err().to_string().contains("tf32"));
    }

    /// `t` is valid and has `plain`'s kernels in another order: the same ideal time.
    fn assert_reordered(t: &Trace, plain: &Trace) {
        t.validate().unwrap();
        let names = |t: &Trace| {
            let mut v: Vec<String> = t.kernels.iter().map(|k| k.name.clone()).collect();
            v.sort();
            v
        };
        assert_eq!(names(t), names(plain));
        assert!((t.iteration_time_us() - plain.iteration_time_us()).abs() < 1e-3);
    }

    #[test]
    fn optimizer_in_backward_steps_each_parameter_after_its_last_gradient_write() {
        let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
        cfg.micro_batches = 2;
        let plain = generate(&cfg).unwrap();
        cfg.optimizer_in_backward = true;
        let t = generate(&cfg).unwrap();
        assert_reordered(&t, &plain);
        // Every step directly follows its gradient's last write, in the last micro-batch;
        // nothing touches the parameter or its states after the step.
        let mut steps = 0;
        for g in t.tensors.iter().filter(|x| x.kind == TensorKind::Gradient) {
            let step = *g.accesses.last().unwrap();
            assert!(t.kernels[step].name.ends_with(".adamw"), "{}", g.name);
            let w = g.writes.as_ref().unwrap();
            let last_write = *w.iter().filter(|&&k| k < step).max().unwrap();
            assert!(t.kernels[last_write].name.starts_with("mb1."), "{}", g.name);
            // Only other steps between the write and this step (several grads per kernel).
            assert!((last_write + 1..step).all(|k| t.kernels[k].name.ends_with(".adamw")));
            steps += 1;
        }
        assert_eq!(steps, plain.kernels.iter().filter(|k| k.name.ends_with(".adamw")).count());
        // The embedding's step ends the iteration (its gradient's last write is the last
        // backward kernel); the other steps run long before the backward pass ends.
        assert!(t.kernels.last().unwrap().name.ends_with(".adamw"));
        let first_step = t.kernels.iter().position(|k| k.name.ends_with(".adamw")).unwrap();
        let last_bwd = t.kernels.iter().rposition(|k| k.name.contains(".bwd")).unwrap();
        assert!(first_step < last_bwd);
    }

    #[test]
    fn optimizer_in_forward_steps_each_parameter_before_its_first_forward_use() {
        let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
        cfg.micro_batches = 2;
        let plain = generate(&cfg).unwrap();
        cfg.optimizer_in_forward = true;
        let t = generate(&cfg).unwrap();
        assert_reordered(&t, &plain);
        let is_step = |k: usize| t.kernels[k].name.ends_with(".adamw");
        let mut steps = 0;
        for w in t.tensors.iter().filter(|x| x.kind == TensorKind::Weight) {
            // The step is the weight's first access, and only other steps stand between it
            // and the weight's first forward use, in the first micro-batch.
            let step = w.accesses[0];
            assert!(is_step(step), "{}", w.name);
            let first_use = w.accesses[1];
            assert!(t.kernels[first_use].name.starts_with("mb0."), "{}", w.name);
            assert!((step + 1..first_use).all(is_step), "{}", w.name);
            steps += 1;
        }
        assert_eq!(steps, plain.kernels.iter().filter(|k| k.name.ends_with(".adamw")).count());
        // Gradients outlive the iteration: written in backward, read by the next step.
        for g in t.tensors.iter().filter(|x| x.kind == TensorKind::Gradient) {
            assert!(g.global && g.created_by.is_none() && g.dies_after.is_none(), "{}", g.name);
            assert!(is_step(g.accesses[0]), "{}", g.name);
            assert!(!g.writes.as_ref().unwrap().contains(&g.accesses[0]), "{}", g.name);
        }
        // The last layer's steps run long after the iteration starts; backward ends it.
        let last_step = t.kernels.iter().rposition(|k| k.name.ends_with(".adamw")).unwrap();
        let first_bwd = t.kernels.iter().position(|k| k.name.contains(".bwd")).unwrap();
        assert!(last_step < first_bwd);
        assert!(!t.kernels.last().unwrap().name.ends_with(".adamw"));
        // Both moves at once are refused.
        cfg.optimizer_in_backward = true;
        let e = generate(&cfg).unwrap_err().to_string();
        assert!(e.contains("exclusive"), "{e}");
    }

    #[test]
    fn absurd_sizes_are_refused_not_overflowed() {
        let err = |spec: &str| {
            let c = ModelConfig::from_spec(spec).unwrap();
            generate(&c).unwrap_err().to_string()
        };
        assert!(err("gpt2-small,seq=4294967296,micro-batch=4294967296").contains("tokens"));
        assert!(err("gpt2-small,hidden=4294967296,heads=1,kv-heads=1").contains("hidden"));
        assert!(err("gpt2-small,layers=4000000000").contains("kernels"));
        assert!(err("gpt2-small,micro-batches=4000000000").contains("kernels"));
        // The largest allowed shapes still generate without overflow (small layer count).
        let c = ModelConfig::from_spec("gpt2-small,layers=1,seq=65536,micro-batch=1").unwrap();
        assert!(generate(&c).is_ok());
    }

    #[test]
    fn specs_set_fields_and_name_what_is_wrong() {
        let c = ModelConfig::from_spec("llama3-8b, dtype=tf32,seq=1024,activation-checkpointing")
            .unwrap();
        assert_eq!((c.dtype, c.seq_len, c.checkpointed_layers), (Dtype::Tf32, 1024, 32));
        let c = ModelConfig::from_spec("gpt2-small,checkpoint-layers=3,micro-batches=2").unwrap();
        assert_eq!((c.checkpointed_layers, c.micro_batches), (3, 2));
        let err = |s: &str| ModelConfig::from_spec(s).unwrap_err().to_string();
        assert!(err("llama3-9b").contains("unknown model preset"));
        assert!(err("gpt2-small,seq=x").contains("seq=x: not a number"));
        assert!(err("gpt2-small,seq").contains("seq needs a value"));
        assert!(err("gpt2-small,batch=4").contains("unknown model option \"batch\""));
        assert!(err("gpt2-small,activation-checkpointing=2").contains("takes no value"));
        assert!(err("gpt2-small,dtype=fp8").contains("known: fp32, tf32, bf16"));
    }

    #[test]
    fn checkpointing_the_first_layers_only() {
        let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
        cfg.checkpointed_layers = 4;
        let t = generate(&cfg).unwrap();
        let rc = |l: u32| t.kernels.iter().any(|k| k.name.starts_with(&format!("mb0.L{l}.rc.")));
        assert!((0..4).all(rc) && !(4..12).any(rc));
        let all = {
            cfg.checkpointed_layers = 12;
            generate(&cfg).unwrap().iteration_time_us()
        };
        cfg.checkpointed_layers = 0;
        let none = generate(&cfg).unwrap().iteration_time_us();
        assert!(none < t.iteration_time_us() && t.iteration_time_us() < all);
    }

    #[test]
    fn activation_checkpointing_recomputes_each_layer_in_backward() {
        let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
        cfg.micro_batches = 2;
        let plain = generate(&cfg).unwrap();
        cfg.checkpointed_layers = cfg.layers;
        let t = generate(&cfg).unwrap();
        let fwd_per_layer = plain
            .kernels
            .iter()
            .filter(|k| k.name.starts_with("mb0.L0.") && k.name.ends_with(".fwd"))
            .count();
        let rc: Vec<usize> =
            (0..t.kernel_count()).filter(|&k| t.kernels[k].name.contains(".rc.")).collect();
        assert_eq!(rc.len(), fwd_per_layer * 12 * 2);
        assert_eq!(t.kernel_count(), plain.kernel_count() + rc.len());
        // About one more forward pass: +20-40% of the iteration.
        let extra = t.iteration_time_us() / plain.iteration_time_us();
        assert!((1.2..1.4).contains(&extra), "{extra}");
        let peak = |t: &Trace| t.resident_memory_per_kernel().into_iter().max().unwrap();
        assert!(peak(&t) * 3 < peak(&plain) * 2, "{} vs {}", peak(&t), peak(&plain));
        let by_name = |t: &Trace, n: &str| t.tensors.iter().find(|x| x.name == n).unwrap().clone();
        let first_bwd = |t: &Trace, mb: u32| {
            t.kernels
                .iter()
                .position(|k| k.name.starts_with(&format!("mb{mb}.")) && k.name.contains(".bwd"))
        };
        // Without checkpointing backward reads the forward's activations; with it they die in
        // the forward and backward reads the recomputed ones, made just before.
        let bwd0 = first_bwd(&plain, 0).unwrap();
        assert!(by_name(&plain, "mb0.L3.qkv").accesses.iter().any(|&k| k > bwd0));
        let bwd0 = first_bwd(&t, 0).unwrap();
        assert!(by_name(&t, "mb0.L3.qkv").accesses.iter().all(|&k| k < bwd0));
        let rq = by_name(&t, "mb0.L3.rc.qkv");
        assert!(rq.accesses.iter().any(|&k| t.kernels[k].name == "mb0.L3.attn.bwd"));
        assert!(t.kernels[rq.accesses[0]].name == "mb0.L3.rc.qkv.fwd");
        // The layer input is the checkpoint: read by its recomputation and its backward.
        let x = by_name(&t, "mb0.x3");
        assert!(x.accesses.iter().any(|&k| t.kernels[k].name == "mb0.L3.rc.norm1.fwd"));
        assert!(x.accesses.iter().any(|&k| t.kernels[k].name == "mb0.L3.norm1.bwd"));
        t.validate().unwrap();
    }
}
