"""Block-scaled low-precision expert weights, dequantised at conversion: NVFP4 and MXFP8.

The published Inkling-2 loop checkpoints store their routed experts' weights this way (the
other tensors are plain). Both formats keep a small code per value and a scale per block of
values along a row (the input dimension of each expert's matrix ``[E, rows, columns]``):

- **NVFP4**: 4-bit E2M1 codes, two per byte, the even element in the low nibble (``weight``
  ``uint8 [E, R, C/2]``); an FP8 E4M3 scale per 16 values (``weight_scale`` ``[E, R, C/16]``);
  and a per-expert factor ``amax / outer_scale_denominator`` (``weight_amax``,
  ``weight_outer_scale_denominator``: one value per expert). value = e2m1(code) * scale * factor.
- **MXFP8** (OCP Microscaling): FP8 E4M3 values (``weight`` ``float8_e4m3fn [E, R, C]``) with an
  E8M0 scale per 32 values (``weight_scale`` ``uint8 [E, R, C/32]``): value = fp8 * 2^(s - 127);
  s = 255 is the format's NaN and is refused.

Every tensor is checked (dtype, shape against the others, finite factors) and a refusal names
it; experts are dequantised a few at a time so memory stays near the output's size.
"""

from __future__ import annotations

import torch

from tinyloop.errors import ArtifactError

__all__ = ["E2M1_VALUES", "NVFP4_BLOCK", "MXFP8_BLOCK", "dequantize_mxfp8", "dequantize_nvfp4"]

# The 16 values of an E2M1 code: sign bit 3, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_BLOCK = 16  # values per FP8 scale
MXFP8_BLOCK = 32  # values per E8M0 scale
_CHUNK = 8  # experts dequantised at a time
_E8M0_NAN = 255


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if tensor.dtype != dtype:
        raise ArtifactError(f"checkpoint tensor {name} has dtype {tensor.dtype}, expected {dtype}")
    if tuple(tensor.shape) != shape:
        raise ArtifactError(f"checkpoint tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}")


def _per_expert(name: str, tensor: torch.Tensor, experts: int) -> torch.Tensor:
    """A per-expert factor as ``[E]`` float32 (stored as ``[E]``, ``[E, 1]`` ... or one value)."""
    if tensor.numel() not in (1, experts):
        raise ArtifactError(f"checkpoint tensor {name} has shape {list(tensor.shape)}, expected one value per "
                            f"expert ({experts})")
    values = tensor.reshape(-1).float().expand(experts) if tensor.numel() == 1 else tensor.reshape(-1).float()
    if not torch.isfinite(values).all():
        raise ArtifactError(f"checkpoint tensor {name} is not finite")
    return values


def dequantize_nvfp4(name: str, codes: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                     denominator: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 ``codes`` ``uint8 [E, R, C/2]`` -> ``[E, R, C]`` in ``dtype`` (``name``: the weight's
    checkpoint name, for errors)."""
    if codes.dim() != 3:
        raise ArtifactError(f"checkpoint tensor {name} has shape {list(codes.shape)}, expected [experts, rows, "
                            "columns / 2]")
    experts, rows, half = codes.shape
    columns = 2 * half
    if columns % NVFP4_BLOCK:
        raise ArtifactError(f"checkpoint tensor {name}: {columns} columns is not a multiple of {NVFP4_BLOCK}")
    _check(name, codes, torch.uint8, (experts, rows, half))
    _check(f"{name}_scale", scale, torch.float8_e4m3fn, (experts, rows, columns // NVFP4_BLOCK))
    factor = _per_expert(f"{name}_amax", amax, experts) / _per_expert(f"{name}_outer_scale_denominator",
                                                                    denominator, experts)
    if not torch.isfinite(factor).all():
        raise ArtifactError(f"checkpoint tensors {name}_amax / {name}_outer_scale_denominator are not finite")
    table = torch.tensor(E2M1_VALUES)
    byte = torch.arange(256)
    pairs = torch.stack((table[byte & 0xF], table[byte >> 4]), dim=-1)  # [256, 2]: low nibble first
    out = torch.empty(experts, rows, columns, dtype=dtype)
    for start in range(0, experts, _CHUNK):
        part = slice(start, start + _CHUNK)
        block = scale[part].float()  # [e, R, C/16]
        if not torch.isfinite(block).all():
            raise ArtifactError(f"checkpoint tensor {name}_scale is not finite")
        values = pairs[codes[part].long()].view(*block.shape, NVFP4_BLOCK) * block[..., None]
        out[part] = (values * factor[part, None, None, None]).view(-1, rows, columns).to(dtype)
    return out


def dequantize_mxfp8(name: str, values: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP8 ``values`` ``float8_e4m3fn [E, R, C]`` -> ``[E, R, C]`` in ``dtype``."""
    if values.dim() != 3:
        raise ArtifactError(f"checkpoint tensor {name} has shape {list(values.shape)}, expected [experts, rows, "
                            "columns]")
    experts, rows, columns = values.shape
    if columns % MXFP8_BLOCK:
        raise ArtifactError(f"checkpoint tensor {name}: {columns} columns is not a multiple of {MXFP8_BLOCK}")
    _check(name, values, torch.float8_e4m3fn, (experts, rows, columns))
    _check(f"{name}_scale", scale, torch.uint8, (experts, rows, columns // MXFP8_BLOCK))
    if (scale == _E8M0_NAN).any():
        raise ArtifactError(f"checkpoint tensor {name}_scale holds the E8M0 NaN (255)")
    out = torch.empty(experts, rows, columns, dtype=dtype)
    for start in range(0, experts, _CHUNK):
        part = slice(start, start + _CHUNK)
        power = torch.exp2(scale[part].float() - 127)  # [e, R, C/32]
        block = values[part].float().view(*power.shape, MXFP8_BLOCK) * power[..., None]
        if not torch.isfinite(block).all():
            raise ArtifactError(f"checkpoint tensor {name} holds a value that is not finite (FP8 NaN)")
        out[part] = block.view(-1, rows, columns).to(dtype)
    return out
