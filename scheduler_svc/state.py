"""Per-request block state in Redis, for scheduler_svc (see DESIGN.md "State in Redis").

Everything lives in Redis; a ``RequestStore`` holds no state of its own, so a new store
(a restarted scheduler) on the same Redis sees every request, block, worker and counter.

State machine (every arrow is ONE Lua script, a compare-and-set on ``status``)::

                claim(id, w)               finish(id, reason)
      create ──> queued ───────────> running ──────────────> finished
                  │  ^                  │  │  fail(id, error)
                  │  │ requeue /        │  └───────────────> failed
                  │  │ requeue_worker   │
                  │  └──────────────────┤  cancel(id)
                  │ cancel(id)          └───────────────────> cancelled
                  └─────────────────────────────────────────> cancelled

* ``create``      absent   -> queued  (False if the id exists: idempotent submit); with a
                  worker, absent -> running there, as create + claim leave it, in one script
* ``claim``       queued   -> running (sets worker, SADD running:{w}, ZREM queue; returns the
                                       ``next_block`` and ``attempt`` streaming needs)
* ``requeue``     running  -> queued  (worker lost: attempt += 1, worker cleared, back in the
                                       queue at its original enqueue time; committed blocks
                                       and ``next_block`` are KEPT, the next attempt resumes)
* ``finish``      running  -> finished
* ``fail``        running  -> failed
* ``cancel``      queued|running -> cancelled
* terminal states (finished, failed, cancelled) are final: the request hash AND its blocks
  hash get a TTL (``finished_ttl_s``), the id leaves the queue and the running set;
  ``finish`` / ``fail`` / ``cancel`` may carry the ending (``end:{id}``) to save in the
  same script.

Any other transition is refused (the call returns False) and changes nothing.

Blocks, exactly once: ``append_block(id, i, payload, n_tokens, attempt)`` stores block ``i``
only if the request is running, ``i == next_block``, and (when ``attempt`` is given) the
request's current attempt is ``attempt``; it then increments ``next_block`` and
``committed_tokens`` in the same script. So a retried or duplicated append answers
``"duplicate"``, a gap answers ``"out_of_order"``, and a zombie worker from an earlier
attempt (or anyone, after a terminal state) answers ``"not_running"``. ``finish`` and
``fail`` take the same optional ``attempt`` guard, so a zombie cannot end a request that
now runs elsewhere.

Keys (``P`` = prefix, default ``cde:``)::

    P req:{id}          hash  status worker prompt_tokens committed_tokens next_block
                              created_at updated_at finish_reason error spec attempt
    P req:{id}:blocks   hash  block_index -> payload bytes (opaque)
    P end:{id}          str   how the request ended (a Finished message, bytes), for replays;
                              written once (NX) with or after the terminal transition, same TTL
    P queue             zset  id, score = first enqueue time (server clock, seconds)
    P running:{worker}  set   ids running on that worker
    P workers           hash  worker_id -> JSON {"heartbeat": t, "registered_at": t, "info": {...}}
    P counts            hash  status -> count, updated by the same scripts

Counts: ``queued`` and ``running`` are live gauges; ``finished``, ``failed``, ``cancelled``
are monotonic totals (terminal hashes expire, the totals do not go down), i.e. a gauge and
a counter in Prometheus terms. ``scan_counts()`` recounts the request hashes actually
present (SCAN), for checks and repair.

Times come from the Redis server clock (``TIME``), so several schedulers agree on them.
Scripts build ``running:{worker}`` keys from the prefix, which is fine on one Redis server
(or one Redis Cluster slot: use a hash-tag prefix such as ``"{cde}:"``).

The client must be created with ``decode_responses=False`` (the default): block payloads
are raw bytes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

__all__ = ["RequestState", "RequestStore", "STATUSES", "TERMINAL", "APPEND_RESULTS", "check_request_id",
           "check_worker_id"]

QUEUED, RUNNING, FINISHED, FAILED, CANCELLED = "queued", "running", "finished", "failed", "cancelled"
STATUSES = (QUEUED, RUNNING, FINISHED, FAILED, CANCELLED)
TERMINAL = frozenset({FINISHED, FAILED, CANCELLED})
APPEND_RESULTS = ("stored", "duplicate", "out_of_order", "not_running")

# Allowed "from" states of the terminal transitions.
_TERMINAL_FROM = {
    FINISHED: (RUNNING,),
    FAILED: (RUNNING,),
    CANCELLED: (QUEUED, RUNNING),
}

_NOW = """
local function now()
  local t = redis.call('TIME')
  return string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
end
"""

# KEYS: req, blocks, queue, counts, running:{worker}   ARGV: id, spec, prompt_tokens, worker
# worker '': absent -> queued; else absent -> running on that worker (create and claim at once:
# the state a create then a claim leave, without the queue entry in between)
_CREATE = _NOW + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local t = now()
redis.call('DEL', KEYS[2])
local status = 'queued'
if ARGV[4] ~= '' then status = 'running' end
redis.call('HSET', KEYS[1], 'status', status, 'worker', ARGV[4], 'prompt_tokens', ARGV[3],
  'committed_tokens', '0', 'next_block', '0', 'created_at', t, 'updated_at', t,
  'finish_reason', '', 'error', '', 'spec', ARGV[2], 'attempt', '0')
if ARGV[4] == '' then
  redis.call('ZADD', KEYS[3], t, ARGV[1])
else
  redis.call('SADD', KEYS[5], ARGV[1])
end
redis.call('HINCRBY', KEYS[4], status, 1)
return 1
"""

# KEYS: req, queue, counts, running:{worker}   ARGV: id, worker
# -> 0, or {next_block, attempt} of the request now running there (what streaming it needs, so the
# caller makes no second round trip to read them)
_CLAIM = _NOW + """
local v = redis.call('HMGET', KEYS[1], 'status', 'next_block', 'attempt')
if v[1] ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[2], 'updated_at', now())
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'queued', -1)
redis.call('HINCRBY', KEYS[3], 'running', 1)
return {tonumber(v[2]), tonumber(v[3])}
"""

# KEYS: req, blocks   ARGV: block_index, payload, n_tokens, attempt ('' = any)
_APPEND = _NOW + """
local v = redis.call('HMGET', KEYS[1], 'status', 'next_block', 'attempt')
if v[1] ~= 'running' then return 'not_running' end
if ARGV[4] ~= '' and tonumber(ARGV[4]) ~= tonumber(v[3]) then return 'not_running' end
local idx = tonumber(ARGV[1])
local nb = tonumber(v[2])
if idx < nb then return 'duplicate' end
if idx > nb then return 'out_of_order' end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 'duplicate' end
redis.call('HINCRBY', KEYS[1], 'next_block', 1)
redis.call('HINCRBY', KEYS[1], 'committed_tokens', tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], 'updated_at', now())
return 'stored'
"""

# KEYS: req, blocks, queue, counts, end
# ARGV: id, new_status, ttl_s, field ('' = none), value, attempt ('' = any), running_prefix,
#       ending ('' = none: saved with the transition, first ending wins), allowed_from...
_TERMINATE = _NOW + """
local v = redis.call('HMGET', KEYS[1], 'status', 'worker', 'attempt')
local st = v[1]
if not st then return 0 end
local ok = false
for i = 9, #ARGV do
  if ARGV[i] == st then ok = true end
end
if not ok then return 0 end
if ARGV[6] ~= '' and tonumber(ARGV[6]) ~= tonumber(v[3]) then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'updated_at', now())
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], ARGV[4], ARGV[5]) end
if v[2] and v[2] ~= '' then redis.call('SREM', ARGV[7] .. v[2], ARGV[1]) end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[4], st, -1)
redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
if ARGV[8] ~= '' then redis.call('SET', KEYS[5], ARGV[8], 'EX', tonumber(ARGV[3]), 'NX') end
return 1
"""

# KEYS: req, queue, counts   ARGV: id, expected_worker ('' = any), running_prefix
_REQUEUE = _NOW + """
local v = redis.call('HMGET', KEYS[1], 'status', 'worker', 'created_at')
if v[1] ~= 'running' or (ARGV[2] ~= '' and v[2] ~= ARGV[2]) then
  -- not running there: only drop a stale membership of the expected worker's set
  if ARGV[2] ~= '' then redis.call('SREM', ARGV[3] .. ARGV[2], ARGV[1]) end
  return 0
end
redis.call('HSET', KEYS[1], 'status', 'queued', 'worker', '', 'updated_at', now())
redis.call('HINCRBY', KEYS[1], 'attempt', 1)
if v[2] and v[2] ~= '' then redis.call('SREM', ARGV[3] .. v[2], ARGV[1]) end
redis.call('ZADD', KEYS[2], v[3], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'running', -1)
redis.call('HINCRBY', KEYS[3], 'queued', 1)
return 1
"""

# KEYS: req, blocks   ARGV: after   -> flat list idx1, payload1, idx2, payload2, ...
_BLOCKS = """
local nb = tonumber(redis.call('HGET', KEYS[1], 'next_block'))
if not nb then return false end
local out = {}
for i = tonumber(ARGV[1]) + 1, nb - 1 do
  local p = redis.call('HGET', KEYS[2], tostring(i))
  if p then
    out[#out + 1] = tostring(i)
    out[#out + 1] = p
  end
end
return out
"""

# KEYS: workers   ARGV: worker_id, info_json
_REGISTER_WORKER = _NOW + """
local t = now()
redis.call('HSET', KEYS[1], ARGV[1],
  '{"heartbeat":' .. t .. ',"registered_at":' .. t .. ',"info":' .. ARGV[2] .. '}')
return 1
"""

# KEYS: workers   ARGV: worker_id   (rewrites only the leading heartbeat field)
_HEARTBEAT = _NOW + """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local rest = string.match(v, '^{"heartbeat":[^,]*,(.*)$')
if not rest then return redis.error_reply('malformed worker record for ' .. ARGV[1]) end
redis.call('HSET', KEYS[1], ARGV[1], '{"heartbeat":' .. now() .. ',' .. rest)
return 1
"""

# KEYS: workers   ARGV: worker_id   (a script so that it is fenced like every other write)
_REMOVE_WORKER = """
return redis.call('HDEL', KEYS[1], ARGV[1])
"""


@dataclass(frozen=True)
class Claimed:
    """What a successful ``claim`` read in the same script: where the new attempt resumes."""
    next_block: int
    attempt: int


@dataclass(frozen=True)
class RequestState:
    id: str
    status: str
    worker: str | None
    prompt_tokens: int
    committed_tokens: int
    next_block: int
    created_at: float
    updated_at: float
    finish_reason: str | None
    error: str | None
    spec: str
    attempt: int

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


def _s(v) -> str:
    return v.decode("utf-8") if isinstance(v, (bytes, bytearray)) else str(v)


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _shown(value) -> str:
    """``value`` as an error message quotes it: at most 64 characters, so the message always fits
    gRPC's metadata (an 8 KiB soft limit, past which peers drop the status at random)."""
    text = repr(value)
    return text if len(text) <= 64 else f"{text[:64]}... ({len(value)} chars)"


def _check_key_part(what: str, value: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 512:
        raise ValueError(f"{what} must be a non-empty str of at most 512 chars, got {_shown(value)}")
    if any(c.isspace() or ord(c) < 32 for c in value):
        raise ValueError(f"{what} must not contain whitespace or control characters: {_shown(value)}")
    return value


def check_request_id(request_id: str) -> str:
    """``request_id``, if it can name a request's keys (ValueError says why not)."""
    _check_key_part("request id", request_id)
    if request_id.endswith(":blocks"):   # would collide with another request's blocks key
        raise ValueError(f"request id must not end with ':blocks': {_shown(request_id)}")
    return request_id


def check_worker_id(worker_id: str) -> str:
    """``worker_id``, if it can name a ``running:{worker}`` key (ValueError says why not)."""
    return _check_key_part("worker id", worker_id)


def _check_nonneg(what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r}")
    return value


class RequestStore:
    """Asyncio access to the per-request state in Redis. See the module docstring."""

    def __init__(self, redis: aioredis.Redis, prefix: str = "cde:", finished_ttl_s: int = 3600,
                 guard=None):
        kwargs = getattr(getattr(redis, "connection_pool", None), "connection_kwargs", {}) or {}
        if kwargs.get("decode_responses"):
            raise ValueError("RequestStore needs a Redis client with decode_responses=False "
                             "(block payloads are bytes)")
        if isinstance(finished_ttl_s, bool) or not isinstance(finished_ttl_s, int) or finished_ttl_s <= 0:
            raise ValueError(f"finished_ttl_s must be an int > 0, got {finished_ttl_s!r}")
        self.redis = redis
        self.prefix = prefix
        self.finished_ttl_s = finished_ttl_s
        self.queue_key = f"{prefix}queue"
        self.workers_key = f"{prefix}workers"
        self.counts_key = f"{prefix}counts"
        self._running_prefix = f"{prefix}running:"
        # guard (scheduler_svc/fencing.py): every script carries the leader's fencing token
        rs = redis.register_script if guard is None else (lambda text: guard.script(redis, text))
        self._create = rs(_CREATE)
        self._claim = rs(_CLAIM)
        self._append = rs(_APPEND)
        self._terminate = rs(_TERMINATE)
        self._requeue = rs(_REQUEUE)
        self._blocks = rs(_BLOCKS)
        self._register_worker = rs(_REGISTER_WORKER)
        self._heartbeat = rs(_HEARTBEAT)
        self._remove_worker = rs(_REMOVE_WORKER)

    # ------------------------------------------------------------------ keys
    def req_key(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def blocks_key(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}:blocks"

    def running_key(self, worker: str) -> str:
        return f"{self._running_prefix}{worker}"

    def end_key(self, request_id: str) -> str:
        return f"{self.prefix}end:{request_id}"

    # ----------------------------------------------------------- transitions
    async def create(self, request_id: str, spec: str, prompt_tokens: int, worker: str | None = None) -> bool:
        """absent -> queued; with ``worker``, absent -> running there (as `claim` would leave it,
        next block 0, attempt 0: one round trip instead of two when a worker is free at once).
        False (and nothing changes) when the id already exists."""
        check_request_id(request_id)
        if worker is not None:
            check_worker_id(worker)
        _check_nonneg("prompt_tokens", prompt_tokens)
        if isinstance(spec, (bytes, bytearray)):
            spec = bytes(spec).decode("utf-8")
        if not isinstance(spec, str):
            raise TypeError(f"spec must be a str (JSON text), got {type(spec).__name__}")
        r = await self._create(
            keys=[self.req_key(request_id), self.blocks_key(request_id), self.queue_key,
                  self.counts_key, self.running_key(worker or "")],
            args=[request_id, spec, prompt_tokens, worker or ""])
        return bool(r)

    async def claim(self, request_id: str, worker: str) -> Claimed | None:
        """queued -> running on ``worker``: the request's `Claimed` state, read in the same
        script; None (nothing changes) unless the request is queued."""
        check_request_id(request_id)
        check_worker_id(worker)
        r = await self._claim(
            keys=[self.req_key(request_id), self.queue_key, self.counts_key,
                  self.running_key(worker)],
            args=[request_id, worker])
        if not r:
            return None
        next_block, attempt = r
        return Claimed(next_block=int(next_block), attempt=int(attempt))

    async def append_block(self, request_id: str, block_index: int, payload: bytes,
                           n_tokens: int, attempt: int | None = None) -> str:
        """Store committed block ``block_index`` exactly once. Returns one of
        ``"stored"``, ``"duplicate"`` (index already committed), ``"out_of_order"`` (index
        beyond ``next_block``), ``"not_running"`` (request absent, not running, or running
        under another attempt than ``attempt``)."""
        check_request_id(request_id)
        _check_nonneg("block_index", block_index)
        _check_nonneg("n_tokens", n_tokens)
        if attempt is not None:
            _check_nonneg("attempt", attempt)
        if isinstance(payload, str):
            payload = payload.encode("utf-8")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        r = await self._append(
            keys=[self.req_key(request_id), self.blocks_key(request_id)],
            args=[block_index, bytes(payload), n_tokens, "" if attempt is None else attempt])
        return _s(r)

    async def _end(self, request_id: str, status: str, field: str, value: str,
                   attempt: int | None, ending: bytes | None) -> bool:
        check_request_id(request_id)
        if attempt is not None:
            _check_nonneg("attempt", attempt)
        if ending is not None and (not isinstance(ending, (bytes, bytearray)) or not ending):
            raise TypeError(f"ending must be non-empty bytes, got {type(ending).__name__}")
        r = await self._terminate(
            keys=[self.req_key(request_id), self.blocks_key(request_id), self.queue_key,
                  self.counts_key, self.end_key(request_id)],
            args=[request_id, status, self.finished_ttl_s, field, value,
                  "" if attempt is None else attempt, self._running_prefix,
                  b"" if ending is None else bytes(ending), *_TERMINAL_FROM[status]])
        return bool(r)

    # ``ending`` (opaque bytes, optional): how the request ended, saved by the same script when
    # the transition succeeds, as `save_ending` would right after it (the first ending wins).
    async def finish(self, request_id: str, reason: str, attempt: int | None = None,
                     ending: bytes | None = None) -> bool:
        """running -> finished (``finish_reason`` = reason). Optional attempt guard."""
        return await self._end(request_id, FINISHED, "finish_reason", str(reason), attempt, ending)

    async def fail(self, request_id: str, error: str, attempt: int | None = None,
                   ending: bytes | None = None) -> bool:
        """running -> failed (``error`` = error). Optional attempt guard."""
        return await self._end(request_id, FAILED, "error", str(error), attempt, ending)

    async def cancel(self, request_id: str, ending: bytes | None = None) -> bool:
        """queued|running -> cancelled (``finish_reason`` = "cancelled")."""
        return await self._end(request_id, CANCELLED, "finish_reason", CANCELLED, None, ending)

    async def requeue(self, request_id: str, worker: str | None = None) -> bool:
        """running -> queued (attempt += 1, worker cleared). With ``worker``, only if the
        request runs on that worker (and a stale entry in that worker's set is dropped)."""
        check_request_id(request_id)
        if worker is not None:
            check_worker_id(worker)
        r = await self._requeue(
            keys=[self.req_key(request_id), self.queue_key, self.counts_key],
            args=[request_id, worker or "", self._running_prefix])
        return bool(r)

    async def requeue_worker(self, worker: str) -> list[str]:
        """Move every request running on a dead ``worker`` back to the queue (one atomic
        script per request). Returns the requeued ids, sorted."""
        check_worker_id(worker)
        moved: list[str] = []
        for _ in range(100):  # the set only shrinks unless the dead worker keeps claiming
            ids = sorted(_s(x) for x in await self.redis.smembers(self.running_key(worker)))
            if not ids:
                break
            for rid in ids:
                if await self.requeue(rid, worker):
                    moved.append(rid)
        return sorted(moved)

    async def save_ending(self, request_id: str, payload: bytes) -> bool:
        """Record how a request ended (opaque bytes). The first ending wins (NX) and it expires
        with the request (``finished_ttl_s``): call it right after the terminal transition.
        False when an ending was already saved."""
        check_request_id(request_id)
        if not isinstance(payload, (bytes, bytearray)):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        return bool(await self.redis.set(self.end_key(request_id), bytes(payload), ex=self.finished_ttl_s, nx=True))

    # ----------------------------------------------------------------- reads
    async def ending(self, request_id: str) -> bytes | None:
        """The saved ending of ``save_ending``, or None."""
        check_request_id(request_id)
        v = await self.redis.get(self.end_key(request_id))
        return None if v is None else bytes(v)

    async def get(self, request_id: str) -> RequestState | None:
        check_request_id(request_id)
        h = await self.redis.hgetall(self.req_key(request_id))
        if not h:
            return None
        d = {_s(k): _s(v) for k, v in h.items()}
        return RequestState(
            id=request_id,
            status=d["status"],
            worker=d.get("worker") or None,
            prompt_tokens=int(d.get("prompt_tokens", 0)),
            committed_tokens=int(d.get("committed_tokens", 0)),
            next_block=int(d.get("next_block", 0)),
            created_at=float(d.get("created_at", 0)),
            updated_at=float(d.get("updated_at", 0)),
            finish_reason=d.get("finish_reason") or None,
            error=d.get("error") or None,
            spec=d.get("spec", ""),
            attempt=int(d.get("attempt", 0)),
        )

    async def blocks(self, request_id: str, after: int = -1) -> list[tuple[int, bytes]]:
        """Committed blocks with index > ``after``, in index order (one atomic read)."""
        check_request_id(request_id)
        if isinstance(after, bool) or not isinstance(after, int) or after < -1:
            raise ValueError(f"after must be an int >= -1, got {after!r}")
        flat = await self._blocks(
            keys=[self.req_key(request_id), self.blocks_key(request_id)], args=[after])
        if not flat:
            return []
        return [(int(flat[i]), bytes(flat[i + 1])) for i in range(0, len(flat), 2)]

    async def queued_ids(self) -> list[str]:
        """Queued ids, oldest first (a requeued request keeps its first enqueue time)."""
        return [_s(x) for x in await self.redis.zrange(self.queue_key, 0, -1)]

    async def all_running_ids(self) -> list[str]:
        """Ids in any worker's running set (SCAN), sorted: what a restarted scheduler takes over."""
        pattern = _glob_escape(self._running_prefix) + "*"
        ids: set[str] = set()
        async for key in self.redis.scan_iter(match=pattern, count=1000):
            ids.update(_s(m) for m in await self.redis.smembers(key))
        return sorted(ids)

    async def running_ids(self, worker: str) -> list[str]:
        check_worker_id(worker)
        return sorted(_s(x) for x in await self.redis.smembers(self.running_key(worker)))

    async def counts(self) -> dict[str, int]:
        """Counters by status (queued/running: current; terminal: totals, see docstring)."""
        h = await self.redis.hgetall(self.counts_key)
        got = {_s(k): int(v) for k, v in h.items()}
        return {st: got.get(st, 0) for st in STATUSES}

    async def scan_counts(self) -> dict[str, int]:
        """Requests present in Redis by status, recounted with SCAN (O(keys))."""
        out = {st: 0 for st in STATUSES}
        pat = _glob_escape(self.prefix) + "req:*"
        keys = [k async for k in self.redis.scan_iter(match=pat, count=1000)]
        keys = [k for k in keys if not _s(k).endswith(":blocks")]
        if not keys:
            return out
        pipe = self.redis.pipeline(transaction=False)
        for k in keys:
            pipe.hget(k, "status")
        for st in await pipe.execute():
            if st is not None:
                out[_s(st)] = out.get(_s(st), 0) + 1
        return out

    # --------------------------------------------------------------- workers
    async def register_worker(self, worker_id: str, info: dict) -> None:
        """Create or replace the worker's record; its heartbeat is now (server clock)."""
        check_worker_id(worker_id)
        await self._register_worker(keys=[self.workers_key],
                                    args=[worker_id, json.dumps(info, separators=(",", ":"))])

    async def heartbeat(self, worker_id: str) -> bool:
        """Refresh the heartbeat. False if the worker is not registered."""
        check_worker_id(worker_id)
        return bool(await self._heartbeat(keys=[self.workers_key], args=[worker_id]))

    async def remove_worker(self, worker_id: str) -> bool:
        check_worker_id(worker_id)
        return bool(await self._remove_worker(keys=[self.workers_key], args=[worker_id]))

    async def workers(self) -> dict[str, dict]:
        """worker_id -> {"heartbeat": t, "registered_at": t, "info": {...}}."""
        h = await self.redis.hgetall(self.workers_key)
        return {_s(k): json.loads(_s(v)) for k, v in h.items()}

    async def server_time(self) -> float:
        sec, usec = await self.redis.time()
        return sec + usec / 1e6

    async def stale_workers(self, max_age_s: float) -> list[str]:
        """Registered workers whose last heartbeat is older than ``max_age_s`` (server
        clock), sorted."""
        now = await self.server_time()
        ws = await self.workers()
        return sorted(w for w, rec in ws.items() if now - float(rec["heartbeat"]) > max_age_s)
