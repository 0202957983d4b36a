"""deploy/: the systemd units, the Containerfile, compose.yaml and the Kubernetes manifests.

Containers cannot run on these machines (no image registry; the runtime is refused its rlimits),
so the files are checked statically (systemd-analyze, the Compose specification's JSON schema,
Kubernetes' JSON schemas) and every command they run is run here, against a real cluster on
loopback addresses (tests/deploy/deployment.py says how): storage nodes, servers and the init
job, then /health and a committed client transaction. The commands come from the files
themselves, so a change to them is what runs."""

from __future__ import annotations

import copy
import os
import pathlib
import subprocess
import time
import tomllib
import uuid
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import yaml
from deployment import (
    BIN,
    DEPLOY,
    HostRun,
    Image,
    Member,
    compose_binary,
    compose_model,
    compose_schema,
    containerfile,
    env_file,
    expand_specifiers,
    kubernetes_documents,
    systemd_unit,
)
from support.client_app import MemoryApp, Write
from waltz.client import ClientConfig, WaltzClient
from waltz.config import NodeSection

UNITS = ("waltz-storage@.service", "waltz-server.service")
KUBERNETES_VERSION = "1.33"


# -- the files on their own ----------------------------------------------------------------------


def _units_for_verify(tmp_path: pathlib.Path) -> list[pathlib.Path]:
    """The units with ExecStart's binary where it is here (verify wants it to exist), the
    template as an instance."""
    paths = []
    for name in UNITS:
        text = (DEPLOY / "systemd" / name).read_text().replace("/opt/waltz/bin/", f"{BIN}/")
        path = tmp_path / name.replace("@.", "@a.")
        path.write_text(text)
        paths.append(path)
    return paths


def test_units_pass_systemd_analyze_verify(tmp_path: pathlib.Path) -> None:
    units = _units_for_verify(tmp_path)
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *map(str, units)], capture_output=True, text=True, cwd=tmp_path
    )
    # verify exits 0 on unknown keys and bad values, which it only prints: any line is a finding.
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done.stderr + done.stdout

    # The check is not blind: a misspelt key is reported.
    broken = tmp_path / "broken.service"
    broken.write_text(units[1].read_text().replace("ProtectHome=yes", "ProtectHom=yes"))
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(broken)], capture_output=True, text=True, cwd=tmp_path
    )
    assert "Unknown key 'ProtectHom'" in done.stderr


def test_units_are_hardened(tmp_path: pathlib.Path) -> None:
    """systemd's own exposure score, offline: 'OK' is at most 2.9 of 10 (ours is 1.7)."""
    for unit in _units_for_verify(tmp_path):
        done = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", "--threshold=25", "--no-pager", str(unit)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr
        service = systemd_unit(unit)["Service"]
        assert (
            service["User"] == ["waltz"]
            and service["DynamicUser"] == ["no"]
            and service["CapabilityBoundingSet"] == [""]
        )


def test_the_storage_unit_gives_the_node_the_files_max_connections_needs() -> None:
    """The node needs 4 x max_connections + 256 descriptors (storage/daemon.py), else serves fewer."""
    from waltz.storage.daemon import FILES_BESIDES_CONNECTIONS

    config = tomllib.loads((DEPLOY / "systemd" / "storage.toml").read_text())
    max_connections = config.get("node", {}).get("max_connections", NodeSection().max_connections)
    limit = int(systemd_unit(DEPLOY / "systemd" / "waltz-storage@.service")["Service"]["LimitNOFILE"][0])
    assert limit >= 4 * max_connections + FILES_BESIDES_CONNECTIONS
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert (
        compose["x-waltz"]["ulimits"]["nofile"]["hard"] >= 4 * NodeSection().max_connections + FILES_BESIDES_CONNECTIONS
    )


def test_sysusers_creates_the_waltz_user(tmp_path: pathlib.Path) -> None:
    (tmp_path / "etc").mkdir()
    done = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(DEPLOY / "systemd" / "waltz.sysusers")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    assert any(
        line.startswith("waltz:") and line.endswith(":/var/lib/waltz:/usr/sbin/nologin") for line in passwd.splitlines()
    ), passwd


def _compose_env() -> dict[str, str]:
    return {"WALTZ_CLUSTER_KEY": str(uuid.uuid4())}


def test_compose_file_follows_the_compose_specification() -> None:
    schema = compose_schema()
    document = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(document, schema, cls=jsonschema.Draft7Validator)
    broken = copy.deepcopy(document)
    broken["services"]["server-0"]["depends_on"]["init"]["condition"] = "service_finished"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema, cls=jsonschema.Draft7Validator)
    # Compose itself: the schema, and what it checks beyond it (dependencies naming services).
    done = subprocess.run(
        [str(compose_binary()), "-f", str(DEPLOY / "compose.yaml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, **_compose_env()},
    )
    assert done.returncode == 0, done.stderr


def test_kubernetes_manifests_follow_the_kubernetes_schemas() -> None:
    import kubernetes_validate

    docs = kubernetes_documents()
    assert sorted(d["kind"] for d in docs) == [
        "ConfigMap",
        "ConfigMap",
        "Deployment",
        "Job",
        "PodDisruptionBudget",
        "Service",
        "Service",
        "StatefulSet",
    ]
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy(next(d for d in docs if d["kind"] == "StatefulSet"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = ["http"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    # Every manifest of the folder is in the kustomization.
    listed = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(
        p.name for p in (DEPLOY / "kubernetes").glob("*.yaml") if p.name != "kustomization.yaml"
    )


def test_the_image_runs_the_daemons_as_a_user_with_a_volume() -> None:
    image = containerfile()
    text = (DEPLOY / "Containerfile").read_text()
    assert image.entrypoint == ["waltz-node"] and image.cmd[0] == "storage"
    assert image.volumes == ["/var/lib/waltz"]
    final = text.rsplit("\nFROM ", 1)[1]
    assert final.startswith("python:3.11-slim") and "\nUSER 10001:10001\n" in final
    # The wheel is built or taken in the first stage; the runtime stage only installs it.
    assert "scripts/wheel.sh" in text.rsplit("\nFROM ", 1)[0] and "cargo" not in final and "rustup" not in final
    for source in image.copies.values():
        assert source.exists(), source


# -- running the files' commands ----------------------------------------------------------------


@pytest.fixture
def metadata_url(zookeeper: Any) -> str:
    return str(zookeeper.url(f"/deploy-{uuid.uuid4().hex[:12]}"))


@pytest.fixture
def host_run(tmp_path: pathlib.Path, metadata_url: str) -> Iterator[HostRun]:
    run = HostRun(tmp_path, metadata_url, str(uuid.uuid4()), containerfile().copies)
    yield run
    run.stop_all()


def _commit_and_check(
    run: HostRun, cluster: str, storage: list[Member], servers: list[Member], init_env: dict[str, str]
) -> None:
    """Every server healthy, a transaction on every partition committed and read back, `waltz
    cluster verify` passing, and a clean stop (exit 0 within the grace period) for everyone."""
    for member in servers:
        run.wait_healthy(member, timeout=90)
    app = MemoryApp()
    with WaltzClient(app, ClientConfig(metadata=run.metadata_url, cluster=cluster, mount_timeout=60.0)) as client:
        contexts = [Write(f"deploy-{p}", partition=p) for p in range(client.partitions)]
        assert [client.submit(c).result(60) for c in contexts] == [True] * len(contexts)
        assert all(client.high_water_mark(p) == 0 for p in range(client.partitions))
        deadline = time.monotonic() + 60
        while any(not app.applied[p] for p in range(client.partitions)):
            assert time.monotonic() < deadline, f"not applied: {dict(app.applied)}"
            time.sleep(0.05)
    assert not app.errors, app.errors
    assert {p: [(txid, d["id"]) for txid, d in app.applied[p]] for p in app.applied} == {
        p: [(0, f"deploy-{p}")] for p in range(len(contexts))
    }
    verify = Member("verify", ["waltz", "cluster", "verify"], init_env, search_path=["/opt/waltz/bin"])
    run.run(verify)
    codes = run.stop_all()
    assert codes == {m.name: 0 for m in servers + storage}, codes
    for member in storage:
        assert "storage node stopped" in (run.root(member) / "daemon.log").read_text()


def test_systemd_units_run_a_cluster(host_run: HostRun) -> None:
    """3 hosts with waltz-storage@, one with waltz-server, the cluster made with init-cluster.sh
    and the env file beside the units, as docs/operations.md tells."""
    init_env = env_file(DEPLOY / "systemd" / "init-cluster.env")
    hosts = [address.rsplit(":", 1)[0] for address in init_env["WALTZ_STORAGE_NODES"].split()]
    server_toml = tomllib.loads((DEPLOY / "systemd" / "server.toml").read_text())
    server_host = server_toml["server"]["advertised_address"].rsplit(":", 1)[0]
    for host in hosts + [server_host]:
        host_run.address(host)

    def member(unit_name: str, name: str, host: str, instance: str) -> Member:
        service = systemd_unit(DEPLOY / "systemd" / unit_name)["Service"]
        argv = expand_specifiers(service["ExecStart"][0], instance).split()
        env: dict[str, str] = {}
        for assignment in service.get("Environment", []):
            for word in expand_specifiers(assignment, instance).split():
                key, _, value = word.partition("=")
                env[key] = value
        for path in service.get("EnvironmentFile", []):
            assert path.startswith("-"), "an EnvironmentFile the test does not write must be optional"
        config = argv[argv.index("--config") + 1]
        files = {config: (DEPLOY / "systemd" / pathlib.Path(config).name).read_text()}
        state = [f"/var/lib/{expand_specifiers(d, instance)}" for d in service.get("StateDirectory", [])]
        return Member(
            name,
            argv,
            env,
            files,
            state,
            float(service["TimeoutStopSec"][0]),
            host,
            notify=service["Type"] == ["notify"],
        )

    storage = [member("waltz-storage@.service", f"storage-{i}", host, str(i)) for i, host in enumerate(hosts)]
    for m in storage:
        host_run.start(m)  # returns once READY=1 came, as systemctl start would
        assert host_run.notifications[m.name][0].startswith("READY=1\nSTATUS=serving ")
        host_run.wait_healthy(m, timeout=1)  # ready means serving
    host_run.run(Member("init", ["sh", str(DEPLOY / "init-cluster.sh")], init_env, search_path=["/bin", "/usr/bin"]))
    server = member("waltz-server.service", "server-0", server_host, "")
    host_run.start(server)
    assert host_run.notifications[server.name][0].startswith("READY=1\nSTATUS=server ")
    _commit_and_check(host_run, init_env["WALTZ_CLUSTER"], storage, [server], init_env)
    # The storage directory is the unit's StateDirectory, given by the unit's Environment=.
    assert (host_run.root(storage[0]) / "var/lib/waltz/storage-0/waltz-storage.ctl").exists()


def _image_member(name: str, image: Image, service: dict[str, Any], stop_timeout: float) -> Member:
    """A compose service of the image: Docker's rules for entrypoint and command."""
    entrypoint = service.get("entrypoint")
    command = service.get("command")
    argv = (entrypoint if entrypoint is not None else image.entrypoint) + (
        command if command is not None else ([] if entrypoint is not None else image.cmd)
    )
    files = {path: source.read_text() for path, source in image.copies.items() if path.startswith("/etc/waltz/")}
    volumes = [v["target"] for v in service.get("volumes", [])] + image.volumes
    search = image.path + ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
    return Member(name, argv, dict(service.get("environment") or {}), files, volumes, stop_timeout, name, search)


def _seconds(duration: str) -> float:
    total, number = 0.0, ""
    for ch in duration:
        if ch.isdigit() or ch == ".":
            number += ch
        else:
            total += float(number) * {"h": 3600, "m": 60, "s": 1}[ch]
            number = ""
    return total


def test_compose_services_run_a_cluster(host_run: HostRun) -> None:
    """Each service of the image in the order its depends_on conditions give, ZooKeeper being
    the test's; the image's ENTRYPOINT and CMD where the service keeps them."""
    model = compose_model({"WALTZ_CLUSTER_KEY": host_run.cluster_key})
    image = containerfile()
    services = model["services"]
    ours = {n: s for n, s in services.items() if "build" in s}
    assert set(services) - set(ours) == {"zookeeper"}
    members = {n: _image_member(n, image, s, _seconds(s["stop_grace_period"])) for n, s in ours.items()}
    for name in members:
        host_run.address(name)
    healthy, completed = {"zookeeper"}, set()
    pending = dict(members)
    while pending:
        ready = [
            n
            for n in pending
            if all(
                (
                    dep in healthy
                    if cond["condition"] == "service_healthy"
                    else dep in completed
                    if cond["condition"] == "service_completed_successfully"
                    else dep in healthy | completed | set(host_run.procs)
                )
                for dep, cond in (ours[n].get("depends_on") or {}).items()
            )
        ]
        assert ready, f"nothing can start among {sorted(pending)}: a dependency cycle or an unmet condition"
        for name in ready:
            member = pending.pop(name)
            if ours[name].get("restart") == "no":
                host_run.run(member)
                completed.add(name)
            else:
                host_run.start(member)
        for name in ready:
            if name in host_run.procs:
                member = members[name]
                host_run.wait_healthy(member, timeout=90)
                # The image's HEALTHCHECK, as the runtime runs it in the container: a runtime
                # calls a container unhealthy after --retries failures in a row (a server is 503
                # for a moment while partitions move to a server that just started).
                for _ in range(image.healthcheck_retries):
                    done = host_run.run_check(member, image.healthcheck)
                    if done.returncode == 0:
                        break
                    time.sleep(1)
                assert done.returncode == 0, f"{name}: HEALTHCHECK failed: {done.stdout} {done.stderr}"
                assert '"status": "ok"' in done.stdout
                healthy.add(name)
    storage = [m for m in members.values() if m.kind == "storage"]
    servers = [m for m in members.values() if m.kind == "server"]
    assert len(storage) == 3 and len(servers) == 2
    init = next(s for s in ours.values() if s.get("restart") == "no")
    _commit_and_check(host_run, init["environment"]["WALTZ_CLUSTER"], storage, servers, dict(init["environment"]))


def _pod_member(
    name: str,
    host: str,
    pod: dict[str, Any],
    claims: list[dict[str, Any]],
    config_maps: dict[str, dict[str, str]],
    image: Image,
) -> Member:
    """A pod's one container: Kubernetes' rules for command and args, env and envFrom, and its
    volumes (ConfigMaps as files, claims and emptyDirs as directories)."""
    spec = pod["spec"]
    (container,) = spec["containers"]
    command, args = container.get("command"), container.get("args")
    argv = (command if command is not None else image.entrypoint) + (
        args if args is not None else ([] if command is not None else image.cmd)
    )
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for item in container.get("env", []):
        if "value" in item:
            value = item["value"]
            for key, known in env.items():
                value = value.replace(f"$({key})", known)
            env[item["name"]] = value
        elif "configMapKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = config_maps[ref["name"]][ref["key"]]
        else:
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            env[item["name"]] = host  # the pod's address: its loopback address here
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    files, directories = {}, []
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        if volume is not None and "configMap" in volume:
            for key, text in config_maps[volume["configMap"]["name"]].items():
                files[f"{mount['mountPath']}/{key}"] = text
        else:
            assert (
                volume is not None and "emptyDir" in volume or mount["name"] in [c["metadata"]["name"] for c in claims]
            )
            directories.append(mount["mountPath"])
    search = image.path + ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
    return Member(
        name, argv, env, files, directories, float(spec.get("terminationGracePeriodSeconds", 30)), host, search
    )


def test_kubernetes_manifests_run_a_cluster(host_run: HostRun) -> None:
    """The StatefulSet's pods, then the Job, then the Deployment's, each ready by its
    readinessProbe; the ConfigMaps as the pods see them."""
    docs = kubernetes_documents()
    image = containerfile()
    config_maps = {d["metadata"]["name"]: dict(d["data"]) for d in docs if d["kind"] == "ConfigMap"}
    by_kind = {d["kind"]: d for d in docs if d["kind"] != "ConfigMap" and d["kind"] != "Service"}
    sts, deployment, job = by_kind["StatefulSet"], by_kind["Deployment"], by_kind["Job"]
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    storage_hosts = [f"{name}-{i}.{service}" for i in range(sts["spec"]["replicas"])]
    server_hosts = [f"{deployment['metadata']['name']}-{i}" for i in range(deployment["spec"]["replicas"])]
    for host in storage_hosts + server_hosts:
        host_run.address(host)
    storage = [
        _pod_member(
            h.split(".")[0], h, sts["spec"]["template"], sts["spec"]["volumeClaimTemplates"], config_maps, image
        )
        for h in storage_hosts
    ]
    servers = [_pod_member(h, h, deployment["spec"]["template"], [], config_maps, image) for h in server_hosts]

    def probe(member: Member, pod: dict[str, Any], kind: str) -> None:
        (container,) = pod["spec"]["containers"]
        get = container[kind]["httpGet"]
        port = (
            next(p["containerPort"] for p in container["ports"] if p["name"] == get["port"])
            if isinstance(get["port"], str)
            else get["port"]
        )
        host_run.wait_healthy(member, get["path"], port, timeout=90)

    for m in storage:
        host_run.start(m)
    for m in storage:
        probe(m, sts["spec"]["template"], "readinessProbe")
        probe(m, sts["spec"]["template"], "livenessProbe")
    init = _pod_member("init", "waltz-init", job["spec"]["template"], [], config_maps, image)
    host_run.run(init)
    for m in servers:
        host_run.start(m)
    for m in servers:
        probe(m, deployment["spec"]["template"], "readinessProbe")
        probe(m, deployment["spec"]["template"], "livenessProbe")
    _commit_and_check(host_run, config_maps["waltz-cluster"]["WALTZ_CLUSTER"], storage, servers, init.env)
    # The directory is the volume's subfolder the ConfigMap names, on the claim's mount.
    assert (host_run.root(storage[0]) / "var/lib/waltz/storage/waltz-storage.ctl").exists()
