"""The reconfigurator's pure core: workload monitor, Stage 1 and Stage 2 ILPs, plans and the trigger.

Nothing here does I/O, reads the wall clock for decisions, or knows about NATS: callers pass a
snapshot in and get a decision back (clocks are injected).
"""
