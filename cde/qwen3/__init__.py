"""Causal LMs in the Qwen3 / SDAR layout (I-DLM): config, model, loading, LoRA, tokenizer.

Import the submodules (`cde.qwen3.config`, `.model`, `.loading`, `.lora`, `.tokenizer`,
`.chat`); the package itself imports nothing, so torch-free users (the gateway reads the
config and the tokenizer) never load torch.
"""
