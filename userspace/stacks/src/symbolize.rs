//! Symbolization of normalized frames with blazesym.
//!
//! Each distinct frame is symbolized once (results are cached by frame), and blazesym
//! keeps one parsed resolver per module file, so the cost is per module and per unique
//! address, not per sample.
//!
//! blazesym reads no module's file: only a sealed in-memory copy of it, without debug
//! links or compressed sections ([`allocbpf_images::sealed_copy`], kept within a byte
//! budget by `crate::copies`), and it is told of no debug directory: it opens
//! nothing by name. Detached debug files in root's `/usr/lib/debug/.build-id` are
//! opened by `crate::copies` itself, checked, and copied the same way.

use std::{collections::HashMap, sync::Arc};

use blazesym::symbolize::{Symbolized, Symbolizer};

use allocbpf_profile::frame::{
    Frame, FunctionFrame, Functions, Module, SourceLocations, Symbolize, LOST_SAMPLES_NAME,
};

use crate::copies::{Copies, COPY_BUDGET_BYTES};
use crate::normalize::ModuleTable;

/// Cached symbolizer for [`Frame`]s.
pub struct FrameSymbolizer {
    /// `None` when not symbolizing: frames are named `[file+0xoffset]` only.
    symbolizer: Option<Symbolizer>,
    cache: HashMap<Frame, Functions>,
    /// The sealed copies blazesym reads modules from.
    copies: Copies,
}

impl Default for FrameSymbolizer {
    fn default() -> Self {
        Self::new()
    }
}

fn code_location(
    info: Option<&blazesym::symbolize::CodeInfo<'_>>,
) -> (Option<String>, Option<u32>) {
    match info {
        Some(info) => (Some(info.to_path().display().to_string()), info.line),
        None => (None, None),
    }
}

impl FrameSymbolizer {
    /// A symbolizer with demangling, inlined functions and source locations on.
    pub fn new() -> Self {
        let symbolizer = Symbolizer::builder()
            .enable_code_info(true)
            .enable_inlined_fns(true)
            .enable_demangling(true)
            // No directory to look for debug files in (copies carry no debug link
            // anyway). Auto-reload stays on: a sealed copy never changes, and its
            // inode check keeps a descriptor number reused by a later copy from ever
            // finding a dropped copy's entry.
            .set_debug_dirs(Some::<[&std::path::Path; 0]>([]))
            .build();
        Self {
            symbolizer: Some(symbolizer),
            cache: HashMap::new(),
            copies: Copies::new(COPY_BUDGET_BYTES),
        }
    }

    /// No symbolization: no debug info is read; frames keep module + offset only, for a
    /// symbolizer elsewhere (pprof mappings carry the build ids).
    pub fn unsymbolized() -> Self {
        Self {
            symbolizer: None,
            cache: HashMap::new(),
            copies: Copies::new(0),
        }
    }

    /// False for [`FrameSymbolizer::unsymbolized`].
    pub fn symbolizes(&self) -> bool {
        self.symbolizer.is_some()
    }

    /// Symbolizes every frame in `frames` not yet in the cache, one batch per module;
    /// runtime frames are named from `locations`.
    pub fn prepare<'a>(
        &mut self,
        modules: &ModuleTable,
        locations: &SourceLocations,
        frames: impl Iterator<Item = &'a Frame>,
    ) {
        let mut by_module: HashMap<u32, Vec<u64>> = HashMap::new();
        for frame in frames {
            if self.cache.contains_key(frame) {
                continue;
            }
            match *frame {
                Frame::Module { module, offset } => {
                    by_module.entry(module).or_default().push(offset)
                }
                Frame::Unknown(addr) => {
                    let name = format!("[unknown 0x{addr:x}]");
                    self.cache.insert(*frame, unresolved(name));
                }
                Frame::Lost => {
                    self.cache
                        .insert(*frame, unresolved(LOST_SAMPLES_NAME.to_string()));
                }
                Frame::Runtime(id) => {
                    self.cache.insert(*frame, locations.functions(id));
                }
            }
        }
        for (module_id, mut offsets) in by_module {
            offsets.sort_unstable();
            offsets.dedup();
            let (Some(module), Some((file, identity))) =
                (modules.get(module_id), modules.file(module_id))
            else {
                continue;
            };
            // Return addresses point after the call; the call itself is one byte earlier.
            let lookups: Vec<u64> = offsets.iter().map(|o| o.saturating_sub(1)).collect();
            let results = match self.symbolizer.as_mut() {
                Some(symbolizer) => crate::copies::symbolize_module(
                    &mut self.copies,
                    symbolizer,
                    (file, identity),
                    module.build_id.as_deref(),
                    &lookups,
                ),
                None => Vec::new(),
            };
            for (i, &offset) in offsets.iter().enumerate() {
                let functions = match results.get(i) {
                    Some(Symbolized::Sym(sym)) => {
                        let mut functions = Vec::with_capacity(sym.inlined.len() + 1);
                        // blazesym lists inlined functions outermost first; each one's
                        // code info is its call site in the function before it, and the
                        // symbol's own code info is the innermost location.
                        let mut location = code_location(sym.code_info.as_deref());
                        for inlined in sym.inlined.iter().rev() {
                            functions.push(FunctionFrame {
                                name: inlined.name.to_string(),
                                file: location.0.take(),
                                line: location.1.take(),
                                shown: None,
                            });
                            location = code_location(inlined.code_info.as_ref());
                        }
                        functions.push(FunctionFrame {
                            name: sym.name.to_string(),
                            file: location.0,
                            line: location.1,
                            shown: None,
                        });
                        functions.into()
                    }
                    _ => unresolved(format!("[{}+0x{offset:x}]", module.file_name())),
                };
                self.cache.insert(
                    Frame::Module {
                        module: module_id,
                        offset,
                    },
                    functions,
                );
            }
        }
    }

    /// The functions at `frame`; frames not prepared yet come back unresolved.
    pub fn functions(&self, frame: &Frame) -> Functions {
        self.cache
            .get(frame)
            .cloned()
            .unwrap_or_else(|| unresolved(format!("{frame:?}")))
    }
}

/// A [`FrameSymbolizer`] with the module table and the location table its frames
/// index: the [`Symbolize`] step a report asks for.
pub struct ModuleSymbolizer<'a> {
    symbolizer: &'a mut FrameSymbolizer,
    modules: &'a ModuleTable,
    locations: &'a SourceLocations,
}

impl FrameSymbolizer {
    /// This symbolizer, reading the files of `modules` and the runtime frames of
    /// `locations` (a [`crate::resolve::StackResolver`]'s).
    pub fn for_frames<'a>(
        &'a mut self,
        modules: &'a ModuleTable,
        locations: &'a SourceLocations,
    ) -> ModuleSymbolizer<'a> {
        ModuleSymbolizer {
            symbolizer: self,
            modules,
            locations,
        }
    }
}

impl Symbolize for ModuleSymbolizer<'_> {
    fn prepare(&mut self, frames: &mut dyn Iterator<Item = &Frame>) {
        self.symbolizer
            .prepare(self.modules, self.locations, frames);
    }

    fn functions(&self, frame: &Frame) -> Functions {
        self.symbolizer.functions(frame)
    }

    fn symbolizes(&self) -> bool {
        self.symbolizer.symbolizes()
    }

    fn modules(&self) -> Vec<Module> {
        self.modules.all().to_vec()
    }
}

fn unresolved(name: String) -> Functions {
    Arc::from(vec![FunctionFrame {
        name,
        file: None,
        line: None,
        shown: None,
    }])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::normalize::AddressNormalizer;

    #[inline(never)]
    fn a_function_with_a_known_name() -> u64 {
        // The address just past the start, as a return address would be.
        a_function_with_a_known_name as *const () as u64 + 1
    }

    #[test]
    #[ignore = "needs root: opens files through /proc/PID/map_files (cargo xtask test runs it in its root lane)"]
    fn own_function_symbolizes_by_name() {
        let mut normalizer = AddressNormalizer::new();
        let frames = normalizer.normalize(std::process::id(), &[a_function_with_a_known_name()]);
        let mut symbolizer = FrameSymbolizer::new();
        symbolizer.prepare(&normalizer.modules, &Default::default(), frames.iter());
        let functions = symbolizer.functions(&frames[0]);
        let names: Vec<&str> = functions.iter().map(|f| f.name.as_str()).collect();
        assert!(
            names
                .iter()
                .any(|n| n.contains("a_function_with_a_known_name")),
            "{names:?}"
        );
    }

    /// The C library's frames are named from its detached debug file when one is
    /// installed (libc6-dbg): static functions too, which its own symbols lack; and
    /// through the symbolizer's own path (a module table's file).
    #[test]
    fn a_detached_debug_file_names_static_functions() {
        use object::{Object, ObjectSegment, ObjectSymbol};
        let path = "/usr/lib/x86_64-linux-gnu/libc.so.6";
        let libc = std::fs::File::open(path).unwrap();
        let id = allocbpf_images::sealed_copy::read_build_id(&libc).unwrap();
        let Some(debug) = allocbpf_images::sealed_copy::open_debug_file(&id) else {
            eprintln!("no debug file for libc installed: nothing to check");
            return;
        };
        // A static function's address, from the debug file, and its file offset in
        // libc, from libc's segments (`__libc_start_call_main`, which calls main).
        let debug_data = std::fs::read(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&debug)
        ))
        .unwrap();
        let debug_elf = object::File::parse(&*debug_data).unwrap();
        let address = debug_elf
            .symbols()
            .find(|s| s.name() == Ok("__libc_start_call_main"))
            .expect("__libc_start_call_main in libc's debug symbols")
            .address();
        let libc_data = std::fs::read(path).unwrap();
        let libc_elf = object::File::parse(&*libc_data).unwrap();
        assert!(!libc_elf
            .symbols()
            .chain(libc_elf.dynamic_symbols())
            .any(|s| s.name() == Ok("__libc_start_call_main")));
        let offset = libc_elf
            .segments()
            .find_map(|s| {
                let (start, len) = s.file_range();
                (s.address() <= address && address < s.address() + len)
                    .then(|| address - s.address() + start)
            })
            .unwrap();

        let mut table = crate::normalize::ModuleTable::default();
        let module = table.intern(
            allocbpf_profile::frame::Module {
                path: path.into(),
                build_id: Some(id),
            },
            None,
            Some(std::sync::Arc::new(libc)),
        );
        // A return address just past the start (the lookup is one byte earlier).
        let frame = allocbpf_profile::frame::Frame::Module {
            module,
            offset: offset + 5,
        };
        let mut symbolizer = crate::symbolize::FrameSymbolizer::new();
        symbolizer.prepare(&table, &Default::default(), [frame].iter());
        let functions = symbolizer.functions(&frame);
        let names: Vec<&str> = functions.iter().map(|f| f.name.as_str()).collect();
        assert!(names.contains(&"__libc_start_call_main"), "{names:?}");
        assert!(functions.iter().any(|f| f.line.is_some()), "{functions:?}");
    }
}
