"""What repeats on every span of a process is written once and remembered: a settings dict's JSON,
a float attribute's text, a keyed hash state.  Remembered text must follow its value the moment the
value changes, even to one that compares equal (``0.0`` and ``-0.0``, ``1`` and ``True``)."""

from __future__ import annotations

import hashlib
import json
import struct

from kvtrace import correlate
from kvtrace import semconv as sc
from kvtrace.recording.capture import CapturePolicy
from kvtrace.recording.exporters.otlp_json import attributes_list, encode_request
from kvtrace.recording.settings_texts import SettingsTexts


def _settings_attribute(recorder, config: dict) -> str:
    with correlate(run_id="r"):
        record = recorder.start_request("llama_cpp", model="m")
    record.config.update(config)
    return recorder.request_attributes(record)[sc.NUMERICS_SETTINGS]


def test_a_settings_dict_seen_again_is_written_again_when_its_values_change(memory_recorder):
    numerics = {"n_ctx": 4096, "flash_attn": "auto", "rope": 1.0, "offload_kqv": True}
    first = _settings_attribute(memory_recorder, {sc.NUMERICS_SETTINGS: numerics})
    assert first == json.dumps(numerics, sort_keys=True)
    assert _settings_attribute(memory_recorder, {sc.NUMERICS_SETTINGS: numerics}) == first

    for name, value in (("n_ctx", 8192), ("rope", -0.0), ("rope", 0.0), ("offload_kqv", 1), ("flash_attn", None)):
        numerics[name] = value  # the same dict, changed in place
        assert _settings_attribute(memory_recorder, {sc.NUMERICS_SETTINGS: numerics}) == json.dumps(
            numerics, sort_keys=True)
    numerics["new"] = "key"
    assert _settings_attribute(memory_recorder, {sc.NUMERICS_SETTINGS: numerics}) == json.dumps(
        numerics, sort_keys=True)


def test_settings_that_can_change_in_place_or_whose_names_are_no_text_are_never_remembered():
    texts = SettingsTexts()
    stops = ["\n"]
    sampling = {"stop": stops, "temp": 0.7}
    assert texts.text(sampling) == json.dumps(sampling, sort_keys=True)
    stops.append("END")  # the same list object, other content
    assert texts.text(sampling) == '{"stop": ["\\n", "END"], "temp": 0.7}'
    # Names that are no text: 1 and True are one dict key, written "1" and "true".
    assert (texts.text({1: "on"}), texts.text({True: "on"})) == ('{"1": "on"}', '{"true": "on"}')


def test_remembered_settings_are_forgotten_when_the_limit_is_reached():
    texts = SettingsTexts(limit=2)
    settings = [{"n": 1000 + i} for i in range(5)]
    for _ in range(2):
        assert [texts.text(s) for s in settings] == [json.dumps(s) for s in settings]
    assert len(texts._texts) <= 2


def test_a_remembered_float_attribute_keeps_its_sign_type_and_key():
    def written(attributes):
        return [json.loads(bytes(part)) if not isinstance(part, dict) else part
                for part in attributes_list(attributes)]

    for _ in range(2):  # the second time from what was remembered
        assert written({"t": 0.8}) == [{"key": "t", "value": {"doubleValue": 0.8}}]
        assert written({"u": 0.8}) == [{"key": "u", "value": {"doubleValue": 0.8}}]
        assert written({"t": 1.0, "i": 1, "b": True, "s": "1.0"}) == [
            {"key": "t", "value": {"doubleValue": 1.0}}, {"key": "i", "value": {"intValue": "1"}},
            {"key": "b", "value": {"boolValue": True}}, {"key": "s", "value": {"stringValue": "1.0"}}]
        assert written({"inf": float("inf"), "minus": float("-inf")}) == [
            {"key": "inf", "value": {"doubleValue": "Infinity"}},
            {"key": "minus", "value": {"doubleValue": "-Infinity"}}]
    zero = '{"key":"t","value":{"doubleValue":0.0}}'
    minus_zero = '{"key":"t","value":{"doubleValue":-0.0}}'
    for _ in range(2):
        assert zero in _span_line({"t": 0.0}) and minus_zero in _span_line({"t": -0.0})
        assert '"doubleValue":"NaN"' in _span_line({"t": float("nan")})


def _span_line(attributes: dict) -> str:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    return encode_request([ReadableSpan(name="s", context=SpanContext(1, 2, is_remote=False),
                                        attributes=attributes, start_time=1, end_time=2)], packed=True)


def test_prompt_and_block_hashes_are_the_keyed_blake2b_of_their_definition():
    # The keyed states are copied rather than keyed anew for each hash: the bits must be the definition's.
    key = b"a deployment key of enough bytes"
    policy = CapturePolicy(sc.CAPTURE_HASHED, key)
    normalised = hashlib.blake2b(key, digest_size=32).digest()
    prompt = list(range(7, 7 + 37))
    packed = struct.pack("<37q", *prompt)
    assert policy.hash_tokens(prompt) == hashlib.blake2b(packed, key=normalised, digest_size=16).hexdigest()
    parent, chain = b"", []
    for start in (0, 128):  # two whole blocks of 16 tokens; the last 5 tokens are no block
        parent = hashlib.blake2b(parent + packed[start:start + 128], key=normalised, digest_size=8).digest()
        chain.append(parent.hex())
    assert policy.block_hashes(prompt, 16) == chain
    assert policy.hash_tokens(prompt[:3]) != policy.hash_tokens(prompt[:4])
    assert policy.output_hash("p", [5, 6]) == hashlib.blake2b(
        b"p\0" + struct.pack("<2q", 5, 6), key=normalised, digest_size=8, person=b"kvtrace.output").hexdigest()


def test_block_hashes_remembered_from_earlier_prompts_are_those_a_fresh_policy_computes(monkeypatch):
    # A conversation's turns share their earlier blocks; two conversations share a system prompt and part
    # ways; a block size changes; the memory fills and is let go: every chain as computed from nothing.
    from kvtrace.recording import capture

    key = b"a deployment key of enough bytes"
    policy = CapturePolicy(sc.CAPTURE_HASHED, key)
    system = list(range(1000, 1000 + 40))
    turns = {name: [system + [start + i for i in range(19)]] for name, start in (("a", 5), ("b", 7))}
    for name in turns:
        for turn in range(3):
            turns[name].append(turns[name][-1] + [turn * 100 + i for i in range(21)])
    prompts = [p for pair in zip(turns["a"], turns["b"]) for p in pair]
    prompts += [turns["a"][2], turns["a"][2][:47], turns["a"][2][:47] + [9] * 30]  # again; cut; cut and other
    for block_size in (16, 8, 16):
        for prompt in prompts:
            assert policy.block_hashes(prompt, block_size) == CapturePolicy(sc.CAPTURE_HASHED, key).block_hashes(
                prompt, block_size)
    assert len(policy._chain_memo) > 0
    monkeypatch.setattr(capture, "CHAIN_MEMO_BLOCKS", 4)
    for prompt in prompts:
        assert policy.block_hashes(prompt, 16) == CapturePolicy(sc.CAPTURE_HASHED, key).block_hashes(prompt, 16)
        assert len(policy._chain_memo) <= 4 + len(prompt) // 16
