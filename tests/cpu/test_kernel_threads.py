"""The C kernels' helper threads (``kernels.set_threads``): the same results on any number of
threads, helpers that really take part, and callers on several threads at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tests.cpu.test_cpu_kernels import key_rows, needs_kernel, pool
from tests.cpu.test_quant_kernels import dequantized_activations
from tinyloop.cpu import kernels
from tinyloop.cpu.backend import CPU
from tinyloop.model.backend import TORCH
from tinyloop.model.quant import QuantWeight

pytestmark = needs_kernel


@pytest.fixture
def threads() -> Iterator[None]:
    """Restore the kernels' thread count after the test."""
    before = kernels.threads()
    yield
    kernels.set_threads(before)


def on_threads(n: int, fn):  # type: ignore[no-untyped-def]
    kernels.set_threads(n)
    return fn()


@pytest.mark.parametrize("rows", [1, 3, 4, 16, 17, 40])
def test_products_split_among_threads_equal_one_thread(threads: None, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    n, k = 1000, 256  # 63 panels, the last short; 4 rows x 1000 x 256 is past the split's threshold
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(1008, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    panels = kernels.pack_panels(weight)
    # (product, its dense weight, the x it multiplies, whether it splits)
    products = [(lambda: kernels.panel_matmul(x, panels, n, bias[:n]), weight, x.double(), True)]  # 1 MB: split
    for mode in ("int8", "int4"):  # the quantised products: every row count, x quantised per block
        quant = QuantWeight(torch.randn(1008, k, generator=gen) * 0.05, mode)  # (int4: N a multiple of 16)
        quant.set_panels(True)
        products.append((lambda q=quant: q.linear(x, bias), quant.dequantize(), dequantized_activations(x), True))
    for product, dense, x_used, splits in products:
        alone = on_threads(1, product)
        shared_before = kernels.task_counts()[0]
        split = on_threads(2, product)
        assert torch.equal(split, alone)  # each output column is computed by one thread, the same way
        assert (kernels.task_counts()[0] > shared_before) == splits
        torch.testing.assert_close(alone.double(), x_used @ dense.double().t() + bias[:dense.shape[0]].double(),
                                   rtol=1e-4, atol=5e-3)  # (int4's fp16 scales: dequantize's are float32)


def test_attention_split_among_threads_equals_one_thread(threads: None) -> None:
    store = pool(2, 64)
    keys = key_rows(16, 40, 128)
    gen = torch.Generator().manual_seed(3)
    n_keys = torch.randint(1, 41, (16,), generator=gen)
    q = torch.randn(16, 8, 1, 64, generator=gen)
    alone = on_threads(1, lambda: CPU.decode_attention(store, q, keys, n_keys, None))
    shared_before = kernels.task_counts()[0]
    split = on_threads(2, lambda: CPU.decode_attention(store, q, keys, n_keys, None))
    assert torch.equal(split, alone)
    assert kernels.task_counts()[0] - shared_before == 16  # one task a row


def test_the_helpers_take_part(threads: None) -> None:
    kernels.set_threads(2)
    weight = torch.randn(2048, 512)
    panels, x = kernels.pack_panels(weight), torch.randn(16, 512)
    _, helped_before = kernels.task_counts()
    deadline = time.monotonic() + 20  # a helper needs a core: bounded for a loaded machine
    while kernels.task_counts()[1] == helped_before and time.monotonic() < deadline:
        kernels.panel_matmul(x, panels, 2048, None)
    assert kernels.task_counts()[1] > helped_before


def test_callers_on_several_threads_at_once_get_their_own_results(threads: None) -> None:
    """One job at a time goes to the helpers; a caller that finds them busy runs its own tasks:
    every caller's product is still its own and whole."""
    kernels.set_threads(2)
    weight = torch.randn(777, 384)
    panels = kernels.pack_panels(weight)
    inputs = [torch.randn(8, 384, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    want = [on_threads(1, lambda x=x: kernels.panel_matmul(x, panels, 777, None)) for x in inputs]
    kernels.set_threads(2)
    wrong: list[int] = []

    def caller(i: int) -> None:
        for _ in range(30):
            if not torch.equal(kernels.panel_matmul(inputs[i], panels, 777, None), want[i]):
                wrong.append(i)

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for one in callers:
        one.start()
    for one in callers:
        one.join(timeout=60)
    assert not wrong and not any(one.is_alive() for one in callers)


def test_the_thread_count_is_checked(threads: None) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        kernels.set_threads(0)
    assert kernels.set_threads(3) == 3 and kernels.threads() == 3
    assert kernels.set_threads(1) == 1 and kernels.threads() == 1


def test_a_forked_child_computes_on_one_thread(threads: None) -> None:
    """The helpers do not survive a fork: the child's kernels run on its one thread, whole."""
    import os

    kernels.set_threads(2)
    weight = torch.randn(640, 256)
    panels, x = kernels.pack_panels(weight), torch.randn(16, 256)
    want = kernels.panel_matmul(x, panels, 640, None)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the product is right and ran on one thread
        ok = kernels.threads() == 1 and torch.equal(kernels.panel_matmul(x, panels, 640, None), want)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0


def test_a_small_product_of_few_rows_stays_on_its_callers_thread(threads: None) -> None:
    gen = torch.Generator().manual_seed(5)
    kernels.set_threads(2)
    for n, k, shared in [(64, 64, False), (512, 512, True)]:  # 16 kB of weights, 1 MB
        panels, x = kernels.pack_panels(torch.randn(n, k, generator=gen)), torch.randn(1, k, generator=gen)
        before = kernels.task_counts()[0]
        kernels.panel_matmul(x, panels, n, None)
        assert (kernels.task_counts()[0] > before) == shared


@pytest.mark.parametrize("mode", [None, "int4"])
@pytest.mark.parametrize("rows", [1, 2])
def test_few_rows_split_their_heads_among_threads(threads: None, mode: str | None, rows: int) -> None:
    """At batch 1 (and 2) a row's KV heads are split among about two tasks a thread: the same
    result as one thread computing whole rows, and against the torch reference."""
    store = pool(3, 64, mode)  # three KV heads: the split's runs are uneven
    keys = key_rows(rows, 40, 128)
    gen = torch.Generator().manual_seed(5)
    n_keys = torch.randint(1, 41, (rows,), generator=gen)
    q = torch.randn(rows, 12, 1, 64, generator=gen)
    alone = on_threads(1, lambda: CPU.decode_attention(store, q, keys, n_keys, None))
    shared_before = kernels.task_counts()[0]
    split = on_threads(2, lambda: CPU.decode_attention(store, q, keys, n_keys, None))
    assert torch.equal(split, alone)
    assert kernels.task_counts()[0] - shared_before == rows * min(3, -(-4 // rows))  # (2 threads: 4 tasks wanted)
    mask = (torch.arange(40)[None, :] < n_keys[:, None])[:, None, None, :]
    torch.testing.assert_close(alone, TORCH.decode_attention(store, q, keys, n_keys, mask), rtol=1e-5, atol=1e-5)
