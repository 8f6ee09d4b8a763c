"""The one consume runtime: binds durables, fetches, and alone decides every message's fate.

Every role consumes through a :class:`Consumer`. It serves three shapes:

* a plain loop, one message at a time (master, health) — :meth:`Consumer.run`;
* a concurrent handler pool (env workers) — :meth:`Consumer.run` with ``concurrency > 1``;
* a scheduler that prefetches from a set of durables and picks what to apply itself (the
  trainer's per-tenant consumers, the inferencer's batcher) — :class:`bus.durables.DurableSet`,
  :meth:`Consumer.fetch` and :meth:`Consumer.process`.

Fate rules (DESIGN.md §2), decided in :meth:`Consumer.settle` and nowhere else:

* handler returned None → ``ack``;
* handler returned :data:`~bus.fate.HOLD` → the effect is not durable yet: the message is kept alive
  with in-progress acks until the owner calls :meth:`Consumer.release` (after its commit);
* :class:`~bus.errors.Interrupted` (the service is stopping) → ``nak`` without delay, for
  another instance; the server allows :data:`HAND_BACK_ALLOWANCE` deliveries beyond
  ``max_deliver`` for this (at the very last one it is dead-lettered instead: the server
  would not deliver it again);
* :class:`~bus.errors.HandlerError` with ``retryable`` → ``nak`` with its delay until the
  consumer's ``max_deliver``, then dead-letter;
* ``retryable`` False (poison: bad schema, bad shapes, unknown tenant) → ``term`` + a
  :class:`~schemas.dead.DeadLetter` on ``nexus.dead.<stream>.<tenant>`` + the durable's
  ``on_dead`` hook (which tells the sender);
* any other exception is a bug of ours: retried with backoff (logged with its traceback) and
  dead-lettered at ``max_deliver`` — never silently acked.

Messages being handled or held get in-progress acks every ``ack_wait / 3`` from one ticker
(:meth:`Consumer.keep_alive`), which, like every loop here, ends on the stop event: nothing in
this module stops a task by cancelling it (a cancel can be lost on Python 3.11, PITFALLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError, FetchTimeoutError, NotFoundError

from bus import tracing
from bus.codec import DecodeError
from bus.crashes import CrashLedger, CrashLoopError
from bus.durable import HAND_BACK_ALLOWANCE, ConsumerSpec, DeadHook, Durable, config_differs
from bus.errors import HandlerError, Interrupted
from bus.fate import Fate, Handler, Hold, dead_letter, error_reason, retry_decision

log = logging.getLogger(__name__)
#: Where the stream's deliveries name their acks: every message a pull consumer fetches.
JS_ACK_PREFIX = "$JS.ACK."

#: How long a stopping pool waits for its running handlers before handing their messages back.
DRAIN_S = 2.0
#: Bound on any single bus call made while stopping (nak, unsubscribe).
STOP_CALL_S = 0.5
#: Bound on dead-lettering what cannot be handed back (a publish, a term and a hook: a
#: message cut short here is lost, so it gets longer than a nak).
DEAD_LETTER_S = 2.0
#: How long after its last fetch returned a pull request of ours may still be answered: the
#: server expires a pull request about when the client's fetch times out, so messages it sent
#: just before land in the subscription after the fetch returned (the next fetch would take
#: them). :meth:`Consumer.close` waits this long, then hands back what landed.
LATE_DELIVERY_S = 0.15
#: At most this many sweeps for late deliveries at close.
LATE_SWEEPS = 4


@dataclass
class _Alive:
    msg: Msg
    every_s: float
    last: float


class Consumer:
    """The consume runtime of one service: the only code that acks, naks or terminates.

    ``stop`` is the service's stop event; :meth:`run`, :meth:`keep_alive` and
    :meth:`DurableSet.fill` return soon after it is set (each wait is bounded by a fetch
    timeout), and :meth:`close` hands back whatever was fetched or held and not settled."""

    def __init__(self, js: JetStreamContext, stop: asyncio.Event) -> None:
        self.js = js
        self.stop = stop
        self.durables: dict[str, Durable] = {}
        self._alive: dict[int, _Alive] = {}
        self.crashes = CrashLedger(js)
        #: Messages fetched and not settled yet (what close() hands back).
        self._unsettled: dict[int, Msg] = {}
        #: Messages settled so far, whatever their fate: the service's progress.
        self.settled = 0
        #: What to do once a message is acknowledged (:meth:`when_acked`), by ``id(msg)``.
        self._on_ack: dict[int, tuple[Msg, Callable[[], Awaitable[None]]]] = {}

    # -- binding and fetching ----------------------------------------------------------------
    async def bind(self, spec: ConsumerSpec, on_dead: DeadHook | None = None) -> Durable:
        """Bind ``spec``'s durable, creating it on first use. One left by an older layout or
        an earlier start with other subject filters or delivery settings (ack wait, max
        deliver, max ack pending) is updated to ``spec``'s (the server keeps its position)."""
        try:
            info = await self.js.consumer_info(spec.stream, spec.durable)
            differs = config_differs(info.config, spec.config())
            if differs:
                log.info("consumer %s: updating %s", spec.durable, ", ".join(differs))
                await self.js.add_consumer(spec.stream, spec.config())  # create-or-update
        except NotFoundError:
            try:
                await self.js.add_consumer(spec.stream, spec.config())
            except BadRequestError as exc:
                # A work-queue stream refuses overlapping filters, e.g. a consumer left by an
                # older layout: say so instead of a bare API error.
                raise RuntimeError(
                    f"cannot create consumer {spec.durable} on {spec.stream} "
                    f"({exc.description}); remove consumers whose filter overlaps "
                    f"{' '.join(spec.filters)}"
                ) from exc
        sub = await self.js.pull_subscribe_bind(spec.durable, stream=spec.stream)
        durable = Durable(spec, sub, on_dead)
        self.durables[spec.durable] = durable
        return durable

    async def fetch(
        self, durable: Durable, n: int, timeout: float, *, count_crashes: bool = True
    ) -> list[Msg]:
        """Up to ``n`` messages within ``timeout``; [] on timeout, on a broker error (the
        connection reconnects on its own; the caller just tries again) or once stopping.
        Redeliveries are counted in the crash ledger (those past its limit dead-lettered)
        unless ``count_crashes`` is False: the caller counts each when it starts it
        (:meth:`begin_redelivered`)."""
        if n <= 0 or self.stop.is_set():
            return []
        try:
            msgs = await durable.sub.fetch(n, timeout=timeout)
        except (TimeoutError, FetchTimeoutError, NatsTimeoutError):
            return []
        except NatsError as exc:
            log.warning("fetch on %s failed: %s", durable.name, exc)
            await self._pause(min(timeout, 0.2))
            return []
        finally:
            durable.fetched_at = time.monotonic()
        stray = [m for m in msgs if not (m.reply or "").startswith(JS_ACK_PREFIX)]
        if stray:
            # Not delivered by the stream: published into the consumer's inbox by someone
            # else (nothing to ack or settle; reading its metadata would raise).
            log.warning(
                "fetch on %s: dropped %d message(s) no stream delivered", durable.name, len(stray)
            )
            msgs = [m for m in msgs if (m.reply or "").startswith(JS_ACK_PREFIX)]
        for msg in msgs:
            self._unsettled[id(msg)] = msg
        if self.stop.is_set():
            await self.hand_back(msgs)
            return []
        if count_crashes and any(m.metadata.num_delivered > 1 for m in msgs):
            kept = await asyncio.gather(*(self.begin_redelivered(durable, m) for m in msgs))
            msgs = [m for m, keep in zip(msgs, kept, strict=True) if keep]
        return msgs

    async def begin_redelivered(self, durable: Durable, msg: Msg) -> bool:
        """Count ``msg``'s handling as begun (:mod:`bus.crashes`); False when its handling
        died too often in a row, and it was dead-lettered here instead."""
        count = await self.crashes.begin(msg)
        if count <= durable.spec.crash_limit:
            return True
        seq = msg.metadata.sequence.stream
        log.error("%s seq %d: crash loop, dead-lettered", msg.subject, seq)
        error = CrashLoopError(
            f"its handling began {count} times in a row without finishing (delivery "
            f"{msg.metadata.num_delivered}): the process of consumer {durable.name} died "
            "or was killed while handling it; dead-lettered so that the consumer carries on"
        )
        await self.settle(msg, error)
        return False

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)

    @staticmethod
    async def _pause_unbounded(seconds: float) -> None:
        """Sleep ``seconds`` (if positive) even once stopping: used by the stop itself."""
        if seconds > 0:
            await asyncio.sleep(seconds)

    # -- handling ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def span(self, msg: Msg) -> Iterator[object]:
        """The CONSUMER span of handling ``msg`` (continues the sender's trace)."""
        name = f"process {msg.subject}"
        attributes = tracing.messaging_attributes(msg)
        with tracing.consumer_span(name, msg.headers, attributes) as s:
            yield s

    async def process(self, msg: Msg, handler: Handler) -> Fate:
        """Run ``handler`` on ``msg`` inside its span with in-progress acks, then settle it
        (or hold it, if the handler returned :data:`~bus.fate.HOLD`)."""
        durable = self.durables.get(msg.metadata.consumer)
        if durable is not None:
            durable.in_flight += 1
        self._keep(msg)
        error: BaseException | None = None
        held = False
        try:
            with self.span(msg):
                held = isinstance(await handler(msg), Hold)
        except asyncio.CancelledError:
            # Only close() cancels, after handing the message back.
            raise
        except Exception as exc:  # noqa: BLE001 - every exception's fate is decided by settle()
            error = exc
        finally:
            if durable is not None:
                durable.in_flight -= 1
        if held and error is None:
            return Fate.HELD
        return await self.settle(msg, error)

    def hold(self, msg: Msg) -> None:
        """Keep ``msg`` alive (in-progress acks) until it is released or handed back."""
        self._unsettled[id(msg)] = msg
        self._keep(msg)

    def when_acked(self, msg: Msg, then: Callable[[], Awaitable[None]]) -> None:
        """Run ``then`` after ``msg`` is acknowledged (e.g. delete the object it referenced).
        Not after any other fate: a redelivery still needs what it refers to, and a dead
        letter is kept for reading. Its failures are logged, never raised."""
        self._on_ack[id(msg)] = (msg, then)

    async def release(self, msgs: Iterable[Msg], error: BaseException | None = None) -> None:
        """Settle held messages now that their effect is durable (``error`` None: ack)."""
        await asyncio.gather(*(self.settle(m, error) for m in msgs))

    # -- fates -------------------------------------------------------------------------------
    async def settle(self, msg: Msg, error: BaseException | None) -> Fate:
        """Decide and carry out ``msg``'s fate after handling ended with ``error`` (None: ok).
        The only place in the code base that acks, naks or terminates a message. If the broker
        cannot take the decision (it is away), the message is left to be redelivered after its
        ack wait, and decided again then: every handler recognises a replay."""
        self._alive.pop(id(msg), None)
        self._unsettled.pop(id(msg), None)
        after = self._on_ack.pop(id(msg), None)
        self.settled += 1
        try:
            fate = await self._settle(msg, error)
        except (NatsError, TimeoutError) as exc:
            log.warning("could not settle %s (%s); it will be redelivered", msg.subject, exc)
            return Fate.RETRY
        finally:
            await self.crashes.end(msg)
        if fate is Fate.ACKED and after is not None and after[0] is msg:
            try:
                await after[1]()
            except Exception:  # the message is settled: only its hook failed
                log.exception("after-ack hook of %s failed", msg.subject)
        return fate

    async def _settle(self, msg: Msg, error: BaseException | None) -> Fate:
        if error is None:
            await msg.ack()
            return Fate.ACKED
        name = msg.metadata.consumer
        durable = self.durables.get(name)
        max_deliver = durable.spec.max_deliver if durable is not None else 1
        delivered = msg.metadata.num_delivered
        if isinstance(error, Interrupted) and self.can_hand_back(msg):
            # The server would not redeliver a message past its max_deliver: at the last
            # delivery an interrupted message is dead-lettered instead, so it is not lost.
            with contextlib.suppress(NatsError):
                await msg.nak()
            return Fate.HANDED_BACK
        retryable, delay = retry_decision(error, delivered)
        if not isinstance(error, HandlerError | DecodeError):
            log.error(
                "unexpected error handling %s (delivery %d)", msg.subject, delivered, exc_info=error
            )
        if retryable and (max_deliver <= 0 or delivered < max_deliver):
            await msg.nak(delay=delay)
            return Fate.RETRY
        reason = error_reason(error)
        if retryable:
            reason = f"gave up after {delivered} deliveries: {reason}"
        error_type = type(error).__name__
        await dead_letter(self.js, msg, consumer=name, reason=reason, error_type=error_type)
        await msg.term()
        if durable is not None and durable.on_dead is not None:
            try:
                await durable.on_dead(msg, reason, error)
            except Exception:  # telling the sender must not block the consumer
                log.exception("on_dead hook failed for %s", msg.subject)
        return Fate.DEAD

    def is_last_delivery(self, msg: Msg, error: BaseException) -> bool:
        """Whether settling ``msg`` with ``error`` will dead-letter it (no redelivery)."""
        if isinstance(error, Interrupted):
            return not self.can_hand_back(msg)
        max_deliver = self._max_deliver(msg)
        delivered = msg.metadata.num_delivered
        retryable, _ = retry_decision(error, delivered)
        return not retryable or (0 < max_deliver <= delivered)

    def _max_deliver(self, msg: Msg) -> int:
        """The retry budget of ``msg``'s consumer (1 for a consumer not bound here)."""
        durable = self.durables.get(msg.metadata.consumer)
        return durable.spec.max_deliver if durable is not None else 1

    def can_hand_back(self, msg: Msg) -> bool:
        """Whether the server delivers ``msg`` again after one more nak (past its consumer's
        ``max_deliver`` and :data:`HAND_BACK_ALLOWANCE` it would not: the message would be
        lost instead of dead-lettered)."""
        max_deliver = self._max_deliver(msg)
        server_max = max_deliver + HAND_BACK_ALLOWANCE
        return max_deliver <= 0 or msg.metadata.num_delivered < server_max

    def deferrable(self, msg: Msg) -> bool:
        """Whether ``msg`` may be handed back for later (it cannot be handled yet) without
        eating into its retries: while it has used less than half its consumer's
        ``max_deliver`` (a hand-back is a delivery, and the retry budget counts deliveries)."""
        max_deliver = self._max_deliver(msg)
        return max_deliver <= 0 or msg.metadata.num_delivered < max_deliver // 2

    async def hand_back(
        self, msgs: Iterable[Msg], delay_s: float = 0.0, *, still_running: bool = False
    ) -> None:
        """Nak without delay (another instance takes them), or redelivered after ``delay_s``;
        bounded, errors ignored. A message on the last delivery the server allows is
        dead-lettered instead (:meth:`settle` with :class:`~bus.errors.Interrupted`): a nak
        would leave it undelivered for good. ``still_running``: their handling has not
        returned (a stop that could not wait for it), so their starts stay counted in the
        crash ledger (a poison that hangs until a restart is counted like one that kills)."""
        pending = list(msgs)
        last = [m for m in pending if not self.can_hand_back(m)]
        if last:
            pending = [m for m in pending if self.can_hand_back(m)]
            reason = Interrupted("handed back on the last delivery its consumer allows")
            dead = asyncio.gather(*(self.settle(m, reason) for m in last))
            await _bounded(dead, DEAD_LETTER_S)
        for msg in pending:
            self._alive.pop(id(msg), None)
            self._unsettled.pop(id(msg), None)
            self._on_ack.pop(id(msg), None)
        if pending:
            # The ledger first: once nak'ed, another instance may count its own start.
            ledger = (self.crashes.handed_back(m, still_running=still_running) for m in pending)
            await _bounded(asyncio.gather(*ledger))
            delay = delay_s or None
            naks = (m.nak(delay=delay) for m in pending)
            await _bounded(asyncio.gather(*naks, return_exceptions=True))

    # -- keep-alive --------------------------------------------------------------------------
    def _keep(self, msg: Msg) -> None:
        durable = self.durables.get(msg.metadata.consumer)
        ack_wait = durable.spec.ack_wait_s if durable is not None else 30.0
        self._alive[id(msg)] = _Alive(msg, max(0.3, ack_wait / 3), time.monotonic())

    async def keep_alive(self) -> None:
        """In-progress acks for messages being handled or held; returns on stop."""
        while not self.stop.is_set():
            now = time.monotonic()
            due = [a for a in self._alive.values() if now - a.last >= a.every_s]
            for alive in due:
                alive.last = now
            if due:
                await asyncio.gather(*(a.msg.in_progress() for a in due), return_exceptions=True)
            every = min((a.every_s for a in self._alive.values()), default=1.0)
            await self._pause(min(1.0, every / 2))

    # -- loops -------------------------------------------------------------------------------
    async def run(
        self,
        durable: Durable,
        handler: Handler,
        *,
        concurrency: int = 1,
        batch: int = 32,
        fetch_timeout_s: float = 0.5,
    ) -> None:
        """Handle ``durable``'s messages until stop: one at a time, or up to ``concurrency``
        at once (only what can start now is fetched). On stop, running handlers get
        :data:`DRAIN_S` to finish (long ones should watch the stop event and raise
        :class:`~bus.errors.Interrupted`); the messages of those still running are handed
        back."""
        if concurrency == 1:
            while not self.stop.is_set():
                msgs = await self.fetch(durable, 1, fetch_timeout_s)
                for i, msg in enumerate(msgs):
                    if self.stop.is_set():
                        await self.hand_back(msgs[i:])
                        break
                    await self.process(msg, handler)
            return
        # Several at once: a message in flight when the process died before (a suspect:
        # counted in the crash ledger already) waits until nothing else runs, then runs
        # alone, counted only then; so the crash of a poison message stops counting against
        # the innocent ones that shared its process (:mod:`bus.crashes`).
        running: dict[asyncio.Task[Fate], Msg] = {}
        suspects: list[Msg] = []
        alone: asyncio.Task[Fate] | None = None  # a suspect's handling
        while not self.stop.is_set():
            for task in [t for t in running if t.done()]:
                del running[task]
            if alone is not None and not alone.done():
                await asyncio.wait({alone}, timeout=fetch_timeout_s)
                continue
            alone = None
            if suspects:
                if running:
                    await asyncio.wait(
                        running, timeout=fetch_timeout_s, return_when=asyncio.FIRST_COMPLETED
                    )
                    continue
                suspect = suspects.pop(0)
                if await self.begin_redelivered(durable, suspect):
                    alone = asyncio.create_task(self.process(suspect, handler))
                    running[alone] = suspect
                continue
            free = concurrency - len(running)
            if free <= 0:
                await asyncio.wait(
                    running, timeout=fetch_timeout_s, return_when=asyncio.FIRST_COMPLETED
                )
                continue
            msgs = await self.fetch(durable, min(free, batch), fetch_timeout_s, count_crashes=False)
            ready, found = await self.sort_out(durable, msgs)
            suspects += found
            if self.stop.is_set():
                await self.hand_back(ready)
                break
            for msg in ready:
                running[asyncio.create_task(self.process(msg, handler))] = msg
        if suspects:
            await self.hand_back(suspects)
        if running:
            _, still = await asyncio.wait(running, timeout=DRAIN_S)
            if still:
                log.warning("%d handlers still running at stop; handing back", len(still))
                await self.hand_back((running[t] for t in still), still_running=True)
                for task in still:
                    task.cancel()  # their messages are already back; not awaited (see module)

    async def sort_out(self, durable: Durable, msgs: list[Msg]) -> tuple[list[Msg], list[Msg]]:
        """Split messages fetched with ``count_crashes=False`` into those that may start now
        (a redelivery counted now; one past the crash limit dead-lettered) and the suspects:
        in flight when a process died before (counted in the crash ledger already), the least
        counted first. A suspect must run with nothing else in flight, counted only when it
        starts (:meth:`begin_redelivered`), so that only the poison's count climbs
        (:mod:`bus.crashes`); all are kept alive meanwhile."""
        if not msgs:
            return [], []
        for msg in msgs:
            self._keep(msg)  # alive while the ledger is asked and while it waits
        counts = await asyncio.gather(*(self.crashes.peek(m) for m in msgs))
        fresh = [m for m, c in zip(msgs, counts, strict=True) if c == 0]
        # The least counted first: an innocent stays at its count, the poison climbs.
        order = sorted(range(len(msgs)), key=lambda i: counts[i])
        suspects = [msgs[i] for i in order if counts[i]]
        starts = await asyncio.gather(*(self._start_fresh(durable, m) for m in fresh))
        return [m for m, start in zip(fresh, starts, strict=True) if start], suspects

    async def _start_fresh(self, durable: Durable, msg: Msg) -> bool:
        """Whether a message with no crash count may start (a redelivery is counted now)."""
        return msg.metadata.num_delivered == 1 or await self.begin_redelivered(durable, msg)

    async def close(self) -> None:
        """Hand back everything fetched or held and not settled, and what the server sent
        after the last fetch returned; unsubscribe (bounded)."""
        await self.hand_back(list(self._unsettled.values()))
        # A pull request of ours the server still holds (it expires by the server's clock,
        # which a loaded machine puts behind the client's timeout) takes messages, even ones
        # just handed back; they land here. Sweep until a sweep finds none (bounded).
        last_fetch = max((d.fetched_at for d in self.durables.values()), default=0.0)
        await self._pause_unbounded(last_fetch + LATE_DELIVERY_S - time.monotonic())
        for _ in range(LATE_SWEEPS):
            late = [m for d in self.durables.values() for m in d.take_late()]
            if not late:
                break
            log.info("handing back %d messages delivered after the last fetch", len(late))
            await self.hand_back(late)
            await self._pause_unbounded(LATE_DELIVERY_S)
        for durable in self.durables.values():
            await _bounded(durable.sub.unsubscribe())

    def is_unsettled(self, msg: Msg) -> bool:
        """Whether ``msg`` was fetched and is not settled or handed back yet."""
        return id(msg) in self._unsettled

    def in_flight(self) -> int:
        """Messages fetched and not settled (being handled, buffered or held)."""
        return len(self._unsettled)

    def unsettled(self, durable: str) -> int:
        """Messages of ``durable`` fetched and not settled."""
        return sum(1 for m in self._unsettled.values() if m.metadata.consumer == durable)


async def _bounded(awaitable: Awaitable[object], seconds: float = STOP_CALL_S) -> None:
    try:
        await asyncio.wait_for(awaitable, seconds)
    except (TimeoutError, NatsError, OSError) as exc:
        log.debug("bounded call at stop did not finish: %r", exc)
