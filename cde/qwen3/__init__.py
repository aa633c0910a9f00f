"""Causal LMs in the Qwen3 / SDAR layout (I-DLM): config, model, loading, LoRA, tokenizer."""

from cde.qwen3.config import IDLM_8B, PRESETS, TINY, Qwen3Config, preset
from cde.qwen3.loading import load_lora, load_qwen3, save_qwen3
from cde.qwen3.lora import LoraAdapter, attach_lora, detach_lora, read_adapter
from cde.qwen3.model import AttendFn, Qwen3Model, causal_attend, masked_attend
from cde.qwen3.tokenizer import Qwen3Tokenizer, load_tokenizer

__all__ = [
    "IDLM_8B", "PRESETS", "TINY", "AttendFn", "LoraAdapter", "Qwen3Config", "Qwen3Model", "Qwen3Tokenizer",
    "attach_lora", "causal_attend", "detach_lora", "load_lora", "load_qwen3", "load_tokenizer",
    "masked_attend", "preset", "read_adapter", "save_qwen3",
]
