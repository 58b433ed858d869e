"""What a disaggregated worker adds to its EngineCore loop (CoreRole): the prefill side hands
each prompt's KV on after its first token; the decode side takes such prompts in.

The KV travels over a KVLink (engine/disagg/transfer.py) on threads of their own, so the engine
loop never waits for the wire: a prefill worker's sender ships hand-offs in the order it made
them, and a decode worker reads each prefill worker's in that same order (the router forwards
the notices in the order that worker published them), one receiving thread per sender."""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.disagg.runahead import LayerStream
from engine.inputs import AddPrefilled, AddRequest, CooperativeSlice, PrefillRequest
from engine.llm_engine import LLMEngine
from engine.outputs import Handoff
from engine.runner.model_runner import ModelRunner
from engine.sequence import Sequence
from engine.text.output_processor import StepOutput

logger = logging.getLogger(__name__)

HANDOFF_TAG = 1  # the point-to-point channel of hand-offs (cooperative prefill uses others)
MAX_FORGOTTEN = 4096  # aborts of requests not arrived yet, remembered until they arrive


class Wire(Protocol):
    """The point-to-point transport of KV tensors between workers (KVLink)."""

    rank: int
    device: torch.device

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None: ...

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """A send under way: its result's wait() returns once it is out."""

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int,
             tag: int) -> torch.Tensor: ...


def note_deadline(deadlines: dict[str, float], message: AddRequest, clock_offset: float) -> None:
    """Record a request's deadline in this host's monotonic clock (`clock_offset`: this clock
    minus the router's, which set it)."""
    if message.request.deadline is not None:
        deadlines[message.request_id] = message.request.deadline + clock_offset


def kv_shape(engine: LLMEngine, num_tokens: int) -> tuple[int, ...]:
    """What export_kv gives for `num_tokens` positions of this engine's model."""
    cache = engine.runner.kv_cache  # [tensors, 2, slots, Hkv, D]
    layers = len(engine.runner.layout.layer_tensors)
    return (layers, 2, num_tokens, cache.shape[3], cache.shape[4])


class PrefillRole:
    """Requests come as PrefillRequests naming their decode worker; each that got its first
    token without ending is detached after the step, its prompt KV queued for the sender."""

    def __init__(self, engine: LLMEngine, wire: Wire) -> None:
        self.engine = engine
        self.wire = wire
        self._targets: dict[str, int] = {}  # request id -> its decode worker's rank
        self.clock_offset = 0.0  # this host's monotonic clock minus the router's
        self._outbox: queue.SimpleQueue[tuple[torch.Tensor, int] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_all, name="kv-sender", daemon=True)
        self._sender.start()

    def apply(self, message: object, deadlines: dict[str, float]) -> bool:
        if isinstance(message, CooperativeSlice):
            self._take_slice(message)
            return True
        if not isinstance(message, PrefillRequest):
            return False
        self.engine.add_validated(message.request_id, message.request)
        self._targets[message.request_id] = message.decode_rank
        note_deadline(deadlines, message, self.clock_offset)
        return True

    def _take_slice(self, message: CooperativeSlice) -> None:
        """Queue a share of a long prompt (KV-Runahead); the last share hands on as usual, the
        others end after their step (their KV went on to the next worker)."""
        seq = self.engine.add_validated(message.request_id, message.request)
        seq.cooperative = True
        seq.num_remote_kv_tokens = message.slice_start
        self.engine.remote_kv[seq.seq_id] = LayerStream(self.wire, message)
        if message.next_rank is None:
            self._targets[message.request_id] = message.decode_rank

    def after_step(self, outputs: list[StepOutput]) -> tuple[Handoff, ...]:
        handoffs = []
        for out in outputs:
            dst = self._targets.pop(out.request_id, None)
            if dst is None or out.finish_reason is not None or out.token_id is None:
                continue  # ended here (EOS, length, an error, a passed-on slice): no more
            seq = self.engine.sequence(out.request_id)
            assert seq is not None and seq.num_computed_tokens == seq.num_prompt_tokens
            kv = self.engine.runner.export_kv(seq, seq.num_prompt_tokens).to(self.wire.device)
            self.engine.detach(out.request_id)
            self._outbox.put((kv, dst))
            handoffs.append(Handoff(out.request_id, out.token_id, seq.sampling_seed,
                                    seq.num_prompt_tokens, self.wire.rank, dst))
        return tuple(handoffs)

    def forget(self, request_id: str, held: bool) -> None:
        self._targets.pop(request_id, None)

    def close(self) -> None:
        self._outbox.put(None)

    def _send_all(self) -> None:
        while (item := self._outbox.get()) is not None:
            kv, dst = item
            try:
                self.wire.send(kv, dst, HANDOFF_TAG)
            except Exception:  # noqa: BLE001 - that decode worker is gone: the router fails it
                logger.exception("KV hand-off to worker %d failed", dst)


@dataclass(frozen=True)
class Arrived:
    """A hand-off whose KV is here (a decode worker's receiving thread to its loop)."""

    notice: AddPrefilled
    kv: torch.Tensor | None  # None: the transfer failed


class DecodeRole:
    """AddPrefilled notices go to the receiving thread of their sender; once the KV is here
    the request joins the engine with its first token and the KV to place at admission."""

    def __init__(self, engine: LLMEngine, wire: Wire, wake: Callable[[], None]) -> None:
        self.engine = engine
        self.wire = wire
        self._wake = wake  # tells the loop an arrival waits
        self.arrivals: queue.SimpleQueue[Arrived] = queue.SimpleQueue()
        self._senders: dict[int, queue.SimpleQueue[AddPrefilled | None]] = {}
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        self.clock_offset = 0.0  # this host's monotonic clock minus the router's

    def apply(self, message: object, deadlines: dict[str, float]) -> bool:
        if isinstance(message, AddPrefilled):
            self._receiving_from(message.src).put(message)
            return True
        if not isinstance(message, Arrived):
            return False
        notice = message.notice
        if self._forgotten.pop(notice.request_id, "kept") is None:
            return True  # aborted on its way here
        admit_prefilled(self.engine, notice, message.kv)
        note_deadline(deadlines, notice, self.clock_offset)
        return True

    def after_step(self, outputs: list[StepOutput]) -> tuple[Handoff, ...]:
        return ()

    def forget(self, request_id: str, held: bool) -> None:
        if held:
            return
        self._forgotten[request_id] = None
        while len(self._forgotten) > MAX_FORGOTTEN:
            self._forgotten.popitem(last=False)

    def close(self) -> None:
        for inbox in self._senders.values():
            inbox.put(None)

    def take_arrivals(self) -> list[Arrived]:
        taken = []
        while not self.arrivals.empty():
            taken.append(self.arrivals.get_nowait())
        return taken

    def _receiving_from(self, src: int) -> queue.SimpleQueue[AddPrefilled | None]:
        inbox = self._senders.get(src)
        if inbox is None:
            inbox = self._senders[src] = queue.SimpleQueue()
            threading.Thread(target=self._receive_all, args=(src, inbox), daemon=True,
                             name=f"kv-from-{src}").start()
        return inbox

    def _receive_all(self, src: int, inbox: queue.SimpleQueue[AddPrefilled | None]) -> None:
        dtype = self.engine.runner.kv_cache.dtype
        while (notice := inbox.get()) is not None:
            try:
                kv: torch.Tensor | None = self.wire.recv(
                    kv_shape(self.engine, notice.num_kv_tokens), dtype, src, HANDOFF_TAG)
            except Exception:  # noqa: BLE001 - the prompt is recomputed here instead
                logger.exception("KV of request %s from worker %d did not arrive; recomputing "
                                 "its prompt", notice.request_id, src)
                kv = None
            self.arrivals.put(Arrived(notice, kv))
            self._wake()


def admit_prefilled(engine: LLMEngine, notice: AddPrefilled,
                    kv: torch.Tensor | None) -> Sequence:
    """Queue a request whose prompt KV (`kv`, export_kv's) and first token another worker
    made: admission places the KV in its blocks and computes from the first token on. Without
    `kv` (its transfer failed) the prompt is computed here, after the same first token."""
    seq = engine.add_validated(notice.request_id, notice.request, seed=notice.seed)
    if seq.is_finished:  # refused here (its grammar): the engine reports it
        return seq
    seq.num_computed_tokens = seq.num_tokens  # the token was sampled after the whole prompt
    seq.append_token(notice.token_id)
    seq.num_computed_tokens = 0
    after = engine.scheduler.long_rope_after
    if after is not None and notice.num_kv_tokens <= after < seq.num_tokens:
        kv = None  # rotated short, needed long (LongRoPE): recomputed here, as colocated
    if kv is not None:
        seq.num_remote_kv_tokens = notice.num_kv_tokens
        engine.remote_kv[seq.seq_id] = ArrivedKV(kv)
    return seq


class ArrivedKV:
    """A hand-off's prompt KV, here in full (an engine's RemoteKV)."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv  # [layers, 2, tokens, Hkv, D]

    def place(self, runner: ModelRunner, seq: Sequence, start: int) -> None:
        runner.import_kv(seq, start, self.kv)
