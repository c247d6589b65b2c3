"""OpenAI-compatible exchanges recorded from outside an engine: a request and its response (from a
canary probe or an imported request log) become the same request spans the engine hooks emit."""
