"""Shared by the tokenizer tests: Meta's real Llama 3 tokenizer, a tiny Meta model around it,
a varied corpus, and AutoTokenizer run where tiktoken, protobuf and sentencepiece cannot load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def llama3_tokenizer_model() -> Path:
    """Meta's Llama 3 ``tokenizer.model`` (tiktoken ranks), shipped in the llama-models package."""
    import llama_models

    return Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"


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
    ``texts`` and of ``chat`` rendered by the chat template."""
    spec = [{"folder": str(f), "texts": texts, "chat": chat or []} for f, texts, chat in jobs]
    res = subprocess.run(
        [sys.executable, "-c", _BLOCKED_AUTOTOKENIZER, json.dumps(spec)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])
