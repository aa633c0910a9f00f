"""The concept catalog: labels, groups and search.

Real labels come from Guide Labs' `concept_labels.parquet` (columns concept_id,
concept_name, concept_description, head, public_group_id, group_name, is_steerable,
is_tone, is_alignment, is_demographic) when it sits in the model directory; it cannot be
downloaded here. The bundled tiny model gets a synthetic catalog with readable names so
search, steering by name and labelled attributions work end to end.

User-facing ids: known concepts 0..n_known-1, discovered n_known + j.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

LABELS_FILE = "concept_labels.parquet"
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
        return f"{'Known' if self.head == 'known' else 'Discovered'}: {self.name}"


class ConceptCatalog:
    def __init__(self, concepts: list[Concept], n_known: int):
        self.n_known = n_known
        self._by_id = {c.concept_id: c for c in concepts}
        self._ids = sorted(self._by_id)   # listing pages walk ids in order
        self._by_name = {c.name.lower(): c for c in concepts if c.head == "known"}
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
            return cls.from_parquet(path, n_known)
        return cls.synthetic(n_known, n_discovered)

    @classmethod
    def from_parquet(cls, path: str | Path, n_known: int) -> ConceptCatalog:
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
        return self._by_name.get(name.strip().lower())

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
        """Case-insensitive substring search over names, then descriptions; exact names first."""
        q = query.strip().lower()
        if not q:
            return []
        hits = []
        for c in self._by_id.values():
            if known_only and c.head != "known":
                continue
            name = c.name.lower()
            if q == name:
                rank = 0
            elif name.startswith(q):
                rank = 1
            elif q in name:
                rank = 2
            elif q in c.description.lower():
                rank = 3
            else:
                continue
            hits.append((rank, c.concept_id, c))
        hits.sort(key=lambda t: (t[0], t[1]))
        return [c for _, _, c in hits[:limit]]

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
