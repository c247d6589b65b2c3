"""The shadow budget of ``kvtrace proxy --workers N`` is one budget: what one worker process spends,
the others no longer have."""

from __future__ import annotations

import multiprocessing

from kvtrace.proxy.limits import ShadowBudget
from kvtrace.proxy.shadow_ledger import ShadowLedger


def spend(ledger: ShadowLedger, answers) -> None:
    """In another process: a twin's tokens and in-flight place taken, and one request upstream."""
    answers.put((ledger.take_tokens(900), ledger.take_twin()))
    ledger.request_sent()


def test_what_one_worker_takes_of_the_budget_the_others_no_longer_have():
    context = multiprocessing.get_context("spawn")
    ledger = ShadowLedger(ShadowBudget(1.0, in_flight=1, tokens_per_minute=1000), context)
    answers = context.SimpleQueue()
    worker = context.Process(target=spend, args=(ledger, answers))
    worker.start()
    worker.join(60)
    assert worker.exitcode == 0 and answers.get() == (True, True)

    assert not ledger.take_twin()  # the one place in flight is the other worker's
    assert not ledger.take_tokens(200)  # 100 of the minute's 1,000 tokens are left (plus the refill since)
    assert (ledger.upstream(), ledger.sent()) == (1, 1)
    ledger.twin_done()
    ledger.refund_tokens(900)
    assert ledger.take_twin() and ledger.take_tokens(200)
    ledger.request_back()
    assert (ledger.upstream(), ledger.sent()) == (0, 1)
