//! How a push authenticates: a bearer token or a user and password, from a private
//! file or the environment.

use std::{
    fs::Metadata,
    io::Read,
    os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt},
    path::Path,
};

use anyhow::{bail, Context, Result};

/// A credentials file larger than this is refused (a token is a few hundred bytes).
const MAX_CREDENTIALS_BYTES: u64 = 64 << 10;

/// How a push authenticates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Credentials {
    /// No Authorization header.
    None,
    /// `Authorization: Bearer TOKEN`.
    Bearer(String),
    /// `Authorization: Basic ...`.
    Basic(String, String),
}

impl Credentials {
    /// From `file` (`Bearer TOKEN`, `USER:PASSWORD`, or a bare token), else from
    /// `ALLOCBPF_PUSH_TOKEN` or `ALLOCBPF_PUSH_USER` + `ALLOCBPF_PUSH_PASSWORD`.
    /// The file must be private ([`read_private_file`]): one others can read would
    /// give any local user the profile store, one others can write would let them
    /// redirect it.
    pub fn load(file: Option<&Path>) -> Result<Credentials> {
        if let Some(path) = file {
            let text = read_private_file(path)?;
            return Ok(Self::parse(text.trim()));
        }
        if let Ok(token) = std::env::var("ALLOCBPF_PUSH_TOKEN") {
            return Ok(Credentials::Bearer(token));
        }
        match (
            std::env::var("ALLOCBPF_PUSH_USER"),
            std::env::var("ALLOCBPF_PUSH_PASSWORD"),
        ) {
            (Ok(user), Ok(password)) => Ok(Credentials::Basic(user, password)),
            (Ok(_), Err(_)) => bail!("ALLOCBPF_PUSH_USER is set but ALLOCBPF_PUSH_PASSWORD is not"),
            _ => Ok(Credentials::None),
        }
    }

    fn parse(text: &str) -> Credentials {
        if let Some(token) = text.strip_prefix("Bearer ") {
            return Credentials::Bearer(token.trim().to_string());
        }
        match text.split_once(':') {
            Some((user, password)) => Credentials::Basic(user.into(), password.into()),
            None if text.is_empty() => Credentials::None,
            None => Credentials::Bearer(text.into()),
        }
    }

    pub(super) fn header(&self) -> Option<String> {
        match self {
            Credentials::None => None,
            Credentials::Bearer(token) => Some(format!("Bearer {token}")),
            Credentials::Basic(user, password) => Some(format!(
                "Basic {}",
                base64(format!("{user}:{password}").as_bytes())
            )),
        }
    }
}

/// Reads the credentials file `path`, refusing what is not a private regular file of
/// root or of the agent's user. Opened without following a symbolic link (whoever can
/// write its directory could point it at another file) and without blocking (a FIFO
/// would hang the reload); every check is made on the opened descriptor, so the file
/// checked is the file read.
fn read_private_file(path: &Path) -> Result<String> {
    let shown = path.display();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|error| match error.raw_os_error() {
            Some(libc::ELOOP) => anyhow::anyhow!(
                "the credentials file {shown} is a symbolic link: set push.credentials_file to the file itself"
            ),
            _ => anyhow::Error::new(error).context(format!("opening the credentials file {shown}")),
        })?;
    let metadata = file
        .metadata()
        .with_context(|| format!("reading the credentials file {shown}"))?;
    // SAFETY: geteuid has no failure mode.
    let euid = unsafe { libc::geteuid() };
    if let Err(problem) = check_private(&metadata, euid) {
        bail!("the credentials file {shown} {problem}");
    }
    let mut text = Vec::new();
    (&file)
        .take(MAX_CREDENTIALS_BYTES + 1)
        .read_to_end(&mut text)
        .with_context(|| format!("reading the credentials file {shown}"))?;
    if text.len() as u64 > MAX_CREDENTIALS_BYTES {
        bail!(
            "the credentials file {shown} is larger than {} KiB: not a credentials file",
            MAX_CREDENTIALS_BYTES >> 10
        );
    }
    String::from_utf8(text)
        .map_err(|_| anyhow::anyhow!("the credentials file {shown} is not UTF-8 text"))
}

/// Why an opened credentials file is not private (a phrase following its name), if
/// it is not: a regular file, owned by root or `euid`, that neither group nor others
/// may read or write.
fn check_private(metadata: &Metadata, euid: u32) -> std::result::Result<(), String> {
    let kind = metadata.file_type();
    if !kind.is_file() {
        let what = if kind.is_dir() {
            "a directory"
        } else if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(format!("is {what}, not a regular file"));
    }
    let uid = metadata.uid();
    if uid != 0 && uid != euid {
        return Err(format!(
            "belongs to uid {uid}: it must belong to root or to the agent's user (uid {euid}), or its owner could change the credentials (chown root it)"
        ));
    }
    let mode = metadata.mode();
    if mode & 0o077 != 0 {
        return Err(format!(
            "can be read or changed by others (mode {:o}): chmod 600 it",
            mode & 0o777
        ));
    }
    Ok(())
}

fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credentials_file_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let path =
            std::env::temp_dir().join(format!("allocbpf-credentials-{}", std::process::id()));
        std::fs::write(&path, "Bearer t0ken\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let error = format!("{:#}", Credentials::load(Some(&path)).unwrap_err());
        assert!(error.contains("chmod 600"), "{error}");
        assert!(!error.contains("t0ken"), "{error}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            Credentials::load(Some(&path)).unwrap(),
            Credentials::Bearer("t0ken".into())
        );
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_credentials_file_must_be_a_private_regular_file_of_root_or_the_agent() {
        use std::os::unix::fs::PermissionsExt;
        let dir =
            std::env::temp_dir().join(format!("allocbpf-credentials-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let real = dir.join("token");
        std::fs::write(&real, "Bearer t0ken\n").unwrap();
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o600)).unwrap();
        let error = |path: &Path| format!("{:#}", Credentials::load(Some(path)).unwrap_err());
        // Through a symbolic link: refused, even to a good file.
        let link = dir.join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let refused = error(&link);
        assert!(refused.contains("symbolic link"), "{refused}");
        // Group-readable.
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o640)).unwrap();
        let refused = error(&real);
        assert!(
            refused.contains("chmod 600") && !refused.contains("t0ken"),
            "{refused}"
        );
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o600)).unwrap();
        // A FIFO: refused at once, not waited on.
        let fifo = dir.join("fifo");
        let c_fifo = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo with a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c_fifo.as_ptr(), 0o600) }, 0);
        let refused = error(&fifo);
        assert!(refused.contains("a FIFO"), "{refused}");
        // Too large to be a credentials file.
        let large = dir.join("large");
        std::fs::write(&large, vec![b'a'; 65 << 10]).unwrap();
        std::fs::set_permissions(&large, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(error(&large).contains("larger than 64 KiB"));
        // Another user's file (the check itself, and for real when we can chown).
        let metadata = std::fs::metadata(&real).unwrap();
        let mine = metadata.uid();
        assert!(check_private(&metadata, mine).is_ok());
        if mine != 0 {
            let refused = check_private(&metadata, mine + 1).unwrap_err();
            assert!(
                refused.contains(&format!("belongs to uid {mine}")),
                "{refused}"
            );
        }
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&real, Some(65534), None).unwrap();
            let refused = error(&real);
            assert!(refused.contains("belongs to uid 65534"), "{refused}");
            std::os::unix::fs::chown(&real, Some(0), None).unwrap();
        }
        assert_eq!(
            Credentials::load(Some(&real)).unwrap(),
            Credentials::Bearer("t0ken".into())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn credentials() {
        assert_eq!(
            Credentials::parse("Bearer abc"),
            Credentials::Bearer("abc".into())
        );
        assert_eq!(
            Credentials::parse("user:pa:ss"),
            Credentials::Basic("user".into(), "pa:ss".into())
        );
        assert_eq!(
            Credentials::Basic("Aladdin".into(), "open sesame".into()).header(),
            Some("Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ==".into())
        );
    }
}
