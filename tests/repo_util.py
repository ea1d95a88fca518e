"""Where things are, for tests in any folder of tests/: the repository root and the top tests/ folder.

``TESTS`` holds the helper and plug-in modules (``toy_rewards``, ``reward_plugins``,
``buffer_plugins``, ``agent_plugins``, ``*_util``): pytest puts it on ``sys.path``
(``pythonpath`` in pyproject.toml), and a test that starts a Python child puts it on the child's
``PYTHONPATH`` so that the same import paths load there.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
