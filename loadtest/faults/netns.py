"""Two network namespaces for a prefill and a decode engine, so NIXL/UCX crosses real links.

Topology (all names start with ``kvft``; everything is removed by :meth:`NetTopology.down`)::

    host: bridge kvft-br 10.213.0.1/24 --- control plane (HTTP from the gateway, Redis)
      ├─ veth kvft-ph <-> kvft-pn 10.213.0.2  in netns kvft-p (prefill)
      └─ veth kvft-dh <-> kvft-dn 10.213.0.3  in netns kvft-d (decode)
    data link: veth kvft-px 10.214.0.2 (kvft-p) <-> kvft-dx 10.214.0.3 (kvft-d)

The engines run UCX with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` set to the data link, so
the KV bytes cross that veth pair (one IPC namespace is shared, so without ``UCX_TLS`` UCX
would pick shared memory and bypass the network). Taking the data link down
(:meth:`cut_data_link`) cuts NIXL between the engines while HTTP and Redis stay up.
This box's kernel has no ``prio``/``netem`` qdiscs, hence a separate link rather than a
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
    ctl_ip: str  # on the bridge (HTTP, Redis)
    data_ip: str  # on the data link (NIXL)
    data_dev: str


class NetTopology:
    """Creates and removes the namespaces, links and addresses above."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.prefill = Side(f"{PREFIX}-p", "10.213.0.2", "10.214.0.2", f"{PREFIX}-px")
        self.decode = Side(f"{PREFIX}-d", "10.213.0.3", "10.214.0.3", f"{PREFIX}-dx")
        self.bridge = f"{PREFIX}-br"
        self.host_ip = HOST_IP
        self.is_up = False

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
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for side, tag in ((self.prefill, "p"), (self.decode, "d")):
                _ip("netns", "add", side.ns)
                _ip("link", "set", "lo", "up", ns=side.ns)
                host_end, ns_end = f"{PREFIX}-{tag}h", f"{PREFIX}-{tag}n"
                _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
                _ip("link", "set", ns_end, "netns", side.ns)
                _ip("link", "set", host_end, "master", self.bridge)
                _ip("link", "set", host_end, "up")
                _ip("addr", "add", f"{side.ctl_ip}/24", "dev", ns_end, ns=side.ns)
                _ip("link", "set", ns_end, "up", ns=side.ns)
            p, d = self.prefill, self.decode
            _ip("link", "add", p.data_dev, "type", "veth", "peer", "name", d.data_dev)
            _ip("link", "set", p.data_dev, "netns", p.ns)
            _ip("link", "set", d.data_dev, "netns", d.ns)
            for side in (p, d):
                _ip("addr", "add", f"{side.data_ip}/24", "dev", side.data_dev, ns=side.ns)
                _ip("link", "set", side.data_dev, "up", ns=side.ns)
        except subprocess.CalledProcessError as exc:
            self.down()
            raise NetnsUnavailable(f"{' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc
        self.is_up = True
        return self

    def down(self) -> None:
        """Remove everything this topology creates (idempotent)."""
        for side in (self.prefill, self.decode):
            _ip("netns", "del", side.ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        for tag in ("p", "d"):
            _ip("link", "del", f"{PREFIX}-{tag}h", check=False)
        self.is_up = False

    def cut_data_link(self) -> None:
        """Take the prefill<->decode data link down (NIXL traffic stops)."""
        _ip("link", "set", self.prefill.data_dev, "down", ns=self.prefill.ns)

    def restore_data_link(self) -> None:
        """Bring the data link back up."""
        _ip("link", "set", self.prefill.data_dev, "up", ns=self.prefill.ns)
        _ip("link", "set", self.decode.data_dev, "up", ns=self.decode.ns)

    def data_link_bytes(self) -> int:
        """Bytes the prefill end of the data link has sent so far (KV pushes cross it)."""
        import json

        out = _ip("-s", "-j", "link", "show", self.prefill.data_dev, ns=self.prefill.ns,
                  check=False)
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
