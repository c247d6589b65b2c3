"""Re-executing recorded requests on their recorded cache paths (``kvtrace replay``).

``recorded`` reads a run back from the database and plans what to execute; a backend (``backends``)
executes it: ``engine_process`` for llama-cpp-python (``engine`` in a process of its own, ``child``)
and for vLLM's offline ``LLM`` (``vllm_engine``, ``vllm_child``, the model directory found by
``vllm_model``), ``server`` for llama-server runs recorded through ``kvtrace proxy``; ``reproduce`` turns the outcome
into the reproduction count and the counterfactual verdict, and ``verdicts`` keeps verdicts where
``kvtrace diff`` finds them.
"""
