//! What teraio's two foreign front ends share: the C ABI (`bindings/c`, crate `teraio-capi`)
//! and the Python package (`bindings/python`). Nothing here crosses a language boundary; this
//! crate is safe Rust that both bindings call, so their behaviour is written and tested once:
//!
//! - [`Status`]: the stable integer codes of `teraio_status` (C) and `TeraioError.status`
//!   (Python), and which code every engine or scheduler error gets.
//! - [`open_engine`]: an [`Engine`](teraio_engine::Engine) from a configuration text or file
//!   plus overrides. Front ends never assemble arrays or stores themselves.
//! - [`HostBuffer`]: engine host memory with a stable address that a foreign caller may hold
//!   pointers into (numpy arrays, C pointers) while the store moves it without a copy.
//! - [`Op`]: a pending offload, prefetch or free, whatever memory it moves.
//! - [`optim`]: the host optimizer steps over caller memory, its checks shared.
//! - [`sched`]: traces, hardware models, plans, simulations, policy comparisons, as JSON.
//! - [`measure_hardware`]: this machine's hardware model, measured through an engine and
//!   cached per machine and array.
#![forbid(unsafe_code)]

mod buffer;
mod catch;
mod error;
mod op;
pub mod optim;
pub mod sched;

use std::path::Path;

use serde_json::Value;
use teraio_engine::queue::Priority;
use teraio_engine::store::{Destination, Location, TensorInfo};
use teraio_engine::{Engine, EngineConfig};

pub use buffer::HostBuffer;
pub use catch::catch;
pub use error::{Error, Result, Status};
pub use op::{Op, OpKind, Outcome};

/// Where an engine's configuration comes from.
#[derive(Debug, Clone, Copy)]
pub enum ConfigSource<'a> {
    /// Every default ([`EngineConfig::default`]); overrides say the rest.
    Default,
    /// TOML text.
    Toml(&'a str),
    /// JSON text.
    Json(&'a str),
    /// A file: JSON when its name ends in `.json`, TOML otherwise; relative paths in it are
    /// relative to its folder.
    File(&'a Path),
}

/// Read a configuration and apply `overrides` (a JSON object whose keys are those of the
/// configuration file; `None` or an empty object: none).
pub fn engine_config(source: ConfigSource<'_>, overrides: Option<&Value>) -> Result<EngineConfig> {
    let cfg = match source {
        ConfigSource::Default => EngineConfig::default(),
        ConfigSource::Toml(t) => EngineConfig::from_toml_str(t)?,
        ConfigSource::Json(t) => EngineConfig::from_json_str(t)?,
        ConfigSource::File(p) => EngineConfig::from_file(p)?,
    };
    let Some(over) = overrides else { return Ok(cfg) };
    let Value::Object(over) = over else {
        return Err(Error::InvalidArgument(format!(
            "engine options must be an object of configuration keys, not {over}"
        )));
    };
    if over.is_empty() {
        return Ok(cfg);
    }
    let mut merged = serde_json::to_value(&cfg)
        .map_err(|e| Error::InvalidArgument(format!("engine configuration: {e}")))?;
    let Value::Object(m) = &mut merged else {
        unreachable!("an engine configuration serializes to an object")
    };
    for (k, v) in over {
        m.insert(k.clone(), v.clone());
    }
    Ok(EngineConfig::from_json_str(&merged.to_string())?)
}

/// Open an engine (see [`engine_config`]).
pub fn open_engine(source: ConfigSource<'_>, overrides: Option<&Value>) -> Result<Engine> {
    Ok(Engine::open(engine_config(source, overrides)?)?)
}

/// Parse a priority name: `urgent`, `normal`, `background`.
pub fn parse_priority(name: &str) -> Result<Priority> {
    match name {
        "urgent" => Ok(Priority::Urgent),
        "normal" => Ok(Priority::Normal),
        "background" => Ok(Priority::Background),
        _ => Err(Error::InvalidArgument(format!(
            "unknown priority {name:?} (known: urgent, normal, background)"
        ))),
    }
}

/// Parse a destination name: `ssd`, `host`.
pub fn parse_destination(name: &str) -> Result<Destination> {
    match name {
        "ssd" => Ok(Destination::Ssd),
        "host" => Ok(Destination::Host),
        _ => {
            Err(Error::InvalidArgument(format!("unknown destination {name:?} (known: ssd, host)")))
        }
    }
}

/// A location as the bindings name it.
pub fn location_name(l: Location) -> &'static str {
    match l {
        Location::Caller => "caller",
        Location::Offloading => "offloading",
        Location::Prefetching => "prefetching",
        Location::OnSsd => "on_ssd",
        Location::InHost => "in_host",
        Location::Held => "held",
    }
}

/// One tensor as the bindings report it (no stripe map).
pub fn tensor_json(t: &TensorInfo) -> Value {
    serde_json::json!({
        "id": t.id,
        "name": t.name,
        "size_bytes": t.size_bytes,
        "location": location_name(t.location),
        "host_copy": t.host_copy,
        "pending_ops": t.pending_ops,
        "checksummed_chunks": t.checksummed_chunks,
    })
}

/// Every tensor of the engine, sorted by id, as a JSON array of [`tensor_json`] objects.
pub fn tensors_json(engine: &Engine) -> Value {
    Value::Array(engine.store().tensors().iter().map(tensor_json).collect())
}

/// What an engine is: description, capacity, persistence and its configuration.
pub fn engine_json(engine: &Engine) -> Value {
    serde_json::json!({
        "describe": engine.describe(),
        "capacity_bytes": engine.capacity_bytes(),
        "persistent": engine.config().persistent,
        "devices": engine.array().device_count(),
        "config": serde_json::to_value(engine.config()).unwrap_or(Value::Null),
    })
}

/// The engine's migration statistics as JSON.
pub fn stats_json(engine: &Engine) -> Value {
    serde_json::to_value(engine.store().stats()).unwrap_or(Value::Null)
}

/// This machine's hardware model, measured through `engine` ([`teraio_engine::probe`]), as
/// JSON: `{"hardware", "report", "source" ("measured" or "cache"), "cache_path", "key",
/// "measured_unix_s", "summary"}`. `cache`: read this machine and array's cached model when
/// there is one and keep a new measurement (false: neither); `fresh`: measure even when one is
/// cached (and replace it); `probe_bytes`: bytes through the array each way (None: the
/// default, 256 MiB; 0: the array is not measured).
pub fn measure_hardware(
    engine: &Engine,
    cache: bool,
    fresh: bool,
    probe_bytes: Option<u64>,
) -> Value {
    use teraio_engine::probe::{CacheMode, ProbeOptions, measure_cached};
    let mut options = ProbeOptions::default();
    if let Some(b) = probe_bytes {
        options.array_bytes = b;
    }
    let mode = match (cache, fresh) {
        (false, _) => CacheMode::Off,
        (true, true) => CacheMode::Refresh,
        (true, false) => CacheMode::Use,
    };
    measure_cached(engine, &options, mode).to_json()
}

/// The version of teraio these bindings were built from.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_replace_keys_of_the_file_and_unknown_ones_are_named() {
        let over = serde_json::json!({"files": 3, "persistent": true, "file_size": "8M"});
        let cfg =
            engine_config(ConfigSource::Toml("dir = \"/x\"\nfiles = 2\n"), Some(&over)).unwrap();
        assert_eq!(cfg.files, 3);
        assert!(cfg.persistent);
        assert_eq!(cfg.file_size_bytes.0, 8 << 20);
        assert_eq!(cfg.dir, std::path::PathBuf::from("/x"));
        let bad = serde_json::json!({"fies": 3});
        let e = engine_config(ConfigSource::Default, Some(&bad)).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.to_string().contains("fies"), "{e}");
        let e = engine_config(ConfigSource::Default, Some(&serde_json::json!([1]))).unwrap_err();
        assert!(e.to_string().contains("object"), "{e}");
    }

    #[test]
    fn names_parse_and_unknown_names_are_listed() {
        assert_eq!(parse_priority("urgent").unwrap(), Priority::Urgent);
        assert_eq!(parse_destination("host").unwrap(), Destination::Host);
        let e = parse_priority("asap").unwrap_err().to_string();
        assert!(e.contains("asap") && e.contains("background"), "{e}");
        assert!(parse_destination("gpu").is_err());
    }
}
