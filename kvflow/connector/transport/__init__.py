"""Transports: what every connector kind and the vLLM connector share to move bytes, knowing no
kind, lease or serving message: :mod:`.shm` (shared-memory caches, on CUDA by CUDA IPC),
:mod:`.cuda_ipc`, the NIXL pieces (:mod:`.nixl_agent`, :mod:`.nixl_plan`, :mod:`.nixl_progress`,
:mod:`.nixl_net`) and :mod:`.frames` (layer frames). Their one error is :class:`TransferError` (also
``kvflow.connector.TransferError``).
"""


class TransferError(RuntimeError):
    """A transfer that cannot be done (bad frames, unmapped peer, size mismatch)."""
