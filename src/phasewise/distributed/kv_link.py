"""KVLink, the transport of KV blocks between engines (the engine's side is engine/kv_transfer.py,
the server's server/disaggregation.py): the channel a prefill instance sends prompts' KV blocks
down to a decode instance, on torch.distributed point-to-point (gloo on CPUs; one group of two
processes: prefill rank 0, decode rank 1), never on a transport of phasewise's own.

Either instance may start first: the group is joined by a background thread, and a send or a
wait blocks (up to its timeout) until the peer is there. Sends run one at a time on the
prefill side's sender thread; the decode side's receiver thread takes whatever arrives and
files it under its transfer key until the request that needs it asks (`expect`). A transfer
is: a header (key, token count, block size, number of parts), the token ids, then per part a
small descriptor (name length, dtype, shape), its name (UTF-8) and its tensor: whatever parts the
cache's layout has (runner/kv_cache.py `read_blocks`) cross, none dropped.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.distributed as dist

log = logging.getLogger("phasewise.kv_link")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8]
MAX_UNCLAIMED = 64          # transfers kept for requests that have not asked yet (the oldest dropped)
Payload = tuple[list[int], int, dict[str, torch.Tensor]]     # token ids, block size, parts


def transfer_key(text: str) -> int:
    """A transfer id (any string) as the 63-bit integer that travels in the header."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class KVLink:
    def __init__(self, role: str, init_method: str, timeout_s: float = 600.0) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"a KV link's role is prefill or decode, got {role!r}")
        self.role, self.timeout_s = role, timeout_s
        self.connected = threading.Event()
        self.error: str | None = None            # why the link failed, once it has
        self._sends: queue.Queue[tuple[int, Payload, Future[None]]] = queue.Queue()
        self._lock = threading.Lock()
        self._arrived: dict[int, Payload] = {}
        self._waiting: dict[int, Future[Payload]] = {}
        target = self._send_loop if role == "prefill" else self._receive_loop
        threading.Thread(target=self._run, args=(init_method, target), name=f"kv-link-{role}",
                         daemon=True).start()

    # ---- the two sides -----------------------------------------------------------------------------

    def send(self, key: str, payload: Payload) -> Future[None]:
        """Queue a transfer to the decode instance; the future resolves once it has been sent."""
        done: Future[None] = Future()
        with self._lock:                         # after a failure nothing sends: fail at once
            if self.error is None:
                self._sends.put((transfer_key(key), payload, done))
                return done
        done.set_exception(ConnectionError(self.error))
        return done

    def expect(self, key: str) -> Future[Payload]:
        """The future of the transfer filed under `key` (resolved at once if it already arrived)."""
        k, done = transfer_key(key), Future[Payload]()
        with self._lock:
            if k in self._arrived:
                done.set_result(self._arrived.pop(k))
            elif self.error is not None:
                done.set_exception(ConnectionError(self.error))
            else:
                self._waiting[k] = done
        return done

    def forget(self, key: str) -> None:
        """The request that wanted this transfer is gone: drop it, arrived or not."""
        k = transfer_key(key)
        with self._lock:
            self._arrived.pop(k, None)
            self._waiting.pop(k, None)

    # ---- threads -----------------------------------------------------------------------------------

    def _run(self, init_method: str, loop: Callable[[], None]) -> None:
        try:
            dist.init_process_group("gloo", init_method=init_method, rank=0 if self.role == "prefill" else 1,
                                    world_size=2, timeout=datetime.timedelta(seconds=self.timeout_s))
            self.connected.set()
            loop()
        except Exception as e:                   # the peer is gone or never came: fail what waits
            self._fail(f"the KV link to the {'decode' if self.role == 'prefill' else 'prefill'} instance "
                       f"failed: {e}")

    def _fail(self, why: str) -> None:
        log.error("%s", why)
        with self._lock:
            self.error = why
            waiting: list[Future[Payload] | Future[None]] = list(self._waiting.values())
            self._waiting = {}
            while not self._sends.empty():
                waiting.append(self._sends.get_nowait()[2])
        for f in waiting:
            f.set_exception(ConnectionError(why))

    def _send_loop(self) -> None:
        while True:
            key, (tokens, block_size, parts), done = self._sends.get()
            try:
                dist.send(torch.tensor([key, len(tokens), block_size, len(parts)], dtype=torch.int64), dst=1)
                dist.send(torch.tensor(tokens, dtype=torch.int64), dst=1)
                for name, t in parts.items():
                    t, label = t.contiguous(), torch.tensor(list(name.encode()), dtype=torch.uint8)
                    desc = [len(label), DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (8 - t.dim())
                    dist.send(torch.tensor(desc, dtype=torch.int64), dst=1)
                    dist.send(label, dst=1)
                    dist.send(t, dst=1)
            except Exception as e:
                done.set_exception(ConnectionError(f"sending KV blocks failed: {e}"))
                raise
            done.set_result(None)

    def _receive_loop(self) -> None:
        while True:
            head = torch.empty(4, dtype=torch.int64)
            dist.recv(head, src=0)
            key, n, block_size, count = head.tolist()
            tokens = torch.empty(n, dtype=torch.int64)
            dist.recv(tokens, src=0)
            parts: dict[str, torch.Tensor] = {}
            for _ in range(count):
                desc = torch.empty(11, dtype=torch.int64)
                dist.recv(desc, src=0)
                size, dtype, ndim, *dims = desc.tolist()
                label = torch.empty(size, dtype=torch.uint8)
                dist.recv(label, src=0)
                t = torch.empty(dims[:ndim], dtype=DTYPES[dtype])
                dist.recv(t, src=0)
                parts[bytes(label.tolist()).decode()] = t
            payload = (tokens.tolist(), block_size, parts)
            with self._lock:
                waiter = self._waiting.pop(key, None)
                if waiter is None:
                    self._arrived[key] = payload
                    while len(self._arrived) > MAX_UNCLAIMED:     # their requests never came: let go
                        del self._arrived[next(iter(self._arrived))]
            if waiter is not None:
                waiter.set_result(payload)
