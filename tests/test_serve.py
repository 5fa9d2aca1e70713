"""`tinydet serve` on a real socket (127.0.0.1, an ephemeral port), called with the official `openai`
client and plain HTTP: every answer equals `Model.generate` of the same request alone, under any load."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import numpy as np
import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed: pip install 'tinydet[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is not installed (the test extra has it)")
import uvicorn  # noqa: E402

from foreground import tinydet_argv  # noqa: E402
from tinydet.serve.app import create_app  # noqa: E402
from tinydet.serve.service import Service  # noqa: E402

NAME = "m"


@contextmanager
def serving(model, name=NAME, loader=None, **kw):
    """A real server in this process (so tests can reach its model); yields (base URL, service)."""
    service = Service(loader or (lambda: model), name, **kw)
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="on"))
    thread, url = start(server)
    try:
        if loader is None:
            wait_ready(url)
        yield url, service
    finally:
        server.should_exit = True
        thread.join(60)


def start(server: uvicorn.Server) -> tuple[threading.Thread, str]:
    """Run `server` on a thread of this process: (the thread, its base URL) once it listens."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (server.started and server.servers):
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def wait_ready(url, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/health")
        if r.status_code == 200 or r.json().get("status") == "failed":
            return r
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)


def client(url, **kw):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def metric(url, name) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def solo(model, prompt, max_tokens, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0, stop=None):
    return model.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          min_p=min_p, seed=seed, stop=stop)


def assert_choice(c, g, text=None):
    """An API choice equals a Generation: text, ids, both hashes, finish reason."""
    assert (c.text if text is None else text) == g.text
    assert c.token_ids == g.token_ids
    assert (c.output_hash, c.logits_hash) == (g.output_hash, g.logits_hash)
    assert c.finish_reason == g.finish_reason


def ref_logprobs(row: np.ndarray) -> np.ndarray:
    """A float64 log-softmax by NumPy, for the accuracy check (not the bits)."""
    x = row.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


@pytest.fixture(scope="module")
def stories(stories_models):
    return stories_models["fp32"]


@pytest.fixture(scope="module")
def stories_server(stories):
    with serving(stories, max_batch=4, prefill_chunk=16) as s:
        yield s


@pytest.fixture(scope="module")
def smollm(smollm_models):
    return smollm_models("fp32")


# -- completions and chat equal generate ----------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=7),
                                      dict(temperature=1.2, top_k=40, min_p=0.05, seed=11)])
def test_completion_equals_generate(stories_server, stories, stream, settings):
    url, _ = stories_server
    c = client(url)
    extra = {k: settings[k] for k in ("top_k", "min_p") if k in settings}
    std = {k: v for k, v in settings.items() if k not in extra}
    want = solo(stories, "Once upon a time", 40, **settings)
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=40, extra_body={"return_token_ids": True, **extra},
              **std)
    if not stream:
        r = c.completions.create(**kw)
        assert r.system_fingerprint == stories.fingerprint and r.model == NAME
        assert_choice(r.choices[0], want)
        assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == 5
        return
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert len({ch.id for ch in chunks}) == 1 and len({ch.created for ch in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    body = [ch for ch in chunks if ch.choices]
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
    assert_choice(body[-1].choices[0], want, text="".join(ch.choices[0].text for ch in body))


def test_chat_equals_model_chat(smollm):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]
    with serving(smollm, max_batch=2) as (url, _):
        c = client(url)
        for settings in (dict(temperature=0.0), dict(temperature=0.7, seed=5)):
            want = smollm.chat(messages, max_tokens=24, **settings)
            r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=24,
                                          extra_body={"return_token_ids": True}, **settings)
            ch = r.choices[0]
            assert ch.message.role == "assistant" and ch.message.content == want.text
            assert ch.token_ids == want.token_ids and ch.prompt_token_ids == smollm.chat_prompt(messages)
            assert (ch.output_hash, ch.logits_hash, ch.finish_reason) == (want.output_hash, want.logits_hash,
                                                                          want.finish_reason)
            chunks = list(c.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=24,
                                                    stream=True, **settings))
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text
            last = chunks[-1].choices[0]
            assert last.finish_reason == want.finish_reason and last.output_hash == want.output_hash
        # A content list of text parts is the same message.
        parts = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
        r = c.chat.completions.create(model=NAME, messages=parts, max_tokens=8, temperature=0)
        assert r.choices[0].output_hash == smollm.chat([messages[1]], max_tokens=8).output_hash


def test_n_choices_have_their_own_seeds(stories_server, stories):
    """Choice i samples with seed + i: each equals the single request with that seed."""
    url, _ = stories_server
    r = client(url).completions.create(model=NAME, prompt=["One day", "The cat"], n=3, max_tokens=20,
                                       temperature=1.0, seed=100, extra_body={"return_token_ids": True})
    assert [ch.index for ch in r.choices] == list(range(6)) and r.seed == 100
    for ch in r.choices:
        prompt = ["One day", "The cat"][ch.index // 3]
        assert_choice(ch, solo(stories, prompt, 20, temperature=1.0, seed=100 + ch.index % 3))
    assert len({ch.output_hash for ch in r.choices[:3]}) == 3


def test_unseeded_sampling_returns_the_seed_it_used(stories_server, stories):
    url, _ = stories_server
    c = client(url)
    a = c.completions.create(model=NAME, prompt="Tom", max_tokens=20)  # temperature absent: OpenAI's 1.0
    b = c.completions.create(model=NAME, prompt="Tom", max_tokens=20, seed=a.seed)
    assert isinstance(a.seed, int) and a.choices[0].output_hash == b.choices[0].output_hash
    assert a.choices[0].output_hash == solo(stories, "Tom", 20, temperature=1.0, seed=a.seed).output_hash


def test_stop_strings_and_token_prompts(stories_server, stories):
    url, _ = stories_server
    c = client(url)
    want = solo(stories, "Once upon a time", 60, stop=["Lily", "park"])
    r = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=60, temperature=0, stop=["Lily", "park"],
                             extra_body={"return_token_ids": True})
    assert_choice(r.choices[0], want)
    assert want.finish_reason == "stop" and "Lily" not in r.choices[0].text
    ids = stories.tokenize("Once upon a time")
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0, echo=True)
    assert r.choices[0].text == "Once upon a time" + solo(stories, ids, 10).text


# -- log-probabilities ----------------------------------------------------------------------------

def test_logprobs_are_exact_log_softmax(stories_server, stories):
    """Completion and chat logprobs: within 1e-12 of a float64 log-softmax of the same float32 rows
    (NumPy's); top alternatives in logit order."""
    url, _ = stories_server
    r = client(url).completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=0,
                                       logprobs=5, extra_body={"return_token_ids": True})
    ch = r.choices[0]
    ids = stories.tokenize("Once upon a time") + ch.token_ids
    rows = stories.logits(ids)[len(ids) - 12 - 1:-1]
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for j, (tok, row) in enumerate(zip(ch.token_ids, rows)):
        ref = ref_logprobs(row)
        assert abs(lp.token_logprobs[j] - ref[tok]) < 1e-12
        top = np.argsort(-row, kind="stable")[:5]
        assert list(lp.top_logprobs[j].values()) == pytest.approx(ref[top], abs=1e-12)
        assert lp.tokens[j] == stories.tokenizer.token_bytes(tok).decode("utf-8", "replace")
    assert lp.text_offset[0] == len("Once upon a time")


def test_echo_gives_the_prompts_logprobs(stories_server, stories):
    """echo + logprobs (what lm-evaluation-harness's local-completions sends, max_tokens 1 or 0):
    the prompt's tokens with their log-probabilities, the first with none, chunked prefill or not."""
    url, _ = stories_server
    prompt = "Lily and Ben went to the park to play with a ball"
    ids = stories.tokenize(prompt)
    rows = stories.logits(ids)
    c = client(url)
    for max_tokens in (1, 0):
        r = c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True,
                                 logprobs=1)
        ch = r.choices[0]
        lp = ch.logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and lp.token_logprobs[0] is None
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - ref_logprobs(rows[i - 1])[ids[i]]) < 1e-12
        assert ch.text == prompt + (solo(stories, prompt, 1).text if max_tokens else "")
        assert r.usage.completion_tokens == max_tokens
    # The same answer through a chunked prefill (prefill_chunk 16 < the prompt) and unchunked.
    with serving(stories, max_batch=2) as (url2, _):
        r2 = client(url2).completions.create(model=NAME, prompt=prompt, max_tokens=0, temperature=0, echo=True,
                                             logprobs=1)
    assert r2.choices[0].logprobs.token_logprobs == lp.token_logprobs


# -- load -----------------------------------------------------------------------------------------

def _mixed_requests(n=32):
    rng = random.Random(1234)
    prompts = ["", "Once upon a time", "Lily and Ben", "The little dog ran to the park and saw a big red ball. It",
               "One day, a girl named Sue found a shiny stone", "Tom", "The sun was hot and the sky was blue. The"]
    out = []
    for i in range(n):
        r = dict(prompt=rng.choice(prompts), max_tokens=rng.randint(4, 48))
        if i % 3:
            r.update(temperature=rng.choice([0.5, 0.9, 1.3]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1 << 32))
        else:
            r.update(temperature=0.0)
        if i % 5 == 0:
            r["stop"] = ["."]
        out.append(r)
    return out


def _ask(url, r):
    body = dict(model=NAME, prompt=r["prompt"], max_tokens=r["max_tokens"], temperature=r["temperature"],
                return_token_ids=True, **{k: r[k] for k in ("top_p", "seed", "stop") if k in r})
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


@pytest.mark.parametrize("max_batch", [4, 8])
def test_load_answers_equal_each_request_alone(stories, max_batch):
    """32 mixed requests from 8 concurrent clients: each answer is that request's `generate` alone,
    none lost; again in another order."""
    reqs = _mixed_requests()
    want = [solo(stories, **r) for r in reqs]
    with serving(stories, max_batch=max_batch, prefill_chunk=32) as (url, _):
        for order in (list(range(len(reqs))), random.Random(max_batch).sample(range(len(reqs)), len(reqs))):
            with ThreadPoolExecutor(8) as pool:
                got = dict(zip(order, pool.map(lambda i: _ask(url, reqs[i]), order)))
            assert sorted(got) == list(range(len(reqs)))
            for i, g in enumerate(want):
                c = got[i]
                assert (c["text"], c["token_ids"], c["output_hash"], c["logits_hash"], c["finish_reason"]) == \
                       (g.text, g.token_ids, g.output_hash, g.logits_hash, g.finish_reason), reqs[i]
        assert metric(url, "tinydet_num_requests_running") == 0


def test_same_prompt_from_8_clients_one_completion_one_logprobs(smollm):
    """The measurement llama.cpp's server fails: one prompt, temperature 0, logprobs, 8 clients at
    once (and alone): 1 distinct completion and 1 distinct logprobs sequence."""
    body = dict(model=NAME, prompt="The three primary colours are", max_tokens=24, temperature=0, logprobs=1)
    with serving(smollm, max_batch=8) as (url, _):
        alone = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]
        with ThreadPoolExecutor(8) as pool:
            loaded = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=300)
                                   .json()["choices"][0], range(8)))
    texts = {c["text"] for c in loaded + [alone]}
    logprobs = {json.dumps(c["logprobs"]) for c in loaded + [alone]}
    assert len(texts) == 1 and len(logprobs) == 1


# -- prefix cache, disconnects ----------------------------------------------------------------------

def test_prefix_cache_same_bits_less_prefill(stories, stories_server):
    url, service = stories_server
    system = "Once upon a time there was a little girl named Lily. She loved to play outside in the park. " * 3
    c = client(url)
    before = metric(url, "tinydet_prompt_tokens_computed_total")
    a = c.completions.create(model=NAME, prompt=system + "One day", max_tokens=10, temperature=0)
    mid = metric(url, "tinydet_prompt_tokens_computed_total")
    b = c.completions.create(model=NAME, prompt=system + "Then", max_tokens=10, temperature=0,
                             extra_body={"return_token_ids": True})
    after = metric(url, "tinydet_prompt_tokens_computed_total")
    n_b = len(stories.tokenize(system + "Then"))
    assert mid - before == len(stories.tokenize(system + "One day"))
    assert after - mid <= n_b - 64 and b.usage.prompt_tokens_details.cached_tokens >= 64
    assert_choice(b.choices[0], solo(stories, system + "Then", 10))
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(url, "tinydet_prefix_cache_hits_total") >= 1


def test_echo_scores_of_a_shared_context_come_from_the_prefix_cache(stories):
    """Multiple choice as lm-eval sends it: one context, several continuations, each scored with echo.
    After the first, each request takes the context's blocks and their scores from the prefix cache
    (cached_tokens), and every response is the one a server with no prefix cache gives, whether the
    requests come one at a time or all at once."""
    context = "Once upon a time there was a little girl named Lily. She loved to play outside in the park. " * 3
    choices = [" She ran home.", " The dog barked at the cat.", " It rained.", " Tom laughed and laughed."]

    def ask(url, prompt):
        r = client(url).completions.create(model=NAME, prompt=prompt, max_tokens=0, temperature=0, echo=True,
                                           logprobs=2)
        return r.choices[0].logprobs.model_dump(), r.usage.prompt_tokens_details.cached_tokens

    with serving(stories, max_batch=4, prefix_cache_bytes=0) as (url, _):
        cold = [ask(url, context + c)[0] for c in choices]
    with serving(stories, max_batch=4, prefill_chunk=16) as (url, _):
        one_by_one = [ask(url, context + c) for c in choices]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda c: ask(url, context + c), choices))
    assert [lp for lp, _ in one_by_one] == cold and [lp for lp, _ in together] == cold
    assert one_by_one[0][1] == 0
    assert all(cached >= 63 for _, cached in one_by_one[1:] + together)


def test_disconnect_mid_stream_frees_the_slot(stories, stories_server):
    url, service = stories_server
    body = dict(model=NAME, prompt="Once upon a time", max_tokens=400, temperature=0, stream=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 10
    while service.engine.counts != (0, 0):
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.02)
    assert metric(url, 'tinydet_requests_total{endpoint="/v1/completions",outcome="disconnected"}') >= 1
    r = client(url).completions.create(model=NAME, prompt="Tom", max_tokens=8, temperature=0)
    assert r.choices[0].output_hash == solo(stories, "Tom", 8).output_hash


# -- bad input, overload, failures ----------------------------------------------------------------

BAD = [
    (b"{not json", 400, None),
    (b'["a"]', 400, None),
    (dict(prompt="x"), 400, "model"),
    (dict(model="other", prompt="x"), 404, "model"),
    (dict(model=NAME, prompt="x", max_tokens="5"), 400, "max_tokens"),
    (dict(model=NAME, prompt="x", max_tokens=0), 400, "max_tokens"),
    (dict(model=NAME, prompt="x", max_tokens=-1), 400, "max_tokens"),
    (dict(model=NAME, prompt="x", max_tokens=100000), 400, "max_tokens"),
    (dict(model=NAME, prompt=[1] * 5000), 400, "prompt"),
    (dict(model=NAME, prompt=[1, 2, 99999]), 400, "prompt"),
    (dict(model=NAME, prompt="x", n=0), 400, "n"),
    (dict(model=NAME, prompt="x", n=17), 400, "n"),
    (dict(model=NAME, prompt="x", logprobs=21), 400, "logprobs"),
    (dict(model=NAME, prompt="x", temperature=-1), 400, "temperature"),
    (dict(model=NAME, prompt="x", top_p=0), 400, "top_p"),
    (dict(model=NAME, prompt="x", stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (dict(model=NAME, prompt="x", seed=-1), 400, "seed"),
    (dict(model=NAME, prompt="x", frequency_penalty=0.5), 400, "frequency_penalty"),
    (dict(model=NAME, prompt="x", logit_bias={"1": 5}), 400, "logit_bias"),
    (dict(model=NAME, prompt="x", bogus=1), 400, "bogus"),
    (dict(model=NAME, prompt="x", system_fingerprint="tinydet-other"), 409, "system_fingerprint"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_completion_requests(stories_server, body, status, param):
    url, _ = stories_server
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}/v1/completions", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    if param:
        assert param in err["message"]
    if status == 409:
        assert "tinydet-other" in err["message"] and _fingerprint(url) in err["message"]


def _fingerprint(url):
    return httpx.get(f"{url}/health").json()["system_fingerprint"]


@pytest.mark.parametrize("body,status,param", [
    (dict(model=NAME, messages=[]), 400, "messages"),
    (dict(model=NAME, messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    (dict(model=NAME, messages=[{"role": "user", "content": "x"}], top_logprobs=3), 400, "top_logprobs"),
    (dict(model=NAME, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21), 400,
     "top_logprobs"),
    (dict(model=NAME, messages=[{"role": "user", "content": "x"}], tools=[]), 400, "tools"),
    (dict(model=NAME, messages=[{"role": "user", "content": "x"}], max_completion_tokens=0), 400,
     "max_completion_tokens"),
])
def test_bad_chat_requests(stories_server, body, status, param):
    url, _ = stories_server
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_chat_without_a_template_is_a_400(stories_server):
    url, _ = stories_server
    r = httpx.post(f"{url}/v1/chat/completions", json=dict(model=NAME, messages=[{"role": "user", "content": "x"}]))
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_unknown_endpoint_and_method(stories_server):
    url, _ = stories_server
    assert httpx.get(f"{url}/v1/nothing").status_code == 404
    r = httpx.get(f"{url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_models_and_oversized_bodies(stories_server):
    url, _ = stories_server
    c = client(url)
    assert [m.id for m in c.models.list()] == [NAME] and c.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other")
    r = httpx.post(f"{url}/v1/completions", content=b'{"model": "m", "prompt": "' + b"a" * (17 << 20) + b'"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_tokenizer_routes(stories_server, stories):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-evaluation-harness's remote tokenizer):
    the model's own tokenizer, and bad input as a 4xx naming the field."""
    url, _ = stories_server
    text = "Once upon a time</s>"
    for special in (False, True):
        r = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": special}).json()
        assert r["tokens"] == stories.tokenize(text, add_special=special) and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == stories.config.context_length
    assert r["tokens"][-1] == stories.tokenizer.eos_ids[0]  # a special token written in the text
    ids = stories.tokenize("Lily and Ben", add_special=False)
    assert httpx.post(f"{url}/detokenize", json={"model": NAME, "tokens": ids}).json() == {"prompt": "Lily and Ben"}
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"]) == ("<s>", "</s>")
    for path, body, status, param in [("/tokenize", {"prompt": 7}, 400, "prompt"),
                                      ("/tokenize", {}, 400, "prompt"),
                                      ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
                                      ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
                                      ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
                                      ("/detokenize", {"tokens": "1 2"}, 400, "tokens")]:
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text)


def test_api_key(stories):
    with serving(stories, api_key="s3cret") as (url, _):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(f"{url}/v1/completions", json=dict(model=NAME, prompt="x"), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="wrong").models.list()
        assert [m.id for m in client(url, api_key="s3cret").models.list()] == [NAME]
        assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200  # health and metrics stay open


def test_full_queue_answers_429(stories):
    """One slot, no queue: while a request holds the slot (its pass held up), the next one gets 429
    with Retry-After; once it is done, requests are served again."""
    gate = threading.Event()

    def hold(layer, op, pos, slots, rows):
        if op == "logits":
            gate.wait(30)

    with serving(stories, max_batch=1, max_queue=0) as (url, service):
        stories.backend.hooks.append(hold)
        try:
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(httpx.post, f"{url}/v1/completions",
                                    json=dict(model=NAME, prompt="Once", max_tokens=4, temperature=0), timeout=60)
                wait = time.monotonic() + 10
                while service.engine.counts != (1, 0):
                    assert time.monotonic() < wait
                    time.sleep(0.01)
                r = httpx.post(f"{url}/v1/completions", json=dict(model=NAME, prompt="x", max_tokens=2))
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
                gate.set()
                assert first.result().status_code == 200
        finally:
            stories.backend.hooks.remove(hold)
        assert httpx.post(f"{url}/v1/completions", json=dict(model=NAME, prompt="x", max_tokens=2)).status_code == 200
        assert metric(url, 'tinydet_requests_total{endpoint="/v1/completions",outcome="overloaded"}') == 1


def test_engine_failure_is_a_500_and_the_server_goes_on(stories):
    with serving(stories, max_batch=2) as (url, _):
        armed = threading.Event()

        def broken(layer, op, pos, slots, rows):
            if op == "logits" and armed.is_set():
                armed.clear()
                raise RuntimeError("injected fault")

        stories.backend.hooks.append(broken)
        try:
            armed.set()
            r = httpx.post(f"{url}/v1/completions", json=dict(model=NAME, prompt="Tom", max_tokens=5))
            assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
            r = httpx.post(f"{url}/v1/completions", json=dict(model=NAME, prompt="Tom", max_tokens=5, temperature=0))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == solo(stories, "Tom", 5).text
        finally:
            stories.backend.hooks.remove(broken)
        assert metric(url, 'tinydet_requests_total{endpoint="/v1/completions",outcome="error"}') == 1


def test_engine_failure_mid_stream_ends_the_stream_with_an_error(stories):
    """After the 200 has gone out, a failure reaches the client as an error event, then [DONE]; the
    request counts as an error and the server goes on."""
    with serving(stories, max_batch=2) as (url, service):
        passes = []

        def broken(layer, op, pos, slots, rows):
            if op == "logits":
                passes.append(1)
                if len(passes) == 3:  # the pass after the prompt's and the second token's
                    raise RuntimeError("injected fault")

        stories.backend.hooks.append(broken)
        try:
            body = dict(model=NAME, prompt="Once upon a time", max_tokens=50, temperature=0, stream=True)
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200
                lines = [x for x in resp.iter_lines() if x]
        finally:
            stories.backend.hooks.remove(broken)
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])["error"]
        assert "injected fault" in err["message"] and err["type"] == "server_error"
        assert [json.loads(x[6:])["choices"][0]["text"] for x in lines[:-2]] == [",", " there"]
        assert metric(url, 'tinydet_requests_total{endpoint="/v1/completions",outcome="error"}') == 1
        assert service.engine.counts == (0, 0)
        r = httpx.post(f"{url}/v1/completions", json=dict(model=NAME, prompt="Tom", max_tokens=5, temperature=0))
        assert r.json()["choices"][0]["text"] == solo(stories, "Tom", 5).text


def test_health_is_503_while_loading(stories):
    release = threading.Event()

    def slow():
        release.wait(30)
        return stories

    with serving(stories, loader=slow) as (url, _):
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(f"{url}/v1/completions", json=dict(model=NAME, prompt="x"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        release.set()
        assert wait_ready(url).status_code == 200


def test_canary_mismatch_at_start_keeps_health_at_503(stories, tmp_path):
    """A golden file whose hashes this build does not reproduce: the server refuses traffic; with the
    right hashes it serves and counts the runs."""
    from tinydet.tools.golden import write_golden

    case = dict(prompt="Once upon a time", dtype="fp32", max_tokens=12, temperature=0.0)
    g = solo(stories, "Once upon a time", 12)
    for good in (False, True):
        path = tmp_path / f"golden-{good}.json"
        hashes = dict(output_hash=g.output_hash, logits_hash=g.logits_hash if good else "0" * 64)
        write_golden(path, "stories260k", stories.sha256, [{**case, **hashes}])
        with serving(stories, canary_file=path) as (url, service):
            assert metric(url, "tinydet_canary_runs_total") == 1
            assert metric(url, "tinydet_canary_mismatches_total") == (0 if good else 1)
            r = httpx.get(f"{url}/health")
            assert r.status_code == (200 if good else 503)
            r = httpx.post(f"{url}/v1/completions", json=dict(model=NAME, prompt="x", max_tokens=2))
            assert r.status_code == (200 if good else 503)
            if good:
                service.run_canary()
                assert metric(url, "tinydet_canary_runs_total") == 2


def test_metrics_names(stories_server):
    url, _ = stories_server
    client(url).completions.create(model=NAME, prompt="Tom", max_tokens=3)
    text = httpx.get(f"{url}/metrics").text
    for name in ("tinydet_requests_total", "tinydet_request_success_total", "tinydet_prompt_tokens_total",
                 "tinydet_generation_tokens_total", "tinydet_num_requests_running", "tinydet_num_requests_waiting",
                 "tinydet_kv_slots_used", "tinydet_kv_cache_usage_perc", "tinydet_request_queue_time_seconds_bucket",
                 "tinydet_time_to_first_token_seconds_bucket", "tinydet_inter_token_latency_seconds_bucket",
                 "tinydet_e2e_request_latency_seconds_bucket", "tinydet_canary_runs_total",
                 "tinydet_canary_mismatches_total", "tinydet_prefix_cache_hits_total"):
        assert f"\n{name}" in text, name
    assert metric(url, "tinydet_kv_slots_total") == 4


def test_requests_outlasting_the_shutdown_grace_end_with_a_503(stories, tmp_path):
    """Shutdown (what SIGTERM starts) while requests run that cannot finish in the grace: just before it
    runs out, a stream ends with an error event that says why, then [DONE], and a plain request gets a
    503 that says it, rather than a connection cut mid-answer; the server then stops."""
    from tinydet.serve import Server

    def slow(layer, op, pos, slots, rows):  # a pass every 50 ms at most: 400 tokens take 20 s
        if op == "logits":
            time.sleep(0.05)

    log = tmp_path / "serve.jsonl"
    service = Service(lambda: stories, NAME, log_path=log)
    app = create_app(service)
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                   timeout_graceful_shutdown=1.0), app.state.end_running)
    thread, url = start(server)
    try:
        wait_ready(url)
        stories.backend.hooks.append(slow)
        deadline = time.monotonic() + 60
        body = dict(model=NAME, prompt="Once upon a time", max_tokens=400, temperature=0)
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, f"{url}/v1/completions", json=dict(body, prompt="Tom"), timeout=60)
            with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True), timeout=60) as resp:
                lines = resp.iter_lines()
                assert next(lines).startswith("data: ")
                while service.engine.counts != (2, 0):
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                t0 = time.monotonic()
                server.should_exit = True  # Server.handle_exit on SIGTERM
                rest = [x for x in lines if x]
                elapsed = time.monotonic() - t0
            r = plain.result()
    finally:
        if slow in stories.backend.hooks:
            stories.backend.hooks.remove(slow)
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()
    assert rest[-1] == "data: [DONE]"
    *chunks, last = [json.loads(x[len("data: "):]) for x in rest[:-1]]
    assert all(c["choices"] for c in chunks) and "choices" not in last
    for error in (last["error"], r.json()["error"]):
        assert error["code"] == "server_shutdown" and error["type"] == "server_error"
        assert "shutting down" in error["message"] and "in the 1 s" in error["message"]
    assert r.status_code == 503
    assert 0.4 < elapsed < 20  # at half the 1 s grace, not when the stream would have ended
    http = [json.loads(x) for x in log.read_text().splitlines() if '"path": "/v1/completions"' in x]
    assert sorted(rec["status"] for rec in http) == [200, 503]
    assert all("shutting down" in rec["error"] for rec in http)


# -- the command ----------------------------------------------------------------------------------

def test_cli_serve_sigterm_finishes_running_requests_and_exits_0(stories_path, tmp_path):
    """`tinydet serve` as a user starts it: a port of its choosing, an API key, a log. SIGTERM while a
    stream runs: the stream still ends with [DONE], new connections are refused, exit status 0, and
    every request (refused ones too) is one line in the log."""
    import os
    import re
    import signal
    import subprocess

    log = tmp_path / "serve.jsonl"
    env = {**os.environ, "TINYDET_API_KEY": "k3y"}
    # One thread and a long grace: the test's workers share the cores, and with a thread per core and four
    # busy processes beside it this stream ran at 41 tok/s (1,238 of its tokens in the default 30 s grace).
    proc = subprocess.Popen(tinydet_argv("serve", "--model", str(stories_path), "--port", "0",
                             "--threads", "1", "--shutdown-timeout", "600", "--log", str(log),
                             "--canary-interval", "0"), stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any(re.search(r"on http://127\.0\.0\.1:(\d+)", x) for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        port = next(re.search(r"on http://127\.0\.0\.1:(\d+)", x) for x in lines if "on http://" in x).group(1)
        url = f"http://127.0.0.1:{port}"
        assert wait_ready(url).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=dict(model="stories260K.gguf", prompt="x")).status_code == 401
        c = client(url, api_key="k3y")
        assert [m.id for m in c.models.list()] == ["stories260K.gguf"]
        stream = c.completions.create(model="stories260K.gguf", prompt="Once upon a time", max_tokens=1500,
                                      temperature=0, stream=True)
        first = next(stream)
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "length"
        text = first.choices[0].text + "".join(ch.choices[0].text for ch in rest)
        assert proc.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
    want = tinydet_generate(stories_path, "Once upon a time", 1500)
    assert text == want
    records = [json.loads(x) for x in log.read_text().splitlines()]
    http = [r for r in records if "path" in r]
    assert [r["status"] for r in http if r["path"] == "/v1/completions"] == [401, 200]
    assert any(r["path"] == "/v1/models" and r["status"] == 200 for r in http)
    done = next(r for r in http if r["path"] == "/v1/completions" and r["status"] == 200)
    assert done["choices"][0]["completion_tokens"] == 1500 and done["stream"] is True
    ch = done["choices"][0]  # where its time went: waiting, to the first token, after it
    assert min(ch["queue_ms"], ch["prefill_ms"]) >= 0 and ch["decode_ms"] > 0
    assert ch["queue_ms"] + ch["prefill_ms"] + ch["decode_ms"] <= done["duration_ms"]
    assert any(r.get("event") == "canary" and r["result"] == "match" for r in records)


def tinydet_generate(path, prompt, n):
    import tinydet

    return tinydet.load(path).generate(prompt, max_tokens=n).text


def test_speculative_server_gives_plain_bytes_and_counts(stories, stories_path):
    import tinydet

    spec = tinydet.load(stories_path, dtype="fp32", speculative="ngram")
    prompt = ("Once upon a time, there was a little girl named Lily. She liked to play in the park. "
              "Once upon a time, there was a little girl named")
    settings = [dict(temperature=0.0), dict(temperature=0.8, seed=3), dict(temperature=1.0, seed=5, stop=[". "]),
                dict(temperature=0.0, stop=["park"])]
    wants = [solo(stories, prompt, 40, **s) for s in settings]
    with serving(spec, max_batch=4, prefill_chunk=16) as (url, _):
        c = client(url)

        def ask(s):
            return c.completions.create(model=NAME, prompt=prompt, max_tokens=40,
                                        extra_body={"return_token_ids": True}, **s)

        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(ask, settings * 2))
        for r, want in zip(got, wants * 2):
            assert_choice(r.choices[0], want)
            assert r.system_fingerprint == stories.fingerprint  # speculation is not in it: the same bytes
        assert metric(url, "tinydet_speculative_accepted_tokens_total") > 0
        assert metric(url, "tinydet_speculative_draft_tokens_total") >= metric(url, "tinydet_speculative_accepted_tokens_total")
