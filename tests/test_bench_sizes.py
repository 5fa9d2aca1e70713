"""bench/sizes.py's report: the columns it promises and the ratios of the medians (the measuring itself is
compare.py's machinery, run by hand: it needs llama.cpp and minutes)."""

from __future__ import annotations

from benchmods import bench_module

sizes = bench_module("sizes")


def _engine(label, engine, speeds, load_s):
    return {"label": label, "engine": engine, "dtype": "native", "model": "/m/llama-1b-random.Q4_0.gguf",
            "load_s": load_s, "load_rss_mib": 700.0, "first_prompt_s": 3.0, "peak_rss_mib": 900.0,
            "others_cpu": 0.02, "redone": 0,
            "by_prompt_tokens": {str(n): {"prefill_tok_s": p, "decode_tok_s": d} for n, (p, d) in speeds.items()}}


def test_render_columns_and_ratios():
    r = {"machine": {"cpu": "cpu", "cpus": 2, "simd": "AVX-512", "loadavg_start": [0.5], "loadavg_end": [0.6]},
         "settings": {"threads": 2, "prompts": [128, 512], "depths": [2048, 4096], "new_tokens": 64, "repeats": 3},
         "tinydet_commit": "abc1234", "tinydet_uncommitted": [],
         "engines": [_engine("tinydet native (Q4_0)", "tinydet",
                             {128: (80, 30), 512: (75, 29), 2048: (60, 22), 4096: (50, 14)}, 8.0),
                     _engine("llama.cpp Q4_0", "llama.cpp",
                             {128: (100, 40), 512: (150, 39), 2048: (100, 32), 4096: (80, 28)}, 0.5)]}
    assert [c[0] for c in sizes.columns(r)] == ["prefill 128", "prefill 512", "prefill 2048", "prefill 4096", "decode",
                                                "decode@2048", "decode@4096"]
    text = sizes.render(r)
    ratio_line = next(line for line in text.splitlines() if line.startswith("tinydet native (Q4_0) / llama.cpp"))
    # prefill 80/100, 75/150, 60/100, 50/80; decode after 128 tokens 30/40, after 2048 22/32, after 4096
    # 14/28; load 8/0.5
    assert ratio_line.endswith("prefill 128 0.80x, prefill 512 0.50x, prefill 2048 0.60x, prefill 4096 0.62x, "
                               "decode 0.75x, decode@2048 0.69x, decode@4096 0.50x; load 16.0x the time")


def test_importing_bench_scripts_leaves_the_path_alone():
    import profile
    import sys

    from benchmods import BENCH

    assert BENCH not in sys.path
    assert hasattr(profile, "runctx")  # the standard library's, not bench/profile.py
