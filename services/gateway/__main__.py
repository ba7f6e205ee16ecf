"""``python -m services.gateway``: the HTTP gateway, configured by ``DLS_*`` environment variables."""

from __future__ import annotations

import logging

import uvicorn

from services.gateway.app import create_app
from shared.metrics import serve_metrics
from shared.settings import GatewaySettings
from shared.telemetry import setup_tracing, shutdown_tracing

logger = logging.getLogger("services.gateway")


def main() -> None:
    settings = GatewaySettings()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("dls-gateway", settings)
    app = create_app(settings)
    # /metrics is on the HTTP app too; DLS_METRICS_PORT serves it on a port of its own for scrapers
    serve_metrics(app.state.metrics.registry, settings.metrics_port, settings.metrics_host)
    logger.info("DiLaServe gateway on http://%s:%d (model %s)", settings.host, settings.port, settings.model_dir)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                timeout_graceful_shutdown=settings.graceful_shutdown_s)
    shutdown_tracing()


if __name__ == "__main__":
    main()
