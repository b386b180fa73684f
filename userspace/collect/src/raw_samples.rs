//! The raw-sample log: every sample as one JSON line, written as samples arrive.
//!
//! This is the estimator's raw input (what the kernel sent), for offline analysis and
//! for the tests that check the kernel's interval picks. A write failure is logged once
//! and stops this log only: the profile itself is never lost to it.

use std::{
    fs::File,
    io::{BufWriter, Write},
    path::{Path, PathBuf},
};

use serde_json::json;

use allocbpf_probe::events::RawSample;

use crate::error::CollectError;

/// An open raw-sample log.
pub struct RawSampleLog {
    path: PathBuf,
    out: Option<BufWriter<File>>,
}

impl RawSampleLog {
    /// Creates (truncates) the log; called before anything is attached.
    pub fn create(path: &Path) -> Result<RawSampleLog, CollectError> {
        let file = File::create(path).map_err(|source| CollectError::RawSamples {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(RawSampleLog {
            path: path.to_path_buf(),
            out: Some(BufWriter::new(file)),
        })
    }

    /// Appends one sample.
    pub fn write(&mut self, sample: &RawSample) {
        let Some(out) = self.out.as_mut() else {
            return;
        };
        let line = json!({
            "pid": sample.pid,
            "tid": sample.tid,
            "timestamp_ns": sample.timestamp_ns,
            "size": sample.size,
            "offset": sample.offset,
            "next_interval": sample.next_interval,
            "rate": sample.rate,
            "certain": sample.certain,
            "lost": sample.lost,
        });
        if let Err(error) = writeln!(out, "{line}") {
            self.fail(error);
        }
    }

    /// Flushes what is buffered (at the end of the session).
    pub fn finish(&mut self) {
        if let Some(out) = self.out.as_mut() {
            if let Err(error) = out.flush() {
                self.fail(error);
            }
        }
    }

    fn fail(&mut self, error: std::io::Error) {
        tracing::warn!(
            "raw sample log {} stopped: {error}; the profile is not affected",
            self.path.display()
        );
        self.out = None;
    }
}
