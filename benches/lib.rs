//! Shared helpers of the criterion benches (see `benches/`).
