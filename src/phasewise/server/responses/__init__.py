"""OpenAI's Responses API: /v1/responses and its stored responses (routes.py), its body and translation
(protocol.py), its output items and events (output.py), and the store (store.py)."""
