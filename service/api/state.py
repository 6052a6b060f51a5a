"""What the routes share, built apart from the app (vLLM's init_app_state apart from build_app): settings,
metrics, and once loaded the artifact, the limits and the engine. Below the routers in the import order:
service/api/routes/ imports this module, service/api/app.py imports both."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from model.fused_attention import c_kernel_runs, use_c_kernels
from model.kernels import load as load_kernels
from model.pooling import STANDARDIZED_POOLINGS
from service.api.protocol import Limits
from service.engine.backends import (
    OnnxBackend,
    TorchBackend,
    kv_cache_dtype,
    resolve_backend,
    resolve_device,
    resolve_dtype,
)
from service.engine.core import Engine, EngineConfig
from service.observability.metrics import ServiceMetrics
from service.prefix_cache import PrefixCacheConfig, resolve_key
from service.settings import Settings
from service.text.structured import ENGINE, GrammarCompiler, engine_version
from service.text.tokenizing import Tokenizing


def package_version() -> str:
    try:
        return version("reformer-serve")
    except PackageNotFoundError:
        return "0+unknown"


def config_dict(config: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def position_limits(cfg: Any) -> tuple[int, int]:
    """(longest prompt, positions) the model can take. The forward pass pads a sequence to a multiple of its
    chunk lengths, and the padded length must fit in max_position_embeddings: where that is no such multiple,
    the last few lengths below it cannot be run at all."""
    positions = int(cfg.max_position_embeddings)
    longest = positions
    padded_length = getattr(cfg, "padded_length", None)
    if padded_length is not None:
        while longest > 1 and padded_length(longest) > positions:
            longest -= 1
    return longest, positions


def kernel_report(mode: str) -> dict[str, Any]:
    """The C kernels as REFORMER_CPU_KERNELS asks (`mode`) and as they loaded: their build (`installed:<variant>`,
    `first-use build`, `off`, `unavailable`) and, when they did not load, why."""
    if mode == "off":
        return {"mode": mode, "loaded": False, "source": "off", "reason": "REFORMER_CPU_KERNELS=off", "path": None}
    status = load_kernels()
    return {"mode": mode, "loaded": status.loaded, "source": status.source, "reason": status.reason,
            "path": status.kernels.path.name if status.kernels is not None else None}


def prefix_cache_config(s: Settings) -> PrefixCacheConfig:
    """The prefix cache's settings; ValueError naming the key setting when the disk tier's key is unusable."""
    key = None
    if s.prefix_cache_dir is not None:
        secret = s.prefix_cache_key.get_secret_value() if s.prefix_cache_key is not None else None
        key = resolve_key(secret, s.prefix_cache_key_file)
    return PrefixCacheConfig(
        -1 if s.prefix_cache_bytes is None else s.prefix_cache_bytes, s.prefix_cache_min_tokens,
        s.prefix_cache_dir, s.prefix_cache_dir_bytes, key=key, ttl_s=s.prefix_cache_ttl_s,
        disk_ttl_s=s.prefix_cache_dir_ttl_s or None, write_queue_bytes=s.prefix_cache_write_queue_bytes)


class ServiceState:
    """Everything the routes share: settings, metrics, and once loaded the artifact and the engine."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = ServiceMetrics(engine_source=lambda: self.engine, debug_memory=settings.debug_memory)
        self.artifact: Any = None
        self.engine: Engine | None = None
        self.limits: Limits | None = None
        self.grammars: GrammarCompiler | None = None  # structured output's compiler, once the tokenizer is here
        self.model_id = settings.served_model_name or "reformer"
        self.backend_name = "torch"
        self.device = "cpu"
        self.dtype = "float32"
        self.embedding_dim = 0
        self.embedding_stats: Any = None  # what mean-pooled embeddings are whitened/standardised with; None: raw
        self.created = int(time.time())
        self.draining = False
        self.load_error: str | None = None
        self.inflight = 0
        self.tokenizing = Tokenizing(settings.tokenize_threads)  # request texts are tokenized off the loop
        self._inflight_lock = threading.Lock()
        # Called (from any thread) when the model worker dies; the server makes the process exit non-zero.
        self.on_fatal: Callable[[BaseException], None] = lambda exc: None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready.is_set() and self.engine.alive

    def unavailable_reason(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if self.engine is not None and not self.engine.alive and self.engine.ready.is_set():
            return "the model worker is not running"
        if not self.ready:
            return "the model is loading" if self.load_error is None else "the model failed to load"
        return None

    def count_inflight(self, delta: int) -> None:
        with self._inflight_lock:
            self.inflight += delta

    def load(self, artifact: Any) -> None:
        """Place the model, pick the backend, start the engine (warm-up runs on the worker thread)."""
        from export import load_artifact

        s = self.settings
        if artifact is None:
            artifact = load_artifact(s.artifact) if s.artifact is not None else load_artifact()
        self.artifact = artifact
        device = resolve_device(s.device)
        dtype = resolve_dtype(s.dtype, device)
        model = artifact.model.to(device=device, dtype=dtype).eval()
        use_c_kernels(model, s.cpu_kernels != "off")  # a forward's chunk windows too (model/fused_attention.py)
        self.backend_name = resolve_backend(s.backend, device, getattr(artifact, "onnx_path", None))
        self.embedding_stats = getattr(artifact, "embedding_stats", None) if s.embed_standardize else None
        backend = (
            OnnxBackend(artifact.onnx_path, device, self.embedding_stats) if self.backend_name == "onnxruntime"
            else TorchBackend(model, device, self.embedding_stats)
        )
        self.device, self.dtype = str(device), str(dtype).removeprefix("torch.")
        cfg = artifact.config
        self.embedding_dim = 2 * int(cfg.hidden_size)
        self.model_id = s.served_model_name or artifact.path.name
        longest_prompt, positions = position_limits(cfg)
        self.limits = Limits(
            max_input_tokens=min(s.max_input_tokens or longest_prompt, longest_prompt),
            max_total_tokens=positions,
            max_new_tokens=s.max_new_tokens,
            default_new_tokens=s.default_new_tokens,
            max_stop_sequences=s.max_stop_sequences,
            max_client_batch_size=s.max_client_batch_size,
        )
        structured = self.metrics.structured
        self.grammars = GrammarCompiler(
            artifact.tokenizer, cache_entries=s.structured_cache_size, timeout_s=s.structured_compile_timeout_s,
            max_source_bytes=s.structured_max_bytes, on_compiled=structured.compile_time.observe,
            on_refused=lambda reason: structured.refused.labels(reason).inc())
        config = EngineConfig(
            max_batch_size=s.max_batch_size, max_batch_tokens=s.max_batch_tokens, max_wait_ms=s.max_wait_ms,
            prefill_budget_ms=s.prefill_budget_ms, max_queue_size=s.max_queue_size, idle_trim_s=s.idle_trim_s,
            memory_budget_bytes=s.memory_budget_mb * 2**20, busy_trim_s=s.busy_trim_s,
            cache_keep_bytes=s.cache_keep_mb * 2**20,
            request_timeout_s=s.request_timeout_s, warmup=s.warmup,
            cache_bytes=s.cache_bytes, batch_invariant=s.batch_invariant, cuda_graphs=s.cuda_graphs,
            cpu_kernels=s.cpu_kernels != "off", kv_cache_dtype=kv_cache_dtype(s.kv_cache_dtype, dtype),
            decode_weights=s.decode_weights,
            max_request_tokens=min(self.limits.max_input_tokens + self.limits.max_new_tokens, positions),
            prefix_cache=prefix_cache_config(s) if s.prefix_cache else None,
            report_cached_tokens=s.prefix_cache_report,
            artifact_sha256=artifact.sha256, prefill=s.prefill,
        )
        engine = Engine(model, artifact.tokenizer, backend, device, config, self.metrics,
                        on_fatal=lambda exc: self.on_fatal(exc))
        engine.start()
        # published only once its worker runs: between construction and start `alive` is False, and /health
        # would call a loading service dead
        self.engine = engine
        runs = self.runs()
        self.metrics.model_info.labels(artifact.sha256, self.model_id, self.backend_name, runs["decode_step"],
                                       self.device, self.dtype).set(1)
        self.metrics.backend_info.labels(runs["decode_step"], runs["decode_attention"], runs["prefill_attention"],
                                         self.device, kernel_report(s.cpu_kernels)["source"],
                                         runs["decode_weights"]).set(1)

    def runs(self) -> dict[str, str]:
        """Which code runs each part now (model/decoding/step.py `Decoder.describe`, the forward's kernel)."""
        if self.engine is None:
            return {"decode_step": "torch", "decode_attention": "torch", "prefill_attention": "torch",
                    "decode_weights": "float32"}
        runner = self.engine.runner
        out = runner.decoder.describe()
        if runner.graphs is not None:
            out["decode_step"] = "cuda-graphs"
        model = self.engine.model
        param = next(model.parameters())
        out["prefill_attention"] = ("c" if c_kernel_runs(model) else "torch-cuda-efficient" if param.is_cuda
                                    else "torch-flash" if param.dtype in (torch.float32, torch.bfloat16)
                                    else "torch")
        return out

    def info(self) -> dict[str, Any]:
        art = self.artifact
        s = self.settings
        params = sum(p.numel() for p in art.model.parameters()) if art is not None else 0
        runs = self.runs()
        limits = self.limits
        return {
            "model_id": self.model_id,
            # TGI's top-level fields, for its clients (model_sha: the artifact's sha256, this server's revision)
            "model_sha": getattr(art, "sha256", None),
            "max_input_tokens": limits.max_input_tokens if limits else None,
            "max_total_tokens": limits.max_total_tokens if limits else None,
            "max_best_of": limits.max_best_of if limits else None,
            "max_stop_sequences": limits.max_stop_sequences if limits else None,
            "model_sha256": getattr(art, "sha256", None),
            "model_config": config_dict(art.config) if art is not None else {},
            "model_parameters": params,
            # The artifact by name and sha256 only: a client has no business knowing the server's filesystem.
            "artifact_name": art.path.name if art is not None else None,
            "backend": self.backend_name,
            # what runs, not what was asked: the decode step (c-fused, c-per-layer, torch, cuda-graphs), its
            # attention, a forward's chunk-window attention (prefill, embeddings), the weights the step's C
            # products read (decode_weights: float32, bfloat16, int8) and the C kernels' build
            "decode_backend": runs["decode_step"],
            "runs": runs,
            "kernels": kernel_report(self.settings.cpu_kernels),
            # Which engine runs each stage: embeddings on the chosen backend; prefill and decode steps on torch
            # (the ONNX graph is the plain forward pass, without the LSH window cache decoding needs).
            "backends": {"embeddings": self.backend_name, "prefill": "torch", "decode": "torch"},
            "device": self.device,
            "dtype": self.dtype,
            "embedding_dimension": self.embedding_dim,
            # pooling "mean" is transformed with the artifact's training statistics (when it ships them and
            # embed_standardize is on) before any L2 normalisation: "whitening", (v - mean) @ W, when the file
            # holds the matrix, else "per-dimension", (v - mean) / std; pooling "last" is raw
            "embedding_standardization": {
                "standardized": self.embedding_stats is not None,
                "method": self.embedding_stats.method if self.embedding_stats is not None else None,
                "poolings": list(STANDARDIZED_POOLINGS) if self.embedding_stats is not None else [],
                "artifact_has_stats": getattr(art, "embedding_stats", None) is not None,
            },
            "limits": dataclasses.asdict(self.limits) if self.limits else {},
            "batching": {
                "max_batch_size": s.max_batch_size, "max_batch_tokens": s.max_batch_tokens,
                "max_wait_ms": s.max_wait_ms, "prefill_budget_ms": s.prefill_budget_ms,
                "max_queue_size": s.max_queue_size,
                # how prompts are read: one-piece or causal (REFORMER_PREFILL, auto resolved on this model and device)
                "prefill": ("causal" if self.engine.causal_prefill else "one-piece") if self.engine
                else s.prefill,
                "prefill_setting": s.prefill,
                "request_timeout_s": s.request_timeout_s,
                # bit-identical to a request alone (fixed row blocks), or the same greedy tokens within 1e-4
                "batch_invariant": s.batch_invariant,
                # whether CUDA graphs are on (only ever on CUDA; a shape whose capture fails still runs eagerly)
                "cuda_graphs": self.engine.runner.graphs is not None if self.engine else False,
                "decode_cache_bytes": self.engine.runner.cache.capacity_bytes if self.engine else None,
                # whether decode steps attend through the C window kernel (False: PyTorch ops; on GPU always)
                "cpu_window_kernel": self.engine.runner.decoder.backends.window is not None if self.engine
                else False,
                # whether the C step kernels (step_linear.c, step_layers.c) are loaded: a float32 CPU step runs
                # its layers in them (model/decoding/steps/fused.py)
                "cpu_step_kernel": self.engine.runner.decoder.backends.linears.kernel is not None if self.engine
                else False,
                # whether a forward (prefill, embeddings) attends its chunk windows through the C kernel
                # (model/kernels/csrc/chunk_attend.c; float32 on CPU)
                "cpu_chunk_kernel": c_kernel_runs(self.engine.model) if self.engine else False,
                "kv_cache_dtype": str(self.engine.runner.cache.kv_dtype).removeprefix("torch.") if self.engine
                else None,
            },
            # the prefix cache's setting, capacity and contents now (service/prefix_cache/)
            "prefix_cache": ({**self.engine.prefix_cache.describe(),
                              # whether a finished causal request leaves its prompt's blocks in the decode cache
                              # for a later one to share (service/engine/live_prefixes.py), and what they hold now
                              "kept_prefixes": self.engine.generations.reuse.keeps_prefixes,
                              "kept_prefix_bytes": self.engine.runner.cache.kept_prefix_bytes}
                             if self.engine and self.engine.prefix_cache else {"enabled": False}),
            # when the worker returns the heap's free pages (service/memory.py), and whether it can here
            "memory": self.engine.memory.describe() if self.engine else {},
            # what compiles and enforces structured output (service/text/structured/)
            "structured_output": {"engine": ENGINE, "version": engine_version()},
            "version": package_version(),
            "settings": public_settings(s),
        }


def public_settings(settings: Settings) -> dict[str, Any]:
    """The settings /info reports: the API key reduced to whether one is set, the artifact to its name."""
    data = settings.public_dict()
    if settings.artifact is not None:
        data["artifact"] = settings.artifact.name
    return data
