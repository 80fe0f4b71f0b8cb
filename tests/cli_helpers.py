"""Assertions shared by the CLI tests."""

from __future__ import annotations


def one_line_error(result, needle: str) -> str:
    """A CliRunner result that failed with exactly one `kvcli: error:` line naming `needle`; that line."""
    assert result.exit_code != 0
    err = result.stderr.strip()
    assert "Traceback" not in result.output and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("kvcli: error:") and needle in err, err
    return err
