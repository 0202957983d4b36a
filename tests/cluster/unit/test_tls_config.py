"""Mutual TLS settings: `[tls]` in node and server files, the client's tls_* keys, the CLI's
--tls-* options, and the development certificates of `waltz tls generate`."""

from __future__ import annotations

import ipaddress
import json
import pathlib
import stat

import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from waltz.cli.main import main
from waltz.client import ClientConfig
from waltz.config import ConfigError, load_server_config, load_storage_node_config
from waltz.tls import CLIENT_PORT_ROLES, DevCertificates, TlsSection, generate_dev_certificates, peer_roles, refuse_role


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> DevCertificates:
    return generate_dev_certificates(tmp_path_factory.mktemp("certs"), ("127.0.0.1", "node-a.example", "::1"))


def test_all_three_or_none(certs: DevCertificates) -> None:
    assert not TlsSection().enabled
    assert TlsSection(certs.ca, certs.server_cert, certs.server_key).enabled
    with pytest.raises(ConfigError, match=r"\[tls\] sets ca but not cert, key: mutual TLS needs all of ca, cert, key"):
        TlsSection(ca=certs.ca)
    with pytest.raises(ConfigError, match=r"sets cert, key but not ca"):
        TlsSection(cert=certs.server_cert, key=certs.server_key)


def test_files_are_checked_when_loaded(certs: DevCertificates, tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=r"\[tls\] cert = '.*/nope.pem': no such file"):
        TlsSection(certs.ca, tmp_path / "nope.pem", certs.server_key)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"\[tls\] ca = '.*junk.pem': not a PEM certificate file"):
        TlsSection(junk, certs.server_cert, certs.server_key)
    with pytest.raises(ConfigError, match=r"not a PEM certificate and its private key"):
        TlsSection(certs.ca, certs.server_cert, certs.client_key)  # another certificate's key


def test_contexts_are_mutual(certs: DevCertificates) -> None:
    import ssl

    server = certs.tls("server").server_context()
    assert server.verify_mode == ssl.CERT_REQUIRED
    assert server.minimum_version >= ssl.TLSVersion.TLSv1_2
    client = certs.client_tls().client_context()
    assert client.check_hostname and client.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ConfigError, match="not configured"):
        TlsSection().client_context()


def _node_file(tmp_path: pathlib.Path, tls: str) -> pathlib.Path:
    path = tmp_path / "node.toml"
    path.write_text(f'[storage]\ndirectory = "{tmp_path / "data"}"\n\n[tls]\n{tls}')
    return path


def test_node_and_server_files(certs: DevCertificates, tmp_path: pathlib.Path) -> None:
    full = f'ca = "{certs.ca}"\ncert = "{certs.server_cert}"\nkey = "{certs.server_key}"\n'
    config = load_storage_node_config(_node_file(tmp_path, full))
    assert config.tls == TlsSection(certs.ca, certs.server_cert, certs.server_key) and config.tls.enabled
    assert not load_storage_node_config(_node_file(tmp_path, "")).tls.enabled

    path = _node_file(tmp_path, f'ca = "{certs.ca}"\n')
    with pytest.raises(ConfigError, match=rf"^{path}: \[tls\] sets ca but not cert, key"):
        load_storage_node_config(path)
    with pytest.raises(ConfigError, match=r"\[tls\]: unknown key\(s\) certificate"):
        load_storage_node_config(_node_file(tmp_path, f'certificate = "{certs.server_cert}"\n'))
    with pytest.raises(ConfigError, match=r"\[tls\]\.ca: expected a path string"):
        load_storage_node_config(_node_file(tmp_path, "ca = 3\n"))

    server = tmp_path / "server.toml"
    server.write_text(f'[server]\nmetadata = "embedded:{tmp_path}/m.db"\n\n[tls]\n{full}')
    assert load_server_config(server).tls.enabled
    server.write_text(f'[server]\nmetadata = "embedded:{tmp_path}/m.db"\n\n[tls]\nkey = "{certs.server_key}"\n')
    with pytest.raises(ConfigError, match=r"\[tls\] sets key but not ca, cert"):
        load_server_config(server)


def test_client_keys(certs: DevCertificates, tmp_path: pathlib.Path) -> None:
    c = ClientConfig(metadata="embedded:/x.db", tls_ca=certs.ca, tls_cert=certs.client_cert, tls_key=certs.client_key)
    assert c.tls.enabled and c.tls.cert == certs.client_cert
    assert not ClientConfig(metadata="embedded:/x.db").tls.enabled
    with pytest.raises(ConfigError, match="sets tls_ca but not tls_cert, tls_key"):
        ClientConfig(metadata="embedded:/x.db", tls_ca=certs.ca)
    path = tmp_path / "client.toml"
    path.write_text(
        f'[client]\nmetadata = "embedded:/x.db"\ntls_ca = "{certs.ca}"\ntls_cert = "{certs.client_cert}"\n'
        f'tls_key = "{tmp_path / "gone.pem"}"\n'
    )
    with pytest.raises(ConfigError, match=rf"^{path} \[client\]: tls_key = '.*gone.pem': no such file"):
        ClientConfig.from_file(path)
    path.write_text(
        f'[client]\nmetadata = "embedded:/x.db"\ntls_ca = "{certs.ca}"\ntls_cert = "{certs.client_cert}"\n'
        f'tls_key = "{certs.client_key}"\n'
    )
    assert ClientConfig.from_file(path).tls.enabled


def test_dev_certificates_one_per_role(certs: DevCertificates, tmp_path: pathlib.Path) -> None:
    for key in (certs.ca_key, certs.storage_key, certs.server_key, certs.admin_key, certs.client_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    for role in ("storage", "server", "admin", "client"):
        cert = x509.load_pem_x509_certificate(getattr(certs, f"{role}_cert").read_bytes())
        assert cert.issuer == ca.subject
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [f"waltz:role:{role}"], role
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        if role in ("storage", "server"):  # they listen: clients check the address they dial
            ips = [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
            assert sans.get_values_for_type(x509.IPAddress) == ips
            assert sans.get_values_for_type(x509.DNSName) == ["node-a.example"]
            assert usages == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        else:
            assert sans.get_values_for_type(x509.IPAddress) == [] and usages == {ExtendedKeyUsageOID.CLIENT_AUTH}
        # The role as the server's client port reads it from a verified peer.
        peer = {"subjectAltName": tuple(("URI", u) for u in sans.get_values_for_type(x509.UniformResourceIdentifier))}
        assert peer_roles(peer) == {role}
        assert (refuse_role(peer, CLIENT_PORT_ROLES) is None) == (role in ("client", "admin"))
    assert "has no role" in (refuse_role({"subjectAltName": (("DNS", "x"),)}, CLIENT_PORT_ROLES) or "")
    with pytest.raises(FileExistsError, match="already exist"):
        generate_dev_certificates(certs.ca.parent)
    assert DevCertificates.at(certs.ca.parent) == certs


def test_cli_generate_and_options(tmp_path: pathlib.Path) -> None:
    runner = CliRunner()
    r = runner.invoke(main, ["tls", "generate", "--directory", str(tmp_path / "c"), "--host", "10.1.2.3", "--json"])
    assert r.exit_code == 0, r.output
    files = json.loads(r.stdout)
    roles = ("storage", "server", "admin", "client")
    assert set(files) == {"ca", "ca_key", *(f"{r}_{k}" for r in roles for k in ("cert", "key"))}
    assert all(pathlib.Path(p).exists() for p in files.values())
    r = runner.invoke(main, ["tls", "generate", "--directory", str(tmp_path / "c")])
    assert r.exit_code == 1 and "already exist" in r.output and "Traceback" not in r.output
    r = runner.invoke(main, ["tls", "generate", "--directory", str(tmp_path / "c"), "--force"])
    assert r.exit_code == 0 and "--tls-ca" in r.output
    # A partial set of --tls-* options is one clear line before anything connects.
    r = runner.invoke(
        main,
        [
            "--metadata",
            f"embedded:{tmp_path}/m.db",
            "--tls-ca",
            files["ca"],
            "cluster",
            "create",
            "--partitions",
            "1",
            "--replicas",
            "1",
        ],
    )
    assert r.exit_code == 0, r.output  # the metadata store needs no TLS
    r = runner.invoke(main, ["--metadata", f"embedded:{tmp_path}/m.db", "--tls-ca", files["ca"], "cluster", "verify"])
    assert r.exit_code == 1 and "sets --tls-ca but not --tls-cert, --tls-key" in r.output, r.output
