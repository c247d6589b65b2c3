"""Alert rules over the saved queries: load, evaluate, track firing/resolved, deliver."""
