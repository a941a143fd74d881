//! `teraio run`: the main job. A training iteration that does not fit in (emulated) GPU memory,
//! planned with the `teraio` policy and replayed in real time with real bytes moving to and from
//! an SSD array, compared with the simulator's prediction and with ideal.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use teraio_engine::Engine;
use teraio_engine::backend::sim::{SimDisk, SimFault};
use teraio_engine::pool::BufferPool;
use teraio_engine::queue::Priority;
use teraio_engine::replay::{
    BandwidthWatch, IterationSummary, ReplayConfig, ReplayReport, replay_adaptive,
};
use teraio_engine::store::{GpuPathInfo, OffloadOptions};
use teraio_engine::tier::{HostTier, MemoryTier, TensorMem};
use teraio_engine::units::ByteSize;
use teraio_scheduler::{
    Hardware, ModelConfig, Plan, Policy, SimOptions, SimReport, Trace, generate, simulate,
};

use super::bench::GpuPathArg;
use super::engine_args::ArrayArgs;
use super::run_faults::{FaultSpec, Injector, parse_fault};
use crate::units::{gb, gbps, parse_size, parse_size_or_zero};
use crate::{CliError, Result};

/// Options of `teraio run`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
What it does:
  1. builds the trace of one training iteration (a model preset, or --trace FILE),
  2. opens the SSD array (4 files in ./teraio-data by default, or --device ...),
  3. measures the array's write and read bandwidth through the tensor store,
  4. plans offloads and prefetches with --policy for an emulated GPU memory smaller than
     the iteration needs, and simulates the plan on the measured hardware,
  5. replays the iteration in real time: kernels wait their duration, tensors are real
     buffers, every planned migration runs on the real engine, every tensor that comes
     back is verified; then prints real vs simulated vs ideal, and every iteration.

Faults (docs/EXECUTOR.md, \"Faults\"): a write that fails keeps the tensor in GPU memory (or
sends it to the host tier, with --host-memory); a read that fails is tried again; a tensor
whose only copy cannot be read back stops its iteration with an error naming the tensor, the
kernel and the device, and the next iteration runs (the exit status is then 1). After an
iteration whose SSD bandwidth moved by more than 1.5x from the first one's, the plan is made
again for the bandwidth measured (--no-replan keeps the first plan).
Faults on simulated disks (no hardware needed): --sim, and --fault SPEC (repeatable), where
SPEC is KIND[:DEV[:FACTOR]][@ITER[:KERNEL]] and the fault starts before kernel KERNEL of
iteration ITER (default: the first kernel of the first iteration):
  slow:DEV:FACTOR   the device becomes FACTOR times slower (needs --sim-bandwidth)
  eio-read:DEV      every read of the device fails (EIO)
  eio-write:DEV     every write of the device fails (EIO)
  enospc:DEV        every write of the device fails (ENOSPC, out of space)
  short:DEV         every transfer of the device moves half its bytes (resumed)
  corrupt           the SSD copy of an activation read again later gets corrupt bytes

Examples:
  teraio run                                   # gpt2-replay, 60% of its peak memory
  teraio run --gpu-memory 900M --time-scale 0.5
  teraio run --device /dev/nvme1n1 --device /dev/nvme2n1 --force
  teraio run --json > run.json --plot run.svg
  teraio run --gpu 0 --gpu-path auto           # tensors in real GPU memory (CUDA)
  teraio run --sim --iterations 4 --fault slow:1:10@1   # one of 4 disks 10x slower
  teraio run --sim --fault corrupt@0:60 --iterations 3  # a lost activation; iteration 1 runs")]
pub struct Args {
    /// Model preset of the trace, with optional overrides `NAME[,KEY=VALUE|,FLAG]...` (see
    /// `teraio trace gen --help`; e.g. `gpt2-replay,selective-recompute`).
    #[arg(long, default_value = "gpt2-replay")]
    pub model: String,
    /// Replay this trace (JSON, docs/TRACE.md) instead of a preset.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Emulated GPU memory for the iteration's tensors (e.g. 1G). Default: 60% of the peak
    /// the iteration needs with every tensor resident.
    #[arg(long, value_parser = parse_size)]
    pub gpu_memory: Option<u64>,
    /// Host memory the planner may use as a second tier (0: SSD only).
    #[arg(long, default_value = "0", value_parser = parse_size_or_zero)]
    pub host_memory: u64,
    /// Planning policy (`auto`: the best of several teraio variants; recomputation is left
    /// out, the replay cannot run producers yet).
    #[arg(long, default_value = "auto")]
    pub policy: String,
    /// The SSD array: --config FILE, --device PATH (repeat), or --files N in --dir.
    #[command(flatten)]
    pub array: ArrayArgs,
    /// Multiply kernel durations (0.5: a twice faster GPU, so twice the bandwidth pressure).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Iterations replayed back to back; the last is reported.
    #[arg(long, default_value_t = 2)]
    pub iterations: usize,
    /// Bytes written and read back to measure the array before planning.
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    pub probe_size: u64,
    /// Skip filling and verifying tensor contents (and the store's checksums).
    #[arg(long)]
    pub no_verify: bool,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG: GPU memory over time (replayed, simulated, all resident) and capacity.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Put every tensor in the memory of this CUDA device (real GPU memory, moved through the
    /// GPU data paths); without it GPU memory is emulated in host memory. The cap is still
    /// --gpu-memory, enforced by the executor's accounting.
    #[arg(long, value_name = "N")]
    pub gpu: Option<u32>,
    /// With --gpu: the data path (auto, gds, bounce; see `teraio bench --help`).
    #[arg(long, value_enum, default_value = "auto", requires = "gpu")]
    pub gpu_path: GpuPathArg,
    /// With --gpu: host memory stands in for the GPU (the same data paths; for tests).
    #[arg(long, hide = true, requires = "gpu")]
    pub gpu_emulated: bool,
    /// Simulated in-memory disks instead of files or devices: --files of them (default 4) of
    /// --file-size each (memory is taken as they are written), each as fast as
    /// --sim-bandwidth. For trying --fault without hardware.
    #[arg(long, conflicts_with = "devices")]
    pub sim: bool,
    /// With --sim: each disk's bandwidth per direction, bytes/s (0: as fast as memory copies).
    #[arg(long, default_value = "1G", value_parser = parse_size_or_zero, requires = "sim")]
    pub sim_bandwidth: u64,
    /// With --sim: inject a fault while the replay runs (repeat for several); see below.
    #[arg(long = "fault", value_name = "SPEC", value_parser = parse_fault, requires = "sim")]
    pub faults: Vec<FaultSpec>,
    /// Keep the first plan whatever bandwidth the iterations measure.
    #[arg(long)]
    pub no_replan: bool,
}

fn load_trace(args: &Args) -> Result<Trace> {
    match &args.trace {
        Some(path) => crate::cmd::trace::load_file(path),
        None => Ok(generate(&ModelConfig::from_spec(&args.model)?)?),
    }
}

/// The array's bandwidth through the store, bytes/s: writing alone, reading alone, and the
/// sum of both directions when they run at the same time (one disk serves both).
struct Measured {
    write: f64,
    read: f64,
    mixed: f64,
}

/// Size of the tensors that measure the array.
const PROBE_TENSOR_BYTES: u64 = 32 << 20;

/// How many probe tensors measure `total` bytes.
fn probe_tensors(total: u64) -> u64 {
    total.div_ceil(PROBE_TENSOR_BYTES).max(4)
}

/// Memory for a probe tensor: the engine's GPU memory with `--gpu`, its host buffers without.
fn probe_mem(engine: &Engine) -> Result<TensorMem> {
    Ok(match engine.gpu_tier() {
        Some(_) => engine.alloc_gpu(PROBE_TENSOR_BYTES)?,
        None => engine.alloc_host(PROBE_TENSOR_BYTES)?,
    })
}

/// Write, read, then write and read at once `total` bytes of 32 MiB tensors through the store
/// (from and to GPU memory with `--gpu`: the same path the replay takes).
fn measure(engine: &Engine, total: u64) -> Result<Measured> {
    const BASE: u64 = u64::MAX - (1 << 20);
    let count = probe_tensors(total);
    let store = engine.store();
    let mem = |i: u64| -> Result<TensorMem> {
        let mut m = probe_mem(engine)?;
        let fill = vec![i as u8 ^ 0x5a; PROBE_TENSOR_BYTES as usize];
        m.fill_from_host(&fill)?;
        Ok(m)
    };
    let offload_all = |first: u64, mems: Vec<TensorMem>| {
        mems.into_iter()
            .enumerate()
            .map(|(i, m)| store.offload(first + i as u64, m, OffloadOptions::default()))
            .collect::<std::result::Result<Vec<_>, _>>()
    };
    let prefetch_all = |first: u64| {
        (0..count)
            .map(|i| {
                let dst = probe_mem(engine)?;
                store.prefetch(first + i, dst, Priority::Normal).map_err(crate::CliError::from)
            })
            .collect::<Result<Vec<_>>>()
    };
    let bytes = (count * PROBE_TENSOR_BYTES) as f64;
    // Writing alone.
    let mems = (0..count).map(mem).collect::<Result<Vec<_>>>()?;
    let start = Instant::now();
    for h in offload_all(BASE, mems)? {
        h.wait()?;
    }
    let write = bytes / start.elapsed().as_secs_f64();
    // Reading alone (a volatile store forgets what it hands back, so write again after).
    let start = Instant::now();
    let back: Vec<_> =
        prefetch_all(BASE)?.into_iter().map(|h| h.wait()).collect::<std::result::Result<_, _>>()?;
    let read = bytes / start.elapsed().as_secs_f64();
    for h in offload_all(BASE, back)? {
        h.wait()?;
    }
    // Both at once: read the first set while writing a second one, issued interleaved.
    let mems = (0..count).map(mem).collect::<Result<Vec<_>>>()?;
    let start = Instant::now();
    let mut handles = Vec::new();
    for (i, m) in mems.into_iter().enumerate() {
        let i = i as u64;
        let w = store.offload(BASE - count + i, m, OffloadOptions::default())?;
        let dst = probe_mem(engine)?;
        let r = store.prefetch(BASE + i, dst, Priority::Normal)?;
        handles.push((w, r));
    }
    for (w, r) in handles {
        w.wait()?;
        r.wait()?;
    }
    let mixed = 2.0 * bytes / start.elapsed().as_secs_f64();
    for i in 0..count {
        store.free(BASE - count + i)?.wait()?;
        store.free(BASE + i)?.wait()?;
    }
    Ok(Measured { write, read, mixed })
}

/// Fail before anything runs when the array cannot hold `needed` bytes at once for `what`:
/// one message with what is needed, what there is, and the options that change it.
fn check_room(what: &str, needed: u64, capacity: u64, or: &str) -> Result<()> {
    if needed <= capacity {
        return Ok(());
    }
    Err(CliError::Usage(format!(
        "the SSD array is too small for {what}: it needs {} at once, the array holds {} of \
         tensor data; give it more room (--file-size per file, more --files, or bigger \
         --device targets) or {or}",
        gb(needed as f64),
        gb(capacity as f64)
    )))
}

/// Bytes the array must hold for `plan`: the simulated peak of its copies (the executor keeps
/// a copy until its tensor dies or is written again, as the simulator counts), simulated with
/// every tensor rounded up to the extent allocator's unit, as the store allocates it.
fn executor_ssd_bytes(
    trace: &Trace,
    plan: &teraio_scheduler::Plan,
    hw: &Hardware,
    unit: u64,
    peak: u64,
) -> Result<u64> {
    let mut padded = trace.clone();
    for t in &mut padded.tensors {
        t.bytes = t.bytes.div_ceil(unit.max(1)) * unit.max(1);
    }
    // Rounded-up tensors would not fit the GPU memory the plan was made for; only the SSD
    // bytes matter here.
    let mut hw = hw.clone();
    hw.gpu_memory_bytes = u64::MAX / 4;
    let sim = simulate(&padded, plan, &hw, &SimOptions { iterations: 2, record_timeline: false })?;
    Ok(sim.peak_ssd_bytes.max(peak))
}

/// The plan for `hw`, checked in the simulator, made again for a little less memory where it
/// cannot run (the scheduler's rule for the replay: `select::choose_with_headroom`). Returns the
/// plan, its simulation (on `hw`) and the headroom used (percent).
fn make_plan(
    trace: &Trace,
    hw: &Hardware,
    capacity: u64,
    policy: Policy,
) -> Result<(Plan, SimReport, u64)> {
    Ok(teraio_scheduler::select::choose_with_headroom(trace, hw, capacity, policy)?)
}

/// Run `teraio run`.
pub fn run(args: Args) -> Result<()> {
    if args.iterations == 0 {
        return Err(CliError::Usage("--iterations must be at least 1".into()));
    }
    let trace = prepare_trace(&args)?;
    let peak = trace.resident_memory_per_kernel().into_iter().max().unwrap_or(0);
    let capacity = args.gpu_memory.unwrap_or(peak * 6 / 10);
    let policy: Policy = args.policy.parse()?;
    let say = |s: String| {
        if !args.json {
            eprintln!("{s}");
        }
    };
    say(format!(
        "teraio run: {} ({} kernels, {} tensors, {} peak with everything resident), emulated GPU memory {}",
        trace.name,
        trace.kernels.len(),
        trace.tensors.len(),
        gb(peak as f64),
        gb(capacity as f64)
    ));

    let (engine, mut injector, backing) = open_engine(&args, &trace)?;
    let gpu_what = match engine.gpu_description() {
        Some(d) => {
            let info = engine.gpu_path()?;
            say(format!("GPU memory: {d}; data path {} ({})", info.path, info.reason));
            Some((d.to_string(), info))
        }
        None => {
            say("GPU memory: emulated in host memory (pass --gpu N for a CUDA device's memory)"
                .into());
            None
        }
    };
    let array_what = engine.describe();
    check_room(
        "measuring it",
        2 * probe_tensors(args.probe_size) * PROBE_TENSOR_BYTES,
        engine.capacity_bytes(),
        "lower --probe-size",
    )?;
    say(format!("array: {array_what}; measuring it with {} ...", gb(args.probe_size as f64)));
    let m = measure(&engine, args.probe_size)?;
    say(format!(
        "array: write {}, read {}, both at once {} in total",
        gbps(m.write),
        gbps(m.read),
        gbps(m.mixed)
    ));

    let hw = hardware_model(&engine, &trace, capacity, &args, &m, gpu_what.is_some(), &say)?;

    // The plan is checked in the simulator before it runs.
    let started = Instant::now();
    let (p, sim, headroom_percent) = make_plan(&trace, &hw, capacity, policy)?;
    let plan_s = started.elapsed().as_secs_f64();
    check_room(
        &format!("the `{}` plan", p.policy),
        executor_ssd_bytes(
            &trace,
            &p,
            &hw,
            engine.config().alloc_unit_bytes.0,
            sim.peak_ssd_bytes,
        )?,
        engine.capacity_bytes(),
        "raise --gpu-memory or --host-memory so that less goes to the SSDs",
    )?;
    if let teraio_scheduler::Outcome::OutOfMemory { kernel, needed_bytes, used_bytes, .. } =
        sim.outcome
    {
        return Err(CliError::Usage(format!(
            "every `{}` plan runs out of memory in the simulator (at kernel {kernel}: {needed_bytes} \
             bytes needed, {used_bytes} in use), also with 30% headroom: raise --gpu-memory, slow \
             the kernels down (--time-scale) or pick another --policy",
            p.policy
        )));
    }
    say(format!(
        "plan: {} migrations by `{}` in {:.2} s{}; simulated iteration {:.2} s ({:.1}% of ideal)",
        p.instructions.len(),
        p.policy,
        plan_s,
        if headroom_percent > 0 {
            format!(
                " (planned for {headroom_percent}% less memory: the first plans ran out in the simulator)"
            )
        } else {
            String::new()
        },
        sim.iteration_time_us * 1e-6,
        sim.percent_of_ideal
    ));

    // GPU memory: exact-byte accounting in the executor; real buffers from a tier big enough for
    // every tensor to keep its own buffer (see `engine::replay`): the CUDA tier with --gpu,
    // host memory emulating it otherwise.
    let gpu: std::sync::Arc<dyn MemoryTier> = match engine.gpu_tier() {
        Some(t) => t.clone(),
        None => HostTier::new("emulated-gpu", backing + (64 << 20))?,
    };
    let kernels = trace.kernels.len() as u64;
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::new(kernels * args.iterations as u64);
        b.set_style(
            ProgressStyle::with_template(
                "{spinner} {msg} [{bar:40}] {pos}/{len} kernels {elapsed}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        b.enable_steady_tick(Duration::from_millis(120));
        b
    };
    let cfg = ReplayConfig {
        gpu_capacity_bytes: capacity,
        time_scale: 1.0,
        iterations: args.iterations,
        verify: !args.no_verify,
    };
    // Notes from the faults injected and the re-plans, printed above the bar as they come.
    let notes = std::cell::RefCell::new(Vec::<String>::new());
    let note = |s: String| {
        if !args.json {
            // Printed above the bar (and also when stderr is not a terminal, where the bar is
            // hidden).
            bar.suspend(|| eprintln!("{s}"));
        }
        notes.borrow_mut().push(s);
    };
    let store = engine.store_arc().clone();
    let mut progress = |pr: teraio_engine::replay::Progress| {
        for s in injector.at(pr.iteration, pr.kernel, &store, &trace) {
            note(s);
        }
        bar.set_message(format!("iteration {}/{}", pr.iteration + 1, args.iterations));
        bar.set_position((pr.iteration * pr.kernels + pr.kernel) as u64);
    };
    // After a slow (or fast again) iteration: plan again for the bandwidth it measured.
    let mut watch = BandwidthWatch::new(1.5, 4 << 20);
    let mut replans = Vec::new();
    let mut adapt = |s: &IterationSummary| -> teraio_engine::Result<Option<Plan>> {
        if args.no_replan {
            return Ok(None);
        }
        let Some((w, r)) = watch.observe(s) else { return Ok(None) };
        let mut h = hw.clone();
        h.ssd_write_bytes_per_s *= w;
        h.ssd_read_bytes_per_s *= r;
        if let Some(d) = h.ssd_duplex_bytes_per_s.as_mut() {
            *d *= w.min(r);
        }
        let what = format!(
            "iteration {}: SSD write {}, read {} while busy (x{w:.2} and x{r:.2} of the first iteration's)",
            s.iteration,
            gbps(s.ssd_write_bytes_per_s),
            gbps(s.ssd_read_bytes_per_s)
        );
        match make_plan(&trace, &h, capacity, policy) {
            Ok((np, nsim, _)) if matches!(nsim.outcome, teraio_scheduler::Outcome::Completed) => {
                note(format!(
                    "{what}: re-planned for that bandwidth: {} migrations by `{}`, simulated iteration {:.2} s ({:.1}% of ideal); iteration {} runs it",
                    np.instructions.len(),
                    np.policy,
                    nsim.iteration_time_us * 1e-6,
                    nsim.percent_of_ideal,
                    s.iteration + 1
                ));
                replans.push(json!({
                    "after_iteration": s.iteration,
                    "write_scale": w,
                    "read_scale": r,
                    "migrations": np.instructions.len(),
                    "simulated_iteration_time_s": nsim.iteration_time_us * 1e-6,
                }));
                Ok(Some(np))
            }
            Ok(_) => {
                note(format!(
                    "{what}: no plan for that bandwidth runs in the simulator; keeping the plan"
                ));
                Ok(None)
            }
            Err(e) => {
                note(format!("{what}: re-planning failed ({e}); keeping the plan"));
                Ok(None)
            }
        }
    };
    let report =
        replay_adaptive(&trace, &p, engine.store_arc(), gpu, &cfg, &mut progress, &mut adapt);
    bar.finish_and_clear();
    let report = report?;
    let notes = notes.into_inner();

    if let Some(path) = &args.plot {
        plot(path, &trace, &sim, &report, capacity)?;
        say(format!("plot written to {}", path.display()));
    }
    let done = Finished {
        trace: &trace,
        plan: &p,
        sim: &sim,
        report: &report,
        hw: &hw,
        engine: &engine,
        measured: &m,
        gpu_what: gpu_what.as_ref(),
        peak,
        capacity,
        plan_s,
        headroom_percent,
    };
    if args.json {
        print_json(&done, &array_what, replans, notes)?;
    } else {
        print_text(&done);
    }
    stopped(&report)
}

/// The trace `teraio run` replays: loaded, its kernels' durations scaled, without producers
/// (the emulated trainer cannot run them: the executor's allocator here cannot recompute, so
/// plans here move tensors only).
fn prepare_trace(args: &Args) -> Result<Trace> {
    let mut trace = load_trace(args)?;
    if args.time_scale != 1.0 {
        trace.scale_durations(args.time_scale)?;
    }
    for t in &mut trace.tensors {
        t.producer = None;
    }
    Ok(trace)
}

/// The engine the replay runs on (simulated disks with `--sim`, the faults to inject, a host
/// tier, a GPU with `--gpu`), with the injector of `--fault` and the bytes of the buffers every
/// tensor keeps between uses (`backing`).
fn open_engine(args: &Args, trace: &Trace) -> Result<(Engine, Injector, u64)> {
    let mut ecfg = args.array.engine_config()?;
    let sim_disks: Vec<std::sync::Arc<SimDisk>> = if args.sim {
        let disks: Vec<_> = (0..ecfg.files.max(1))
            .map(|i| SimDisk::new(ecfg.file_size_bytes.0, 4096, u64::from(i)))
            .collect();
        if args.sim_bandwidth > 0 {
            for d in &disks {
                d.inject(SimFault::Throughput { bytes_per_s: args.sim_bandwidth });
            }
        }
        ecfg.sim_disks = disks.clone();
        disks
    } else {
        Vec::new()
    };
    let injector = Injector::new(sim_disks, args.sim_bandwidth, &args.faults)?;
    ecfg.host_tier_bytes = ByteSize(args.host_memory);
    ecfg.checksums = !args.no_verify;
    // Copies stay valid after a prefetch, so the plan's clean drops write nothing.
    ecfg.retain_on_prefetch = true;
    // The probe's buffers: two sets of probe tensors in flight at once.
    let probe_buffers = (2 * probe_tensors(args.probe_size) + 2) * PROBE_TENSOR_BYTES;
    ecfg.host_buffers_bytes = ByteSize(ecfg.host_buffers_bytes.0.max(probe_buffers + (256 << 20)));
    // Every tensor keeps its own buffer between uses (see `engine::replay`): the tier holds
    // them all; the cap the plan runs under is the executor's exact-byte accounting.
    let backing: u64 =
        trace.tensors.iter().map(|t| BufferPool::capacity_for(t.bytes as usize) as u64).sum();
    if let Some(n) = args.gpu {
        ecfg.gpu.device = Some(n);
        ecfg.gpu.path = args.gpu_path.into();
        ecfg.gpu.emulated = args.gpu_emulated;
        ecfg.gpu.budget_bytes = ByteSize(backing.max(probe_buffers) + (512 << 20));
    }
    let engine = Engine::open(ecfg)?;
    Ok((engine, injector, backing))
}

/// The hardware model the plan is made for: the array as measured (`m`), the emulated or real
/// GPU's memory (`capacity`), the host tier, and with a real GPU (`real_gpu`) its PCIe copies
/// measured.
fn hardware_model(
    engine: &Engine,
    trace: &Trace,
    capacity: u64,
    args: &Args,
    m: &Measured,
    real_gpu: bool,
    say: &dyn Fn(String),
) -> Result<Hardware> {
    let array = engine.array();
    let (write_bw, read_bw) = (m.write, m.read);
    let n = f64::from(array.device_count());
    let mut hw = Hardware::dev();
    hw.gpu_memory_bytes = capacity;
    hw.ssd_count = array.device_count();
    hw.ssd_write_bytes_per_s = write_bw / n;
    hw.ssd_read_bytes_per_s = read_bw / n;
    // The emulated GPU memory is host memory: there is no PCIe hop, and I/O goes to it
    // directly. Reads and writes compete for the same drives: the measured two-way figure is
    // the array's combined limit.
    hw.ssd_duplex_bytes_per_s = Some(m.mixed / n);
    hw.pcie_h2d_bytes_per_s = 50e9;
    hw.pcie_d2h_bytes_per_s = 50e9;
    hw.host_memory_bytes_per_s = 50e9;
    hw.host_memory_cap_bytes = args.host_memory;
    hw.gpudirect = true;
    // Plans keep their copies within the array (less a block per tensor and device of slack
    // for the padding of stripe tails).
    let devices = u64::from(array.device_count());
    let slack =
        trace.tensors.len() as u64 * u64::from(array.geometry().block_bytes) * (devices + 1);
    hw.ssd_capacity_bytes = Some((engine.capacity_bytes().saturating_sub(slack) / devices).max(1));
    if real_gpu {
        // Real GPU memory: the PCIe hop is measured; the measured array bandwidth above already
        // went GPU <-> SSD through the chosen path (the bounce pipeline overlaps PCIe and SSD).
        let pcie = teraio_engine::probe::measure_pcie(engine, 256 << 20, 4)?;
        say(format!(
            "PCIe (pinned copies): host -> GPU {}, GPU -> host {}, both at once {} in total",
            gbps(pcie.h2d),
            gbps(pcie.d2h),
            gbps(pcie.both)
        ));
        hw.pcie_h2d_bytes_per_s = pcie.h2d;
        hw.pcie_d2h_bytes_per_s = pcie.d2h;
        // A link that moves more both ways at once than the two alone add up to does not limit
        // them together.
        hw.pcie_duplex_bytes_per_s = (pcie.both < pcie.h2d + pcie.d2h).then_some(pcie.both);
    }

    Ok(hw)
}

/// What a finished `teraio run` reports.
struct Finished<'a> {
    trace: &'a Trace,
    plan: &'a Plan,
    sim: &'a SimReport,
    report: &'a ReplayReport,
    hw: &'a Hardware,
    engine: &'a Engine,
    measured: &'a Measured,
    gpu_what: Option<&'a (String, GpuPathInfo)>,
    peak: u64,
    capacity: u64,
    plan_s: f64,
    headroom_percent: u64,
}

/// `teraio run --json`: the run's report as one JSON object on stdout.
fn print_json(
    d: &Finished<'_>,
    array_what: &str,
    replans: Vec<serde_json::Value>,
    notes: Vec<String>,
) -> Result<()> {
    let Finished {
        trace,
        plan: p,
        sim,
        report,
        hw,
        engine,
        measured: m,
        gpu_what,
        peak,
        capacity,
        plan_s,
        headroom_percent,
    } = *d;
    let array = engine.array();
    let (write_bw, read_bw) = (m.write, m.read);
    let ideal_s = sim.ideal_time_us * 1e-6;
    let sim_s = sim.iteration_time_us * 1e-6;
    let real_s = report.iteration_time_s;
    let sim_stall_s = sim.stall_us * 1e-6;
    let out = json!({
        "trace": trace.name,
        "kernels": trace.kernels.len(),
        "tensors": trace.tensors.len(),
        "policy": p.policy,
        "peak_resident_bytes": peak,
        "gpu_capacity_bytes": capacity,
        "gpu": gpu_what.as_ref().map(|(d, info)| json!({
            "device": d,
            "path": info.path,
            "reason": info.reason,
            "cufile_mode": info.direct_mode.map(|m| m.describe()),
            "pcie_h2d_bytes_per_s": hw.pcie_h2d_bytes_per_s,
            "pcie_d2h_bytes_per_s": hw.pcie_d2h_bytes_per_s,
            "pcie_duplex_bytes_per_s": hw.pcie_duplex_bytes_per_s,
            "stats": engine.store().gpu_stats(),
        })),
        "array": {
            "what": array_what,
            "devices": array.device_count(),
            "write_bytes_per_s": write_bw,
            "read_bytes_per_s": read_bw,
            "mixed_bytes_per_s": m.mixed,
        },
        "plan": {
            "migrations": p.instructions.len(),
            "plan_time_s": plan_s,
            "headroom_percent": headroom_percent,
        },
        "ideal_time_s": ideal_s,
        "simulated": {
            "iteration_time_s": sim_s,
            "stall_s": sim_stall_s,
            "percent_of_ideal": sim.percent_of_ideal,
            "peak_gpu_bytes": sim.peak_gpu_bytes,
            "bytes_moved": sim.bytes_moved,
        },
        "replay": {
            "iteration_time_s": real_s,
            "iteration_times_s": report.iteration_times_s,
            "stall_s": report.stall_s,
            "overrun_s": report.overrun_s,
            "percent_of_ideal": 100.0 * ideal_s / real_s,
            "peak_gpu_bytes": report.peak_gpu_bytes,
            "offloads": report.offloads,
            "clean_drops": report.clean_drops,
            "prefetches": report.prefetches,
            "kept_copies": report.kept_copies,
            "verified_tensors": report.verified_tensors,
            "verified_bytes": report.verified_bytes,
            "store": report.store,
            "iterations": report.iterations,
            "stopped_iterations": report.stopped_iterations,
            "replans": replans,
        },
        "notes": notes,
        "agreement": {
            "iteration_time_ratio": real_s / sim_s,
            "stall_difference_s": report.stall_s - sim_stall_s,
        },
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// `teraio run`: the run's report as tables on stdout.
fn print_text(d: &Finished<'_>) {
    let Finished { sim, report, engine, gpu_what, peak, capacity, .. } = *d;
    let ideal_s = sim.ideal_time_us * 1e-6;
    let sim_s = sim.iteration_time_us * 1e-6;
    let real_s = report.iteration_time_s;
    let sim_stall_s = sim.stall_us * 1e-6;
    let st = &report.store;
    println!();
    println!("{:<24} {:>12} {:>12} {:>12}", "", "replayed", "simulated", "ideal");
    println!("{:<24} {:>10.2} s {:>10.2} s {:>10.2} s", "iteration time", real_s, sim_s, ideal_s);
    println!(
        "{:<24} {:>11.1}% {:>11.1}% {:>11}",
        "% of ideal",
        100.0 * ideal_s / real_s,
        sim.percent_of_ideal,
        "100.0%"
    );
    println!("{:<24} {:>10.2} s {:>10.2} s {:>12}", "stall time", report.stall_s, sim_stall_s, "0");
    println!(
        "{:<24} {:>12} {:>12} {:>12}",
        "peak GPU memory",
        gb(report.peak_gpu_bytes as f64),
        gb(sim.peak_gpu_bytes as f64),
        gb(peak as f64)
    );
    println!("{:<24} {:>12}", "GPU memory capacity", gb(capacity as f64));
    println!();
    for (name, d) in [
        ("offload  GPU -> SSD", &st.ssd_write),
        ("prefetch SSD -> GPU", &st.ssd_read),
        ("offload  GPU -> host", &st.host_write),
        ("prefetch host -> GPU", &st.host_read),
    ] {
        if d.ops > 0 {
            println!(
                "{name:<24} {:>12} in {:>5} ops, {:>12} while busy",
                gb(d.bytes as f64),
                d.ops,
                gbps(d.bandwidth_bytes_per_s())
            );
        }
    }
    println!(
        "{} offloads written, {} clean drops (unchanged tensors released without writing), {} prefetches",
        report.offloads, report.clean_drops, report.prefetches
    );
    println!(
        "verified {} tensors ({}) after they came back; {} store checksum chunks; 0 mismatches",
        report.verified_tensors,
        gb(report.verified_bytes as f64),
        st.chunks_verified
    );
    if let Some((d, info)) = &gpu_what {
        let g = engine.store().gpu_stats();
        println!(
            "{d}: {} path ({}); bounce {} out / {} in, gds {} out / {} in, GPU crc32c {:.3} s",
            info.path,
            info.direct_mode.map_or("cuFile not used", |m| m.describe()),
            gb(g.bounce_write.bytes as f64),
            gb(g.bounce_read.bytes as f64),
            gb(g.gds_write.bytes as f64),
            gb(g.gds_read.bytes as f64),
            g.gpu_crc_ns as f64 * 1e-9
        );
    }
    if report.overrun_s > 0.05 * real_s {
        println!(
            "note: the emulation itself ran {:.2} s over kernel durations (filling and verifying buffers on this CPU)",
            report.overrun_s
        );
    }
    println!(
        "replay vs simulator: iteration time x{:.3}, stall {:+.2} s",
        real_s / sim_s,
        report.stall_s - sim_stall_s
    );
    print_iterations(report);
}

/// Every iteration: time, stall, SSD bandwidth, the plan it ran, what went wrong.
fn print_iterations(report: &ReplayReport) {
    println!();
    println!(
        "{:<10} {:>9} {:>9} {:>12} {:>12} {:>10}  plan",
        "iteration", "time", "stall", "SSD write", "SSD read", "host tier"
    );
    for s in &report.iterations {
        println!(
            "{:<10} {:>7.2} s {:>7.2} s {:>12} {:>12} {:>10}  {} migrations{}",
            s.iteration,
            s.time_s,
            s.stall_s,
            gbps(s.ssd_write_bytes_per_s),
            gbps(s.ssd_read_bytes_per_s),
            gb((s.host_write_bytes + s.host_read_bytes) as f64),
            s.migrations,
            if s.replanned { " (re-planned)" } else { "" }
        );
        let mut went_on = Vec::new();
        if s.failed_offloads > 0 {
            went_on.push(format!(
                "{} writes failed (the tensors stayed in GPU memory)",
                s.failed_offloads
            ));
        }
        if s.host_retries > 0 {
            went_on.push(format!("{} failed SSD writes went to the host tier", s.host_retries));
        }
        if s.prefetch_retries > 0 {
            went_on.push(format!("{} failed reads tried again", s.prefetch_retries));
        }
        if s.evictions > 0 {
            went_on.push(format!(
                "{} tensors evicted, {} read back on demand",
                s.evictions, s.demand_fetches
            ));
        }
        if !went_on.is_empty() {
            println!("{:<10} went on: {}", "", went_on.join("; "));
        }
        if let Some(why) = &s.stopped {
            println!("{:<10} STOPPED: {why}", "");
        }
    }
}

/// An error (exit status 1) when an iteration stopped, after the report was printed.
fn stopped(report: &ReplayReport) -> Result<()> {
    if report.stopped_iterations == 0 {
        return Ok(());
    }
    let first = report.iterations.iter().find(|s| s.stopped.is_some()).expect("counted");
    Err(CliError::Usage(format!(
        "{} of {} iterations stopped because a tensor was lost (first: iteration {}: {}); the iterations after each one ran",
        report.stopped_iterations,
        report.iterations.len(),
        first.iteration,
        first.stopped.as_deref().unwrap_or("")
    )))
}

fn plot(
    path: &Path,
    trace: &Trace,
    sim: &SimReport,
    report: &ReplayReport,
    capacity: u64,
) -> Result<()> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| CliError::Usage(format!("plot: {e}"));
    let gib = 1024.0 * 1024.0 * 1024.0;
    let real: Vec<(f64, f64)> =
        report.memory_timeline.iter().map(|&(t, b)| (t, b as f64 / gib)).collect();
    let simulated: Vec<(f64, f64)> = sim
        .timeline
        .as_ref()
        .map(|tl| tl.memory.iter().map(|&(t, b)| (t * 1e-6, b as f64 / gib)).collect())
        .unwrap_or_default();
    let starts = trace.kernel_starts_us();
    let resident = trace.resident_memory_per_kernel();
    let all: Vec<(f64, f64)> = resident
        .iter()
        .enumerate()
        .flat_map(|(k, &b)| {
            [(starts[k] * 1e-6, b as f64 / gib), (starts[k + 1] * 1e-6, b as f64 / gib)]
        })
        .collect();
    let t_end = real.last().map_or(0.0, |p| p.0).max(sim.iteration_time_us * 1e-6).max(1e-3);
    let y_max = all.iter().chain(&real).map(|p| p.1).fold(capacity as f64 / gib, f64::max) * 1.1;
    let root = SVGBackend::new(path, (1200, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{}: GPU memory over one iteration", trace.name), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..t_end, 0.0..y_max)
        .map_err(|e| err(&e))?;
    chart.configure_mesh().x_desc("time (s)").y_desc("GiB").draw().map_err(|e| err(&e))?;
    let step = |v: &[(f64, f64)]| -> Vec<(f64, f64)> {
        let mut out = Vec::with_capacity(v.len() * 2);
        for w in v.windows(2) {
            out.push(w[0]);
            out.push((w[1].0, w[0].1));
        }
        out.extend(v.last());
        out
    };
    chart
        .draw_series(LineSeries::new(all, RGBColor(150, 150, 150)))
        .map_err(|e| err(&e))?
        .label("every tensor resident (no plan)")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], RGBColor(150, 150, 150)));
    chart
        .draw_series(LineSeries::new(step(&simulated), BLUE))
        .map_err(|e| err(&e))?
        .label("with plan, simulated")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLUE));
    chart
        .draw_series(LineSeries::new(step(&real), RED))
        .map_err(|e| err(&e))?
        .label("with plan, replayed on the engine")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], RED));
    let cap = capacity as f64 / gib;
    chart
        .draw_series(LineSeries::new([(0.0, cap), (t_end, cap)], BLACK.stroke_width(2)))
        .map_err(|e| err(&e))?
        .label("emulated GPU capacity")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
