"""The node agent: starts, stops and restarts worker processes on one node (see ``agent.py``)."""
