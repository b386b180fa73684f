//! How a push authenticates: a bearer token or a user and password, from a private
//! file or the environment.

use std::path::Path;

use anyhow::{bail, Context, Result};

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
    /// A credentials file others can read is refused: it would give any local user
    /// the profile store.
    pub fn load(file: Option<&Path>) -> Result<Credentials> {
        if let Some(path) = file {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(path)
                .with_context(|| format!("reading the credentials file {}", path.display()))?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                bail!(
                    "the credentials file {} can be read by others (mode {:o}): chmod 600 it",
                    path.display(),
                    mode & 0o777
                );
            }
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the credentials file {}", path.display()))?;
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
