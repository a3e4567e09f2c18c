"""The four stages: plain functions `run(cfg, plan, tracker) -> dict`."""
