"""Shared test helpers: `truth` (real eager step measured at storage level) is importable from any test."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
