//! `pgapply source-speed`: how fast the source decodes and sends a slot's backlog to pgapply's
//! reader when nothing is applied. That is the ceiling for any applier of this source on this
//! machine (bench/run.sh reports throughput as a fraction of it). Nothing is confirmed, so the
//! slot does not move and the same backlog can be read again.

use std::time::{Duration, Instant};

use crate::cli::SourceSpeedArgs;
use crate::error::{Error, Result};
use crate::protocol::pgoutput::{LogicalMessage, MessageDecoder};
use crate::protocol::walsender::ReplicationFrame;
use crate::protocol::Lsn;
use crate::source::options::{negotiate, Requested};
use crate::source::ReplicationSession;

/// What was read.
#[derive(Debug, Default, Clone, Copy)]
pub struct SourceSpeed {
    pub transactions: u64,
    pub messages: u64,
    pub bytes: u64,
    pub seconds: f64,
}

pub async fn source_speed_command(args: &SourceSpeedArgs) -> Result<()> {
    let source =
        crate::config::resolve_source_flag(&args.source, args.source_password_file.as_ref())?;
    let endpos: Lsn = args.endpos.parse().map_err(|e| {
        Error::definite(format!(
            "--endpos {:?}: {e} (give an LSN such as 0/16B3748, for example pg_current_wal_lsn() on the source)",
            args.endpos
        ))
    })?;
    let speed = measure(&source, &args.publication, &args.slot, endpos).await?;
    let per_second = |n: u64| rate(n as f64 / speed.seconds.max(1e-9));
    crate::out!(
        "read {} transactions ({} messages, {:.1} MB) up to {endpos} in {:.3} s: {} txn/s, {} messages/s, {} MB/s",
        speed.transactions,
        speed.messages,
        speed.bytes as f64 / 1e6,
        speed.seconds,
        per_second(speed.transactions),
        per_second(speed.messages),
        rate(speed.bytes as f64 / speed.seconds.max(1e-9) / 1e6),
    );
    Ok(())
}

/// A rate with the digits that say something: a few transactions over a long read are not "0".
fn rate(per_second: f64) -> String {
    match per_second {
        r if r >= 100.0 => format!("{r:.0}"),
        r if r >= 1.0 => format!("{r:.1}"),
        r => format!("{r:.3}"),
    }
}

/// Reads the slot's changes up to `endpos` (a commit ending there or later, or the source's WAL
/// end passing it), decoding every message, applying and confirming nothing.
pub async fn measure(
    source: &tokio_postgres::Config,
    publications: &[String],
    slot: &str,
    endpos: Lsn,
) -> Result<SourceSpeed> {
    let mut session = ReplicationSession::connect(source, 1 << 30).await?;
    session.identify_system().await?;
    session.check_publications(publications).await?;
    if !session.slot_exists(slot).await? {
        return Err(Error::definite(format!(
            "slot {slot:?} does not exist on the source: create it first (SELECT pg_create_logical_replication_slot({}, 'pgoutput'))",
            crate::sql::quote_literal(slot)
        )));
    }
    let negotiated = negotiate(session.server_version(), &Requested::default())?;
    let mut decoder = MessageDecoder::new(negotiated.abort_info());
    let started = Instant::now();
    // From the slot's confirmed position (0/0 asks for that).
    let mut stream = session
        .start(slot, Lsn(0), &negotiated, publications)
        .await?;
    let mut speed = SourceSpeed::default();
    let mut in_transaction = false;
    let mut last_probe = Instant::now();
    loop {
        // Ask for the source's position now and then, so that an idle end is noticed.
        if last_probe.elapsed() >= Duration::from_millis(250) {
            stream.send_status(Lsn(0), Lsn(0), true).await?;
            last_probe = Instant::now();
        }
        let frame = tokio::time::timeout(Duration::from_millis(250), stream.next_frame()).await;
        let Ok(frame) = frame else { continue };
        let frame = frame?.ok_or_else(|| {
            Error::transient("the source ended the replication stream before the end position")
        })?;
        match frame {
            ReplicationFrame::Keepalive {
                wal_end,
                reply_requested,
                ..
            } => {
                if reply_requested {
                    // Position 0/0: nothing is confirmed, the slot stays where it is.
                    stream.send_status(Lsn(0), Lsn(0), false).await?;
                }
                if !in_transaction && wal_end >= endpos {
                    break;
                }
            }
            ReplicationFrame::XLogData {
                data, wal_start, ..
            } => {
                speed.bytes += data.len() as u64;
                speed.messages += 1;
                let message = decoder.decode(data).map_err(|e| {
                    Error::definite(format!(
                        "the source sent a message at {wal_start} that pgapply cannot decode: {e}"
                    ))
                })?;
                match message {
                    LogicalMessage::Begin(_) => in_transaction = true,
                    LogicalMessage::Commit(c) => {
                        in_transaction = false;
                        speed.transactions += 1;
                        if c.end_lsn >= endpos {
                            break;
                        }
                    }
                    LogicalMessage::StreamCommit(c) => {
                        speed.transactions += 1;
                        if c.end_lsn >= endpos {
                            break;
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    speed.seconds = started.elapsed().as_secs_f64();
    stream.close().await;
    Ok(speed)
}

#[cfg(test)]
mod tests {
    #[test]
    fn rates_keep_their_digits() {
        assert_eq!(super::rate(14_563.4), "14563");
        assert_eq!(super::rate(2.54), "2.5");
        assert_eq!(super::rate(0.04), "0.040");
    }
}
