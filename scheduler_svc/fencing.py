"""Guarded state writes: the fencing token of the active scheduler, and optional WAIT.

`RequestStore` (scheduler_svc/state.py) runs every state change as one Lua script. Given a
`WriteGuard`, it registers them through `WriteGuard.script` instead of
``redis.register_script``, and each call then

* carries the fencing token: one extra key (the token counter of scheduler_svc/leadership.py)
  and one extra argument (our token) are appended, and a prologue pops them and refuses
  the whole script (``CDE_FENCED`` error, nothing written) unless the counter still equals
  our token. A newer leader INCRs the counter when it takes the lease, so every write of a
  deposed leader is refused by Redis itself, whatever the deposed one believes. A guard
  with no token (a standby, or a leader that stepped down) refuses locally.
* optionally waits for replication: ``WAIT replicas ms`` runs on the same connection right
  after the script (one pipeline, so WAIT counts this very write). Fewer acknowledgements
  raise `ReplicationTimeout`, a ``redis.exceptions.TimeoutError``: the run retries it as a
  transient failure and publishes the block only once a replica has it (docs/deploy-ha.md).

Reads (scripts are reads or writes; reads are cheap to guard too) go through the same path,
so a deposed leader also stops serving stale views.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis.asyncio as aioredis
import redis.exceptions

__all__ = ["Fenced", "GuardedScript", "ReplicationTimeout", "WriteGuard", "FENCED_ERROR"]

log = logging.getLogger("scheduler_svc.fencing")

FENCED_ERROR = "CDE_FENCED"

# Pops the fence key and our token (the last KEYS and ARGV entries) so the script below sees
# exactly the keys and arguments it was written for.
_FENCE_PROLOGUE = f"""
local fence_token = table.remove(ARGV)
local fence_key = table.remove(KEYS)
local fence_current = redis.call('GET', fence_key)
if fence_current ~= fence_token then
  return redis.error_reply('{FENCED_ERROR} token ' .. fence_token .. ' is stale: the current one is '
    .. tostring(fence_current))
end
"""


class Fenced(redis.exceptions.RedisError):
    """A write refused because a newer scheduler holds the lease (or we hold none)."""


class ReplicationTimeout(redis.exceptions.TimeoutError):
    """The write is on the master but fewer replicas than required acknowledged it in time."""


class WriteGuard:
    """Shared by every script of one `RequestStore`. ``token`` is set by the leadership loop
    (None: refuse every call); ``fence_key`` None turns fencing off (WAIT only)."""

    def __init__(self, fence_key: str | None = None, wait_replicas: int = 0, wait_ms: int = 1000):
        self.fence_key = fence_key
        self.token: int | None = None
        self.wait_replicas = wait_replicas
        self.wait_ms = wait_ms
        self.on_fenced: Callable[[str], None] | None = None   # Redis said a newer leader exists

    def script(self, client: aioredis.Redis, text: str) -> GuardedScript:
        """What ``RequestStore`` registers instead of ``client.register_script(text)``."""
        if self.fence_key is not None:
            text = _FENCE_PROLOGUE + text
        return GuardedScript(self, client.register_script(text))


class GuardedScript:
    def __init__(self, guard: WriteGuard, script):
        self.guard = guard
        self.script = script

    async def __call__(self, keys=(), args=()):
        g = self.guard
        keys, args = list(keys), list(args)
        if g.fence_key is not None:
            if g.token is None:
                raise Fenced("this scheduler is not the active one (no lease)")
            keys.append(g.fence_key)
            args.append(str(g.token))
        try:
            if g.wait_replicas <= 0:
                return await self.script(keys=keys, args=args)
            return await self._with_wait(keys, args)
        except redis.exceptions.ResponseError as e:
            if FENCED_ERROR not in str(e):
                raise
            log.warning("write refused by Redis: %s", e)
            if g.on_fenced is not None:
                g.on_fenced(str(e))
            raise Fenced(str(e)) from None

    async def _with_wait(self, keys: list, args: list):
        g = self.guard
        client = self.script.registered_client
        pipe = client.pipeline(transaction=False)
        pipe.scripts.add(self.script)   # the pipeline SCRIPT LOADs it first when Redis lacks it
        pipe.evalsha(self.script.sha, len(keys), *keys, *args)
        pipe.execute_command("WAIT", g.wait_replicas, g.wait_ms)
        result, acked = await pipe.execute()
        if int(acked) < g.wait_replicas:
            raise ReplicationTimeout(f"{acked} of {g.wait_replicas} replicas acknowledged the write "
                                     f"within {g.wait_ms} ms")
        return result
