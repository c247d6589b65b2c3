"""The generated test models: deterministic, loadable, quantizable, with realistic logit spread."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from kvtrace.patches.llama_cpp.repack import load_llama  # noqa: E402
from kvtrace.testmodels.llama_gguf import SIZES, build_vocab, make_model  # noqa: E402


def test_same_arguments_same_bytes(tmp_path, tiny_gguf):
    again = make_model(tmp_path / "again.gguf", "F32", "tiny")
    assert again.read_bytes() == Path(tiny_gguf).read_bytes()


def test_vocabulary_tokenizes_words_into_pieces(make_llama):
    llm = make_llama()
    tokens = llm.tokenize(b"the quick brown fox", add_bos=False)
    assert len(tokens) <= 0.6 * len("the quick brown fox")  # multi-letter pieces, not bytes
    assert llm.detokenize(tokens) == b" the quick brown fox"  # SentencePiece's leading space
    assert llm.detokenize(llm.tokenize("naïve – 漢字".encode(), add_bos=False)).strip() == "naïve – 漢字".encode()


def test_logit_spread_is_realistic(make_llama):
    llm = make_llama(logits_all=True)
    llm.create_completion("A prompt to measure margins on", max_tokens=64, temperature=0.0)
    rows = np.sort(llm.scores[: llm.n_tokens], axis=1)
    margins = rows[:, -1] - rows[:, -2]
    assert 0.3 < float(np.median(margins)) < 1.2


def test_quantized_variant_via_cli(tmp_path):
    out = tmp_path / "tiny-q8.gguf"
    result = subprocess.run([sys.executable, "-m", "kvtrace.cli", "make-model", "--out", str(out), "--quant", "Q8_0",
                             "--size", "tiny"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    llm = load_llama(out, n_ctx=128, n_threads=1, n_threads_batch=1)
    try:
        assert llm.metadata["general.file_type"] == "7"  # MOSTLY_Q8_0
        assert llm.create_completion("quantized", max_tokens=2, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()


def test_sizes_fit_their_purpose():
    assert SIZES["tiny"].n_params < 3_000_000
    assert 80_000_000 < SIZES["base"].n_params < 130_000_000
    for name in ("small", "base"):  # k-quants need rows that are multiples of 256
        assert SIZES[name].n_embd % 256 == 0 and SIZES[name].n_ff % 256 == 0
    tokens, scores, types = build_vocab(4096)
    assert len(tokens) == len(scores) == len(types) == 4096 == len(set(tokens))
