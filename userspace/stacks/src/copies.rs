//! The sealed copies a symbolizer reads modules from, bounded in bytes.
//!
//! blazesym never reads a module's file: it reads a sealed in-memory copy of it
//! ([`allocbpf_images::sealed_copy`]), made at the first symbolization of the module by
//! a [`crate::symbolize::FrameSymbolizer`] (one per interval). Copies take memory (they
//! hold symbol tables and DWARF), so at most [`COPY_BUDGET_BYTES`] of them are kept: a
//! new copy first drops the least recently used ones until it fits (a single copy may
//! fill the budget alone, up to [`allocbpf_images::sealed_copy::MAX_COPY_BYTES`]), and
//! each copy dropped is evicted from blazesym's cache with it (which holds its own
//! descriptor and mapping of the copy). A module dropped and needed again later in the
//! interval is copied again. A file refused (not ELF, hostile headers) is remembered
//! and not planned again.
//!
//! A module without DWARF of its own may have a detached debug file installed by root
//! under its build id ([`allocbpf_images::sealed_copy::open_debug_file`]: Debian's
//! `libc6-dbg` for the C library): that file is copied the same way, and named by
//! [`Copies::debug`]. blazesym itself is told of no debug directory.

use std::{collections::HashMap, fs::File, path::PathBuf};

use allocbpf_images::sealed_copy::{
    open_debug_file, CopyPlan, FileIdentity, SealedCopy, MAX_COPY_BYTES,
};
use blazesym::symbolize::{
    evict,
    source::{Elf, Source},
    Input, Symbolized, Symbolizer,
};

/// Bytes of sealed copies a symbolizer keeps at once. The agent runs under a 1 GiB
/// memory limit and copies are memory (shmem, not page cache the kernel could reclaim):
/// a quarter of it. The largest copy, alone, fits.
pub const COPY_BUDGET_BYTES: u64 = MAX_COPY_BYTES;

/// A module file's copy: `None` if it was refused.
struct Entry {
    copy: Option<SealedCopy>,
    used: u64,
}

/// Sealed copies by file identity, least recently used dropped first.
pub(crate) struct Copies {
    entries: HashMap<FileIdentity, Entry>,
    /// Detached debug files by build id, held open (`None`: none installed).
    debug_files: HashMap<Vec<u8>, Option<(File, FileIdentity)>>,
    /// Bytes of the copies held.
    bytes: u64,
    budget: u64,
    clock: u64,
}

impl Copies {
    /// No copy yet; at most `budget` bytes of them kept.
    pub(crate) fn new(budget: u64) -> Copies {
        Copies {
            entries: HashMap::new(),
            debug_files: HashMap::new(),
            bytes: 0,
            budget,
            clock: 0,
        }
    }

    /// Bytes of the copies held now.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The path blazesym reads for the file `file`, whose identity is `identity`: its
    /// sealed copy (`/proc/self/fd/N`), made now if there is none. `None` if the file
    /// is refused. Copies dropped to make room are evicted from `symbolizer`.
    #[cfg(test)]
    pub(crate) fn path(
        &mut self,
        identity: FileIdentity,
        file: &File,
        symbolizer: &mut Symbolizer,
    ) -> Option<PathBuf> {
        self.copy(identity, file, symbolizer).map(SealedCopy::path)
    }

    /// The sealed copy of `file` ([`Copies::path`]).
    pub(crate) fn copy(
        &mut self,
        identity: FileIdentity,
        file: &File,
        symbolizer: &mut Symbolizer,
    ) -> Option<&SealedCopy> {
        self.copy_keeping(identity, file, symbolizer, None)
    }

    /// [`Copies::copy`], never dropping the copy of `keep` to make room (one in use).
    fn copy_keeping(
        &mut self,
        identity: FileIdentity,
        file: &File,
        symbolizer: &mut Symbolizer,
        keep: Option<FileIdentity>,
    ) -> Option<&SealedCopy> {
        self.clock += 1;
        if self.entries.contains_key(&identity) {
            let entry = self.entries.get_mut(&identity)?;
            entry.used = self.clock;
            return entry.copy.as_ref();
        }
        let copy = CopyPlan::new(file)
            .and_then(|plan| {
                self.make_room(plan.bytes(), symbolizer, keep);
                plan.copy(file)
            })
            .map_err(|error| tracing::debug!("module not symbolized: {error}"))
            .ok();
        self.bytes += copy.as_ref().map_or(0, SealedCopy::bytes);
        let entry = self.entries.entry(identity).or_insert(Entry {
            copy,
            used: self.clock,
        });
        entry.copy.as_ref()
    }

    /// The path blazesym reads for the detached debug file of build id `build_id`: a
    /// sealed copy of root's file, if one is installed and copies with its DWARF. The
    /// copy of `module` (in use) is not dropped to make room for it.
    pub(crate) fn debug(
        &mut self,
        build_id: &[u8],
        symbolizer: &mut Symbolizer,
        module: FileIdentity,
    ) -> Option<PathBuf> {
        let opened = self
            .debug_files
            .entry(build_id.to_vec())
            .or_insert_with(|| {
                let file = open_debug_file(build_id)?;
                let identity = FileIdentity::of(&file).ok()?;
                Some((file, identity))
            });
        let (file, identity) = opened.as_ref()?;
        let file = file.try_clone().ok()?;
        let identity = *identity;
        let copy = self.copy_keeping(identity, &file, symbolizer, Some(module))?;
        copy.has_debug_info().then(|| copy.path())
    }

    /// Drops the least recently used copies but `keep`'s until `bytes` more fit in the
    /// budget (or none is left).
    fn make_room(&mut self, bytes: u64, symbolizer: &mut Symbolizer, keep: Option<FileIdentity>) {
        while self.bytes + bytes > self.budget {
            let Some((&oldest, _)) = self
                .entries
                .iter()
                .filter(|(identity, entry)| entry.copy.is_some() && Some(**identity) != keep)
                .min_by_key(|(_, entry)| entry.used)
            else {
                return;
            };
            let Some(Entry {
                copy: Some(copy), ..
            }) = self.entries.remove(&oldest)
            else {
                continue;
            };
            // blazesym's entry holds a descriptor and a mapping of the copy: without
            // this the memory would stay, and a later copy given the same descriptor
            // number would find a stale entry under the same path.
            let _ = symbolizer.evict(&evict::Elf::new(copy.path()).into());
            self.bytes -= copy.bytes();
        }
    }
}

/// Symbolizes file offsets `offsets` of the module whose file is `file` (identity
/// `identity`, build id `build_id`): from its sealed copy and, if that has no DWARF,
/// from the detached debug file of its build id where one is installed (which wins
/// where it names something). Empty if the file is refused.
pub(crate) fn symbolize_module<'s>(
    copies: &mut Copies,
    symbolizer: &'s mut Symbolizer,
    (file, identity): (&File, FileIdentity),
    build_id: Option<&[u8]>,
    offsets: &[u64],
) -> Vec<Symbolized<'s>> {
    let Some(copy) = copies.copy(identity, file, symbolizer) else {
        return Vec::new();
    };
    let path = copy.path();
    // The debug file's symbols are virtual addresses: translated through the module's
    // own segments (a debug file's segments hold no bytes).
    let debug = match (copy.has_debug_info(), build_id) {
        (false, Some(id)) => {
            let addresses: Vec<Option<u64>> =
                offsets.iter().map(|&o| copy.virtual_offset(o)).collect();
            copies
                .debug(id, symbolizer, identity)
                .map(|debug_path| (debug_path, addresses))
        }
        _ => None,
    };
    let symbolizer: &'s Symbolizer = symbolizer;
    let mut results = symbolizer
        .symbolize(&Source::Elf(Elf::new(path)), Input::FileOffset(offsets))
        .unwrap_or_default();
    let Some((debug_path, addresses)) = debug else {
        return results;
    };
    let known: Vec<u64> = addresses.iter().flatten().copied().collect();
    let Ok(from_debug) = symbolizer.symbolize(
        &Source::Elf(Elf::new(debug_path)),
        Input::VirtOffset(&known),
    ) else {
        return results;
    };
    results.resize_with(offsets.len(), || {
        Symbolized::Unknown(blazesym::symbolize::Reason::UnknownAddr)
    });
    let mut from_debug = from_debug.into_iter();
    for (result, address) in results.iter_mut().zip(&addresses) {
        if address.is_none() {
            continue;
        }
        if let Some(named @ Symbolized::Sym(_)) = from_debug.next() {
            *result = named;
        }
    }
    results
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(file: &File) -> FileIdentity {
        FileIdentity::of(file).unwrap()
    }

    fn run(command: &mut std::process::Command) {
        let status = command.status().expect("gcc and binutils are installed");
        assert!(status.success(), "{command:?}");
    }

    /// A C program built in `dir` with `flags`, and the file offset of its function
    /// `copied_site`.
    fn program(dir: &std::path::Path, flags: &[&str]) -> (PathBuf, u64) {
        use object::{Object, ObjectSegment, ObjectSymbol};
        let source = dir.join("prog.c");
        std::fs::write(
            &source,
            "#include <stdlib.h>\n\
             __attribute__((noinline)) void *copied_site(int n) {\n\
             \treturn malloc(n * 3);\n\
             }\n\
             int main(int argc, char **argv) { free(copied_site(argc)); return 0; }\n",
        )
        .unwrap();
        let binary = dir.join("prog");
        run(std::process::Command::new("gcc")
            .args(flags)
            .arg("-o")
            .arg(&binary)
            .arg(&source));
        let data = std::fs::read(&binary).unwrap();
        let elf = object::File::parse(&*data).unwrap();
        let address = elf
            .symbols()
            .find(|s| s.name() == Ok("copied_site"))
            .unwrap()
            .address();
        let offset = elf
            .segments()
            .find_map(|s| {
                let (start, len) = s.file_range();
                (s.address() <= address && address < s.address() + len)
                    .then(|| address - s.address() + start)
            })
            .unwrap();
        (binary, offset)
    }

    /// Symbolizes `offset` of `binary` through its sealed copy, on a thread: `None` if
    /// that takes over 20 s (a hang).
    fn symbolize_copy(binary: &std::path::Path, offset: u64) -> Option<(String, Option<u32>)> {
        let binary = binary.to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut symbolizer = Symbolizer::builder()
                .set_debug_dirs(Some::<[&std::path::Path; 0]>([]))
                .build();
            let file = File::open(&binary).unwrap();
            let mut copies = Copies::new(COPY_BUDGET_BYTES);
            let path = copies
                .path(identity(&file), &file, &mut symbolizer)
                .unwrap();
            let result = symbolizer
                .symbolize_single(&Source::Elf(Elf::new(path)), Input::FileOffset(offset))
                .unwrap();
            let named = result.as_sym().map(|sym| {
                (
                    sym.name.to_string(),
                    sym.code_info.as_ref().and_then(|info| info.line),
                )
            });
            let _ = tx.send(named);
        });
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("symbolization hung")
    }

    /// Line numbers come through the copy, compressed debug sections included.
    #[test]
    fn copies_keep_line_numbers() {
        let dir = std::env::temp_dir().join(format!("copies-lines-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for flags in [&["-g", "-O1"][..], &["-g", "-O1", "-gz=zlib"][..]] {
            let (binary, offset) = program(&dir, flags);
            let (name, line) = symbolize_copy(&binary, offset + 4).unwrap();
            assert_eq!(name, "copied_site", "{flags:?}");
            assert!(matches!(line, Some(2..=3)), "{flags:?}: line {line:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A debug link naming a FIFO (next to the binary, and in its `.debug`) is not
    /// followed: symbolization returns, with the symbol table's names.
    #[test]
    fn copies_follow_no_debug_link_to_a_fifo() {
        let dir = std::env::temp_dir().join(format!("copies-fifo-{}", std::process::id()));
        std::fs::create_dir_all(dir.join(".debug")).unwrap();
        let (binary, offset) = program(&dir, &["-g", "-O1"]);
        let debug = dir.join("prog.debug");
        run(std::process::Command::new("objcopy")
            .arg("--only-keep-debug")
            .arg(&binary)
            .arg(&debug));
        run(std::process::Command::new("strip").arg("-g").arg(&binary));
        run(std::process::Command::new("objcopy")
            .arg("--add-gnu-debuglink=prog.debug")
            .arg(&binary)
            .current_dir(&dir));
        std::fs::remove_file(&debug).unwrap();
        for fifo in [debug, dir.join(".debug/prog.debug")] {
            run(std::process::Command::new("mkfifo").arg(fifo));
        }
        let (name, _) = symbolize_copy(&binary, offset + 4).unwrap();
        assert_eq!(name, "copied_site");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn copies_are_made_once_bounded_and_evicted() {
        let mut symbolizer = Symbolizer::new();
        let exe = File::open("/proc/self/exe").unwrap();
        let libc_path = allocbpf_images::procfs::read_maps(std::process::id())
            .into_iter()
            .find_map(|e| {
                e.file_path()
                    .filter(|p| p.file_name().is_some_and(|n| n == "libc.so.6"))
                    .map(|p| p.to_path_buf())
            })
            .expect("tests run on glibc");
        let libc = File::open(libc_path).unwrap();
        let exe_bytes = CopyPlan::new(&exe).unwrap().bytes();
        let libc_bytes = CopyPlan::new(&libc).unwrap().bytes();
        // Room for either, not both.
        let mut copies = Copies::new(exe_bytes.max(libc_bytes));
        let first = copies.path(identity(&exe), &exe, &mut symbolizer).unwrap();
        assert_eq!(
            copies.path(identity(&exe), &exe, &mut symbolizer),
            Some(first.clone()),
            "made once"
        );
        // blazesym reads the copy (its cache now holds it).
        let results = symbolizer
            .symbolize(&Source::Elf(Elf::new(&first)), Input::FileOffset(&[0x1000]))
            .unwrap();
        assert_eq!(results.len(), 1);
        copies
            .path(identity(&libc), &libc, &mut symbolizer)
            .unwrap();
        assert_eq!(
            copies.bytes(),
            libc_bytes,
            "the executable's copy was dropped"
        );
        // A copy in use is not dropped for another: both held, over the budget.
        copies.copy_keeping(identity(&exe), &exe, &mut symbolizer, Some(identity(&libc)));
        assert_eq!(copies.bytes(), libc_bytes + exe_bytes);
        assert!(copies.entries[&identity(&libc)].copy.is_some());
        // Refused files are remembered, and take nothing.
        let text = File::open("/proc/self/cmdline").unwrap();
        assert_eq!(copies.path(identity(&text), &text, &mut symbolizer), None);
        assert_eq!(copies.bytes(), libc_bytes + exe_bytes);
    }
}
