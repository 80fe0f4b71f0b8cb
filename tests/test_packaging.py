"""The package list in pyproject.toml is explicit (kernels/ installs as kvcli_kernels), so a new
subpackage must be added there or a non-editable install silently lacks it."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvcli").rglob("__init__.py")}
    assert found - listed == set(), f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
    assert "kvcli_kernels" in listed


def test_kernels_folder_never_shadows_a_kernels_package(tmp_path: Path) -> None:
    """transformers imports Hugging Face's `kernels` when it is installed; run from the clone (repo root first
    on sys.path, as `python -m kvcli` and pytest put it), the kernels/ folder must not stand in for it, so it
    stays a namespace portion (no __init__.py), while `kvcli_kernels` still imports from it."""
    import subprocess
    import sys

    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'the installed kernels'\n")
    code = "import kernels, kvcli_kernels.cpu_build as k; print(kernels.WHO); print(k.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(other.parent), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    who, where = out.stdout.splitlines()
    assert who == "the installed kernels"
    assert Path(where).resolve().parent == (ROOT / "kernels").resolve()
