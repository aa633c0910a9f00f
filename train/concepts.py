"""The known-concept catalog and the lexicon the labeler tags text with.

Concepts (in id order): the story generator's own, VADER tone, WordNet lexicographer categories,
chosen mid-depth WordNet noun synsets, Empath categories, Roget's headings. Each has a name,
description, group and steerable flag; `write_catalog` writes them as `concept_labels.parquet`
in the public `steerling` package's column layout. `Lexicon` (word -> concept ids, priority
order) is saved as gzipped JSON so the labeler on the GPU machine needs only the stdlib.

Precision rules (why a word maps to a concept):
* story concepts: the generator's word lists, exact;
* WordNet: only a word's commonest sense (first synset of the part of speech with the most
  tagged senses), its lexname and its nearest two chosen ancestor synsets;
* Empath: words in at most 5 categories; Roget: single words in at most 2 headings;
* a stop list keeps function words out of every non-story concept.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from train.story_concepts import ALL_STORY_CONCEPTS, IRREGULAR, STORY_GROUPS

LEXICON_FILE = "lexicon.json.gz"
TONE_NAMES = ("positive tone", "negative tone", "very positive tone", "very negative tone")
N_SYNSETS = 300
MAX_EMPATH_PER_WORD = 5
MAX_ROGET_PER_WORD = 2

STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below between both but
by can could did do does doing down during each few for from further had has have having he her here hers herself
him himself his how i if in into is it its itself just me more most my myself no nor not now of off on once only or
other our ours ourselves out over own same she should so some such than that the their theirs them themselves then
there these they this those through to too under until up very was we were what when where which while who whom why
will with would you your yours yourself yourselves shall may might must ye thee thou thy thine unto upon also one two
said say says go went come came make made get got let like well much many even every thing things way ever never
yet still again away back upon us lord man men day time till already neither either whereby hereby thereby
albeit indeed thus hence whence wherefore therefore though although unless whether whose hath doth art wast shalt
wilt hast thereof whereof herein therein ah oh o yes nay aye also mr mrs miss sir
""".split())


@dataclass
class CatalogEntry:
    concept_id: int
    name: str
    description: str
    group: str                  # group name (what "suppress" widens to)
    source: str                 # story | vader | wordnet | empath | roget
    key: str                    # the source's own id (lexname, synset offset, category, heading number)
    steerable: bool
    is_tone: bool = False
    words: list[str] = field(default_factory=list)


@dataclass
class Lexicon:
    """word (base form, lower case) -> concept ids in priority order, plus what the labeler
    needs besides: irregular forms, VADER valences, the tone and dialogue concept ids."""

    words: dict[str, list[int]]
    exceptions: dict[str, list[str]]  # surface form -> base forms (WordNet *.exc + the generator's)
    freq: dict[str, int]              # WordNet tagged-sense count: picks among suffix-rule candidates
    noun_forms: dict[str, list[str]]  # plural -> singular (noun.exc + the generator's plurals)
    verbal_story_ids: list[int]       # story concepts that verb/adjective forms may express (actions,
                                      # emotions, morals); "born" is not the animal "bear"
    valence: dict[str, float]
    tone_ids: dict[str, int]
    dialogue_id: int
    story_ids: list[int]
    n_concepts: int
    not_before: dict[str, list[str]] = field(default_factory=lambda: {"kind": ["of"]})  # "kind of" is not kindness
    stop: list[str] = field(default_factory=lambda: sorted(STOPWORDS))  # never labelled (but story words)

    def save(self, path: Path) -> None:
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=9) as f:
            json.dump(asdict(self), f, sort_keys=True, separators=(",", ":"))

    @classmethod
    def load(cls, path: Path) -> Lexicon:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return cls(**json.load(f))


# ---------------------------------------------------------------------------- parsing the sources


def _wordnet_dir(root: Path) -> Path:
    return next(root.rglob("data.noun")).parent


def _lexnames(wn_root: Path) -> dict[int, tuple[str, str]]:
    """file number -> (lexname, contents) from the lexnames(5WN) man page."""
    man = next(wn_root.rglob("lexnames.5WN.gz"))
    out = {}
    for line in gzip.decompress(man.read_bytes()).decode("latin-1").splitlines():
        m = re.match(r"^(\d\d)\t(\S+)\s*\t(.+)$", line)
        if m:
            out[int(m.group(1))] = (m.group(2), m.group(3).strip())
    if len(out) < 45:
        raise ValueError(f"lexnames: found only {len(out)} categories")
    return out


@dataclass
class _Synset:
    offset: str
    lexfile: int
    lemmas: list[str]
    hypernyms: list[str]
    gloss: str


def _read_synsets(wn: Path, pos: str) -> dict[str, _Synset]:
    out = {}
    for line in (wn / f"data.{pos}").read_text(encoding="latin-1").splitlines():
        if line.startswith("  "):
            continue
        head, _, gloss = line.partition("|")
        f = head.split()
        n = int(f[3], 16)
        lemmas = [re.sub(r"\(.*\)$", "", f[4 + 2 * i]).lower() for i in range(n)]
        k = 4 + 2 * n
        n_ptr = int(f[k])
        hyper = [f[k + 1 + 4 * j + 1] for j in range(n_ptr) if f[k + 1 + 4 * j] in ("@", "@i")]
        out[f[0]] = _Synset(f[0], int(f[1]), lemmas, hyper, gloss.strip().split(";")[0].strip())
    return out


def _first_senses(wn: Path) -> tuple[dict[str, tuple[str, str]], dict[str, int]]:
    """word -> (pos, synset offset) of its commonest sense: the part of speech with the most
    tagged senses (nouns win ties), its first-listed synset."""
    best: dict[str, tuple[int, int, str, str]] = {}
    order = {"noun": 3, "verb": 2, "adj": 1, "adv": 0}
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (wn / f"index.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  "):
                continue
            f = line.split()
            lemma, n_syn, n_ptr = f[0], int(f[2]), int(f[3])
            if "_" in lemma:
                continue
            tagged = int(f[5 + n_ptr])
            first = f[6 + n_ptr]
            key = (tagged, order[pos], pos, first)
            if lemma not in best or key[:2] > best[lemma][:2]:
                best[lemma] = key
            del n_syn
    return {w: (v[2], v[3]) for w, v in best.items()}, {w: v[0] for w, v in best.items()}


def _exceptions(wn: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (wn / f"{pos}.exc").read_text(encoding="latin-1").splitlines():
            f = line.split()
            if len(f) >= 2 and "_" not in f[0]:
                for base in f[1:]:
                    if base not in out[f[0]]:
                        out[f[0]].append(base)
    for surface, base in IRREGULAR.items():
        if base not in out[surface]:
            out[surface].insert(0, base)
    return dict(out)


def _empath(root: Path) -> dict[str, list[str]]:
    path = next(root.rglob("categories.tsv"))
    cats = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        f = line.split("\t")
        if len(f) > 1:
            cats[f[0]] = sorted({w.lower() for w in f[1:] if w and " " not in w})
    return cats


_ROGET_HEAD = re.compile(r"^[ \t]*(\d+[a-z]?)\. (?:\[[^\]\n]*\][ \t]*)?([A-Z][^\n]*?) -- ", re.M)
_ROGET_MAX_BODY = 6000  # characters of a heading's entry read (guards against a missed next heading)
_ROGET_SECTION = re.compile(r"^SECTION ([IVXL]+)\.\s*\n\s*([A-Z][A-Z ,'&;-]+)$", re.M)


def _roget(root: Path) -> list[tuple[str, str, str, list[str]]]:
    """[(number, heading, section, words)] from the bundled Gutenberg text (HTML-escaped)."""
    import html

    text = html.unescape(next(root.rglob("10681-body.py")).read_text(encoding="utf-8", errors="replace"))
    sections = [(m.start(), m.group(2).strip().title()) for m in _ROGET_SECTION.finditer(text)]
    heads = list(_ROGET_HEAD.finditer(text))
    out = []
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = text[m.end():min(end, m.end() + _ROGET_MAX_BODY)]
        body = re.sub(r"\[.*?\]|\(.*?\)|&c\.?|\b\d+\b|\b(N|V|Adj|Adv|Phr|Int)\.", " ", body, flags=re.S)
        words = []
        for piece in re.split(r"[,;.:\n]", body):
            w = piece.strip().lower()
            if re.fullmatch(r"[a-z]+", w) and len(w) > 2:
                words.append(w)
        section = next((name for pos, name in reversed(sections) if pos < m.start()), "")
        heading = re.sub(r"\s*\[.*?\]", "", m.group(2)).strip().rstrip(".")
        out.append((m.group(1), heading, section, sorted(set(words))))
    return out


def _vader(root: Path) -> dict[str, float]:
    out = {}
    for line in next(root.rglob("vader_lexicon.txt")).read_text(encoding="utf-8", errors="replace").splitlines():
        f = line.split("\t")
        if len(f) >= 2 and re.fullmatch(r"[a-z][a-z'-]*", f[0]):
            out[f[0]] = float(f[1])
    return out


# ---------------------------------------------------------------------------- building


def build(roots: dict[str, Path]) -> tuple[list[CatalogEntry], Lexicon]:
    """The catalog and lexicon from unpacked sources (`sources.fetch_sources`)."""
    entries: list[CatalogEntry] = []

    def add(**kw) -> CatalogEntry:
        e = CatalogEntry(concept_id=len(entries), **kw)
        entries.append(e)
        return e

    word_ids: dict[str, list[int]] = defaultdict(list)

    def link(word: str, cid: int) -> None:
        if cid not in word_ids[word]:
            word_ids[word].append(cid)

    # 1. story concepts (exact word lists; highest priority)
    story_ids = []
    dialogue_id = -1
    for c in ALL_STORY_CONCEPTS:
        e = add(name=c.name, description=c.description, group=c.group, source="story", key=f"{c.group}:{c.name}",
                steerable=True, words=list(c.words))
        story_ids.append(e.concept_id)
        if c.name == "dialogue":
            dialogue_id = e.concept_id
        for w in c.words:
            link(w, e.concept_id)

    # 2. tone
    tone_ids = {}
    for t in TONE_NAMES:
        tone_ids[t] = add(name=t, description=f"{t}: VADER compound valence of the chunk "
                          f"({'>= 0.5' if t == 'positive tone' else '<= -0.5' if t == 'negative tone' else '>= 0.9' if t.startswith('very pos') else '<= -0.9'}); "
                          "tokens: words with |valence| >= 2", group="tone", source="vader", key=t,
                          steerable=True, is_tone=True).concept_id
    valence = _vader(roots["vader"])

    # 3./4. WordNet
    wn = _wordnet_dir(roots["wordnet"])
    lexnames = _lexnames(roots["wordnet"])
    synsets = {pos: _read_synsets(wn, pos) for pos in ("noun", "verb", "adj", "adv")}
    first, tagged = _first_senses(wn)
    nouns = synsets["noun"]

    depth: dict[str, int] = {}

    def get_depth(off: str) -> int:
        stack, path = [off], []
        while stack:
            o = stack[-1]
            if o in depth:
                stack.pop()
                continue
            hs = [h for h in nouns[o].hypernyms if h in nouns]
            missing = [h for h in hs if h not in depth and h not in path]
            if missing:
                path.append(o)
                stack.extend(missing)
                continue
            depth[o] = 1 + min((depth[h] for h in hs if h in depth), default=-1)
            stack.pop()
            if o in path:
                path.remove(o)
        return depth[off]

    ancestors: dict[str, list[str]] = {}

    def chain(off: str) -> list[str]:
        """Ancestors nearest first (breadth-first over hypernyms)."""
        if off not in ancestors:
            seen, out, frontier = {off}, [], [off]
            while frontier:
                nxt = []
                for o in frontier:
                    for h in nouns[o].hypernyms:
                        if h in nouns and h not in seen:
                            seen.add(h)
                            out.append(h)
                            nxt.append(h)
                frontier = nxt
            ancestors[off] = out
        return ancestors[off]

    mass: Counter[str] = Counter()
    members: dict[str, set[str]] = defaultdict(set)
    for w, (pos, off) in first.items():
        if pos != "noun" or w in STOPWORDS or not w.isalpha():
            continue
        for a in [off] + chain(off):
            mass[a] += 1
            members[a].add(w)
    candidates = [o for o in mass if 5 <= get_depth(o) <= 8 and 15 <= len(members[o]) <= 3000]
    candidates.sort(key=lambda o: -mass[o])
    cand_set = set(candidates)
    # near-duplicates can only be ancestors or descendants of each other
    near_of: dict[str, set[str]] = defaultdict(set)
    for o in candidates:
        for a in chain(o):
            if a in cand_set:
                near_of[o].add(a)
                near_of[a].add(o)
    chosen: list[str] = []
    for o in candidates:
        if len(chosen) == N_SYNSETS:
            break
        # skip a synset whose members are (almost) those of one already chosen
        if any(len(members[o] & members[c]) > 0.9 * min(len(members[o]), len(members[c])) for c in chosen
               if c in near_of[o]):
            continue
        chosen.append(o)

    lex_ids = {}
    # adjective / adverb files (adj.all, adv.all, ...) say only the part of speech: left out
    for num, (name, contents) in sorted(lexnames.items()):
        if not name.startswith(("noun.", "verb.")):
            continue
        lex_ids[num] = add(name=f"{name} (WordNet)", description=f"WordNet lexicographer file {name}: {contents}",
                           group=f"wordnet {name.split('.')[0]}", source="wordnet", key=name, steerable=False).concept_id
    syn_ids = {}
    for o in chosen:
        s = nouns[o]
        syn_ids[o] = add(name=f"{s.lemmas[0].replace('_', ' ')} (WordNet)", description=s.gloss,
                         group=lexnames[s.lexfile][0], source="wordnet", key=f"n{o}", steerable=True).concept_id

    # 5. Empath
    empath = _empath(roots["empath"])
    emp_count = Counter(w for ws in empath.values() for w in ws)
    emp_ids = {cat: add(name=f"{cat.replace('_', ' ')} (Empath)", description=f"Empath category {cat}: "
                        + ", ".join(ws[:8]), group="empath", source="empath", key=cat, steerable=True).concept_id
               for cat, ws in sorted(empath.items())}

    # 6. Roget
    roget = _roget(roots["roget"])
    rog_count = Counter(w for _, _, _, ws in roget for w in ws)
    rog_ids = {}
    for num, head, section, ws in roget:
        rog_ids[num] = add(name=f"{head.lower()} (Roget {num})", description=f"Roget's Thesaurus #{num} {head}: "
                           + ", ".join(ws[:8]), group=f"roget {section.lower()}", source="roget", key=num,
                           steerable=False).concept_id

    emp_of: dict[str, list[str]] = defaultdict(list)
    for cat, ws in sorted(empath.items()):
        for w in ws:
            emp_of[w].append(cat)
    rog_of: dict[str, list[str]] = defaultdict(list)
    for num, _, _, ws in roget:
        for w in ws:
            rog_of[w].append(num)

    # word links, in priority order: story > synsets (nearest) > empath > roget > lexname
    vocab = set(first) | set(emp_count) | set(rog_count)
    for w in sorted(vocab):
        if w in STOPWORDS or not w.isalpha():
            continue
        if w in first:
            pos, off = first[w]
            if pos == "noun":
                near = [syn_ids[a] for a in [off] + chain(off) if a in syn_ids][:2]
                for cid in near:
                    link(w, cid)
        if emp_count[w] <= MAX_EMPATH_PER_WORD:
            for cat in emp_of.get(w, ()):
                link(w, emp_ids[cat])
        if rog_count[w] <= MAX_ROGET_PER_WORD:
            for num in rog_of.get(w, ()):
                link(w, rog_ids[num])
        if w in first:
            pos, off = first[w]
            if synsets[pos][off].lexfile in lex_ids:
                link(w, lex_ids[synsets[pos][off].lexfile])
    # unique names: a repeated synset lemma gets its lexname, anything still repeated its key
    seen = Counter(e.name.lower() for e in entries)
    for e in entries:
        if seen[e.name.lower()] > 1 and e.source == "wordnet" and e.key.startswith("n"):
            e.name = f"{e.name[:-len(' (WordNet)')]} (WordNet, {e.group})"
    seen = Counter(e.name.lower() for e in entries)
    for e in entries:
        if seen[e.name.lower()] > 1 and e.source != "story":
            e.name = f"{e.name[:-1]} {e.key})"
    for e in entries:
        if not e.words:
            e.words = sorted(w for w, ids in word_ids.items() if e.concept_id in ids)[:50]

    words = {w: ids for w, ids in word_ids.items() if ids}
    exceptions = {k: [b for b in v if b in words] for k, v in _exceptions(wn).items()}
    noun_exc: dict[str, list[str]] = defaultdict(list)
    for line in (wn / "noun.exc").read_text(encoding="latin-1").splitlines():
        f = line.split()
        if len(f) >= 2 and "_" not in f[0]:
            noun_exc[f[0]] += [b for b in f[1:] if b in words]
    for surface, base in IRREGULAR.items():
        if base in words and any(w == base for c in ALL_STORY_CONCEPTS if c.group != "action" for w in c.words):
            noun_exc[surface].insert(0, base)
    verbal = [i for i, c in zip(story_ids, ALL_STORY_CONCEPTS) if c.group in ("action", "emotion", "moral")]
    lex = Lexicon(words=words, exceptions={k: v for k, v in exceptions.items() if v},
                  noun_forms={k: v for k, v in noun_exc.items() if v}, verbal_story_ids=verbal,
                  freq={w: tagged.get(w, 0) for w in words},
                  valence=valence, tone_ids=tone_ids, dialogue_id=dialogue_id, story_ids=story_ids,
                  n_concepts=len(entries))
    return entries, lex


def group_ids(entries: list[CatalogEntry]) -> dict[str, int]:
    """Group name -> public_group_id: story groups first (stable), then the rest in order seen."""
    out: dict[str, int] = {g: i for i, g in enumerate(STORY_GROUPS)}
    for e in entries:
        out.setdefault(e.group, len(out))
    return out


def write_catalog(entries: list[CatalogEntry], path: Path) -> None:
    """`concept_labels.parquet` in the public package's layout (plus source, source_key, words)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    gids = group_ids(entries)
    table = pa.table({
        "concept_id": pa.array([e.concept_id for e in entries], pa.int64()),
        "concept_name": [e.name for e in entries],
        "concept_description": [e.description for e in entries],
        "head": ["known"] * len(entries),
        "public_group_id": pa.array([gids[e.group] for e in entries], pa.int64()),
        "group_name": [e.group for e in entries],
        "is_steerable": [e.steerable for e in entries],
        "is_tone": [e.is_tone for e in entries],
        "is_alignment": [False] * len(entries),
        "is_demographic": [False] * len(entries),
        "source": [e.source for e in entries],
        "source_key": [e.key for e in entries],
        "words": [", ".join(e.words[:20]) for e in entries],
    })
    pq.write_table(table, path, compression="zstd")
