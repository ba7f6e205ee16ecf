"""``python -m services.node_agent``: the node agent, settings from ``DLS_NODE_AGENT_*`` (shared/README.md)."""

import logging
import sys

from services.node_agent.agent import AgentError, serve
from shared.runtime import run
from shared.settings import NodeAgentSettings


def main() -> None:
    settings = NodeAgentSettings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(serve(settings))
    except AgentError as exc:  # bad settings: say which, no traceback
        logging.getLogger("dls.node_agent").error("cannot start: %s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
