"""The fleet: engine replicas, their registry in Redis, and routing."""
