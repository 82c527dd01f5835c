"""The store: PostgreSQL through asyncpg. The truth: all on the bus can be rebuilt from it."""
