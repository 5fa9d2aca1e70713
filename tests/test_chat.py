"""Chat: the model's template rendered in a sandbox, equal to HF transformers' rendering."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tinydet.chat import ChatTemplateError, render_chat
from tinydet.cli import main
from tinydet.errors import TinydetError

from reference import load_hf_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about <tags> & ünïcode 🎉"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_template_matches_transformers(smollm_path, smollm_models, messages):
    pytest.importorskip("transformers")
    hf = load_hf_tokenizer(smollm_path)
    model = smollm_models("fp32")
    expected_text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tok = model.tokenizer
    ours = render_chat(tok.chat_template, messages, bos_token=tok.hf.id_to_token(tok.bos_id),
                       eos_token=tok.hf.id_to_token(tok.eos_ids[0]))
    assert ours == expected_text
    # Token ids agree where the text has no numerals (transformers' GGUF tokenizer lacks smollm's digit split).
    assert model.chat_prompt(messages) == hf(expected_text, add_special_tokens=False)["input_ids"]


def test_chat_answers_and_is_deterministic(smollm_models):
    model = smollm_models("fp32")
    g = model.chat(CONVERSATIONS[0], max_tokens=40)
    assert "Paris" in g.text and g.finish_reason == "stop"
    assert g.token_ids[-1] in model.tokenizer.eos_ids and "<|im_end|>" not in g.text
    assert model.chat(CONVERSATIONS[0], max_tokens=40).logits_hash == g.logits_hash


def test_cli_chat_keeps_history(smollm_path, smollm_models):
    model = smollm_models("fp32")
    r = CliRunner().invoke(main, ["chat", "--model", str(smollm_path), "--max-tokens", "24", "--temperature", "0"],
                           input="What is the capital of France?\nAnd of Italy?\n\n")
    assert r.exit_code == 0, r.output
    first = model.chat(CONVERSATIONS[0], max_tokens=24).text
    second = model.chat(CONVERSATIONS[0] + [{"role": "assistant", "content": first},
                                            {"role": "user", "content": "And of Italy?"}], max_tokens=24).text
    assert first in r.output and second in r.output
    assert r.output.index(first) < r.output.index(second)


def test_generate_chat_flag(smollm_path, smollm_models):
    r = CliRunner().invoke(main, ["generate", "What is the capital of France?", "--chat", "--model", str(smollm_path),
                                  "--max-tokens", "24", "--temperature", "0"])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == smollm_models("fp32").chat(CONVERSATIONS[0], max_tokens=24).text.strip()


def test_sandbox_blocks_python_internals():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        render_chat(evil, CONVERSATIONS[0])
    with pytest.raises(ChatTemplateError, match="only user"):
        render_chat("{{ raise_exception('only user') }}", CONVERSATIONS[0])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for %}", CONVERSATIONS[0])


def test_missing_template_and_bad_messages(stories_models):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        stories_models["fp32"].chat(CONVERSATIONS[0])
    with pytest.raises(TinydetError, match="role"):
        render_chat("{{ messages }}", [{"role": "wizard", "content": "x"}])
    with pytest.raises(TinydetError, match="at least one"):
        render_chat("{{ messages }}", [])
