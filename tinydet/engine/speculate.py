"""Speculative decoding that changes no bit: a drafter proposes the next tokens of a sequence, one
forward pass computes the rows at the last token and at each proposal, and the sequence takes its own
choice at each row (its sampler, its seed, its position) while that choice equals the proposal, then
the choice that differs. A row's logits do not depend on how many rows share its pass, and the draw is
keyed by (seed, position), so every token, logits row and hash is what plain decoding gives; a poor
proposal costs only time. The engine cuts the KV cache back past the first rejection
(`scheduler.Engine`).

Drafters: `NgramDrafter` (prompt lookup: what followed the latest earlier occurrence of the last few
tokens of prompt + output; no second model) and `ModelDrafter` (a draft model's greedy tokens: the same
file in a cheaper mode, or a smaller model with the same tokenizer, `same_tokenizer`)."""

from __future__ import annotations

import json
import threading
from typing import Sequence

import numpy as np

from ..errors import TinydetError

SPECULATIVE_KINDS = ("ngram",)


class DraftLength:
    """A sequence's draft length, adapted to what was accepted: one more after a pass that took every
    proposal, back to one more than the proposals taken after one that did not."""

    def __init__(self, start: int, most: int):
        self.k, self.most = start, most

    def update(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.k = min(self.most, self.k + 1) if accepted == proposed else max(1, accepted + 1)


class NgramDrafter:
    """Prompt lookup: for n from `max_ngram` down to `min_ngram`, the latest earlier place where the
    last n tokens of the context occur, and up to k tokens that followed it there."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise TinydetError(f"speculative ngram: expected 1 <= min_ngram <= max_ngram, found {min_ngram}, {max_ngram}")
        if max_draft < 1:
            raise TinydetError(f"speculative ngram: max_draft must be at least 1, found {max_draft}")
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft

    def length(self) -> DraftLength:
        return DraftLength(min(4, self.max_draft), self.max_draft)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k proposed tokens to follow `context` (prompt ids + generated ids); [] when none."""
        n_ctx = len(context)
        if k < 1 or n_ctx < self.min_ngram + 1:
            return []
        ids = np.asarray(context, np.int64)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = ids[n_ctx - n:]
            # candidate ends e (exclusive) of an earlier occurrence: e <= n_ctx - 1, so a token follows
            ends = np.flatnonzero(ids[n - 1:n_ctx - 1] == tail[-1]) + n
            for e in ends[::-1]:
                if np.array_equal(ids[e - n:e], tail):
                    return ids[e:min(e + k, n_ctx)].tolist()
        return []


class RandomDrafter:
    """Proposes random token ids (seeded): nearly every proposal is wrong. For checking that a poor
    drafter changes no bit (`tinydet verify`, the tests)."""

    name = "random"

    def __init__(self, vocab_size: int, seed: int = 0, k: int = 4):
        self.rng, self.vocab, self.k = np.random.default_rng(seed), vocab_size, k

    def length(self) -> DraftLength:
        return DraftLength(self.k, self.k)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return self.rng.integers(0, self.vocab, max(k, 0)).tolist()


class ModelDrafter:
    """A draft model proposes: its greedy tokens after the context, from a second model that shares the
    tokenizer (`same_tokenizer`), for example the same file in a cheaper mode (`--speculative int8`
    drafting for native). Its KV cache keeps a slot per recent context, cut back to what the new
    context shares with it, so each call computes only the tokens it has not seen: the accepted ones
    since the last call, then one pass per proposal."""

    def __init__(self, model, max_draft: int = 6, slots: int = 8):
        self.model, self.max_draft = model, max_draft
        self.name = f"model:{model.path.name}:{model.dtype}"
        self.cache = model.backend.new_cache(256, slots)
        self.held: list[list[int]] = [[] for _ in range(slots)]  # the ids each slot's positions hold
        self.real = [0] * slots  # how many of them were the context (the rest: its last proposals)
        self.last_use = [0] * slots
        self.clock = 0
        self.lock = threading.Lock()  # one Model's drafter serves every call made on it

    def length(self) -> DraftLength:
        return DraftLength(min(3, self.max_draft), self.max_draft)

    def _slot(self, context: list[int]) -> tuple[int, int]:
        """(slot, positions kept) for context: the slot sharing the longest prefix with it (at most
        len(context) - 1 kept, so a pass has a token to run). Where that would cut another sequence's
        own tokens (several sequences after one prompt, batched) and a slot is free, the free one takes
        the shared prefix's whole blocks by copy instead, so that sequences do not undo each other."""
        best, keep = 0, -1
        for s, held in enumerate(self.held):
            n = min(len(held), len(context) - 1)
            same = next((i for i in range(n) if held[i] != context[i]), n)
            if same > keep or (same == keep and self.last_use[s] < self.last_use[best]):
                best, keep = s, same
        if keep < self.real[best]:  # past the shared prefix, best holds another sequence's tokens
            free = [s for s, held in enumerate(self.held) if not held]
            if free:
                block = self.cache.block
                for b in range(keep // block):
                    self.cache.write_block(free[0], b, self.cache.read_block(best, b))
                return free[0], keep // block * block
            if keep == 0:
                best = min(range(len(self.held)), key=self.last_use.__getitem__)
        return best, keep

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        k = min(k, self.max_draft)
        if k < 1 or not context:
            return []
        with self.lock:
            return self._propose([int(t) for t in context], k)

    def _propose(self, ctx: list[int], k: int) -> list[int]:
        need = len(ctx) + k
        if need > self.model.config.context_length:
            return []
        slot, keep = self._slot(ctx)
        self.clock += 1
        self.last_use[slot] = self.clock
        if need > self.cache.capacity:
            self.cache.grow(max(need, 2 * self.cache.capacity))
        self.cache.lengths[slot] = keep  # positions past it are overwritten before they are read
        self.held[slot], self.real[slot] = ctx[:keep], keep  # so far, should a pass fail
        backend = self.model.backend
        logits = backend.forward(ctx[keep:], self.cache, slot=slot)
        out: list[int] = []
        while True:
            out.append(int(np.argmax(logits[-1])))
            if len(out) == k:
                break
            logits = backend.forward(out[-1:], self.cache, slot=slot)
        self.held[slot], self.real[slot] = ctx + out[:-1], len(ctx)
        return out


def same_tokenizer(a, b) -> str | None:
    """None when tokenizers a and b turn text into the same ids and back, else the first difference in
    a few words: vocabulary size, a token, the merges, the special ids."""
    ha, hb = a.hf, b.hf
    if ha.get_vocab_size(with_added_tokens=True) != hb.get_vocab_size(with_added_tokens=True):
        return (f"vocabulary sizes differ: {ha.get_vocab_size(with_added_tokens=True)} against "
                f"{hb.get_vocab_size(with_added_tokens=True)}")
    for i in range(ha.get_vocab_size(with_added_tokens=True)):
        if ha.id_to_token(i) != hb.id_to_token(i):
            return f"token {i} differs: {ha.id_to_token(i)!r} against {hb.id_to_token(i)!r}"
    ma, mb = json.loads(ha.to_str()).get("model", {}), json.loads(hb.to_str()).get("model", {})
    if ma.get("type") != mb.get("type") or ma.get("merges") != mb.get("merges"):
        return "the merges (or the tokenizer model's kind) differ"
    if (a.bos_id, sorted(a.eos_ids)) != (b.bos_id, sorted(b.eos_ids)):
        return f"special ids differ: BOS/EOS {a.bos_id}/{sorted(a.eos_ids)} against {b.bos_id}/{sorted(b.eos_ids)}"
    for field in ("model", "pre", "add_bos", "add_space_prefix"):
        if getattr(a, field) != getattr(b, field):
            return f"the tokenizers' {field} differs: {getattr(a, field)!r} against {getattr(b, field)!r}"
    return None


def make_drafter(spec):
    """The drafter `spec` names: None or "" for none, "ngram", a loaded draft model (its tokenizer is
    the caller's to check: `same_tokenizer`), or a drafter object (kept: anything with `name`, `length()`
    giving a `DraftLength` and `propose(context, k)` giving at most k token ids)."""
    if spec is None or spec == "" or spec is False:
        return None
    if all(hasattr(spec, a) for a in ("name", "length", "propose")):
        return spec
    if hasattr(spec, "backend") and hasattr(spec, "tokenizer"):  # a loaded model (`api.Model`)
        return ModelDrafter(spec)
    if spec == "ngram":
        return NgramDrafter()
    raise TinydetError(f"speculative: expected one of {', '.join(SPECULATIVE_KINDS)} or none, found {spec!r}")


def speculation(g, drafter: str) -> dict:
    """What speculation did for a finished `Generation` (for --json, the request log, metrics)."""
    return dict(drafter=drafter, draft_tokens=g.draft_tokens, draft_accepted=g.draft_accepted,
                acceptance_rate=round(g.acceptance_rate, 4), decode_passes=g.decode_passes,
                tokens_per_pass=round(g.tokens_per_pass, 4))
