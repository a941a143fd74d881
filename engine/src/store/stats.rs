//! The statistics of a tensor store's migration engine: what its workers count as they move
//! tensors (traffic per direction, queue waits, checksums verified, cancellations), and the
//! difference of two snapshots (an iteration's share).

use std::time::{Duration, Instant};

use serde::Serialize;

/// Traffic in one direction.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DirectionStats {
    /// Completed operations.
    pub ops: u64,
    /// Bytes moved by completed operations.
    pub bytes: u64,
    /// Failed operations.
    pub errors: u64,
    /// Sum of operation durations (operations overlap, so this exceeds wall time).
    pub op_time_ns: u64,
    /// Wall time during which at least one operation of this direction was running.
    pub busy_ns: u64,
    #[serde(skip)]
    running: u32,
    #[serde(skip)]
    busy_since: Option<Instant>,
}

impl DirectionStats {
    /// Achieved bandwidth: bytes over the time this direction was busy.
    pub fn bandwidth_bytes_per_s(&self) -> f64 {
        if self.busy_ns == 0 { 0.0 } else { self.bytes as f64 * 1e9 / self.busy_ns as f64 }
    }

    pub(crate) fn start(&mut self, now: Instant) {
        if self.running == 0 {
            self.busy_since = Some(now);
        }
        self.running += 1;
    }

    pub(crate) fn finish(&mut self, now: Instant, took: Duration, bytes: u64, ok: bool) {
        self.running -= 1;
        if self.running == 0
            && let Some(s) = self.busy_since.take()
        {
            self.busy_ns += now.duration_since(s).as_nanos() as u64;
        }
        self.op_time_ns += took.as_nanos() as u64;
        if ok {
            self.ops += 1;
            self.bytes += bytes;
        } else {
            self.errors += 1;
        }
    }
}

/// Time operations of one priority spent queued before a worker started them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct QueueWaitStats {
    /// Operations started.
    pub ops: u64,
    /// Sum of waits.
    pub total_ns: u64,
    /// Longest wait.
    pub max_ns: u64,
}

impl QueueWaitStats {
    pub(crate) fn record(&mut self, wait: Duration) {
        let ns = wait.as_nanos() as u64;
        self.ops += 1;
        self.total_ns += ns;
        self.max_ns = self.max_ns.max(ns);
    }

    /// Mean wait in nanoseconds.
    pub fn mean_ns(&self) -> u64 {
        self.total_ns.checked_div(self.ops).unwrap_or(0)
    }
}

/// Statistics of a tensor store's migration engine.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StoreStats {
    /// Offloads to the SSD array (GPU/host -> SSD writes).
    pub ssd_write: DirectionStats,
    /// Prefetches from the SSD array.
    pub ssd_read: DirectionStats,
    /// Offloads to the host tier.
    pub host_write: DirectionStats,
    /// Prefetches from the host tier.
    pub host_read: DirectionStats,
    /// Queue wait of urgent, normal and background operations.
    pub queue_wait: [QueueWaitStats; 3],
    /// Checksummed chunks verified on prefetch.
    pub chunks_verified: u64,
    /// Offloads cancelled by a later prefetch of the same tensor.
    pub offloads_cancelled: u64,
    /// Host-tier offloads that went to SSD because the host tier was full.
    pub host_fallbacks: u64,
    /// Of the host-tier offloads, those from device memory queued on the device (their
    /// `host_write` time is the time to queue the copy, not the copy's).
    pub host_writes_queued: u64,
}

/// The difference of two snapshots of store statistics.
pub fn diff_stats(before: &StoreStats, after: &StoreStats) -> StoreStats {
    let d = |a: &DirectionStats, b: &DirectionStats| {
        let mut x = b.clone();
        x.ops -= a.ops;
        x.bytes -= a.bytes;
        x.errors -= a.errors;
        x.op_time_ns -= a.op_time_ns;
        x.busy_ns -= a.busy_ns;
        x
    };
    let mut s = after.clone();
    s.ssd_write = d(&before.ssd_write, &after.ssd_write);
    s.ssd_read = d(&before.ssd_read, &after.ssd_read);
    s.host_write = d(&before.host_write, &after.host_write);
    s.host_read = d(&before.host_read, &after.host_read);
    s.chunks_verified -= before.chunks_verified;
    s.offloads_cancelled -= before.offloads_cancelled;
    s.host_fallbacks -= before.host_fallbacks;
    s.host_writes_queued -= before.host_writes_queued;
    s
}
