"""``python -m services.worker``: one model instance, settings from ``DLS_WORKER_*`` (shared/README.md)."""

import logging

from services.worker.service import serve
from shared.runtime import run
from shared.settings import WorkerSettings


def main() -> None:
    settings = WorkerSettings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(serve(settings))


if __name__ == "__main__":
    main()
