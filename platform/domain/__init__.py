"""One folder per domain, each with controllers, service, repository, schemas (and models)."""
