"""flashinfer-python 0.6.6's paged attention, as the runtime calls it, written out in torch for the fake CUDA device.

There is no GPU here, so the FlashInfer backend cannot run its real kernels; this module stands in for the package
(``install(monkeypatch)`` puts it in ``sys.modules`` as ``flashinfer``) and does what 0.6.6 does with the same
arguments, read from its source, so that the runtime's calls are checked where CPU tests can check them:

- ``BatchPrefillWithPagedKVCacheWrapper.plan`` (``prefill.py``): with a mask it computes ``mask_indptr`` from the
  indptr arrays it is given, on their device (``_compute_page_mask_indptr``), the index of the *unpacked* bits; an
  unpacked ``custom_mask`` is then packed by ``segment_packbits`` (``quantization.py``), a CUDA kernel: the mask and
  the index must both be on the GPU. Given ``packed_custom_mask`` it keeps the unpacked index (PR #2201, open).
  ``backend="auto"`` is decided at the first plan (``determine_attention_backend``: fa3 on Hopper when there is no
  custom mask) and kept. Host copies of the indptr arrays are taken with ``.to("cpu")``, device copies with
  ``.to(device, non_blocking=True)``, as there (the fake device counts what syncs).
- ``run``: the kernel's mask (``variants.cuh``): a custom mask reads bit ``qo_idx * kv_len + kv_idx`` from the byte
  ``mask_indptr[b]`` on, least significant bit first; causal lets query i see keys up to ``kv_len - q_len + i``;
  a left window of ``w`` keeps keys with ``kv_idx + q_len + w >= kv_len + qo_idx``. fa3 returns
  ``cudaErrorNotSupported`` for a custom mask (``hopper/prefill_sm90.cuh``).
- ``append_paged_kv_cache`` and ``get_batch_indices_positions`` (``page.py``).

Every kernel checks that its tensors are on the GPU, as tvm-ffi's do, and computes on the host data beneath the
fake device's tags (a kernel makes no host sync).
"""

from __future__ import annotations

import sys
import types

import torch

from fake_cuda import OnFakeCuda, _tag, _untag

HOPPER = True  # the GPU check's H200: ``auto`` picks fa3 for unmasked plans
BUILD_ERROR: str | None = None  # set: every module's build fails with this (a node without nvcc)
BUILT: list[tuple] = []  # the modules built or loaded, in order


class KernelError(RuntimeError):
    """What a real kernel call would raise for these arguments."""


def _on_gpu(name: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    for t in tensors:
        if not isinstance(t, OnFakeCuda):
            raise KernelError(f"{name}: a tensor on {t.device} where the kernel needs the GPU's")
    return [_untag(t) for t in tensors]


def _kernel(fn):
    """Run ``fn`` as a kernel: no torch function mode sees its ops (the tags were taken off its inputs)."""
    def wrapped(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)
    return wrapped


def _compute_page_mask_indptr(qo_indptr, paged_kv_indptr, last_page_len, page_size: int) -> torch.Tensor:
    mask_indptr = torch.empty_like(qo_indptr)
    mask_indptr[0] = 0
    mask_indptr[1:] = torch.cumsum((qo_indptr[1:] - qo_indptr[:-1])
                                   * ((paged_kv_indptr[1:] - paged_kv_indptr[:-1] - 1) * page_size + last_page_len), 0)
    return mask_indptr


@_kernel
def _packbits(x: torch.Tensor, indptr: torch.Tensor, new_indptr: torch.Tensor) -> torch.Tensor:
    x, indptr, new_indptr = _on_gpu("segment_packbits", x, indptr, new_indptr)
    out = torch.zeros(int(new_indptr[-1]), dtype=torch.uint8)
    for b in range(indptr.numel() - 1):
        seg = x[int(indptr[b]) : int(indptr[b + 1])].to(torch.uint8)
        seg = torch.nn.functional.pad(seg, (0, (-seg.numel()) % 8)).view(-1, 8)
        out[int(new_indptr[b]) : int(new_indptr[b + 1])] = (seg << torch.arange(8, dtype=torch.uint8)).sum(-1)
    return _tag(out)


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big"):
    assert bitorder == "little", "the runtime packs least significant bit first"
    seglen = indptr[1:] - indptr[:-1]
    indptr_new = torch.zeros(len(indptr), dtype=indptr.dtype, device=indptr.device)
    indptr_new[1:] = torch.cumsum((seglen + 7) // 8, 0)
    indptr_new[-1].item()  # 0.6.6 sizes its output from the device
    return _packbits(x, indptr.to(torch.int32), indptr_new.to(torch.int32)), indptr_new.to(torch.int32)


def determine_attention_backend(device, pos_encoding_mode, use_fp16_qk_reductions, use_custom_mask, dtype_q,
                                dtype_kv) -> str:
    return "fa3" if HOPPER and not use_custom_mask and pos_encoding_mode == 0 else "fa2"


def get_batch_prefill_module(backend: str, *args):
    """``prefill.get_batch_prefill_module``: the module is built with nvcc at its first use (or loaded prebuilt)."""
    if BUILD_ERROR is not None:
        raise RuntimeError(BUILD_ERROR)
    if (backend, *args) not in BUILT:
        BUILT.append((backend, *args))


def get_page_module():
    if BUILD_ERROR is not None:
        raise RuntimeError(BUILD_ERROR)


class BatchPrefillWithPagedKVCacheWrapper:
    instances: list = []  # every wrapper made, for tests to inspect

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", backend: str = "auto",
                 **kwargs) -> None:
        assert kv_layout == "NHD" and not kwargs
        _on_gpu("BatchPrefillWithPagedKVCacheWrapper", float_workspace_buffer)
        self.device = float_workspace_buffer.device
        self._backend = backend
        self._kv_lens_buffer = torch.empty((32768,), dtype=torch.int32, device=self.device)
        self.plans: list[str] = []  # the backend of each plan
        BatchPrefillWithPagedKVCacheWrapper.instances.append(self)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, page_size: int, head_dim_vo=None, custom_mask=None,
             packed_custom_mask=None, causal: bool = False, window_left: int = -1, q_data_type=None,
             kv_data_type=None, non_blocking: bool = True, seq_lens=None, **unused) -> None:
        assert not unused, f"arguments this model does not cover: {sorted(unused)}"
        if custom_mask is not None or packed_custom_mask is not None:
            mask_indptr = _compute_page_mask_indptr(qo_indptr, paged_kv_indptr, paged_kv_last_page_len, page_size)
        if packed_custom_mask is None and custom_mask is not None:
            packed_custom_mask, mask_indptr = segment_packbits(custom_mask.contiguous().view(-1), mask_indptr,
                                                               bitorder="little")
        qo_host = qo_indptr.to("cpu")
        kv_lens_host = (seq_lens.cpu().flatten() if seq_lens is not None else
                        (paged_kv_indptr.to("cpu")[1:] - paged_kv_indptr.to("cpu")[:-1] - 1) * page_size
                        + paged_kv_last_page_len.to("cpu"))
        self._kv_lens_buffer[: len(kv_lens_host)].copy_(kv_lens_host, non_blocking=non_blocking)
        self._qo_indptr_buf = qo_indptr.to(self.device, non_blocking=non_blocking)
        self._paged_kv_indptr_buf = paged_kv_indptr.to(self.device, non_blocking=non_blocking)
        self._paged_kv_indices_buf = paged_kv_indices.to(self.device, non_blocking=non_blocking)
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len.to(self.device, non_blocking=non_blocking)
        if packed_custom_mask is not None:
            self._custom_mask_buf = packed_custom_mask.to(self.device, non_blocking=non_blocking)
            self._mask_indptr_buf = mask_indptr.to(self.device, non_blocking=non_blocking)
        else:
            self._custom_mask_buf = self._mask_indptr_buf = None
        if self._backend == "auto":
            self._backend = determine_attention_backend(self.device, 0, False, self._custom_mask_buf is not None,
                                                        q_data_type, kv_data_type)
        get_batch_prefill_module(self._backend, q_data_type, kv_data_type, q_data_type, paged_kv_indptr.dtype,
                                 head_dim_qk, head_dim_vo or head_dim_qk, 0, window_left >= 0, False, False)
        self._sizes = (num_qo_heads, num_kv_heads, head_dim_qk, page_size, qo_host.numel() - 1)
        self._causal, self._window_left = causal, window_left
        self.plans.append(self._backend)

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self._custom_mask_buf is not None and self._backend == "fa3":
            raise KernelError("BatchPrefillWithPagedKVCache (fa3): cudaErrorNotSupported for a custom mask")
        mask = () if self._custom_mask_buf is None else (self._custom_mask_buf, self._mask_indptr_buf)
        return _attend(q, *paged_kv_cache, self._qo_indptr_buf, self._paged_kv_indptr_buf,
                       self._paged_kv_indices_buf, self._kv_lens_buffer, self._sizes, self._causal,
                       self._window_left, *mask)


@_kernel
def _attend(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_lens, sizes, causal, window_left,
            mask=None, mask_indptr=None):
    """``q [T, Hq, D]`` over the pages ``k_cache, v_cache [P, page, Hkv, D]`` -> ``[T, Hq, D]`` in q's dtype."""
    tensors = [q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_lens] + ([mask, mask_indptr] if mask is not
                                                                                   None else [])
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_lens, *packed = _on_gpu("run", *tensors)
    hq, hkv, d, page, batch = sizes
    out = torch.empty_like(q)
    for b in range(batch):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        kv_len, q_len = int(kv_lens[b]), q1 - q0
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(hq // hkv, 1)
        v = v_cache[pages].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(hq // hkv, 1)
        qi, kj = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
        if packed:
            offset = qi * kv_len + kj
            byte = packed[0][int(packed[1][b]) + offset // 8]
            allowed = ((byte >> (offset % 8).to(torch.uint8)) & 1).bool()
        elif causal:
            allowed = kj <= kv_len - q_len + qi
        else:
            allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
        if window_left >= 0:
            allowed = allowed & (kj + q_len + window_left >= kv_len + qi)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * d**-0.5
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return _tag(out)


@_kernel
def append_paged_kv_cache(k, v, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr, last_page_len,
                          kv_layout: str = "NHD") -> None:
    k_cache, v_cache = paged_kv_cache
    k, v, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr = _on_gpu(
        "append_paged_kv_cache", k, v, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr)
    page = k_cache.shape[1]
    pages = kv_indices[kv_indptr[batch_indices.long()].long() + positions.long() // page].long()
    k_cache[pages, positions.long() % page] = k
    v_cache[pages, positions.long() % page] = v


@_kernel
def get_batch_indices_positions(append_indptr, seq_lens, nnz: int):
    append_indptr, seq_lens = _on_gpu("get_batch_indices_positions", append_indptr, seq_lens)
    counts = (append_indptr[1:] - append_indptr[:-1]).long()
    batch = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    within = torch.arange(nnz) - append_indptr[:-1].long()[batch]
    positions = seq_lens.long()[batch] - counts[batch] + within
    return _tag(batch.to(torch.int32)), _tag(positions.to(torch.int32))


def install(monkeypatch, build_error: str | None = None) -> types.ModuleType:
    """Put this model in ``sys.modules`` as ``flashinfer`` (with its ``prefill``, ``page`` and ``utils``), and as
    installed, for the test's duration; ``build_error``: every kernel build fails with it."""
    from mtp_train.runtime import attention

    module = types.ModuleType("flashinfer")
    module.__version__ = "0.6.6"
    for name in ("BatchPrefillWithPagedKVCacheWrapper", "append_paged_kv_cache", "get_batch_indices_positions",
                 "segment_packbits"):
        setattr(module, name, globals()[name])
    parts = {"prefill": ("get_batch_prefill_module",), "page": ("get_page_module",),
             "utils": ("determine_attention_backend",)}
    for part, names in parts.items():
        sub = types.ModuleType(f"flashinfer.{part}")
        for name in names:
            setattr(sub, name, globals()[name])
        setattr(module, part, sub)
        monkeypatch.setitem(sys.modules, f"flashinfer.{part}", sub)
    BatchPrefillWithPagedKVCacheWrapper.instances = []
    BUILT.clear()
    monkeypatch.setattr(sys.modules[__name__], "BUILD_ERROR", build_error)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(attention, "_flashinfer_installed", lambda: True)
    return module
