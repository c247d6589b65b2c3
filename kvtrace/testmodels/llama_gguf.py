"""Random-weight Llama-architecture GGUF models for tests and benchmarks.

Nothing is downloaded: the weights come from a fixed-seed generator and the
tokenizer (a SentencePiece-style vocabulary with byte fallback) is built here
in code.  The same arguments always give a byte-identical file.

Invariants:

* the architecture is plain ``llama`` (RMSNorm, RoPE, GQA, SwiGLU), so every
  llama.cpp code path that matters for cache reuse (batched prefill versus
  single-token decode) is exercised;
* the output projection is scaled so that raw logits have a realistic spread
  (median top-1 − top-2 margin of roughly 0.6), which is what makes near ties —
  and therefore cache-path forks — as frequent as with trained models;
* ``small`` and ``base`` have ``n_embd`` and ``n_ff`` multiples of 256, so the
  k-quants (Q4_K_M, Q3_K_M) quantize every matrix instead of falling back.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtrace.patches.llama_cpp.log import llama_log_to_logging

QUANTS = ("F32", "F16", "Q8_0", "Q4_0", "Q4_K_M", "Q3_K_M")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Token types of the GGUF tokenizer metadata (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6
_SPACE = "\u2581"  # SentencePiece's visible space


@dataclass(frozen=True)
class ModelShape:
    """Hyper-parameters of one generated model size."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int = 1024
    """The context kvtrace runs these models with (the experiment's default ``n_ctx``): a smaller
    context than the trained one makes llama.cpp warn on every load."""
    output_scale: float = 1.0
    """Multiplies the output projection's init std; tuned for a median margin ≈ 0.6."""

    @property
    def n_params(self) -> int:
        head_dim = self.n_embd // self.n_head
        attn = 2 * self.n_embd * self.n_embd + 2 * self.n_embd * head_dim * self.n_head_kv
        ffn = 3 * self.n_embd * self.n_ff
        return 2 * self.n_vocab * self.n_embd + self.n_layer * (attn + ffn + 2 * self.n_embd) + self.n_embd


SIZES: dict[str, ModelShape] = {
    # ~1.3M params, ~5 MB at F32: fast enough for unit tests on two cores.
    "tiny": ModelShape(n_vocab=4096, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, n_ff=384),
    # ~20M params: k-quant friendly.
    "small": ModelShape(n_vocab=32000, n_embd=256, n_layer=4, n_head=4, n_head_kv=2, n_ff=768),
    # ~100M params: benchmarks.
    "base": ModelShape(n_vocab=32000, n_embd=768, n_layer=8, n_head=12, n_head_kv=4, n_ff=2048),
}

SEED = 20240607


def shape_key(size: str, seed: int = SEED) -> str:
    """A short key of the shape and seed of a generated model, for caches of generated files:
    a changed shape (say, its trained context) must not reuse a file made before the change."""
    return hashlib.sha256(f"{SIZES[size]!r}:{seed}".encode()).hexdigest()[:10]


# --- tokenizer ------------------------------------------------------------------------


def build_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary of exactly ``n_vocab`` pieces.

    Layout: ``<unk> <s> </s>``, the 256 byte-fallback pieces, the ChatML
    control tokens, printable ASCII characters, then lowercase letter n-grams
    (with and without the leading ``▁``).  Every multi-letter piece's prefix is
    also in the vocabulary, so llama.cpp's greedy bigram merging can reach it.
    Scores decrease with rank (earlier pieces merge first).
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [_UNKNOWN, _CONTROL, _CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [_BYTE] * 256
    tokens += ["<|im_start|>", "<|im_end|>"]
    types += [_CONTROL, _CONTROL]
    n_special = len(tokens)

    pieces: list[str] = [_SPACE]
    pieces += [c for c in string.printable[:95] if c != " "]
    pieces += [_SPACE + c for c in string.ascii_letters + string.digits]
    letters = string.ascii_lowercase
    for n in (2, 3, 4):
        grams = ["".join(g) for g in itertools.product(letters, repeat=n)]
        for gram in grams:
            pieces.append(_SPACE + gram)
            pieces.append(gram)
    seen: set[str] = set(tokens)
    for piece in pieces:
        if len(tokens) >= n_vocab:
            break
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(_NORMAL)
    if len(tokens) < n_vocab:
        raise ValueError(f"vocabulary of {n_vocab} pieces is larger than this generator supports")
    scores = [0.0] * n_special + [-float(i) for i in range(len(tokens) - n_special)]
    return tokens, scores, types


# --- weights ---------------------------------------------------------------------------


def _weights(shape: ModelShape, seed: int) -> dict[str, np.ndarray]:
    """Tensors in GGUF naming; numpy shapes are (rows=out, cols=in)."""
    rng = np.random.default_rng(seed)
    e, ff = shape.n_embd, shape.n_ff
    kv = (e // shape.n_head) * shape.n_head_kv

    def matrix(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (scale / np.sqrt(cols))).astype(np.float32)

    tensors: dict[str, np.ndarray] = {
        # Embeddings of unit RMS so the residual stream starts at a sane scale.
        "token_embd.weight": rng.standard_normal((shape.n_vocab, e), dtype=np.float32),
    }
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = np.ones(e, dtype=np.float32)
        tensors[p + "attn_q.weight"] = matrix(e, e)
        tensors[p + "attn_k.weight"] = matrix(kv, e)
        tensors[p + "attn_v.weight"] = matrix(kv, e)
        tensors[p + "attn_output.weight"] = matrix(e, e, 0.5)
        tensors[p + "ffn_norm.weight"] = np.ones(e, dtype=np.float32)
        tensors[p + "ffn_gate.weight"] = matrix(ff, e)
        tensors[p + "ffn_up.weight"] = matrix(ff, e)
        tensors[p + "ffn_down.weight"] = matrix(e, ff, 0.5)
    tensors["output_norm.weight"] = np.ones(e, dtype=np.float32)
    tensors["output.weight"] = matrix(shape.n_vocab, e, _output_std(shape) * np.sqrt(e))
    return tensors


def _output_std(shape: ModelShape) -> float:
    """Std of one logit for a unit-RMS final hidden state.

    For V i.i.d. Gaussian logits of std σ the top-1 − top-2 gap has median
    ≈ σ·ln2 / sqrt(2 ln V); choose σ so that median is ≈ 0.6.
    """
    sigma = 0.6 * np.sqrt(2 * np.log(shape.n_vocab)) / np.log(2)
    return float(sigma * shape.output_scale / np.sqrt(shape.n_embd))


# --- writing -------------------------------------------------------------------------


def write_f32(path: Path, size: str = "tiny", seed: int = SEED) -> Path:
    """Write the F32 model of ``size`` to ``path`` (the base every quant is made from)."""
    import gguf  # deferred, heavy (~0.3 s): only when a model is written

    shape = SIZES[size]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, scores, types = build_vocab(shape.n_vocab)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"kvtrace-test-{size}")
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(CHATML_TEMPLATE)
    for name, tensor in _weights(shape, seed).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize(source: Path, target: Path, quant: str, threads: int = 1) -> Path:
    """Quantize a GGUF file with llama.cpp's own quantizer (its per-tensor lines go to the debug log)."""
    import gguf  # deferred, heavy: as in write_f32
    import llama_cpp  # deferred, optional engine

    if quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANTS)}")
    ftype = gguf.LlamaFileType.ALL_F32 if quant == "F32" else gguf.LlamaFileType[f"MOSTLY_{quant}"]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.nthread = threads
    with llama_log_to_logging():
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({quant}) failed with code {rc}")
    return Path(target)


def make_model(out: Path, quant: str = "F32", size: str = "tiny", seed: int = SEED, threads: int = 1) -> Path:
    """Write a ``size`` model quantized as ``quant`` to ``out`` (atomically)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".kvtrace-model-") as tmp:
        f32 = write_f32(Path(tmp) / "f32.gguf", size, seed)
        final = f32 if quant == "F32" else quantize(f32, Path(tmp) / "q.gguf", quant, threads)
        os.replace(final, out)
    return out
