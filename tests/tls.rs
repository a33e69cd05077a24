//! TLS on both connections: sslmode require / verify-ca / verify-full with a root certificate made
//! by the test (a throwaway CA), on servers that refuse plaintext; and the clear errors when the
//! certificate or the server does not fit.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command as StdCommand;

use common::{run_with_deadline, stderr};
use pgapply::cluster::{find_pg_bin, LocalCluster};

struct Certs {
    dir: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = StdCommand::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA and a server certificate for `localhost` (no IP address in it), and a second, unrelated CA.
fn make_certs() -> Certs {
    make_certs_with(Some("subjectAltName=DNS:localhost\n"))
}

/// `make_certs`, the server certificate made with these extensions: none makes a version 1
/// certificate (as `openssl x509 -req` does, the way PostgreSQL's manual shows it).
fn make_certs_with(extensions: Option<&str>) -> Certs {
    // (One directory per call: tests run side by side, each with its own CA and servers.)
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("pgapply-tls-{}-{call}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    openssl(
        &dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=pgapply test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ],
    );
    openssl(
        &dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=other CA",
            "-keyout",
            "other.key",
            "-out",
            "other.crt",
        ],
    );
    openssl(
        &dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    let mut sign = vec![
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        "server.crt",
    ];
    if let Some(extensions) = extensions {
        std::fs::write(dir.join("ext.cnf"), extensions).unwrap();
        sign.extend(["-extfile", "ext.cnf"]);
    }
    openssl(&dir, &sign);
    hand_to_postgres(&dir, &["ca.crt", "other.crt"]);
    Certs { dir }
}

/// The server reads its key as the postgres user; the key must not be readable by others, the
/// certificates (`public`) by everyone.
fn hand_to_postgres(dir: &Path, public: &[&str]) {
    let _ = StdCommand::new("chown")
        .args(["-R", "postgres", dir.to_str().unwrap()])
        .output();
    let _ = StdCommand::new("chmod")
        .args(["0600", dir.join("server.key").to_str().unwrap()])
        .output();
    let _ = StdCommand::new("chmod")
        .args(["0755", dir.to_str().unwrap()])
        .output();
    let _ = StdCommand::new("chmod")
        .arg("0644")
        .args(public.iter().map(|f| dir.join(f)))
        .output();
}

/// A self-signed server certificate for localhost, as `openssl req -x509` makes it (marked a
/// CA), given to clients as its own root certificate.
fn make_self_signed() -> Certs {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("pgapply-tls-self-{}-{call}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    openssl(
        &dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.crt",
        ],
    );
    std::fs::copy(dir.join("server.crt"), dir.join("ca.crt")).unwrap();
    hand_to_postgres(&dir, &["server.crt", "ca.crt"]);
    Certs { dir }
}

fn tls_cluster(certs: &Certs) -> LocalCluster {
    let bin = find_pg_bin().expect("PostgreSQL binaries");
    let cert = format!(
        "ssl_cert_file = '{}'",
        certs.dir.join("server.crt").display()
    );
    let key = format!(
        "ssl_key_file = '{}'",
        certs.dir.join("server.key").display()
    );
    // The CA that signs client certificates, for `cert` authentication of certuser.
    let client_ca = format!("ssl_ca_file = '{}'", certs.dir.join("ca.crt").display());
    let cluster = LocalCluster::start(&bin, &["ssl = on", &cert, &key, &client_ca])
        .expect("start TLS cluster");
    // Plaintext TCP connections are refused: a success below means TLS was used.
    std::fs::write(
        cluster.data_dir.join("pg_hba.conf"),
        "local all all trust\nhostnossl all all 0.0.0.0/0 reject\nhostnossl replication all 0.0.0.0/0 reject\n\
         hostssl all binder 127.0.0.1/32 scram-sha-256\nhostssl replication binder 127.0.0.1/32 scram-sha-256\n\
         hostssl all postgres 127.0.0.1/32 trust\nhostssl replication postgres 127.0.0.1/32 trust\n\
         hostssl all certuser 127.0.0.1/32 cert\nhostssl replication certuser 127.0.0.1/32 cert\n",
    )
    .unwrap();
    let out = StdCommand::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(cluster.bin.join("pg_ctl"))
        .arg("-D")
        .arg(&cluster.data_dir)
        .arg("reload")
        .current_dir(std::env::temp_dir())
        .output();
    if out.is_err() || !out.as_ref().unwrap().status.success() {
        // Not root: reload directly.
        let _ = StdCommand::new(cluster.bin.join("pg_ctl"))
            .arg("-D")
            .arg(&cluster.data_dir)
            .arg("reload")
            .output();
    }
    cluster
}

async fn sql(conninfo: &str, text: &str) -> Vec<String> {
    let config = pgapply::conninfo::parse("test", conninfo).unwrap();
    let client = pgapply::tls::connect(&config)
        .await
        .map_err(|e| e.into_error("connect"))
        .unwrap();
    let mut out = Vec::new();
    for m in client.simple_query(text).await.unwrap() {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
            out.push(r.get(0).unwrap_or("").to_owned());
        }
    }
    out
}

fn pgapply(source: &str, target: &str, extra: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgapply"));
    cmd.args([
        "run",
        "--source",
        source,
        "--target",
        target,
        "--publication",
        "p",
        "--slot",
        "tls_slot",
    ])
    .args(extra)
    .kill_on_drop(true);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_modes_on_both_connections() {
    let certs = make_certs();
    let source = tls_cluster(&certs);
    let target = tls_cluster(&certs);
    let ca = certs.dir.join("ca.crt");
    let other = certs.dir.join("other.crt");
    let conn = |port: u16, host: &str, mode: &str, root: &Path| {
        format!(
            "host={host} port={port} user=postgres dbname=postgres sslmode={mode} sslrootcert={}",
            root.display()
        )
    };
    let src_full = conn(source.port, "localhost", "verify-full", &ca);
    let dst_full = conn(target.port, "localhost", "verify-full", &ca);
    for c in [&src_full, &dst_full] {
        sql(c, "CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    }
    sql(&src_full, "CREATE PUBLICATION p FOR TABLE t").await;
    sql(
        &src_full,
        "SELECT pg_create_logical_replication_slot('tls_slot', 'pgoutput')",
    )
    .await;
    sql(&src_full, "INSERT INTO t VALUES (1, 'over TLS')").await;
    let endpos = sql(&src_full, "SELECT pg_current_wal_lsn()::text")
        .await
        .remove(0);

    // verify-full by host name: replication and SQL connections both encrypted and verified.
    let out = run_with_deadline(pgapply(&src_full, &dst_full, &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        sql(&dst_full, "SELECT v FROM t").await,
        vec!["over TLS".to_string()]
    );

    // verify-full by IP address: the certificate names localhost only.
    let out = run_with_deadline(
        pgapply(
            &conn(source.port, "127.0.0.1", "verify-full", &ca),
            &dst_full,
            &["--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("TLS handshake with source 127.0.0.1") && err.to_lowercase().contains("name"),
        "{err}"
    );

    // verify-ca checks the chain, not the name; require without a root certificate only encrypts.
    sql(&src_full, "INSERT INTO t VALUES (2, 'verify-ca')").await;
    let endpos = sql(&src_full, "SELECT pg_current_wal_lsn()::text")
        .await
        .remove(0);
    let src_ca = conn(source.port, "127.0.0.1", "verify-ca", &ca);
    let dst_require = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=require",
        target.port
    );
    let out = run_with_deadline(pgapply(&src_ca, &dst_require, &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        sql(&dst_full, "SELECT count(*) FROM t").await,
        vec!["2".to_string()]
    );

    // A certificate from another CA is refused, naming the server.
    let out = run_with_deadline(
        pgapply(
            &conn(source.port, "localhost", "verify-ca", &other),
            &dst_full,
            &["--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("TLS handshake with source localhost"),
        "{}",
        stderr(&out)
    );

    // The same on the target: exit 1 with the advice, not retried for ever.
    let out = run_with_deadline(
        pgapply(
            &src_full,
            &conn(target.port, "localhost", "verify-ca", &other),
            &["--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("connecting to target") && stderr(&out).contains("check sslrootcert"),
        "{}",
        stderr(&out)
    );

    // verify-full without a root certificate: told what to set.
    let out = run_with_deadline(
        pgapply(&format!("host=localhost port={} user=postgres dbname=postgres sslmode=verify-full sslrootcert=/nonexistent/root.crt", source.port), &dst_full, &[]),
        60,
    )
    .await;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("sslrootcert /nonexistent/root.crt"),
        "{}",
        stderr(&out)
    );
}

/// SCRAM over TLS binds the replication connection to the TLS channel (SCRAM-SHA-256-PLUS, the
/// server certificate's hash), as libpq does: `channel_binding=require` works against a server
/// that offers it (the server checks the hash pgapply sends), and refuses one that lets pgapply
/// in without SCRAM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_binding_on_the_replication_connection() {
    let certs = make_certs();
    let source = tls_cluster(&certs);
    let target = tls_cluster(&certs);
    let ca = certs.dir.join("ca.crt");
    let admin = format!(
        "host=localhost port={} user=postgres dbname=postgres sslmode=verify-full sslrootcert={}",
        source.port,
        ca.display()
    );
    let dst = format!(
        "host=localhost port={} user=postgres dbname=postgres sslmode=verify-full sslrootcert={}",
        target.port,
        ca.display()
    );
    sql(&dst, "CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    sql(&admin, "CREATE TABLE t (id int PRIMARY KEY, v text)").await;
    sql(&admin, "SET password_encryption = 'scram-sha-256'; CREATE ROLE binder LOGIN REPLICATION SUPERUSER PASSWORD 'bind-secret'").await;
    sql(&admin, "CREATE PUBLICATION p FOR TABLE t").await;
    sql(
        &admin,
        "SELECT pg_create_logical_replication_slot('tls_slot', 'pgoutput')",
    )
    .await;
    sql(&admin, "INSERT INTO t VALUES (1, 'bound')").await;
    let endpos = sql(&admin, "SELECT pg_current_wal_lsn()::text")
        .await
        .remove(0);
    let bound = format!(
        "host=localhost port={} user=binder password=bind-secret dbname=postgres sslmode=require channel_binding=require",
        source.port
    );
    let out = run_with_deadline(pgapply(&bound, &dst, &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        sql(&dst, "SELECT v FROM t").await,
        vec!["bound".to_string()]
    );
    // Trust authentication: nothing is bound, so require refuses, naming the setting.
    let trusted = format!(
        "host=localhost port={} user=postgres dbname=postgres sslmode=require channel_binding=require",
        source.port
    );
    let out = run_with_deadline(pgapply(&trusted, &dst, &["--endpos", &endpos]), 60).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("channel_binding=require") && !stderr(&out).contains("bind-secret"),
        "{}",
        stderr(&out)
    );
}

/// A client certificate for `user`, signed by the test CA, and its key (readable by its owner
/// only, as libpq requires).
fn make_client_cert(certs: &Certs, user: &str) -> (PathBuf, PathBuf) {
    make_client_cert_by(certs, user, "ca", "client")
}

/// A client certificate for `user` signed by CA `ca` (`ca.crt`/`ca.key` in the directory), as
/// `name`.crt and `name`.key.
fn make_client_cert_by(certs: &Certs, user: &str, ca: &str, name: &str) -> (PathBuf, PathBuf) {
    let subject = format!("/CN={user}");
    let (key, csr, crt) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
    );
    let (ca_crt, ca_key) = (format!("{ca}.crt"), format!("{ca}.key"));
    openssl(
        &certs.dir,
        &[
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", &subject, "-keyout", &key, "-out",
            &csr,
        ],
    );
    openssl(
        &certs.dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_crt,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &crt,
        ],
    );
    let key = certs.dir.join(&key);
    // (Made by this process: its user's, as libpq wants it, and private.)
    let _ = StdCommand::new("chmod").arg("0600").arg(&key).output();
    (certs.dir.join(&crt), key)
}

/// `cert` authentication: the client certificate given with sslcert/sslkey in the connection
/// string (the source, on its replication connection and the others) or with PGSSLCERT/PGSSLKEY
/// (the target); pg_dump gets it too (`schema`). A key others may read is refused, naming the
/// file, as libpq refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_on_both_connections() {
    let certs = make_certs();
    let source = tls_cluster(&certs);
    let target = tls_cluster(&certs);
    let ca = certs.dir.join("ca.crt");
    let (cert, key) = make_client_cert(&certs, "certuser");
    let admin = |port: u16| {
        format!(
            "host=localhost port={port} user=postgres dbname=postgres sslmode=verify-full sslrootcert={}",
            ca.display()
        )
    };
    let (src_admin, dst_admin) = (admin(source.port), admin(target.port));
    for side in [&src_admin, &dst_admin] {
        sql(side, "CREATE ROLE certuser LOGIN REPLICATION SUPERUSER").await;
    }
    sql(
        &src_admin,
        "CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'before')",
    )
    .await;
    sql(&src_admin, "CREATE PUBLICATION p FOR TABLE t").await;
    let as_certuser = |port: u16| {
        format!(
            "host=localhost port={port} user=certuser dbname=postgres sslmode=verify-full sslrootcert={}",
            ca.display()
        )
    };
    let src = format!(
        "{} sslcert={} sslkey={}",
        as_certuser(source.port),
        cert.display(),
        key.display()
    );
    let dst = as_certuser(target.port);
    let with_env = |mut cmd: tokio::process::Command| {
        cmd.env("PGSSLCERT", &cert).env("PGSSLKEY", &key);
        cmd
    };
    // The table's definition by pg_dump, which connects with the same certificate.
    let mut schema = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgapply"));
    schema
        .args(["schema", "--source", &src, "--target", &dst])
        .args(["--publication", "p"])
        .kill_on_drop(true);
    let out = run_with_deadline(with_env(schema), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let before = sql(&src_admin, "SELECT pg_current_wal_lsn()::text")
        .await
        .remove(0);
    let out = run_with_deadline(
        with_env(pgapply(&src, &dst, &["--copy-data", "--endpos", &before])),
        60,
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    sql(&src_admin, "INSERT INTO t VALUES (2, 'streamed')").await;
    let endpos = sql(&src_admin, "SELECT pg_current_wal_lsn()::text")
        .await
        .remove(0);
    let out = run_with_deadline(with_env(pgapply(&src, &dst, &["--endpos", &endpos])), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        sql(&dst_admin, "SELECT string_agg(v, ',' ORDER BY id) FROM t").await,
        vec!["before,streamed".to_string()]
    );
    // Without the certificate the server refuses certuser.
    let out = run_with_deadline(pgapply(&src, &dst, &["--endpos", &endpos]), 60).await;
    assert!(!out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("certificate"), "{}", stderr(&out));
    // Another key than the certificate's: refused before connecting, naming both files.
    let (_, other_key) = make_client_cert_by(&certs, "certuser", "ca", "second");
    let mismatched = format!(
        "{} sslcert={} sslkey={}",
        as_certuser(source.port),
        cert.display(),
        other_key.display()
    );
    let out = run_with_deadline(pgapply(&mismatched, &dst_admin, &["--endpos", &endpos]), 60).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the key is not the certificate's"),
        "{}",
        stderr(&out)
    );
    // The same on the target only: the error says which side.
    let mismatched_target = format!(
        "{} sslcert={} sslkey={}",
        as_certuser(target.port),
        cert.display(),
        other_key.display()
    );
    let out = run_with_deadline(
        pgapply(&src_admin, &mismatched_target, &["--endpos", &endpos]),
        60,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the key is not the certificate's")
            && stderr(&out).contains("target"),
        "{}",
        stderr(&out)
    );
    // A certificate the server's CA did not sign: the server's refusal is no passing failure.
    let (foreign, foreign_key) = make_client_cert_by(&certs, "certuser", "other", "foreign");
    let refused = format!(
        "{} sslcert={} sslkey={}",
        as_certuser(source.port),
        foreign.display(),
        foreign_key.display()
    );
    let out = run_with_deadline(pgapply(&refused, &dst_admin, &["--endpos", &endpos]), 60).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("check sslcert and sslkey"),
        "{}",
        stderr(&out)
    );
    // A key others may read: refused before connecting, naming the file and the fix.
    let _ = StdCommand::new("chmod").arg("0644").arg(&key).output();
    let out = run_with_deadline(pgapply(&src, &dst_admin, &["--endpos", &endpos]), 60).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("sslkey {}", key.display()))
            && stderr(&out).contains("chmod 0600"),
        "{}",
        stderr(&out)
    );
}

/// Server certificates as PostgreSQL's manual makes them: version 1 (no extensions), or version
/// 3 without a subjectAltName; either names the host only in its subject's common name, which
/// verify-full reads then, as libpq does; verify-ca checks the signature of the version 1 one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_naming_the_host_in_their_common_name_only() {
    let v1 = make_certs_with(None);
    let no_alt_names = make_certs_with(Some("basicConstraints=CA:FALSE\n"));
    let source = tls_cluster(&v1);
    let target = tls_cluster(&no_alt_names);
    let conn = |port: u16, host: &str, mode: &str, certs: &Certs| {
        format!(
            "host={host} port={port} user=postgres dbname=postgres sslmode={mode} sslrootcert={}",
            certs.dir.join("ca.crt").display()
        )
    };
    let src = conn(source.port, "localhost", "verify-full", &v1);
    let dst = conn(target.port, "LOCALHOST", "verify-full", &no_alt_names);
    sql(&dst, "CREATE TABLE t (id int PRIMARY KEY)").await;
    sql(&src, "CREATE TABLE t (id int PRIMARY KEY)").await;
    sql(&src, "CREATE PUBLICATION p FOR TABLE t").await;
    sql(
        &src,
        "SELECT pg_create_logical_replication_slot('tls_slot', 'pgoutput')",
    )
    .await;
    sql(&src, "INSERT INTO t VALUES (1)").await;
    let endpos = sql(&src, "SELECT pg_current_wal_lsn()::text")
        .await
        .remove(0);
    let out = run_with_deadline(pgapply(&src, &dst, &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        sql(&dst, "SELECT count(*) FROM t").await,
        vec!["1".to_string()]
    );
    // verify-ca takes the version 1 certificate by another name; verify-full does not, nor
    // does a root that did not sign it.
    let ca_only = conn(source.port, "127.0.0.1", "verify-ca", &v1);
    let out = run_with_deadline(pgapply(&ca_only, &dst, &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    for (wrong, said) in [
        (
            conn(source.port, "127.0.0.1", "verify-full", &v1),
            "NotValidForName",
        ),
        // (Said as what it is, not as a version webpki does not read: the other test CA has
        // the same name, and another key.)
        (
            conn(source.port, "localhost", "verify-ca", &no_alt_names),
            "BadSignature",
        ),
        // A root of another name: its issuer is not there at all.
        (
            format!(
                "host=localhost port={} user=postgres dbname=postgres sslmode=verify-ca sslrootcert={}",
                source.port,
                v1.dir.join("other.crt").display()
            ),
            "no certificate in sslrootcert signed it",
        ),
    ] {
        let out = run_with_deadline(pgapply(&wrong, &dst, &["--endpos", &endpos]), 60).await;
        assert_eq!(out.status.code(), Some(1), "{wrong}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(said) && !stderr(&out).contains("UnsupportedCertVersion"),
            "{wrong}: {}",
            stderr(&out)
        );
    }
}

/// A server whose self-signed certificate (marked a CA, as `openssl req -x509` makes it) is
/// given as the root certificate: trusted by verify-ca and, for its name, verify-full, as libpq
/// trusts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_self_signed_certificate_given_as_its_own_root_is_trusted() {
    let certs = make_self_signed();
    let source = tls_cluster(&certs);
    let target = tls_cluster(&certs);
    let root = certs.dir.join("server.crt");
    let conn = |port: u16, host: &str, mode: &str| {
        format!(
            "host={host} port={port} user=postgres dbname=postgres sslmode={mode} sslrootcert={}",
            root.display()
        )
    };
    let src = conn(source.port, "localhost", "verify-full");
    let dst = conn(target.port, "127.0.0.1", "verify-ca");
    sql(&dst, "CREATE TABLE t (id int PRIMARY KEY)").await;
    sql(&src, "CREATE TABLE t (id int PRIMARY KEY)").await;
    sql(&src, "CREATE PUBLICATION p FOR TABLE t").await;
    sql(
        &src,
        "SELECT pg_create_logical_replication_slot('tls_slot', 'pgoutput')",
    )
    .await;
    sql(&src, "INSERT INTO t VALUES (1)").await;
    let endpos = sql(&src, "SELECT pg_current_wal_lsn()::text")
        .await
        .remove(0);
    let out = run_with_deadline(pgapply(&src, &dst, &["--endpos", &endpos]), 60).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        sql(&dst, "SELECT count(*) FROM t").await,
        vec!["1".to_string()]
    );
    // verify-full still checks the name: 127.0.0.1 is not in the certificate.
    let out = run_with_deadline(
        pgapply(
            &conn(source.port, "127.0.0.1", "verify-full"),
            &dst,
            &["--endpos", &endpos],
        ),
        60,
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_against_a_server_without_tls_fails_clearly() {
    let c = common::clusters();
    let source = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=require",
        c.source_port
    );
    let target = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        c.target_port
    );
    let out = run_with_deadline(pgapply(&source, &target, &[]), 30).await;
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("does not accept TLS") || err.contains("TLS"),
        "{err}"
    );
}

/// The target side too: a definite error (exit 1) with the same advice, not a retry for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_against_a_target_without_tls_is_not_retried() {
    let c = common::clusters();
    let source = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        c.source_port
    );
    let target = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=require",
        c.target_port
    );
    let out = run_with_deadline(pgapply(&source, &target, &[]), 60).await;
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("does not accept TLS connections, but sslmode requires TLS"),
        "{err}"
    );
}
