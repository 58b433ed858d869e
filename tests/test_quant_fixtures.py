"""Self-checks of tests/quant_fixtures.py: packing by hand-computed words, rounding bounds."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.quant_fixtures import (
    activation_fake_quant,
    dequantized_folder,
    dynamic_scale,
    fp8_fake_quant,
    pack_awq,
    pack_bitstream,
    quantize_folder,
    unpack_awq,
    unpack_bitstream,
)

LINEARS = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64),
           "self_attn.v_proj": (32, 64), "self_attn.o_proj": (64, 64),
           "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64), "mlp.down_proj": (64, 128)}


def _i32(word: int) -> int:
    return word - 2**32 if word >= 2**31 else word


def _load(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-shaped float32 folder (tensors only; no transformers needed)."""
    path = tmp_path_factory.mktemp("float")
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(320, 64, generator=gen) * 0.2,
               "lm_head.weight": torch.randn(320, 64, generator=gen) * 0.2,
               "model.norm.weight": torch.ones(64)}
    for i in range(2):
        for name, shape in LINEARS.items():
            tensors[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, generator=gen) * 0.2
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(64)
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(64)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    (path / "tokenizer.json").write_text("{}")
    return path


def _modules() -> list[str]:
    return [f"model.layers.{i}.{name}" for i in range(2) for name in LINEARS]


# ---------------------------------------------------------------------------------- packing

def test_awq_nibble_order_hand_word() -> None:
    codes = torch.arange(16).reshape(1, 16)  # column j holds code j
    words = pack_awq(codes)
    # nibbles 0..7 hold columns 0,2,4,6,1,3,5,7 -> 0x75316420; +8 for the second word
    assert words.tolist() == [[0x75316420, _i32(0xFDB9ECA8)]]
    assert words.dtype == torch.int32
    # logical column j sits at shift (0,16,4,20,8,24,12,28)[j]
    for j, shift in enumerate((0, 16, 4, 20, 8, 24, 12, 28)):
        one = torch.zeros(1, 8, dtype=torch.int64)
        one[0, j] = 0xF
        assert pack_awq(one).item() == _i32(0xF << shift)
    rnd = torch.randint(0, 16, (5, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_awq(pack_awq(rnd)), rnd)


def test_gptq_3bit_stream_straddles_words() -> None:
    codes = torch.zeros(32, 1, dtype=torch.int64)
    codes[0, 0] = 7  # bits 0..2 of word 0
    codes[10, 0] = 5  # bits 30..32: 0b101 -> word0 bit30 = 1, bit31 = 0, word1 bit0 = 1
    codes[21, 0] = 3  # bits 63..65: 0b011 -> word1 bit31 = 1, word2 bit0 = 1, bit1 = 0
    codes[31, 0] = 4  # bits 93..95: 0b100 -> word2 bit31 = 1
    words = pack_bitstream(codes, 3, dim=0)
    assert words.shape == (3, 1)
    assert words[:, 0].tolist() == [0x40000007, _i32(0x80000001), _i32(0x80000001)]
    assert torch.equal(unpack_bitstream(words, 3, 32, dim=0), codes)
    rnd = torch.randint(0, 8, (64, 6), generator=torch.Generator().manual_seed(2))
    assert torch.equal(unpack_bitstream(pack_bitstream(rnd, 3, 0), 3, 64, 0), rnd)
    assert torch.equal(unpack_bitstream(pack_bitstream(rnd.t(), 3, 1), 3, 64, 1), rnd.t())


def test_ct_int4_sequential_along_input() -> None:
    codes = torch.arange(12).reshape(1, 12)  # [out, in]: 12 values -> ceil(48/32) = 2 words
    words = pack_bitstream(codes, 4, dim=1)
    assert words.tolist() == [[0x76543210, 0xBA98]]
    # 4-bit GPTQ: row k of a column at bits 4k of word k // 8
    assert pack_bitstream(codes.t()[:8], 4, dim=0)[:, 0].tolist() == [0x76543210]


# ------------------------------------------------------------------------------ int formats

ScaleOf = Callable[[dict[str, torch.Tensor], str], torch.Tensor]


def _check_int(folder: Path, ref: Path, orig: dict[str, torch.Tensor],
               scale_of: ScaleOf) -> None:
    q, d = _load(folder), _load(ref)
    for m in _modules():
        w, wd = orig[m + ".weight"], d[m + ".weight"]
        assert wd.dtype == torch.float32 and wd.shape == w.shape
        s = scale_of(q, m)  # per element [N, K]
        assert ((w - wd).abs() <= s / 2 * (1 + 1e-5) + 1e-7).all(), m
        assert (w - wd).abs().max() > 0
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(d[name], orig[name]) and torch.equal(q[name], orig[name])
    cfg = json.loads((ref / "config.json").read_text())
    assert "quantization_config" not in cfg and (ref / "tokenizer.json").exists()


def test_awq(float_folder: Path, tmp_path: Path) -> None:
    qf = quantize_folder(float_folder, tmp_path / "q", "awq", group_size=32)
    ref = dequantized_folder(qf, tmp_path / "d")
    q = _load(qf)
    qc = json.loads((qf / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                  "version": "gemm", "modules_to_not_convert": None}
    p = "model.layers.0.mlp.down_proj"  # N=64, K=128
    assert q[p + ".qweight"].shape == (128, 8) and q[p + ".qweight"].dtype == torch.int32
    assert q[p + ".qzeros"].shape == (4, 8) and q[p + ".scales"].shape == (4, 64)
    assert q[p + ".scales"].dtype == torch.float16 and p + ".weight" not in q
    codes = unpack_awq(q[p + ".qweight"])
    assert codes.min() == 0 and codes.max() == 15  # full asymmetric range used

    def scale_of(q: dict[str, torch.Tensor], m: str) -> torch.Tensor:
        return q[m + ".scales"].float().repeat_interleave(32, dim=0).t()
    _check_int(qf, ref, _load(float_folder), scale_of)


def _gptq_scale_of(q: dict[str, torch.Tensor], m: str) -> torch.Tensor:
    return q[m + ".scales"].float()[q[m + ".g_idx"].long()].t()


@pytest.mark.parametrize("bits,sym,desc_act,ckpt", [
    (4, True, False, "gptq"), (4, False, False, "gptq"), (3, False, True, "gptq_v2"),
    (8, True, True, "gptq_v2"), (2, False, False, "gptq")])
def test_gptq(float_folder: Path, tmp_path: Path, bits: int, sym: bool, desc_act: bool,
              ckpt: str) -> None:
    qf = quantize_folder(float_folder, tmp_path / "q", "gptq", bits=bits, sym=sym,
                         desc_act=desc_act, checkpoint_format=ckpt, group_size=32)
    ref = dequantized_folder(qf, tmp_path / "d")
    q = _load(qf)
    qc = json.loads((qf / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["sym"], qc["desc_act"], qc["checkpoint_format"]) == (
        bits, sym, desc_act, ckpt)
    assert qc["lm_head"] is False
    p = "model.layers.1.mlp.down_proj"  # N=64, K=128
    assert q[p + ".qweight"].shape == (128 * bits // 32, 64)
    assert q[p + ".qzeros"].shape == (4, 64 * bits // 32)
    g_idx = q[p + ".g_idx"]
    assert g_idx.dtype == torch.int32 and torch.bincount(g_idx).tolist() == [32] * 4
    assert torch.equal(g_idx, torch.arange(128, dtype=torch.int32) // 32) != desc_act
    if sym and bits == 4 and ckpt == "gptq":
        assert (q[p + ".qzeros"] == 0x77777777).all()  # stores zero - 1 = 7
    _check_int(qf, ref, _load(float_folder), _gptq_scale_of)


def test_gptq_v1_and_v2_decode_alike(float_folder: Path, tmp_path: Path) -> None:
    refs = []
    for ckpt in ("gptq", "gptq_v2"):
        qf = quantize_folder(float_folder, tmp_path / ckpt, "gptq", sym=False,
                             checkpoint_format=ckpt)
        refs.append(_load(dequantized_folder(qf, tmp_path / (ckpt + "_d"))))
        zeros = unpack_bitstream(_load(qf)["model.layers.0.self_attn.q_proj.qzeros"], 4, 64, 1)
        refs.append(zeros)
    assert torch.equal(refs[1] + 1, refs[3])  # v1 stores zero - 1
    for name in refs[0]:
        assert torch.equal(refs[0][name], refs[2][name])


@pytest.mark.parametrize("sym,strategy,desc_act", [
    (True, "group", False), (False, "group", False), (True, "channel", False),
    (False, "group", True)])
def test_ct_int(float_folder: Path, tmp_path: Path, sym: bool, strategy: str,
                desc_act: bool) -> None:
    qf = quantize_folder(float_folder, tmp_path / "q", "ct-int", sym=sym, strategy=strategy,
                         desc_act=desc_act)
    ref = dequantized_folder(qf, tmp_path / "d")
    q = _load(qf)
    qc = json.loads((qf / "config.json").read_text())["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert qc["format"] == "pack-quantized" and qc["ignore"] == ["lm_head"]
    assert (w["symmetric"], w["strategy"]) == (sym, strategy)
    p = "model.layers.0.mlp.gate_proj"  # N=128, K=64
    n_groups = 2 if strategy == "group" else 1
    assert q[p + ".weight_packed"].shape == (128, 8)
    assert q[p + ".weight_scale"].shape == (128, n_groups)
    assert q[p + ".weight_shape"].tolist() == [128, 64]
    assert (p + ".weight_zero_point" in q) == (not sym)
    if not sym:
        assert q[p + ".weight_zero_point"].shape == (16, n_groups)
    if sym:  # signed codes in [-7, 7] stored + 8
        codes = unpack_bitstream(q[p + ".weight_packed"], 4, 64, dim=1)
        assert codes.min() >= 1 and codes.max() <= 15

    def scale_of(q: dict[str, torch.Tensor], m: str) -> torch.Tensor:
        s = q[m + ".weight_scale"].float()
        k = int(q[m + ".weight_shape"][1])
        g = q.get(m + ".weight_g_idx", torch.arange(k) // (k // s.shape[1])).long()
        return s[:, g]
    _check_int(qf, ref, _load(float_folder), scale_of)


def test_ct_int_signed_storage_by_hand(tmp_path: Path) -> None:
    """One group [1, 8] with known values: sym int4 scale = amax / 7, code = round(w/s) + 8."""
    src = tmp_path / "src"
    src.mkdir()
    w = torch.tensor([[-7.0, -3.0, 0.0, 1.0, 2.0, 4.0, 6.0, 7.0]]).repeat(8, 1)
    save_file({"model.layers.0.mlp.down_proj.weight": w}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    qf = quantize_folder(src, tmp_path / "q", "ct-int", group_size=8)
    q = _load(qf)
    assert q["model.layers.0.mlp.down_proj.weight_scale"].tolist() == [[1.0]] * 8
    assert q["model.layers.0.mlp.down_proj.weight_packed"][0].tolist() == [_i32(0xFECA9851)]
    d = _load(dequantized_folder(qf, tmp_path / "d"))
    assert torch.equal(d["model.layers.0.mlp.down_proj.weight"], w)


# ------------------------------------------------------------------------------------- fp8

def _check_fp8(qf: Path, ref: Path, orig: dict[str, torch.Tensor],
               full_scale: ScaleOf) -> None:
    q, d = _load(qf), _load(ref)
    for m in _modules():
        w, wd = orig[m + ".weight"], d[m + ".weight"]
        assert q[m + ".weight"].dtype == torch.float8_e4m3fn and wd.dtype == torch.float32
        s = full_scale(q, m).expand_as(w)
        assert ((w - wd).abs() <= w.abs() / 16 + s * 2**-10 + 1e-7).all(), m
        assert torch.equal(wd, q[m + ".weight"].float() * s)
    assert torch.equal(d["lm_head.weight"], orig["lm_head.weight"])


@pytest.mark.parametrize("block,acts", [((32, 32), "dynamic"), ((16, 32), "dynamic"),
                                        (None, "dynamic"), (None, "static")])
def test_fp8(float_folder: Path, tmp_path: Path, block: tuple[int, int] | None,
             acts: str) -> None:
    qf = quantize_folder(float_folder, tmp_path / "q", "fp8", block=block, activations=acts)
    ref = dequantized_folder(qf, tmp_path / "d")
    q = _load(qf)
    qc = json.loads((qf / "config.json").read_text())["quantization_config"]
    assert qc["activation_scheme"] == acts and qc.get("weight_block_size") == (
        list(block) if block else None)
    p = "model.layers.0.mlp.down_proj"  # N=64, K=128
    if block:
        assert q[p + ".weight_scale_inv"].shape == (64 // block[0], 128 // block[1])
    else:
        assert q[p + ".weight_scale"].shape == ()
        assert (p + ".input_scale" in q) == (acts == "static")

    def full_scale(q: dict[str, torch.Tensor], m: str) -> torch.Tensor:
        if block is None:
            return q[m + ".weight_scale"]
        s = q[m + ".weight_scale_inv"]
        return s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    _check_fp8(qf, ref, _load(float_folder), full_scale)


@pytest.mark.parametrize("strategy,acts", [("channel", "dynamic"), ("tensor", "static"),
                                           ("channel", None), ("block", "dynamic")])
def test_ct_fp8(float_folder: Path, tmp_path: Path, strategy: str, acts: str | None) -> None:
    qf = quantize_folder(float_folder, tmp_path / "q", "ct-fp8", strategy=strategy,
                         activations=acts)
    ref = dequantized_folder(qf, tmp_path / "d")
    q = _load(qf)
    qc = json.loads((qf / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == "float-quantized" and group["weights"]["strategy"] == strategy
    p = "model.layers.0.self_attn.k_proj"  # N=32, K=64
    shape = {"channel": (32, 1), "tensor": (1,), "block": (1, 2)}[strategy]
    assert q[p + ".weight_scale"].shape == shape
    assert q[p + ".weight_scale"].dtype == torch.float32
    assert (p + ".input_scale" in q) == (acts == "static")
    if acts == "static":
        assert q[p + ".input_scale"].shape == (1,) and q[p + ".input_scale"].item() > 0

    def full_scale(q: dict[str, torch.Tensor], m: str) -> torch.Tensor:
        s = q[m + ".weight_scale"]
        return s.repeat_interleave(32, 0).repeat_interleave(32, 1) if strategy == "block" else s
    _check_fp8(qf, ref, _load(float_folder), full_scale)


# ------------------------------------------------------------------------------ activations

class _Tree(torch.nn.Module):
    """Module names as in a transformers Llama: model.layers.{i}.{self_attn|mlp}.{proj}."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for _ in range(2):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            layer.mlp = torch.nn.Module()
            for name, (n, k) in LINEARS.items():
                parent, leaf = name.split(".")
                setattr(getattr(layer, parent), leaf, torch.nn.Linear(k, n, bias=False))
            self.model.layers.append(layer)


def _seen_input(model: _Tree, x: torch.Tensor) -> torch.Tensor:
    q_proj = model.model.layers[0].self_attn.q_proj
    seen: list[torch.Tensor] = []
    h = q_proj.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    q_proj(x)
    h.remove()
    return seen[0]


@pytest.mark.parametrize("fmt,kw,kind", [
    ("fp8", {"block": (32, 32)}, "group"), ("fp8", {"block": None}, "token"),
    ("fp8", {"block": None, "activations": "static"}, "static"),
    ("ct-fp8", {}, "token"), ("ct-fp8", {"strategy": "tensor", "activations": "static"},
                              "static"),
    ("ct-fp8", {"activations": None}, None), ("gptq", {}, None)])
def test_activation_fake_quant(float_folder: Path, tmp_path: Path, fmt: str,
                               kw: dict, kind: str | None) -> None:
    qf = quantize_folder(float_folder, tmp_path / "q", fmt, **kw)
    model = _Tree()
    handles = activation_fake_quant(model, qf)
    assert len(handles) == (0 if kind is None else 14)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(3)) * 2
    x[0, 0, :32] = 0.0  # an all-zero group / half token
    seen = _seen_input(model, x)
    if kind is None:
        assert seen is x
        return
    if kind == "static":
        scale = _load(qf)["model.layers.0.self_attn.q_proj.input_scale"].float().reshape(())
    else:
        amax = x.abs().reshape(3, 5, 2, 32).amax(-1) if kind == "group" else x.abs().amax(-1)
        scale = (amax / 448).clamp_min(1e-12)
        scale = scale.repeat_interleave(32, -1) if kind == "group" else scale[..., None]
    expected = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(seen, expected) and not torch.equal(seen, x)
    assert torch.isfinite(seen).all()
    for h in handles:
        h.remove()
    assert _seen_input(model, x) is x


def test_dynamic_scale_and_dtype() -> None:
    x = torch.tensor([[1.0, -448.0, 3.0, 0.0]], dtype=torch.bfloat16)
    assert dynamic_scale(x).tolist() == [[1.0]]
    third = torch.tensor(3.0) / 448
    assert torch.equal(dynamic_scale(x, group=2), torch.stack([torch.tensor(1.0)] * 2
                                                              + [third] * 2)[None])
    y = fp8_fake_quant(x, dynamic_scale(x))
    assert y.dtype == torch.bfloat16 and y.tolist() == [[1.0, -448.0, 3.0, 0.0]]
