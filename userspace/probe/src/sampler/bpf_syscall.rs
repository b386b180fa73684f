//! The `bpf(2)` system call itself, for the commands aya does not offer (batched map
//! operations, uprobe session and multi links): one unsafe call site.

use std::io;

/// Runs `bpf(command, attr, size_of::<T>())` and returns its result (a count, or a new
/// descriptor for commands that make one).
///
/// # Safety
/// `attr` must be a valid, initialised prefix of `union bpf_attr` for `command`, and
/// every pointer inside it must point at a live buffer of the size the command
/// expects, for the length of the call.
pub(super) unsafe fn bpf<T>(command: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: the caller's promise.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            attr as *mut T,
            std::mem::size_of::<T>() as u32,
        )
    };
    match result {
        0.. => Ok(result),
        _ => Err(io::Error::last_os_error()),
    }
}
