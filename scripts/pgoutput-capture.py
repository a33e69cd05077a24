#!/usr/bin/env python3
"""Run a workload against a PostgreSQL server and record the raw pgoutput
messages that a logical replication slot produces for it.

Used by scripts/capture-fixtures.sh; needs psycopg2 (psycopg2-binary).

Two ways to read the slot:
  --mode sql        pg_logical_slot_get_binary_changes() after every \\drain
                    (one row = one pgoutput message)
  --mode walsender  START_REPLICATION ... LOGICAL over a replication
                    connection (each XLogData payload = one pgoutput message);
                    decoding runs live, while the workload's transactions are
                    still open, exactly as a subscriber would see it.

The workload comes on stdin. SQL statements end with a line ending in ';'
(dollar-quoted bodies are kept together) and run one by one in autocommit
mode, so BEGIN/COMMIT must be written explicitly. Directives:
  \\step TEXT              write "# step: TEXT" to the fixture
  \\conn NAME              run the following SQL on connection NAME
                          (opened on first use; the default is "main")
  \\drain [expect=TAGS] [quiet=SECONDS]
                          append the messages produced so far to the fixture;
                          in walsender mode wait until every tag character in
                          TAGS has been seen and then no message arrived for
                          `quiet` seconds (default 1.5)
Each recorded message is written as one line of lowercase hex.

`pgoutput-capture.py check FILE [--require f1,f2,...]` decodes a fixture file
message by message (failing on anything malformed) and lists the features it
contains (e.g. update-key, tuple-unchanged-toast, stream-abort-subxact).
"""

import argparse
import select
import sys
import time

import psycopg2
import psycopg2.extensions
import psycopg2.extras


def parse_workload(text):
    """Yield ('sql', stmt) and ('directive', name, arg) items."""
    buf = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not buf and line.lstrip().startswith("\\"):
            body = line.lstrip()[1:]
            name, _, arg = body.partition(" ")
            yield ("directive", name, arg.strip())
            continue
        if not buf and (not line.strip() or line.strip().startswith("--")):
            continue
        buf.append(line)
        joined = "\n".join(buf)
        if line.endswith(";") and joined.count("$$") % 2 == 0:
            yield ("sql", joined)
            buf = []
    if buf:
        raise SystemExit("workload: unterminated statement: %s" % "\n".join(buf))


class Capture:
    def __init__(self, args):
        self.args = args
        self.dsn = args.dsn
        self.options = {}
        for opt in args.option:
            key, sep, value = opt.partition("=")
            if not sep:
                raise SystemExit("bad --option %r (want key=value)" % opt)
            self.options[key] = value
        self.conns = {}
        self.out = open(args.out, "a", encoding="ascii")
        self.total = 0
        self.repl = None
        self.repl_cur = None
        if args.mode == "walsender":
            self.start_walsender()

    # ----- ordinary connections -------------------------------------------
    def conn(self, name):
        if name not in self.conns:
            c = psycopg2.connect(self.dsn)
            c.autocommit = True
            self.conns[name] = c
        return self.conns[name]

    def execute(self, name, stmt):
        cur = self.conn(name).cursor()
        try:
            cur.execute(stmt)
        except psycopg2.Error as e:
            raise SystemExit("SQL error on connection %s: %s\nstatement: %s" % (name, e, stmt))
        finally:
            cur.close()

    # ----- output -------------------------------------------------------------
    def emit(self, payload):
        data = bytes(payload)
        if not data:
            return
        self.out.write(data.hex() + "\n")
        self.total += 1

    def comment(self, text):
        self.out.write("# %s\n" % text)

    # ----- SQL interface ------------------------------------------------------
    def wait_wal_flushed(self, timeout=5.0):
        """Decoding reads only flushed WAL; async commits/aborts are flushed
        by the WAL writer a little later, so wait for it."""
        c = self.conn("__decoder")
        cur = c.cursor()
        cur.execute("SELECT pg_current_wal_insert_lsn()")
        target = cur.fetchone()[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            cur.execute("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (target,))
            if cur.fetchone()[0]:
                break
            time.sleep(0.02)
        cur.close()

    def drain_sql(self):
        self.wait_wal_flushed()
        cur = self.conn("__decoder").cursor()
        params = [self.args.slot]
        opt_sql = ""
        for k, v in self.options.items():
            opt_sql += ", %s, %s"
            params += [k, v]
        cur.execute(
            "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL" + opt_sql + ")",
            params,
        )
        for (data,) in cur.fetchall():
            self.emit(data)
        cur.close()

    # ----- walsender ------------------------------------------------------------
    def start_walsender(self):
        self.repl = psycopg2.connect(
            self.dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection
        )
        self.repl_cur = self.repl.cursor()
        self.repl_cur.start_replication(
            slot_name=self.args.slot, decode=False, options=self.options
        )

    def drain_walsender(self, expect="", quiet=1.5, timeout=60.0):
        want = set(expect)
        seen = set()
        cur = self.repl_cur
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while True:
            msg = cur.read_message()
            now = time.monotonic()
            if msg is not None:
                payload = bytes(msg.payload)
                self.emit(payload)
                if payload:
                    seen.add(chr(payload[0]))
                cur.send_feedback(write_lsn=msg.data_start, flush_lsn=msg.data_start)
                last = now
                continue
            if want <= seen and now - last >= quiet:
                return
            if now > deadline:
                raise SystemExit(
                    "walsender: timed out waiting for message tags %r (seen %r)"
                    % ("".join(sorted(want - seen)), "".join(sorted(seen)))
                )
            select.select([cur], [], [], 0.2)

    def drain(self, arg):
        expect, quiet = "", 1.5
        for word in arg.split():
            k, _, v = word.partition("=")
            if k == "expect":
                expect = v
            elif k == "quiet":
                quiet = float(v)
            else:
                raise SystemExit("\\drain: unknown argument %r" % word)
        if self.args.mode == "sql":
            self.drain_sql()
        else:
            self.drain_walsender(expect=expect, quiet=quiet)

    # ----- main loop ------------------------------------------------------------
    def run(self, text):
        current = "main"
        for item in parse_workload(text):
            if item[0] == "sql":
                self.execute(current, item[1])
                continue
            _, name, arg = item
            if name == "step":
                self.comment("step: " + arg)
            elif name == "conn":
                current = arg or "main"
            elif name == "drain":
                self.drain(arg)
            else:
                raise SystemExit("workload: unknown directive \\%s" % name)
        self.out.close()
        for c in self.conns.values():
            c.close()
        if self.repl is not None:
            self.repl.close()
        print("captured %d messages" % self.total, file=sys.stderr)


# ---------------------------------------------------------------------------
# check: decode a fixture file and list the features it contains


class Reader:
    def __init__(self, data):
        self.data = data
        self.pos = 0

    def take(self, n):
        if self.pos + n > len(self.data):
            raise ValueError("message truncated at byte %d (need %d more)" % (self.pos, n))
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def u8(self):
        return self.take(1)[0]

    def u16(self):
        return int.from_bytes(self.take(2), "big")

    def u32(self):
        return int.from_bytes(self.take(4), "big")

    def u64(self):
        return int.from_bytes(self.take(8), "big")

    def cstr(self):
        end = self.data.index(b"\0", self.pos)
        s = self.data[self.pos:end].decode("utf-8")
        self.pos = end + 1
        return s

    def left(self):
        return len(self.data) - self.pos


def decode_tuple(r, features):
    natts = r.u16()
    for _ in range(natts):
        kind = chr(r.u8())
        if kind == "n":
            features.add("tuple-null")
        elif kind == "u":
            features.add("tuple-unchanged-toast")
        elif kind in "tb":
            r.take(r.u32())
            features.add("tuple-text" if kind == "t" else "tuple-binary")
        else:
            raise ValueError("bad tuple column kind %r" % kind)


def check_file(path):
    """Decode every message; return (tag counts, feature set)."""
    counts = {}
    features = set()
    in_stream = False
    lineno = 0
    with open(path, encoding="ascii") as f:
        for line in f:
            lineno += 1
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            data = bytes.fromhex(line)
            tag = chr(data[0])
            counts[tag] = counts.get(tag, 0) + 1
            r = Reader(data)
            r.u8()
            try:
                xid_prefixed = in_stream and tag in "RYIUDTM"
                if xid_prefixed:
                    r.u32()
                    features.add("streamed-" + tag)
                if tag == "B":
                    r.u64(); r.u64(); r.u32()
                elif tag == "C":
                    r.u8(); r.u64(); r.u64(); r.u64()
                elif tag == "O":
                    r.u64(); r.cstr()
                    features.add("origin")
                elif tag == "Y":
                    r.u32(); r.cstr(); r.cstr()
                    features.add("type")
                elif tag == "R":
                    r.u32(); r.cstr(); r.cstr()
                    features.add("relation-ident-" + chr(r.u8()))
                    for _ in range(r.u16()):
                        r.u8(); r.cstr(); r.u32(); r.u32()
                elif tag == "I":
                    r.u32()
                    if chr(r.u8()) != "N":
                        raise ValueError("insert without 'N'")
                    decode_tuple(r, features)
                elif tag == "U":
                    r.u32()
                    kind = chr(r.u8())
                    if kind in "KO":
                        features.add("update-key" if kind == "K" else "update-old")
                        decode_tuple(r, features)
                        kind = chr(r.u8())
                    else:
                        features.add("update-new-only")
                    if kind != "N":
                        raise ValueError("update without 'N'")
                    decode_tuple(r, features)
                elif tag == "D":
                    r.u32()
                    kind = chr(r.u8())
                    if kind not in "KO":
                        raise ValueError("delete without 'K'/'O'")
                    features.add("delete-key" if kind == "K" else "delete-old")
                    decode_tuple(r, features)
                elif tag == "T":
                    nrels = r.u32()
                    flags = r.u8()
                    for _ in range(nrels):
                        r.u32()
                    if nrels > 1:
                        features.add("truncate-multi")
                    if flags & 1:
                        features.add("truncate-cascade")
                    if flags & 2:
                        features.add("truncate-restart-identity")
                elif tag == "M":
                    flags = r.u8()
                    r.u64(); r.cstr(); r.take(r.u32())
                    features.add("message-transactional" if flags & 1 else "message-nontransactional")
                elif tag == "S":
                    r.u32()
                    if r.u8() == 1:
                        features.add("stream-first-segment")
                    in_stream = True
                elif tag == "E":
                    in_stream = False
                elif tag == "c":
                    r.u32(); r.u8(); r.u64(); r.u64(); r.u64()
                elif tag == "A":
                    xid = r.u32()
                    subxid = r.u32()
                    features.add("stream-abort-top" if xid == subxid else "stream-abort-subxact")
                    if r.left() == 16:
                        r.u64(); r.u64()
                        features.add("stream-abort-with-lsn")
                elif tag == "b":
                    r.u64(); r.u64(); r.u64(); r.u32(); r.cstr()
                elif tag in "PKp":
                    r.u8(); r.u64(); r.u64(); r.u64(); r.u32(); r.cstr()
                elif tag == "r":
                    r.u8(); r.u64(); r.u64(); r.u64(); r.u64(); r.u32(); r.cstr()
                else:
                    raise ValueError("unknown message tag %r" % tag)
                if r.left():
                    raise ValueError("%d trailing bytes" % r.left())
            except ValueError as e:
                raise SystemExit("%s:%d: message %r: %s" % (path, lineno, tag, e))
    return counts, features


def check_main(argv):
    p = argparse.ArgumentParser(prog="pgoutput-capture.py check")
    p.add_argument("file")
    p.add_argument("--require", default="", help="comma-separated feature names")
    args = p.parse_args(argv)
    counts, features = check_file(args.file)
    print("%s: %s" % (args.file, " ".join("%s=%d" % (k, counts[k]) for k in sorted(counts))))
    print("  features: %s" % " ".join(sorted(features)))
    missing = [f for f in args.require.split(",") if f and f not in features]
    if missing:
        print("  MISSING: %s" % " ".join(missing))
        return 1
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "check":
        sys.exit(check_main(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", required=True)
    p.add_argument("--slot", required=True)
    p.add_argument("--mode", choices=["sql", "walsender"], default="sql")
    p.add_argument("--option", action="append", default=[], help="pgoutput option key=value")
    p.add_argument("--out", required=True, help="fixture file to append to")
    args = p.parse_args()
    Capture(args).run(sys.stdin.read())


if __name__ == "__main__":
    main()
