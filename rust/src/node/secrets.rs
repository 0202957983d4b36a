//! Per-role shared secrets: the minimum a plaintext node asks of its peers (issue 34). A peer
//! names its role and gives that role's secret at the end of its Hello; the node keeps only
//! SHA-256 digests of the secrets and compares digests in constant time, so neither the time an
//! answer takes nor its length tells how much of a guess was right. Plaintext still carries the
//! secret in clear on the wire (docs/operations.md, "Security model").
use crate::node::protocol::Credential;
use ring::digest::{digest, SHA256};
use subtle::ConstantTimeEq;

/// The secret of each role a node admits; empty when none is configured (then nothing is asked).
#[derive(Clone, Default)]
pub struct RoleSecrets {
    digests: Vec<(String, [u8; 32])>,
}

impl std::fmt::Debug for RoleSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let roles: Vec<&str> = self.digests.iter().map(|(r, _)| r.as_str()).collect();
        write!(f, "RoleSecrets {{ roles: {roles:?} }}")
    }
}

fn sha256(b: &[u8]) -> [u8; 32] {
    digest(&SHA256, b).as_ref().try_into().expect("SHA-256 is 32 bytes")
}

impl RoleSecrets {
    pub fn new<'a>(secrets: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> RoleSecrets {
        RoleSecrets { digests: secrets.into_iter().map(|(role, s)| (role.to_owned(), sha256(s))).collect() }
    }

    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// The role `credential` proves among `admitted`: Ok(None) when no secret is configured
    /// (nothing to prove), Ok(Some(role)) when it gives a configured secret of an admitted role,
    /// else Err(why) for the refusal, which never echoes the secret given.
    pub fn check(&self, credential: Option<&Credential>, admitted: &[&str]) -> Result<Option<String>, String> {
        if self.is_empty() {
            return Ok(None);
        }
        let Some(c) = credential else {
            return Err(format!(
                "this node requires a role secret in Hello (one of {}) and none was given: configure the \
                 role's secret ([role_secrets] / WALTZ_ADMIN_SECRET)",
                admitted.join(", ")
            ));
        };
        if !admitted.contains(&c.role.as_str()) {
            return Err(format!("role {:?} is not admitted on this port (only {})", c.role, admitted.join(", ")));
        }
        let given = sha256(&c.secret);
        // Every configured digest of the role is compared, whatever the first comparisons gave.
        let matched = self
            .digests
            .iter()
            .filter(|(role, _)| *role == c.role)
            .fold(subtle::Choice::from(0), |ok, (_, d)| ok | d.ct_eq(&given));
        if bool::from(matched) {
            Ok(Some(c.role.clone()))
        } else {
            Err(format!("wrong secret for role {} (or no secret configured for it on this node)", c.role))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cred(role: &str, secret: &[u8]) -> Credential {
        Credential { role: role.into(), secret: secret.to_vec() }
    }

    #[test]
    fn only_a_configured_secret_of_an_admitted_role_passes() {
        let none = RoleSecrets::default();
        assert_eq!(none.check(None, &["server"]), Ok(None));
        let s = RoleSecrets::new([("server", &b"alpha"[..]), ("admin", &b"beta"[..])]);
        assert_eq!(s.check(Some(&cred("server", b"alpha")), &["server", "admin"]), Ok(Some("server".into())));
        assert_eq!(s.check(Some(&cred("admin", b"beta")), &["server", "admin"]), Ok(Some("admin".into())));
        assert!(s.check(None, &["server", "admin"]).unwrap_err().contains("requires a role secret"));
        let wrong = s.check(Some(&cred("server", b"beta")), &["server", "admin"]).unwrap_err();
        assert!(wrong.contains("wrong secret for role server") && !wrong.contains("beta"), "{wrong}");
        assert!(s.check(Some(&cred("client", b"alpha")), &["server", "admin"]).unwrap_err().contains("not admitted"));
        assert!(s.check(Some(&cred("admin", b"beta")), &["server"]).is_err());
        assert!(!format!("{s:?}").contains("alpha"));
    }
}
