"""The low-level API: a tenant's own training algorithm, call by call (Tinker's shape).

```python
service = await ServiceClient.connect(tenant="alice")          # the local stack's alice
training = await service.create_training_client(
    head=HeadSpec(kind="oft", action_dim=2, proprio_dim=4), backbone="tiny"
)
fb = training.forward_backward(batch)        # a future, at once: calls pipeline
opt = training.optim_step(AdamParams(learning_rate=1e-3))
print((await fb).loss, (await opt).metrics["grad_norm"])
sampling = await training.save_weights_and_get_sampling_client("iter-1")
actions = await sampling.act([observation([image], "reach the target", proprio)])
await training.close()
```

A :class:`TrainingClient` is a *session* on the trainer (a job of kind ``session``): a slot
with the tenant's action module and AdamW state beside the shared frozen backbone. Each call
is numbered as it is made and sent at once (several in flight); the trainer applies a
session's calls strictly in that order, each exactly once, also across a trainer crash, and a
``forward_backward`` shares the round's grouped backbone forward with other tenants' work.
Every call returns an :class:`asyncio.Future` of its :class:`CallOutput`; a call the trainer
could not apply fails its future with :class:`CallError` (``retryable``: sending the same
work again as a new call may succeed), and the session goes on.

The session has a lease (``lease_s``): the client renews it while open; a client that goes
away for longer has its session closed by the master (its saved states remain, and a new
session can start from one with ``init_from``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from nats.errors import Error as NatsError

from bus.codec import DecodeError, decode, encode
from clients.calls import AdamParams, CallError, CallOutput, SessionClosed, VLABatch
from clients.errors import RequestError
from clients.follow import EventFollower
from clients.sampling import SampleOutput, SamplingClient
from clients.sdk import Client
from schemas.events import EVENT_DECODER, CallResult, Rejected, StateChanged
from schemas.jobs import TERMINAL_STATUSES
from schemas.specs import HeadSpec, OptimizerSpec, SessionSpec
from schemas.tenantctl import CallSession, Leased, RenewLease
from schemas.tensor import Tensor
from schemas.train import (
    ForwardBackward,
    LoadState,
    LossFn,
    OptimStep,
    SaveState,
    SessionCall,
)

log = logging.getLogger(__name__)

__all__ = [
    "AdamParams",
    "CallError",
    "CallOutput",
    "SampleOutput",
    "SamplingClient",
    "ServiceClient",
    "SessionClosed",
    "TrainingClient",
    "VLABatch",
]

#: Requests a client has in flight to the master at most (the master serves 16 per tenant).
MAX_SENDING = 8
#: Calls out without an answer at most (well under the trainer's per-tenant buffer, so the
#: calls waiting there for a retried earlier one can never crowd it out).
MAX_UNANSWERED = 64
#: How long a call may take to be queued (retrying while the master is away).
SEND_DEADLINE_S = 60.0
#: Bytes of ``max_payload`` a call leaves for headers: the request's (trace context) and
#: those the master adds when it queues the call (message id, job id, trace context).
CALL_HEADER_ROOM = 1024
#: How long opening a session may take (the trainer commits its first version first).
OPEN_TIMEOUT_S = 60.0


def _tensor(a: np.ndarray, dtype: type[np.generic]) -> Tensor:
    return Tensor.from_numpy(np.ascontiguousarray(a, dtype=dtype))


class ServiceClient:
    """Entry point: creates training sessions and sampling clients for one tenant."""

    def __init__(self, client: Client, tenant: str) -> None:
        self.client = client
        self.tenant = tenant
        #: Sessions opened through this client, closed with it.
        self._sessions: weakref.WeakSet[TrainingClient] = weakref.WeakSet()

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        *,
        tenant: str,
        creds: str | Path | None = None,
        home: str | Path | None = None,
        **kw: Any,
    ) -> ServiceClient:
        """Connect as ``tenant`` (to ``url``, or the local stack under ``home``; see
        :meth:`clients.sdk.Client.connect`)."""
        client = await Client.connect(url, creds=creds, home=home, tenant=tenant, **kw)
        return cls(client, tenant)

    async def close(self, timeout: float = 10.0) -> None:
        """Close the sessions still open (their pending calls fail with
        :class:`SessionClosed`; their slots are freed at once, not when their leases run
        out), then the connection."""
        sessions = [s for s in self._sessions if not s.closing]
        if sessions:
            await asyncio.gather(*(s.close("its service client closed", timeout) for s in sessions))
        await self.client.close()

    async def create_training_client(
        self,
        *,
        head: HeadSpec | Mapping[str, Any],
        backbone: str = "tiny",
        optimizer: OptimizerSpec | Mapping[str, Any] | None = None,
        seed: int = 0,
        num_views: int = 1,
        token_budget: int = 16,
        lease_s: float = 300.0,
        checkpoint_every: int = 20,
        priority: int = 1,
        init_from: str | None = None,
        session_id: str | None = None,
        timeout: float = OPEN_TIMEOUT_S,
    ) -> TrainingClient:
        """Open a session (a slot for ``head`` on ``backbone``'s trainer, optionally starting
        from job ``init_from``'s policy) and return its client once the slot is open.
        Raises :class:`schemas.specs.JobSpecError` naming a bad field, and
        :class:`SessionClosed` if the master refuses the session."""
        spec = SessionSpec.model_validate(
            {
                "kind": "session",
                "tenant": self.tenant,
                "backbone": backbone,
                "head": head if isinstance(head, Mapping) else head.model_dump(),
                "optimizer": (
                    {}
                    if optimizer is None
                    else optimizer
                    if isinstance(optimizer, Mapping)
                    else optimizer.model_dump()
                ),
                "seed": seed,
                "num_views": num_views,
                "token_budget": token_budget,
                "lease_s": lease_s,
                "checkpoint_every": checkpoint_every,
                "priority": priority,
                "init_from": init_from,
            }
        )
        job = await self.client.submit(
            spec, job_id=session_id or f"session-{uuid.uuid4().hex[:12]}"
        )
        training = TrainingClient(self, job.job_id, spec)
        await training._open(timeout)
        self._sessions.add(training)
        return training

    def create_sampling_client(self, policy: str, version: int = 0) -> SamplingClient:
        """Sampling from a committed version of the tenant's job or session ``policy``
        (``version`` 0: its latest at each call)."""
        return SamplingClient(self, policy, version)


class TrainingClient:
    """One open session: calls numbered in the order they are made; see the module doc."""

    def __init__(self, service: ServiceClient, session_id: str, spec: SessionSpec) -> None:
        self.service = service
        self.client = service.client
        self.tenant = service.tenant
        self.session_id = session_id
        self.spec = spec
        self.next_call = 0
        self._waiting: dict[int, asyncio.Future[CallOutput]] = {}
        self._sending = asyncio.Semaphore(MAX_SENDING)
        self._window = asyncio.Semaphore(MAX_UNANSWERED)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed: SessionClosed | None = None
        self._follower: asyncio.Task[None] | None = None
        self._lease: asyncio.Task[None] | None = None
        self._opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last_sent = 0.0
        #: Set when the session's terminal state (or rejection) arrives.
        self._ended = asyncio.Event()
        #: :meth:`close` was called (its service client's close leaves it alone then).
        self.closing = False

    # -- lifecycle ---------------------------------------------------------------------------
    async def _open(self, timeout: float) -> None:
        self._follower = asyncio.create_task(self._follow())
        try:
            await asyncio.wait_for(asyncio.shield(self._opened), timeout)
        except TimeoutError:
            await self._stop_tasks()
            # Nobody will use the session: closed now, not when its lease runs out (its
            # trainer slot held until then).
            with contextlib.suppress(RequestError, NatsError):
                reason = f"not open within {timeout:g}s of its client's request"
                await self.client.cancel(self.tenant, self.session_id, reason)
            raise
        except BaseException:
            await self._stop_tasks()
            raise
        self._lease = asyncio.create_task(self._renew())

    async def close(self, reason: str = "closed by its client", timeout: float = 10.0) -> None:
        """End the session (its saved states and versions remain) and wait, at most
        ``timeout``, until the master has closed it; pending calls fail with
        :class:`SessionClosed`."""
        self.closing = True
        if not self._ended.is_set():
            try:
                await self.client.cancel(self.tenant, self.session_id, reason)
            except (RequestError, NatsError) as exc:  # the lease ends it then
                log.warning("session %s: close not queued (%s)", self.session_id, exc)
            if self._follower is not None and not self._follower.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._ended.wait(), timeout)
        closed = SessionClosed(f"session {self.session_id}: {reason}", call=-1, retryable=False)
        self._fail_all(closed)
        await self._stop_tasks()

    async def __aenter__(self) -> TrainingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _stop_tasks(self) -> None:
        for task in (self._follower, self._lease, *self._tasks):
            if task is not None:
                task.cancel()
        for task in (self._follower, self._lease, *self._tasks):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # -- calls -------------------------------------------------------------------------------
    def forward_backward(
        self,
        batch: VLABatch,
        loss_fn: LossFn = "default",
        *,
        clip: float = 0.2,
    ) -> asyncio.Future[CallOutput]:
        """The loss of ``batch`` and its gradients, added to those accumulated since the last
        ``optim_step``. ``loss_fn``: ``default`` (the head's supervised loss against
        ``batch.actions``) or ``ppo`` (clipped surrogate over ``batch.advantages``)."""
        return self._forward(batch, True, loss_fn, clip)

    def forward(
        self, batch: VLABatch, loss_fn: LossFn = "default", *, clip: float = 0.2
    ) -> asyncio.Future[CallOutput]:
        """The loss of ``batch`` only: nothing in the session changes."""
        return self._forward(batch, False, loss_fn, clip)

    def _forward(
        self, batch: VLABatch, backward: bool, loss_fn: LossFn, clip: float
    ) -> asyncio.Future[CallOutput]:
        if loss_fn == "ppo" and batch.advantages is None:
            raise ValueError("advantages: loss_fn 'ppo' needs batch.advantages")
        n = self._number()
        return self._send(
            ForwardBackward(
                self.tenant,
                self.session_id,
                n,
                _tensor(batch.images, np.uint8),
                list(batch.instructions),
                _tensor(batch.proprio, np.float32),
                _tensor(batch.actions, np.float32),
                backward=backward,
                loss_fn=loss_fn,
                advantages=None
                if batch.advantages is None
                else _tensor(batch.advantages, np.float32),
                old_log_probs=None
                if batch.old_log_probs is None
                else _tensor(batch.old_log_probs, np.float32),
                clip=clip,
            )
        )

    def optim_step(self, params: AdamParams | None = None) -> asyncio.Future[CallOutput]:
        """One AdamW update from the accumulated gradients (then cleared)."""
        p = params or AdamParams()
        n = self._number()
        return self._send(
            OptimStep(
                self.tenant,
                self.session_id,
                n,
                p.learning_rate,
                p.beta1,
                p.beta2,
                p.eps,
                p.weight_decay,
                p.grad_clip,
            )
        )

    def save_state(self, name: str) -> asyncio.Future[CallOutput]:
        """Commit the session's state (weights, AdamW moments, step) as a new policy version
        kept under ``name`` (once per name); the output's ``version`` is its number."""
        return self._send(SaveState(self.tenant, self.session_id, self._number(), name))

    def save_weights_for_sampler(self, name: str) -> asyncio.Future[CallOutput]:
        """:meth:`save_state` for sampling: its ``version`` is what a sampling client of
        this session serves."""
        return self._send(
            SaveState(self.tenant, self.session_id, self._number(), name, for_sampler=True)
        )

    def load_state(self, name: str, *, optimizer: bool = True) -> asyncio.Future[CallOutput]:
        """Reset the session to the state saved under ``name`` (with ``optimizer``: its
        AdamW moments and step count too); accumulated gradients are dropped."""
        return self._send(LoadState(self.tenant, self.session_id, self._number(), name, optimizer))

    async def save_weights_and_get_sampling_client(self, name: str) -> SamplingClient:
        """Save for the sampler, then a sampling client of exactly that version."""
        saved = await self.save_weights_for_sampler(name)
        return SamplingClient(self.service, self.session_id, saved.version)

    def _number(self) -> int:
        """The next call's number (taken by :meth:`_send` once the call is accepted)."""
        if self._closed is not None:
            raise self._closed
        return self.next_call

    def _send(self, call: SessionCall) -> asyncio.Future[CallOutput]:
        """Number the call, send it in the background and return its future. A call too big
        for one message is refused here, before it takes a number (a number never sent
        would hold up every later call)."""
        assert call.call == self.next_call
        size = len(encode(CallSession(self.tenant, self.session_id, call)))
        # Room for the headers of the request and of the master's publish onto TRAIN.
        limit = self.client.nc.max_payload - CALL_HEADER_ROOM
        if size > limit:
            raise ValueError(
                f"call of {size} bytes is over {limit} (the server's max_payload less "
                f"{CALL_HEADER_ROOM} for headers): send the batch in smaller pieces "
                "(forward_backward accumulates)"
            )
        self.next_call += 1
        future: asyncio.Future[CallOutput] = asyncio.get_running_loop().create_future()
        self._waiting[call.call] = future
        task = asyncio.create_task(self._deliver(call, future))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # The caller may stop waiting for its answer (cancel what it holds, as
        # ``asyncio.wait_for`` does on a timeout); the call is still sent and answered, since
        # its number is taken and every later call waits for it.
        return asyncio.shield(future)

    async def _deliver(self, call: SessionCall, future: asyncio.Future[CallOutput]) -> None:
        """Queue the call with the master, asking again while it is busy or away. At most
        :data:`MAX_UNANSWERED` calls are out unanswered (the trainer buffers a bounded number
        of calls that wait for an earlier one). A call that cannot be queued leaves a gap no
        later call can pass: the session is closed."""
        await self._window.acquire()
        future.add_done_callback(lambda _: self._window.release())
        if future.done():  # failed meanwhile (the session closed)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SEND_DEADLINE_S
        delay = 0.05
        async with self._sending:
            while True:
                try:
                    await self.client.request(
                        self.tenant, CallSession(self.tenant, self.session_id, call)
                    )
                    self._last_sent = loop.time()
                    return
                except RequestError as exc:
                    if not exc.retryable or loop.time() + delay > deadline:
                        problem = str(exc)
                        break
                except NatsError as exc:  # the connection is closed or refused the message
                    problem = f"{type(exc).__name__}: {exc}"
                    break
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
        error = SessionClosed(
            f"call {call.call} could not be queued ({problem}); the session cannot go on "
            "without it",
            call=call.call,
            retryable=False,
        )
        with contextlib.suppress(RequestError, NatsError):
            await self.client.cancel(self.tenant, self.session_id, str(error))
        self._fail_all(error)

    def _fail_all(self, error: SessionClosed) -> None:
        self._closed = self._closed or error
        if not self._opened.done():
            self._opened.set_exception(error)
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error)
        self._waiting.clear()

    async def _renew(self) -> None:
        """Renew the lease while no call does (a third of ``lease_s`` without one)."""
        loop = asyncio.get_running_loop()
        every = self.spec.lease_s / 3
        while self._closed is None:
            await asyncio.sleep(max(0.1, every - (loop.time() - self._last_sent)))
            if loop.time() - self._last_sent < every:
                continue
            try:
                reply = await self.client.request(
                    self.tenant, RenewLease(self.tenant, self.session_id)
                )
                assert isinstance(reply, Leased)
                self._last_sent = loop.time()
            except RequestError as exc:
                if not exc.retryable:
                    self._fail_all(SessionClosed(str(exc), call=-1, retryable=False))
                    return
            except NatsError as exc:  # the connection is away: try again next time
                if self.client.nc.is_closed:
                    return  # closed for good (the follower ends the session's calls)
                log.warning("session %s: lease not renewed (%s)", self.session_id, exc)

    async def _follow(self) -> None:
        """The session's events: opens, answers and the end."""
        follower = EventFollower(
            self.client.nc, self.client.read_events, self.tenant, self.session_id, poll_s=2.0
        )
        try:
            while True:
                try:
                    stored = await follower.next(3600.0)
                except TimeoutError:
                    continue
                except RequestError as exc:
                    if not exc.retryable:  # e.g. the tenant revoked: no answer can come
                        reason = f"session {self.session_id}: events unreadable: {exc}"
                        self._fail_all(SessionClosed(reason, call=-1, retryable=False))
                        self._ended.set()
                        return
                    log.warning("session %s: events unreadable (%s)", self.session_id, exc)
                    await asyncio.sleep(1.0)
                    continue
                except NatsError as exc:
                    if self.client.nc.is_closed:  # closed for good: no answer can come
                        reason = f"session {self.session_id}: its connection closed"
                        self._fail_all(SessionClosed(reason, call=-1, retryable=False))
                        self._ended.set()
                        return
                    log.warning("session %s: events unreadable (%s)", self.session_id, exc)
                    await asyncio.sleep(1.0)
                    continue
                try:
                    event = decode(EVENT_DECODER, stored.data)
                except DecodeError as exc:  # not one of ours (a newer kind): not for a call
                    log.warning("session %s: an event skipped: %s", self.session_id, exc)
                    continue
                match event:
                    case CallResult():
                        self._answer(event)
                    case StateChanged(status="running"):
                        if not self._opened.done():
                            self._opened.set_result(None)
                    case StateChanged() if event.status in TERMINAL_STATUSES:
                        reason = f"session {self.session_id} {event.status}: {event.reason}"
                        self._fail_all(SessionClosed(reason, call=-1, retryable=False))
                        self._ended.set()
                        return
                    case Rejected():
                        self._ended.set()
                        self._fail_all(
                            SessionClosed(
                                f"session {self.session_id} rejected: {event.reason}",
                                call=-1,
                                retryable=False,
                            )
                        )
                        return
        finally:
            await follower.close()

    def _answer(self, result: CallResult) -> None:
        future = self._waiting.pop(result.call, None)
        if future is None or future.done():
            return  # answered already (a replayed call's answer is published again)
        if result.error:
            future.set_exception(
                CallError(result.error, call=result.call, retryable=result.retryable)
            )
        else:
            future.set_result(
                CallOutput(result.call, result.op, dict(result.metrics), result.version)
            )
