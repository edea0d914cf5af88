"""ThinkingSignature: the `signature` of the thinking blocks this server writes (Anthropic's Messages API),
an HMAC-SHA256 of the thinking text under a secret key, so thinking sent back edited or made up (or from
another machine's server) is told apart from the model's own. The key is made at random once and kept in
the cache directory (readable by its owner only): a conversation goes on across a restart of the server."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path


class ThinkingSignature:
    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    @classmethod
    def kept_in(cls, folder: Path) -> ThinkingSignature:
        """The signer whose key is `folder`/thinking_key: made and written (mode 0600) the first time,
        atomically, so two servers starting at once agree; a key that cannot be kept is this process's."""
        path = folder / "thinking_key"
        try:
            if not path.exists():
                folder.mkdir(parents=True, exist_ok=True)
                tmp = folder / f".thinking_key.{os.getpid()}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(secrets.token_bytes(32))
                try:
                    os.link(tmp, path)                 # the first writer wins; later ones read its key
                except FileExistsError:
                    pass
                finally:
                    tmp.unlink()
            key = path.read_bytes()
        except OSError:
            return cls()
        return cls(key if len(key) == 32 else None)

    def sign(self, thinking: str) -> str:
        digest = hmac.new(self._key, thinking.encode("utf-8"), hashlib.sha256).digest()
        return base64.b64encode(digest).decode("ascii")

    def verify(self, thinking: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(thinking), signature)
