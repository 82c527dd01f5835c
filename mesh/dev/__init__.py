"""The embedded default: a whole mesh on one machine from wheels (`mesh dev up`)."""
