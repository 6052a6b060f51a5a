"""Builds the image as a user would and runs it: `make image-check`.

    python bench/docker/image_check.py [--warm] [--variants cuda,cpu] [--ca BUNDLE]

- starts a Docker daemon when none runs; builds on Docker Hub's python image, or, where Docker Hub cannot be
  reached, on one it makes from Debian's packages (bench/docker/base_image.sh);
- from cold caches (every build cache and the check's images removed first; --warm keeps them): builds the
  default CUDA image from this checkout, rebuilds it after a one-line source change, and builds the CPU image
  offline from a wheelhouse (pip with --no-index: neither PyPI nor PyTorch's index), the CA bundle given as a
  BuildKit secret to every build;
- runs each image on this host (no GPU: the CUDA image serves on CPU) with a read-only root file system and a
  tmpfs /tmp, REFORMER_HOST and REFORMER_PORT choosing where it listens, and checks: /ready within the
  HEALTHCHECK's start period, HEALTHCHECK healthy, a non-root uid, /info, the same answers to /generate,
  /generate_stream and /embed as the service run from this venv, and `docker stop` during a long prompt's
  prefill (the request answered, exit 0 within REFORMER_GRACE_PERIOD_S);
- on the CPU image: a cache larger than `--memory` refused at start-up; under `--restart unless-stopped`,
  the server killed (SIGKILL from the host, as an OOM kill or a crash ends it) back to ready, timed (`docker
  kill` itself is a manual stop to Docker, which this policy leaves stopped: recorded too);
- on both: no compiler or pip cache, OCI labels, the CA secret in no layer and not in the history.

Writes bench/results/image_check.json and prints a table; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.docker import container_checks as checks  # noqa: E402
from bench.docker.docker_host import Docker, build, copy_context, docker_client, run  # noqa: E402
from bench.docker.secret_scan import scan  # noqa: E402
from bench.server_process import ServerProcess, service_argv  # noqa: E402

RESULTS = ROOT / "bench/results/image_check.json"
TAGS = {"cuda": "reformer-serve:check-cuda", "cpu": "reformer-serve:check-cpu"}
PORTS = {"cuda": 18401, "cpu": 18402, "restart": 18403}
START_PERIOD_S = 300  # the Dockerfile's HEALTHCHECK --start-period
TARGETS = {"cuda_build_s": 15 * 60, "rebuild_s": 120, "cpu_image_bytes": 1.5e9, "ready_s": 60}


def torch_cpu_wheels() -> Path:
    """The folder holding the CPU torch wheel (pip's find-links on the build machines)."""
    for line in run([sys.executable, "-m", "pip", "config", "list"]).stdout.splitlines():
        if line.split("=", 1)[0].endswith("find-links"):
            return Path(line.split("=", 1)[1].strip().strip("'"))
    raise SystemExit("no find-links with the CPU torch wheel: pass --torch-wheels DIR")


def fill_wheelhouse(wheelhouse: Path, python: str, torch_wheels: Path, torch_version: str) -> dict[str, Any]:
    """Every wheel the CPU image needs, for the base image's Python on x86-64 Linux: pip download (PyPI), the CPU
    torch wheel from a local folder."""
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    # the base image is Debian bookworm (glibc 2.36): every manylinux tag it runs (llguidance's wheels are 2_31)
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(36, 16, -1)] + ["manylinux2014_x86_64",
                                                                                "linux_x86_64"]
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheelhouse), "--only-binary=:all:",
            "--python-version", python, "--implementation", "cp", "--find-links", str(torch_wheels)]
    for platform in platforms:
        argv += ["--platform", platform]
    start = time.monotonic()
    run([*argv, f"torch=={torch_version}+cpu", *requirements, "setuptools>=68", "wheel"], timeout=1800)
    wheels = list(wheelhouse.glob("*.whl"))
    return {"seconds": round(time.monotonic() - start, 1), "wheels": len(wheels),
            "bytes": sum(w.stat().st_size for w in wheels)}


def check_image(docker: Docker, variant: str, reference: dict[str, Any]) -> dict[str, Any]:
    tag, port = TAGS[variant], PORTS[variant]
    name = f"reformer-check-{variant}"
    url = f"http://{checks.HOST}:{port}"
    checks.run_container(docker, tag, name, port)
    try:
        ready_s = checks.wait_ready(docker, name, url, START_PERIOD_S)
        info = checks.httpx.get(url + "/info", timeout=10).json()
        answers = checks.answers(url)
        same = checks.compare(answers, reference)
        uid = checks.whoami(docker, name)
        healthy_s, health_status = checks.wait_healthy(docker, name, 60)
        health_log = checks.health(docker, name).get("Log", [])
        stop = checks.stop_during_prefill(docker, name, url)
    finally:
        logs = docker("logs", "--tail", "60", name, check=False)
        docker("rm", "-f", name, check=False)
    return {
        "ready_s": round(ready_s, 2), "start_period_s": START_PERIOD_S,
        "healthy_after_s": None if healthy_s is None else round(healthy_s + ready_s, 1),
        "health_status": health_status, "health_last_probe": health_log[-1] if health_log else None,
        "listening": f"{checks.HOST}:{port} (REFORMER_HOST, REFORMER_PORT)", "uid": uid,
        "same_as_venv": same,
        "info": {key: info.get(key) for key in ("version", "device", "dtype", "decode_backend", "kernels", "runs",
                                                "model_id")},
        "docker_stop": stop, "log_tail": (logs.stdout + logs.stderr)[-1500:],
        "passed": (ready_s <= START_PERIOD_S and health_status == "healthy" and uid != 0 and all(same.values())
                   and stop["passed"] and info.get("kernels", {}).get("source", "").startswith("installed:")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", action="store_true", help="keep the build cache (no cold-cache build times)")
    parser.add_argument("--variants", default="cuda,cpu")
    parser.add_argument("--ca", type=Path, default=Path("/etc/ssl/certs/ca-certificates.crt"),
                        help="PEM bundle given to every build as the BuildKit secret `ca`")
    parser.add_argument("--torch-wheels", type=Path, default=None, help="folder holding the CPU torch wheel")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-build", action="store_true", help="run the images the last check built")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    docker = Docker(docker_client())
    result: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "commit": run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip(),
                              "load_before": os.getloadavg(), "cores": os.cpu_count(), "docker_client": docker.cli,
                              "daemon": docker.ensure_daemon()}
    base, result["base_image_source"] = docker.base_image()
    result["base_image"] = base
    python = docker("run", "--rm", "--network", "none", base, "python3", "-c",
                    "import sys; print('%d.%d' % sys.version_info[:2])").stdout.strip()
    result["base_python"] = python
    if not args.warm and not args.no_build:
        for tag in TAGS.values():
            docker("rmi", "-f", tag, check=False)
        docker("builder", "prune", "-af", timeout=1800)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_version = run(["sed", "-n", "s/^ARG TORCH_VERSION=//p", "Dockerfile"]).stdout.strip()
    common = {"PYTHON_IMAGE": base, "VERSION": pyproject["project"]["version"],
              "REVISION": run(["git", "rev-parse", "HEAD"]).stdout.strip()}
    logs = Path(tempfile.mkdtemp(prefix="image_check-"))
    result["logs"] = str(logs)
    builds: dict[str, Any] = {}
    if "cuda" in variants and not args.no_build:
        if list((ROOT / "wheelhouse").glob("*.whl")):
            raise SystemExit("wheelhouse/ holds wheels: the CUDA build would be offline from them; empty it first")
        cuda = build(docker, TAGS["cuda"], ROOT, common, secret_ca=args.ca, log_path=logs / "build-cuda.log")
        builds["cuda"] = {"seconds": round(cuda.seconds, 1), "context_bytes": cuda.context_bytes,
                          "image_bytes": docker.size(TAGS["cuda"]), "cold_cache": not args.warm}
        changed = copy_context(logs / "context-changed")
        with (changed / "service/__init__.py").open("a") as source:
            source.write("# a source change for the rebuild check\n")
        again = build(docker, TAGS["cuda"] + "-rebuild", changed, common, secret_ca=args.ca,
                      log_path=logs / "build-cuda-rebuild.log")
        builds["cuda_rebuild_after_source_change"] = {
            "seconds": round(again.seconds, 1), "deps_layer_cached": step_cached(again.log, "install.sh deps")}
        docker("rmi", TAGS["cuda"] + "-rebuild", check=False)
    if "cpu" in variants and not args.no_build:
        offline = copy_context(logs / "context-offline")
        wheelhouse = fill_wheelhouse(offline / "wheelhouse", python, args.torch_wheels or torch_cpu_wheels(),
                                     torch_version)
        cpu = build(docker, TAGS["cpu"], offline, {**common, "VARIANT": "cpu"}, secret_ca=args.ca,
                    log_path=logs / "build-cpu.log")
        builds["cpu"] = {"seconds": round(cpu.seconds, 1), "context_bytes": cpu.context_bytes,
                         "image_bytes": docker.size(TAGS["cpu"]), "cold_cache": not args.warm,
                         "wheelhouse": wheelhouse,
                         "pip_no_index": "installing from /wheelhouse only (--no-index)" in cpu.log}
    result["builds"] = builds

    with ServerProcess(service_argv(), log_path=logs / "venv-server.log") as server:
        server.wait_ready()
        reference = checks.answers(server.url)
    result["venv_reference"] = {"command": " ".join(service_argv()), "generated_text":
                                reference["generate"].get("generated_text")}
    runs: dict[str, Any] = {}
    for variant in variants:
        runs[variant] = guarded(check_image, docker, variant, reference)
        if "error" in runs[variant]:
            continue
        runs[variant]["labels"] = checks.labels(docker, TAGS[variant])
        runs[variant]["healthcheck"] = checks.healthcheck_config(docker, TAGS[variant])
        runs[variant]["runtime_contents"] = checks.runtime_contents(docker, TAGS[variant])
        runs[variant]["ca_secret"] = scan(docker, TAGS[variant], base, args.ca)
    faults_on = "cpu" if "cpu" in variants else variants[0]
    result["faults"] = {"image": TAGS[faults_on],
                        "memory_limit_refusal": checks.memory_limit_refusal(docker, TAGS[faults_on]),
                        "restart_after_kill": guarded(checks.restart_after_kill, docker, TAGS[faults_on],
                                                      "reformer-check-restart", PORTS["restart"])}
    result["runs"] = runs
    result["load_after"] = os.getloadavg()
    result["passed"] = check_targets(result)
    checks.write_json(args.out, result)
    print_table(result)
    return 0 if all(result["passed"].values()) else 1


def guarded(check: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """A check's figures, or its failure as a result (the other checks still run and are written)."""
    try:
        return check(*args)
    except Exception as err:  # noqa: BLE001 - any failure of the check is its result
        return {"passed": False, "error": repr(err)[-2000:]}


def step_cached(log: str, step: str) -> bool:
    """Whether BuildKit's plain log shows the RUN naming `step` as taken from the cache."""
    ids = re.findall(rf"^#(\d+) \[[^\]]+\] RUN .*{re.escape(step)}", log, flags=re.M)
    return bool(ids) and all(re.search(rf"^#{i} CACHED$", log, flags=re.M) for i in ids)


def check_targets(result: dict[str, Any]) -> dict[str, bool]:
    builds, runs, faults = result["builds"], result["runs"], result["faults"]
    passed = {f"run_{variant}": run_["passed"] and run_["runtime_contents"]["passed"] and run_["ca_secret"]["passed"]
              and len(run_["labels"]) >= 3 for variant, run_ in runs.items() if "error" not in run_}
    passed.update({f"run_{variant}": False for variant, run_ in runs.items() if "error" in run_})
    passed.update({f"ready_{variant}": run_["ready_s"] <= TARGETS["ready_s"] for variant, run_ in runs.items()
                   if "error" not in run_})
    if "cuda" in builds:
        passed["cuda_build"] = builds["cuda"]["seconds"] <= TARGETS["cuda_build_s"]
        passed["rebuild"] = builds["cuda_rebuild_after_source_change"]["seconds"] <= TARGETS["rebuild_s"]
    if "cpu" in builds:
        passed["cpu_image_size"] = builds["cpu"]["image_bytes"] <= TARGETS["cpu_image_bytes"]
        passed["cpu_offline"] = builds["cpu"]["pip_no_index"]
    passed["memory_limit_refusal"] = faults["memory_limit_refusal"]["passed"]
    passed["restart_after_kill"] = faults["restart_after_kill"]["passed"]
    return passed


def print_table(result: dict[str, Any]) -> None:
    print(f"image check {result['date']} at {result['commit']}, base {result['base_image']} "
          f"({result['base_image_source']}), load {result['load_before'][0]:.2f} before, "
          f"{result['load_after'][0]:.2f} after, {result['cores']} cores")
    for variant, b in result["builds"].items():
        size = f", image {b['image_bytes'] / 1e9:.2f} GB" if "image_bytes" in b else ""
        context = f", context {b['context_bytes'] / 1e6:.1f} MB" if b.get("context_bytes") else ""
        print(f"  build {variant:<34} {b['seconds']:7.1f} s{size}{context}")
    for variant, r in result["runs"].items():
        if "error" in r:
            print(f"  run {variant}: FAILED {r['error'][-300:]}")
            continue
        stop = r["docker_stop"]
        print(f"  run {variant}: ready {r['ready_s']:.1f} s, healthy after {r['healthy_after_s']} s, uid {r['uid']}, "
              f"same as venv {r['same_as_venv']}, kernels {r['info']['kernels'].get('source')}")
        print(f"    docker stop in prefill: request {stop['request'].get('status')} "
              f"({stop['request'].get('tokens')} tokens, {stop['request']['request_s']:.1f} s), "
              f"exit {stop['exit_code']} after {stop['stop_s']} s (grace {stop['grace_period_s']} s); "
              f"no compiler/pip cache {r['runtime_contents']['passed']}; CA secret in no layer "
              f"{r['ca_secret']['passed']}")
    faults = result["faults"]
    print(f"  --memory 1g with a 2 GiB cache: exit {faults['memory_limit_refusal']['exit_code']} in "
          f"{faults['memory_limit_refusal']['seconds']} s: {faults['memory_limit_refusal']['message'][:110]}")
    restart = faults["restart_after_kill"]
    print(rf"  --restart unless-stopped: after `docker kill` {restart.get('after_docker_kill')}; after SIGKILL of "
          f"the server process ready again in {restart.get('seconds_to_ready')} s")
    print("  passed: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in result["passed"].items()))


if __name__ == "__main__":
    sys.exit(main())
