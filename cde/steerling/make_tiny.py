"""Write the bundled tiny Steerling checkpoint (random weights, seeded, fp32).

    python -m cde.steerling.make_tiny models/steerling-tiny

The output is deterministic: the same seed gives the same bytes, so a test can check that
the committed checkpoint is the one this script makes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cde.steerling.config import TINY
from cde.steerling.loading import save_model
from cde.steerling.model import SteerlingModel

SEED = 20261130


def make_tiny(directory: str | Path, seed: int = SEED) -> list[Path]:
    model = SteerlingModel(TINY).init_random(seed, std=0.05)
    return save_model(model, directory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("directory", nargs="?", default="models/steerling-tiny")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    for path in make_tiny(args.directory, args.seed):
        print(path)


if __name__ == "__main__":
    main()
