"""Graders that ship with harnessrl (`judge`: an LLM judge for tasks without tests)."""
