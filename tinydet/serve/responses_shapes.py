"""The Responses API's answer shapes: a response object, whole and as its stream of typed events
(`response.created` ... `response.completed`, each with its `sequence_number`).

A choice's output items (reasoning, message, function_call) are built from its parser's deltas in
order by one builder, for the stream and the whole answer alike: a stream's items equal the answer's.
Item ids, like call ids, derive from the chat key (prompt, seed, index): the same request gives the
same ids.
"""

from __future__ import annotations

import itertools

from ..api import chat_key
from ..chat.tools import call_ids
from .service import Service
from .streaming import _Job


def _item_id(key: str, kind: str, n: int) -> str:
    return kind + call_ids(f"{key}\0{kind}\0{n}", 1)[0][4:]  # "call_<hex>" -> "<kind>_<hex>"


class _Items:
    """One choice's output items, grown by deltas; each step returns the stream events it makes."""

    def __init__(self, key: str):
        self.key, self.items, self.open = key, [], None

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def add(self, kind: str, text: str = "", call=None) -> list[dict]:
        if kind == "call":
            ev = self.close("completed")
            item = {"type": "function_call", "id": _item_id(self.key, "fc", len(self.items)), "call_id": call.id,
                    "name": call.name, "arguments": call.arguments, "status": "completed"}
            self.items.append(item)
            at = self._where(item)
            return ev + [
                {"type": "response.output_item.added", "output_index": at["output_index"],
                 "item": {**item, "arguments": "", "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", **at, "delta": call.arguments},
                {"type": "response.function_call_arguments.done", **at, "name": call.name,
                 "arguments": call.arguments},
                {"type": "response.output_item.done", "output_index": at["output_index"], "item": item}]
        want = "reasoning" if kind == "reasoning" else "message"
        ev = []
        if self.open is None or self.open["type"] != want:
            ev = self.close("completed")
            if want == "reasoning":
                item = {"type": "reasoning", "id": _item_id(self.key, "rs", len(self.items)), "summary": [],
                        "content": []}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": _item_id(self.key, "msg", len(self.items)), "role": "assistant",
                        "status": "in_progress", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items.append(item)
            self.open = item
            at = self._where(item)
            ev += [{"type": "response.output_item.added", "output_index": at["output_index"],
                    "item": {**item, "content": []}},
                   {"type": "response.content_part.added", **at, "content_index": 0, "part": dict(part)}]
            item["content"].append(part)
        if text:
            item = self.open
            item["content"][0]["text"] += text
            at = self._where(item)
            if want == "reasoning":
                ev.append({"type": "response.reasoning_text.delta", **at, "content_index": 0, "delta": text})
            else:
                ev.append({"type": "response.output_text.delta", **at, "content_index": 0, "delta": text,
                           "logprobs": []})
        return ev

    def close(self, status: str) -> list[dict]:
        """End the open text item (its status `status` for a message)."""
        item, self.open = self.open, None
        if item is None:
            return []
        at = self._where(item)
        part = item["content"][0]
        if item["type"] == "message":
            item["status"] = status
            done = {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
                    "logprobs": []}
        else:
            done = {"type": "response.reasoning_text.done", **at, "content_index": 0, "text": part["text"]}
        return [done, {"type": "response.content_part.done", **at, "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": at["output_index"], "item": item}]


def _deltas(job: _Job, texts: list[str]) -> list[tuple]:
    """(kind, text, call) of the choice's deltas: its parser's, else its text as content."""
    if job.parser is None:
        text = "".join(texts)
        return [("content", text, None)] if text else []
    return [(d.kind, d.text, d.call) for d in (job.history if texts is None else job.deltas)]


def renderers(service: Service, body, rid: str, created: int):
    """The renderers (chunks, final) of a response answered as `rid`: `body` is the Responses request."""
    seq = itertools.count()
    building: dict[int, _Items] = {}

    def key(job: _Job, seed: int) -> str:
        return job.parser.key if job.parser is not None else chat_key(job.request.prompt_ids, seed, job.index)

    def status(job: _Job) -> str:
        return "incomplete" if job.result.finish_reason == "length" else "completed"

    def response(job: _Job, seed: int, state: str, output: list) -> dict:
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        done = state != "in_progress"
        out = {"id": rid, "object": "response", "created_at": created, "status": state, "background": False,
               "error": None, "incomplete_details": {"reason": "max_output_tokens"} if state == "incomplete" else None,
               "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
               "metadata": body.metadata or {}, "model": service.name, "output": output,
               "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
               "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
               "store": False,  # nothing is kept, whatever the request said
               "temperature": 1.0 if body.temperature is None else body.temperature,
               "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
               "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
               "tools": body.tools or [], "top_p": 1.0 if body.top_p is None else body.top_p,
               "truncation": "disabled", "user": body.user, "usage": None,
               "system_fingerprint": service.fingerprint, "seed": seed}
        if done:
            g = job.result
            n_in, n_out = len(job.request.prompt_ids), len(job.tokens)
            out["usage"] = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": g.cached_tokens},
                            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": job.reasoning_tokens},
                            "total_tokens": n_in + n_out}
            out.update(output_hash=g.output_hash, logits_hash=g.logits_hash)
        return out

    def final(jobs, seed, usage_only=False):
        job = jobs[0]
        items = _Items(key(job, seed))
        for kind, text, call in _deltas(job, job.text if job.parser is None else None):
            items.add(kind, text, call)
        items.close(status(job))
        return response(job, seed, status(job), items.items)

    def chunks(job, data, started, seed, include_usage):
        text, tok, _, reason, _ = data
        out = []
        if job.index not in started:
            started.add(job.index)
            building[job.index] = _Items(key(job, seed))
            head = response(job, seed, "in_progress", [])
            out += [{"type": "response.created", "response": head}, {"type": "response.in_progress", "response": head}]
        items = building[job.index]
        for kind, piece, call in _deltas(job, [text] if tok is not None else []):
            out += items.add(kind, piece, call)
        if reason is not None:
            state = status(job)
            out += items.close(state)
            out.append({"type": f"response.{state}", "response": response(job, seed, state, items.items)})
        for ev in out:
            yield {**ev, "sequence_number": next(seq)}

    return chunks, final
