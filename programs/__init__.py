"""The programs a person runs: the `mesh` command line (`cli/`), `mesh dev up` (`dev_up.py`) and
`mesh init` (`init.py`). They stand above both the library (`mesh/`) and the services
(`services/`), which they start; neither of those imports anything from here."""
