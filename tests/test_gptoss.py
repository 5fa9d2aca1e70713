"""gpt-oss on a tiny checkpoint made here (tests/gptossgen.py): against transformers fp32, logits within
1e-4 and the same 32 greedy tokens, with the attention sinks, the clamped SwiGLU (shown to bind) and
the biases in play; the hub's MXFP4 checkpoint form read as MXFP4 blocks with the values transformers
decodes, kept as blocks natively with fp32's bits; the GGUF as llama.cpp's converter writes it gives
the Hugging Face directory's bits; threads, chunks and batches keep them; a harmony-style chat
template renders as transformers renders it; bad settings refused with the file and field named."""

from __future__ import annotations

import dataclasses
import json
from datetime import date

import numpy as np
import pytest

import gptossgen as G
import tinydet
from archrunner import DROP, check_logits, edited, fixtures
from contract import bits, check_greedy_matches, check_native_gives_fp32_bits, check_threads_chunking_and_batch
from reference import hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

# Longer than the sliding window (8), so the sliding layers drop positions.
TEXTS = ["The quick brown fox jumps over the lazy dog, and the dog does not mind: it is a lazy dog.",
         "In 1969, three astronauts flew to the Moon and back; tabs\tand  double  spaces.",
         "Once upon a time there was a little robot who wanted to learn how to paint.\n\nEvery morning it"]


# files: (hf_dir, {None: F32 gguf}); models: {"hf", "gguf"}; ref: transformers' model of the directory
arch, files, models, ref = fixtures(lambda arch, tied: G.spec(), quants=())


@pytest.fixture(scope="module")
def model(models):
    return models["hf"]


def test_logits_match_transformers_and_gguf_gives_the_same_bits(models, model, ref, record_property):
    cfg = model.config
    assert (cfg.arch, cfg.n_experts, cfg.n_experts_used, cfg.moe_gating) == ("gptoss", 8, 2, "softmax_topk")
    assert cfg.layer_windows == (8, 0, 8, 0) and cfg.rope.scaling == "yarn" and not cfg.rope.truncate
    gguf = models["gguf"]
    assert dataclasses.replace(gguf.config, rms_eps=cfg.rms_eps) == cfg  # GGUF keeps eps as a float32
    assert all(len(model.tokenize(text)) > 2 * G.WINDOW for text in TEXTS)
    check_logits(model, gguf, ref, TEXTS, "gptoss", record_property)


def test_sinks_and_the_clamp_are_in_play(ref, model):
    """The test model exercises what gpt-oss adds: transformers' logits move by more than 1e-3 with
    its sinks at -inf (no sink) or its clamp lifted, so the match above holds them."""
    ids = model.tokenize(TEXTS[0])
    base = hf_logits(ref, ids)
    layers = ref.model.layers
    saved = [(layer.self_attn.sinks.data.clone(), layer.mlp.experts.limit) for layer in layers]
    try:
        for layer in layers:
            layer.self_attn.sinks.data.fill_(-float("inf"))
        assert np.abs(hf_logits(ref, ids) - base).max() > 1e-3
        for layer, (sinks, _) in zip(layers, saved):
            layer.self_attn.sinks.data.copy_(sinks)
            layer.mlp.experts.limit = 1e9
        assert np.abs(hf_logits(ref, ids) - base).max() > 1e-3
    finally:
        for layer, (sinks, limit) in zip(layers, saved):
            layer.self_attn.sinks.data.copy_(sinks)
            layer.mlp.experts.limit = limit
    assert np.array_equal(hf_logits(ref, ids), base)


def test_greedy_tokens_match_transformers(model, ref):
    check_greedy_matches(model, ref, model.tokenize(TEXTS[2]))


def test_threads_chunking_and_batch(model):
    check_threads_chunking_and_batch(model, model.tokenize(TEXTS[0]), TEXTS)


def test_hub_mxfp4_checkpoint(tmp_path):
    """The hub's form (experts as MXFP4 `_blocks` and `_scales`): read as MXFP4 blocks whose values are
    the ones transformers decodes, so fp32 matches transformers on those values; native storage keeps
    the blocks and gives fp32's bits."""
    hub = G.mxfp4_state_dict()
    mx = G.write_hf_dir(tmp_path / "hub", sd=hub, mxfp4=True)
    flat = G.write_hf_dir(tmp_path / "values", sd=G.hf_values(hub))
    ref, ours = G.hf_model(flat), tinydet.load(mx)
    ids = ours.tokenize(TEXTS[1])
    assert np.abs(ours.logits(ids) - hf_logits(ref, ids)).max() <= 1e-4
    native = tinydet.load(mx, dtype="native")
    assert native.backend.storage()["w13e"] == "MXFP4" and native.backend.storage()["w2e"] == "MXFP4"
    assert np.array_equal(bits(native.logits(ids)), bits(ours.logits(ids)))


def test_mxfp4_gguf_experts_give_fp32_bits(tmp_path):
    """llama.cpp's gpt-oss files: MXFP4 experts, the rest F32; native keeps the blocks, fp32's bits."""
    path = G.write_gguf(tmp_path / "tiny-gptoss-MXFP4.gguf", expert_quant="mxfp4")
    check_native_gives_fp32_bits(path, "mxfp4", TEXTS[:1], kinds=("w13e", "w2e"))


def test_convert_to_hf_and_back(files, model, tmp_path):
    from tinydet.tools.convert import convert_gguf_to_hf

    out = convert_gguf_to_hf(files.gguf[None], tmp_path / "hf")
    ids = model.tokenize(TEXTS[0])
    assert np.array_equal(bits(tinydet.load(out).logits(ids)), bits(model.logits(ids)))
    assert np.abs(hf_logits(G.hf_model(out), ids) - model.logits(ids)).max() <= 1e-4


# A chat template in the harmony format, with what gpt-oss's own template asks of a renderer: today's
# date (strftime_now), namespace() across a loop, a developer message taken from the first, slices,
# tojson, raise_exception and kwargs' defaults.
HARMONY = """{%- set effort = reasoning_effort if reasoning_effort is defined else "medium" -%}
{{- "<|start|>system<|message|>Knowledge cutoff: 2024-06\\nCurrent date: " + strftime_now("%Y-%m-%d") }}
{{- "\\n\\nReasoning: " + effort + "\\n\\n# Valid channels: analysis, commentary, final.<|end|>" }}
{%- if messages[0].role in ("developer", "system") -%}
{%- set dev = messages[0].content -%}{%- set rest = messages[1:] -%}
{%- else -%}{%- set dev = "" -%}{%- set rest = messages -%}{%- endif -%}
{%- if dev -%}{{- "<|start|>developer<|message|># Instructions\\n\\n" + dev + "\\n\\n<|end|>" }}{%- endif -%}
{%- set seen = namespace(users=0) -%}
{%- for m in rest -%}
{%- if m.role == "assistant" -%}
{%- if "<|channel|>" in m.content -%}{{- raise_exception("channel tags in content") }}{%- endif -%}
{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" }}
{%- elif m.role == "tool" -%}
{{- "<|start|>functions.tool to=assistant<|channel|>commentary<|message|>" + m.content|tojson + "<|end|>" }}
{%- else -%}{%- set seen.users = seen.users + 1 -%}
{{- "<|start|>user<|message|>" + m.content + "<|end|>" }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start|>assistant" }}{%- endif -%}"""


def test_harmony_template_renders_as_transformers_does(files, tmp_path):
    import shutil

    from tinydet.chat import render_chat

    d = tmp_path / "chat"
    shutil.copytree(files.hf, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "chat_template.jinja").write_text(HARMONY)  # where the hub's gpt-oss keeps its template
    messages = [{"role": "developer", "content": "Answer in one word."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Colour of the sky?"}]
    template = tinydet.load(d).tokenizer.chat_template
    assert template == HARMONY
    ours = render_chat(template, messages)
    want = transformers.AutoTokenizer.from_pretrained(str(d)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    # tinydet renders a fixed date (a clock would break determinism); transformers renders today's
    assert ours == want.replace(date.today().isoformat(), "2024-01-01")
    assert "Current date: 2024-01-01" in ours and ours.endswith("<|start|>assistant")
    with pytest.raises(tinydet.TinydetError, match="channel tags in content"):
        render_chat(template, [{"role": "assistant", "content": "<|channel|>final"}])


def test_config_defaults_are_gpt_oss_configs(files, tmp_path):
    """Without rope_scaling, GptOssConfig's YaRN (factor 32, original 4096, not truncated) on the
    config's rope_theta, or on 150000 without one; logits then match transformers' on that config."""
    from tinydet.formats import open_checkpoint

    d = edited(files.hf, tmp_path / "defaults", rope_scaling=DROP, rope_theta=50000.0)
    rope = open_checkpoint(d).config.rope
    assert (rope.base, rope.scaling, rope.factor, rope.original_context, rope.truncate) == (
        50000.0, "yarn", 32.0, 4096, False)
    d = edited(files.hf, tmp_path / "no-theta", rope_scaling=DROP)
    rope = open_checkpoint(d).config.rope
    assert (rope.base, rope.scaling) == (150000.0, "yarn")
    ids = tinydet.load(d).tokenize(TEXTS[1])
    assert np.abs(tinydet.load(d).logits(ids) - hf_logits(G.hf_model(d), ids)).max() <= 1e-4


@pytest.mark.parametrize("key,value,field", [
    ("swiglu_limit", 8.0, "swiglu_limit"),
    ("swiglu_alpha", 1.5, "swiglu_alpha"),
    ("attention_bias", False, "attention_bias"),
    ("layer_types", ["sliding_attention"], "layer_types"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
])
def test_bad_config_is_refused_by_name(files, tmp_path, key, value, field):
    with pytest.raises(tinydet.ModelFormatError, match=field):
        tinydet.load(edited(files.hf, tmp_path / "bad", **{key: value}))
