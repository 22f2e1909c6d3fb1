"""A fake CUDA device on a machine without one, that fails where a real GPU would on a misplaced tensor.

``fake_cuda()`` makes ``torch.cuda.is_available()`` true and routes every torch call through a function mode:
a tensor asked for on ``cuda`` (a factory's ``device=``, ``.to("cuda")``, ``.cuda()``, ``Module.to``) is
computed on the CPU but tagged ``OnFakeCuda``, whose ``device`` reads ``cuda:0``; every op on tagged inputs
gives tagged outputs; ``.cpu()`` / ``.to("cpu")`` untag. An op that meets a tagged tensor and an untagged CPU
tensor of one or more dimensions raises the error CUDA would, as does a tagged tensor handed to ``.numpy()`` or
sampled with a CPU generator. What CUDA allows stays allowed: CPU scalars (0-dim tensors), CPU index tensors in
``cuda_tensor[index]``, ``copy_`` across devices, ``item()`` and ``tolist()``.

It also counts host syncs (``FakeCudaMode.syncs``, one entry per sync naming the op), each of which stalls a real
GPU's queue: reading a device tensor on the host (``item``, ``tolist``, ``bool``/``int``/``float``, ``.cpu()``,
``numpy``), a host-to-device copy from pageable memory (``torch.tensor(..., device="cuda")``, ``.to("cuda")`` or
``copy_`` from a tensor that is not pinned or not ``non_blocking``, a CPU index tensor or list into a device tensor),
ops whose output size depends on the data (``nonzero``, boolean indexing, ``unique``, ``bincount``,
``repeat_interleave`` without ``output_size``), and ``torch.cuda.synchronize`` or an event's ``synchronize``.
``pin_memory()`` marks a CPU tensor as pinned.

Autograd runs on the untagged CPU data (gradients come back tagged through ``.grad``), so backward needs no CUDA.
It is a check of placement, not of kernels: the numbers are the CPU's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)


class OnFakeCuda(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:0``."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def grad(self):  # type: ignore[override]
        g = torch.Tensor.grad.__get__(self)
        return None if g is None else _tag(g)

    @grad.setter
    def grad(self, value) -> None:
        torch.Tensor.grad.__set__(self, None if value is None else _untag(value))

    def __repr__(self, **kwargs) -> str:  # type: ignore[override]
        return f"OnFakeCuda({_untag(self)!r})"


def _tag(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, OnFakeCuda) or t.device.type == "meta":
        return t
    tagged = t.as_subclass(OnFakeCuda)
    if getattr(t, "_is_param", False):
        tagged._is_param = True
    return tagged


def _untag(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, OnFakeCuda) else t


def _device_arg(value: Any) -> str | None:
    """``cuda`` / ``cpu`` / ``meta`` when ``value`` names a device, else None."""
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, str) and value.split(":")[0] in ("cuda", "cpu", "meta"):
        return value.split(":")[0]
    return None


def _mismatch(op: str) -> RuntimeError:
    return RuntimeError(f"fake CUDA: {op}: Expected all tensors to be on the same device, but found at least two "
                        f"devices, cuda:0 and cpu!")


def _on_cpu(arg: Any) -> Any:
    """An argument of ``Tensor.to`` with its device made the CPU (a tensor argument gives its dtype)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype
    return "cpu" if _device_arg(arg) == "cuda" else arg


_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "__array__"}
_DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
_FROM_DATA = {torch.tensor, torch.as_tensor}  # factories that copy host data onto the device


def _pinned(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, OnFakeCuda) and getattr(t, "_fake_pinned", False)


def _index_syncs(index: Any) -> bool:
    """Whether indexing a device tensor with ``index`` costs a sync: a host index tensor or list is copied from
    pageable memory, a boolean device mask needs its count of true entries."""
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, list):
            return True
        if isinstance(part, torch.Tensor):
            if isinstance(part, OnFakeCuda) and part.dtype == torch.bool:
                return True
            if not isinstance(part, OnFakeCuda) and part.dim() > 0:
                return True
    return False


def _sync_reason(func, name: str, args: tuple, kwargs: dict, target: str | None, on_cuda: bool) -> str | None:
    """Why ``func`` stalls a real GPU's queue, or None when it does not."""
    first = args[0] if args else None
    if name in _READS and isinstance(first, OnFakeCuda):
        return name
    if target == "cpu" and on_cuda:
        return f"{name} to the host"
    if target == "cuda" and func in _FROM_DATA:
        return f"{name} from host data"
    if target == "cuda" and isinstance(first, torch.Tensor) and not isinstance(first, OnFakeCuda):
        if not (_pinned(first) and kwargs.get("non_blocking", False)):
            return f"{name} from pageable memory" if not _pinned(first) else f"{name} without non_blocking"
    if func is torch.Tensor.copy_ and len(args) > 1:
        dst, src = args[0], args[1]
        if isinstance(dst, OnFakeCuda) and isinstance(src, torch.Tensor) and not isinstance(src, OnFakeCuda):
            if src.dim() > 0 and not (_pinned(src) and (len(args) > 2 and args[2] or kwargs.get("non_blocking"))):
                return "copy_ from pageable memory"
        if not isinstance(dst, OnFakeCuda) and isinstance(src, OnFakeCuda):
            return "copy_ to the host"
    if func in _INDEXING and isinstance(first, OnFakeCuda) and len(args) > 1 and _index_syncs(args[1]):
        return f"{name} with a host or boolean index"
    if on_cuda and name in _DATA_DEPENDENT:
        return name
    if on_cuda and name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                                                              torch.Tensor) and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if on_cuda and name == "where" and len(args) == 1:
        return "where(condition)"
    return None
_CROSS_DEVICE = {torch.Tensor.copy_, torch._has_compatible_shallow_copy_type}  # CUDA allows these across devices


def _target_device(func, args: tuple, kwargs: dict) -> str | None:
    """Where a device-changing call sends its result: ``to``, ``cuda``, ``cpu`` and factories' ``device=``."""
    if func is torch.Tensor.cuda:
        return "cuda"
    if func is torch.Tensor.cpu:
        return "cpu"
    if func is torch.Tensor.to:
        for a in list(args[1:]) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                return "cuda" if isinstance(a, OnFakeCuda) else a.device.type
            found = _device_arg(a)
            if found:
                return found
        return None
    return _device_arg(kwargs.get("device"))


class FakeCudaMode(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []  # one entry per host sync, naming its op

    def sync(self, reason: str) -> None:
        self.syncs.append(reason)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        if func is torch.Tensor.pin_memory:
            pinned = args[0].clone()
            pinned._fake_pinned = True
            return pinned
        if func is torch.Tensor.is_pinned:
            return _pinned(args[0])
        target = _target_device(func, args, kwargs)
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        on_cuda = any(isinstance(t, OnFakeCuda) for t in tensors)
        if (reason := _sync_reason(func, name, args, kwargs, target, on_cuda)) is not None:
            self.sync(reason)
        if on_cuda and func not in _CROSS_DEVICE and target is None:
            checked = tensors if func not in _INDEXING else [args[0]] + ([args[2]] if len(args) > 2 else [])
            checked = [t for t in checked if isinstance(t, torch.Tensor)]  # (a scalar set into a tensor)
            if any(not isinstance(t, OnFakeCuda) and t.device.type == "cpu" and t.dim() > 0 for t in checked):
                raise _mismatch(name)
            generator = kwargs.get("generator")
            if isinstance(generator, torch.Generator) and generator.device.type != "cuda":
                raise RuntimeError(f"fake CUDA: {name}: Expected a 'cuda' device type for generator but found 'cpu'")
            if name in ("numpy", "__array__"):
                raise TypeError("fake CUDA: can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first")
        if "device" in kwargs and _device_arg(kwargs["device"]) == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            func, args, kwargs = torch.Tensor.to, (args[0], "cpu"), {}
        elif func is torch.Tensor.to:
            args = (args[0], *map(_on_cpu, args[1:]))
            kwargs = {k: _on_cpu(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if target == "cpu":
            return tree_map(lambda t: _untag(t) if isinstance(t, torch.Tensor) else t, out)
        if target == "cuda" or (on_cuda and target is None):
            return tree_map(lambda t: _tag(t) if isinstance(t, torch.Tensor) else t, out)
        return out


class FakeEvent:
    """``torch.cuda.Event`` on the fake device: a host clock reading at ``record``; ``synchronize`` counts a sync."""

    def __init__(self, mode: FakeCudaMode, enable_timing: bool = False, **kwargs) -> None:
        self.mode, self.at = mode, None

    def record(self, stream=None) -> None:
        import time

        self.at = time.perf_counter()

    def synchronize(self) -> None:
        self.mode.sync("Event.synchronize")

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1e3


@contextlib.contextmanager
def fake_cuda(monkeypatch) -> Iterator[FakeCudaMode]:
    """Within: ``torch.cuda`` says one device is there, and tensors placed on it are checked as above; yields the
    mode, whose ``syncs`` list the host syncs so far."""
    mode = FakeCudaMode()
    for name, value in {"is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
                        "set_device": lambda d: None, "synchronize": lambda d=None: mode.sync("synchronize"),
                        "Event": lambda **kw: FakeEvent(mode, **kw),
                        "is_bf16_supported": lambda *a, **k: True,
                        "get_device_name": lambda d=None: "fake CUDA (CPU)",
                        "mem_get_info": lambda d=None: (8 * 2**30, 16 * 2**30)}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # Module.to keeps the tagged tensors
    try:
        with mode:
            yield mode
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
