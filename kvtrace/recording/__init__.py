"""Writing spans: what the engine hooks hand over (records), how it becomes OpenTelemetry spans
(recorder, capture policy), how those leave the process (pipeline, exporters) and the counters
that account for every span (counters, stats)."""
