"""The local stack's home directory: where ``joynexus up`` keeps its store, logs and the
connection file that other commands on this machine read to find the bus."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

DEFAULT_HOME = Path(".joynexus")
STACK_FILE = "stack.json"


class StackInfo(msgspec.Struct, frozen=True):
    """Written by ``joynexus up`` (mode 0600): how to reach the running local stack.

    With ``auth`` (the default of ``joynexus up``) every identity has its own creds file,
    ``<creds_dir>/<name>.creds`` (``operator``, ``service``, each tenant's), and there is no
    shared password; ``user``/``password`` are the open mode's (``--no-auth``)."""

    url: str
    pid: int
    auth: bool = False
    creds_dir: str = ""
    user: str = ""
    password: str = ""
    #: Replicas of every stream, KV bucket and object store: 3 on a cluster
    #: (``joynexus up --cluster 3``), else 1.
    replicas: int = 1
    #: The JSON-lines file every role appends its spans to (``joynexus up --trace-file``);
    #: empty when the stack does not trace. ``joynexus submit`` adds its own spans there.
    trace_file: str = ""

    def creds(self, name: str) -> Path | None:
        """The creds file of identity ``name`` (None in open mode)."""
        return Path(self.creds_dir) / f"{name}.creds" if self.auth else None


def write_stack_info(home: Path, info: StackInfo) -> Path:
    path = Path(home) / STACK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(info))
    tmp.chmod(0o600)
    os.replace(tmp, path)
    return path


def read_stack_info(home: Path) -> StackInfo | None:
    """The stack file under ``home``, or None when no local stack was started there."""
    path = Path(home) / STACK_FILE
    if not path.exists():
        return None
    return msgspec.json.decode(path.read_bytes(), type=StackInfo)
