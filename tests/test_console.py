"""The quiet terminal: only our own lines reach it; what the process and its libraries write goes to the run's log."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_only_our_lines_reach_the_terminal_and_the_rest_goes_to_the_log(tmp_path):
    script = textwrap.dedent(f"""
        import logging, os, subprocess, sys, warnings
        from pathlib import Path
        from amalia_ray.core.console import activity, console, err_console, quiet_output, stage_line, warnings_in

        logging.basicConfig(level=logging.INFO)
        with quiet_output(Path({str(tmp_path)!r}) / "logs") as log:
            stage_line("pretrain", "running")
            print("ray says hello")
            logging.getLogger("ray.data").warning("a Ray Data warning")
            warnings.warn("a library's warning")
            os.write(2, b"written by C++ to fd 2\\n")
            subprocess.run(["echo", "a child process"], check=True)
            err_console.print("error: one line for the user")
            console._force_terminal = True  # the spinner as on a terminal: a rich Live display
            with activity("data"):
                print("streamed by Ray while the spinner turns")
            console._force_terminal = None
        stage_line("logs", f"{{log}} ({{warnings_in(log)}} warning lines)")
        print("after: back on the terminal")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "logs" / "driver.log").read_text()
    lines = [ln for ln in proc.stdout.split("\n") if "\x1b" not in ln]  # the spinner's frames are escape codes
    assert lines == ["  pretrain running", f"      logs {tmp_path}/logs/driver.log (2 warning lines)",
                     "after: back on the terminal", ""]
    assert "streamed" not in proc.stdout
    assert proc.stderr == "error: one line for the user\n"
    for line in ("ray says hello", "a Ray Data warning", "a library's warning", "written by C++ to fd 2",
                 "a child process", "streamed by Ray while the spinner turns"):
        assert line in log
    assert "pretrain" not in log and "one line for the user" not in log
