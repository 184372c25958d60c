"""The engine side: the vLLM launcher with the connector, its status heartbeat in Redis, the
suspect marks a failed dispatch leaves, and draining."""
