"""Metric definitions, tracing setup, Grafana dashboards and alert rules."""
