"""Every setting of the service, in one pydantic-settings class.

Each field is read from the environment (`REFORMER_<NAME>`) and from the command line (`--<name>` with
dashes); the command line wins. The field descriptions are the documentation: `reformer serve --help`
prints them and `/info` reports the values in effect (never the API key).
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.api_keys import ApiKeys, ApiKeysError, load_api_keys
from service.memory import container_memory_limit
from service.settings_prefix_cache import PREFIX_CACHE_SHARE, PrefixCacheTrustSettings, blank_is_none

BackendName = Literal["auto", "torch", "onnxruntime"]
DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
LogLevel = Literal["debug", "info", "warning", "error"]


class Settings(BaseSettings, PrefixCacheTrustSettings):
    """Configuration of `reformer serve`."""

    model_config = SettingsConfigDict(env_prefix="REFORMER_", extra="forbid", validate_default=True)

    host: str = Field("0.0.0.0", description="Address to listen on (0.0.0.0: every interface).")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on (0: pick a free one).")
    artifact: Path | None = Field(
        None, description="Artifact directory to serve; unset serves the default artifact shipped in the package."
    )
    served_model_name: str | None = Field(
        None, description="Model id reported by /v1/models and /info; unset uses the artifact directory name."
    )
    backend: BackendName = Field(
        "auto",
        description="Forward backend for embeddings: torch or onnxruntime (needs the artifact's model.onnx). "
        "auto picks torch, the faster of the two in bench/forward/backends.py on this model. "
        "Decoding always runs on torch.",
    )
    device: DeviceName = Field("auto", description="Device: cpu, cuda, or auto (CUDA when present).")
    dtype: DtypeName = Field(
        "auto", description="Weights' dtype: float32, bfloat16, float16; auto is float32 on CPU, bfloat16 on CUDA."
    )
    max_input_tokens: int | None = Field(
        None, ge=1, description="Longest accepted input in tokens; unset uses the model's max_position_embeddings."
    )
    max_new_tokens: int = Field(1024, ge=1, description="Largest max_new_tokens (or max_tokens) a request may ask.")
    default_new_tokens: int = Field(
        20, ge=1, description="New tokens generated when a /generate request does not say (capped by max_new_tokens)."
    )
    max_batch_size: int = Field(
        32, ge=1, description="Most sequences in one embedding batch, and most generations decoded together."
    )
    max_batch_tokens: int = Field(
        16384,
        ge=1,
        description="Padded-token budget of one embedding batch (longest length x batch size) and of the "
        "prompt tokens prefilled between two decode steps; a single longer input runs alone.",
    )
    max_wait_ms: float = Field(
        5.0, ge=0, description="How long an embedding request may wait for company before its batch runs."
    )
    prefill_budget_ms: float = Field(
        100.0, ge=0,
        description="How long a long prompt's sliced prefill may run between two decode steps of the running "
        "generations (chunked prefill; at least one slice per step, 0: one slice per step). Smaller: shorter "
        "gaps between the running streams' tokens while a long prompt is prefilled, and a longer prefill. "
        "bench/prefill/prefill_gap.py measures both (bench/README.md).",
    )
    prefill: Literal["auto", "one-piece", "causal"] = Field(
        "auto",
        description="How a generation's prompt is read. causal: by the exact extend, which leaves what one decode "
        "step per token leaves (each position's LSH window a function of the tokens before it), in slices "
        "between the running generations' steps; the prefix cache keeps each prompt's state at its last "
        "256-token block boundary, and a later prompt continues from the longest boundary it shares with a "
        "kept state among those kept reachable (every 4,096th token and the last four) with no declaration "
        "(cache_prefix_chars / cache_prefix_messages are ignored). Answers are the "
        "same bits whatever the cache holds (and, where the C kernels run, whatever the batch). one-piece: one "
        "forward over the whole prompt (sorted into LSH chunks together, so a position's attention depends on "
        "the tokens after it), sliced between "
        "decode steps when long; only whole prompts and declared prefixes are reused. auto: causal where the C "
        "extend runs (CPU with the C kernels, fixed bucket counts), one-piece elsewhere (GPU, kernels off, "
        "automatic bucket counts, where the causal read would be one decode step per token). /info's "
        "batching.prefill says which runs. Prompts scored with logprobs (echo, decoder_input_details) are scored "
        "with the semantics their prefill reads them with: causal, read from position 0 (never from a kept "
        "state), each position's logprobs those of the decode step that reads it; one-piece, the forward's.",
    )
    cache_bytes: int | None = Field(
        None, ge=0,
        description="Decode-cache capacity in bytes (keys, values and LSH bookkeeping of running generations, in "
        "preallocated blocks). A generation starts when its prompt plus max_new_tokens fits, waits in the queue "
        "while it does not, and gets 422 if it never could. Default: half the free GPU memory after the model "
        "is loaded (CUDA) or a quarter of the available RAM, within a container's memory limit (CPU), capped at what "
        "max_batch_size generations of max_input_tokens + max_new_tokens could use. A value not below the "
        "container's memory limit is refused at start-up. Each LSH layer's bucket order is held in the generation's "
        "own blocks; with an automatic bucket count, the bucket counts of that longest generation are reserved "
        "for every slot (they grow for all slots at once).",
    )
    kv_cache_dtype: DtypeName = Field(
        "auto",
        description="What the decode cache keeps keys and values in: auto is the model's dtype (the cache holds "
        "keys and values as the model computes them). A float32 model may keep them in bfloat16 or float16: half "
        "the bytes of the keys and values, which are most of a token's cache (the LSH bookkeeping is not "
        "halved: 12,690 -> 6,505 bytes per token after a 1K prompt at bench/decode/generate.py's config, "
        "bench/results/generate_kv_float16.json), so about twice the tokens in the same cache_bytes, at the "
        "price of rounding every cached key and value (bench/decode/decode_quality.py measures the difference). A "
        "model of another dtype only takes auto or its own dtype. float16 keys overflow past 65504. On CPU "
        "the C kernel reads bfloat16 on any build and float16 where the compiler targets F16C; otherwise "
        "those steps use PyTorch ops.",
    )
    decode_weights: Literal["float32", "bfloat16", "int8"] = Field(
        "float32",
        description="What a CPU decode step's matrix products (projections, feed-forward, LM head) read the "
        "weights in, where the C kernels run them: float32 (the model's), bfloat16 (half the bytes, each weight "
        "rounded to nearest even) or int8 (a quarter: one float32 scale per output column, max |w| / 127); the "
        "products still add in float32. A large model's step is bound by reading its weights, so it runs "
        "about that much faster, at a cost in accuracy that bench/decode/decode_weights.py measures "
        "(bench/results/decode_weights.json). Prefill, embeddings, the norms, embeddings tables and the LSH "
        "hash stay float32, and so do steps PyTorch runs (GPU, cpu_kernels off, or a float32 product on more "
        "than one thread outside the one-call step). /info's runs.decode_weights says what the step uses.",
    )
    batch_invariant: bool = Field(
        False,
        description="Make a generation's logits bit-identical whatever it is batched with: prefill each prompt "
        "alone, and run decode steps in fixed blocks of 16 rows, except on CPU with the C kernels (cpu_kernels, "
        "float32), where every step runs on one intra-op thread and the kernels compute each row alone, so "
        "steps are batched as with this off. Off: prompts arriving together are prefilled together by the "
        "one-piece prefill, and results match a request alone within 1e-4, with the same greedy tokens; the "
        "causal prefill reads each prompt alone, its bits never depending on the batch.",
    )
    cuda_graphs: bool = Field(
        False,
        description="On CUDA, replay each decode step shape as a captured CUDA graph (one launch instead of "
        "hundreds of small kernels; model/decoding/steps/cuda_graphs.py): a shape runs eagerly once, is captured "
        "the next time "
        "and replayed after; steps whose rows hash with different bucket counts, and any shape whose capture "
        "fails, run eagerly. Off by default: it has not yet run on a GPU (the GPU check, bench/gpu/gpu_check.py, "
        "compares its logits with eager steps). No effect on CPU.",
    )
    cpu_kernels: Literal["auto", "on", "off"] = Field(
        "auto",
        description="The C kernels of the CPU paths (model/kernels/csrc/, compiled when the package is installed, "
        "one library per CPU variant: portable, and avx2 and avx512 on x86-64; the best the CPU runs is loaded). "
        "auto: use them when they load, else PyTorch ops; on: refuse to start, naming the reason, when they "
        "cannot load; off: PyTorch ops only (true/false and 1/0 read as auto/off). With them a float32 decode "
        "step runs in one C call (embeddings, every layer's norms, projections, cache write, LSH hash and index "
        "insert, attention window and feed-forward, the LM head; each row computed alone, the same bits in any "
        "batch and on any thread count) and a float32 forward attends its chunk windows in C (chunk_attend.c). "
        "Where no installed build exists (a source checkout) one is compiled at first use with the compiler "
        "named by CC, or cc, into REFORMER_KERNEL_DIR or the user's cache folder. /info's kernels and "
        "backends, and the reformer_backend_info metric, say what runs. No effect on GPU.",
    )

    @field_validator("cpu_kernels", mode="before")
    @classmethod
    def _kernel_mode(cls, value: object) -> object:
        """The older boolean spellings: true/1/yes mean auto (use them when they load), false/0/no off."""
        if isinstance(value, bool):
            return "auto" if value else "off"
        text = str(value).strip().lower()
        return {"true": "auto", "1": "auto", "yes": "auto", "false": "off", "0": "off", "no": "off"}.get(text, text)

    max_queue_size: int = Field(
        64, ge=1,
        description="Requests allowed to wait for the model, counted as requests whatever their prompts and n/best_of "
        "sequences: one holds a place from the arrival of its body until the model has started every sequence of "
        "it. Beyond it new requests get 429 at once; a request once admitted is never refused for room.",
    )
    request_timeout_s: float = Field(
        60.0, gt=0, description="Longest a request may wait in the queue before it gets 504."
    )
    max_client_batch_size: int = Field(32, ge=1, description="Most inputs (or prompts) in one request.")
    max_stop_sequences: int = Field(4, ge=0, description="Most stop sequences in one generation request.")
    max_payload_bytes: int = Field(4_000_000, ge=1, description="Largest request body in bytes; larger gets 413.")
    tokenize_threads: int = Field(
        2, ge=1,
        description="Threads that tokenize request texts (and render chat templates) off the event loop: at most "
        "this many bodies are tokenized at once, the others wait their turn.",
    )
    body_timeout_s: float = Field(
        30.0, gt=0,
        description="Longest a client may take to send its request body after the headers; slower gets 408 "
        "(body_timeout). No queue place is held while a body is on the way.",
    )
    api_key: SecretStr | None = Field(
        None,
        description="If set, inference routes need `Authorization: Bearer <key>` (compared in constant time). "
        "An empty or blank value means no key.",
    )
    api_keys_file: Path | None = Field(
        None,
        description="A file of `tenant:key` lines (a mounted Secret), one per caller: each key is accepted as "
        "api_key is, and names its caller's tenant (api_key's tenant is `default`). A malformed line is refused "
        "at start-up naming it (service/api_keys.py).",
    )
    cache_salt_per_key: bool = Field(
        True,
        description="With keys set (api_key, api_keys_file): a request's prefix-cache salt includes its caller's "
        "tenant, so callers with different keys never share a kept state, an in-flight prefill or a "
        "cached_tokens report, whatever cache_salt or X-Cache-Salt they send. false: only those decide.",
    )
    api_key_on_probes: bool = Field(
        False, description="Whether /metrics, /health and /ready also need the API key (when one is set)."
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Comma-separated origins allowed by CORS; empty turns CORS off."
    )
    grace_period_s: float = Field(
        30.0, ge=0, description="On SIGTERM: how long in-flight requests get to finish before the process exits."
    )
    embed_standardize: bool = Field(
        True,
        description="Transform mean-pooled embeddings with the statistics the artifact ships "
        "(embedding_stats.safetensors, estimated on training passages) before any L2 normalisation: when the file "
        "holds a whitening matrix W, shrinkage-whitening (v - mean) @ W (BERT-whitening of the training "
        "covariance shrunk toward a scaled identity, its shrinkage chosen by the export on training passages and "
        "recorded in manifest.json); for an older file without W, per-dimension standardisation "
        "(v - mean) / std. It makes nearest neighbours follow content rather than a few dominant directions. No "
        "effect on pooling last or on an artifact without the file. Off: raw mean-pooled states. /info's "
        "embedding_standardization says which is applied.",
    )
    idle_trim_s: float = Field(
        2.0, ge=0, le=86_400, allow_inf_nan=False,  # the worker waits this long: a finite, sane timeout
        description="When the model worker has had nothing running or queued for this many seconds, it returns "
        "the free pages of the heap (glibc malloc_trim) and of the decode cache's pools to the system once (but "
        "the lowest free blocks, as many as a restore of the longest state the prefix cache holds in memory "
        "takes: a hit is restored into them), then waits for work; 0: never. The service keeps freed memory in "
        "the heap while it works (model/decoding/runtime.py's "
        "malloc thresholds, which spare large tensors a page fault per use) and the pools stay resident wherever "
        "a request wrote them, so resident memory otherwise only grows. The first request after a trim faults in "
        "the pages it reuses. reformer_heap_trims_total{reason=\"idle\"} counts the trims.",
    )
    busy_trim_s: float = Field(
        30.0, ge=0, le=86_400, allow_inf_nan=False,
        description="Under steady load (the worker never idle for REFORMER_IDLE_TRIM_S), it also returns the free "
        "pages of the heap and of the decode cache's pools (but those the prefix cache's hits are restored into, "
        "as an idle trim) once every this many seconds, between two of its turns (never during a model step); 0: "
        "never. Without it the heap's free chunks stay resident and add up with "
        "fragmentation while the service is busy. Each trim pauses the running requests for the trim itself "
        "(reformer_heap_trim_seconds_total adds up its time) and the pages it returned fault in again as they are "
        "reused. reformer_heap_trims_total{reason=\"busy\"} counts the trims.",
    )
    memory_budget_mb: int = Field(
        0, ge=0,
        description="Resident memory (RSS, MiB) above which the model worker also trims the heap and gives the "
        "decode cache's free pool pages back while busy (every one of them, even those a prefix-cache hit would be "
        "restored into): "
        "between two of its turns (never during a model step), at most once every 10 s; 0 (default): only the "
        "idle and busy trims. Each such trim costs the running requests a pause (the trim itself, tens of ms per GB "
        "returned) and page faults as the memory is reused: set it above the working set, as a bound on "
        "fragmentation, not below it. reformer_memory_budget_bytes shows it, process_resident_memory_bytes "
        "what it bounds, reformer_heap_trims_total{reason=\"budget\"} the trims.",
    )
    cache_keep_mb: int = Field(
        64, ge=0,
        description="When a generation finishes, the model worker gives the pages of the decode cache's free "
        "blocks back to the system, all but the lowest-numbered this many MiB of them (blocks are handed out "
        "lowest first, so short requests reuse those pages instead of faulting them in again) and, with the prefix "
        "cache on, at least as many as a restore of the longest state the prefix cache holds in memory takes (a "
        "hit is restored into the lowest free blocks, which then write resident pages instead of faulting fresh "
        "ones in). Without it the "
        "cache's resident memory under steady load is the most it ever held at once: the engine is never idle "
        "for REFORMER_IDLE_TRIM_S, and a free block's pages stay resident once written. Larger: fewer page "
        "faults, more resident memory; 0: every finished request's pages go back but those kept for prefix-cache "
        "hits. "
        "reformer_decode_cache_released_bytes_total{reason=\"finished\"} counts what goes back, "
        "reformer_decode_cache_resident_bytes shows what stays.",
    )
    prefix_cache: bool = Field(
        True,
        description="Keep the decode state of each prompt of at least prefix_cache_min_tokens tokens after its "
        "prefill (or of the part a request declares with cache_prefix_chars), when it fits prefix_cache_bytes or a "
        "disk tier is set, so a later request with the same tokens restores it instead of prefilling (docs/API.md, "
        "\"Prefix cache\"). A restored state is a copy of "
        "the state the prefill left, so an answer never depends on what the cache held. false: nothing is kept "
        "or looked up (identical prompts in flight together, and the choices of n / best_of, still share one "
        "prefill).",
    )
    prefix_cache_bytes: int | None = Field(
        None, ge=0,
        description="The prefix cache's memory, in bytes, apart from the decode cache's (states are copied in "
        "and out, so a full prefix cache never delays a request: least recently used entries are evicted). "
        "Host memory on every device: on CUDA each kept state is copied to page-locked host memory and back to "
        "the GPU when restored. Default: half the decode cache's capacity; on CUDA at most a quarter of the "
        "host's available memory (within a container's limit) too.",
    )
    prefix_cache_min_tokens: int = Field(
        128, ge=1, description="Shorter prompts (or declared parts) are neither kept in the prefix cache nor looked "
        "up in it.",
    )
    prefix_cache_dir: Path | None = Field(
        None,
        description="A folder for the prefix cache's disk tier: every kept state is also written there as a "
        "safetensors file named by its key (which covers the artifact and the settings that change bits), and "
        "read back on a miss in memory: after a restart, or by another replica sharing the folder and "
        "prefix_cache_key. A file that fails its HMAC, its layout or its identity checks is refused by reason, "
        "deleted, and the request prefills; a read that fails (EIO) leaves it.",
    )
    prefix_cache_dir_bytes: int = Field(
        16 * 2**30, ge=0,
        description="The disk tier's size cap in bytes, its files being written included: past it, least recently "
        "used files are deleted.",
    )
    debug_memory: bool = Field(
        False,
        description="Also export reformer_python_objects, reformer_live_tensor_bytes and "
        "reformer_live_tensor_resident_bytes, from a walk over gc.get_objects() at most every 30 s (a scrape in "
        "between reuses the figures): about 0.2 s with the GIL held, for diagnosis and bench/serving/soak.py, not for "
        "production. With it, the objects of start-up are not frozen out of the garbage collector's full passes "
        "(gc.freeze, which the walk could not see past), so those passes take longer.",
    )
    # structured output (service/text/structured/)
    structured_compile_timeout_s: float = Field(
        10.0, gt=0, description="Longest a request waits for its structured-output constraint (schema, regex, "
        "grammar) to compile before it is refused (400/422); compiling runs on its own threads, never on the "
        "event loop or the model worker.")
    structured_max_bytes: int = Field(
        65536, ge=1, description="Largest structured-output constraint (a schema's JSON text, a regex, a grammar) in "
        "bytes; larger is refused.")
    structured_cache_size: int = Field(
        256, ge=1, description="Compiled structured-output constraints kept (least recently used dropped), "
        "refusals included, keyed by their content.")
    # end of structured output
    warmup: bool = Field(True, description="Run a warm-up embedding and generation before reporting ready.")
    log_level: LogLevel = Field("info", description="Log level; prompts are logged only at debug.")
    log_json: bool = Field(True, description="Structured JSON logs (one object per line) rather than plain text.")

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("api_key", mode="before")
    @classmethod
    def _blank_key_is_no_key(cls, value: Any) -> Any:
        # `REFORMER_API_KEY=` must not turn authentication on with a blank key every client would have to send
        return blank_is_none(value)

    # the keys as read once at validation: the server serves exactly the keys checked at start-up, even if the
    # file changes afterwards
    _api_keys: ApiKeys | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _keys_file_is_usable(self) -> Settings:
        # a malformed or unreadable file is refused here, at start-up, naming its line
        try:
            self._api_keys = load_api_keys(self.api_key.get_secret_value() if self.api_key is not None else None,
                                           self.api_keys_file)
        except ApiKeysError as err:
            raise ValueError(str(err)) from err
        return self

    def api_keys(self) -> ApiKeys | None:
        """The accepted keys and their tenants (read when the settings were validated), or None: no key is
        needed."""
        return self._api_keys

    @model_validator(mode="after")
    def _cache_fits_the_container(self) -> Settings:
        # A decode cache the container's memory limit cannot hold is refused at start-up: its pools are mapped
        # whole but only resident where written, so it would otherwise start and be OOM-killed under load.
        limit = container_memory_limit()
        if limit is None:
            return self
        if self.cache_bytes is not None and self.cache_bytes >= limit:
            raise ValueError(
                f"cache_bytes ({self.cache_bytes} bytes) does not fit the container's memory limit ({limit} bytes, "
                "the cgroup's memory.max / memory.limit_in_bytes): the process would be OOM-killed once the decode "
                "cache fills. Set REFORMER_CACHE_BYTES well below the limit (the model and the process need memory "
                "too), or raise the limit (docker run --memory, the pod's resources.limits.memory)")
        # The prefix cache's states live in host memory on every device (service/prefix_cache/host.py), in
        # its memory tier and, with a disk tier, in the disk writer's queue: counted with a host decode cache.
        tier, queue = self.prefix_cache_host_bytes()
        decode = self.cache_bytes if self.cache_bytes is not None and self._decode_cache_on_host() else 0
        if tier + queue and decode + tier + queue >= limit:
            parts = [f"prefix_cache_bytes {tier} bytes" + ("" if self.prefix_cache_bytes is not None else
                                                            f" (its default: {PREFIX_CACHE_SHARE} of cache_bytes)")]
            if queue:
                parts.append(f"prefix_cache_write_queue_bytes {queue} bytes (prefix_cache_dir is set)")
            if decode:
                parts.append(f"cache_bytes {decode} bytes")
            raise ValueError(
                f"the prefix cache's memory ({' + '.join(parts)}: {decode + tier + queue} bytes) does not fit the "
                f"container's memory limit ({limit} bytes, the cgroup's memory.max / memory.limit_in_bytes): the "
                "process would be OOM-killed once the prefix cache fills. Set REFORMER_PREFIX_CACHE_BYTES"
                + (" and REFORMER_PREFIX_CACHE_WRITE_QUEUE_BYTES" if queue else "")
                + " well below the limit, turn the prefix cache off (REFORMER_PREFIX_CACHE=false), or raise the limit")
        return self

    def prefix_cache_host_bytes(self) -> tuple[int, int]:
        """The most host memory the prefix cache holds, as the settings say: its memory tier's cap
        (prefix_cache_bytes, or its default share of cache_bytes; 0 when both are unset: the tier is then sized
        at start-up within what is free) and, with a disk tier, the write queue's bound (states too large for
        the memory tier wait there for the writer). (0, 0) with the prefix cache off."""
        if not self.prefix_cache:
            return 0, 0
        if self.prefix_cache_bytes is not None:
            tier = self.prefix_cache_bytes
        else:
            tier = int(self.cache_bytes * PREFIX_CACHE_SHARE) if self.cache_bytes is not None else 0
        queue = self.prefix_cache_write_queue_bytes if self.prefix_cache_dir is not None else 0
        return tier, queue

    def _decode_cache_on_host(self) -> bool:
        if self.device == "cpu":
            return True
        if self.device == "cuda":
            return False
        import torch

        return not torch.cuda.is_available()

    def public_dict(self) -> dict[str, Any]:
        """The settings as JSON-able values, the API key reduced to whether one is set."""
        data = self.model_dump(mode="json", exclude={"api_key", "prefix_cache_key"})
        data["api_key_set"] = self.api_key is not None
        data["prefix_cache_key_set"] = self.prefix_cache_key is not None
        return data


def _flag_kwargs(annotation: Any) -> dict[str, Any]:
    """argparse keyword arguments for a field's type (choices for Literals, on/off for booleans)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in args if a is not type(None))
        args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Annotated:
        annotation = args[0]
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is Literal:
        return {"choices": list(typing.get_args(annotation))}
    return {}


def build_parser(prog: str = "reformer serve") -> argparse.ArgumentParser:
    """A parser with one flag per setting; flags left out fall back to the environment and defaults."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a Reformer artifact over HTTP. Every flag can also be set as REFORMER_<NAME>.",
    )
    parser.add_argument(
        "artifact_positional", nargs="?", metavar="ARTIFACT", default=argparse.SUPPRESS,
        help="artifact directory (same as --artifact)",
    )
    for name, field in Settings.model_fields.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{field.description} [env REFORMER_{name.upper()}]",
            **_flag_kwargs(field.annotation),
        )
    return parser


def settings_from_argv(argv: list[str]) -> Settings:
    """Settings from flags over environment over defaults."""
    given = vars(build_parser().parse_args(argv))
    positional = given.pop("artifact_positional", None)
    if positional is not None:
        given["artifact"] = positional
    return Settings(**given)
