"""The settings every proxy record of one server carries are derived once, as the spans' text, and follow the
server's log while it still states them; a request's own cache members still reach its own record."""

from __future__ import annotations

import json

from kvtrace.proxy.margin_request import UpstreamProfile
from kvtrace.proxy.record_settings import request_cache_settings, server_settings

PROFILE = UpstreamProfile(engine="llama-server", settings={"n_ctx": 4096, "total_slots": 4})


def test_records_of_one_server_share_its_settings_text_made_once():
    logged = ({"cache_ram_mib": 64}, {"n_batch": 2048, "type_k": "q8_0", "type_v": "f16"})
    first = server_settings(PROFILE, logged)
    assert json.loads(first.cache_text) == {"n_ctx": 4096, "total_slots": 4, "cache_ram_mib": 64,
                                            "prompt_cache": "llama-server", "capacity_bytes": 64 << 20}
    assert json.loads(first.numerics_text) == logged[1] and first.kv_cache_type == "q8_0/f16"
    assert server_settings(PROFILE, logged) is first  # the next record derives nothing
    request = {"messages": [], "max_tokens": 1}
    assert request_cache_settings(first, request) is first.cache_text


def test_settings_the_log_states_later_are_derived_again():
    # Until a task has started the provenance hands out a new pair at each call: each is read afresh.
    early = server_settings(PROFILE, ({}, {}))
    assert early.numerics_text is None and early.kv_cache_type is None
    later = server_settings(PROFILE, ({"cache_ram_mib": 0}, {"type_k": "f16"}))
    assert later is not early and json.loads(later.cache_text)["cache_ram_mib"] == 0
    assert later.kv_cache_type == "f16"
    assert server_settings(PROFILE, None).cache_text == json.dumps(PROFILE.settings, sort_keys=True)
    assert server_settings(UpstreamProfile(engine="openai-compatible"), None).cache_text is None


def test_a_requests_own_cache_members_reach_its_record_and_no_other():
    server = server_settings(PROFILE, ({"cache_ram_mib": 64}, {}))
    own = request_cache_settings(server, {"messages": [], "cache_prompt": False, "cache_salt": "secret",
                                          "id_slot": 2})
    assert own["cache_prompt"] is False and own["id_slot"] == 2
    assert own["cache_salt"] is True  # a salt is a secret: only that one was set
    assert "cache_prompt" not in server.cache and "cache_prompt" not in json.loads(server.cache_text)
    assert request_cache_settings(server, {"messages": []}) == server.cache_text
