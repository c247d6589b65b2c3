"""A canary that pages: ``kvtrace probe`` a server, ingest, ``kvtrace alert --rules
examples/alert-rules.yaml``, and see what reached the Alertmanager routed by examples/alertmanager.yml.

    python examples/alerting.py [--url http://HOST:PORT/v1] [--model M.gguf]
                                [--alertmanager http://HOST:9093] [--rules examples/alert-rules.yaml]

Without ``--url`` the probed server is ``kvtrace run -- python -m llama_cpp.server`` on ``--model``
(default: a tiny random-weight model made with ``kvtrace make-model``), so the engine records each
probe request too. Without ``--alertmanager`` the script starts Debian's ``prometheus-alertmanager``
(``apt-get install prometheus-alertmanager``) with examples/alertmanager.yml on a free local port,
and stops it at the end. The rules are the given file's, delivered to that Alertmanager only (a copy
of the file with its ``delivery`` section pointed there is written beside the servers' logs). Last,
the Alertmanager's own API (``/api/v2/alerts``) says which kvtrace alerts it holds and for which receiver.

Exit code: 0 whether or not something fired (the script reports either), 1 when a step failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator

import yaml

from kvtrace.commands.arguments import count, http_url, input_file
from kvtrace.error_report import one_line

from common import EXAMPLES, free_port, generated_model, kvtrace, started, traced_llama_cpp_server, work_dir


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", type=http_url,
                        help="OpenAI base URL of the server to probe (default: start a traced one)")
    parser.add_argument("--model", type=input_file,
                        help="GGUF model of the started server (default: a generated tiny one)")
    parser.add_argument("--alertmanager", type=http_url,
                        help="the Alertmanager's URL (default: start one with alertmanager.yml)")
    parser.add_argument("--rules", type=input_file, default=EXAMPLES / "alert-rules.yaml",
                        help="alert rules (default: examples/alert-rules.yaml)")
    parser.add_argument("--prompts", type=input_file, default=EXAMPLES / "probe-prompts.jsonl",
                        help="probe prompts (default: examples/probe-prompts.jsonl)")
    parser.add_argument("--warm", type=count, default=4, help="warm requests per prompt (default 4)")
    parser.add_argument("--max-tokens", type=count, default=64, help="tokens per probe request (default 64)")
    parser.add_argument("--weight-format", default="", help="weight format label of the probe's spans, e.g. Q4_K_M")
    parser.add_argument("--run-id", default=f"canary-{time.strftime('%Y%m%dT%H%M%S')}")
    return parser.parse_args(argv)


@contextlib.contextmanager
def alertmanager(url: str | None, logs: Path) -> Iterator[str]:
    """The given Alertmanager, or Debian's started with examples/alertmanager.yml (no clustering)."""
    if url:
        yield url.rstrip("/")
        return
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if binary is None:
        raise SystemExit("no Alertmanager found: apt-get install prometheus-alertmanager, or give --alertmanager URL")
    port = free_port()
    command = [binary, f"--config.file={EXAMPLES / 'alertmanager.yml'}", f"--storage.path={logs / 'alertmanager'}",
               f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="]
    print(f"\n$ {' '.join(command)} &", flush=True)
    base = f"http://127.0.0.1:{port}"
    with started(command, f"{base}/-/ready", logs / "alertmanager.log"):
        yield base


@contextlib.contextmanager
def probed_server(args: argparse.Namespace, logs: Path) -> Iterator[str]:
    if args.url:
        yield args.url
        return
    model = args.model.resolve() if args.model else generated_model("alerting")  # the server runs elsewhere
    env = {} if args.model else {"KVTRACE_CAPTURE": "ids"}  # a generated model's token ids reveal nothing
    with traced_llama_cpp_server(model, [], env, 1, logs / "server.log") as base_url:
        yield base_url


def read_rules(rules: Path) -> dict:
    """The rules file as YAML, refused now rather than after the probe; ``kvtrace alert`` checks the rest."""
    try:
        config = yaml.safe_load(rules.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SystemExit(f"--rules {rules}: not a YAML rules file ({one_line(exc)})") from None
    if not isinstance(config, dict):
        raise SystemExit(f"--rules {rules}: not a rules file (see examples/alert-rules.yaml)")
    return config


def delivered_to(rules: Path, config: dict, alertmanager_url: str, logs: Path) -> Path:
    """A copy of the rules whose alerts go to ``alertmanager_url`` and nowhere else."""
    retries = {k: v for k, v in (config.get("delivery") or {}).items() if k in ("attempts", "retry_delay")}
    copy = logs / f"{rules.stem}.delivered.yaml"
    copy.write_text(f"# {rules} with its alerts delivered to {alertmanager_url}\n"
                    + yaml.safe_dump({**config, "delivery": {**retries, "alertmanager": {"url": alertmanager_url}}}))
    return copy


def kvtrace_alerts(alertmanager_url: str) -> list[dict]:
    query = urllib.parse.urlencode({"filter": 'source="kvtrace"'})
    try:
        with urllib.request.urlopen(f"{alertmanager_url}/api/v2/alerts?{query}", timeout=10) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{alertmanager_url}/api/v2/alerts: {exc} (is an Alertmanager answering there?)") from None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config = read_rules(args.rules)
    logs = work_dir("alerting")
    with alertmanager(args.alertmanager, logs) as alertmanager_url:
        with probed_server(args, logs) as server_url:
            kvtrace("probe", "--url", server_url, "--prompts", str(args.prompts), "--run-id", args.run_id,
                    "--warm", str(args.warm), "--max-tokens", str(args.max_tokens),
                    *(["--weight-format", args.weight_format] if args.weight_format else []))
        kvtrace("db", "ingest")  # the server has stopped: its spans are in the spool, beside the probe's
        rules = delivered_to(args.rules, config, alertmanager_url, logs)
        kvtrace("alert", "--rules", str(rules), ok_codes=(0, 1))  # 1: something is firing
        held = kvtrace_alerts(alertmanager_url)
        print(f"\n{alertmanager_url}/api/v2/alerts holds {len(held)} kvtrace alert(s)")
        for alert in held:
            labels = ", ".join(f"{k}={v}" for k, v in sorted(alert["labels"].items()))
            receivers = ", ".join(r["name"] for r in alert["receivers"])
            print(f"  {alert['status']['state']} {alert['labels']['alertname']} -> receiver {receivers}: "
                  f"{alert['annotations'].get('summary', '')}\n    {labels}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
