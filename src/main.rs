use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tokio::sync::watch;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{EnvFilter, Layer};

use pgapply::cli::{Cli, Command, LogFormat, RunArgs};
use pgapply::cli::{CutoverArgs, SchemaArgs, VerifyArgs};
use pgapply::config::{self, FileConfig};
use pgapply::error::{Error, ErrorClass};
use pgapply::replicate::run;
use pgapply::retry::Backoff;
use pgapply::{check, cutover, demo, metrics, schema, skip, source_speed, status, verify};

/// Exit codes (documented in the README): 0 done, 1 a definite error (fix something and rerun),
/// 2 bad command line, 3 a transient error that did not clear (rerunning may work).
const EXIT_DEFINITE: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_TRANSIENT: u8 = 3;
/// Stopped at once by a second signal or after the shutdown grace period (`shutdown_signal`).
const EXIT_FORCED_STOP: u8 = 4;

/// glibc's malloc raises its mmap threshold each time a large block is freed (up to 32 MiB), so
/// after the first 1 MiB values every later one came from the heaps of whichever runtime threads
/// handled it, and freed space stayed with each heap: the resident size could grow with how the
/// work was spread over threads, not with what was held (the slow-helper test of a 16 MB queue:
/// 126 to 133 MB here, 173 and 323 MB in two CI runs; 116 to 119 MB here with this). A
/// fixed threshold keeps every block of 512 KiB or more in a mapping of its own, returned to the
/// system when freed; smaller ones (the 256 KiB read chunks, rows, statements) stay in the heaps.
/// Set before any thread starts.
fn fix_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes a malloc setting; no other thread exists yet.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 512 * 1024);
    }
}

fn main() -> ExitCode {
    fix_large_allocations();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => match env_variable_behind(&e) {
            // clap names the flag; the value came from the environment.
            Some(variable) => {
                {
                    use std::io::Write as _;
                    let _ = write!(std::io::stderr(), "{}", e.render());
                }
                pgapply::err_line!("(the value comes from the environment variable {variable})");
                return ExitCode::from(EXIT_USAGE);
            }
            None => e.exit(),
        },
    };
    // The file may set the log level, so it is read before logging starts.
    let config_path = match &cli.command {
        Command::Run(a) => a.servers.config.clone(),
        Command::Check(a) => a.run.servers.config.clone(),
        Command::Cutover(a) => a.run.servers.config.clone(),
        Command::Verify(a) => a.servers.config.clone(),
        Command::Schema(a) => a.servers.config.clone(),
        Command::Status(a) => a.servers.config.clone(),
        Command::Skip(a) => a.servers.config.clone(),
        Command::Forget(a) => a.servers.config.clone(),
        _ => None,
    };
    let file = match config_path.as_deref().map(FileConfig::load).transpose() {
        Ok(f) => f.unwrap_or_default(),
        Err(e) => {
            early_error(cli.log_format, &e.to_string());
            return ExitCode::from(match e.class() {
                ErrorClass::Usage => EXIT_USAGE,
                _ => EXIT_DEFINITE,
            });
        }
    };
    // Flag (or PGAPPLY_LOG_LEVEL) over RUST_LOG over the file over "info", as for every setting.
    let level = cli
        .log_level
        .clone()
        .or_else(|| {
            std::env::var("RUST_LOG")
                .ok()
                .filter(|v| !v.trim().is_empty())
        })
        .or_else(|| file.log_level.clone());
    let filter = log_filter(level.as_deref().unwrap_or("info"));
    let filter = match filter {
        Ok(f) => f,
        Err(e) => {
            early_error(
                cli.log_format.or(file.log_format),
                &format!(
                    "invalid log level {}: {e}",
                    level.as_deref().unwrap_or("info")
                ),
            );
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let format = cli
        .log_format
        .or(file.log_format)
        .unwrap_or(LogFormat::Text);
    let (filter, log_reload) = tracing_subscriber::reload::Layer::new(filter);
    let fmt_layer: Box<dyn Layer<_> + Send + Sync> = match format {
        LogFormat::Json => Box::new(
            tracing_subscriber::fmt::layer()
                .json()
                .flatten_event(true)
                .with_writer(std::io::stderr),
        ),
        // Colours only on a terminal: a log file or journal gets plain text.
        LogFormat::Text => Box::new(
            tracing_subscriber::fmt::layer()
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_writer(std::io::stderr),
        ),
    };
    let subscriber = tracing_subscriber::registry()
        .with(filter)
        .with(ServerNotices)
        .with(fmt_layer);
    if tracing::subscriber::set_global_default(subscriber).is_ok()
        && log::set_boxed_logger(Box::new(LogBridge(tracing_log::LogTracer::new()))).is_ok()
    {
        log::set_max_level(log::LevelFilter::Trace);
    }
    // The log level can follow the config file on SIGHUP unless a flag or RUST_LOG set it.
    let level_from_file =
        cli.log_level.is_none() && std::env::var("RUST_LOG").map_or(true, |v| v.trim().is_empty());
    // One thread by default: reader, applier and connections hand work to each other for every
    // message, and on one thread that costs no wake-ups across cores (measured with bench/run.sh:
    // about 30% less CPU and 15% more throughput than two threads). PGAPPLY_WORKER_THREADS=N
    // (N > 1) runs N worker threads instead.
    let threads: usize = std::env::var("PGAPPLY_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        if threads > 1 {
            b.worker_threads(threads);
        }
        b
    };
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            pgapply::err_line!("pgapply: error: starting the runtime: {e}");
            return ExitCode::from(EXIT_DEFINITE);
        }
    };
    let result = runtime.block_on(async {
        // A reload signal sent to every pgapply process (a service manager's reload) must not
        // end a command half-way, a cutover least of all: only `run` reloads anything.
        if !matches!(cli.command, Command::Run(_)) {
            tokio::spawn(async {
                use tokio::signal::unix::{signal, SignalKind};
                let Ok(mut hup) = signal(SignalKind::hangup()) else {
                    return;
                };
                while hup.recv().await.is_some() {
                    tracing::info!("SIGHUP: nothing to reload for this command");
                }
            });
        }
        match cli.command {
            Command::Run(args) => {
                let reload = Reload {
                    path: args.servers.config.clone(),
                    log: log_reload,
                    level_from_file,
                };
                run_command(args, file, reload).await
            }
            Command::Check(args) => until_signalled(check::check_command(&args, &file)).await,
            Command::Status(args) => until_signalled(status::status_command(&args, &file)).await,
            Command::Skip(args) => until_signalled(skip::skip_command(&args, &file)).await,
            Command::Forget(args) => until_signalled(skip::forget_command(&args, &file)).await,
            Command::Verify(args) => until_signalled(verify_command(args, file)).await,
            Command::Cutover(args) => cutover_command(args, file).await,
            Command::Schema(args) => until_signalled(schema_command(args, file)).await,
            Command::Demo(args) => demo::demo(args.duration, args.pg_bin).await,
            Command::SourceSpeed(args) => {
                until_signalled(source_speed::source_speed_command(&args)).await
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // In JSON every line is an object (the log line); as text, the error ends the output
            // on a line of its own, and on a terminal that line alone (the same error twice on a
            // screen is noise; a log file keeps the timestamped line too).
            use std::io::IsTerminal;
            if format == LogFormat::Json || !std::io::stderr().is_terminal() {
                match RUN_SLOT.get() {
                    Some(slot) => tracing::error!(slot = %slot, error = %e, "stopped"),
                    None => tracing::error!(error = %e, "stopped"),
                }
            }
            if format == LogFormat::Text {
                pgapply::err_line!("pgapply: error: {e}");
            } else if !tracing::enabled!(tracing::Level::ERROR) {
                // (`--log-level off`: the error is still said, as it is as text.)
                early_error(Some(LogFormat::Json), &e.to_string());
            }
            let signalled = INTERRUPTED_BY.load(std::sync::atomic::Ordering::Relaxed);
            ExitCode::from(match e.class() {
                _ if signalled != 0 => 128 + signalled,
                ErrorClass::Definite => EXIT_DEFINITE,
                ErrorClass::Transient => EXIT_TRANSIENT,
                ErrorClass::Usage => EXIT_USAGE,
            })
        }
    }
}

/// The signal that ended a one-shot command (`until_signalled`), 0 for none: the exit code is
/// 128 + its number, as a shell reports a command a signal ended.
static INTERRUPTED_BY: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Runs a one-shot command (check, status, verify, skip, forget, schema, source-speed) until
/// it ends or SIGINT/SIGTERM arrives: then it is dropped where it is (its connections close, an
/// open transaction of its rolls back, a pg_dump it started is ended) and the process says so
/// and exits 130 or 143. (`run` and `cutover` have their own stops.)
async fn until_signalled(
    work: impl std::future::Future<Output = pgapply::error::Result<()>>,
) -> pgapply::error::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    pgapply::cancel::enable();
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // (No handlers: the default action ends the process.)
        return work.await;
    };
    let (name, number) = tokio::select! {
        result = work => return result,
        _ = int.recv() => ("SIGINT", libc::SIGINT),
        _ = term.recv() => ("SIGTERM", libc::SIGTERM),
    };
    pgapply::cancel::cancel_all().await;
    INTERRUPTED_BY.store(
        u8::try_from(number).unwrap_or(2),
        std::sync::atomic::Ordering::Relaxed,
    );
    Err(Error::definite(format!(
        "interrupted by {name} before it finished (a transaction it had open on a server is rolled back)"
    )))
}

/// The run's span (`run{slot=..}`), for lines the run's own tasks do not write (signals,
/// reloads): every line of a run names its slot.
fn run_span() -> tracing::Span {
    match RUN_SLOT.get() {
        Some(slot) => tracing::error_span!("run", slot = %slot),
        None => tracing::Span::none(),
    }
}

/// `forced_stop_note`: the target and slot whose status row says "stopped" when the process
/// ends at once.
fn shutdown_signal(
    forced_stop_note: Option<(tokio_postgres::Config, String)>,
) -> watch::Receiver<bool> {
    use tracing::Instrument;
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
        tracing::info!("shutting down: the transaction being applied, if one is, is committed if all of it has come, else rolled back (the source sends it again at the next start); a second SIGTERM or SIGINT stops at once");
        let _ = tx.send(true);
        // A graceful stop waits for the target to answer; a lock held there, or a target that
        // went silent, would keep it waiting. A second signal, or the grace period running out,
        // ends the process at once: the target rolls back the open transaction with the
        // session, and the next start resumes after the last committed one (as after kill -9).
        let forced = tokio::select! {
            _ = term.recv() => "a second signal",
            _ = int.recv() => "a second signal",
            _ = tokio::time::sleep(SHUTDOWN_GRACE) => "the shutdown taking longer than 30 s",
        };
        tracing::warn!("stopping at once after {forced}: the open target transaction is rolled back; the next start resumes after the last committed one");
        if let Some((target, slot)) = forced_stop_note {
            let note = pgapply::replicate::note_forced_stop(&target, &slot);
            let _ = tokio::time::timeout(Duration::from_secs(2), note).await;
        }
        std::process::exit(EXIT_FORCED_STOP.into());
    }.instrument(run_span()));
    rx
}

/// How long a graceful stop may take before the process ends at once (`shutdown_signal`).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// What SIGHUP reloads: the log level and the conflict policies, from the config file.
struct Reload {
    path: Option<std::path::PathBuf>,
    log: tracing_subscriber::reload::Handle<EnvFilter, tracing_subscriber::Registry>,
    level_from_file: bool,
}

fn reload_on_sighup(
    reload: Reload,
    policies: watch::Sender<std::sync::Arc<pgapply::apply::conflict::PolicyMap>>,
) {
    // The file as this process read it at its start: what a reload cannot change is said.
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|text| text.parse::<toml::Value>().ok())
    };
    let at_start = reload.path.as_deref().and_then(read);
    // Whether the level in force came from the file's log_level (taken out: back to info).
    let mut level_set_by_file = at_start
        .as_ref()
        .is_some_and(|v| v.get("log_level").is_some());
    use tracing::Instrument;
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            return;
        };
        while hup.recv().await.is_some() {
            let Some(path) = &reload.path else {
                tracing::info!("SIGHUP: no --config file to reload");
                continue;
            };
            // (The file first checked: what changed in a file that is not taken is not said.)
            let file = match FileConfig::load(path) {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(error = %e, "SIGHUP: config file not reloaded; keeping the current settings");
                    continue;
                }
            };
            if let (Some(before), Some(now)) = (&at_start, read(path)) {
                let changed = config::changed_on_reload(before, &now);
                if !changed.is_empty() {
                    tracing::warn!(
                        "SIGHUP: {} changed in the config file: a reload applies only log_level and the conflict policies, the rest takes effect when pgapply starts again",
                        changed.join(", ")
                    );
                }
            }
            // Only what a reload changes: the policies (not the servers or password files).
            match config::conflict_policies(&file) {
                Ok(map) => {
                    policies.send_replace(std::sync::Arc::new(map));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "SIGHUP: settings not reloaded");
                    continue;
                }
            }
            // The level first checked, then said (before it changes, so that it is seen
            // whatever the new level), then set.
            // (A log_level taken out of the file goes back to the default.)
            let filter = match (reload.level_from_file, &file.log_level) {
                (true, None) if level_set_by_file => log_filter("info").ok(),
                (true, Some(level)) => match log_filter(level) {
                    Ok(f) => Some(f),
                    Err(e) => {
                        tracing::warn!(error = %e, "SIGHUP: reloaded the conflict policies; the log_level is not valid, so the current level stays");
                        None
                    }
                },
                _ => None,
            };
            let back_to_info =
                reload.level_from_file && file.log_level.is_none() && level_set_by_file;
            match (&filter, reload.level_from_file) {
                // (Said below, once the level is back: a quieter one would hide it now.)
                (Some(_), true) if back_to_info => {}
                (Some(_), _) => tracing::info!("SIGHUP: reloaded log level and conflict policies"),
                (None, true) if file.log_level.is_none() => {
                    tracing::info!("SIGHUP: reloaded conflict policies (the file sets no log_level)")
                }
                (None, true) => {}
                (None, false) => tracing::info!("SIGHUP: reloaded conflict policies (the log level stays as --log-level, PGAPPLY_LOG_LEVEL or RUST_LOG set it)"),
            }
            if reload.level_from_file && (filter.is_some() || file.log_level.is_none()) {
                level_set_by_file = file.log_level.is_some();
            }
            if let Some(f) = filter {
                let _ = reload.log.reload(f);
                if back_to_info {
                    tracing::info!(
                        "SIGHUP: reloaded conflict policies; the file sets no log_level now: back to info"
                    );
                }
            }
        }
    }.instrument(run_span()));
}

/// The log filter for a level setting. The connection pool's own warnings ("Connection error:
/// db error", without the server or the reason) repeat what pgapply says about the same failure
/// with both: left out unless the setting names the pool.
/// The crates whose log lines pgapply shows: a directive naming anything else selects nothing.
const LOGGING_CRATES: [&str; 7] = [
    "pgapply",
    "tokio_postgres",
    "postgres_protocol",
    "deadpool",
    "deadpool_postgres",
    "rustls",
    "tokio",
];

/// The filter for a log level (`info`) or RUST_LOG-style directives (`info,pgapply=debug`).
fn log_filter(level: &str) -> Result<EnvFilter, String> {
    // A bare word is taken by the filter as a module whose every line is shown, and then nothing
    // else is: a misspelt level ("warning") would silence the log, errors included. (A module
    // name alone, `pgapply` or `tokio_postgres`, is a valid directive and stays one.)
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    const LEVEL_LIKE: [&str; 16] = [
        "warning",
        "warnings",
        "err",
        "errors",
        "information",
        "informational",
        "verbose",
        "notice",
        "fatal",
        "critical",
        "crit",
        "panic",
        "log",
        "none",
        "all",
        "quiet",
    ];
    for directive in level.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let word = directive.to_ascii_lowercase();
        // PostgreSQL's debug1 .. debug5.
        let numbered_debug = word.len() == 6 && word.starts_with("debug");
        if LEVEL_LIKE.contains(&word.as_str()) || numbered_debug {
            return Err(format!(
                "{directive:?} is not a log level: use one of {}, or directives such as info,pgapply=debug",
                LEVELS.join(", ")
            ));
        }
        // Any other bare word names a module: one of the crates that log here, or it is a
        // misspelt level ("inof") that would show nothing at all.
        let bare = !directive.contains('=') && !directive.contains('[');
        let first = word.split("::").next().unwrap_or_default();
        if bare && !LEVELS.contains(&word.as_str()) && !LOGGING_CRATES.contains(&first) {
            return Err(format!(
                "{directive:?} is neither a log level nor a module that logs: use one of {}, or directives such as info,pgapply=debug (modules: {})",
                LEVELS.join(", "),
                LOGGING_CRATES.join(", ")
            ));
        }
    }
    let directives = if level.contains("deadpool") {
        level.to_owned()
    } else {
        format!("{level},deadpool=error")
    };

    EnvFilter::try_new(directives).map_err(|e| e.to_string())
}

/// The servers' notices, which the client library logs as info lines of its own ("WARNING:
/// ...", "NOTICE: ..."): a NOTICE or INFO (a target trigger's RAISE NOTICE, say) and the
/// WARNING a ROLLBACK after a failed COMMIT draws ("there is no transaction in progress") are
/// noise beside what pgapply says, and left out; a server's WARNING (wraparound ahead, a
/// trigger's RAISE WARNING) stays, as the library's info line ("WARNING: ..."), shown unless
/// the log level is above info. From the debug level on, all are shown.
struct ServerNotices;

impl<S: tracing::Subscriber> Layer<S> for ServerNotices {
    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        // (Lines of the `log` crate come through tracing-log: their target is a field there.)
        let target = event.metadata().target();
        if target != "tokio_postgres::connection" && target != "log" {
            return true;
        }
        // From the debug level on, everything is shown.
        if tracing::level_filters::LevelFilter::current()
            >= tracing::level_filters::LevelFilter::DEBUG
        {
            return true;
        }
        #[derive(Default)]
        struct Fields {
            target: String,
            message: String,
        }
        impl tracing::field::Visit for Fields {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "log.target" {
                    self.target = value.to_owned();
                }
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                match field.name() {
                    "message" => self.message = format!("{value:?}"),
                    "log.target" => self.target = format!("{value:?}"),
                    _ => {}
                }
            }
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        if target == "log" && fields.target.trim_matches('"') != "tokio_postgres::connection" {
            return true;
        }
        let text = fields.message.as_str();
        !(text.starts_with("NOTICE:")
            || text.starts_with("INFO:")
            || text.starts_with("LOG:")
            || text.starts_with("DEBUG")
            || text == NO_TRANSACTION_WARNING)
    }
}

/// The `log` crate's lines (the client libraries') into tracing. tokio-postgres writes every
/// server notice at info level, so a server's WARNING (a REVOKE that revoked nothing, a target
/// trigger's RAISE WARNING) would be hidden by `--log-level warn`: it goes out at warn level here.
struct LogBridge(tracing_log::LogTracer);

const NOTICES_TARGET: &str = "tokio_postgres::connection";

impl log::Log for LogBridge {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.target() == NOTICES_TARGET || self.0.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        if record.target() == NOTICES_TARGET && record.level() == log::Level::Info {
            let text = record.args().to_string();
            // (That one follows a failed apply's rollback and says nothing new: left to
            // `ServerNotices` at info level.)
            if text.starts_with("WARNING:") && text != NO_TRANSACTION_WARNING {
                tracing::warn!(target: "tokio_postgres::connection", "{text}");
                return;
            }
        }
        if self.0.enabled(record.metadata()) {
            self.0.log(record);
        }
    }

    fn flush(&self) {}
}

const NO_TRANSACTION_WARNING: &str = "WARNING: there is no transaction in progress";

/// An error before logging has started (the config file, the log level): as a JSON object when
/// the log is asked for in JSON, so that a collector reading one object per line gets it too.
fn early_error(format: Option<LogFormat>, message: &str) {
    if format == Some(LogFormat::Json) {
        let line = serde_json::json!({
            "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
            "level": "ERROR",
            "target": "pgapply",
            "message": "stopped",
            "error": message,
        });
        pgapply::err_line!("{line}");
    } else {
        pgapply::err_line!("pgapply: error: {message}");
    }
}

/// Reads the passwords again (password files, PGPASSWORD's ~/.pgpass) before a run starts
/// again, as libpq reads them at each connection: a password rotated while pgapply ran is
/// taken without a restart. (A file that cannot be read now keeps the password read before.)
fn refresh_passwords(
    args: &RunArgs,
    file: &FileConfig,
    config: &mut pgapply::replicate::RunConfig,
) {
    let Ok(fresh) = config::resolve_servers(&args.servers, file) else {
        return;
    };
    if let Some(password) = fresh.source.get_password() {
        config.source.password(password);
    }
    if let Some(password) = fresh.target.get_password() {
        config.target.password(password);
    }
}

/// The slot `pgapply run` replicates, once known: named on its last log line too.
static RUN_SLOT: std::sync::OnceLock<String> = std::sync::OnceLock::new();

async fn run_command(args: RunArgs, file: FileConfig, reload: Reload) -> Result<(), Error> {
    let (mut config, service) = config::resolve(&args, &file)?;
    config::check_run_only(&config)?;
    let _ = RUN_SLOT.set(config.slot.clone());
    let _ = pgapply::metrics::METRICS.slot.set(config.slot.clone());
    let (policy_tx, policy_rx) = watch::channel(std::sync::Arc::new(config.policies.clone()));
    config.policy_updates = Some(policy_rx);
    if let Some(addr) = &service.metrics_addr {
        metrics::serve(addr).await?;
    }
    reload_on_sighup(reload, policy_tx);
    let mut shutdown = shutdown_signal(Some((config.target.clone(), config.slot.clone())));
    let mut backoff = Backoff::new(service.retry_min, service.retry_max);
    // The flushed position each run reports: attempts count the failures in a row of runs that
    // neither moved it nor lasted a minute (a run that applied something, or streamed for a
    // while, and then failed was not a failed attempt).
    let (progress_tx, progress_rx) = watch::channel(pgapply::replicate::RunProgress {
        durable: pgapply::protocol::Lsn::INVALID,
    });
    let mut first = true;
    let mut said_in_use = false;
    loop {
        if !std::mem::take(&mut first) {
            refresh_passwords(&args, &file, &mut config);
        }
        let before = progress_rx.borrow().durable;
        let started = std::time::Instant::now();
        match run(config.clone(), shutdown.clone(), Some(progress_tx.clone())).await {
            Ok(outcome) => {
                tracing::info!(slot = %config.slot, reason = ?outcome.reason, flushed_lsn = %outcome.flushed, "done");
                return Ok(());
            }
            Err(e) if e.is_planned_restart() && !*shutdown.borrow() => {
                tracing::info!(slot = %config.slot, "{e}");
            }
            // A stop asked while an attempt failed for a passing reason (the slot still in
            // use, say): a stop, as one during the wait after it would be, not a failure.
            Err(e) if (e.is_transient() || e.is_planned_restart()) && *shutdown.borrow() => {
                stopped_between_attempts(
                    &config,
                    &format!("while starting (that attempt ended with: {e})"),
                )
                .await;
                return Ok(());
            }
            Err(e) if e.is_transient() && !*shutdown.borrow() => {
                if progress_rx.borrow().durable > before
                    || started.elapsed() > Duration::from_secs(60)
                {
                    backoff.reset();
                }
                if service.max_retries > 0 && backoff.attempts >= service.max_retries {
                    return Err(
                        e.context(format!("giving up after {} attempts", backoff.attempts + 1))
                    );
                }
                metrics::METRICS.reconnects.inc();
                let mut delay = backoff.next_delay();
                let in_use = pgapply::replicate::is_slot_in_use(&e);
                if !in_use {
                    said_in_use = false;
                }
                if in_use {
                    // A warm standby: it takes over within seconds of the other worker's end,
                    // however long it has waited (the back-off would reach --retry-max).
                    delay = delay.min(Duration::from_secs(5));
                }
                let retry_in =
                    humantime::format_duration(Duration::from_millis(delay.as_millis() as u64));
                if in_use && std::mem::replace(&mut said_in_use, true) {
                    // (Said as a warning once: waiting is what a standby does.)
                    tracing::info!(slot = %config.slot, attempt = backoff.attempts, retry_in = %retry_in, "the slot is still in use on the source (another worker streams it): waiting to take over");
                } else {
                    tracing::warn!(
                        slot = %config.slot,
                        error = %e,
                        attempt = backoff.attempts,
                        retry_in = %retry_in,
                        "transient error; starting again from what the target recorded"
                    );
                }
                // Meanwhile the heartbeat goes on (`forget` refuses a slot whose worker waits
                // to try again), and a stop says so on the target.
                let mut target = None;
                let waiting = async {
                    loop {
                        pgapply::replicate::note_waiting(
                            &config.target,
                            &mut target,
                            &config.slot,
                            false,
                        )
                        .await;
                        tokio::time::sleep(Duration::from_secs(10)).await;
                    }
                };
                let stop = tokio::select! {
                    _ = tokio::time::sleep(delay) => false,
                    _ = waiting => false,
                    _ = shutdown.changed() => true,
                };
                if stop {
                    stopped_between_attempts(
                        &config,
                        &format!("while waiting to start again (after: {e})"),
                    )
                    .await;
                    return Ok(());
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// A stop asked between two attempts of `run`: recorded on the target (best effort, 5 s at
/// most) and said, `when` saying where it came.
async fn stopped_between_attempts(config: &pgapply::replicate::RunConfig, when: &str) {
    let mut target = None;
    let noting = pgapply::replicate::note_waiting(&config.target, &mut target, &config.slot, true);
    let _ = tokio::time::timeout(Duration::from_secs(5), noting).await;
    tracing::info!(slot = %config.slot, "replication stopped {when}");
    tracing::info!(slot = %config.slot, reason = "Shutdown", "done");
}

async fn schema_command(args: SchemaArgs, file: FileConfig) -> Result<(), Error> {
    let servers = config::resolve_servers(&args.servers, &file)?;
    let table_map = config::table_map(&file)?;
    let sort_memory = match args.maintenance_work_mem.trim() {
        "server" => None,
        size => Some(
            pgapply::cutover::parse_size(size)
                .map_err(|e| Error::usage(format!("--maintenance-work-mem: {}", e.message())))?,
        ),
    };
    schema::schema(
        &servers.source,
        &servers.target,
        &servers.publications,
        &args.section,
        &table_map,
        sort_memory,
    )
    .await
}

async fn verify_command(args: VerifyArgs, file: FileConfig) -> Result<(), Error> {
    let servers = config::resolve_servers(&args.servers, &file)?;
    let table_map = config::table_map(&file)?;
    let settings = verify::VerifySettings {
        chunk_rows: args.chunk_rows.max(1),
        jobs: args.jobs as usize,
        ..Default::default()
    };
    let results = verify::verify(
        &servers.source,
        &servers.target,
        &servers.publications,
        &table_map,
        &config::column_map(&file)?,
        &settings,
    )
    .await?;
    verify::report(&results, args.json)
}

async fn cutover_command(args: CutoverArgs, file: FileConfig) -> Result<(), Error> {
    if args.run.endpos.is_some() {
        return Err(Error::usage(
            "--endpos (or PGAPPLY_ENDPOS) does not apply to cutover: it takes the end position from the source itself once writes have stopped; leave it out",
        ));
    }
    pgapply::cancel::enable();
    let (mut config, service) = config::resolve(&args.run, &file)?;
    // (A run's --copy-only, from the environment or the file, is not the cutover's business.)
    config.copy_only = false;
    if let Some(addr) = &service.metrics_addr {
        // The running worker may serve the same address (a config file both use): its metrics
        // stay where they are, and the cutover goes on without its own.
        if let Err(e) = metrics::serve(addr).await {
            if e.class() == ErrorClass::Usage {
                return Err(e);
            }
            tracing::info!(error = %e, "cutover: no metrics of its own (the address is the running worker's when both read one config file; the worker's stay served)");
        }
    }
    let settings = cutover::CutoverSettings {
        max_lag: cutover::MaxLag::parse(&args.max_lag)?,
        timeout: args.timeout,
        freeze_roles: args
            .freeze_writes
            .iter()
            .map(|r| r.trim().to_owned())
            .filter(|r| !r.is_empty())
            .collect(),
        all_sequences: args.all_sequences,
        reverse: args.reverse,
        no_verify: args.no_verify,
        again: args.again,
    };
    // A signal ends it with what is left to do (writes may be frozen by then), not in silence.
    let (roles, shown) = (settings.freeze_roles.clone(), config.clone());
    let signalled = async {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            },
            // (No handler: the default action ends the process.)
            _ => std::future::pending().await,
        }
    };
    tokio::select! {
        result = cutover::cutover(config, settings, verify::VerifySettings::default()) => result,
        _ = signalled => {
            // (Its verify step's comparisons, if it was there.)
            pgapply::cancel::cancel_all().await;
            cutover::release_own_run(&shown).await;
            Err(cutover::interrupted(&shown, &roles))
        }
    }
}

/// The environment variable a refused value came from, when the flag itself is not on the
/// command line.
fn env_variable_behind(e: &clap::Error) -> Option<String> {
    use clap::error::ErrorKind;
    use clap::CommandFactory;
    if !matches!(
        e.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return None;
    }
    let clap::error::ContextValue::String(arg) = e.get(clap::error::ContextKind::InvalidArg)?
    else {
        return None;
    };
    // ("--slot <SLOT>", or "--create-slot[=<on|off>]" for a flag whose value is optional.)
    let long = arg
        .strip_prefix("--")?
        .split(|c: char| c.is_whitespace() || c == '[' || c == '=')
        .next()?;
    let given = std::env::args_os().any(|a| {
        let a = a.to_string_lossy();
        a == format!("--{long}") || a.starts_with(&format!("--{long}="))
    });
    if given {
        return None;
    }
    let command = Cli::command();
    let args = command
        .get_arguments()
        .chain(command.get_subcommands().flat_map(|c| c.get_arguments()));
    let variable = args
        .filter(|a| a.get_long() == Some(long))
        .filter_map(|a| a.get_env())
        .find(|v| std::env::var_os(v).is_some())
        .map(|v| v.to_string_lossy().into_owned());
    variable
}
