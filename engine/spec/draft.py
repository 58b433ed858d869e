"""A draft model as the proposer: a smaller model with the target's vocabulary runs greedily for
k tokens per proposing sequence, batched over them, on its own runner and KV pool (paged, as
many token slots as the target's pool). Each sequence has a shadow sequence in the draft's pool;
after verification the shadow keeps the KV of what the target accepted and recomputes from
there. Greedy drafts are one-hot proposals: the target's verification (speculator.py) keeps
greedy and seeded output exactly what decoding without speculation gives."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from engine.config import EngineConfig
from engine.kv.block_manager import BlockManager
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler.base import ScheduledBatch
from engine.sequence import Sequence

logger = logging.getLogger(__name__)

DRAFT_BLOCK_SIZE = 16
_GREEDY = SamplingParams(max_new_tokens=1 << 30, ignore_eos=True)


class DraftProposer:
    """propose([(sequence, k)]) → each sequence's up to k greedy draft tokens."""

    def __init__(self, runner: ModelRunner, allocator: BlockManager) -> None:
        self.runner, self.allocator = runner, allocator
        self._shadows: dict[int, Sequence] = {}  # target seq id → its shadow in the draft pool

    def propose(self, wanted: list[tuple[Sequence, int]], running: list[Sequence]
                ) -> list[list[int]]:
        """`running`: every running sequence (the others' shadows are freed)."""
        self.forget(running)
        shadows: list[Sequence | None] = []
        lengths: list[int] = []
        for seq, k in wanted:
            shadow = self._synced(seq)
            if not self.allocator.can_allocate(shadow, shadow.num_uncomputed_tokens + k):
                self._drop(seq.seq_id)  # its pool is full: no proposals, its KV freed
                shadows.append(None)
                lengths.append(0)
                continue
            shadows.append(shadow)
            lengths.append(k)
        live = [(s, k) for s, k in zip(shadows, lengths, strict=True) if s is not None]
        for step in range(max((k for _, k in live), default=0)):
            batch = [s for s, k in live if k > step]
            counts = [s.num_uncomputed_tokens for s in batch]
            for shadow, n in zip(batch, counts, strict=True):
                self.allocator.allocate(shadow, n)
            samples = self.runner.run(ScheduledBatch(tuple(batch), tuple(counts)))
            for shadow, n, sample in zip(batch, counts, samples, strict=True):
                assert sample is not None  # each caught up: sampled
                shadow.num_computed_tokens += n
                shadow.append_token(sample.token_id)
        return [[] if shadow is None else shadow.token_ids[seq.num_tokens:]
                for (seq, _), shadow in zip(wanted, shadows, strict=True)]

    def _synced(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, holding its tokens; its KV kept as far as they agree."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.seq_id, seq.token_ids[:seq.num_prompt_tokens], _GREEDY)
            self._shadows[seq.seq_id] = shadow
        same = 0
        # (its last token runs again at least: the draft's next logits come from it)
        limit = min(shadow.num_computed_tokens, seq.num_tokens - 1)
        old, new = shadow.token_ids, seq.token_ids
        while same < limit and old[same] == new[same]:
            same += 1
        shadow.token_ids = list(new)
        shadow.num_computed_tokens = same
        return shadow

    def _forget_others(self, keep: set[int]) -> None:
        for seq_id in [i for i in self._shadows if i not in keep]:
            self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        shadow = self._shadows.pop(seq_id, None)
        if shadow is not None:
            self.allocator.free(shadow)

    def forget(self, running: list[Sequence]) -> None:
        """Free the shadows of sequences no longer running (finished, preempted)."""
        self._forget_others({seq.seq_id for seq in running})


def build_draft(config: EngineConfig, target_slots: int, max_model_len: int,
                vocab_size: int) -> DraftProposer:
    """Load the draft model on the target's device and dtype, with a paged pool of as many
    token slots as the target's; ValueError where it cannot serve as the target's draft."""
    from engine.parallel.shard import Shard
    from engine.runner.setup import build_rank, rank_device

    assert config.speculative_model is not None  # the config checks it with draft_model
    _check_tokenizer(Path(config.model), Path(config.speculative_model))
    draft_config = replace(
        config, model=config.speculative_model, batching="paged", speculative_method=None,
        speculative_model=None, enable_lora=False, lora_modules=(), quantize=None,
        tensor_parallel_size=1, enable_prefix_caching=False, block_size=DRAFT_BLOCK_SIZE,
        num_kv_blocks=-(-target_slots // DRAFT_BLOCK_SIZE), kv_cache_memory=None,
        max_model_len=max_model_len, async_scheduling=False)
    rank = build_rank(draft_config, rank_device(draft_config, Shard()))
    if rank.spec.vocab_size != vocab_size:
        raise ValueError(f"invalid speculative_model={config.speculative_model}: its "
                         f"vocabulary has {rank.spec.vocab_size} tokens, the target's "
                         f"{vocab_size}; a draft model must share the target's tokenizer")
    allocator = BlockManager(rank.kv.num_blocks, rank.kv.block_size,
                             table_windows=rank.kv.layout.table_windows)
    logger.info("speculative draft model %s: %s, %d KV blocks of %d tokens (%.1f MiB)",
                config.speculative_model, rank.spec.architecture, rank.kv.num_blocks,
                rank.kv.block_size, rank.kv.pool_bytes / 2**20)
    return DraftProposer(rank.runner, allocator)


def _check_tokenizer(target: Path, draft: Path) -> None:
    """The draft's tokenizer.json, where both folders have one, is the target's."""
    mine, theirs = target / "tokenizer.json", draft / "tokenizer.json"
    if not (draft / "config.json").is_file():
        raise ValueError(f"invalid speculative_model={draft}: no config.json there (a local "
                         "model folder is needed)")
    if mine.is_file() and theirs.is_file() and mine.read_bytes() != theirs.read_bytes():
        raise ValueError(f"invalid speculative_model={draft}: its tokenizer.json differs from "
                         "the target's; a draft model must share the target's tokenizer")
