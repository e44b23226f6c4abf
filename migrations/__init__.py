"""Alembic environment and revisions for loraplex.platform's models."""
