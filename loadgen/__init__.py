"""Open-loop load generation against a DiLaServe gateway."""
