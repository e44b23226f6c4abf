"""Tenants: the companies that host adapters on loraplex."""
