"""The GPU collector run on CPU against fake `torch.cuda` and fake NVML (pynvml) modules: only this process's
devices (CUDA_VISIBLE_DEVICES by index or UUID), labelled by torch index and UUID, each series on its own
(a MIG-style NotSupported drops one series of one device), and the scrape itself off the event loop."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from service.observability.gpu_metrics import GPU_FAMILIES, GpuCollector
from service.observability.metrics import ServiceMetrics
from tests.service.helpers import running_app

UUIDS = ["aaaaaaaa-0000-0000-0000-000000000000", "bbbbbbbb-1111-1111-1111-111111111111",
         "cccccccc-2222-2222-2222-222222222222"]
GIB = 2**30
PID = 4242


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    pass


@dataclass
class FakeNvml:
    """Three GPUs in NVML (PCI) order; device i uses (i + 1) GiB of 80, runs at 10*(i+1) % utilisation."""

    fail: dict[tuple[str, int], Exception] = field(default_factory=dict)
    processes: dict[int, list[Any]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    NVMLError: type = NVMLError

    def _check(self, name: str, index: int) -> None:
        self.calls.append(name)
        if (name, index) in self.fail:
            raise self.fail[(name, index)]

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")

    def nvmlDeviceGetCount(self) -> int:
        return len(UUIDS)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for index, known in enumerate(UUIDS):
            if uuid == f"GPU-{known}":
                return index
        raise NVMLError("Not Found")

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{UUIDS[handle]}"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        self._check("memory", handle)
        return SimpleNamespace(used=(handle + 1) * GIB, total=80 * GIB)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        self._check("utilization", handle)
        return SimpleNamespace(gpu=10 * (handle + 1))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        self._check("processes", handle)
        return self.processes.get(handle, [SimpleNamespace(pid=PID, usedGpuMemory=(handle + 1) * 100),
                                           SimpleNamespace(pid=1, usedGpuMemory=999)])


class FakeCuda:
    """What torch.cuda shows a process that sees `nvml_indices` (in CUDA_VISIBLE_DEVICES order)."""

    def __init__(self, nvml_indices: list[int], available: bool = True):
        self.nvml_indices = nvml_indices
        self.available = available

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return len(self.nvml_indices)

    def get_device_properties(self, index: int) -> Any:
        return SimpleNamespace(uuid=UUIDS[self.nvml_indices[index]])

    def memory_allocated(self, index: int) -> int:
        return 1000 + index

    def memory_reserved(self, index: int) -> int:
        return 2000 + index

    def max_memory_allocated(self, index: int) -> int:
        return 3000 + index


def scrape(collector: GpuCollector) -> dict[str, dict[tuple[str, str], float]]:
    """{family: {(device, uuid): value}} from one collect()."""
    out: dict[str, dict[tuple[str, str], float]] = {}
    for family in collector.collect():
        for sample in family.samples:
            out.setdefault(family.name, {})[(sample.labels["device"], sample.labels["uuid"])] = sample.value
    return out


def test_every_series_for_each_visible_device_labelled_by_torch_index_and_uuid() -> None:
    collector = GpuCollector(cuda=FakeCuda([2, 0]), nvml=FakeNvml(), environ={"CUDA_VISIBLE_DEVICES": "2,0"},
                             pid=PID)
    series = scrape(collector)
    assert set(series) == set(GPU_FAMILIES)
    first, second = ("0", f"GPU-{UUIDS[2]}"), ("1", f"GPU-{UUIDS[0]}")
    for family in GPU_FAMILIES:
        assert set(series[family]) == {first, second}, family  # never NVML's third GPU, never NVML's index
    assert series["reformer_gpu_memory_used_bytes"] == {first: 3 * GIB, second: 1 * GIB}
    assert series["reformer_gpu_memory_total_bytes"][first] == 80 * GIB
    assert series["reformer_gpu_utilization_ratio"] == {first: 0.3, second: 0.1}
    assert series["reformer_gpu_process_memory_bytes"] == {first: 300, second: 100}  # this pid only
    assert series["reformer_gpu_memory_allocated_bytes"] == {first: 1000, second: 1001}
    assert series["reformer_gpu_memory_reserved_bytes"][second] == 2001
    assert series["reformer_gpu_memory_peak_allocated_bytes"][first] == 3000


@pytest.mark.parametrize("visible", ["GPU-cccccccc,GPU-aaaaaaaa", "2,0"])
def test_cuda_visible_devices_maps_to_nvml_when_torch_gives_no_uuid(visible: str) -> None:
    class NoUuidCuda(FakeCuda):
        def get_device_properties(self, index: int) -> Any:
            raise AttributeError("uuid")

    collector = GpuCollector(cuda=NoUuidCuda([2, 0]), nvml=FakeNvml(), environ={"CUDA_VISIBLE_DEVICES": visible},
                             pid=PID)
    used = scrape(collector)["reformer_gpu_memory_used_bytes"]
    assert used == {("0", f"GPU-{UUIDS[2]}"): 3 * GIB, ("1", f"GPU-{UUIDS[0]}"): 1 * GIB}


def test_a_mig_style_not_supported_drops_that_series_of_that_device_only(caplog: Any) -> None:
    nvml = FakeNvml(fail={("utilization", 0): NVMLError_NotSupported("Not Supported")})
    collector = GpuCollector(cuda=FakeCuda([0, 1]), nvml=nvml, environ={}, pid=PID)
    series = scrape(collector)
    assert set(series["reformer_gpu_utilization_ratio"]) == {("1", f"GPU-{UUIDS[1]}")}
    for family in set(GPU_FAMILIES) - {"reformer_gpu_utilization_ratio"}:
        assert len(series[family]) == 2, family
    assert "reformer_gpu_utilization_ratio for cuda:0 skipped: NVMLError_NotSupported" in caplog.text
    # Logged once at warning level, not at every scrape.
    scrape(collector)
    assert caplog.text.count("reformer_gpu_utilization_ratio for cuda:0 skipped") == 1


def test_a_series_failing_on_every_device_is_absent_and_the_others_stay() -> None:
    nvml = FakeNvml(fail={("processes", 0): NVMLError("Unknown Error")})
    series = scrape(GpuCollector(cuda=FakeCuda([0]), nvml=nvml, environ={}, pid=PID))
    assert "reformer_gpu_process_memory_bytes" not in series
    assert set(series) == set(GPU_FAMILIES) - {"reformer_gpu_process_memory_bytes"}


def test_process_memory_absent_when_nvml_does_not_list_this_process() -> None:
    nvml = FakeNvml(processes={0: [SimpleNamespace(pid=1, usedGpuMemory=5)]})
    series = scrape(GpuCollector(cuda=FakeCuda([0]), nvml=nvml, environ={}, pid=PID))
    assert "reformer_gpu_process_memory_bytes" not in series


def test_without_nvml_the_torch_series_remain() -> None:
    class BrokenNvml(FakeNvml):
        def nvmlInit(self) -> None:
            raise NVMLError("Driver Not Loaded")

    series = scrape(GpuCollector(cuda=FakeCuda([0]), nvml=BrokenNvml(), environ={}, pid=PID))
    assert set(series) == {"reformer_gpu_memory_allocated_bytes", "reformer_gpu_memory_reserved_bytes",
                           "reformer_gpu_memory_peak_allocated_bytes"}
    assert set(series["reformer_gpu_memory_allocated_bytes"]) == {("0", UUIDS[0])}


def test_no_cuda_no_gpu_series_and_nvml_untouched() -> None:
    nvml = FakeNvml()
    assert scrape(GpuCollector(cuda=FakeCuda([], available=False), nvml=nvml, environ={}, pid=PID)) == {}
    assert nvml.calls == []


def test_the_collector_renders_through_a_registry() -> None:
    registry = CollectorRegistry()
    registry.register(GpuCollector(cuda=FakeCuda([1]), nvml=FakeNvml(), environ={"CUDA_VISIBLE_DEVICES": "1"},
                                   pid=PID))
    text = generate_latest(registry).decode()
    assert f'reformer_gpu_memory_used_bytes{{device="0",uuid="GPU-{UUIDS[1]}"}} 2.147483648e+09' in text


def test_the_metrics_route_collects_off_the_event_loop(artifact: Any) -> None:
    seen: list[str] = []

    class RecordingCollector:
        def collect(self) -> Any:
            seen.append(threading.current_thread().name)
            return []

    with running_app(artifact) as client:
        metrics: ServiceMetrics = client.app.state.service.metrics
        metrics.add_collector(RecordingCollector(), "recording")  # type: ignore[arg-type]
        loop_thread: list[str] = []

        async def probe() -> None:
            loop_thread.append(threading.current_thread().name)

        client.portal.call(probe)
        assert client.get("/metrics").status_code == 200
    assert seen and loop_thread and seen[0] != loop_thread[0]
