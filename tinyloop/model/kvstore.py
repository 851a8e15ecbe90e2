"""Storage strategies behind the paged KV pool: plain tensors or 4-bit codes, K,V or h.

A store holds named fields (``k`` and ``v``, or ``h`` in h-mode) over *rows*: one row is one
(block, offset) position of the pool, row ``block * block_size + offset``. Everything the pool
and the contexts do is a row operation, so block tables, fork, copy-on-write, truncate and the
exit slot fill work the same in every mode:

- ``write(rows, **values)``: store ``values[name]`` ``[n, *row_shape]`` at ``rows`` ``[n]``
- ``read(name, rows, dtype)``: gather ``[*rows.shape, *row_shape]``, dequantized to ``dtype``
- ``copy_rows(src, dst)`` / ``copy_block(src, dst)``: duplicate rows (exit fill, copy-on-write)

A field is a ``PlainBuffer`` (the full mode's tensor, written and gathered by indexing: no
extra work) or an ``Int4Buffer`` (two 4-bit codes per byte plus an fp16 scale and an fp16
minimum per group, asymmetric: ``x ~ code * scale + min``; quantized on write, dequantized
after the gather, in torch ops).
"""

from __future__ import annotations

import torch

from tinyloop.model import hostmem
from tinyloop.model.config import ModelConfig
from tinyloop.vocabulary import KVMode

__all__ = ["KVStore", "PlainBuffer", "Int4Buffer", "quantize_int4", "dequantize_int4",
           "recompute_dtype"]

_FP16_MAX = 65504.0


def recompute_dtype(mode: KVMode, model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype h is stored in and K,V are recomputed in (h-mode).

    The model dtype, or with ``fp16_qkv`` float16 on CUDA and bfloat16 on CPU: CPU float16
    matmuls run on a slow fallback (several times slower than float32 here), bfloat16 ones on
    fast kernels, and both are 2 bytes.
    """
    if not mode.fp16_qkv:
        return model_dtype
    return torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16


def quantize_int4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[..., W]`` -> codes ``[..., W/2]`` uint8 (even index in the low nibble) and meta
    ``[..., W/group, 2]`` fp16 (scale, minimum) with ``x ~ code * scale + minimum``."""
    xg = x.float().reshape(*x.shape[:-1], -1, group)  # [..., G, g]
    lo = xg.amin(-1).clamp(-_FP16_MAX, _FP16_MAX)
    scale = ((xg.amax(-1) - lo) / 15).clamp(max=_FP16_MAX)
    meta = torch.stack([scale, lo], dim=-1).to(torch.float16)  # [..., G, 2]
    s, m = meta.float().unbind(-1)  # quantize against the rounded scale and minimum
    codes = ((xg - m[..., None]) / s.clamp_min(1e-30)[..., None]).round_().clamp_(0, 15)
    codes = codes.to(torch.uint8).flatten(-2)  # [..., W]
    return codes[..., 0::2] | (codes[..., 1::2] << 4), meta


def dequantize_int4(codes: torch.Tensor, meta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes ``[..., W/2]`` uint8, meta ``[..., G, 2]`` fp16 -> ``[..., W]`` in ``dtype``."""
    q = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)  # [..., W]
    q = q.reshape(*q.shape[:-1], meta.shape[-2], -1).float()  # [..., G, g]
    m = meta.float()
    return (q * m[..., 0:1] + m[..., 1:2]).flatten(-2).to(dtype)


class PlainBuffer:
    """One field as a plain tensor ``[rows, *row_shape]`` in ``dtype``."""

    def __init__(self, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.data = hostmem.zeros((rows, *row_shape), dtype, device)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.data,)

    @property
    def bytes_per_row(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        self.data[rows] = x if x.dtype == self.data.dtype else x.to(self.data.dtype)

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # index_select copies whole rows: 4-5x faster on the CPU than indexing with ``rows``
        out = self.data.index_select(0, rows.flatten()).view(*rows.shape, *self.data.shape[1:])
        return out if out.dtype == dtype else out.to(dtype)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.data[dst] = self.data[src]


class Int4Buffer:
    """One field as 4-bit codes ``[rows, *lead, W/2]`` uint8 and meta ``[rows, *lead, W/g, 2]``
    fp16 (scale, minimum), for ``row_shape = (*lead, W)``."""

    def __init__(self, rows: int, row_shape: tuple[int, ...], group: int,
                 device: torch.device | str) -> None:
        *lead, width = row_shape
        if width % 2 or width % group:
            raise ValueError(f"int4 needs an even width divisible by the group, got {width}/{group}")
        self.group = group
        self.codes = hostmem.zeros((rows, *lead, width // 2), torch.uint8, device)
        self.meta = hostmem.zeros((rows, *lead, width // group, 2), torch.float16, device)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.meta)

    @property
    def bytes_per_row(self) -> int:
        return self.codes[0].numel() + self.meta[0].numel() * self.meta.element_size()

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.meta.numel() * self.meta.element_size()

    def write(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        codes, meta = quantize_int4(x, self.group)
        self.codes[rows] = codes
        self.meta[rows] = meta

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(self.codes[rows], self.meta[rows], dtype)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.codes[dst] = self.codes[src]
        self.meta[dst] = self.meta[src]


Buffer = PlainBuffer | Int4Buffer


# Up to this many runs of consecutive blocks are zeroed run by run (``zero_``: a memset, 5x
# index_fill_'s speed on a prefill's 256 blocks); more scattered ones by one index_fill_.
_ZERO_RUNS = 16


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """``blocks`` as [first, end) runs of consecutive ids, in ascending order."""
    ordered = sorted(blocks)
    runs: list[tuple[int, int]] = []
    first = prev = ordered[0]
    for b in ordered[1:]:
        if b != prev + 1:
            runs.append((first, prev + 1))
            first = b
        prev = b
    runs.append((first, prev + 1))
    return runs


class KVStore:
    """The fields of one pool: ``k`` and ``v`` ``[KVH, D]`` per row, or ``h`` ``[H]`` in h-mode;
    an Inkling-2 model's: ``k``, ``v`` and its short convolutions' inputs, flat."""

    def __init__(self, mode: KVMode, config: ModelConfig, rows: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.mode = mode
        self.block_size = block_size
        shapes: dict[str, tuple[int, ...]]
        if config.architecture == "inkling2":  # K, V and the short convolutions' inputs, per token and slot
            self.dtype = dtype
            width = config.kv_heads * config.head_dim
            shapes = {"k": (width,), "v": (width,), "k_in": (width,), "v_in": (width,),
                      "attn_in": (config.hidden,), "mlp_in": (config.hidden,)}
        elif mode.h_mode:
            self.dtype = recompute_dtype(mode, dtype, device)
            shapes = {"h": (config.hidden,)}
        else:
            self.dtype = dtype
            shapes = {"k": (config.kv_heads, config.head_dim), "v": (config.kv_heads, config.head_dim)}
        self.row_shapes = shapes  # each field's shape of a row
        self.fields: dict[str, Buffer] = {
            name: (Int4Buffer(rows, shape, mode.group(shape[-1]), device) if mode.int4
                   else PlainBuffer(rows, shape, self.dtype, device))
            for name, shape in shapes.items()}

    def __repr__(self) -> str:
        kind = "int4" if self.mode.int4 else str(self.dtype).removeprefix("torch.")
        return f"<KVStore {self.mode.name} fields={','.join(self.fields)} {kind} {self.bytes_per_row} B/row>"

    @property
    def bytes_per_row(self) -> int:
        """Bytes per token and slot, measured on the allocated tensors."""
        return sum(f.bytes_per_row for f in self.fields.values())

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the store allocated."""
        return sum(f.nbytes for f in self.fields.values())

    def write(self, rows: torch.Tensor, **values: torch.Tensor) -> None:
        """Store ``values[name]`` ``[n, *row_shape]`` at ``rows`` ``[n]``, for each field given."""
        for name, value in values.items():
            self.fields[name].write(rows, value)

    def read(self, name: str, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Field ``name`` at ``rows`` (any shape): ``[*rows.shape, *row_shape]`` in ``dtype``."""
        return self.fields[name].read(rows, self.dtype if dtype is None else dtype)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for field in self.fields.values():
            field.copy_rows(src, dst)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for field in self.fields.values():
            for t in field.tensors:
                t[dst * bs:(dst + 1) * bs] = t[src * bs:(src + 1) * bs]

    def clear_blocks(self, blocks: list[int]) -> None:
        """Zero every row of ``blocks``."""
        if not blocks:
            return
        runs = _runs(blocks)
        index: torch.Tensor | None = None
        for field in self.fields.values():
            for t in field.tensors:
                per_block = t.view(-1, self.block_size * t[0].numel())
                if len(runs) <= _ZERO_RUNS:  # a few runs of neighbours (a fresh pool's): a memset each
                    for first, end in runs:
                        per_block[first:end].zero_()
                    continue
                if index is None:  # every field lives on the one device
                    index = torch.tensor(blocks, dtype=torch.long, device=t.device)
                per_block.index_fill_(0, index, 0)

    def tensor(self, name: str) -> torch.Tensor:
        """The plain tensor of field ``name`` as ``[blocks, block_size, *row_shape]`` (full mode)."""
        field = self.fields[name]
        if not isinstance(field, PlainBuffer):
            raise TypeError(f"field {name!r} of a {self.mode.name} store is not a plain tensor")
        return field.data.view(-1, self.block_size, *field.data.shape[1:])

