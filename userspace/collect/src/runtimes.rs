//! The language runtimes a collection sees processes of: the one place that names them.
//! The engine holds them as a list of [`Runtime`]s and never names one; a new runtime
//! (a crate under `userspace/runtimes/`) is added here.

use allocbpf_go::heap_profile::GoRuntime;
use allocbpf_jvm::JvmRuntime;
use allocbpf_node::NodeRuntime;
use allocbpf_python::runtime::PythonRuntime;
use allocbpf_runtime::Runtime;

/// Every runtime allocbpf knows, each with no process yet.
pub fn supported() -> Vec<Box<dyn Runtime>> {
    vec![
        Box::new(PythonRuntime::default()),
        Box::new(GoRuntime::default()),
        Box::new(JvmRuntime::default()),
        Box::new(NodeRuntime::default()),
    ]
}
