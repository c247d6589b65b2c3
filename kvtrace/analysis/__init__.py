"""Reading spans back: saved-query results turned into forks and their explanation (text, JSON,
HTML) for ``kvtrace diff``, ``runs`` and ``query``."""
