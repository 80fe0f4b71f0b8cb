"""Help that fits the terminal: typer's rich option table below RICH_HELP_MIN_COLUMNS, click's plain layout above.

typer draws a command's options as one rich table of five columns (name, short name, --no- name, type, help).
Rich can wrap only the help; on a terminal narrower than the widest rows need it cuts the option names
themselves ("--repetition-pe…", "--attention-bac…" at 80 columns), which a --help must never do. Below that
width each command's --help takes click's plain layout (the names in full, the help wrapped beside them); the
top-level command list stays rich, which wraps. tests/test_cli.py checks both widths for every command.
"""

from __future__ import annotations

import shutil
from typing import Any

from kvcli.cli_errors import OneLineErrorGroup

# The narrowest terminal on which no command's rich option table cuts a name (104 on 2026-12-06, serve and
# continue the widest), with some room for options to come.
RICH_HELP_MIN_COLUMNS = 110


class KvcliGroup(OneLineErrorGroup):
    """kvcli's command group: one-line errors (OneLineErrorGroup), and each command's help laid out for the
    terminal's width."""

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None and hasattr(cmd, "rich_markup_mode"):
            wide = shutil.get_terminal_size().columns >= RICH_HELP_MIN_COLUMNS
            cmd.rich_markup_mode = self.rich_markup_mode if wide else None
        return cmd
