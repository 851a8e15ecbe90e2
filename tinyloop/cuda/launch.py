"""Launch geometry of the kernels in this package: pure Python, so it is tested without a GPU.

Each function returns a ``Launch``: grid and block (x, y, z) and the bytes of dynamic shared
memory. The numbers here must agree with the ``.cu`` sources (their header comments say how
they index): ``ATTN_THREADS`` is ``TL_ATTN_THREADS``, ``ATTN_MAX_PER_THREAD`` is
``TL_ATTN_MAX_PER_THREAD``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Launch", "ATTN_THREADS", "ATTN_MAX_PER_THREAD", "MAX_THREADS", "SHARED_LIMIT",
           "rmsnorm_launch", "rope_launch", "swiglu_launch", "kv_write_launch", "kv_write_int4_launch",
           "decode_splits", "keys_per_split", "paged_decode_launch", "paged_combine_launch", "block_threads"]

MAX_THREADS = 1024  # threads per block on every architecture CUDA 12/13 supports
SHARED_LIMIT = 48 * 1024  # dynamic shared memory without the opt-in attribute
ATTN_THREADS = 128
ATTN_MAX_PER_THREAD = 4
SWIGLU_THREADS = 256
SWIGLU_MAX_BLOCKS = 65535 * 8  # grid-stride loop beyond this


@dataclass(frozen=True, slots=True)
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int = 0


def block_threads(work: int, cap: int = MAX_THREADS) -> int:
    """Threads for a block that loops over ``work`` items: a whole number of warps, at least
    one, at most ``cap``."""
    if work < 1:
        raise ValueError("work must be >= 1")
    return min(cap, -(-work // 32) * 32)


def rmsnorm_launch(rows: int, hidden: int) -> Launch:
    """One block per row, threads striding over the hidden width (``rmsnorm.cu``)."""
    if rows < 1:
        raise ValueError("rows must be >= 1")
    return Launch((rows, 1, 1), (block_threads(hidden), 1, 1))


def rope_launch(tokens: int, q_heads: int, kv_heads: int, head_dim: int) -> Launch:
    """A block per (token, head) of q then k; a thread per rotation pair (``rope.cu``)."""
    if head_dim % 2:
        raise ValueError("RoPE needs an even head_dim")
    if tokens < 1:
        raise ValueError("tokens must be >= 1")
    return Launch((tokens, q_heads + kv_heads, 1), (block_threads(head_dim // 2), 1, 1))


def kv_write_launch(tokens: int, kv_heads: int, head_dim: int) -> Launch:
    """A block per (token, head, K or V); its threads stride over the head (``kv_write.cu``)."""
    if tokens < 1 or kv_heads < 1 or head_dim < 1:
        raise ValueError("tokens, kv_heads and head_dim must be >= 1")
    return Launch((tokens, kv_heads, 2), (block_threads(head_dim, 256), 1, 1))


def kv_write_int4_launch(tokens: int, kv_heads: int, groups: int) -> Launch:
    """A block per (token, K or V); its threads stride over the token's ``kv_heads * groups``
    int4 groups, one each (``kv_write.cu``)."""
    if tokens < 1 or kv_heads < 1 or groups < 1:
        raise ValueError("tokens, kv_heads and groups must be >= 1")
    return Launch((tokens, 2, 1), (block_threads(kv_heads * groups, 256), 1, 1))


def swiglu_launch(rows: int, inter: int) -> Launch:
    """A 1-D grid-stride loop over ``rows * inter`` outputs (``swiglu.cu``)."""
    n = rows * inter
    if n < 1:
        raise ValueError("rows and inter must be >= 1")
    return Launch((min(-(-n // SWIGLU_THREADS), SWIGLU_MAX_BLOCKS), 1, 1), (SWIGLU_THREADS, 1, 1))


def decode_splits(rows: int, q_heads: int, max_len: int, sms: int, min_keys: int = 256) -> int:
    """How many key splits (flash-decoding) a decode step uses: enough blocks to fill about two
    waves of ``sms`` multiprocessors, never a split shorter than ``min_keys`` keys."""
    blocks = rows * q_heads
    want = max(1, -(-2 * sms // blocks))
    return max(1, min(want, max_len // min_keys))


def keys_per_split(max_len: int, splits: int) -> int:
    """Keys each split walks: a whole number of tiles, so splits never share a tile."""
    per = -(-max_len // splits)
    return max(ATTN_THREADS, -(-per // ATTN_THREADS) * ATTN_THREADS)


def paged_decode_launch(rows: int, q_heads: int, head_dim: int, splits: int) -> Launch:
    """Grid (rows, q_heads, splits); shared memory q ``[D]`` and p ``[THREADS]`` floats plus the
    tile's pool rows ``[THREADS]`` int32 (``paged_attention.cu``)."""
    if head_dim > ATTN_THREADS * ATTN_MAX_PER_THREAD:
        raise ValueError(f"paged decode attention supports head_dim <= {ATTN_THREADS * ATTN_MAX_PER_THREAD}")
    if min(rows, q_heads, splits) < 1:
        raise ValueError("rows, q_heads and splits must be >= 1")
    shared = 4 * (head_dim + ATTN_THREADS) + 4 * ATTN_THREADS
    if shared > SHARED_LIMIT:
        raise ValueError("shared memory over the default limit")
    return Launch((rows, q_heads, splits), (ATTN_THREADS, 1, 1), shared)


def paged_combine_launch(rows: int, q_heads: int, head_dim: int) -> Launch:
    return Launch((rows, q_heads, 1), (block_threads(head_dim, 256), 1, 1))
