"""The denoising engine: a request's state and step result (``request``), planning a step
(``planner``), the engine that plans, runs and applies steps (``engine.DLMEngine``), the interface every
engine offers the service and the tools (``protocol.Engine``) and a zero-compute fake (``fake``)."""
