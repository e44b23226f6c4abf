"""Recording usage so that no request goes unbilled and none is billed twice.

`UsageRecorder.record` inserts one row per request, idempotently (the request id is the primary key). When the
database write fails or times out the event goes to an outbox instead: a Redis stream (`usage:outbox` under the
deployment's prefix) shared by every replica, or an in-process deque in the embedded mode (and as the last resort
when Redis fails too). `drain_once`, run by a background loop in every replica, moves outbox entries into the
database and deletes them only after the insert commits; replicas draining the same entry at once are harmless
because the insert skips request ids already stored.

`record` opens its own session and never raises, so the completions code can run it in a shielded `finally`:
a client that disconnects mid-stream is still billed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import uuid
from dataclasses import MISSING, dataclass, fields
from datetime import datetime
from typing import Any, Protocol, cast

from redis.exceptions import RedisError
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.domain.usage.repository import UsageRepository
from loraplex.platform.ids import TenantId
from loraplex.platform.kv import KeyValueStore, RedisStore
from loraplex.platform.service_tiers import ServiceTier

logger = logging.getLogger(__name__)

OUTBOX_KEY = "usage:outbox"
DEAD_LETTER_KEY = "usage:dead"  # entries the database refuses for good (e.g. their tenant was deleted)


_TIERS = frozenset(tier.value for tier in ServiceTier)

# Column widths of the usage table (models.py).
_MAX_LENGTHS = {
    "request_id": 64,
    "api_key_id": 32,
    "adapter_digest": 80,
    "model": 200,
    "base_model": 200,
    "status": 16,
}


@dataclass(frozen=True)
class UsageEvent:
    """One finished (or failed, or cancelled) request: the columns of its usage row."""

    request_id: str
    tenant_id: TenantId
    api_key_id: str | None
    endpoint_id: uuid.UUID | None
    adapter_id: uuid.UUID | None
    adapter_digest: str | None
    model: str  # what the client sent as `model`
    base_model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: str  # ok | length | error | cancelled
    started_at: datetime  # timezone-aware
    finished_at: datetime
    service_tier: str = ServiceTier.DEFAULT.value  # the tier it ran on, resolved (never "auto")
    reasoning_tokens: int = 0  # the completion tokens spent inside a think block (part of completion_tokens)

    def __post_init__(self) -> None:
        # Checked here, at the caller, so that the database never refuses an event for its shape.
        for name, max_len in _MAX_LENGTHS.items():
            value = getattr(self, name)
            if value is not None and not 0 < len(value) <= max_len:
                raise ValueError(f"usage event: {name} must be 1 to {max_len} characters, got {value!r}")
        if min(self.prompt_tokens, self.cached_tokens, self.completion_tokens, self.reasoning_tokens) < 0:
            raise ValueError("usage event: token counts must be >= 0")
        if self.reasoning_tokens > self.completion_tokens:
            raise ValueError("usage event: reasoning_tokens are completion tokens: at most completion_tokens")
        if self.started_at.tzinfo is None or self.finished_at.tzinfo is None:
            raise ValueError("usage event: started_at and finished_at must be timezone-aware")
        if self.service_tier not in _TIERS:
            raise ValueError(f"usage event: service_tier must be one of {sorted(_TIERS)}, got {self.service_tier!r}")

    def row(self) -> dict[str, Any]:
        # Every field holds an immutable value: a shallow copy is the row (asdict would deep-copy each one).
        return {name: getattr(self, name) for name in _EVENT_FIELDS}

    def encode(self) -> bytes:
        values = self.row()
        for name in ("tenant_id", "endpoint_id", "adapter_id"):
            values[name] = None if values[name] is None else str(values[name])
        for name in ("started_at", "finished_at"):
            values[name] = values[name].isoformat()
        return json.dumps(values, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> UsageEvent:
        """Raise ValueError (or KeyError, TypeError) on an entry that is not an encoded event. A field with a default
        may be absent: an entry that a replica of an earlier version deferred, before the field was added."""
        values = json.loads(raw)
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        if not isinstance(values, dict) or not required <= set(values) <= names:
            raise ValueError("not a usage event")
        values["tenant_id"] = TenantId(uuid.UUID(values["tenant_id"]))
        for name in ("endpoint_id", "adapter_id"):
            values[name] = None if values[name] is None else uuid.UUID(values[name])
        for name in ("started_at", "finished_at"):
            values[name] = datetime.fromisoformat(values[name])
        return cls(**values)


_EVENT_FIELDS = tuple(f.name for f in fields(UsageEvent))


# ---------------------------------------------------------------------------------------------------------------
# Outboxes


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    entry_id: str
    payload: bytes  # an encoded UsageEvent


class UsageOutbox(Protocol):
    """Events waiting for the database, oldest first. Entries stay until `remove`d: a crash between reading and
    removing leaves them to be drained again (harmless: inserts are idempotent)."""

    async def append(self, payload: bytes) -> None: ...

    async def peek(self, count: int) -> list[OutboxEntry]:
        """Up to `count` of the oldest entries, without removing them."""
        ...

    async def remove(self, entry_ids: list[str]) -> None: ...

    async def bury(self, entry: OutboxEntry, reason: str) -> None:
        """Move `entry` aside for an operator: the database refuses it for good."""
        ...

    async def size(self) -> int: ...


class RedisOutbox:
    """A Redis stream shared by every replica. No MAXLEN: trimming would drop billable usage."""

    def __init__(self, store: RedisStore) -> None:
        self._redis = store.redis
        self._key = store.key(OUTBOX_KEY)
        self._dead_key = store.key(DEAD_LETTER_KEY)

    async def append(self, payload: bytes) -> None:
        await self._redis.xadd(self._key, {"event": payload})

    async def peek(self, count: int) -> list[OutboxEntry]:
        # The client is built without decode_responses: ids, field names and values come back as bytes.
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await self._redis.xrange(self._key, count=count))
        return [OutboxEntry(entry_id.decode(), values.get(b"event", b"")) for entry_id, values in entries]

    async def remove(self, entry_ids: list[str]) -> None:
        if entry_ids:
            await self._redis.xdel(self._key, *entry_ids)

    async def bury(self, entry: OutboxEntry, reason: str) -> None:
        await self._redis.xadd(self._dead_key, {"event": entry.payload, "reason": reason[:1000]})
        await self._redis.xdel(self._key, entry.entry_id)

    async def size(self) -> int:
        return int(await self._redis.xlen(self._key))


class MemoryOutbox:
    """An in-process deque: the outbox of the embedded mode, and the last resort when Redis fails too. Lost if the
    process dies, which is why shared deployments use the Redis stream first."""

    def __init__(self) -> None:
        self._entries: collections.deque[OutboxEntry] = collections.deque()
        self._ids = itertools.count()
        self.dead: list[tuple[OutboxEntry, str]] = []

    async def append(self, payload: bytes) -> None:
        self._entries.append(OutboxEntry(str(next(self._ids)), payload))

    async def peek(self, count: int) -> list[OutboxEntry]:
        return list(itertools.islice(self._entries, count))

    async def remove(self, entry_ids: list[str]) -> None:
        gone = set(entry_ids)
        self._entries = collections.deque(e for e in self._entries if e.entry_id not in gone)

    async def bury(self, entry: OutboxEntry, reason: str) -> None:
        self.dead.append((entry, reason))
        await self.remove([entry.entry_id])

    async def size(self) -> int:
        return len(self._entries)


# ---------------------------------------------------------------------------------------------------------------
# The recorder


def _refused_for_good(exc: Exception) -> bool:
    """Whether the database will never accept the row (a tenant deleted since: the foreign key; a value it cannot
    bind), as opposed to being unreachable, slow or not migrated: those keep the entry for the next round."""
    if isinstance(exc, IntegrityError | DataError):
        return True
    # A StatementError that is not the driver's: the value failed on our side, before reaching the database.
    return isinstance(exc, StatementError) and not isinstance(exc, DBAPIError)


_OUTBOX_ERRORS = (RedisError, OSError, TimeoutError)


class UsageRecorder:
    """Writes usage rows; one per process, safe for concurrent use. Owns its sessions (from `sessions`)."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        outboxes: list[UsageOutbox],
        *,
        db_timeout_s: float = 5.0,
        batch_size: int = 200,
        linger_s: float = 0.005,
    ) -> None:
        if not outboxes:
            raise ValueError("a usage recorder needs at least one outbox")
        self._sessions = sessions
        self._outboxes = outboxes
        self._db_timeout_s = db_timeout_s
        self._batch_size = batch_size
        self._linger_s = linger_s
        self._max_batches_per_drain = 50
        self._drain_lock = asyncio.Lock()
        self._in_flight: set[asyncio.Task[Any]] = set()  # `record` calls
        self._queued: list[UsageEvent] = []  # by `record_soon`, for the writer
        self._num_writing = 0  # events the writer has taken and not yet stored
        self._writer: asyncio.Task[None] | None = None  # while events are queued or being written
        self.num_deferred = 0  # events that went to an outbox because the database write failed
        self.num_lost = 0  # events no outbox would take either (logged in full, at error level)

    @property
    def outboxes(self) -> list[UsageOutbox]:
        return list(self._outboxes)

    @property
    def num_in_flight(self) -> int:
        """Events on their way to the database (or an outbox): in `record` calls running, or given to `record_soon`
        and not yet stored."""
        return len(self._in_flight) + len(self._queued) + self._num_writing

    async def record(self, event: UsageEvent) -> None:
        """Store `event` in the database, or else in an outbox. Never raises (but lets a cancellation through);
        opens its own session, so it is safe to run in `asyncio.shield` after the request's session is gone."""
        task = asyncio.current_task()
        if task is not None:
            self._in_flight.add(task)
        try:
            await self._record([event])
        finally:
            if task is not None:
                self._in_flight.discard(task)

    def record_soon(self, event: UsageEvent) -> None:
        """`record` without waiting, so that the caller (a response ready to send) never waits on a slow database;
        `close` waits for it. One writer task stores what is given here, all that was given while it waited or wrote
        in one statement: under load a transaction per batch, not per request. It waits `linger_s` before its first
        write, so that the response which gave the event goes out before the write takes the event loop."""
        self._queued.append(event)
        if self._writer is None:
            self._writer = asyncio.ensure_future(self._write_queued())

    async def _write_queued(self) -> None:
        try:
            await asyncio.sleep(self._linger_s)
            while self._queued:
                batch = self._queued[: self._batch_size]
                del self._queued[: len(batch)]
                self._num_writing = len(batch)
                try:
                    await self._record(batch)
                finally:
                    self._num_writing = 0
        finally:
            # No await between the last look at the queue and this: an event queued later starts a new writer.
            self._writer = None

    async def _record(self, events: list[UsageEvent]) -> None:
        """Insert `events` in one statement, else each on its own when the database refused one of them for good
        (the others still go in now), else (the database is unreachable or slow) defer them all to an outbox."""
        try:
            async with asyncio.timeout(self._db_timeout_s):
                await self._insert([event.row() for event in events])
            return
        except Exception as exc:  # whatever the database did, no event may be lost: defer it
            if len(events) > 1 and _refused_for_good(exc):
                for event in events:
                    await self._record([event])
                return
            for event in events:
                logger.warning("usage %s: database write failed (%r); deferring to the outbox", event.request_id, exc)
        for event in events:
            await self._defer(event)

    async def _defer(self, event: UsageEvent) -> None:
        payload = event.encode()
        for outbox in self._outboxes:
            try:
                await outbox.append(payload)
            except _OUTBOX_ERRORS as exc:
                logger.warning("usage %s: outbox %s failed (%r)", event.request_id, type(outbox).__name__, exc)
                continue
            self.num_deferred += 1
            return
        self.num_lost += 1
        logger.error("usage %s LOST: no database and no outbox; event=%s", event.request_id, payload.decode())

    async def _insert(self, rows: list[dict[str, Any]]) -> int:
        async with self._sessions() as session:
            inserted = await UsageRepository(session).add_if_absent(rows)
            await session.commit()
        return inserted

    async def drain_once(self) -> int:
        """Move outbox entries into the database; returns how many rows this call inserted (entries already in the
        database are removed without counting). Stops at the first failure that looks temporary and leaves the rest
        for the next call; an entry the database refuses for good is moved to the dead-letter stream."""
        async with self._drain_lock:
            inserted = 0
            for outbox in self._outboxes:
                try:
                    inserted += await self._drain_outbox(outbox)
                except _OUTBOX_ERRORS as exc:  # this outbox is unreachable; the others may not be
                    logger.warning("usage drainer: outbox %s failed (%r)", type(outbox).__name__, exc)
            return inserted

    async def _drain_outbox(self, outbox: UsageOutbox) -> int:
        inserted = 0
        # Bounded, so one call ends even if entries keep arriving; the next call goes on.
        for _ in range(self._max_batches_per_drain):
            entries = await outbox.peek(self._batch_size)
            if not entries:
                break
            done, count, stuck = await self._drain_batch(outbox, entries)
            inserted += count
            if stuck or done < len(entries):
                break
        return inserted

    async def _drain_batch(self, outbox: UsageOutbox, entries: list[OutboxEntry]) -> tuple[int, int, bool]:
        """(entries removed, rows inserted, stopped on a temporary failure)."""
        decoded: list[tuple[OutboxEntry, UsageEvent]] = []
        for entry in entries:
            try:
                decoded.append((entry, UsageEvent.decode(entry.payload)))
            except (ValueError, KeyError, TypeError) as exc:
                logger.error(
                    "usage outbox entry %s is not an event (%r); moved to the dead letters", entry.entry_id, exc
                )
                await outbox.bury(entry, f"undecodable: {exc!r}")
        removed = len(entries) - len(decoded)
        try:
            async with asyncio.timeout(self._db_timeout_s):
                count = await self._insert([event.row() for _, event in decoded])
        except Exception as exc:  # sorted below: a refused row, or a database that is unreachable or slow
            if not _refused_for_good(exc):
                logger.warning("usage outbox: database unavailable (%r); %d entries wait", exc, len(decoded))
                return removed, 0, True
            logger.warning("usage outbox: batch of %d refused (%r); inserting one by one", len(decoded), exc)
        else:
            await outbox.remove([entry.entry_id for entry, _ in decoded])
            return len(entries), count, False
        # One bad row fails the whole statement: find it, and keep the good rows.
        count = 0
        for entry, event in decoded:
            try:
                async with asyncio.timeout(self._db_timeout_s):
                    count += await self._insert([event.row()])
            except Exception as exc:  # sorted as above
                if not _refused_for_good(exc):
                    logger.warning("usage outbox: database unavailable (%r); the rest waits", exc)
                    return removed, count, True
                logger.error("usage %s refused by the database for good (%r); dead-lettered", event.request_id, exc)
                await outbox.bury(entry, repr(exc))
            else:
                await outbox.remove([entry.entry_id])
            removed += 1
        return removed, count, False

    async def run_drainer(self, interval_s: float, stop: asyncio.Event | None = None) -> None:
        """Drain every `interval_s` until `stop` is set (or the task is cancelled). The app's lifespan sets `stop`
        and waits: cancelling a round in the middle of a database call can leave its connection half-closed, and
        disposing of the pool then waits on it."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            if stop.is_set():
                return
            try:
                drained = await self.drain_once()
            except Exception:  # a failed round must not end the loop: the next one retries
                logger.warning("usage drainer round failed", exc_info=True)
                continue
            if drained:
                logger.info("usage drainer: %d deferred events written", drained)

    async def close(self, timeout_s: float = 10.0) -> None:
        """At shutdown, before the database closes: wait (at most `timeout_s`) for `record` calls and the writer still
        running, move what the writer has not taken to an outbox, then drain once more, since the in-process outbox
        dies with the process. What is still there is logged in full."""
        pending = {t for t in self._in_flight if t is not asyncio.current_task()}
        if self._writer is not None:
            pending.add(self._writer)
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        stranded, self._queued = self._queued, []
        for event in stranded:
            await self._defer(event)
        if self._writer is not None and not self._num_writing:  # still waiting to write: nothing left for it
            self._writer.cancel()
        try:
            async with asyncio.timeout(timeout_s):
                await self.drain_once()
        except Exception:  # shutting down: report what is left rather than fail the shutdown
            logger.warning("usage: the last drain failed", exc_info=True)
        for outbox in self._outboxes:
            if isinstance(outbox, MemoryOutbox):
                for entry in await outbox.peek(await outbox.size()):
                    self.num_lost += 1
                    logger.error("usage LOST at shutdown (database unreachable): event=%s", entry.payload.decode())


def open_usage_recorder(sessions: async_sessionmaker[AsyncSession], kv: KeyValueStore) -> UsageRecorder:
    """A recorder whose outbox is the Redis stream when the key-value store is Redis (with the in-process deque
    behind it), else only the deque."""
    outboxes: list[UsageOutbox] = [MemoryOutbox()]
    if isinstance(kv, RedisStore):
        outboxes.insert(0, RedisOutbox(kv))
    return UsageRecorder(sessions, outboxes)
