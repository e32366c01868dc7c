"""`allowed_sources` entries, read one way by the config check and by the peer guard.

An IPv4-mapped IPv6 network (``::ffff:10.0.0.0/104``) is the IPv4 network it maps
(``10.0.0.0/8``): the guard compares an IPv4-mapped peer as its IPv4 address, so the entry must be
compared (and judged for width) the same way — ``::ffff:0:0/96`` is every IPv4 address, not a
narrow IPv6 /96.
"""

from __future__ import annotations

import ipaddress

__all__ = ["Network", "source_network"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


def source_network(cidr: str, *, strict: bool = True) -> Network:
    """The network an entry names; ValueError if it is none or (``strict``) has host bits set.

    Host bits are an error, not silently dropped: ``10.1.2.3/8`` is a typo for ``/28`` or
    ``/32`` far more often than a wish to let in all of 10/8.
    """
    net = ipaddress.ip_network(str(cidr).strip(), strict=strict)
    if isinstance(net, ipaddress.IPv6Network) and net.prefixlen >= 96 and net.subnet_of(_MAPPED):
        mapped = net.network_address.ipv4_mapped
        assert mapped is not None
        return ipaddress.IPv4Network(f"{mapped}/{net.prefixlen - 96}")
    return net
