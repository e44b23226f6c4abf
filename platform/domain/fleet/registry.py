"""The fleet: engine replicas the platform can send work to, and the choice of one per request.

Replicas announce themselves in Redis (engine/serve/registration.py writes `{prefix}fleet:engine:{id}` every second
with a 5 s expiry and adds the id to `{prefix}fleet:engines`); a replica whose key expired has missed its
heartbeats and is dropped. In the embedded mode the one in-process engine is the fleet.

Routing, among the replicas that serve the request's base model: prefer one where the adapter is resident, then
the replica this tenant's prefix last went to (its KV blocks may be cached there), then the least loaded. Two
guards keep those preferences from piling work onto one replica:
- A replica's announced state is up to a beat (plus the registry cache) old, so the router adds the requests it sent
  each replica in the last few seconds to its load; a burst spreads instead of all going to the first idle replica.
- Residency and warmth only choose among replicas whose load is within BALANCE_SLACK of the least loaded one (as
  SGLang's cache-aware router falls back to the shortest queue when the fleet is out of balance): a hot adapter or a
  busy tenant is served by a second replica rather than queueing behind itself.
When balance sends a prefix away from the replica it last went to, `choose` names that warm peer: the chosen replica
may fetch the prefix's KV blocks from it instead of computing them (completions/service.py's `plan_kv_transfer`).
Disaggregated prefill and decode: a replica announced with role "prefill" gets no whole requests while another
serves the base model; `pick_prefill` picks among those (adapter resident first, then load) the engine that prefills
a request's prompt for the decode replica `pick` chose (completions/service.py's `plan_kv_transfer`).
A replica that refused a connection is left out of routing for UNREACHABLE_S (a crashed engine's key lives on for up
to its TTL); if every replica of the base model is left out, they are tried anyway. With a single candidate there is
nothing to choose: the affinity is neither read nor written (a round trip to Redis saved per request), so the first
request of a prefix after a second replica joins picks by load and records its affinity from then on.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import RedisError

from loraplex.engine.serve import ENGINE_KEY, ENGINES_SET, FleetRecord
from loraplex.platform.domain.fleet.client import EngineClient, HttpEngineClient
from loraplex.platform.kv import KeyValueStore, RedisStore

logger = logging.getLogger(__name__)

AFFINITY_KEY = "fleet:affinity:{key}"
AFFINITY_TTL_S = 600.0
_CACHE_S = 0.5  # how long a read of the registry is reused (requests come faster than heartbeats)
RECENT_S = 2.0  # a request sent this recently may not show in the replica's announced load yet (1 s beats + cache)
BALANCE_SLACK = 8.0  # load units (a queued request weighs 2, a running one 1) a preferred replica may exceed the least
UNREACHABLE_S = 5.0  # a replica that refused a connection gets no requests for this long (the registry key's TTL)


# A replica is what its engine announced: the engine's own record type (one definition of the format).
Replica = FleetRecord


class Fleet(Protocol):
    async def replicas(self) -> list[Replica]:
        """The live replicas (for routing and for the admin's list)."""
        ...

    def client(self, replica: Replica) -> EngineClient: ...

    def reachable(self, replica: Replica) -> bool:
        """False while the replica is known not to answer (a connection to it failed a moment ago)."""
        ...

    async def close(self) -> None: ...


class EmptyFleet:
    """No engine (engine mode off): every completion is a 503."""

    async def replicas(self) -> list[Replica]:
        return []

    def client(self, replica: Replica) -> EngineClient:
        raise LookupError("the empty fleet has no replica")

    def reachable(self, replica: Replica) -> bool:
        return False

    async def close(self) -> None:
        return None


class RedisFleet:
    """Replicas from the Redis registry; one HTTP client per replica URL, sending `api_key` (the engines' shared
    --api-key) when one is set."""

    def __init__(self, kv: RedisStore, *, api_key: str | None = None) -> None:
        self._kv = kv
        self._api_key = api_key
        self._clients: dict[str, HttpEngineClient] = {}
        self._cached: tuple[float, list[Replica]] = (0.0, [])
        self._unreachable_until: dict[str, float] = {}  # replica URL -> monotonic time its exclusion ends

    async def replicas(self) -> list[Replica]:
        now = time.monotonic()
        if now - self._cached[0] < _CACHE_S:
            return self._cached[1]
        redis = self._kv.redis
        try:
            ids = sorted(
                m.decode() if isinstance(m, bytes) else str(m) for m in await redis.smembers(self._kv.key(ENGINES_SET))
            )
            raws = await redis.mget([self._kv.key(ENGINE_KEY.format(id=i)) for i in ids]) if ids else []
        except RedisError:
            logger.warning("engine registry unreachable; keeping the last known fleet", exc_info=True)
            return self._cached[1]
        live: list[Replica] = []
        gone: list[str] = []
        for engine_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                gone.append(engine_id)  # missed its heartbeats: its key expired
                continue
            try:
                live.append(Replica.parse(json.loads(raw)))
            except (ValueError, KeyError, TypeError):
                logger.warning("engine %s announced an unreadable state", engine_id)
        if gone:
            with contextlib.suppress(RedisError):
                await redis.srem(self._kv.key(ENGINES_SET), *gone)
        self._cached = (now, live)
        return live

    def client(self, replica: Replica) -> EngineClient:
        client = self._clients.get(replica.url)
        if client is None:
            url = replica.url

            def unreachable() -> None:
                logger.warning("engine %s (%s) refused a connection; routing around it", replica.id, url)
                self._unreachable_until[url] = time.monotonic() + UNREACHABLE_S

            client = self._clients[url] = HttpEngineClient(url, on_unreachable=unreachable, api_key=self._api_key)
        return client

    def reachable(self, replica: Replica) -> bool:
        until = self._unreachable_until.get(replica.url)
        if until is None:
            return True
        if time.monotonic() >= until:
            del self._unreachable_until[replica.url]
            return True
        return False

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


class LocalFleet:
    """The embedded mode's fleet: one in-process engine, its state read fresh at every request."""

    def __init__(self, replica_state: Callable[[], Replica], engine_client: EngineClient) -> None:
        self.replica_state = replica_state
        self.engine_client = engine_client

    async def replicas(self) -> list[Replica]:
        return [self.replica_state()]

    def client(self, replica: Replica) -> EngineClient:
        return self.engine_client

    def reachable(self, replica: Replica) -> bool:
        return True

    async def close(self) -> None:
        await self.engine_client.close()


@dataclass(frozen=True, slots=True)
class Choice:
    """A request's replica, and the replica its prefix last went to when that is another one (which may hold the
    prefix's KV blocks: the chosen replica can fetch them from it instead of computing them)."""

    replica: Replica
    warm_peer: Replica | None = None


class Router:
    """Picks a replica per request (see the module's docstring); one per platform process."""

    def __init__(self, fleet: Fleet, kv: KeyValueStore) -> None:
        self.fleet = fleet
        self._kv = kv
        self._sent: dict[str, collections.deque[float]] = {}  # replica id -> monotonic times of recent picks

    async def pick(
        self, base_model: str, adapter_digest: str | None, affinity: str | None, exclude: frozenset[str] = frozenset()
    ) -> Replica | None:
        """The replica for a request (see the module's docstring), never one whose id is in `exclude` (replicas this
        request has already tried); None when no other serves `base_model`."""
        choice = await self.choose(base_model, adapter_digest, affinity, exclude)
        return choice.replica if choice is not None else None

    async def choose(
        self, base_model: str, adapter_digest: str | None, affinity: str | None, exclude: frozenset[str] = frozenset()
    ) -> Choice | None:
        """`pick`'s replica, with the warm peer it passed over for balance, if any."""
        replicas = await self.fleet.replicas()
        serving = [r for r in replicas if r.base_model == base_model and r.id not in exclude]
        serving = [r for r in serving if r.role != "prefill"] or serving
        candidates = [r for r in serving if self.fleet.reachable(r)] or serving
        if not candidates:
            return None
        if len(candidates) == 1:
            affinity = None  # nothing to choose: no round trip for the affinity (see the module's docstring)
        warm_id = None
        if affinity is not None:
            try:
                raw = await self._kv.get(AFFINITY_KEY.format(key=affinity))
                warm_id = raw.decode() if raw else None
            except (RedisError, OSError):
                warm_id = None

        now = time.monotonic()
        recent = self._recent(now)
        loads = {r.id: r.load + recent.get(r.id, 0) for r in candidates}
        floor = min(loads.values())
        balanced = [r for r in candidates if loads[r.id] <= floor + BALANCE_SLACK]

        def score(replica: Replica) -> tuple[int, int, float]:
            resident = 0 if adapter_digest is not None and adapter_digest in replica.adapters else 1
            warm = 0 if replica.id == warm_id else 1
            return (resident, warm, loads[replica.id])

        chosen = min(balanced, key=score)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "routed to %s: loads %s (announced waiting/running %s, recent picks %s), balanced %s, warm %s, "
                "resident %s",
                chosen.id,
                loads,
                {r.id: (r.num_waiting, r.num_running) for r in candidates},
                recent,
                [r.id for r in balanced],
                warm_id,
                [r.id for r in candidates if adapter_digest is not None and adapter_digest in r.adapters],
            )
        self._sent.setdefault(chosen.id, collections.deque()).append(now)
        if affinity is not None and chosen.id != warm_id:
            with contextlib.suppress(RedisError, OSError):
                await self._kv.set(AFFINITY_KEY.format(key=affinity), chosen.id.encode(), ttl_s=AFFINITY_TTL_S)
        warm = next((r for r in candidates if r.id == warm_id and r.id != chosen.id), None)
        return Choice(chosen, warm)

    async def pick_prefill(self, base_model: str, adapter_digest: str | None) -> Replica | None:
        """A prefill-role replica for a request's prompt (adapter resident first, then the least loaded, counting
        recent picks); None when the base model has none that is reachable."""
        replicas = await self.fleet.replicas()
        candidates = [
            r for r in replicas if r.base_model == base_model and r.role == "prefill" and self.fleet.reachable(r)
        ]
        if not candidates:
            return None
        now = time.monotonic()
        recent = self._recent(now)
        chosen = min(
            candidates,
            key=lambda r: (adapter_digest is None or adapter_digest not in r.adapters, r.load + recent.get(r.id, 0)),
        )
        self._sent.setdefault(chosen.id, collections.deque()).append(now)
        return chosen

    def recent_picks(self) -> dict[str, int]:
        """Requests this router sent each replica in the last RECENT_S seconds (what it adds to their loads)."""
        return self._recent(time.monotonic())

    def _recent(self, now: float) -> dict[str, int]:
        """Requests sent to each replica in the last RECENT_S seconds; older picks (and idle replicas) are forgotten."""
        for replica_id, sent in list(self._sent.items()):
            while sent and sent[0] <= now - RECENT_S:
                sent.popleft()
            if not sent:
                del self._sent[replica_id]
        return {replica_id: len(sent) for replica_id, sent in self._sent.items()}
