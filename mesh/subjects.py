"""Every subject mesh uses, in one place (design.md §4). Names are checked before they get here."""

SEAT = "mesh-controller"
QUEUE = "mesh-controller"  # queue group of every controller verb subscription

CTL_VERBS = "mesh.ctl.*"  # operator verbs: mesh.ctl.<verb>
CTL_HOST_VERBS = "mesh.ctl.host.*.*"  # what a host asks: mesh.ctl.host.<name>.<verb>
HOST_BEATS = "mesh.host.*.beat"
SEAT_EVENTS = f"mesh.seat.{SEAT}.*"


def ctl(verb: str) -> str:
    return f"mesh.ctl.{verb}"


def ctl_host(name: str, verb: str) -> str:
    return f"mesh.ctl.host.{name}.{verb}"


def host(name: str, verb: str) -> str:
    return f"mesh.host.{name}.{verb}"


def seat(event: str) -> str:
    return f"mesh.seat.{SEAT}.{event}"
