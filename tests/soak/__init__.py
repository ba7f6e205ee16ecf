"""The soak: sustained open-loop load on the chaos cluster while a seeded injector breaks it (``python -m tests.soak``)."""
