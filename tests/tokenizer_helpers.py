"""Shared by the tokenizer tests: the real vocabularies (Meta's Llama 3 rank file, llama.cpp's
Llama 2 / Llama 3 vocabularies and test texts, Mistral's sentencepiece models, Llama 4's rank
file, OpenAI's o200k_base ranks, DeepSeek V3's tokenizer.json), a tiny Meta
model around Llama 3's, a varied corpus, and AutoTokenizer run where tiktoken, protobuf and
sentencepiece cannot load.

The real vocabularies come the way users get them, from PyPI packages: ``llama-models``
(installed), the ``llama-cpp-python`` and ``sentencepiece`` sdists and the ``mistral-common``,
``llama-models`` and ``litellm`` wheels (fetched once with pip into ``CKPTKIT_TEST_CACHE``,
default: the system temp dir; only the files used are kept). Every file taken from them is
checked by SHA-256.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# Code, emoji, CJK, whitespace runs, digits, contractions, odd unicode.
CORPUS = [
    "Hello, world! This is a test of the tokenizer.",
    "def add(a, b):\n    return a + b  # sum\n\n\nclass X:\n\tpass\n",
    "emoji: 😀🎉👨‍👩‍👧‍👦 🇯🇵 ❤️ and text",
    "中文分词测试，日本語のテキスト、한국어 문장입니다.",
    "   leading and trailing   ",
    "tabs\t\tand\r\nCRLF\n\n\n   \n end",
    "numbers 1234567890 3.14159 1e-9 ١٢٣ ⅷ",
    "contractions: don't, I'LL, we've, they'd, it's",
    "ünïcödé  ¿qué?  ÀÉÎÕÜ  ﬁ ligature  \u200b zero width",
    "",
    " ",
    "x" * 300,
]
# Llama 3: special tokens in the text are encoded as the special ids (Meta: allowed_special="all").
LLAMA3_SPECIAL_TEXTS = [
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>",
    "tool call<|python_tag|>print(1)<|eom_id|><|reserved_special_token_7|>",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2? 😀"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And in 中文?"},
]


LLAMA_CPP_PYTHON = "0.3.36"
# What tests take from llama.cpp (vendor/llama.cpp in the sdist): the converters and gguf-py
# (test_llama_cpp.py), and the Llama, Qwen3.5 and Gemma 4 vocabularies with their test texts and official ids.
LLAMA_CPP_FILES = (
    "convert_hf_to_gguf.py", "conversion/", "gguf-py/", "convert_lora_to_gguf.py", "examples/convert_legacy_llama.py",
    "models/ggml-vocab-llama-spm.gguf", "models/ggml-vocab-llama-bpe.gguf", "models/ggml-vocab-qwen35.gguf",
    "models/ggml-vocab-gemma-4.gguf",
)  # fmt: skip
LLAMA_CPP_SHA256 = {
    "models/ggml-vocab-llama-spm.gguf": "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
    "models/ggml-vocab-llama-spm.gguf.inp": "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
    "models/ggml-vocab-llama-spm.gguf.out": "ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29",
    "models/ggml-vocab-llama-bpe.gguf": "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
    "models/ggml-vocab-llama-bpe.gguf.inp": "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
    "models/ggml-vocab-llama-bpe.gguf.out": "118abf2034a197fc5c9dec5204dfdeee7004c7c70952ae577f66b99e212fab9b",
    "models/ggml-vocab-qwen35.gguf": "63ed952ff338996cf0bdf24a7b10015124273f75c6dc9bb427356aa3f67ec62c",
    "models/ggml-vocab-qwen35.gguf.inp": "0fc6547e7876cd5b2ef64a9d319c6e39040eb53986660bd4227ed7ddef017a94",
    "models/ggml-vocab-qwen35.gguf.out": "5efe225820325303857d0a087a8d59216f0d1e9a9e31133e7a5b44c3c4e1e9ca",
    "models/ggml-vocab-gemma-4.gguf": "58b1ba0b57f3b4d7c468ba4ffd91ad85190346a3d7ad7e71d1cabaae8a14bb65",
    "models/ggml-vocab-gemma-4.gguf.inp": "0528aa007b06965f980181d252b5dff7bb170a77af6157bd48bba56885374448",
    "models/ggml-vocab-gemma-4.gguf.out": "ba8c596bcd05e97e62566fa994b42eeaeffd6a4e4b4a4abe7b5b689aa6b43bf3",
}
MISTRAL_COMMON = "1.13.1"
# Mistral's sentencepiece models: v1 (Mistral 7B v0.1, 32000 pieces) and v3 (v0.3, 32768
# pieces with 750 control tokens and 20 user-defined ones).
MISTRAL_SHA256 = {
    "tokenizer.model.v1": "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055",
    "mistral_instruct_tokenizer_240323.model.v3": "9addc8bdce5988448ae81b729336f43a81262160ae8da760674badab9d4c7d33",
}


def cache_dir() -> Path:
    return Path(os.environ.get("CKPTKIT_TEST_CACHE", tempfile.gettempdir()))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checked(root: Path, expected: dict[str, str]) -> Path:
    for name, digest in expected.items():
        got = _sha256(root / name)
        assert got == digest, f"{root / name}: sha256 {got}, expected {digest}"
    return root


def _pip_download(pkg: str, dest: Path, sdist: bool) -> Path:
    kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *kind, "-d", str(dest), pkg]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    name, version = pkg.split("==")
    stem = f"{name.replace('-', '_')}-{version}"
    return next(p for p in dest.iterdir() if p.name.startswith(stem) and p.suffix in (".gz", ".whl"))


_LOCK_DEPTH = [0]  # held by this process already: a nested fetch must not wait on itself


@contextlib.contextmanager
def _cache_lock() -> Iterator[None]:
    """One process at a time fills the test cache (pytest-xdist workers share it)."""
    if _LOCK_DEPTH[0]:
        _LOCK_DEPTH[0] += 1
        try:
            yield
        finally:
            _LOCK_DEPTH[0] -= 1
        return
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".ckptkit-test-cache.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        _LOCK_DEPTH[0] = 1
        try:
            yield
        finally:
            _LOCK_DEPTH[0] = 0
            fcntl.flock(f, fcntl.LOCK_UN)


def llama_cpp_dir() -> Path:
    """llama.cpp as vendored in the llama-cpp-python sdist: ``LLAMA_CPP_FILES`` (and the
    vocabularies' ``.inp`` / ``.out`` test files), unpacked once into the cache."""
    cache = cache_dir() / f"llama-cpp-{LLAMA_CPP_PYTHON}"
    ready = cache / f"llama.cpp-{len(LLAMA_CPP_FILES)}"  # a new name when more files are vendored
    with _cache_lock():
        if not all((ready / name).exists() for name in LLAMA_CPP_FILES):
            _fetch_llama_cpp(cache, ready)
    return _checked(ready, LLAMA_CPP_SHA256)


def _fetch_llama_cpp(cache: Path, ready: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    sdist = _pip_download(f"llama-cpp-python=={LLAMA_CPP_PYTHON}", cache, sdist=True)
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    staging = Path(tempfile.mkdtemp(dir=cache))
    with tarfile.open(sdist) as tar:
        wanted = [m for m in tar.getmembers() if m.name.removeprefix(prefix).startswith(LLAMA_CPP_FILES)]
        for m in wanted:
            m.name = m.name.removeprefix(prefix)
        tar.extractall(staging, members=wanted, filter="data")
    sdist.unlink()
    os.replace(staging, ready)


def mistral_tokenizer_models() -> dict[str, Path]:
    """Mistral's v1 and v3 sentencepiece ``tokenizer.model`` files, from the mistral-common wheel."""
    ready = cache_dir() / f"mistral-common-{MISTRAL_COMMON}"
    with _cache_lock():
        if not all((ready / name).is_file() for name in MISTRAL_SHA256):
            members = {name: f"mistral_common/data/{name}" for name in MISTRAL_SHA256}
            _fetch_wheel_files(ready, f"mistral-common=={MISTRAL_COMMON}", members)
    _checked(ready, MISTRAL_SHA256)
    return {"v1": ready / "tokenizer.model.v1", "v3": ready / "mistral_instruct_tokenizer_240323.model.v3"}


def _fetch_wheel_files(ready: Path, requirement: str, members: dict[str, str], packages: tuple[str, ...] = ()) -> None:
    """Unpack ``members`` (name in ``ready`` -> path in the wheel) of ``requirement``'s wheel into
    ``ready``, whole or not at all; ``packages``: folders given an ``__init__.py`` (importable)."""
    ready.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=ready.parent))
    wheel = _pip_download(requirement, staging, sdist=False)
    with zipfile.ZipFile(wheel) as zf:
        for name, member in members.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(zf.read(member))
    for package in packages:
        (staging / package / "__init__.py").touch()
    wheel.unlink()
    os.replace(staging, ready)


LLAMA_MODELS = "0.3.0"
# Meta's Llama 4 tokenizer as its release has it: the tiktoken rank file and the code that reads
# it (llama_models.llama4.tokenizer, with the helper it imports), from the llama-models wheel.
LLAMA_MODELS_SHA256 = {
    "llama_models/llama4/tokenizer.model": "d0bdbaf59b0762c8c807617e2d8ea51420eb1b1de266df2495be755c8e0ed6ed",
    "llama_models/llama4/tokenizer.py": "606f0473436ebd847589149d7bb1b6761a85269c4b846767b813183ed5cd5795",
    "llama_models/tokenizer_utils.py": "562f69d8b94eea8c8d75fcd258602d130c712d51d65f76914933065032827c08",
}


def llama4_meta_tokenizer() -> tuple[Any, Path]:
    """(Meta's Llama 4 ``Tokenizer`` (tiktoken), its rank file ``tokenizer.model``), from the
    llama-models wheel unpacked once into the cache (only those files, as its package lays them out)."""
    import importlib

    ready = cache_dir() / f"llama-models-{LLAMA_MODELS}"
    with _cache_lock():
        if not all((ready / name).is_file() for name in LLAMA_MODELS_SHA256):
            members = {name: name for name in LLAMA_MODELS_SHA256}
            packages = ("llama_models", "llama_models/llama4")
            _fetch_wheel_files(ready, f"llama-models=={LLAMA_MODELS}", members, packages)
    _checked(ready, LLAMA_MODELS_SHA256)
    sys.path.insert(0, str(ready))
    try:
        module = importlib.import_module("llama_models.llama4.tokenizer")
    finally:
        sys.path.remove(str(ready))
    path = ready / "llama_models" / "llama4" / "tokenizer.model"
    return module.Tokenizer(path), path


SENTENCEPIECE = "0.2.0"
# A unigram model with the nfkc normalizer, from sentencepiece's own tests (its sdist's test/).
SENTENCEPIECE_TEST_MODEL_SHA256 = "4884d27bf50494e080aa99dbb868f27b68b6a3b6bd128da37ad6057c5e3cf5a2"


def sentencepiece_test_model() -> Path:
    """``test/test_model.model`` of the sentencepiece sdist: a unigram model (1000 pieces,
    nfkc) that sentencepiece's own tests use."""
    path = cache_dir() / f"sentencepiece-{SENTENCEPIECE}" / "test_model.model"
    with _cache_lock():
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=path.parent))
            sdist = _pip_download(f"sentencepiece=={SENTENCEPIECE}", staging, sdist=True)
            with tarfile.open(sdist) as tar:
                member = tar.extractfile(f"sentencepiece-{SENTENCEPIECE}/test/test_model.model")
                assert member is not None
                (staging / path.name).write_bytes(member.read())
            os.replace(staging / path.name, path)
            sdist.unlink()
            staging.rmdir()
    return _checked(path.parent, {path.name: SENTENCEPIECE_TEST_MODEL_SHA256}) / path.name


_VOCAB_READERS: dict[Path, object] = {}  # llama.cpp's own vocabularies, read once per process


def gguf_reader(path: Path) -> object:
    """llama.cpp's own ``GGUFReader`` (gguf-py from the same sdist) for ``path``; one reader
    per process for the vocabularies of ``llama_cpp_dir()`` (checked by SHA-256, never
    written): reading Llama 3's (128256 tokens, 280147 merges) takes tens of seconds."""
    root = llama_cpp_dir()
    if path in _VOCAB_READERS:
        return _VOCAB_READERS[path]
    gguf_py = str(root / "gguf-py")
    sys.path.insert(0, gguf_py)
    try:
        from gguf import GGUFReader
    finally:
        sys.path.remove(gguf_py)
    reader = GGUFReader(path)
    if path.is_relative_to(root / "models"):
        _VOCAB_READERS[path] = reader
    return reader


_VOCABS: dict[str, dict[str, object]] = {}


def llama_cpp_vocab(name: str) -> dict[str, object]:
    """The key/value entries of llama.cpp's ``models/ggml-vocab-{name}.gguf`` (checked by
    SHA-256), decoded once per process by ``gguf_sections.kv_values`` (``test_gguf.py`` checks
    it against ``GGUFReader``, which takes tens of seconds on Llama 3's)."""
    if name not in _VOCABS:
        from gguf_sections import kv_values

        _VOCABS[name] = kv_values(llama_cpp_dir() / "models" / f"ggml-vocab-{name}.gguf")
    return _VOCABS[name]


LLAMA2_MODEL_SHA256 = "e402be23ecce98d0833a76ba7a502e2a8bf01f8063f1c7087667e5c1858bd969"


def llama2_tokenizer_model() -> Path:
    """Llama 2's sentencepiece ``tokenizer.model``, rebuilt from llama.cpp's copy of its
    vocabulary (``ggml-vocab-llama-spm.gguf``: the 32000 pieces with Meta's scores and types)
    and Llama 2's model settings (BPE, byte fallback, identity normalizer, dummy prefix,
    whitespace kept; unk 0, bos 1, eos 2, no pad). No PyPI package ships Meta's file itself;
    this one holds everything sentencepiece encodes with."""

    path = cache_dir() / f"llama-cpp-{LLAMA_CPP_PYTHON}" / "llama2-tokenizer.model"
    vocab = llama_cpp_dir() / "models" / "ggml-vocab-llama-spm.gguf"
    with _cache_lock():
        if not path.is_file():
            _write_llama2_model(vocab, path)
    got = _sha256(path)
    assert got == LLAMA2_MODEL_SHA256, f"{path}: sha256 {got}, expected {LLAMA2_MODEL_SHA256}"
    return path


def _write_llama2_model(vocab: Path, path: Path) -> None:
    from ckptkit.tokenization.spm_proto import BPE, Piece, SpmModel, write_spm_model

    fields = llama_cpp_vocab(vocab.name.removeprefix("ggml-vocab-").removesuffix(".gguf"))
    tokens, scores, types = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    pieces = [Piece(t, s, k) for t, s, k in zip(tokens, scores, types, strict=True)]  # type: ignore[call-overload]
    model = SpmModel(pieces, BPE, byte_fallback=True, normalizer_name="identity", remove_extra_whitespaces=False)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(write_spm_model(model))
    os.replace(tmp, path)


def vocab_tests(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test texts for ``ggml-vocab-{name}.gguf`` with the ids the
    official tokenizer gives them (no BOS), as its test-tokenizer-0 reads them."""
    models = llama_cpp_dir() / "models"
    texts = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = (models / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    texts = texts[:-1] if texts[-1] == "" else texts  # (Gemma 4's lacks the last separator)
    lines = lines[:-1] if lines[-1] == "" else lines
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=True)]


LLAMA3_MODEL_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"  # Meta's file


def llama3_tokenizer_model() -> Path:
    """Meta's Llama 3 ``tokenizer.model`` (tiktoken ranks), shipped in the llama-models package."""
    import llama_models

    path = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
    got = _sha256(path)
    assert got == LLAMA3_MODEL_SHA256, f"{path}: sha256 {got}, expected {LLAMA3_MODEL_SHA256}"
    return path


def write_tiny_meta_llama3(root: Path, vocab: int = 128256) -> None:
    """A one-layer Meta Llama 3.1 checkpoint (dim 16) around Meta's real tokenizer."""
    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(31)
    dim, heads, kv, ffn = 16, 2, 1, 64  # multiple_of 32 gives 64 for dim 16

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    a, f = "layers.0.attention.", "layers.0.feed_forward."
    sd = {
        "tok_embeddings.weight": rand(vocab, dim),
        a + "wq.weight": rand(dim, dim),
        a + "wk.weight": rand(kv * dim // heads, dim),
        a + "wv.weight": rand(kv * dim // heads, dim),
        a + "wo.weight": rand(dim, dim),
        f + "w1.weight": rand(ffn, dim),
        f + "w2.weight": rand(dim, ffn),
        f + "w3.weight": rand(ffn, dim),
        "layers.0.attention_norm.weight": rand(dim),
        "layers.0.ffn_norm.weight": rand(dim),
        "norm.weight": rand(dim),
        "output.weight": rand(vocab, dim),
    }
    torch.save(sd, root / "consolidated.00.pth")
    params = {
        "dim": dim,
        "n_layers": 1,
        "n_heads": heads,
        "n_kv_heads": kv,
        "vocab_size": vocab,
        "multiple_of": 32,
        "norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "use_scaled_rope": True,
    }
    (root / "params.json").write_text(json.dumps(params))
    (root / "tokenizer.model").write_bytes(llama3_tokenizer_model().read_bytes())


_BLOCKED_AUTOTOKENIZER = """
import json, sys
for name in ("tiktoken", "google", "google.protobuf", "sentencepiece"):
    sys.modules[name] = None  # imports fail and transformers' availability checks say "absent"
from transformers import AutoTokenizer
results = []
for job in json.loads(sys.argv[1]):
    tok = AutoTokenizer.from_pretrained(job["folder"])
    out = {"ids": [tok.encode(t) for t in job["texts"]], "bos": tok.bos_token_id, "eos": tok.eos_token_id}
    out["plain"] = [tok.encode(t, add_special_tokens=False) for t in job["texts"]]
    if job["chat"]:
        ids = tok.apply_chat_template(job["chat"], add_generation_prompt=True, tokenize=True)
        out["chat"] = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    results.append(out)
for name in ("tiktoken", "google.protobuf", "sentencepiece"):
    try:
        __import__(name)
        raise SystemExit(name + " was importable")
    except ImportError:
        pass
print(json.dumps(results))
"""


def autotokenizer_without_extras(jobs: list[tuple[Path, list[str], list[dict] | None]]) -> list[dict]:
    """For each (folder, texts, chat): ``AutoTokenizer.from_pretrained(folder)`` in one fresh
    interpreter where tiktoken, protobuf and sentencepiece cannot be imported, with the ids of
    ``texts`` (``ids``: with special tokens, ``plain``: without) and of ``chat`` rendered by
    the chat template."""
    spec = [{"folder": str(f), "texts": texts, "chat": chat or []} for f, texts, chat in jobs]
    res = subprocess.run(
        [sys.executable, "-c", _BLOCKED_AUTOTOKENIZER, json.dumps(spec)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


LITELLM = "1.110.2"
# Two release tokenizers, as the litellm wheel ships them (data files only, its code unused): OpenAI's
# o200k_base rank file (tiktoken's cache name for its URL; gpt-oss's o200k_harmony is these ranks and
# harmony's special tokens) and DeepSeek V3's tokenizer.json (MIT, its license beside it).
LITELLM_TOKENIZERS = "litellm/litellm_core_utils/tokenizers/"
LITELLM_SHA256 = {
    "fb374d419588a4632f3f557e76b4b70aebbca790": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    "deepseek_tokenizer.json": "4607b3d1929c5ca263a81d7153c6d6ecdbc71c9e933c0fb2df2abf181bf6df61",
}


def litellm_tokenizers() -> dict[str, Path]:
    """``o200k_base`` (the rank file, under the name tiktoken caches it by: ``TIKTOKEN_CACHE_DIR``
    may point at its folder) and ``deepseek-v3`` (a folder holding DeepSeek V3's ``tokenizer.json``),
    from the litellm wheel, unpacked once into the cache."""
    ready = cache_dir() / f"litellm-{LITELLM}"
    with _cache_lock():
        if not all((ready / name).is_file() for name in LITELLM_SHA256):
            members = {name: LITELLM_TOKENIZERS + name for name in LITELLM_SHA256}
            _fetch_wheel_files(ready, f"litellm=={LITELLM}", members)
    _checked(ready, LITELLM_SHA256)
    deepseek = ready / "deepseek-v3"
    with _cache_lock():
        if not (deepseek / "tokenizer.json").is_file():
            deepseek.mkdir(exist_ok=True)
            os.link(ready / "deepseek_tokenizer.json", deepseek / "tokenizer.json")
    return {"o200k_base": ready / "fb374d419588a4632f3f557e76b4b70aebbca790", "deepseek-v3": deepseek}
