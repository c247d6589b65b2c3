"""``kvtrace proxy --upstream URL [--listen HOST:PORT]``: trace a server kvtrace cannot patch."""

from __future__ import annotations

import argparse
import os
import sys

from kvtrace.commands.arguments import (count, input_file, listen_address, positive_number, share, upstream_url,
                                       whole_number)
from kvtrace.errors import ConfigError
from kvtrace.preflight import check_settings
from kvtrace.proxy.limits import Limits, ShadowBudget

DEFAULTS = Limits()
MAX_WORKERS = 64
"""As kvtrace.proxy.workers.MAX_WORKERS (not imported: --help imports nothing it need not)."""


def workers(text: str) -> int:
    value = count(text)
    if value > MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_WORKERS} workers")
    return value


def add_arguments(p) -> None:
    p.description = ("Forward requests to the server at --upstream and record each completion request "
                     "(/v1/completions, /v1/chat/completions, llama-server's /completion; streamed or not) as a "
                     "kvtrace.request span: correlation from W3C traceparent/baggage, per-token top-two margins "
                     "(asked from the server and removed from the answer when the client asked for no logprobs), "
                     "cache counts the server reports, the llama-server slot. Other paths pass through untouched.")
    p.add_argument("--upstream", required=True, type=upstream_url, metavar="URL",
                   help="the server's base URL, e.g. http://127.0.0.1:8080 (without /v1 or credentials)")
    p.add_argument("--listen", type=listen_address, default=("127.0.0.1", 8081), metavar="HOST:PORT",
                   help="address to listen on (default 127.0.0.1:8081)")
    p.add_argument("--llama-server-log", type=input_file, default=None, metavar="FILE",
                   help="llama-server's log (its --log-file, or standard error in a file; start it with -lv 4): "
                        "its prompt-cache decisions become cache events naming the request whose state was restored")
    p.add_argument("--run-id", default=None, help="run id for requests without baggage (env KVTRACE_RUN_ID)")
    p.add_argument("--workers", type=workers, default=1, metavar="N",
                   help="proxy processes on the one port, each with its own GIL (default 1; up to "
                        f"{MAX_WORKERS}). Raise it toward the cores free beside the server when one proxy's CPU "
                        "is the bottleneck; the limits below hold per worker, the shadow budget for them all")
    p.add_argument("--pin-workers", action="store_true",
                   help="keep each worker to a CPU of its own (Linux; worker i on the i-th CPU this process may "
                        "use): more tokens a second where the proxy has its CPUs to itself (docs/proxy.md, 'Workers')")
    shadow = p.add_argument_group("shadow twins (docs/proxy.md, 'Shadow twins'): margin shift measured on live traffic")
    shadow.add_argument("--shadow", type=share, default=None, metavar="RATE",
                        help="after a cache-hit request is answered, send this share of them again with the "
                             "server's cache bypass (llama-server, vLLM) and record the answer as its cold twin, "
                             "arm 'shadow' (e.g. 0.01; default: none). On llama-server, start it with "
                             "--slot-save-path and give --llama-server-log, so each twin's slot is put back")
    shadow.add_argument("--shadow-in-flight", type=count, default=ShadowBudget.in_flight, metavar="N",
                        help=f"twins upstream at once (default {ShadowBudget.in_flight}). A twin beyond the budget "
                             "is dropped and counted")
    shadow.add_argument("--shadow-tokens-per-minute", type=count, default=ShadowBudget.tokens_per_minute,
                        metavar="N", help=f"prompt plus generated tokens of twins per minute "
                                          f"(default {ShadowBudget.tokens_per_minute})")
    shadow.add_argument("--shadow-busy", type=whole_number, default=ShadowBudget.busy, metavar="N",
                        help="twins only while at most N other requests are upstream through this proxy "
                             f"(default {ShadowBudget.busy}: only while it is idle; with llama-server also only "
                             "while one of its slots is idle). On a GPU, where a batch has spare room, raise it")
    limits = p.add_argument_group("limits per client (docs/proxy-limits.md; each refusal is counted)")
    limits.add_argument("--max-header-bytes", type=count, default=DEFAULTS.max_header_bytes, metavar="N",
                        help=f"a request's line and headers (default {DEFAULTS.max_header_bytes}; over it: 431)")
    limits.add_argument("--max-body-bytes", type=count, default=DEFAULTS.max_body_bytes, metavar="N",
                        help=f"a request's body (default {DEFAULTS.max_body_bytes}; over it: 413)")
    limits.add_argument("--max-connections", type=count, default=DEFAULTS.max_connections, metavar="N",
                        help=f"client connections open at once (default {DEFAULTS.max_connections}; one more: 503)")
    limits.add_argument("--idle-timeout", type=positive_number, default=DEFAULTS.idle_timeout_s, metavar="S",
                        help=f"seconds a kept-alive connection waits for its next request, and a write to a "
                             f"client may take (default {DEFAULTS.idle_timeout_s:g})")
    limits.add_argument("--request-timeout", type=positive_number, default=DEFAULTS.request_timeout_s,
                        metavar="S", help=f"seconds a request's head and body may take to arrive "
                                          f"(default {DEFAULTS.request_timeout_s:g}; over it: 408)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.run_id:
        os.environ["KVTRACE_RUN_ID"] = args.run_id
    settings = check_settings()  # a recorder that could not record is refused now (exit 2), not found later
    try:
        # Deferred: httptools comes with the optional `proxy` extra.
        from kvtrace.proxy.app import serve
    except ImportError as exc:
        raise ConfigError(f"kvtrace proxy needs {exc.name or 'its extra'}: pip install 'kvtrace[proxy]'") from None

    host, port = args.listen
    if args.pin_workers:
        from kvtrace.proxy import cpu_affinity

        if not cpu_affinity.supported():
            raise ConfigError("--pin-workers needs Linux's CPU affinity; run without it")
    where = "nowhere (recording is disabled)" if settings.disabled else f"the {settings.exporter} exporter"

    def listening(bound: int) -> None:
        print(f"kvtrace: proxy on http://{host}:{bound} for {args.upstream}; spans go to {where}", file=sys.stderr,
              flush=True)

    try:
        limits = Limits(max_header_bytes=args.max_header_bytes, max_body_bytes=args.max_body_bytes,
                        max_connections=args.max_connections, idle_timeout_s=args.idle_timeout,
                        request_timeout_s=args.request_timeout)
        shadow = ShadowBudget(args.shadow, args.shadow_in_flight, args.shadow_tokens_per_minute,
                              args.shadow_busy) if args.shadow else None
        if args.workers > 1:
            from kvtrace.proxy.workers import WorkerPlan, serve_workers

            serve_workers(WorkerPlan(args.upstream, host, port, args.llama_server_log, limits, shadow,
                                     pin=args.pin_workers), args.workers, on_listening=listening)
        else:
            serve(args.upstream, host, port, llama_server_log=args.llama_server_log, on_listening=listening,
                  limits=limits, shadow=shadow, pin=args.pin_workers)
    except OSError as exc:  # the address is taken or not this machine's
        raise ConfigError(f"--listen {host}:{port}: {exc.strerror or exc}") from None
    return 0
