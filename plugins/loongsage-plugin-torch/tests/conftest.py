"""Shared set-up of the torch plugin's tests.

The tests run with ``--import-mode=importlib``, so a test module cannot import another one; the
helpers several of them share live in ``torch_test_support.py`` beside them, and this folder is
put on ``sys.path`` (conftest files load before the test modules are collected) so that they can
``import torch_test_support``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
