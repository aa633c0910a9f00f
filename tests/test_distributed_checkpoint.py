"""The published Steerling directory layout, built with the public package's own code path.

Each directory here is what Guide Labs' writers make, at tiny sizes: a flat `config.json`
with the field list of the package's Hugging Face writer (`build_config_json`:
`model_type` "steerling", architecture and concept keys at the top level, token ids from the
package's `SteerlingTokenizer`, `vocab_size` from that tokenizer), `tokenizer_config.json`
with its tokenizer writer's ids, the package model's state dict with the tied
`transformer.lm_head.weight` dropped (its converter), single-file or sharded + index. The
package model is then built from that same config.json the way its remote code does
(`topk=topk_known`, `topk_features=topk_known_features`, `block_size=concept_block_size`)
and loaded with its own `load_state_dict`; ours loads the directory through
`cde.steerling.loading` and the services' entry points, and the two are compared.

The package's tokenizer calls `tiktoken.get_encoding("cl100k_base")`, a download; offline we
hand it a synthetic encoding with cl100k's exact id layout (100,256 ranks, <|endoftext|> at
100257, n_vocab 100,277), and write the same ranks as the directory's `cl100k_base.tiktoken`,
so both tokenizers produce the real special ids (base vocabulary 100,281, instruct 100,284).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from cde.checkpoint import CheckpointError
from cde.model_family import STEERLING, model_family
from cde.steerling import attribution as attr
from cde.steerling import steering as st
from cde.steerling.config import TINY, ConfigError, SteerlingConfig
from cde.steerling.loading import LM_HEAD, TOK_EMB, load_model, save_model
from cde.steerling.model import KnownIntervention, SteeringInputs
from cde.steerling.reference_decoder import generate
from cde.steerling.sampling import SamplingParams
from cde.steerling.tokenizer import CL100K_PAT_STR, load_model_tokenizer
from tests.numerics import rel_err
from tests.options import decode_options
from tests.oracle import assert_same_topk
from tests.seeding import draw_seed

pytestmark = pytest.mark.parity
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
N_RANKS = 100_256
CL100K_SPECIALS = {"<|endoftext|>": 100_257, "<|fim_prefix|>": 100_258, "<|fim_middle|>": 100_259,
                   "<|fim_suffix|>": 100_260, "<|endofprompt|>": 100_276}
TINY_ARCH = dict(interpretable=True, n_layers=2, n_head=4, n_embd=32, n_kv_heads=2, block_size=256)
# topk_known < topk_known_features: the features mix 12 known concepts, 4 are recorded
TINY_CONCEPT = dict(n_concepts=40, n_unknown_concepts=100, concept_dim=32, topk_known=4, topk_known_features=12,
                    unknown_topk=8, factorize_rank=16, block_size=16, pad_multiple=16)

# The keys of the package's HF writer's config.json (build_config_json), in its order.
WRITER_KEYS = (
    "model_type", "auto_map", "architectures", "interpretable", "vocab_size", "n_layers", "n_head", "n_embd",
    "n_kv_heads", "block_size", "diff_block_size", "use_rms_norm", "norm_eps", "norm_order", "use_qk_norm",
    "use_rope", "rope_base", "rope_full_precision", "clip_qkv", "mlp_type", "activation", "mlp_ratio",
    "intermediate_size", "use_bias", "weight_sharing", "pad_token_id", "bos_token_id", "eos_token_id",
    "mask_token_id", "endofchunk_token_id", "n_concepts", "n_unknown_concepts", "concept_dim",
    "use_attention_known", "use_attention_unknown", "topk_known", "topk_known_features", "unknown_topk",
    "use_unknown", "apply_topk_to_unknown", "topk_on_logits", "factorize_unknown", "factorize_rank",
    "use_epsilon_correction", "concept_block_size", "pad_multiple", "store_unknown_weights", "inject_layer",
    "inject_alpha", "torch_dtype", "transformers_version",
)
INSTRUCT_KEYS = ("start_header_id", "end_header_id", "eot_id")


@pytest.fixture(autouse=True)
def _directory_bpe_only(monkeypatch):
    """These directories carry a synthetic BPE table with cl100k's id layout (the package's side
    uses the same table): CDE_CL100K_BPE, which the test command sets to the real file, would
    give our side the real ranks instead."""
    monkeypatch.delenv("CDE_CL100K_BPE", raising=False)


# ---- the package's code path ---------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    table = {bytes([b]): b for b in range(256)}
    table.update({i.to_bytes(3, "big"): 256 + i for i in range(N_RANKS - 256)})
    return table


@contextlib.contextmanager
def offline_cl100k(ranks: dict[bytes, int]):
    """tiktoken.get_encoding('cl100k_base') without the download (see the module docstring)."""
    import tiktoken

    enc = tiktoken.Encoding(name="cl100k_base", pat_str=CL100K_PAT_STR, mergeable_ranks=ranks,
                            special_tokens=CL100K_SPECIALS)
    with mock.patch.object(tiktoken, "get_encoding", lambda name: enc):
        yield


_PACKAGE_TOKENIZERS: dict[bool, object] = {}


def package_tokenizer(ranks, instruct: bool):
    """The package's SteerlingTokenizer (built once per variant: 100k ranks take a while)."""
    from steerling.data.tokenizer import SteerlingTokenizer

    if instruct not in _PACKAGE_TOKENIZERS:
        with offline_cl100k(ranks):
            _PACKAGE_TOKENIZERS[instruct] = SteerlingTokenizer(instruct=instruct)
    return _PACKAGE_TOKENIZERS[instruct]


def writer_config(arch: dict, concept: dict, tok, instruct: bool) -> dict:
    """config.json as the package's HF writer builds it: the package configs' defaults
    overlaid with the given fields, the token ids and vocab_size from its tokenizer."""
    from steerling.configs.causal_diffusion import CausalDiffusionConfig
    from steerling.configs.concept import ConceptConfig

    a = {n: f.default for n, f in CausalDiffusionConfig.model_fields.items() if not f.is_required()} | arch
    c = {n: f.default for n, f in ConceptConfig.model_fields.items() if not f.is_required()} | concept
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               mask_token_id=tok.mask_token_id, endofchunk_token_id=tok.endofchunk_token_id)
    out: dict = {}
    for key in WRITER_KEYS:
        if key == "model_type":
            out[key] = "steerling"
        elif key == "auto_map":
            out[key] = {"AutoConfig": "configuration_steerling.SteerlingConfig",
                        "AutoModel": "modeling_steerling.SteerlingForCausalLM"}
        elif key == "architectures":
            out[key] = ["SteerlingForCausalLM"]
        elif key == "vocab_size":
            out[key] = tok.vocab_size
        elif key in ids:
            out[key] = ids[key]
        elif key == "concept_block_size":
            out[key] = c["block_size"]
        elif key == "torch_dtype":
            out[key] = "bfloat16"
        elif key == "transformers_version":
            out[key] = "4.48.0"
        else:
            out[key] = a[key] if key in a else c[key]
    if instruct:
        out.update(start_header_id=tok.start_header_id, end_header_id=tok.end_header_id, eot_id=tok.eot_id)
    return out


def tokenizer_config(tok, instruct: bool) -> dict:
    """tokenizer_config.json's id fields as the package's writer emits them."""
    out = {"tokenizer_class": "SteerlingTokenizer", "encoding_name": "cl100k_base",
           "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "endofchunk_token_id": tok.endofchunk_token_id, "mask_token_id": tok.mask_token_id}
    if instruct:
        out.update(start_header_id=tok.start_header_id, end_header_id=tok.end_header_id, eot_id=tok.eot_id)
    return out


def package_model(flat: dict):
    """The package's model as its remote code builds it from a flat config.json."""
    from steerling.configs.causal_diffusion import CausalDiffusionConfig
    from steerling.configs.concept import ConceptConfig
    from steerling.models.interpretable.interpretable_causal_diffusion import InterpretableCausalDiffusionLM

    arch = {k: flat[k] for k in CausalDiffusionConfig.model_fields if k in flat and k != "model_type"}
    concept = {k: flat[k] for k in ConceptConfig.model_fields if k in flat}
    concept["block_size"] = flat["concept_block_size"]
    return InterpretableCausalDiffusionLM(CausalDiffusionConfig(**arch), ConceptConfig(**concept),
                                          flat["vocab_size"]).eval()


def randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def write_bpe(path: Path, ranks: dict[bytes, int]) -> None:
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))


def write_shards(state: dict[str, torch.Tensor], directory: Path, shard_bytes: int | None) -> None:
    """The converter's save: one model.safetensors, or shards in order + index past the limit."""
    state = {k: v.contiguous() for k, v in state.items()}
    total = sum(v.numel() * v.element_size() for v in state.values())
    if shard_bytes is None or total <= shard_bytes:
        save_file(state, str(directory / "model.safetensors"))
        return
    shards: list[dict] = [{}]
    used = 0
    for k, v in state.items():
        size = v.numel() * v.element_size()
        if used + size > shard_bytes and shards[-1]:
            shards.append({})
            used = 0
        shards[-1][k] = v
        used += size
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name))
        weight_map.update({k: name for k in shard})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def load_package_weights(model, directory: Path) -> None:
    """The package's own loader: every *.safetensors, strict=False, then the tie restored."""
    from steerling.inference.checkpoint_utils import load_state_dict

    missing, unexpected = model.load_state_dict(load_state_dict(str(directory)), strict=False)
    assert not unexpected and all("lm_head" in k or "tok_emb" in k for k in missing), (missing, unexpected)
    model.transformer._restore_weight_tying()


@pytest.fixture
def make_dir(tmp_path, ranks):
    """Build a distributed directory; returns (dir, flat config, package model, package tokenizer)."""
    counter = iter(range(100))

    def build(*, instruct: bool = False, arch: dict | None = None, concept: dict | None = None,
              spelling: str = "tok_emb", shard_bytes: int | None = None, seed: int | None = None):
        seed = draw_seed() if seed is None else seed
        directory = tmp_path / f"ckpt{next(counter)}"
        directory.mkdir()
        tok = package_tokenizer(ranks, instruct)
        flat = writer_config(TINY_ARCH | (arch or {}), TINY_CONCEPT | (concept or {}), tok, instruct)
        (directory / "config.json").write_text(json.dumps(flat, indent=2))
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok, instruct), indent=2))
        write_bpe(directory / "cl100k_base.tiktoken", ranks)
        model = package_model(flat)
        randomize(model, seed)
        if spelling == "save_model":  # safetensors' own writer keeps one name of the tied pair
            from safetensors.torch import save_model as st_save_model
            st_save_model(model, str(directory / "model.safetensors"))
        else:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if spelling == "tok_emb":
                del state[LM_HEAD]
            elif spelling == "lm_head":
                del state[TOK_EMB]
            write_shards(state, directory, shard_bytes)
        return SimpleNamespace(dir=directory, flat=flat, model=model, tok=tok, seed=seed)

    return build


def random_tokens(seed: int, shape=(2, 130), mask_from: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100_000, shape, generator=g)
    tokens[:, mask_from:] = 100_280  # <|mask|>
    return tokens


# ---- config.json ---------------------------------------------------------------------------

@pytest.mark.parametrize("instruct", [False, True])
def test_every_field_of_the_flat_config_is_read(make_dir, instruct):
    ck = make_dir(instruct=instruct, arch={"rope_base": 10_000.0, "norm_eps": 1e-6, "clip_qkv": 8.0},
                  concept={"inject_layer": 1, "inject_alpha": 0.5})
    cfg = SteerlingConfig.load(ck.dir)
    f = ck.flat
    assert (cfg.n_layers, cfg.n_head, cfg.n_embd, cfg.n_kv_heads, cfg.block_size, cfg.diff_block_size) == \
        (f["n_layers"], f["n_head"], f["n_embd"], f["n_kv_heads"], f["block_size"], f["diff_block_size"])
    assert (cfg.rope_base, cfg.norm_eps, cfg.clip_qkv, cfg.mlp_ratio) == (10_000.0, 1e-6, 8.0, 4)
    assert (cfg.n_known, cfg.n_discovered, cfg.factorize_rank, cfg.pad_multiple, cfg.concept_chunk) == (40, 100, 16, 16, 16)
    assert (cfg.topk_known, cfg.known_features_k, cfg.topk_discovered) == (4, 12, 8)
    assert (cfg.inject_layer, cfg.inject_alpha) == (1, 0.5)
    assert (cfg.eos_id, cfg.pad_id, cfg.bos_id, cfg.endofchunk_id, cfg.mask_id) == \
        (100_257, 100_277, 100_278, 100_279, 100_280)
    if instruct:
        assert (cfg.vocab_size, cfg.instruct) == (100_284, True)
        assert (cfg.start_header_id, cfg.end_header_id, cfg.eot_id) == (100_281, 100_282, 100_283)
    else:
        assert (cfg.vocab_size, cfg.instruct, cfg.eot_id, cfg.start_header_id) == (100_281, False, None, None)
    assert cfg.tokenizer["kind"] == "cl100k" and cfg.tokenizer.get("instruct", True) is instruct
    assert model_family(ck.dir) == STEERLING


def test_absent_fields_take_the_package_defaults(ranks):
    """Drop each optional key from a file written with the package's defaults: same config."""
    tok = package_tokenizer(ranks, False)
    full = writer_config({"interpretable": True}, {}, tok, False)
    want = SteerlingConfig.from_json_dict(full)
    required = {"model_type", "interpretable", "vocab_size", "pad_token_id", "bos_token_id", "eos_token_id",
                "mask_token_id", "endofchunk_token_id"}
    for key in full:
        if key not in required:
            assert SteerlingConfig.from_json_dict({k: v for k, v in full.items() if k != key}) == want, key
    for key in required - {"model_type", "interpretable"}:
        with pytest.raises(ConfigError, match=f"{key} is required"):
            SteerlingConfig.from_json_dict({k: v for k, v in full.items() if k != key})


@pytest.mark.parametrize("key,value", [
    ("interpretable", False), ("use_rms_norm", False), ("norm_order", "pre"), ("use_qk_norm", False),
    ("use_rope", False), ("rope_full_precision", False), ("mlp_type", "standard"), ("use_bias", True),
    ("weight_sharing", False), ("use_attention_known", True), ("use_attention_unknown", True),
    ("use_unknown", False), ("factorize_unknown", False), ("apply_topk_to_unknown", False),
    ("topk_on_logits", True), ("use_epsilon_correction", False), ("diff_block_size", 32), ("clip_qkv", None),
    ("topk_known", None), ("unknown_topk", None), ("topk_known_features", 2), ("concept_dim", 64),
    ("n_layers", 0), ("n_head", "4"), ("norm_eps", -1.0), ("store_unknown_weights", "no"),
    ("activation", "tanh"), ("eot_id", 100_283), ("some_new_field", 1),
])
def test_unsupported_or_unknown_field_is_refused_by_name(ranks, key, value):
    tok = package_tokenizer(ranks, False)
    data = writer_config(TINY_ARCH, TINY_CONCEPT, tok, False) | {key: value}
    with pytest.raises(ConfigError, match=key):
        SteerlingConfig.from_json_dict(data)


def test_instruct_ids_outside_a_base_vocabulary_are_refused(ranks):
    base, instruct = package_tokenizer(ranks, False), package_tokenizer(ranks, True)
    data = writer_config(TINY_ARCH, TINY_CONCEPT, instruct, True) | {"vocab_size": base.vocab_size}
    with pytest.raises(ConfigError, match=r"start_header_id 100281 is outside the 100281-row vocabulary"):
        SteerlingConfig.from_json_dict(data)
    partial = writer_config(TINY_ARCH, TINY_CONCEPT, instruct, True)
    del partial["end_header_id"]
    with pytest.raises(ConfigError, match="end_header_id missing"):
        SteerlingConfig.from_json_dict(partial)


def test_converter_nested_layout_reads_the_same(ranks):
    """The package's weight converter nests the concept keys; same model, same config."""
    tok = package_tokenizer(ranks, False)
    flat = writer_config(TINY_ARCH, TINY_CONCEPT, tok, False)
    concept_keys = ("n_concepts", "n_unknown_concepts", "concept_dim", "use_attention_known", "use_attention_unknown",
                    "topk_known", "topk_known_features", "unknown_topk", "use_unknown", "apply_topk_to_unknown",
                    "topk_on_logits", "factorize_unknown", "factorize_rank", "use_epsilon_correction",
                    "pad_multiple", "store_unknown_weights", "inject_layer", "inject_alpha")
    nested = {k: v for k, v in flat.items() if k not in concept_keys and k not in
              ("concept_block_size", "auto_map", "architectures", "torch_dtype", "transformers_version")}
    nested["model_type"] = "causal_diffusion"
    nested["concept"] = {k: flat[k] for k in concept_keys} | {"block_size": flat["concept_block_size"],
                                                              "max_concepts": 16}
    assert SteerlingConfig.from_json_dict(nested) == SteerlingConfig.from_json_dict(flat)
    with pytest.raises(ConfigError, match="no 'concept' object"):
        SteerlingConfig.from_json_dict({k: v for k, v in nested.items() if k != "concept"})


# models/steerling-tiny/config.json as this project wrote it before the distributed layout
LEGACY_TINY_CONFIG = (
    "{\"model_type\": \"causal_diffusion\", \"interpretable\": true, \"instruct\": true, \"vocab_size\": 320, \"n_la"
    "yers\": 4, \"n_head\": 4, \"n_embd\": 128, \"block_size\": 1024, \"n_kv_heads\": 2, \"diff_block_size\": 64, \"u"
    "se_rms_norm\": true, \"norm_eps\": 1e-05, \"norm_order\": \"post\", \"use_qk_norm\": true, \"use_rope\": true, "
    "\"rope_base\": 500000.0, \"rope_full_precision\": true, \"mlp_type\": \"swiglu\", \"mlp_ratio\": 4, \"intermedi"
    "ate_size\": null, \"use_bias\": false, \"clip_qkv\": 10.0, \"weight_sharing\": true, \"concept\": {\"n_concept"
    "s\": 48, \"n_unknown_concepts\": 96, \"concept_dim\": 128, \"topk_known\": 8, \"topk_known_features\": 8, \"us"
    "e_unknown\": true, \"factorize_unknown\": true, \"factorize_rank\": 16, \"unknown_topk\": 16, \"use_epsilon_"
    "correction\": true, \"block_size\": 32, \"pad_multiple\": 16, \"apply_topk_to_unknown\": true, \"topk_on_log"
    "its\": false}, \"cde\": {\"eos_id\": 256, \"pad_id\": 257, \"bos_id\": 258, \"endofchunk_id\": 259, \"mask_id\": "
    "260, \"eot_id\": 263, \"tokenizer\": {\"kind\": \"byte\"}}}"
)


def test_this_projects_older_nested_files_still_load():
    old = json.loads(LEGACY_TINY_CONFIG)
    assert old["model_type"] == "causal_diffusion" and "concept" in old and "eos_id" in old["cde"]
    assert SteerlingConfig.from_json_dict(old) == TINY.replace(inject_layer=16)  # the package's default then


def test_save_model_writes_the_distributed_layout(make_dir, tmp_path):
    ck = make_dir(instruct=True)
    ours = load_model(ck.dir)
    out = tmp_path / "resaved"
    save_model(ours, out)
    written = json.loads((out / "config.json").read_text())
    assert list(written)[:2] == ["model_type", "architectures"] and written["model_type"] == "steerling"
    expected = set(WRITER_KEYS) - {"auto_map", "transformers_version"} | set(INSTRUCT_KEYS)
    assert set(written) == expected
    assert {k: written[k] for k in expected if k != "torch_dtype"} == \
        {k: ck.flat[k] for k in expected if k != "torch_dtype"}
    assert written["torch_dtype"] == "float32"
    assert SteerlingConfig.load(out) == SteerlingConfig.load(ck.dir)
    # the package loads what we wrote and computes the same logits
    ref = package_model(written)
    load_package_weights(ref, out)
    tokens = random_tokens(ck.seed)
    with torch.no_grad():
        a, _ = ref(tokens, minimal_output=True)
        b, _ = ck.model(tokens, minimal_output=True)
    assert torch.equal(a, b), f"seed {ck.seed}"


def test_bundled_tiny_model_is_in_the_distributed_layout():
    data = json.loads((ROOT / "models" / "steerling-tiny" / "config.json").read_text())
    assert data["model_type"] == "steerling" and "concept" not in data and data["cde"] == {"tokenizer": {"kind": "byte"}}
    assert SteerlingConfig.load(ROOT / "models" / "steerling-tiny") == TINY


# ---- weights and forward -------------------------------------------------------------------

@pytest.mark.parametrize("spelling,shard_bytes", [("tok_emb", None), ("tok_emb", 100_000), ("save_model", None),
                                                  ("lm_head", 100_000), ("both", None)])
def test_forward_and_concept_records_match_the_package(make_dir, spelling, shard_bytes):
    ck = make_dir(spelling=spelling, shard_bytes=shard_bytes)
    if shard_bytes:
        assert len(list(ck.dir.glob("model-*-of-*.safetensors"))) >= 3
    ours = load_model(ck.dir)
    assert ours.transformer.lm_head.weight is ours.transformer.tok_emb.weight
    tokens = random_tokens(ck.seed)
    with torch.no_grad():
        ref_logits, ref = ck.model(tokens, minimal_output=True)
        out = ours(tokens)
    n = tokens.numel()
    assert rel_err(out.logits, ref_logits.reshape(n, -1)) <= 1e-5, f"seed {ck.seed}"
    assert out.known_idx.shape == (n, 4) == ref.known_topk_indices.reshape(n, -1).shape
    assert_same_topk(out.known_idx, out.known_logits, ref.known_topk_indices.reshape(n, -1),
                     ref.known_topk_logits.reshape(n, -1))
    assert_same_topk(out.disc_idx, out.disc_logits, ref.unknown_topk_indices.reshape(n, -1),
                     ref.unknown_topk_logits.reshape(n, -1))


def test_which_name_safetensors_save_model_keeps_loads_either_way(make_dir):
    ck = make_dir(spelling="save_model")
    from safetensors import safe_open
    with safe_open(str(ck.dir / "model.safetensors"), "pt") as f:
        kept = {TOK_EMB, LM_HEAD} & set(f.keys())
    assert len(kept) == 1  # one of the tied pair, whichever safetensors picked
    assert load_model(ck.dir).transformer.tok_emb.weight.shape == (100_281, 32)


def test_differing_tied_tables_are_refused(make_dir):
    ck = make_dir(spelling="both")
    from safetensors.torch import load_file
    state = load_file(str(ck.dir / "model.safetensors"))
    state[LM_HEAD] = state[LM_HEAD] + 1.0
    save_file(state, str(ck.dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="differ, but the model ties them"):
        load_model(ck.dir)


def test_known_topk_semantics_decide_the_attributions(make_dir):
    """Attributions from the package's accumulator on the package's records equal ours from
    ours; recording all topk_known_features concepts instead (the old reading) would not."""
    from steerling.attribution.concept_attribution import AttributionAccumulator

    ck = make_dir()
    ours = load_model(ck.dir)
    tokens = random_tokens(ck.seed, (1, 96), mask_from=80)
    positions = torch.arange(70, 96)
    with torch.no_grad():
        ref_logits, ref = ck.model(tokens, minimal_output=True)
        out = ours(tokens)
    targets = ref_logits[0, positions].argmax(-1)
    acc = AttributionAccumulator(96, 4, 8, torch.device("cpu"), ck.model.transformer.lm_head.weight,
                                 ck.model.known_head, ck.model.unknown_head)
    acc.commit(SimpleNamespace(positions=positions, token_ids=targets, denoising_step=0,
                               target_logits=ref_logits[0, positions, targets],
                               known_indices=ref.known_topk_indices[0, positions],
                               known_logits=ref.known_topk_logits[0, positions],
                               unk_indices=ref.unknown_topk_indices[0, positions],
                               unk_logits=ref.unknown_topk_logits[0, positions]))
    pkg = acc.result()
    rec = attr.RawRecords(positions, targets, out.logits[positions, targets], out.known_idx[positions],
                          out.known_logits[positions], out.disc_idx[positions], out.disc_logits[positions])
    ta = attr.token_attribution(rec, *attr.model_lookups(ours))
    torch.testing.assert_close(ta.residual, pkg.epsilon_contribution[0, positions], atol=1e-4, rtol=0,
                               msg=f"seed {ck.seed}")
    torch.testing.assert_close(ta.known_contrib.sum(-1), pkg.known_contributions[0, positions].sum(-1),
                               atol=1e-4, rtol=0, msg=f"seed {ck.seed}")
    # the same tokens with all 12 feature concepts recorded: a different residual
    h_idx, h_logits = ours.known_head.topk_of(_hidden(ours, tokens)[positions])
    assert h_idx.shape == (len(positions), 12)
    wrong = attr.token_attribution(attr.RawRecords(positions, targets, rec.target_logits, h_idx, h_logits,
                                                   rec.disc_idx, rec.disc_logits), *attr.model_lookups(ours))
    assert float((wrong.residual - ta.residual).abs().max()) > 1e-3, f"seed {ck.seed}"


def _hidden(model, tokens):
    from cde.steerling.model import dense_block_causal_attend

    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model.hidden_states(tokens, pos, dense_block_causal_attend(pos, 64)).reshape(-1, model.cfg.n_embd)


def test_steering_and_interventions_match_the_package(make_dir):
    ck = make_dir(instruct=True)
    ours = load_model(ck.dir)
    tokens = random_tokens(ck.seed, (1, 130), mask_from=70)
    direction = st.steering_direction(ours.known_head.embeddings(torch.tensor([1, 4, 9])))
    gate = (tokens == 100_280).float()
    known = {3: 0.95, 11: 0.0, 27: 0.5}
    with torch.no_grad():
        ref_steered, _ = ck.model(tokens, minimal_output=True, position_injection=gate[..., None] * direction,
                                  steering_inject_layer=1, steering_inject_alpha=3.7)
        steered = ours(tokens, steering=SteeringInputs(direction[None], torch.tensor([3.7]), gate, torch.tensor([1])))
        ref_iv, _ = ck.model.intervene(tokens, known=known)
        iv = ours(tokens, intervention=KnownIntervention(torch.tensor([list(known)]),
                                                         torch.tensor([list(known.values())])))
    assert rel_err(steered.logits, ref_steered.reshape(steered.logits.shape)) <= 1e-5, f"seed {ck.seed}"
    assert rel_err(iv.logits, ref_iv.reshape(iv.logits.shape)) <= 1e-5, f"seed {ck.seed}"


def test_greedy_generation_with_attribution_matches_the_package_generator(make_dir):
    from steerling.configs.generation import GenerationConfig
    from steerling.inference.causal_diffusion import SteerlingGenerator

    ck = make_dir(instruct=True)
    ours = load_model(ck.dir)
    cfg = ours.cfg
    gen = SteerlingGenerator(ck.model, ck.tok, package_model_config(ck.flat), is_interpretable=True, device="cpu")
    prompt = random_tokens(ck.seed, (1, 64), mask_from=64)
    ref = gen.generate_full(prompt, GenerationConfig(max_new_tokens=64, steps=64, use_entropy_sampling=False,
                                                     temperature=0.0))
    res = generate(ours, prompt[0].tolist(), decode_options(64, sampling=SamplingParams(use_entropy_sampling=False,
                                                                              temperature=0.0)),
                   tokenizer_vocab_size=load_model_tokenizer(cfg, ck.dir).vocab_size)
    assert res.sequence == ref.tokens.tolist(), f"seed {ck.seed}"


def package_model_config(flat: dict):
    from steerling.configs.causal_diffusion import CausalDiffusionConfig

    return CausalDiffusionConfig(**{k: flat[k] for k in CausalDiffusionConfig.model_fields
                                    if k in flat and k != "model_type"})


# ---- tokenizer -----------------------------------------------------------------------------

@pytest.mark.parametrize("instruct", [False, True])
def test_tokenizer_ids_match_the_packages(make_dir, ranks, instruct):
    ck = make_dir(instruct=instruct)
    ours = load_model_tokenizer(SteerlingConfig.load(ck.dir), ck.dir)
    pkg = ck.tok
    assert (ours.vocab_size, ours.eos_id, ours.pad_id, ours.bos_id, ours.endofchunk_id, ours.mask_id) == \
        (pkg.vocab_size, pkg.eos_token_id, pkg.pad_token_id, pkg.bos_token_id, pkg.endofchunk_token_id,
         pkg.mask_token_id)
    assert (ours.start_header_id, ours.end_header_id, ours.eot_id) == \
        (pkg.start_header_id, pkg.end_header_id, pkg.eot_id)
    assert ours.stop_ids == ({100_257, 100_283} if instruct else {100_257})
    text = "hello <|eot_id|> world \u00e9"
    assert ours.encode(text) == pkg.encode(text, add_special_tokens=False)


def test_tokenizer_that_disagrees_with_the_config_is_refused(make_dir):
    ck = make_dir(instruct=True)
    flat = json.loads((ck.dir / "config.json").read_text())
    (ck.dir / "config.json").write_text(json.dumps(flat | {"cde": {"tokenizer": {"kind": "byte"}}}))
    with pytest.raises(ValueError, match="does not match the model config: eos_token_id is 100257"):
        load_model_tokenizer(SteerlingConfig.load(ck.dir), ck.dir)
    (ck.dir / "config.json").write_text(json.dumps(flat | {"cde": {"tokenizer": {"kind": "cl100k", "instruct": False}}}))
    with pytest.raises(ConfigError, match="cde.tokenizer.instruct"):
        SteerlingConfig.load(ck.dir)


# ---- entry points --------------------------------------------------------------------------

def test_gateway_steering_and_attribution_services_open_the_directory(make_dir):
    from attribution_svc.compute import AttributionTables
    from gateway.pipeline import ModelCard
    from steering_svc.backend import SteeringBackend

    ck = make_dir(instruct=True, spelling="lm_head", shard_bytes=100_000)
    card = ModelCard.load(ck.dir)
    assert card.family == STEERLING and card.tokenizer.eot_id == 100_283 and card.config.vocab_size == 100_284
    assert card.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])[0] == 100_281
    from cde.rpc.v1 import generate_pb2
    from gateway.errors import GatewayError
    from gateway.pipeline import Pipeline

    chat = generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(
        role="user", content="hi")]))
    base = ModelCard.load(make_dir(instruct=False).dir)
    assert base.tokenizer.eot_id is None and base.config.vocab_size == 100_281
    with pytest.raises(GatewayError, match="no chat tokens"):
        Pipeline(base, None, None, None).tokenize(chat)
    assert Pipeline(card, None, None, None).tokenize(chat)[0] == 100_281
    backend = SteeringBackend(ck.dir)
    assert torch.equal(backend.lm_weight, ck.model.transformer.lm_head.weight.detach())
    tables = AttributionTables.open(ck.dir)
    ids = torch.tensor([5, 100_283])
    assert torch.equal(tables.lm_rows(ids), ck.model.transformer.lm_head.weight.detach()[ids])


def test_inspect_reports_a_good_and_a_broken_directory(make_dir):
    ck = make_dir(instruct=True, shard_bytes=100_000)
    run = subprocess.run([sys.executable, "-m", "cde.steerling.inspect", str(ck.dir)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "distributed layout" in run.stdout and "ready to serve" in run.stdout
    assert "vocab_size 100284" in run.stdout and "shard(s)" in run.stdout
    (ck.dir / "cl100k_base.tiktoken").unlink()
    flat = json.loads((ck.dir / "config.json").read_text())
    (ck.dir / "config.json").write_text(json.dumps(flat | {"n_concepts": 50}))
    tc = json.loads((ck.dir / "tokenizer_config.json").read_text())
    (ck.dir / "tokenizer_config.json").write_text(json.dumps(tc | {"eot_id": 7}))
    run = subprocess.run([sys.executable, "-m", "cde.steerling.inspect", str(ck.dir)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout
    assert "known_head.concept_predictor.weight: expected shape (64, 32) from config.json, file has (48, 32)" \
        in run.stdout
    assert "tokenizer_config.json disagrees with config.json: eot_id 7 (config.json: 100283)" in run.stdout
    assert "cl100k BPE file not found" in run.stdout and "4 error(s); not servable" in run.stdout


@pytest.mark.e2e
@pytest.mark.slow
def test_launcher_serves_the_distributed_directory(make_dir, tmp_path):
    """The whole stack (launcher, gateway, scheduler, worker, steering, attribution) on the directory."""
    import httpx

    from tests.stack_fixture import running_stack

    ck = make_dir(instruct=True, shard_bytes=100_000)
    ours = load_model(ck.dir)
    tok = load_model_tokenizer(ours.cfg, ck.dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])
    greedy = SamplingParams(use_entropy_sampling=False, temperature=0.0)
    want = generate(ours, prompt, decode_options(64, sampling=greedy, stop_ids=tuple(sorted(tok.stop_ids))),
                    tokenizer_vocab_size=tok.vocab_size)
    ta = attr.token_attribution(want.records, *attr.model_lookups(ours))
    want_tokens = dict(zip(want.records.positions.tolist(), want.records.tokens.tolist()))
    want_residual = dict(zip(want.records.positions.tolist(), ta.residual.tolist()))
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 64,
            "temperature": 0, "attribution": "tokens", "attribution_top_k": 64}
    with running_stack(tmp_path / "run", model_dir=ck.dir, timeout=400.0) as stack:
        r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        steered = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=300,
                             json=body | {"steering": {"concepts": [{"id": 3}], "mode": "amplify"}})
        assert steered.status_code == 200, steered.text
        tas = r.json()["cde"]["token_attributions"]
        # inside the stack: a failure prints the services' log tails
        assert {a["position"]: a["token"] for a in tas} == want_tokens, \
            f"seed {ck.seed}: {len(tas)} token attributions, blocks {r.json()['cde']['blocks']}"
    for a in tas:
        assert a["residual"] == pytest.approx(want_residual[a["position"]], abs=1e-3), f"seed {ck.seed}"
        assert len(a["top"]) == 12  # 4 recorded known + 8 discovered
        assert a["target_logit"] == pytest.approx(a["residual"] + sum(c["score"] for c in a["top"]), abs=1e-3)
    assert steered.json()["cde"]["token_attributions"]
