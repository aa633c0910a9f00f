"""CLI: python -m attribution_svc --model-dir DIR [--host H] [--port P].

Environment fallbacks: CDE_MODEL_DIR, CDE_ATTRIBUTION_HOST, CDE_ATTRIBUTION_PORT.
"""

from __future__ import annotations

import argparse
import os

from attribution_svc.service import DEFAULT_PORT, serve
from cde.rpc.serving import run_main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m attribution_svc", description="cde.v1.Attribution gRPC service")
    ap.add_argument("--model-dir", default=os.environ.get("CDE_MODEL_DIR"),
                    help="model directory with config.json and the checkpoint (env CDE_MODEL_DIR)")
    ap.add_argument("--host", default=os.environ.get("CDE_ATTRIBUTION_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("CDE_ATTRIBUTION_PORT", DEFAULT_PORT)))
    ap.add_argument("--grace", type=float, default=5.0, help="seconds to drain calls on SIGTERM/SIGINT")
    args = ap.parse_args(argv)
    if not args.model_dir:
        ap.error("--model-dir (or CDE_MODEL_DIR) is required")
    return args


def main(argv: list[str] | None = None) -> None:
    run_main(serve, parse_args(argv))


if __name__ == "__main__":
    main()
