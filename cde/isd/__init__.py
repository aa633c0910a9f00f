"""Introspective Strided Decoding (I-DLM): the verify rule, its Triton kernel, reference decoders.

See docs/ISD.md. ``verify`` holds the acceptance rule (torch, float64
reference, Triton), ``decoder`` the plain full-recompute AR and ISD decoders the engine
must match, ``toy`` a hand-built model whose mask positions draft well (for tests).
"""

from cde.isd.decoder import (PROPOSALS, DecodeStats, Generation, generate_ar, generate_ar_batch, generate_isd,
                             generate_isd_batch)
from cde.isd.verify import onehot_logits, verify_reference, verify_torch, verify_triton

__all__ = [
    "PROPOSALS", "DecodeStats", "Generation", "generate_ar", "generate_ar_batch", "generate_isd",
    "generate_isd_batch", "onehot_logits", "verify_reference", "verify_torch", "verify_triton",
]
