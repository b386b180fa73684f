//! What every HTTP push shares: how a failure is classified, and how a request
//! authenticates.

use super::Credentials;

/// Why a delivery failed, and so what waits.
#[derive(Debug)]
pub(super) enum Failure {
    /// It can never succeed: drop the record.
    Permanent(anyhow::Error),
    /// The server, or the way to it: nothing else would go through, everything waits.
    Server(anyhow::Error),
    /// This record failed: it waits, the others go on.
    Record(anyhow::Error),
}

/// What an HTTP status says about a failed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StatusKind {
    /// The request itself is refused (400, 413, 415, 422...): sending it again cannot
    /// change that.
    Permanent,
    /// The server or the way to it: 3xx, 401, 403, 404 (configuration a reload
    /// fixes), 407, 408, 429 (asks to slow down), 501-505, 507, 511.
    Server,
    /// This request failed on the server (500 and the other 5xx): others may not.
    Record,
}

/// What a failed request's HTTP status says, for a store that uses statuses as HTTP
/// means them (a 429 asks the client to slow down).
pub(super) fn status_kind(code: u16) -> StatusKind {
    match code {
        401 | 403 | 404 | 407 | 408 | 429 | 501..=505 | 507 | 511 => StatusKind::Server,
        400..=499 => StatusKind::Permanent,
        500..=599 => StatusKind::Record,
        _ => StatusKind::Server,
    }
}

/// The failure of a request that got no 2xx (`Ok` carries what the server answered,
/// including a 3xx ureq did not follow), its status judged by `kind_of` (a store's
/// own reading of statuses), or `Ok(response)` if it got one.
pub(super) fn classify(
    outcome: Result<ureq::Response, ureq::Error>,
    kind_of: fn(u16) -> StatusKind,
) -> Result<ureq::Response, Failure> {
    match outcome {
        Ok(response) if (300..400).contains(&response.status()) => {
            Err(Failure::Server(anyhow::anyhow!(
                "HTTP {}: redirected to {:?}, not followed (set the URL to the final address)",
                response.status(),
                response.header("Location").unwrap_or("")
            )))
        }
        Ok(response) => Ok(response),
        Err(ureq::Error::Status(code, response)) => {
            // The server's words, bounded: they name the limit or label at fault.
            let text = response.into_string().unwrap_or_default();
            let error = anyhow::anyhow!(
                "HTTP {code}: {}",
                text.trim().chars().take(300).collect::<String>()
            );
            Err(match kind_of(code) {
                StatusKind::Permanent => Failure::Permanent(error),
                StatusKind::Server => Failure::Server(error),
                StatusKind::Record => Failure::Record(error),
            })
        }
        Err(error) => Err(Failure::Server(error.into())),
    }
}

/// Reads what is left of a 2xx answer (bounded), so its connection can be reused.
pub(super) fn finish(response: ureq::Response) -> Vec<u8> {
    use std::io::Read;
    let mut answer = Vec::new();
    let _ = response
        .into_reader()
        .take(64 << 10)
        .read_to_end(&mut answer);
    answer
}

/// `request` with the credentials' `Authorization` and the tenant's `X-Scope-OrgID`.
pub(super) fn authorize(
    mut request: ureq::Request,
    credentials: &Credentials,
    tenant: Option<&str>,
) -> ureq::Request {
    if let Some(header) = credentials.header() {
        request = request.set("Authorization", &header);
    }
    if let Some(tenant) = tenant {
        request = request.set("X-Scope-OrgID", tenant);
    }
    request
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        for code in [400, 409, 413, 415, 422] {
            assert_eq!(status_kind(code), StatusKind::Permanent, "{code}");
        }
        for code in [301, 401, 403, 404, 407, 408, 429, 502, 503, 504, 507] {
            assert_eq!(status_kind(code), StatusKind::Server, "{code}");
        }
        for code in [500, 506, 599] {
            assert_eq!(status_kind(code), StatusKind::Record, "{code}");
        }
    }
}
