"""`mesh init --address HOST`: the addresses other machines reach this machine's servers at.

Each is checked before anything is made, so a refusal leaves no folder behind: an IP address
must be one this machine has (a bind test: what nats-server would do with it, and what the
store's front does), a DNS name must be a name (RFC 1123 labels; a last label of digits is a
mistyped IP address, not a name) that resolves here to such an address, since this machine's
own pieces connect by the URL too.

What they serve, worked out once (`Served`): nats-server takes a single `listen`, so with an
address other than 127.0.0.1 it listens on the wildcard, which serves loopback and the address
alike (0.0.0.0, or [::] where an IPv6 address is given: Go's [::] is dual-stack); the store's
front takes several, so it listens on 127.0.0.1 and on each address alone. Certificates name
loopback and every address; the URLs written name the first address, so that a credentials
file copied to another machine leads there.
"""

import ipaddress
import re
import socket

import msgspec

from mesh.errors import MeshError

LOOPBACK = "127.0.0.1"
LOOPBACK_NAMES = [LOOPBACK, "localhost"]  # what every server's certificate names
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


class AddressError(MeshError):
    """An --address that cannot be served; the message names it."""


class Served(msgspec.Struct, frozen=True):
    given: list[str]  # as given (IP addresses normalised), in order, once each
    listen: str  # nats-server's one listen host
    fronts: list[str]  # the store's front listens on each (IP addresses)
    url_host: str  # the host every URL written names: the first address given, else loopback

    @property
    def certified(self) -> list[str]:
        """What the servers' certificates name: loopback (this machine's pieces, tools) and
        every address given."""
        return list(dict.fromkeys([*LOOPBACK_NAMES, *self.given]))


LOOPBACK_ONLY = Served(given=[], listen=LOOPBACK, fronts=[LOOPBACK], url_host=LOOPBACK)


def url_host(host: str) -> str:
    """`host` as it goes into a URL before `:PORT` (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def served(addresses: list[str]) -> Served:
    """What `addresses` (--address, in order) make the servers listen on, name and write."""
    if not addresses:
        return LOOPBACK_ONLY
    given: list[str] = []
    local: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for text in addresses:
        name, found = _check(text)
        if name not in given:
            given.append(name)
        local += [a for a in found if a not in local]
    if all(str(a) == LOOPBACK for a in local):
        listen = LOOPBACK
    elif any(a.version == 6 for a in local):
        listen = "[::]"
    else:
        listen = "0.0.0.0"
    fronts = list(dict.fromkeys([LOOPBACK, *(str(a) for a in local)]))
    return Served(given=given, listen=listen, fronts=fronts, url_host=url_host(given[0]))


def _check(text: str) -> tuple[str, list[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """(the address as certificates and URLs name it, this machine's addresses it stands for)."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.is_unspecified or "%" in text:
            raise AddressError(f"--address {text}: not an address other machines can reach; "
                               "give one of this machine's own")  # fmt: skip
        why = _unbindable(str(ip))
        if why:
            raise AddressError(f"--address {text}: not an address of this machine "
                               f"(nats-server could not listen on it: {why})")  # fmt: skip
        return str(ip), [ip]
    name = text.removesuffix(".").lower()
    labels = name.split(".")
    if (
        not name
        or len(name) > 253
        or not all(_LABEL.fullmatch(label) for label in labels)
        or labels[-1].isdigit()
    ):
        raise AddressError(f"--address {text!r}: neither an IP address nor a DNS name")
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as e:
        raise AddressError(f"--address {name}: does not resolve on this machine ({e}); this "
                           "machine's own pieces connect by it too") from None  # fmt: skip
    resolved = list(dict.fromkeys(ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos))
    ours = [a for a in resolved if not _unbindable(str(a))]
    if not ours:
        raise AddressError(f"--address {name}: resolves to {', '.join(map(str, resolved))}, "
                           "none of them an address of this machine")  # fmt: skip
    # Served on IPv4 where the name has an IPv4 address here: clients try each address the
    # name resolves to, and the servers need not listen on IPv6 for it.
    v4 = [a for a in ours if a.version == 4]
    return name, v4 or ours


def _unbindable(ip: str) -> str | None:
    """Why a TCP socket cannot bind `ip` here (None: it can, so it is this machine's)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
    except OSError as e:
        return e.strerror or str(e)
    return None
