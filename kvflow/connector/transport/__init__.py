"""Transports: the pieces every connector kind and the vLLM connector share to move bytes.

Nothing here knows a kind, a request's lease or a message of the serving protocol; the kinds
(:mod:`kvflow.connector`) and :mod:`kvflow.integrations.vllm` stand on these modules.

- :mod:`.shm`: a paged cache in a POSIX shared-memory segment (export, map a peer's); on
  either device, export a new cache and map D's (CPU segment or CUDA IPC).
- :mod:`.cuda_ipc`: a GPU cache's one allocation exported by CUDA IPC handle (export, publish,
  read, import; peer access).
- :mod:`.nixl_agent`: the NIXL agent (registration, descriptors, one-sided READ / WRITE).
- :mod:`.nixl_plan`: descriptor plans (rows of block ids, runs NIXL merges).
- :mod:`.nixl_progress`: the progress driver (one thread per agent, polls while transfers run).
- :mod:`.nixl_net`: binding UCX's listeners to ``--host``'s interface.
- :mod:`.frames`: a staging buffer as one zero-copy frame per layer, and the one "check every
  frame, then scatter" of the receiving side.

Their one error is :class:`TransferError` (defined here, below the connector contract
:mod:`kvflow.connector.base`, which raises it too; ``kvflow.connector.TransferError``).
"""


class TransferError(RuntimeError):
    """A transfer that cannot be done (bad frames, unmapped peer, size mismatch)."""
