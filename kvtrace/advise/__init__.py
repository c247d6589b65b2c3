"""``kvtrace advise``: the experiment's cache comparison under candidate llama.cpp settings, each
timed against the baseline, and the cheapest setting under which the cache path forked nothing."""
