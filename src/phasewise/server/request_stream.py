"""RequestStream: the deltas of the engine requests of one API call, as the event loop reads them.

The engine thread's deltas reach it through AsyncEngine (call_soon_threadsafe, then `_put` on the
loop); closing it, or a consumer that stops reading, aborts what has not finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from phasewise.outputs import StreamDelta
from phasewise.server.errors import SlowClientError


class RequestStream:
    """The deltas of one or more engine requests added together, in the order they are produced.

    Iterate with `async for`; `close()` (also run when iteration stops for any reason)
    aborts whatever has not finished.
    """

    def __init__(self, request_ids: list[str], close: Callable[[list[str], list[str]], None],
                 max_pending: int) -> None:
        self.request_ids = request_ids
        self._queue: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()
        self._unfinished = set(request_ids)
        self._aborted = False
        self._close = close                # (its ids, those to abort): the engine stops routing to it
        self._max_pending = max_pending

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        try:
            while self._unfinished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self._unfinished.discard(item.request_id)
                yield item
        finally:
            self.close()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: StreamDelta | BaseException) -> None:
        """On the loop: a delta (or an error) for the consumer. Past `max_pending` unread items the
        consumer has stopped reading (a client that no longer reads its socket): the requests are
        aborted, and a consumer that comes back finds the error after what it had not read."""
        limit = self._max_pending
        if self._queue.qsize() >= limit and not isinstance(item, BaseException):
            self._queue.put_nowait(SlowClientError(f"the client read none of the last {limit} chunks of its "
                                                   "stream, so the request was aborted"))
            self._abort()
            return
        self._queue.put_nowait(item)

    def _abort(self) -> None:
        """Stop routing to this stream and abort what has not finished (once); what is queued stays."""
        self._close(self.request_ids, [] if self._aborted else sorted(self._unfinished))
        self._aborted = True

    def close(self) -> None:
        """Abort the requests that have not finished; idempotent, safe to call from the event loop."""
        self._abort()
        self._unfinished.clear()
