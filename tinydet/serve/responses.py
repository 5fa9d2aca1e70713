"""OpenAI's answer shapes for `tinydet serve`: the bodies of /v1/completions and /v1/chat/completions,
whole and as stream chunks, with their logprobs, usage and tinydet's own fields; /v1/models' card."""

from __future__ import annotations

from ..hashing import hash_ids, hash_logits
from . import chat_tools
from .protocol import ChatCompletionRequest, CompletionRequest
from .service import Service
from .streaming import _Job


class Answers:
    """The answers of one served model: its name and fingerprint in each, its tokenizer for logprobs.
    `completion` and `chat` give the renderers that `streaming.Runner.run` calls for one request."""

    def __init__(self, service: Service):
        self.service = service

    # -- shared answer parts ----------------------------------------------------------------------

    def _head(self, obj: str, rid: str, created: int, seed: int) -> dict:
        return {"id": rid, "object": obj, "created": created, "model": self.service.name,
                "system_fingerprint": self.service.fingerprint, "seed": seed}

    def _extension(self, job: _Job, body) -> dict:
        """tinydet's fields of a finished choice."""
        g = job.result
        out = {"output_hash": g.output_hash, "logits_hash": g.logits_hash}
        if job.drop_token:
            out = {"output_hash": hash_ids([]), "logits_hash": hash_logits([])}  # no token is answered
        if body.return_token_ids:
            out["token_ids"] = list(job.tokens)
            out["prompt_token_ids"] = list(job.request.prompt_ids)
        return out

    def _usage(self, jobs: list[_Job], n: int) -> dict:
        prompt = sum(len(j.request.prompt_ids) for j in jobs[::n])
        done = sum(len(j.tokens) for j in jobs)
        cached = sum(j.result.cached_tokens for j in jobs[::n] if j.result is not None)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _reason(self, job: _Job) -> str:
        return "length" if job.drop_token else job.result.finish_reason

    def _token_str(self, tok: int) -> tuple[str, list[int]]:
        b = self.service.model.tokenizer.token_bytes(tok)
        return b.decode("utf-8", errors="replace"), list(b)

    def card(self) -> dict:
        s = self.service
        return {"id": s.name, "object": "model", "created": s.created, "owned_by": "tinydet",
                "system_fingerprint": s.fingerprint}

    # -- /v1/completions --------------------------------------------------------------------------

    def completion(self, body: CompletionRequest, rid: str, created: int):
        """The renderers (chunks, final) of a completion answered as `rid`, created at `created`."""

        def logprobs(job: _Job, entries: list[tuple], offset: int, with_prompt: bool) -> tuple[dict, int]:
            """OpenAI's completions logprobs for `entries`, the first at character `offset` of the
            answer's text; with the prompt, its first token comes first (no log-probability)."""
            tokens, lps, tops, offsets = [], [], [], []
            rows = ([(job.request.prompt_ids[0], None, None)] if with_prompt else []) + list(entries)
            for tok, lp, alts in rows:
                s, _ = self._token_str(tok)
                tokens.append(s)
                lps.append(lp)
                tops.append(None if alts is None else {self._token_str(a)[0]: alp for a, alp in alts})
                offsets.append(offset)
                offset += len(s)
            return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset

        def final(jobs, seed, usage_only=False):
            head = self._head("text_completion", rid, created, seed)
            if usage_only:
                return {**head, "choices": [], "usage": self._usage(jobs, body.n)}
            choices = []
            for j in jobs:
                text = "".join(j.text)
                lp = None
                if j.top is not None:
                    lp = logprobs(j, j.prompt_logprobs + j.logprobs if j.echo else j.logprobs,
                                  0 if j.echo else len(j.prompt_text), j.echo)[0]
                choices.append({"index": j.index, "text": j.prompt_text + text if j.echo else text,
                                "logprobs": lp, "finish_reason": self._reason(j), **self._extension(j, body)})
            return {**head, "choices": choices, "usage": self._usage(jobs, body.n)}

        def chunks(job, data, started, seed, include_usage):
            text, tok, lp, reason, _ = data
            index = job.index
            pieces, entries, with_prompt = [], [], False
            if index not in started:
                started.add(index)
                job.offset = 0 if job.echo else len(job.prompt_text)
                if job.echo:
                    pieces.append(job.prompt_text)
                    entries, with_prompt = list(job.prompt_logprobs), True
            if tok is not None and not job.drop_token:
                pieces.append(text)
                if lp is not None:
                    entries.append(lp)
            if not pieces and reason is None:
                return
            c = {"index": index, "text": "".join(pieces), "logprobs": None, "finish_reason": None}
            if job.top is not None and (entries or with_prompt):
                c["logprobs"], job.offset = logprobs(job, entries, job.offset, with_prompt)
            if reason is not None:
                c["finish_reason"] = self._reason(job)
                c.update(self._extension(job, body))
            out = {**self._head("text_completion", rid, created, seed), "choices": [c]}
            if include_usage:
                out["usage"] = None
            yield out

        return chunks, final

    # -- /v1/chat/completions ---------------------------------------------------------------------

    def chat(self, body: ChatCompletionRequest, rid: str, created: int):
        """The renderers (chunks, final) of a chat completion answered as `rid`, created at `created`."""

        def content(entries):
            out = []
            for tok, lp, alts in entries:
                s, b = self._token_str(tok)
                out.append({"token": s, "logprob": lp, "bytes": b,
                            "top_logprobs": [dict(zip(("token", "bytes"), self._token_str(a)), logprob=alp)
                                             for a, alp in alts]})
            return out

        def final(jobs, seed, usage_only=False):
            head = self._head("chat.completion", rid, created, seed)
            if usage_only:
                return {**self._head("chat.completion.chunk", rid, created, seed), "choices": [],
                        "usage": self._usage(jobs, body.n)}
            choices = [{"index": j.index, "message": chat_tools.message(j),
                        "logprobs": {"content": content(j.logprobs)} if j.top is not None else None,
                        "finish_reason": chat_tools.reason(j, self._reason(j)), **self._extension(j, body)}
                       for j in jobs]
            return {**head, "choices": choices, "usage": self._usage(jobs, body.n)}

        def chunks(job, data, started, seed, include_usage):
            text, tok, lp, reason, _ = data
            index = job.index
            head = self._head("chat.completion.chunk", rid, created, seed)
            if include_usage:
                head["usage"] = None
            if index not in started:
                started.add(index)
                yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            lps = {"content": content([lp])} if lp is not None else None
            if job.parser is not None:  # the parser's deltas; a token's logprobs ride with the first
                pieces = chat_tools.deltas(job) or ([{}] if lps else [])
                for k, delta in enumerate(pieces):
                    yield {**head, "choices": [{"index": index, "delta": delta, "logprobs": None if k else lps,
                                                "finish_reason": None}]}
            elif text or lp is not None:
                yield {**head, "choices": [{"index": index, "delta": {"content": text}, "logprobs": lps,
                                            "finish_reason": None}]}
            if reason is not None:
                yield {**head, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                            "finish_reason": chat_tools.reason(job, self._reason(job)),
                                            **self._extension(job, body)}]}

        return chunks, final
