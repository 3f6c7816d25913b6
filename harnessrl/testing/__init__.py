"""Test doubles, each named for what it stands in for. Used by tests and benchmarks only."""
