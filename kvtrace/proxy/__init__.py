"""``kvtrace proxy``: a reverse proxy that records each completion request it relays.

Kept empty: ``kvtrace proxy --help`` imports ``limits`` alone, never the HTTP layer (httptools)."""
