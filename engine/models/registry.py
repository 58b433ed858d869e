"""The architectures served natively, one record each, and which checkpoint files are never
loaded. A record says what its architecture does differently; the model code reads those
features and never tests an architecture's name, so an architecture that differs from the
supported ones only in features is one more record (register()). Pure Python: the handler
chooses a strategy from it before torch is imported."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

# Which implementation runs the record (engine/models/loader.py maps it to a class):
# llama.py (RMSNorm, SwiGLU) or gemma.py (Gemma's (1 + w) RMSNorm, GELU, embedding scale).
Family = Literal["llama", "gemma"]
# Which layers attend within `sliding_window` when config.json has no `layer_types`:
#   every_layer  Mistral's: every layer, when there is a window (and use_sliding_window, true
#                unless the config says otherwise);
#   qwen         only with use_sliding_window (false by default), layers >= max_window_layers;
#   qwen2_moe    as qwen, but the odd-numbered layers below max_window_layers;
#   none         no layer (Gemma 1);
#   alternating  one full layer in every `sliding_window_pattern` (default: window_pattern).
WindowRule = Literal["every_layer", "qwen", "qwen2_moe", "none", "alternating"]
# Sparse experts (engine/models/moe.py): mixtral's are sized by intermediate_size, their top-k
# weights renormalised and kept in float32; qwen's by moe_intermediate_size, renormalised when
# norm_topk_prob, cast to the activations' dtype, with an optional shared expert.
MoeKind = Literal["mixtral", "qwen"]
# The config key naming the MLP's activation; in a gemma record `hidden_act`'s "gelu" means
# the tanh approximation (Gemma 1's official configs; transformers rewrites it so).
ActivationKey = Literal["hidden_act", "hidden_activation"]

_WINDOW_RULES: dict[str, tuple[str, ...]] = {
    "llama": ("every_layer", "qwen", "qwen2_moe"), "gemma": ("none", "alternating")}
# features only gemma.py reads: a llama record asking for one would be served without it
_GEMMA_ONLY = ("sandwich_norms", "query_pre_attn_scalar", "soft_capping", "local_rope_base")


@dataclass(frozen=True)
class ModelRecord:
    """One natively served architecture: its HF name (config.json's `architectures[0]`), the
    implementation that runs it, and each feature that implementation reads from the record
    rather than from config.json (settings the config states, such as rope scaling or biases
    it names, are read from the config)."""

    name: str
    family: Family
    qkv_bias: bool = False  # q/k/v biases when config.json names neither attention_bias
    # nor qkv_bias (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    windows: WindowRule = "every_layer"
    window_pattern: int = 0  # alternating: the default sliding_window_pattern
    moe: MoeKind | None = None  # the MLP is sparse experts of this kind
    fused_checkpoint: bool = False  # the checkpoint may store q/k/v and gate/up fused (Phi-3)
    sandwich_norms: bool = False  # norms after attention and around the MLP (Gemma 2/3)
    query_pre_attn_scalar: bool = False  # queries scaled by 1/sqrt(the config's scalar)
    soft_capping: bool = False  # attention scores and final logits soft-capped when the
    # config sets attn_logit_softcapping / final_logit_softcapping (Gemma 2/3)
    local_rope_base: bool = False  # sliding layers rotate with rope_local_base_freq (Gemma 3)
    activation_key: ActivationKey = "hidden_act"

    def __post_init__(self) -> None:
        """A feature the record's implementation does not read would be silently dropped:
        refuse such a record where it is written."""
        wrong = [name for name in _GEMMA_ONLY if getattr(self, name) and self.family != "gemma"]
        if self.family not in _WINDOW_RULES:
            wrong.append("family")
        elif self.windows not in _WINDOW_RULES[self.family]:
            wrong.append("windows")
        if (self.window_pattern > 0) != (self.windows == "alternating"):
            wrong.append("window_pattern")
        if self.moe is not None and self.family != "llama":
            wrong.append("moe")
        if self.activation_key != "hidden_act" and self.family != "gemma":
            wrong.append("activation_key")
        if wrong:
            raise ValueError(f"model record {self.name}: {', '.join(wrong)} not served by the "
                             f"{self.family!r} implementation")


_RECORDS: dict[str, ModelRecord] = {r.name: r for r in (
    ModelRecord("LlamaForCausalLM", "llama"),
    ModelRecord("MistralForCausalLM", "llama"),
    ModelRecord("Qwen2ForCausalLM", "llama", qkv_bias=True, windows="qwen"),
    ModelRecord("Qwen3ForCausalLM", "llama", qk_norm=True, windows="qwen"),
    ModelRecord("Phi3ForCausalLM", "llama", fused_checkpoint=True),
    ModelRecord("MixtralForCausalLM", "llama", moe="mixtral"),
    ModelRecord("Qwen2MoeForCausalLM", "llama", qkv_bias=True, windows="qwen2_moe", moe="qwen"),
    ModelRecord("Qwen3MoeForCausalLM", "llama", qk_norm=True, windows="qwen", moe="qwen"),
    ModelRecord("GemmaForCausalLM", "gemma", windows="none"),
    ModelRecord("Gemma2ForCausalLM", "gemma", windows="alternating", window_pattern=2,
                sandwich_norms=True, query_pre_attn_scalar=True, soft_capping=True,
                activation_key="hidden_activation"),
    ModelRecord("Gemma3ForCausalLM", "gemma", qk_norm=True, windows="alternating",
                window_pattern=6, sandwich_norms=True, query_pre_attn_scalar=True,
                soft_capping=True, local_rope_base=True, activation_key="hidden_activation"),
)}

# The HF `architectures` name in config.json -> its record; a live, read-only view (register()
# shows in it).
NATIVE_ARCHITECTURES: Mapping[str, ModelRecord] = MappingProxyType(_RECORDS)


def model_record(arch: str) -> ModelRecord:
    """The record of a natively served architecture; ValueError naming the native ones."""
    record = _RECORDS.get(arch)
    if record is None:
        raise ValueError(f"architecture {arch} is not served natively; native: {native_names()}")
    return record


def native_names(dense_only: bool = False) -> str:
    """The native architectures' names for a message, sorted (`dense_only`: without sparse
    experts, which int8 does not quantize)."""
    return ", ".join(sorted(r.name for r in _RECORDS.values()
                            if not (dense_only and r.moe is not None)))


def register(record: ModelRecord) -> None:
    """Serve another architecture natively with an existing implementation's features."""
    if record.name in _RECORDS:
        raise ValueError(f"architecture {record.name} already has a model record")
    _RECORDS[record.name] = record


def unregister(name: str) -> None:
    """Drop a record register() added (tests restore the registry so)."""
    del _RECORDS[name]


# Unpickling a checkpoint can run arbitrary code: only safetensors are loaded.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
