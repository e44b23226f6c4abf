"""Helpers shared by the test suite (importable as `_support` because pytest puts tests/ on sys.path)."""
