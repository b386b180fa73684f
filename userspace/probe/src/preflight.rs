//! Checks that run before anything is loaded, so failures come with a clear fix.

use std::{
    fs::File,
    io::Write,
    os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt},
    path::Path,
};

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
    /// The output file cannot be written.
    #[error("cannot write the output file {path}")]
    Output {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The output path is one allocbpf refuses to write (another user's file, a
    /// symbolic link to a regular file).
    #[error("refusing to write the output file {path}: {reason}")]
    OutputRefused {
        /// The path.
        path: String,
        /// Why, and what to do instead.
        reason: String,
    },
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

/// Where the profile goes, opened before profiling starts.
pub enum Sink {
    /// Standard output.
    Stdout,
    /// A file, opened (not yet truncated: an earlier profile survives a failed run).
    File {
        /// Its path, for messages.
        path: std::path::PathBuf,
        /// The open file.
        file: File,
    },
}

impl Sink {
    /// Opens `path` for writing, or stdout for `None` (and for `/dev/stdout`,
    /// `/dev/fd/1`, `/proc/self/fd/1`). Fails if it cannot be written.
    ///
    /// allocbpf runs as root, often in a directory others can write (`/tmp`), and a
    /// profile reveals the target's code: a new file is created 0600; the last path
    /// component is never followed as a symbolic link to a regular file (whoever
    /// planted the link would choose which file root overwrites), only to a device or
    /// FIFO (`/dev/null`, a pipe), which have no content to lose; and an existing
    /// regular file must belong to the user allocbpf runs as.
    pub fn open(path: Option<&Path>) -> Result<Sink, PreflightError> {
        let Some(path) = path else {
            return Ok(Sink::Stdout);
        };
        if ["/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"]
            .iter()
            .any(|stdout| path == Path::new(stdout))
        {
            return Ok(Sink::Stdout);
        }
        let shown = || path.display().to_string();
        let output_error = |source| PreflightError::Output {
            path: shown(),
            source,
        };
        let refused = |reason: String| PreflightError::OutputRefused {
            path: shown(),
            reason,
        };
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path);
        let file = match opened {
            Ok(file) => file,
            // The last component is a symbolic link: through it only to a device or a
            // FIFO, checked on what was opened (no O_CREAT: a dangling link creates
            // nothing; not truncated: a regular file found there is left as it was).
            Err(error) if error.raw_os_error() == Some(libc::ELOOP) => {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_CLOEXEC)
                    .open(path)
                    .map_err(output_error)?;
                let kind = file.metadata().map_err(output_error)?.file_type();
                if !(kind.is_char_device() || kind.is_fifo() || kind.is_socket()) {
                    return Err(refused(
                        "it is a symbolic link, and allocbpf writes no file through one \
                         (another user could have pointed it at any file); give the \
                         link's target, or omit --output to write to standard output"
                            .into(),
                    ));
                }
                file
            }
            Err(source) => return Err(output_error(source)),
        };
        let metadata = file.metadata().map_err(output_error)?;
        // SAFETY: geteuid has no failure mode.
        let euid = unsafe { libc::geteuid() };
        if metadata.is_file() && metadata.uid() != euid {
            return Err(refused(format!(
                "it exists and belongs to uid {}, not to uid {euid} that allocbpf runs as; \
                 remove it or choose another path",
                metadata.uid()
            )));
        }
        Ok(Sink::File {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Replaces the sink's content with what `write` produces.
    pub fn write_with(
        self,
        write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<(), PreflightError> {
        let (path, result) = match self {
            Sink::Stdout => {
                let mut lock = std::io::stdout().lock();
                let result = write(&mut lock).and_then(|()| lock.flush());
                ("standard output".into(), result)
            }
            Sink::File { path, file } => {
                // Only a regular file has old content to drop; /dev/null, /dev/stdout and
                // FIFOs reject truncation.
                let is_regular = file.metadata().map(|m| m.is_file()).unwrap_or(false);
                let truncated = if is_regular { file.set_len(0) } else { Ok(()) };
                let result = truncated.and_then(|()| {
                    let mut buffered = std::io::BufWriter::new(&file);
                    write(&mut buffered)?;
                    buffered.flush()
                });
                (path.display().to_string(), result)
            }
        };
        result.map_err(|source| PreflightError::Output { path, source })
    }
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

    #[test]
    fn devices_are_written_without_truncation() {
        let sink = Sink::open(Some(Path::new("/dev/null"))).unwrap();
        sink.write_with(|out| out.write_all(b"profile")).unwrap();
    }

    #[test]
    fn a_regular_file_loses_its_old_content() {
        let path = std::env::temp_dir().join(format!("allocbpf-sink-{}", std::process::id()));
        std::fs::write(&path, "an older, longer profile").unwrap();
        let sink = Sink::open(Some(&path)).unwrap();
        sink.write_with(|out| out.write_all(b"new")).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_new_output_file_is_private_and_no_link_to_a_file_is_followed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("allocbpf-sink-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // Created 0600, whatever the umask.
        let new = dir.join("profile.json");
        Sink::open(Some(&new))
            .unwrap()
            .write_with(|out| out.write_all(b"{}"))
            .unwrap();
        let mode = std::fs::metadata(&new).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // A symbolic link to a regular file: refused, the file left alone.
        let victim = dir.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let link = dir.join("link.json");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let error = Sink::open(Some(&link)).err().unwrap().to_string();
        assert!(
            error.contains("symbolic link") && error.contains("link.json"),
            "{error}"
        );
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        // A dangling one creates nothing.
        let dangling = dir.join("dangling.json");
        std::os::unix::fs::symlink(dir.join("nothing"), &dangling).unwrap();
        assert!(Sink::open(Some(&dangling)).is_err());
        assert!(!dir.join("nothing").exists());
        // A link to a device is fine, and /dev/stdout is standard output.
        let to_null = dir.join("null");
        std::os::unix::fs::symlink("/dev/null", &to_null).unwrap();
        Sink::open(Some(&to_null))
            .unwrap()
            .write_with(|out| out.write_all(b"profile"))
            .unwrap();
        assert!(matches!(
            Sink::open(Some(Path::new("/dev/stdout"))),
            Ok(Sink::Stdout)
        ));
        // Another user's file (root can make one).
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&victim, Some(65534), None).unwrap();
            let error = Sink::open(Some(&victim)).err().unwrap().to_string();
            assert!(error.contains("belongs to uid 65534"), "{error}");
            assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unwritable_output_fails_early() {
        let err = Sink::open(Some(Path::new("/nonexistent-dir/profile.pb.gz")))
            .err()
            .unwrap();
        assert!(err.to_string().contains("/nonexistent-dir/profile.pb.gz"));
    }
}
