"""Speculative decoding gives plain decoding's bytes: the same token ids, text, finish reason, logits
hash and logits rows, greedy and sampled, alone and batched, with chunked prefill, stop strings, the
prefix cache and cancellation, whatever the drafter proposes (prompt lookup, proposals that are right
only in part, random tokens). Only the passes differ, and the counts say so."""

from __future__ import annotations

import random

import numpy as np
import pytest

import tinydet
from tinydet.engine import Engine, generate, generate_batch, stream
from tinydet.engine.speculate import DraftLength, ModelDrafter, NgramDrafter, RandomDrafter, make_drafter, same_tokenizer
from tinydet.errors import TinydetError

STORY = ("Once upon a time, there was a little girl named Lily. She liked to play in the park with her ball. "
         "One day, Lily saw a big dog in the park. The dog was brown and fluffy. ")
PROMPTS = [STORY * 3 + "Once upon a time, there was a little girl named", "Lily and Ben went to the park.", STORY]


class Scripted:
    """Proposes what plain decoding chose (`truth[request's prompt]`), every third proposal wrong: each
    pass has accepted and rejected proposals."""

    name = "scripted"

    def __init__(self, truth: dict, vocab: int):
        self.truth, self.vocab = truth, vocab

    def length(self):
        return DraftLength(5, 5)

    def propose(self, context, k):
        for prompt, ids in self.truth.items():
            n = len(prompt)
            if list(context[:n]) == list(prompt) and len(context) - n < len(ids):
                out = list(ids[len(context) - n:len(context) - n + k])
                return [(t + 1) % self.vocab if (len(context) + i) % 3 == 0 else t for i, t in enumerate(out)]
        return []


def same(a, b):
    return ((a.token_ids, a.text, a.finish_reason, a.logits_hash, a.output_hash)
            == (b.token_ids, b.text, b.finish_reason, b.logits_hash, b.output_hash))


SETTINGS = [dict(max_tokens=48), dict(max_tokens=40, temperature=0.8, top_p=0.95, seed=7),
            dict(max_tokens=40, temperature=1.0, seed=3, stop=[". "])]


def test_ngram_proposes_what_followed_the_latest_match():
    d = NgramDrafter(max_ngram=3)
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert d.propose(ctx, 3) == [4, 5, 6]  # the latest earlier "1 2 3" was followed by 4 5 6
    assert d.propose(ctx, 10) == [4, 5, 6, 7, 1, 2, 3]  # up to the end of the context
    assert d.propose([5, 6, 7, 8], 4) == []  # nothing repeats
    assert d.propose([7, 1, 2, 9, 2], 2) == [9, 2]  # falls back to a 1-gram: the "2" at index 2
    assert d.propose([1, 2], 0) == []
    with pytest.raises(TinydetError, match="speculative: expected one of ngram"):
        make_drafter("lookahead")


def test_draft_length_adapts():
    k = DraftLength(4, 8)
    k.update(4, 4)
    assert k.k == 5
    k.update(5, 1)
    assert k.k == 2
    k.update(0, 0)  # no proposal: unchanged
    assert k.k == 2
    for _ in range(20):
        k.update(k.k, k.k)
    assert k.k == 8


@pytest.fixture(scope="module")
def stories(stories_models):
    return stories_models["fp32"]


def _drafters(model, requests):
    plain = [generate(model.backend, model.tokenizer, r) for r in requests]
    truth = {tuple(r.prompt_ids): g.token_ids for r, g in zip(requests, plain)}
    vocab = model.config.vocab_size
    return plain, {"ngram": NgramDrafter(), "scripted": Scripted(truth, vocab), "random": RandomDrafter(vocab)}


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_alone_every_drafter_gives_plain_bytes(stories_models, dtype):
    model = stories_models[dtype]
    reqs = [model.request(p, **s) for p in PROMPTS for s in SETTINGS]
    plain, drafters = _drafters(model, reqs)
    for name, d in drafters.items():
        accepted = 0
        for r, want in zip(reqs, plain):
            g = generate(model.backend, model.tokenizer, r, d)
            assert same(g, want), (name, r.params, r.stop)
            assert g.draft_tokens >= g.draft_accepted
            accepted += g.draft_accepted
            assert g.decode_passes + g.draft_accepted == len(g.token_ids) - 1
        if name != "random":
            assert accepted > 0, name  # proposals were taken: the speculative path ran
    assert any(w.finish_reason == "stop" and len(w.token_ids) < 40 for w in plain)  # a stop string cut one


def test_logits_rows_and_stream_events_are_plain_ones(stories):
    r = stories.request(PROMPTS[0], max_tokens=32, temperature=0.7, seed=1, logits=True)
    plain = list(stream(stories.backend, stories.tokenizer, r))
    spec = list(stream(stories.backend, stories.tokenizer, r, NgramDrafter()))
    assert [(e.text, e.token, e.finish_reason) for e in spec] == [(e.text, e.token, e.finish_reason) for e in plain]
    for a, b in zip(spec, plain):
        assert np.array_equal(a.logits.view(np.uint32), b.logits.view(np.uint32))
    assert spec[-1].result.draft_accepted > 0


@pytest.mark.parametrize("step_tokens", [None, 7])
def test_batched_and_chunked_give_plain_bytes(stories, step_tokens):
    reqs = [stories.request(p, **s) for p in PROMPTS for s in SETTINGS]
    plain, drafters = _drafters(stories, reqs)
    for name, d in drafters.items():
        got = generate_batch(stories.backend, stories.tokenizer, reqs, max_batch=4, step_tokens=step_tokens,
                             speculative=d)
        for i, (g, want) in enumerate(zip(got, plain)):
            assert same(g, want), (name, i)


def test_prefix_cache_and_cancellation(stories):
    reqs = [stories.request(PROMPTS[0], max_tokens=40), stories.request(PROMPTS[0], max_tokens=30, temperature=0.9,
                                                                       seed=2)]
    plain = [generate(stories.backend, stories.tokenizer, r) for r in reqs]
    eng = Engine(stories.backend, stories.tokenizer, max_batch=2, prefix_cache_bytes=1 << 24, speculative="ngram")
    for r, want in zip(reqs, plain):  # the second request starts from what the first left in the prefix cache
        got = eng.submit(r)
        eng.run()
        assert same(got.wait(), want)
    assert eng.prefix.hit_tokens >= 64  # (a block of 64 positions, written by a speculating sequence)
    # cancelled after a few steps: what it got is the start of plain decoding's tokens
    h = eng.submit(reqs[0])
    for _ in range(4):
        eng.step()
    h.cancel()
    eng.run()
    g = h.wait()
    assert g.finish_reason == "cancelled"
    assert g.token_ids == plain[0].token_ids[:len(g.token_ids)] and len(g.token_ids) > 4


def test_model_setting_and_smollm_copy(smollm_models, tmp_path):
    import json

    model = tinydet.load(smollm_models("native").path, dtype="native", speculative="ngram", log=tmp_path / "r.jsonl")
    assert model.speculative.name == "ngram"
    text = ("The committee met on Tuesday to review the budget for the new library, which will open in the "
            "spring with a reading room, a children's floor and a cafe. ")
    prompt = model.chat_prompt([{"role": "user", "content": "Repeat this text word for word:\n\n" + text * 2}])
    spec = model.generate(prompt, max_tokens=48)
    model.speculative = None
    want = model.generate(prompt, max_tokens=48)
    assert same(spec, want)
    assert spec.draft_accepted > 0 and spec.decode_passes < len(spec.token_ids) - 1
    first, second = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert first["speculative"]["draft_accepted"] == spec.draft_accepted and "speculative" not in second
    assert first["logits_hash"] == second["logits_hash"]
    with pytest.raises(TinydetError, match="speculative"):
        model.speculative = "draft-model-that-does-not-exist"


def test_cli_generate_json(stories_path):
    import json

    from click.testing import CliRunner

    from tinydet.cli import main

    prompt = PROMPTS[0]
    out = {}
    for drafter in (None, "ngram", "fp16"):
        extra = ["--speculative", drafter] if drafter else []
        r = CliRunner().invoke(main, ["generate", "--model", str(stories_path), "--max-tokens", "40", "--json",
                                      "--temperature", "0", *extra, prompt])
        assert r.exit_code == 0, r.output
        out[drafter] = json.loads(r.output)
    plain = out[None]
    assert "speculative" not in plain
    for drafter, name in (("ngram", "ngram"), ("fp16", "model:stories260K.gguf:fp16")):
        spec = out[drafter]
        assert (spec["token_ids"], spec["output_hash"], spec["logits_hash"]) == (
            plain["token_ids"], plain["output_hash"], plain["logits_hash"])
        s = spec["speculative"]
        assert s["drafter"] == name and 0 < s["draft_accepted"] <= s["draft_tokens"]
        assert s["decode_passes"] + s["draft_accepted"] == len(spec["token_ids"]) - 1 and s["tokens_per_pass"] > 1
    r = CliRunner().invoke(main, ["generate", "--model", str(stories_path), "--speculative", "medusa", "x"])
    assert r.exit_code != 0 and "medusa" in r.output


def sibling_of(path, out, scale=0.05, seed=0):
    """A copy of a GGUF model with every float32 tensor perturbed (w * (1 + scale * noise)): another
    model of the same shape and tokenizer, a draft model that agrees with it often, not always."""
    import ggufgen

    rng = np.random.default_rng(seed)

    def edit(tensors):
        got = []
        for name, shape, ggml_type, data in tensors:
            if ggml_type == 0 and len(shape) > 1:  # F32 matrices
                w = np.frombuffer(data, np.float32)
                data = (w * (1 + np.float32(scale) * rng.standard_normal(w.size).astype(np.float32))).astype(np.float32).tobytes()
            got.append((name, shape, ggml_type, data))
        return got

    out.write_bytes(ggufgen.rewrite(path, tensor_edits=edit))
    return out


@pytest.fixture(scope="module")
def sibling(stories_path, tmp_path_factory):
    return tinydet.load(sibling_of(stories_path, tmp_path_factory.mktemp("draft") / "sibling.gguf"))


def test_draft_models_give_plain_bytes(stories, stories_models, sibling):
    """A draft model (the same file at fp16, another model sharing the tokenizer) alone and batched,
    greedy, sampled and with stop strings: plain decoding's bytes, some proposals taken, some not."""
    reqs = [stories.request(p, **s) for p in PROMPTS for s in SETTINGS]
    plain = [generate(stories.backend, stories.tokenizer, r) for r in reqs]
    for draft in (stories_models["fp16"], sibling):
        d = ModelDrafter(draft)
        got = [generate(stories.backend, stories.tokenizer, r, d) for r in reqs]
        assert all(same(g, w) for g, w in zip(got, plain)), draft.path
        taken, proposed = sum(g.draft_accepted for g in got), sum(g.draft_tokens for g in got)
        assert 0 < taken < proposed, (draft.path, taken, proposed)
        batched = generate_batch(stories.backend, stories.tokenizer, reqs, max_batch=4, step_tokens=7,
                                 speculative=ModelDrafter(draft, slots=2))
        assert all(same(g, w) for g, w in zip(batched, plain)), draft.path


def test_draft_model_setting_and_its_tokenizer_checked(stories_path, sibling, smollm_models):
    model = tinydet.load(stories_path, speculative="fp16")  # the same file at fp16 drafting
    assert model.speculative.name == "model:stories260K.gguf:fp16"
    model.speculative = sibling
    assert model.speculative.name == "model:sibling.gguf:fp32"
    with pytest.raises(TinydetError, match="tokenizer.*vocabulary sizes differ"):
        model.speculative = smollm_models("native")
    assert same_tokenizer(model.tokenizer, sibling.tokenizer) is None
    assert "differ" in same_tokenizer(model.tokenizer, smollm_models("native").tokenizer)


def test_draft_model_keeps_each_sequence_in_its_slot(stories):
    """Two sequences after one prompt, proposed for in turn: the second takes a free slot with the
    prompt's blocks copied, neither undoes the other (each call runs only its new tokens and its
    proposals), and every proposal is what a fresh draft model proposes for that context."""
    from types import SimpleNamespace

    ran = []

    class Counting:
        def __init__(self, backend):
            self.backend = backend

        def new_cache(self, *args):
            return self.backend.new_cache(*args)

        def forward(self, tokens, cache, slot=0):
            ran.append(len(tokens))
            return self.backend.forward(tokens, cache, slot=slot)

    draft = SimpleNamespace(path=stories.path, dtype="fp32", config=stories.config, backend=Counting(stories.backend))
    d = ModelDrafter(draft, slots=2)
    prompt = stories.tokenizer.encode(STORY * 3)
    ctx = {"a": prompt + [7], "b": prompt + [9]}
    for turn in range(6):
        for name in ("a", "b"):
            ran.clear()
            got = d.propose(ctx[name], 3)
            assert got == ModelDrafter(stories).propose(ctx[name], 3), (turn, name)
            if turn:
                assert sum(ran) <= 2 + 2, (turn, name, ran)  # the last proposal and the new token, then 2 more
            ctx[name] = ctx[name] + got[:turn % 3] + [(got[turn % 3] + 1) % stories.config.vocab_size]
