"""The job's rendezvous store, with no port picked free first and bound later.

The launcher (node 0's, on several nodes) hosts a ``torch.distributed.TCPStore`` for as long as its job runs,
on ``runtime.port`` or, with 0, on a port the kernel picks at the bind (:func:`host_store`). Every card
process joins it (:func:`join_store`; the spec's ``dist_init`` is ``tcp://host:port``) for gloo's rendezvous
(whose pair sockets take kernel-picked ports too) and to publish the address its TCP mailbox bound: a mailbox
address ``tcp://host:*`` (:func:`picks_port`) is bound on a kernel-picked port and found by the peers under
``npt/inbox/<rank>`` (:func:`publish_address`, :func:`peer_address`). A port that was free a moment ago and is
bound later (``Endpoint.free_tcp_port``) races every other process on the host: two sweep jobs started
together died at the rendezvous with EADDRINUSE that way.
"""
from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlsplit

from npu_train.errors import ConfigError

#: the store key of rank ``r``'s bound mailbox address
INBOX_KEY = "npt/inbox/{rank}"


def host_store(host: str, port: int, timeout_s: float):
    """A ``TCPStore`` server listening on ``port`` (0: a port the kernel picks; read it from ``.port``) and
    reached at ``host``; it stops when the object is dropped. Raises ConfigError when ``port`` is taken or
    ``host`` is not this machine's address."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, int(port), world_size=None, is_master=True, timeout=timedelta(seconds=float(timeout_s)),
                        wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - DistNetworkError / RuntimeError
        cause = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        if port:
            raise ConfigError(f"runtime.port={port} on {host} is in use ({cause}): pick another runtime.port or use "
                              "runtime.port=0 for a free one") from None
        raise ConfigError(f"cannot host the job's rendezvous store on {host} ({cause}): set runtime.host to an "
                          "address of this machine") from None


def join_store(dist_init: str, timeout_s: float):
    """A client of the store at ``dist_init`` (``tcp://host:port``, IPv6 literals bracketed); ``timeout_s``:
    for the connection and every wait on a key."""
    from torch.distributed import TCPStore

    u = urlsplit(dist_init)
    if u.scheme != "tcp" or not u.hostname or not u.port:
        raise ValueError(f"dist_init {dist_init!r} is not tcp://host:port")
    return TCPStore(u.hostname, u.port, world_size=None, is_master=False, timeout=timedelta(seconds=float(timeout_s)))


def picks_port(addr: str) -> bool:
    """Whether ``addr`` is a TCP address whose port the kernel picks at the bind (``tcp://host:*``)."""
    return addr.startswith("tcp://") and addr.endswith(":*")


def publish_address(store, rank: int, addr: str) -> None:
    """Record rank ``rank``'s bound mailbox address (``tcp://host:port``) in ``store``."""
    store.set(INBOX_KEY.format(rank=rank), addr)


def peer_address(store, rank: int, addr: str) -> str:
    """Rank ``rank``'s mailbox address: ``addr`` itself unless it :func:`picks_port`, else the bound address
    that rank published (waits for it up to the store's timeout)."""
    if not picks_port(addr):
        return addr
    return store.get(INBOX_KEY.format(rank=rank)).decode()
