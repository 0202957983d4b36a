//! Mutual TLS for the storage node's ports: a rustls server configuration that requires a client
//! certificate signed by the cluster's CA, and plain words for why a handshake failed.
//!
//! rustls with the `ring` provider: it builds with nothing but a C compiler (aws-lc-rs wants
//! cmake), and the node only needs the common TLS 1.2/1.3 suites.
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::io;
use std::path::Path;
use std::sync::Arc;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};

pub use tokio_rustls::TlsAcceptor;

/// The server side of mutual TLS from PEM files: `ca` (the authorities client certificates must
/// chain to), `cert` (this node's chain, leaf first) and `key` (its private key).
pub fn server_config(ca: &Path, cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, String> {
    let provider = Arc::new(ring::default_provider());
    let mut roots = RootCertStore::empty();
    for c in certificates(ca, "ca")? {
        roots.add(c).map_err(|e| format!("ca {}: {e}", ca.display()))?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| format!("ca {}: {e}", ca.display()))?;
    let chain = certificates(cert, "cert")?;
    let key_der =
        PrivateKeyDer::from_pem_file(key).map_err(|e| format!("key {}: no PEM private key ({e})", key.display()))?;
    let config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key_der)
        .map_err(|e| format!("cert {} and key {}: {e}", cert.display(), key.display()))?;
    Ok(Arc::new(config))
}

fn certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{what} {}: no PEM certificate in the file", path.display()));
    }
    Ok(certs)
}

/// Why an accepted connection's handshake failed, for the one warning line it gets.
pub fn describe(e: &io::Error) -> String {
    use rustls::{AlertDescription as A, CertificateError as C, Error as E, InvalidMessage};
    let Some(tls) = e.get_ref().and_then(|inner| inner.downcast_ref::<E>()) else {
        return match e.kind() {
            io::ErrorKind::UnexpectedEof => {
                "the client closed the connection during the handshake (it may not trust this node's certificate)"
                    .into()
            }
            _ => e.to_string(),
        };
    };
    match tls {
        E::InvalidMessage(InvalidMessage::InvalidContentType)
        | E::InvalidMessage(InvalidMessage::UnknownProtocolVersion) => {
            "it does not speak TLS (a plaintext client on a TLS port: configure its TLS settings)".into()
        }
        E::NoCertificatesPresented => "the client presented no certificate (mutual TLS requires one)".into(),
        // BadSignature: issued under the same CA name by another key (two development CAs).
        E::InvalidCertificate(c @ (C::UnknownIssuer | C::BadSignature)) => {
            format!("the client's certificate is not signed by this node's CA ({c:?})")
        }
        E::InvalidCertificate(c) => format!("the client's certificate is refused: {c:?}"),
        E::AlertReceived(A::UnknownCA | A::BadCertificate | A::CertificateUnknown) => {
            "the client does not trust this node's certificate (its CA is not the one that signed it)".into()
        }
        other => other.to_string(),
    }
}

/// The URI subject alternative name that gives a certificate its role: `waltz:role:<role>`
/// (`storage`, `server`, `admin` or `client`; docs/operations.md, "Security model").
pub const ROLE_URI_PREFIX: &str = "waltz:role:";

/// The roles a storage node's storage and admin ports admit: servers (which replicate through
/// them) and operators. A client's or another storage node's certificate is refused, however
/// valid its chain.
pub const NODE_PORT_ROLES: &[&str] = &["server", "admin"];

/// The roles a verified peer certificate (DER, leaf) carries in its `waltz:role:` URIs; none
/// for a certificate without one (issued before roles existed) or one that does not parse.
pub fn roles(cert: &CertificateDer<'_>) -> Vec<String> {
    match webpki::EndEntityCert::try_from(cert) {
        Ok(ee) => ee.valid_uri_names().filter_map(|u| u.strip_prefix(ROLE_URI_PREFIX)).map(str::to_owned).collect(),
        Err(_) => Vec::new(),
    }
}

/// None when the peer's leaf certificate carries one of `allowed` roles; otherwise why it is
/// refused, for the warning line.
pub fn refuse_role(peer_certs: Option<&[CertificateDer<'_>]>, allowed: &[&str]) -> Option<String> {
    let Some(leaf) = peer_certs.and_then(|c| c.first()) else {
        return Some("the client presented no certificate".into());
    };
    let roles = roles(leaf);
    if roles.iter().any(|r| allowed.contains(&r.as_str())) {
        return None;
    }
    let has = if roles.is_empty() {
        format!("no role (no {ROLE_URI_PREFIX}<role> URI subject alternative name; reissue it with a role)")
    } else {
        format!("role {}", roles.join(", "))
    };
    Some(format!("the client's certificate has {has}; this port admits only {}", allowed.join(", ")))
}

/// True when `buf` starts like a TLS ClientHello: a TLS client on a plaintext port. Frames of
/// ours would need a length of over 350 MB to start this way.
pub fn looks_like_client_hello(buf: &[u8]) -> bool {
    buf.len() >= 2 && buf[0] == 0x16 && buf[1] == 0x03
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn errors_name_the_file_and_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let empty = write(dir.path(), "empty.pem", "");
        let junk =
            write(dir.path(), "junk.pem", "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n");
        let missing = dir.path().join("missing.pem");

        let e = server_config(&missing, &empty, &empty).unwrap_err();
        assert!(e.starts_with("ca ") && e.contains("missing.pem"), "{e}");
        let e = server_config(&empty, &empty, &empty).unwrap_err();
        assert!(e.contains("no PEM certificate") && e.contains("empty.pem"), "{e}");
        let e = server_config(&junk, &empty, &empty).unwrap_err();
        assert!(e.starts_with("ca ") && e.contains("junk.pem"), "{e}");
    }

    /// `waltz tls generate`'s admin certificate: URI `waltz:role:admin` after a DNS name.
    const ADMIN_CERT: &str = "\
-----BEGIN CERTIFICATE-----\n\
MIICHDCCAcKgAwIBAgIUY7aCXbPX7/qJKq7BPBUbiet08cUwCgYIKoZIzj0EAwIw\n\
RDEaMBgGA1UECgwRV2FsdHogZGV2ZWxvcG1lbnQxJjAkBgNVBAMMHVdhbHR6IGRl\n\
dmVsb3BtZW50IENBIDg5ZWU5NmVlMB4XDTI1MTIzMTIzNTUwMFoXDTM1MTIzMDAw\n\
MDAwMFowMjEaMBgGA1UECgwRV2FsdHogZGV2ZWxvcG1lbnQxFDASBgNVBAMMC3dh\n\
bHR6IGFkbWluMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAESf5F/qLpAkIGfAU6\n\
9NgSPyoFMgo4GiwhICFjan3S5vulLp11KVSiA8XBWqrDESfjNEzgXZFR+STRZdhO\n\
ysBqyKOBozCBoDAMBgNVHRMBAf8EAjAAMA4GA1UdDwEB/wQEAwIHgDATBgNVHSUE\n\
DDAKBggrBgEFBQcDAjAdBgNVHQ4EFgQUhDbwhynRo1bW6K0JWjS1MM5122cwHwYD\n\
VR0jBBgwFoAU5QxCgYDDPHVlqF3mFTcZZvavyGcwKwYDVR0RBCQwIoIObm9kZS1h\n\
LmV4YW1wbGWGEHdhbHR6OnJvbGU6YWRtaW4wCgYIKoZIzj0EAwIDSAAwRQIhAKVF\n\
tmcQlM0K3wJeEYoxEuX2o8pM+R58HQ1szFq/AOxyAiBpRNkbNzBG3YpQ1aibjSlu\n\
p+D+Ft5haKwEEsimYwuTnA==\n\
-----END CERTIFICATE-----\n\
";

    #[test]
    fn the_role_is_read_from_the_uri_name() {
        let cert = CertificateDer::from_pem_slice(ADMIN_CERT.as_bytes()).unwrap();
        assert_eq!(roles(&cert), vec!["admin".to_string()]);
        assert_eq!(refuse_role(Some(std::slice::from_ref(&cert)), NODE_PORT_ROLES), None);
        let why = refuse_role(Some(&[cert]), &["server"]).unwrap();
        assert!(why.contains("has role admin; this port admits only server"), "{why}");
    }

    #[test]
    fn a_peer_without_an_allowed_role_is_refused() {
        assert!(refuse_role(None, NODE_PORT_ROLES).unwrap().contains("no certificate"));
        let junk = CertificateDer::from(vec![0x30, 0x03, 0x02, 0x01, 0x00]);
        let why = refuse_role(Some(&[junk]), NODE_PORT_ROLES).unwrap();
        assert!(why.contains("no role") && why.contains("server, admin"), "{why}");
    }

    #[test]
    fn a_client_hello_is_told_from_a_frame() {
        assert!(looks_like_client_hello(&[0x16, 0x03, 0x01, 0x02, 0x00]));
        assert!(!looks_like_client_hello(&[0x00, 0x00, 0x00, 0x0a, 0x57, 0x53]));
        assert!(!looks_like_client_hello(&[0x16]));
    }

    #[test]
    fn handshake_failures_read_as_causes() {
        let wrap = |e: rustls::Error| io::Error::new(io::ErrorKind::InvalidData, e);
        assert!(describe(&wrap(rustls::Error::NoCertificatesPresented)).contains("no certificate"));
        let plain = rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType);
        assert!(describe(&wrap(plain)).contains("does not speak TLS"));
        let unknown = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        assert!(describe(&wrap(unknown)).contains("not signed by this node's CA"));
        assert!(describe(&io::Error::from(io::ErrorKind::UnexpectedEof)).contains("closed the connection"));
    }
}
