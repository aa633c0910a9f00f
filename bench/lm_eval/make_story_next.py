"""Writes bench/lm_eval/story_next.jsonl: a small multiple-choice task for lm-eval over held-out
stories of our own story grammar (train/stories.py, seeds no trainer generates), so it runs with
no download and both bundled models (trained on that grammar) have something to get right.

Each item: the first `j` sentences of a held-out story (j in 2..4) as the context; the choices are
its next sentence and the sentence at the same place in three other held-out stories (their
heroes' names replaced by this story's hero, so a name alone does not give the answer away);
`label` is the true one's index (drawn). Deterministic: the same file every run.

    .venv/bin/python -m bench.lm_eval.make_story_next
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from train.stories import NAMES, generate_story

OUT = Path(__file__).with_name("story_next.jsonl")
SEED = 900_777      # held out: trainers draw story seeds far below 900_000 (train/steerling_data.py)
ITEMS = 100


def _hero_name(sentences: list[str]) -> str | None:
    return next((w.strip(".,!?\"'") for s in sentences[:2] for w in s.split() if w.strip(".,!?\"'") in NAMES), None)


def items(n: int = ITEMS) -> list[dict]:
    rng = random.Random(SEED)
    stories = [generate_story(SEED, i).sentences for i in range(4 * n)]
    out = []
    for k in range(n):
        story = stories[k]
        j = rng.randrange(2, min(5, len(story)))
        name = _hero_name(story)
        others = [s for s in stories[n:] if len(s) > j and s[j] != story[j]]
        wrong = []
        for o in rng.sample(others, 3):
            sentence, theirs = o[j], _hero_name(o)
            wrong.append(sentence.replace(theirs, name) if theirs and name else sentence)
        label = rng.randrange(4)
        choices = wrong[:label] + [story[j]] + wrong[label:]
        out.append({"context": " ".join(story[:j]), "choices": choices, "label": label})
    return out


def main() -> None:
    OUT.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items()))
    print(f"wrote {ITEMS} items to {OUT}")


if __name__ == "__main__":
    main()
