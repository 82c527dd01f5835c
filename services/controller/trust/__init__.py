"""Who asked: operators as the bus verified them, what each may change, the audit log."""
