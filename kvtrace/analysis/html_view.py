"""A self-contained HTML page of where two runs forked.

One file, no network fetches: inline CSS and SVG only, so it can be attached
to a bug report or opened from an air-gapped box.  Per forked episode it
shows the cache path of every turn of both runs on a timeline (cache events
as markers), the two token streams of the forking turn side by side with the
fork position marked (the first fork's column has ``id="fork"``; every fork
column has class ``fork``), each token coloured by its top-two margin, and a
margin sparkline of both sides.
"""

from __future__ import annotations

import html
import math
from importlib import resources
from pathlib import Path
from string import Template
from typing import Optional, Sequence

from kvtrace import semconv as sc
from kvtrace.analysis.forks import Detokenizer, Diff, Fork, Side, Turn, episode_turns

MARGIN_BINS = tuple(zip(sc.MARGIN_BIN_EDGES + (math.inf,), (f"m{i}" for i in range(len(sc.MARGIN_BIN_LABELS))),
                        sc.MARGIN_BIN_LABELS))
"""(upper edge, CSS class, label) per margin bin: the bins of flip_rate_by_margin, so a reader sees the
same boundaries (fork_view.html has a colour for each of m0…m3)."""
LAYER_CLASSES = {sc.LAYER_NONE: "l-none", sc.LAYER_KV_REUSE: "l-kv", sc.LAYER_PROMPT_CACHE: "l-pc",
                 sc.LAYER_PREFIX_BLOCKS: "l-pb"}
TOKENS_PAST_FORK = 40
"""How many positions after the fork to draw (outputs run on; the fork is what matters)."""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def margin_class(margin: float) -> str:
    if margin != margin:
        return "m-na"
    for upper, css, _ in MARGIN_BINS:
        if margin < upper:
            return css
    return MARGIN_BINS[-1][1]


def write_fork_view(client, diff: Diff, path: Path, detokenize: Optional[Detokenizer] = None) -> Path:
    """Render ``diff`` with the turn timelines of its forked episodes into one HTML file at ``path``."""
    timelines = {f.episode: episode_turns(client, diff.run_a, diff.run_b, f.episode) for f in diff.forks}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_diff(diff, timelines, detokenize), encoding="utf-8")
    return path


def render_diff(diff: Diff, timelines: dict[str, list[Turn]], detokenize: Optional[Detokenizer] = None) -> str:
    """The whole page for ``diff``; ``timelines`` maps each forked episode to its turns (``episode_turns``)."""
    sections = [_fork_section(fork, timelines.get(fork.episode, []), detokenize, first=(i == 0))
                for i, fork in enumerate(diff.forks)]
    if not sections:
        sections = ['<p class="none">No episode forked: every turn both runs made agrees.</p>']
    legend = " ".join(f'<span class="tok {css}">{_e(label)}</span>' for _, css, label in MARGIN_BINS)
    layers = " ".join(f'<span class="lane-key {css}">{_e(name)}</span>' for name, css in LAYER_CLASSES.items())
    template = Template((resources.files("kvtrace.analysis") / "fork_view.html").read_text(encoding="utf-8"))
    return template.substitute(
        title=_e(f"kvtrace diff {diff.run_a} vs {diff.run_b}"),
        run_a=_e(diff.run_a),
        run_b=_e(diff.run_b),
        summary=_e(f"{len(diff.forks)} of {diff.episodes_compared} episode(s) forked"
                   + (f"; not forked: {len(diff.unforked)}" if diff.unforked else "")),
        margin_legend=legend,
        layer_legend=layers,
        sections="\n".join(sections),
    )


def _cut(side: Side, position: int) -> str:
    """Why a side has no margin at the fork, where its rows were cut before it."""
    cut = side.rows_cut_before(position)
    return f'<br><span class="cut">{_e(cut)}</span>' if cut else ""


def _fork_section(fork: Fork, turns: list[Turn], detokenize: Optional[Detokenizer], first: bool) -> str:
    a_turn = next((t for t in turns if t.side == "a" and t.turn == fork.turn), None)
    b_turn = next((t for t in turns if t.side == "b" and t.turn == fork.turn), None)
    culprit = ""
    if fork.culprit:
        used, stored = fork.culprit.describe_parts(_e, lambda value: f"<code>{_e(value)}</code>")
        chain = f'<br><span class="chain">{stored}</span>' if stored else ""
        culprit = f'<p class="culprit"><b>Culprit</b> {used}{chain}</p>'
    sides = "".join(
        f'<tr><th>{label} <span class="run">{_e(s.run)}</span></th>'
        f'<td>{_e(_token_label(s.token, s.text, s.ended_before(fork.position)))}</td>'
        f'<td class="{margin_class(s.margin)}">{_fmt(s.margin)}{_cut(s, fork.position)}</td>'
        f'<td>{_e(s.cache.describe())}</td></tr>'
        for label, s in (("A", fork.a), ("B", fork.b)))
    tie = ("near tie" if fork.near_tie else "not a near tie") if fork.position >= 0 else "position unknown"
    verdict = (f' <span class="badge verdict {_e(fork.verdict)}">counterfactual: {_e(fork.verdict)}</span>'
               if fork.verdict else "")
    verdict_note = f'\n  <p class="verdict-note">{_e(fork.verdict_note)}</p>' if fork.verdict_note else ""
    if fork.verdict is None and fork.replayable():
        verdict_note += (f'\n  <p class="replay">Prove it: <code>{_e(fork.replay_command())}</code> '
                         f'(add <code>--server URL</code> for a run recorded through <code>kvtrace proxy</code>)</p>')
    return f"""
<section class="fork-section" data-episode="{_e(fork.episode)}" data-attribution="{_e(fork.attribution)}">
  <h2>Episode {_e(fork.episode)} <span class="where">forked at {_e(fork.where())}</span>
      <span class="badge {_e(fork.attribution)}">{_e(fork.attribution)}</span>{verdict}</h2>
  <p class="note">{_e(fork.note)} &middot; {_e(tie)}</p>{verdict_note}
  <table class="sides"><tr><th></th><th>chose</th><th>margin</th><th>cache path at the fork</th></tr>{sides}</table>
  {culprit}
  <h3>Turns and cache events</h3>
  {_timeline_svg(fork, turns)}
  <h3>Turn {fork.turn}: the two token streams</h3>
  {_streams(fork, a_turn, b_turn, detokenize, first)}
  {_sparkline(fork, a_turn, b_turn)}
</section>"""


def _token_label(token: int, text: Optional[str], ended: str = "") -> str:
    if ended:
        return f"nothing: {ended}"
    if token < 0:
        return "?"
    return f"{text!r} ({token})" if text is not None else str(token)


def _fmt(value: float) -> str:
    return "n/a" if value != value else f"{value:.3f}"


def _timeline_svg(fork: Fork, turns: list[Turn]) -> str:
    if not turns:
        return '<p class="none">No per-turn data.</p>'
    numbers = sorted({t.turn for t in turns})
    cell_w, cell_h, lane_gap, left = 128, 44, 26, 34
    width = left + cell_w * len(numbers) + 10
    height = 2 * (cell_h + lane_gap) + 8
    parts = [f'<svg class="timeline" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'role="img" aria-label="cache path per turn">']
    for lane, side in enumerate(("a", "b")):
        y = 6 + lane * (cell_h + lane_gap)
        parts.append(f'<text x="4" y="{y + cell_h / 2 + 5}" class="lane-label">{side.upper()}</text>')
        for i, number in enumerate(numbers):
            x = left + i * cell_w
            t = next((t for t in turns if t.side == side and t.turn == number), None)
            if t is None:
                parts.append(f'<rect x="{x + 2}" y="{y}" width="{cell_w - 6}" height="{cell_h}" class="missing"/>')
                continue
            after = " after-fork" if number > fork.turn else ""
            at = " fork-turn" if number == fork.turn else ""
            share = (t.reused_tokens / t.prompt_tokens) if t.prompt_tokens else 0.0
            tip = (f"run {t.run_id} turn {t.turn}: {t.cache_layer}, reused {t.reused_tokens}/{t.prompt_tokens}"
                   + (f", state from episode {t.source_episode_id} turn {t.source_turn}" if t.source_episode_id else ""))
            parts.append(f'<g class="turn{after}{at}"><title>{_e(tip)}</title>'
                         f'<rect x="{x + 2}" y="{y}" width="{cell_w - 6}" height="{cell_h}" rx="4" class="cell"/>'
                         f'<rect x="{x + 2}" y="{y + cell_h - 8}" width="{(cell_w - 6) * share:.1f}" height="8" '
                         f'class="{LAYER_CLASSES.get(t.cache_layer, "l-none")}"/>'
                         f'<text x="{x + 8}" y="{y + 15}" class="cell-text">t{t.turn} {_e(t.cache_layer)}</text>'
                         f'<text x="{x + 8}" y="{y + 29}" class="cell-sub">{t.reused_tokens}/{t.prompt_tokens} cached</text>'
                         '</g>')
            for k, (name, layer, outcome, tokens) in enumerate(
                    zip(t.event_names, t.event_layers, t.event_outcomes, t.event_tokens)):
                short = name.rsplit(".", 1)[-1]
                parts.append(f'<g class="event ev-{_e(short)}"><title>{_e(f"{name} {layer} {outcome} {tokens} tokens")}</title>'
                             f'<circle cx="{x + 10 + k * 12}" cy="{y + cell_h + 9}" r="5"/></g>')
    parts.append("</svg>")
    return "".join(parts)


def _streams(fork: Fork, a: Optional[Turn], b: Optional[Turn], detokenize: Optional[Detokenizer],
             first: bool) -> str:
    if a is None or b is None:
        return '<p class="none">Token streams not available.</p>'
    length = max(len(a.token_ids), len(b.token_ids), len(a.margins), len(b.margins))
    fork_at = fork.position if fork.position >= 0 else length
    end = min(length, fork_at + TOKENS_PAST_FORK + 1)
    texts = {}
    for turn in (a, b):
        if detokenize and turn.capture_mode == sc.CAPTURE_IDS:
            texts[turn.side] = [detokenize([tok]) for tok in turn.token_ids[:end]]
    columns = []
    for i in range(end):
        classes = ["pos"]
        extra = ""
        if i == fork_at:
            classes.append("fork")
            if first:
                extra = ' id="fork"'
        elif i > fork_at:
            classes.append("past")
        chips = "".join(_chip(turn, i, texts.get(turn.side)) for turn in (a, b))
        columns.append(f'<div class="{" ".join(classes)}"{extra} data-position="{i}"><span class="idx">{i}</span>{chips}</div>')
    more = f'<span class="more">… {length - end} more</span>' if end < length else ""
    return (f'<div class="streams"><div class="stream-labels"><span>#</span><span>A</span><span>B</span></div>'
            f'{"".join(columns)}{more}</div>')


def _chip(turn: Turn, i: int, texts: Optional[list[str]]) -> str:
    token = turn.token_ids[i] if i < len(turn.token_ids) else None
    margin = turn.margins[i] if i < len(turn.margins) else float("nan")
    if token is None and i >= len(turn.margins):
        return '<span class="tok end">∅</span>'
    label = texts[i] if texts and i < len(texts) else (str(token) if token is not None else "·")
    runner = turn.runner_up_ids[i] if i < len(turn.runner_up_ids) else None
    tip = f"{turn.side.upper()} pos {i}: token {token}, margin {_fmt(margin)}" + (
        f", runner-up {runner}" if runner is not None else "")
    return f'<span class="tok {margin_class(margin)}" title="{_e(tip)}">{_e(label) or "&nbsp;"}</span>'


def _sparkline(fork: Fork, a: Optional[Turn], b: Optional[Turn]) -> str:
    if a is None or b is None or not (a.margins or b.margins):
        return ""
    width, height, pad = 760, 90, 6
    length = max(len(a.margins), len(b.margins))
    finite = [m for m in list(a.margins) + list(b.margins) if m == m and math.isfinite(m)]
    top = max(finite + [1e-9])
    step = (width - 2 * pad) / max(length - 1, 1)

    def y(m: float) -> float:
        return height - pad - (min(m, top) / top) * (height - 2 * pad)

    def line(values: Sequence[float], css: str) -> str:
        points = " ".join(f"{pad + i * step:.1f},{y(m):.1f}" for i, m in enumerate(values) if m == m)
        return f'<polyline class="{css}" points="{points}"/>'

    fork_x = pad + fork.position * step if fork.position >= 0 else None
    marker = (f'<line class="fork-line" x1="{fork_x:.1f}" x2="{fork_x:.1f}" y1="0" y2="{height}"/>'
              if fork_x is not None else "")
    return (f'<h3>Top-two margin per token (A blue, B orange; red line: fork)</h3>'
            f'<svg class="sparkline" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="margins">{marker}{line(a.margins, "spark-a")}{line(b.margins, "spark-b")}'
            f'<text x="{width - 4}" y="12" text-anchor="end" class="cell-sub">max {top:.2f}</text></svg>')
