"""The one base class of errors a person can act on from their words alone.

A command turns any `MeshError` into one line on stderr and exit code 1; anything else is a bug,
reported as an internal error. Library, services and programs raise subclasses named for what
went wrong (`Unreachable`, `SeatLost`, `RegistrationRefused`, ...), so the command line needs to
know none of them, and no layer imports a higher one to catch its exceptions.
"""


class MeshError(Exception):
    """A failure whose message says what happened and, where it can, what to do."""
