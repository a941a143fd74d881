//! `teraio run --sim --fault SPEC`: faults injected into the simulated array while the replay
//! runs (a slow device, EIO, out of space, short transfers, a corrupt copy on disk).

use std::sync::Arc;

use teraio_engine::backend::sim::{SimDisk, SimFault, SimOp};
use teraio_engine::store::{Location, TensorStore};
use teraio_scheduler::Trace;

use crate::{CliError, Result};

/// What a `--fault` does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FaultKind {
    /// The device becomes this many times slower.
    Slow(f64),
    /// Every read of the device fails with EIO.
    EioRead,
    /// Every write of the device fails with EIO.
    EioWrite,
    /// Every write of the device fails with ENOSPC.
    Enospc,
    /// Every transfer of the device moves half its bytes (the backend resumes the rest).
    Short,
    /// The SSD copy of one activation that is read again later is corrupted on disk.
    Corrupt,
}

/// One `--fault KIND[:DEV[:FACTOR]][@ITER[:KERNEL]]`.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultSpec {
    /// What happens.
    pub kind: FaultKind,
    /// The device (all but `corrupt`).
    pub device: Option<usize>,
    /// The replayed iteration it starts in (0-based).
    pub iteration: usize,
    /// The kernel of that iteration it starts before.
    pub kernel: usize,
    /// As given.
    pub text: String,
}

/// Parse a `--fault` value (a clap value parser).
pub fn parse_fault(s: &str) -> std::result::Result<FaultSpec, String> {
    let bad = |why: &str| {
        format!(
            "`{s}`: {why} (expected KIND[:DEV[:FACTOR]][@ITER[:KERNEL]], KIND one of slow, \
             eio-read, eio-write, enospc, short, corrupt; e.g. slow:1:10@1, eio-read:2@0:40, corrupt@0:60)"
        )
    };
    let (what, when) = match s.split_once('@') {
        Some((w, t)) => (w, Some(t)),
        None => (s, None),
    };
    let (iteration, kernel) = match when {
        None => (0, 0),
        Some(t) => {
            let mut parts = t.split(':');
            let it = parts.next().unwrap_or("").parse().map_err(|_| bad("ITER is not a number"))?;
            let k = match parts.next() {
                Some(k) => k.parse().map_err(|_| bad("KERNEL is not a number"))?,
                None => 0,
            };
            if parts.next().is_some() {
                return Err(bad("too many fields after @"));
            }
            (it, k)
        }
    };
    let fields: Vec<&str> = what.split(':').collect();
    let device = |i: usize| -> std::result::Result<usize, String> {
        fields
            .get(i)
            .ok_or_else(|| bad("DEV is missing"))?
            .parse()
            .map_err(|_| bad("DEV is not a number"))
    };
    let (kind, dev, n) = match fields[0] {
        "slow" => {
            let f: f64 = fields
                .get(2)
                .ok_or_else(|| bad("FACTOR is missing"))?
                .parse()
                .map_err(|_| bad("FACTOR is not a number"))?;
            if !(f > 1.0 && f.is_finite()) {
                return Err(bad("FACTOR must be above 1"));
            }
            (FaultKind::Slow(f), Some(device(1)?), 3)
        }
        "eio-read" => (FaultKind::EioRead, Some(device(1)?), 2),
        "eio-write" => (FaultKind::EioWrite, Some(device(1)?), 2),
        "enospc" => (FaultKind::Enospc, Some(device(1)?), 2),
        "short" => (FaultKind::Short, Some(device(1)?), 2),
        "corrupt" => (FaultKind::Corrupt, None, 1),
        other => return Err(bad(&format!("unknown kind `{other}`"))),
    };
    if fields.len() != n {
        return Err(bad("wrong number of fields"));
    }
    Ok(FaultSpec { kind, device: dev, iteration, kernel, text: s.to_string() })
}

/// Injects the `--fault`s into the simulated disks when the replay reaches them.
pub struct Injector {
    disks: Vec<Arc<SimDisk>>,
    bandwidth: u64,
    specs: Vec<(FaultSpec, bool)>,
}

impl Injector {
    /// Faults `specs` for `disks`, each moving `bandwidth` bytes/s (0: unlimited).
    pub fn new(disks: Vec<Arc<SimDisk>>, bandwidth: u64, specs: &[FaultSpec]) -> Result<Self> {
        for s in specs {
            if let Some(d) = s.device
                && d >= disks.len()
            {
                return Err(CliError::Usage(format!(
                    "--fault {}: device {d} does not exist (the array has {} devices, 0 to {})",
                    s.text,
                    disks.len(),
                    disks.len() - 1
                )));
            }
            if matches!(s.kind, FaultKind::Slow(_)) && bandwidth == 0 {
                return Err(CliError::Usage(format!(
                    "--fault {}: a slow device needs a device speed to slow down: give --sim-bandwidth",
                    s.text
                )));
            }
        }
        Ok(Self { disks, bandwidth, specs: specs.iter().cloned().map(|s| (s, false)).collect() })
    }

    /// The replay is before `kernel` of `iteration`: inject what starts there. Returns a line
    /// per fault injected.
    pub fn at(
        &mut self,
        iteration: usize,
        kernel: usize,
        store: &TensorStore,
        trace: &Trace,
    ) -> Vec<String> {
        let mut said = Vec::new();
        for (spec, done) in &mut self.specs {
            if *done || (iteration, kernel) < (spec.iteration, spec.kernel) {
                continue;
            }
            let disk = spec.device.map(|d| &self.disks[d]);
            let fault = match spec.kind {
                FaultKind::Slow(f) => Some(SimFault::Throughput {
                    bytes_per_s: (self.bandwidth as f64 / (f - 1.0)).max(1.0) as u64,
                }),
                FaultKind::EioRead => Some(SimFault::Eio { op: SimOp::Read, after_ops: 0 }),
                FaultKind::EioWrite => Some(SimFault::Eio { op: SimOp::Write, after_ops: 0 }),
                FaultKind::Enospc => Some(SimFault::Enospc { after_ops: 0 }),
                FaultKind::Short => Some(SimFault::ShortTransfer { op: SimOp::Any, after_ops: 0 }),
                FaultKind::Corrupt => None,
            };
            if let (Some(f), Some(d)) = (fault, disk) {
                d.inject(f);
                *done = true;
                said.push(format!(
                    "fault {}: injected before kernel {kernel} of iteration {iteration}",
                    spec.text
                ));
                continue;
            }
            // Corrupt: an activation created already, read again later, its copy on SSD only.
            if iteration > spec.iteration {
                *done = true;
                said.push(format!(
                    "fault {}: no activation had its only copy on the SSDs in iteration {}",
                    spec.text, spec.iteration
                ));
                continue;
            }
            let victim = trace.tensors.iter().enumerate().find(|(i, t)| {
                !t.global
                    && t.accesses.first().is_some_and(|&a| a < kernel)
                    && t.accesses.iter().any(|&a| a > kernel)
                    && store.info(*i as u64).is_some_and(|x| x.location == Location::OnSsd)
            });
            if let Some((i, t)) = victim
                && let Some(dev) = store.corrupt_ssd_copy(&self.disks, i as u64)
            {
                *done = true;
                said.push(format!(
                    "fault {}: corrupted the SSD copy of tensor t{i} ({}) on device {dev} before kernel {kernel} of iteration {iteration}",
                    spec.text, t.name
                ));
            }
        }
        said
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_specs_parse_and_bad_ones_say_why() {
        let s = parse_fault("slow:1:10@2").unwrap();
        assert_eq!(
            (s.kind, s.device, s.iteration, s.kernel),
            (FaultKind::Slow(10.0), Some(1), 2, 0)
        );
        let s = parse_fault("eio-read:3@0:40").unwrap();
        assert_eq!((s.kind, s.device, s.iteration, s.kernel), (FaultKind::EioRead, Some(3), 0, 40));
        assert_eq!(parse_fault("corrupt@1:7").unwrap().kind, FaultKind::Corrupt);
        assert_eq!(parse_fault("enospc:0").unwrap().iteration, 0);
        for bad in
            ["slow:1", "slow:1:0.5", "eio-read", "eio-read:x", "melt:1", "corrupt:2", "short:1@x"]
        {
            let e = parse_fault(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains("expected"), "{e}");
        }
    }

    #[test]
    fn an_injector_refuses_devices_that_do_not_exist() {
        let disks = vec![SimDisk::new(1 << 20, 4096, 1)];
        let spec = parse_fault("eio-write:3").unwrap();
        let e = Injector::new(disks.clone(), 0, &[spec]).err().unwrap();
        assert!(e.to_string().contains("device 3 does not exist"), "{e}");
        let slow = parse_fault("slow:0:10").unwrap();
        let e = Injector::new(disks, 0, &[slow]).err().unwrap();
        assert!(e.to_string().contains("--sim-bandwidth"), "{e}");
    }
}
