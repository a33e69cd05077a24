//! What to ask the walsender for: protocol version and pgoutput options, from what the user asked
//! and what the server supports. Asking for a feature the server lacks is a clear error; what is
//! chosen, and why, is logged at start-up.

use crate::cli::Streaming;
use crate::error::{Error, Result};
use crate::sql::{quote_ident, quote_replication_literal};

/// What the user asked for (`None` streaming: the default for the server).
#[derive(Debug, Clone, Default)]
pub struct Requested {
    pub streaming: Option<Streaming>,
    pub two_phase: bool,
    pub binary: bool,
    pub messages: bool,
    /// Only changes that originated on the source itself (`origin = none`, PostgreSQL 16+).
    pub origin_none: bool,
}

/// What this session uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub protocol_version: u32,
    pub streaming: Streaming,
    pub two_phase: bool,
    pub binary: bool,
    pub messages: bool,
    pub origin_none: bool,
}

impl Negotiated {
    /// Stream Abort carries abort LSN and time (protocol 4 with streaming = parallel).
    pub fn abort_info(&self) -> bool {
        self.streaming == Streaming::Parallel && self.protocol_version >= 4
    }

    /// The START_REPLICATION option list.
    pub fn options_sql(&self, publications: &[String]) -> String {
        // publication_names is parsed by the server as a list of identifiers, so each name is
        // quoted as an identifier, and the list as a whole as a string literal.
        let names = publications
            .iter()
            .map(|p| quote_ident(p))
            .collect::<Vec<_>>()
            .join(",");
        let mut options = vec![
            format!("proto_version '{}'", self.protocol_version),
            format!("publication_names {}", quote_replication_literal(&names)),
        ];
        match self.streaming {
            Streaming::Off => {}
            Streaming::On => options.push("streaming 'on'".into()),
            Streaming::Parallel => options.push("streaming 'parallel'".into()),
        }
        if self.two_phase {
            options.push("two_phase 'on'".into());
        }
        if self.binary {
            options.push("binary 'true'".into());
        }
        if self.messages {
            options.push("messages 'true'".into());
        }
        if self.origin_none {
            options.push("origin 'none'".into());
        }
        options.join(", ")
    }

    pub fn describe(&self) -> String {
        format!(
            "protocol {}, streaming {}, two-phase {}, binary {}, messages {}, origin {}",
            self.protocol_version,
            match self.streaming {
                Streaming::Off => "off",
                Streaming::On => "on",
                Streaming::Parallel => "parallel",
            },
            on_off(self.two_phase),
            on_off(self.binary),
            on_off(self.messages),
            if self.origin_none { "none" } else { "any" }
        )
    }
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// Every requested option a source of this version cannot serve, each said with what to do.
pub fn version_problems(server_version: u32, requested: &Requested) -> Vec<String> {
    let major = server_version / 10000;
    let streaming = match requested.streaming {
        Some(Streaming::On) => Some("--streaming on"),
        Some(Streaming::Parallel) => Some("--streaming parallel"),
        _ => None,
    };
    [
        (streaming, 14),
        (requested.two_phase.then_some("--two-phase"), 15),
        (requested.messages.then_some("--messages"), 14),
        (requested.origin_none.then_some("--origin none"), 16),
    ]
    .into_iter()
    .filter_map(|(feature, min)| {
        let feature = feature?;
        (major < min).then(|| {
            format!("{feature} needs a PostgreSQL {min} or later source; this source runs PostgreSQL {major}: leave it out")
        })
    })
    .collect()
}

/// `server_version` as `server_version_num` (150004).
pub fn negotiate(server_version: u32, requested: &Requested) -> Result<Negotiated> {
    let major = server_version / 10000;
    let protocol_version = match major {
        m if m >= 16 => 4,
        15 => 3,
        14 => 2,
        _ => 1,
    };
    let problems = version_problems(server_version, requested);
    if !problems.is_empty() {
        return Err(Error::definite(problems.join("; ")));
    }
    // Off unless asked for: sources were seen sending, in a streamed transaction, changes that
    // ROLLBACK TO SAVEPOINT undid as kept (a TOASTed value's, 16 to 18; a subtransaction's rows
    // after the connection started again mid-transaction, 14 to 18), and PostgreSQL's own
    // subscriber applies them too. Not streamed, the source decodes the whole transaction
    // before sending it, and sends only what committed.
    let streaming = match requested.streaming {
        None => Streaming::Off,
        Some(Streaming::Off) => Streaming::Off,
        Some(Streaming::On) => Streaming::On,
        Some(Streaming::Parallel) => {
            if major < 16 {
                // As PostgreSQL's own subscriber does with an older publisher: large
                // transactions still stream, spooled until they commit.
                tracing::warn!(source_major = major, "--streaming parallel needs a PostgreSQL 16 or later source: streaming large transactions with --streaming on instead");
                Streaming::On
            } else {
                Streaming::Parallel
            }
        }
    };
    // Binary values are a way to go faster, and text is what `--binary` falls back to for
    // tables it cannot serve: a source too old for it gets text too (a config file shared by
    // sources of several versions keeps working).
    let binary = requested.binary && major >= 14;
    if requested.binary && !binary {
        tracing::warn!(
            source_major = major,
            "--binary needs a PostgreSQL 14 or later source: values arrive in text form"
        );
    }
    Ok(Negotiated {
        protocol_version,
        streaming,
        two_phase: requested.two_phase,
        binary,
        messages: requested.messages,
        origin_none: requested.origin_none,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_and_defaults() {
        let n = negotiate(130011, &Requested::default()).unwrap();
        assert_eq!((n.protocol_version, n.streaming), (1, Streaming::Off));
        // Streaming only when asked for (see `negotiate`).
        let n = negotiate(180004, &Requested::default()).unwrap();
        assert_eq!((n.protocol_version, n.streaming), (4, Streaming::Off));
        let n = negotiate(
            140005,
            &Requested {
                streaming: Some(Streaming::On),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!((n.protocol_version, n.streaming), (2, Streaming::On));
        let n = negotiate(
            180001,
            &Requested {
                streaming: Some(Streaming::Parallel),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(n.protocol_version, 4);
        assert!(n.abort_info());
        assert!(n
            .options_sql(&["My Pub".into()])
            .contains("streaming 'parallel'"));
    }

    #[test]
    fn every_option_a_source_cannot_serve_is_named() {
        let all = Requested {
            streaming: Some(Streaming::Parallel),
            two_phase: true,
            binary: true,
            messages: true,
            origin_none: true,
        };
        let problems = version_problems(110000, &all);
        assert_eq!(problems.len(), 4, "{problems:?}");
        for needs in [
            "--streaming parallel needs a PostgreSQL 14",
            "--two-phase needs a PostgreSQL 15",
            "--messages needs a PostgreSQL 14",
            "--origin none needs a PostgreSQL 16",
        ] {
            assert!(problems.iter().any(|p| p.contains(needs)), "{problems:?}");
        }
        assert_eq!(version_problems(150000, &all).len(), 1);
        assert!(version_problems(160000, &all).is_empty());
        let err = negotiate(110000, &all).unwrap_err().to_string();
        assert!(
            err.contains("--two-phase") && err.contains("--origin none"),
            "{err}"
        );
    }

    #[test]
    fn unsupported_features_are_named() {
        let parallel = Requested {
            streaming: Some(Streaming::Parallel),
            ..Default::default()
        };
        // 14 and 15 stream without applying as they arrive; before 14 nothing streams.
        let n = negotiate(150000, &parallel).unwrap();
        assert_eq!(n.streaming, Streaming::On);
        let err = negotiate(130000, &parallel).unwrap_err();
        assert!(
            err.to_string()
                .contains("--streaming parallel needs a PostgreSQL 14"),
            "{err}"
        );
        let err = negotiate(
            140000,
            &Requested {
                two_phase: true,
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("--two-phase needs a PostgreSQL 15"),
            "{err}"
        );
        let n = negotiate(
            130000,
            &Requested {
                binary: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(!n.binary, "text values from a source before 14");
    }

    #[test]
    fn options_sql_quotes_publications() {
        let n = negotiate(
            150000,
            &Requested {
                streaming: Some(Streaming::Off),
                two_phase: true,
                binary: true,
                messages: true,
                origin_none: false,
            },
        )
        .unwrap();
        assert_eq!(
            n.options_sql(&["a".into(), "it's \"x\"".into()]),
            "proto_version '3', publication_names '\"a\",\"it''s \"\"x\"\"\"', two_phase 'on', binary 'true', messages 'true'"
        );
    }
}
