"""How long installing the project into a fresh venv takes: `make install`'s uv path (deploy/uv_pip_install.py, pip's
configuration handed to uv) against pip itself with the same flags `make install` falls back to. Each side gets a
fresh venv and an empty cache of its own (so neither reuses what the other, or an earlier run, downloaded); timed
from venv creation to the end of the install. Prints JSON, with whether both installed the same packages.

    .venv/bin/python bench/install_time.py [--extra cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def fresh_venv(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    return where / "bin"


def freeze(bin_dir: Path) -> set[str]:
    listed = subprocess.run([str(bin_dir / "python"), "-m", "pip", "list", "--format=freeze",
                             "--exclude-editable"], capture_output=True, text=True, check=True).stdout
    skip = {"pip", "setuptools", "uv"}
    return {ln.lower().replace("_", "-") for ln in listed.splitlines() if ln.split("==")[0].lower() not in skip}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--extra", default="cpu")
    args = parser.parse_args()
    target = f".[{args.extra},dev]"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = {**os.environ, "PIP_CACHE_DIR": str(tmp / "pip-cache"), "UV_CACHE_DIR": str(tmp / "uv-cache")}
        started = time.perf_counter()
        pip_bin = fresh_venv(tmp / "pip")
        subprocess.run([str(pip_bin / "pip"), "install", "--quiet", "--disable-pip-version-check", "--no-compile",
                        "-e", target], cwd=ROOT, env=env, check=True)
        pip_s = time.perf_counter() - started

        started = time.perf_counter()
        uv_bin = fresh_venv(tmp / "uv")
        subprocess.run([str(uv_bin / "pip"), "install", "--quiet", "--disable-pip-version-check", "uv"], env=env,
                       check=True)
        subprocess.run([str(uv_bin / "python"), "deploy/uv_pip_install.py", str(uv_bin / "uv"), "pip", "install",
                        "--quiet", "--python", str(uv_bin / "python"), "-e", target], cwd=ROOT, env=env, check=True)
        uv_s = time.perf_counter() - started
        pip_set, uv_set = freeze(pip_bin), freeze(uv_bin)
    print(json.dumps({
        "extra": args.extra, "pip_s": round(pip_s, 1), "uv_s": round(uv_s, 1),
        "speedup": round(pip_s / uv_s, 2), "packages": len(pip_set),
        "same_packages": pip_set == uv_set,
        "only_pip": sorted(pip_set - uv_set), "only_uv": sorted(uv_set - pip_set),
    }, indent=2))


if __name__ == "__main__":
    main()
