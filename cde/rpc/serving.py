"""What every service process does around its server: logging setup, run until a signal.

Kept here so the five `python -m <service>` entry points share one shutdown path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable


def configure_logging() -> None:
    logging.basicConfig(level=os.environ.get("CDE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def wait_for_shutdown_signal() -> None:
    """Return on SIGTERM or SIGINT (the caller then goes NOT_SERVING and drains)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def run_main(serve: Callable[..., Awaitable[None]], args) -> None:
    """`python -m <service>`: configure logging, then serve until a shutdown signal."""
    configure_logging()
    asyncio.run(serve(args))
