"""tests/: the tests of the machinery in folders, one file per topic. The repository root goes on sys.path, so
the teaching files, the folders' packages and test_seed.py (its fixtures and helpers) import by name."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from test_seed import one_thread, out_dir_of_the_tests, tiny, trajectories  # noqa: E402,F401  (shared fixtures)
