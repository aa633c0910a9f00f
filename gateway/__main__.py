"""`python -m gateway --model-dir models/steerling-tiny ...` (flags fall back to CDE_* env vars)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import fields

from gateway.server import GatewaySettings, serve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    defaults = GatewaySettings()
    for f in fields(GatewaySettings):
        flag = "--" + f.name.replace("_", "-")
        # default None so GatewaySettings.from_mapping can tell "not given" from a value and use the env
        p.add_argument(flag, type=type(f.default), default=None,
                       help=f"(env CDE_{f.name.upper()}; default {getattr(defaults, f.name)!r})")
    return p.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    settings = GatewaySettings.from_mapping(vars(args))
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    handle = await serve(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, asyncio.ensure_future(handle.wait())}, return_when=asyncio.FIRST_COMPLETED)
    await handle.stop()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(_main(parse_args(argv)))


if __name__ == "__main__":
    main()
