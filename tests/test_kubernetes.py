"""deploy/kubernetes: every object valid against Kubernetes' own OpenAPI schemas (kubernetes-validate,
strict: no unknown fields), the tinydet commands in it accepted by tinydet's CLI, and the probes on the
port tinydet serves. (No cluster here: the manifests are checked, not applied.)"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (the test extra has it)")
yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (kubernetes-validate needs it)")

from tinydet.cli import main  # noqa: E402

MANIFESTS = sorted((Path(__file__).resolve().parent.parent / "deploy" / "kubernetes").glob("*.yaml"))
K8S_VERSION = "1.33"


def _docs():
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def _containers(doc):
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def _tinydet_commands(container) -> list[list[str]]:
    """Each tinydet command line in a container's command and args (also inside `sh -c`)."""
    words = container.get("command", []) + container.get("args", [])
    if words[:2] == ["sh", "-c"]:
        words = shlex.split(" ".join(words[2:]))
    out, cur = [], None
    for w in words:
        if w == "tinydet":
            cur = []
            out.append(cur)
        elif w in ("&&", ";", "exec"):
            cur = None
        elif cur is not None:
            cur.append(w)
    return out


def test_there_are_manifests():
    assert MANIFESTS and any(doc["kind"] == "Deployment" for _, doc in _docs())


@pytest.mark.parametrize("name,doc", list(_docs()), ids=lambda x: x if isinstance(x, str) else x.get("kind", "?"))
def test_valid_against_the_kubernetes_schema(name, doc):
    kv.validate(doc, K8S_VERSION, strict=True)


def test_an_invalid_manifest_is_caught():
    """The validator does fail: a probe with a misspelt field is rejected."""
    name, doc = next((n, d) for n, d in _docs() if d["kind"] == "Deployment")
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_tinydet_commands_parse_and_probes_hit_the_served_port():
    served = []
    for _, doc in _docs():
        for c in _containers(doc):
            for argv in _tinydet_commands(c):
                ctx = main.make_context("tinydet", list(argv), resilient_parsing=False)
                sub = main.get_command(ctx, argv[0])
                sub_ctx = sub.make_context(argv[0], argv[1:])  # raises on an unknown option or bad value
                if argv[0] == "serve":
                    served.append((c, sub_ctx.params))
    assert served, "no `tinydet serve` in the manifests"
    for c, params in served:
        assert params["on_ray"] and params["host"] == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == params["port"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
