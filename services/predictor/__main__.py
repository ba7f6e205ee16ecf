"""``python -m services.predictor``: the predictor service, settings from ``DLS_PREDICTOR_*`` (shared/README.md)."""

import logging

from services.predictor.service import serve
from shared.runtime import run
from shared.settings import PredictorSettings


def main() -> None:
    settings = PredictorSettings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(serve(settings))


if __name__ == "__main__":
    main()
