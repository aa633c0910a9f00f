"""A small command-line client for the gateway's REST API (no dependencies beyond Python).

    python -m cde.client generate "Tell me about the sea" --steer ocean --attribution chunks
    python -m cde.client generate "Write a poem" --suppress anger --max-tokens 128 --seed 3
    python -m cde.client concepts ocean
    python -m cde.client generate "Tell me about the sea" --stride 4 --temperature 0   # a causal (I-DLM) model

`generate` streams a chat completion (SSE) and prints text as blocks arrive; with
--attribution it prints the top concepts of every chunk (or token) as they close.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request

from cde.sse import is_sse_done, parse_sse_line


def _request(url: str, body: dict | None = None, api_key: str | None = None):
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    return urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=600)


def _error(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read())["error"]["message"]
    except Exception:
        return str(exc)


def sse_events(resp):
    """Yield the JSON payload of each `data:` line until `[DONE]`."""
    for raw in resp:
        line = raw.decode("utf-8").rstrip("\n")
        if is_sse_done(line):
            return
        event = parse_sse_line(line)
        if event is not None:
            yield event


def _served_family(args) -> str:
    """"steerling" or "causal": what the server's model is (its /v1/models entry)."""
    try:
        with _request(f"{args.url}/v1/models", api_key=args.api_key) as r:
            models = json.loads(r.read()).get("data", [])
    except (urllib.error.URLError, ValueError):
        return "steerling"
    chosen = next((m for m in models if not args.model or m.get("id") == args.model), models[0] if models else {})
    return (chosen.get("cde") or {}).get("family") or "steerling"


def generate(args) -> int:
    causal = _served_family(args) == "causal"
    attribution = args.attribution or ("none" if causal else "chunks")
    body: dict = {"messages": [{"role": "user", "content": args.prompt}],
                  "max_tokens": args.max_tokens, "stream": True, "stream_options": {"include_usage": True},
                  "attribution": attribution}
    if args.model:
        body["model"] = args.model
    if args.seed is not None:
        body["seed"] = args.seed
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.stride:
        body["decode"] = {"stride": args.stride}
    if args.suppress:
        body["steering"] = {"mode": "suppress", "concepts": [_concept(args.suppress)]}
    elif args.steer:
        body["steering"] = {"mode": "amplify", "concepts": [_concept(s) for s in args.steer]}
    if args.tokens_per_step:
        body["decode"] = {"tokens_per_step": args.tokens_per_step}
    try:
        resp = _request(f"{args.url}/v1/chat/completions", body, args.api_key)
    except urllib.error.HTTPError as exc:
        print(f"error {exc.code}: {_error(exc)}", file=sys.stderr)
        return 1
    usage = None
    for event in sse_events(resp):
        for choice in event.get("choices", []):
            text = (choice.get("delta") or {}).get("content")
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
            if choice.get("finish_reason"):
                print(f"\n[finish: {choice['finish_reason']}]")
        extra = event.get("cde") or {}
        for ch in extra.get("chunk_attributions", []):
            tops = ", ".join(f"{c['label']} {c['score']:+.3f}" for c in ch.get("top", [])[: args.top])
            print(f"\n  [chunk {ch['start']}-{ch['end']}] {tops}", flush=True)
        if attribution == "tokens":
            for tok in extra.get("token_attributions", []):
                tops = ", ".join(f"{c['label']} {c['score']:+.2f}" for c in tok.get("top", [])[: args.top])
                print(f"\n  [token {tok['position']} {tok.get('text', '')!r}] {tops}", flush=True)
        if event.get("usage"):
            usage = event["usage"]
        if causal and extra.get("tokens_per_forward") is not None:
            print(f"[tokens per forward {extra['tokens_per_forward']:.2f}, ISD acceptance "
                  f"{extra.get('isd_acceptance') or 0:.2f}]")
    if usage:
        print(f"usage: {usage}")
    return 0


def concepts(args) -> int:
    q = urllib.parse.urlencode({"q": args.query, "limit": args.limit})
    try:
        with _request(f"{args.url}/v1/concepts?{q}", api_key=args.api_key) as r:
            data = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        print(f"error {exc.code}: {_error(exc)}", file=sys.stderr)
        return 1
    for c in data.get("data", data.get("concepts", [])):
        print(f"{c['id']:>7}  {c['head']:<10} {c['name']}  {c.get('group_name', '')}")
    return 0


def _concept(ref: str) -> dict:
    return {"id": int(ref)} if ref.isdigit() else {"name": ref}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default="", help="model id (default: the one the server serves)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream a chat completion")
    g.add_argument("prompt")
    g.add_argument("--steer", action="append", default=[], help="concept name or id to amplify (repeatable)")
    g.add_argument("--suppress", default=None, help="concept name or id to suppress")
    g.add_argument("--attribution", choices=["none", "tokens", "chunks", "all"], default=None,
                   help="default: chunks (none for a causal model, which has no concepts)")
    g.add_argument("--stride", type=int, default=0, help="causal models: ISD stride N (1 = plain AR)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--max-tokens", type=int, default=96)
    g.add_argument("--tokens-per-step", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--top", type=int, default=5)
    c = sub.add_parser("concepts", help="search the concept catalog")
    c.add_argument("query")
    c.add_argument("--limit", type=int, default=10)
    args = ap.parse_args()
    try:
        code = generate(args) if args.cmd == "generate" else concepts(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`... | head`): stop quietly, as the Python docs recommend
        # (signal module, "Note on SIGPIPE"): point stdout at devnull so the interpreter's final
        # flush does not raise again, and exit with the status a SIGPIPE'd program has
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(141)
    sys.exit(code)


if __name__ == "__main__":
    main()
