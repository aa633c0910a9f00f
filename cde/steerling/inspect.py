"""Validate a Steerling checkpoint directory before serving it, and say what is in it.

    python -m cde.steerling.inspect /models/steerling-8b

Checks, without loading the weights into a model (tensor headers only; memory-mapped):
config.json (every field read or refused), every tensor's name and shape against the model
that config describes (the tied LM head in either spelling), the tokenizer (the BPE file
and its special ids against the config; `tokenizer_config.json` too when present) and
`concept_labels.parquet` when present. Prints one line per finding; exit status 0 when the
directory can be served, 1 when not.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cde.checkpoint import INDEX_FILE, CheckpointError, CheckpointReader
from cde.steerling.catalog import LABELS_FILE, ConceptCatalog
from cde.steerling.config import SteerlingConfig
from cde.steerling.loading import LM_HEAD, TOK_EMB
from cde.steerling.model import SteerlingModel
from cde.steerling.tokenizer import load_model_tokenizer

TOKENIZER_CONFIG = "tokenizer_config.json"
# tokenizer_config.json key -> SteerlingConfig attribute
_TOKENIZER_CONFIG_IDS = {"pad_token_id": "pad_id", "bos_token_id": "bos_id", "eos_token_id": "eos_id",
                         "endofchunk_token_id": "endofchunk_id", "mask_token_id": "mask_id",
                         "start_header_id": "start_header_id", "end_header_id": "end_header_id",
                         "eot_id": "eot_id"}


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    errors: int = 0

    def ok(self, msg: str) -> None:
        self.lines.append(f"ok    {msg}")

    def warn(self, msg: str) -> None:
        self.lines.append(f"warn  {msg}")

    def error(self, msg: str) -> None:
        self.errors += 1
        self.lines.append(f"ERROR {msg}")


def expected_tensors(cfg: SteerlingConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model `cfg` describes, with its shape (built on meta: no memory)."""
    with torch.device("meta"):
        model = SteerlingModel(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_config(model_dir: Path, report: Report) -> SteerlingConfig | None:
    try:
        cfg = SteerlingConfig.load(model_dir)
    except (OSError, ValueError) as e:
        report.error(f"config.json: {e}")
        return None
    layout = json.loads((model_dir / "config.json").read_text()).get("model_type")
    report.ok(f"config.json ({'distributed' if layout == 'steerling' else 'nested'} layout, model_type {layout!r}): "
              f"{cfg.n_layers} layers, n_embd {cfg.n_embd}, {cfg.n_head} heads / {cfg.n_kv_heads} KV, "
              f"vocab_size {cfg.vocab_size}, context {cfg.block_size}, "
              f"{'instruct' if cfg.instruct else 'base'} (eot_id {cfg.eot_id})")
    report.ok(f"concepts: {cfg.n_known} known (top {cfg.topk_known} recorded, {cfg.known_features_k} in the "
              f"features), {cfg.n_discovered} discovered (rank {cfg.factorize_rank}, top {cfg.topk_discovered})")
    return cfg


def check_tensors(model_dir: Path, cfg: SteerlingConfig, report: Report) -> None:
    try:
        reader = CheckpointReader(model_dir)
    except CheckpointError as e:
        report.error(f"weights: {e}")
        return
    with reader:
        where = f"{len(reader.files())} shard(s) + {INDEX_FILE}" if reader.path.name == INDEX_FILE else reader.path.name
        expected = expected_tensors(cfg)
        bad = 0
        for name, shape in expected.items():
            alias = {LM_HEAD: TOK_EMB, TOK_EMB: LM_HEAD}.get(name)
            stored = name if name in reader else alias if alias in reader else None
            if stored is None:
                report.error(f"missing tensor {name} (expected shape {shape})")
                bad += 1
                continue
            try:
                got = reader.shape(stored)
            except CheckpointError as e:
                report.error(str(e))
                bad += 1
                continue
            if got != shape:
                report.error(f"{stored}: expected shape {shape} from config.json, file has {got}")
                bad += 1
        extra = sorted(set(reader.names()) - set(expected))
        for name in extra:
            report.error(f"unexpected tensor {name} {reader.shape(name)}: the config describes no such weight")
        if not bad and not extra:
            dtypes = sorted({str(reader.dtype(n)).removeprefix("torch.") for n in reader.names()})
            spelled = [n for n in (TOK_EMB, LM_HEAD) if n in reader]
            total = sum(_numel(reader.shape(n)) for n in reader.names())
            report.ok(f"weights ({where}): {len(reader)} tensors, {total:,} values, dtype {', '.join(dtypes)}; "
                      f"tied embedding stored as {' and '.join(spelled)}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_tokenizer(model_dir: Path, cfg: SteerlingConfig, report: Report) -> None:
    path = model_dir / TOKENIZER_CONFIG
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            report.error(f"{TOKENIZER_CONFIG}: not valid JSON ({e})")
            data = None
        if data is not None:
            wrong = [f"{key} {data[key]} (config.json: {getattr(cfg, attr)})"
                     for key, attr in _TOKENIZER_CONFIG_IDS.items() if key in data and data[key] != getattr(cfg, attr)]
            if cfg.instruct and "eot_id" not in data:
                wrong.append("eot_id missing (an instruct model's tokenizer has it)")
            if wrong:
                report.error(f"{TOKENIZER_CONFIG} disagrees with config.json: {'; '.join(wrong)}")
            else:
                report.ok(f"{TOKENIZER_CONFIG}: special ids agree with config.json")
    try:
        tok = load_model_tokenizer(cfg, model_dir)
    except (OSError, ValueError) as e:
        report.error(f"tokenizer: {e}")
        return
    where = f" from {tok.path}" if hasattr(tok, "path") else ""
    report.ok(f"tokenizer {tok.name}{where}: {tok.vocab_size} ids, special ids match config.json")


def check_labels(model_dir: Path, cfg: SteerlingConfig, report: Report) -> None:
    path = model_dir / LABELS_FILE
    if not path.is_file():
        report.warn(f"no {LABELS_FILE}: concept labels will be synthetic placeholders (the real names are in that file)")
        return
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        missing = [c for c in ("concept_id", "concept_name") if c not in table.column_names]
        if missing:
            report.error(f"{LABELS_FILE}: missing column(s) {', '.join(missing)}")
            return
        ids = table.column("concept_id").to_pylist()
        heads = table.column("head").to_pylist() if "head" in table.column_names else ["known"] * len(ids)
        ConceptCatalog.from_parquet(path, cfg.n_known)  # what the services will do with it
    except Exception as e:  # noqa: BLE001 - any unreadable parquet is the same finding
        report.error(f"{LABELS_FILE}: unreadable ({type(e).__name__}: {e})")
        return
    discovered = [str(h) in ("unknown", "discovered") for h in heads]
    bad = [i for i, disc in zip(ids, discovered)
           if i is None or not 0 <= i < (cfg.n_known + cfg.n_discovered if disc else cfg.n_known)]
    if bad:
        report.error(f"{LABELS_FILE}: concept ids out of range (known must be < {cfg.n_known}, discovered < "
                     f"{cfg.n_known + cfg.n_discovered}): {bad[:5]}")
        return
    known = [i for i, disc in zip(ids, discovered) if not disc]
    report.ok(f"{LABELS_FILE}: {len(known)} known and {len(ids) - len(known)} discovered labels")


def inspect_dir(model_dir: str | Path) -> Report:
    model_dir = Path(model_dir)
    report = Report()
    if not model_dir.is_dir():
        report.error(f"{model_dir}: not a directory")
        return report
    cfg = check_config(model_dir, report)
    if cfg is not None:
        check_tensors(model_dir, cfg, report)
        check_tokenizer(model_dir, cfg, report)
        check_labels(model_dir, cfg, report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", help="the checkpoint directory (config.json, weights, cl100k_base.tiktoken, ...)")
    args = ap.parse_args(argv)
    report = inspect_dir(args.model_dir)
    print("\n".join(report.lines))
    print(f"{args.model_dir}: " + ("ready to serve" if not report.errors else f"{report.errors} error(s); not servable"))
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
