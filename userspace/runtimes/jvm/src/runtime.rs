//! The JVM as a [`Runtime`]: a HotSpot process allocbpf can read has the eBPF program
//! capture its threads' last Java frame and stack at each sample of its Java heap, and
//! those samples' frames become the allocated class (the leaf) and the Java frames that
//! allocated it, interpreted, compiled and inlined, as
//! `package.Class.method (File.java:line)`.

use std::time::{Duration, Instant};

use allocbpf_common::{
    java::{JavaCapture, JavaStatus, JAVA_STACK_BYTES},
    runtime_entry::{Plain, JAVA_MAP},
    AllocFn, SAMPLE_FLAG_JAVA,
};
use allocbpf_profile::frame::{Frame, LocationStyle, SourceLocation, SourceLocations};
use allocbpf_runtime::{
    toolkit::{ProcessStates, RetryPolicy, StackCopy},
    Departure, Found, ProcessView, Runtime, RuntimeMaps, SampleStack,
};

use crate::{
    process::{JvmFiles, JvmProcess},
    walk::{walk, Anchor, JavaFrame},
    JvmError,
};

/// This runtime's [`Runtime::name`].
pub const NAME: &str = "jvm";

/// How often a JVM whose structures were not readable yet (still starting) is looked at
/// again.
const RETRY_EVERY: Duration = Duration::from_millis(500);

/// How many times it is, before it is profiled without Java frames for good.
const RETRIES: u32 = 20;

/// [`RETRY_EVERY`] and [`RETRIES`], as the process states take them.
const RETRY: RetryPolicy = RetryPolicy {
    every: RETRY_EVERY,
    times: RETRIES,
};

/// How a sample whose thread had no Java frame reads (the VM allocating for itself).
pub const NO_JAVA_FRAME: &str = "[JVM internal]";

/// How a sample whose Java frames could not be read reads.
pub const FRAMES_UNREADABLE: &str = "[Java frames unreadable]";

/// How a method that could not be named reads.
pub const UNKNOWN_METHOD: &str = "[unknown Java method]";

/// Where a frame is in its method's bytecodes.
enum Bci {
    /// An interpreted frame's bytecode pointer.
    Pointer(u64),
    /// A compiled scope's bytecode index.
    Index(i32),
}

/// How a class that could not be named reads.
pub const UNKNOWN_CLASS: &str = "[unknown class]";

/// What a Java heap sample captured of its thread ([`JavaCapture`], read from the
/// capture's bytes without copying its stack).
struct CapturedThread<'a> {
    /// A [`JavaStatus`] as sent.
    status: u32,
    /// The allocated object's `Klass*`.
    klass: u64,
    /// A new TLAB's sample: the bytes of the object that took it (0: not known).
    object_bytes: u64,
    /// The thread's last Java `sp`, `pc` and `fp`.
    anchor: [u64; 3],
    /// The address `stack` was copied from.
    base: u64,
    /// The stack from `base` up, as far as it was copied.
    stack: &'a [u8],
}

impl<'a> CapturedThread<'a> {
    /// The thread in `capture`, if it is long enough to be one.
    fn read(capture: &'a [u8]) -> Option<Self> {
        if capture.len() < std::mem::size_of::<JavaCapture>() {
            return None;
        }
        let word = |offset: usize| -> Option<u64> {
            Some(u64::from_ne_bytes(
                capture.get(offset..offset + 8)?.try_into().ok()?,
            ))
        };
        let half = |offset: usize| -> Option<u32> {
            Some(u32::from_ne_bytes(
                capture.get(offset..offset + 4)?.try_into().ok()?,
            ))
        };
        let anchor = std::mem::offset_of!(JavaCapture, anchor);
        let copied =
            (half(std::mem::offset_of!(JavaCapture, copied))? as usize).min(JAVA_STACK_BYTES);
        let stack = std::mem::offset_of!(JavaCapture, stack);
        Some(CapturedThread {
            status: half(std::mem::offset_of!(JavaCapture, status))?,
            klass: word(std::mem::offset_of!(JavaCapture, klass))?,
            object_bytes: word(std::mem::offset_of!(JavaCapture, object_bytes))?,
            anchor: [word(anchor)?, word(anchor + 8)?, word(anchor + 16)?],
            base: word(std::mem::offset_of!(JavaCapture, base))?,
            stack: capture.get(stack..stack + copied)?,
        })
    }
}

/// The JVMs of a session and the naming of their frames.
pub struct JvmRuntime {
    /// Each process looked at: a JVM whose Java frames are walked (boxed: most
    /// processes are not JVMs and keep a small state), one still starting (looked at
    /// again a few times), or not a JVM or one allocbpf cannot read (the reason was
    /// said once). A JVM's entry in [`JAVA_MAP`] goes when it execs or its pid is
    /// reused.
    processes: ProcessStates<Box<JvmProcess>>,
    files: JvmFiles,
}

impl Default for JvmRuntime {
    fn default() -> Self {
        Self {
            processes: ProcessStates::new(RETRY, Some(JAVA_MAP)),
            files: JvmFiles::default(),
        }
    }
}

impl Runtime for JvmRuntime {
    fn name(&self) -> &'static str {
        NAME
    }

    fn look_at(&mut self, process: &ProcessView<'_>, maps: &mut dyn RuntimeMaps) -> Option<Found> {
        let pid = process.pid;
        let attempts = self.processes.attempts(pid)?;
        let jvm = match self.files.discover(pid, process.maps) {
            Ok(Some(jvm)) => jvm,
            // Not recorded: a launcher maps libjvm only once it has chosen it, and a
            // later look may find it.
            Ok(None) => return None,
            Err(JvmError::Unreadable(what)) if attempts < RETRIES => {
                tracing::debug!("pid {pid}: a JVM not readable yet ({what}); looking again");
                self.processes.retry_later(pid, attempts, Instant::now());
                return None;
            }
            Err(error) => {
                tracing::warn!(
                    "pid {pid} maps libjvm.so but is profiled without Java frames: {error}"
                );
                self.processes.set_other(pid);
                return None;
            }
        };
        let mut labels = vec![("java_version", jvm.layout.major.to_string())];
        if let Some(main) = crate::command::main_of_process(pid) {
            labels.push(("java_main", main));
        }
        let found = Found {
            runtime: NAME,
            labels,
            source: None,
        };
        if !jvm.tracer {
            tracing::warn!(
                "pid {pid}: HotSpot JDK {} in {} defines no allocation tracer symbols (a \
                 stripped libjvm): its Java heap is not profiled, its native allocations are",
                jvm.layout.major,
                jvm.image.display()
            );
            self.processes.set_other(pid);
            return Some(found);
        }
        match maps.set_entry(JAVA_MAP, pid, jvm.layout.walk.as_bytes()) {
            Ok(()) => {
                tracing::info!(
                    "pid {pid}: HotSpot JDK {} in {}: its Java heap is sampled with Java frames",
                    jvm.layout.major,
                    jvm.image.display()
                );
                self.processes.insert(pid, Box::new(jvm));
            }
            Err(error) => {
                tracing::warn!("pid {pid} is profiled without Java frames: {error}");
                self.processes.set_other(pid);
            }
        }
        Some(found)
    }

    fn look_again_due(&self, pid: u32, now: Instant) -> bool {
        self.processes.look_again_due(pid, now)
    }

    /// A Java heap sample's frames: its class, then its Java frames (its native
    /// frames are the VM's allocation path, which names no Java code).
    fn merge_frames(
        &mut self,
        sample: &SampleStack<'_>,
        native: Vec<Frame>,
        locations: &mut SourceLocations,
    ) -> Vec<Frame> {
        let Some(java) = sample
            .capture_of(SAMPLE_FLAG_JAVA)
            .and_then(CapturedThread::read)
        else {
            return native;
        };
        let Some(jvm) = self.processes.get_mut(sample.pid) else {
            return native;
        };
        let mut frame = |function: &str, file: &str, line: u32| {
            Frame::Runtime(locations.intern(SourceLocation {
                function: function.to_string(),
                file: file.to_string(),
                line,
                style: LocationStyle::WithFile,
            }))
        };
        let jvm = &mut **jvm;
        jvm.refresh_due();
        let class = (jvm.names.class(&jvm.memory, &jvm.layout, java.klass))
            .unwrap_or(UNKNOWN_CLASS)
            .to_string();
        let mut frames = vec![frame(&class, "", 0)];
        if java.status == JavaStatus::NoJavaFrame as u32 {
            frames.push(frame(NO_JAVA_FRAME, "", 0));
            return frames;
        }
        let [sp, pc, fp] = java.anchor;
        let copy = StackCopy {
            base: java.base,
            bytes: java.stack,
        };
        let walked = walk(
            &mut jvm.code,
            &jvm.memory,
            &jvm.layout,
            Anchor { sp, pc, fp },
            &copy,
        );
        if walked.is_empty() {
            frames.push(frame(FRAMES_UNREADABLE, "", 0));
        }
        for java_frame in walked {
            let (method, bci) = match java_frame {
                JavaFrame::Interpreted { method, bcp } => (method, Bci::Pointer(bcp)),
                JavaFrame::Compiled(scope) => (scope.method, Bci::Index(scope.bci)),
            };
            frames.push(match jvm.names.method(&jvm.memory, &jvm.layout, method) {
                Some(name) => {
                    let bci = match bci {
                        Bci::Pointer(bcp) => name.bci_of(bcp),
                        Bci::Index(bci) => bci,
                    };
                    frame(&name.function, &name.file, name.line(bci))
                }
                None => frame(UNKNOWN_METHOD, "", 0),
            });
        }
        frames
    }

    /// A new TLAB's sample stands for the object that took the TLAB (its bytes from
    /// the capture; 0 when unknown, as for a sample that lost its capture).
    fn attributed_object(&self, sample: &SampleStack<'_>) -> Option<u64> {
        (sample.function == Some(AllocFn::JavaTlab)).then(|| {
            (sample.capture_of(SAMPLE_FLAG_JAVA))
                .and_then(CapturedThread::read)
                .map_or(0, |java| java.object_bytes)
        })
    }

    fn forget(&mut self, pid: u32, why: Departure, maps: &mut dyn RuntimeMaps) {
        self.processes.forget(pid, why, maps);
    }

    fn descriptor_errors(&self) -> u64 {
        self.files.descriptor_errors()
    }
}
