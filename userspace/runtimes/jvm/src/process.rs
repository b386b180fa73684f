//! Is a process a HotSpot JVM, and can allocbpf read it? Found from the file mapped as
//! `libjvm.so` that exports HotSpot's structure tables (`gHotSpotVMStructs`...); its
//! version and layout come from the tables themselves, read from the process's memory.
//!
//! Files are read through the kernel's link to the very file mapped
//! (`allocbpf_images::procfs::open_mapped`: checked, size-capped), and once per file.

use allocbpf_images::{
    allocators, examined::ExaminedFiles, memory::ProcessMemory, procfs::MapsEntry,
};
use object::{Object, ObjectSegment, ObjectSymbol};

use crate::{
    code::CodeCache,
    layout::{Layout, CONSTANTS, TYPES},
    names::Names,
    vmstructs::{TableSymbols, VmStructs, SYMBOLS},
    JvmError,
};

/// What a libjvm file says, whichever process maps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JvmFile {
    /// The `gHotSpotVM*` symbols' addresses in the file.
    symbols: Vec<(&'static str, u64)>,
    /// The lowest address of its loadable segments (mapped at file offset 0).
    first_address: u64,
    /// It defines HotSpot's allocation tracer (what the probes sit on): a stripped
    /// build has the tables but not these local symbols.
    pub tracer: bool,
}

/// How long the code and names read from a JVM are believed: compiled methods are
/// freed and their space reused, classes unloaded, so what was read is read again now
/// and then.
pub const REFRESH_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// A JVM allocbpf reads.
pub struct JvmProcess {
    /// Its memory.
    pub memory: ProcessMemory,
    /// Its structures' offsets.
    pub layout: Layout,
    /// Its interpreter and code heaps.
    pub code: CodeCache,
    /// Names read from it.
    pub names: Names,
    /// The libjvm it runs.
    pub image: std::path::PathBuf,
    /// Its libjvm defines the allocation tracer the probes sit on.
    pub tracer: bool,
    /// When the code and names read were last forgotten.
    pub refreshed: std::time::Instant,
}

/// libjvm files examined.
#[derive(Default)]
pub struct JvmFiles {
    files: ExaminedFiles<JvmFile>,
}

impl JvmProcess {
    /// Forgets what was read of its code and names once [`REFRESH_EVERY`] has passed.
    pub fn refresh_due(&mut self) {
        if self.refreshed.elapsed() >= REFRESH_EVERY {
            self.code.forget_blobs();
            self.names.clear();
            self.refreshed = std::time::Instant::now();
        }
    }
}

impl JvmFiles {
    /// Opens that failed for want of descriptors so far.
    pub fn descriptor_errors(&self) -> u64 {
        self.files.descriptor_errors
    }

    /// The JVM in `pid`'s mappings: `Ok(None)` when it maps no `libjvm.so` exporting
    /// HotSpot's tables.
    pub fn discover(
        &mut self,
        pid: u32,
        maps: &[MapsEntry],
    ) -> Result<Option<JvmProcess>, JvmError> {
        let named = |name: &std::ffi::OsStr| name == "libjvm.so";
        let Some((mapping, path, file)) = self.files.find(pid, maps, named, examine) else {
            return Ok(None);
        };
        let bias = mapping.range.start.wrapping_sub(file.first_address);
        let symbols = TableSymbols {
            addresses: (file.symbols.iter())
                .map(|&(name, address)| (name, address.wrapping_add(bias)))
                .collect(),
        };
        let memory = ProcessMemory::new(pid);
        let vm = VmStructs::read(&memory, &symbols, TYPES, CONSTANTS)?;
        let major_at = vm.address("Abstract_VM_Version", "_vm_major_version")?;
        let major = (memory.i32(major_at)).map_err(|_| JvmError::Unreadable("the VM's version"))?;
        let major = u32::try_from(major).map_err(|_| JvmError::Forged("the VM's version"))?;
        let layout = Layout::from_tables(&vm, major)?;
        let code =
            CodeCache::read(&memory, &layout).ok_or(JvmError::Unreadable("the code cache"))?;
        Ok(Some(JvmProcess {
            memory,
            layout,
            code,
            names: Names::default(),
            image: path.to_path_buf(),
            tracer: file.tracer,
            refreshed: std::time::Instant::now(),
        }))
    }
}

/// Reads one parsed libjvm: its table symbols, or `None` when it exports none.
fn examine(elf: &object::File<'_>) -> Option<JvmFile> {
    let symbols: Vec<(&'static str, u64)> = (SYMBOLS.iter())
        .filter_map(|&wanted| {
            let symbol = elf
                .dynamic_symbols()
                .find(|s| s.is_definition() && s.name() == Ok(wanted))?;
            Some((wanted, symbol.address()))
        })
        .collect();
    if symbols.len() != SYMBOLS.len() {
        return None;
    }
    let first_address = elf.segments().map(|s| s.address()).min()?;
    let tracer = elf.symbols().any(|s| {
        s.is_definition()
            && s.name()
                .is_ok_and(|n| allocators::JVM_NEW_TLAB_NAMES.contains(&n))
    });
    Some(JvmFile {
        symbols,
        first_address,
        tracer,
    })
}
