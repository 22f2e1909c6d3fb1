"""GPU memory the runtime takes beside its weights and KV cache, reserved before the KV budget is measured.

The KV budget (``engine.kv_budget``) is what ``target.gpu_memory_fraction`` of the GPU leaves beside what is in use
once the weights are loaded. What is allocated after that point must be counted there, or the GPU runs out at the
first step that needs it: FlashInfer's workspaces (one per engine and one per drafter, allocated when the attention
backend is built) and NCCL's communicator buffers (allocated at a tensor-parallel group's first collectives). The
memory plan (``mtp_train.memory``) counts the same bytes, from the same function.
"""

from __future__ import annotations

# FlashInfer's float workspace, which its split-KV plans fill (shared by an attention backend's wrappers, which run
# one after another on one stream): 128 MiB is a known overflow at 32 query heads on an H100's 132 SMs.
FLASHINFER_FLOAT_WORKSPACE = 512 * 2**20
# Each BatchPrefillWithPagedKVCacheWrapper allocates an 8 MiB int workspace and a 128 KiB kv-length buffer of its
# own; a backend has two wrappers (unmasked plans, and tree-masked plans on fa2).
FLASHINFER_WRAPPER_BYTES = 8 * 2**20 + 32768 * 4
FLASHINFER_WRAPPERS = 2
# NCCL's buffers for one tensor-parallel communicator: an allowance (its channels' send/receive buffers, NVLS
# buffers on NVSwitch systems), not a measurement; NCCL_BUFFSIZE and NCCL_NVLS_ENABLE change it.
NCCL_BYTES = 1 * 2**30


def flashinfer_backend_bytes() -> int:
    """One FlashInfer attention backend's device memory: its float workspace and its wrappers' buffers."""
    return FLASHINFER_FLOAT_WORKSPACE + FLASHINFER_WRAPPERS * FLASHINFER_WRAPPER_BYTES


def reserved_bytes(flashinfer_backends: int, tp_size: int) -> int:
    """What one rank allocates after its weights and before or beside its KV cache: ``flashinfer_backends``
    backends (the engine's and each drafter's; 0 on the torch backend) and, with ``tp_size > 1``, one NCCL
    communicator."""
    return flashinfer_backends * flashinfer_backend_bytes() + (NCCL_BYTES if tp_size > 1 else 0)
