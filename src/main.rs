use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use tokio::sync::watch;
use tracing_subscriber::EnvFilter;

use pgapply::cli::{Cli, Command, RunArgs, Streaming};
use pgapply::error::{Error, ErrorClass};
use pgapply::replicate::{run, RunConfig};
use pgapply::retry::Backoff;
use pgapply::{conninfo, demo};

/// Exit codes (documented in the README): 0 done, 1 a definite error (fix something and rerun),
/// 2 bad command line, 3 a transient error that did not clear (rerunning may work).
const EXIT_DEFINITE: u8 = 1;
const EXIT_TRANSIENT: u8 = 3;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = match &cli.log_level {
        Some(level) => EnvFilter::try_new(level),
        None => EnvFilter::try_from_default_env().or_else(|_| EnvFilter::try_new("info")),
    };
    let filter = match filter {
        Ok(f) => f,
        Err(e) => {
            eprintln!("pgapply: error: invalid --log-level: {e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pgapply: error: starting the runtime: {e}");
            return ExitCode::from(EXIT_DEFINITE);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run_command(args).await,
            Command::Demo(args) => demo::demo(args.duration, args.pg_bin).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "stopped");
            eprintln!("pgapply: error: {e}");
            ExitCode::from(match e.class() {
                ErrorClass::Definite => EXIT_DEFINITE,
                ErrorClass::Transient => EXIT_TRANSIENT,
            })
        }
    }
}

fn shutdown_signal() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("shutting down: finishing the current transaction");
        let _ = tx.send(true);
    });
    rx
}

async fn run_command(args: RunArgs) -> Result<(), Error> {
    if args.streaming != Streaming::Off {
        return Err(Error::definite(
            "--streaming on/parallel is not available in this version yet; use --streaming off (large transactions are applied at commit)",
        ));
    }
    if args.two_phase {
        return Err(Error::definite(
            "--two-phase is not available in this version yet; prepared transactions are applied when they commit",
        ));
    }
    if args.config.is_some() {
        return Err(Error::definite(
            "--config is not available in this version yet; give the settings as flags or PGAPPLY_* environment variables",
        ));
    }
    let publications: Vec<String> = args
        .publication
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect();
    if publications.is_empty() {
        return Err(Error::definite(
            "--publication: give at least one publication name",
        ));
    }
    let mut config = RunConfig::new(
        conninfo::parse("source", &args.source)?,
        conninfo::parse("target", &args.target)?,
        publications,
        args.slot,
    );
    config.create_slot = args.create_slot;
    config.copy_data = args.copy_data;
    config.copy.jobs = args.copy_jobs.max(1);
    config.copy.truncate_target = args.truncate_target;
    config.copy.split_pages = args.copy_split_pages.max(1);
    config.status_interval = args.status_interval;
    if let Some(endpos) = args.endpos {
        config.endpos = Some(
            endpos
                .parse()
                .map_err(|e| Error::definite(format!("--endpos: {e}")))?,
        );
    }
    let mut shutdown = shutdown_signal();
    let mut backoff = Backoff::new(args.retry_min, args.retry_max);
    loop {
        let started = Instant::now();
        match run(config.clone(), shutdown.clone(), None).await {
            Ok(outcome) => {
                tracing::info!(reason = ?outcome.reason, flushed_lsn = %outcome.flushed, "done");
                return Ok(());
            }
            Err(e) if e.is_transient() && !*shutdown.borrow() => {
                if started.elapsed() > Duration::from_secs(60) {
                    backoff.reset();
                }
                if args.max_retries > 0 && backoff.attempts >= args.max_retries {
                    return Err(
                        e.context(format!("giving up after {} attempts", backoff.attempts + 1))
                    );
                }
                let delay = backoff.next_delay();
                tracing::warn!(
                    error = %e,
                    attempt = backoff.attempts,
                    retry_in = %humantime::format_duration(Duration::from_millis(delay.as_millis() as u64)),
                    "transient error; reconnecting and resuming from the recorded position"
                );
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.changed() => return Ok(()),
                }
            }
            Err(e) => return Err(e),
        }
    }
}
