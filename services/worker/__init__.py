"""The worker process: scheduler and model runner behind ZMQ (`python -m services.worker`)."""
