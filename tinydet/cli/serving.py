"""The commands that serve a model over HTTP: serve (one process, or replicas on Ray) and rollout
(a Ray deployment moved to a new model or version), with the options they share (replica_options)."""

from __future__ import annotations

import click

from ..errors import TinydetError
from ..packing.names import DTYPES
from . import common
from .common import (check_sha256_option, cli_errors, device_option, json_object, loader, model_option,
                     no_memory_check_option, no_panel_cache_option)


def _cluster_module():
    try:
        from ..serve import cluster
    except ImportError as e:
        raise TinydetError(f"--ray needs the ray extra ({e.name} is missing): pip install 'tinydet[ray]'") from None
    return cluster


def _replica_spec(cluster, model_name, dtype, threads, max_batch, max_queue, prefill_chunk, prefix_cache_mb, api_key,
                  log_path, served_model_name, canary_file, canary_interval, verify, speculative=None) -> dict:
    """What each replica runs: the model resolved here (pulled and verified once) and pinned by its
    SHA-256, which every replica checks before its gate; a draft model (--speculative) resolved here too."""
    from pathlib import Path

    from ..api import check_speculative
    from ..hashing import model_sha256
    from ..registry import DEFAULT_MODEL, known_models, resolve_model

    check_speculative(speculative)
    if speculative and speculative not in ("ngram", *DTYPES):  # a draft model: pulled here, once
        speculative = str(resolve_model(speculative, verify=verify).resolve())
    name = model_name or DEFAULT_MODEL
    path = resolve_model(name, verify=verify).resolve()
    served = served_model_name or (name if name in known_models() else Path(name).name)
    return cluster.spec(str(path), dtype, threads or 1, served, max_batch, max_queue, prefill_chunk,
                        prefix_cache_mb << 20, api_key, log_path and str(Path(log_path).resolve()),
                        canary_file and str(Path(canary_file).resolve()), 60 * canary_interval,
                        sha256=model_sha256(path), check_memory=None if common._memory_check else False,
                        speculative=speculative)


def replica_options(fn):
    """The options of a served model, shared by `serve` and `rollout`."""
    options = [
        model_option,
        click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True,
                     help=common.DTYPE_HELP),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="Default: the CPUs available; on Ray (--ray, rollout), 1 per replica."),
        click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
                     help="Sequences computed together (KV-cache slots)."),
        click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
                     help="Requests waiting for a slot before new ones get 429."),
        click.option("--prefill-chunk", type=click.IntRange(min=1), default=512, show_default=True,
                     help="Tokens per step (prompt chunks plus one per running sequence), so a long prompt does "
                          "not stall running streams."),
        click.option("--prefix-cache", "prefix_cache_mb", type=click.IntRange(min=0), default=256, show_default=True,
                     help="MiB of keys and values kept for prompt prefixes seen before (0 = off)."),
        click.option("--api-key", envvar="TINYDET_API_KEY", default=None,
                     help="Require `Authorization: Bearer KEY` on /v1 (or set TINYDET_API_KEY)."),
        click.option("--log", "log_path", type=click.Path(dir_okay=False), default=None,
                     help="Append one JSON line per request (answered or refused) to this file."),
        click.option("--served-model-name", default=None, help="The model's name in the API. Default: the known "
                     "model's name, or the file or directory name (rollout: the name in use)."),
        click.option("--canary", "canary_file", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="A golden file (`tinydet golden --write`) whose cases for this dtype are the determinism "
                          "canary. Default: the model manifest's golden case."),
        click.option("--canary-interval", type=click.FloatRange(min=0), default=10.0, show_default=True,
                     help="Minutes between canary runs after the one at start (0 = only at start)."),
        check_sha256_option("Re-hash a known model's file against its manifest's SHA-256 before use."),
        no_memory_check_option,
        no_panel_cache_option,
        common.speculative_option,
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@click.command()
@replica_options
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 = any free port.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds running requests get to finish after SIGTERM.")
@click.option("--ray", "on_ray", is_flag=True, help="Serve replicas on Ray Serve (the ray extra), each gated by the "
              "model's golden hashes before it takes traffic.")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="With --ray: replicas of the model (each with --threads threads, default 1). Default: 2.")
@click.option("--ray-address", default=None, help="With --ray: the Ray cluster to join (e.g. auto, or "
              "ray://host:10001). Default: start a local one, stopped on exit.")
@device_option
@cli_errors
def serve(model_name, host, port, dtype, threads, max_batch, max_queue, prefill_chunk, prefix_cache_mb, api_key,
          log_path, served_model_name, canary_file, canary_interval, shutdown_timeout, check_sha256, speculative,
          on_ray, replicas, ray_address, device):
    """Serve a model over HTTP. Same system_fingerprint + same request + same seed = the same bytes,
    under any load. Sampling follows OpenAI's defaults (temperature 1), not generate's.

    \b
    Endpoints:
      POST /v1/completions          OpenAI's completions (streamed or not)
      POST /v1/chat/completions     chat through the model's template; tools, reasoning
      POST /v1/responses            OpenAI's Responses API (stateless)
      GET  /v1/models, /v1/models/NAME
      POST /tokenize, /detokenize   vLLM's: text to token ids and back
      GET  /tokenizer_info          vLLM's: the tokenizer's settings (lm-evaluation-harness reads it)
      GET  /health                  200 once loaded and the canary passed, else 503; the fingerprint
      GET  /metrics                 Prometheus text
    """
    import logging
    from pathlib import Path

    if on_ray and device != "cpu":
        raise TinydetError("--device: Ray replicas run on the CPU (--device cpu); serve a GPU without --ray")
    if on_ray:
        cluster = _cluster_module()
        spec = _replica_spec(cluster, model_name, dtype, threads, max_batch, max_queue, prefill_chunk, prefix_cache_mb,
                             api_key, log_path, served_model_name, canary_file, canary_interval, check_sha256,
                             speculative)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        cluster.run(spec, replicas or 2, host, port, ray_address, shutdown_timeout,
                    echo=lambda m: click.echo(m, err=True))
        return
    if replicas is not None or ray_address is not None:
        raise TinydetError("--replicas and --ray-address go with --ray")
    from ..api import check_speculative

    check_speculative(speculative)  # before the load

    try:
        from .. import serve as serving
        from ..serve.service import Service
    except ImportError as e:
        raise TinydetError(f"tinydet serve needs the serve extra ({e.name} is missing): "
                           "pip install 'tinydet[serve]'") from None
    from ..registry import DEFAULT_MODEL, known_models

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    name = model_name or DEFAULT_MODEL
    if served_model_name is None:
        served_model_name = name if name in known_models() else Path(name).name
    load = loader()  # now: the service calls it on a thread of its own, where there is no click context
    def load_model():
        model = load(model_name, dtype, threads, check_sha256, device=device)
        model.speculative = speculative  # the same bytes, so the fingerprint does not name it
        return model

    service = Service(load_model, served_model_name, max_batch,
                      max_queue, prefill_chunk, prefix_cache_mb << 20, api_key, log_path, canary_file,
                      60 * canary_interval)
    serving.run(service, host, port, shutdown_timeout,
                on_bound=lambda p: click.echo(f"tinydet serve: {served_model_name} on http://{host}:{p} "
                                              "(loading; /health says when ready)", err=True))


@click.command()
@replica_options
@click.option("--replicas", type=click.IntRange(min=1), default=2, show_default=True,
              help="Replicas of the new version (each with --threads threads, default 1).")
@click.option("--ray-address", default="auto", show_default=True, help="The Ray cluster that runs `tinydet serve --ray`.")
@click.option("--probe", "probe_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help='Probe requests, JSON Lines of {"path": "/v1/completions", "body": {...}}. Default: three built in.')
@click.option("--steps", default="0.1,0.5,1", show_default=True,
              help="The new version's share of traffic at each step, increasing, the last 1.")
@click.option("--step-seconds", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="How long the new replicas must stay healthy at each step.")
@click.option("--record", "record_path", type=click.Path(dir_okay=False), default=None,
              help="Write the outcome (plan, fingerprint, the new baseline's probe hashes) to this JSON file.")
@click.option("--runtime-env", "runtime_env_json", default=None,
              help='Ray\'s runtime_env for the new replicas, as JSON: e.g. {"pip": ["tinydet==0.2.0"]} for another '
                   "tinydet version.")
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
@cli_errors
def rollout(model_name, dtype, threads, max_batch, max_queue, prefill_chunk, prefix_cache_mb, api_key, log_path,
            served_model_name, canary_file, canary_interval, check_sha256, speculative, replicas, ray_address, probe_file,
            steps, step_seconds, record_path, runtime_env_json, dry_run):
    """Roll a `tinydet serve --ray` deployment over to a new model or tinydet version: new replicas
    beside the old ones, each through its golden gate; probes compared with the old replicas' answers
    (byte-identical under the same fingerprint, else recorded as the new baseline); traffic shifted in
    steps; the old retired. Any failure rolls back (exit 1)."""
    import logging

    cluster = _cluster_module()
    from ..serve import rollout as ro

    try:
        shares = [float(x) for x in steps.split(",")]
    except ValueError:
        shares = []
    if not shares or shares[-1] != 1.0 or any(a >= b for a, b in zip([0.0, *shares], shares)):
        raise TinydetError(f"--steps {steps}: expected increasing shares in (0, 1], the last 1 (e.g. 0.1,0.5,1)")
    probes = ro.read_probes(probe_file) if probe_file else ro.DEFAULT_PROBES
    runtime_env = json_object("--runtime-env", runtime_env_json or None)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cluster.connect(ray_address)
    try:
        table = cluster.current_table() if cluster.running() else None
        if not table or not table["backends"]:
            raise TinydetError(f"no tinydet deployment runs on the Ray cluster at {ray_address} "
                               "(start one with `tinydet serve --ray`)")
        if served_model_name is None:
            served_model_name = cluster.backend_info(table["backends"][0]["app"])["name"]
        spec = _replica_spec(cluster, model_name, dtype, threads, max_batch, max_queue, prefill_chunk, prefix_cache_mb,
                             api_key, log_path, served_model_name, canary_file, canary_interval, check_sha256,
                             speculative)
        try:
            out = ro.rollout(spec, replicas, probes, shares, step_seconds, dry_run, runtime_env, echo=click.echo)
        except ro.RolloutFailed as e:
            raise TinydetError(f"rollout failed and was rolled back: {e}") from None
        if record_path:
            from ..jsonfile import write_json

            write_json(record_path, out)
        click.echo("dry run: nothing changed" if dry_run else f"rolled out: {out['fingerprint']}")
    finally:
        import ray

        ray.shutdown()
