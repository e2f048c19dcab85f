"""The router: runs each request over the control plane (``Allocate`` to D, ``Prefill`` to P,
the tokens in order; ``Abort`` on an early end). docs/design.md, "One request, from the router
to D's cache"."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
import uuid
from typing import Any, AsyncIterator

from kvflow.serve.protocol import Abort, Allocate, Allocated, Prefill, Rejected, Tokens

from .api import CompletionRequest, shown
from ..launch.config import ServeConfig
from .control import Controller
from .placement import ReqState
from .errors import RequestError
from .metrics import Metrics
from ..timings import RequestClock

log = logging.getLogger("kvflow.serve.router")

STOPPING = "the server is stopping"  # HTTP 503: a request running or arriving at a stop


def load_tokenizer(model: str) -> Any:
    """The tokenizer of ``model`` without loading its weights."""
    from kvflow.model import PRESETS, ByteTokenizer, HFTokenizer
    return ByteTokenizer() if model in PRESETS else HFTokenizer(model)


class Router:
    """Runs requests over a :class:`Controller`."""

    reply_timeout_s = 5.0       # an instance answers a control message within this
    first_token_timeout_s = 120.0
    token_timeout_s = 60.0

    def __init__(self, controller: Controller, tokenizer: Any, model_name: str, metrics: Metrics,
                 *, admit_timeout_s: float = ServeConfig.admit_timeout_s,
                 api_key: str | None = None) -> None:
        self.ctl, self.tokenizer, self.model_name, self.metrics = controller, tokenizer, model_name, metrics
        self.created = int(time.time())  # /v1/models "created": when this router started
        self.admit_timeout_s = admit_timeout_s  # retry "busy" (no free blocks now) this long
        self.api_key = api_key.encode() if api_key else None
        self.stopping = False  # set by :meth:`stop`: every request from then on is refused
        self._sends: set[asyncio.Future] = set()  # Aborts not yet handed to the control socket

    def stop(self) -> None:
        """Refuse new requests and end every running one with HTTP 503 :data:`STOPPING` (each
        then sends its :class:`Abort`); :attr:`ended` tells when all have (docs/reliability.md,
        "Stop")."""
        self.stopping = True
        for st in list(self.ctl.requests.values()):
            st.queue.put_nowait(RequestError(503, STOPPING))

    @property
    def ended(self) -> bool:
        """No request is running and every :class:`Abort` has been handed to the socket."""
        return not self.ctl.requests and not self._sends

    def authorized(self, header: str | None) -> bool:
        """True without an API key, else when ``header`` is ``Bearer <key>`` (constant time)."""
        if self.api_key is None:
            return True
        given = (header or "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, b"Bearer " + self.api_key)

    def tokenize(self, body: CompletionRequest) -> list[int]:
        if body.model is not None and body.model != self.model_name:  # vLLM answers 404 too
            raise RequestError(404, f"The model {shown(body.model)} does not exist; this server "
                                    f"serves {shown(self.model_name)}.", "model")
        if isinstance(body.prompt, str):
            try:
                return self.tokenizer.encode(body.prompt)
            except UnicodeError as exc:  # e.g. a lone surrogate "\ud800" in the JSON string
                raise RequestError(400, f"prompt is not valid Unicode text: {exc.reason} at "
                                        f"character {exc.start}", "prompt") from None
        vocab = self.tokenizer.vocab_size
        bad = [t for t in body.prompt if t >= vocab]
        if bad:
            raise RequestError(400, f"prompt holds token id {shown(bad[0])}, not in [0, {vocab})",
                               "prompt")
        return list(body.prompt)

    async def _wait(self, st: ReqState, timeout: float, what: str) -> Any:
        try:
            msg = await asyncio.wait_for(st.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise RequestError(504, f"timed out after {timeout:.0f} s waiting for {what}") from None
        if isinstance(msg, RequestError):  # put there by :meth:`stop`
            raise msg
        return msg

    async def run(self, body: CompletionRequest, token_ids: list[int],
                  t_received: float | None = None) -> AsyncIterator[Tokens]:
        """Yield the :class:`Tokens` of one request in output order (P's first, ``index`` 0; then
        D's); the finishing one carries the ``kvflow`` object (:meth:`RequestClock.report`, from
        ``t_received``, default now). A request P's token finished is followed in the background
        (:meth:`_follow`). Raises :class:`RequestError` (the HTTP status and message)."""
        clock = RequestClock(time.monotonic() if t_received is None else t_received)
        if self.stopping:
            raise RequestError(503, STOPPING)
        pair = self.ctl.pick()
        if pair is None:
            raise RequestError(503, "no prefill/decode pair is ready (see GET /health)")
        p, d = pair
        limit = d.reg.max_model_len
        if len(token_ids) + body.max_tokens > limit:
            raise RequestError(400, f"prompt ({len(token_ids)} tokens) + max_tokens "
                                    f"({body.max_tokens}) = {len(token_ids) + body.max_tokens} "
                                    f"exceeds max_model_len={limit}",
                               "prompt" if len(token_ids) >= limit else "max_tokens")
        req_id = f"cmpl-{uuid.uuid4().hex}"
        seed = body.seed if body.seed is not None else secrets.randbelow(1 << 62)  # as vLLM
        st = ReqState(asyncio.Queue(), decode_id=d.id)
        self.ctl.requests[req_id] = st
        done, followed, outcome = False, False, "error"  # outcome None: a 4xx, not counted
        try:
            deadline = time.monotonic() + self.admit_timeout_s
            while True:
                clock.mark("allocate_sent")  # the last try's ("busy" retries drop it)
                await self.ctl.send(d, Allocate(req_id=req_id, token_ids=token_ids,
                                                max_tokens=body.max_tokens,
                                                temperature=body.temperature, seed=seed,
                                                ignore_eos=body.ignore_eos))
                msg = await self._wait(st, self.reply_timeout_s, f"decode instance {d.id} to allocate")
                if isinstance(msg, Allocated):
                    break
                if isinstance(msg, Rejected) and msg.kind == "busy" and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    clock.stamps.pop("allocate_sent", None)
                    continue
                raise self._error(msg)
            clock.mark("allocated")
            st.prefill_id, st.stage = p.id, "prefilling"
            # stamped before the send: awaiting it can resume after P has already received it
            clock.mark("prefill_sent")
            await self.ctl.send(p, Prefill(req_id=req_id, token_ids=token_ids,
                                           temperature=body.temperature, seed=seed,
                                           decode_id=d.id, decode_block_ids=msg.block_ids,
                                           num_cached_blocks=msg.num_cached_blocks,
                                           max_tokens=body.max_tokens,
                                           ignore_eos=body.ignore_eos))
            clock.kvflow.update(prefill_instance=p.id, decode_instance=d.id)
            colocated = p is d
            expect, held = 0, {}  # output index of the next token; messages that came early
            timeout, what = self.first_token_timeout_s, "the first token"
            while True:
                msg = held.pop(expect, None)
                if msg is None:
                    msg = await self._wait(st, timeout, what)
                if not isinstance(msg, Tokens) or msg.error:
                    raise self._error(msg)
                if msg.index > expect:  # D's token overtook P's: keep it for its turn
                    held[msg.index] = msg
                    continue
                clock.merge(msg.kvflow)
                if msg.index <= 1 and msg.token_ids:
                    clock.mark("second_token_at_router" if msg.index else "first_token_at_router")
                if msg.index >= 1 or colocated:  # D has the KV: P is not needed any more
                    st.stage, timeout, what = "decoding", self.token_timeout_s, "the next token"
                else:  # P's token: the KV may still be moving to D
                    st.stage, what = "transferring", "the KV transfer and the second token"
                expect = msg.index + len(msg.token_ids)
                done = msg.finished
                followed = (done and not colocated and msg.index == 0  # D not done yet
                            and not any(h.finished for h in held.values()))
                if msg.index <= 1 and msg.token_ids:
                    clock.mark("second_token_out" if msg.index else "first_token_out")
                if done:
                    msg.kvflow = clock.report()
                if followed:  # P's token ended it: D still receives the KV, then frees
                    asyncio.ensure_future(self._follow(req_id, st))
                yield msg
                if done:
                    return
        except (GeneratorExit, asyncio.CancelledError):  # the HTTP side gave up: client gone
            outcome = "aborted"
            raise
        except RequestError as exc:  # a 4xx (D refused the prompt's size) is the client's, not ours
            outcome = "error" if exc.status >= 500 else None
            raise
        finally:
            if not followed:
                self.ctl.requests.pop(req_id, None)
            if not done:
                if outcome is not None:
                    self.metrics.requests.labels(outcome).inc()
                self._abort(req_id, st)
            else:
                self.metrics.requests.labels("ok").inc()

    async def _follow(self, req_id: str, st: ReqState) -> None:
        """After P's token finished a request: wait for D's empty finished :class:`Tokens`
        (the KV arrived, blocks freed); on an error or a timeout, abort it on P and D."""
        try:
            while True:
                msg = await self._wait(st, self.first_token_timeout_s, "the KV transfer")
                if not isinstance(msg, Tokens) or msg.error:
                    raise self._error(msg)
                if msg.finished:
                    return
        except RequestError as exc:
            log.error("request %s (finished on P's token): %s; aborted", req_id, exc.message)
            self._abort(req_id, st)
        finally:
            self.ctl.requests.pop(req_id, None)

    def _abort(self, req_id: str, st: ReqState) -> None:
        """Send :class:`Abort` to the request's live instances (naming a dead one)."""
        ids = {st.prefill_id, st.decode_id} - {""}
        dead = sorted(i for i in ids if i not in self.ctl.instances)
        for inst_id in ids - set(dead):
            sent = asyncio.ensure_future(self.ctl.send(self.ctl.instances[inst_id], Abort(
                req_id=req_id, reason="router ended the request",
                peer_dead=dead[0] if dead else "", prefill_sent=bool(st.prefill_id),
                prefill_id=st.prefill_id,
                peer_exited=bool(dead) and dead[0] in getattr(self.ctl, "exited", ()))))
            self._sends.add(sent)
            sent.add_done_callback(self._sends.discard)

    @staticmethod
    def _error(msg: Any) -> RequestError:
        if isinstance(msg, Rejected):
            status = {"capacity": 400, "busy": 503, "transfer": 502}.get(msg.kind, 500)
            return RequestError(status,
                                msg.error, (msg.param or "prompt") if msg.kind == "capacity" else None)
        if isinstance(msg, Tokens):
            return RequestError(502, msg.error)
        return RequestError(500, f"unexpected reply {type(msg).__name__}")
