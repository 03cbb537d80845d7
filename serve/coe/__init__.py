"""Composition of Experts: several whole models behind one endpoint, a trained router choosing.

config.py reads COE.yaml; runtime.py holds the experts and routes; server.py is `baton serve --coe`;
metrics.py the route and per-expert Prometheus series. The router itself is common/router.py.
"""
