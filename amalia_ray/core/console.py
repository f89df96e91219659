"""One rich console for the whole program, so stage progress and errors look the same everywhere."""

from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def stage_line(stage: str, message: str) -> None:
    console.print(f"[bold cyan]{stage:>10}[/] {message}")
