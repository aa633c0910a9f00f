"""Write the bundled tiny I-DLM (Qwen3/SDAR layout) checkpoint: random weights, seeded, fp32,
and a byte-level `tokenizer.json` with Qwen's special tokens, so the causal serving path
(decode.stride) runs end to end on a CPU.

    python -m cde.qwen3.make_tiny models/idlm-tiny

Deterministic: the same seed gives the same bytes (a test checks the committed files).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cde.qwen3.chat import write_byte_tokenizer
from cde.qwen3.config import TINY
from cde.qwen3.loading import save_qwen3
from cde.qwen3.model import Qwen3Model
from cde.qwen3.tokenizer import TOKENIZER_FILE

SEED = 20261130
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")   # ids 256..259
CONFIG = TINY.replace(vocab_size=260, bos_token_id=256, eos_token_ids=(258, 256), mask_token_id=259,
                      max_positions=2048)


def make_tiny(directory: str | Path, seed: int = SEED) -> list[Path]:
    directory = Path(directory)
    ids = write_byte_tokenizer(directory / TOKENIZER_FILE, SPECIALS)
    assert [ids[s] for s in SPECIALS] == [256, 257, 258, 259], ids
    model = Qwen3Model(CONFIG).init_random(seed, std=0.05)
    return [directory / TOKENIZER_FILE, *save_qwen3(model, directory)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("directory", nargs="?", default="models/idlm-tiny")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    for path in make_tiny(args.directory, args.seed):
        print(path)


if __name__ == "__main__":
    main()
