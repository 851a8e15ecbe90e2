"""``FusedBlock``: one decoder block's decode step as one C call (``block.c``).

A decode step of a small model at batch 1 spends as long between the C kernels as in them: each
block makes some twenty Python and torch calls (norms, views, RoPE tables, residual adds, the
KV write), about 150 us a block on this machine, against about 3 ms of weights a token for a
~100M model at int8. ``FusedBlock.run`` runs the same kernels in the same order from C, on the
same buffers, so a block's output is the unfused one's (the SwiGLU aside, computed in C: float32
rounding).

It covers the plain decode step (one new token a row, a float32 or 4-bit KV pool, no tree, no
loop gaps: ``PagedContext.decode_rows``) of a float32 block with a fused q/k/v projection or
three (Ouro), q and k biases or none (Huginn), no q/k norm with a weight (Parcae's weightless
per-head norm after RoPE is covered), a SwiGLU or Parcae's ``relu2`` MLP, Parcae's value
embeddings (their gate a float32 linear; the rows' tokens handed in: such blocks are not stacked
into one call), a ``pre_ln``, ``sandwich`` or ``peri_ln`` layout, and every weight on the kernels
(``cpu_linear.PackedWeight`` with panels, ``quant.QuantWeight`` int8, int4 or bf16 with panels). Anything else (a
prefill, a verify, h-mode KV, another dtype) returns None from ``run`` and the block
runs unfused. ``cpu.backend.use_cpu_kernels`` gives each covered block one (``Block.fused``).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Mapping
from typing import TypeGuard

import torch

from tinyloop.cpu import kernels
from tinyloop.model.context import PagedContext
from tinyloop.model.cpu_linear import PackedLinear, PackedWeight
from tinyloop.model.kvstore import Int4Buffer, PlainBuffer
from tinyloop.model.layers import Attention, AttentionContext, Block, RMSNorm
from tinyloop.model.quant import QuantLinear, QuantWeight

__all__ = ["FusedBlock", "Weight", "check_code", "held_weight", "kv_struct", "module_weight", "stack_index"]

_STYLES = {"pre_ln": 0, "sandwich": 1, "peri_ln": 2}
_I64, _P = ctypes.c_int64, ctypes.c_void_p


class Weight(ctypes.Structure):  # block.c's tl_weight
    _fields_ = [("kind", _I64), ("n", _I64), ("k", _I64), ("group", _I64), ("panels", _P), ("scales", _P),
                ("terms", _I64)]


class _KV(ctypes.Structure):  # block.c's tl_kv
    _fields_ = [("int4", _I64), ("group", _I64), ("pool_rows", _I64), ("k", _P), ("v", _P), ("k_codes", _P),
                ("v_codes", _P), ("k_meta", _P), ("v_meta", _P)]


def kv_struct(fields: Mapping[str, object]) -> _KV | None:
    """A layer's K and V pool as block.c reads it: float32 rows, or 4-bit (``Int4Buffer``); None
    for any other (h-mode, another dtype)."""
    k, v = fields.get("k"), fields.get("v")
    if isinstance(k, PlainBuffer) and isinstance(v, PlainBuffer):
        if all(t.dtype == torch.float32 and t.is_contiguous() and t.is_cpu for t in (k.data, v.data)):
            return _KV(0, 0, k.data.shape[0], k.data.data_ptr(), v.data.data_ptr(), None, None, None, None)
    elif isinstance(k, Int4Buffer) and isinstance(v, Int4Buffer) and k.group == v.group:
        parts = (k.codes, v.codes, k.meta, v.meta)
        if (all(t.is_contiguous() and t.is_cpu for t in parts) and k.meta.dtype == v.meta.dtype == torch.float16
                and k.codes.dtype == torch.uint8):
            return _KV(1, k.group, k.codes.shape[0], None, None, *(t.data_ptr() for t in parts))
    return None


class _Block(ctypes.Structure):  # block.c's tl_block
    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("intermediate", _I64),
                ("style", _I64), ("rope_half", _I64), ("n1", _P), ("n2", _P), ("n3", _P), ("n4", _P),
                ("qkv", Weight), ("o", Weight), ("fc", Weight), ("proj", Weight), ("eps", ctypes.c_float),
                ("fused_qkv", _I64), ("q", Weight), ("k", Weight), ("v", Weight), ("q_bias", _P), ("k_bias", _P),
                ("relu2", _I64), ("qk_head_norm", _I64), ("head_eps", ctypes.c_float), ("value_table", _P),
                ("value_gate", _P), ("gate_channels", _I64), ("vocab", _I64)]


def module_weight(module: torch.nn.Module) -> tuple[Weight, torch.Tensor] | None:
    """A linear layer as block.c reads it, and the panels it points at; None off the kernels."""
    if isinstance(module, PackedLinear) and module.bias is None:
        return held_weight(module.packed)
    if isinstance(module, QuantLinear) and module.bias is None:
        return held_weight(module.quant)
    return None


def held_weight(holder: PackedWeight | QuantWeight) -> tuple[Weight, torch.Tensor] | None:
    """A weight's panels as block.c reads them (float32 ``PackedWeight``, or int8, int4 or bf16
    ``QuantWeight``), and the panels; None where it has none."""
    panels = holder.panels
    if panels is None:
        return None
    if isinstance(holder, PackedWeight):
        n, k = holder.weight.shape
        return Weight(0, n, k, 0, panels.data_ptr(), None, 1), panels
    (n, k), kind = holder.shape, {"int8": 1, "int4": 2, "bf16": 3}[holder.mode]
    scales = holder.scales.data_ptr() if kind == 1 and not holder.group else None  # (grouped: in the panels)
    return Weight(kind, n, k, holder.group, panels.data_ptr(), scales, holder.terms), panels


_Watch = tuple[dict[str, "torch.nn.Module | None"], str, torch.nn.Module, object, object]


def _layers(block: Block) -> list[tuple[torch.nn.Module, str]]:
    """Where a block's linear layers sit: (parent module, name), the q/k/v projection(s) first."""
    qkv = ["qkv"] if block.attn.config.fused_qkv else ["q", "k", "v"]
    return [(block.attn, name) for name in (*qkv, "o")] + [(block.mlp, "fc"), (block.mlp, "proj")]


def _watched(block: Block) -> tuple[_Watch, ...]:
    """What a block's struct depends on: each of its linear layers where the block holds it (its
    parent's module dict, the name), and the object holding the layer's panels with the panels
    it holds now. ``FusedBlock.current`` checks each still holds the same."""
    out: list[_Watch] = []
    for parent, name in _layers(block):
        layer = parent._modules[name]
        assert layer is not None
        holder = getattr(layer, "packed", None) or getattr(layer, "quant", None)
        out.append((parent._modules, name, layer, holder, getattr(holder, "panels", None)))
    return tuple(out)


def _value_embedding(attn: Attention) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Parcae's value table ``[vocab, KVH * D]`` and gate weight ``[KVH, channels]`` as block.c reads
    them (float32, contiguous), or Nones: a gate that is not a plain float32 linear (quantised with
    ``--weights``: its product rounds its input, which the C step's float dot would not) runs the
    layer's modules."""
    table, gate = attn.value_table.weight, attn.value_gate
    if not isinstance(gate, torch.nn.Linear) or gate.bias is not None or gate.weight.dtype != torch.float32:
        return None, None  # (a PackedLinear is one: its weight maybe re-laid column-major, copied here)
    weight = gate.weight.detach().contiguous()
    if table.dtype != torch.float32 or not table.is_contiguous() or table.device.type != "cpu":
        return None, None
    return table.detach(), weight


def _norm(norm: RMSNorm | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


class FusedBlock:
    """A covered ``Block``'s decode step in one call; ``for_block`` is None for a block it does
    not cover. Rebuilt (``Block.fused``) whenever the block's weights get new panels."""

    __slots__ = ("block", "_struct", "_keep", "_watch")

    def __init__(self, block: Block, struct: _Block, keep: list[torch.Tensor]) -> None:
        self.block, self._struct, self._keep = block, struct, keep  # (_keep: what the struct points at)
        self._watch = _watched(block)

    @classmethod
    def for_block(cls, block: Block) -> FusedBlock | None:
        attn, c = block.attn, block.attn.config
        if not kernels.available() or block.style not in _STYLES or c.qk_norm:
            return None
        if c.mlp not in ("swiglu", "relu2"):
            return None
        if c.rope_style not in ("half", "interleaved"):
            return None
        norms = [getattr(block, name, None) for name in ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm")]
        biases = [attn.q_bias, attn.k_bias] if c.qk_bias else []
        if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"
               for t in [*(n.weight for n in norms if n is not None), *biases]):
            return None
        found = [module_weight(parent._modules[name]) for parent, name in _layers(block)]  # type: ignore[arg-type]
        weights = [w for w in found if w is not None]
        if len(weights) != len(found):
            return None
        value = _value_embedding(attn) if attn.value_embed else (None, None)
        if attn.value_embed and value[0] is None:
            return None
        structs = [w[0] for w in weights]
        none = Weight(0, 0, 0, 0, None, None)
        qkv, q, k, v = (structs[0], none, none, none) if c.fused_qkv else (none, *structs[:3])
        o, fc, proj = structs[-3:]
        struct = _Block(c.hidden, c.heads, c.kv_heads, c.head_dim, c.intermediate, _STYLES[block.style],
                        int(c.rope_style == "half"), *(_norm(n) for n in norms), qkv, o, fc, proj, block.eps,
                        int(c.fused_qkv), q, k, v, *(t.data_ptr() for t in biases) if biases else (None, None),
                        int(c.mlp == "relu2"), int(c.qk_head_norm), torch.finfo(torch.float32).eps,
                        *(None if t is None else t.data_ptr() for t in value),
                        0 if value[1] is None else value[1].shape[1], 0 if value[0] is None else value[0].shape[0])
        keep = [w[1] for w in weights] + [n.weight for n in norms if n is not None] + biases
        keep += [t for t in value if t is not None]
        return cls(block, struct, keep)

    def __deepcopy__(self, memo: dict[int, object]) -> None:
        """A copied block has its own panels (or none yet): it runs unfused until
        ``use_cpu_kernels`` gives it its own (the struct points at this block's memory)."""
        return None

    @property
    def address(self) -> int:
        """The address of the block's struct (what a stack's call takes, one per block)."""
        return ctypes.addressof(self._struct)

    @property
    def stackable(self) -> bool:
        """Whether the block runs inside a stack's one call (``run_stack``, ``cpu.step``): not
        with value embeddings, which need the rows' tokens."""
        return self._struct.value_table is None

    def current(self) -> bool:
        """Whether the block still has the layers and panels this was built from."""
        return all(modules[name] is layer and holder.panels is panels  # type: ignore[attr-defined]
                   for modules, name, layer, holder, panels in self._watch)

    def run(self, x: torch.Tensor, ctx: AttentionContext, rows: torch.Tensor | None, slots: torch.Tensor | int,
            normed: torch.Tensor | None, then: RMSNorm | None,
            ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``Block.run`` for a plain decode step (x ``[R, 1, H]`` float32 contiguous; ``ids`` the
        rows' tokens ``[R, 1]``, which value embeddings need); None where this call is not one it
        covers (the block then runs unfused)."""
        if not _decode_step(ctx, x) or not self.current():
            return None
        if self._struct.value_table is None:
            ids = None  # (read only for value embeddings)
        elif ids is None or ids.numel() != x.shape[0]:
            return None
        else:
            ids = ids.reshape(-1).to(torch.int64).contiguous()
        index = ctx.decode_rows(rows, slots)
        if index is None:
            return None
        kv = kv_struct(ctx.pool.store.fields)
        if kv is None:
            return None
        if normed is not None and (normed.dtype is not torch.float32 or not normed.is_contiguous()):
            return None
        if then is not None and (then.weight.dtype is not torch.float32 or not then.weight.is_contiguous()):
            return None
        write, keys, n_keys, cos, sin = index
        r = x.shape[0]
        out = torch.empty_like(x)
        then_out = None if then is None else torch.empty_like(x)
        code = kernels.load().tl_decode_block(
            ctypes.byref(self._struct), x.data_ptr(), None if normed is None else normed.data_ptr(), r,
            cos.data_ptr(), sin.data_ptr(), cos.shape[0], ctypes.byref(kv),
            write.data_ptr(), keys.data_ptr(), keys.shape[1], n_keys.data_ptr(),
            None if then is None else then.weight.data_ptr(), out.data_ptr(),
            None if then_out is None else then_out.data_ptr(), None if ids is None else ids.data_ptr())
        check_code(code, kv)
        return out, then_out

    def run_stack(self, blocks: torch.nn.ModuleList, x: torch.Tensor, ctx: AttentionContext,
                  slot0: int) -> torch.Tensor | None:
        """``LoopedLM.stack`` of a plain decode step through ``blocks`` (this block first, every
        one fused), all rows, block i at slot ``slot0 + i``, in one C call (``tl_decode_stack``);
        None where any block or the call is not covered (the blocks then run one by one)."""
        fused = [getattr(layer, "fused", None) for layer in blocks]
        if not _decode_step(ctx, x):
            return None
        steps = [f for f in fused if isinstance(f, FusedBlock) and f.current() and f.stackable]
        if len(steps) != len(fused):  # (value embeddings need the tokens: block by block)
            return None
        found = stack_index(ctx)
        if found is None:
            return None
        (write, keys, n_keys, cos, sin), kv = found
        if not 0 <= slot0 <= write.shape[0] - len(steps):
            return None
        cached = _STACKS.get(blocks)
        if cached is None or cached[0] != tuple(steps):  # (identity: a rebuilt FusedBlock is another object)
            cached = tuple(steps), (_P * len(steps))(*(f.address for f in steps))
            _STACKS[blocks] = cached
        r = x.shape[0]
        out, scratch = x.clone(), torch.empty_like(x)
        code = kernels.load().tl_decode_stack(
            cached[1], len(steps), slot0, out.data_ptr(), scratch.data_ptr(), r, cos.data_ptr(), sin.data_ptr(),
            cos.shape[0], ctypes.byref(kv), write.data_ptr(), keys.data_ptr(), keys.shape[2], n_keys.data_ptr())
        check_code(code, kv)
        return out


# Each stack's block structs as the array tl_decode_stack takes, with the FusedBlocks they belong
# to (the structs live in them); keyed weakly by the stack's ModuleList.
_Structs = tuple[tuple["FusedBlock", ...], ctypes.Array[ctypes.c_void_p]]
_STACKS: weakref.WeakKeyDictionary[torch.nn.Module, _Structs] = weakref.WeakKeyDictionary()


def stack_index(ctx: PagedContext) -> tuple[tuple[torch.Tensor, ...], _KV] | None:
    """A plain decode step's rows at every slot (``PagedContext.decode_slots``) and its pool as
    block.c reads it, for a call through stacks of blocks; None for any other step or pool."""
    index = ctx.decode_slots()
    kv = None if index is None else kv_struct(ctx.pool.store.fields)
    return None if index is None or kv is None else (index, kv)


def _decode_step(ctx: AttentionContext, x: torch.Tensor) -> TypeGuard[PagedContext]:
    """Whether x ``[R, 1, H]`` (float32, contiguous) goes through a paged context: what both the
    fused block and the fused stack take (the context then says whether the step is plain)."""
    return (isinstance(ctx, PagedContext) and x.dtype is torch.float32 and x.dim() == 3 and x.shape[1] == 1
            and x.is_contiguous())


def check_code(code: int, kv: _KV) -> None:
    if code == 2:
        raise IndexError(f"a KV row is outside the pool of {kv.pool_rows} rows")
    if code == 3:
        raise IndexError("a token id is outside the value embedding table")
    if code:
        raise MemoryError("a fused decode block could not allocate its scratch memory")
