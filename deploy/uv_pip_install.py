"""`uv pip install ARGS...` with this machine's pip configuration, which uv does not read: the package sources,
constraints and certificate that pip.conf and PIP_* variables give pip (a mirror, a folder of local wheels, a
version cap, a proxy's CA) are passed to uv in its own environment variables, and uv weighs all indexes alike, as
pip does.
`make install` runs it with the venv's Python (standard library only: nothing is installed yet) and falls back to
pip when it fails.

    python deploy/uv_pip_install.py UV ARGS...
"""

from __future__ import annotations

import os
import subprocess
import sys

# pip's list-valued settings, the uv environment variable each becomes and how uv splits that variable's list. They
# go to uv through its environment, never its command line: an index URL may hold a password (https://user:TOKEN@…),
# and any user of the machine can read a process's command line (ps, /proc/PID/cmdline) but not its environment
LISTS = {"index-url": ("UV_INDEX_URL", " "), "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
         "find-links": ("UV_FIND_LINKS", ","), "constraint": ("UV_CONSTRAINT", " "),
         "trusted-host": ("UV_INSECURE_HOST", " ")}
SCOPES = ("global", "user", "site", ":env:")  # lowest to highest priority, as pip reads them


def pip_settings(listed: str) -> dict[str, str]:
    """Each setting's value from its highest-priority scope, out of `pip config list` (`scope.key='value'`)."""
    found: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        name, sep, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        if not sep or scope not in SCOPES:
            continue
        rank = SCOPES.index(scope)
        if key not in found or rank >= found[key][0]:
            found[key] = (rank, value.strip().strip("'\""))
    return {key: value for key, (_, value) in found.items()}


def uv_command(uv: str, args: list[str], settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command (ARGS and the index strategy) and the environment that carries pip's settings to uv."""
    env = dict(os.environ)
    for key, (variable, separator) in LISTS.items():
        if values := settings.get(key, "").split():
            env[variable] = separator.join(values)
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        env["UV_NO_INDEX"] = "1"
    if settings.get("cert"):
        env["SSL_CERT_FILE"] = settings["cert"]
    return [uv, *args, "--index-strategy", "unsafe-best-match"], env


def main(argv: list[str]) -> int:
    uv, *args = argv
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True).stdout
    command, env = uv_command(uv, args, pip_settings(listed))
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
