"""Host buffers on 2 MiB pages (model/hostmem.py): zeros of the asked shape and dtype, writable,
alive while any view is."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tinyloop.model import hostmem


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8, torch.bfloat16])
def test_zeros_are_zeros_of_the_shape_and_dtype(dtype: torch.dtype) -> None:
    t = hostmem.zeros((3, 5, 7), dtype, "cpu")
    assert t.shape == (3, 5, 7) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert not t.any()
    t[1, 2] = 3
    assert t.sum().item() == 21


def test_a_view_keeps_the_memory_alive() -> None:
    view = hostmem.huge_page_bytes(5 << 20)[4096:8192].view(torch.float32)
    gc.collect()
    view.fill_(2.0)
    assert view.sum().item() == 2.0 * 1024


def test_the_kv_pool_on_the_cpu_is_zeros_on_it() -> None:
    from tinyloop.model.kvstore import KVStore
    from tinyloop.model.presets import PRESETS
    from tinyloop.vocabulary import KVMode

    store = KVStore(KVMode.parse(None), PRESETS["tiny"], 64, 16, torch.float32, "cpu")
    for field in store.fields.values():
        for t in field.tensors:
            assert not t.any()


def test_zeros_commit_their_memory_when_made() -> None:
    """Written once at allocation (as ``torch.zeros``): a buffer that does not fit fails when it
    is made, not at its first use."""

    def rss_kb() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1])
        pytest.skip("no /proc/self/status here")

    before = rss_kb()
    t = hostmem.zeros((64 << 20,), torch.uint8, "cpu")  # 64 MiB
    assert rss_kb() - before > 48 << 10
    del t


def test_a_map_that_cannot_be_made_is_a_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import mmap

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match="could not map"):
        hostmem.huge_page_bytes(1 << 20)
