"""Endpoints: a tenant's named (base model, adapter) pairs that completions address as `model`."""
