"""The local stack: an embedded NATS server and every role as a supervised child process.

``joynexus up`` runs :func:`run_stack`; ``joynexus up --check`` runs :func:`check_stack`;
what other commands do to a running stack is :mod:`services.stackops`.
Children get the bus URL and credentials through ``JOYNEXUS_*`` variables (their typed
config reads them): with auth (the default) the service identity's creds file
(``JOYNEXUS_CREDS``), no password anywhere; their logs go to ``<home>/logs/<role>.log``. A
child that exits unexpectedly is restarted in place with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bus import tenantadmin
from bus.auth import load_registry, render
from bus.cluster import LocalCluster
from bus.identity import OPERATOR_NAME, SERVICE_NAME
from bus.local import StackInfo, write_stack_info
from bus.server import EmbeddedServer
from schemas.health import ROLES
from schemas.ids import validate_id
from services.stackops import PER_BACKBONE, declare_layout, wait_healthy

log = logging.getLogger("joynexus.up")

#: Roles that take their features from the backbone role with ``--backbone-service``.
HEAD_ONLY = ("trainer", "inferencer")
#: Tiny names :meth:`vla.backbone.Backbone.load` builds in-process (no checkpoint directory).
TINY_PREFIX = "tiny"
#: Tenants whose identities ``joynexus up`` creates (if missing): the demo's.
DEMO_TENANTS = ("acme-arm", "beta-gripper", "gamma-flow")


@dataclass(frozen=True)
class ServedBackbone:
    """One backbone the stack serves: its id and what the trainer/inferencer load."""

    backbone_id: str
    source: str


def backbone_of(arg: str) -> ServedBackbone:
    """``--backbone`` value -> what to serve: ``ID=DIR`` names it; a checkpoint directory is
    named after itself (as :meth:`vla.backbone.Backbone.load` names it); a tiny name is its
    own id. Raises ValueError naming the value when it is neither."""
    named, _, rest = arg.partition("=")
    source = rest if rest else arg
    path = Path(source).expanduser()
    if path.is_dir():
        source = str(path.resolve())
        default = re.sub(r"[^a-z0-9-]+", "-", path.resolve().name.lower()).strip("-")[:64]
    elif source.startswith(TINY_PREFIX) and "/" not in source:
        default = source
    else:
        raise ValueError(f"--backbone {arg!r}: neither a checkpoint directory nor a tiny name")
    backbone_id = (named if rest else default).strip("-") or "backbone"
    return ServedBackbone(validate_id(backbone_id, "backbone id"), source)


@dataclass
class Child:
    """One supervised role process."""

    role: str
    name: str
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    last_start: float = 0.0
    #: Stopped on purpose (scaled down): not restarted.
    retired: bool = False
    #: The backbone id it serves (trainer and inferencer only).
    backbone: str = ""
    #: Its Prometheus endpoint's port (0: none), kept across its restarts.
    metrics_port: int = 0


#: The highest TCP port.
MAX_PORT = 65535


class StackConfigError(ValueError):
    """A ``joynexus up`` setting that cannot work, found before anything starts."""


@dataclass
class LocalStack:
    """Embedded NATS + role processes under ``home``."""

    home: Path
    roles: dict[str, int] = field(default_factory=lambda: {r: 1 for r in ROLES})
    extra_env: dict[str, str] = field(default_factory=dict)
    role_args: dict[str, list[str]] = field(default_factory=dict)
    #: What the trainers and inferencers serve, one process of each per backbone.
    backbones: list[ServedBackbone] = field(
        default_factory=lambda: [ServedBackbone("tiny", "tiny")]
    )
    server: EmbeddedServer | None = None
    children: list[Child] = field(default_factory=list)
    info: StackInfo | None = None
    #: Per-identity NKey auth (``joynexus up``'s default); False = the open mode's one
    #: generated user/password (``--no-auth``).
    auth: bool = True
    #: Tenants given identities at start (existing ones are kept).
    tenants: tuple[str, ...] = DEMO_TENANTS
    #: Run the backbone role (one per backbone) and trainers/inferencers holding only heads.
    backbone_service: bool = False
    #: JetStream nodes: 1 (one server), or a loopback cluster of 3+ with everything at 3
    #: replicas (:mod:`bus.cluster`).
    cluster: int = 1
    nodes: LocalCluster | None = None
    #: Every role appends its finished spans to this JSON-lines file (``--trace-file``).
    trace_file: Path | None = None
    #: Each role process serves Prometheus metrics on its own port from this one up
    #: (``--metrics-port``; 0: none).
    metrics_port: int = 0
    _ports_given: int = 0

    def __post_init__(self) -> None:
        if self.backbone_service and "backbone" not in self.roles:
            self.roles = {**self.roles, "backbone": 1}
        if self.metrics_port:
            processes = sum(n * len(self.groups(role)) for role, n in self.roles.items())
            last = self.metrics_port + processes - 1
            if self.metrics_port < 1 or last > MAX_PORT:
                # Checked before anything starts: a role given a port past it exits at
                # start, and its supervisor would restart it for ever.
                raise StackConfigError(
                    f"--metrics-port {self.metrics_port}: the {processes} role processes "
                    f"take ports {self.metrics_port}..{last}, which must be within "
                    f"1..{MAX_PORT} (0: no metrics)"
                )

    @property
    def expected_roles(self) -> list[str]:
        """The roles a healthy stack runs."""
        return [*ROLES, *(["backbone"] if self.backbone_service else [])]

    @property
    def replicas(self) -> int:
        return 3 if self.cluster > 1 else 1

    def start_server(self) -> StackInfo:
        self.home.mkdir(parents=True, exist_ok=True)
        store, log_file = tenantadmin.server_dir(self.home), self.home / tenantadmin.SERVER_LOG
        user = password = auth = None
        if self.auth:
            tenantadmin.init_home(self.home)
            for tenant in self.tenants:
                tenantadmin.ensure_tenant(self.home, tenant)
            auth = render(load_registry(self.home))
        else:
            user, password = "joynexus", secrets.token_urlsafe(18)
        if self.cluster > 1:
            creds = tenantadmin.creds_path(tenantadmin.creds_dir(self.home), OPERATOR_NAME)
            self.nodes = LocalCluster(
                tenantadmin.node_dirs(self.home, self.cluster),
                tenantadmin.node_logs(self.home, self.cluster),
                user=user,
                password=password,
                auth=auth,
                creds=creds if self.auth else None,
            ).start()
            url = self.nodes.url
        else:
            self.server = EmbeddedServer(
                store, log_file=log_file, user=user, password=password, auth=auth
            ).start()
            url = self.server.url
        if self.auth:
            creds_dir = str(tenantadmin.creds_dir(self.home).resolve())
            self.info = StackInfo(
                url,
                os.getpid(),
                auth=True,
                creds_dir=creds_dir,
                replicas=self.replicas,
                trace_file=self.trace_path,
            )
        else:
            self.info = StackInfo(
                url,
                os.getpid(),
                user=user or "",
                password=password or "",
                replicas=self.replicas,
                trace_file=self.trace_path,
            )
        # Declare before announcing: a client that finds the stack file can submit at once.
        asyncio.run(declare_layout(self.info, self.home))
        write_stack_info(self.home, self.info)
        return self.info

    @property
    def trace_path(self) -> str:
        return str(self.trace_file.resolve()) if self.trace_file is not None else ""

    def child_env(self) -> dict[str, str]:
        assert self.info is not None
        env = dict(os.environ)
        # An operator's own credentials in this shell are not the roles' to inherit.
        for name in ("JOYNEXUS_CREDS", "JOYNEXUS_USER", "JOYNEXUS_PASSWORD"):
            env.pop(name, None)
        service_creds = self.info.creds(SERVICE_NAME)
        if service_creds is not None:
            env["JOYNEXUS_CREDS"] = str(service_creds)
        else:
            env.update(JOYNEXUS_USER=self.info.user, JOYNEXUS_PASSWORD=self.info.password)
        env.update(
            JOYNEXUS_URL=self.info.url,
            JOYNEXUS_HOME=str(self.home.resolve()),
            HF_HUB_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        env["JOYNEXUS_REPLICAS"] = str(self.info.replicas)
        if self.trace_file is not None:
            env["JOYNEXUS_TRACE_FILE"] = self.trace_path
        # ManiSkill fixes its asset directory from MS_ASSET_DIR at import, so the env worker
        # gets it here, in its environment (nothing sets it in a running process); an
        # operator's own MS_ASSET_DIR wins.
        env.setdefault("MS_ASSET_DIR", str(self.home.resolve() / "maniskill"))
        env.update(self.extra_env)
        return env

    def spawn(self, child: Child) -> None:
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{child.name}.log", "ab") as out:
            env = self.child_env()
            if child.metrics_port:
                env["JOYNEXUS_METRICS_PORT"] = str(child.metrics_port)
            child.proc = subprocess.Popen(
                [sys.executable, "-m", f"services.{child.role}", *child.args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        child.last_start = time.monotonic()

    def args_of(self, role: str, backbone: ServedBackbone | None) -> list[str]:
        """A child's flags: the role's own, then what it serves (the backbone it loads, or the
        ids of every served backbone for the master and env workers)."""
        args = list(self.role_args.get(role, []))
        if self.backbone_service and role in HEAD_ONLY:
            args.append("--backbone-service")
        if backbone is not None:
            return [*args, "--backbone", backbone.source, "--backbone-id", backbone.backbone_id]
        if role in ("master", "envs"):
            return [*args, "--backbones", ",".join(b.backbone_id for b in self.backbones)]
        return args

    def groups(self, role: str) -> list[ServedBackbone | None]:
        return list(self.backbones) if role in PER_BACKBONE else [None]

    def base_name(self, role: str, backbone: ServedBackbone | None) -> str:
        """``trainer`` with one backbone, ``trainer-<id>`` with several (its log's name)."""
        if backbone is not None and len(self.backbones) > 1:
            return f"{role}-{backbone.backbone_id}"
        return role

    def new_child(self, role: str, backbone: ServedBackbone | None, name: str) -> Child:
        child = Child(role, name, self.args_of(role, backbone))
        child.backbone = backbone.backbone_id if backbone else ""
        if self.metrics_port:
            child.metrics_port = self.metrics_port + self._ports_given
            self._ports_given += 1
        return child

    def start_roles(self) -> None:
        for role, count in self.roles.items():
            for backbone in self.groups(role):
                base = self.base_name(role, backbone)
                for i in range(count):
                    child = self.new_child(role, backbone, base if count == 1 else f"{base}-{i}")
                    self.spawn(child)
                    self.children.append(child)

    def supervise_once(self) -> list[str]:
        """Restart children that exited; return the names restarted."""
        restarted = []
        for child in self.children:
            if child.retired:
                continue
            if child.proc is not None and child.proc.poll() is not None:
                backoff = min(10.0, 0.5 * 2**child.restarts)
                if time.monotonic() - child.last_start < backoff:
                    continue
                log.warning("%s exited with %s; restarting", child.name, child.proc.returncode)
                child.restarts += 1
                self.spawn(child)
                restarted.append(child.name)
        if restarted:  # processes.json names the live pids, not the dead ones
            self.write_process_table()
        return restarted

    def start(self, timeout: float = 180.0) -> StackInfo:
        """Start the server and the roles and wait until every role it runs heartbeats;
        SystemExit naming the roles that did not, and where their logs are."""
        info = self.start_server()
        self.start_roles()
        running = [role for role, count in self.roles.items() if count > 0]
        _, missing = asyncio.run(wait_healthy(info, running, timeout))
        if missing:
            raise SystemExit(f"roles did not come up: {missing}; see {self.home}/logs")
        return info

    @contextlib.contextmanager
    def supervising(self, every_s: float = 0.2) -> Iterator[None]:
        """Restart what exits (as ``joynexus up`` does: a role the health manager orders to
        restart exits and relies on this) from a thread, while the block runs."""
        stopping = threading.Event()

        def supervise() -> None:
            while not stopping.wait(every_s):
                self.supervise_once()

        thread = threading.Thread(target=supervise, name="supervisor", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stopping.set()
            thread.join(timeout=5)

    def live(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role and not c.retired]

    def scale(self, role: str, count: int) -> None:
        """Run ``count`` processes of ``role`` (per backbone, for a trainer or inferencer):
        start new ones, or SIGTERM the newest extras (they release their in-flight work,
        which other instances then pick up)."""
        for backbone in self.groups(role):
            bid = backbone.backbone_id if backbone else ""
            live = [c for c in self.live(role) if c.backbone == bid]
            base = self.base_name(role, backbone)
            for i in range(len(live), count):
                names = {c.name for c in self.children}
                n = i
                while f"{base}-{n}" in names:
                    n += 1
                child = self.new_child(role, backbone, f"{base}-{n}")
                self.spawn(child)
                self.children.append(child)
            for child in live[count:][::-1]:
                child.retired = True
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
        self.write_process_table()

    def write_process_table(self) -> None:
        table: dict[str, list[int] | int] = {
            role: [c.proc.pid for c in self.live(role) if c.proc is not None]
            for role in {c.role for c in self.children}
        }
        table["per_backbone"] = len(self.backbones)  # trainers/inferencers per scale count
        tmp = self.home / "processes.json.tmp"
        tmp.write_text(json.dumps(table))
        os.replace(tmp, self.home / "processes.json")

    def apply_desired(self) -> None:
        """Apply ``<home>/desired.json`` (written by ``joynexus scale``) if it changed."""
        path = self.home / "desired.json"
        try:
            desired = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return
        for role, count in desired.items():
            if len(self.live(role)) != count * len(self.groups(role)):
                log.info("scaling %s to %d", role, count)
                self.scale(role, int(count))

    def stop(self, timeout: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every child, wait, SIGKILL stragglers, then stop the server."""
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for child in self.children:
            if child.proc is None:
                continue
            try:
                codes[child.name] = child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                codes[child.name] = child.proc.wait()
        if self.server is not None:
            self.server.stop()
        if self.nodes is not None:
            self.nodes.stop()
        return codes


def check_stack(
    home: Path,
    timeout: float = 60.0,
    backbones: list[ServedBackbone] | None = None,
    auth: bool = True,
    backbone_service: bool = False,
    cluster: int = 1,
) -> int:
    """Start the stack, wait for its roles to heartbeat (five, six with the backbone role),
    print them and a JSON summary line, stop everything; exit code 0 only if all are healthy."""
    stack = LocalStack(home, auth=auth, backbone_service=backbone_service, cluster=cluster)
    stack.backbones = backbones or stack.backbones
    roles = stack.expected_roles
    try:
        info = stack.start_server()
        print(f"bus: {info.url}", flush=True)
        stack.start_roles()
        seen, missing = asyncio.run(wait_healthy(info, roles, timeout))
        for role in roles:
            print(f"{role:<11} {'healthy  ' + seen[role] if role in seen else 'MISSING'}")
        print(json.dumps({"healthy": [r for r in roles if r in seen], "missing": missing}))
    finally:
        codes = stack.stop()
    bad_exits = {n: c for n, c in codes.items() if c not in (0, None)}
    if bad_exits:
        print(f"roles that did not stop cleanly: {bad_exits}", file=sys.stderr)
    return 0 if not missing and not bad_exits else 1


def run_stack(
    home: Path,
    roles: dict[str, int] | None = None,
    backbones: list[ServedBackbone] | None = None,
    auth: bool = True,
    backbone_service: bool = False,
    cluster: int = 1,
    trace_file: Path | None = None,
    metrics_port: int = 0,
) -> int:
    """Run the stack until Ctrl-C / SIGTERM; supervise children meanwhile. ``backbones``
    (default: the tiny one) each get their own trainer and inferencer; ``auth`` False runs
    the open mode (one generated password, every client is everyone); ``backbone_service``
    runs the backbone role, the trainers and inferencers then holding only heads;
    ``cluster`` 3+ runs that many JetStream nodes with everything at 3 replicas;
    ``trace_file``, where every role appends its spans (``joynexus trace`` reads them);
    ``metrics_port``, the first of the roles' Prometheus ports (one each, in start order)."""
    stack = LocalStack(
        home,
        roles=roles or {r: 1 for r in ROLES},
        backbones=backbones or [ServedBackbone("tiny", "tiny")],
        auth=auth,
        backbone_service=backbone_service,
        cluster=cluster,
        trace_file=trace_file,
        metrics_port=metrics_port,
    )
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        info = stack.start_server()
        stack.start_roles()
        where = f"creds in {info.creds_dir}" if info.auth else f"credentials in {home}/stack.json"
        print(f"JoyNexus local stack up. bus: {info.url}  ({where})")
        for b in stack.backbones:
            print(
                f"serving backbone {b.backbone_id}  ({b.source}); specs name it "
                f"`backbone: {b.backbone_id}`"
            )
        if trace_file is not None:
            print(f"spans: {stack.trace_path}  (joynexus trace TENANT JOB draws a job's)")
        for child in stack.children:
            if child.metrics_port:
                print(f"metrics of {child.name}: http://127.0.0.1:{child.metrics_port}/metrics")
        print(f"logs: {home}/logs/   stop with Ctrl-C", flush=True)
        (home / "desired.json").unlink(missing_ok=True)
        stack.write_process_table()
        while not stopping:
            stack.supervise_once()
            stack.apply_desired()
            time.sleep(0.2)
    finally:
        print("stopping...", flush=True)
        stack.stop()
        (home / "stack.json").unlink(missing_ok=True)
    return 0
