"""CLI: python -m attribution_svc --model-dir DIR [--host H] [--port P].

Environment fallbacks: CDE_MODEL_DIR, CDE_ATTRIBUTION_HOST, CDE_ATTRIBUTION_PORT.
"""

from __future__ import annotations

import argparse

from attribution_svc.service import DEFAULT_PORT, serve
from cde.rpc.serving import model_service_args, run_main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return model_service_args("python -m attribution_svc", "cde.v1.Attribution gRPC service", "ATTRIBUTION", DEFAULT_PORT, argv)


def main(argv: list[str] | None = None) -> None:
    run_main(serve, parse_args(argv))


if __name__ == "__main__":
    main()
