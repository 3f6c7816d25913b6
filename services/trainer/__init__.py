"""The trainer service: samples from recorded groups, GRPO-family losses, optimizer steps."""
