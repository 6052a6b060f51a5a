"""Kept states live in host memory under the memory tier's budget on every device (service/prefix_cache/host.py):
on the CPU the snapshot itself (no copy); on another decode-cache device every tensor copied to host memory
(page-locked where CUDA is available) before it is counted, and copied back by the restore. Before, on CUDA the
kept states stayed in GPU memory outside any budget.

The device is a parameter, so the CPU tests carry the proof: a cache told its decode cache is on `cuda` keeps
host copies of what it is offered (the tensors here are CPU tensors standing for device ones). The test marked
for CUDA checks the same with real device tensors and pinning where a GPU is present."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from model.decoding.snapshot import StateSnapshot
from service.engine.runner import CPU_CACHE_FRACTION, default_cache_bytes, default_prefix_cache_bytes
from service.prefix_cache import PrefixCache, PrefixCacheConfig
from service.prefix_cache.entry_key import EntryKey
from service.prefix_cache.host import host_copy, to_host
from service.prefix_cache.keys import CacheIdentity
from service.prefix_cache.metrics import PrefixCacheMetrics
from tests.service.helpers import metric_value, running_app
from tests.service.prefix_cache.test_prefix_cache import DOCS, LIMITS, QUESTIONS, _generate

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
KEY = EntryKey(b"h" * 32, "setting")


def _snapshot(numel: int = 1000, device: torch.device = CPU) -> StateSnapshot:
    return StateSnapshot(length=20, num_buckets=[None], index_len=[0], meta={"m": 1},
                         tensors={"logits": torch.randn(7), "kv.0": torch.randn(numel, device=device),
                                  "order.0": torch.arange(12, dtype=torch.int16, device=device).reshape(3, 4)})


def _cache(device: torch.device, capacity: int = 10**6, **config: Any) -> tuple[PrefixCache, CollectorRegistry]:
    registry = CollectorRegistry()
    identity = CacheIdentity("sha", 1, "float32", "float32", device.type, 64, False)
    cache = PrefixCache(identity, PrefixCacheConfig(capacity, min_tokens=16, key=KEY, **config),
                        PrefixCacheMetrics(registry), vocab_size=7, device=device, pin=False)
    return cache, registry


def _shares_storage(a: StateSnapshot, b: StateSnapshot) -> bool:
    return any(a.tensors[n].untyped_storage().data_ptr() == b.tensors[n].untyped_storage().data_ptr()
               for n in a.tensors)


def test_on_the_cpu_a_snapshot_is_kept_as_it_is() -> None:
    snap = _snapshot()
    assert to_host(snap, CPU, pin=False) is snap
    cache, _ = _cache(CPU)
    assert cache.offer("a" * 64, snap)
    assert cache.store.get("a" * 64) is snap  # no copy
    assert cache.describe()["memory"] == "host"
    assert _cache(CUDA)[0].describe()["memory"] == "host-copy"  # pin=False: no CUDA driver to page-lock with


def test_from_another_device_every_tensor_is_a_host_copy() -> None:
    snap = _snapshot()
    kept = to_host(snap, CUDA, pin=False)
    assert kept is not snap and not _shares_storage(kept, snap)
    assert all(t.device == CPU and t.is_contiguous() for t in kept.tensors.values())
    assert all(kept.tensors[n].equal(t) and kept.tensors[n].dtype == t.dtype for n, t in snap.tensors.items())
    assert (kept.length, kept.num_buckets, kept.index_len, kept.meta) == (snap.length, snap.num_buckets,
                                                                          snap.index_len, snap.meta)
    assert kept.nbytes == snap.nbytes
    # a strided view copies to a contiguous tensor of its own
    view = torch.arange(20.0).reshape(4, 5).t()
    assert host_copy(view, pin=False).equal(view) and host_copy(view, pin=False).is_contiguous()


def test_states_kept_from_another_device_are_host_copies_under_the_budget() -> None:
    nbytes = _snapshot().nbytes
    cache, registry = _cache(CUDA, capacity=2 * nbytes + nbytes // 2)
    offered = [_snapshot() for _ in range(3)]
    for i, snap in enumerate(offered):
        assert cache.offer(f"{i:064x}", snap)
    # the third evicted the first: the budget counts the host copies
    assert f"{0:064x}" not in cache.store and len(cache.store) == 2
    for i in (1, 2):
        kept = cache.store.get(f"{i:064x}")
        assert kept is not None and not _shares_storage(kept, offered[i])
        assert all(t.device == CPU for t in kept.tensors.values())
    cache.store.check()
    assert cache.store.evictable_bytes == 2 * nbytes
    registry_text = "\n".join(f"{s.name} {s.labels} {s.value}" for m in registry.collect() for s in m.samples)
    assert f"reformer_prefix_cache_bytes {{'state': 'evictable'}} {float(2 * nbytes)}" in registry_text
    assert not cache.offer("f" * 64, _snapshot(numel=10**6))  # larger than the whole tier: not kept


def test_a_disk_write_from_another_device_writes_the_host_copy(tmp_path: Path) -> None:
    cache, _ = _cache(CUDA, disk_dir=tmp_path)
    try:
        snap = _snapshot()
        assert cache.offer("c" * 64, snap)
        cache.flush()
        assert cache.queued_bytes == 0 and len(list(tmp_path.glob("*.safetensors"))) == 1
        kept = cache.store.get("c" * 64)
        assert kept is not None and not _shares_storage(kept, snap)
    finally:
        cache.close()


def test_the_default_tier_on_a_gpu_is_bounded_by_host_memory() -> None:
    huge = 10**15  # a decode cache larger than any host's memory
    assert default_prefix_cache_bytes(huge, CPU) == huge // 2
    host = default_cache_bytes(CPU)
    assert default_prefix_cache_bytes(huge, CUDA) == host
    assert default_prefix_cache_bytes(1000, CUDA) == 500  # a share below the host's bound
    assert CPU_CACHE_FRACTION < 1


def test_answers_through_host_copies_equal_the_cold_answers(artifact: Any) -> None:
    """The service with its prefix cache told its decode cache is on another device: every kept state is a
    host copy, restored by copying back, and the answers are the cache-off answers bit for bit."""
    doc = DOCS[0]
    with running_app(artifact, **LIMITS, prefix_cache=False) as off:
        cold = [_generate(off, doc + q, len(doc))[0] for q in QUESTIONS]
    with running_app(artifact, **LIMITS) as on:
        cache = on.app.state.service.engine.prefix_cache  # type: ignore[attr-defined]
        cache.device, cache.pin = CUDA, False  # the worker only reads these when it keeps a state
        offered: list[StateSnapshot] = []
        real = to_host

        def watched(snap: StateSnapshot, device: torch.device, pin: bool) -> StateSnapshot:
            kept = real(snap, device, pin)
            offered.append(snap)
            assert kept is not snap and not _shares_storage(kept, snap)
            return kept

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("service.prefix_cache.to_host", watched)
            warm = [_generate(on, doc + q, len(doc)) for q in QUESTIONS]
        metrics = on.get("/metrics").text
    assert [text for text, _ in warm] == cold
    assert [cached for _, cached in warm] == [0, len(doc), len(doc)]
    assert len(offered) == 1
    assert metric_value(metrics, "reformer_prefix_cache_bytes", {"state": "evictable"}) == offered[0].nbytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; the tests above carry the proof")
def test_on_cuda_kept_states_are_pinned_host_copies_and_restore_to_the_device() -> None:
    snap = _snapshot(device=CUDA)
    registry = CollectorRegistry()
    identity = CacheIdentity("sha", 1, "float32", "float32", "cuda", 64, False)
    cache = PrefixCache(identity, PrefixCacheConfig(10**6, min_tokens=16, key=KEY), PrefixCacheMetrics(registry),
                        vocab_size=7, device=CUDA)
    assert cache.pin
    allocated = torch.cuda.memory_allocated()
    assert cache.offer("d" * 64, snap)
    kept = cache.store.get("d" * 64)
    assert kept is not None
    assert all(t.device == CPU and t.is_pinned() for t in kept.tensors.values())
    del snap
    assert torch.cuda.memory_allocated() < allocated  # the device copies went with the offered snapshot
    back = {n: t.to(CUDA) for n, t in kept.tensors.items()}  # what restore_snapshot does, tensor by tensor
    assert all(back[n].device.type == "cuda" and back[n].cpu().equal(t) for n, t in kept.tensors.items())


def test_a_read_ahead_state_gives_way_to_a_longer_one_memory_holds_since() -> None:
    """A prompt's disk read ahead found its state at 256 positions; a prompt that waited for a reader of its
    document (service/engine/prefix_readers.py) finds the reader's longer state in memory: that one is used."""
    cache, _ = _cache(CPU)
    links = [(256, "k256"), (512, "k512"), (768, "k768")]
    disk = StateSnapshot(length=256, num_buckets=[None], index_len=[0], tensors={"kv.0": torch.zeros(4)})
    assert cache.lookup_longest(links, 800, disk) == (256, disk, "disk")  # memory holds nothing
    assert cache.peek_longest(links, 800, disk) == 256
    held = StateSnapshot(length=512, num_buckets=[None], index_len=[0], tensors={"kv.0": torch.zeros(4)})
    assert cache.offer("k512", held)
    assert cache.peek_longest(links, 800, disk) == 512
    found = cache.lookup_longest(links, 800, disk)
    assert found is not None and found[0] == 512 and found[2] == "memory"
    longer = StateSnapshot(length=768, num_buckets=[None], index_len=[0], tensors={"kv.0": torch.zeros(4)})
    assert cache.lookup_longest(links, 800, longer) == (768, longer, "disk")  # the read-ahead is the longest
