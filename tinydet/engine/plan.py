"""Deciding a step, apart from running it (vLLM's scheduler output beside its model runner): which
sequences the engine's next forward pass takes, with which tokens and which logits rows, under the
step's token budget. `scheduler.Engine` admits and cancels requests, asks `plan_step` for a
`StepPlan`, executes it (the cache grows, the backend runs the pass) and applies the rows to each
sequence. Deciding changes no sequence (only a drafter's own state, when it proposes), so a plan can
be read and tested alone. The order of the items and the budget's rules are part of what makes a
step's work the same at every run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

# The most rows a step's decoding sequences and their proposals make together (`_propose`):
# proposals only fill the rows a batch leaves. On a CPU a checked row costs its arithmetic, and a full
# batch already shares each weight's read: 8 SmolLM2 requests with prompt lookup ran at 0.93x plain
# with no limit, 0.95x with 16 or 12 rows, 1.00x with 8 (no proposals in a batch of 8).
SPECULATIVE_ROWS = 8


@dataclass(frozen=True)
class StepPlan:
    """One step's pass, item by item: `items[i]` is `(slot, token ids, logits rows wanted)` for
    `Backend.forward_batch`, for sequence `seqs[i]`, feeding `fed[i]` more of its prompt (0 for a
    decoding sequence) and checking the proposals `drafts[i]` after its last token (() for none).
    `need`: the positions the cache must hold for the pass."""

    items: tuple[tuple[int, list[int], str], ...]
    seqs: tuple
    fed: tuple[int, ...]
    drafts: tuple[tuple[int, ...], ...]
    need: int

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the pass computes."""
        return sum(self.fed)


def plan_step(running: Sequence, lengths: np.ndarray, step_tokens: int | None, context_length: int,
              drafter=None) -> StepPlan:
    """The next pass over `running` (the engine's sequences in the order they were admitted, each with
    its `slot`, `fed` prompt tokens, `state` and `handle.request`), whose cache slots hold `lengths`
    positions, under a budget of `step_tokens` tokens (None: no limit). Decoding sequences take one
    token each (plus their drafter's proposals); prompts share what is left of the budget, in the order
    they joined (at least one prompt token per step, so every prompt progresses)."""
    items, seqs, fed = [], [], []
    prefill = [s for s in running if s.fed < len(s.state.prompt_ids)]
    for s in running:
        if s.fed == len(s.state.prompt_ids):
            items.append((s.slot, [s.state.ids[-1]], "last"))
            seqs.append(s)
            fed.append(0)
    drafts = [()] * len(items)
    if drafter is not None:
        _propose(items, seqs, drafts, len(prefill), lengths, step_tokens, context_length, drafter)
    n_decode = sum(len(toks) for _, toks, _ in items)
    budget = None if step_tokens is None else max(step_tokens - n_decode, 0 if items else 1)
    for s in prefill:
        if budget == 0:
            break
        rest = len(s.state.prompt_ids) - s.fed
        n = rest if budget is None else min(rest, budget)
        r = s.handle.request
        want = "all" if r.prompt_logits or r.prompt_logprobs is not None else "last" if n == rest else "none"
        items.append((s.slot, s.state.prompt_ids[s.fed:s.fed + n], want))
        seqs.append(s)
        fed.append(n)
        drafts.append(())
        if budget is not None:
            budget -= n
    need = max((int(lengths[slot]) + len(toks) for slot, toks, _ in items), default=0)
    return StepPlan(tuple(items), tuple(seqs), tuple(fed), tuple(drafts), need)


def _propose(items: list, seqs: list, drafts: list, n_prefill: int, lengths: np.ndarray,
             step_tokens: int | None, context_length: int, drafter) -> None:
    """Give each decoding item its drafter's proposals (as many as its draft length, the tokens it
    may still make, the context, the step's budget and SPECULATIVE_ROWS allow), asking for every
    row."""
    room = None if step_tokens is None else step_tokens - len(items) - (1 if n_prefill else 0)
    decode_room = max(0, SPECULATIVE_ROWS - len(items))
    room = decode_room if room is None else min(room, decode_room)
    for i, s in enumerate(seqs):
        st = s.state
        k = min(s.k.k, st.max_tokens - len(st.ids) - 1, context_length - int(lengths[s.slot]) - 1)
        k = min(k, room)
        draft = drafter.propose(st.prompt_ids + st.ids, k) if k > 0 else []
        if draft:
            drafts[i] = tuple(draft)
            items[i] = (s.slot, [st.ids[-1]] + draft, "all")
            room -= len(draft)
