"""The engine side of a replay: load the recorded configuration, refuse a different one, execute steps.

Runs in the replay's engine process (``child``). The model is loaded the way kvtrace loads its own
engines (``load_llama``: the weight repack off unless the run recorded it on) with the recorded
context settings; the configuration this engine then reports (kvtrace's own ``static_config``, the
one every recorded request carries) must equal the recorded one, or nothing runs. Each step starts
from an empty context (recompute) or from a kept end state (``load_state``: the bytes the original
request found in its context or prompt cache); llama-cpp-python then reuses the common prefix
itself, exactly as it did when recorded. Generated ids are read back the experiment's way
(``completion_token_ids``), so nothing is patched and nothing is recorded.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

from kvtrace import semconv as sc
from kvtrace.experiment.conversation import completion_token_ids
from kvtrace.patches.llama_cpp.config import fingerprint, static_config
from kvtrace.patches.llama_cpp.engine import ENGINE as LLAMA_CPP
from kvtrace.patches.llama_cpp.repack import load_llama
from kvtrace.patches.llama_cpp.reuse import common_prefix
from kvtrace.replay.recorded import EngineConfiguration

SAMPLING_ARGUMENTS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                      "typical_p": "typical_p", "repeat_penalty": "repeat_penalty",
                      "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                      "tfs_z": "tfs_z", "mirostat_mode": "mirostat_mode", "mirostat_tau": "mirostat_tau",
                      "mirostat_eta": "mirostat_eta"}
"""Recorded sampling setting → ``create_completion`` argument."""

_FLASH_ATTN = {"enabled": True, "disabled": False}


def load_engine(model: Path, numerics: dict[str, Any]):
    """A ``Llama`` on ``model`` with the recorded numerics settings (what cannot be set is left to compare)."""
    from gguf import GGMLQuantizationType  # llama-cpp-python's companion; engine processes only

    def ggml_type(name: Any):
        try:
            return int(GGMLQuantizationType[str(name).upper()])
        except KeyError:
            return None

    settings = {"n_ctx": numerics.get("n_ctx"), "n_batch": numerics.get("n_batch"),
                "n_ubatch": numerics.get("n_ubatch"), "n_threads": numerics.get("n_threads"),
                "n_threads_batch": numerics.get("n_threads_batch"),
                "flash_attn": _FLASH_ATTN.get(numerics.get("flash_attn")),
                "type_k": ggml_type(numerics.get("type_k")), "type_v": ggml_type(numerics.get("type_v")),
                "logits_all": numerics.get("logits_all"), "offload_kqv": numerics.get("offload_kqv"),
                "n_gpu_layers": numerics.get("n_gpu_layers")}
    settings = {k: v for k, v in settings.items() if v is not None}
    return load_llama(model, weight_repack=bool(numerics.get("weight_repack")), verbose=False, **settings)


def configuration_of(llm, model: Path) -> EngineConfiguration:
    """This engine as a recorded request would describe it."""
    config = static_config(llm)
    return EngineConfiguration(LLAMA_CPP, config[sc.ENGINE_VERSION], model.name,
                               config[sc.MODEL_FINGERPRINT], dict(config[sc.NUMERICS_SETTINGS]))


def file_fingerprint(model: Path) -> Optional[str]:
    """The model fingerprint an engine loaded from ``model`` records (None: llama.cpp cannot read the file).

    llama.cpp loads the header and vocabulary only, never the weights; the metadata is read as
    ``Llama`` reads it, so the fingerprint equals the recorded one.
    """
    import llama_cpp
    from llama_cpp._internals import LlamaModel

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    try:
        loaded = LlamaModel(path_model=str(model), params=params, verbose=False)
    except ValueError:
        return None
    try:
        try:
            metadata = loaded.metadata()
        except Exception:  # what Llama records then: no metadata
            metadata = {}
        return fingerprint(str(model), metadata)
    finally:
        loaded.close()


def refusal(recorded: EngineConfiguration, here: EngineConfiguration) -> str:
    """Why this engine cannot replay the recording ('' when it can): the model file, the version, the numerics."""
    differences = recorded.differences(here)
    if not differences:
        return ""
    return ("the engine loaded here differs from the recorded one in " + "; ".join(differences)
            + " (recorded vs here); replay needs the same model file, engine version and numerics settings")


def execute(llm, steps: list[dict[str, Any]], progress: Callable[[int, dict], None]) -> dict[str, dict[str, Any]]:
    """Run every step; per step key: the generated ids and how many prompt tokens the engine reused."""
    states: dict[str, Any] = {}
    uses = Counter(s["starts_from"] for s in steps if s["starts_from"])
    outcomes = {}
    for done, step in enumerate(steps):
        progress(done, step)
        llm.reset()
        source = step["starts_from"]
        if source is not None:
            llm.load_state(states[source])
            uses[source] -= 1
            if uses[source] == 0:
                del states[source]  # a state is held only until its last use
        prompt = [int(t) for t in step["prompt"]]
        live = llm.input_ids[: llm.n_tokens]
        # llama-cpp-python keeps the live context's common prefix with all but the prompt's last token
        reused = common_prefix(live, prompt[:-1]) if llm.n_tokens > 0 else 0
        sampling = step["sampling"]
        arguments = {argument: sampling[name] for name, argument in SAMPLING_ARGUMENTS.items()
                     if sampling.get(name) is not None}
        # max_tokens 0 would mean "until the context is full" to llama-cpp-python
        output = llm.create_completion(prompt, max_tokens=max(1, step["max_tokens"]), **arguments)
        try:
            generated = completion_token_ids(llm, prompt, output)
        except RuntimeError:  # the ids cannot all be read back: what the context holds is compared, and falls short
            generated = llm.input_ids[len(prompt): llm.n_tokens].tolist()
        outcomes[step["key"]] = {"token_ids": generated, "reused": reused}
        if step["keep_state"]:
            states[step["span_id"]] = llm.save_state()
    return outcomes
