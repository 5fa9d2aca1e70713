"""The step-wise engine: requests submitted at any step, prompts chunked under a token budget,
cancellation, events as they are produced, a background engine thread fed from other threads; every
result bit-identical to the same request generated alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tinydet.errors import ContextLengthError, TinydetError
from tinydet.hashing import hash_logits
from tinydet.logprobs import token_logprobs

REQUESTS = [
    dict(prompt="", max_tokens=30),
    dict(prompt="Once upon a time there was a little girl named Lily who", max_tokens=25, temperature=0.8,
         top_p=0.9, seed=1),
    dict(prompt="The sun", max_tokens=33, stop=["."]),
    dict(prompt="Tom had a red ball and a big blue kite", max_tokens=9, temperature=1.0, top_k=20, seed=2),
    dict(prompt="One day", max_tokens=40, temperature=0.9, seed=4),
]


def same(a, b):
    return (a.token_ids, a.logits_hash, a.text, a.finish_reason) == (b.token_ids, b.logits_hash, b.text, b.finish_reason)


@pytest.fixture(scope="module")
def solo(stories_models):
    model = stories_models["fp32"]
    return [model.generate(**r) for r in REQUESTS]


@pytest.mark.parametrize("step_tokens", [None, 1, 3, 7])
@pytest.mark.parametrize("max_batch", [2, 5])
def test_staggered_submissions_equal_solo(stories_models, solo, step_tokens, max_batch):
    """Requests join while others run (one submitted every few steps), prompts prefilled in chunks of
    the step's leftover budget: each result, and each event stream, is the request's solo run."""
    model = stories_models["fp32"]
    engine = model.engine(max_batch=max_batch, step_tokens=step_tokens)
    pending = [model.request(**r, logits=True) for r in REQUESTS]
    handles, steps = [], 0
    while pending or not engine.idle:
        if pending and steps % 3 == 0:
            handles.append(engine.submit(pending.pop(0)))
        engine.step()
        steps += 1
    for i, (h, want) in enumerate(zip(handles, solo)):
        assert same(h.result, want), f"request {i}, step_tokens={step_tokens}, max_batch={max_batch}"
        events = list(h.events(timeout=1))
        assert "".join(e.text for e in events) == want.text
        assert [e.token for e in events] == want.token_ids
        assert hash_logits([e.logits for e in events]) == want.logits_hash
        assert events[-1].finish_reason == want.finish_reason and events[-1].result is h.result


def test_budget_chunks_the_prompt(stories_models):
    """A 13-token prompt under a budget of 4 tokens a step gives its first token at the 4th step."""
    model = stories_models["fp32"]
    r = model.request([1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421], max_tokens=3)
    engine = model.engine(max_batch=1, step_tokens=4)
    h = engine.submit(r)
    per_step = [len(engine.step()) for _ in range(6)]
    assert per_step == [0, 0, 0, 1, 1, 1] and h.finished
    assert same(h.result, model.generate(r.prompt_ids, max_tokens=3))


def test_cancel_running_and_waiting(stories_models, solo):
    model = stories_models["fp32"]
    engine = model.engine(max_batch=2)
    hs = [engine.submit(model.request(**r)) for r in REQUESTS[:3]]
    for _ in range(5):
        engine.step()
    hs[0].cancel()  # running, 5 tokens in
    hs[2].cancel()  # still waiting for a slot
    engine.run()
    a, b, c = (h.result for h in hs)
    assert a.finish_reason == "cancelled" and a.token_ids == solo[0].token_ids[:len(a.token_ids)]
    assert 0 < len(a.token_ids) < len(solo[0].token_ids)
    assert c.finish_reason == "cancelled" and c.token_ids == [] and c.text == ""
    assert same(b, solo[1])  # the others are not disturbed
    assert list(hs[2].events(timeout=1))[-1].finish_reason == "cancelled"


def test_engine_thread_fed_from_other_threads(stories_models, solo):
    """A server's shape: one thread runs the engine, client threads submit and read their events."""
    model = stories_models["fp32"]
    engine = model.engine(max_batch=3, step_tokens=5)
    stop = threading.Event()
    runner = threading.Thread(target=engine.serve, args=(stop,), daemon=True)
    runner.start()
    results = {}

    def client(i):
        h = engine.submit(model.request(**REQUESTS[i]))
        text = "".join(e.text for e in h.events(timeout=60))
        results[i] = (text, h.wait(60))

    clients = [threading.Thread(target=client, args=(i,)) for i in range(len(REQUESTS))]
    for t in clients:
        t.start()
    for t in clients:
        t.join(120)
    stop.set()
    runner.join(10)
    assert not runner.is_alive()
    for i, want in enumerate(solo):
        text, g = results[i]
        assert text == want.text and same(g, want), i


def test_bad_requests_are_refused_at_submit(stories_models):
    model = stories_models["fp32"]
    engine = model.engine()
    with pytest.raises(TinydetError, match="max_tokens"):
        engine.submit(model.request("Hi", max_tokens=0))
    with pytest.raises(ContextLengthError, match="max_tokens"):
        engine.submit(model.request("Hi", max_tokens=model.config.context_length))
    assert engine.idle and engine.step() == []
    with pytest.raises(TinydetError, match="step_tokens"):
        model.engine(step_tokens=0)
    with pytest.raises(TinydetError, match="max_batch"):
        model.engine(max_batch=0)


def test_cache_grows_for_longer_requests(stories_models):
    """The cache starts small and grows as longer requests arrive; entries already there are kept."""
    model = stories_models["fp16"]
    engine = model.engine(max_batch=2)
    short = engine.submit(model.request("A", max_tokens=40))
    for _ in range(10):
        engine.step()
    cap = engine.cache.capacity
    long = engine.submit(model.request("Once upon a time " * 20, max_tokens=200, temperature=0.7, seed=5))
    engine.run()
    assert engine.cache.capacity > cap
    assert same(short.result, model.generate("A", max_tokens=40))
    assert same(long.result, model.generate("Once upon a time " * 20, max_tokens=200, temperature=0.7, seed=5))


def test_failed_pass_ends_every_request_with_the_error(stories_models):
    model = stories_models["fp32"]
    engine = model.engine(max_batch=2)

    def broken(layer, op, pos, slots, rows):
        if op == "logits":
            raise RuntimeError("injected")

    h = engine.submit(model.request("Once", max_tokens=5))
    model.backend.hooks.append(broken)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
    finally:
        model.backend.hooks.remove(broken)
    with pytest.raises(RuntimeError, match="injected"):
        h.wait(1)
    assert engine.idle
    assert np.isfinite(model.logits([1, 403])).all()  # the model itself is fine


LONG = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park with her "
        "friends. One day she saw a big red ball under a tree and she ran to get it. ")


@pytest.mark.parametrize("step_tokens", [None, 5])
def test_prefix_cache_reuses_blocks_with_the_same_bits(stories_models, step_tokens):
    """A prompt that starts like an earlier one (or like an earlier prompt plus its answer) takes the
    earlier keys and values from the prefix cache: fewer prompt tokens computed, the same bits."""
    model = stories_models["fp32"]
    engine = model.engine(max_batch=2, step_tokens=step_tokens, prefix_cache_bytes=64 << 20)
    block = engine.cache.block
    first = model.request(LONG * 3, max_tokens=20)
    assert len(first.prompt_ids) > 2 * block
    g1 = engine.submit(first)
    engine.run()
    g1 = g1.result
    assert g1.cached_tokens == 0 and engine.stats["prompt_tokens_computed"] == len(first.prompt_ids)
    # The same prompt, one that continues it, and one that continues its prompt + answer (a chat's next turn).
    follow = [first, model.request(LONG * 3 + "Tom", max_tokens=15, temperature=0.8, seed=3),
              model.request(g1.prompt_token_ids + g1.token_ids + model.tokenize("Then", add_special=False),
                            max_tokens=10)]
    for r in follow:
        before = engine.stats["prompt_tokens_computed"]
        h = engine.submit(r)
        engine.run()
        alone = model.generate(r.prompt_ids, max_tokens=r.max_tokens, temperature=r.params.temperature,
                               seed=r.params.seed)
        assert same(h.result, alone)
        assert h.result.cached_tokens >= 2 * block and h.result.cached_tokens % block == 0
        assert engine.stats["prompt_tokens_computed"] - before == len(r.prompt_ids) - h.result.cached_tokens
    assert engine.prefix.hits == 3 and engine.prefix.queries == 4


def test_prefix_cache_stays_within_its_bytes(stories_models):
    model = stories_models["fp32"]
    block_bytes = sum(a.nbytes for a in model.backend.new_cache(64).read_block(0, 0))
    engine = model.engine(max_batch=1, prefix_cache_bytes=3 * block_bytes)
    for i in range(4):  # four prompts of two blocks and more each: 8 blocks offered, 3 kept
        assert 2 * 64 < len(model.tokenize(f"{i} " + LONG * 3)) < 3 * 64
        engine.submit(model.request(f"{i} " + LONG * 3, max_tokens=2))
        engine.run()
        assert engine.prefix.nbytes <= 3 * block_bytes
    assert len(engine.prefix) == 3 and engine.prefix.evictions >= 5
    # The most recent prompt's blocks are the ones kept.
    h = engine.submit(model.request("3 " + LONG * 3, max_tokens=2))
    engine.run()
    assert h.result.cached_tokens == 2 * 64


def test_prompt_logits_rows_equal_a_full_pass(stories_models):
    """With prompt_logits, events carry the rows predicting each prompt token, chunk by chunk: the
    rows of one full causal pass, bit for bit; the answer is the same as without them."""
    model = stories_models["fp32"]
    r = model.request(LONG, max_tokens=8, prompt_logits=True)
    full = model.logits(r.prompt_ids)
    for step_tokens in (None, 7):
        engine = model.engine(max_batch=2, step_tokens=step_tokens)
        other = engine.submit(model.request("The sun", max_tokens=12))
        h = engine.submit(r)
        engine.run()
        rows = [ev.prompt_rows for ev in h.events(timeout=1) if ev.prompt_rows is not None]
        assert (len(rows) > 1) == (step_tokens is not None)
        assert np.array_equal(np.concatenate(rows), full[:-1])
        assert same(h.result, model.generate(r.prompt_ids, max_tokens=8))
        assert other.result.finish_reason == "length"


def _scores(h) -> list:
    return [e for ev in h.events(timeout=1) if ev.prompt_scores is not None for e in ev.prompt_scores]


@pytest.mark.parametrize("step_tokens", [None, 5])
def test_prompt_scores_from_the_prefix_cache_equal_a_full_pass(stories_models, step_tokens):
    """Echo scoring (`prompt_logprobs`) keeps each prompt token's log-probability and alternatives with
    its block in the prefix cache: a request scoring a context scored before computes only what follows
    the cached blocks (and their last position again), and gets the bits of one full causal pass,
    alone or among other requests, whatever number of alternatives the earlier request asked for."""
    model = stories_models["fp32"]
    ctx = LONG * 3
    engine = model.engine(max_batch=3, step_tokens=step_tokens, prefix_cache_bytes=64 << 20)

    def run(r):
        before = engine.stats["prompt_tokens_computed"]
        h = engine.submit(r)
        engine.run()
        full = model.logits(r.prompt_ids)
        expected = [(t, *token_logprobs(full[i], t, r.prompt_logprobs)) for i, t in enumerate(r.prompt_ids[1:])]
        assert _scores(h) == expected
        assert same(h.result, model.generate(r.prompt_ids, max_tokens=r.max_tokens))
        assert engine.stats["prompt_tokens_computed"] - before == len(r.prompt_ids) - h.result.cached_tokens
        return h.result.cached_tokens

    # Blocks kept by a plain request have no scores: the first scoring request computes every row, and
    # its blocks take them.
    engine.submit(model.request(ctx + "Tom", max_tokens=3))
    engine.run()
    assert len(engine.prefix) >= 2
    assert run(model.request(ctx + "Lily", max_tokens=3, prompt_logprobs=5)) == 0
    # Warm: the context's blocks and their scores from the cache, two alternatives of the five kept.
    blocks = (len(model.tokenize(ctx)) // 64) * 64
    assert run(model.request(ctx + "Tom went", max_tokens=4, prompt_logprobs=2)) == blocks - 1
    assert run(model.request(ctx + "The", max_tokens=2, prompt_logprobs=0)) == blocks - 1
    # Among other requests (decoding and prefilling beside it): the same bits.
    others = [engine.submit(model.request(**q)) for q in REQUESTS[1:4]]
    r = model.request(ctx + "Tom went", max_tokens=4, prompt_logprobs=2)
    h = engine.submit(r)
    engine.run()
    full = model.logits(r.prompt_ids)
    assert _scores(h) == [(t, *token_logprobs(full[i], t, 2)) for i, t in enumerate(r.prompt_ids[1:])]
    assert h.result.cached_tokens == blocks - 1 and all(o.result.finish_reason for o in others)


@pytest.mark.parametrize("scored", [False, True])
def test_requests_sharing_a_prompt_being_prefilled_wait_for_its_blocks(stories_models, scored):
    """Requests sent together whose prompts share a context (a multiple-choice question's choices) are
    not prefilled side by side: the first computes the context, the others wait for its blocks and
    compute only their own tokens; a request with nothing to share goes ahead meanwhile. Each result
    is its solo run's."""
    model = stories_models["fp32"]
    ctx = LONG * 3
    endings = [" Tom ran home.", " The dog barked.", " It rained all day.", " Lily laughed."]
    engine = model.engine(max_batch=4, prefix_cache_bytes=64 << 20)
    reqs = [model.request(ctx + e, max_tokens=2, prompt_logprobs=1 if scored else None) for e in endings]
    other = model.request("The sun was hot", max_tokens=3)
    handles = [engine.submit(r) for r in reqs[:2]] + [engine.submit(other)] + [engine.submit(r) for r in reqs[2:]]
    engine.run()
    blocks = (len(model.tokenize(ctx)) // 64) * 64
    shared = blocks - 1 if scored else blocks
    assert [h.result.cached_tokens for h in handles] == [0, shared, 0, shared, shared]
    assert engine.stats["prompt_tokens_computed"] == sum(len(r.prompt_ids) for r in reqs + [other]) - 3 * shared
    for h in handles:
        r = h.request
        assert same(h.result, model.generate(r.prompt_ids, max_tokens=r.max_tokens))
    if scored:
        full = model.logits(reqs[3].prompt_ids)
        assert _scores(handles[4]) == [(t, *token_logprobs(full[i], t, 1)) for i, t in enumerate(reqs[3].prompt_ids[1:])]


def test_prompt_scores_count_in_the_prefix_cache_bytes(stories_models):
    """Scores kept with blocks count toward the cache's bytes, which it never exceeds."""
    model = stories_models["fp32"]
    block_bytes = sum(a.nbytes for a in model.backend.new_cache(64).read_block(0, 0))
    engine = model.engine(max_batch=1, prefix_cache_bytes=4 * block_bytes)
    engine.submit(model.request(LONG * 3, max_tokens=2))
    engine.run()
    plain = engine.prefix.nbytes
    engine.submit(model.request(LONG * 3, max_tokens=2, prompt_logprobs=1))
    engine.run()
    assert engine.prefix.nbytes > plain
    for i in range(4):
        engine.submit(model.request(f"{i} " + LONG * 3, max_tokens=2, prompt_logprobs=1))
        engine.run()
        assert engine.prefix.nbytes <= 4 * block_bytes
    assert engine.prefix.evictions > 0


def test_one_requests_failure_leaves_the_others_running(stories_models, solo):
    """NaN logits in one sequence's rows fail that request only; the batch-mates finish unchanged."""
    model = stories_models["fp32"]
    engine = model.engine(max_batch=3)
    handles = [engine.submit(model.request(**r)) for r in REQUESTS[:2]]
    bad = engine.submit(model.request("Tom", max_tokens=20))
    bad_slot = 2  # slots are handed out in order of admission

    def poison(layer, op, pos, slots, rows):
        if op == "logits":
            rows[slots == bad_slot] = np.nan

    model.backend.hooks.append(poison)
    try:
        engine.run()
    finally:
        model.backend.hooks.remove(poison)
    with pytest.raises(TinydetError, match="NaN"):
        bad.wait(1)
    for h, want in zip(handles, solo[:2]):
        assert same(h.result, want)
    assert engine.idle and len(engine._free) == 3
