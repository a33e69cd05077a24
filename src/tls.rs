//! TLS for every connection, with libpq's `sslmode` meanings and `sslrootcert`.
//!
//! tokio-postgres knows only disable/prefer/require, so `sslmode` and `sslrootcert` are read from the
//! connection string here, and the rustls connector enforces the rest:
//!
//! | sslmode | encrypted | certificate checked | host name checked |
//! | --- | --- | --- | --- |
//! | disable | no | – | – |
//! | prefer (default) | if the server offers it | only with a root certificate | no |
//! | require | yes | only with a root certificate (as libpq) | no |
//! | verify-ca | yes | yes | no |
//! | verify-full | yes | yes | yes |
//!
//! The root certificate is `sslrootcert`, else `~/.postgresql/root.crt` when it exists.
//!
//! Connection strings are parsed in `conninfo`; the TLS part of each is kept here, per server
//! (host, port, user, database), so that every connection to that server, from any module, gets
//! the same connector through [`make_tls`] and [`connect`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::Host;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    Disable,
    #[default]
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    pub root_cert: Option<PathBuf>,
    /// `sslcert` / `sslkey`: a client certificate and its key, for `cert` authentication (or
    /// `clientcert=verify-full` in pg_hba.conf).
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

impl SslMode {
    pub fn parse(text: &str) -> Result<SslMode> {
        Ok(match text {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(Error::usage(format!(
                    "sslmode {other:?}: use disable, prefer, require, verify-ca or verify-full"
                )))
            }
        })
    }

    /// What tokio-postgres is told; the verification is the connector's.
    pub fn for_tokio_postgres(self) -> tokio_postgres::config::SslMode {
        match self {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        }
    }
}

/// Which connection string the settings belong to: every host, host address and port, the user,
/// the database and the mode tokio-postgres was given (two connection strings that differ only
/// in `hostaddr`, or in their `sslmode`, must not share them).
type ServerKey = String;

fn key(config: &tokio_postgres::Config) -> ServerKey {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|h| match h {
            Host::Tcp(h) => h.clone(),
            Host::Unix(p) => p.display().to_string(),
        })
        .collect();
    format!(
        "{hosts:?} {:?} {:?} {:?} {:?} {:?}",
        config.get_hostaddrs(),
        config.get_ports(),
        config.get_user(),
        config.get_dbname(),
        config.get_ssl_mode()
    )
}

fn registry() -> &'static Mutex<HashMap<ServerKey, TlsSettings>> {
    static REGISTRY: OnceLock<Mutex<HashMap<ServerKey, TlsSettings>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Remembers the TLS settings of a parsed connection string.
pub fn register(config: &tokio_postgres::Config, settings: TlsSettings) {
    if let Ok(mut r) = registry().lock() {
        r.insert(key(config), settings);
    }
}

pub fn settings_for(config: &tokio_postgres::Config) -> TlsSettings {
    registry()
        .lock()
        .ok()
        .and_then(|r| r.get(&key(config)).cloned())
        .unwrap_or_default()
}

/// Where a TLS handshake leaves the server's certificate (DER), for SCRAM channel binding.
pub type SeenCertificate = Arc<Mutex<Option<Vec<u8>>>>;

/// The rustls connector for a server, verifying as its `sslmode` says.
pub fn make_tls(config: &tokio_postgres::Config) -> Result<MakeRustlsConnect> {
    make_tls_seeing(config, None)
}

/// `make_tls`, keeping the server's certificate in `seen` (the replication connection, whose
/// SCRAM exchange is pgapply's own, binds it to the TLS channel as libpq does).
pub fn make_tls_seeing(
    config: &tokio_postgres::Config,
    seen: Option<SeenCertificate>,
) -> Result<MakeRustlsConnect> {
    let settings = settings_for(config);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let root = settings.root_cert.clone().or_else(|| {
        std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".postgresql/root.crt"))
            .filter(|p| p.exists())
    });
    // The root certificates as given: a server whose own certificate is one of them (a
    // self-signed one, given as its root) is trusted as libpq trusts it.
    let mut pinned: Vec<Vec<u8>> = Vec::new();
    let roots = match &root {
        Some(path) => {
            let mut store = RootCertStore::empty();
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
                .map_err(|e| {
                    Error::definite(format!(
                        "sslrootcert {}: cannot read it: {e}",
                        path.display()
                    ))
                })?
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| {
                    Error::definite(format!(
                        "sslrootcert {}: not a PEM certificate file: {e}",
                        path.display()
                    ))
                })?;
            for cert in certs {
                pinned.push(cert.as_ref().to_vec());
                store.add(cert).map_err(|e| {
                    Error::definite(format!(
                        "sslrootcert {}: unusable certificate: {e}",
                        path.display()
                    ))
                })?;
            }
            Some(Arc::new(store))
        }
        None => None,
    };
    let check = match (settings.mode, roots) {
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
            return Err(Error::definite(
                "sslmode=verify-ca and verify-full need a root certificate: set sslrootcert=/path/to/root.crt in the connection string (or put it at ~/.postgresql/root.crt)",
            ))
        }
        (SslMode::VerifyFull, Some(roots)) => Check::Full(verifier(roots, &provider)?),
        (_, Some(roots)) => Check::ChainOnly(verifier(roots, &provider)?),
        (_, None) => Check::Nothing,
    };
    let identity = client_identity(&settings, &provider)?;
    let client = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::definite(format!("TLS setup: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Verifier {
            check,
            provider,
            seen,
            pinned,
        }));
    let client = match identity {
        Some(identity) => client.with_client_cert_resolver(Arc::new(ClientIdentity(identity))),
        None => client.with_no_client_auth(),
    };
    Ok(MakeRustlsConnect::new(client))
}

/// The client certificate and key, as libpq finds them: `sslcert`/`sslkey` (or `PGSSLCERT`,
/// `PGSSLKEY`), else `~/.postgresql/postgresql.crt` and `.key`. A certificate file that does not
/// exist means no client certificate (as in libpq, which sends none then); a certificate without
/// its key, an unreadable or encrypted key, or a key others may read, is an error.
fn client_identity(
    settings: &TlsSettings,
    provider: &rustls::crypto::CryptoProvider,
) -> Result<Option<Arc<CertifiedKey>>> {
    let home = || std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".postgresql"));
    let Some(cert_path) = settings
        .client_cert
        .clone()
        .or_else(|| home().map(|d| d.join("postgresql.crt")))
        .filter(|p| p.exists())
    else {
        return Ok(None);
    };
    if let Some(given) = settings.client_key.as_ref().filter(|p| !p.exists()) {
        return Err(Error::definite(format!(
            "sslkey {}: no such file (the private key of sslcert {}): check the path",
            given.display(),
            cert_path.display()
        )));
    }
    let key_path = settings
        .client_key
        .clone()
        .or_else(|| home().map(|d| d.join("postgresql.key")));
    let Some(key_path) = key_path.filter(|p| p.exists()) else {
        return Err(Error::definite(format!(
            "sslcert {}: the certificate is there, but not its private key: give it with sslkey=/path/to/key (or PGSSLKEY), or put it at ~/.postgresql/postgresql.key",
            cert_path.display()
        )));
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert_path)
        .and_then(|certs| certs.collect::<std::result::Result<_, _>>())
        .map_err(|e| {
            Error::definite(format!(
                "sslcert {}: not a readable PEM certificate file: {e}",
                cert_path.display()
            ))
        })?;
    if chain.is_empty() {
        return Err(Error::definite(format!(
            "sslcert {}: no certificate in it (a PEM file with -----BEGIN CERTIFICATE----- is needed)",
            cert_path.display()
        )));
    }
    key_file_private(&key_path)?;
    let text = std::fs::read_to_string(&key_path).map_err(|e| {
        Error::definite(format!(
            "sslkey {}: cannot read it: {e}",
            key_path.display()
        ))
    })?;
    if text.contains("ENCRYPTED") {
        return Err(Error::definite(format!(
            "sslkey {}: the key is encrypted, which pgapply does not support (no sslpassword): give it a key without a passphrase, e.g. made with `openssl pkey -in {} -out client-plain.key`, readable only by its owner",
            key_path.display(),
            key_path.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_slice(text.as_bytes()).map_err(|e| {
        Error::definite(format!(
            "sslkey {}: not a PEM private key (PKCS#8, PKCS#1 or SEC1): {e}",
            key_path.display()
        ))
    })?;
    let key = provider.key_provider.load_private_key(key).map_err(|e| {
        Error::definite(format!(
            "sslkey {}: a key of a kind pgapply cannot sign with (RSA, ECDSA P-256/P-384 and Ed25519 work): {e}",
            key_path.display()
        ))
    })?;
    let identity = CertifiedKey::new(chain, key);
    // A version 1 certificate (what `openssl x509 -req` makes without extensions) cannot be
    // parsed for this check, but libpq and the server accept it: only a definite mismatch is
    // refused here.
    // (Compared by hand when rustls cannot parse the certificate: a version 1 one.)
    let mismatch = match identity.keys_match() {
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => true,
        Ok(()) => false,
        Err(_) => match (
            identity.key.public_key(),
            identity
                .cert
                .first()
                .and_then(|c| certificate_spki(c.as_ref())),
        ) {
            (Some(key), Some((cert, _, _))) => key.as_ref() != cert,
            _ => false,
        },
    };
    if mismatch {
        return Err(Error::definite(format!(
            "sslcert {} and sslkey {}: the key is not the certificate's: give the key the certificate was made for",
            cert_path.display(),
            key_path.display()
        )));
    }
    Ok(Some(Arc::new(identity)))
}

/// The one client certificate, offered whenever the server asks for one.
#[derive(Debug)]
struct ClientIdentity(Arc<CertifiedKey>);

impl rustls::client::ResolvesClientCert for ClientIdentity {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// libpq's rule for a client key: read access for the group at most when it belongs to root (a
/// key managed by the system); otherwise no access for group or others.
fn key_file_private(path: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path)
        .map_err(|e| Error::definite(format!("sslkey {}: cannot read it: {e}", path.display())))?;
    if !meta.is_file() {
        return Err(Error::definite(format!(
            "sslkey {}: not a regular file",
            path.display()
        )));
    }
    // As libpq: a key owned by root may be read by its group (u=rw,g=r at most); any other
    // owner's by nobody else (u=rw at most), whoever runs pgapply.
    let mode = meta.mode();
    let too_open = if meta.uid() == 0 {
        mode & 0o037 != 0
    } else {
        mode & 0o077 != 0
    };
    if too_open {
        return Err(Error::definite(format!(
            "sslkey {}: others may read the key (permissions {:04o}): make it readable by its owner only (chmod 0600), or, for a key owned by root, by root's group at most (chmod 0640)",
            path.display(),
            mode & 0o7777
        )));
    }
    Ok(())
}

/// The `tls-server-end-point` channel binding data of a server certificate (RFC 5929, as
/// PostgreSQL computes it): the certificate's hash, by the hash function of its signature
/// algorithm, SHA-256 where that is MD5 or SHA-1. None for a certificate whose algorithm names no
/// hash pgapply knows (Ed25519, say, for which the server cannot compute one either).
pub fn tls_server_end_point(certificate: &[u8]) -> Option<Vec<u8>> {
    use sha2::Digest;
    let oid = signature_algorithm(certificate)?;
    // 1.2.840.113549.1.1.x (RSA) and 1.2.840.10045.4.x (ECDSA).
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01];
    const ECDSA: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04];
    let hash = match oid {
        o if o.starts_with(RSA) && o.len() == RSA.len() + 1 => match o[RSA.len()] {
            // md5 and sha1: SHA-256 instead
            0x04 | 0x05 | 0x0b => 256,
            0x0e => 224,
            0x0c => 384,
            0x0d => 512,
            _ => return None,
        },
        o if o == [ECDSA, &[0x01]].concat() => 256,
        o if o.starts_with(ECDSA) && o.len() == ECDSA.len() + 2 && o[ECDSA.len()] == 0x03 => {
            match o[ECDSA.len() + 1] {
                0x01 => 224,
                0x02 => 256,
                0x03 => 384,
                0x04 => 512,
                _ => return None,
            }
        }
        _ => return None,
    };
    Some(match hash {
        224 => sha2::Sha224::digest(certificate).to_vec(),
        256 => sha2::Sha256::digest(certificate).to_vec(),
        384 => sha2::Sha384::digest(certificate).to_vec(),
        _ => sha2::Sha512::digest(certificate).to_vec(),
    })
}

/// The OID (its encoded bytes) of a DER certificate's signatureAlgorithm: `Certificate ::=
/// SEQUENCE { tbsCertificate, signatureAlgorithm SEQUENCE { OID, .. }, signature }`.
fn signature_algorithm(der: &[u8]) -> Option<&[u8]> {
    let (0x30, certificate, _) = tlv(der)? else {
        return None;
    };
    let (0x30, _, rest) = tlv(certificate)? else {
        return None;
    };
    let (0x30, algorithm, _) = tlv(rest)? else {
        return None;
    };
    let (0x06, oid, _) = tlv(algorithm)? else {
        return None;
    };
    Some(oid)
}

/// One DER TLV: (tag, contents, the rest after it).
fn tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |a, &b| (a << 8) | b as usize);
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// The subject's common names of a DER certificate, or None when it has a subjectAltName
/// extension (whose names then are the only ones, as libpq reads them) or does not parse.
fn common_names_without_alt_names(der: &[u8]) -> Option<Vec<String>> {
    const CN: &[u8] = &[0x55, 0x04, 0x03];
    const SAN: &[u8] = &[0x55, 0x1d, 0x11];
    let (0x30, certificate, _) = tlv(der)? else {
        return None;
    };
    // version [0] (optional), serialNumber, signature, issuer, validity, subject, spki,
    // issuerUniqueID [1], subjectUniqueID [2], extensions [3].
    let fields = tbs_fields(certificate)?;
    let skip = usize::from(fields.first()?.0 == 0xa0);
    let (0x30, subject, _) = *fields.get(skip + 4)? else {
        return None;
    };
    if let Some((_, extensions, _)) = fields.iter().find(|(tag, _, _)| *tag == 0xa3) {
        let (0x30, mut list, _) = tlv(extensions)? else {
            return None;
        };
        while !list.is_empty() {
            let (_, extension, after) = tlv(list)?;
            if let (0x06, oid, _) = tlv(extension)? {
                if oid == SAN {
                    return None;
                }
            }
            list = after;
        }
    }
    let mut names = Vec::new();
    let mut sets = subject;
    while !sets.is_empty() {
        let (0x31, set, after) = tlv(sets)? else {
            return None;
        };
        let mut attributes = set;
        while !attributes.is_empty() {
            let (0x30, attribute, next) = tlv(attributes)? else {
                return None;
            };
            let (0x06, oid, value) = tlv(attribute)? else {
                return None;
            };
            if oid == CN {
                // UTF8String, PrintableString, IA5String, T61String.
                if let (0x0c | 0x13 | 0x16 | 0x14, text, _) = tlv(value)? {
                    names.push(String::from_utf8_lossy(text).into_owned());
                }
            }
            attributes = next;
        }
        sets = after;
    }
    Some(names)
}

/// Whether a DER certificate is X.509 version 1 (no extensions: what `openssl x509 -req`
/// makes without `-extfile`, as PostgreSQL's manual shows it), which webpki does not take.
fn is_version1(der: &[u8]) -> bool {
    let Some((0x30, certificate, _)) = tlv(der) else {
        return false;
    };
    let Some((0x30, tbs, _)) = tlv(certificate) else {
        return false;
    };
    matches!(tlv(tbs), Some((tag, _, _)) if tag != 0xa0)
}

/// A version 1 certificate signed by one of the root certificates given (`roots`, DER) and
/// valid `now`: the check OpenSSL (and so libpq) makes of it, for a server certificate made the
/// way PostgreSQL's manual shows. (One level: signed by a root itself.)
fn version1_signed_by_root(
    der: &[u8],
    roots: &[Vec<u8>],
    provider: &rustls::crypto::CryptoProvider,
    now: UnixTime,
) -> std::result::Result<(), rustls::Error> {
    let invalid = |e| rustls::Error::InvalidCertificate(e);
    let check = || -> Option<std::result::Result<(), rustls::Error>> {
        let (0x30, certificate, _) = tlv(der)? else {
            return None;
        };
        let (0x30, _, after_tbs) = tlv(certificate)? else {
            return None;
        };
        // The signed bytes: the whole tbsCertificate, its tag and length included.
        let signed = &certificate[..certificate.len() - after_tbs.len()];
        let (0x30, algorithm, after_algorithm) = tlv(after_tbs)? else {
            return None;
        };
        let (0x03, signature, _) = tlv(after_algorithm)? else {
            return None;
        };
        let signature = signature.split_first()?.1;
        let fields = tbs_fields(certificate)?;
        let skip = usize::from(fields.first()?.0 == 0xa0);
        let issuer = fields.get(skip + 2)?.2;
        let (0x30, validity, _) = *fields.get(skip + 3)? else {
            return None;
        };
        let (t1, not_before, rest) = tlv(validity)?;
        let (t2, not_after, _) = tlv(rest)?;
        let now = now.as_secs() as i64;
        if now < asn1_time(t1, not_before)? {
            return Some(Err(invalid(CertificateError::NotValidYet)));
        }
        if now > asn1_time(t2, not_after)? {
            return Some(Err(invalid(CertificateError::Expired)));
        }
        let mut issuer_found = false;
        for root in roots {
            let Some(root_fields) = tbs_fields(tlv(root)?.1) else {
                continue;
            };
            let root_skip = usize::from(root_fields.first()?.0 == 0xa0);
            if root_fields.get(root_skip + 4)?.2 != issuer {
                continue;
            }
            issuer_found = true;
            let Some((_, key_algorithm, key)) = certificate_spki(root) else {
                continue;
            };
            let verified = provider
                .signature_verification_algorithms
                .all
                .iter()
                .any(|a| {
                    a.signature_alg_id().as_ref() == algorithm
                        && a.public_key_alg_id().as_ref() == key_algorithm
                        && a.verify_signature(key, signed, signature).is_ok()
                });
            if verified {
                return Some(Ok(()));
            }
        }
        Some(Err(if issuer_found {
            invalid(CertificateError::BadSignature)
        } else {
            rustls::Error::General(
                "the server's certificate is a version 1 one (no extensions), and no certificate in sslrootcert signed it: pgapply takes a version 1 certificate only when a certificate in sslrootcert signed it directly, so put its issuing (intermediate) CA in the sslrootcert file too, or give the server a version 3 certificate (openssl x509 -req ... -extfile with subjectAltName=DNS:<host>)".into(),
            )
        }))
    };
    check().unwrap_or(Err(invalid(CertificateError::BadEncoding)))
}

/// A DER certificate's subjectPublicKeyInfo: (the whole TLV, its algorithm's contents, the key
/// bits).
fn certificate_spki(der: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let fields = tbs_fields(tlv(der)?.1)?;
    let skip = usize::from(fields.first()?.0 == 0xa0);
    let (0x30, spki, whole) = *fields.get(skip + 5)? else {
        return None;
    };
    let (0x30, algorithm, after) = tlv(spki)? else {
        return None;
    };
    let (0x03, key, _) = tlv(after)? else {
        return None;
    };
    Some((whole, algorithm, key.split_first()?.1))
}

/// One DER field: its tag, its contents, and the whole TLV.
type Field<'a> = (u8, &'a [u8], &'a [u8]);

/// A certificate's tbsCertificate fields (`certificate`: the Certificate SEQUENCE's contents):
/// (tag, contents, the whole TLV).
fn tbs_fields(certificate: &[u8]) -> Option<Vec<Field<'_>>> {
    let (0x30, tbs, _) = tlv(certificate)? else {
        return None;
    };
    let mut rest = tbs;
    let mut fields = Vec::new();
    while !rest.is_empty() {
        let (tag, contents, after) = tlv(rest)?;
        fields.push((tag, contents, &rest[..rest.len() - after.len()]));
        rest = after;
    }
    Some(fields)
}

/// A UTCTime (`YYMMDDHHMMSSZ`, 1950 to 2049) or GeneralizedTime (`YYYYMMDDHHMMSSZ`), in seconds
/// since 1970.
fn asn1_time(tag: u8, text: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(text).ok()?.strip_suffix('Z')?;
    let (year, rest) = match tag {
        0x17 if text.len() == 12 => {
            let yy: i64 = text[..2].parse().ok()?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &text[2..])
        }
        0x18 if text.len() == 14 => (text[..4].parse().ok()?, &text[4..]),
        _ => return None,
    };
    let part = |i: usize| -> Option<i64> { rest.get(i..i + 2)?.parse().ok() };
    let (month, day) = (part(0)?, part(2)?);
    let (hour, minute, second) = (part(4)?, part(6)?, part(8)?);
    // Days from 1970-01-01 to the date (the proleptic Gregorian calendar).
    let (y, m) = if month <= 2 {
        (year - 1, month + 9)
    } else {
        (year, month - 3)
    };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hour * 3600 + minute * 60 + second)
}

/// A certificate name (`db.example.com`, or `*.example.com` for one label) against the host
/// connected to, as libpq compares them: without regard to case.
fn name_matches(name: &str, host: &str) -> bool {
    let (name, host) = (name.to_ascii_lowercase(), host.to_ascii_lowercase());
    match name.strip_prefix("*.") {
        Some(domain) => host
            .split_once('.')
            .is_some_and(|(label, rest)| !label.is_empty() && rest == domain),
        None => name == host,
    }
}

/// verify-full against a certificate with no subjectAltName: its subject's common name, as
/// libpq falls back to it (webpki reads only subjectAltName).
fn common_name_fits(end_entity: &CertificateDer<'_>, server_name: &ServerName<'_>) -> bool {
    let host = match server_name {
        ServerName::DnsName(d) => d.as_ref().to_owned(),
        ServerName::IpAddress(ip) => std::net::IpAddr::from(*ip).to_string(),
        _ => return false,
    };
    common_names_without_alt_names(end_entity.as_ref())
        .is_some_and(|names| names.iter().any(|n| name_matches(n, &host)))
}

fn verifier(
    roots: Arc<RootCertStore>,
    provider: &Arc<rustls::crypto::CryptoProvider>,
) -> Result<Arc<WebPkiServerVerifier>> {
    WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| Error::definite(format!("TLS setup: {e}")))
}

#[derive(Debug)]
enum Check {
    /// sslmode=prefer/require without a root certificate: encryption only, as libpq does.
    Nothing,
    /// verify-ca (and require with a root certificate): the chain, not the host name.
    ChainOnly(Arc<WebPkiServerVerifier>),
    Full(Arc<WebPkiServerVerifier>),
}

#[derive(Debug)]
struct Verifier {
    check: Check,
    provider: Arc<rustls::crypto::CryptoProvider>,
    seen: Option<SeenCertificate>,
    /// The sslrootcert certificates, DER.
    pinned: Vec<Vec<u8>>,
}

impl Verifier {
    /// A version 1 server certificate (webpki takes only version 3) signed by a root given, and
    /// for verify-full naming the host in its subject's common name (it has no other names).
    fn version1(
        &self,
        end_entity: &CertificateDer<'_>,
        server_name: &ServerName<'_>,
        now: UnixTime,
        full: bool,
    ) -> Option<std::result::Result<ServerCertVerified, rustls::Error>> {
        if !is_version1(end_entity.as_ref()) {
            return None;
        }
        // (Its own reason when it fails: webpki's says only that version 1 is not its kind.)
        if let Err(e) =
            version1_signed_by_root(end_entity.as_ref(), &self.pinned, &self.provider, now)
        {
            return Some(Err(e));
        }
        Some(if !full || common_name_fits(end_entity, server_name) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName,
            ))
        })
    }

    /// The handshake's signature by the key of a version 1 certificate, which webpki does not
    /// parse: its subjectPublicKeyInfo read here, the algorithms rustls has for the scheme.
    fn version1_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        let bad = || rustls::Error::InvalidCertificate(CertificateError::BadSignature);
        let (_, algorithm, key) = certificate_spki(cert.as_ref()).ok_or_else(bad)?;
        let mapping = self.provider.signature_verification_algorithms.mapping;
        let verified = mapping
            .iter()
            .filter(|(scheme, _)| *scheme == dss.scheme)
            .flat_map(|(_, algs)| algs.iter())
            .filter(|a| a.public_key_alg_id().as_ref() == algorithm)
            .any(|a| a.verify_signature(key, message, dss.signature()).is_ok());
        if verified {
            Ok(HandshakeSignatureValid::assertion())
        } else {
            Err(bad())
        }
    }

    /// A server certificate that is itself one of the root certificates given (a self-signed
    /// one, made with `openssl req -x509`, which marks it a CA: webpki refuses a CA as a
    /// server's certificate, libpq's OpenSSL trusts it): trusted, its name checked for
    /// verify-full.
    fn pinned(
        &self,
        end_entity: &CertificateDer<'_>,
        server_name: &ServerName<'_>,
        full: bool,
    ) -> Option<std::result::Result<ServerCertVerified, rustls::Error>> {
        if !self
            .pinned
            .iter()
            .any(|c| c.as_slice() == end_entity.as_ref())
        {
            return None;
        }
        if !full {
            return Some(Ok(ServerCertVerified::assertion()));
        }
        Some(
            rustls::server::ParsedCertificate::try_from(end_entity)
                .and_then(|parsed| rustls::client::verify_server_name(&parsed, server_name))
                .map(|()| ServerCertVerified::assertion())
                .or_else(|e| match e {
                    _ if common_name_fits(end_entity, server_name) => {
                        Ok(ServerCertVerified::assertion())
                    }
                    // (webpki cannot read a version 1 certificate's names: its only name, the
                    // common name, was just compared.)
                    _ if is_version1(end_entity.as_ref()) => Err(
                        rustls::Error::InvalidCertificate(CertificateError::NotValidForName),
                    ),
                    e => Err(e),
                }),
        )
    }
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        if let Some(seen) = &self.seen {
            if let Ok(mut seen) = seen.lock() {
                *seen = Some(end_entity.to_vec());
            }
        }
        match &self.check {
            Check::Nothing => Ok(ServerCertVerified::assertion()),
            Check::Full(v) => {
                match v.verify_server_cert(
                    end_entity,
                    intermediates,
                    server_name,
                    ocsp_response,
                    now,
                ) {
                    // (webpki checks the name after the chain: the chain is good.)
                    Err(rustls::Error::InvalidCertificate(
                        CertificateError::NotValidForName
                        | CertificateError::NotValidForNameContext { .. },
                    )) if common_name_fits(end_entity, server_name) => {
                        Ok(ServerCertVerified::assertion())
                    }
                    Err(e) => self
                        .pinned(end_entity, server_name, true)
                        .or_else(|| self.version1(end_entity, server_name, now, true))
                        .unwrap_or(Err(e)),
                    ok => ok,
                }
            }
            Check::ChainOnly(v) => {
                match v.verify_server_cert(
                    end_entity,
                    intermediates,
                    server_name,
                    ocsp_response,
                    now,
                ) {
                    Err(rustls::Error::InvalidCertificate(
                        CertificateError::NotValidForName
                        | CertificateError::NotValidForNameContext { .. },
                    )) => Ok(ServerCertVerified::assertion()),
                    Err(e) => self
                        .pinned(end_entity, server_name, false)
                        .or_else(|| self.version1(end_entity, server_name, now, false))
                        .unwrap_or(Err(e)),
                    ok => ok,
                }
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        if is_version1(cert.as_ref()) {
            return self.version1_signature(message, cert, dss);
        }
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        if is_version1(cert.as_ref()) {
            // (TLS 1.3 signs with these only: no PKCS#1 v1.5, no SHA-1.)
            let tls13 = matches!(
                dss.scheme,
                SignatureScheme::ECDSA_NISTP256_SHA256
                    | SignatureScheme::ECDSA_NISTP384_SHA384
                    | SignatureScheme::ECDSA_NISTP521_SHA512
                    | SignatureScheme::RSA_PSS_SHA256
                    | SignatureScheme::RSA_PSS_SHA384
                    | SignatureScheme::RSA_PSS_SHA512
                    | SignatureScheme::ED25519
                    | SignatureScheme::ED448
            );
            if !tls13 {
                return Err(
                    rustls::PeerMisbehaved::SignedHandshakeWithUnadvertisedSigScheme.into(),
                );
            }
            return self.version1_signature(message, cert, dss);
        }
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// An ordinary SQL connection, with the server's TLS settings; the connection task is spawned.
pub async fn connect(
    config: &tokio_postgres::Config,
) -> std::result::Result<tokio_postgres::Client, ConnectError> {
    let tls = make_tls(config).map_err(ConnectError::Setup)?;
    // The whole handshake, not only the TCP connect that tokio-postgres times: a server that
    // accepts the connection and then says nothing would keep this waiting for ever.
    let (client, connection) = tokio::time::timeout(handshake_timeout(config), config.connect(tls))
        .await
        .map_err(|_| ConnectError::Setup(Error::transient(handshake_timed_out(config))))?
        .map_err(ConnectError::Postgres)?;
    tokio::spawn(tracing::Instrument::in_current_span(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "connection ended");
        }
    }));
    crate::cancel::register(&client, config);
    Ok(client)
}

/// How long one connection attempt may take, handshake included: `connect_timeout` (as libpq:
/// per host, here per host and per address of a name with two, IPv6 and IPv4), 10 s each unless
/// the connection string sets it (`conninfo::parse` sets that default on the config).
pub fn handshake_timeout(config: &tokio_postgres::Config) -> std::time::Duration {
    let each = config
        .get_connect_timeout()
        .copied()
        .unwrap_or(crate::conninfo::CONNECT_TIMEOUT);
    // (An address given as such, or a socket, is one attempt; a name may have two addresses.)
    let attempts: u32 = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| match host {
            tokio_postgres::config::Host::Tcp(name)
                if name.parse::<std::net::IpAddr>().is_err()
                    && config.get_hostaddrs().get(i).is_none() =>
            {
                2
            }
            _ => 1,
        })
        .sum();
    each * attempts.max(1)
}

/// Why a connection that took longer than `handshake_timeout` was given up.
pub fn handshake_timed_out(config: &tokio_postgres::Config) -> String {
    format!(
        "the server did not complete the PostgreSQL handshake within {} (connect_timeout {} per host and address): is it overloaded or stopped, and is that port PostgreSQL's?",
        humantime::format_duration(handshake_timeout(config)),
        humantime::format_duration(
            config
                .get_connect_timeout()
                .copied()
                .unwrap_or(crate::conninfo::CONNECT_TIMEOUT)
        )
    )
}

/// `connect`, with an error that names the server (`role` is "source" or "target").
pub async fn connect_to(
    config: &tokio_postgres::Config,
    role: &str,
) -> Result<tokio_postgres::Client> {
    connect(config).await.map_err(|e| {
        e.into_error(format!(
            "connecting to {role} {}",
            crate::conninfo::describe(config)
        ))
    })
}

/// What to do when sslmode requires TLS of a server that does not do it.
/// What to do about a connection the TLS settings made fail (no TLS on a server sslmode
/// requires it of, a certificate sslrootcert does not vouch for): settings, not a retry, fix it.
pub fn tls_advice(e: &tokio_postgres::Error) -> Option<&'static str> {
    if crate::error::refusing_alert(e).is_some() {
        Some(CLIENT_CERTIFICATE_ADVICE)
    } else if crate::error::server_lacks_tls(e) {
        Some(NO_TLS_ADVICE)
    } else if crate::error::certificate_refused(e) {
        Some(CERTIFICATE_ADVICE)
    } else {
        None
    }
}

pub const CLIENT_CERTIFICATE_ADVICE: &str = "the server ended the TLS handshake over the connection's settings, not for a moment: if it asks for a client certificate, check sslcert and sslkey (the key must be the certificate's; the certificate signed by a CA in the server's ssl_ca_file, with any intermediate CA in the sslcert file after it); otherwise compare the TLS versions the server allows (ssl_min_protocol_version)";
pub const CERTIFICATE_ADVICE: &str = "check sslrootcert (the CA that signed the server's certificate) and, with verify-full, that the certificate names the host you connect to; sslmode=require without a root certificate (no sslrootcert, no ~/.postgresql/root.crt) encrypts without checking";
pub const NO_TLS_ADVICE: &str = "the server does not accept TLS connections, but sslmode requires TLS: enable ssl on the server, or use sslmode=prefer or disable";

#[derive(Debug)]
pub enum ConnectError {
    Setup(Error),
    Postgres(tokio_postgres::Error),
}

impl ConnectError {
    /// As pgapply's error, with what was being done.
    pub fn into_error(self, context: impl Into<String>) -> Error {
        match self {
            ConnectError::Setup(e) => e.context(context.into()),
            ConnectError::Postgres(e) => {
                let advice = tls_advice(&e);
                // `ALTER DATABASE .. ALLOW_CONNECTIONS false` (the only 55000 a connection
                // gets): maintenance, which ends; transient, as for a running worker.
                let refused = e.code()
                    == Some(&tokio_postgres::error::SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE);
                let err = Error::postgres(context, e);
                if refused {
                    return Error::transient(format!(
                        "{}: the database refuses connections for now (ALTER DATABASE .. ALLOW_CONNECTIONS false)",
                        err.message()
                    ));
                }
                if let Some(advice) = advice {
                    return err.context_after(advice);
                }
                if err.message().ends_with("password missing") {
                    err.context_after(
                        "the server asks for a password: give password= in the connection string, --source-password-file / --target-password-file, PGPASSWORD, or ~/.pgpass",
                    )
                } else {
                    err
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate's outline: SEQUENCE { SEQUENCE (tbs), SEQUENCE { OID, NULL }, BIT STRING }.
    fn certificate(oid: &[u8]) -> Vec<u8> {
        let mut algorithm = vec![0x06, oid.len() as u8];
        algorithm.extend_from_slice(oid);
        algorithm.extend_from_slice(&[0x05, 0x00]);
        let mut body = vec![0x30, 0x03, 0x02, 0x01, 0x01, 0x30, algorithm.len() as u8];
        body.extend_from_slice(&algorithm);
        body.extend_from_slice(&[0x03, 0x02, 0x00, 0xff]);
        let mut der = vec![0x30, 0x81, body.len() as u8];
        der.extend_from_slice(&body);
        der
    }

    #[test]
    fn certificate_times_and_names_read_as_openssl_and_libpq_read_them() {
        // 2026-12-02 00:17:20 UTC, as UTCTime and GeneralizedTime; 1999 from a UTCTime.
        assert_eq!(asn1_time(0x17, b"261202001720Z"), Some(1_796_170_640));
        assert_eq!(asn1_time(0x18, b"20261202001720Z"), Some(1_796_170_640));
        assert_eq!(asn1_time(0x17, b"991231235959Z"), Some(946_684_799));
        assert_eq!(asn1_time(0x17, b"2612020017Z"), None);
        assert!(name_matches("DB.example.com", "db.EXAMPLE.com"));
        assert!(name_matches("*.example.com", "db.example.com"));
        assert!(!name_matches("*.example.com", "a.db.example.com"));
        assert!(!name_matches("*.example.com", "example.com"));
        assert!(!name_matches("db.example.com", "db.example.org"));
    }

    #[test]
    fn the_end_point_hash_follows_the_signature_algorithm() {
        let rsa = |last: u8| certificate(&[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, last]);
        let ecdsa = |last: u8| certificate(&[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, last]);
        let len = |der: Vec<u8>| tls_server_end_point(&der).map(|h| h.len());
        assert_eq!(len(rsa(0x0b)), Some(32)); // sha256WithRSAEncryption
        assert_eq!(len(rsa(0x05)), Some(32)); // sha1WithRSAEncryption: SHA-256
        assert_eq!(len(rsa(0x0c)), Some(48));
        assert_eq!(len(rsa(0x0d)), Some(64));
        assert_eq!(len(ecdsa(0x02)), Some(32));
        assert_eq!(len(ecdsa(0x03)), Some(48));
        assert_eq!(len(certificate(&[0x2b, 0x65, 0x70])), None); // Ed25519
        let der = rsa(0x0b);
        assert_eq!(
            tls_server_end_point(&der),
            Some(<sha2::Sha256 as sha2::Digest>::digest(&der).to_vec())
        );
        // Cut short anywhere: no answer, no panic.
        for n in 0..der.len() {
            assert_eq!(tls_server_end_point(&der[..n]), None);
        }
    }
}
