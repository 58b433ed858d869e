"""A step crosses between host and device exactly twice: one upload of the packed step
(StepBuffer) and one download of the sampled tokens. Counted on CPU, where a hidden sync would
be free but is still visible: every `.item()`/`bool(t)` dispatches aten._local_scalar_dense,
ops with data-dependent shapes (nonzero, masked_select, unique) sync on CUDA, and host reads
of tensors go through Tensor.numpy/tolist/item."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engine.kernels as kernels
from engine import SamplingParams
from engine.guided import GuidedSpec
from engine.runner.sampler import sample
from engine.runner.step_buffer import StepBuffer
from tests.engine_harness import make_engine
from tests.models_fixtures import build_tiny_model

# Ops whose result the host must wait for, or whose output shape depends on device data.
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
            "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim", "aten::item"}
HOST_READS = ("numpy", "tolist", "item")
TENSOR_BUILDERS = ("tensor", "as_tensor", "from_numpy")


class SyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in SYNC_OPS:
            self.syncs.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def counted_step(engine, monkeypatch) -> tuple[list[str], Counter, list]:
    """engine.step() with every sync op, host read and tensor-from-data call counted."""
    calls: Counter = Counter()

    def counting(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapper)

    for name in HOST_READS:
        counting(torch.Tensor, name)
    for name in TENSOR_BUILDERS:
        counting(torch, name)
    counter = SyncCounter()
    with counter:
        events = engine.step()
    monkeypatch.undo()
    return counter.syncs, calls, events


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("transfers"))


GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
PROCESSED = [SamplingParams(max_new_tokens=20, ignore_eos=True, do_sample=True, top_k=5,
                            top_p=0.9, temperature=0.8, seed=1, frequency_penalty=0.5,
                            presence_penalty=0.3),
             SamplingParams(max_new_tokens=20, repetition_penalty=1.3, top_logprobs=2,
                            min_new_tokens=10),
             GREEDY]
# grammars that outlast the test: the rows stay guided in every counted step
GUIDED = [GREEDY, SamplingParams(max_new_tokens=20, guided=GuidedSpec("regex", "[a-z ]{40}")),
          SamplingParams(max_new_tokens=20, do_sample=True, seed=3,
                         guided=GuidedSpec("regex", "[0-9]{40}"))]
BACKENDS = ["reference"] + (["cpu_paged"] if kernels.compiler() else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batching", ["continuous", "paged"])
@pytest.mark.parametrize("params", [[GREEDY] * 3, PROCESSED, GUIDED],
                         ids=["greedy", "processed", "guided"])
def test_a_decode_step_reads_the_device_once(tiny, backend, batching, params,
                                             monkeypatch) -> None:
    engine = make_engine(tiny, batching, attention_backend=backend)
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [5, 6, 7, 8 + i], p)
    for _ in range(3):  # prefill, then decode steps: the step buffer has its size by now
        engine.step()
    syncs, calls, events = counted_step(engine, monkeypatch)
    assert len(events) == 3 and engine.last_batch.num_decode_tokens == 3
    assert syncs == []
    assert sum(calls[n] for n in HOST_READS) == 1, calls
    assert sum(calls[n] for n in TENSOR_BUILDERS) == 0, calls


def test_a_mixed_chunked_step_reads_the_device_once(tiny, monkeypatch) -> None:
    """Paged: decodes beside a prompt chunk, and a chunk that samples nothing yet."""
    engine = make_engine(tiny, "paged", max_num_batched_tokens=8, attention_backend="reference")
    engine.add_request("a", [5, 6, 7], PROCESSED[0])
    engine.step()
    engine.add_request("b", list(range(10, 40)), GREEDY)
    syncs, calls, _ = counted_step(engine, monkeypatch)
    batch = engine.last_batch
    assert batch.num_decode_tokens == 1 and batch.num_prefill_tokens == 7
    assert syncs == [] and sum(calls[n] for n in HOST_READS) == 1, calls


def test_step_buffer_stays_put_across_steps(tiny) -> None:
    engine = make_engine(tiny, "paged")
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.step()
    buffer = engine.runner.buffer
    pointers = {(buffer.host.data_ptr(), buffer.dev.data_ptr())}
    for _ in range(5):
        engine.step()
        pointers.add((buffer.host.data_ptr(), buffer.dev.data_ptr()))
    assert len(pointers) == 1


@pytest.mark.parametrize("params", [[GREEDY] * 3, PROCESSED], ids=["greedy", "processed"])
def test_the_decode_forward_and_sampler_trace_as_one_graph(tiny, params) -> None:
    """What CUDA graphs and torch.compile need: TorchDynamo traces the decode forward and the
    batched sampler (up to its one download) with no graph break, i.e. no host sync inside.
    The GPU's path: aten linears, no C kernels (those are CPU-only calls across ctypes)."""
    engine = make_engine(tiny, "paged", attention_backend="reference", linear_backend="aten")
    engine.runner.model.use_fused_cpu_ops(None)
    engine.runner.sampler.greedy = None
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [5, 6, 7, 8 + i], p)
    engine.step()
    runner = engine.runner
    views, meta, plan = runner.stage(engine.scheduler.schedule())

    def decode(views):
        return sample(runner.eager_logits(views, meta, [0]), plan, views)

    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(decode)(views)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_step_buffer_sections_take_flat_values_rows_and_arrays() -> None:
    buffer = StepBuffer(torch.device("cpu"))
    buffer.put("flat", [3, 1, 2])
    buffer.put("rows", [[1, 2, 3], (4, 5, 6)], shape=(2, 3))
    buffer.put("pages", [[7, 8], [9, 0], [1, 2], [3, 4]], shape=(2, 2, 2))
    buffer.put("flags", [np.bool_(True), False])
    buffer.put("array", np.arange(4).reshape(2, 2), shape=(2, 2))
    buffer.put("empty", [], shape=(3, 0))
    views = buffer.upload()
    assert views["flat"].tolist() == [3, 1, 2]
    assert views["rows"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert views["pages"].tolist() == [[[7, 8], [9, 0]], [[1, 2], [3, 4]]]
    assert views["flags"].tolist() == [1, 0] and views["array"].tolist() == [[0, 1], [2, 3]]
    assert views["empty"].shape == (3, 0)
    buffer.reset()
    with pytest.raises(AssertionError, match="rows do not fill"):
        buffer.put("ragged", [[1, 2], [3, 4, 5]], shape=(2, 2))
