//! TCP proxy on 127.0.0.1 that delays every byte by a fixed time in each direction.
//!
//! Usage: `delay_proxy LISTEN_PORT UPSTREAM_PORT DELAY_MS`
//!
//! bench/run.sh puts it between pgapply and the target server to add a network round trip of
//! 2 x DELAY_MS. Each direction of each connection has a reader thread that stamps every chunk it
//! receives with "send at = arrival + delay" and a writer thread that forwards the chunks in order,
//! each no earlier than its stamp. The reader never waits for the writer (up to a bounded
//! backlog), so the delay adds latency without limiting throughput: chunks arriving 0.1 ms apart
//! leave 0.1 ms apart, DELAY_MS later.
//!
//! Why threads and not tokio: the writer must wake at its stamp with sub-millisecond precision,
//! and tokio's timer rounds up to whole milliseconds, which would turn 1 ms into up to 2 ms. A
//! blocked thread costs nothing, and `thread::sleep` wakes within tens of microseconds. The first
//! version was a Python asyncio script; its own CPU use on the 2-core bench machine cost pgapply
//! ~17% of its throughput before any delay was added, which hid what the delay itself costs.
//!
//! Prints "ready" on stdout once it listens.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread;
use std::time::{Duration, Instant};

const CHUNK: usize = 256 * 1024;
/// Backpressure: the reader waits when this many chunks are queued.
const MAX_QUEUED_CHUNKS: usize = 1024;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let parsed = match args.as_slice() {
        [_, listen, upstream, delay] => listen
            .parse::<u16>()
            .ok()
            .zip(upstream.parse::<u16>().ok())
            .zip(
                delay
                    .parse::<f64>()
                    .ok()
                    .filter(|d| d.is_finite() && *d >= 0.0),
            ),
        _ => None,
    };
    let Some(((listen_port, upstream_port), delay_ms)) = parsed else {
        eprintln!(
            "usage: delay_proxy LISTEN_PORT UPSTREAM_PORT DELAY_MS (ports 1-65535, delay >= 0)"
        );
        std::process::exit(2);
    };
    let delay = Duration::from_secs_f64(delay_ms / 1000.0);
    let listener = match TcpListener::bind(("127.0.0.1", listen_port)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("delay_proxy: cannot listen on 127.0.0.1:{listen_port}: {e}");
            std::process::exit(1);
        }
    };
    println!("ready");
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        thread::spawn(move || connect(client, upstream_port, delay));
    }
}

/// Joins one client connection to a new upstream connection, one delayed pump each way.
fn connect(client: TcpStream, upstream_port: u16, delay: Duration) {
    let server = match TcpStream::connect(("127.0.0.1", upstream_port)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("delay_proxy: cannot reach 127.0.0.1:{upstream_port}: {e}");
            return;
        }
    };
    for s in [&client, &server] {
        let _ = s.set_nodelay(true);
    }
    let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else {
        eprintln!("delay_proxy: cannot clone a socket handle");
        return;
    };
    pump(client, server, delay);
    pump(server2, client2, delay);
}

/// Forwards `from` to `to`, each chunk `delay` after it arrived, order kept. Each direction
/// ends on its own (half close), so the connection closes when both have.
fn pump(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (tx, rx): (SyncSender<(Instant, Vec<u8>)>, Receiver<_>) = sync_channel(MAX_QUEUED_CHUNKS);
    thread::spawn(move || {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
        // Dropping tx tells the writer that this direction has ended.
    });
    thread::spawn(move || {
        let mut out = Vec::with_capacity(CHUNK);
        while let Ok((due, data)) = rx.recv() {
            let now = Instant::now();
            if due > now {
                thread::sleep(due - now);
            }
            // Chunks that are due by now leave in the same write: one system call and one
            // wake-up of the receiver instead of one per chunk.
            out.clear();
            out.extend_from_slice(&data);
            while out.len() < CHUNK {
                match rx.try_recv() {
                    Ok((due, data)) if due <= Instant::now() => out.extend_from_slice(&data),
                    Ok((due, data)) => {
                        if to.write_all(&out).is_err() {
                            return;
                        }
                        out.clear();
                        thread::sleep(due.saturating_duration_since(Instant::now()));
                        out.extend_from_slice(&data);
                    }
                    Err(_) => break,
                }
            }
            if to.write_all(&out).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}
