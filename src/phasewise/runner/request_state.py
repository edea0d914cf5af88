"""What the runner keeps of each request, keyed by request id (vLLM v1's runner-side request states).

The scheduler hands the runner plain data: a `NewRequest` with a request's first scheduled chunk, its
chunks each step, and its id in `finished_ids` once it ended. From these the runner keeps the token ids
its sampler and proposer read (the prompt, and the outputs it sampled itself), the seeded generator of
its draws and its proposer's state. A preempted request keeps all of it (a seeded request draws on from
where it was); only its KV and recurrent slot are new when it runs again, and its chunks say where.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from phasewise.core.handoffs import NewRequest, RunnerOutput, ScheduledChunk
from phasewise.core.request import Grammar
from phasewise.core.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    grammar: Grammar | None = None            # the core's (read here: masks and draft checks)
    generator: torch.Generator | None = None  # a seeded request's draws
    spec: object = None                       # the proposer's: an n-gram index, the draft model's progress
    token_ids: list[int] = field(default_factory=list)   # prompt + output, kept as they grow
    # the model's hidden states of committed rows from position hidden_start on, for a proposer that
    # reads them (MTP), until it takes them
    hidden: list[torch.Tensor] = field(default_factory=list)
    hidden_start: int = 0

    def __post_init__(self) -> None:
        self.token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def add_hidden(self, start: int, rows: torch.Tensor) -> None:
        """The hidden states [n, H] of positions start.. (what follows those kept, or a new run of them:
        a prefix hit or a recomputation after preemption starts elsewhere)."""
        if start != self.hidden_start + sum(len(h) for h in self.hidden):
            self.hidden, self.hidden_start = [], start
        self.hidden.append(rows)

    def take_hidden(self) -> tuple[int, torch.Tensor | None]:
        """(the first position, the hidden states [n, H] kept since the last take, or None); kept no more."""
        start, rows = self.hidden_start, torch.cat(self.hidden) if self.hidden else None
        self.hidden_start, self.hidden = start + (0 if rows is None else len(rows)), []
        return start, rows

    def keep(self, num_tokens: int) -> None:
        """Only the first `num_tokens` (prompt and output)."""
        assert num_tokens <= len(self.token_ids), f"{self.request_id}: the runner lost outputs"
        del self.token_ids[num_tokens:]
        del self.output_token_ids[max(num_tokens - len(self.prompt_token_ids), 0):]


@dataclass
class RequestStates:
    """Every live request's state by id; `update` before a step, `commit` after it."""
    device: torch.device
    states: dict[str, RequestState] = field(default_factory=dict)

    def __getitem__(self, request_id: str) -> RequestState:
        return self.states[request_id]

    def __len__(self) -> int:
        return len(self.states)

    def update(self, new: Iterable[NewRequest], finished: Iterable[str],
               chunks: Iterable[ScheduledChunk]) -> None:
        """Let the ended requests go, take the new ones in, and line each chunk's request up with the
        core's count of its tokens (a step's sampled tokens past a stop the core found are not its own)."""
        for request_id in finished:
            self.states.pop(request_id, None)
        for r in new:
            seed = r.sampling_params.seed
            gen = None if seed is None else torch.Generator(self.device).manual_seed(seed)
            self.states[r.request_id] = RequestState(r.request_id, r.sampling_params,
                                                     list(r.prompt_token_ids),
                                                     list(r.output_token_ids), r.grammar, gen)
        for c in chunks:
            self.states[c.request_id].keep(c.num_request_tokens)

    def commit(self, out: RunnerOutput) -> None:
        """The step's accepted drafts and sampled tokens, appended to their requests' outputs."""
        for request_id, final in out.sampled.items():
            st = self.states[request_id]
            for t in (*out.accepted.get(request_id, ()), final):
                st.append(t.token_id)
