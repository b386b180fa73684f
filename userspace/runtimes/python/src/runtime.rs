//! CPython as a [`Runtime`]: a process allocbpf knows the interpreter of has the eBPF
//! program walk its frames at each sample, and its samples' Python frames go into
//! their native stacks the way `py-spy --native` shows them: each native frame of the
//! interpreter's eval loop is replaced by the Python frames that call of the loop was
//! running, so a C extension's allocation shows the Python line that called it.

use std::time::{Duration, Instant};

use allocbpf_common::{
    python::MAX_PYTHON_FRAMES,
    runtime_entry::{Plain, PYTHON_MAP},
    PythonStack, SAMPLE_FLAG_PYTHON,
};
use allocbpf_profile::frame::{Frame, LocationStyle, SourceLocation, SourceLocations};
use allocbpf_runtime::{
    toolkit::{ProcessStates, RetryPolicy},
    Departure, Found, ProcessView, Runtime, RuntimeMaps, SampleStack,
};

use crate::{
    code::{CodeResolver, ResolvedFrame},
    discover::{InterpreterFiles, PythonError},
};

/// This runtime's [`Runtime::name`].
pub const NAME: &str = "python";

/// How often an interpreter whose runtime was not readable yet (one that has only just
/// started initialising) is looked at again.
const RETRY_EVERY: Duration = Duration::from_millis(500);

/// How many times it is, before it is profiled without Python frames for good.
const RETRIES: u32 = 20;

/// Looks again at an interpreter that was not readable yet, as [`RETRY_EVERY`] and
/// [`RETRIES`] say.
const RETRY: RetryPolicy = RetryPolicy {
    every: RETRY_EVERY,
    times: RETRIES,
};

/// The Python processes of a session and the resolution of their frames.
pub struct PythonRuntime {
    /// Each process looked at: a CPython one's resolver (boxed: a process that is not
    /// Python, or waits for a look again, does not cost a resolver's size), a retry, or
    /// nothing to do; forgetting one drops its entry of the kernel's [`PYTHON_MAP`].
    processes: ProcessStates<Box<CodeResolver>>,
    files: InterpreterFiles,
}

impl Default for PythonRuntime {
    fn default() -> Self {
        Self {
            processes: ProcessStates::new(RETRY, Some(PYTHON_MAP)),
            files: InterpreterFiles::default(),
        }
    }
}

impl PythonRuntime {
    /// Looks at `process` once: `Some` (its resolver) if it is a CPython process
    /// allocbpf knows. `Err` says why a Python process gets no Python frames.
    fn discover(
        &mut self,
        process: &ProcessView<'_>,
    ) -> Result<Option<&CodeResolver>, PythonError> {
        let pid = process.pid;
        let Some(attempts) = self.processes.attempts(pid) else {
            return Ok(None);
        };
        match self.files.discover(pid, process.maps) {
            Ok(Some(found)) => {
                let resolver = self
                    .processes
                    .insert(pid, Box::new(CodeResolver::new(found)));
                Ok(Some(&**resolver))
            }
            Ok(None) => {
                self.processes.set_other(pid);
                Ok(None)
            }
            Err(error) => {
                // An interpreter still initialising is looked at again, a few times;
                // past them, or for any other reason, it is said once and not again.
                let again = matches!(error, PythonError::Unreadable { .. })
                    && self.processes.retry_later(pid, attempts, Instant::now());
                if again {
                    return Ok(None);
                }
                self.processes.set_other(pid);
                Err(error)
            }
        }
    }
}

impl Runtime for PythonRuntime {
    fn name(&self) -> &'static str {
        NAME
    }

    /// One that it does not know is profiled natively; the log says why it has no
    /// Python frames.
    fn look_at(&mut self, process: &ProcessView<'_>, maps: &mut dyn RuntimeMaps) -> Option<Found> {
        let pid = process.pid;
        let (walk, said, found) = match self.discover(process) {
            Ok(Some(resolver)) => {
                let python = resolver.process();
                let said = format!(
                    "CPython 3.{} in {}: Python frames are walked at its samples",
                    python.minor,
                    python.image.display()
                );
                let labels = vec![("python_version", format!("3.{}", python.minor))];
                let found = Found {
                    runtime: NAME,
                    labels,
                    source: None,
                };
                (python.walk, said, found)
            }
            Ok(None) => return None,
            Err(error) => {
                tracing::warn!("pid {pid} is profiled without Python frames: {error}");
                return None;
            }
        };
        match maps.set_entry(PYTHON_MAP, pid, walk.as_bytes()) {
            Ok(()) => tracing::info!("pid {pid}: {said}"),
            Err(error) => {
                // Still labelled with its version: it runs CPython, without its frames.
                tracing::warn!("pid {pid} is profiled without Python frames: {error}");
                self.processes.remove(pid);
            }
        }
        Some(found)
    }

    fn look_again_due(&self, pid: u32, now: Instant) -> bool {
        self.processes.look_again_due(pid, now)
    }

    /// Python frames left over (the native unwind stopped early) go outermost.
    fn merge_frames(
        &mut self,
        sample: &SampleStack<'_>,
        native: Vec<Frame>,
        locations: &mut SourceLocations,
    ) -> Vec<Frame> {
        let Some(stack) = sample
            .capture_of(SAMPLE_FLAG_PYTHON)
            .and_then(PythonStack::read_from)
        else {
            return native;
        };
        let records = &stack.frames[..(stack.len as usize).min(MAX_PYTHON_FRAMES)];
        if records.is_empty() {
            return native;
        }
        let Some(resolver) = self.processes.get_mut(sample.pid) else {
            return native;
        };
        let eval_loop = resolver.process().eval_loop.clone();
        let segments = resolver.segments(records);
        if segments.is_empty() {
            return native;
        }
        let mut intern = |frame: &ResolvedFrame| {
            Frame::Runtime(locations.intern(SourceLocation {
                function: frame.function.clone(),
                file: frame.file.clone(),
                line: frame.line,
                style: LocationStyle::WithFile,
            }))
        };
        let mut segments = segments.iter();
        let mut merged = Vec::with_capacity(native.len() + records.len());
        for (index, frame) in native.into_iter().enumerate() {
            let in_eval_loop = (sample.addresses.get(index))
                .zip(eval_loop.as_ref())
                .is_some_and(|(address, range)| range.contains(&address.wrapping_sub(1)));
            match in_eval_loop.then(|| segments.next()).flatten() {
                Some(segment) => merged.extend(segment.iter().map(&mut intern)),
                None => merged.push(frame),
            }
        }
        for segment in segments {
            merged.extend(segment.iter().map(&mut intern));
        }
        merged
    }

    /// The kernel's walk goes at an exec or a pid's reuse, whatever is known here (the
    /// process may have been forgotten at its main thread's exit while a thread that
    /// outlived it exec'd): the new program is looked at afresh. After an exit, threads
    /// that outlive the main thread keep it until the cut releases the pid's kernel
    /// entries.
    fn forget(&mut self, pid: u32, why: Departure, maps: &mut dyn RuntimeMaps) {
        self.processes.forget(pid, why, maps);
    }

    fn descriptor_errors(&self) -> u64 {
        self.files.descriptor_errors()
    }
}

#[cfg(test)]
mod tests {
    use allocbpf_runtime::RuntimeMapError;

    use super::*;

    /// The kernel map entries forgotten.
    #[derive(Default)]
    struct Forgotten(Vec<(&'static str, u32)>);

    impl RuntimeMaps for Forgotten {
        fn set_entry(&mut self, _: &'static str, _: u32, _: &[u8]) -> Result<(), RuntimeMapError> {
            Ok(())
        }

        fn forget_entry(&mut self, map: &'static str, pid: u32) {
            self.0.push((map, pid));
        }
    }

    #[test]
    fn the_kernel_walk_goes_at_an_exec_or_a_reuse_only() {
        let mut runtime = PythonRuntime::default();
        let mut maps = Forgotten::default();
        for (pid, why) in [
            (1, Departure::Exit),
            (2, Departure::Exec),
            (3, Departure::Reused),
            (4, Departure::Released),
        ] {
            runtime.forget(pid, why, &mut maps);
        }
        assert_eq!(maps.0, [(PYTHON_MAP, 2), (PYTHON_MAP, 3)]);
    }
}
