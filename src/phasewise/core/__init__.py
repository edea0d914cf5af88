"""The engine core: requests, KV blocks, scheduling. Plain Python, no torch."""
