//! Parsing of sizes (`64KiB`, `1MiB`, `4096`) and durations (`2s`, `500ms`).

use std::time::Duration;

/// Parses a byte size: a number with an optional unit `B`, `KiB`/`K`/`KB`,
/// `MiB`/`M`/`MB`, `GiB`/`G`/`GB` (all binary multiples), case-insensitive.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("{s:?} is not a size (try 4096, 64KiB, 1MiB)"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        u => return Err(format!("unknown size unit {u:?} in {s:?} (use B, KiB, MiB or GiB)")),
    };
    let v = n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))?;
    if v == 0 {
        return Err(format!("{s:?}: a size must be non-zero"));
    }
    Ok(v)
}

/// Parses a comma-separated list of sizes.
#[cfg(test)]
pub fn parse_size_list(s: &str) -> Result<Vec<usize>, String> {
    s.split(',').filter(|p| !p.trim().is_empty()).map(parse_size).collect()
}

/// Parses a duration: a number with unit `ms`, `s` or `m` (seconds if none).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a duration (try 2s, 500ms)"))?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1e3,
        "us" | "µs" => n / 1e6,
        "m" | "min" => n * 60.0,
        u => return Err(format!("unknown duration unit {u:?} in {s:?} (use ms, s or m)")),
    };
    if !(0.0..=86_400.0).contains(&secs) {
        return Err(format!("{s:?}: a duration must lie between 0 and 24 h"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `65536` → `64KiB`.
pub fn fmt_size(n: usize) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{}{unit}", n >> shift);
        }
    }
    format!("{n}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("16m"), Ok(16 << 20));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(parse_size_list("4KiB,64KiB"), Ok(vec![4096, 65536]));
        assert_eq!(fmt_size(1 << 20), "1MiB");
        assert_eq!(fmt_size(1000), "1000B");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("3 weeks").is_err());
    }
}
