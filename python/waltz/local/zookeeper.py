"""A real standalone ZooKeeper (Debian package `zookeeper`) on 127.0.0.1, for tests and torture
runs: started, SIGKILLed and restarted on the same port and data directory."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

from waltz.local.cluster import free_port
from waltz.tls import TlsSection

ZOOKEEPER_JAR = "/usr/share/java/zookeeper.jar"


def zookeeper_available() -> bool:
    return os.path.exists(ZOOKEEPER_JAR) and shutil.which("java") is not None


NETTY_EXTRA_JARS = ("/usr/share/java/netty-codec.jar", "/usr/share/java/netty-resolver.jar")


class ZooKeeperServer:
    """A real standalone ZooKeeper 3.8 (Debian package `zookeeper`) on 127.0.0.1 and a free port.

    minSessionTimeout is lowered to 1 s so that tests can expire sessions quickly."""

    def __init__(self, directory: pathlib.Path, tls: TlsSection | None = None) -> None:
        """With `tls` (PEM files: its CA, certificate and key), ZooKeeper also serves a
        `secureClientPort` (`secure_port`) taking only mutual TLS with certificates of that CA."""
        self.directory = directory
        self.port = free_port()
        self.secure_port = free_port() if tls is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)
        secure = ""
        if tls is not None and tls.ca is not None and tls.cert is not None and tls.key is not None:
            # ZooKeeper 3.8 reads PEM stores; its key store is the key followed by the certificate.
            keystore = directory / "keystore.pem"
            keystore.write_bytes(tls.key.read_bytes() + tls.cert.read_bytes())
            keystore.chmod(0o600)
            secure = (
                f"secureClientPort={self.secure_port}\n"
                "secureClientPortAddress=127.0.0.1\n"
                "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory\n"
                f"ssl.keyStore.location={keystore}\nssl.keyStore.type=PEM\n"
                f"ssl.trustStore.location={tls.ca}\nssl.trustStore.type=PEM\n"
                "ssl.clientAuth=need\n"
            )
        (directory / "zoo.cfg").write_text(
            "tickTime=500\n"
            f"dataDir={directory / 'data'}\n"
            f"clientPort={self.port}\n"
            "clientPortAddress=127.0.0.1\n"
            "admin.enableServer=false\n"
            "4lw.commands.whitelist=ruok,srvr,stat\n"
            "minSessionTimeout=1000\n"
            "maxSessionTimeout=60000\n" + secure
        )

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, chroot: str = "") -> str:
        return f"zk://{self.hosts}{chroot}"

    def start(self, timeout: float = 60.0) -> None:
        log = open(self.directory / "zookeeper.log", "ab")
        self.proc = subprocess.Popen(
            [
                "java",
                "-Xmx256m",
                "-cp",
                # The Netty codec jars are not in the package jar's class path; the secure port needs them.
                ":".join(["/etc/zookeeper/conf", ZOOKEEPER_JAR, *NETTY_EXTRA_JARS]),
                "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                str(self.directory / "zoo.cfg"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ZooKeeper exited: {(self.directory / 'zookeeper.log').read_text()[-2000:]}")
            if self.serving():
                return
            time.sleep(0.1)
        raise RuntimeError("ZooKeeper did not start serving in time")

    def serving(self) -> bool:
        """Whether ZooKeeper serves requests: `ruok` answers as soon as the process listens,
        while it may still be loading its data (and a client's Connect then waits unanswered)."""
        return self.four_letter("srvr").startswith("Zookeeper version")

    def four_letter(self, word: str) -> str:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(word.encode())
                return s.recv(4096).decode()
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
