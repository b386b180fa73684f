//! Parsing of human-written byte sizes (`512KiB`, `1M`) and durations (`30s`, `2m`).
//!
//! Conventions (also in the README): `KiB`/`MiB`/`GiB` are powers
//! of 1024; the short forms `K`/`M`/`G` are ALSO powers of 1024, as in `ulimit`, `dd`
//! and most profilers' rate flags; `KB`/`MB`/`GB` are powers of 1000 (SI).

use std::time::Duration;

/// Why a size or duration was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    /// Empty input.
    #[error("empty value")]
    Empty,
    /// The numeric part is missing or not a number.
    #[error("`{0}` is not a number followed by an optional unit")]
    NotANumber(String),
    /// The unit is not one we know.
    #[error("unknown unit `{unit}` (use {expected})")]
    UnknownUnit {
        /// The unit as written.
        unit: String,
        /// The units that are accepted.
        expected: &'static str,
    },
    /// Zero or negative.
    #[error("must be greater than zero")]
    NotPositive,
    /// Larger than the caller's bound.
    #[error("{value} is larger than the maximum of {max}")]
    TooLarge {
        /// The value as written.
        value: String,
        /// The maximum, as text.
        max: String,
    },
}

const SIZE_UNITS: &str = "B, K/KiB, M/MiB, G/GiB (1024-based) or KB, MB, GB (1000-based)";
const DURATION_UNITS: &str = "ms, s, m, h";

/// Splits `"512KiB"` into `("512", "KiB")`, rejecting signs and empty numbers.
fn split_number(text: &str) -> Result<(f64, &str), ParseError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(ParseError::Empty);
    }
    if text.starts_with('-') {
        return Err(ParseError::NotPositive);
    }
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| ParseError::NotANumber(text.to_string()))?;
    if !value.is_finite() {
        return Err(ParseError::NotANumber(text.to_string()));
    }
    Ok((value, unit.trim()))
}

/// Largest accepted sampling rate (1 GiB): beyond it almost nothing is ever sampled.
pub const MAX_RATE: u64 = 1 << 30;
/// Longest accepted duration (30 days).
pub const MAX_DURATION: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

/// Parses a byte size such as `4096`, `512KiB`, `1MiB`, `1M` or `2MB`.
///
/// Returns a size of at least one byte and at most `max` bytes.
pub fn parse_size(text: &str, max: u64) -> Result<u64, ParseError> {
    let (value, unit) = split_number(text)?;
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => {
            return Err(ParseError::UnknownUnit {
                unit: unit.to_string(),
                expected: SIZE_UNITS,
            })
        }
    };
    let bytes = value * multiplier as f64;
    if bytes < 1.0 {
        return Err(ParseError::NotPositive);
    }
    if bytes > max as f64 {
        return Err(ParseError::TooLarge {
            value: text.trim().to_string(),
            max: format!("{max} bytes"),
        });
    }
    Ok(bytes.round() as u64)
}

/// Parses a duration such as `500ms`, `30s`, `2m` or `1h`; a bare number is seconds.
///
/// Returns a duration of at least one millisecond and at most `max`.
pub fn parse_duration(text: &str, max: Duration) -> Result<Duration, ParseError> {
    let (value, unit) = split_number(text)?;
    let seconds = match unit.to_ascii_lowercase().as_str() {
        "ms" => value / 1000.0,
        "" | "s" | "sec" => value,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        _ => {
            return Err(ParseError::UnknownUnit {
                unit: unit.to_string(),
                expected: DURATION_UNITS,
            })
        }
    };
    if seconds < 0.001 {
        return Err(ParseError::NotPositive);
    }
    if seconds > max.as_secs_f64() {
        return Err(ParseError::TooLarge {
            value: text.trim().to_string(),
            max: format!("{}s", max.as_secs()),
        });
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// Formats a byte count for people: `1.5 MiB`.
pub fn format_bytes(bytes: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value.abs() >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value:.0} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: u64 = 1 << 40;

    #[test]
    fn sizes_in_every_documented_form() {
        assert_eq!(parse_size("4096", MAX), Ok(4096));
        assert_eq!(parse_size("512KiB", MAX), Ok(512 * 1024));
        assert_eq!(parse_size("1MiB", MAX), Ok(1 << 20));
        assert_eq!(parse_size("1M", MAX), Ok(1 << 20));
        assert_eq!(parse_size("1m", MAX), Ok(1 << 20));
        assert_eq!(parse_size("2MB", MAX), Ok(2_000_000));
        assert_eq!(parse_size("64k", MAX), Ok(65536));
        assert_eq!(parse_size("1.5MiB", MAX), Ok(1_572_864));
        assert_eq!(parse_size(" 8 KiB ", MAX), Ok(8192));
        assert_eq!(parse_size("1G", MAX), Ok(1 << 30));
    }

    #[test]
    fn bad_sizes_are_rejected_with_a_reason() {
        assert_eq!(parse_size("", MAX), Err(ParseError::Empty));
        assert_eq!(parse_size("0", MAX), Err(ParseError::NotPositive));
        assert_eq!(parse_size("-5K", MAX), Err(ParseError::NotPositive));
        assert_eq!(parse_size("0.1", MAX), Err(ParseError::NotPositive));
        assert!(matches!(
            parse_size("abc", MAX),
            Err(ParseError::NotANumber(_))
        ));
        assert!(matches!(
            parse_size("12parsecs", MAX),
            Err(ParseError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_size("2TiB", MAX),
            Err(ParseError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_size("2048G", MAX),
            Err(ParseError::TooLarge { .. })
        ));
        assert!(matches!(
            parse_size("1.2.3", MAX),
            Err(ParseError::NotANumber(_))
        ));
    }

    #[test]
    fn durations() {
        let max = Duration::from_secs(86_400);
        assert_eq!(parse_duration("30s", max), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("30", max), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms", max), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m", max), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h", max), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("0", max), Err(ParseError::NotPositive));
        assert_eq!(parse_duration("-1s", max), Err(ParseError::NotPositive));
        assert!(matches!(
            parse_duration("2days", max),
            Err(ParseError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_duration("48h", max),
            Err(ParseError::TooLarge { .. })
        ));
    }

    #[test]
    fn bytes_are_formatted_for_people() {
        assert_eq!(format_bytes(100.0), "100 B");
        assert_eq!(format_bytes(1536.0), "1.5 KiB");
        assert_eq!(format_bytes(3.0 * 1024.0 * 1024.0), "3.0 MiB");
    }
}
