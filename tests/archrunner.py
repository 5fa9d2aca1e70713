"""One test runner for every architecture's tiny checkpoints (the tinygen specs of qwen2gen, spmgen,
gemma3gen, gemma2gen, smollm3gen, moegen, gptossgen), as mlx-lm's model_test_runner serves every
architecture: a test module names its spec and texts, takes its fixtures from `fixtures` (the files
made once per module, the models loaded from them, transformers' reference) and runs the checks below
on them: logits against transformers, the golden hashes pinned to transformers, conversion back to a
directory, and the determinism contract of contract.py (threads, chunks, batches, native storage,
trace, verify). What is particular to an architecture stays in its own module, with `backend_logits`
for runs with changed settings or weights, and `edited` and `refused` for the settings and files it
must refuse. A new architecture: a tinygen spec, and a test module of these."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import pytest

import tinydet
from contract import bits, check_greedy_matches
from reference import hf_generate, hf_logits
from tinygen import QUANTS, Tiny, load_hf_dir

GOLDEN = Path(__file__).parent / "golden"


class Files(NamedTuple):
    """An architecture's files: the Hugging Face directory and its GGUFs by quant (None: F32)."""

    hf: Path
    gguf: dict


def make_files(spec: Tiny, out: Path, quants=("q8_0", "q4_0")) -> Files:
    hf, f32 = spec.make(out)
    ggufs = {q: spec.write_gguf(out / f"tiny-{spec.stem}-{QUANTS[q][0]}.gguf", q) for q in quants}
    return Files(hf, {None: f32, **ggufs})


def reference(spec: Tiny, files: Files):
    """transformers' model of the spec: built from its config and weights, or for a spec whose
    directory is in the hub's own layout (mixtures of experts), read from that directory."""
    return spec.hf_model() if spec.save_pretrained else load_hf_dir(files.hf)


def fixtures(spec_of: Callable, archs: list | None = None, tied: bool = False, quants=("q8_0", "q4_0")):
    """The module-scoped fixtures of a test module: `arch` (each of `archs` in turn, or None),
    `files` (Files of spec_of(arch, tied)), `models` ({"hf", "gguf"}: the untied F32 model loaded from
    each form) and `ref` (transformers' model of the untied spec). With `tied`, `files` and `ref` are
    {False: ..., True: ...}, the tied variant's too (its GGUFs at every quant as well)."""

    @pytest.fixture(scope="module", params=archs)
    def arch(request):
        return getattr(request, "param", None)

    @pytest.fixture(scope="module")
    def files(tmp_path_factory, arch):
        out = tmp_path_factory.mktemp(arch or "tiny")
        made = {t: make_files(spec_of(arch, t), out, quants) for t in ((False, True) if tied else (False,))}
        return made if tied else made[False]

    @pytest.fixture(scope="module")
    def models(files):
        f = files[False] if tied else files
        return {"hf": tinydet.load(f.hf), "gguf": tinydet.load(f.gguf[None])}

    @pytest.fixture(scope="module")
    def ref(files, arch):
        if tied:
            return {t: reference(spec_of(arch, t), files[t]) for t in (False, True)}
        return reference(spec_of(arch, False), files)

    return arch, files, models, ref


# ---------------------------------------------------------------------------------------------------
# The checks

def float32_eps(config):
    """A config as its GGUF has it: GGUF stores the RMSNorm epsilon as a float32, config.json as a
    decimal (the kernels use float32)."""
    return dataclasses.replace(config, rms_eps=float(np.float32(config.rms_eps)))


def check_logits(from_dir, from_gguf, ref, texts, label: str, record_property, encode=None, each=None) -> None:
    """On each text (the directory's tokens; the GGUF's and `encode`'s too where given): the GGUF's
    logits are the directory's bits, within 1e-4 of transformers' (`ref`). `each(text, ids)` checks
    more of the tokens."""
    worst = 0.0
    for text in texts:
        ids = from_dir.tokenize(text)
        if encode is not None:
            assert from_gguf.tokenize(text) == ids == encode(text), text
        if each is not None:
            each(text, ids)
        ours = from_gguf.logits(ids)
        assert np.array_equal(bits(ours), bits(from_dir.logits(ids))), text
        worst = max(worst, float(np.abs(ours - hf_logits(ref, ids)).max()))
    record_property(f"{label}_max_abs_diff_vs_transformers", worst)
    print(f"tiny {label}: max |tinydet - transformers| = {worst:.2e} over {len(texts)} prompts")
    assert worst <= 1e-4, worst


def backend_logits(config, tensors, ids, hook=None) -> np.ndarray:
    """Every position's logits of one CPU-backend pass with `config` and `tensors` (a test's changed
    settings or weights), `hook` seeing each op's rows."""
    from tinydet.backends.cpu import CPUBackend

    be = CPUBackend(config, tensors)
    return be.forward_batch([(0, ids)], be.new_cache(len(ids)), all_logits=True, hook=hook)[0]


def check_greedy(models: dict, ref, picks) -> None:
    """contract.check_greedy_matches on each (form, text) of `picks`: "hf" or "gguf"'s model."""
    for name, text in picks:
        model = models[name]
        check_greedy_matches(model, ref, model.tokenize(text), label=(name, text))


def check_matches_reference(path, ref, texts) -> None:
    """The file runs transformers' model `ref` (holding the file's dequantized weights) within 1e-4."""
    model = tinydet.load(path)
    for text in texts:
        ids = model.tokenize(text)
        assert float(np.abs(model.logits(ids) - hf_logits(ref, ids)).max()) <= 1e-4, text


def check_golden_pinned(path, name: str, ref) -> None:
    """tests/golden/{name}.json (of the file at `path`, by `tinydet golden --write`). Its greedy fp32
    case is pinned to transformers: the same 32 tokens from `ref`, the model holding the file's
    dequantized weights. Then every case, and every fp32 case again with native storage, gives the
    recorded hashes."""
    from tinydet.hashing import file_sha256
    from tinydet.tools.golden import check_golden, model_loader, read_golden

    data = read_golden(GOLDEN / f"{name}.json")
    assert data["model_sha256"] == file_sha256(path), "the generator no longer writes the recorded file"
    model = tinydet.load(path, dtype="fp32")
    case = data["cases"][0]
    assert (case["dtype"], case["temperature"], case["max_tokens"]) == ("fp32", 0.0, 32)
    want = hf_generate(ref, model.tokenize(case["prompt"]), 32)
    g = model.generate(case["prompt"], max_tokens=32)
    assert g.token_ids == want and g.output_hash == case["output_hash"]
    assert check_golden(model_loader(path, fp32=model), data, file_sha256(path)) == []


def check_converted(src, out: Path, ref, cls: str, texts, attn: str | None = "eager") -> None:
    """`out`, the directory `convert` wrote of the GGUF `src`: transformers reads it as class `cls`
    (with `attn` attention) with `ref`'s logits bit for bit, and tinydet reads the GGUF's tokens and
    bits from it."""
    import torch
    import transformers

    kw = {"attn_implementation": attn} if attn else {}
    m = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **kw).eval()
    assert type(m).__name__ == cls
    back, orig = tinydet.load(out), tinydet.load(src)
    for text in texts:
        ids = orig.tokenize(text)
        assert back.tokenize(text) == ids, text
        assert np.array_equal(hf_logits(m, ids), hf_logits(ref, ids)), text  # the same weights, through transformers
        assert np.array_equal(bits(back.logits(ids)), bits(orig.logits(ids))), text


# ---------------------------------------------------------------------------------------------------
# Files and settings that are wrong on purpose

DROP = object()  # `edited`'s value for a key to delete


def edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of the HF directory `src` (its other files linked, not copied) with config.json's keys
    changed; a value of DROP deletes the key."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    for k, v in changes.items():
        if v is DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def refused(path, field: str, *words: str, strict: bool = False) -> str:
    """tinydet.load(path) raises one line naming `path` and `field`, with `words` in it (`strict`: it
    starts "FILE: FIELD: ", FILE config.json in a directory); returns the message."""
    with pytest.raises(tinydet.ModelFormatError) as e:
        tinydet.load(path)
    msg, file = str(e.value), Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    assert "\n" not in msg and str(path) in msg and e.value.field == field, msg
    assert not strict or msg.startswith(f"{file}: {field}: "), msg
    for w in words:
        assert w in msg, (w, msg)
    return msg
