"""GPU series (docs/METRICS.md, "GPU") for the devices this process uses, read at scrape time.

Every series carries the torch index (`device`, what the service's own settings and logs name) and the GPU
UUID (`uuid`, what NVML, nvidia-smi and the orchestrator name). Torch index i is the i-th entry of
CUDA_VISIBLE_DEVICES, which may be an NVML index or a UUID (prefix), and NVML enumerates every GPU of the
host: devices are matched by UUID (torch's own, else the CUDA_VISIBLE_DEVICES entry), by NVML index only as
the last resort. Each series is collected on its own: an NVML call that a device does not support (MIG
slices answer NotSupported to utilisation) drops that series for that device and nothing else.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("service.metrics")

ALLOCATED = "reformer_gpu_memory_allocated_bytes"
RESERVED = "reformer_gpu_memory_reserved_bytes"
PEAK = "reformer_gpu_memory_peak_allocated_bytes"
USED = "reformer_gpu_memory_used_bytes"
TOTAL = "reformer_gpu_memory_total_bytes"
UTILIZATION = "reformer_gpu_utilization_ratio"
PROCESS = "reformer_gpu_process_memory_bytes"
GPU_FAMILIES = (ALLOCATED, RESERVED, PEAK, USED, TOTAL, UTILIZATION, PROCESS)
LABELS = ["device", "uuid"]


@dataclass(frozen=True)
class Device:
    """One device this process uses: torch's index, its UUID ("" if unknown) and its NVML handle."""

    index: int
    uuid: str
    handle: Any


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bare(uuid: str) -> str:
    """A UUID without NVML's `GPU-`/`MIG-` prefix, lower case: torch prints it bare."""
    for prefix in ("GPU-", "MIG-"):
        if uuid.upper().startswith(prefix):
            return uuid[len(prefix):].lower()
    return uuid.lower()


class GpuCollector(Collector):
    """torch allocator series and NVML series for each CUDA device of this process; nothing without CUDA.

    `cuda` and `nvml` default to `torch.cuda` and `pynvml` (imported when first scraped); tests pass fakes.
    """

    def __init__(self, cuda: Any = None, nvml: Any = None, environ: Mapping[str, str] | None = None,
                 pid: int | None = None):
        self._cuda = cuda
        self._nvml = nvml
        self._environ = environ if environ is not None else os.environ
        self._pid = pid if pid is not None else os.getpid()
        self._lock = threading.Lock()
        self._nvml_state: bool | None = None  # None: not tried yet
        self._devices: list[Device] | None = None
        self._warned: set[tuple[str, int]] = set()

    # -- sources -------------------------------------------------------------------------------------------
    def _torch_cuda(self) -> Any:
        if self._cuda is None:
            import torch

            self._cuda = torch.cuda
        return self._cuda

    def _nvml_module(self) -> Any | None:
        """pynvml, initialised once; None where it is missing or NVML cannot start (no driver, no library)."""
        if self._nvml_state is None:
            try:
                if self._nvml is None:
                    import pynvml

                    self._nvml = pynvml
                self._nvml.nvmlInit()
                self._nvml_state = True
            except Exception as error:  # ImportError, NVMLError_LibraryNotFound, ...
                log.warning("NVML unavailable (%s): GPU used/total/utilisation/process series are skipped", error)
                self._nvml_state = False
        return self._nvml if self._nvml_state else None

    def _visible_entries(self) -> list[str] | None:
        value = self._environ.get("CUDA_VISIBLE_DEVICES")
        if value is None:
            return None
        return [entry.strip() for entry in value.split(",") if entry.strip()]

    def _handle_for(self, nvml: Any, index: int, torch_uuid: str) -> tuple[Any, str]:
        """(NVML handle, NVML UUID) of torch device `index`, or (None, torch_uuid) when none matches."""
        wanted: list[str] = []
        if torch_uuid:
            wanted = [f"GPU-{torch_uuid}", f"MIG-{torch_uuid}"]
        entries = self._visible_entries()
        entry = entries[index] if entries is not None and index < len(entries) else None
        if entry is not None and entry.upper().startswith(("GPU-", "MIG-")):
            wanted.append(entry)
        for uuid in wanted:  # MIG slices are reachable by UUID only, not by NVML index
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                return handle, _text(nvml.nvmlDeviceGetUUID(handle))
            except Exception:  # noqa: S112 - the next candidate or the enumeration below decides
                continue
        by_nvml_index: dict[int, tuple[Any, str]] = {}
        for nvml_index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
            by_nvml_index[nvml_index] = (handle, _text(nvml.nvmlDeviceGetUUID(handle)))
        for handle, uuid in by_nvml_index.values():
            if torch_uuid and _bare(uuid) == torch_uuid.lower():
                return handle, uuid
            if entry is not None and not entry.isdigit() and _bare(uuid).startswith(_bare(entry)):
                return handle, uuid
        # Last resort, an index: CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA's order NVML's.
        fallback = int(entry) if entry is not None and entry.isdigit() else (index if entry is None else -1)
        if fallback in by_nvml_index:
            return by_nvml_index[fallback]
        return None, torch_uuid

    def devices(self) -> list[Device]:
        """This process's CUDA devices, resolved once (the visible set does not change while it runs)."""
        with self._lock:
            if self._devices is not None:
                return self._devices
            cuda = self._torch_cuda()
            nvml = self._nvml_module()
            found = []
            for index in range(cuda.device_count()):
                try:
                    torch_uuid = _bare(_text(cuda.get_device_properties(index).uuid))
                except Exception:
                    torch_uuid = ""
                handle, uuid = None, torch_uuid
                if nvml is not None:
                    try:
                        handle, uuid = self._handle_for(nvml, index, torch_uuid)
                    except Exception as error:
                        log.warning("no NVML handle for cuda:%d (%s): its NVML series are skipped", index, error)
                found.append(Device(index, uuid, handle))
            self._devices = found
            return found

    # -- series --------------------------------------------------------------------------------------------
    def _process_bytes(self, handle: Any) -> float:
        nvml = self._nvml
        mine = [p for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == self._pid]
        if not mine:
            # Seen in containers with their own PID namespace: NVML reports the host's PIDs.
            raise LookupError(f"pid {self._pid} is not among NVML's running processes on this device")
        used = [p.usedGpuMemory for p in mine]
        if any(value is None for value in used):
            raise LookupError("NVML does not report this process's memory (usedGpuMemory unavailable)")
        return float(sum(used))

    def _series(self) -> list[tuple[str, str, bool, Callable[[Device], float]]]:
        """(name, help, needs an NVML handle, value of one device)."""
        cuda = self._cuda
        nvml = self._nvml
        return [
            (ALLOCATED, "Bytes allocated by torch tensors.", False,
             lambda d: float(cuda.memory_allocated(d.index))),
            (RESERVED, "Bytes reserved by torch's caching allocator.", False,
             lambda d: float(cuda.memory_reserved(d.index))),
            (PEAK, "Peak bytes allocated by torch tensors since start.", False,
             lambda d: float(cuda.max_memory_allocated(d.index))),
            (USED, "Bytes used on the device by all processes (NVML).", True,
             lambda d: float(nvml.nvmlDeviceGetMemoryInfo(d.handle).used)),
            (TOTAL, "Bytes of memory on the device (NVML).", True,
             lambda d: float(nvml.nvmlDeviceGetMemoryInfo(d.handle).total)),
            (UTILIZATION, "Fraction of NVML's last sample period in which a kernel ran.", True,
             lambda d: nvml.nvmlDeviceGetUtilizationRates(d.handle).gpu / 100.0),
            (PROCESS, "Device memory used by this process, as NVML's running processes report it.", True,
             lambda d: self._process_bytes(d.handle)),
        ]

    def _warn_once(self, name: str, device: Device, error: BaseException) -> None:
        key = (name, device.index)
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, "%s for cuda:%d skipped: %s: %s", name, device.index, type(error).__name__, error)

    def collect(self) -> Iterator[Metric]:
        cuda = self._torch_cuda()
        if not cuda.is_available():
            return
        devices = self.devices()
        for name, help_text, needs_nvml, value_of in self._series():
            family = GaugeMetricFamily(name, help_text, labels=LABELS)
            for device in devices:
                if needs_nvml and device.handle is None:
                    continue
                try:
                    value = value_of(device)
                except Exception as error:  # one call, one series, one device: the rest go on
                    self._warn_once(name, device, error)
                    continue
                family.add_metric([str(device.index), device.uuid], value)
            if family.samples:
                yield family
