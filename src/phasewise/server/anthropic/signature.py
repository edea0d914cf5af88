"""ThinkingSignature: the `signature` of the thinking blocks this server writes (Anthropic's Messages API),
an HMAC-SHA256 of the thinking text under a key made at random when the server starts, so thinking
sent back edited or made up (or from another server) is told apart from the model's own."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets


class ThinkingSignature:
    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def sign(self, thinking: str) -> str:
        digest = hmac.new(self._key, thinking.encode("utf-8"), hashlib.sha256).digest()
        return base64.b64encode(digest).decode("ascii")

    def verify(self, thinking: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(thinking), signature)
