"""Where two runs forked and why, as Python objects.

``diff_runs`` runs the saved queries ``forks`` and ``fork_attribution`` and
turns their rows into :class:`Fork` objects (one per forked episode) that the
CLI prints, the HTML view draws and experiment code can reuse.  All the
deciding happens in SQL; this module only names things and checks input.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from kvtrace import queries
from kvtrace import semconv as sc
from kvtrace.errors import ConfigError, UnknownRun
from kvtrace.jsonable import jsonable

DEFAULT_NEAR_TIE = 0.05
"""Raw-logit margin below which a fork counts as a near tie (see queries/fork_attribution.sql)."""

Detokenizer = Callable[[list[int]], str]


@dataclass(frozen=True)
class Provenance:
    """The request that stored a piece of cached state that another request restored."""

    request_id: str
    run_id: str
    episode_id: str
    turn: int
    span_id: str

    def describe(self) -> str:
        return (f"stored by request {self.request_id or '?'} of episode {self.episode_id or '?'}, "
                f"turn {self.turn}, run {self.run_id or '?'}")


@dataclass(frozen=True)
class CachePath:
    """How one side's prompt was served at the forking turn."""

    layer: str
    reused_tokens: int
    prompt_tokens: int
    state_key: str
    source_episode_id: str
    source_turn: int
    slot_selected_by: str = ""
    """How llama-server chose the slot that served it (``semconv.SLOT_SELECTED_BY_*``; "": not recorded)."""

    def describe(self) -> str:
        slot = f"; {_SLOT_CHOICES.get(self.slot_selected_by, self.slot_selected_by)}" if self.slot_selected_by else ""
        if self.reused_tokens == 0:
            return f"recomputed all {self.prompt_tokens} prompt tokens{slot}"
        source = ""
        if self.source_episode_id:
            source = f", state from episode {self.source_episode_id} turn {self.source_turn}"
        return f"{self.layer}: reused {self.reused_tokens} of {self.prompt_tokens} prompt tokens{source}{slot}"


_SLOT_CHOICES = {sc.SLOT_SELECTED_BY_LCP_SIMILARITY: "slot chosen by prompt similarity",
                 sc.SLOT_SELECTED_BY_LRU: "slot chosen as least recently used (no state similar enough)",
                 sc.SLOT_SELECTED_BY_ID: "slot named by the request"}


@dataclass(frozen=True)
class Culprit:
    """The cache event held responsible for a fork."""

    run: str
    span_id: str
    event: str
    event_index: int
    layer: str
    reused_tokens: int
    key_hash: str
    block_hashes: list[str]
    source: Optional[Provenance]

    def describe(self) -> str:
        return "\n    ".join(part for part in self.describe_parts() if part)

    def describe_parts(self, text: Callable[[str], str] = str,
                       literal: Optional[Callable[[str], str]] = None) -> tuple[str, Optional[str]]:
        """The culprit in words: the cached state it used, then who stored that state (``None``: unknown).

        ``text`` is applied to every value and phrase, ``literal`` (default: ``text``) to the ids a
        reader copies; the HTML view passes escaping and ``<code>``, so the CLI and the page say the same.
        """
        literal = literal or text
        event = self.event or "request-level cache fields (no cache event recorded)"
        used = f"run {text(self.run)} span {literal(self.span_id)}: {text(event)} ({text(self.layer)}, " \
               f"{self.reused_tokens} tokens" + (f", key {literal(self.key_hash)})" if self.key_hash else ")")
        stored = None
        if self.source:
            state = "foreign state" if self.event == sc.EVENT_CACHE_INTEGRITY_VIOLATION else "restored state"
            stored = f"{text(state + ' <- ' + self.source.describe())} (span {literal(self.source.span_id)})"
        return used, stored


@dataclass(frozen=True)
class StepBatch:
    """How the engine batched one side's forking request (docs/batching.md)."""

    rows: int
    """Sequences in the step that computed the token at the fork (-1: no token there)."""
    tokens: int
    """Tokens that step computed over all its rows (-1: no token there)."""
    prefill_steps: list[int]
    """The prompt's computed tokens per step."""

    def describe(self) -> str:
        step = f"fork token's step {self.rows} rows, {self.tokens} tokens; " if self.rows >= 0 else ""
        return f"{step}prompt computed in {len(self.prefill_steps)} step(s) {_steps(self.prefill_steps)}"


def _steps(split: list[int]) -> str:
    shown = ",".join(map(str, split[:8])) + (",…" if len(split) > 8 else "")
    return f"[{shown}]"


@dataclass
class Side:
    """One run at the fork position."""

    run: str
    span_id: str
    request_id: str
    token: int
    runner_up: int
    margin: float
    cache: CachePath
    text: Optional[str] = None
    """The chosen token as text, when a tokenizer was given and ids were captured."""
    batch: Optional[StepBatch] = None
    """How the engine batched it, where it was recorded."""
    rows_cut_at: int = -1
    """The position from which its per-token arrays were left out, its token ids kept (-1: they were not)."""
    rows_cut_reason: str = ""
    """Why (``semconv.ROWS_MISALIGNED`` / ``ROWS_LATE`` / ``ROWS_UNREPORTED``)."""
    finish_reason: str = ""
    """Why its output ended (the engine's ``stop``, ``length``…, or ``cancelled``)."""

    def rows_cut_before(self, position: int) -> str:
        """Why this side has no margin at ``position`` in words, if its rows were cut by then; else ""."""
        if not self.rows_cut_reason or not 0 <= self.rows_cut_at <= position:
            return ""
        why = _ROWS_CUT_WHERE.get(self.rows_cut_reason, f"({self.rows_cut_reason})")
        return f"its rows stop at token {self.rows_cut_at}, {why}"

    def ended_before(self, position: int) -> str:
        """Why this side chose no token at ``position`` (its output had ended, the other's went on); else ""."""
        if self.token >= 0 or position < 0:
            return ""
        return f"its output ended ({self.finish_reason or 'reason unknown'})"


_ROWS_CUT_WHERE = {sc.ROWS_MISALIGNED: "where the sampler's row was not the output token",
                   sc.ROWS_LATE: "where its rows had not reached the engine core when the request ended",
                   sc.ROWS_UNREPORTED: "where the server reported no log-probabilities"}


@dataclass
class Fork:
    episode: str
    turn: int
    kind: str
    """``output`` (this turn's generation differs) or ``prompt`` (the prompts already differ)."""
    position: int
    attribution: str
    note: str
    run_a: str
    run_b: str
    a: Side
    b: Side
    near_tie: bool
    margin_share: float
    capture_mode: str
    culprit: Optional[Culprit]
    verdict: Optional[str] = None
    """The counterfactual verdict (``confirmed``, ``not_cache``, ``not_reproduced``) once ``kvtrace replay
    --counterfactual`` has judged this fork; ``None`` until then."""
    verdict_note: str = ""

    def label(self) -> str:
        """The attribution, with the verdict when one is known: ``hit_vs_recompute, counterfactual: confirmed``."""
        return self.attribution + (f", counterfactual: {self.verdict}" if self.verdict else "")

    def replayable(self) -> bool:
        """Whether ``kvtrace replay --counterfactual`` may judge it: a token decided on a prompt both sides share."""
        return self.kind != sc.FORK_KIND_PROMPT and self.attribution != sc.ATTRIBUTION_OUTPUT_CANCELLED

    def replay_command(self) -> str:
        """The command that proves or refutes the cache as this fork's cause (docs/postmortem.md);
        runs recorded through ``kvtrace proxy`` add ``--server URL``."""
        return (f"kvtrace replay {shlex.quote(self.run_a)} {shlex.quote(self.run_b)} "
                f"--episode {shlex.quote(self.episode)} --counterfactual")

    def where(self) -> str:
        """``turn 3, token 17`` (the token only when the position is known)."""
        return f"turn {self.turn}" + (f", token {self.position}" if self.position >= 0 else "")

    def to_json(self) -> dict[str, Any]:
        return jsonable(asdict(self))


@dataclass(frozen=True)
class TurnPair:
    """Which turn of run A is compared with which turn of run B, in every episode.

    A probe records a prompt's cold request as turn 0 and its warm ones as turns 1..N of one run, so
    ``TurnPair(0, 2)`` with run A = run B compares the cold request with the second warm one.
    """

    a: int
    b: int


@dataclass
class Diff:
    run_a: str
    run_b: str
    episodes_compared: int
    forks: list[Fork] = field(default_factory=list)
    unforked: list[str] = field(default_factory=list)
    compared_by: str = sc.COMPARED_BY_TOKEN_IDS
    turns: Optional[TurnPair] = None
    paths: dict[str, tuple[CachePath, CachePath]] = field(default_factory=dict)
    """With ``turns``: per episode, how each side's prompt was served (forked or not)."""


def known_runs(client) -> list[str]:
    _, rows = queries.run(client, "runs")
    return [row[0] for row in rows]


def check_runs(client, *run_ids: str) -> None:
    runs = known_runs(client)
    missing = [r for r in run_ids if r not in runs]
    if missing:
        shown = ", ".join(runs[-10:]) if runs else "none (ingest spans first: kvtrace db ingest)"
        raise UnknownRun(f"no run {missing[0]!r} in the database; `kvtrace runs` lists them (latest: {shown})")


def diff_runs(client, run_a: str, run_b: str, episode: Optional[str] = None,
              near_tie: float = DEFAULT_NEAR_TIE, detokenize: Optional[Detokenizer] = None,
              turns: Optional[TurnPair] = None) -> Diff:
    """Every episode both runs contain: the forks (with attribution) and the episodes that did not fork.

    With ``turns``, one turn of each run per episode is compared, and every episode's two cache paths
    are kept in ``Diff.paths``.
    """
    check_runs(client, run_a, run_b)
    params: dict[str, Any] = {"run_a": run_a, "run_b": run_b, "episode": episode or ""}
    if turns is not None:
        params.update(turn_a=turns.a, turn_b=turns.b)
    columns, rows = queries.run(client, "forks", params)
    summary = [dict(zip(columns, row)) for row in rows]
    diff = Diff(run_a, run_b, episodes_compared=len(summary), turns=turns)
    if turns is not None:
        columns, rows = queries.run(client, "cache_paths", params)
        diff.paths = {row["episode_id"]: (_cache_path(row, "a"), _cache_path(row, "b"))
                      for row in (dict(zip(columns, r)) for r in rows)}
    diff.unforked = [r["episode_id"] for r in summary if not r["forked"]]
    if summary and all(r["compared_by"] == sc.COMPARED_BY_OUTPUT_HASH for r in summary):
        diff.compared_by = sc.COMPARED_BY_OUTPUT_HASH
    if len(diff.unforked) == len(summary):
        return diff
    columns, rows = queries.run(client, "fork_attribution", {**params, "near_tie": near_tie})
    diff.forks = [_fork(dict(zip(columns, row)), detokenize) for row in rows]
    return diff


def _cache_path(row: dict[str, Any], s: str) -> CachePath:
    """Side ``s``'s cache path from a row of fork_attribution or cache_paths (same column names)."""
    return CachePath(row[f"layer_{s}"], row[f"reused_tokens_{s}"], row[f"prompt_tokens_{s}"],
                     row[f"state_key_{s}"], row[f"source_episode_id_{s}"], row[f"source_turn_{s}"],
                     row[f"slot_selected_by_{s}"])


def _fork(row: dict[str, Any], detokenize: Optional[Detokenizer]) -> Fork:
    sides = {}
    for s in ("a", "b"):
        sides[s] = Side(
            run=row[f"run_{s}"], span_id=row[f"span_id_{s}"], request_id=row[f"request_id_{s}"],
            token=row[f"token_{s}"], runner_up=row[f"runner_up_{s}"], margin=row[f"margin_{s}"],
            cache=_cache_path(row, s),
            rows_cut_at=row[f"rows_cut_at_{s}"], rows_cut_reason=row[f"rows_cut_reason_{s}"],
            finish_reason=row[f"finish_reason_{s}"],
        )
        if row[f"batch_composition_{s}"] == sc.BATCH_RECORDED:
            sides[s].batch = StepBatch(row[f"step_rows_{s}"], row[f"step_tokens_{s}"], list(row[f"prefill_steps_{s}"]))
        if detokenize and row["capture_mode"] == sc.CAPTURE_IDS and sides[s].token >= 0:
            sides[s].text = detokenize([sides[s].token])
    culprit = None
    if row["culprit_side"]:
        source = None
        if row["culprit_source_span_id"] or row["culprit_source_request_id"]:
            source = Provenance(row["culprit_source_request_id"], row["culprit_source_run_id"],
                                row["culprit_source_episode_id"], row["culprit_source_turn"],
                                row["culprit_source_span_id"])
        culprit = Culprit(row["culprit_run"], row["culprit_span_id"], row["culprit_event"],
                          row["culprit_event_index"], row["culprit_layer"], row["culprit_reused_tokens"],
                          row["culprit_key_hash"], list(row["culprit_block_hashes"]), source)
    return Fork(
        episode=row["episode_id"], turn=row["fork_turn"], kind=row["fork_kind"], position=row["position"],
        attribution=row["attribution"], note=row["note"], run_a=row["run_a"], run_b=row["run_b"],
        a=sides["a"], b=sides["b"], near_tie=bool(row["near_tie"]), margin_share=row["margin_share"],
        capture_mode=row["capture_mode"], culprit=culprit,
    )


@dataclass
class Turn:
    """One request of one side of an episode, for timelines."""

    side: str
    run_id: str
    turn: int
    span_id: str
    request_id: str
    capture_mode: str
    prompt_hash: str
    prompt_tokens: int
    cache_layer: str
    reused_tokens: int
    state_key: str
    source_request_id: str
    source_run_id: str
    source_episode_id: str
    source_turn: int
    source_span_id: str
    output_hash: str
    token_ids: list[int]
    top1_ids: list[int]
    runner_up_ids: list[int]
    margins: list[float]
    event_names: list[str]
    event_layers: list[str]
    event_outcomes: list[str]
    event_tokens: list[int]


def episode_turns(client, run_a: str, run_b: str, episode: str) -> list[Turn]:
    """Both runs' requests of one episode, run A's turns first."""
    columns, rows = queries.run(client, "episode_timeline", {"run_a": run_a, "run_b": run_b, "episode": episode})
    return [Turn(**{c: (list(v) if isinstance(v, (list, tuple)) else v) for c, v in zip(columns, row)})
            for row in rows]


def gguf_detokenizer(model_path: Path) -> Detokenizer:
    """Token ids → text with the vocabulary of a GGUF model (weights are not loaded)."""
    try:
        import llama_cpp  # noqa: F401  (deferred, optional engine: only whether it is installed)
    except ImportError:
        raise ConfigError("--model needs llama-cpp-python (pip install 'kvtrace[llama]')") from None
    if not Path(model_path).is_file():
        raise ConfigError(f"--model {model_path}: no such file; give the GGUF the runs used")
    # Deferred with the engine it loads: kvtrace.patches.llama_cpp brings the engine's patches, the
    # recorder and numpy, which only --model needs (not `kvtrace diff` without it, nor `--help`).
    from kvtrace.patches.llama_cpp.repack import load_llama

    vocab = load_llama(model_path, vocab_only=True)  # llama.cpp's load messages go to the debug log

    def detokenize(ids: list[int]) -> str:
        return vocab.detokenize([int(i) for i in ids]).decode("utf-8", errors="replace")

    return detokenize
