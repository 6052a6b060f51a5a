"""`reformer serve`: parse the settings, load the artifact (a bad one stops start-up with a message naming the
file and exit status 2), and run uvicorn.

SIGTERM (or Ctrl-C) drains: new API requests get 503 and /ready turns 503 while in-flight requests finish,
for at most `grace_period_s`; then the process exits 0 at once (skipping the interpreter's slow teardown). A
second signal exits at once. If the model worker dies, the process exits 1 so that an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import NoReturn

import uvicorn
from pydantic import ValidationError

from model.decoding.runtime import fit_threads_to_container, tune_cpu_runtime
from service.api.app import create_app
from service.api.state import ServiceState, prefix_cache_config
from service.engine.backends import kv_cache_dtype, resolve_device, resolve_dtype
from service.observability.logs import configure_logging
from service.settings import settings_from_argv

log = logging.getLogger("service.server")

# Time uvicorn gives idle keep-alive connections to close once the drain is over.
CLOSE_CONNECTIONS_S = 2.0
SWITCH_INTERVAL_S = 0.0005


def apply_process_settings() -> dict[str, bool]:
    """The process-wide settings `reformer serve` runs the engine under (benchmarks that drive the engine in
    their own process apply them too, bench/prefill/prefill_gap.py); returns which of tune_cpu_runtime's settings took
    effect.

    The model worker thread holds the GIL between torch calls; at Python's default 5 ms switch interval
    every await of the event loop can wait that long for it back (a convoy), which made answers that need
    no model at all (429, 503, /health) take seconds under load. 0.5 ms keeps the loop responsive."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return tune_cpu_runtime()  # denormals flushed, large blocks kept (model/decoding/runtime.py)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServiceState, grace_period_s: float):
        super().__init__(config)
        self.state = state
        self.grace_period_s = grace_period_s
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise the signal after shutdown and the
        # process would die of it instead of exiting 0 after a clean drain.
        if self._draining or self._loop is None:
            log.warning("second signal %s: exiting now", signal.Signals(sig).name)
            self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        self.state.draining = True
        log.info("signal %s: draining %d in-flight requests (grace period %.1f s)",
                 signal.Signals(sig).name, self.state.inflight, self.grace_period_s)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_period_s
        while self.state.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.inflight > 0:
            log.warning("grace period over with %d requests still in flight; exiting", self.state.inflight)
        else:
            log.info("drained; exiting")
        self.should_exit = True

    def fatal(self, exc: BaseException) -> None:
        """The model worker died: exit non-zero (callable from any thread)."""
        self.exit_code = 1
        if self._loop is not None:
            self._loop.call_soon_threadsafe(setattr, self, "should_exit", True)
        else:
            self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    try:
        settings = settings_from_argv(list(sys.argv[1:] if argv is None else argv))
    except ValidationError as err:
        print(f"reformer serve: invalid settings:\n{err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_json)
    try:  # settings that contradict each other only once the device and dtype are known
        kv_cache_dtype(settings.kv_cache_dtype, resolve_dtype(settings.dtype, resolve_device(settings.device)))
    except RuntimeError as err:
        print(f"reformer serve: invalid settings: {err}", file=sys.stderr)
        return 2
    # the kernels' loader reads the same variable: a flag or .env setting reaches it too
    os.environ["REFORMER_CPU_KERNELS"] = settings.cpu_kernels
    if settings.cpu_kernels == "on" and resolve_device(settings.device).type == "cpu":
        from model.kernels import load as load_kernels

        status = load_kernels()
        if not status.loaded:
            print(f"reformer serve: REFORMER_CPU_KERNELS=on but the C kernels cannot load ({status.source}): "
                  f"{status.reason}", file=sys.stderr)
            return 2
    if settings.prefix_cache and settings.prefix_cache_dir is not None:
        problem = unusable_folder(settings.prefix_cache_dir)
        if problem:
            print(f"reformer serve: REFORMER_PREFIX_CACHE_DIR {settings.prefix_cache_dir}: {problem}", file=sys.stderr)
            return 2
        try:  # a key too short, or a key file that cannot be read, is refused before the model loads
            prefix_cache_config(settings)
        except (ValueError, OSError) as err:
            print(f"reformer serve: invalid settings: {err}", file=sys.stderr)
            return 2
    from export import ArtifactError, load_artifact

    try:
        artifact = load_artifact(settings.artifact) if settings.artifact is not None else load_artifact()
    except (ArtifactError, OSError, ValueError) as err:
        log.critical("cannot serve the artifact: %s", err)
        print(f"reformer serve: cannot load the artifact: {err}", file=sys.stderr)
        return 2
    log.info("cpu runtime: %s", apply_process_settings())
    fitted = fit_threads_to_container()
    if fitted is not None:
        log.info("intra-op threads lowered to the container's CPU quota: %d", fitted)
    app = create_app(settings, artifact)
    state: ServiceState = app.state.service
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False, lifespan="on",
        timeout_graceful_shutdown=int(CLOSE_CONNECTIONS_S), workers=1,
    )
    server = DrainingServer(config, state, settings.grace_period_s)
    state.on_fatal = server.fatal
    server.run()
    if server.exit_code:
        log.critical("exiting with status %d: the model worker died", server.exit_code)
    end_process(server.exit_code)
    return server.exit_code  # not reached


def unusable_folder(folder: Path) -> str | None:
    """Why the disk tier cannot use `folder` (created if missing), or None when a file can be written there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as err:
        return f"cannot write there ({err.strerror or err})"
    return None


def end_process(code: int) -> NoReturn:
    """Exit now, skipping the interpreter's teardown. Uvicorn has returned: the drain is over, the model
    worker has stopped and the log is flushed here; what teardown would add is freeing every module torch
    loaded, which took 2-5 s on a loaded 2-core machine (0.07 s without it), while an orchestrator waits
    on a process that no longer serves. Nothing of ours runs at exit (no atexit handlers to lose)."""
    log.info("exiting with status %d", code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
