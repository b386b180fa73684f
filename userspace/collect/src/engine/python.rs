//! Python processes: looked at once, when the engine first reads their maps; a CPython
//! process allocbpf knows gets its frames walked by the eBPF program at its samples.

use allocbpf_images::procfs::MapsEntry;

use super::Collector;

impl Collector {
    /// Looks at `pid` (mapping `maps`) for a CPython interpreter and, if it has one
    /// allocbpf knows, has the kernel walk its Python frames. One that it does not know
    /// is profiled natively; the log says why it has no Python frames.
    pub(super) fn look_for_python(&mut self, pid: u32, maps: &[MapsEntry]) {
        let walk = match self.stacks.python.look_at(pid, maps) {
            Ok(Some(process)) => {
                tracing::info!(
                    "pid {pid}: CPython 3.{} in {}: Python frames are walked at its samples",
                    process.minor,
                    process.image.display()
                );
                let (walk, version) = (process.walk, format!("3.{}", process.minor));
                if let Some(tracked) = self.processes.tracked.get_mut(&pid) {
                    tracked.info.python_version = Some(version);
                }
                walk
            }
            Ok(None) => return,
            Err(error) => {
                tracing::warn!("pid {pid} is profiled without Python frames: {error}");
                return;
            }
        };
        if let Err(error) = self.kernel().set_python(pid, walk) {
            tracing::warn!("pid {pid} is profiled without Python frames: {error}");
            self.stacks.python.forget(pid);
        }
    }
}
