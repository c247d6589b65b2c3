"""A request's recorded batch as companion requests: what a replay sends alongside it to recreate its steps.

vLLM records, per generated token, the rows and tokens of the step that computed it, and the
prompt's split into prefill steps (docs/batching.md); which other requests those rows were is not
recorded, and not needed: a step's kernels depend on how many rows and tokens it holds, and each row's
attention on its own sequence only. So the companions are fillers of the recorded sizes: the last
prefill step's other tokens shared among them, and filler k kept running while the recorded step held
more than k rows. Sent in one ``llm.generate`` with the request, vLLM schedules them into the same
steps. A batch that grew while the request ran, or a step that prefilled another request beside
its decode, cannot be recreated from one call, and is refused.
"""

from __future__ import annotations

from kvtrace.replay.recorded import RecordedRequest, ReplayRefused


def companions(request: RecordedRequest) -> tuple[tuple[int, int], ...]:
    """(prompt length, generated tokens) per companion of ``request``'s recorded steps (empty: it ran alone)."""
    where = f"episode {request.episode_id} turn {request.turn} of run {request.run_id!r}"
    steps = request.steps
    if steps is None or not steps.rows:
        raise ReplayRefused(f"{where} recorded no engine steps (batch composition unknown); its batch cannot be "
                            f"recreated")
    rows, tokens = steps.rows, steps.tokens
    if any(later > earlier for earlier, later in zip(rows, rows[1:])):
        raise ReplayRefused(f"{where} was joined by other requests while it generated (step rows {list(rows)}); "
                            f"replay recreates a batch whose requests all start with it")
    if len(steps.prefill) > 1:
        raise ReplayRefused(f"{where} had its prompt computed in {len(steps.prefill)} steps "
                            f"{list(steps.prefill)}; replay recreates a batch prefilled in one step")
    if any(t != r for r, t in zip(rows[1:], tokens[1:])):
        raise ReplayRefused(f"{where} was decoded beside other requests' prefills (step tokens {list(tokens)}, "
                            f"rows {list(rows)}); replay recreates a batch whose requests all start with it")
    fillers = rows[0] - 1
    if fillers == 0:
        return ()
    shared = tokens[0] - (steps.prefill[0] if steps.prefill else 0)
    if shared < fillers:
        raise ReplayRefused(f"{where}: its first step held {rows[0]} rows but only {tokens[0]} tokens; replay "
                            f"recreates companions that each prefill their prompt in that step")
    lengths = [shared // fillers + (1 if k < shared % fillers else 0) for k in range(fillers)]
    return tuple((lengths[k - 1], sum(1 for r in rows if r > k)) for k in range(1, fillers + 1))


def described(request: RecordedRequest) -> str:
    """The request's recorded batch in words: ``alone`` or ``beside 31 requests, a first step of 3200 tokens``."""
    rows, tokens = request.steps.rows, request.steps.tokens
    if max(rows) == 1:
        return "alone"
    return f"beside {rows[0] - 1} request(s), a first step of {tokens[0]} tokens"
