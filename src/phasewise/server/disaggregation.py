"""The server's side of a disaggregated pair (`serve --role prefill|decode`): a request that carries
kv_transfer_params has its prompt's KV blocks sent (prefill) or received and imported (decode)
through the engine's side (engine/kv_transfer.py `KVTransfer`, over the transport
distributed/kv_link.py), on the engine thread between steps.

A transfer that fails or does not come within the timeout fails only its request (503 in
OpenAI's shape, code kv_transfer_failed) and holds no block on either side: the prefill side's
blocks are the finished request's, cached and free; the decode side takes blocks only once the
transfer is there. A decode instance without room for the blocks waits for running requests to
free some (up to `room_wait_s`), then computes the prompt itself.
"""

from __future__ import annotations

import asyncio
import logging

from phasewise.engine.client import ChatPrompt, Prompt
from phasewise.server.async_engine import AsyncEngine
from phasewise.server.api_error import APIError

log = logging.getLogger("phasewise.server")


class DisaggregatedPair:
    def __init__(self, engine: AsyncEngine, timeout_s: float = 120.0, room_wait_s: float = 30.0) -> None:
        self.engine, self.timeout_s, self.room_wait_s = engine, timeout_s, room_wait_s

    async def send(self, transfer_id: str, prompt: Prompt | ChatPrompt, chat: bool,
                   salt: str | None = None) -> None:
        """After the prefill instance ran the prompt (under this cache salt): its blocks to the decode
        instance."""
        try:
            sent = await self.engine.call(
                lambda e: e.kv_transfer.send(transfer_id, e.encode_prompt(prompt, chat), salt))
            await asyncio.wait_for(asyncio.wrap_future(sent), self.timeout_s)
        except (ConnectionError, TimeoutError, asyncio.TimeoutError, ValueError) as e:
            raise _failed(f"sending this prompt's KV blocks failed: {e or 'timed out'}") from None

    async def receive(self, transfer_id: str, salt: str | None = None) -> int:
        """Before the decode instance runs the request (of this cache salt): wait for its blocks and import
        them (the tokens imported; 0 when there was no room and the prompt is computed here)."""
        try:
            arriving = await self.engine.call(lambda e: e.kv_transfer.expect(transfer_id))
            kv = await asyncio.wait_for(asyncio.wrap_future(arriving), self.timeout_s)
        except (ConnectionError, TimeoutError, asyncio.TimeoutError, ValueError) as e:
            await self.engine.call(lambda eng: eng.kv_transfer.forget(transfer_id))
            raise _failed(f"this prompt's KV blocks did not arrive: {e or 'timed out'}") from None
        deadline = asyncio.get_running_loop().time() + self.room_wait_s
        while True:
            try:
                return await self.engine.call(lambda e: e.kv_transfer.adopt(kv, salt))
            except ValueError as e:               # no room now: the transfer waits its turn
                if asyncio.get_running_loop().time() >= deadline:
                    log.warning("computing a prompt here instead of importing its KV blocks: %s", e)
                    return 0
            await asyncio.sleep(0.05)


def _failed(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="kv_transfer_failed")
