"""The `mesh` command line: one client of the controller's verbs, and the way services are run."""
