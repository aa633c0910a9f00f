"""Training text for idlm-small: one function, ``load_corpus``, behind which the source can change.

Sources (only one so far; the data package's shard loader, ``train.data.ShardSet``, with its
prose shards, would be a second one here):

* ``"standin"``: a self-contained stand-in: seeded stories (the data helper's grammar,
  ``train/stories.py``, when the tree has it, else a small grammar of our own: characters,
  settings, animals, weather, objects, feelings, dialogue, a moral) plus chat-form pairs
  ("Tell me a story about X." -> a story), tokenized with the bundled models' tokenizer
  (``train/artifacts/tokenizer.json``) when the tree has it, else a byte-level BPE trained on
  them here with ``tokenizers``. It runs anywhere in seconds (tiny) to tens of seconds (GPU run, 16 cores);

Every source gives the same thing: a :class:`Corpus` (tokenizer.json path, special ids, a
uint16 token stream for training with documents separated by ``<|endoftext|>``, a disjoint
held-out stream and held-out prompts for decoding).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"
SPECIALS = (ENDOFTEXT, IM_START, IM_END, MASK)


@dataclass
class Corpus:
    tokenizer_file: Path
    special_ids: dict[str, int]          # ENDOFTEXT, IM_START, IM_END, MASK -> id
    vocab_size: int
    train: np.ndarray                    # uint16 token stream
    heldout: np.ndarray                  # uint16, documents never in `train`
    prompts: list[list[int]]             # held-out decoding prompts (story openings and chat prompts)
    prompt_texts: list[str] = field(default_factory=list)
    source: str = "standin"

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.special_ids[IM_END], self.special_ids[ENDOFTEXT])


# ---- the stand-in story grammar --------------------------------------------------------------
NAMES = ("Mia", "Tom", "Lily", "Ben", "Sara", "Max", "Anna", "Leo", "Zoe", "Sam", "Ella", "Jack", "Nora",
         "Finn", "Ruby", "Omar", "Ivy", "Hugo", "Maya", "Theo", "Lucy", "Noah", "Ada", "Eli")
ANIMALS = ("cat", "dog", "fox", "owl", "rabbit", "bear", "frog", "duck", "horse", "mouse", "turtle", "bird",
           "fish", "goat", "lion", "whale", "crab", "deer", "wolf", "bee")
SETTINGS = {
    "sea": ("the beach", "a small boat", "the harbor", "a rocky shore"),
    "forest": ("the tall trees", "a quiet path", "a mossy log", "the old oak"),
    "city": ("a busy street", "the park", "a tall tower", "the market"),
    "space": ("a silver rocket", "the moon", "a far star", "the space station"),
    "farm": ("the red barn", "a green field", "the hen house", "the pond"),
    "mountain": ("a snowy peak", "a cold cave", "the high trail", "a wooden hut"),
    "school": ("the classroom", "the library", "the playground", "the music room"),
}
WEATHER = ("the sun was warm", "it was raining", "the wind was strong", "snow was falling", "the sky was grey",
           "a storm was coming", "the air was cool", "the stars were bright")
OBJECTS = ("a red ball", "a shiny key", "an old map", "a blue kite", "a little box", "a golden shell",
           "a paper boat", "a warm blanket", "a lost hat", "a big drum", "a magic stone", "a green book")
FEELINGS = ("happy", "sad", "scared", "brave", "curious", "tired", "proud", "angry", "excited", "calm", "lonely",
            "surprised")
ACTIONS = ("ran to", "walked to", "looked at", "jumped over", "climbed up", "sat near", "danced around",
           "hid behind", "waved at", "sang to")
PROBLEMS = ("could not find the way home", "lost {obj}", "was stuck in the mud", "wanted to fly",
            "had no friends", "was afraid of the dark", "broke {obj}", "forgot a promise")
HELPS = ("shared {obj}", "showed the way", "gave a kind hug", "told a funny story", "found {obj}",
         "held out a paw", "sang a soft song", "built a small bridge")
MORALS = ("Friends help each other.", "It is good to be kind.", "Being brave is not being unafraid.",
          "Sharing makes everyone happy.", "Always tell the truth.", "Small things can matter a lot.",
          "It is okay to ask for help.", "Patience brings good things.")
SAYS = ("said", "asked", "shouted", "whispered", "laughed")


def story(rng: random.Random) -> tuple[str, str]:
    """One story and its setting name."""
    name, friend = rng.sample(NAMES, 2)
    animal = rng.choice(ANIMALS)
    setting = rng.choice(list(SETTINGS))
    place, place2 = rng.sample(SETTINGS[setting], 2)
    obj, obj2 = rng.sample(OBJECTS, 2)
    f1, f2 = rng.sample(FEELINGS, 2)
    out = [rng.choice((f"Once upon a time, there was a {f1} {animal} named {name}.",
                       f"One day, a little {animal} called {name} felt {f1}.",
                       f"There once lived a {animal} named {name} near {place}."))]
    out.append(f"{rng.choice(WEATHER).capitalize()} at {place}.")
    for _ in range(rng.randint(1, 3)):
        out.append(f"{name} {rng.choice(ACTIONS)} {rng.choice(SETTINGS[setting])} and saw {rng.choice(OBJECTS)}.")
    out.append(f"But {name} {rng.choice(PROBLEMS).format(obj=obj)}.")
    out.append(f"\"I feel {f1},\" {name} {rng.choice(SAYS)}.")
    out.append(f"Then {friend} the {rng.choice(ANIMALS)} came to {place2}.")
    out.append(f"\"Do not worry, {name},\" {friend} {rng.choice(SAYS)}. \"I will help you.\"")
    out.append(f"{friend} {rng.choice(HELPS).format(obj=obj2)}.")
    out.append(f"Now {name} felt {f2}, and the two friends {rng.choice(ACTIONS)} {rng.choice(SETTINGS[setting])} "
               f"together.")
    if rng.random() < 0.7:
        out.append(rng.choice(MORALS))
    return " ".join(out), setting


def chat(ask: str, text: str) -> str:
    return f"{IM_START}user\n{ask}{IM_END}\n{IM_START}assistant\n{text}{IM_END}\n"


def chat_prompt(ask: str) -> str:
    return f"{IM_START}user\n{ask}{IM_END}\n{IM_START}assistant\n"


def _story_generator():
    """The data helper's story grammar (train/stories.py, issue 14) when this tree has it."""
    try:
        from train.stories import generate_story
    except ImportError:
        return None
    return generate_story


def story_at(seed: int, index: int) -> tuple[str, str]:
    """Story ``index`` of ``seed`` and an instruction it answers: the data helper's grammar when
    present (richer), else the small grammar above. Depends only on (seed, index)."""
    gen = _story_generator()
    if gen is not None:
        st = gen(seed, index)
        return st.text, (getattr(st, "prompt", "") or "Tell me a story.")
    rng = random.Random(seed * 1_000_003 + index)
    text, setting = story(rng)
    ask = rng.choice(("Tell me a story about the {s}.", "Write a short story set in the {s}.",
                      "Can you tell me a story about the {s}?", "Tell me about the {s}."))
    return text, ask.format(s=setting)


def story_source() -> str:
    return "train.stories" if _story_generator() is not None else "standin grammar"


HELDOUT_START = 1 << 40   # held-out documents' indices: never reached by training indices


def documents(seed: int, start: int, count: int) -> list[str]:
    """Documents ``start .. start + count - 1``: stories, one in four as a chat pair."""
    docs = []
    for i in range(start, start + count):
        text, ask = story_at(seed, i)
        docs.append(chat(ask, text) if i % 4 == 0 else text)
    return docs


def _docs_job(args: tuple[int, int, int]) -> list[str]:
    return documents(*args)


SHARED_TOKENIZER = Path(__file__).resolve().parent / "artifacts" / "tokenizer.json"


def shared_tokenizer() -> Path | None:
    """The committed tokenizer of the bundled models (train/artifacts/tokenizer.json, built by
    ``python -m train.build_data tokenizer``), when the tree has it and it has the causal
    family's specials."""
    if not SHARED_TOKENIZER.is_file():
        return None
    added = {t["content"] for t in json.loads(SHARED_TOKENIZER.read_text()).get("added_tokens", [])}
    return SHARED_TOKENIZER if set(SPECIALS) <= added else None


def _train_tokenizer(texts: list[str], vocab_size: int, path: Path) -> None:
    """The data helper's tokenizer trainer (train/tokenizer_build.py: the bundled models' specials
    and ids) when the tree has it, else a byte-level BPE with the four causal-family specials."""
    try:
        from train.tokenizer_build import train_tokenizer
    except ImportError:
        train_tokenizer = None
    if train_tokenizer is not None:
        train_tokenizer(texts, path, vocab_size)
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))


def _encode(tokenizer_file: Path, docs: list[str], eot: int) -> np.ndarray:
    """Documents -> one uint16 stream, each document followed by ``eot``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    parts = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([eot], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def _encoded_docs_job(args: tuple[str, int, int, int, int]) -> np.ndarray:
    """Generate and tokenize documents in a worker (no text travels between processes)."""
    tok_file, eot, seed, start, count = args
    return _encode(Path(tok_file), documents(seed, start, count), eot)


def _pool_map(fn, jobs: list, workers: int) -> list:
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers) as ex:
            return list(ex.map(fn, jobs))
    return [fn(j) for j in jobs]


def _ranges(start: int, count: int, parts: int) -> list[tuple[int, int]]:
    per = max(1, -(-count // parts))
    return [(start + i, min(per, count - i)) for i in range(0, count, per)]


def standin_corpus(work_dir: str | Path, train_docs: int, vocab_size: int, seed: int = 1, heldout_docs: int = 400,
                   n_prompts: int = 64, workers: int | None = None, tokenizer_docs: int = 20_000) -> Corpus:
    """Generate the stand-in corpus: a tokenizer (work_dir/tokenizer.json) trained on the first
    ``tokenizer_docs`` training documents, then every document generated and tokenized in
    ``workers`` processes."""
    work_dir = Path(work_dir)
    workers = workers or max(1, min(16, os.cpu_count() or 1))
    tok_file = work_dir / "tokenizer.json"
    shared = shared_tokenizer()
    if shared is not None:   # the bundled models' tokenizer (data helper, issue 14): the same family
        work_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shared, tok_file)
    else:
        n_tok = min(tokenizer_docs, train_docs)
        jobs = [(seed, a, c) for a, c in _ranges(0, n_tok, workers)]
        _train_tokenizer([d for part in _pool_map(_docs_job, jobs, workers) for d in part], vocab_size, tok_file)
    data = json.loads(tok_file.read_text())
    special = {t["content"]: int(t["id"]) for t in data["added_tokens"]}
    eot = special[ENDOFTEXT]
    jobs = [(str(tok_file), eot, seed, a, c) for a, c in _ranges(0, train_docs, workers * 4)]
    train = np.concatenate(_pool_map(_encoded_docs_job, jobs, workers))
    heldout = _encode(tok_file, documents(seed, HELDOUT_START, heldout_docs), eot)
    prompts, prompt_texts = _prompts(tok_file, seed, n_prompts)
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(tok_file)).get_vocab_size(with_added_tokens=True)
    source = f"standin ({story_source()}; tokenizer: {'train/artifacts' if shared else 'trained here'})"
    return Corpus(tok_file, special, vocab, train, heldout, prompts, prompt_texts, source)


def _prompts(tok_file: Path, seed: int, n: int) -> tuple[list[list[int]], list[str]]:
    """Held-out prompts (stories past the held-out text's): story openings (first sentence) and
    chat requests, alternating."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    texts = []
    for i in range(n):
        text, ask = story_at(seed, HELDOUT_START + (1 << 30) + i)
        texts.append(chat_prompt(ask) if i % 2 else text.split(". ")[0] + ".")
    return [tok.encode(t, add_special_tokens=False).ids for t in texts], texts


def load_corpus(source: str, work_dir: str | Path, *, tiny: bool = False, seed: int = 1,
                docs: int | None = None) -> Corpus:
    """The corpus of a run; ``docs`` overrides the stand-in's number of training documents."""
    work_dir = Path(work_dir)
    if source != "standin":
        raise ValueError(f"data source must be 'standin' (the only one wired so far), got {source!r}")
    if tiny:
        return standin_corpus(work_dir, train_docs=docs or 3000, vocab_size=512, seed=seed, heldout_docs=60,
                              n_prompts=8, workers=1)
    return standin_corpus(work_dir, train_docs=docs or 400_000, vocab_size=4096, seed=seed)
