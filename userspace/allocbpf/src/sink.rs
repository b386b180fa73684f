//! Where the profile goes: standard output or a file, opened before profiling starts
//! so that a path that cannot be written fails at once, and written only by the
//! binary (the libraries print nothing).

use std::{
    fs::File,
    io::Write,
    os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt},
    path::Path,
};

/// Why the profile cannot be written.
#[derive(Debug)]
pub enum SinkError {
    /// The output file cannot be written.
    Output {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The output path is one allocbpf refuses to write (another user's file, a
    /// symbolic link to a regular file).
    OutputRefused {
        /// The path.
        path: String,
        /// Why, and what to do instead.
        reason: String,
    },
}

impl std::fmt::Display for SinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SinkError::Output { path, .. } => write!(f, "cannot write the output file {path}"),
            SinkError::OutputRefused { path, reason } => {
                write!(f, "refusing to write the output file {path}: {reason}")
            }
        }
    }
}

impl std::error::Error for SinkError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SinkError::Output { source, .. } => Some(source),
            SinkError::OutputRefused { .. } => None,
        }
    }
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
    pub fn open(path: Option<&Path>) -> Result<Sink, SinkError> {
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
        let output_error = |source| SinkError::Output {
            path: shown(),
            source,
        };
        let refused = |reason: String| SinkError::OutputRefused {
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
    ) -> Result<(), SinkError> {
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
        result.map_err(|source| SinkError::Output { path, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
