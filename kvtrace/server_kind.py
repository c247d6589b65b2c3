"""Which server answers: told from its OpenAI ``/models`` list, where each server names itself as the
model's owner.  The probe and the proxy both ask it this way."""

from __future__ import annotations

from typing import Any

OWNERS = {"vllm": "vllm", "llamacpp": "llama-server", "llama.cpp": "llama-server", "me": "llama-cpp-python"}
"""``owned_by`` → the server (llama-cpp-python's server says ``me``); anything else is ``openai``."""


def server_of_models(models: Any) -> tuple[str, str]:
    """(server: ``vllm``, ``llama-server``, ``llama-cpp-python`` or ``openai``; first model id) of a
    ``/models`` answer; a document of another shape is an ``openai`` server without a model id."""
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    return OWNERS.get(str(first.get("owned_by", "")).lower(), "openai"), str(first.get("id", ""))
