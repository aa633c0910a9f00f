"""Generate with the reference decoder, steering and concept attribution, in one process.

    python -m cde.steerling.demo "Tell me about the sea" --steer ocean --max-tokens 96

Uses the bundled tiny model by default (random weights: the text is noise, the machinery is
real). Prints the text and the top concepts of each chunk.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from cde.steerling import attribution as attr
from cde.steerling.catalog import ConceptCatalog
from cde.steerling.config import SteerlingConfig
from cde.steerling.loading import load_model
from cde.options import DecodeOptions
from cde.steerling.reference_decoder import generate
from cde.steerling.sampling import SamplingParams
from cde.steerling.steering import SteeringSpec, prepare
from cde.steerling.tokenizer import load_model_tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "steerling-tiny"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--steer", action="append", default=[], help="known concept name or id to amplify")
    ap.add_argument("--suppress", default=None, help="known concept name or id to suppress")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cfg = SteerlingConfig.load(args.model)
    model = load_model(args.model)
    tok = load_model_tokenizer(cfg, Path(args.model))
    catalog = ConceptCatalog.load(args.model, cfg.n_known, cfg.n_discovered)

    def resolve(name: str) -> int:
        c = catalog.get(int(name)) if name.isdigit() else catalog.by_name(name)
        if c is None or c.head != "known":
            raise SystemExit(f"unknown known-concept {name!r}; try one of: "
                             + ", ".join(x.name for x in catalog.search(name[:2] or "a", 8, known_only=True)))
        return c.concept_id

    spec = None
    if args.suppress:
        cid = resolve(args.suppress)
        spec = SteeringSpec.suppress(cid, catalog.group_neighbours(cid))
    elif args.steer:
        spec = SteeringSpec.amplify([resolve(s) for s in args.steer])
    steering = None
    if spec is not None:
        steering = prepare(spec, model.known_head.embeddings(torch.tensor(spec.concept_ids)),
                           model.transformer.lm_head.weight, cfg.n_layers)

    prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    options = DecodeOptions(args.max_tokens, SamplingParams(), tokens_per_step=1, confidence_threshold=None,
                            seed=args.seed, stop_ids=())
    res = generate(model, prompt, options, steering,
                   tokenizer_vocab_size=tok.vocab_size)
    print(f"text ({len(res.output_tokens)} tokens, finish={res.finish_reason}):")
    print(repr(tok.decode(res.output_tokens)))
    ta = attr.token_attribution(res.records, *attr.model_lookups(model))
    order = {int(p): i for i, p in enumerate(res.records.positions)}
    start = res.prompt_len
    generated = res.sequence[start:]
    for n, (s, e) in enumerate(attr.chunk_spans(generated, cfg.endofchunk_id, sorted(tok.stop_ids))):
        rows = [order[start + p] for p in range(s, e) if start + p in order]
        scores, eps_pct = attr.chunk_scores(ta, rows, e - s, cfg.n_known, top=5)
        shown = ", ".join(f"{catalog.label(x.concept_id)} {x.score:+.3f}" for x in scores)
        print(f"chunk {n} [{s}:{e}) residual {eps_pct:.1f}%: {shown}")


if __name__ == "__main__":
    main()
