"""The responses kept for /v1/responses (`store`, `previous_response_id`, GET and DELETE): an LRU in memory.

Bounded by count and by bytes (their JSON's size): past either bound the least recently used go.
A response bigger than the whole byte budget is not kept. Nothing survives a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from phasewise.json_types import JsonObject

MAX_RESPONSES = 1000
MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    """body: the response object as returned; conversation: its chat messages without the instructions
    (the input, after its predecessors', then the output as an assistant message), which a request
    naming it as previous_response_id continues."""
    body: JsonObject
    conversation: list[JsonObject]
    size: int
    # the request's input as items with ids (GET .../input_items)
    input_items: tuple[JsonObject, ...] = ()


class ResponseStore:
    """An LRU of stored responses by id; on the event loop only (no lock)."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, body: JsonObject, conversation: list[JsonObject],
            input_items: Sequence[JsonObject] = ()) -> None:
        rid = body["id"]
        if not isinstance(rid, str):
            raise TypeError("a stored response needs a string id")
        size = len(json.dumps(body, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        size += len(json.dumps(input_items, ensure_ascii=False)) if input_items else 0
        self.delete(rid)
        if size > self.max_bytes:
            return
        self._items[rid] = StoredResponse(body, conversation, size, tuple(input_items))
        self.bytes += size
        while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, rid: str) -> StoredResponse | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def delete(self, rid: str) -> bool:
        item = self._items.pop(rid, None)
        if item is not None:
            self.bytes -= item.size
        return item is not None
