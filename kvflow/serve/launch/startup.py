"""Start-up checks of ``python -m kvflow.serve``: each failure is one line on stderr
(:class:`StartupError`, exit 1) naming the flag or value at fault; SIGINT/SIGTERM while starting."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import signal
from typing import Iterator

PREFIX = "kvflow.serve: error: "
log = logging.getLogger("kvflow.serve")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that both stop the same way."""


_INTERRUPTS: list[int] = []  # SIGINT / SIGTERM received while starting, in order


def record_interrupt(signum: int, frame) -> None:
    """SIGINT / SIGTERM while the process imports its modules: only remember it (raised inside
    an import it could abort a C++ extension); :func:`arm_interrupts` raises it afterwards."""
    _INTERRUPTS.append(signum)


def arm_interrupts(sigterm: bool = True) -> None:
    """From now on SIGINT (and SIGTERM with ``sigterm``) raise at once; one received before is
    raised now."""
    signal.signal(signal.SIGINT, on_interrupt)
    if sigterm:
        signal.signal(signal.SIGTERM, on_interrupt)
    check_interrupted()


def on_interrupt(signum: int, frame) -> None:
    """SIGINT / SIGTERM while starting: remember it, raise KeyboardInterrupt or Terminated."""
    _INTERRUPTS.append(signum)
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def interrupted_by() -> int | None:
    """The first SIGINT / SIGTERM received while starting, or None."""
    return _INTERRUPTS[0] if _INTERRUPTS else None


def check_interrupted() -> None:
    """Raise the first interrupt received while starting again (an import that catches every
    exception may have swallowed it)."""
    if _INTERRUPTS:
        raise Terminated if _INTERRUPTS[0] == signal.SIGTERM else KeyboardInterrupt


class StartupError(SystemExit):
    """A start-up failure: ``str(exc)`` is the one line to print; exit status 1 (a SystemExit:
    never swallowed by ``except Exception``)."""

    def __init__(self, message: str) -> None:
        self.message = " ".join(str(message).split())  # one line, whatever the cause printed
        super().__init__(PREFIX + self.message)

    def __str__(self) -> str:
        return PREFIX + self.message


def check_model(model: str):
    """``--model``'s :class:`~kvflow.model.config.ModelConfig`, read without loading weights.
    :class:`StartupError` when it is neither a built-in name nor a checkpoint directory (naming what
    it lacks), or its config.json is unreadable or unsupported."""
    from kvflow.model.config import PRESETS, ModelConfig
    if model in PRESETS:
        return PRESETS[model]
    names = ", ".join(PRESETS)
    if not os.path.exists(model):
        raise StartupError(f"--model {model!r} is neither a built-in model ({names}) nor a "
                           f"directory; pass one of those names or the path of a local Hugging "
                           f"Face Llama/Qwen2 checkpoint")
    if not os.path.isdir(model):
        raise StartupError(f"--model {model!r} is a file, not a checkpoint directory; pass the "
                           f"directory that holds config.json, *.safetensors and tokenizer.json")
    has = {f: os.path.isfile(os.path.join(model, f)) for f in ("config.json", "tokenizer.json")}
    has["*.safetensors"] = bool(glob.glob(os.path.join(glob.escape(model), "*.safetensors")))
    missing = [f for f in ("config.json", "*.safetensors", "tokenizer.json") if not has[f]]
    if missing:
        raise StartupError(f"--model {model!r} is a directory but not a checkpoint: it has no "
                           f"{', '.join(missing)}; pass a Hugging Face Llama/Qwen2 checkpoint "
                           f"directory or a built-in model ({names})")
    path = os.path.join(model, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = ModelConfig.from_hf(json.load(f), name=model)
    except json.JSONDecodeError as exc:
        raise StartupError(f"--model {model!r}: config.json is not valid JSON ({exc})") from None
    except OSError as exc:
        raise StartupError(f"--model {model!r}: cannot read config.json ({exc.strerror})") from None
    except KeyError as exc:
        raise StartupError(f"--model {model!r}: config.json has no {exc.args[0]!r}") from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise StartupError(f"--model {model!r}: {exc}") from None
    return config


def check_device(device: str, gpus: dict[str, int] | None = None) -> None:
    """Check that ``--device`` can run here, before any child starts (``gpus``: ``{flag: ordinal}``
    handed out); :class:`StartupError` without CUDA, or for an ordinal past the visible GPUs."""
    if device == "cpu":
        return
    import torch
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = f"this torch ({torch.__version__}) is built without CUDA"
        else:
            why = (f"torch sees no CUDA GPU (CUDA_VISIBLE_DEVICES="
                   f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})")
        raise StartupError(f"--device {device}: {why}; use --device cpu, or a CUDA build of "
                           f"torch on a machine with an NVIDIA GPU")
    n = torch.cuda.device_count()
    for flag, ordinal in (gpus or {}).items():
        if ordinal >= n:
            fix = (f"pass {flag} 0 to put P and D on the one GPU (each then gets half of "
                   f"--gpu-memory-utilization)" if n == 1 else f"pass a {flag} below {n}")
            raise StartupError(f"{flag} {ordinal}: this process sees {n} CUDA GPU(s) "
                               f"(ordinals 0..{n - 1}); {fix}")


def check_backend(backend: str, device: str) -> None:
    """Check that ``--backend`` can run on ``device`` here (``auto`` always can). Raises
    :class:`StartupError` naming why not and the backends that can."""
    if backend == "auto":
        return
    import torch
    from kvflow.kernels.registry import available_backends, get_backend
    try:
        get_backend(backend, torch.device(device))
    except (ValueError, RuntimeError) as exc:
        ok = [n for n, why in available_backends().items() if why == "available"]
        raise StartupError(f"--backend {backend}: {exc}; use --backend auto or one available "
                           f"here ({', '.join(ok)})") from None


def bind_error(flag: str, value: object, host: str, port: int, code: int | None,
               reason: str) -> StartupError:
    """The one-line error for a socket that cannot bind ``host:port``; ``flag``/``value`` chose
    the port, ``code`` is the errno (ZMQ's are the same), ``reason`` its text."""
    where = f"{host}:{port}" if port else host
    if code == errno.EADDRINUSE:
        return StartupError(f"{flag} {value} is in use ({where}: {reason}); stop what holds it "
                            f"or pick another {flag}")
    if code == errno.EACCES:
        return StartupError(f"{flag} {value} needs privileges ({where}: {reason}); pick a "
                            f"{flag} of 1024 or more")
    if code in (errno.EADDRNOTAVAIL, errno.EINVAL, errno.ENODEV) or code is None:
        return StartupError(f"--host {host} is not an address of this machine ({where}: "
                            f"{reason}); use 127.0.0.1, 0.0.0.0 or one of this host's addresses")
    return StartupError(f"cannot listen on {where} ({flag} {value}, --host {host}): {reason}; "
                        f"check --host and {flag}")


def check_host(host: str) -> None:
    """Raise :func:`bind_error`'s error when this machine cannot listen on ``host``."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except socket.gaierror as exc:
            raise bind_error("--host", host, host, 0, None, exc.strerror) from None
        except OSError as exc:
            raise bind_error("--host", host, host, 0, exc.errno, exc.strerror) from None


@contextlib.contextmanager
def one_line_errors(what: str) -> Iterator[None]:
    """An unexpected exception in the block becomes ``StartupError("<what>: <type>: <msg>")``
    (its traceback logged at debug level)."""
    try:
        yield
    except Exception as exc:  # StartupError is a SystemExit: it passes through unchanged
        log.debug("%s", what, exc_info=True)
        raise StartupError(f"{what}: {type(exc).__name__}: {exc} "
                           f"(--log-level debug shows where)") from None
