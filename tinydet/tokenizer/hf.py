"""A Hugging Face directory's tokenizer: tokenizer.json (the `tokenizers` library), with BOS/EOS, their
insertion and the chat template from tokenizer_config.json, generation_config.json and config.json,
read as transformers reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ModelFormatError
from ..jsonfile import is_int as _is_int
from ..jsonfile import one_line as _one_line
from ..jsonfile import read_json as _read_json
from .core import Tokenizer

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where recent transformers versions save the template


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken dict, or null."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return ""  # malformed: the caller reports it


def _is_unicode(text: str) -> bool:
    """False for a string JSON can hold but UTF-8 cannot (a lone surrogate escape, "\\ud800"), which
    tokenizers' Rust side cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _chat_template(v: Any, path: Path) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                   and isinstance(t.get("template"), str) for t in v):
        by_name = {t["name"]: t["template"] for t in v}
        return by_name.get("default", v[0]["template"] if v else None)
    raise ModelFormatError(path, "chat_template", "expected a string or a list of {name, template} objects")


def _id_list(v: Any, path: Path, field: str, n: int) -> list[int]:
    ids = v if isinstance(v, list) else [v]
    if not ids:
        raise ModelFormatError(path, field, "expected a token id or a list of them, found an empty list")
    for i in ids:
        if not _is_int(i):
            raise ModelFormatError(path, field, f"expected a token id or a list of them, found {v!r}")
        if not 0 <= i < n:
            raise ModelFormatError(path, field, f"token id {i} is outside the vocabulary (0..{n - 1})")
    return list(ids)


def _probe(hf, tpath: Path, add_special: bool) -> list[int]:
    """The ids of "a": a tokenizer.json whose post-processor names a token its vocabulary lacks makes
    `tokenizers` panic in Rust, raised as pyo3's PanicException, a BaseException (not an Exception)."""
    try:
        return hf.encode("a", add_special_tokens=add_special).ids
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001
        raise ModelFormatError(tpath, TOKENIZER_FILE, f"the tokenizer fails on a test input: {_one_line(e)}") from None


def read_hf_tokenizer(path: str | Path, raw_config: dict | None = None) -> Tokenizer:
    """Tokenizer from tokenizer.json, with BOS/EOS, their insertion and the chat template from
    tokenizer_config.json, generation_config.json (and config.json's ids as a fallback)."""
    import tokenizers

    path = Path(path)
    tpath = path / TOKENIZER_FILE
    if not tpath.is_file():
        extra = " (a SentencePiece tokenizer.model alone is not supported)" if (path / "tokenizer.model").exists() else ""
        raise ModelFormatError(tpath, TOKENIZER_FILE, f"missing: tinydet needs a fast tokenizer file{extra}")
    try:
        hf = tokenizers.Tokenizer.from_file(str(tpath))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions on bad files
        raise ModelFormatError(tpath, TOKENIZER_FILE, f"does not parse as a tokenizers file: {_one_line(e)}") from None
    n = hf.get_vocab_size(with_added_tokens=True)

    tcpath = path / TOKENIZER_CONFIG_FILE
    tc = _read_json(tcpath, TOKENIZER_CONFIG_FILE, required=False) or {}
    gcpath = path / GENERATION_CONFIG_FILE
    gc = _read_json(gcpath, GENERATION_CONFIG_FILE, required=False) or {}
    cc = raw_config or {}
    ccpath = path / CONFIG_FILE

    def token_id(key) -> int | None:
        text = _token_text(tc.get(key))
        if text is None:
            return None
        if text == "" or not _is_unicode(text):
            raise ModelFormatError(tcpath, key, "expected a token string (valid Unicode) or an AddedToken object, "
                                                f"found {tc[key]!r}")
        tid = hf.token_to_id(text)
        if tid is None:
            raise ModelFormatError(tcpath, key, f"token {text!r} is not in tokenizer.json's vocabulary")
        return tid

    bos_id = token_id("bos_token")
    if bos_id is None:
        for src, p in ((gc, gcpath), (cc, ccpath)):
            if src.get("bos_token_id") is not None:
                bos_id = _id_list(src["bos_token_id"], p, "bos_token_id", n)[0]
                break
    eos_ids: list[int] = []
    tc_eos = token_id("eos_token")
    if tc_eos is not None:
        eos_ids.append(tc_eos)
    for src, p in ((gc, gcpath), (cc, ccpath)):
        if src.get("eos_token_id") is not None:
            eos_ids += _id_list(src["eos_token_id"], p, "eos_token_id", n)
            break

    # Whether BOS/EOS are added: tokenizer_config.json's flags when it has them, else what
    # tokenizer.json's post-processor does (which is what transformers then does too).
    plain = _probe(hf, tpath, False)
    full = _probe(hf, tpath, True)
    pre, post = [], []
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            pre, post = full[:k], full[k + len(plain):]
            break
    flags = {}
    for key, inferred in (("add_bos_token", pre == [bos_id]),
                          ("add_eos_token", post == [eos_ids[0]] if eos_ids else False)):
        v = tc.get(key)
        if v is None:
            flags[key] = inferred
        elif not isinstance(v, bool):
            raise ModelFormatError(tcpath, key, f"expected true or false, found {v!r}")
        else:
            flags[key] = v
    if flags["add_bos_token"] and bos_id is None:
        raise ModelFormatError(tcpath, "add_bos_token", "is true but no BOS token is defined")
    if flags["add_eos_token"] and not eos_ids:
        raise ModelFormatError(tcpath, "add_eos_token", "is true but no EOS token is defined")

    tok = Tokenizer.from_hf(hf, bos_id=bos_id, eos_ids=eos_ids,
                            add_bos=flags["add_bos_token"], add_eos=flags["add_eos_token"])
    jinja = path / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        tok.chat_template = jinja.read_text(encoding="utf-8")
    else:
        tok.chat_template = _chat_template(tc.get("chat_template"), tcpath)
    for attr, key in (("unk_id", "unk_token"), ("pad_id", "pad_token")):
        text = _token_text(tc.get(key))
        if text and _is_unicode(text):  # optional: a malformed one is ignored, as a malformed dict is
            setattr(tok, attr, hf.token_to_id(text))
    return tok
