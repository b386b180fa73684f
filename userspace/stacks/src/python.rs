//! Python frames in native stacks, the way `py-spy --native` shows them: each native
//! frame of the interpreter's eval loop is replaced by the Python frames that call of
//! the loop was running, so a C extension's allocation shows the Python line that
//! called it.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use allocbpf_images::procfs::MapsEntry;
use allocbpf_probe::events::RawSample;
use allocbpf_profile::frame::{source_locations, Frame, SourceLocation};
use allocbpf_python::{
    code::{CodeResolver, ResolvedFrame},
    discover::{InterpreterFiles, PythonError, PythonProcess},
};

/// What is known of one process.
enum Known {
    /// A CPython process whose frames are walked.
    Python(Box<CodeResolver>),
    /// Not Python, or Python allocbpf cannot walk (the reason was said once).
    Other,
    /// A CPython whose runtime could not be read yet (an interpreter that has only just
    /// started initialising): looked at again at a sample after `next`, a few times.
    Retry { next: Instant, attempts: u32 },
}

/// How often an interpreter whose runtime was not readable yet is looked at again.
const RETRY_EVERY: Duration = Duration::from_millis(500);

/// How many times it is, before it is profiled without Python frames for good.
const RETRIES: u32 = 20;

/// The Python processes of a session and the resolution of their frames.
#[derive(Default)]
pub struct PythonStacks {
    processes: HashMap<u32, Known>,
    files: InterpreterFiles,
}

impl PythonStacks {
    /// Looks at `pid` (mapping `maps`) once: the walk the eBPF program must do for it,
    /// if it is a CPython process allocbpf knows. `Err` says why a Python process gets
    /// no Python frames (it is still profiled natively).
    pub fn look_at(
        &mut self,
        pid: u32,
        maps: &[MapsEntry],
    ) -> Result<Option<&PythonProcess>, PythonError> {
        let attempts = match self.processes.get(&pid) {
            None => 0,
            Some(Known::Retry { attempts, .. }) => *attempts,
            Some(_) => return Ok(None),
        };
        match self.files.discover(pid, maps) {
            Ok(Some(process)) => {
                let resolver = Box::new(CodeResolver::new(process));
                self.processes.insert(pid, Known::Python(resolver));
                match self.processes.get(&pid) {
                    Some(Known::Python(resolver)) => Ok(Some(resolver.process())),
                    _ => Ok(None),
                }
            }
            Ok(None) => {
                self.processes.insert(pid, Known::Other);
                Ok(None)
            }
            Err(PythonError::Unreadable { .. }) if attempts < RETRIES => {
                let next = Instant::now() + RETRY_EVERY;
                let attempts = attempts + 1;
                self.processes.insert(pid, Known::Retry { next, attempts });
                Ok(None)
            }
            Err(error) => {
                self.processes.insert(pid, Known::Other);
                Err(error)
            }
        }
    }

    /// True when `pid` is a Python process whose runtime was not readable when it was
    /// looked at, and it is time to look again ([`PythonStacks::look_at`]).
    pub fn retry_due(&self, pid: u32) -> bool {
        matches!(self.processes.get(&pid), Some(Known::Retry { next, .. }) if Instant::now() >= *next)
    }

    /// Forgets `pid` (it exited, or exec'd another program).
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    /// `native` (the sample's frames, innermost first, `addresses` their return
    /// addresses) with each eval-loop frame replaced by its Python frames. Python
    /// frames left over (the native unwind stopped early) go outermost.
    pub fn merge(
        &mut self,
        sample: &RawSample,
        addresses: &[u64],
        native: Vec<Frame>,
    ) -> Vec<Frame> {
        if sample.python.is_empty() {
            return native;
        }
        let Some(Known::Python(resolver)) = self.processes.get_mut(&sample.pid) else {
            return native;
        };
        let eval_loop = resolver.process().eval_loop.clone();
        let segments = resolver.segments(&sample.python);
        if segments.is_empty() {
            return native;
        }
        let Ok(mut table) = source_locations().write() else {
            return native;
        };
        let mut intern = |frame: &ResolvedFrame| {
            Frame::Python(table.intern(SourceLocation {
                function: frame.function.clone(),
                file: frame.file.clone(),
                line: frame.line,
            }))
        };
        let mut segments = segments.iter();
        let mut merged = Vec::with_capacity(native.len() + sample.python.len());
        for (index, frame) in native.into_iter().enumerate() {
            let in_eval_loop = addresses
                .get(index)
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
}
