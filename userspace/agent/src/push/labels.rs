//! The labels of a pushed profile as a profile store reads them: a service name for
//! every profile, Pyroscope's reserved labels, its validation limits, and a bound on
//! the number of series.
//!
//! Everything here comes from other processes (command names, paths, cgroup names):
//! a label Pyroscope would refuse is left out and counted, never sent to make the
//! whole profile fail.

use std::{
    collections::HashMap,
    hash::{DefaultHasher, Hash, Hasher},
    time::{Duration, Instant},
};

/// The label every Pyroscope series needs (a series without it lands under
/// `unknown_service`), and the OpenTelemetry resource attribute it maps to.
pub const SERVICE_NAME: &str = "service_name";

/// Labels the agent adds to a profile that change every interval: kept in the profile
/// itself, never in a series' labels (each value would be a new series). The writer's
/// own list, so the two cannot drift.
pub use allocbpf_export::pprof::PER_INTERVAL_LABELS as PER_INTERVAL;

/// Pyroscope's default validation limits (`validation.max-label-names-per-series`,
/// `-max-label-name-length`, `-max-label-value-length`).
pub const MAX_LABEL_NAMES: usize = 30;
/// Longest label name Pyroscope accepts by default.
pub const MAX_LABEL_NAME_LENGTH: usize = 1024;
/// Longest label value Pyroscope accepts by default.
pub const MAX_LABEL_VALUE_LENGTH: usize = 2048;

/// A profile's service name: the configured one, else the process's systemd unit
/// (its cgroup's last component, `redis-server.service` naming `redis-server`), else
/// a JVM's main class or jar (`java_main`: every JVM's command name is `java`), else
/// its command name.
pub fn service_name(configured: Option<&str>, labels: &[(String, String)]) -> String {
    if let Some(name) = configured {
        return name.to_string();
    }
    let value = |key: &str| {
        labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
    };
    let unit = value("cgroup")
        .and_then(|cgroup| cgroup.rsplit('/').next())
        .and_then(|last| last.strip_suffix(".service"))
        // A templated unit's instance (`getty@tty1`) is one service.
        .map(|unit| unit.split('@').next().unwrap_or(unit))
        .filter(|unit| !unit.is_empty());
    unit.or_else(|| value("java_main"))
        .or_else(|| value("comm"))
        .unwrap_or("unknown")
        .to_string()
}

/// Whether Pyroscope (and Prometheus) accept `name` as a label name.
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= MAX_LABEL_NAME_LENGTH
}

/// The labels of a profile's Pyroscope series, in a fixed order: `__name__=memory`,
/// `service_name`, `__delta__=false` (our values are already per interval: without it
/// the server would difference `alloc_*` values against the previous push and drop
/// the first), then the profile's own labels that Pyroscope accepts. Returns them and
/// how many were left out.
pub fn pyroscope_series(
    labels: &[(String, String)],
    service_name: &str,
) -> (Vec<(String, String)>, u64) {
    let mut series: Vec<(String, String)> = vec![
        ("__name__".into(), "memory".into()),
        ("__delta__".into(), "false".into()),
        (SERVICE_NAME.into(), bounded(service_name)),
    ];
    let mut dropped = 0;
    for (name, value) in labels {
        if value.is_empty() || PER_INTERVAL.contains(&name.as_str()) {
            continue;
        }
        let reserved = name.starts_with("__") || name == SERVICE_NAME;
        if reserved
            || !valid_name(name)
            || value.len() > MAX_LABEL_VALUE_LENGTH
            || series.len() >= MAX_LABEL_NAMES
        {
            dropped += 1;
            continue;
        }
        series.push((name.clone(), value.clone()));
    }
    (series, dropped)
}

/// `text` cut to the longest value Pyroscope accepts (on a character boundary).
pub fn bounded(text: &str) -> String {
    if text.len() <= MAX_LABEL_VALUE_LENGTH {
        return text.to_string();
    }
    let mut end = MAX_LABEL_VALUE_LENGTH;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// Bounds the number of distinct series pushed within a window, as a store's
/// per-tenant series limit does: a profile of a series seen in the window always
/// passes; a new one passes while fewer than the bound were seen.
pub struct SeriesLimit {
    max: usize,
    window: Duration,
    /// Hash of each series' labels, and when a profile of it last passed.
    seen: HashMap<u64, Instant>,
}

impl SeriesLimit {
    /// At most `max` series within `window`.
    pub fn new(max: usize, window: Duration) -> SeriesLimit {
        SeriesLimit {
            max,
            window,
            seen: HashMap::new(),
        }
    }

    /// Changes the bound (a reload); series already seen stay.
    pub fn set_max(&mut self, max: usize) {
        self.max = max;
    }

    /// Whether a profile of the series `labels` may be pushed at `now`.
    pub fn admit(&mut self, labels: &[(String, String)], now: Instant) -> bool {
        let mut hasher = DefaultHasher::new();
        labels.hash(&mut hasher);
        let key = hasher.finish();
        if let Some(last) = self.seen.get_mut(&key) {
            *last = now;
            return true;
        }
        if self.seen.len() >= self.max {
            let window = self.window;
            self.seen
                .retain(|_, last| now.saturating_duration_since(*last) < window);
            if self.seen.len() >= self.max {
                return false;
            }
        }
        self.seen.insert(key, now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn service_names() {
        let unit = pairs(&[
            ("comm", "redis-server"),
            ("cgroup", "/system.slice/redis-server.service"),
        ]);
        assert_eq!(service_name(None, &unit), "redis-server");
        let templated = pairs(&[
            ("comm", "agetty"),
            ("cgroup", "/system.slice/getty@tty1.service"),
        ]);
        assert_eq!(service_name(None, &templated), "getty");
        let shell = pairs(&[
            ("comm", "python3"),
            ("cgroup", "/user.slice/session-4.scope"),
        ]);
        assert_eq!(service_name(None, &shell), "python3");
        let jvm = pairs(&[
            ("comm", "java"),
            ("cgroup", "/user.slice/session-4.scope"),
            ("java_main", "orders.jar"),
        ]);
        assert_eq!(service_name(None, &jvm), "orders.jar");
        let jvm_unit = pairs(&[
            ("comm", "java"),
            ("cgroup", "/system.slice/kafka.service"),
            ("java_main", "kafka.Kafka"),
        ]);
        assert_eq!(service_name(None, &jvm_unit), "kafka");
        assert_eq!(service_name(Some("checkout"), &unit), "checkout");
        assert_eq!(service_name(None, &[]), "unknown");
    }

    #[test]
    fn series_labels_are_what_pyroscope_accepts() {
        let long = "x".repeat(MAX_LABEL_VALUE_LENGTH + 1);
        let labels = pairs(&[
            ("hostname", "h"),
            ("pid", "12"),
            ("observed_fraction", "0.25"),
            ("exe", &long),
            ("container_id", ""),
            ("bad-name", "v"),
            ("__delta__", "true"),
        ]);
        let (series, dropped) = pyroscope_series(&labels, "svc");
        assert_eq!(
            series,
            pairs(&[
                ("__name__", "memory"),
                ("__delta__", "false"),
                ("service_name", "svc"),
                ("hostname", "h"),
                ("pid", "12"),
            ])
        );
        assert_eq!(dropped, 3, "the long exe, the bad name, the reserved one");
        let many: Vec<(String, String)> = (0..40).map(|i| (format!("l{i}"), "v".into())).collect();
        let (series, dropped) = pyroscope_series(&many, "svc");
        assert_eq!(series.len(), MAX_LABEL_NAMES);
        assert_eq!(dropped, 40 + 3 - MAX_LABEL_NAMES as u64);
    }

    #[test]
    fn the_series_limit_admits_known_series_and_forgets_old_ones() {
        let mut limit = SeriesLimit::new(2, Duration::from_secs(60));
        let t0 = Instant::now();
        let a = pairs(&[("pid", "1")]);
        let b = pairs(&[("pid", "2")]);
        let c = pairs(&[("pid", "3")]);
        assert!(limit.admit(&a, t0));
        assert!(limit.admit(&b, t0));
        assert!(!limit.admit(&c, t0), "a third series within the window");
        assert!(limit.admit(&a, t0 + Duration::from_secs(30)), "a known one");
        // b was last seen more than a window ago: c takes its place.
        assert!(limit.admit(&c, t0 + Duration::from_secs(61)));
    }
}
