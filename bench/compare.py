"""tinydet against its peers (llama.cpp through llama-cpp-python, Hugging Face transformers on torch),
on the same GGUF model, prompt tokens and thread count, engines run alternately.

    python bench/compare.py --model M.gguf [--threads 2] [--prompt-tokens 128] [--new-tokens 64]
        [--repeats 5] [--dtype fp32|fp16] [--engines tinydet,llama.cpp,transformers]
        [--llama-python $LLAMA_VENV/bin/python] [--transformers-python PY] [--wait-idle 20]
        [--retry-contended 3] [--spin 0.5] [--json]

Each engine runs in its own worker process (this file, run with `--worker`), so llama-cpp-python can
live in another virtual environment, and no engine's threads share a process with another's. All
workers load their model first (load time is reported, not compared), then run one warm-up round
(excluded), then `--repeats` rounds. In a round every engine runs once, one after another, the order
rotating by one engine each round, with a short pause between engines; nothing else of ours runs
meanwhile. Before each run the driver waits (up to --wait-idle seconds) for other processes to leave the
machine at least 85% idle, and it records the share of the CPU they used during each run ("others");
then the worker busy-waits --spin seconds (untimed: after an idle wait this machine's cores need a few
tenths of a second to return to full clock) and runs;
a run during which they took 10% or more is run again (up to --retry-contended times; the last attempt
counts, the discarded ones are kept in the JSON).
A run starts from an empty KV cache: prefill = one forward over the prompt tokens plus the greedy pick
of the first new token; decode = `--new-tokens` single-token forwards, each with a greedy pick. Reported
numbers are medians over the rounds; ratios are tinydet / peer of those medians, and in brackets the
median of the per-round ratios (steadier when the machine's load drifts between rounds).

Engine specs (`--engines`, comma-separated): NAME[:DTYPE][=MODEL][@SRC]. NAME is tinydet, llama.cpp or
transformers; DTYPE is tinydet's fp32/fp16/native or another mode that tinydet has (default --dtype) or
transformers' torch dtype fp32/bf16/fp16 (default fp32); llama.cpp computes in the GGUF's own tensor
types (its KV cache is F16, its default; --llama-no-extra-bufts: without its AMX and repacked-weight
buffers, for machines where they fail). MODEL is a GGUF file (default --model). SRC, for tinydet, is
a source checkout to import instead of the installed one (put first on PYTHONPATH), so two versions run
side by side ($OLD: a checkout of the older commit, e.g. `git worktree add $OLD COMMIT`):

    python bench/compare.py --model M.gguf --engines tinydet:fp32@$OLD,tinydet:fp32

Without --engines: tinydet and every peer that imports.
Example (the 2026-11-29 table in bench/NOTES.md):

    python bench/compare.py --model F32.gguf --llama-python $LLAMA_VENV/bin/python \\
        --engines llama.cpp,llama.cpp=F16.gguf,transformers,tinydet:fp32,tinydet:fp16

Only the standard library is imported at the top: the workers import their engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINES = ("tinydet", "llama.cpp", "transformers")
ALIASES = {"tinydet": "tinydet", "llama.cpp": "llama.cpp", "llama": "llama.cpp", "llama-cpp": "llama.cpp",
           "llama_cpp": "llama.cpp", "transformers": "transformers", "hf": "transformers"}
IMPORT = {"tinydet": "tinydet", "llama.cpp": "llama_cpp", "transformers": "transformers"}
DTYPES = {"tinydet": ("fp32", "fp16", "native"), "transformers": ("fp32", "bf16", "fp16"), "llama.cpp": ()}
PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books "
    "quickly and cheaply. Before that, texts were copied by hand, a slow process that made books rare and "
    "expensive. Within a few decades, printing shops had spread to hundreds of towns across Europe, and "
    "millions of volumes were in circulation. Scholars could compare identical copies, errors could be "
    "corrected in later editions, and new ideas travelled faster than ever before. "
)
LLAMA_NO_EXTRA_HELP = ("llama.cpp without its extra CPU buffer types (AMX, and the repacked Q4_0/Q4_K/IQ4_NL "
                       "layouts): for machines where they fail (SIGILL); slows llama.cpp's quantized products")
PAUSE_S = 0.3  # between engines: lets the previous engine's spinning worker threads go to sleep
QUIET = 0.10  # a "quiet" run: other processes took under this share of the machine's CPU meanwhile


# ----------------------------------------------------------------------------------------------- workers

class Worker:
    """Base of an engine worker: load(), tokenize(text), run(ids, new_tokens) -> (t0, t1, t2, out ids)."""

    def info(self) -> dict:
        return {}


class TinydetWorker(Worker):
    def __init__(self, model: str, dtype: str, threads: int):
        import tinydet

        self.model = tinydet.load(model, dtype=dtype, threads=threads)
        self.tr = getattr(self.model, "backend", None) or self.model.transformer  # this or an older tinydet
        self.threads = threads
        self.version = tinydet.__version__

    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text)

    def run(self, ids: list[int], new_tokens: int):
        if hasattr(self.model, "backend"):
            from tinydet.tools.bench import timed_greedy
        else:  # a tinydet from before backends/ and tools/ (compared side by side)
            from tinydet.bench import timed_greedy

        return timed_greedy(self.tr, ids, new_tokens, self.threads)

    def batch(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[str]]:
        """generate_batch of greedy requests, one per prompt: (seconds, each result's output hash)."""
        t0 = time.perf_counter()
        out = self.model.generate_batch([dict(prompt=p, max_tokens=new_tokens) for p in prompts],
                                        max_batch=len(prompts))
        return time.perf_counter() - t0, [g.output_hash for g in out]

    def info(self) -> dict:
        import numba

        return {"version": self.version, "numba": numba.__version__, "threading_layer": _numba_layer()}


def _numba_layer() -> str:
    try:
        import numba

        return numba.threading_layer()
    except Exception:  # not initialised until a parallel kernel ran
        return "?"


class LlamaCppWorker(Worker):
    def __init__(self, model: str, dtype: str, threads: int, n_ctx: int, extra_bufts: bool = True):
        import llama_cpp
        import llama_cpp.llama_cpp as lib
        import numpy as np

        self.np, self.lc = np, llama_cpp
        defaults = lib.llama_model_default_params
        if not extra_bufts:  # Llama() takes no such argument: it starts from these defaults
            def no_extra():
                p = defaults()
                p.use_extra_bufts = False
                return p

            lib.llama_model_default_params = no_extra
        try:
            self.llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                       n_batch=512, verbose=False)
        finally:
            lib.llama_model_default_params = defaults
        self.extra_bufts = extra_bufts
        self.n_vocab = self.llm.n_vocab()
        self.version = llama_cpp.__version__

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True)

    def _pick(self) -> int:
        # logits of the last token of the last batch (the only row llama.cpp computed)
        p = self.lc.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self.np.argmax(self.np.ctypeslib.as_array(p, shape=(self.n_vocab,))))

    def run(self, ids: list[int], new_tokens: int):
        llm = self.llm
        llm.reset()  # n_tokens = 0: the next eval drops the whole KV cache
        out = []
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = self._pick()
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            out.append(tok)
            llm.eval([tok])
            tok = self._pick()
        t2 = time.perf_counter()
        out.append(tok)
        return t0, t1, t2, out

    def info(self) -> dict:
        sysinfo = self.lc.llama_print_system_info()
        sysinfo = sysinfo.decode() if isinstance(sysinfo, bytes) else str(sysinfo)
        return {"version": self.version, "system_info": sysinfo, "extra_bufts": self.extra_bufts,
                "file_type": self.llm.metadata.get("general.file_type")}


class TransformersWorker(Worker):
    def __init__(self, model: str, dtype: str, threads: int):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        self.torch = torch
        p = Path(model)
        tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=tdtype)
        self.model.eval()
        # transformers 5.x renamed `past_key_values` to `cache` (argument and output); take either
        import inspect

        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.path = p
        self.version = transformers.__version__

    def tokenize(self, text: str) -> list[int]:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        return list(tok(text)["input_ids"])

    def run(self, ids: list[int], new_tokens: int):
        torch = self.torch
        out = []
        with torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long)
            t0 = time.perf_counter()
            o = self.model(input_ids=x, use_cache=True, logits_to_keep=1)
            tok = int(o.logits[0, -1].argmax())
            t1 = time.perf_counter()
            past = getattr(o, self.cache_kw)
            for _ in range(new_tokens):
                out.append(tok)
                o = self.model(input_ids=torch.tensor([[tok]], dtype=torch.long), use_cache=True, logits_to_keep=1,
                               **{self.cache_kw: past})
                past = getattr(o, self.cache_kw)
                tok = int(o.logits[0, -1].argmax())
            t2 = time.perf_counter()
        out.append(tok)
        return t0, t1, t2, out

    def info(self) -> dict:
        torch = self.torch
        return {"version": self.version, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                "parallel_info": torch.__config__.parallel_info().splitlines()[:6]}


def worker_main(spec: dict) -> None:
    """Serve one engine: JSON lines in on stdin, JSON lines out on the original stdout (C libraries'
    prints are sent to stderr so they cannot corrupt the channel)."""
    chan = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj):
        chan.write(json.dumps(obj) + "\n")
        chan.flush()

    try:
        t0 = time.perf_counter()
        engine, model, dtype, threads = spec["engine"], spec["model"], spec["dtype"], spec["threads"]
        if engine == "tinydet":
            w = TinydetWorker(model, dtype, threads)
        elif engine == "llama.cpp":
            w = LlamaCppWorker(model, dtype, threads, spec["n_ctx"], spec.get("extra_bufts", True))
        else:
            w = TransformersWorker(model, dtype, threads)
        send({"ok": True, "load_s": time.perf_counter() - t0, "python": sys.executable, "maxrss_kb": _maxrss_kb()})
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["cmd"] == "tokenize":
                send({"ok": True, "ids": w.tokenize(req["text"])})
            elif req["cmd"] == "run":
                c0 = _cpu_s()
                spin(req.get("spin_s", 0.0))
                t0, t1, t2, out = w.run(req["ids"], req["new_tokens"])
                send({"ok": True, "prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": out,
                      "cpu_s": _cpu_s() - c0, "maxrss_kb": _maxrss_kb()})
            elif req["cmd"] == "batch":
                spin(req.get("spin_s", 0.0))
                c0 = _cpu_s()
                seconds, hashes = w.batch(req["prompts"], req["new_tokens"])
                send({"ok": True, "seconds": seconds, "hashes": hashes, "cpu_s": _cpu_s() - c0})
            elif req["cmd"] == "info":
                send({"ok": True, "info": w.info()})
            elif req["cmd"] == "quit":
                send({"ok": True})
                return
        except BaseException as e:  # noqa: BLE001
            send({"ok": False, "error": f"{type(e).__name__}: {e}"})


def spin(seconds: float) -> None:
    """Busy-wait (untimed) before a run: after the idle wait, this machine's cores take a few tenths of a
    second to come back to full clock, which would otherwise slow the start of every run (and short runs,
    i.e. faster engines, the most)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def _maxrss_kb() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def machine_cpu_s() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    total = sum(v[:8])  # guest time is already counted in user
    return (total - idle) / hz, total / hz


def wait_idle(limit_s: float, log, min_idle: float = 0.85, window_s: float = 0.5) -> float:
    """Wait (at most limit_s) until the machine is at least `min_idle` idle over `window_s`; returns
    the seconds waited. Our own workers are asleep meanwhile, so what is busy is someone else."""
    if limit_s <= 0 or machine_cpu_s() is None:
        return 0.0
    t0 = time.perf_counter()
    warned = False
    while True:
        a = machine_cpu_s()
        time.sleep(window_s)
        b = machine_cpu_s()
        busy = (b[0] - a[0]) / max(b[1] - a[1], 1e-9)
        waited = time.perf_counter() - t0
        if 1.0 - busy >= min_idle or waited >= limit_s:
            return waited
        if not warned and waited > 5:
            log(f"  waiting for other processes to quiet down (machine {busy:.0%} busy)")
            warned = True


# ----------------------------------------------------------------------------------------------- driver

class EngineProc:
    """A running worker, seen from the driver."""

    def __init__(self, spec: dict, python: str):
        self.spec = spec
        self.label = spec["label"]
        self.python = python
        self.log = tempfile.TemporaryFile("w+", encoding="utf-8")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     bufsize=1, env=worker_env(spec))

    def recv(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"{self.label}: worker exited with status {self.proc.returncode}; "
                               f"its stderr ends with:\n{self.stderr_tail()}")
        msg = json.loads(line)
        if not msg.get("ok"):
            raise RuntimeError(f"{self.label}: {msg.get('error')}\n{self.stderr_tail()}")
        return msg

    def call(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self.recv()

    def stderr_tail(self, n: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read()[-n:]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(cmd="quit")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def file_tag(path: str) -> str:
    """SmolLM2-135M-Instruct.Q4_1.gguf -> Q4_1 (the quant suffix, else the file's stem)."""
    stem = Path(path).stem
    m = re.search(r"[.-]((?:I?Q\d\w*)|F16|F32|BF16)$", stem, re.IGNORECASE)
    return m.group(1).upper() if m else stem


def worker_env(spec: dict) -> dict:
    """The environment of a worker: with a tinydet source checkout (`@SRC`), that checkout first on
    PYTHONPATH."""
    env = dict(os.environ)
    if spec.get("src"):
        env["PYTHONPATH"] = os.pathsep.join([spec["src"]] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def parse_engines(text: str | None, a) -> list[dict]:
    specs = []
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        item, _, src = item.partition("@")
        head, _, model = item.partition("=")
        name, _, dtype = head.partition(":")
        engine = ALIASES.get(name.strip().lower())
        if engine is None:
            raise SystemExit(f"--engines: unknown engine {name!r} (tinydet, llama.cpp, transformers)")
        dtype = dtype.strip().lower()
        if engine == "llama.cpp" and dtype:
            raise SystemExit("--engines: llama.cpp takes no dtype: it computes in the file's tensor types "
                             "(give it an F32 or F16 file with =MODEL)")
        dtype = dtype or {"tinydet": a.dtype, "transformers": "fp32", "llama.cpp": ""}[engine]
        # tinydet's own modes are its to check (a newer tinydet may have more); a typo fails its load
        if engine == "transformers" and dtype not in DTYPES[engine] or not re.fullmatch(r"[a-z0-9_]*", dtype):
            raise SystemExit(f"--engines: {engine} dtype {dtype!r}: expected one of {', '.join(DTYPES[engine])}")
        model = model.strip() or a.model
        model = str(Path(model).expanduser().resolve()) if model else None
        if src and engine != "tinydet":
            raise SystemExit(f"--engines: @SRC is for tinydet, found it on {engine}")
        if src and not (Path(src).expanduser() / "tinydet" / "__init__.py").is_file():
            raise SystemExit(f"--engines: @{src}: not a tinydet source checkout (no tinydet/__init__.py)")
        src = str(Path(src).expanduser().resolve()) if src else None
        specs.append(dict(engine=engine, dtype=dtype, model=model, src=src))
    return specs


def python_for(engine: str, a) -> str:
    return {"tinydet": a.tinydet_python, "llama.cpp": a.llama_python,
            "transformers": a.transformers_python}[engine] or sys.executable


def importable(python: str, module: str, env: dict | None = None) -> bool:
    r = subprocess.run([python, "-c", f"import importlib.util as u, sys; sys.exit(u.find_spec({module!r}) is None)"],
                       capture_output=True, env=env)
    return r.returncode == 0


def git_state() -> tuple[str | None, list[str]]:
    """(short commit, files of the tinydet package that differ from it: modified or untracked)."""
    root = Path(__file__).resolve().parent.parent
    try:
        r = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h"], capture_output=True, text=True,
                           timeout=10)
        st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "tinydet"],
                            capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None, []
    if r.returncode != 0:
        return None, []
    dirty = [line[3:] for line in st.splitlines() if line.strip()]
    return r.stdout.strip() + ("+uncommitted" if dirty else ""), dirty


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("flags"):
                f = set(line.split(":", 1)[1].split())
                return "AVX-512" if "avx512f" in f else "AVX2" if "avx2" in f else "no AVX2"
    except OSError:
        pass
    return "?"


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def start_engines(specs: list[dict], a, n_ctx: int, log) -> tuple[list[EngineProc], dict, list]:
    """Label each engine, find the Python that runs it, start its worker and load its model, one at a
    time (an engine whose module does not import, whose file is missing or whose load fails is skipped).
    Returns (the started engines, label -> load seconds, skipped engines with the reason). Sets
    `a.git_state` (the code the workers load) and each spec's `load` (the worker's load message)."""
    # label each engine; find the Python that runs it
    for s in specs:
        tag = file_tag(s["model"])
        s["label"] = {"tinydet": f"tinydet {s['dtype']} ({tag})", "transformers": f"transformers {s['dtype']} ({tag})",
                      "llama.cpp": f"llama.cpp {tag}"}[s["engine"]]
        if s.get("src"):
            s["label"] += f" @{Path(s['src']).name}"
        s.update(threads=a.threads, n_ctx=n_ctx, extra_bufts=not getattr(a, "llama_no_extra_bufts", False))
    seen = {}
    for s in specs:  # the same engine twice on the same model and dtype: number them
        seen[s["label"]] = seen.get(s["label"], 0) + 1
        if seen[s["label"]] > 1:
            s["label"] += f" #{seen[s['label']]}"
    skipped, procs = [], []
    for s in specs:
        py = python_for(s["engine"], a)
        if not importable(py, IMPORT[s["engine"]], worker_env(s)):
            why = f"{IMPORT[s['engine']]} does not import in {py}"
            skipped.append({"label": s["label"], "reason": why})
            log(f"skip {s['label']}: {why}")
            continue
        if not Path(s["model"]).is_file():
            skipped.append({"label": s["label"], "reason": f"no file {s['model']}"})
            log(f"skip {s['label']}: no file {s['model']}")
            continue
        s["python"] = py
        procs.append(s)
    if not procs:
        raise SystemExit("no engine to run")

    a.git_state = git_state()  # the code the workers are about to load
    # load, one engine at a time
    engines, loads = [], {}
    for s in procs:
        e = EngineProc(s, s["python"])
        try:
            msg = e.recv()
        except RuntimeError as err:
            skipped.append({"label": s["label"], "reason": str(err).splitlines()[0]})
            log(f"skip {s['label']}: {err}")
            e.close()
            continue
        loads[e.label] = msg["load_s"]
        s["load"] = msg
        log(f"loaded {e.label} in {msg['load_s']:.1f} s ({s['python']})")
        engines.append(e)
    if not engines:
        raise SystemExit("no engine started")
    return engines, loads, skipped


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        worker_main(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", help="GGUF file (the default for every engine)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="fp32", help="tinydet's dtype: fp32 (default), fp16, native, ...")
    ap.add_argument("--engines", help="comma-separated NAME[:DTYPE][=MODEL] (default: tinydet and every "
                                      "installed peer)")
    ap.add_argument("--llama-python", help="Python with llama-cpp-python (default: this one)")
    ap.add_argument("--transformers-python", help="Python with transformers + torch (default: this one)")
    ap.add_argument("--llama-no-extra-bufts", action="store_true", help=LLAMA_NO_EXTRA_HELP)
    ap.add_argument("--tinydet-python", help="Python with tinydet (default: this one)")
    ap.add_argument("--wait-idle", type=float, default=20.0, metavar="S",
                    help="before each run, wait up to S seconds for the machine to be 85%% idle (0: don't)")
    ap.add_argument("--retry-contended", type=int, default=3, metavar="N",
                    help="run again (up to N times) a run during which other processes took 10%% or more of the "
                         "CPU (0: keep every run)")
    ap.add_argument("--spin", type=float, default=0.5, metavar="S",
                    help="each worker busy-waits S seconds, untimed, right before each run (0: don't)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = ap.parse_args()
    for name in ("threads", "prompt_tokens", "new_tokens", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected a positive integer")
    explicit = a.engines is not None
    if explicit:
        specs = parse_engines(a.engines, a)
    else:
        specs = parse_engines(",".join(ENGINES), a)
    for s in specs:
        if not s["model"]:
            ap.error(f"{s['engine']}: no model (give --model or NAME=MODEL in --engines)")
    log = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))

    engines, loads, skipped = start_engines(specs, a, a.prompt_tokens + a.new_tokens + 16, log)
    try:
        result = measure(engines, loads, skipped, a, log)
    finally:
        for e in engines:
            e.close()
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print(render(result))
    if explicit and skipped:
        sys.exit(1)


def prompt_ids(engine: EngineProc, n: int) -> list[int]:
    """The prompt: fixed English text through `engine`'s tokenizer, cut or repeated (without its BOS)
    to `n` ids."""
    ids = engine.call(cmd="tokenize", text=PROMPT_TEXT * 4)["ids"]
    body = ids[1:] if len(ids) > 1 else ids
    while len(ids) < n:
        ids = ids + body
    return ids[:n]


def _attempt(e: EngineProc, ids: list[int], new_tokens: int, a, log) -> dict:
    time.sleep(PAUSE_S)
    waited = wait_idle(a.wait_idle, log)
    c0 = machine_cpu_s()
    t0 = time.perf_counter()
    m = e.call(cmd="run", ids=ids, new_tokens=new_tokens, spin_s=a.spin)
    wall = time.perf_counter() - t0
    c1 = machine_cpu_s()
    m["waited_s"] = waited
    # CPU that other processes used meanwhile, as a share of the machine (0 = it had the machine).
    # /proc/stat counts in clock ticks (10 ms): allow a tick per CPU, and don't judge runs under 0.25 s.
    m["others_cpu"] = None
    if c0 and c1 and wall >= 0.25:
        ncpu = os.cpu_count() or 1
        slack = ncpu / os.sysconf("SC_CLK_TCK")
        m["others_cpu"] = max(0.0, (c1[0] - c0[0]) - m["cpu_s"] - slack) / (wall * ncpu)
    return m


def run_once(e: EngineProc, ids: list[int], new_tokens: int, a, log) -> dict:
    """A run of `e` (prefill `ids`, then `new_tokens` decode steps) after an idle wait (--wait-idle) and
    a spin (--spin); one during which other processes took QUIET or more of the CPU is run again (up to
    --retry-contended times), and the last attempt counts. Every discarded attempt is kept."""
    m = _attempt(e, ids, new_tokens, a, log)
    discarded = []
    while m["others_cpu"] is not None and m["others_cpu"] >= QUIET and len(discarded) < a.retry_contended:
        log(f"  {e.label}: other processes took {m['others_cpu']:.0%} of the CPU during the run "
            f"({len(ids) / m['prefill_s']:.0f}/{new_tokens / m['decode_s']:.1f} tok/s): again")
        discarded.append({k: m[k] for k in ("prefill_s", "decode_s", "others_cpu", "waited_s")})
        m = _attempt(e, ids, new_tokens, a, log)
    m["discarded"] = discarded
    return m


def measure(engines: list[EngineProc], loads: dict, skipped: list, a, log) -> dict:
    ids = prompt_ids(engines[0], a.prompt_tokens)
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None

    runs = {e.label: [] for e in engines}
    log(f"warm-up round (excluded), then {a.repeats} rounds of {len(engines)} engines, alternating")

    def one(e: EngineProc) -> dict:
        return run_once(e, ids, a.new_tokens, a, log)

    for e in engines:
        one(e)
    for r in range(a.repeats):
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        for e in order:
            m = one(e)
            m["round"] = r
            runs[e.label].append(m)
        log(f"round {r + 1}/{a.repeats}: " + ", ".join(
            f"{e.label} {a.prompt_tokens / runs[e.label][-1]['prefill_s']:.0f}/"
            f"{a.new_tokens / runs[e.label][-1]['decode_s']:.1f}" for e in engines) + "  (prefill/decode tok/s)")
    load_end = os.getloadavg() if hasattr(os, "getloadavg") else None

    ref = engines[0].label
    ref_tokens = runs[ref][0]["tokens"]
    rows = []
    for e in engines:
        rs = runs[e.label]
        pre = [a.prompt_tokens / m["prefill_s"] for m in rs]
        dec = [a.new_tokens / m["decode_s"] for m in rs]
        toks = rs[0]["tokens"]
        rows.append({
            "label": e.label, "engine": e.spec["engine"], "dtype": e.spec["dtype"], "model": e.spec["model"],
            "python": e.spec["python"], "info": e.call(cmd="info")["info"], "load_s": loads[e.label],
            "prefill_tok_s": median(pre), "decode_tok_s": median(dec),
            "prefill_tok_s_runs": pre, "decode_tok_s_runs": dec,
            "peak_rss_mib": max(m["maxrss_kb"] for m in rs) / 1024,
            "others_cpu_runs": [m["others_cpu"] for m in rs], "waited_s_runs": [m["waited_s"] for m in rs],
            "discarded_runs": [d for m in rs for d in m["discarded"]],
            "others_cpu": median([m["others_cpu"] for m in rs if m["others_cpu"] is not None]),
            "tokens": toks, "repeats_identical": all(m["tokens"] == toks for m in rs),
            "agree_with_first": leading_agreement(toks, ref_tokens),
        })
        rows[-1]["quiet"] = quiet_medians(rows[-1])
    ratios = []
    for t in [r for r in rows if r["engine"] == "tinydet"]:
        for p in [r for r in rows if r["engine"] != "tinydet"]:
            paired = {}
            for kind in ("prefill", "decode"):
                tv, pv = t[f"{kind}_tok_s_runs"], p[f"{kind}_tok_s_runs"]
                paired[kind] = median([x / y for x, y in zip(tv, pv)])
            ratios.append({"tinydet": t["label"], "peer": p["label"],
                           "prefill": t["prefill_tok_s"] / p["prefill_tok_s"],
                           "decode": t["decode_tok_s"] / p["decode_tok_s"],
                           "prefill_paired_median": paired["prefill"], "decode_paired_median": paired["decode"]})
    commit, dirty = a.git_state
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "machine": {"cpu": cpu_name(), "simd": cpu_flags(), "cpus": os.cpu_count(), "cpus_usable": affinity,
                    "platform": platform.platform(), "loadavg_start": load_start, "loadavg_end": load_end},
        "settings": {"threads": a.threads, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
                     "repeats": a.repeats, "warmup_rounds": 1, "pause_s": PAUSE_S, "wait_idle_s": a.wait_idle,
                     "spin_s": a.spin, "retry_contended": a.retry_contended, "quiet_below": QUIET,
                     "prompt_ids_from": ref, "prompt_ids_head": ids[:8]},
        "tinydet_commit": commit, "tinydet_uncommitted": dirty,
        "engines": rows, "ratios": ratios, "skipped": skipped,
    }


def quiet_medians(e: dict) -> dict:
    """Medians over an engine's runs during which others used under QUIET of the CPU."""
    keep = [i for i, o in enumerate(e.get("others_cpu_runs", [])) if o is not None and o < QUIET]
    return {"n": len(keep), "prefill_tok_s": median([e["prefill_tok_s_runs"][i] for i in keep]),
            "decode_tok_s": median([e["decode_tok_s_runs"][i] for i in keep])}


def render(r: dict) -> str:
    m, s = r["machine"], r["settings"]
    la = lambda v: "/".join(f"{x:.2f}" for x in v[:1]) if v else "?"  # noqa: E731
    out = [f"machine: {m['cpu']}, {m['cpus_usable']} of {m['cpus']} CPUs usable, {m['simd']}; "
           f"load average {la(m['loadavg_start'])} -> {la(m['loadavg_end'])}",
           f"settings: threads {s['threads']}, prompt {s['prompt_tokens']} tokens, {s['new_tokens']} new tokens "
           f"(greedy), medians of {s['repeats']} alternating rounds after 1 warm-up round, "
           f"{s.get('spin_s', 0):g} s spin before each run; "
           f"tinydet commit {r['tinydet_commit']}"
           + (f" ({', '.join(r['tinydet_uncommitted'])})" if r["tinydet_uncommitted"] else ""), ""]
    w = max(len(e["label"]) for e in r["engines"])
    out.append(f"{'engine':<{w}}  {'prefill tok/s':>13} {'(min-max)':>11}  {'decode tok/s':>12} {'(min-max)':>11}  "
               f"{'others':>6} {'redone':>6}  {'load s':>6}  {'RSS MiB':>7}  same tokens as first")
    for e in r["engines"]:
        pre, dec = e["prefill_tok_s_runs"], e["decode_tok_s_runs"]
        agree = f"{e['agree_with_first']}/{len(e['tokens'])}" + ("" if e["repeats_identical"] else ", runs differ")
        oth = "?" if e.get("others_cpu") is None or e["others_cpu"] != e["others_cpu"] else f"{e['others_cpu']:.0%}"
        out.append(f"{e['label']:<{w}}  {e['prefill_tok_s']:>13.1f} {f'{min(pre):.0f}-{max(pre):.0f}':>11}  "
                   f"{e['decode_tok_s']:>12.1f} {f'{min(dec):.1f}-{max(dec):.1f}':>11}  {oth:>6} "
                   f"{len(e.get('discarded_runs', [])):>6}  "
                   f"{e['load_s']:>6.1f}  {e['peak_rss_mib']:>7.0f}  {agree}")
    out.append("(others: median share of the machine's CPU that other processes took during this engine's counted "
               "runs; redone: runs discarded and run again because others took 10% or more)")
    quiet = {e["label"]: quiet_medians(e) for e in r["engines"]}
    if any(o is not None and o >= QUIET for e in r["engines"] for o in e.get("others_cpu_runs", [])):
        out += ["", f"only the runs during which other processes used under {QUIET:.0%} of the CPU:"]
        for label, q in quiet.items():
            e = next(x for x in r["engines"] if x["label"] == label)
            line = f"{label:<{w}}  {q['n']} runs"
            if all(o is None for o in e.get("others_cpu_runs", [])):
                line += " (runs under 0.25 s: not judged)"
            elif q["n"]:
                line += f"  prefill {q['prefill_tok_s']:.1f} tok/s  decode {q['decode_tok_s']:.1f} tok/s"
            out.append(line)
    if r["ratios"]:
        out += ["", "tinydet / peer (ratio of medians; paired per-round median in brackets):"]
        wt = max(len(x["tinydet"]) for x in r["ratios"])
        wp = max(len(x["peer"]) for x in r["ratios"])
        for x in r["ratios"]:
            out.append(f"  {x['tinydet']:<{wt}}  /  {x['peer']:<{wp}}  prefill {x['prefill']:.2f}x "
                       f"[{x['prefill_paired_median']:.2f}]  decode {x['decode']:.2f}x "
                       f"[{x['decode_paired_median']:.2f}]")
    for sk in r["skipped"]:
        out.append(f"skipped {sk['label']}: {sk['reason']}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
