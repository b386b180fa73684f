//! OpenTelemetry: OTLP/HTTP profiles, protobuf.
//!
//! ```text
//! POST {otlp_endpoint}/v1development/profiles
//! Content-Type: application/x-protobuf
//! body: ExportProfilesServiceRequest (allocbpf_export::otlp): one resource per
//!       process (service.name, host.name, process.pid, ...), one profile per sample
//!       type, as the spooled pprof holds them
//! Authorization / X-Scope-OrgID as for Pyroscope (a Collector's bearertokenauth,
//! Pyroscope's own OTLP endpoint)
//! ```
//!
//! The spool holds the gzipped pprof, the one format every store's spool shares; it
//! is converted here, on the delivery thread, when sent.

use std::{
    io::Write,
    sync::{atomic::Ordering, Arc},
};

use allocbpf_export::otlp;
use prost::Message;

use super::{
    decode_spooled,
    http::{authorize, classify, finish, status_kind, Failure},
    labels::{bounded, service_name, PER_INTERVAL, SERVICE_NAME},
    Credentials, PushMeta, PushStats, Transport,
};
use crate::config::{PushConfig, PushTarget};

/// An OTLP/HTTP endpoint.
pub(super) struct Otlp {
    agent: ureq::Agent,
    url: String,
    service_name: Option<String>,
    tenant: Option<String>,
    credentials: Credentials,
    stats: Arc<PushStats>,
}

impl Otlp {
    pub(super) fn new(
        agent: ureq::Agent,
        config: &PushConfig,
        target: &PushTarget,
        credentials: Credentials,
        stats: Arc<PushStats>,
    ) -> Otlp {
        Otlp {
            agent,
            url: target.url.clone(),
            service_name: config.service_name.clone(),
            tenant: config.tenant.clone(),
            credentials,
            stats,
        }
    }
}

/// The OTLP request of one spooled profile, encoded and gzipped.
///
/// Without the pprof's per-sample labels: receivers make sample attributes series
/// labels (Pyroscope does), and ours (raw sample counts, confidence intervals) differ
/// per stack and per interval: a series each. The local store's pprof keeps them.
/// Resource values are bounded as Pyroscope's label values are (it refuses longer).
pub fn request_body(
    meta: &PushMeta,
    gzipped: &[u8],
    service_name: &str,
) -> anyhow::Result<Vec<u8>> {
    let mut profile = decode_spooled(gzipped)?;
    profile.drop_labels();
    let mut resource: Vec<(String, String)> =
        vec![(SERVICE_NAME.to_string(), bounded(service_name))];
    resource.extend(
        meta.labels
            .iter()
            .filter(|(name, value)| !value.is_empty() && !PER_INTERVAL.contains(&name.as_str()))
            .map(|(name, value)| (name.clone(), bounded(value))),
    );
    // The pprof's own start and duration: nanoseconds, where the metadata has seconds.
    let request = otlp::request_from_pprof(&profile, &resource, 0, 0);
    let mut body = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    body.write_all(&otlp::encode(&request))?;
    Ok(body.finish()?)
}

impl Transport for Otlp {
    fn send(&self, meta: &PushMeta, profile: &[u8]) -> Result<(), Failure> {
        let service = service_name(self.service_name.as_deref(), &meta.labels);
        // A record that does not convert never will.
        let body = request_body(meta, profile, &service).map_err(Failure::Permanent)?;
        let request = self
            .agent
            .post(&format!("{}{}", self.url, otlp::HTTP_PATH))
            .set("Content-Type", otlp::CONTENT_TYPE)
            .set("Content-Encoding", "gzip");
        let request = authorize(request, &self.credentials, self.tenant.as_deref());
        let response = classify(request.send_bytes(&body), status_kind)?;
        // A 200 may still say part was refused (partial success): counted and logged;
        // the record is done (sending it again would be refused again).
        let answer = finish(response);
        if let Ok(decoded) = otlp::proto::ExportProfilesServiceResponse::decode(answer.as_slice()) {
            if let Some(partial) = decoded.partial_success {
                if partial.rejected_profiles > 0 {
                    self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                }
                if partial.rejected_profiles > 0 || !partial.error_message.is_empty() {
                    tracing::warn!(
                        "OTLP push to {}: {} profile(s) rejected: {}",
                        self.url,
                        partial.rejected_profiles,
                        partial.error_message.chars().take(300).collect::<String>()
                    );
                }
            }
        }
        Ok(())
    }
}
