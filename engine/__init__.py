"""loraplex data plane: model, memory pool, scheduler, engine server."""
