"""Parity of cde.qwen3 (I-DLM / Qwen3 layout) with transformers' Qwen3 and with PEFT LoRA.

Every test builds tiny models with fresh random weights (the seed is in each failure
message), saves them the way transformers / PEFT do, loads them with our loaders and
compares logits. Also: the R-ISD gate semantics, error reporting for bad checkpoints and
adapters, the 8B preset's parameter count, and the tokenizer's special-token rule.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers  # noqa: E402
from tokenizers import models as tok_models  # noqa: E402

from cde.checkpoint import CheckpointError, save_checkpoint  # noqa: E402
from cde.qwen3 import lora as lora_mod  # noqa: E402
from cde.qwen3.config import IDLM_8B, TINY, Qwen3Config, preset  # noqa: E402
from cde.qwen3.loading import load_lora, load_qwen3, save_qwen3  # noqa: E402
from cde.qwen3.model import Qwen3Model, masked_attend  # noqa: E402
from cde.qwen3.tokenizer import Qwen3Tokenizer, load_tokenizer  # noqa: E402
from tests.numerics import rel_err  # noqa: E402

pytestmark = pytest.mark.parity

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 256
TOL = 1e-5


def hf_config(tied: bool, rope_theta: float = 1_000_000.0, **kw) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=rope_theta,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, attn_implementation="eager", **kw)


def build_hf(cfg: transformers.Qwen3Config, seed: int) -> transformers.Qwen3ForCausalLM:
    """transformers' model with random weights, norm weights included (not all ones)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model


def hf_logits(model, tokens, positions=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, position_ids=positions).logits


def random_tokens(seed: int, b: int = 3, t: int = 17) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed + 1))


# ---------------------------------------------------------------------------------------
# Base model: logits equal transformers' on the same weights


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tmp_path, tied, seed):
    hf = build_hf(hf_config(tied, rope_theta=10_000.0 if tied else 1_000_000.0), seed)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in names) != tied, f"seed={seed}: unexpected HF layout {sorted(names)[:3]}"

    ours = load_qwen3(tmp_path, torch.float32, "cpu")
    assert ours.cfg.tie_word_embeddings == tied
    if tied:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    tokens = random_tokens(seed)
    with torch.no_grad():
        got = ours(tokens)
    err = rel_err(got, hf_logits(hf, tokens))
    assert err <= TOL, f"seed={seed}: logits rel err {err:.3g}"

    # Explicit positions (large, different per row) go through RoPE exactly as HF's position_ids.
    b, t = tokens.shape
    positions = torch.arange(t).expand(b, t) + torch.tensor([[0], [1000], [3000]])
    with torch.no_grad():
        got = ours(tokens, positions)
    err = rel_err(got, hf_logits(hf, tokens, positions))
    assert err <= TOL, f"seed={seed}: logits with offset positions rel err {err:.3g}"


def test_sharded_checkpoint_and_save_roundtrip(tmp_path, seed):
    hf = build_hf(hf_config(False), seed)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = load_qwen3(tmp_path / "hf")
    tokens = random_tokens(seed)
    ref = hf_logits(hf, tokens)
    with torch.no_grad():
        assert rel_err(ours(tokens), ref) <= TOL, f"seed={seed}"

    # Ours -> disk -> transformers: same function again.
    save_qwen3(ours, tmp_path / "ours", max_shard_bytes=50_000)
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    err = rel_err(hf_logits(back, tokens), ref)
    assert err <= TOL, f"seed={seed}: transformers reading our checkpoint, rel err {err:.3g}"


def test_bf16_equals_transformers_sdpa(tmp_path, seed):
    """In bf16 we follow transformers' op order (RMSNorm cast before the weight multiply, RoPE
    in the activation dtype, fp32 frequencies), so logits equal its SDPA path bit for bit."""
    build_hf(hf_config(False), seed).save_pretrained(tmp_path, safe_serialization=True)
    ours = load_qwen3(tmp_path, torch.bfloat16)
    assert ours.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert ours.rope_inv_freq.dtype == torch.float32
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                       attn_implementation="sdpa").eval()
    tokens = random_tokens(seed)
    with torch.no_grad():
        got = ours(tokens)
    ref = hf_logits(hf, tokens)
    assert got.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(got, ref), f"seed={seed}: bf16 logits differ, rel err {rel_err(got, ref):.3g}"
    # .to(dtype) must not round the RoPE frequencies
    assert ours.to(torch.float16).rope_inv_freq.dtype == torch.float32


def test_checkpoint_errors_name_the_tensor(tmp_path, seed):
    hf = build_hf(hf_config(False), seed)
    hf.config.save_pretrained(tmp_path)
    state = {k: v.clone() for k, v in hf.state_dict().items()}

    bad = dict(state)
    del bad["model.layers.1.mlp.up_proj.weight"]
    save_checkpoint(bad, tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_qwen3(tmp_path)

    bad = dict(state)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_checkpoint(bad, tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight: expected shape \(32, 64\)"):
        load_qwen3(tmp_path)

    bad = {k: v for k, v in state.items() if k != "lm_head.weight"}  # untied config needs the head
    save_checkpoint(bad, tmp_path)
    with pytest.raises(CheckpointError, match=r"missing tensor lm_head\.weight"):
        load_qwen3(tmp_path)

    bad = dict(state, **{"model.layers.0.extra.weight": torch.zeros(2)})
    save_checkpoint(bad, tmp_path)
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.0\.extra\.weight"):
        load_qwen3(tmp_path)

    with pytest.raises(FileNotFoundError, match="config.json"):
        load_qwen3(tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------
# LoRA: equal to PEFT, and the R-ISD gate


LORA_CASES = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS),
    "rslora-partial": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                           layers_to_transform=[1]),
    "patterns": dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS, rank_pattern={"q_proj": 4},
                     alpha_pattern={"layers.0.mlp.down_proj": 64}),
}


def make_adapter(tmp_path, seed, case="all-r8", tied=False):
    """Base checkpoint + PEFT adapter on disk; returns (tokens, base logits, PEFT logits)."""
    hf = build_hf(hf_config(tied), seed)
    hf.save_pretrained(tmp_path / "base", safe_serialization=True)
    tokens = random_tokens(seed)
    base = hf_logits(hf, tokens)
    peft_model = get_peft_model(hf, LoraConfig(lora_dropout=0.0, **LORA_CASES[case])).eval()
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT initialises B to zero: the adapter would be a no-op
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(tmp_path / "adapter", safe_serialization=True)
    with torch.no_grad():
        adapted = peft_model(input_ids=tokens).logits
    assert rel_err(adapted, base) > 1e-3, f"seed={seed}: the adapter does not change the logits"
    return tokens, base, adapted


@pytest.mark.parametrize("case", sorted(LORA_CASES))
def test_lora_matches_peft_and_gate_semantics(tmp_path, case, seed):
    tokens, base_ref, peft_ref = make_adapter(tmp_path, seed, case)
    ours = load_qwen3(tmp_path / "base")
    with torch.no_grad():
        base = ours(tokens)
        assert rel_err(base, base_ref) <= TOL, f"seed={seed}"

        load_lora(tmp_path / "adapter", ours)
        n_expected = {"all-r8": 14, "rslora-partial": 3, "patterns": 14}[case]
        assert len(lora_mod.attached_modules(ours)) == n_expected, f"seed={seed}"
        full = ours(tokens)
        err = rel_err(full, peft_ref)
        assert err <= TOL, f"seed={seed}: LoRA logits vs PEFT rel err {err:.3g}"

        b, t = tokens.shape
        assert torch.equal(ours(tokens, lora_gate=torch.ones(b, t)), full), f"seed={seed}: gate=1 != gate=None"
        assert torch.equal(ours(tokens, lora_gate=torch.zeros(b, t)), base), f"seed={seed}: gate=0 != base model"

        # Mixed gate (R-ISD: LoRA only at [MASK] positions). Causality: every position before a
        # row's first gated position is exactly the base model; the gated ones and later differ.
        first = [5, 11, 16]
        gate = torch.zeros(b, t)
        for row, g in enumerate(first):
            gate[row, g::2] = 1.0
        mixed = ours(tokens, lora_gate=gate)
        for row, g in enumerate(first):
            assert torch.equal(mixed[row, :g], base[row, :g]), f"seed={seed}: row {row} before {g} != base"
            for pos in range(g, t):
                diff = float((mixed[row, pos] - base[row, pos]).abs().max())
                assert diff > 1e-6, f"seed={seed}: row {row} position {pos} unaffected by the LoRA"

        # Bool gate = float gate; detaching restores the base model exactly.
        assert torch.equal(ours(tokens, lora_gate=gate.bool()), mixed)
        lora_mod.detach_lora(ours)
        assert torch.equal(ours(tokens), base), f"seed={seed}"


def test_lora_tied_and_paged_style_attend(tmp_path, seed):
    """Tied head + adapter, driven through hidden_states/logits with a custom attend."""
    tokens, _, peft_ref = make_adapter(tmp_path, seed, "all-r8", tied=True)
    ours = load_lora(tmp_path / "adapter", load_qwen3(tmp_path / "base"))
    b, t = tokens.shape
    positions = torch.arange(t).expand(b, t)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None].expand(b, 1, t, t)
    seen = []

    def attend(layer, q, k, v):
        seen.append(layer)
        return masked_attend(mask)(layer, q, k, v)

    with torch.no_grad():
        got = ours.logits(ours.hidden_states(tokens, positions, attend))
    assert seen == [0, 1]
    assert rel_err(got, peft_ref) <= TOL, f"seed={seed}"


def test_lora_errors_name_the_tensor(tmp_path, seed):
    tokens, _, _ = make_adapter(tmp_path, seed, "all-r8")
    ours = load_qwen3(tmp_path / "base")
    adapter = tmp_path / "adapter"
    weights = adapter / "adapter_model.safetensors"
    good = load_file(weights)
    key = "base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight"
    assert key in good, sorted(good)[:4]

    save_file({k: v for k, v in good.items() if k != key}, weights)
    with pytest.raises(CheckpointError, match=rf"missing LoRA tensor {key.replace('.', r'[.]')}"):
        load_lora(adapter, ours)

    save_file(dict(good, **{key: torch.zeros(128, 4)}), weights)
    with pytest.raises(CheckpointError, match=rf"{key.replace('.', r'[.]')}: expected shape \(128, 8\)"):
        load_lora(adapter, ours)

    save_file(dict(good, **{"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}), weights)
    with pytest.raises(CheckpointError, match=r"unexpected.*lm_head\.lora_A"):
        load_lora(adapter, ours)
    assert lora_mod.attached_modules(ours) == [], "a failed load must attach nothing"

    save_file(good, weights)
    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(dict(cfg, use_dora=True)))
    with pytest.raises(ValueError, match="use_dora"):
        load_lora(adapter, ours)
    cfg_path.write_text(json.dumps(dict(cfg, target_modules=["q_proj", "lm_head"])))
    with pytest.raises(ValueError, match="lm_head"):
        load_lora(adapter, ours)
    cfg_path.write_text(json.dumps(cfg))
    load_lora(adapter, ours)
    assert len(lora_mod.attached_modules(ours)) == 14

    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_lora(tmp_path / "nowhere", ours)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        load_lora(adapter, ours)


# ---------------------------------------------------------------------------------------
# Config and the 8B preset


# The I-DLM-8B config.json (SDARForCausalLM), as released.
IDLM_8B_JSON = {
    "architectures": ["SDARForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288, "mask_token_id": 151669,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "sdar", "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": False, "use_sliding_window": False, "vocab_size": 151936,
}


def test_idlm_8b_preset_has_qwen3_8b_parameters():
    assert Qwen3Config.from_hf_config(IDLM_8B_JSON) == IDLM_8B == preset("idlm-8b")
    with torch.device("meta"):
        ours = Qwen3Model(IDLM_8B)
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**IDLM_8B.to_hf_config()))
    hf_count = sum(p.numel() for p in hf.parameters())
    assert ours.num_parameters() == hf_count == 8_190_735_360
    ours_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert ours_shapes == hf_shapes


def test_config_roundtrip_and_rejections(tmp_path):
    for cfg in (TINY, IDLM_8B, TINY.replace(tie_word_embeddings=True, eos_token_ids=(1, 2), mask_token_id=None,
                                            architecture="Qwen3ForCausalLM")):
        assert Qwen3Config.from_hf_config(cfg.to_hf_config()) == cfg
        hf = transformers.Qwen3Config(**cfg.to_hf_config())
        assert Qwen3Config.from_hf_config(hf.to_dict()).replace(architecture=cfg.architecture) == cfg
    # generation_config.json's eos ids join config.json's
    IDLM_8B.save(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert Qwen3Config.load(tmp_path).eos_token_ids == (151645, 151643)

    v5 = {k: v for k, v in IDLM_8B_JSON.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}  # transformers >= 5 layout
    assert Qwen3Config.from_hf_config(v5) == IDLM_8B
    with pytest.raises(ValueError, match="rope_parameters"):
        Qwen3Config.from_hf_config(dict(v5, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}))
    with pytest.raises(ValueError, match="rope_scaling"):
        Qwen3Config.from_hf_config(dict(IDLM_8B_JSON, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="sliding"):
        Qwen3Config.from_hf_config(dict(IDLM_8B_JSON, use_sliding_window=True, sliding_window=4096,
                                        max_window_layers=20))
    with pytest.raises(ValueError, match="full attention"):
        Qwen3Config.from_hf_config(dict(IDLM_8B_JSON, layer_types=["sliding_attention"] * 36))
    with pytest.raises(ValueError, match="architecture"):
        Qwen3Config.from_hf_config(dict(IDLM_8B_JSON, architectures=["LlamaForCausalLM"], model_type="llama"))
    with pytest.raises(ValueError, match="mask_token_id"):
        TINY.replace(mask_token_id=TINY.vocab_size)


# ---------------------------------------------------------------------------------------
# Tokenizer


def write_tokenizer(path) -> tuple[Tokenizer, int, int]:
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over <|MASK|> the lazy dog"] * 20, trainer)
    tok.add_special_tokens(["<|MASK|>"])
    tok.add_tokens(["<think>", "<|notspecial|>"])  # added, not special
    tok.save(str(path))
    return tok, tok.token_to_id("<|MASK|>"), tok.token_to_id("<|notspecial|>")


def test_tokenizer_never_emits_special_ids(tmp_path):
    raw, mask_id, notspecial_id = write_tokenizer(tmp_path / "tokenizer.json")
    text = "hello <|MASK|> world <|endoftext|><|notspecial|> <think> héllo ✓ 日本"
    # The library's default DOES turn the spelling into the special id, even without specials.
    assert mask_id in raw.encode(text, add_special_tokens=False).ids

    cfg = TINY.replace(mask_token_id=notspecial_id)  # protected although the file says not special
    tok = load_tokenizer(tmp_path, cfg)
    ids = tok.encode(text)
    assert not set(ids) & tok.special_ids, ids
    assert {mask_id, notspecial_id, raw.token_to_id("<|endoftext|>")} <= tok.special_ids
    assert raw.token_to_id("<think>") in ids  # non-special added tokens behave as in transformers
    assert tok.decode(ids) == text
    for s in ["", "plain text", "<|MASK|><|MASK|>", "a\ud800b", "<|MASK", "  spaces \n\t newline"]:
        assert tok.decode(tok.encode(s)) == s.replace("\ud800", "\ufffd"), s

    # Ordinary text: same ids as the library and as transformers' fast tokenizer.
    plain = "the quick brown fox, hello world!"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert tok.encode(plain) == raw.encode(plain, add_special_tokens=False).ids == fast.encode(
        plain, add_special_tokens=False)

    with_mask = tok.encode_with_specials("hello <|MASK|>")
    assert with_mask[-1] == mask_id
    assert tok.decode(with_mask) == "hello "
    assert tok.decode(with_mask, skip_special=False) == "hello <|MASK|>"
    with pytest.raises(ValueError, match="not assigned"):
        tok.decode([tok.vocab_size + 5])


def test_tokenizer_file_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"tok\.json"):
        Qwen3Tokenizer(tmp_path / "tok.json")
