//! Cross-crate integration tests live in `tests/tests/`; what several of them share is here.

use teraio_scheduler::{ModelConfig, Trace, generate};

/// A small generated GPT iteration (the `gpt2-replay` preset cut down: hidden 256, 4 heads,
/// sequence 128, micro-batch 2) with `layers` layers, scaled to `iteration_us` when given.
pub fn small_gpt(layers: u32, iteration_us: Option<f64>) -> Trace {
    let mut c = ModelConfig::preset("gpt2-replay").expect("a preset");
    c.layers = layers;
    c.hidden = 256;
    c.heads = 4;
    c.kv_heads = 4;
    c.ffn = 1024;
    c.vocab = 8192;
    c.seq_len = 128;
    c.micro_batch = 2;
    c.target_iteration_us = iteration_us;
    generate(&c).expect("the generator takes the preset")
}
