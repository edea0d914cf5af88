"""The engine core: requests and their sampling parameters, KV blocks, scheduling. Plain Python, no torch."""
