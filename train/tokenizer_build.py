"""The bundled models' tokenizer: a byte-level BPE of `VOCAB_SIZE` ids trained with `tokenizers`
on the story + prose mix, saved as one `tokenizer.json` for both model families.

Ids 0..10 are the special tokens (`SPECIALS`): the Steerling ones (`<|endoftext|>`, pad, bos,
`<|endofchunk|>`, `<|mask|>`, the Llama-3-style header ids and `<|eot_id|>`) and, for the causal
(I-DLM) family, ChatML's `<|im_start|>` / `<|im_end|>` and its mask `<|MASK|>`. Then the 256
byte tokens, then merges. No normalizer: decoding gives back the exact bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

VOCAB_SIZE = 8192
SPECIALS = (
    "<|endoftext|>", "<|pad|>", "<|bos|>", "<|endofchunk|>", "<|mask|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_start|>", "<|im_end|>", "<|MASK|>",
)
SPECIAL_IDS = {s: i for i, s in enumerate(SPECIALS)}


def train_tokenizer(texts: Iterable[str], out: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer)
    for s, i in SPECIAL_IDS.items():
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s} got id {tok.token_to_id(s)}, expected {i}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out
