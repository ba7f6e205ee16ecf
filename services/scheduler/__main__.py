"""``python -m services.scheduler``: the step loop, settings from ``DLS_SCHEDULER_*`` (shared/README.md)."""

import logging

from services.scheduler.service import serve
from shared.runtime import run
from shared.settings import SchedulerSettings


def main() -> None:
    settings = SchedulerSettings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(serve(settings))


if __name__ == "__main__":
    main()
