"""harnessrl: train LLM agents with RL through the harness they are deployed with."""

__version__ = "0.1.0"
