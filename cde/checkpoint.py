"""Hugging Face style safetensors checkpoints: write, lazily read, load into a module.

Model-agnostic: everything works on ``name -> tensor`` dicts.  Layout on disk is exactly
what ``transformers`` writes: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors``
shards plus ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...},
"weight_map": {name: file}}``).  Readers memory-map files and read only the tensors asked for.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64, "C64": torch.complex64,
}
for _code, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_code] = getattr(torch, _attr)


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match what the caller expects."""


def _shape(s) -> tuple[int, ...]:
    return tuple(int(d) for d in s)


def save_checkpoint(tensors: dict[str, torch.Tensor], directory, *,
                    max_shard_bytes: int | None = None,
                    metadata: dict[str, str] | None = None) -> list[Path]:
    """Write ``tensors`` to ``directory``; return the paths written (shards, then the index).

    Shards are filled in insertion order (like ``transformers``); a tensor larger than
    ``max_shard_bytes`` gets a shard of its own.  Each file is written under a temporary
    name and renamed, the index last; stale ``model*.safetensors``/index files from an
    earlier save into the same directory are removed afterwards.  Same input, same bytes.
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    meta = {"format": "pt", **(metadata or {})}
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str, got {k!r}: {v!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    prepared: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"expected str -> torch.Tensor, got {name!r}: {type(t).__name__}")
        if t.is_meta:
            raise CheckpointError(f"{name}: cannot save a meta tensor")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen_storages:
            t = t.clone()  # safetensors refuses tensors that share storage
        seen_storages.add(t.untyped_storage().data_ptr())
        prepared[name] = t

    sizes = {n: t.numel() * t.element_size() for n, t in prepared.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in prepared.items():
        if max_shard_bytes is not None and shards[-1] and used + sizes[name] > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += sizes[name]

    if len(shards) == 1:
        files = [SINGLE_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written = []
    for fname, shard in zip(files, shards):
        written.append(_atomic_write(directory / fname, lambda p, s=shard: save_file(s, p, metadata=meta)))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: f for f, s in zip(files, shards) for n in s}}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        written.append(_atomic_write(directory / INDEX_FILE, lambda p: p.write_text(text)))

    keep = {p.name for p in written}
    for p in directory.iterdir():
        if p.name not in keep and (p.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(p.name)):
            p.unlink()
    return written


def _atomic_write(path: Path, write) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class CheckpointReader:
    """Lazy, memory-mapped access to a single-file or sharded checkpoint.

    ``path`` is a checkpoint directory, a ``.safetensors`` file or an index ``.json``.
    Shard files are opened (header only, mmap) on first use of one of their tensors.
    """

    def __init__(self, path):
        path = Path(path)
        if path.is_dir():
            if (path / INDEX_FILE).is_file():
                path = path / INDEX_FILE
            elif (path / SINGLE_FILE).is_file():
                path = path / SINGLE_FILE
            else:
                raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")
        elif not path.is_file():
            raise CheckpointError(f"{path}: no such checkpoint file or directory")
        self.path = path
        self._lock = threading.Lock()
        self._handles: dict[Path, safe_open] = {}
        if path.suffix == ".json":
            try:
                weight_map = json.loads(path.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{path}: unreadable index ({type(e).__name__}: {e})") from e
            self._files = {n: path.parent / f for n, f in weight_map.items()}
            for name, f in sorted(self._files.items()):
                if not f.is_file():
                    raise CheckpointError(f"{f}: shard file is missing (index maps tensor {name} to it)")
        else:
            self._files = {n: path for n in self._open(path, None).keys()}

    def _open(self, file: Path, name: str | None):
        with self._lock:
            h = self._handles.get(file)
            if h is None:
                try:
                    h = safe_open(str(file), framework="pt")
                except (SafetensorError, OSError) as e:
                    what = f" (reading tensor {name})" if name else ""
                    raise CheckpointError(f"{file}: corrupt or unreadable safetensors file{what}: {e}") from e
                if name is not None:
                    listed = {n for n, f in self._files.items() if f == file}
                    missing = sorted(listed - set(h.keys()))
                    if missing:
                        raise CheckpointError(f"{file}: index maps tensor {missing[0]} to this file, "
                                              f"which does not contain it")
                self._handles[file] = h
            return h

    def _slice(self, name: str):
        file = self._files.get(name)
        if file is None:
            raise CheckpointError(f"missing tensor {name} in checkpoint {self.path}")
        try:
            return file, self._open(file, name).get_slice(name)
        except SafetensorError as e:
            raise CheckpointError(f"{file}: cannot read tensor {name}: {e}") from e

    def names(self) -> list[str]:
        return sorted(self._files)

    def files(self) -> list[Path]:
        """The safetensors files holding the tensors (one, or the index's shards)."""
        return sorted(set(self._files.values()))

    def __contains__(self, name) -> bool:
        return name in self._files

    def __len__(self) -> int:
        return len(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return _shape(self._slice(name)[1].get_shape())

    def dtype(self, name: str) -> torch.dtype:
        file, sl = self._slice(name)
        code = sl.get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"{file}: tensor {name} has unsupported dtype {code}")
        return _DTYPES[code]

    def get(self, name: str, *, dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor:
        """Tensor ``name``. On CPU with its stored dtype this is zero-copy: a view of this
        reader's private (copy-on-write) mapping. The file is never modified, but an in-place
        change is seen by later ``get(name)`` on the same reader until ``close()``; clone first
        if you mutate it."""
        file = self._files.get(name)
        if file is None:
            raise CheckpointError(f"missing tensor {name} in checkpoint {self.path}")
        try:
            t = self._open(file, name).get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{file}: cannot read tensor {name}: {e}") from e
        return t.to(device=device, dtype=dtype or t.dtype)

    def get_slice(self, name: str, rows: slice, *, dtype: torch.dtype | None = None,
                  device="cpu") -> torch.Tensor:
        """Rows ``rows`` (a slice along dim 0, Python semantics) of tensor ``name``; only those bytes are read."""
        file, sl = self._slice(name)
        shape = _shape(sl.get_shape())
        if not shape:
            raise CheckpointError(f"{name}: get_slice needs a tensor with at least 1 dim, checkpoint has ()")
        start, stop, step = rows.indices(shape[0])
        if step != 1:
            raise CheckpointError(f"{name}: get_slice supports step 1 only, got {rows}")
        try:
            t = sl[start:max(start, stop)]
        except SafetensorError as e:
            raise CheckpointError(f"{file}: cannot read rows {rows} of tensor {name}: {e}") from e
        return t.to(device=device, dtype=dtype or t.dtype)

    def close(self) -> None:
        """Drop file handles. Tensors already returned stay valid."""
        with self._lock:
            self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_into(module: torch.nn.Module, reader: CheckpointReader, *,
              tied: dict[str, str] | None = None, strict: bool = True,
              materialize: bool = False, device="cpu") -> None:
    """Check ``reader`` against ``module.state_dict()`` (names, exact shapes) and load it.

    ``tied`` maps alias -> source (e.g. lm_head.weight -> tok_emb.weight); aliases need not
    be in the checkpoint (if present, their shape is checked).  With ``strict``, checkpoint
    tensors the module lacks are an error.  Default: copy into existing (non-meta) tensors,
    converting dtype.  ``materialize=True`` (for modules built on the meta device) assigns
    the checkpoint tensors (moved to ``device``, converted to the module's dtype) with
    ``load_state_dict(assign=True)`` -- zero-copy on CPU when dtypes match -- then re-points
    each alias at its source parameter (two modules materialized from one open reader share
    storage, see ``CheckpointReader.get``).  Non-persistent buffers are not in the checkpoint
    and stay as they are (on meta they must be rebuilt by the caller).
    """
    tied = dict(tied or {})
    sd = module.state_dict()
    for alias, source in tied.items():
        for n in (alias, source):
            if n not in sd:
                raise CheckpointError(f"tied {alias} -> {source}: {n} is not a tensor of the module")
        if tuple(sd[alias].shape) != tuple(sd[source].shape):
            raise CheckpointError(f"tied {alias} -> {source}: shapes differ in the module, "
                                  f"{tuple(sd[alias].shape)} vs {tuple(sd[source].shape)}")
    for name, target in sd.items():
        expected = tuple(target.shape)
        if name not in reader:
            if name in tied:
                continue
            raise CheckpointError(f"missing tensor {name} (expected shape {expected})")
        got = reader.shape(name)
        if got != expected:
            raise CheckpointError(f"{name}: expected shape {expected}, checkpoint has {got}")
    if strict:
        extra = [n for n in reader.names() if n not in sd]
        if extra:
            more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
            raise CheckpointError(f"{len(extra)} unexpected tensor(s) in checkpoint: "
                                  f"{', '.join(extra[:5])}{more}")

    if not materialize:
        meta = [n for n, t in sd.items() if t.is_meta]
        if meta:
            raise CheckpointError(f"{meta[0]}: module has meta tensors; use load_into(..., materialize=True)")
        with torch.no_grad():
            for name, target in sd.items():
                if name in tied:
                    continue
                target.copy_(reader.get(name, dtype=target.dtype))
            for alias, source in tied.items():  # untied in the module: give the alias the source values
                if sd[alias].data_ptr() != sd[source].data_ptr():
                    sd[alias].copy_(sd[source])
        return

    loaded = {n: reader.get(n, dtype=t.dtype, device=device) for n, t in sd.items() if n not in tied}
    for alias, source in tied.items():
        loaded[alias] = loaded[source]
    module.load_state_dict(loaded, strict=True, assign=True)
    for alias, source in tied.items():
        owner_name, _, attr = alias.rpartition(".")
        owner = module.get_submodule(owner_name)
        src_owner_name, _, src_attr = source.rpartition(".")
        setattr(owner, attr, getattr(module.get_submodule(src_owner_name), src_attr))
