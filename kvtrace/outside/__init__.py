"""Recording from outside an engine: OpenAI-compatible requests and responses (a canary probe,
imported request logs) become the same request spans the engine hooks emit."""
