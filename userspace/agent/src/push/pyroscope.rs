//! Grafana Pyroscope: the Connect push API (the default) or the legacy `/ingest`.
//!
//! ```text
//! POST {url}/push.v1.PusherService/Push                     (push.protocol = "push")
//! Content-Type: application/proto
//! body: push.v1.PushRequest { series: [ { labels: [__delta__=false, __name__=memory,
//!        service_name=..., hostname=..., pid=..., ...], samples: [ { raw_profile:
//!        gzipped pprof, ID: ... } ] } ] }
//!
//! POST {url}/ingest?name={service_name}{hostname=h,pid=1234,...}
//!                  &from={unix s}&until={unix s}&format=pprof&spyName=allocbpf
//! Content-Type: application/octet-stream                   (push.protocol = "ingest")
//! body: the gzipped pprof (with `format=pprof` the server reads the body as the
//!       profile itself: a multipart body is refused, 422)
//!
//! Authorization: Bearer TOKEN | Basic base64(USER:PASSWORD)   (if configured)
//! X-Scope-OrgID: TENANT                                       (if configured)
//! ```
//!
//! Both send the profile without its per-sample string labels: Pyroscope makes every
//! string label of a pprof sample a series label (the process's labels are already
//! the series'; one that changes every interval would make a series per interval).
//! docs/operations.md ("Pyroscope") says why the push API is the default.

use std::{
    sync::{atomic::Ordering, Arc, Mutex},
    time::{Duration, Instant},
};

use prost::Message;

use super::{
    decode_spooled,
    http::{authorize, classify, finish, status_kind, Failure, StatusKind},
    labels::{pyroscope_series, service_name, SeriesLimit},
    Credentials, PushMeta, PushStats, Transport,
};
use crate::config::{Destination, PushConfig, PushTarget};

/// How long a series counts against `push.max_series` after its last profile: the
/// span over which Pyroscope's ingesters hold a series as active.
pub const SERIES_WINDOW: Duration = Duration::from_secs(3600);

/// Pyroscope's statuses: a 429 is about the request more often than the server (a new
/// series beyond the tenant's limit, a profile larger than the rate limiter's burst
/// can never pass), so it holds back that record, not everything; two in a row still
/// back off everything, and a record refused so again and again while others go
/// through is dropped (see [`super`]).
fn pyroscope_status_kind(code: u16) -> StatusKind {
    match code {
        429 => StatusKind::Record,
        _ => status_kind(code),
    }
}

/// `push.v1.PushRequest` (grafana/pyroscope `api/push/v1/push.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct PushRequest {
    /// One series per profile here.
    #[prost(message, repeated, tag = "1")]
    pub series: Vec<RawProfileSeries>,
}

/// `push.v1.RawProfileSeries`: a label set and its profiles.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RawProfileSeries {
    /// The series' labels.
    #[prost(message, repeated, tag = "1")]
    pub labels: Vec<LabelPair>,
    /// Its profiles.
    #[prost(message, repeated, tag = "2")]
    pub samples: Vec<RawSample>,
}

/// `types.v1.LabelPair`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LabelPair {
    /// Label name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Label value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `push.v1.RawSample`: one encoded profile.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RawSample {
    /// A pprof, gzipped or not.
    #[prost(bytes = "vec", tag = "1")]
    pub raw_profile: Vec<u8>,
    /// An id of this profile (optional: the server assigns its own).
    #[prost(string, tag = "2")]
    pub id: String,
}

/// `gzipped` (a pprof) without string sample labels, gzipped again.
pub fn without_string_labels(gzipped: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut profile = decode_spooled(gzipped)?;
    profile.drop_string_labels();
    Ok(allocbpf_export::pprof::gzip(&profile))
}

/// Pyroscope's `name` parameter of `/ingest`: `application{k=v,...}`, the application
/// in the characters it accepts there (`A-Za-z0-9_./-`, others become `_`), values
/// with the characters the syntax reserves replaced by `_`.
pub fn ingest_name(application: &str, labels: &[(String, String)]) -> String {
    let application: String = application
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_./-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if ",{}=\"".contains(c) || c.is_whitespace() {
                    '_'
                } else {
                    c
                }
            })
            .collect()
    };
    let pairs: Vec<String> = labels
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k}={}", clean(v)))
        .collect();
    format!("{application}{{{}}}", pairs.join(","))
}

/// A Pyroscope server.
pub(super) struct Pyroscope {
    agent: ureq::Agent,
    url: String,
    ingest: bool,
    service_name: Option<String>,
    tenant: Option<String>,
    credentials: Credentials,
    stats: Arc<PushStats>,
    /// The store's series bound, kept for the agent's life (a reload must not reset it).
    series: Arc<Mutex<SeriesLimit>>,
}

impl Pyroscope {
    pub(super) fn new(
        agent: ureq::Agent,
        config: &PushConfig,
        target: &PushTarget,
        credentials: Credentials,
        stats: Arc<PushStats>,
        series: Arc<Mutex<SeriesLimit>>,
    ) -> Pyroscope {
        Pyroscope {
            agent,
            url: target.url.clone(),
            ingest: target.destination == Destination::PyroscopeIngest,
            service_name: config.service_name.clone(),
            tenant: config.tenant.clone(),
            credentials,
            stats,
            series,
        }
    }
}

impl Transport for Pyroscope {
    fn send(&self, meta: &PushMeta, profile: &[u8]) -> Result<(), Failure> {
        let service = service_name(self.service_name.as_deref(), &meta.labels);
        let (series, dropped) = pyroscope_series(&meta.labels, &service);
        if dropped > 0 {
            self.stats
                .labels_dropped
                .fetch_add(dropped, Ordering::Relaxed);
        }
        let admitted = self
            .series
            .lock()
            .map(|mut limit| limit.admit(&series, Instant::now()))
            .unwrap_or(true);
        if !admitted {
            self.stats.series_dropped.fetch_add(1, Ordering::Relaxed);
            return Err(Failure::Permanent(anyhow::anyhow!(
                "more than push.max_series series within an hour: a profile of a new \
                 series is not pushed"
            )));
        }
        // A record that does not decode never will.
        let profile = &without_string_labels(profile).map_err(Failure::Permanent)?;
        let (request, body) = if self.ingest {
            ingest_request(&self.agent, &self.url, &service, series, meta, profile)
        } else {
            let body = PushRequest {
                series: vec![RawProfileSeries {
                    labels: series
                        .into_iter()
                        .map(|(name, value)| LabelPair { name, value })
                        .collect(),
                    samples: vec![RawSample {
                        raw_profile: profile.to_vec(),
                        id: String::new(),
                    }],
                }],
            }
            .encode_to_vec();
            let request = self
                .agent
                .post(&format!("{}/push.v1.PusherService/Push", self.url))
                .set("Content-Type", "application/proto");
            (request, body)
        };
        let request = authorize(request, &self.credentials, self.tenant.as_deref());
        let response = classify(request.send_bytes(&body), pyroscope_status_kind)?;
        finish(response);
        Ok(())
    }
}

/// The `/ingest` request: the service name is the application, the other series
/// labels go in braces (`__name__` is the server's, from the sample types;
/// `__delta__=false` it adds itself, and drops any label of ours starting `__`).
fn ingest_request(
    agent: &ureq::Agent,
    url: &str,
    service: &str,
    series: Vec<(String, String)>,
    meta: &PushMeta,
    profile: &[u8],
) -> (ureq::Request, Vec<u8>) {
    let labels: Vec<(String, String)> = series
        .into_iter()
        .filter(|(name, _)| !name.starts_with("__") && name != super::labels::SERVICE_NAME)
        .collect();
    let request = agent
        .post(&format!("{url}/ingest"))
        .query("name", &ingest_name(service, &labels))
        .query("from", &meta.from.to_string())
        .query("until", &meta.until.to_string())
        .query("format", "pprof")
        .query("spyName", "allocbpf")
        .set("Content-Type", "application/octet-stream");
    (request, profile.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ingest_names() {
        let labels = vec![
            ("hostname".to_string(), "h".to_string()),
            ("comm".to_string(), "a,b{c}".to_string()),
            ("container_id".to_string(), String::new()),
        ];
        assert_eq!(
            ingest_name("my app@1", &labels),
            "my_app_1{hostname=h,comm=a_b_c_}"
        );
    }

    #[test]
    fn push_requests_decode_as_sent() {
        let request = PushRequest {
            series: vec![RawProfileSeries {
                labels: vec![LabelPair {
                    name: "service_name".into(),
                    value: "svc".into(),
                }],
                samples: vec![RawSample {
                    raw_profile: vec![0x1f, 0x8b, 1, 2],
                    id: String::new(),
                }],
            }],
        };
        let bytes = request.encode_to_vec();
        assert_eq!(PushRequest::decode(bytes.as_slice()).unwrap(), request);
    }

    /// Which labels go is `Profile::drop_string_labels`'s (tested in allocbpf-export);
    /// here, the spool record's way through: gunzip, rewrite, gzip; not gzip, an error.
    #[test]
    fn string_labels_leave_the_spooled_profile() {
        use allocbpf_export::pprof::proto::{Label, Profile, Sample};
        let mut profile = Profile {
            string_table: vec!["".into(), "comm".into(), "x".into()],
            sample: vec![Sample {
                value: vec![1],
                label: vec![Label {
                    key: 1,
                    str: 2,
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        let rewritten = without_string_labels(&allocbpf_export::pprof::gzip(&profile)).unwrap();
        profile.drop_string_labels();
        assert_eq!(decode_spooled(&rewritten).unwrap(), profile);
        assert!(without_string_labels(b"not gzip").is_err());
    }
}
