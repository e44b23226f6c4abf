"""Tenants' LoRA adapters: uploads, validation, versions, storage in the object store."""
