"""Speculative decoding that changes no bit: a drafter proposes the next tokens of a sequence, one
forward pass computes the rows at the last token and at each proposal, and the sequence takes its own
choice at each row (its sampler, its seed, its position) while that choice equals the proposal, then
the choice that differs. A row's logits do not depend on how many rows share its pass, and the draw is
keyed by (seed, position), so every token, logits row and hash is what plain decoding gives; a poor
proposal costs only time. The engine cuts the KV cache back past the first rejection
(`scheduler.Engine`).

Drafters: `NgramDrafter` (prompt lookup: what followed the latest earlier occurrence of the last few
tokens of prompt + output; no second model)."""

from __future__ import annotations

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


def make_drafter(spec):
    """The drafter `spec` names: None or "" for none, "ngram", or a drafter object (kept: anything with
    `name`, `length()` giving a `DraftLength` and `propose(context, k)` giving at most k token ids)."""
    if spec is None or spec == "" or spec is False:
        return None
    if all(hasattr(spec, a) for a in ("name", "length", "propose")):
        return spec
    if spec == "ngram":
        return NgramDrafter()
    raise TinydetError(f"speculative: expected one of {', '.join(SPECULATIVE_KINDS)} or none, found {spec!r}")


def speculation(g, drafter: str) -> dict:
    """What speculation did for a finished `Generation` (for --json, the request log, metrics)."""
    return dict(drafter=drafter, draft_tokens=g.draft_tokens, draft_accepted=g.draft_accepted,
                acceptance_rate=round(g.acceptance_rate, 4), decode_passes=g.decode_passes,
                tokens_per_pass=round(g.tokens_per_pass, 4))
