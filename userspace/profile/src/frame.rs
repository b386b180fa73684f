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

/// Most distinct source locations held at once; past it new ones share one frame
/// ([`SOURCE_LOCATIONS_FULL`]). Locations no remaining stack refers to are released at
/// each cut ([`SourceLocations::release`]), so the table follows what runs now, not
/// the agent's history; the bound keeps a hostile process that forges endless names
/// from growing the agent without limit within an interval.
pub const MAX_SOURCE_LOCATIONS: usize = 1 << 18;

/// Locations one process may hold at once ([`SourceLocations::charge_to`]): an eighth
/// of the table, so that a process forging names fills its share, not everyone's.
pub const SOURCE_LOCATIONS_PER_PROCESS: usize = MAX_SOURCE_LOCATIONS / 8;

/// How a location past [`MAX_SOURCE_LOCATIONS`] reads.
pub const SOURCE_LOCATIONS_FULL: &str = "[location table full]";

/// How a location of a process past [`SOURCE_LOCATIONS_PER_PROCESS`] reads.
pub const PROCESS_LOCATIONS_FULL: &str = "[location share of this process full]";

/// How the one frame of a process's samples past its cap on distinct stacks reads.
pub const PROCESS_STACKS_FULL: &str = "[stack table of this process full]";

/// One interned location and the process it is charged to.
struct Slot {
    location: Arc<SourceLocation>,
    owner: Option<u32>,
}

/// The session's source locations, interned: a [`Frame::Runtime`] is an index here.
/// One table per session, owned by the frame resolver that makes the frames and names
/// them (not one per report): every report of an interval names a frame the same way.
/// An id stays its location's as long as a stack refers to it; released ids are reused.
#[derive(Default)]
pub struct SourceLocations {
    ids: HashMap<Arc<SourceLocation>, u32>,
    slots: Vec<Option<Slot>>,
    /// Released ids, reused first.
    free: Vec<u32>,
    /// The process new locations are charged to now, if any.
    charge: Option<u32>,
    /// Locations held per process charged.
    held: HashMap<u32, usize>,
}

impl SourceLocations {
    /// The id of `location`, interned on first sight (charged to the process named by
    /// [`SourceLocations::charge_to`], which may hold at most
    /// [`SOURCE_LOCATIONS_PER_PROCESS`]).
    pub fn intern(&mut self, location: SourceLocation) -> u32 {
        if let Some(&id) = self.ids.get(&location) {
            return id;
        }
        let owner = self.charge;
        let over_share = owner.is_some_and(|pid| {
            self.held.get(&pid).copied().unwrap_or(0) >= SOURCE_LOCATIONS_PER_PROCESS
        });
        if over_share {
            return self.sentinel(PROCESS_LOCATIONS_FULL);
        }
        if self.len() < MAX_SOURCE_LOCATIONS {
            return self.push(location, owner);
        }
        self.sentinel(SOURCE_LOCATIONS_FULL)
    }

    /// New locations are charged to process `pid` from now on (`None`: to nobody).
    /// The frame resolver names the process whose frames it merges; a runtime whose
    /// poll reads many processes names each in turn.
    pub fn charge_to(&mut self, pid: Option<u32>) {
        self.charge = pid;
    }

    /// The id of the location named `name` (uncharged): one that stands for frames
    /// refused or merged ([`SOURCE_LOCATIONS_FULL`], [`PROCESS_STACKS_FULL`]).
    pub fn sentinel(&mut self, name: &str) -> u32 {
        let location = SourceLocation {
            function: name.to_string(),
            file: String::new(),
            line: 0,
            style: LocationStyle::ByName,
        };
        match self.ids.get(&location) {
            Some(&id) => id,
            None => self.push(location, None),
        }
    }

    /// Adds a location not interned yet.
    fn push(&mut self, location: SourceLocation, owner: Option<u32>) -> u32 {
        let location = Arc::new(location);
        let slot = Some(Slot {
            location: location.clone(),
            owner,
        });
        let id = match self.free.pop() {
            Some(id) => {
                self.slots[id as usize] = slot;
                id
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        if let Some(pid) = owner {
            *self.held.entry(pid).or_default() += 1;
        }
        self.ids.insert(location, id);
        id
    }

    /// Releases every location `referenced` says no stack refers to (called at a cut,
    /// with the ids the remaining stacks hold): their ids are reused. Returns how many
    /// were released.
    pub fn release(&mut self, referenced: impl Fn(u32) -> bool) -> usize {
        let mut released = 0;
        for (id, slot) in self.slots.iter_mut().enumerate() {
            let id = id as u32;
            if slot.is_none() || referenced(id) {
                continue;
            }
            let Slot { location, owner } = slot.take().expect("checked above");
            self.ids.remove(&location);
            if let Some(pid) = owner {
                if let Some(held) = self.held.get_mut(&pid) {
                    *held -= 1;
                    if *held == 0 {
                        self.held.remove(&pid);
                    }
                }
            }
            self.free.push(id);
            released += 1;
        }
        released
    }

    /// The location of id `id`.
    pub fn get(&self, id: u32) -> Option<Arc<SourceLocation>> {
        let slot = self.slots.get(id as usize)?.as_ref()?;
        Some(slot.location.clone())
    }

    /// Locations held.
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// No location held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

#[cfg(test)]
mod tests {
    use super::*;

    fn at(line: u32) -> SourceLocation {
        SourceLocation {
            function: format!("f{line}"),
            file: "forged.py".into(),
            line,
            style: LocationStyle::WithFile,
        }
    }

    fn name(locations: &SourceLocations, id: u32) -> String {
        locations.get(id).unwrap().function.clone()
    }

    #[test]
    fn released_ids_are_reused_and_kept_ones_keep_their_location() {
        let mut locations = SourceLocations::default();
        let (a, b) = (locations.intern(at(1)), locations.intern(at(2)));
        assert_eq!(locations.release(|id| id == a), 1);
        assert_eq!(locations.get(b), None);
        let c = locations.intern(at(3));
        assert_eq!(c, b, "the released id is reused");
        assert_eq!(
            (name(&locations, a), name(&locations, c)),
            ("f1".into(), "f3".into())
        );
        assert_eq!(locations.intern(at(1)), a, "still interned");
        assert_ne!(locations.intern(at(2)), a, "interned anew");
        assert_eq!(locations.len(), 3);
    }

    #[test]
    fn a_process_past_its_share_reads_as_such_and_others_do_not() {
        let mut locations = SourceLocations::default();
        locations.charge_to(Some(7));
        for line in 0..SOURCE_LOCATIONS_PER_PROCESS as u32 {
            locations.intern(at(line));
        }
        let over = locations.intern(at(u32::MAX));
        assert_eq!(name(&locations, over), PROCESS_LOCATIONS_FULL);
        locations.charge_to(Some(8));
        let other = locations.intern(at(u32::MAX));
        assert_eq!(name(&locations, other), "f4294967295");
        // Process 7's stacks are gone at a cut: its share is free again.
        locations.release(|id| id == other || id == over);
        locations.charge_to(Some(7));
        let again = locations.intern(at(1));
        assert_eq!(name(&locations, again), "f1");
    }

    #[test]
    fn a_full_table_names_frames_again_once_its_stacks_are_gone() {
        let mut locations = SourceLocations::default();
        // Many forging processes, each within its share, fill the table.
        for line in 0..MAX_SOURCE_LOCATIONS as u32 {
            locations.charge_to(Some(line / SOURCE_LOCATIONS_PER_PROCESS as u32));
            locations.intern(at(line));
        }
        locations.charge_to(Some(1_000));
        let full = locations.intern(at(u32::MAX));
        assert_eq!(name(&locations, full), SOURCE_LOCATIONS_FULL);
        // Their profiles were cut: nothing refers to their locations any more.
        locations.release(|_| false);
        assert!(locations.is_empty());
        let named = locations.intern(at(u32::MAX));
        assert_eq!(name(&locations, named), "f4294967295");
    }
}
