"""Training data (train/): story generator, labeler, license allow list, shards, loader and the
committed artifacts. CPU, seconds; nothing is downloaded (the committed tokenizer, lexicon and
catalog under train/artifacts are the fixtures)."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import numpy as np
import pytest

from train.build_data import CATALOG, LEXICON, MANIFEST, PROSE, TOKENIZER
from train.concepts import Lexicon
from train.labeler import CHUNK, CHUNK_K, NO_LABEL, TOKEN_K, Labeler
from train.sources import ALLOWED_LICENSES, SOURCES, LicenseRefused, Source, check_license, fetch_sources
from train.stories import generate_story
from train.story_concepts import ALL_STORY_CONCEPTS, BY_NAME
from train.tokenizer_build import SPECIAL_IDS, SPECIALS


@pytest.fixture(scope="module")
def lexicon() -> Lexicon:
    return Lexicon.load(LEXICON)


@pytest.fixture(scope="module")
def lab(lexicon: Lexicon) -> Labeler:
    return Labeler(lexicon, TOKENIZER)


@pytest.fixture(scope="module")
def names(lexicon: Lexicon) -> dict[int, str]:
    import pyarrow.parquet as pq

    t = pq.read_table(CATALOG)
    return dict(zip(t.column("concept_id").to_pylist(), t.column("concept_name").to_pylist()))


def story_names(lab: Labeler, lexicon: Lexicon, text: str) -> set[str]:
    ids = dict(zip(lexicon.story_ids, (c.name for c in ALL_STORY_CONCEPTS)))
    labels = lab.label_text(text).labels
    return {ids[int(c)] for c in np.unique(labels) if int(c) in ids}


# ---------------------------------------------------------------------------- generator


def test_generator_is_deterministic_by_seed_and_index() -> None:
    a = [generate_story(11, i) for i in range(50)]
    b = [generate_story(11, i) for i in reversed(range(50))][::-1]
    assert [s.text for s in a] == [s.text for s in b]
    assert [s.concepts for s in a] == [s.concepts for s in b]
    assert [s.text for s in a] != [generate_story(12, i).text for i in range(50)]
    assert len({s.text for s in a}) == 50


def test_story_concept_words_are_disjoint() -> None:
    seen: dict[str, str] = {}
    for c in ALL_STORY_CONCEPTS:
        for w in c.words:
            assert w not in seen, f"{w!r} in both {seen[w]!r} and {c.name!r}"
            seen[w] = c.name
    for c in ALL_STORY_CONCEPTS:
        for n in c.natives + c.actions:
            assert n in BY_NAME, f"{c.name}: unknown concept {n!r}"


@pytest.mark.parametrize("grammar", [1, 2])
@pytest.mark.parametrize("seed", [0, 5, 2024])
def test_story_tags_are_exactly_what_the_labeler_finds(lab: Labeler, lexicon: Lexicon, seed: int, grammar: int) -> None:
    """Every story concept the generator records is found in its text, and no other."""
    for i in range(150):
        s = generate_story(seed, i, grammar)
        found = story_names(lab, lexicon, s.text)
        assert found == s.concepts, (f"seed={seed} grammar={grammar} index={i}: missing {s.concepts - found}, "
                                     f"extra {found - s.concepts}\n{s.text}")


def distinct_sentence_share(grammar: int, n: int = 400) -> float:
    sentences = [x for i in range(n) for x in re.split(r"(?<=[.!?\"])\s+", generate_story(3, i, grammar).text)]
    return len(set(sentences)) / len(sentences)


def test_stories_have_variety() -> None:
    one, two = distinct_sentence_share(1), distinct_sentence_share(2)
    assert one > 0.5 and two > one + 0.05, (one, two)   # over 20,000 stories: 0.36 and 0.70


# sha256 of grammar 1's stories 0..199 of seed 7, joined by newlines (before grammar 2 existed)
GRAMMAR_1_DIGEST = "eba9a0f5f08ba46c22b33251a09b2618ed2ca737d8f537b7dc6f5a7ecc8fca81"


def test_grammar_1_is_unchanged_and_grammar_2_varies_the_narration() -> None:
    """Grammar 1 draws exactly what it always drew (the bundled model's data and the committed
    evaluation figures depend on it); grammar 2's stories carry its leads and tails."""
    import hashlib

    from train.stories import LEADS, TAILS
    digest = hashlib.sha256("\n".join(generate_story(7, i).text for i in range(200)).encode()).hexdigest()
    assert digest == GRAMMAR_1_DIGEST, digest
    varied = sum(any(t in generate_story(7, i, 2).text for t in TAILS) for i in range(100))
    assert varied == 100, varied
    assert all(lead not in generate_story(7, i).text for i in range(50) for lead in LEADS[5:]), "grammar 1 changed"
    with pytest.raises(ValueError, match="grammar"):
        generate_story(7, 0, 3)


# ---------------------------------------------------------------------------- labeler

POSITIVE = [
    ("The foxes swam across the wide sea.", {"fox", "swimming", "sea"}),
    ("Three mice hid under the cottage.", {"mouse", "hiding", "village"}),
    ("The children were singing in the garden.", {"singing", "garden"}),
    ("A rainbow appeared, and the girl felt happy.", {"rainbow", "girl", "joy"}),
    ("Wolves howled on the mountain during the blizzard.", {"wolf", "mountain", "snow"}),
    ("He was grateful for the warm bread and honey.", {"gratitude", "bread", "honey"}),
    ("He was born in a small city.", {"city"}),  # "born" is a form of the verb bear, not the animal
]
NEGATIVE = [
    "What kind of day is it?",              # "kind of" is not kindness
    "The committee adjourned the meeting.",  # no story concept at all
    "She rose early and was being careful.",  # "rose" was dropped from the garden; "being" is not "bee"
    "The report lists the quarterly figures.",
    "The memory-mapped devices were bearing the load.",  # verb forms of noun concepts (map, bear)
]


@pytest.mark.parametrize("text,expected", POSITIVE)
def test_labeler_finds_concepts_and_base_forms(lab: Labeler, lexicon: Lexicon, text: str, expected: set[str]) -> None:
    assert story_names(lab, lexicon, text) == expected, text


@pytest.mark.parametrize("text", NEGATIVE)
def test_labeler_negatives(lab: Labeler, lexicon: Lexicon, text: str) -> None:
    assert story_names(lab, lexicon, text) == set(), text


def test_labels_sit_on_the_word_tokens(lab: Labeler, lexicon: Lexicon, names: dict[int, str]) -> None:
    text = 'Then the fox said, "The treasure is mine." Nobody answered.'
    out = lab.label_text(text)
    fox = next(i for i, c in zip(lexicon.story_ids, ALL_STORY_CONCEPTS) if c.name == "fox")
    for tok_id, row in zip(out.ids, out.labels):
        piece = lab.tok.decode([int(tok_id)])
        has_fox = fox in row
        assert has_fox == (piece.strip() == "fox"), (piece, [names[int(c)] for c in row if c != NO_LABEL])
    # dialogue on the quoted tokens only
    dialogue = [lexicon.dialogue_id in row for row in out.labels]
    quoted = "".join(lab.tok.decode([int(i)]) for i, d in zip(out.ids, dialogue) if d)
    assert "treasure is mine" in quoted and "Nobody" not in quoted and "fox" not in quoted


def test_chunk_labels_and_tone(lab: Labeler, lexicon: Lexicon) -> None:
    happy = lab.label_text("The happy fox laughed with joy and delight, wonderful and glad. " * 6)
    sad = lab.label_text("The sad wolf cried in terrible misery and grief, hopeless and alone. " * 6)
    rows = []
    for piece in (happy, sad):
        n = len(piece.ids) // CHUNK * CHUNK
        rows.append(lab.chunk_labels(piece.labels[:n], piece.valence[:n])[0])
    tone = lexicon.tone_ids
    assert tone["positive tone"] in rows[0] and tone["negative tone"] not in rows[0]
    assert tone["negative tone"] in rows[1] and tone["positive tone"] not in rows[1]
    fox = next(i for i, c in zip(lexicon.story_ids, ALL_STORY_CONCEPTS) if c.name == "fox")
    assert fox in rows[0] and fox not in rows[1]
    with pytest.raises(ValueError, match="multiple of 64"):
        lab.chunk_labels(happy.labels[:10], happy.valence[:10])


# ---------------------------------------------------------------------------- licenses


def test_every_source_is_on_the_allow_list() -> None:
    for s in SOURCES:
        check_license(s)
        assert s.license in ALLOWED_LICENSES


def test_allow_list_refuses_a_gpl_source(tmp_path: Path) -> None:
    gcide = Source("gcide", "debian", "dict-gcide", "0.48", "GPL-3.0-or-later", "debian/copyright",
                   "GNU Collaborative International Dictionary of English", "prose")
    with pytest.raises(LicenseRefused, match="GPL-3.0-or-later"):
        check_license(gcide)
    with pytest.raises(LicenseRefused):  # refused before anything is downloaded
        fetch_sources(tmp_path / "cache", sources=SOURCES[:2] + (gcide,))
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------- shards and loader


@pytest.fixture(scope="module")
def story_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from train.shards import _story_shard

    d = tmp_path_factory.mktemp("stories")
    for k in range(2):
        _story_shard((9, k, 120, str(d), "llama3", 0.3, str(TOKENIZER), str(LEXICON)))
    return d


def test_story_shards_layout_and_determinism(story_dir: Path, tmp_path: Path) -> None:
    from train.shards import ShardMeta, _story_shard

    meta = ShardMeta.load(story_dir / "stories-llama3-s9-00001.json")
    assert meta.n_tokens % CHUNK == 0 and meta.n_docs == 120 and 0 < meta.n_chat_docs < 120
    base = story_dir / meta.name
    tokens = np.load(f"{base}.tokens.npy")
    assert tokens.dtype == np.uint16 and tokens.shape == (meta.n_tokens,)
    assert np.load(f"{base}.token_labels.npy").shape == (meta.n_tokens, TOKEN_K)
    assert np.load(f"{base}.chunk_labels.npy").shape == (meta.n_tokens // CHUNK, CHUNK_K)
    assert (tokens == SPECIAL_IDS["<|endoftext|>"]).sum() == 120
    _story_shard((9, 1, 120, str(tmp_path), "llama3", 0.3, str(TOKENIZER), str(LEXICON)))
    for suffix in ("tokens", "token_labels", "chunk_labels"):
        assert np.array_equal(np.load(f"{base}.{suffix}.npy"), np.load(tmp_path / f"{meta.name}.{suffix}.npy"))


def test_grammar_2_shards_are_named_apart_and_a_corpus_of_another_grammar_is_refused(tmp_path: Path) -> None:
    from train.shards import ShardMeta, _story_shard
    from train.steerling_data import open_data

    d = tmp_path / "corpus" / "stories"
    d.mkdir(parents=True)
    meta = _story_shard((9, 0, 40, str(d), "llama3", 0.3, str(TOKENIZER), str(LEXICON), 2))
    assert meta.name == "stories-llama3-g2-s9-00000" and ShardMeta.load(d / f"{meta.name}.json").n_docs == 40
    (tmp_path / "corpus" / "story_grammar").write_text("2\n")
    with pytest.raises(SystemExit, match="grammar 2, not 1"):
        open_data(str(tmp_path / "corpus"), tiny=False, seed=0, log=print, time_budget_s=1, story_grammar=1)


def test_chat_documents_match_the_serving_templates(lab: Labeler) -> None:
    from cde.qwen3.chat import ChatTokenizer
    from cde.qwen3.tokenizer import Qwen3Tokenizer
    from cde.steerling.tokenizer import TokenizerJsonTokenizer
    from train.shards import chat_document

    prompt, reply = "Tell me a story about the sea.", "Once upon a time, a crab lived by the shore."
    ids = np.concatenate([p.ids for p in chat_document(lab, prompt, reply, "llama3")]).tolist()
    steerling = TokenizerJsonTokenizer(TOKENIZER)
    msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    assert ids == steerling.apply_chat_template(msgs, add_generation_prompt=False) + [steerling.eos_id]
    ids = np.concatenate([p.ids for p in chat_document(lab, prompt, reply, "chatml")]).tolist()
    cfg = types.SimpleNamespace(mask_token_id=SPECIAL_IDS["<|MASK|>"], bos_token_id=None,
                                eos_token_ids=[SPECIAL_IDS["<|im_end|>"], SPECIAL_IDS["<|endoftext|>"]])
    chatml = ChatTokenizer(Qwen3Tokenizer(TOKENIZER, protected_ids=[SPECIAL_IDS["<|MASK|>"]]), cfg)
    assert ids == chatml.apply_chat_template(msgs, add_generation_prompt=False) + [SPECIAL_IDS["<|endoftext|>"]]
    with pytest.raises(ValueError, match="chat format"):
        chat_document(lab, prompt, reply, "alpaca")


def test_loader_windows_are_chunk_aligned(story_dir: Path, lexicon: Lexicon) -> None:
    torch = pytest.importorskip("torch")
    from train.data import ShardSet

    data = ShardSet.open(story_dir, val_fraction=0.1)
    rng = np.random.default_rng(3)
    wins = data.windows(6, 256, rng)
    batch = data.batch(6, 256, np.random.default_rng(3))
    assert batch.tokens.shape == (6, 256) and batch.tokens.dtype == torch.int64
    assert batch.token_labels.shape == (6, 256, TOKEN_K) and batch.chunk_labels.shape == (6, 4, CHUNK_K)
    for row, (shard, c) in enumerate(wins):  # same rng, same windows
        assert c < shard.first_chunk + shard.n_chunks - 3
        assert np.array_equal(batch.tokens[row].numpy(), shard.tokens[c * CHUNK:(c + 4) * CHUNK])
        cl = shard.chunk_labels[c:c + 4].astype(np.int64)
        cl[cl == NO_LABEL] = -1
        assert np.array_equal(batch.chunk_labels[row].numpy(), cl)
    targets = batch.chunk_targets(lexicon.n_concepts)
    assert targets.shape == (6, 4, lexicon.n_concepts)
    assert torch.equal(targets.sum(-1), (batch.chunk_labels >= 0).sum(-1).float())
    # held-out chunks are never in a training window
    val = ShardSet.open(story_dir, split="val", val_fraction=0.1)
    for s_train, s_val in zip(data.shards, val.shards):
        assert s_train.first_chunk + s_train.n_chunks == s_val.first_chunk
    with pytest.raises(ValueError, match="multiple of 64"):
        data.batch(2, 100)
    with pytest.raises(ValueError, match="not loaded"):
        data.set_weights({"nonsense": 1.0})


def test_packed_prose_round_trip(lab: Labeler, tmp_path: Path) -> None:
    from train.shards import DocumentBuilder, ShardMeta, ShardWriter, pack_shard, sha256_file, unpack_shards

    docs = ["It is a truth universally acknowledged, that a single man in possession of a good fortune, "
            "must be in want of a wife.", "In the beginning God created the heaven and the earth. " * 5]
    meta = ShardMeta("prose-test", "test", 0, 0, TOKEN_K, CHUNK_K, "", sha256_file(TOKENIZER), sha256_file(LEXICON))
    w = ShardWriter(tmp_path / "a", meta.name, meta, lab)
    for piece in lab.label_texts(docs):
        d = DocumentBuilder()
        d.text(piece)
        d.special(SPECIAL_IDS["<|endoftext|>"])
        w.add(d.parts)
    w.close()
    (tmp_path / "packed").mkdir()
    pack_shard(tmp_path / "a", meta.name, tmp_path / "packed")
    assert unpack_shards(tmp_path / "packed", tmp_path / "b", TOKENIZER, LEXICON, workers=1) == [meta.name]
    for suffix in ("tokens", "token_labels", "chunk_labels"):
        assert np.array_equal(np.load(tmp_path / "a" / f"{meta.name}.{suffix}.npy"),
                              np.load(tmp_path / "b" / f"{meta.name}.{suffix}.npy"))


# ---------------------------------------------------------------------------- committed artifacts


def test_catalog_loads_in_the_public_package_and_ours(lexicon: Lexicon) -> None:
    import pyarrow.parquet as pq

    from cde.steerling.catalog import ConceptCatalog as Ours

    table = pq.read_table(CATALOG)
    n = table.num_rows
    assert 1000 <= n <= 2000 and n == lexicon.n_concepts
    for col in ("concept_id", "concept_name", "concept_description", "head", "public_group_id", "group_name",
                "is_steerable", "is_tone", "is_alignment", "is_demographic"):
        assert col in table.column_names, col
    assert table.column("concept_id").to_pylist() == list(range(n))
    names = [x.lower() for x in table.column("concept_name").to_pylist()]
    assert len(set(names)) == n
    ours = Ours.from_parquet(CATALOG, n)
    assert ours.by_name("fox").concept_id == BY_NAME_ID("fox", lexicon)
    assert ours.by_name("sea").group_name == "setting"
    public = pytest.importorskip("steerling.concepts")
    cat = public.ConceptCatalog.load(CATALOG)
    assert len(cat) == n and cat.get(0).name == ALL_STORY_CONCEPTS[0].name
    hits = cat.search("fox", limit=3)
    assert hits and hits[0].name == "fox" and hits[0].is_steerable
    assert set(cat.group(BY_NAME_ID("fox", lexicon))) >= {BY_NAME_ID("wolf", lexicon)}


def BY_NAME_ID(name: str, lexicon: Lexicon) -> int:
    return next(i for i, c in zip(lexicon.story_ids, ALL_STORY_CONCEPTS) if c.name == name)


def test_tokenizer_artifact_layout() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    assert tok.get_vocab_size() == 8192
    for s, i in SPECIAL_IDS.items():
        assert tok.token_to_id(s) == i
    assert list(SPECIALS) == sorted(SPECIAL_IDS, key=SPECIAL_IDS.get)


def test_manifest_lists_every_source_with_counts() -> None:
    manifest = {m["name"]: m for m in json.loads(MANIFEST.read_text())}
    for s in SOURCES:
        assert manifest[s.name]["license"] == s.license and manifest[s.name]["version"] == s.version
        if s.kind == "prose":
            assert manifest[s.name]["n_tokens"] > 0
    committed = {p.name.split(".")[0].removeprefix("prose-") for p in PROSE.glob("*.tokens.xz")}
    assert committed == {n for n, m in manifest.items() if m["committed"]}
    assert sum(p.stat().st_size for p in PROSE.glob("*.tokens.xz")) <= 15 * 2**20
