"""An int8 KV cache's tail slots (runner/kv_cache.py): each running request has one for the fp32 keys of
its newest key groups, from its first step until it holds no blocks (it finished or was preempted)."""

from __future__ import annotations

from phasewise.core.request import Request


class TailSlots:
    """Slots 0 .. n - 1 handed to requests as they come; those of requests that hold no blocks any more
    are taken back when none is free."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n - 1, -1, -1))            # a stack: slot 0 first
        self.held: dict[str, tuple[Request, int]] = {}

    def slot(self, req: Request) -> int:
        """The request's slot (a new one on its first step)."""
        got = self.held.get(req.request_id)
        if got is not None and got[0] is req:
            return got[1]
        if not self.free:
            self._take_back()
        if not self.free:
            raise RuntimeError(f"more running requests than the int8 KV cache's {len(self.held)} tail slots")
        slot = self.free.pop()
        self.held[req.request_id] = (req, slot)
        return slot

    def _take_back(self) -> None:
        for rid, (req, slot) in list(self.held.items()):
            if not req.block_tables:
                del self.held[rid]
                self.free.append(slot)
