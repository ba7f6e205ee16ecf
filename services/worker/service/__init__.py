"""The worker service: the process around one model instance's engine. ``startup`` builds the engine and
wires the process (``python -m services.worker``); ``service.WorkerService`` subscribes to its step
commands and runs the step loop, its lifecycle and drain; ``pipelining.HeldCommands`` keeps the
scheduler's commands for the step after the running one; ``records`` maps a stored request onto the
engine's state and back; ``events.EventPublisher`` publishes the requests' progress and answers;
``heartbeat`` sends the lease from a thread of its own; ``online_profile`` holds the step times an
uncalibrated worker measures."""
