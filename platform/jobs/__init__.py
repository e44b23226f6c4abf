"""Durable work that outlives the request that asked for it (background responses; later fine-tuning jobs and
batches): rows of the `jobs` table, claimed by a worker in any platform replica under a lease that it renews while it
runs them, so a job whose replica stopped is taken up by another (decision 0049)."""
