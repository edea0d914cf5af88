"""OpenAI's API proper: /v1/models, /v1/completions and /v1/chat/completions (routes.py), their bodies
(protocol.py), response bodies (output.py) and SSE chunks (stream.py)."""
