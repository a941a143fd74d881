//! Byte counts for people, the one place for them: parsing sizes given on the command line
//! (`4k`, `1M`, `1.5G`: powers of 1024, as fio and the engine configuration read them), binary
//! units (KiB, MiB, ...) for storage sizes and rates, decimal GB for training-scale figures.

/// Parse a size option: `4096`, `4k`, `1M`, `1.5G`, `1GiB` (see
/// [`teraio_engine::units::parse_bytes`]).
pub fn parse_size(s: &str) -> Result<u64, String> {
    teraio_engine::units::parse_bytes(s)
}

/// [`parse_size`] that also takes `0` (an option that can be switched off).
pub fn parse_size_or_zero(s: &str) -> Result<u64, String> {
    if s.trim() == "0" { Ok(0) } else { parse_size(s) }
}

/// Bytes as a number of decimal gigabytes (10^9 bytes), for tables that print the unit in
/// their header.
pub fn to_gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

/// Bytes as decimal gigabytes: `12.35 GB`.
pub fn gb(bytes: f64) -> String {
    format!("{:.2} GB", bytes / 1e9)
}

/// Bytes per second as decimal gigabytes per second: `3.10 GB/s`.
pub fn gbps(bytes_per_s: f64) -> String {
    format!("{:.2} GB/s", bytes_per_s / 1e9)
}

const BINARY: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

/// `bytes` scaled to the largest binary unit that keeps it at 1 or more, and that unit.
pub fn binary(bytes: f64) -> (f64, &'static str) {
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < BINARY.len() {
        v /= 1024.0;
        u += 1;
    }
    (v, BINARY[u])
}

/// `bytes` as `1.5GiB` (fio's style, no space; whole bytes without a decimal).
pub fn binary_compact(bytes: f64) -> String {
    match binary(bytes) {
        (v, "B") => format!("{v:.0}B"),
        (v, u) => format!("{v:.1}{u}"),
    }
}

/// `bytes` as `1.5 GiB` (`512 B` below a KiB).
pub fn binary_spaced(bytes: u64) -> String {
    match binary(bytes as f64) {
        (_, "B") => format!("{bytes} B"),
        (v, u) => format!("{v:.1} {u}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_fio() {
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29), "decimal sizes, as the configuration");
        assert_eq!(parse_size("0.5M"), Ok(512 << 10));
        assert!(parse_size("-1").unwrap_err().contains("negative"));
        assert!(parse_size("0").is_err());
        assert_eq!(parse_size_or_zero("0"), Ok(0));
        assert!(parse_size("x").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(gb(1.5e9), "1.50 GB");
        assert_eq!(gbps(2e9), "2.00 GB/s");
    }

    #[test]
    fn scales_and_names_units() {
        assert_eq!(binary_compact(512.0), "512B");
        assert_eq!(binary_compact(1536.0), "1.5KiB");
        assert_eq!(binary_compact(3.0 * 1024.0 * 1024.0 * 1024.0), "3.0GiB");
        assert_eq!(binary_spaced(1023), "1023 B");
        assert_eq!(binary_spaced(1 << 20), "1.0 MiB");
        assert_eq!(binary_spaced(u64::MAX), "16384.0 PiB");
    }
}
