"""Which server answers, told from its ``/models`` list: the probe's and the proxy's one reading."""

from kvtrace.server_kind import server_of_models


def test_each_server_is_told_by_the_owner_it_names():
    for owner, server in (("vllm", "vllm"), ("llamacpp", "llama-server"), ("llama.cpp", "llama-server"),
                          ("me", "llama-cpp-python"), ("openai", "openai"), ("VLLM", "vllm")):
        assert server_of_models({"data": [{"id": "m", "owned_by": owner}]}) == (server, "m")


def test_an_answer_of_another_shape_is_an_openai_server_without_a_model():
    for models in (None, [], "vllm", {}, {"data": None}, {"data": []}, {"data": ["vllm"]}, {"data": [{"id": 7}]}):
        server, model = server_of_models(models)
        assert server == "openai" and model in ("", "7")
