"""MXFP4 codec: decode bit-exact against compressed-tensors, encode round trips and rounding rules.

Oracle: `compressed_tensors.compressors.mxfp4.base.MXFP4PackedCompressor.decompress` (the compressor that
is registered under "mxfp4-pack-quantized"), called with the MXFP4A16 preset scheme. It unpacks with
`compressors.nvfp4.helpers.unpack_fp4_from_uint8` (low nibble first), turns the E8M0 bytes into bf16
2^(s-127) with `compressors.mx_utils.decompress_mx_scale`, and multiplies per group of 32 in bf16
(`quantization.lifecycle.forward.dequantize`). It takes 2-D tensors only, so stacked experts are decoded
one matrix at a time. `MXFP4PackedCompressor.compress` (given our float scales) is a secondary oracle for
the packing and rounding of `encode`.
"""

from __future__ import annotations

import math

import pytest
import torch

from kimik3.ops.mxfp4 import GROUP_SIZE, decode, encode, packed_shapes
from tests.helpers import needs_cuda_triton, needs_interpreter

_BITS_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-for-bit equality; NaNs must sit in the same places (their sign/payload is not compared)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b)
    view = _BITS_VIEW[a.dtype]
    assert torch.equal(a.view(view)[~nan_a], b.view(view)[~nan_b])


@pytest.fixture(scope="module")
def oracle():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])

    def decode_ref(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        P = packed.shape[-1]
        mats = zip(packed.reshape(-1, *packed.shape[-2:]), scale.reshape(-1, *scale.shape[-2:]))
        outs = [MXFP4PackedCompressor.decompress({"weight_packed": p, "weight_scale": s}, scheme)["weight"]
                for p, s in mats]
        return torch.stack(outs).reshape(*packed.shape[:-1], 2 * P)

    def encode_ref(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        scale_f = torch.exp2(scale.double() - 127).float()  # exact: integer exponents in fp64
        out = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale_f}, scheme)
        return out["weight_packed"]

    decode_ref.compress = encode_ref
    return decode_ref


def _random_packed(gen, shape_OI, scale_lo, scale_hi):
    *lead, O, I = shape_OI
    packed = torch.randint(0, 256, (*lead, O, I // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(scale_lo, scale_hi + 1, (*lead, O, I // GROUP_SIZE), dtype=torch.uint8, generator=gen)
    return packed, scale


def _pack_codes(code: torch.Tensor) -> torch.Tensor:
    """Independent packer for tests: element 2j -> low nibble, 2j+1 -> high nibble."""
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4)




def test_layout_by_hand():
    # byte 0x71: low nibble 1 (0.5) is element 0, high nibble 7 (6.0) is element 1; 0x8F: -6.0 then -0.0.
    row = [0x71, 0x8F] + [0x00] * 14
    packed = torch.tensor([row, row], dtype=torch.uint8)
    scale = torch.tensor([[127], [130]], dtype=torch.uint8)
    w = decode(packed, scale, torch.float32)
    assert w.shape == (2, 32)
    assert w[0, :4].tolist() == [0.5, 6.0, -6.0, -0.0] and w[1, :4].tolist() == [4.0, 48.0, -48.0, -0.0]
    assert torch.signbit(w[:, 3]).all() and not torch.signbit(w[:, 4:]).any()


def test_decode_matches_oracle_random_with_expert_dims(oracle):
    gen = torch.Generator().manual_seed(0)
    packed, scale = _random_packed(gen, (2, 3, 16, 256), 100, 154)
    _assert_same_bits(decode(packed, scale), oracle(packed, scale))


def test_decode_every_code_pair_and_every_scale_byte(oracle):
    # Row r holds all 256 bytes (every low/high code pair); its 16 groups get scale bytes (16 r + g) % 256,
    # so together the rows cover every scale byte 0..255 under many code patterns, NaN/inf included.
    gen = torch.Generator().manual_seed(1)
    rows = torch.stack([torch.randperm(256, generator=gen) for _ in range(64)]).to(torch.uint8)
    scale = ((torch.arange(64)[:, None] * 16 + torch.arange(16)) % 256).to(torch.uint8)
    got = decode(rows, scale)
    _assert_same_bits(got, oracle(rows, scale))
    assert torch.isinf(got).any() and torch.isnan(got).any()  # s = 255 and large codes at s >= 253
    # fp32 output equals the (exact) bf16 one widened; fp16 output is the fp32 one rounded.
    _assert_same_bits(decode(rows, scale, torch.float32), oracle(rows, scale).float())
    _assert_same_bits(decode(rows, scale, torch.float16), decode(rows, scale, torch.float32).half())


def test_decode_matches_formula_in_float64():
    # Independent of the oracle: W = (-1)^sign * magnitude * 2^(s-127), in float64, for s in 0..254.
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    code = torch.arange(16).repeat(255, 2)  # [255, 32]: every code, one group per row
    scale = torch.arange(255, dtype=torch.uint8)[:, None]
    expect = torch.tensor([[math.ldexp((-1) ** (c >> 3) * mags[c & 7], s - 127) for c in range(16)] * 2
                           for s in range(255)], dtype=torch.float64)
    got = decode(_pack_codes(code), scale, torch.float32)
    _assert_same_bits(got, expect.float())
    assert torch.equal(torch.signbit(got), torch.signbit(expect.float()))  # code 8 is -0.0




def _codes_with_max(gen, shape_OI, max_mag: torch.Tensor) -> torch.Tensor:
    """Random codes whose magnitude in each group is <= max_mag [..., O, G], random signs."""
    mag = torch.randint(0, 8, shape_OI, generator=gen)
    cap = max_mag.repeat_interleave(GROUP_SIZE, dim=-1)
    mag = torch.minimum(mag, cap)
    sign = torch.randint(0, 2, shape_OI, generator=gen)
    return mag | (sign << 3), cap


def test_encode_round_trip_canonical():
    gen = torch.Generator().manual_seed(2)
    shape = (3, 8, 128)
    G = shape[-1] // GROUP_SIZE
    code, cap = _codes_with_max(gen, shape, torch.full((3, 8, G), 7))
    # Force one element per group to magnitude code 6 or 7 (4.0 or 6.0): the group uses E2M1's top exponent.
    top = torch.randint(6, 8, (3, 8, G), generator=gen)
    pos = torch.randint(0, GROUP_SIZE, (3, 8, G), generator=gen) + torch.arange(G) * GROUP_SIZE
    code.scatter_(-1, pos, top | (code.gather(-1, pos) & 8))
    packed = _pack_codes(code)
    scale = torch.randint(0, 253, (3, 8, G), dtype=torch.uint8, generator=gen)  # 253+ overflows bf16
    scale[0, 0, :] = torch.tensor([0, 1, 252, 127], dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        p2, s2 = encode(decode(packed, scale, dtype))
        assert torch.equal(p2, packed) and torch.equal(s2, scale)


def test_encode_round_trip_any_packed():
    # Groups whose codes stay small (down to all-zero groups) have several encodings; only values must survive.
    gen = torch.Generator().manual_seed(3)
    shape = (2, 16, 256)
    G = shape[-1] // GROUP_SIZE
    code, _ = _codes_with_max(gen, shape, torch.randint(0, 8, (2, 16, G), generator=gen))
    packed = _pack_codes(code)
    scale = torch.randint(0, 253, (2, 16, G), dtype=torch.uint8, generator=gen)
    scale[0, 0, :4] = torch.tensor([0, 1, 2, 3], dtype=torch.uint8)  # exercise the clamp at byte 0
    w = decode(packed, scale)
    _assert_same_bits(decode(*encode(w)), w)


def test_encode_rounding_rules():
    # Scale byte 127 (amax in [4, 8)): ties go to the even code, > 6 saturates, signs (and -0.0) are kept.
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 7.9, -0.25, -0.1, 0.0, -0.0, 4.0, 0.26, -2.9]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -0.0, 0.0, -0.0, 4.0, 0.5, -3.0]
    w = torch.tensor(vals * 2).reshape(1, 32)
    packed, scale = encode(w)
    assert scale.tolist() == [[127]]
    got = decode(packed, scale, torch.float32)
    _assert_same_bits(got, torch.tensor(want * 2).reshape(1, 32))


def test_encode_scale_choice():
    # OCP: e = floor(log2(amax)) - 2, biased by 127, clamped to [0, 254]; all-zero group -> byte 0.
    amaxes = [1.0, 1.999, 2.0, 7.99, 8.0, 0.3, 1e-3, 3.0e38, 2.0 ** -126, 1e-44, 0.0]
    amax = torch.tensor(amaxes)  # fp32, as encoded
    w = torch.zeros(len(amaxes), 32)
    w[:, 5], w[:, 6] = amax, -amax / 3
    _, scale = encode(w)
    want = [min(254, max(0, math.floor(math.log2(a)) - 2 + 127)) if a else 0 for a in amax.tolist()]
    assert scale[:, 0].tolist() == want


def test_encode_random_normal_error_and_oracle(oracle):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(4, 64, 256, generator=gen) * torch.logspace(-3, 3, 4)[:, None, None]
    packed, scale = encode(w)
    deq = decode(packed, scale, torch.float32)
    rel = (deq - w).norm() / w.norm()
    assert rel < 0.15, rel  # MXFP4 on Gaussian data: ~0.11
    # Per element, the error is at most half the widest step (2^(e+1)) or the clip from (6, 8): 2^(e+1).
    step = torch.exp2(scale.double() - 127 + 1).repeat_interleave(GROUP_SIZE, -1)
    assert ((deq.double() - w.double()).abs() <= step).all()
    for e in range(w.shape[0]):  # compressed-tensors packs the same codes given our scales
        assert torch.equal(oracle.compress(w[e], scale[e]), packed[e])


def test_encode_accepts_bf16_and_fp16():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(8, 64, generator=gen)
    ref = encode(w.to(torch.bfloat16).float())
    assert all(torch.equal(a, b) for a, b in zip(encode(w.to(torch.bfloat16)), ref))
    ref16 = encode(w.half().float())
    assert all(torch.equal(a, b) for a, b in zip(encode(w.half()), ref16))




def test_packed_shapes():
    assert packed_shapes(7168, 2048) == ((7168, 1024), (7168, 64))
    for bad in (48, 33, 0, 15):
        with pytest.raises(ValueError):
            packed_shapes(16, bad)


@pytest.mark.parametrize("packed_shape,scale_shape", [
    ((4, 15), (4, 1)),        # odd byte width
    ((4, 8), (4, 1)),         # in = 16, not a multiple of 32
    ((4, 24), (4, 1)),        # in = 48
    ((4, 16), (4, 2)),        # scale width does not match
    ((4, 16), (5, 1)),        # out mismatch
    ((2, 4, 16), (3, 4, 1)),  # expert dim mismatch
    ((16,), (1,)),            # 1-D
])
def test_decode_bad_shapes(packed_shape, scale_shape):
    with pytest.raises(ValueError):
        decode(torch.zeros(packed_shape, dtype=torch.uint8), torch.zeros(scale_shape, dtype=torch.uint8))


def test_decode_bad_dtypes():
    p, s = torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8)
    with pytest.raises(ValueError):
        decode(p.to(torch.int8), s)
    with pytest.raises(ValueError):
        decode(p, s.float())


@pytest.mark.parametrize("w", [
    torch.zeros(4, 48), torch.zeros(4, 31), torch.zeros(32), torch.zeros(4, 32, dtype=torch.int32),
    torch.tensor([[float("inf")] + [0.0] * 31]), torch.tensor([[float("nan")] + [0.0] * 31]),
])
def test_encode_bad_inputs(w):
    with pytest.raises(ValueError):
        encode(w)


def _every_pattern(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked [2, 32, 272] codes (every byte under every scale byte, a width that is not a multiple of the
    kernel's 128-byte tile) and their scales."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.stack([torch.randperm(272, generator=gen) % 256 for _ in range(64)]).to(torch.uint8)
    scale = ((torch.arange(64)[:, None] * 17 + torch.arange(17)) % 256).to(torch.uint8)
    return rows.reshape(2, 32, 272).to(device), scale.reshape(2, 32, 17).to(device)


@needs_interpreter
def test_triton_decode_is_the_reference_bit_for_bit_interpreter():
    from kimik3.ops.mxfp4 import reference
    from kimik3.ops.mxfp4 import triton as fast

    packed, scale = _every_pattern()
    got = fast.decode(packed, scale, torch.float32)
    _assert_same_bits(got, reference.decode(packed, scale, torch.float32))
    assert torch.isinf(got).any() and torch.isnan(got).any() and (got.abs() < 2.0 ** -126).any()
    # the interpreter's fp32 -> bf16 / fp16 casts do not round subnormals and overflow as the GPU's do (the GPU
    # test covers them and bf16's own GPU decode): bf16 here only where the results are normal numbers
    normal = scale.clamp(min=8)
    _assert_same_bits(fast.decode(packed, normal), reference.decode(packed, normal))


@pytest.mark.gpu
@needs_cuda_triton
def test_decode_on_cuda_is_the_reference_bit_for_bit_gpu():
    from kimik3.ops.backend import use_backend

    packed, scale = _every_pattern("cuda")
    big = _random_packed(torch.Generator().manual_seed(6), (16, 3072, 3584), 100, 154)  # 16 experts' w1 at K3 dims
    for p, s in ((packed, scale), tuple(t.cuda() for t in big)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            got = decode(p, s, dtype)
            with use_backend("torch"):
                _assert_same_bits(got, decode(p, s, dtype))
    with pytest.raises(ValueError, match="uint8"):
        decode(packed.int(), scale)
