//! Spooling of streamed (in-progress) transactions: their messages are kept, in the order
//! received, until Stream Commit applies them or Stream Abort discards them.
//!
//! Each transaction keeps a bounded in-memory buffer; past it, its messages go to a file under the
//! spool directory, so memory stays flat whatever the transaction's size. All transactions
//! together have a bound too: past it, the largest one in memory goes to its file. Messages are stored as
//! the raw pgoutput bytes (length-prefixed on disk) and decoded again when replayed. A
//! subtransaction's abort cuts the spool back to where that subtransaction's first change was,
//! as PostgreSQL's own apply worker does: anything after it belongs to the aborted subtransaction
//! or its children. Files are removed after use, and those an earlier run left behind (killed,
//! say) at start-up.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::metrics::METRICS;
use crate::protocol::pgoutput::Xid;

/// Bytes of one transaction kept in memory before it goes to disk.
const MEMORY_PER_TRANSACTION: usize = 4 * 1024 * 1024;

/// Bytes of all spooled transactions kept in memory: past it, the largest goes to disk (many
/// large transactions streamed at once must not add up).
const MEMORY_IN_ALL: usize = 64 * 1024 * 1024;

/// The write buffer of a transaction's file.
const WRITE_BUFFER: usize = 256 * 1024;

struct SpooledTransaction {
    /// Messages not yet written to the file.
    memory: Vec<Bytes>,
    memory_bytes: usize,
    file: Option<(PathBuf, BufWriter<File>)>,
    /// Bytes written to the file.
    file_bytes: u64,
    /// Messages written to the file.
    file_messages: usize,
    /// Per subtransaction: where its first change is in the whole spooled stream (file, then
    /// memory), as (serialized bytes before it, messages before it).
    subtransactions: Vec<(Xid, u64, usize)>,
    /// The xids in `subtransactions`: a transaction may have a million of them (a loop with an
    /// exception block), and each of its messages is checked.
    known: std::collections::HashSet<Xid>,
    /// Relation and Type messages, by position in the stream: the source sends a relation's
    /// description once per streamed transaction, in whichever subtransaction first uses it, and
    /// counts it as sent even when that subtransaction is rolled back. A cut keeps them.
    schema: Vec<(usize, Bytes)>,
}

impl SpooledTransaction {
    fn new() -> Self {
        SpooledTransaction {
            memory: Vec::new(),
            memory_bytes: 0,
            file: None,
            file_bytes: 0,
            file_messages: 0,
            subtransactions: Vec::new(),
            known: std::collections::HashSet::new(),
            schema: Vec::new(),
        }
    }
}

/// Where a spool's files go: `<dir>/<slot>.<instance>.xid-<xid>.spool`. The slot in the name
/// keeps pgapply processes of other slots given the same `--spool-dir` out of each other's files
/// (two sources may both have an xid 1234). The instance keeps apart processes of the same slot
/// name, which two sources may both use: each holds a lock on `<slot>.<instance>.lock` for as
/// long as it runs, and a start empties only the files of the instance it locked (left by a
/// process that ended without removing them, killed say).
#[derive(Clone)]
struct SpoolFiles {
    dir: PathBuf,
    /// `<slot>.<instance>`.
    prefix: String,
}

/// Processes of one slot name that may spool into one directory at once.
const MAX_INSTANCES: u32 = 64;

impl SpoolFiles {
    fn path(&self, xid: Xid) -> PathBuf {
        self.dir.join(format!("{}.xid-{xid}.spool", self.prefix))
    }

    /// This instance's files.
    fn is_ours(&self, name: &str) -> bool {
        name.strip_prefix(self.prefix.as_str())
            .and_then(|rest| rest.strip_prefix(".xid-"))
            .is_some_and(|rest| rest.ends_with(".spool"))
    }
}

/// Files of pgapply versions that named them `xid-<xid>.spool` or `<slot>.xid-<xid>.spool`:
/// left by a run before an upgrade, they would stay for ever.
fn is_legacy(name: &str, slot: &str) -> bool {
    let unnamed = name.strip_prefix("xid-");
    let named = name
        .strip_prefix(slot)
        .and_then(|rest| rest.strip_prefix(".xid-"));
    unnamed
        .or(named)
        .is_some_and(|rest| rest.ends_with(".spool"))
}

/// Takes the first free instance of `slot` in `dir`: its lock file, held (by the open file)
/// until the spool is dropped or the process ends, however it ends.
fn lock_instance(dir: &std::path::Path, slot: &str) -> Result<(u32, File)> {
    use std::os::fd::AsRawFd;
    for instance in 0..MAX_INSTANCES {
        let path = dir.join(format!("{slot}.{instance}.lock"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| spool_error(&path, e))?;
        // SAFETY: flock on a descriptor this function owns; it has no other preconditions.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok((instance, file));
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            // A filesystem without locks (some network ones): spooling still works, but two
            // processes of one slot name must not share the directory.
            tracing::warn!(
                error = %e,
                "cannot lock {} in the spool directory: two pgapply processes of slot {slot} must not share it (give each its own --spool-dir)",
                path.display()
            );
            return Ok((instance, file));
        }
    }
    Err(Error::definite(format!(
        "spool directory {}: {MAX_INSTANCES} pgapply processes of slot {slot} spool there already: give this one a --spool-dir of its own",
        dir.display()
    )))
}

pub struct Spool {
    files: SpoolFiles,
    /// Held while the spool is in use (`lock_instance`).
    _lock: File,
    transactions: HashMap<Xid, SpooledTransaction>,
    /// The sum of the transactions' `memory_bytes`.
    memory_bytes: usize,
}

/// Messages of one committed streamed transaction, in order: file first, then memory.
pub struct Replay {
    file: Option<(PathBuf, BufReader<File>)>,
    memory: std::vec::IntoIter<Bytes>,
}

impl Replay {
    pub fn next_message(&mut self) -> Result<Option<Bytes>> {
        if let Some((path, reader)) = &mut self.file {
            let broken = |what: String| {
                Error::definite(format!(
                    "reading spool file {}: {what}; the streamed transaction is received again after a restart",
                    path.display()
                ))
            };
            // A length prefix, then that many bytes. No bytes at all is the file's end; part of
            // a prefix, or fewer bytes than it says, is a damaged file, not an end.
            let mut len = [0u8; 4];
            let mut got = 0;
            while got < 4 {
                match reader.read(&mut len[got..]) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(broken(e.to_string())),
                }
            }
            if got == 0 {
                let _ = std::fs::remove_file(&*path);
                self.file = None;
                return Ok(self.memory.next());
            }
            if got < 4 {
                return Err(broken("it ends inside a length prefix".into()));
            }
            let len = u32::from_be_bytes(len) as usize;
            // Read (and allocated) as far as the file goes, not as far as the prefix claims
            // beyond 64 MiB (a damaged prefix may claim 4 GiB). Below that, one allocation of
            // the message's size: grown by doubling, a 1 MiB value kept 2 MiB alive while its
            // statement was pending.
            let mut buf = Vec::with_capacity(len.min(64 << 20));
            std::io::Read::by_ref(reader)
                .take(len as u64)
                .read_to_end(&mut buf)
                .map_err(|e| broken(e.to_string()))?;
            if buf.len() != len {
                return Err(broken(format!(
                    "a {len}-byte message ends after {} bytes",
                    buf.len()
                )));
            }
            return Ok(Some(Bytes::from(buf)));
        }
        Ok(self.memory.next())
    }
}

impl Drop for Replay {
    fn drop(&mut self) {
        if let Some((path, _)) = &self.file {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The default spool directory, in the shared temp directory: created private to this user
/// (0700), and refused when it exists otherwise. Another user could read the spooled rows there,
/// or leave files and links for pgapply to write through or to replay.
pub fn private_dir(dir: &std::path::Path) -> Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(Error::definite(format!(
                "cannot create spool directory {}: {e} (--spool-dir, or PGAPPLY_SPOOL_DIR, chooses where spooled transactions go: point it at a directory this user may create and write)",
                dir.display()
            )))
        }
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| {
        Error::definite(format!(
            "spool directory {}: {e} (--spool-dir, or PGAPPLY_SPOOL_DIR, chooses where spooled transactions go: point it at a directory this user may create and write)",
            dir.display()
        ))
    })?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !meta.is_dir() || meta.uid() != me {
        return Err(Error::definite(format!(
            "spool directory {} exists but is not this user's (a link, or another owner): remove it, or set --spool-dir to a directory of your own",
            dir.display()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        // Made by an earlier version with the default umask.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| {
            Error::definite(format!(
                "spool directory {}: {e} (--spool-dir, or PGAPPLY_SPOOL_DIR, chooses where spooled transactions go: point it at a directory this user may create and write)",
                dir.display()
            ))
        })?;
    }
    Ok(())
}

impl Spool {
    /// A spool in `dir` for `slot`, emptied of files left by an earlier run on that slot.
    pub fn open(dir: PathBuf, slot: &str) -> Result<Spool> {
        // Spooled rows are the source's data: readable by this user only.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| {
                Error::definite(format!(
                    "cannot create spool directory {}: {e} (--spool-dir, or PGAPPLY_SPOOL_DIR, chooses where spooled transactions go: point it at a directory this user may create and write)",
                    dir.display()
                ))
            })?;
        let (instance, lock) = lock_instance(&dir, slot)?;
        let files = SpoolFiles {
            dir: dir.clone(),
            prefix: format!("{slot}.{instance}"),
        };
        // Only this instance's own files go: the directory may be shared with other things,
        // and with other processes of the slot name.
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let name = entry.file_name();
                let name = name.to_string_lossy();
                if files.is_ours(&name) || (instance == 0 && is_legacy(&name, slot)) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        Ok(Spool {
            files,
            _lock: lock,
            transactions: HashMap::new(),
            memory_bytes: 0,
        })
    }

    /// Stream Start: a first segment starts the transaction afresh.
    pub fn start(&mut self, xid: Xid, first_segment: bool) {
        if first_segment {
            self.discard(xid);
        }
        self.transactions
            .entry(xid)
            .or_insert_with(SpooledTransaction::new);
    }

    /// Appends a message of transaction `xid`; `subxid` is the xid the message carries.
    pub fn append(&mut self, xid: Xid, subxid: Option<Xid>, raw: Bytes) -> Result<()> {
        let files = self.files.clone();
        let t = self
            .transactions
            .entry(xid)
            .or_insert_with(SpooledTransaction::new);
        if let Some(sub) = subxid.filter(|s| *s != xid) {
            if t.known.insert(sub) {
                let bytes = t.file_bytes + (t.memory_bytes + 4 * t.memory.len()) as u64;
                let messages = t.file_messages + t.memory.len();
                t.subtransactions.push((sub, bytes, messages));
            }
        }
        // A copy: the message is a slice of a 256 KiB read buffer, which it would keep alive
        // for as long as the transaction is spooled, uncounted.
        let raw = Bytes::copy_from_slice(&raw);
        if matches!(raw.first(), Some(b'R' | b'Y')) {
            t.schema
                .push((t.file_messages + t.memory.len(), raw.clone()));
        }
        let before = t.memory_bytes;
        push_message(&files, xid, t, raw)?;
        self.memory_bytes = self.memory_bytes.saturating_sub(before) + t.memory_bytes;
        while self.memory_bytes > MEMORY_IN_ALL {
            // (One smaller than its file's write buffer would cost more memory on disk.)
            let largest = self
                .transactions
                .iter()
                .filter(|(_, t)| t.memory_bytes >= WRITE_BUFFER)
                .max_by_key(|(_, t)| t.memory_bytes)
                .map(|(x, _)| *x);
            let Some((x, t)) = largest.and_then(|x| self.transactions.get_mut(&x).map(|t| (x, t)))
            else {
                break;
            };
            let before = t.memory_bytes;
            flush_to_file(&files, x, t)?;
            self.memory_bytes = self.memory_bytes.saturating_sub(before);
        }
        Ok(())
    }

    /// Bytes of spooled messages held in memory, all transactions together.
    pub fn memory_bytes(&self) -> usize {
        self.memory_bytes
    }

    fn recount(&mut self) {
        self.memory_bytes = self.transactions.values().map(|t| t.memory_bytes).sum();
    }

    /// Stream Abort: the whole transaction (`subxid == xid`) or one subtransaction.
    pub fn abort(&mut self, xid: Xid, subxid: Xid) -> Result<()> {
        if xid == subxid {
            self.discard(xid);
            return Ok(());
        }
        let Some(t) = self.transactions.get_mut(&xid) else {
            return Ok(());
        };
        // From the end: the one aborted is usually the latest.
        let Some(pos) = t.subtransactions.iter().rposition(|(x, ..)| *x == subxid) else {
            // No change of that subtransaction was streamed: nothing to undo.
            return Ok(());
        };
        let (_, cut_bytes, cut_messages) = t.subtransactions[pos];
        for (x, ..) in t.subtransactions.drain(pos..) {
            t.known.remove(&x);
        }
        if cut_messages < t.file_messages {
            // The cut is inside the file: truncate it and drop everything in memory.
            if let Some((path, writer)) = &mut t.file {
                writer.flush().map_err(|e| spool_error(path, e))?;
                writer
                    .get_ref()
                    .set_len(cut_bytes)
                    .map_err(|e| spool_error(path, e))?;
                // Appends continue at the new end.
                let file = OpenOptions::new()
                    .append(true)
                    .open(&*path)
                    .map_err(|e| spool_error(path, e))?;
                *writer = BufWriter::with_capacity(WRITE_BUFFER, file);
            }
            t.file_bytes = cut_bytes;
            t.file_messages = cut_messages;
            t.memory.clear();
            t.memory_bytes = 0;
        } else {
            t.memory.truncate(cut_messages - t.file_messages);
            t.memory_bytes = t.memory.iter().map(Bytes::len).sum();
        }
        // Descriptions sent in what was cut still describe the tables for what follows.
        let kept = t.schema.iter().position(|(at, _)| *at >= cut_messages);
        if let Some(kept) = kept {
            let cut_schema: Vec<Bytes> = t.schema.drain(kept..).map(|(_, raw)| raw).collect();
            let files = self.files.clone();
            for raw in cut_schema {
                t.schema
                    .push((t.file_messages + t.memory.len(), raw.clone()));
                push_message(&files, xid, t, raw)?;
            }
        }
        self.recount();
        Ok(())
    }

    /// Stream Commit / Stream Prepare: the transaction's messages, in order; removed from the spool.
    pub fn take(&mut self, xid: Xid) -> Result<Replay> {
        let Some(mut t) = self.transactions.remove(&xid) else {
            return Ok(Replay {
                file: None,
                memory: Vec::new().into_iter(),
            });
        };
        self.recount();
        let file = match t.file.take() {
            Some((path, mut writer)) => {
                writer.flush().map_err(|e| spool_error(&path, e))?;
                drop(writer);
                let reader = File::open(&path).map_err(|e| spool_error(&path, e))?;
                Some((path, BufReader::with_capacity(256 * 1024, reader)))
            }
            None => None,
        };
        Ok(Replay {
            file,
            memory: std::mem::take(&mut t.memory).into_iter(),
        })
    }

    pub fn discard(&mut self, xid: Xid) {
        if let Some(t) = self.transactions.remove(&xid) {
            if let Some((path, _)) = t.file {
                let _ = std::fs::remove_file(path);
            }
            self.recount();
        }
    }

    /// Transactions being spooled.
    pub fn len(&self) -> usize {
        self.transactions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.transactions.is_empty()
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        let xids: Vec<Xid> = self.transactions.keys().copied().collect();
        for xid in xids {
            self.discard(xid);
        }
    }
}

fn spool_error(path: &std::path::Path, e: std::io::Error) -> Error {
    let hint = if e.raw_os_error() == Some(libc::ENOSPC) {
        ": free space there, or set --spool-dir to a disk with room (nothing is lost: the source sends the transaction again when pgapply starts again)"
    } else {
        ""
    };
    Error::definite(format!("spool file {}: {e}{hint}", path.display()))
}

/// Adds a message at the end, spilling to the file beyond the memory allowance.
fn push_message(
    files: &SpoolFiles,
    xid: Xid,
    t: &mut SpooledTransaction,
    raw: Bytes,
) -> Result<()> {
    t.memory_bytes += raw.len();
    t.memory.push(raw);
    if t.memory_bytes > MEMORY_PER_TRANSACTION {
        flush_to_file(files, xid, t)?;
    }
    Ok(())
}

fn flush_to_file(files: &SpoolFiles, xid: Xid, t: &mut SpooledTransaction) -> Result<()> {
    if t.file.is_none() {
        let path = files.path(xid);
        // A new file of this user's only, never one found in its place (or a link).
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| spool_error(&path, e))?;
        t.file = Some((path, BufWriter::with_capacity(WRITE_BUFFER, file)));
    }
    let Some((path, writer)) = &mut t.file else {
        return Ok(());
    };
    for raw in t.memory.drain(..) {
        writer
            .write_all(&(raw.len() as u32).to_be_bytes())
            .and_then(|_| writer.write_all(&raw))
            .map_err(|e| spool_error(path, e))?;
        t.file_bytes += 4 + raw.len() as u64;
        t.file_messages += 1;
        METRICS.spilled_bytes.add(4 + raw.len() as u64);
    }
    t.memory_bytes = 0;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(replay: &mut Replay) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(m) = replay.next_message().unwrap() {
            out.push(m.to_vec());
        }
        out
    }

    /// Spooled transactions' files (not the instances' lock files).
    fn spooled(d: &std::path::Path) -> usize {
        std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".spool"))
            .count()
    }

    fn dir(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("pgapply-spool-test-{}-{name}", std::process::id()))
    }

    #[test]
    fn the_default_directory_is_private_and_files_are_the_users_only() {
        let d = dir("private");
        let _ = std::fs::remove_dir_all(&d);
        // Made by an earlier version with the default umask: tightened.
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(&d).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        // A link in its place is refused.
        let link = dir("private-link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&d, &link).unwrap();
        let err = private_dir(&link).unwrap_err().to_string();
        assert!(err.contains("not this user's"), "{err}");
        // Spilled files: 0600.
        let mut s = Spool::open(d.clone(), "s").unwrap();
        s.start(7, true);
        s.append(7, None, Bytes::from(vec![1u8; MEMORY_PER_TRANSACTION + 1]))
            .unwrap();
        let file = d.join("s.0.xid-7.spool");
        assert_eq!(std::fs::metadata(&file).unwrap().mode() & 0o777, 0o600);
        drop(s);
        let _ = std::fs::remove_file(&link);
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Two sources may use one slot name, and their pgapply processes the default spool
    /// directory: neither removes the other's files, nor writes into them.
    #[test]
    fn processes_of_one_slot_name_keep_to_their_own_files() {
        let d = dir("instances");
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir(&d).unwrap();
        // Left by an earlier version, and by a killed process.
        std::fs::write(d.join("s.xid-3.spool"), b"old").unwrap();
        std::fs::write(d.join("s.0.xid-4.spool"), b"killed").unwrap();
        let big = Bytes::from(vec![1u8; MEMORY_PER_TRANSACTION + 1]);
        let mut first = Spool::open(d.clone(), "s").unwrap();
        assert!(!d.join("s.xid-3.spool").exists());
        assert!(!d.join("s.0.xid-4.spool").exists());
        first.start(9, true);
        first.append(9, None, big.clone()).unwrap();
        assert!(d.join("s.0.xid-9.spool").exists());
        // A second process of the slot name, while the first runs: its own files, the same xid.
        let mut second = Spool::open(d.clone(), "s").unwrap();
        assert!(d.join("s.0.xid-9.spool").exists(), "the first's file stays");
        second.start(9, true);
        second.append(9, None, big.clone()).unwrap();
        assert!(d.join("s.1.xid-9.spool").exists());
        assert_eq!(messages(&mut first.take(9).unwrap()).len(), 1);
        // The first ends; a third start takes its place (and would remove what it left).
        drop(first);
        let third = Spool::open(d.clone(), "s").unwrap();
        assert_eq!(third.files.prefix, "s.0");
        assert!(
            d.join("s.1.xid-9.spool").exists(),
            "the second's file stays"
        );
        assert_eq!(messages(&mut second.take(9).unwrap()).len(), 1);
        drop((second, third));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_relation_sent_in_a_rolled_back_subtransaction_stays() {
        for spill in [false, true] {
            let mut s =
                Spool::open(dir(if spill { "schema-file" } else { "schema-mem" }), "s").unwrap();
            s.start(10, true);
            s.append(10, Some(10), Bytes::from_static(b"Ia")).unwrap();
            s.append(10, Some(11), Bytes::from_static(b"Rrel")).unwrap();
            s.append(10, Some(11), Bytes::from_static(b"Ib")).unwrap();
            if spill {
                let big = vec![b'I'; MEMORY_PER_TRANSACTION + 1];
                s.append(10, Some(11), Bytes::from(big)).unwrap();
            }
            s.abort(10, 11).unwrap();
            s.append(10, Some(12), Bytes::from_static(b"Ic")).unwrap();
            let mut replay = s.take(10).unwrap();
            assert_eq!(
                messages(&mut replay),
                vec![b"Ia".to_vec(), b"Rrel".to_vec(), b"Ic".to_vec()],
                "spilled: {spill}"
            );
        }
    }

    #[test]
    fn memory_only_subtransaction_abort() {
        let mut s = Spool::open(dir("mem"), "s").unwrap();
        s.start(10, true);
        s.append(10, Some(10), Bytes::from_static(b"a")).unwrap();
        s.append(10, Some(11), Bytes::from_static(b"b")).unwrap();
        s.append(10, Some(11), Bytes::from_static(b"c")).unwrap();
        s.append(10, Some(12), Bytes::from_static(b"d")).unwrap();
        s.abort(10, 12).unwrap();
        s.append(10, Some(10), Bytes::from_static(b"e")).unwrap();
        s.abort(10, 99).unwrap();
        let mut r = s.take(10).unwrap();
        assert_eq!(
            messages(&mut r),
            vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec(), b"e".to_vec()]
        );
    }

    #[test]
    fn large_transaction_goes_to_disk_and_aborts_cut_the_file() {
        let d = dir("disk");
        let mut s = Spool::open(d.clone(), "s").unwrap();
        s.start(5, true);
        let big = Bytes::from(vec![7u8; 1024 * 1024]);
        for _ in 0..6 {
            s.append(5, Some(5), big.clone()).unwrap();
        }
        // A subtransaction whose changes start in memory and end up in the file.
        s.append(5, Some(6), Bytes::from_static(b"sub")).unwrap();
        for _ in 0..5 {
            s.append(5, Some(6), big.clone()).unwrap();
        }
        assert!(spooled(&d) == 1, "spilled to a file");
        s.abort(5, 6).unwrap();
        s.append(5, Some(5), Bytes::from_static(b"tail")).unwrap();
        let mut r = s.take(5).unwrap();
        let got = messages(&mut r);
        assert_eq!(got.len(), 7);
        assert!(got[..6].iter().all(|m| m.len() == 1024 * 1024));
        assert_eq!(got[6], b"tail");
        drop(r);
        assert_eq!(spooled(&d), 0, "file removed after use");
        // Whole-transaction abort removes everything.
        s.start(8, true);
        for _ in 0..6 {
            s.append(8, Some(8), big.clone()).unwrap();
        }
        s.abort(8, 8).unwrap();
        assert_eq!(spooled(&d), 0);
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn a_damaged_spool_file_is_an_error_not_an_end_or_a_huge_allocation() {
        let d = dir("damaged");
        std::fs::create_dir_all(&d).unwrap();
        // A file that ends inside a length prefix was read as a clean end before; one whose
        // prefix claims more than there is must not be allocated at that size either.
        for (name, bytes, says) in [
            ("prefix", vec![0u8, 0], "inside a length prefix"),
            (
                "short",
                vec![0xff, 0xff, 0xff, 0xff, 1, 2, 3],
                "ends after 3 bytes",
            ),
        ] {
            let path = d.join(name);
            std::fs::write(&path, &bytes).unwrap();
            let file = File::open(&path).unwrap();
            let mut replay = Replay {
                file: Some((path, BufReader::new(file))),
                memory: Vec::new().into_iter(),
            };
            let err = replay.next_message().unwrap_err().to_string();
            assert!(
                err.contains("spool file") && err.contains(says),
                "{name}: {err}"
            );
        }
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn many_transactions_at_once_stay_within_the_memory_for_all() {
        let d = dir("many");
        let mut s = Spool::open(d.clone(), "s").unwrap();
        for xid in 1..=40u32 {
            s.start(xid, true);
            for i in 0..3u8 {
                let chunk = Bytes::from(vec![xid as u8 ^ i; 1024 * 1024]);
                s.append(xid, Some(xid), chunk).unwrap();
            }
            assert!(s.memory_bytes() <= MEMORY_IN_ALL, "{}", s.memory_bytes());
        }
        assert!(spooled(&d) > 0, "some went to disk");
        // Every message comes back, in order, from memory or disk.
        for xid in 1..=40u32 {
            let mut r = s.take(xid).unwrap();
            let got = messages(&mut r);
            let firsts: Vec<u8> = got.iter().map(|m| m[0]).collect();
            assert_eq!(firsts, vec![xid as u8, xid as u8 ^ 1, xid as u8 ^ 2]);
        }
        assert_eq!(s.memory_bytes(), 0);
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn two_slots_sharing_a_spool_dir_keep_their_own_files() {
        let d = dir("shared");
        let big = || Bytes::from(vec![1u8; MEMORY_PER_TRANSACTION + 1]);
        let mut a = Spool::open(d.clone(), "a").unwrap();
        a.start(7, true);
        a.append(7, None, big()).unwrap();
        // Another process, another source, the same xid.
        let mut b = Spool::open(d.clone(), "b").unwrap();
        b.start(7, true);
        b.append(7, None, Bytes::from(vec![2u8; MEMORY_PER_TRANSACTION + 1]))
            .unwrap();
        assert!(d.join("a.0.xid-7.spool").exists() && d.join("b.0.xid-7.spool").exists());
        // "b" killed, leaving a file; its restart removes only its own files.
        drop(b);
        std::fs::write(d.join("b.0.xid-8.spool"), b"killed").unwrap();
        let b2 = Spool::open(d.clone(), "b").unwrap();
        assert!(d.join("a.0.xid-7.spool").exists());
        assert!(!d.join("b.0.xid-8.spool").exists());
        drop(b2);
        let mut r = a.take(7).unwrap();
        assert!(messages(&mut r).iter().all(|m| m.iter().all(|&x| x == 1)));
        let _ = std::fs::remove_dir_all(d);
    }
}
