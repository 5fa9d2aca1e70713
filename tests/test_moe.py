"""Mixtures of experts (Qwen3-MoE, Mixtral) on tiny checkpoints made here (tests/moegen.py): against
transformers fp32, logits within 1e-4 and the same 32 greedy tokens; the HF directory and the GGUF (a
`llama` file for Mixtral, 3-D expert tensors) give the same bits; threads, chunks and batches keep them,
with batch mates that share experts and ones that do not; native storage gives fp32's bits; routing
ties go to the lower expert id, checked against a float64 reference of the block; golden hashes of the
Q8_0 Qwen3-MoE pinned to transformers; conversion back to a Hugging Face directory; bad settings
refused with the file and field named."""

from __future__ import annotations

import json

import numpy as np
import pytest

import moegen as M
import tinydet
from archrunner import check_golden_pinned, check_logits, edited, fixtures, make_files
from contract import bits, check_greedy_matches, check_native_gives_fp32_bits, check_threads_chunking_and_batch
from reference import hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TEXTS = ["The quick brown fox jumps over the lazy dog, and the dog does not mind: it is a lazy dog.",
         "In 1969, three astronauts flew to the Moon and back; tabs\tand  double  spaces.",
         "Once upon a time there was a little robot who wanted to learn how to paint.\n\nEvery morning it",
         "def greet(name):\n\treturn 'Hello, ' + name"]


# files: (hf_dir, {None, "q8_0": gguf}); models: {"hf", "gguf"}; ref: transformers' model of the directory
arch, files, models, ref = fixtures(lambda arch, tied: M.spec(arch), sorted(M.ARCHS), quants=("q8_0",))


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory):
    """Qwen3-MoE's files, for the checks made on one architecture."""
    return make_files(M.spec("qwen3moe"), tmp_path_factory.mktemp("qwen3moe-one"), ("q8_0",))


@pytest.fixture(scope="module")
def model(models):
    return models["hf"]


def test_logits_match_transformers_and_gguf_gives_the_same_bits(models, model, ref, arch, record_property):
    assert model.config.n_experts == M.EXPERTS and model.config.n_experts_used == M.USED
    check_logits(model, models["gguf"], ref, TEXTS, arch, record_property)


def test_greedy_tokens_match_transformers(model, ref):
    check_greedy_matches(model, ref, model.tokenize(TEXTS[2]))


def test_threads_chunking_and_batch(model):
    check_threads_chunking_and_batch(model, model.tokenize(TEXTS[0]), TEXTS)


def _routes(model, ids_list) -> list[set[int]]:
    """The experts of layer 0 chosen by each single-token item, from the router logits a pass shows
    (the n_used largest, ties to the lower id), each item alone."""
    k, out = model.config.n_experts_used, []
    for ids in ids_list:
        seen = {}
        model.backend.hooks.append(lambda layer, op, pos, slots, rows: seen.setdefault((layer, op), rows.copy()))
        try:
            model.backend.forward(ids, model.backend.new_cache(len(ids)))
        finally:
            model.backend.hooks.pop()
        last = seen[(0, "router")][-1]
        out.append({int(e) for e in np.argsort(-last, kind="stable")[:k]})
    return out


def test_batch_mates_sharing_experts_or_not_keep_their_bits(model):
    """One decode step of two sequences in one pass: a pair whose tokens choose a common expert in
    layer 0 and a pair whose tokens choose none in common; each row's logits equal its pass alone."""
    prompts = [model.tokenize(t)[:6] for t in TEXTS]
    routes = _routes(model, prompts)
    pairs = [(a, b) for a in range(len(prompts)) for b in range(a + 1, len(prompts))]
    shared = [p for p in pairs if routes[p[0]] & routes[p[1]]]
    disjoint = [p for p in pairs if not routes[p[0]] & routes[p[1]]]
    assert shared and disjoint, routes  # the generator's routers spread tokens over the experts
    for a, b in (shared[0], disjoint[0]):
        alone = [model.backend.forward(prompts[i], model.backend.new_cache(8)) for i in (a, b)]
        cache = model.backend.new_cache(8, n_slots=2)
        got = model.backend.forward_batch([(0, prompts[a]), (1, prompts[b])], cache)
        assert all(np.array_equal(bits(g), bits(w)) for g, w in zip(got, alone))


def test_native_storage_gives_fp32_bits(files):
    check_native_gives_fp32_bits(files.gguf["q8_0"], "q8_0", TEXTS[:2], kinds=("wqkv", "w13e", "w2e"))
    assert tinydet.load(files.gguf["q8_0"], dtype="native").backend.storage()["router"] == "f32"  # stored F32


def test_mxfp4_experts_give_fp32_bits(tmp_path):
    """gpt-oss's expert storage: a mixture whose matrices are MXFP4 blocks, kept as blocks natively,
    gives fp32's bits."""
    path = M.write_gguf(tmp_path / "tiny-qwen3moe-MXFP4.gguf", "qwen3moe", "mxfp4")
    check_native_gives_fp32_bits(path, "mxfp4", TEXTS[:2], kinds=("w13e", "w2e"))


def test_memory_estimate_counts_every_expert(files):
    """The load's memory check sees the experts: its estimate is the packed weights' size within 1%, in
    native storage (the file's blocks) and in fp32."""
    from tinydet import memory
    from tinydet.formats import open_checkpoint

    for path, dtype in ((files.gguf["q8_0"], "native"), (files.gguf[None], "fp32")):
        est = memory.weight_bytes(open_checkpoint(path).tensors, dtype)
        real = tinydet.load(path, dtype=dtype, check_memory=False).backend.weight_bytes()
        assert abs(est - real) <= 0.01 * real, (dtype, est, real)


def test_native_keeps_batch_invariance(qwen_files):
    """Quantized panels take mm's units path for a few rows (`loaders.few_rows`): a chunk's or a batch
    step's experts then run in one parallel region, one row or several each, as a single row's do;
    the prompt in one pass runs each expert's own product. Every way gives each row the same bits."""
    m = tinydet.load(qwen_files.gguf["q8_0"], dtype="native")
    check_threads_chunking_and_batch(m, m.tokenize(TEXTS[1]), TEXTS[:3])


def test_int8_keeps_batch_invariance(qwen_files):
    """(One architecture: the integer products are the same kernels for every one.)"""
    m = tinydet.load(qwen_files.gguf["q8_0"], dtype="int8")
    assert m.backend.storage()["w13e"] == "Q8_0:int8"
    check_threads_chunking_and_batch(m, m.tokenize(TEXTS[1]), TEXTS[:3])


def test_route_ties_go_to_the_lower_expert_id():
    from tinydet.backends.cpu.moe import SOFTMAX, SOFTMAX_TOPK, route

    def run(row, k, gating=SOFTMAX, norm=False):
        lg = np.array([row], np.float32)
        sel, wt = np.empty((1, k), np.int64), np.empty((1, k), np.float32)
        route(lg, k, gating, norm, sel, wt)
        return sel[0].tolist(), wt[0]

    assert run([1.0, 3.0, 3.0, 0.0], 2)[0] == [1, 2]
    assert run([3.0, 1.0, 3.0, 3.0], 2)[0] == [0, 2]
    assert run([2.0, 2.0, 2.0], 1)[0] == [0]
    assert run([np.nan, 1.0, 2.0], 2)[0] == [2, 1]  # NaN never outranks a number
    sel, wt = run([0.5, 2.0, 1.0, -1.0], 2, SOFTMAX_TOPK)
    e = np.exp(np.float64([2.0, 1.0]) - 2.0)
    assert sel == [1, 2] and np.allclose(wt, e / e.sum(), rtol=1e-6)
    sel, wt = run([0.5, 2.0, 1.0, -1.0], 2, SOFTMAX, True)
    assert np.allclose(wt, e / e.sum(), rtol=1e-6)  # renormalised softmax = softmax over the chosen
    sel, wt = run([0.5, 2.0, 1.0, -1.0], 2, SOFTMAX, False)
    assert np.allclose(wt, e / np.exp(np.float64([0.5, 2.0, 1.0, -1.0]) - 2.0).sum(), rtol=1e-6)


def _moe64(sd, arch, layer, h, logits, lower_first):
    """A float64 reference of the block from its input rows and router logits: experts by the largest
    logits, a tie broken to the lower id (or, `lower_first` False, the higher), softmax weights
    renormalised over the chosen, the SwiGLU experts summed."""
    router, experts, (g, d, u) = M._names(arch)
    p = f"model.layers.{layer}.{experts}."
    out = np.zeros(h.shape, np.float64)
    for t in range(h.shape[0]):
        lg = logits[t].astype(np.float64)
        order = sorted(range(len(lg)), key=lambda e: (-lg[e], e if lower_first else -e))[:M.USED]
        w = np.exp(lg[order] - lg.max())
        w /= w.sum()
        for wi, e in zip(w, order):
            x = h[t].astype(np.float64)
            gate, up = sd[p + f"{e}.{g}.weight"] @ x, sd[p + f"{e}.{u}.weight"] @ x
            out[t] += wi * (sd[p + f"{e}.{d}.weight"] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def test_routing_ties_in_a_model_go_to_the_lower_id(tmp_path):
    """Experts 3 and 5 of layer 0 with one router row: equal logits on every token. Where the pair
    straddles the cut (the second-best logit), expert 3 is chosen: the block's output matches a float64
    reference that breaks ties to the lower id, and not one that breaks them to the higher."""
    arch = "qwen3moe"
    hf = M.write_hf_dir(tmp_path / "tie", arch, tie=(3, 5))
    sd = M.state_dict(arch, tie=(3, 5))
    model = tinydet.load(hf)
    seen: dict = {}
    model.backend.hooks.append(lambda layer, op, pos, slots, rows: seen.setdefault((layer, op), rows.copy()))
    ids = model.tokenize(" ".join(TEXTS))
    model.backend.forward(ids, model.backend.new_cache(len(ids)))
    h, lg, down = seen[(0, "ffn_norm")], seen[(0, "router")], seen[(0, "down")]
    assert np.array_equal(bits(lg[:, 3]), bits(lg[:, 5]))
    straddle = [t for t in range(len(ids)) if sorted(set(lg[t].tolist()))[-2] == lg[t, 3]]
    assert straddle, "no token puts the tied pair at the cut"
    low = _moe64(sd, arch, 0, h[straddle], lg[straddle], True)
    high = _moe64(sd, arch, 0, h[straddle], lg[straddle], False)
    assert np.abs(down[straddle] - low).max() < 1e-5
    assert np.abs(down[straddle] - high).max() > 1e-3


def test_golden_hashes(qwen_files, tmp_path):
    """tests/golden/qwen3moe-tiny.json (the Q8_0 file), pinned to transformers holding the file's
    dequantized weights (archrunner.check_golden_pinned)."""
    ref = M.hf_model(M.write_hf_dir(tmp_path / "dq", "qwen3moe", quant="q8_0"))
    check_golden_pinned(qwen_files.gguf["q8_0"], "qwen3moe-tiny", ref)


def test_convert_to_hf_and_back(files, model, arch, tmp_path):
    """`convert` of the GGUF writes a directory transformers reads as the same model (Mixtral's `llama`
    file as a MixtralForCausalLM), which gives tinydet the GGUF's bits."""
    from tinydet.tools.convert import convert_gguf_to_hf

    out = tmp_path / "hf"
    convert_gguf_to_hf(files.gguf[None], out)
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == json.loads((files.hf / "config.json").read_text())["architectures"]
    ids = model.tokenize(TEXTS[0])
    assert np.array_equal(bits(tinydet.load(out).logits(ids)), bits(model.logits(ids)))
    assert np.abs(hf_logits(M.hf_model(out), ids) - model.logits(ids)).max() <= 1e-4


@pytest.mark.parametrize("key,value,field", [
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("mlp_only_layers", [1], "mlp_only_layers"),
    ("decoder_sparse_step", 2, "decoder_sparse_step"),
    ("norm_topk_prob", "yes", "norm_topk_prob"),
    ("num_experts", 4, "mlp.experts.4"),
])
def test_bad_config_is_refused_by_name(qwen_files, tmp_path, key, value, field):
    from tinydet.errors import ModelFormatError

    with pytest.raises(ModelFormatError, match=field.replace(".", r"\.")):
        tinydet.load(edited(qwen_files.hf, tmp_path / "bad", **{key: value}))


def test_gguf_without_expert_count_is_refused(qwen_files, tmp_path):
    """(A llama file without expert_count is a dense Llama: its missing ffn_gate is what is refused.)"""
    import gguf

    from tinydet.errors import ModelFormatError

    r = gguf.GGUFReader(qwen_files.gguf[None])
    assert "qwen3moe.expert_count" in r.fields
    w = gguf.GGUFWriter(tmp_path / "x.gguf", "qwen3moe")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "qwen3moe.expert_count"):
            continue
        w.add_key_value(name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="expert_count"):
        tinydet.load(tmp_path / "x.gguf")


def test_the_gpu_path_refuses_a_mixture_by_name(qwen_files):
    from tinydet.errors import TinydetError

    with pytest.raises(TinydetError, match="qwen3moe: mixtures of experts run on the CPU backend only"):
        tinydet.load(qwen_files.gguf[None], device="cuda-host")


def test_verify_cells_pass(qwen_files):
    """`tinydet verify` on the Q8_0 mixture: fp32, native and int8, every cell of its own process (the
    other numba targets' runs are SmolLM2's, test_verify.py: the same kernels)."""
    from click.testing import CliRunner

    from contract import VERIFY_CELLS_IN_PROCESS
    from tinydet.cli import main

    r = CliRunner().invoke(main, ["verify", "--model", str(qwen_files.gguf["q8_0"]), "--json", "--max-tokens", "12",
                                  "--dtype", "fp32", "--dtype", "native", "--dtype", "int8", "--no-subprocess"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["passed"] and len(out["cells"]) == 3 * VERIFY_CELLS_IN_PROCESS
    assert {c["dtype"] for c in out["cells"]} == {"fp32", "native", "int8"}
