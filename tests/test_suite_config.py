"""The test suite's own guarantees: every test runs under a timeout, so a hang fails instead of
hanging CI (CPU, instant)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_every_test_has_a_timeout(pytestconfig):
    assert 0 < float(pytestconfig.getini("timeout")) <= 600


def test_a_hanging_test_fails_under_the_configured_timeout(tmp_path, pytestconfig):
    """A test that would sleep for an hour is stopped; the per-test limit is read from pyproject."""
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import time

        def test_hangs():
            time.sleep(3600)
    """))
    ini = pytestconfig.inipath
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ini), "--rootdir", str(tmp_path),
           "-o", "timeout=3", str(tmp_path / "test_hang.py")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Timeout" in out.stdout, out.stdout[-2000:]
