"""What the unit tests of vLLM's replay share: a stand-in for the ``vllm`` module (no vLLM in this venv)."""

from __future__ import annotations

import sys
import types

import pytest


@pytest.fixture
def fake_vllm(monkeypatch):
    module, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    module.SamplingParams = lambda **settings: settings
    inputs.TokensPrompt = lambda **prompt: prompt
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
