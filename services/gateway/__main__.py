"""``python -m services.gateway``: the HTTP gateway, configured by ``DLS_*`` environment variables."""

from __future__ import annotations

import logging

import uvicorn

from services.gateway.app import create_app
from shared.settings import GatewaySettings

logger = logging.getLogger("services.gateway")


def main() -> None:
    settings = GatewaySettings()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    logger.info("DiLaServe gateway on http://%s:%d (model %s)", settings.host, settings.port, settings.model_dir)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
