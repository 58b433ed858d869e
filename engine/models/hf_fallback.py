"""Any transformers decoder on batchyard's KV pool: the model runs as transformers builds it, and
its attention calls reach our paged attention through transformers' attention interface.

Each step packs every scheduled token into one row (batch 1, N tokens, their own positions);
transformers computes embeddings, RoPE or learned positions, norms and MLPs, and at each layer
hands our registered attention function the new tokens' q, k, v. That function writes k and v
into the pool at the step's slots and attends with the runner's backend over each sequence's
pages, so continuous and paged batching, chunked prefill, preemption and prefix caching work
as for native models. A layer that asks for logit soft-capping (Gemma 2) attends explicitly
(engine/attention/explicit.py); one with a window of its own reads that window's metadata, as
native layers do. Start-up probes the model once:
every layer must call the interface with a layer index and the same KV shape; otherwise the
model is refused with the reason."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM

from engine.attention.explicit import explicit_attention
from engine.attention.reference import AttentionMetadata, store_kv
from engine.models.linear import pack_linears
from engine.models.registry import native_names
from engine.models.spec import ModelSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

ATTENTION = "batchyard_paged"
_STEP = "batchyard_step"  # the kwarg that carries (metadata, kv pool) through transformers
_PROBE = "batchyard_probe"  # the kwarg of start-up's probe: a list each layer reports into
# What transformers' attention calls may carry that this path honours (or that changes
# nothing here); any other input set (attention sinks, position biases, sparse indices, ...)
# would be dropped silently, so such a model is refused.
_UNDERSTOOD = {_STEP, _PROBE, "position_ids", "cache_position", "use_cache", "sliding_window",
               "softcap", "output_attentions", "return_dict", "position_embeddings",
               "is_causal"}  # is_causal=False is refused on its own
_LAYER_TYPES = {"full_attention", "sliding_attention"}


def _paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, N, D], key and value [1, Hkv, N, D] of the packed tokens → [1, N, H, D]."""
    probe = kwargs.get(_PROBE)
    if probe is not None:
        ignored = sorted(k for k, v in kwargs.items() if v is not None and k not in _UNDERSTOOD)
        if kwargs.get("is_causal") is False:
            ignored.append("is_causal=False")
        probe.append((getattr(module, "layer_idx", None), (query.shape[1], *key.shape[1:2],
                                                             key.shape[3]),
                      kwargs.get("sliding_window"), ignored))
        return query.transpose(1, 2), None
    meta, kv_cache = kwargs[_STEP]
    layer = kv_cache[module.layer_idx]
    # the layer's window: the model's, or its own (the runner describes each attention group)
    softcap, window = kwargs.get("softcap"), kwargs.get("sliding_window")
    mine = meta.for_layer(module.layer_idx, window)
    q = query[0].transpose(0, 1).contiguous()  # [N, H, D]
    store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), layer[0], layer[1],
             mine.slot_mapping)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if softcap is not None:  # what the backends do not take
        out = explicit_attention(q, layer[0], layer[1], mine, scale, softcap, window)
    else:
        out = mine.backend.forward(q, layer[0], layer[1], mine, scale)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION, _paged_attention)


class TransformersModel(nn.Module):
    """A transformers CausalLM behind the native models' interface: forward() → hidden states,
    compute_logits() → float32 logits."""

    graph_safe = False  # transformers' Python per step: decode runs eagerly, no CUDA graphs

    def __init__(self, hf_model: PreTrainedModel, spec: ModelSpec) -> None:
        super().__init__()
        self.hf = hf_model
        self.spec = spec
        config = hf_model.config
        # What CausalLM.forward does to the head's output in the families that do anything
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.logit_scale = getattr(config, "logit_scale", None)  # Cohere: multiplies
        self.logits_scaling = getattr(config, "logits_scaling", None)  # Granite: divides

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: Sequence[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions [N]; kv_cache: each layer's [2, slots, Hkv, D] → hidden
        [N, hidden]."""
        out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None],
                                 use_cache=False,
                                 **{_STEP: (meta, kv_cache)})
        return out.last_hidden_state[0]

    def pack_linears(self, backend: str, batch_hint: int) -> int:
        """transformers' nn.Linear layers through a packed CPU backend (engine.models.linear);
        its other layer types (e.g. GPT-2's Conv1D) stay as they are."""
        if backend in ("int8", "fp8"):
            raise ValueError(f"invalid quantize={backend!r}: needs a native model without sparse "
                             f"experts ({native_names(dense_only=True)}), not the transformers "
                             "fallback")
        return pack_linears(self.hf, backend, batch_hint)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(hidden)  # [S, vocab]
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()


def load_fallback(model_dir: str | Path, config: dict, dtype: torch.dtype,
                  device: torch.device, trust_remote_code: bool) -> TransformersModel:
    """Load the folder with transformers (safetensors only) and check it fits our KV pool."""
    arch = (config.get("architectures") or ["?"])[0]
    refuse_unservable(arch, config, trust_remote_code)
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=ATTENTION, use_safetensors=True,
        local_files_only=True, trust_remote_code=trust_remote_code, device_map=device)
    hf.eval()
    if getattr(hf, "_is_stateful", False):
        raise ValueError(f"architecture {arch} keeps a recurrent state beside its attention "
                         "(e.g. Mamba layers); batchyard's KV pool cannot hold it")
    model = TransformersModel(hf, _probe_spec(hf, arch))
    _check_head(model, arch)
    logger.info("%s runs through the transformers fallback (not a native architecture: "
                "transformers' modules, batchyard's KV pool and attention; no fused CPU "
                "kernels, CUDA graphs or tensor parallelism)", arch)
    return model


def refuse_unservable(arch: str, config: dict, trust_remote_code: bool) -> None:
    """ValueError naming the architecture for what a decoder-only text engine cannot serve."""
    if config.get("is_encoder_decoder"):
        raise ValueError(f"architecture {arch} is an encoder-decoder model; batchyard serves "
                         "decoder-only causal LMs (use a seq2seq server such as TGI for it)")
    if "vision_config" in config or "audio_config" in config:
        raise ValueError(f"architecture {arch} takes images or audio; batchyard serves text-only "
                         "decoders (serve its language model alone, or use vLLM for it)")
    if set(config.get("layer_types") or ()) - _LAYER_TYPES or config.get("attention_chunk_size"):
        raise ValueError(f"architecture {arch} has layers other than full or sliding-window "
                         "attention (recurrent, linear or chunked); batchyard cannot serve it")
    if config.get("auto_map") and not trust_remote_code:
        raise ValueError(f"architecture {arch} needs the model folder's own code "
                         "(auto_map in config.json); set option.trust_remote_code=true if you "
                         "trust that code")


@torch.inference_mode()
def _probe_spec(hf: PreTrainedModel, arch: str) -> ModelSpec:
    """Run one token with the probe kwarg: each layer reports its index, KV shape and the
    attention features it asks for."""
    reports: list = []
    device = next(hf.parameters()).device
    try:
        hf.base_model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                      position_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                      use_cache=False, **{_PROBE: reports})
    except Exception as err:  # noqa: BLE001 - e.g. a family that picks its own attention
        raise ValueError(f"architecture {arch} does not run through transformers' attention "
                         f"interface ({type(err).__name__}: {err}); it cannot be served") from err
    config = hf.config
    layers = config.num_hidden_layers
    if sorted(r[0] for r in reports if r[0] is not None) != list(range(layers)):
        raise ValueError(f"architecture {arch}: its attention layers do not all go through "
                         "transformers' attention interface with a layer index")
    ignored = sorted({name for r in reports for name in r[3]})
    if ignored:
        raise ValueError(f"architecture {arch} passes its attention {', '.join(ignored)}, "
                         "which batchyard's attention would ignore; it cannot be served")
    # each layer's window (by layer index): the runner describes the step for each of them
    windows = tuple(window for _, window in sorted((r[0], r[2]) for r in reports
                                                   if r[0] is not None))
    shapes = {r[1] for r in reports}
    if len(shapes) != 1:
        raise ValueError(f"architecture {arch} has layers of different attention shapes {shapes}")
    [(heads, kv_heads, head_dim)] = shapes
    vocab = hf.get_output_embeddings().weight.shape[0]
    uniform = len(set(windows)) == 1
    return ModelSpec(arch, layers, config.hidden_size, heads, kv_heads, head_dim, vocab,
                     _max_positions(config), windows[0] if uniform else None,
                     layer_windows=None if uniform else windows)


@torch.inference_mode()
def _check_head(model: TransformersModel, arch: str) -> None:
    """compute_logits() must give what the CausalLM's own forward gives (some families scale
    or cap the head's output in ways this class does not know): checked on a few tokens with
    transformers' eager attention."""
    hf = model.hf
    device = next(hf.parameters()).device
    ids = torch.arange(3, 7, device=device)[None] % model.spec.vocab_size  # [1, 4]
    hf.set_attn_implementation("eager")
    try:
        want = hf(input_ids=ids, use_cache=False).logits[0].float()  # [4, vocab]
        hidden = hf.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]
        got = model.compute_logits(hidden)
    finally:
        hf.set_attn_implementation(ATTENTION)
    error = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
    if error > 1e-3:
        raise ValueError(f"architecture {arch} transforms its logits in a way batchyard does "
                         f"not reproduce (relative difference {error:.1e}); it cannot be served")


def _max_positions(config) -> int:
    """The longest sequence it may serve. LongRoPE: its original context, since transformers
    switches factors per forward pass (by the batch's longest position) and drops its cache to
    recompute, neither of which holds on a shared KV pool."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        original = rope.get("original_max_position_embeddings",
                            getattr(config, "original_max_position_embeddings", None))
        if isinstance(original, int) and original > 0:
            logger.warning("%s uses LongRoPE: the transformers fallback serves up to its "
                           "original context, %d tokens", type(config).__name__, original)
            return original
    for name in ("max_position_embeddings", "n_positions", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048
