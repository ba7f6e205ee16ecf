"""``python -m services.reconfigurator``: the periodic reconfigurator, settings from ``DLS_RECONFIGURATOR_*``
(shared/README.md)."""

import logging
import sys

from services.reconfigurator.core.files import SpecError
from services.reconfigurator.service import serve
from shared.profiles import ProfileError
from shared.runtime import run
from shared.settings import ReconfiguratorSettings


def main() -> None:
    settings = ReconfiguratorSettings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(serve(settings))
    except (SpecError, ProfileError) as exc:  # a bad cluster spec or profile: say which, no traceback
        logging.getLogger("dls.reconfigurator").error("cannot start: %s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
