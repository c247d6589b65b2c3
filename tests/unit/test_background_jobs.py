"""The proxy's background jobs when the proxy stops while a job is being handed its thread."""

import threading

from kvtrace.proxy import background

_Thread = threading.Thread  # the real class; the test swaps the module's for one that starts slowly


class _SlowStart(_Thread):
    """A thread whose start() lets ``close()`` run on another thread first, as a stop that lands
    between a job's registration and its thread's start."""

    jobs: background.Background
    errors: list[BaseException] = []

    def start(self) -> None:
        def close() -> None:
            try:
                self.jobs.close(timeout_s=10)
            except BaseException as exc:  # noqa: BLE001 - what the stop raised is the finding
                self.errors.append(exc)

        closer = _Thread(target=close)
        closer.start()
        closer.join(0.2)  # close() either finished (wrongly, before the job) or waits for this start
        super().start()
        _SlowStart.closer = closer


def test_a_stop_while_a_job_starts_waits_for_it_instead_of_failing(monkeypatch):
    jobs = background.Background(limit=4, name="test-jobs")
    _SlowStart.jobs, _SlowStart.errors = jobs, []
    monkeypatch.setattr(background.threading, "Thread", _SlowStart)
    ran = threading.Event()

    assert jobs.try_run(ran.set)
    monkeypatch.undo()
    _SlowStart.closer.join(10)

    assert _SlowStart.errors == []
    assert ran.is_set()
    assert not jobs.try_run(ran.set), "a closed set of jobs starts no more"


def test_a_thread_that_finished_its_job_takes_the_next_and_the_limit_still_holds():
    jobs = background.Background(limit=1, name="test-jobs")
    threads, release = [], threading.Event()
    finished = threading.Semaphore(0)

    def job():
        threads.append(threading.get_ident())
        release.wait(10)
        finished.release()

    assert jobs.try_run(job)
    assert not jobs.try_run(job), "one job on a thread at once: the next runs on its caller's"
    release.set()
    assert finished.acquire(timeout=10)
    # The thread waits for the next job in turn; it is handed over, not started anew.
    for _ in range(1000):
        if jobs.try_run(job):
            break
        threading.Event().wait(0.01)
    assert finished.acquire(timeout=10)
    jobs.close(timeout_s=10)
    assert len(threads) == 2 and threads[0] == threads[1]


def test_a_stop_waits_for_a_held_job_whose_end_runs_on_another_thread():
    jobs = background.Background(limit=4, name="test-jobs")
    release = jobs.hold()
    ended = threading.Event()
    closer = threading.Thread(target=lambda: (jobs.close(timeout_s=30), ended.set()))
    closer.start()
    assert not ended.wait(0.2), "close() returned while a held job had not ended"
    release()
    assert ended.wait(30)
    closer.join(30)
