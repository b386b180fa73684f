//! The push's HTTP client: no redirects, a per-request timeout, and TLS roots that can
//! include a private CA bundle (`push.ca_file`).
//!
//! A Pyroscope behind a company CA is common; without a way to trust that CA an operator
//! would have to turn TLS off (`http://`), which the push refuses with credentials. The
//! bundle's certificates are trusted in addition to the public roots ureq ships
//! (webpki-roots), through the same rustls version and crypto provider (ring).

use std::{path::Path, sync::Arc, time::Duration};

use anyhow::{bail, Context, Result};
use rustls_pki_types::{pem::PemObject, CertificateDer};

/// The HTTP client of the push: `timeout` per request, redirects never followed (one
/// would carry the credentials to another server), and the certificates of `ca_file`
/// (PEM) trusted besides the public roots.
pub fn http_agent(timeout: Duration, ca_file: Option<&Path>) -> Result<ureq::Agent> {
    let builder = ureq::AgentBuilder::new().timeout(timeout).redirects(0);
    let Some(ca_file) = ca_file else {
        return Ok(builder.build());
    };
    Ok(builder.tls_config(client_config(ca_file)?).build())
}

/// A rustls client config trusting the public roots and every certificate in `ca_file`.
fn client_config(ca_file: &Path) -> Result<Arc<rustls::ClientConfig>> {
    let pem = std::fs::read(ca_file)
        .with_context(|| format!("push.ca_file: reading {}", ca_file.display()))?;
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    let certificates: Vec<CertificateDer> = CertificateDer::pem_slice_iter(&pem)
        .filter_map(Result::ok)
        .collect();
    let found = certificates.len();
    // A bundle may hold certificates webpki cannot use (a system bundle has a few):
    // those are skipped and counted, as ureq does for the system's roots.
    let (added, unusable) = roots.add_parsable_certificates(certificates);
    if added == 0 {
        bail!(
            "push.ca_file: {} holds no usable PEM certificate ({found} found)",
            ca_file.display()
        );
    }
    if unusable > 0 {
        tracing::warn!(
            "push.ca_file: {unusable} of the {found} certificates of {} are not usable CAs and are ignored",
            ca_file.display()
        );
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_without_certificates_is_refused() {
        let dir = std::env::temp_dir().join(format!("allocbpf-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let error = http_agent(Duration::from_secs(1), Some(&empty))
            .unwrap_err()
            .to_string();
        assert!(error.contains("holds no usable PEM certificate"), "{error}");
        let missing = http_agent(Duration::from_secs(1), Some(&dir.join("missing.pem")))
            .unwrap_err()
            .to_string();
        assert!(missing.contains("reading"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
