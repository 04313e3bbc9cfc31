"""Test support: tiny checkpoints and drivers shared by the test suites."""
