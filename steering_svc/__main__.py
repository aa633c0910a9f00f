"""CLI: python -m steering_svc --model-dir DIR [--host H] [--port P].

Environment fallbacks: CDE_MODEL_DIR, CDE_STEERING_HOST, CDE_STEERING_PORT.
"""

from __future__ import annotations

import argparse

from cde.rpc.serving import model_service_args, run_main
from steering_svc.service import DEFAULT_PORT, serve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return model_service_args("python -m steering_svc", "cde.v1.Steering gRPC service", "STEERING", DEFAULT_PORT, argv)


def main(argv: list[str] | None = None) -> None:
    run_main(serve, parse_args(argv))


if __name__ == "__main__":
    main()
