//! Which processes system-wide mode profiles: by command name and by cgroup.
//!
//! Names are bytes and need not be UTF-8. A command name regex is matched against the
//! name's bytes (`(?-u:\xff)` matches the byte 0xff) and, if they are not UTF-8,
//! against the name as shown (each invalid sequence made U+FFFD, as in labels and
//! logs): either is a match. A cgroup is compared byte for byte.

use std::{ffi::OsStr, os::unix::ffi::OsStrExt};

use regex::bytes::Regex;

use super::identity::ProcessInfo;

/// What a [`ProcessFilter`] is built from (the command line's filter flags, or the
/// agent's config keys of the same names).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FilterOptions {
    /// Only processes whose command name (/proc/PID/comm) matches this regex.
    pub comm: Option<String>,
    /// Not the processes whose command name matches this regex.
    pub exclude_comm: Option<String>,
    /// Only processes in this cgroup (v2) or below it: a path relative to the cgroup
    /// root, or under /sys/fs/cgroup.
    pub cgroup: Option<String>,
}

/// A filter on processes, built from the command line or the agent's config.
#[derive(Clone, Debug, Default)]
pub struct ProcessFilter {
    comm: Option<Regex>,
    exclude_comm: Option<Regex>,
    /// A cgroup path relative to the cgroup v2 root, without a trailing slash.
    cgroup: Option<String>,
}

/// A bad filter.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    /// A regex that does not compile.
    #[error("{key} {pattern:?} is not a valid regex: {source}")]
    Regex {
        /// Which option ([`FilterOptions`] field name).
        key: &'static str,
        /// The pattern.
        pattern: String,
        /// The parse error.
        source: regex::Error,
    },
    /// A cgroup that does not exist.
    #[error("cgroup {0}: no such cgroup (looked for /sys/fs/cgroup{1})")]
    NoSuchCgroup(String, String),
}

fn compile(key: &'static str, pattern: Option<&str>) -> Result<Option<Regex>, FilterError> {
    pattern
        .map(|p| {
            Regex::new(p).map_err(|source| FilterError::Regex {
                key,
                pattern: p.to_string(),
                source,
            })
        })
        .transpose()
}

impl ProcessFilter {
    /// Compiles the filter; a cgroup must exist.
    pub fn new(args: &FilterOptions) -> Result<ProcessFilter, FilterError> {
        let cgroup = match args.cgroup.as_deref() {
            None => None,
            Some(path) => {
                let relative = path
                    .strip_prefix("/sys/fs/cgroup")
                    .unwrap_or(path)
                    .trim_end_matches('/');
                let relative = if relative.starts_with('/') {
                    relative.to_string()
                } else {
                    format!("/{relative}")
                };
                if !std::path::Path::new(&format!("/sys/fs/cgroup{relative}")).is_dir() {
                    return Err(FilterError::NoSuchCgroup(path.to_string(), relative));
                }
                Some(relative)
            }
        };
        Ok(ProcessFilter {
            comm: compile("comm", args.comm.as_deref())?,
            exclude_comm: compile("exclude_comm", args.exclude_comm.as_deref())?,
            cgroup,
        })
    }

    /// True if `process` is to be profiled.
    pub fn admits(&self, process: &ProcessInfo) -> bool {
        if self
            .comm
            .as_ref()
            .is_some_and(|re| !name_matches(re, &process.comm))
        {
            return false;
        }
        if self
            .exclude_comm
            .as_ref()
            .is_some_and(|re| name_matches(re, &process.comm))
        {
            return false;
        }
        match &self.cgroup {
            None => true,
            Some(root) if root == "/" || root.is_empty() => true,
            Some(root) => {
                let cgroup = process.cgroup.as_bytes();
                cgroup == root.as_bytes()
                    || cgroup
                        .strip_prefix(root.as_bytes())
                        .is_some_and(|rest| rest.starts_with(b"/"))
            }
        }
    }
}

/// Whether `re` matches `name`'s bytes or, if they are not UTF-8, the name as shown.
fn name_matches(re: &Regex, name: &OsStr) -> bool {
    let bytes = name.as_bytes();
    re.is_match(bytes)
        || (std::str::from_utf8(bytes).is_err()
            && re.is_match(String::from_utf8_lossy(bytes).as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(comm: &str, cgroup: &str) -> ProcessInfo {
        ProcessInfo {
            comm: comm.into(),
            cgroup: cgroup.into(),
            ..ProcessInfo::default()
        }
    }

    #[test]
    fn comm_and_cgroup_filters() {
        let filter = ProcessFilter::new(&FilterOptions {
            comm: Some("^(nginx|redis)".into()),
            exclude_comm: Some("redis-cli".into()),
            cgroup: Some("/sys/fs/cgroup/".into()),
        })
        .unwrap();
        assert!(filter.admits(&process("nginx", "/a")));
        assert!(filter.admits(&process("redis-server", "/a")));
        assert!(!filter.admits(&process("redis-cli", "/a")));
        assert!(!filter.admits(&process("bash", "/a")));

        let filter = ProcessFilter {
            cgroup: Some("/system.slice/x.service".into()),
            ..ProcessFilter::default()
        };
        assert!(filter.admits(&process("a", "/system.slice/x.service")));
        assert!(filter.admits(&process("a", "/system.slice/x.service/child")));
        assert!(!filter.admits(&process("a", "/system.slice/x.services")));
    }

    fn process_bytes(comm: &[u8], cgroup: &[u8]) -> ProcessInfo {
        use std::os::unix::ffi::OsStringExt;
        ProcessInfo {
            comm: std::ffi::OsString::from_vec(comm.to_vec()),
            cgroup: std::ffi::OsString::from_vec(cgroup.to_vec()),
            ..ProcessInfo::default()
        }
    }

    /// Names that are not UTF-8 match by their bytes or as shown, and cgroups by bytes.
    #[test]
    fn names_that_are_not_utf8_are_filtered_like_others() {
        let hostile = process_bytes(b"x\xff\xfe\xc3bad", b"/a/\xff/b");
        let admits = |comm: &str| {
            ProcessFilter::new(&FilterOptions {
                comm: Some(comm.into()),
                ..FilterOptions::default()
            })
            .unwrap()
            .admits(&hostile)
        };
        // Literal parts, the name as shown (U+FFFD), raw bytes; `.` on either.
        assert!(admits("bad$"));
        assert!(admits("^x\u{fffd}+bad$"));
        assert!(admits("^x(?-u:\\xff\\xfe)"));
        assert!(admits("^x.*bad$"));
        assert!(!admits("^y"));
        assert!(!admits("^x(?-u:\\xfe)"));
        let exclude = ProcessFilter::new(&FilterOptions {
            exclude_comm: Some("^x.{3}bad$".into()),
            ..FilterOptions::default()
        })
        .unwrap();
        assert!(!exclude.admits(&hostile));
        assert!(exclude.admits(&process("nginx", "/a")));

        let in_cgroup = |root: &str| ProcessFilter {
            cgroup: Some(root.into()),
            ..ProcessFilter::default()
        };
        assert!(!in_cgroup("/a/b").admits(&hostile));
        assert!(in_cgroup("/a").admits(&hostile));
        assert!(!in_cgroup("/a/\u{fffd}/b").admits(&hostile));
        assert!(in_cgroup("/a").admits(&process_bytes(b"x", b"/a")));
    }

    #[test]
    fn bad_filters_say_why() {
        let error = ProcessFilter::new(&FilterOptions {
            comm: Some("(".into()),
            ..FilterOptions::default()
        })
        .unwrap_err();
        assert!(error.to_string().contains("not a valid regex"));
        let error = ProcessFilter::new(&FilterOptions {
            cgroup: Some("/no/such/group".into()),
            ..FilterOptions::default()
        })
        .unwrap_err();
        assert!(error.to_string().contains("no such cgroup"));
    }
}
