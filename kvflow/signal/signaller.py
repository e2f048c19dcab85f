"""The engine's layer signaller: a :class:`~kvflow.signal.channel.SignalChannel` created only
outside a profile/dummy run, and a counted no-op before that (see :mod:`kvflow.signal`)."""

from __future__ import annotations

from typing import Any, Callable

from kvflow.context import sends_allowed

from .channel import SignalChannel, SignalStats, _count
from .segment import check_num_layers


class LayerSignaller:
    """The engine's handle: holds a channel once :meth:`init` ran outside a profile run.

    Before :meth:`init` (or after a refused one) every :meth:`signal` is a counted no-op, so a
    profile run that happens before set-up cannot leave signals nobody reads.

    Parameters
    ----------
    instance_id, num_layers, device, store
        As :meth:`SignalChannel.create`.

    Examples
    --------
    >>> sig = LayerSignaller("p0", num_layers=32)
    >>> with forward_context(is_dummy_or_profile_run=True):
    ...     engine.profile_run()             # no channel, no signal
    >>> sig.init()                           # real run: the segment appears
    >>> engine.prefill(token_ids, block_table, on_chunk=lambda start, end: sig.layer_hook(step))
    """

    def __init__(self, instance_id: str, num_layers: int, *, device: Any = "cpu",
                 store: str = "atomic") -> None:
        self.instance_id, self.num_layers = instance_id, check_num_layers(num_layers)
        self.device, self.store = device, store
        self.channel: SignalChannel | None = None
        self.stats = SignalStats()

    def init(self) -> SignalChannel | None:
        """Create the channel unless inside a profile/dummy run (then None, counted)."""
        if self.channel is None:
            self.channel = SignalChannel.create(self.instance_id, self.num_layers,
                                                device=self.device, store=self.store)
            if self.channel is None:
                self.stats.creates_suppressed += 1
        return self.channel

    def signal(self, layer: int, step: int) -> bool:
        """Signal through the channel; a counted no-op before init or inside a profile run."""
        if self.channel is None or not sends_allowed():
            _count("suppressed", self.stats)
            return False
        ok = self.channel.signal(layer, step)
        if ok:
            self.stats.written += 1
        return ok

    def layer_hook(self, step: int) -> Callable[[int], None]:
        """The per-layer hook ``on_layer(layer)`` of one prefill step (what an ``on_chunk`` of
        :meth:`Engine.prefill <kvflow.engine.Engine.prefill>` returns)."""
        return lambda layer: self.signal(layer, step)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
