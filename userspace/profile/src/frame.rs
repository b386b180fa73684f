//! The locations stacks are made of, as every stage after the ring buffer sees them.
//!
//! A [`Frame`] is a return address normalized to (module, file offset) while its process
//! lived; a [`Module`] names the file; [`Functions`] are what symbolization found at a
//! frame. [`Symbolize`] is the step a report asks of whoever owns the modules' files
//! (`allocbpf-stacks`), so the model itself reads no file.

use std::{collections::HashMap, path::PathBuf, sync::Arc};

/// An executable or shared object that frames point into.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Module {
    /// Path to the file (as named in the process's maps).
    pub path: PathBuf,
    /// GNU build id, if the file has one.
    pub build_id: Option<Vec<u8>>,
}

impl Module {
    /// The build id as lowercase hex, or an empty string.
    pub fn build_id_hex(&self) -> String {
        self.build_id
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The file name, for display.
    pub fn file_name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.path.display().to_string())
    }
}

/// A normalized frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Frame {
    /// A return address inside a module, as a file offset.
    Module {
        /// Index into the report's module list ([`Symbolize::modules`]).
        module: u32,
        /// File offset of the return address.
        offset: u64,
    },
    /// An address no module covered (JIT code, unmapped, or a garbage frame pointer).
    Unknown(u64),
    /// The only frame of samples the kernel's sample ring had no room for: they kept
    /// their weight but not their stack ([`LOST_SAMPLES_NAME`]).
    Lost,
    /// A frame a language runtime read from its own tables (a Python, Go, Java or
    /// JavaScript function at a line, a Java heap sample's allocated class): an index
    /// into the session's [`SourceLocations`], whose location says how it reads.
    Runtime(u32),
}

impl Frame {
    /// The module a native frame is in (`None` for any other frame).
    pub fn module(&self) -> Option<u32> {
        match *self {
            Frame::Module { module, .. } => Some(module),
            _ => None,
        }
    }
}

/// Where a frame read from a runtime's own tables was: function (Python's qualified
/// name where the version has one), file and line (0 when the line table gave none),
/// and how reports that show names only show it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SourceLocation {
    /// The function.
    pub function: String,
    /// Its source file.
    pub file: String,
    /// The line; 0 when unknown.
    pub line: u32,
    /// How it reads where only a name is shown.
    pub style: LocationStyle,
}

/// How a [`SourceLocation`] reads in reports that show names only (text, json,
/// folded, svg); pprof and OTLP carry name, file and line apart whatever the style.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LocationStyle {
    /// `function (file:line)`, the way an interpreted language's traceback reads, so
    /// that its lines stay apart when stacks are merged by name (a location without a
    /// file reads by its name).
    #[default]
    WithFile,
    /// By its function's name, as native frames read.
    ByName,
}

/// Most distinct source locations a session keeps; later new ones share one frame
/// ([`SOURCE_LOCATIONS_FULL`]). Frames in aggregated stacks refer to them for the whole
/// session, so they are never released; the bound keeps a hostile process that forges
/// endless names from growing the agent without limit.
pub const MAX_SOURCE_LOCATIONS: usize = 1 << 18;

/// How a location past [`MAX_SOURCE_LOCATIONS`] reads.
pub const SOURCE_LOCATIONS_FULL: &str = "[location table full]";

/// The session's source locations, interned: a [`Frame::Runtime`] is an index here. One table per session, owned by the frame resolver that makes the frames
/// and names them (not one per report): every report of the session names a frame the
/// same way.
#[derive(Default)]
pub struct SourceLocations {
    ids: HashMap<Arc<SourceLocation>, u32>,
    all: Vec<Arc<SourceLocation>>,
}

impl SourceLocations {
    /// The id of `location`, interned on first sight.
    pub fn intern(&mut self, location: SourceLocation) -> u32 {
        if let Some(&id) = self.ids.get(&location) {
            return id;
        }
        if self.all.len() < MAX_SOURCE_LOCATIONS {
            return self.push(location);
        }
        let full = SourceLocation {
            function: SOURCE_LOCATIONS_FULL.to_string(),
            file: String::new(),
            line: 0,
            style: LocationStyle::ByName,
        };
        match self.ids.get(&full) {
            Some(&id) => id,
            None => self.push(full),
        }
    }

    /// Adds a location not interned yet.
    fn push(&mut self, location: SourceLocation) -> u32 {
        let location = Arc::new(location);
        let id = self.all.len() as u32;
        self.all.push(location.clone());
        self.ids.insert(location, id);
        id
    }

    /// The location of id `id`.
    pub fn get(&self, id: u32) -> Option<Arc<SourceLocation>> {
        self.all.get(id as usize).cloned()
    }

    /// Locations interned.
    pub fn len(&self) -> usize {
        self.all.len()
    }

    /// No location interned yet.
    pub fn is_empty(&self) -> bool {
        self.all.is_empty()
    }
}

impl SourceLocations {
    /// The functions of a [`Frame::Runtime`] at location `id`, for reports, shown as
    /// its location's style says.
    pub fn functions(&self, id: u32) -> Functions {
        let frame = match self.get(id) {
            Some(location) => {
                let line = (location.line != 0).then_some(location.line);
                let with_file = location.style == LocationStyle::WithFile;
                FunctionFrame {
                    name: location.function.clone(),
                    file: (!location.file.is_empty()).then(|| location.file.clone()),
                    line,
                    shown: (with_file && !location.file.is_empty())
                        .then(|| shown_with_file(&location.function, &location.file, line)),
                }
            }
            None => FunctionFrame {
                name: format!("[source location {id}]"),
                file: None,
                line: None,
                shown: None,
            },
        };
        Arc::new([frame])
    }
}

/// How a [`Frame::Lost`] reads in reports.
pub const LOST_SAMPLES_NAME: &str = "[stack lost: sample ring buffer full]";

/// One function in a symbolized location.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FunctionFrame {
    /// Demangled function name.
    pub name: String,
    /// Source file, where debug info exists.
    pub file: Option<String>,
    /// Source line, where debug info exists.
    pub line: Option<u32>,
    /// How reports that show names only (text, json, folded, svg) show it, when not
    /// by `name` ([`LocationStyle::WithFile`]). pprof and OTLP carry name, file and
    /// line apart instead.
    pub shown: Option<String>,
}

impl FunctionFrame {
    /// The name reports that show names only use.
    pub fn shown_name(&self) -> &str {
        self.shown.as_deref().unwrap_or(&self.name)
    }
}

/// How a [`LocationStyle::WithFile`] location reads where only a name is shown:
/// `function (file:line)`.
pub fn shown_with_file(function: &str, file: &str, line: Option<u32>) -> String {
    match line {
        Some(line) => format!("{function} ({file}:{line})"),
        None => format!("{function} ({file})"),
    }
}

/// The functions at one address: innermost (inlined callee) first, the function that
/// physically contains the code last. This is pprof's `Location.line` order.
/// Shared (`Arc`): reports cross to the agent's writer thread.
pub type Functions = Arc<[FunctionFrame]>;

/// Names frames for a report.
pub trait Symbolize {
    /// Resolves every frame of `frames` not resolved yet (one batch per module).
    fn prepare(&mut self, frames: &mut dyn Iterator<Item = &Frame>);
    /// The functions at `frame`; a frame not prepared comes back unresolved.
    fn functions(&self, frame: &Frame) -> Functions;
    /// False when frames keep module + offset only (no debug info read).
    fn symbolizes(&self) -> bool;
    /// The modules frames point into, indexed by [`Frame::Module::module`].
    fn modules(&self) -> Vec<Module>;
}
