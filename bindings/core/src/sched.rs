//! The scheduler for the bindings: traces from files, specs or text; hardware models from a
//! preset or JSON plus overrides; plans, simulations and policy comparisons as JSON values.

use std::time::Instant;

use serde::Serialize;
use serde_json::{Value, json};
use teraio_scheduler::optimizer::{self, PlaceOptions};
use teraio_scheduler::{
    Hardware, ModelConfig, Plan, PlanStats, Policy, SimOptions, SimReport, TensorId, Trace,
};

use crate::{Error, Result};

/// A trace from a JSON file (docs/TRACE.md) or a generator spec `preset:NAME[,KEY=VALUE...]`
/// (as `teraio plan` reads them). Errors name the file.
pub fn load_trace(path_or_spec: &str) -> Result<Trace> {
    if let Some(spec) = path_or_spec.strip_prefix("preset:") {
        return Ok(teraio_scheduler::generate(&ModelConfig::from_spec(spec)?)?);
    }
    let text = read_trace_text(path_or_spec)?;
    trace_from_json(&text).map_err(|e| match e {
        Error::Scheduler(teraio_scheduler::Error::InvalidTrace { path, detail }) => {
            Error::Scheduler(teraio_scheduler::Error::InvalidTrace {
                path: format!("{path_or_spec}: {path}"),
                detail,
            })
        }
        Error::Scheduler(teraio_scheduler::Error::Json(j)) => {
            Error::Scheduler(teraio_scheduler::Error::InvalidTrace {
                path: path_or_spec.to_string(),
                detail: j.to_string(),
            })
        }
        e => e,
    })
}

/// A trace file's text, at most [`teraio_scheduler::trace_text_bytes_max`] bytes (never reading
/// more): a larger file is an error naming it and the limit.
fn read_trace_text(path: &str) -> Result<String> {
    use std::io::Read;
    let file_err = |source| Error::File { context: format!("reading the trace {path}"), source };
    let max = teraio_scheduler::trace_text_bytes_max()?;
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(max.saturating_add(1)).read_to_end(&mut bytes))
        .map_err(file_err)?;
    if bytes.len() as u64 > max {
        return Err(Error::InvalidArgument(format!(
            "the trace {path} holds more than {max} bytes, the limit on a trace's text (set {}=BYTES \
             to raise it)",
            teraio_scheduler::TRACE_TEXT_BYTES_MAX_ENV
        )));
    }
    String::from_utf8(bytes).map_err(|e| {
        Error::Scheduler(teraio_scheduler::Error::InvalidTrace {
            path: path.to_string(),
            detail: format!(
                "not UTF-8 JSON text (invalid at byte {})",
                e.utf8_error().valid_up_to()
            ),
        })
    })
}

/// A trace from its JSON text, validated.
pub fn trace_from_json(text: &str) -> Result<Trace> {
    let t = Trace::from_json(text)?;
    t.validate()?;
    Ok(t)
}

/// A synthetic trace: model preset `model` with `options` as `teraio trace gen` takes them
/// (`layers`, `micro-batch`, `dtype`, flags such as `activation-checkpointing` with no value;
/// `_` in a key reads as `-`).
pub fn generate_trace(model: &str, options: &[(String, Option<String>)]) -> Result<Trace> {
    let mut cfg = ModelConfig::preset(model)?;
    for (k, v) in options {
        cfg.set(&k.replace('_', "-"), v.as_deref())?;
    }
    Ok(teraio_scheduler::generate(&cfg)?)
}

/// What a trace is: name, kernels, tensors, ideal iteration time, peak memory if nothing moves.
pub fn trace_json(t: &Trace) -> Value {
    serde_json::json!({
        "name": t.name,
        "kernel_count": t.kernel_count(),
        "tensor_count": t.tensors.len(),
        "iteration_time_us": t.iteration_time_us(),
        "peak_resident_bytes": t.resident_memory_per_kernel().into_iter().max().unwrap_or(0),
    })
}

/// A hardware model: a preset name (`paper`, `dev`) or a JSON object of a `Hardware`, then
/// `overrides` (a JSON object of `Hardware` fields), validated.
pub fn hardware(preset_or_json: &str, overrides: Option<&Value>) -> Result<Hardware> {
    let text = preset_or_json.trim();
    let mut v = if text.starts_with('{') {
        serde_json::from_str::<Value>(text)
            .map_err(|e| Error::InvalidArgument(format!("hardware JSON: {e}")))?
    } else {
        let hw = Hardware::preset(if text.is_empty() { "paper" } else { text })?;
        serde_json::to_value(&hw).expect("a hardware model serializes")
    };
    if let Some(over) = overrides {
        let Value::Object(over) = over else {
            return Err(Error::InvalidArgument(format!(
                "hardware overrides must be an object of Hardware fields, not {over}"
            )));
        };
        let Value::Object(m) = &mut v else {
            return Err(Error::InvalidArgument(format!(
                "hardware must be a preset name or a JSON object, not {text}"
            )));
        };
        // Every field of the model, also the optional ones a given JSON object leaves out.
        let all =
            serde_json::to_value(Hardware::preset("paper")?).expect("a hardware model serializes");
        let mut known: Vec<&str> = m.keys().map(String::as_str).collect();
        if let Value::Object(all) = &all {
            known.extend(all.keys().map(String::as_str));
        }
        known.sort_unstable();
        known.dedup();
        let known: Vec<String> = known.into_iter().map(str::to_owned).collect();
        for (k, val) in over {
            if !known.contains(k) {
                return Err(Error::InvalidArgument(format!(
                    "unknown hardware field {k:?} (known: {})",
                    known.join(", ")
                )));
            }
            m.insert(k.clone(), val.clone());
        }
    }
    let hw: Hardware = serde_json::from_value(v)
        .map_err(|e| Error::InvalidArgument(format!("hardware model: {e}")))?;
    hw.validate()?;
    Ok(hw)
}

/// Parse a policy name (`teraio`, `teraio-hybrid`, `g10`, `zero-infinity`, ...).
pub fn policy(name: &str) -> Result<Policy> {
    Ok(name.parse::<Policy>()?)
}

/// Plan `trace` on `hw` with `policy`.
pub fn plan(trace: &Trace, hw: &Hardware, policy: Policy) -> Result<Plan> {
    Ok(teraio_scheduler::plan(trace, hw, policy)?)
}

/// [`plan`], checked as the CLI's `plan` checks it: a kernel whose working set exceeds the GPU
/// budget, a plan that runs out of GPU memory in the simulator, or one whose SSD or host
/// footprint exceeds the hardware's capacities is an error naming what is needed and what
/// there is.
pub fn plan_checked(trace: &Trace, hw: &Hardware, policy: Policy) -> Result<Plan> {
    let opts = teraio_scheduler::PlanOptions::default();
    Ok(teraio_scheduler::plan_checked(trace, hw, policy, &opts)?.plan)
}

/// What [`select`] and [`budgets`] read from a front end: the options of
/// `teraio_scheduler::choose` as JSON (every key optional except `gpu_budget_bytes`; unknown
/// keys are refused, naming them).
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectRequest {
    /// The planning policy (default `auto`).
    #[serde(default = "auto")]
    pub policy: String,
    /// The GPU budget, bytes (default: the hardware model's GPU memory).
    #[serde(default)]
    pub gpu_budget_bytes: Option<u64>,
    /// What the allocator needs beside the plan (default none):
    /// `{"kind": "fixed", "keep_fraction": 0.85}`, `{"kind": "measured", "bytes": N}`.
    #[serde(default)]
    pub allowance: Option<teraio_scheduler::Allowance>,
    /// Bytes others hold beside the plan (FSDP's unsharded parameters).
    #[serde(default)]
    pub reserved_bytes: u64,
    /// Plans are made for this fraction less than the executor's budget.
    #[serde(default)]
    pub plan_margin: f64,
    /// The second plan for slower transfers (0: none).
    #[serde(default)]
    pub traffic_margin: f64,
    /// The pager's schedule as a plan where the policy's does not run (default: with `auto`).
    #[serde(default)]
    pub paging_fallback: Option<bool>,
    /// The planner's options (default: the scheduler's).
    #[serde(default)]
    pub wear_tolerance: Option<f64>,
    /// Let plans recompute (default true).
    #[serde(default)]
    pub recompute: Option<bool>,
}

fn auto() -> String {
    "auto".into()
}

impl SelectRequest {
    /// From JSON text (`{}`: every default, with `hw`'s GPU memory as the budget).
    pub fn from_json(text: &str) -> Result<SelectRequest> {
        serde_json::from_str(text)
            .map_err(|e| Error::InvalidArgument(format!("plan selection options: {e}")))
    }

    fn budget(&self, hw: &Hardware) -> teraio_scheduler::Budget {
        teraio_scheduler::Budget {
            gpu_budget_bytes: self.gpu_budget_bytes.unwrap_or(hw.gpu_memory_bytes),
            allowance: self.allowance.unwrap_or(teraio_scheduler::Allowance::None),
            reserved_bytes: self.reserved_bytes,
            plan_margin: self.plan_margin,
        }
    }

    /// The scheduler's options, the budget from `hw`'s GPU memory where none is given.
    pub fn options(&self, hw: &Hardware) -> Result<teraio_scheduler::SelectOptions> {
        let policy = policy(&self.policy)?;
        let defaults = teraio_scheduler::PlanOptions::default();
        Ok(teraio_scheduler::SelectOptions {
            policy,
            plan: teraio_scheduler::PlanOptions {
                wear_tolerance: self.wear_tolerance.unwrap_or(defaults.wear_tolerance),
                recompute: self.recompute.unwrap_or(defaults.recompute),
            },
            budget: self.budget(hw),
            traffic_margin: self.traffic_margin,
            paging_fallback: self.paging_fallback.unwrap_or(policy == Policy::Auto),
        })
    }
}

/// Plan selection (`teraio_scheduler::choose`): the plan, and the rest of the selection as
/// JSON (`choice`, `why`, `budgets`, `alternatives`, `traffic` when a second plan was made or
/// tried, and the plan's simulation: `iteration_time_us`, `peak_gpu_bytes`).
pub fn select(trace: &Trace, hw: &Hardware, request: &SelectRequest) -> Result<(Plan, Value)> {
    let opts = request.options(hw)?;
    let sel = teraio_scheduler::choose(trace, hw, &opts)?;
    let mut v = serde_json::json!({
        "policy": sel.plan.policy,
        "choice": sel.choice,
        "why": sel.why,
        "budgets": sel.budgets,
        "alternatives": sel.alternatives,
        "iteration_time_us": sel.report.iteration_time_us,
        "peak_gpu_bytes": sel.report.peak_gpu_bytes,
    });
    if let Some(t) = &sel.traffic {
        v["traffic"] = serde_json::to_value(t).expect("the figures serialize");
    }
    Ok((sel.plan, v))
}

/// The layers to checkpoint so that the selected plan of the rest simulates fastest
/// (`teraio_scheduler::checkpoint::choose_layers`, with the options `select` takes), as JSON:
/// `layers`, `iteration_time_us`, `without_us`, `tried` and `why`.
pub fn choose_checkpoint(trace: &Trace, hw: &Hardware, request: &SelectRequest) -> Result<Value> {
    let opts = request.options(hw)?;
    let c = teraio_scheduler::checkpoint::choose_layers(trace, hw, &opts)?;
    Ok(serde_json::to_value(c).expect("the choice serializes"))
}

/// The budgets of a selection without planning: `(executor bytes, planning bytes)` for a trace
/// whose largest tensor is `largest_tensor_bytes` (`teraio_scheduler::Budget`).
pub fn budgets(request: &SelectRequest, largest_tensor_bytes: u64) -> Result<(u64, u64)> {
    let gpu = request.gpu_budget_bytes.ok_or_else(|| {
        Error::InvalidArgument("plan selection options: gpu_budget_bytes is required here".into())
    })?;
    let b = teraio_scheduler::Budget {
        gpu_budget_bytes: gpu,
        allowance: request.allowance.unwrap_or(teraio_scheduler::Allowance::None),
        reserved_bytes: request.reserved_bytes,
        plan_margin: request.plan_margin,
    };
    let executor = b.executor_bytes(largest_tensor_bytes);
    Ok((executor, b.planning_bytes(executor)))
}

/// The budgets of a selection for `trace` (`teraio_scheduler::Budget::resolve`) as JSON:
/// `executor_bytes`, `planning_bytes`, `allowance_bytes`, the largest working set and whether
/// the budgets were raised for it (`Budget::resolve` says how); a kernel that can never fit is
/// not an error here but `{"never_fits": {"kernel", "name", "needed_bytes", "capacity_bytes",
/// "message"}}`, so a front end can raise its own error naming its own arguments.
pub fn resolve_budgets(trace: &Trace, request: &SelectRequest) -> Result<Value> {
    let gpu = request.gpu_budget_bytes.ok_or_else(|| {
        Error::InvalidArgument("plan selection options: gpu_budget_bytes is required here".into())
    })?;
    let b = teraio_scheduler::Budget {
        gpu_budget_bytes: gpu,
        allowance: request.allowance.unwrap_or(teraio_scheduler::Allowance::None),
        reserved_bytes: request.reserved_bytes,
        plan_margin: request.plan_margin,
    };
    match b.resolve(trace) {
        Ok(budgets) => Ok(serde_json::to_value(budgets).expect("budgets serialize")),
        Err(teraio_scheduler::Error::GpuMemoryTooSmall {
            kernel,
            name,
            needed_bytes,
            capacity_bytes,
        }) => {
            let message = teraio_scheduler::Error::GpuMemoryTooSmall {
                kernel,
                name: name.clone(),
                needed_bytes,
                capacity_bytes,
            }
            .to_string();
            Ok(serde_json::json!({"never_fits": {
                "kernel": kernel, "name": name, "needed_bytes": needed_bytes,
                "capacity_bytes": capacity_bytes, "message": message,
            }}))
        }
        Err(e) => Err(e.into()),
    }
}

/// A plan from its JSON text, checked against `trace`.
pub fn plan_from_json(trace: &Trace, text: &str) -> Result<Plan> {
    let p = Plan::from_json(text).map_err(|e| match e {
        teraio_scheduler::Error::Json(j) => {
            Error::Scheduler(teraio_scheduler::Error::InvalidPlan {
                path: "plan".into(),
                detail: j.to_string(),
            })
        }
        e => e.into(),
    })?;
    p.validate(trace)?;
    Ok(p)
}

/// Simulate `plan` of `trace` on `hw` for `iterations` (the last one is reported).
pub fn simulate(
    trace: &Trace,
    plan: &Plan,
    hw: &Hardware,
    iterations: usize,
    timeline: bool,
) -> Result<SimReport> {
    let opts = SimOptions { iterations, record_timeline: timeline };
    Ok(teraio_scheduler::simulate(trace, plan, hw, &opts)?)
}

/// One policy of a comparison.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyResult {
    /// The policy.
    pub policy: String,
    /// Wall time of planning, seconds.
    pub plan_time_s: f64,
    /// The planner's figures.
    pub plan_stats: PlanStats,
    /// The simulation of its plan.
    pub report: SimReport,
}

/// Plan and simulate `trace` on `hw` with each policy (every policy when empty).
///
/// Each policy at most once (a list that names one twice is an error): the caller's list sets
/// how many plans are made, so it is bounded by the number of policies.
pub fn compare(trace: &Trace, hw: &Hardware, policies: &[Policy]) -> Result<Vec<PolicyResult>> {
    for (i, p) in policies.iter().enumerate() {
        if policies[..i].contains(p) {
            return Err(Error::InvalidArgument(format!(
                "policies: {p} is named twice ({} names; each of the {} policies at most once)",
                policies.len(),
                Policy::ALL.len()
            )));
        }
    }
    let all = if policies.is_empty() { &Policy::ALL[..] } else { policies };
    all.iter()
        .map(|&p| {
            let start = Instant::now();
            let pl = plan(trace, hw, p)?;
            let plan_time_s = start.elapsed().as_secs_f64();
            let report = simulate(trace, &pl, hw, SimOptions::default().iterations, false)?;
            Ok(PolicyResult { policy: p.to_string(), plan_time_s, plan_stats: pl.stats, report })
        })
        .collect()
}

/// Where each optimizer update of `trace` runs (`teraio_scheduler::optimizer::place`), as
/// JSON: `summary` (one line), `host_weights` (names of the weights updated on the host, as
/// the trace names them) and `host_weight_ids`, parameter counts, the simulated iteration of
/// the choice, of all-GPU and all-host (`null` where no plan runs), the ideal and the lower
/// bound (microseconds), every candidate simulated, and per update its weights' names, whether
/// it is on the host, and why not where it cannot be. `candidates`: grid points (at least 2).
/// `in_backward`: the trainer runs a host update as soon as its gradients arrived (else at its
/// optimizer step; `PlaceOptions::in_backward`).
pub fn place_optimizer(
    trace: &Trace,
    hw: &Hardware,
    policy: Policy,
    candidates: usize,
    in_backward: bool,
) -> Result<Value> {
    let opts = PlaceOptions { policy, candidates, in_backward, ..PlaceOptions::default() };
    let p = optimizer::place(trace, hw, &opts)?;
    let name = |t: &TensorId| trace.tensor(*t).name.clone();
    let updates: Vec<Value> = p
        .updates
        .iter()
        .zip(&p.on_host)
        .map(|(u, &h)| {
            json!({
                "weights": u.weights.iter().map(name).collect::<Vec<_>>(),
                "params": u.params,
                "on_host": h,
                "eligible": u.eligible,
                "reason": u.reason,
                "cpu_us": u.cpu_us,
                "gpu_us": u.gpu_us,
            })
        })
        .collect();
    Ok(json!({
        "summary": p.summary(),
        "host_weights": p.host_weights.iter().map(name).collect::<Vec<_>>(),
        "host_weight_ids": p.host_weights.iter().map(|t| t.0).collect::<Vec<_>>(),
        "host_params": p.host_params,
        "total_params": p.total_params,
        "host_state_bytes": p.host_state_bytes,
        "iteration_us": p.iteration_us,
        "all_gpu_us": p.all_gpu_us,
        "all_host_us": p.all_host_us,
        "ideal_us": p.ideal_us,
        "bound_us": p.bound_us,
        "policy": p.plan.policy,
        "candidates": p.candidates,
        "updates": updates,
    }))
}

/// Policy names.
pub fn policy_names() -> Vec<&'static str> {
    Policy::ALL.iter().map(|p| p.as_str()).collect()
}

/// Model preset names.
pub fn model_presets() -> Vec<&'static str> {
    ModelConfig::PRESETS.to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;

    fn small() -> Trace {
        generate_trace(
            "gpt2-small",
            &[("layers".into(), Some("2".into())), ("micro_batch".into(), Some("2".into()))],
        )
        .unwrap()
    }

    #[test]
    fn a_generated_trace_plans_and_simulates_under_a_squeezed_gpu() {
        let t = small();
        let peak = trace_json(&t)["peak_resident_bytes"].as_u64().unwrap();
        let hw = hardware("paper", Some(&serde_json::json!({"gpu_memory_bytes": peak * 3 / 4})))
            .unwrap();
        let p = plan(&t, &hw, policy("teraio").unwrap()).unwrap();
        let text = p.to_json();
        let back = plan_from_json(&t, &text).unwrap();
        let r = simulate(&t, &back, &hw, 2, false).unwrap();
        assert!(r.peak_gpu_bytes <= hw.gpu_memory_bytes);
        let all = compare(&t, &hw, &[Policy::Teraio, Policy::None]).unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].report.percent_of_ideal, r.percent_of_ideal);
    }

    #[test]
    fn the_optimizers_placement_names_its_host_weights() {
        let t = small();
        let peak = trace_json(&t)["peak_resident_bytes"].as_u64().unwrap();
        let hw = hardware(
            "paper",
            Some(&serde_json::json!({"gpu_memory_bytes": peak * 3 / 4, "cpu_adam_params_per_s": 1e13})),
        )
        .unwrap();
        let v = place_optimizer(&t, &hw, Policy::Teraio, 3, false).unwrap();
        let names = v["host_weights"].as_array().unwrap();
        let ids = v["host_weight_ids"].as_array().unwrap();
        assert_eq!(names.len(), ids.len());
        assert!(!names.is_empty(), "{v}");
        for (n, id) in names.iter().zip(ids) {
            let id = id.as_u64().unwrap() as usize;
            assert_eq!(n.as_str().unwrap(), t.tensors[id].name);
        }
        assert!(v["summary"].as_str().unwrap().starts_with("optimizer: "), "{v}");
        let e = place_optimizer(&t, &hw, Policy::Teraio, 0, false).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.to_string().contains("candidates 0"), "{e}");
    }

    #[test]
    fn a_comparison_names_each_policy_once_and_a_long_list_is_refused_at_once() {
        let t = small();
        let hw = hardware("paper", None).unwrap();
        let many = vec![Policy::Teraio; 100_000];
        let start = std::time::Instant::now();
        let e = compare(&t, &hw, &many).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.to_string().contains("teraio is named twice"), "{e}");
        assert!(start.elapsed() < std::time::Duration::from_secs(2));
    }

    #[test]
    fn a_trace_file_over_the_text_limit_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.json");
        std::fs::write(&path, vec![b' '; 2 << 20]).unwrap();
        // The limit comes from the environment; a child process sets it (tests share theirs).
        if std::env::var_os("TERAIO_SCHED_CHILD").is_some() {
            let e = load_trace(path.to_str().unwrap()).unwrap_err().to_string();
            assert!(e.contains("big.json") && e.contains("1048576"), "{e}");
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sched::tests::a_trace_file_over_the_text_limit_is_refused_naming_it",
            ])
            .env("TERAIO_SCHED_CHILD", "1")
            .env("TERAIO_TRACE_BYTES_MAX", "1048576")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && stdout.contains("1 passed"), "{stdout}");
    }

    #[test]
    fn selection_reads_its_options_and_names_unknown_ones() {
        let t = small();
        let peak = trace_json(&t)["peak_resident_bytes"].as_u64().unwrap();
        let hw = hardware("paper", None).unwrap();
        let req = SelectRequest::from_json(&format!(
            "{{\"gpu_budget_bytes\": {}, \"traffic_margin\": 0.03}}",
            peak * 3 / 4
        ))
        .unwrap();
        let (p, v) = select(&t, &hw, &req).unwrap();
        assert!(p.policy.starts_with("auto["), "{}", p.policy);
        assert_eq!(v["budgets"]["executor_bytes"].as_u64().unwrap(), peak * 3 / 4);
        assert!(v["traffic"]["chosen"].is_string(), "{v}");
        assert!(v["why"].as_str().unwrap().contains("auto"), "{v}");
        let e = SelectRequest::from_json("{\"gpu_budget\": 1}").unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.to_string().contains("gpu_budget"), "{e}");
        let fixed = SelectRequest::from_json(
            "{\"gpu_budget_bytes\": 1000000, \"allowance\": {\"kind\": \"fixed\", \"keep_fraction\": 0.85}}",
        )
        .unwrap();
        assert_eq!(budgets(&fixed, 200_000).unwrap(), (600_000, 600_000));
    }

    #[test]
    fn bad_traces_hardware_and_policies_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        std::fs::write(&path, "{\"name\": \"x\", \"kernels\": [").unwrap();
        let e = load_trace(path.to_str().unwrap()).unwrap_err();
        assert_eq!(e.status(), Status::Trace);
        assert!(e.to_string().contains("t.json"), "{e}");
        let e = load_trace("/nonexistent/trace.json").unwrap_err();
        assert_eq!(e.status(), Status::Io);
        let e = hardware("paper", Some(&serde_json::json!({"gpu_mem": 1}))).unwrap_err();
        assert!(e.to_string().contains("gpu_mem"), "{e}");
        // A JSON model that leaves an optional field out still takes it as an override (the
        // PyTorch session gives the array's capacity to a model loaded from a file).
        let mut given = serde_json::to_value(Hardware::preset("dev").unwrap()).unwrap();
        given.as_object_mut().unwrap().remove("ssd_capacity_bytes");
        let hw =
            hardware(&given.to_string(), Some(&serde_json::json!({"ssd_capacity_bytes": 1 << 30})))
                .unwrap();
        assert_eq!(hw.ssd_capacity_bytes, Some(1 << 30));
        assert!(hardware("moon", None).is_err());
        assert!(policy("magic").unwrap_err().to_string().contains("teraio-hybrid"));
        let e = plan_from_json(&small(), "{\"policy\": 1}").unwrap_err();
        assert_eq!(e.status(), Status::Plan);
        let e = generate_trace("gpt2-small", &[("wings".into(), Some("2".into()))]).unwrap_err();
        assert!(e.to_string().contains("wings"), "{e}");
        assert!(load_trace("preset:gpt2-small,layers=1").is_ok());
    }
}
