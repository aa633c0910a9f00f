"""Redis fixtures for tests: a pytest plugin that conftest.py loads, so any test module can take
``redis_server`` or ``redis_client`` without importing them (``run`` and ``flush`` are plain
functions: import those).

``redis_server`` (session): a real redis-server (``cde.redis_util.EmbeddedRedis``, AOF on,
``appendfsync always``, in a tmp dir), stopped at the end of the session. With env
``REDIS_URL`` set, that server is used instead and nothing is started; it must be a
DISPOSABLE database: ``redis_client`` flushes it before every test.

``redis_client`` (function): the db is flushed, then a ``redis.asyncio.Redis`` on it is
yielded. Asyncio connections belong to the event loop that opened them, so drive the test
with ``run(fn, client)``: it runs ``fn(client)`` under ``asyncio.run`` and closes the
client inside that same loop.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import pytest
import redis
import redis.asyncio as aioredis

from cde.redis_util import EmbeddedRedis


@dataclass
class ExternalRedis:
    """Stand-in for EmbeddedRedis when REDIS_URL is given: a URL and no process control."""
    url: str


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    url = os.environ.get("REDIS_URL")
    if url:
        yield ExternalRedis(url)
        return
    server = EmbeddedRedis(aof=True, appendfsync="always",
                           data_dir=tmp_path_factory.mktemp("redis-data"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def flush(url: str) -> None:
    c = redis.Redis.from_url(url)
    try:
        c.flushdb()
    finally:
        c.close()


@pytest.fixture
def redis_client(redis_server):
    flush(redis_server.url)
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    try:  # no-op when run() already closed it
        asyncio.run(client.aclose())
    except Exception:
        pass


def run(fn, client):
    """``asyncio.run(fn(client))``, closing ``client`` in the same loop afterwards."""
    async def main():
        try:
            return await fn(client)
        finally:
            await client.aclose()
    return asyncio.run(main())
