//! One module per subcommand. Each has `Args` (clap) and `run(args) -> Result<()>`.

pub mod advise;
pub mod analyze;
pub mod bench;
pub mod bench_gpu;
pub mod bench_optim;
pub mod bench_tensors;
pub mod engine_args;
pub mod fsdp;
pub mod gpu_check;
pub mod hw;
pub mod hw_args;
pub mod inspect;
pub mod plan;
pub mod run;
pub mod run_faults;
pub mod simulate;
pub mod trace;
