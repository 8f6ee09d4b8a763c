"""A JetStream cluster of embedded servers on loopback (``joynexus up --cluster 3``).

Each node is an :class:`~bus.server.EmbeddedServer` with its own store and log, a client
port and a route port, routed to every other node. Clients get every node's URL
(:attr:`LocalCluster.url`, comma-separated; :func:`bus.connect.connect` splits it), so a
client whose node dies reconnects to another. Streams, KV buckets and object stores are
declared with 3 replicas (``JOYNEXUS_REPLICAS``): a write is acknowledged once a majority
of the nodes holds it, so losing any one node loses nothing acknowledged, and a node started
again on its store catches up from the others.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

from nats.errors import Error as NatsError

from bus.connect import connect
from bus.server import EmbeddedServer, Route, ServerError, free_port


class LocalCluster:
    """``len(store_dirs)`` routed nats-server processes; node ``i`` keeps ``store_dirs[i]``
    and logs to ``log_files[i]``."""

    def __init__(
        self,
        store_dirs: Sequence[Path],
        log_files: Sequence[Path],
        *,
        user: str | None = None,
        password: str | None = None,
        auth: str | None = None,
        creds: Path | None = None,
    ) -> None:
        if len(store_dirs) < 3 or len(store_dirs) != len(log_files):
            raise ValueError("a cluster needs 3 or more nodes, each with a store and a log")
        route_ports = [free_port() for _ in store_dirs]
        #: How :meth:`wait_jetstream` connects (the operator's creds with ``auth``).
        self.user, self.password, self.creds = user, password, creds
        self.nodes = [
            EmbeddedServer(
                store,
                port=free_port(),
                log_file=log,
                user=user,
                password=password,
                auth=auth,
                route=Route(
                    f"node-{i + 1}",
                    route_ports[i],
                    tuple(p for j, p in enumerate(route_ports) if j != i),
                ),
            )
            for i, (store, log) in enumerate(zip(store_dirs, log_files, strict=True))
        ]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated (what clients connect with)."""
        return ",".join(node.url for node in self.nodes)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        """Start every node, then wait until JetStream answers (a meta leader is elected)."""
        for node in self.nodes:
            node.start()
        asyncio.run(self.wait_jetstream(timeout))
        return self

    async def wait_jetstream(self, timeout: float = 30.0) -> None:
        """Until the cluster's JetStream API answers through any node."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                nc = await connect(
                    self.url,
                    creds=self.creds,
                    user=self.user,
                    password=self.password,
                    max_reconnect_attempts=1,
                )
            except (NatsError, OSError, TimeoutError) as exc:
                last = exc
                await asyncio.sleep(0.2)
                continue
            try:
                await nc.jetstream().account_info()
                return
            except (NatsError, TimeoutError) as exc:
                last = exc  # no meta leader yet
                await asyncio.sleep(0.2)
            finally:
                await nc.close()
        raise ServerError(f"the cluster's JetStream did not answer within {timeout}s: {last}")

    def kill(self, index: int) -> None:
        """SIGKILL node ``index``, as a crash would."""
        self.nodes[index].kill()

    def restart(self, index: int) -> None:
        """Start node ``index`` again on its port and store: it rejoins and catches up."""
        self.nodes[index].restart()

    def reload(self, auth: str | None = None) -> None:
        for node in self.nodes:
            node.reload(auth)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
