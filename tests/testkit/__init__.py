"""Helpers shared by the tests (imported as ``testkit.<module>``; tests/ is on sys.path through its conftest)."""
