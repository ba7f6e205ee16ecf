"""DiLaServe's discrete-event simulator: the scheduler, predictor and reconfigurator cores on a virtual clock.

See ``sim/README.md``. Nothing here re-implements a policy: the simulator drives
``services.scheduler.core.SchedulingLoop`` and ``services.reconfigurator.core.Reconfigurator``.
"""
