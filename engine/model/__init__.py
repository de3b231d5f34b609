"""Model execution: config, weight loading, the networks, attention backends, the runner."""
