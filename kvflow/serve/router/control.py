"""The router's control plane: one ZMQ ROUTER socket for every instance; registration, N x M
pairing, liveness (:mod:`kvflow.serve.router.liveness`), ``Unpair`` / ``Reregister``, and
routing of replies to requests. Rules: docs/reliability.md, "Liveness"."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import zmq
import zmq.asyncio

from kvflow.serve.protocol import (Heartbeat, Leaving, Pair, PairResult, Register, Registered,
                                   Reregister, Tokens, Unpair, decode_or_log, encode)
from kvflow.segments import ALIVE, DEAD, UNKNOWN, process_state

from ..advertise import advertised_host
from ..instance.heartbeat import BEAT_SUFFIX
from ..launch.config import ServeConfig
from .errors import registration_refusal
from .liveness import GONE, StallClock, judge
from .placement import InstanceInfo, ReqState, pick_pair

log = logging.getLogger("kvflow.serve.router")


class Controller:
    """Bound to ``host``:``port`` (0: a free port; :attr:`addr` names ``advertise_host``);
    ``proc_alive(pid)``: for processes this server spawned (None: heartbeats only)."""

    MONITOR_S = 0.1  # how often liveness is judged (seconds)

    def __init__(self, host: str = ServeConfig.host, port: int = 0, *, mode: str = "disagg",
                 metrics: Any = None, proc_alive: Callable[[int], bool | None] | None = None,
                 dead_after_s: float = ServeConfig.dead_after_s,
                 hung_after_s: float = ServeConfig.hung_after_s, model: str = "",
                 tokenizer: str = "", advertise_host: str | None = None) -> None:
        self.mode, self.metrics, self.proc_alive = mode, metrics, proc_alive
        self.model, self.tokenizer = model, tokenizer  # an instance must share the vocabulary
        self.dead_after_s, self.hung_after_s = dead_after_s, hung_after_s
        self.stalls = StallClock(time.monotonic(), self.MONITOR_S)
        self.registered_pids: set[int] = set()  # every pid that ever registered (kept after death)
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.addr = f"tcp://{advertised_host(host, advertise_host)}:{port}"  # what peers dial
        self.instances: dict[str, InstanceInfo] = {}
        self.requests: dict[str, ReqState] = {}
        self.errors: list[str] = []
        self.exited: set[str] = set()  # instances declared dead whose process was seen to exit
        self._asked: dict[bytes, float] = {}  # unknown instance -> when it was asked to register
        self.pairs_sent: dict[str, set[str]] = {}  # instance -> peers it was sent a Pair for
        self.left: set[str] = set()  # instances that stopped cleanly (Leaving)
        self._tasks: list[asyncio.Task] = []
        self._rr = 0

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._recv_loop()), asyncio.ensure_future(self._monitor())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.sock.close(0)
        self.ctx.destroy(linger=0)  # not term(): one socket left open would hang the stop

    def by_role(self, role: str) -> list[InstanceInfo]:
        return [i for i in self.instances.values() if i.role == role]

    def ready(self) -> bool:
        if self.mode == "colocated":
            return bool(self.by_role("colocated"))
        return any(d.id in p.pair_ok and p.id in d.pair_ok
                   for p in self.by_role("prefill") for d in self.by_role("decode"))

    def pick(self) -> tuple[InstanceInfo, InstanceInfo] | None:
        """(prefill, decode) for the next request (:func:`~kvflow.serve.router.placement.pick_pair`),
        or None while no pair is ready."""
        got = pick_pair(self.instances.values(), self.requests.values(), self.mode, self._rr + 1)
        if got is not None and self.mode != "colocated":  # the turn counts disagg picks only
            self._rr += 1
        return got

    async def send(self, inst: InstanceInfo, msg: Any) -> None:
        await self._send(inst.ident, msg, f"cannot send {type(msg).__name__} to {inst.id}")

    async def _send(self, ident: bytes, msg: Any, failed: str) -> None:
        try:
            await self.sock.send_multipart([ident, encode(msg)])
        except zmq.ZMQError as exc:  # instance gone (ROUTER_MANDATORY)
            log.error("%s: %s", failed, exc)

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                log.error("rejected control message of %d frames (expected 2)", len(frames))
                continue
            ident, frame = frames
            msg = decode_or_log(frame, f"instance {ident.decode(errors='replace')!r}")
            if msg is not None:
                try:
                    await self._handle(ident, msg)
                except Exception:
                    log.exception("handling %s failed", type(msg).__name__)

    async def _handle(self, ident: bytes, msg: Any) -> None:
        now = time.monotonic()
        if isinstance(msg, Register):
            refused = registration_refusal(msg, ident, mode=self.mode, model=self.model,
                                           tokenizer=self.tokenizer)
            if refused:
                self.errors.append(f"registration of {msg.instance_id} refused: {refused}")
                log.error("%s", self.errors[-1])
                await self._send(ident, Registered(ok=False, error=refused),
                                 f"cannot answer {ident!r}")
                return
            await self._send(ident, Registered(ok=True), f"cannot answer {ident!r}")
            self.left.discard(msg.instance_id)
            info = InstanceInfo(msg, ident, now, msg.free_blocks, heartbeat_at=now)
            self.instances[msg.instance_id] = info
            self.registered_pids.add(msg.pid)
            self._set_blocks(info)
            log.info("registered %s (%s, pid %d, %d blocks)", msg.instance_id, msg.role, msg.pid,
                     msg.num_blocks)
            await self._pair(info)
            return
        name = ident.decode(errors="replace")
        if name.endswith(BEAT_SUFFIX):  # an instance's heartbeat socket: answer its own
            name = name[:-len(BEAT_SUFFIX)]
            if not isinstance(msg, Heartbeat) or msg.instance_id != name:
                log.error("%s from heartbeat socket %r; dropped", type(msg).__name__, ident)
                return
            ident = name.encode()
        info = self.instances.get(name)
        if info is None and name in self.left:  # a beat that overtook its own Leaving
            return
        if info is None:
            log.error("%s from unregistered instance %r; dropped", type(msg).__name__, ident)
            if isinstance(msg, Heartbeat) and now - self._asked.get(ident, 0.0) >= 1.0:
                self._asked[ident] = now  # alive after all (e.g. declared dead under load)
                await self._send(ident, Reregister(reason="declared dead after missed heartbeats"),
                                 f"cannot ask {ident!r} to register again")
            return
        info.last_seen = now
        if isinstance(msg, Heartbeat):
            if msg.seq and msg.seq < info.seq:  # overtaken by a newer one (the other socket)
                return
            info.seq = msg.seq
            info.free_blocks, info.num_running = msg.free_blocks, msg.num_running
            info.heartbeat_at = now
            self._set_blocks(info)
        elif isinstance(msg, PairResult):
            if msg.ok and msg.peer_id not in self.instances:  # a late pairing, peer died since
                await self.send(info, Unpair(peer_id=msg.peer_id, reason="not registered",
                                             exited=msg.peer_id in self.exited))
            elif msg.ok:
                info.pair_ok.add(msg.peer_id)
            else:
                self.errors.append(msg.error)
        elif isinstance(msg, Leaving):  # a clean stop: forgotten now, logged as a stop
            self.left.add(info.id)
            self.instance_died(info, f"stopped by {msg.reason or 'its own request'}", stopped=True)
        elif hasattr(msg, "req_id"):
            st = self.requests.get(msg.req_id)
            if st is not None:
                st.queue.put_nowait(msg)
        else:
            log.error("unexpected %s from %s; dropped", type(msg).__name__, info.id)

    def _set_blocks(self, info: InstanceInfo) -> None:
        if self.metrics is not None:
            self.metrics.set_blocks(info.id, info.role, info.free_blocks, info.reg.num_blocks)

    async def _pair(self, new: InstanceInfo) -> None:
        if new.role == "colocated":
            return
        others = self.by_role("decode" if new.role == "prefill" else "prefill")
        for other in others:
            p, d = (new, other) if new.role == "prefill" else (other, new)
            if p.reg.kv_connector != d.reg.kv_connector:
                self.errors.append(f"kv connector mismatch: {p.id} uses {p.reg.kv_connector!r}, "
                                   f"{d.id} uses {d.reg.kv_connector!r}; not paired")
                continue
            self.pairs_sent.setdefault(p.id, set()).add(d.id)
            self.pairs_sent.setdefault(d.id, set()).add(p.id)
            await self.send(p, _pair_msg(d, data_addr=d.reg.data_addr, lease_addr=d.reg.lease_addr))
            await self.send(d, _pair_msg(p))

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.MONITOR_S)
            self.check_liveness(time.monotonic())

    def check_liveness(self, now: float) -> None:
        """Judge every instance at ``now`` (a stall of this loop is credited to each first);
        declare the dead ones dead."""
        stalled = self.stalls.tick(now)
        for info in list(self.instances.values()):
            info.last_seen += stalled
            ours = None if self.proc_alive is None else self.proc_alive(info.reg.pid)
            process = {True: ALIVE, False: DEAD}.get(ours) if ours is not None else \
                process_state(info.reg.pid, info.reg.host_id)
            state, why = judge(now - info.last_seen, process or UNKNOWN,
                               dead_after_s=self.dead_after_s, hung_after_s=self.hung_after_s)
            if state == GONE:
                self.instance_died(info, why, exited=process == DEAD)
            elif state != info.liveness:
                log.warning("%s instance %s is %s (nothing heard for %.1f s)", info.role,
                            info.id, state, now - info.last_seen)
                info.liveness = state

    def instance_died(self, info: InstanceInfo, why: str, *, exited: bool = False,
                      stopped: bool = False) -> None:
        """Forget a dead instance, fail the requests that need it, unlink its segment. ``exited``:
        its process was seen to exit; ``stopped``: a clean stop (``Leaving``), logged at INFO."""
        self.instances.pop(info.id, None)
        if exited:
            self.exited.add(info.id)
        text = f"{info.role} instance {info.id} (pid {info.reg.pid}) {why}"
        if stopped:
            log.info("%s", text)
        else:
            self.errors.append(text)
            log.error("%s", text)
        self.pairs_sent.pop(info.id, None)
        for other in self.instances.values():  # each peer (also one still waiting to pair) unpairs
            sent = self.pairs_sent.get(other.id, set())
            if info.id in other.pair_ok or info.id in sent:
                asyncio.ensure_future(self.send(other, Unpair(peer_id=info.id, reason=why,
                                                              exited=exited, stopped=stopped)))
            other.pair_ok.discard(info.id)
            sent.discard(info.id)
        if self.metrics is not None:
            self.metrics.forget(info.id, info.role)
        if info.reg.shm_name:  # kept while its owner lives: it may register again
            from kvflow import segments
            parsed = segments.parse_name(info.reg.shm_name)
            if parsed is not None and segments.owner_state(parsed.owner) == segments.DEAD:
                segments.unlink(info.reg.shm_name)
        for req_id, st in self.requests.items():
            if st.decode_id == info.id or (st.prefill_id == info.id and st.stage != "decoding"):
                st.queue.put_nowait(Tokens(req_id=req_id, token_ids=[], finished=True,
                                           finish_reason="error",
                                           error=f"{info.role} instance {info.id} " +
                                                 (why if stopped else f"died ({why})")))

    def health(self) -> dict:
        """The ``/health`` JSON."""
        now = time.monotonic()
        return {"status": "ok" if self.ready() else "starting", "mode": self.mode,
                "control_addr": self.addr,
                "instances": [{"id": i.id, "role": i.role, "pid": i.reg.pid,
                               "kv_connector": i.reg.kv_connector, "num_blocks": i.reg.num_blocks,
                               "free_blocks": i.free_blocks, "num_running": i.num_running,
                               "heartbeat_age_s": now - i.heartbeat_at, "liveness": i.liveness,
                               "max_model_len": i.reg.max_model_len, "spec": i.reg.spec,
                               "shm_name": i.reg.shm_name, "data_addr": i.reg.data_addr,
                               "lease_addr": i.reg.lease_addr, "paired_with": sorted(i.pair_ok),
                               "spec_differs": _spec_differs(self, i)}
                              for i in self.instances.values()],
                "router_stalled_s": self.stalls.stalled_s,
                "errors": self.errors[-20:]}


def _pair_msg(peer: InstanceInfo, **extra: str) -> Pair:
    """The :class:`Pair` that tells an instance of its peer ``peer``."""
    r = peer.reg
    return Pair(peer_id=peer.id, peer_role=peer.role, peer_spec=r.spec,
                peer_num_blocks=r.num_blocks, shm_name=r.shm_name, peer_pid=r.pid,
                peer_host_id=r.host_id, peer_fingerprint=r.fingerprint,
                peer_connector_md=r.connector_md, **extra)


def _spec_differs(ctl: Controller, info: InstanceInfo) -> dict:
    """``{peer id: {field: [ours, theirs]}}`` for each paired peer whose KV cache spec differs."""
    out = {}
    for peer in filter(None, map(ctl.instances.get, sorted(info.pair_ok))):
        diff = {k: [v, peer.reg.spec.get(k)] for k, v in info.reg.spec.items()
                if peer.reg.spec.get(k) != v}
        if diff:
            out[peer.id] = diff
    return out
