"""The gateway: the OpenAI-compatible endpoint harnesses talk to; records every call."""
