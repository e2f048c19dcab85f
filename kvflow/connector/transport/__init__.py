"""Transports: the pieces every connector kind and the vLLM connector share to move bytes;
nothing here knows a kind, a lease or a serving-protocol message.

- :mod:`.shm`: a paged cache in a POSIX shared-memory segment (or, on CUDA, CUDA IPC).
- :mod:`.cuda_ipc`: a GPU cache's one allocation exported by CUDA IPC handle.
- :mod:`.nixl_agent`, :mod:`.nixl_plan`, :mod:`.nixl_progress`, :mod:`.nixl_net`: the NIXL
  agent, descriptor plans, the progress driver, UCX listeners bound to ``--host``.
- :mod:`.frames`: a staging buffer as one zero-copy frame per layer, and check-then-scatter.

Their one error is :class:`TransferError` (also ``kvflow.connector.TransferError``).
"""


class TransferError(RuntimeError):
    """A transfer that cannot be done (bad frames, unmapped peer, size mismatch)."""
