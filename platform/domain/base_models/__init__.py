"""Base models: the checkpoints engines serve, registered by an admin."""
