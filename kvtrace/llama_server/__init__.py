"""llama.cpp's llama-server as kvtrace reads it: its log (per-task slots, counts and prompt-cache
decisions), requests tied to their tasks, slots saved and restored, and the binary built and cached."""
