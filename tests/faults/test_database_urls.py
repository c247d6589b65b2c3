"""A database URL that is dead, hung, half-alive or busy: the command ends with one line of its own
(exit code 1) within the connect time-out, whatever urllib3, clickhouse-connect or chDB had to say
(that is for --debug), and the password in the URL is never printed.  A password need not be on the
command line at all (where ``ps`` shows it): ``--db-file`` / ``KVTRACE_CLICKHOUSE_URL_FILE`` read it
from a file."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sink_faults import BlackHole, refused_port, run_host
from span_lines import dead_writer_name, request, write_lines

KVTRACE = [sys.executable, "-m", "kvtrace.cli", "-q"]
LIMIT_S = 45
"""Well above the 5 s connect time-out a command waits, well below the 60 s a query may take."""


class PingOnly:
    """An HTTP server on 127.0.0.1 that answers ClickHouse's /ping and drops every query unanswered."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/ping"):
                    self.send_response(200)
                    self.send_header("Content-Length", "4")
                    self.end_headers()
                    self.wfile.write(b"Ok.\n")
                    return
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

            do_POST = do_GET

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def server(request):
    kind = request.param
    if kind == "refused":
        yield refused_port()
        return
    running = BlackHole() if kind == "black hole" else PingOnly()
    yield running.port
    running.close()


def one_line(run) -> str:
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: "), run.stderr
    return lines[0]


@pytest.mark.parametrize("server", ["refused", "black hole", "ping only"], indirect=True)
def test_a_dead_or_hung_database_server_is_one_line_within_the_connect_time_out(server):
    run = run_host([*KVTRACE, "--db", f"http://kvtrace:s3cret-pw@127.0.0.1:{server}/otel", "runs"], {},
                   limit_s=LIMIT_S)
    assert run.returncode == 1
    line = one_line(run)
    assert f"cannot reach ClickHouse at http://kvtrace:***@127.0.0.1:{server}/otel" in line
    assert "s3cret-pw" not in run.stderr + run.stdout


def test_with_debug_the_libraries_words_are_shown_too(request):
    server = PingOnly()
    request.addfinalizer(server.close)
    run = run_host([*KVTRACE, "--debug", "--db", f"http://127.0.0.1:{server.port}/otel", "runs"], {}, limit_s=LIMIT_S)
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1].startswith("kvtrace: error: cannot reach")
    assert "clickhouse_connect" in run.stderr


def test_the_url_can_come_from_a_file_and_is_never_printed(tmp_path):
    secret = tmp_path / "db-url"
    secret.write_text(f"http://kvtrace:s3cret-pw@127.0.0.1:{refused_port()}/otel\n")
    for way in (["--db-file", str(secret)], []):
        env = {} if way else {"KVTRACE_CLICKHOUSE_URL_FILE": str(secret), "KVTRACE_CLICKHOUSE_URL": ""}
        run = run_host([*KVTRACE, *way, "runs"], env, limit_s=LIMIT_S)
        assert run.returncode == 1 and "cannot reach ClickHouse at http://kvtrace:***@" in one_line(run)
        assert "s3cret-pw" not in run.stderr
    embedded = tmp_path / "embedded-url"
    embedded.write_text(f"chdb://{tmp_path / 'db'}\n")
    status = run_host([*KVTRACE, "--db-file", str(embedded), "db", "status"], {}, limit_s=300)
    assert status.returncode == 0, status.stderr
    assert str(tmp_path / "db") in status.stdout


@pytest.mark.parametrize("argv, message", [
    (["--db", "chdb://memory", "--db-file", "url"], "--db URL or --db-file FILE, not both"),
    (["--db-file", "/no/such/file"], "KVTRACE_CLICKHOUSE_URL_FILE (--db-file): /no/such/file is not a readable"),
    (["--db-file", "/dev/null"], "is not a readable regular file"),
])
def test_a_db_file_that_cannot_be_used_is_refused_with_one_line(argv, message):
    run = run_host([*KVTRACE, *argv, "runs"], {}, limit_s=LIMIT_S)
    assert run.returncode == 2 and message in one_line(run)


def test_an_ingest_that_loses_the_embedded_database_to_another_process_says_so_in_one_line(tmp_path, spool_dir):
    url = f"chdb://{tmp_path / 'busy'}"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys\nfrom kvtrace.db import connect\nc = connect({url!r})\nprint('open', "
                               "flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        spool_dir.mkdir(exist_ok=True)
        write_lines(dead_writer_name(spool_dir), [request(0)])  # something to store: ingest must open the database
        run = run_host([*KVTRACE, "--db", url, "db", "ingest"], {}, limit_s=300)
    finally:
        holder.communicate("", timeout=120)
    assert run.returncode == 1
    line = one_line(run)
    assert f"is in use by process {holder.pid}" in line and "Code: 76" not in run.stderr
