"""``--device cuda`` / ``TINYLOOP_DEVICE=cuda`` where torch has no CUDA: a plain error, status 2."""

from __future__ import annotations

import pytest
import torch

from tinyloop.cli import main
from tinyloop.errors import ConfigError
from tinyloop.server import check_device, load_engine
from tinyloop.settings import Settings


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_cpu_needs_nothing(no_cuda: None) -> None:
    check_device("cpu")


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_a_gpu_is_a_config_error(no_cuda: None, device: str) -> None:
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        check_device(device)
    with pytest.raises(ConfigError, match="TINYLOOP_DEVICE"):
        load_engine(Settings(device=device))


def test_missing_device_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_device("cuda:0")
    with pytest.raises(ConfigError, match="only 1 CUDA device"):
        check_device("cuda:1")
    with pytest.raises(ConfigError, match="cuda:N"):
        check_device("cuda:x")


def test_serve_flag_exits_2_before_serving(no_cuda: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--device", "cuda", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device 'cuda'") and "needs a CUDA GPU" in err
    assert "Traceback" not in err


def test_devices_flag_exits_2_before_serving(no_cuda: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--devices", "0,1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device 'cuda:0'") and "--devices" in err and "Traceback" not in err


def test_env_variable_and_generate(no_cuda: None, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TINYLOOP_DEVICE", "cuda")
    assert main(["serve", "--port", "0", "--detach"]) == 2  # refused before it forks a server
    assert main(["generate", "--prompt", "hello", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("needs a CUDA GPU") == 2
