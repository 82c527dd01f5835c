"""The verbs: the table from name to the method that serves it, and the read side."""
