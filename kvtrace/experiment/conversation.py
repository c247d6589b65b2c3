"""How the agent carries its conversation from one turn to the next (``--conversation``).

Every generated token stays in the conversation. ``text`` keeps the transcript as text and sends it
whole each turn, tokenized again, as an agent does through a completion API: the server then reuses
only the prefix whose re-tokenization matches what it holds, so reuse lengths vary the way they do in
production. ``tokens`` appends the generated token ids themselves, so the prefix always matches
exactly (an idealized harness, and the only way to feed back an output that is not valid text).
"""

from __future__ import annotations

import ctypes
from typing import Any, Union

import numpy as np


class TextConversation:
    """The transcript as text; each turn's prompt is that text tokenized again."""

    def __init__(self, llm: Any, opening: str):
        self.llm = llm
        self.text = opening

    def prompt(self) -> list[int]:
        return self.llm.tokenize(self.text.encode())

    def add_turn(self, prompt: list[int], output: dict, observation: str) -> None:
        self.text += output["choices"][0]["text"] + observation


class TokenConversation:
    """The conversation as token ids: the previous prompt, every generated id, the observation's ids."""

    def __init__(self, llm: Any, opening: str):
        self.llm = llm
        self.tokens = llm.tokenize(opening.encode())

    def prompt(self) -> list[int]:
        return list(self.tokens)

    def add_turn(self, prompt: list[int], output: dict, observation: str) -> None:
        self.tokens = prompt + completion_token_ids(self.llm, prompt, output) \
            + self.llm.tokenize(observation.encode(), add_bos=False)


Conversation = Union[TextConversation, TokenConversation]
CONVERSATIONS: dict[str, type] = {"text": TextConversation, "tokens": TokenConversation}


def completion_token_ids(llm: Any, prompt: list[int], output: dict) -> list[int]:
    """Every token id the completion generated, the last one included.

    llama-cpp-python evaluates a generated token only to sample the next one, so after a completion
    that stopped at ``max_tokens`` the last token is in no buffer (``llm.input_ids[:llm.n_tokens]``
    ends one short). Decoding is greedy, so that token is the arg-max of the logits it was sampled
    from, which are still the context's last output row. The ids are checked against the returned
    text, so a mismatch (another sampler, a stop sequence) fails loudly instead of feeding back
    the wrong conversation.
    """
    generated = output["usage"]["completion_tokens"]
    ids = llm.input_ids[len(prompt): llm.n_tokens].tolist()
    if len(ids) == generated - 1:
        ids.append(_last_logits_argmax(llm))
    text = output["choices"][0]["text"]
    if len(ids) != generated or llm.detokenize(ids, prev_tokens=prompt).decode("utf-8", errors="ignore") != text:
        raise RuntimeError(f"could not recover the {generated} generated token ids of a completion "
                           "(greedy decoding without stop sequences is required)")
    return ids


def _last_logits_argmax(llm: Any) -> int:
    pointer = llm._ctx.get_logits_ith(-1)
    address = ctypes.cast(pointer, ctypes.c_void_p).value
    row = np.frombuffer((ctypes.c_float * int(llm.n_vocab())).from_address(address), dtype=np.float32)
    return int(np.argmax(row))
