"""Which kernel backends a study sweeps on a device (:mod:`.kernels`, :mod:`.contention`)."""

from __future__ import annotations


def pick_backends(requested: list[str] | None, device) -> tuple[list[str], dict[str, str]]:
    """Backends to sweep on ``device`` (torch first, as the baseline) and why others are left out.

    ``requested=None`` means every backend available here that runs on ``device`` (except Triton
    on a CPU, which is its interpreter); an explicitly requested backend that cannot run raises
    (never silently dropped).

    Raises
    ------
    ValueError, RuntimeError
        From :func:`kvflow.kernels.registry.get_backend`, naming the backend.
    """
    from kvflow.kernels.registry import available_backends, get_backend
    left_out: dict[str, str] = {}
    names = []
    if requested is None:
        for name, state in available_backends().items():
            if state != "available":
                left_out[name] = state
                continue
            try:
                get_backend(name, device)
            except (ValueError, RuntimeError) as exc:
                left_out[name] = str(exc)
                continue
            if name == "triton" and device.type == "cpu":
                left_out[name] = ("runs in Triton's interpreter here (TRITON_INTERPRET=1): a "
                                  "correctness mode, not a speed; name it in --backends to time it")
                continue
            names.append(name)
    else:
        for name in requested:
            get_backend(name, device)
            names.append(name)
    names.sort(key=lambda n: (n != "torch", n))
    return names, left_out
