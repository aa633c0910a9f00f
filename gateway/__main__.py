"""`python -m gateway --model-dir models/steerling-tiny ...` (flags fall back to CDE_* env vars).

`--processes N` (N > 1) runs a supervisor and N gateway processes sharing both ports
(gateway/processes.py); a child of that supervisor takes this entry point too."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import fields

from gateway import processes
from gateway.server import GatewaySettings, check_settings, serve_until_signalled


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    defaults = GatewaySettings()
    for f in fields(GatewaySettings):
        flag = "--" + f.name.replace("_", "-")
        # default None so GatewaySettings.from_mapping can tell "not given" from a value and use the env
        p.add_argument(flag, type=type(f.default), default=None,
                       help=f"(env CDE_{f.name.upper()}; default {getattr(defaults, f.name)!r})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    if processes.is_child():
        processes.child_main()
        return
    settings = GatewaySettings.from_mapping(vars(parse_args(argv)))
    try:
        check_settings(settings)
    except ValueError as e:
        sys.exit(f"python -m gateway: {e}")
    fmt = "%(asctime)s %(name)s %(levelname)s %(message)s"
    logging.basicConfig(level=settings.log_level.upper(), format=fmt)
    if settings.processes > 1:
        sys.exit(processes.run(settings))
    asyncio.run(serve_until_signalled(settings))


if __name__ == "__main__":
    main()
