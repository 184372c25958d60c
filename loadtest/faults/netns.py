"""Network namespaces for a stack's engines, so NIXL/UCX crosses real links.

Topology (all names start with ``kvft``; everything is removed by :meth:`NetTopology.down`)::

    host: bridge kvft-br 10.213.0.1/24 --- control plane (HTTP from the gateway, Redis)
      ├─ veth kvft-ph <-> kvft-pn 10.213.0.2  in netns kvft-p (prefill)
      ├─ veth kvft-dh <-> kvft-dn 10.213.0.3  in netns kvft-d (decode)
      └─ veth kvft-bh <-> kvft-bn 10.213.0.4  in netns kvft-b (a second prefill, when asked)
    data: bridge kvft-xbr (no host address) with each namespace's kvft-<t>x 10.214.0.<n>

The engines run UCX with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` set to their data link, so
the KV bytes cross the data bridge (one IPC namespace is shared, so without ``UCX_TLS`` UCX
would pick shared memory and bypass the network). Taking one engine's data link down
(:meth:`cut_data_link`) cuts NIXL between it and the others while HTTP and Redis stay up.
This box's kernel has no ``prio``/``netem`` qdiscs, hence a link taken down rather than a
tc filter.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PREFIX = "kvft"
HOST_IP = "10.213.0.1"


class NetnsUnavailable(RuntimeError):
    """``ip netns`` cannot be used here (no iproute2, not root, no veth support)."""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


@dataclass(frozen=True)
class Side:
    """One engine's namespace."""

    ns: str
    ctl_ip: str  # on the control bridge (HTTP, Redis)
    data_ip: str  # on the data bridge (NIXL)
    data_dev: str  # the namespace's end of its data link

    @property
    def tag(self) -> str:
        return self.ns.removeprefix(f"{PREFIX}-")


# Engine name -> (namespace tag, last octet of its addresses).
_SIDES = {"prefill": ("p", 2), "decode": ("d", 3), "prefill-b": ("b", 4)}


class NetTopology:
    """Creates and removes the namespaces, links and addresses above."""

    def __init__(self, workdir: Path, names: tuple[str, ...] = ("prefill", "decode"),
                 tcp_rto_max_ms: int | None = None) -> None:
        self.workdir = Path(workdir)
        # Linux backs off a retransmission up to 2 min: bytes in a socket whose link healed
        # may wait many seconds to cross. Capped, they cross within this of the heal, as on a
        # fabric whose NIC retries in microseconds; the retries are raised so that a
        # connection outlives the cut as it does uncapped.
        self.tcp_rto_max_ms = tcp_rto_max_ms
        unknown = set(names) - set(_SIDES)
        if unknown:
            raise ValueError(f"no namespace layout for {sorted(unknown)}; known: {sorted(_SIDES)}")
        self.sides = {name: Side(f"{PREFIX}-{t}", f"10.213.0.{n}", f"10.214.0.{n}",
                                 f"{PREFIX}-{t}x")
                      for name, (t, n) in _SIDES.items() if name in names}
        self.bridge, self.data_bridge = f"{PREFIX}-br", f"{PREFIX}-xbr"
        self.host_ip = HOST_IP
        self.is_up = False

    @property
    def prefill(self) -> Side:
        return self.sides["prefill"]

    @property
    def decode(self) -> Side:
        return self.sides["decode"]

    @staticmethod
    def available() -> str | None:
        """None when namespaces can be made here, else why not."""
        if shutil.which("ip") is None:
            return "iproute2 (`ip`) is not installed"
        if os.geteuid() != 0:
            return "creating network namespaces needs root"
        return None

    def up(self) -> NetTopology:
        """Build the topology (after removing leftovers of an earlier run)."""
        why = self.available()
        if why:
            raise NetnsUnavailable(why)
        self.down()
        try:
            for br in (self.bridge, self.data_bridge):
                _ip("link", "add", br, "type", "bridge")
                _ip("link", "set", br, "up")
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
            for side in self.sides.values():
                _ip("netns", "add", side.ns)
                _ip("link", "set", "lo", "up", ns=side.ns)
                if self.tcp_rto_max_ms:
                    self._sysctl(side, "tcp_rto_max_ms", self.tcp_rto_max_ms)
                    self._sysctl(side, "tcp_retries2", 60)
                for host_end, ns_end, br, ip in (
                        (f"{PREFIX}-{side.tag}h", f"{PREFIX}-{side.tag}n", self.bridge,
                         side.ctl_ip),
                        (f"{PREFIX}-{side.tag}y", side.data_dev, self.data_bridge,
                         side.data_ip)):
                    _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
                    _ip("link", "set", ns_end, "netns", side.ns)
                    _ip("link", "set", host_end, "master", br)
                    _ip("link", "set", host_end, "up")
                    _ip("addr", "add", f"{ip}/24", "dev", ns_end, ns=side.ns)
                    _ip("link", "set", ns_end, "up", ns=side.ns)
        except subprocess.CalledProcessError as exc:
            self.down()
            raise NetnsUnavailable(f"{' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc
        self.is_up = True
        return self

    @staticmethod
    def _sysctl(side: Side, name: str, value: int) -> None:
        subprocess.run(["ip", "netns", "exec", side.ns, "sh", "-c",
                        f"echo {value} > /proc/sys/net/ipv4/{name}"],
                       check=True, capture_output=True, text=True)

    def down(self) -> None:
        """Remove everything this topology can create (idempotent, whatever the names)."""
        for tag, _n in _SIDES.values():
            _ip("netns", "del", f"{PREFIX}-{tag}", check=False)
        for br in (self.bridge, self.data_bridge):
            _ip("link", "del", br, check=False)
        for tag, _n in _SIDES.values():
            for end in "hy":
                _ip("link", "del", f"{PREFIX}-{tag}{end}", check=False)
        self.is_up = False

    def cut_data_link(self, name: str = "prefill") -> None:
        """Take engine ``name``'s data link down: its NIXL traffic stops, the others' goes on."""
        side = self.sides[name]
        _ip("link", "set", side.data_dev, "down", ns=side.ns)

    def restore_data_link(self, name: str = "prefill") -> None:
        """Bring engine ``name``'s data link back up."""
        side = self.sides[name]
        _ip("link", "set", side.data_dev, "up", ns=side.ns)

    def data_link_bytes(self, name: str = "prefill") -> int:
        """Bytes engine ``name``'s end of its data link has sent so far (KV pushes cross it)."""
        import json

        side = self.sides[name]
        out = _ip("-s", "-j", "link", "show", side.data_dev, ns=side.ns, check=False)
        try:
            return int(json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"])
        except (ValueError, LookupError):
            return -1

    def launcher(self, side: Side) -> str:
        """An executable that runs this Python interpreter inside ``side``'s namespace, with
        UCX bound to the data link (used as ``EngineSpec.python``)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / f"python-in-{side.ns}"
        path.write_text(
            "#!/bin/sh\n"
            f"export UCX_TLS=tcp UCX_NET_DEVICES={side.data_dev}\n"
            f'exec ip netns exec {side.ns} {sys.executable} "$@"\n'
        )
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return str(path)

    def __enter__(self) -> NetTopology:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.down()
