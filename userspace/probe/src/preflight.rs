//! Checks that run before anything is loaded, so failures come with a clear fix.

use std::path::Path;

/// Why allocbpf cannot start.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    /// Missing capabilities.
    #[error(
        "allocbpf needs root, or the CAP_BPF and CAP_PERFMON capabilities, to load eBPF \
         programs and attach uprobes; run it with sudo"
    )]
    Privileges,
    /// No BTF.
    #[error(
        "this kernel exposes no BTF (/sys/kernel/btf/vmlinux is missing); allocbpf needs a \
         kernel built with CONFIG_DEBUG_INFO_BTF=y"
    )]
    NoBtf,
    /// No uprobes.
    #[error(
        "this kernel has no uprobe support (/sys/bus/event_source/devices/uprobe is missing); \
         allocbpf needs CONFIG_UPROBES=y and CONFIG_UPROBE_EVENTS=y"
    )]
    NoUprobes,
}

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Effective capability mask from a `/proc/self/status` text.
fn effective_capabilities(status: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0)
}

/// True if a capability mask allows loading tracing programs and attaching uprobes.
fn capabilities_suffice(caps: u64) -> bool {
    let has = |cap: u32| caps & (1u64 << cap) != 0;
    has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON))
}

/// Fails unless this process may load tracing programs.
pub fn check_privileges() -> Result<(), PreflightError> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if capabilities_suffice(effective_capabilities(&status)) {
        Ok(())
    } else {
        Err(PreflightError::Privileges)
    }
}

/// Keeps large buffers (whole files read to examine them, often 5-25 MB) out of the
/// heap. glibc raises its mmap threshold to the size of each large block freed, after
/// which such buffers come from the heap, whose pages stay resident once freed: the
/// agent's heap held ~40 MiB that way. A fixed 128 KiB threshold (glibc's initial one)
/// maps every large buffer on its own and returns it to the kernel when freed.
pub fn keep_large_buffers_out_of_the_heap() {
    // SAFETY: mallopt only changes allocator tunables; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// Raises the soft limit on open descriptors to the hard limit and returns it: the
/// profiler holds one descriptor per allocator image and per module of a sampled
/// process, which on a busy host exceeds the usual soft limit of 1,024.
pub fn raise_descriptor_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 0;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                return raised.rlim_cur;
            }
        }
    }
    limit.rlim_cur
}

/// Fails unless the kernel has the features allocbpf needs.
pub fn check_kernel() -> Result<(), PreflightError> {
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Err(PreflightError::NoBtf);
    }
    if !Path::new("/sys/bus/event_source/devices/uprobe").exists() {
        return Err(PreflightError::NoUprobes);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_rules() {
        let status = "Name:\tx\nCapEff:\t000001ffffffffff\n";
        assert!(capabilities_suffice(effective_capabilities(status)));
        let bpf_and_perfmon = (1u64 << CAP_BPF) | (1u64 << CAP_PERFMON);
        assert!(capabilities_suffice(bpf_and_perfmon));
        assert!(!capabilities_suffice(1u64 << CAP_BPF));
        assert!(!capabilities_suffice(effective_capabilities(
            "CapEff:\t0000000000000000\n"
        )));
        assert!(!capabilities_suffice(effective_capabilities("")));
    }
}
