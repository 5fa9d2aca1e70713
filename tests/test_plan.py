"""Deciding a step (`engine.plan`), without a model: which items a pass takes, in which order, with how
many prompt tokens under the budget and how many proposals; then the engine's steps over a fake
backend whose passes are recorded (admission, cancellation, the prefix cache's wait, a failure kept
to its own request)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tinydet.backends.base import Backend, KVCache, plan_batch, split_logits
from tinydet.engine import Engine, Request
from tinydet.engine.plan import SPECULATIVE_ROWS, plan_step
from tinydet.engine.speculate import DraftLength
from tinydet.errors import TinydetError

VOCAB, CONTEXT = 50, 64
POISON = 13  # a prompt starting with this token gets NaN logits from the fake backend


def seq(slot, prompt, fed=None, ids=(), max_tokens=10, k=None, prompt_logits=False, prompt_logprobs=None):
    """What `plan_step` reads of one of the engine's sequences (`fed` None: its prompt is in)."""
    prompt = list(prompt)
    state = SimpleNamespace(prompt_ids=prompt, ids=list(ids), max_tokens=max_tokens)
    request = Request(prompt, max_tokens=max_tokens, prompt_logits=prompt_logits, prompt_logprobs=prompt_logprobs)
    return SimpleNamespace(slot=slot, fed=len(prompt) if fed is None else fed, state=state, k=k,
                           handle=SimpleNamespace(request=request))


P10, P5 = list(range(1, 11)), list(range(21, 26))


def mixed():
    """Two decoding sequences and two prompts, interleaved in admission order; slot lengths."""
    running = [seq(2, [5, 6], ids=[7]), seq(0, P10, fed=0), seq(1, [8], ids=[9, 4]), seq(3, P5, fed=2)]
    return running, np.array([0, 2, 2, 2])


@pytest.mark.parametrize("step_tokens, prefill, need", [
    # decoding first (one token each, in admission order), then prompts in admission order with what is
    # left: 6 - 2 leaves 4 of P10 ("none": not its end), nothing for P5
    (6, [(0, P10[:4], "none")], 4),
    (13, [(0, P10, "last"), (3, P5[2:3], "none")], 10),
    (20, [(0, P10, "last"), (3, P5[2:], "last")], 10),
    (None, [(0, P10, "last"), (3, P5[2:], "last")], 10),
    (2, [], 3),  # the decoders take the whole budget: no prompt token this step
    (1, [], 3),  # over budget already: decoding still goes on
])
def test_plan_decodes_first_then_feeds_prompts_in_order_under_the_budget(step_tokens, prefill, need):
    running, lengths = mixed()
    plan = plan_step(running, lengths, step_tokens, CONTEXT)
    assert plan.items == ((2, [7], "last"), (1, [4], "last"), *prefill)
    assert [s.slot for s in plan.seqs] == [i[0] for i in plan.items]
    assert plan.fed == (0, 0) + tuple(len(t) for _, t, _ in prefill)
    assert plan.prompt_tokens == sum(len(t) for _, t, _ in prefill)
    assert plan.drafts == ((),) * len(plan.items) and plan.need == need
    assert [s.fed for s in running] == [2, 0, 1, 2]  # deciding changed no sequence


def test_plan_feeds_at_least_one_prompt_token_without_decoders():
    running = [seq(0, P10, fed=3), seq(1, P5, fed=0)]
    plan = plan_step(running, np.array([3, 0]), 1, CONTEXT)
    assert plan.items == ((0, [4], "none"),) and plan.prompt_tokens == 1 and plan.need == 4
    plan = plan_step(running, np.array([3, 0]), 8, CONTEXT)
    assert plan.items == ((0, P10[3:], "last"), (1, P5[:1], "none")) and plan.fed == (7, 1)


def test_plan_asks_every_row_of_a_scored_prompt():
    running = [seq(0, P10, fed=0, prompt_logits=True), seq(1, P5, fed=0, prompt_logprobs=0)]
    plan = plan_step(running, np.zeros(2, np.int64), 12, CONTEXT)
    assert plan.items == ((0, P10, "all"), (1, P5[:2], "all"))


def test_plan_empty():
    plan = plan_step([], np.zeros(1, np.int64), 4, CONTEXT)
    assert plan.items == () and plan.prompt_tokens == 0 and plan.need == 0


class CountingDrafter:
    """Proposes last + 1, last + 2, ... (k of them); records each call's k."""

    name = "counting"

    def __init__(self):
        self.asked = []

    def length(self):
        return DraftLength(4, 4)

    def propose(self, context, k):
        self.asked.append(k)
        return [context[-1] + i for i in range(1, k + 1)]


@pytest.mark.parametrize("step_tokens, with_prompt, asked, rows", [
    # no budget: the proposals fill SPECULATIVE_ROWS (8) less the 3 decoding rows
    (None, False, [4, 1], [5, 2, 1]),
    (None, True, [4, 1], [5, 2, 1]),
    # a budget of 7 less 3 decoding rows and 1 kept for the prompt: 3 proposals, then the prompt's 1 token
    (7, True, [3], [4, 1, 1]),
    (7, False, [4], [5, 1, 1]),
])
def test_plan_proposals_fill_the_rows_left(step_tokens, with_prompt, asked, rows):
    running = [seq(0, [1, 2], ids=[3], k=DraftLength(4, 4)), seq(1, [1], ids=[5], k=DraftLength(4, 4)),
               seq(2, [1], ids=[7, 8], max_tokens=3, k=DraftLength(4, 4))]  # one token left: no proposal
    if with_prompt:
        running.append(seq(3, P10, fed=0))
    drafter = CountingDrafter()
    plan = plan_step(running, np.array([2, 1, 2, 0]), step_tokens, CONTEXT, drafter)
    assert drafter.asked == asked
    assert [len(t) for _, t, _ in plan.items[:3]] == rows
    assert plan.items[0] == (0, [3] + [4, 5, 6, 7][:rows[0] - 1], "all" if rows[0] > 1 else "last")
    assert plan.drafts[0] == tuple(plan.items[0][1][1:]) and plan.drafts[2] == ()
    assert sum(rows) <= SPECULATIVE_ROWS
    if with_prompt:
        left = len(P10) if step_tokens is None else step_tokens - sum(rows)
        assert plan.items[3] == (3, P10[:left], "last" if left == len(P10) else "none")
    assert [s.fed for s in running][:3] == [2, 1, 1] and [s.state.ids for s in running][0] == [3]


def test_plan_proposals_stop_at_the_context():
    s = seq(0, list(range(1, 62)), ids=[3], max_tokens=5, k=DraftLength(4, 4))
    drafter = CountingDrafter()
    plan = plan_step([s], np.array([CONTEXT - 3]), None, CONTEXT, drafter)
    assert drafter.asked == [2] and plan.items == ((0, [3, 4, 5], "all"),) and plan.need == CONTEXT


# -- the engine over a fake backend ---------------------------------------------------------------


class FakeCache(KVCache):
    """Holds each position's token id; a block is 4 positions."""

    block = 4

    def __init__(self, capacity, n_slots):
        self.lengths = np.zeros(n_slots, np.int64)
        self.capacity, self.ids = 0, np.zeros((n_slots, 0), np.int64)
        self.grow(capacity)

    def grow(self, capacity):
        if capacity > self.capacity:
            ids = np.zeros((self.lengths.shape[0], capacity), np.int64)
            ids[:, :self.capacity] = self.ids
            self.ids, self.capacity = ids, capacity

    def read_block(self, slot, b):
        return (self.ids[slot, b * 4:(b + 1) * 4].copy(),)

    def write_block(self, slot, b, data):
        self.ids[slot, b * 4:(b + 1) * 4] = data[0]

    @property
    def nbytes(self):
        return self.ids.nbytes


class FakeBackend(Backend):
    """A position's logits pick 1 + (the sum of the tokens up to it) % (VOCAB - 1): what the cache holds
    decides them, as a model's do. Records each pass's items."""

    name, dtype, hooks = "fake", "fp32", []

    def __init__(self):
        self.config = SimpleNamespace(context_length=CONTEXT, vocab_size=VOCAB)
        self.passes = []

    def new_cache(self, capacity, n_slots=1):
        return FakeCache(capacity, n_slots)

    def forward_batch(self, items, cache, all_logits=False, hook=None):
        self.passes.append([(slot, list(toks), want) for slot, toks, want in items])
        b = plan_batch(items, cache, VOCAB, all_logits)
        cache.ids[b.slots, b.pos] = b.ids
        logits = np.zeros((len(b.rows), VOCAB), np.float32)
        for i, t in enumerate(b.rows):
            slot, pos = b.slots[t], b.pos[t]
            logits[i, 1 + int(cache.ids[slot, :pos + 1].sum()) % (VOCAB - 1)] = 1
            if cache.ids[slot, 0] == POISON:
                logits[i, 0] = np.nan
        for item, (a, e, _) in zip(items, b.spans):
            cache.lengths[item[0]] += e - a
        return split_logits(b, logits)

    def storage(self):
        return {}

    def weight_bytes(self):
        return 0


class FakeTokenizer:
    eos_ids = (0,)

    def stream(self, prompt_ids):
        return SimpleNamespace(push=lambda tok: f"<{tok}>", flush=lambda: "")


def engine(**kw):
    return Engine(FakeBackend(), FakeTokenizer(), **kw)


def alone(prompt, max_tokens):
    """The tokens a request makes alone, by the fake backend's rule."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(1 + sum(ids) % (VOCAB - 1))
    return ids[len(prompt):]


def test_engine_steps_run_the_plans():
    """Admission into free slots (slot 0 first), chunked prompts, decoders first, a slot reused."""
    e = engine(max_batch=2, step_tokens=4)
    a, b, c = (Request([1, 2, 3, 4, 5, 6], max_tokens=2), Request([10, 11], max_tokens=3),
               Request([20, 21, 22], max_tokens=1))
    ha, hb, hc = (e.submit(r) for r in (a, b, c))
    e.run()
    ta, tb, tc = (h.result.token_ids for h in (ha, hb, hc))
    assert (ta, tb, tc) == (alone(a.prompt_ids, 2), alone(b.prompt_ids, 3), alone(c.prompt_ids, 1))
    assert e.backend.passes == [
        [(0, [1, 2, 3, 4], "none")],
        [(0, [5, 6], "last"), (1, [10, 11], "last")],
        [(0, ta[:1], "last"), (1, tb[:1], "last")],  # a finishes: slot 0 is free
        [(1, tb[1:2], "last"), (0, [20, 21, 22], "last")],
    ]
    assert e.stats["steps"] == 4 and e.stats["prompt_tokens_computed"] == 11 and e.idle


def test_engine_cancels_before_it_decides():
    e = engine(max_batch=1)
    h1, h2, h3 = (e.submit(Request([i, i + 1], max_tokens=3)) for i in (1, 30, 40))
    e.step()
    e.cancel(h1)
    e.cancel(h2)  # still waiting: never runs
    e.run()
    assert h1.result.finish_reason == h2.result.finish_reason == "cancelled"
    assert h1.result.token_ids == alone([1, 2], 1) and h2.result.token_ids == []
    assert h3.result.token_ids == alone([40, 41], 3)
    assert [p[0][1] for p in e.backend.passes] == [[1, 2], [40, 41]] + [[t] for t in h3.result.token_ids[:2]]


def test_engine_admission_waits_for_a_shared_prompt_to_be_cached():
    """A prompt that continues one being prefilled waits for its blocks, then starts after them."""
    e = engine(max_batch=2, step_tokens=3, prefix_cache_bytes=1 << 20)
    first, second = list(range(1, 11)), list(range(1, 9)) + [40, 41]
    h1, h2 = e.submit(Request(first, max_tokens=2)), e.submit(Request(second, max_tokens=2))
    e.run()
    assert h2.result.cached_tokens == 8
    assert h1.result.token_ids == alone(first, 2) and h2.result.token_ids == alone(second, 2)
    assert e.backend.passes[:5] == [
        [(0, [1, 2, 3], "none")], [(0, [4, 5, 6], "none")], [(0, [7, 8, 9], "none")],
        [(0, [10], "last")],  # the second still waits: its blocks are not cached before this pass
        [(0, h1.result.token_ids[:1], "last"), (1, [40, 41], "last")],
    ]


def test_engine_failure_of_one_request_leaves_the_others():
    e = engine(max_batch=2)
    bad, good = e.submit(Request([POISON, 1], max_tokens=3)), e.submit(Request([2, 3], max_tokens=3))
    e.run()
    with pytest.raises(TinydetError, match="NaN"):
        bad.wait(1)
    assert good.result.token_ids == alone([2, 3], 3) and e.idle
