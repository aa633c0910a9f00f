import json

import pytest
import torch
from torch import nn

from cde.checkpoint import (INDEX_FILE, SINGLE_FILE, CheckpointError, CheckpointReader,
                            load_into, save_checkpoint)


def mixed_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "emb.weight": torch.randn(16, 8, generator=g),
        "blocks.0.w": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "blocks.0.b": torch.randn(8, generator=g),
        "blocks.1.w": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "positions": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "scalar": torch.tensor(3.5),
    }


def assert_same(reader, tensors):
    assert reader.names() == sorted(tensors)
    for name, t in tensors.items():
        assert name in reader
        assert reader.shape(name) == tuple(t.shape)
        assert reader.dtype(name) == t.dtype
        got = reader.get(name)
        assert got.dtype == t.dtype and torch.equal(got, t), name


def test_round_trip_single_file(tmp_path):
    tensors = mixed_tensors()
    paths = save_checkpoint(tensors, tmp_path, metadata={"arch": "toy"})
    assert paths == [tmp_path / SINGLE_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]
    with CheckpointReader(tmp_path) as r:
        assert_same(r, tensors)
    with CheckpointReader(tmp_path / SINGLE_FILE) as r:  # path to the file itself
        assert_same(r, tensors)


def test_round_trip_sharded_and_index(tmp_path):
    tensors = mixed_tensors()
    paths = save_checkpoint(tensors, tmp_path, max_shard_bytes=300)
    shards = [p for p in paths if p.suffix == ".safetensors"]
    assert len(shards) >= 3
    n = len(shards)
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert paths[-1] == tmp_path / INDEX_FILE
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    # a tensor bigger than the limit gets a shard of its own (emb.weight is 512 bytes)
    assert [k for k, v in index["weight_map"].items() if v == index["weight_map"]["emb.weight"]] == ["emb.weight"]
    with CheckpointReader(tmp_path) as r:
        assert_same(r, tensors)
    with CheckpointReader(tmp_path / INDEX_FILE) as r:
        assert_same(r, tensors)


def test_resave_removes_stale_files(tmp_path):
    tensors = mixed_tensors()
    save_checkpoint(tensors, tmp_path, max_shard_bytes=300)
    save_checkpoint(tensors, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]
    save_checkpoint(tensors, tmp_path, max_shard_bytes=300)
    assert SINGLE_FILE not in {p.name for p in tmp_path.iterdir()}
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    with CheckpointReader(tmp_path) as r:
        assert_same(r, tensors)


def test_deterministic_bytes(tmp_path):
    for shard in (None, 300):
        a = save_checkpoint(mixed_tensors(), tmp_path / f"a{shard}", max_shard_bytes=shard)
        b = save_checkpoint(mixed_tensors(), tmp_path / f"b{shard}", max_shard_bytes=shard)
        assert [p.name for p in a] == [p.name for p in b]
        for pa, pb in zip(a, b):
            assert pa.read_bytes() == pb.read_bytes()


def test_shared_and_noncontiguous_tensors_are_saved(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    tensors = {"a": base, "a_alias": base, "t": base.t(), "rows": base[1:3]}
    save_checkpoint(tensors, tmp_path)
    with CheckpointReader(tmp_path) as r:
        for name, t in tensors.items():
            assert torch.equal(r.get(name), t)


def test_lazy_access_and_get_slice(tmp_path):
    tensors = mixed_tensors()
    save_checkpoint(tensors, tmp_path, max_shard_bytes=300)
    r = CheckpointReader(tmp_path)
    assert r._handles == {}  # nothing opened until asked
    assert r.shape("blocks.1.w") == (8, 8)
    assert len(r._handles) == 1
    emb = tensors["emb.weight"]
    assert torch.equal(r.get_slice("emb.weight", slice(3, 7)), emb[3:7])
    assert torch.equal(r.get_slice("emb.weight", slice(-2, None)), emb[-2:])
    assert torch.equal(r.get_slice("emb.weight", slice(10, 100)), emb[10:])
    assert r.get_slice("emb.weight", slice(5, 5)).shape == (0, 8)
    half = r.get_slice("emb.weight", slice(0, 2), dtype=torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, emb[:2].half())
    assert r.get("blocks.0.w", dtype=torch.float32).dtype == torch.float32
    with pytest.raises(CheckpointError, match="scalar"):
        r.get_slice("scalar", slice(0, 1))
    with pytest.raises(CheckpointError, match="nope"):
        r.get("nope")
    assert "nope" not in r
    r.close()
    assert torch.equal(r.get("positions"), tensors["positions"])  # reopens after close


class Toy(nn.Module):
    def __init__(self, vocab=10, dim=4):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.register_buffer("scale", torch.ones(dim))


TIED = {"lm_head.weight": "tok_emb.weight"}


def toy_checkpoint(tmp_path, drop_alias=True, **extra):
    torch.manual_seed(0)
    src = Toy()
    sd = {k: v for k, v in src.state_dict().items() if not (drop_alias and k in TIED)}
    sd["scale"] = sd["scale"] * 2
    sd.update(extra)
    save_checkpoint(sd, tmp_path)
    return src


@pytest.mark.parametrize("drop_alias", [True, False])
def test_load_into_copy(tmp_path, drop_alias):
    src = toy_checkpoint(tmp_path, drop_alias=drop_alias)
    torch.manual_seed(1)
    dst = Toy()
    with CheckpointReader(tmp_path) as r:
        load_into(dst, r, tied=TIED)
    for name, t in src.state_dict().items():
        expected = t * 2 if name == "scale" else t
        assert torch.equal(dst.state_dict()[name], expected), name
    assert dst.lm_head.weight is dst.tok_emb.weight


def test_load_into_converts_dtype(tmp_path):
    src = toy_checkpoint(tmp_path)
    dst = Toy().to(torch.bfloat16)
    with CheckpointReader(tmp_path) as r:
        load_into(dst, r, tied=TIED)
    assert dst.proj.weight.dtype == torch.bfloat16
    assert torch.equal(dst.proj.weight, src.proj.weight.to(torch.bfloat16))


def test_load_into_materialize_meta(tmp_path):
    src = toy_checkpoint(tmp_path)
    with torch.device("meta"):
        dst = Toy()
    with CheckpointReader(tmp_path) as r:
        with pytest.raises(CheckpointError, match="materialize"):
            load_into(dst, r, tied=TIED)
        load_into(dst, r, tied=TIED, materialize=True)
    assert not any(t.is_meta for t in dst.state_dict().values())
    assert dst.lm_head.weight is dst.tok_emb.weight
    assert isinstance(dst.proj.weight, nn.Parameter) and dst.proj.weight.requires_grad
    assert torch.equal(dst.proj.weight, src.proj.weight)
    assert torch.equal(dst.scale, torch.full((4,), 2.0))
    x = torch.tensor([1, 2, 3])
    assert torch.equal(dst.lm_head(dst.proj(dst.tok_emb(x))), src.lm_head(src.proj(src.tok_emb(x))))
    assert len(list(dst.parameters())) == 3  # tie kept: tok_emb/lm_head counted once


def test_missing_tensor_named(tmp_path):
    torch.manual_seed(0)
    sd = {k: v for k, v in Toy().state_dict().items() if k not in TIED and k != "proj.bias"}
    save_checkpoint(sd, tmp_path)
    with CheckpointReader(tmp_path) as r, pytest.raises(CheckpointError) as e:
        load_into(Toy(), r, tied=TIED)
    assert str(e.value) == "missing tensor proj.bias (expected shape (4,))"


def test_untied_alias_must_be_present(tmp_path):
    toy_checkpoint(tmp_path)
    with CheckpointReader(tmp_path) as r, pytest.raises(CheckpointError, match="missing tensor lm_head.weight"):
        load_into(Toy(), r)  # no tie declared: alias is a required tensor


def test_misshaped_tensor_names_both_shapes(tmp_path):
    torch.manual_seed(0)
    sd = {k: v for k, v in Toy().state_dict().items() if k not in TIED}
    sd["proj.weight"] = torch.zeros(4, 3)
    save_checkpoint(sd, tmp_path)
    with CheckpointReader(tmp_path) as r, pytest.raises(CheckpointError) as e:
        load_into(Toy(), r, tied=TIED)
    assert str(e.value) == "proj.weight: expected shape (4, 4), checkpoint has (4, 3)"


def test_misshaped_alias(tmp_path):
    toy_checkpoint(tmp_path, **{"lm_head.weight": torch.zeros(9, 4)})
    with CheckpointReader(tmp_path) as r, pytest.raises(CheckpointError, match=r"lm_head.weight: expected shape \(10, 4\), checkpoint has \(9, 4\)"):
        load_into(Toy(), r, tied=TIED)


def test_unexpected_tensor_when_strict(tmp_path):
    extra = {f"extra.{i}": torch.zeros(1) for i in range(7)}
    src = toy_checkpoint(tmp_path, **extra)
    dst = Toy()
    with CheckpointReader(tmp_path) as r:
        with pytest.raises(CheckpointError, match=r"7 unexpected .*extra\.0, extra\.1, extra\.2, extra\.3, extra\.4 \(and 2 more\)"):
            load_into(dst, r, tied=TIED)
        load_into(dst, r, tied=TIED, strict=False)
    assert torch.equal(dst.proj.weight, src.proj.weight)


def test_truncated_shard_names_file(tmp_path):
    shard = save_checkpoint(mixed_tensors(), tmp_path, max_shard_bytes=300)[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 7])
    weight_map = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    victim = next(k for k, v in weight_map.items() if v == shard.name)
    r = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match=shard.name) as e:
        r.get(victim)
    assert victim in str(e.value)
    other = next(k for k, v in weight_map.items() if v != shard.name)
    assert r.get(other).shape == mixed_tensors()[other].shape  # other shards unaffected


@pytest.mark.parametrize("keep", [0, 5, 100])
def test_corrupt_single_file(tmp_path, keep):
    save_checkpoint(mixed_tensors(), tmp_path)
    f = tmp_path / SINGLE_FILE
    f.write_bytes(f.read_bytes()[:keep])
    with pytest.raises(CheckpointError, match=SINGLE_FILE):
        CheckpointReader(tmp_path)


def test_index_pointing_to_missing_shard(tmp_path):
    gone = save_checkpoint(mixed_tensors(), tmp_path, max_shard_bytes=300)[2].name
    weight_map = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    (tmp_path / gone).unlink()
    victims = [k for k, v in weight_map.items() if v == gone]
    with pytest.raises(CheckpointError, match=gone) as e:
        CheckpointReader(tmp_path)
    assert any(v in str(e.value) for v in victims)


def test_index_names_tensor_absent_from_shard(tmp_path):
    first = save_checkpoint(mixed_tensors(), tmp_path, max_shard_bytes=300)[0].name
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["weight_map"]["ghost"] = first
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with CheckpointReader(tmp_path) as r, pytest.raises(CheckpointError, match="ghost"):
        r.get("ghost")


def test_bad_index_and_empty_dir(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        CheckpointReader(tmp_path)
    (tmp_path / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=INDEX_FILE):
        CheckpointReader(tmp_path)


def test_get_is_zero_copy_but_never_writes_the_file(tmp_path):
    save_checkpoint({"w": torch.zeros(4, 4)}, tmp_path)
    before = (tmp_path / SINGLE_FILE).read_bytes()
    with CheckpointReader(tmp_path) as r:
        r.get("w").add_(1)  # private copy-on-write mapping
    assert (tmp_path / SINGLE_FILE).read_bytes() == before
    with CheckpointReader(tmp_path) as r:
        assert torch.equal(r.get("w"), torch.zeros(4, 4))
