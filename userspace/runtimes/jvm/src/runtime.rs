//! The JVM as a [`Runtime`]: a HotSpot process allocbpf can read has the eBPF program
//! capture its threads' last Java frame and stack at each sample of its Java heap, and
//! those samples' frames become the allocated class (the leaf) and the Java frames that
//! allocated it, interpreted, compiled and inlined, as
//! `package.Class.method (File.java:line)`.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use allocbpf_common::java::JavaStatus;
use allocbpf_profile::frame::{Frame, SourceLocation, SourceLocations};
use allocbpf_runtime::{Departure, Found, ProcessView, Runtime, RuntimeMaps, SampleStack};

use crate::{
    process::{JvmFiles, JvmProcess},
    walk::{walk, Anchor, JavaFrame, StackCopy},
    JvmError,
};

/// This runtime's [`Runtime::name`].
pub const NAME: &str = "jvm";

/// How often a JVM whose structures were not readable yet (still starting) is looked at
/// again.
const RETRY_EVERY: Duration = Duration::from_millis(500);

/// How many times it is, before it is profiled without Java frames for good.
const RETRIES: u32 = 20;

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

/// What is known of one process.
enum Known {
    /// A JVM whose Java frames are walked.
    Jvm(Box<JvmProcess>),
    /// A JVM still starting: looked at again after `next`, a few times.
    Retry { next: Instant, attempts: u32 },
    /// Not a JVM, or one allocbpf cannot read (the reason was said once).
    Other,
}

/// The JVMs of a session and the naming of their frames.
#[derive(Default)]
pub struct JvmRuntime {
    processes: HashMap<u32, Known>,
    files: JvmFiles,
}

impl Runtime for JvmRuntime {
    fn name(&self) -> &'static str {
        NAME
    }

    fn look_at(&mut self, process: &ProcessView<'_>, maps: &mut dyn RuntimeMaps) -> Option<Found> {
        let pid = process.pid;
        let attempts = match self.processes.get(&pid) {
            None => 0,
            Some(Known::Retry { attempts, .. }) => *attempts,
            Some(_) => return None,
        };
        let jvm = match self.files.discover(pid, process.maps) {
            Ok(Some(jvm)) => jvm,
            // Not recorded: a launcher maps libjvm only once it has chosen it, and a
            // later look may find it.
            Ok(None) => return None,
            Err(JvmError::Unreadable(what)) if attempts < RETRIES => {
                tracing::debug!("pid {pid}: a JVM not readable yet ({what}); looking again");
                let next = Instant::now() + RETRY_EVERY;
                let attempts = attempts + 1;
                self.processes.insert(pid, Known::Retry { next, attempts });
                return None;
            }
            Err(error) => {
                tracing::warn!(
                    "pid {pid} maps libjvm.so but is profiled without Java frames: {error}"
                );
                self.processes.insert(pid, Known::Other);
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
            self.processes.insert(pid, Known::Other);
            return Some(found);
        }
        match maps.set_java(pid, jvm.layout.walk) {
            Ok(()) => {
                tracing::info!(
                    "pid {pid}: HotSpot JDK {} in {}: its Java heap is sampled with Java frames",
                    jvm.layout.major,
                    jvm.image.display()
                );
                self.processes.insert(pid, Known::Jvm(Box::new(jvm)));
            }
            Err(error) => {
                tracing::warn!("pid {pid} is profiled without Java frames: {error}");
                self.processes.insert(pid, Known::Other);
            }
        }
        Some(found)
    }

    fn look_again_due(&self, pid: u32, now: Instant) -> bool {
        matches!(self.processes.get(&pid), Some(Known::Retry { next, .. }) if now >= *next)
    }

    /// A Java heap sample's frames: its class, then its Java frames (its native
    /// frames are the VM's allocation path, which names no Java code).
    fn merge_frames(
        &mut self,
        sample: &SampleStack<'_>,
        native: Vec<Frame>,
        locations: &mut SourceLocations,
    ) -> Vec<Frame> {
        let Some(java) = sample.java else {
            return native;
        };
        let Some(Known::Jvm(jvm)) = self.processes.get_mut(&sample.pid) else {
            return native;
        };
        let mut frame = |function: &str, file: &str, line: u32| {
            Frame::Java(locations.intern(SourceLocation {
                function: function.to_string(),
                file: file.to_string(),
                line,
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

    fn forget(&mut self, pid: u32, why: Departure, maps: &mut dyn RuntimeMaps) {
        self.processes.remove(&pid);
        if matches!(why, Departure::Exec | Departure::Reused) {
            maps.forget_java(pid);
        }
    }

    fn descriptor_errors(&self) -> u64 {
        self.files.descriptor_errors()
    }
}
