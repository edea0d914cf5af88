"""What /metrics and the dashboard show of the engine at one moment: each part's own stats, composed on
the server's engine thread after each turn (frozen: the event loop reads it without locks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from phasewise.core.handoffs import EngineStats
from phasewise.engine.step_event import ThreadStats


@dataclass(frozen=True, kw_only=True)
class ServerStats:
    engine: EngineStats = field(default_factory=EngineStats)      # the core: requests, blocks, counters
    threads: ThreadStats = field(default_factory=ThreadStats)     # the kernel threads, others' CPU use
    kv_block_bytes: int = 0            # bytes of one KV block (of one group, every layer)
    num_received: int = 0              # sub-requests the engine thread has taken in (added or refused), ever
