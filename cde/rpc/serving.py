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


async def serve_until_signal(running, name: str, grace: float) -> None:
    """Serve `running` (anything with `async stop(grace)`) until SIGTERM/SIGINT, then stop it:
    NOT_SERVING, and in-flight calls get `grace` seconds to drain."""
    try:
        await wait_for_shutdown_signal()
    finally:
        logging.getLogger(name).info("shutting down")
        await running.stop(grace)


def run_main(serve: Callable[..., Awaitable[None]], args) -> None:
    """`python -m <service>`: configure logging, then serve until a shutdown signal."""
    configure_logging()
    asyncio.run(serve(args))


def model_service_args(prog: str, description: str, env_prefix: str, default_port: int,
                       argv: list[str] | None = None):
    """Flags of a service that serves one model directory: --model-dir --host --port --grace,
    with CDE_MODEL_DIR / CDE_<PREFIX>_HOST / CDE_<PREFIX>_PORT fallbacks."""
    import argparse

    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--model-dir", default=os.environ.get("CDE_MODEL_DIR"),
                    help="model directory with config.json and the checkpoint (env CDE_MODEL_DIR)")
    ap.add_argument("--host", default=os.environ.get(f"CDE_{env_prefix}_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get(f"CDE_{env_prefix}_PORT", default_port)))
    ap.add_argument("--grace", type=float, default=5.0, help="seconds to drain calls on SIGTERM/SIGINT")
    args = ap.parse_args(argv)
    if not args.model_dir:
        ap.error("--model-dir (or CDE_MODEL_DIR) is required")
    return args


async def start_then_load(server, health, host: str, port: int, load: Callable[[], object]):
    """Bind and start `server` first (health answers NOT_SERVING meanwhile), then run the blocking
    `load()` in a thread, then report SERVING. Returns (bound port, what load returned); stops the
    server and re-raises when binding or loading fails."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise RuntimeError(f"cannot bind {host}:{port}")
    await server.start()
    try:
        loaded = await asyncio.to_thread(load)
    except BaseException:
        await server.stop(None)
        raise
    await health.set_serving(True)
    return bound, loaded
