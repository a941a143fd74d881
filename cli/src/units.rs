//! Byte counts for people: binary units (KiB, MiB, ...) for storage sizes and rates.

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
    fn scales_and_names_units() {
        assert_eq!(binary_compact(512.0), "512B");
        assert_eq!(binary_compact(1536.0), "1.5KiB");
        assert_eq!(binary_compact(3.0 * 1024.0 * 1024.0 * 1024.0), "3.0GiB");
        assert_eq!(binary_spaced(1023), "1023 B");
        assert_eq!(binary_spaced(1 << 20), "1.0 MiB");
        assert_eq!(binary_spaced(u64::MAX), "16384.0 PiB");
    }
}
