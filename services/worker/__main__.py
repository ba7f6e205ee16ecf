"""``python -m services.worker``: one model instance, settings from ``DLS_WORKER_*`` (shared/README.md)."""

import logging
import sys

from services.worker.service.startup import serve
from shared.calibration import CalibrationError
from shared.devices import DeviceError
from shared.runtime import run
from shared.settings import WorkerSettings


def main() -> None:
    settings = WorkerSettings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(serve(settings))
    except (DeviceError, CalibrationError) as exc:  # its GPUs are not there, or its calibration is another's
        logging.getLogger("dls.worker").error("cannot start: %s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
