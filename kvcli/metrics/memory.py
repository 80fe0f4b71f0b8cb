"""Device memory probes feeding `MemorySnapshot`.

On CUDA the driver's view comes from NVML (`pynvml`, from the nvidia-ml-py distribution) and the
allocator's from torch. Without a GPU, without pynvml, or when NVML cannot start (no driver, a
container without the library), the probe falls back quietly to what the OS reports for this
process: a dashboard must never fail because a counter is missing.

A sample is a handful of syscalls / NVML queries (well under a millisecond), so the engine may
take one every step.
"""

from __future__ import annotations

import functools
import os
import resource
import sys
from typing import Any

from kvcli.metrics.snapshot import MemorySnapshot

NO_GPU_NOTE = "no GPU found: process RSS shown"


def _cuda_index(device: str) -> int | None:
    """'cuda' -> 0, 'cuda:3' -> 3, anything else -> None (not a CUDA device)."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return None
    return int(index) if index.isdigit() else 0


def _process_rss() -> tuple[int | None, bool]:
    """(bytes, is_peak): current RSS from /proc, else the peak RSS that `resource` keeps."""
    try:
        with open("/proc/self/statm", "rb") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE"), False
    except (OSError, ValueError, IndexError):
        pass
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError):
        return None, False
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return (peak if sys.platform == "darwin" else peak * 1024), True


def _system_memory() -> tuple[int | None, int | None]:
    """(total, used) RAM; used = MemTotal - MemAvailable, which counts reclaimable cache as free."""
    total: int | None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        total = None
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                if key in (b"MemTotal", b"MemAvailable"):
                    fields[key.decode()] = int(rest.split()[0]) * 1024
                    if len(fields) == 2:
                        break
        return fields.get("MemTotal", total), fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, ValueError, IndexError, KeyError):
        return total, None


class MemoryProbe:
    """Samples memory for one device. NVML is initialised once here (and shut down by `close`),
    not on every sample."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._cuda_index = _cuda_index(device)
        self._nvml: Any = None  # the pynvml module once nvmlInit succeeded
        self._handle: Any = None
        self._name = ""
        self._torch_cuda: Any = None  # torch.cuda when usable for this device
        if self._cuda_index is not None:
            self._init_torch_cuda()
            self._init_nvml()

    # -- setup ---------------------------------------------------------------------------------

    def _init_torch_cuda(self) -> None:
        try:
            import torch

            if torch.cuda.is_available() and self._cuda_index is not None \
                    and self._cuda_index < torch.cuda.device_count():
                self._torch_cuda = torch.cuda
                self._name = torch.cuda.get_device_name(self._cuda_index)
        except Exception:  # a broken CUDA install is "no GPU", not a crash
            self._torch_cuda = None

    def _init_nvml(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            return
        try:
            self._handle = self._nvml_handle(pynvml)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self._name = name.decode() if isinstance(name, bytes) else str(name)
            self._nvml = pynvml
        except Exception:
            self._handle = None
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass

    def _nvml_handle(self, pynvml: Any) -> Any:
        """NVML numbers GPUs physically while CUDA numbers the visible ones, so match by PCI bus
        id when torch can tell it, else map the index through CUDA_VISIBLE_DEVICES."""
        assert self._cuda_index is not None
        if self._torch_cuda is not None:
            try:
                p = self._torch_cuda.get_device_properties(self._cuda_index)
                bus_id = f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
                return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            except Exception:
                pass
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if self._cuda_index < len(visible):
            entry = visible[self._cuda_index]
            if entry.isdigit():
                return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
            return pynvml.nvmlDeviceGetHandleByUUID(entry)
        return pynvml.nvmlDeviceGetHandleByIndex(self._cuda_index)

    @property
    def gpu_found(self) -> bool:
        return self._handle is not None or self._torch_cuda is not None

    # -- sampling ------------------------------------------------------------------------------

    def sample(self, kv_pool_bytes: int = 0, weight_bytes: int = 0) -> MemorySnapshot:
        if self.gpu_found:
            return self._sample_cuda(kv_pool_bytes, weight_bytes)
        return self._sample_host(kv_pool_bytes, weight_bytes)

    def _sample_cuda(self, kv_pool_bytes: int, weight_bytes: int) -> MemorySnapshot:
        total = used = process = allocated = reserved = None
        notes: list[str] = []
        if self._torch_cuda is not None:
            # Allocator counters only: these never initialise CUDA or synchronise.
            allocated = int(self._torch_cuda.memory_allocated(self._cuda_index))
            reserved = int(self._torch_cuda.memory_reserved(self._cuda_index))
        if self._handle is not None:
            nvml = self._nvml
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(self._handle)
                total, used = int(info.total), int(info.used)
                process = self._nvml_process_bytes()
                if process is None:
                    notes.append("per-process GPU memory not reported by NVML")
            except Exception:
                notes.append("NVML query failed")
        elif self._torch_cuda is not None:
            notes.append("NVML unavailable: device memory from torch")
            try:
                free, total = self._torch_cuda.mem_get_info(self._cuda_index)
                used = int(total) - int(free)
            except Exception:
                pass
        return MemorySnapshot(
            device=f"cuda:{self._cuda_index} {self._name}".rstrip(),
            gpu_found=True,
            device_total_bytes=total,
            device_used_bytes=used,
            process_used_bytes=process,
            torch_allocated_bytes=allocated,
            torch_reserved_bytes=reserved,
            kv_pool_bytes=kv_pool_bytes,
            weight_bytes=weight_bytes,
            note="; ".join(notes),
        )

    def _nvml_process_bytes(self) -> int | None:
        """This process's GPU memory, or None when the driver does not say (a container's PID
        namespace hides the pid; some drivers report usedGpuMemory as not available)."""
        pid = os.getpid()
        for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
            if proc.pid == pid:
                used = getattr(proc, "usedGpuMemory", None)
                return int(used) if used is not None else None
        return None

    def _sample_host(self, kv_pool_bytes: int, weight_bytes: int) -> MemorySnapshot:
        rss, is_peak = _process_rss()
        total, used = _system_memory()
        if self.device == "cpu" or self._cuda_index is not None:
            note = NO_GPU_NOTE
        else:
            note = f"{self.device}: process RSS shown"
        if is_peak:
            note += " (peak RSS: /proc unavailable)"
        return MemorySnapshot(
            device="cpu" if self._cuda_index is not None else self.device,
            gpu_found=False,
            device_total_bytes=total,
            device_used_bytes=used,
            process_used_bytes=rss,
            kv_pool_bytes=kv_pool_bytes,
            weight_bytes=weight_bytes,
            note=note,
        )

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
            self._handle = None

    def __enter__(self) -> MemoryProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.lru_cache(maxsize=8)
def _probe_for(device: str) -> MemoryProbe:
    # One long-lived probe per device, so NVML is initialised once per process.
    return MemoryProbe(device)


def probe_memory(device: str, kv_pool_bytes: int, weight_bytes: int) -> MemorySnapshot:
    """A memory snapshot for `device` ("cpu", "cuda", "cuda:N"); never raises for a missing GPU,
    driver or pynvml."""
    return _probe_for(device).sample(kv_pool_bytes, weight_bytes)


def process_rss() -> int | None:
    """This process's resident bytes now (None where the OS says nothing current: only a peak)."""
    rss, is_peak = _process_rss()
    return None if is_peak else rss


@functools.lru_cache(maxsize=1)
def _glibc():
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # both, or neither is used
        return libc
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator decides
        return None


def _malloc_trim():
    libc = _glibc()
    return None if libc is None else libc.malloc_trim


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
STEP_BUFFER_MAX = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit
HEAP_TOP_KEPT = 64 << 20


def keep_step_buffers_in_heap() -> bool:
    """Serve buffers up to 32 MiB from the heap and keep up to 64 MiB of freed heap top for the next step
    (glibc's mallopt; nothing elsewhere). Returns whether it was set.

    A CPU prefill chunk allocates and frees outputs of several MB per linear (512 x 8192 fp32 = 16 MiB on a 1B
    shape). Under glibc's default policy each came from a fresh mmap, or from heap pages trimmed off at every
    free, and was zero-filled page by page on first touch: 127,000 page faults in a 512-token prefill on the 1B
    shape, about 5,000 with these settings, set before the model build (2-core Xeon, 2026-12-06, ad hoc: 555 ->
    670 tok/s; neither setting alone helped, nor both set after the build). The cost: up to HEAP_TOP_KEPT of
    freed memory stays resident; return_freed_heap still hands everything free back where a caller asks
    (after a model build; the load's measured growth is unchanged). tests/test_heap_policy.py."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, STEP_BUFFER_MAX)) and bool(libc.mallopt(M_TRIM_THRESHOLD, HEAP_TOP_KEPT))


def return_freed_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere).

    A model build frees each weight's load-time form (the file's codes unpacked, scales) as it packs the
    kernel's; glibc kept those pages, mostly mid-sized chunks below its mmap threshold, so RSS grew by about
    a second copy of the weights (tests/test_inspect_cli.py bounds the growth; `python -m kvcli.bench
    resident` measures it on 1B-8B shapes)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
