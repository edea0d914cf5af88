"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens (routes.py), its bodies and their
translation (protocol.py), its content blocks and events (output.py), and thinking signatures
(signature.py)."""
