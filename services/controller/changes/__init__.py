"""The write side: the changes operators ask, by what they change (modules, secrets,
machines), each recorded as a plan."""
