"""Database plumbing: declarative base, engine and sessions, migrations."""
