"""mypy holds agent/, tools/ and server/ to their annotations, as `make lint` does.

mypy cannot run the import hook through which setuptools maps `opencomposer.<name>`
onto the top-level folders; it finds the packages through the symlinks in
typecheck/opencomposer/ instead (pyproject.toml's [tool.mypy]). The first run in a
checkout fills .mypy_cache (about 25 s of CPU); later runs take a few seconds.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("agent", "tools", "server")


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )


def test_typecheck_links_mirror_the_package_dir() -> None:
    """Guards a package added to (or moved in) setuptools' package-dir that mypy would
    not find under its `opencomposer.` name: its importers would see nothing to check."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    links = {p.name: p for p in (ROOT / "typecheck" / "opencomposer").iterdir()}
    tops = {k: v for k, v in setuptools["package-dir"].items() if k.count(".") == 1}
    assert sorted(links) == sorted(k.split(".")[1] for k in tops)
    for name, folder in tops.items():
        link = links[name.split(".")[1]]
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), name


def test_mypy_reads_the_packages_by_their_installed_names(tmp_path: Path) -> None:
    """Guards a check that passes because it sees nothing: were `opencomposer.*` not
    resolved to the source, its names would be missing or Any and no misuse would show."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from opencomposer.tools.protocols import Workspace\n"
        "def f(ws: Workspace) -> int:\n"
        "    return ws.key('.')\n"
    )
    proc = _mypy(str(probe))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert 'Incompatible return value type (got "str", expected "int")' in proc.stdout


def test_mypy_is_clean_on_agent_tools_and_server() -> None:
    """Guards a type error landing in the checked packages: an Optional used as if
    present, a protocol method its implementations lack, a str where a Literal goes."""
    proc = _mypy()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modules = sum(len(list((ROOT / p).rglob("*.py"))) for p in CHECKED)
    # a folder of data alone (the shipped adapter's) is a namespace package to mypy: a source
    modules += sum(
        1
        for p in CHECKED
        for d in (ROOT / p).rglob("*")
        if d.is_dir() and d.name != "__pycache__" and not (d / "__init__.py").exists()
    )
    assert f"no issues found in {modules} source files" in proc.stdout, proc.stdout
