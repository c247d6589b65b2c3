"""``kvtrace probe --url http://host:port/v1 --prompts FILE``: cold vs warm canary for a running server."""

from __future__ import annotations

import sys
import time

from kvtrace.commands.arguments import count, input_file, positive_number
from kvtrace.exchanges.probe import (SERVER_KINDS, ProbeError, Prober, ProbeSettings, compare, detect_server,
                                     load_prompts)
from kvtrace.exchanges.recorder import OutsideRecorder


def add_arguments(p) -> None:
    p.description = ("For each prompt send a cold request (prefix reuse bypassed as the server allows: vLLM "
                     "cache_salt, llama-server cache_prompt=false, a flush request for llama-cpp-python) and warm "
                     "requests, greedy with top-2 logprobs, and record them as kvtrace spans (run id, episode = "
                     "prompt id, turn 0 = cold). Each request carries traceparent and baggage, so a server kvtrace "
                     "traces records it in the same trace and run. The margin_shift query and alert rules then "
                     "compare warm against cold; so does kvtrace diff RUN RUN --turns 0,N.")
    p.add_argument("--url", required=True, metavar="URL", help="the server's OpenAI base URL, e.g. http://host:8000/v1")
    p.add_argument("--prompts", required=True, type=input_file, metavar="FILE",
                   help='JSON lines: {"id": ..., "messages": [...]} or {"id": ..., "prompt": "..."}')
    p.add_argument("--server", choices=("auto", "vllm", "llama-server", "llama-cpp-python", "openai"),
                   default="auto", help="server kind (default: detected from GET /models)")
    p.add_argument("--warm", type=count, default=2, metavar="N", help="warm requests per prompt (default 2)")
    p.add_argument("--max-tokens", type=count, default=16, metavar="N", help="tokens per request (default 16)")
    p.add_argument("--run-id", metavar="RUN", help="run id of the recorded spans (default probe-<time>)")
    p.add_argument("--model", default="", help="model name to request (default: the server's first model)")
    p.add_argument("--weight-format", default="", metavar="FMT",
                   help="weight format label for the spans (e.g. Q4_K_M), used by alert filters")
    p.add_argument("--arm", default="probe", help="arm label of the spans (default probe)")
    p.add_argument("--timeout", type=positive_number, default=120.0, metavar="SECONDS",
                   help="per request (default 120)")
    p.set_defaults(func=run)


def run(args) -> int:
    prompts = load_prompts(args.prompts)
    base_url = args.url.rstrip("/")
    detected, first_model = detect_server(base_url, timeout_s=min(args.timeout, 30.0))
    kind = detected if args.server == "auto" else SERVER_KINDS[args.server]
    run_id = args.run_id or f"probe-{time.strftime('%Y%m%dT%H%M%S')}"
    print(f"kvtrace: probing {base_url} as {kind.name}: {kind.note}", file=sys.stderr)
    settings = ProbeSettings(base_url, run_id, warm=args.warm, max_tokens=args.max_tokens,
                             model=args.model or first_model, weight_format=args.weight_format, arm=args.arm,
                             timeout_s=args.timeout)
    recorder = OutsideRecorder()
    prober = Prober(settings, kind, recorder)
    failed = 0
    try:
        for prompt in prompts:
            try:
                results = prober.probe(prompt)
            except ProbeError as exc:
                failed += 1
                print(f"kvtrace: error: {exc}", file=sys.stderr)
                continue
            for warm in results[1:]:
                print(compare(results[0], warm))
    finally:
        counters = recorder.close()
    dropped = counters.get("spans_dropped_queue_full", 0)
    print(f"kvtrace: recorded {recorder.recorded} request span(s) as run {run_id}"
          + (f"; {dropped} dropped" if dropped else "")
          + f"; see `kvtrace query margin_shift --param run_prefix={run_id}` and "
          + f"`kvtrace diff {run_id} {run_id} --turns 0,{args.warm}`", file=sys.stderr)
    return 1 if failed else 0
