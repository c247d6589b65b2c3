"""``kvtrace proxy --upstream URL [--listen HOST:PORT]``: trace a server kvtrace cannot patch."""

from __future__ import annotations

import os
import sys

from kvtrace.commands.arguments import http_url, input_file, listen_address
from kvtrace.errors import ConfigError
from kvtrace.preflight import check_settings


def add_arguments(p) -> None:
    p.description = ("Forward requests to the server at --upstream and record each completion request "
                     "(/v1/completions, /v1/chat/completions, llama-server's /completion; streamed or not) as a "
                     "kvtrace.request span: correlation from W3C traceparent/baggage, per-token top-two margins "
                     "(asked from the server and removed from the answer when the client asked for no logprobs), "
                     "cache counts the server reports, the llama-server slot. Other paths pass through untouched.")
    p.add_argument("--upstream", required=True, type=http_url, metavar="URL",
                   help="the server's base URL, e.g. http://127.0.0.1:8080 (without /v1)")
    p.add_argument("--listen", type=listen_address, default=("127.0.0.1", 8081), metavar="HOST:PORT",
                   help="address to listen on (default 127.0.0.1:8081)")
    p.add_argument("--llama-server-log", type=input_file, default=None, metavar="FILE",
                   help="llama-server's log (its --log-file, or standard error in a file; start it with -lv 4): "
                        "its prompt-cache decisions become cache events naming the request whose state was restored")
    p.add_argument("--run-id", default=None, help="run id for requests without baggage (env KVTRACE_RUN_ID)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.run_id:
        os.environ["KVTRACE_RUN_ID"] = args.run_id
    settings = check_settings()  # a recorder that could not record is refused now (exit 2), not found later
    try:
        # Deferred: h11 comes with the optional `proxy` extra.
        from kvtrace.outside.proxy import serve
    except ImportError as exc:
        raise ConfigError(f"kvtrace proxy needs {exc.name or 'its extra'}: pip install 'kvtrace[proxy]'") from None

    host, port = args.listen
    where = "nowhere (recording is disabled)" if settings.disabled else f"the {settings.exporter} exporter"

    def listening(bound: int) -> None:
        print(f"kvtrace: proxy on http://{host}:{bound} for {args.upstream}; spans go to {where}", file=sys.stderr,
              flush=True)

    try:
        serve(args.upstream, host, port, llama_server_log=args.llama_server_log, on_listening=listening)
    except OSError as exc:  # the address is taken or not this machine's
        raise ConfigError(f"--listen {host}:{port}: {exc.strerror or exc}") from None
    return 0
