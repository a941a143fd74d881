//! Notices: what the library has to say that is not the result of the call at hand (a fallback
//! it took, a cleanup that failed in a destructor), without printing.
//!
//! A library that writes to the caller's stderr interleaves with the caller's own output, cannot
//! be silenced or redirected, and is lost where there is no terminal. teraio never prints:
//! it hands each notice to the *sink* the program installed ([`set_sink`]: the CLI prints them,
//! `teraio: warning: ...`), or, with none, keeps it in a bounded queue that the bindings drain
//! ([`take`]: Python turns them into `teraio.TeraioWarning`s, C reads them with
//! `teraio_take_notice`). The queue keeps the latest [`QUEUE_LEN`] notices; older ones are
//! counted ([`take_dropped`]), so a caller that never drains pays a bounded amount of memory.
//!
//! The one exception is a fatal error that aborts the process (io_uring failing with requests
//! in flight): it says why on stderr first, since nothing else survives the abort.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

/// Notices kept for [`take`] when no sink is installed.
pub const QUEUE_LEN: usize = 256;

/// How much a notice matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// A choice the library made that the caller may want to know (a slower fallback taken).
    Info,
    /// Something went wrong and was worked around, or could not be reported by a call.
    Warning,
    /// Something failed where no call could return the error (a destructor).
    Error,
}

impl Level {
    /// "notice", "warning" or "error".
    pub fn name(self) -> &'static str {
        match self {
            Level::Info => "notice",
            Level::Warning => "warning",
            Level::Error => "error",
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One notice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    /// How much it matters.
    pub level: Level,
    /// What happened, in a sentence (no "teraio:" prefix, no trailing newline).
    pub message: String,
}

impl fmt::Display for Notice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "teraio: {}: {}", self.level, self.message)
    }
}

/// Where notices go when a program installed a sink.
pub type Sink = Arc<dyn Fn(&Notice) + Send + Sync>;

static QUEUE: Mutex<VecDeque<Notice>> = Mutex::new(VecDeque::new());
static DROPPED: AtomicU64 = AtomicU64::new(0);
static SINK: RwLock<Option<Sink>> = RwLock::new(None);

fn queue() -> MutexGuard<'static, VecDeque<Notice>> {
    // A panic while the lock was held left a queue of whole notices: keep using it.
    QUEUE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Say something: to the sink if one is installed, else into the queue (the oldest notice
/// dropped, and counted, when it is full).
pub fn emit(level: Level, message: impl Into<String>) {
    let notice = Notice { level, message: message.into() };
    let sink = SINK.read().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some(sink) = sink {
        sink(&notice);
        return;
    }
    let mut q = queue();
    if q.len() >= QUEUE_LEN {
        q.pop_front();
        DROPPED.fetch_add(1, Ordering::Relaxed);
    }
    q.push_back(notice);
}

/// [`emit`] at [`Level::Info`].
pub fn info(message: impl Into<String>) {
    emit(Level::Info, message)
}

/// [`emit`] at [`Level::Warning`].
pub fn warning(message: impl Into<String>) {
    emit(Level::Warning, message)
}

/// [`emit`] at [`Level::Error`].
pub fn error(message: impl Into<String>) {
    emit(Level::Error, message)
}

/// Send every later notice to `sink` (None: back to the queue). Notices already queued stay
/// there for [`take`].
pub fn set_sink(sink: Option<Sink>) {
    *SINK.write().unwrap_or_else(|p| p.into_inner()) = sink;
}

/// The oldest queued notice, if any.
pub fn take() -> Option<Notice> {
    queue().pop_front()
}

/// Every queued notice, oldest first.
pub fn take_all() -> Vec<Notice> {
    queue().drain(..).collect()
}

/// How many notices were dropped (the queue was full) since the last call.
pub fn take_dropped() -> u64 {
    DROPPED.swap(0, Ordering::Relaxed)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Tests that read the process-wide queue run one at a time (the engine's other tests may
    /// emit meanwhile: they filter by a marker of their own).
    pub(crate) static SERIAL: Mutex<()> = Mutex::new(());

    fn mine(marker: &str) -> Vec<Notice> {
        take_all().into_iter().filter(|n| n.message.contains(marker)).collect()
    }

    #[test]
    fn notices_queue_in_order_and_the_oldest_go_first_when_full() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        take_all();
        take_dropped();
        warning("q-order one");
        info("q-order two");
        let got = mine("q-order");
        assert_eq!(
            got,
            vec![
                Notice { level: Level::Warning, message: "q-order one".into() },
                Notice { level: Level::Info, message: "q-order two".into() },
            ]
        );
        assert_eq!(got[0].to_string(), "teraio: warning: q-order one");
        for i in 0..QUEUE_LEN + 10 {
            error(format!("q-full {i}"));
        }
        let kept = mine("q-full");
        assert!(kept.len() <= QUEUE_LEN, "{} kept", kept.len());
        assert_eq!(
            kept.last().map(|n| n.message.as_str()),
            Some(&*format!("q-full {}", QUEUE_LEN + 9))
        );
        assert!(take_dropped() >= 10);
        assert_eq!(take_dropped(), 0, "the count resets when read");
    }

    #[test]
    fn a_sink_gets_every_notice_and_the_queue_none() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        set_sink(Some(Arc::new(move |n: &Notice| s.lock().unwrap().push(n.clone()))));
        warning("sink-marker a");
        set_sink(None);
        warning("sink-marker b");
        let seen: Vec<_> = seen.lock().unwrap().iter().map(|n| n.message.clone()).collect();
        assert!(seen.contains(&"sink-marker a".to_string()), "{seen:?}");
        assert!(!seen.contains(&"sink-marker b".to_string()));
        let queued: Vec<_> = mine("sink-marker").into_iter().map(|n| n.message).collect();
        assert_eq!(queued, vec!["sink-marker b".to_string()]);
    }
}
