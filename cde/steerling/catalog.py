"""The concept catalog: labels, groups and search.

Real labels come from Guide Labs' `concept_labels.parquet` (columns concept_id,
concept_name, concept_description, head, public_group_id, group_name, is_steerable,
is_tone, is_alignment, is_demographic) when it sits in the model directory; it cannot be
downloaded here. The bundled tiny model gets a synthetic catalog with readable names so
search, steering by name and labelled attributions work end to end.

User-facing ids: known concepts 0..n_known-1, discovered n_known + j. Every discovered id
resolves: from `discovered_concepts.parquet` when the bundle ships it (written at bundle time by
`train/describe_discovered.py`: "Discovered #N: tok1 / tok2 / tok3", a description with the top
tokens through the LM head and the training text that activates the concept most), else from
discovered rows of `concept_labels.parquet`, else a generic "Discovered #N" (never steerable).

Names: `find_name` takes an exact name (case-insensitive) first, then a unique base name (the
part before " (": "music" for "music (Empath)"; for discovered concepts also the part before
": ", "discovered #N"); an ambiguous or unknown name raises `NameNotFound` with the closest names.
Search ranks exact names, then base names, then whole-word name matches, name words starting with
the query, whole-word description matches, and substrings inside words last.
"""

from __future__ import annotations

import bisect
import difflib
import re
from dataclasses import dataclass
from pathlib import Path

LABELS_FILE = "concept_labels.parquet"
DISCOVERED_FILE = "discovered_concepts.parquet"   # bundle-time descriptions of the discovered head
SUGGESTIONS = 5                                   # closest names a NameNotFound lists
HEADS = ("known", "discovered")

_TINY_WORDS = [
    "ocean", "river", "rain", "mountain", "music", "melody", "rhythm", "song",
    "mathematics", "algebra", "geometry", "number", "cooking", "bread", "spice", "kitchen",
    "space", "planet", "star", "rocket", "medicine", "doctor", "health", "hospital",
    "law", "court", "contract", "justice", "sports", "football", "running", "team",
    "computer", "software", "network", "database", "history", "empire", "war", "ancient",
    "joy", "sadness", "anger", "fear", "formal tone", "casual tone", "politeness", "humor",
]


@dataclass(frozen=True)
class Concept:
    concept_id: int
    name: str
    head: str                 # "known" | "discovered"
    description: str = ""
    group_id: int | None = None
    group_name: str = ""
    steerable: bool = True

    @property
    def label(self) -> str:
        if self.head == "known":
            return f"Known: {self.name}"
        # "Discovered #N: a / b" reads "Discovered: #N: a / b", not "Discovered: Discovered #N..."
        name = self.name[len("Discovered "):] if self.name.startswith("Discovered #") else self.name
        return f"Discovered: {name}"

    @property
    def base_name(self) -> str:
        """The name without its source suffix: "music" for "music (Empath)"; for a discovered
        concept also without its description: "discovered #N" for "Discovered #N: a / b"."""
        base = self.name.split(" (", 1)[0]
        if self.head == "discovered":
            base = base.split(": ", 1)[0]
        return base.strip().lower()


def generic_discovered(concept_id: int) -> Concept:
    """The entry of a discovered concept the bundle does not describe."""
    return Concept(concept_id, f"Discovered #{concept_id}", "discovered",
                   "a concept of the discovered head (no description in this bundle)", steerable=False)


class NameNotFound(LookupError):
    """No concept has this name or base name, or several share the base name; `candidates` are
    the closest names (the sharing ones, when ambiguous)."""

    def __init__(self, name: str, candidates: list[str], ambiguous: bool):
        self.name, self.candidates, self.ambiguous = name, candidates, ambiguous
        what = f"{name!r} is ambiguous" if ambiguous else f"no concept named {name!r}"
        hint = f"; {'candidates' if ambiguous else 'closest names'}: " + ", ".join(repr(c) for c in candidates) \
            if candidates else ""
        super().__init__(what + hint)
        self.message = what + hint


def _word_re(q: str, whole: bool) -> re.Pattern[str]:
    return re.compile(r"(?<!\w)" + re.escape(q) + (r"(?!\w)" if whole else ""))


class ConceptCatalog:
    def __init__(self, concepts: list[Concept], n_known: int):
        self.n_known = n_known
        self._by_id = {c.concept_id: c for c in concepts}
        self._ids = sorted(self._by_id)   # listing pages walk ids in order
        # exact names: known first (a discovered concept never shadows a known one)
        self._by_name: dict[str, Concept] = {}
        self._by_base: dict[str, list[Concept]] = {}
        for c in sorted(concepts, key=lambda c: (c.head != "known", c.concept_id)):
            self._by_name.setdefault(c.name.strip().lower(), c)
            self._by_base.setdefault(c.base_name, []).append(c)
        self._groups: dict[int, list[int]] = {}
        for c in concepts:
            if c.group_id is not None:
                self._groups.setdefault(c.group_id, []).append(c.concept_id)
        for members in self._groups.values():
            members.sort()

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def load(cls, model_dir: str | Path | None, n_known: int, n_discovered: int) -> ConceptCatalog:
        path = Path(model_dir) / LABELS_FILE if model_dir is not None else None
        if path is not None and path.exists():
            disc = path.parent / DISCOVERED_FILE
            return cls.from_parquet(path, n_known, n_discovered, disc if disc.exists() else None)
        return cls.synthetic(n_known, n_discovered)

    @classmethod
    def from_parquet(cls, path: str | Path, n_known: int, n_discovered: int = 0,
                     discovered_path: str | Path | None = None) -> ConceptCatalog:
        """The labels file's rows; discovered ids n_known .. n_known + n_discovered - 1 that it
        lacks come from `discovered_path` (DISCOVERED_FILE) where it has them, else generic."""
        import pyarrow.parquet as pq

        table = pq.read_table(path).to_pylist()
        concepts = []
        for row in table:
            head = "discovered" if str(row.get("head", "known")) in ("unknown", "discovered") else "known"
            cid = int(row["concept_id"])
            gid = row.get("public_group_id")
            concepts.append(Concept(
                concept_id=cid, name=str(row.get("concept_name") or f"#{cid}"), head=head,
                description=str(row.get("concept_description") or ""),
                group_id=int(gid) if gid is not None and gid == gid else None,
                group_name=str(row.get("group_name") or ""),
                steerable=bool(row.get("is_steerable", True)) if row.get("is_steerable") is not None else True,
            ))
        have = {c.concept_id for c in concepts}
        if discovered_path is not None:
            for row in pq.read_table(discovered_path, columns=["concept_id", "concept_name",
                                                               "concept_description"]).to_pylist():
                cid = int(row["concept_id"])
                if cid in have or not n_known <= cid < n_known + n_discovered:
                    continue   # the labels file wins; ids outside this model's head are not its
                concepts.append(Concept(cid, str(row["concept_name"]), "discovered",
                                        str(row.get("concept_description") or ""), steerable=False))
                have.add(cid)
        concepts.extend(generic_discovered(cid) for cid in range(n_known, n_known + n_discovered) if cid not in have)
        return cls(concepts, n_known)

    @classmethod
    def synthetic(cls, n_known: int, n_discovered: int) -> ConceptCatalog:
        concepts = []
        for i in range(n_known):
            word = _TINY_WORDS[i] if i < len(_TINY_WORDS) else f"concept {i}"
            gid = i // 4
            concepts.append(Concept(i, word, "known", f"synthetic concept '{word}'", gid,
                                    f"group {gid}: " + ", ".join(_TINY_WORDS[gid * 4:gid * 4 + 4])))
        for j in range(n_discovered):
            concepts.append(Concept(n_known + j, f"discovered #{j}", "discovered", steerable=False))
        return cls(concepts, n_known)

    # ---- queries ----------------------------------------------------------------------
    def get(self, concept_id: int) -> Concept | None:
        return self._by_id.get(concept_id)

    def by_name(self, name: str) -> Concept | None:
        """`find_name`, or None where it raises."""
        try:
            return self.find_name(name)
        except NameNotFound:
            return None

    def find_name(self, name: str) -> Concept:
        """The concept an exact name (case-insensitive) or else a unique base name means (a base
        name shared by several concepts of which exactly one is a steerable known concept means
        that one: "music" is "music (Empath)", not the unsteerable "music (Roget 415)"); raises
        NameNotFound (listing candidates) when the base name is ambiguous or nothing matches."""
        q = " ".join(name.split()).lower()
        c = self._by_name.get(q)
        if c is not None:
            return c
        same = self._by_base.get(q, [])
        if len(same) == 1:
            return same[0]
        steerable = [c for c in same if c.head == "known" and c.steerable]
        if len(steerable) == 1:
            return steerable[0]
        if same:
            raise NameNotFound(name, [c.name for c in same[:SUGGESTIONS]], ambiguous=True)
        raise NameNotFound(name, self.closest_names(q), ambiguous=False)

    def closest_names(self, query: str, n: int = SUGGESTIONS) -> list[str]:
        """Up to n names near `query`: name matches of the search first, then similar spellings."""
        q = query.strip().lower()
        if not q:
            return []
        hits = sorted(self._ranked(q, known_only=False), key=lambda t: (t[0], t[1].concept_id))
        out = [c.name for rank, c in hits if rank <= 3][:n]
        if len(out) < n:
            for base in difflib.get_close_matches(q, list(self._by_base), n=n, cutoff=0.6):
                for c in self._by_base[base]:
                    if c.name not in out:
                        out.append(c.name)
        return out[:n]

    def label(self, concept_id: int) -> str:
        c = self._by_id.get(concept_id)
        if c is not None:
            return c.label
        head = "Discovered" if concept_id >= self.n_known else "Known"
        return f"{head}: #{concept_id}"

    def group_neighbours(self, concept_id: int) -> list[int]:
        c = self._by_id.get(concept_id)
        if c is None or c.group_id is None:
            return []
        return [i for i in self._groups[c.group_id] if i != concept_id and i < self.n_known]

    def search(self, query: str, limit: int = 20, known_only: bool = False) -> list[Concept]:
        """Case-insensitive search over names, then descriptions, best first (ties in id order):
        0 exact name, 1 base name ("music" -> "music (Empath)"), 2 the query as whole words of the
        name, 3 name words starting with it, 4 whole words of the description, 5 a substring
        inside a word of the name ("sea" in "disease"), 6 inside a word of the description."""
        q = " ".join(query.split()).lower()
        if not q:
            return []
        hits = self._ranked(q, known_only)
        hits.sort(key=lambda t: (t[0], t[1].concept_id))
        return [c for _, c in hits[:limit]]

    def _ranked(self, q: str, known_only: bool) -> list[tuple[int, Concept]]:
        whole, prefix = _word_re(q, True), _word_re(q, False)
        hits = []
        for c in self._by_id.values():
            if known_only and c.head != "known":
                continue
            name, desc = c.name.lower(), c.description.lower()
            if q == name:
                rank = 0
            elif q == c.base_name:
                rank = 1
            elif q not in name and q not in desc:
                continue
            elif whole.search(name):
                rank = 2
            elif prefix.search(name):
                rank = 3
            elif whole.search(desc):
                rank = 4
            elif q in name:
                rank = 5
            else:
                rank = 6
            hits.append((rank, c))
        return hits

    def page(self, limit: int, after: int | None = None, head: str | None = None, group_id: int | None = None,
             steerable: bool | None = None) -> tuple[list[Concept], bool]:
        """Up to `limit` concepts with ids above `after`, ascending, that pass every given filter;
        and whether more pass after them (the next page starts after the last id returned)."""
        ids = self._groups.get(group_id, []) if group_id is not None else self._ids
        out: list[Concept] = []
        for cid in ids[bisect.bisect_right(ids, after) if after is not None else 0:]:
            c = self._by_id[cid]
            if (head is not None and c.head != head) or (steerable is not None and c.steerable != steerable):
                continue
            if len(out) == limit:
                return out, True
            out.append(c)
        return out, False

    def __len__(self) -> int:
        return len(self._by_id)
