"""The device side of a step: the batch the engine hands over and the output it gets back (``batch``),
the runner that turns one into the other in one forward (``runner.ModelRunner``), the commit rule and
draws on the device (``sampler``) and CUDA graphs of dual-cache steps (``graphs``)."""
