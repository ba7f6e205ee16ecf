"""The HTTP gateway: OpenAI-shaped completions in front of the scheduler (see README.md)."""
